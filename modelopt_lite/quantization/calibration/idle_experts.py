"""MoE experts that a calibration pass routed no token to (``docs/moe.md``).

* Fused experts (:class:`~modelopt_lite.moe.QuantExperts`) share one input quantizer per projection, so an
  idle expert's inputs are quantized with the amax its module's quantizer took from the other experts'
  tokens; its weight quantizers are calibrated from its weights.
* Experts that are separate modules (an ``nn.ModuleList`` / ``nn.ModuleDict`` of MLPs) have activation
  quantizers of their own, which saw nothing: each takes the largest amax of the same quantizer in the
  other experts of its layer (those that saw data with the same ``pre_quant_scale``: none, or the same).

Both are named in a WARNING. The algorithm option ``moe_experts_without_tokens="raise"`` (every algorithm;
:func:`~.calibrate.calibrate` holds it in :func:`experts_without_tokens_policy` while the step runs) makes
them an error instead. A quantizer outside experts that saw no data, or one that no other expert of its
layer can stand in for (none saw data, or all were smoothed with scales of their own), is an error either
way (raised by the caller). Token counts are summed over ranks and the
decisions taken after the calibrators' statistics were merged, so every rank decides the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from ...distributed import all_reduce_sum
from ...logging import get_logger
from ...moe import QuantExperts, amax_donors, expert_containers
from ...moe.sequential import split_expert_name
from ...nn import TensorQuantizer
from ..config import EXPERTS_WITHOUT_TOKENS, experts_without_tokens

__all__ = [
    "IdleExperts",
    "experts_without_tokens_policy",
    "fill_from_other_experts",
]

logger = get_logger(__name__)

# What load_activations does with idle experts during the current calibration step; a context variable
# (set and reset by calibrate around each step) rather than an argument threaded through every algorithm.
_POLICY: ContextVar[str] = ContextVar(EXPERTS_WITHOUT_TOKENS, default="warn")


@contextmanager
def experts_without_tokens_policy(value: str) -> Iterator[None]:
    """Calibration inside the block treats idle experts as ``value`` says (``"warn"`` or ``"raise"``)."""
    token = _POLICY.set(experts_without_tokens(value))
    try:
        yield
    finally:
        _POLICY.reset(token)


class IdleExperts:
    """The experts a calibration pass left without tokens, as seen by the quantizers it calibrated
    (``activations``, their statistics already merged across ranks).

    ``shared``: ``{fused experts module: [idle experts]}`` for modules whose input quantizers this pass
    calibrated (their amax comes from the other experts); ``weights_only``: the same for the other fused
    modules; ``fills``: ``{activation quantizer of an idle expert module: [the same quantizer of the
    experts of its layer that saw data]}``; ``empty``: the quantizers that saw no data and that no other
    expert can stand in for."""

    def __init__(self, model: nn.Module, activations: list[TensorQuantizer]) -> None:
        self.shared, self.weights_only = _idle_fused(model, activations)
        empty = [q.name for q in activations if q.calibrator.num_batches == 0]
        self.containers = expert_containers(model) if empty else {}
        seen = [q.name for q in activations if q.calibrator.num_batches > 0]
        by_name = {q.name: q for q in activations}
        self.fills = {
            name: same
            for name, donors in amax_donors(empty, seen, self.containers).items()
            if (same := [d for d in donors if _same_input_scale(by_name[name], by_name[d])])
        }
        self.empty = [name for name in empty if name not in self.fills]

    def check_policy(self) -> None:
        """Raise naming the idle experts when the step runs with ``moe_experts_without_tokens="raise"``."""
        if _POLICY.get() != "raise" or not (self.shared or self.fills):
            return
        raise RuntimeError(
            f"{self._count()} MoE expert(s) received no calibration tokens and the algorithm option "
            f"{EXPERTS_WITHOUT_TOKENS}='raise' forbids giving them the amax of the other experts of their "
            f"layer: {self._describe()}. Calibrate on more (or more varied) data so that the router sends "
            "tokens to every expert (modelopt_lite.moe.coverage_report(model) counts them per expert), or "
            f"leave out {EXPERTS_WITHOUT_TOKENS} (default 'warn') to carry on with a WARNING"
        )

    def log(self) -> None:
        if self.shared or self.fills:
            logger.warning(
                "%d MoE expert(s) received no calibration tokens; their activations are quantized with the "
                "amax of the other experts of their layer (their weights are calibrated from the weights): "
                "%s. Calibrate on data that reaches them, or set the algorithm option %s='raise' to make "
                "this an error",
                self._count(),
                self._describe(),
                EXPERTS_WITHOUT_TOKENS,
            )
        if self.weights_only:
            logger.info(
                "%d expert(s) in %d fused experts module(s) without calibrated input quantizers received no "
                "calibration tokens (their weights are calibrated from the weights): %s",
                sum(len(v) for v in self.weights_only.values()),
                len(self.weights_only),
                "; ".join(f"{k}: {v}" for k, v in self.weights_only.items()),
            )

    def _groups(self) -> dict[tuple[str, str], tuple[list[str], list[str]]]:
        """``{(container, path inside the expert): ([idle experts], [experts that gave the amax])}``."""
        groups: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
        for name, donors in self.fills.items():
            container, key, inside = split_expert_name(name, self.containers)  # type: ignore[misc]
            keys, sources = groups.setdefault((container, inside), ([], []))
            keys.append(key)
            for donor in donors:
                source = split_expert_name(donor, self.containers)[1]  # type: ignore[index]
                if source not in sources:
                    sources.append(source)
        return groups

    def _count(self) -> int:
        groups = self._groups().items()
        sequential = {(container, key) for (container, _), (keys, _) in groups for key in keys}
        return sum(len(v) for v in self.shared.values()) + len(sequential)

    def _describe(self) -> str:
        parts = [
            f"{name} (fused): experts {idle} use the amax of the module's shared input quantizers"
            for name, idle in self.shared.items()
        ]
        parts += [
            f"{container}.[{', '.join(keys)}].{inside} took the largest amax of experts "
            f"[{', '.join(sources)}]"
            for (container, inside), (keys, sources) in self._groups().items()
        ]
        return "; ".join(parts)


def _idle_fused(
    model: nn.Module, activations: list[TensorQuantizer]
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Idle experts of the fused modules (token counts summed over ranks), split by whether the module's
    own activation quantizers are among ``activations``."""
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, QuantExperts)]
    if not modules:
        return {}, {}
    counts = all_reduce_sum(torch.cat([m.tokens_per_expert.detach().cpu() for _, m in modules])).tolist()
    calibrated = {id(q) for q in activations}
    shared: dict[str, list[int]] = {}
    weights_only: dict[str, list[int]] = {}
    start = 0
    for name, module in modules:
        idle = [i for i, c in enumerate(counts[start : start + module.num_experts]) if c == 0]
        start += module.num_experts
        if idle:
            own = any(id(q) in calibrated for q in module.children() if isinstance(q, TensorQuantizer))
            (shared if own else weights_only)[name] = idle
    return shared, weights_only


