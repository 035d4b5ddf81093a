"""Fused MoE experts: per-expert weight quantizers and per-projection input quantizers, applied on
transformers' own ``grouped_mm`` and ``eager`` backends (no patching).

transformers 5 stores the experts of most MoE models as 3-D parameters in a class decorated with
``@use_experts_implementation``; its forward dispatches on ``config._experts_implementation`` through the
``ExpertsInterface``. The quantized class overrides that forward and dispatches itself on the same value:

* ``grouped_mm`` calls transformers' ``grouped_mm_experts_forward`` on a view of the module whose weights are
  the fake-quantized ones and whose gate applies ``down_proj_input_quantizer`` to its output;
* ``eager`` is a loop over the experts that received tokens (the reference computation).

The model keeps transformers' names, so ``model.set_experts_implementation("eager" | "grouped_mm")`` switches
a quantized model like any other. Inserting quantizers moves a backend that would not run the quantizers
(``batched_mm``, kernels from the hub) to ``grouped_mm`` with a WARNING; switching to one afterwards makes
the next experts forward raise. While weight quantizers only collect statistics, the stored weights are used
as they are (no weight-sized copy). While training on the CPU in float32, the NVFP4 fake quant of each 3-D
weight writes into a buffer kept from step to step (see :meth:`QuantExperts.weight_buffer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import grouped_mm_experts_forward

from ..formats import fake_quant
from ..formats.kernels.fused import fused_fake_quant_enabled
from ..nn import QUANT_MODULES, QuantModule, TensorQuantizer
from ..nn.quant_module import Quantizer
from ..nn.quantizer.buffers import reusable_buffer

__all__ = [
    "EXPERTS_IMPLEMENTATIONS",
    "LEGACY_EXPERTS_IMPLEMENTATIONS",
    "QuantExperts",
    "experts_implementation_name",
    "is_seam_experts",
]

#: transformers' experts backends on which the quantized experts apply their quantizers.
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager")
#: The private names earlier development versions set in ``config._experts_implementation``, and the
#: standard backend each one means.
LEGACY_EXPERTS_IMPLEMENTATIONS = {"modelopt_lite_grouped_mm": "grouped_mm", "modelopt_lite_eager": "eager"}


def _standard(impl: str | None) -> str:
    """``impl`` with an old private name mapped to its standard one; ``None`` (a standalone experts module,
    which transformers runs eagerly) is ``eager``."""
    return LEGACY_EXPERTS_IMPLEMENTATIONS.get(impl, impl or "eager")  # type: ignore[arg-type]


def experts_implementation_name(choice: str | None) -> str:
    """The backend quantizing a model whose experts run ``choice`` switches them to: ``eager`` stays eager,
    everything else (``None``, ``batched_mm``, kernels from the hub) runs on ``grouped_mm``."""
    return "eager" if choice is not None and _standard(choice) == "eager" else "grouped_mm"


class _QuantizedView:
    """Stands in for the experts module inside transformers' grouped forward: the weights are replaced,
    the gate output goes through the down-projection input quantizer, everything else is the module's."""

    def __init__(self, module: QuantExperts, weights: dict[str, torch.Tensor], gate: Callable[..., Any]):
        self.__dict__.update(weights)
        self._module = module
        if module.has_gate:
            self._apply_gate = gate
        else:
            self.act_fn = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _batched_fake_quant(
    quantizers: nn.ModuleList,
    weight: torch.Tensor,
    buffer: Callable[[], torch.Tensor | None] | None = None,
) -> torch.Tensor | None:
    """All experts of ``weight`` ``(experts, out, in)`` fake-quantized in one call, bit for bit what each
    expert's quantizer gives it alone; ``None`` unless every quantizer only fake-quantizes (no calibration,
    smoothing, rotation, bias or learned amax) with the same attributes, one calibrated amax per expert and
    a format whose math takes that amax as a per-expert broadcast (NVFP4 with its global amax, per-tensor
    INT / FP8). One autograd node then carries the whole weight: no per-expert slices, stack or unbind.
    ``buffer``: gives a float32 tensor shaped like ``weight`` for NVFP4 (a last axis that splits into whole
    blocks) to write its result into, or ``None`` for a fresh one (it decides when, e.g. on the CPU only)."""
    first = quantizers[0]
    if not isinstance(first, TensorQuantizer):
        return None
    attrs, spec = first.attributes, first._spec
    nvfp4 = spec.kind == "nvfp4" and not spec.static_nvfp4
    per_tensor = (
        spec.kind in ("int", "fp8") and spec.axis is None and not spec.block_axes and not spec.dynamic
    )
    if not (nvfp4 or per_tensor):
        return None
    amaxes = []
    for q in quantizers:
        amax = q.amax if isinstance(q, TensorQuantizer) else None
        if amax is None or amax.numel() != 1 or q.attributes != attrs or attrs.learn_amax:
            return None
        if not attrs.enable or not q._quant_enabled or q._calib_enabled or q._rotation is not None:
            return None
        if q.pre_quant_scale is not None or attrs.bias is not None or q.global_amax is not None:
            return None
        amaxes.append(amax.reshape(()))
    amax, clip = torch.stack(amaxes).view(-1, 1, 1), attrs.backward == "clipped"
    try:
        block = spec.block_axes[0][1] if nvfp4 else None
        out = None
        # asked on every device (a module moved off the CPU releases its buffer); the opt-in fused CPU
        # path takes NVFP4 with a single global amax only (one expert): it keeps that case
        if block and buffer is not None and weight.shape[-1] % block == 0:
            out = None if fused_fake_quant_enabled() and amax.numel() == 1 else buffer()
        return fake_quant(weight, spec, amax, clip, out=out)
    except ValueError as err:
        raise ValueError(f"{first.name} (and the other experts' weight quantizers): {err}") from None


