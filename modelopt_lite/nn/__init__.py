"""Floor 2: ``TensorQuantizer``, calibrators (and, with later work, quantized module wrappers)."""

from .calibrators import Calibrator, HistogramCalibrator, MaxCalibrator, make_calibrator
from .tensor_quantizer import QuantizerAttributes, TensorQuantizer

__all__ = [
    "Calibrator",
    "HistogramCalibrator",
    "MaxCalibrator",
    "QuantizerAttributes",
    "TensorQuantizer",
    "make_calibrator",
]
