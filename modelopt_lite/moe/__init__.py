"""Floor 2: fused MoE experts (transformers' ``@use_experts_implementation`` classes, Llama 4's text
experts): per-expert quantizers on transformers' ``grouped_mm`` and ``eager`` backends, and the token
coverage report."""

from .coverage import coverage_report, reset_coverage, unquantized_experts
from .experts import (
    EXPERTS_IMPLEMENTATIONS,
    LEGACY_EXPERTS_IMPLEMENTATIONS,
    QuantExperts,
    experts_implementation_name,
    is_seam_experts,
)
from .llama4 import QuantLlama4TextExperts

__all__ = [
    "EXPERTS_IMPLEMENTATIONS",
    "LEGACY_EXPERTS_IMPLEMENTATIONS",
    "QuantExperts",
    "QuantLlama4TextExperts",
    "coverage_report",
    "experts_implementation_name",
    "is_seam_experts",
    "reset_coverage",
    "unquantized_experts",
]
