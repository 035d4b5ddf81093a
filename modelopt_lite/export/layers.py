"""What the export writes, read from a quantized model: one :class:`ExportLayer` per quantized linear map
(a linear layer, or one projection of one fused expert under its hub name), its format (``quant_algo``),
the KV-cache scales, the layers that share scales, and the norms that absorb a ``pre_quant_scale``.

Formats are recognised from the quantizers' attributes; a combination the export cannot write raises
:class:`UnsupportedFormatError` naming the layer and the combination.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..distributed import weight_access
from ..logging import get_logger
from ..moe import QuantExperts
from ..nn import QuantAttention, QuantLinear, SequentialQuantizer, TensorQuantizer
from ..nn.quant_module import Quantizer
from ..quantization.compress import CompressedExperts, CompressedLinear
from ..quantization.compress.real_format import (
    COMPRESS_ONLY,
    SUPPORTED,
    UnsupportedFormatError,
    _describe,
    _kind,
    detect_format,
    linear_format,
)

__all__ = [
    "SHARED_INPUT_GROUPS",
    "SUPPORTED",
    "ExportLayer",
    "ExportModule",
    "UnsupportedFormatError",
    "detect_format",
    "export_layers",
    "export_plan",
    "foldable_norms",
    "kv_cache_format",
    "unify_shared_scales",
]

logger = get_logger(__name__)

#: sibling projections that read one input: engines fuse them and need one input scale (and, for NVFP4,
#: one weight_scale_2)
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
#: (norm, the projections that alone read its output) inside one decoder layer
_NORM_CONSUMERS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
)


@dataclass
class ExportLayer:
    name: str  # hub name of the linear map (``...q_proj``, ``...experts.3.gate_proj``)
    quant_algo: str | None  # None: stored unquantized
    weight: torch.Tensor  # (out, in), as the weight quantizer sees it
    weight_quantizer: Quantizer | None
    input_quantizer: TensorQuantizer | None
    bias: torch.Tensor | None = None
    split: tuple[str, str] | None = None  # experts gate_up: pack once, write the halves under these names


def _unstored_transform(q: nn.Module) -> str | None:
    """What of a KV quantizer an export cannot write: a rotation (the reference writes nothing of it), a
    dynamic bias (only a calibrated one is written, as ``k_bias`` / ``v_bias``)."""
    if q.attributes.rotation() is not None:
        return "a Hadamard rotation (rotate=True; NVFP4_KV_CFG is NVFP4_KV_ROTATE_CFG without it)"
    if q.bias_calibrator is not None and q.bias_value is None:
        return f"a bias with no calibrated value (bias={q.attributes.bias!r})"
    return None


def _kv_kind(q: Quantizer) -> str | None:
    """The ``kv_cache_quant_algo`` of one KV quantizer: FP8 per tensor, or NVFP4 with dynamic E4M3 scales
    per 16 channels (what engines store); ``None`` for anything else."""
    if not q.is_enabled or isinstance(q, SequentialQuantizer):  # (sequential: no one KV format)
        return None
    if _kind(q) == "fp8":
        return "FP8"
    spec = q.spec
    return "NVFP4" if spec.kind == "nvfp4" and spec.dynamic and spec.block_axes == ((-1, 16),) else None


def kv_cache_format(name: str, module: nn.Module) -> str | None:
    """The ``kv_cache_quant_algo`` of the attention module's KV quantizers, named as the reference names it:
    ``"FP8"`` (per tensor, with or without a calibrated bias), ``"NVFP4"``, ``"NVFP4_AFFINE"`` (NVFP4 with a
    calibrated bias on both K and V); ``None`` when both are off. Anything else raises, naming the module."""
    quantizers = [getattr(module, s) for s in ("k_bmm_quantizer", "v_bmm_quantizer")]
    if not any(q.is_enabled for q in quantizers):
        return None
    kinds = []
    for q in quantizers:
        slot = q.name.rpartition(".")[2]
        kinds.append(_kv_kind(q))
        if kinds[-1] is None:
            raise UnsupportedFormatError(
                f"{name}: KV cache {slot} is {_describe(q)}; the export writes an FP8 per-tensor KV cache "
                "(FP8_KV_CFG, FP8_AFFINE_KV_CFG) or an NVFP4 one with 16-element dynamic blocks "
                "(NVFP4_KV_CFG, NVFP4_AFFINE_KV_CFG) on both K and V: use one of them or disable the KV "
                "quantizers"
            )
        unstored = _unstored_transform(q)
        if unstored:
            raise UnsupportedFormatError(
                f"{name}: KV cache {slot} has {unstored}, which the checkpoint format cannot record (engines "
                "would read the cache without it): quantize the KV cache without it to export"
            )
    if kinds[0] != kinds[1]:
        raise UnsupportedFormatError(
            f"{name}: KV cache k_bmm_quantizer is {_describe(quantizers[0])} but v_bmm_quantizer is "
            f"{_describe(quantizers[1])}; the checkpoint records one kv_cache_quant_algo for K and V: "
            "quantize both the same way"
        )
    algo = kinds[0]
    biased = [q.bias_value is not None for q in quantizers]
    if algo == "NVFP4" and any(biased):
        if not all(biased):
            raise UnsupportedFormatError(
                f"{name}: only {'k_bmm_quantizer' if biased[0] else 'v_bmm_quantizer'} has a calibrated "
                "bias; an NVFP4_AFFINE KV cache has one on K and on V (NVFP4_AFFINE_KV_CFG)"
            )
        algo = "NVFP4_AFFINE"
    if not hasattr(module, "k_proj") or not hasattr(module, "v_proj"):
        raise UnsupportedFormatError(
            f"{name}: KV-cache scales are written as <attn>.k_proj.k_scale / v_proj.v_scale, but "
            f"{type(module).__name__} has no k_proj / v_proj"
        )
    return algo


#: formats whose stored scales come from the weight itself or one per-tensor amax, so that the rows of an
#: interleaved gate_up_proj can be reordered into [gate; up] before packing
_ROW_ORDER_FREE = {"FP8", "NVFP4", "NVFP4_AWQ", "W4A16_NVFP4"}


def _interleaved(module: QuantExperts) -> bool:
    """GPT-OSS stores gate_up_proj's rows as (gate_0, up_0, gate_1, ...) instead of [gate; up]."""
    return module.has_gate and not getattr(module, "is_concatenated", True)


