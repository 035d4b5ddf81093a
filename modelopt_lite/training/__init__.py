"""Floor 5: training (QAT / QAD trainers arrive with their issue): the garbage-collector policy and the
chunked distillation loss they use."""

from .arguments import DistillationArguments, QuantizationArguments
from .distill_loss import chunked_distillation_loss
from .gc_policy import GCPolicy
from .qat_trainer import QATTrainer

__all__ = [
    "DistillationArguments",
    "GCPolicy",
    "QATTrainer",
    "QuantizationArguments",
    "chunked_distillation_loss",
]
