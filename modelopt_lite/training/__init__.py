"""Floor 5: training: ``QATTrainer``, ``QADTrainer``, their argument dataclasses, the garbage-collector
policy, the allocator policy (``MallocPolicy``, from ``modelopt_lite.allocator``) and the chunked
distillation loss."""

from ..allocator import MallocPolicy
from .arguments import DistillationArguments, QuantizationArguments
from .distill_loss import chunked_distillation_loss
from .gc_policy import GCPolicy
from .qad_trainer import QADTrainer
from .qat_trainer import QATTrainer

__all__ = [
    "DistillationArguments",
    "GCPolicy",
    "MallocPolicy",
    "QADTrainer",
    "QATTrainer",
    "QuantizationArguments",
    "chunked_distillation_loss",
]
