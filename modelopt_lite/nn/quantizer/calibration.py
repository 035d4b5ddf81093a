"""How a :class:`~.tensor_quantizer.TensorQuantizer` calibrates: the calibrator its attributes name
(:func:`build_calibrator`), and :class:`QuantizerCalibration`, the quantizer's calibration methods (collect
statistics of an input, load the calibrated amax and an affine quantizer's static bias, calibrate from a
weight alone). A mixin of ``TensorQuantizer`` as :class:`~.buffers.QuantizerBuffers` is: it works on the
quantizer's attributes, spec and buffers.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from ...distributed import is_distributed
from ...formats import FormatSpec
from ...logging import get_logger
from ..calibrators import BiasCalibrator, Calibrator, bias_settings, make_calibrator
from .attributes import QuantizerAttributes, calibrator_constructor

__all__ = ["QuantizerCalibration", "build_calibrator"]

logger = get_logger(__name__)
_Q = TypeVar("_Q", bound="QuantizerCalibration")


def build_calibrator(attrs: QuantizerAttributes, spec: FormatSpec, owner: str) -> Calibrator:
    """The calibrator ``attrs.calibrator`` names, or the custom one it gives as ``(cls, args, kwargs)``."""
    constructor = calibrator_constructor(attrs.calibrator)
    if constructor is None:
        return make_calibrator(attrs.calibrator, spec, owner, **attrs.calibrator_options)
    cls, args, kwargs = constructor
    if attrs.calibrator_options:
        raise ValueError(
            f"calibrator {cls.__qualname__}: give its arguments in the calibrator tuple (cls, args, kwargs), "
            "not in calibrator_options"
        )
    calibrator = cls(*args, **kwargs)
    if getattr(calibrator, "owner", "TensorQuantizer") == "TensorQuantizer":
        calibrator.owner = owner
    return calibrator


class QuantizerCalibration:
    """The calibration methods of :class:`~.tensor_quantizer.TensorQuantizer` (its ``_calibrator``,
    ``_bias_calibrator``, ``_attrs``, ``_spec`` and buffers)."""

    @property
    def calibrator(self) -> Calibrator:
        return self._calibrator

    @property
    def bias_calibrator(self) -> BiasCalibrator | None:
        """The calibrator of an affine quantizer's bias (``None`` without ``bias``)."""
        return self._bias_calibrator

    def reset_bias(self) -> None:
        self._bias_value = None
        if self._bias_calibrator is not None:
            self._bias_calibrator.reset()

    def reset_calibration(self) -> None:
        """Forget the statistics collected so far (amax and bias calibrators); loaded values stay."""
        self._calibrator.reset()
        if self._bias_calibrator is not None:
            self._bias_calibrator.reset()

    def _static_bias(self) -> bool:
        return self._bias_calibrator is not None and bias_settings(self._attrs.bias)[2] == "static"

    def load_calib_bias(self) -> None:
        """Move the bias calibrator's result into ``bias_value`` (an affine quantizer with a static bias)."""
        if not self._static_bias():
            return
        if is_distributed():
            raise NotImplementedError(
                f"{self.name}: affine (bias) calibration is not merged across ranks; calibrate in one process"
            )
        bias = self._bias_calibrator.compute_bias()
        if bias is None:
            raise RuntimeError(f"{self.name}: no data reached this quantizer's bias calibration")
        self.bias_value = bias

    def load_calib_amax(self, *args: Any, strict: bool = True, **kwargs: Any) -> None:
        """Move the calibrator's result into the ``amax`` buffer (no-op for formats without amax and for a
        pinned amax: ``constant_amax`` / ``use_constant_amax``), and a static bias into ``bias_value``.
        ``args`` / ``kwargs`` go to the calibrator's ``compute_amax`` (e.g. ``load_calib_amax("entropy")``
        with a histogram calibrator); ``strict=False`` leaves the amax unset, with a WARNING, when no data
        arrived (instead of raising)."""
        if self._attrs.pinned_amax is not None:
            return
        self.load_calib_bias()
        if not self._spec.needs_amax:
            return
        amax = self._calibrator.compute_amax(*args, **kwargs)
        if amax is None:
            if not strict:
                logger.warning(
                    "%s: no data reached this quantizer during calibration; amax left unset", self.name
                )
                return
            raise RuntimeError(
                f"{self.name}: Calibrator returned None: no data reached this quantizer during "
                "calibration; run a forward pass over calibration data or disable the quantizer"
            )
        self._store_amax(amax.float())
        if self._spec.static_nvfp4:
            self._global_amax = amax.float().amax()

    def calibrate(self: _Q, x: torch.Tensor) -> _Q:
        """Set ``amax`` from ``x`` alone (e.g. a weight): reset, collect ``x``, load the result."""
        self.reset_calibration()
        if self._spec.needs_amax and self._attrs.pinned_amax is None:
            self._collect(self._transform(x))
            self.load_calib_amax()
        return self

    def _collect(self, x: torch.Tensor) -> None:
        """Calibration: a static bias from ``x``, then the amax of ``x`` minus the bias so far."""
        if self._static_bias():
            self._bias_calibrator.collect(x)
            x = x - self._bias_calibrator.compute_bias()
        if self._spec.needs_amax:
            counted = self._calibrator.num_batches
            self._calibrator.collect(x)
            if self._calibrator.num_batches == counted:  # a custom calibrator that does not count
                self._calibrator.num_batches += 1

    def _bias(self, x: torch.Tensor) -> torch.Tensor | None:
        """The bias subtracted before the fake quantization (``None``: none, or dynamic block scales)."""
        if self._bias_calibrator is None or (self._spec.kind in ("nvfp4", "mx") and self._spec.dynamic):
            return None
        if not self._static_bias():
            return self._bias_calibrator.compute_dynamic_bias(x)
        if self._bias_value is None:
            raise RuntimeError(
                f"{self.name}: bias={self._attrs.bias!r} has no calibrated bias_value; calibrate it first"
            )
        return self._bias_value.to(x.dtype)
