"""Floor 2b (above ``nn``): fused MoE experts (transformers' ``@use_experts_implementation`` classes,
Llama 4's text experts): per-expert quantizers on transformers' ``grouped_mm`` and ``eager`` backends, and the
token coverage report; the experts that are separate modules, whose activation quantizers calibration fills
from the other experts of their layer when they received no tokens."""

from .coverage import coverage_report, reset_coverage, unquantized_experts
from .experts import (
    EXPERTS_IMPLEMENTATIONS,
    LEGACY_EXPERTS_IMPLEMENTATIONS,
    QuantExperts,
    experts_implementation_name,
    is_seam_experts,
)
from .llama4 import QuantLlama4TextExperts
from .sequential import amax_donors, expert_containers, record_amax_fills, recorded_amax_fills

__all__ = [
    "EXPERTS_IMPLEMENTATIONS",
    "LEGACY_EXPERTS_IMPLEMENTATIONS",
    "QuantExperts",
    "QuantLlama4TextExperts",
    "amax_donors",
    "coverage_report",
    "expert_containers",
    "experts_implementation_name",
    "is_seam_experts",
    "record_amax_fills",
    "recorded_amax_fills",
    "reset_coverage",
    "unquantized_experts",
]