class QuantExperts(QuantModule):
    """``<proj>_weight_quantizers.{i}`` (one per expert) and ``<proj>_input_quantizer`` for the first
    projection (``gate_up_proj`` or ``up_proj``) and ``down_proj``. Weight quantizers see each expert's
    weight as ``(out, in)`` whatever the storage layout (GPT-OSS stores ``(in, out)``)."""

    num_experts: int
    #: Use the stored weights as they are when no weight quantizer would change them (calibration). Only
    #: ``benchmarks/moe.py`` turns this off, to measure the stacked copy it saves.
    weight_pass_through: bool = True
    #: Keep each projection's fake-quantized weight buffer from step to step (see :meth:`weight_buffer`).
    #: Set ``False`` (on the class or one module) to give up that speed for the memory the buffers hold
    #: between steps; ``benchmarks/moe.py`` does, to measure both.
    reuse_weight_buffers: bool = True
    has_gate: bool
    has_bias: bool
    is_transposed: bool

    def _setup(self) -> None:
        if getattr(self, "_is_expert_parallel", False):
            raise NotImplementedError(f"{type(self).__name__}: expert-parallel experts are not supported")
        self._projections = ("gate_up_proj" if self.has_gate else "up_proj", "down_proj")
        for proj in self._projections:
            if getattr(self, proj, None) is None or getattr(self, proj).ndim != 3:
                raise ValueError(f"{type(self).__name__}.{proj}: expected a 3-D (experts, ., .) weight")
            setattr(self, f"{proj}_input_quantizer", TensorQuantizer(f"{proj}_input_quantizer"))
            quantizers = [TensorQuantizer(f"{proj}_weight_quantizers.{i}") for i in range(self.num_experts)]
            setattr(self, f"{proj}_weight_quantizers", nn.ModuleList(quantizers))
        self.reset_coverage()

    # ----------------------------------------------------------------------- weights
    def expert_weight(self, proj: str, expert: int) -> torch.Tensor:
        """Expert ``expert``'s weight of ``proj`` as ``(out, in)``."""
        w = getattr(self, proj)[expert]
        return w.t() if self.is_transposed else w

    def weight_quantizer_pairs(self) -> Iterator[tuple[Quantizer, torch.Tensor]]:
        for proj in self._projections:
            for i, q in enumerate(getattr(self, f"{proj}_weight_quantizers")):
                yield q, self.expert_weight(proj, i)

    def quantized_weight(self, proj: str) -> torch.Tensor:
        """The 3-D weight with each expert fake-quantized by its own quantizer; the parameter itself when no
        quantizer of ``proj`` would change it (calibration, or all disabled)."""
        quantizers = getattr(self, f"{proj}_weight_quantizers")
        if self.weight_pass_through and not any(q.is_enabled and q._quant_enabled for q in quantizers):
            return getattr(self, proj)
        weight = getattr(self, proj)
        oi = weight.transpose(1, 2) if self.is_transposed else weight
        batched = _batched_fake_quant(quantizers, oi, lambda: self.weight_buffer(proj, oi))
        if batched is not None:
            return batched.transpose(1, 2) if self.is_transposed else batched
        # one unbind for all experts: indexing expert by expert would make autograd add a zero gradient of
        # the whole 3-D weight per expert (quadratic in the number of experts)
        experts = weight.unbind(0)
        if self.is_transposed:
            return torch.stack([q(w.t()).t() for q, w in zip(quantizers, experts, strict=True)])
        return torch.stack([q(w) for q, w in zip(quantizers, experts, strict=True)])

    def weight_buffer(self, proj: str, weight: torch.Tensor) -> torch.Tensor | None:
        """The float32 buffer that ``proj``'s fake-quantized ``(experts, out, in)`` weight is written into,
        kept on the module from one training step to the next; ``None`` (a fresh tensor each call) unless the
        module is training with grad enabled, on the CPU, in float32.

        A fresh weight-sized output each step is handed out by the allocator as new memory (glibc maps
        blocks above 32 MiB afresh and unmaps them on free) and page-faulted in while being written: on
        the CPU about as long as the fake quant itself. Kept, it is written in place. The buffer is reused
        only when nothing else references its memory any more (the previous step's graph was freed: its
        backward ran, or it was dropped); otherwise a new one replaces it. Memory: in training every
        layer's fake-quantized weight stays alive until the backward anyway; keeping it between steps
        holds that memory (the experts' float32 weights once more) across the optimizer step too. It is
        released by a forward outside training (``eval()`` or ``no_grad``) or off the CPU, ``fold_weight``
        and removal of the quantizers."""
        cache: dict[str, tuple[torch.Tensor, int]] = self.__dict__.setdefault("_weight_buffers", {})
        if not (
            self.reuse_weight_buffers and self.training and torch.is_grad_enabled()
            and weight.device.type == "cpu" and weight.dtype == torch.float32
            and type(weight) in (torch.Tensor, nn.Parameter)  # no tensor subclass (DTensor, ...)
        ):  # fmt: skip
            cache.pop(proj, None)
            return None
        return reusable_buffer(cache, proj, weight.shape)

    @torch.no_grad()
    def fold_weight(self) -> None:
        for proj in self._projections:
            quantizers = getattr(self, f"{proj}_weight_quantizers")
            if any(q.transforms_input for q in quantizers):
                getattr(self, proj).copy_(self.quantized_weight(proj))
                for q in quantizers:
                    q.mark_folded()

    #: ``fn(projection, expert, rows)``: when set, each forward shows it every expert's input rows of
    #: both projections (what the grouped GEMM computes, split by the cumulative offsets). Calibration
    #: algorithms that need each expert's own inputs (GPTQ, AWQ) set it.
    input_observer: Callable[[str, int, torch.Tensor], None] | None = None

    def _teardown(self) -> None:
        super()._teardown()
        for name in ("_projections", "tokens_per_expert", "forward_calls", "_weight_buffers"):
            self.__dict__.pop(name, None)

    # ----------------------------------------------------------------------- coverage
    def reset_coverage(self) -> None:
        # on the CPU even when built under a meta-device context (from_pretrained): moved on first use
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device="cpu")
        self.forward_calls = 0

    def _count(self, top_k_index: torch.Tensor) -> None:
        # counted on the routing's device without a host sync (no data-dependent shapes)
        self.forward_calls += 1
        with torch.no_grad():
            ids = top_k_index.reshape(-1).long()
            if self.tokens_per_expert.device != ids.device:
                self.tokens_per_expert = self.tokens_per_expert.to(ids.device)
            valid = (ids < self.num_experts).long()  # expert-parallel sentinels are not counted
            self.tokens_per_expert.scatter_add_(0, ids.clamp(max=self.num_experts - 1), valid)

    # ----------------------------------------------------------------------- forward
    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Dispatch on ``config._experts_implementation`` as transformers does, to the quantized version of
        the named backend; a backend that would bypass the quantizers raises."""
        impl = getattr(self.config, "_experts_implementation", None)
        run = _BACKENDS.get(_standard(impl))
        if run is None:
            raise RuntimeError(
                f"{type(self).__name__}: experts implementation is {impl!r}, which would bypass the "
                "expert quantizers; use model.set_experts_implementation(name) with name in "
                f"{list(EXPERTS_IMPLEMENTATIONS)}"
            )
        return run(self, hidden_states, top_k_index, top_k_weights)

    def _gate(self, counts: list[int] | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """The gate (or activation) followed by ``down_proj_input_quantizer``; with ``counts`` (rows per
        expert of an expert-sorted batch) the result is also shown to the input observer, split per expert."""
        inner = self._module_gate()
        down_q = self.down_proj_input_quantizer

        def gate(t: torch.Tensor) -> torch.Tensor:
            out = inner(t)
            if counts is not None:
                self._observe("down_proj", out, counts)
            return down_q(out)

        return gate

    def _observe(self, proj: str, rows: torch.Tensor, counts: list[int]) -> None:
        for expert, chunk in enumerate(torch.split(rows, counts)):
            if chunk.shape[0]:
                self.input_observer(proj, expert, chunk)

    def _module_gate(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self._apply_gate if self.has_gate else self.act_fn

    def _prepare(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        self._count(top_k_index)
        return getattr(self, f"{self._projections[0]}_input_quantizer")(hidden_states)


def _grouped_forward(module: QuantExperts, hidden_states, top_k_index, top_k_weights):
    counts = None
    if module.input_observer is not None:
        # the expert-sorted rows, sorted as transformers' grouped forward sorts them
        ids, perm = torch.sort(top_k_index.reshape(-1))
        counts = torch.bincount(ids[ids < module.num_experts], minlength=module.num_experts).tolist()
        rows = hidden_states[perm[: sum(counts)] // top_k_index.shape[-1]]
        module._observe(module._projections[0], rows, counts)
    hidden_states = module._prepare(hidden_states, top_k_index)
    weights = {p: module.quantized_weight(p) for p in module._projections}
    view = _QuantizedView(module, weights, module._gate(counts))
    return grouped_mm_experts_forward(view, hidden_states, top_k_index, top_k_weights)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = x @ w if transposed else F.linear(x, w)
    return out if b is None else out + b


def _eager_forward(module: QuantExperts, hidden_states, top_k_index, top_k_weights):
    raw = hidden_states
    hidden_states = module._prepare(hidden_states, top_k_index)
    first, down = module._projections
    w_first, w_down = module.quantized_weight(first), module.quantized_weight(down)
    inner, down_q = module._module_gate(), module.down_proj_input_quantizer
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():  # rows per expert in the order transformers' eager forwards use (k, then token)
        mask = F.one_hot(top_k_index, num_classes=module.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist()
    for expert in hit:
        if expert >= module.num_experts:
            continue
        k_pos, token_idx = torch.where(mask[expert])
        b1 = getattr(module, f"{first}_bias")[expert] if module.has_bias else None
        b2 = module.down_proj_bias[expert] if module.has_bias else None
        if module.input_observer is not None:
            module.input_observer(first, expert, raw[token_idx])
        h = inner(_linear(hidden_states[token_idx], w_first[expert], b1, module.is_transposed))
        if module.input_observer is not None:
            module.input_observer(down, expert, h)
        h = down_q(h)
        h = _linear(h, w_down[expert], b2, module.is_transposed)
        if module.has_post_expert_norm:
            h = module.post_expert_norm(h)
        h = h * top_k_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


_BACKENDS = {"grouped_mm": _grouped_forward, "eager": _eager_forward}


def is_seam_experts(cls: type[nn.Module]) -> bool:
    """Classes decorated with transformers' ``@use_experts_implementation``."""
    forward = getattr(cls, "forward", None)
    return getattr(forward, "__globals__", {}).get("__name__") == "transformers.integrations.moe"


QUANT_MODULES.register_rule("transformers fused experts (ExpertsInterface)", is_seam_experts, QuantExperts)
