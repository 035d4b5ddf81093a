"""Floor 5: training (QAT / QAD trainers arrive with their issue); the garbage-collector policy they use."""

from .gc_policy import GCPolicy

__all__ = ["GCPolicy"]
