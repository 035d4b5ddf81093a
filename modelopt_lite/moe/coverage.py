"""Which experts received tokens: counted by the quantized experts forward since the last reset
(calibration resets it), reported per experts module; for experts that are separate modules, which of their
quantizers calibration gave an amax from the other experts of their layer."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..logging import get_logger
from .experts import QuantExperts
from .sequential import expert_containers, recorded_amax_fills, split_expert_name

__all__ = ["coverage_report", "reset_coverage", "unquantized_experts"]

logger = get_logger(__name__)


def reset_coverage(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, QuantExperts):
            module.reset_coverage()


def coverage_report(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per experts module, what the last calibration saw.

    Fused experts (:class:`QuantExperts`): ``forward_calls``, ``tokens_per_expert`` and
    ``experts_without_tokens`` (their weights are still calibrated from the weights; their inputs go through
    the module's shared input quantizers). Experts that are separate modules (an ``nn.ModuleList`` /
    ``nn.ModuleDict`` of experts) are listed when calibration gave some of their activation quantizers an
    amax from the other experts: ``experts_without_tokens`` (their keys: ints for a ``ModuleList``) and
    ``amax_from_other_experts`` (``{quantizer: [the quantizers whose largest amax it took]}``). Also logged
    at DEBUG."""
    report: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantExperts):
            counts = module.tokens_per_expert.tolist()
            report[name] = {
                "forward_calls": module.forward_calls,
                "tokens_per_expert": counts,
                "experts_without_tokens": [i for i, c in enumerate(counts) if c == 0],
            }
            logger.debug("%s: %d call(s), tokens per expert %s", name, module.forward_calls, counts)
    containers = expert_containers(model)
    for name, fills in recorded_amax_fills(model).items():
        lists = isinstance(model.get_submodule(name), nn.ModuleList)
        keys = {split[1] for q in fills if (split := split_expert_name(q, containers)) is not None}
        idle = sorted(int(k) if lists else k for k in keys)
        report[name] = {"experts_without_tokens": idle, "amax_from_other_experts": fills}
        logger.debug("%s: experts without tokens %s", name, idle)
    return report


def unquantized_experts(model: nn.Module) -> list[str]:
    """Experts modules none of whose quantizers is enabled."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, QuantExperts)
        and not any(q.is_enabled for q in module.modules() if q is not module and hasattr(q, "is_enabled"))
    ]