def _gate_up_order(t: torch.Tensor | None) -> torch.Tensor | None:
    """Interleaved rows -> [gate; up] (the order the writer splits into gate_proj / up_proj)."""
    return None if t is None else torch.cat((t[0::2], t[1::2]))


def _exportable(name: str, algo: str | None) -> str | None:
    """``algo``, or a refusal for the formats only ``mtq.compress`` writes."""
    if algo in COMPRESS_ONLY:
        raise UnsupportedFormatError(
            f"{name}: {algo} has no unified checkpoint layout here (mtq.compress keeps it packed in memory; "
            "GPT-OSS MXFP4 experts: export_gpt_oss_mxfp4); export another format, e.g. NVFP4 or MXFP8"
        )
    return algo


def _experts_specs(name: str, module: QuantExperts) -> Iterator[tuple]:
    """``(hub name, split, quant_algo, proj, expert, weight quantizer, input quantizer)`` per expert
    projection; reads no weight."""
    first, down = module._projections
    halves = ("gate_proj", "up_proj") if module.has_gate else None
    for proj, hub in ((first, halves or "up_proj"), (down, "down_proj")):
        iq = getattr(module, f"{proj}_input_quantizer")
        for e, wq in enumerate(getattr(module, f"{proj}_weight_quantizers")):
            prefix = f"{name}.{e}"
            algo = _exportable(f"{name}.{proj}[{e}]", detect_format(f"{name}.{proj}[{e}]", wq, iq))
            reordered = isinstance(hub, tuple) and _interleaved(module) and algo is not None
            if reordered and (algo not in _ROW_ORDER_FREE or getattr(wq.spec, "static_nvfp4", False)):
                raise UnsupportedFormatError(
                    f"{name}.{proj}[{e}]: {type(module).__name__} interleaves the gate and up rows of "
                    f"gate_up_proj; the unified export writes them as gate_proj / up_proj in "
                    f"{sorted(_ROW_ORDER_FREE)} (dynamic NVFP4 blocks) only, not {algo}"
                )
            if isinstance(hub, tuple):
                yield prefix, (f"{prefix}.{hub[0]}", f"{prefix}.{hub[1]}"), algo, proj, e, wq, iq
            else:
                yield f"{prefix}.{hub}", None, algo, proj, e, wq, iq


