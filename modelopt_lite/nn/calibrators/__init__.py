"""Calibrators: collect statistics of a quantizer's input and turn them into an amax (:mod:`.base`: the base
class and max; :mod:`.histogram`: percentile / MSE / entropy) or an affine quantizer's bias (:mod:`.bias`).
Imports only :mod:`modelopt_lite.formats`, ``distributed`` and ``nn.errors``.
"""

from .base import Calibrator, MaxCalibrator, ShapeChangedError, sync_calibrators
from .bias import BiasCalibrator, bias_settings
from .histogram import HistogramCalibrator, make_calibrator

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
