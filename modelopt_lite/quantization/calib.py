"""``modelopt_lite.quantization.calib``: the reference library's calibrator module names. ``MaxCalibrator``,
``HistogramCalibrator`` and ``BiasCalibrator`` are :mod:`modelopt_lite.nn.calibrators`' (constructed as in the
reference: ``MaxCalibrator(num_bits, axis, unsigned, track_amax)``, ``HistogramCalibrator(num_bits, axis,
unsigned, num_bins, grow_method, skip_zeros, torch_hist)``, ``BiasCalibrator(method, axis)``; or with a
format spec). A subclass of one of them (or of ``Calibrator``, also named ``_Calibrator`` as in the
reference) is a custom calibrator: ``{"calibrator": (MyCalibrator, args, kwargs)}`` in a quantizer's
attributes. The other calibrators exist and raise :class:`~modelopt_lite.nn.errors.UnsupportedFeatureError`
naming what to use."""

from __future__ import annotations

from ..nn.calibrators import BiasCalibrator, Calibrator, HistogramCalibrator, MaxCalibrator
from ..nn.errors import unsupported_class

__all__ = [
    "BiasCalibrator",
    "Calibrator",
    "HistogramCalibrator",
    "MaxCalibrator",
    "MseCalibrator",
    "NVFP4ActHeadroomCalibrator",
    "NVFP4MSECalibrator",
]

_Calibrator = Calibrator  # the reference's name of the base class custom calibrators subclass

_MSE = (
    "use the 'mse' calibration algorithm (weights) or HistogramCalibrator(num_bits, method='mse') "
    "(activations)"
)
MseCalibrator = unsupported_class("MseCalibrator", _MSE, __name__)
NVFP4MSECalibrator = unsupported_class("NVFP4MSECalibrator", _MSE, __name__)
NVFP4ActHeadroomCalibrator = unsupported_class(
    "NVFP4ActHeadroomCalibrator",
    "NVFP4 activation headroom calibration is not implemented; use 'max'",
    __name__,
)
