"""Calibrators: collect statistics of a quantizer's input and turn them into an amax (max, histogram) or an
affine quantizer's bias. Imports only :mod:`modelopt_lite.formats`, ``distributed`` and ``nn.errors``.
"""

from .base import (
    BiasCalibrator,
    Calibrator,
    HistogramCalibrator,
    MaxCalibrator,
    ShapeChangedError,
    bias_settings,
    make_calibrator,
    sync_calibrators,
)

__all__ = [
    "BiasCalibrator",
    "Calibrator",
    "HistogramCalibrator",
    "MaxCalibrator",
    "ShapeChangedError",
    "bias_settings",
    "make_calibrator",
    "sync_calibrators",
]
