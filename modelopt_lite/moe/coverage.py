"""Which experts received tokens: counted by the quantized experts forward since the last reset
(calibration resets it), reported per experts module."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..logging import get_logger
from .experts import QuantExperts

__all__ = ["coverage_report", "reset_coverage", "unquantized_experts"]

logger = get_logger(__name__)


def reset_coverage(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, QuantExperts):
            module.reset_coverage()


def coverage_report(model: nn.Module) -> dict[str, dict[str, Any]]:
    """For each quantized experts module: forward calls, tokens routed to each expert, and the experts that
    received none (their weights are still calibrated from the weights). Also logged at DEBUG."""
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
    return report


def unquantized_experts(model: nn.Module) -> list[str]:
    """Experts modules none of whose quantizers is enabled."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, QuantExperts)
        and not any(q.is_enabled for q in module.modules() if q is not module and hasattr(q, "is_enabled"))
    ]