@dataclass
class ExportModule:
    """A module whose linear maps the export writes itself (a :class:`QuantLinear` or the fused experts of
    one MoE block), planned without reading its weights: :meth:`layers` reads them, so under FSDP2 call it
    inside a :func:`~modelopt_lite.distributed.weight_access` window on :attr:`module`."""

    name: str
    module: nn.Module
    replaced: set[str]  # the state-dict keys its layers replace
    algos: list[str | None]  # quant_algo of each layer, in the order of :meth:`layers`
    awq: bool = False  # some layer of the model is NVFP4_AWQ: plain NVFP4 layers are written as NVFP4_AWQ

    def formats(self) -> Iterator[tuple[tuple[str, ...], str | None, Quantizer]]:
        """``(hub names, quant_algo, weight quantizer)`` per layer; reads no weight."""
        if isinstance(self.module, QuantExperts):
            specs = _experts_specs(self.name, self.module)
            for (hub, split, _, _, _, wq, _), algo in zip(specs, self.algos, strict=True):
                yield split or (hub,), algo, wq
        else:
            yield (self.name,), self.algos[0], self.module.weight_quantizer

    def layers(self) -> list[ExportLayer]:
        module = self.module
        out: list[ExportLayer] = []
        if isinstance(module, QuantExperts):
            for hub, split, algo, proj, e, wq, iq in _experts_specs(self.name, module):
                biases = getattr(module, f"{proj}_bias", None) if module.has_bias else None
                bias = None if biases is None else biases[e]
                weight = module.expert_weight(proj, e)
                if split is not None and _interleaved(module):
                    weight, bias = _gate_up_order(weight), _gate_up_order(bias)
                out.append(ExportLayer(hub, algo, weight, wq, iq, bias, split))
        else:
            algo = self.algos[0]
            w = module._weight_view()
            out.append(ExportLayer(self.name, algo, w, module.weight_quantizer, module.input_quantizer))
        for layer in out:
            layer.quant_algo = "NVFP4_AWQ" if self.awq and layer.quant_algo == "NVFP4" else layer.quant_algo
        return out


def export_plan(model: nn.Module) -> list[ExportModule]:
    """The modules whose linear maps the export writes itself, in ``named_modules`` order, with their
    formats; reads no weight (safe on an FSDP2-sharded model)."""
    plan: list[ExportModule] = []
    for name, module in model.named_modules():
        if isinstance(module, (CompressedLinear, CompressedExperts)):
            raise UnsupportedFormatError(
                f"{name}: the layer is compressed (mtq.compress); export the model before compressing it "
                "(the export writes the same packed tensors), or save the compressed model with mto.save"
            )
        elif isinstance(module, QuantExperts):
            algos = [spec[2] for spec in _experts_specs(name, module)]
            replaced = {f"{name}.{p}" for proj in module._projections for p in (proj, f"{proj}_bias")}
            plan.append(ExportModule(name, module, replaced, algos))
        elif isinstance(module, QuantLinear):
            algo = _exportable(name, linear_format(name, module))
            if algo is not None:
                plan.append(ExportModule(name, module, {f"{name}.weight"}, [algo]))
    awq = any(algo == "NVFP4_AWQ" for m in plan for algo in m.algos)  # a layer AWQ left unsmoothed is AWQ
    for m in plan:
        m.awq = awq
        m.algos = ["NVFP4_AWQ" if awq and a == "NVFP4" else a for a in m.algos]
    return plan


def export_layers(model: nn.Module) -> tuple[list[ExportLayer], set[str]]:
    """Every linear map of the model that the export writes itself, and the state-dict keys they replace
    (reads the weights: on an FSDP2-sharded model use :func:`export_plan` and windows instead)."""
    plan = export_plan(model)
    return [layer for m in plan for layer in m.layers()], {k for m in plan for k in m.replaced}


def _siblings(model: nn.Module) -> Iterator[list[QuantLinear]]:
    for _, parent in model.named_modules():
        for group in SHARED_INPUT_GROUPS:
            members = [getattr(parent, n, None) for n in group]
            members = [m for m in members if isinstance(m, QuantLinear) and m.weight_quantizer.is_enabled]
            if len(members) > 1:
                yield members


@torch.no_grad()
def _raise_to_max(quantizers: list[TensorQuantizer], attr: str = "amax") -> bool:
    amaxes = [getattr(q, attr) for q in quantizers]
    if any(a is None or a.numel() != 1 for a in amaxes):
        return False
    top = torch.stack([a.reshape(()).float() for a in amaxes]).amax()
    changed = any(not torch.equal(a.reshape(()), top.to(a.device)) for a in amaxes)
    for q, a in zip(quantizers, amaxes, strict=True):
        setattr(q, attr, top.to(a.device).reshape(a.shape))
    return changed


