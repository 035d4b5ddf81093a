"""The bias of an affine quantizer (its ``bias`` attribute): :func:`bias_settings` reads the attribute,
:class:`BiasCalibrator` computes the mean of ``x`` over the bias axes (running mean of the per-batch means),
or the midpoint of its running max and min.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["BiasCalibrator", "bias_settings"]

_BIAS_KEYS = ("type", "method")


def bias_settings(bias: Mapping[Any, Any]) -> tuple[tuple[int, ...], str, str]:
    """``(axes, method, type)`` of a ``bias`` attribute such as ``{-2: None, -4: None, "type": "static"}``:
    the integer keys are the axes the bias is reduced over (values unused), ``"method"`` is ``"mean"``
    (default) or ``"max_min"``, ``"type"`` ``"static"`` (calibrated, default) or ``"dynamic"`` (per input)."""
    if not isinstance(bias, Mapping):
        raise TypeError(f"bias={bias!r} must be a mapping such as {{-2: None, -4: None, 'type': 'static'}}")
    axes = [k for k in bias if k not in _BIAS_KEYS]
    if not axes or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
        raise ValueError(
            f"bias={dict(bias)!r}: its keys are the axes to reduce over (ints, at least one) and optionally "
            f"'type' ('static' / 'dynamic') and 'method' ('mean' / 'max_min')"
        )
    method, kind = bias.get("method", "mean"), bias.get("type", "static")
    if method not in ("mean", "max_min"):
        raise ValueError(f"bias method={method!r} (allowed: 'mean', 'max_min')")
    if kind not in ("static", "dynamic"):
        raise ValueError(f"bias type={kind!r} (allowed: 'static', 'dynamic')")
    return tuple(axes), method, kind


class BiasCalibrator:
    """The bias of an affine quantizer, reduced over ``axis`` (the axes listed; keepdim): ``"mean"``, the
    running mean of each batch's mean (every batch weighs the same), or ``"max_min"``, the midpoint of the
    running max and min. Constructed as in the reference library: ``BiasCalibrator(method, axis)``."""

    def __init__(self, method: str = "mean", axis: int | tuple[int, ...] | None = None):
        if method not in ("mean", "max_min"):
            raise ValueError(f"BiasCalibrator: method={method!r} (allowed: 'mean', 'max_min')")
        self.method = method
        self.axis = (axis,) if isinstance(axis, int) else axis
        self.reset()

    def _dims(self, x: torch.Tensor) -> tuple[int, ...] | None:
        if self.axis is None:
            return None
        return tuple(sorted({a % x.dim() for a in self.axis if -x.dim() <= a < x.dim()}))

    def _reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        dims = self._dims(x)
        if dims is None:
            return getattr(torch, op)(x)
        return getattr(torch, op)(x, dim=dims, keepdim=True)

    def compute_dynamic_bias(self, x: torch.Tensor) -> torch.Tensor:
        """The bias of ``x`` alone (a ``"dynamic"`` bias)."""
        if self.method == "mean":
            return self._reduce(x, "mean")
        return (self._reduce(x, "amax") + self._reduce(x, "amin")) / 2

    def collect(self, x: torch.Tensor) -> None:
        x = x.detach()
        if self.method == "mean":
            bias = self._reduce(x, "mean")
            if self._bias is not None:
                bias = ((self._bias.float() * self.num_batches + bias.float()) / (self.num_batches + 1)).to(
                    bias.dtype
                )
            self._bias = bias
        else:
            high, low = self._reduce(x, "amax"), self._reduce(x, "amin")
            self._max = high if self._max is None else torch.maximum(self._max, high)
            self._min = low if self._min is None else torch.minimum(self._min, low)
            self._bias = (self._max + self._min) / 2
        self.num_batches += 1

    def compute_bias(self) -> torch.Tensor | None:
        return None if self._bias is None else self._bias.clone()

    def reset(self) -> None:
        self._bias: torch.Tensor | None = None
        self._max: torch.Tensor | None = None
        self._min: torch.Tensor | None = None
        self.num_batches = 0