def _same_input_scale(a: TensorQuantizer, b: TensorQuantizer) -> bool:
    """Whether ``a`` and ``b`` see their inputs on the same scale: neither has a ``pre_quant_scale``, or both
    the same one (an amax of inputs smoothed by another expert's scale does not fit an expert without one)."""
    sa, sb = a.pre_quant_scale, b.pre_quant_scale
    if sa is None or sb is None:
        return sa is None and sb is None
    return sa.shape == sb.shape and bool(torch.equal(sa.detach().cpu(), sb.detach().cpu()))


@torch.no_grad()
def fill_from_other_experts(activations: list[TensorQuantizer], fills: dict[str, list[str]]) -> None:
    """Give each quantizer of ``fills`` the element-wise largest amax of its donors (already loaded)."""
    by_name = {q.name: q for q in activations}
    for name, donors in fills.items():
        amaxes = [by_name[d].amax for d in donors]
        shapes = sorted({tuple(a.shape) for a in amaxes if a is not None})
        if len(shapes) != 1 or any(a is None for a in amaxes):
            raise RuntimeError(
                f"{name} received no calibration data, and the same quantizer of the other experts of its "
                f"layer has no amax of one shape to stand in ({shapes}): calibrate on data that reaches "
                "this expert, or disable the quantizer"
            )
        q = by_name[name]
        q.amax = torch.stack([a.detach().float().to(amaxes[0].device) for a in amaxes]).amax(0)
        if q.spec.static_nvfp4:
            q.global_amax = q.amax.amax()
