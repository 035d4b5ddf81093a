"""modelopt_lite: quantization-aware training, distillation and post-training quantization of LLMs.

``from modelopt_lite import QATTrainer, QADTrainer, QuantizationArguments, DistillationArguments`` works;
the training classes are imported on first use (so ``import modelopt_lite`` stays light)."""

from typing import Any

from ._version import __version__
from .logging import quiet_third_party_import_noise

quiet_third_party_import_noise()  # torchao's CUDA-extension lines on CPU machines (see modelopt_lite.logging)

_TRAINING = ("DistillationArguments", "QADTrainer", "QATTrainer", "QuantizationArguments")
__all__ = ["__version__", *_TRAINING]


def __getattr__(name: str) -> Any:
    if name in _TRAINING:
        from . import training

        return getattr(training, name)
    raise AttributeError(f"module 'modelopt_lite' has no attribute {name!r}")