def unify_shared_scales(model: nn.Module) -> list[str]:
    """Give q/k/v and gate/up one input amax and, for NVFP4, one weight global amax (the group maximum),
    in place, so that the fake quantization computes what the fused engine kernel will. Returns the layers
    whose amax changed."""
    changed: list[str] = []
    for members in _siblings(model):
        inputs = [m.input_quantizer for m in members if m.input_quantizer.is_enabled]
        if len(inputs) > 1 and _raise_to_max(inputs):
            changed.extend(q.name for q in inputs)
        weights = [m.weight_quantizer for m in members]
        if all(isinstance(q, TensorQuantizer) and q.spec.kind == "nvfp4" for q in weights):
            static = all(q.spec.static_nvfp4 for q in weights)  # type: ignore[union-attr]
            if _raise_to_max(weights, "global_amax" if static else "amax"):  # type: ignore[arg-type]
                changed.extend(q.name for q in weights)
    if changed:
        logger.info(
            "export: %d quantizer(s) of q/k/v or gate/up raised to their group's amax so the fused layers "
            "share input_scale / weight_scale_2 (the model's fake quantization now matches): %s",
            len(changed), ", ".join(changed[:6]) + (" ..." if len(changed) > 6 else ""),
        )  # fmt: skip
    return changed


def _fold_is_exact(norm: nn.Module, scale: torch.Tensor) -> bool:
    """Whether ``norm(x) * scale`` equals the norm with its weight (and bias) times ``scale`` on a probe."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != scale.shape:
        return False
    with weight_access(norm):  # full weights under FSDP2 (a collective: every rank plans the same folds)
        probe_norm = copy.deepcopy(norm).float()
        reference = copy.deepcopy(norm).float()
    probe_norm.weight.data.mul_(scale.float())
    if getattr(probe_norm, "bias", None) is not None:
        probe_norm.bias.data.mul_(scale.float())
    x = torch.randn(4, scale.numel(), generator=torch.Generator().manual_seed(0)).to(weight.device)
    with torch.no_grad():
        return torch.allclose(probe_norm(x), reference(x) * scale.float(), rtol=1e-4, atol=1e-5)


def foldable_norms(model: nn.Module) -> dict[str, tuple[torch.Tensor, list[str]]]:
    """``{norm name: (pre_quant_scale, consumer layer names)}`` for norms whose output only the consumers
    read, that all carry the same ``pre_quant_scale``, and whose weight scales their output."""
    plan: dict[str, tuple[torch.Tensor, list[str]]] = {}
    for name, block in model.named_modules():
        for norm_name, consumers in _NORM_CONSUMERS:
            norm = getattr(block, norm_name, None)
            if norm is None:
                continue
            mods = []
            for path in consumers:
                try:
                    mods.append(block.get_submodule(path))
                except AttributeError:
                    break
            scales = [m.input_quantizer.pre_quant_scale for m in mods if isinstance(m, QuantLinear)]
            if len(scales) != len(consumers) or any(s is None for s in scales):
                continue
            if not all(torch.equal(s, scales[0]) for s in scales) or not _fold_is_exact(norm, scales[0]):
                continue
            prefix = f"{name}." if name else ""
            plan[prefix + norm_name] = (scales[0], [prefix + p for p in consumers])
    return plan


_FAKE_ONLY = {"q_bmm_quantizer": "query", "p_bmm_quantizer": "softmax probabilities"}


def kv_layers(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], str | None]:
    """The attention modules whose KV cache the checkpoint quantizes, and its one ``kv_cache_quant_algo``
    (``None``: none); modules with different KV formats raise, naming two of them."""
    for slot, what in _FAKE_ONLY.items():
        modules = model.named_modules()
        names = [n for n, m in modules if isinstance(m, QuantAttention) and getattr(m, slot).is_enabled]
        if names:
            logger.warning(
                "%d attention module(s) quantize the %s (%s, ...): %s is fake quant only, the checkpoint "
                "format has no scale for it (engines with FP8 attention compute their own)",
                len(names),
                what,
                names[0],
                slot,
            )
    found: list[tuple[str, nn.Module]] = []
    first: dict[str, str] = {}  # kv_cache_quant_algo -> the first module with it
    for name, module in model.named_modules():
        algo = kv_cache_format(name, module) if isinstance(module, QuantAttention) else None
        if algo is not None:
            found.append((name, module))
            first.setdefault(algo, name)
    if len(first) > 1:
        shown = ", ".join(f"{a} in {n}" for a, n in first.items())
        raise UnsupportedFormatError(
            f"KV caches in different formats ({shown}); the checkpoint records one kv_cache_quant_algo for "
            "the model: quantize every KV cache the same way"
        )
    return found, next(iter(first), None)
