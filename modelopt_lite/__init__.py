"""modelopt_lite: quantization-aware training, distillation and post-training quantization of LLMs.

``from modelopt_lite import QATTrainer, QADTrainer, QuantizationArguments, DistillationArguments`` works;
the training classes are imported on first use.

Any import of the library (``import modelopt_lite``, ``import modelopt_lite.quantization``, ...) registers
its loader for exported checkpoints (``quant_method: "modelopt"``) with transformers, so that
``from_pretrained(export_dir)`` loads an export whichever of its modules the user imported (a few seconds:
it imports transformers and torch)."""

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


def _register_export_loader() -> None:
    from .export.load import loader  # noqa: F401  (registers quant_method "modelopt" with transformers)


_register_export_loader()
