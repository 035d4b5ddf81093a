"""``QuantizerAttributes``: what a :class:`~.tensor_quantizer.TensorQuantizer` is configured with.

Attributes users set (directly, through :meth:`TensorQuantizer.configure` or through configs):
``num_bits``, ``axis``, ``block_sizes``, ``unsigned``, ``narrow_range``, ``enable``, ``fake_quant``,
``backward`` (``"pass_through"`` or ``"clipped"``), ``learn_amax``, ``calibrator``, ``type`` (``"static"``, or
``"dynamic"``: the amax taken from each input, per tensor / ``axis`` / block) and ``pre_quant_scale``.
Every change is validated at once; a bad value raises naming the attribute and the allowed values.

``learn_amax=True`` makes a static amax (INT / FP8, per tensor, channel or block) an ``nn.Parameter``
(``<quantizer>._amax``) that an optimizer trains: the forward is unchanged, the backward gives the amax an
LSQ gradient and zeroes the input's gradient where it was clipped (:mod:`modelopt_lite.formats.learnable`).
It is still calibrated first, saved and restored as the amax buffer is, and exported like any amax.

Two attributes pin the amax instead of calibrating it (the quantizer then needs no calibration data and
calibration leaves it as it is): ``constant_amax`` (a finite number > 0) holds that value in ``amax``, so
the fake quantization and the exported scale use it (an NVFP4 activation quantizer with ``constant_amax``
2688 exports ``input_scale`` 1.0); ``use_constant_amax=True`` holds the FP8 E4M3 maximum, 448 (KV caches
whose engine runs FP8 attention math: an FP8 KV scale of 1.0). Both need a format with one amax per tensor
(INT / FP8 per tensor, NVFP4's global amax) and exclude each other. ``calibrator`` is ``"max"``,
``"percentile"``, ``"mse"``, ``"entropy"``, ``"histogram"`` (the reference's name; percentile unless
:meth:`TensorQuantizer.load_calib_amax` names another method) or a calibrator class
of your own with its constructor arguments: ``MyCalibrator``, ``(MyCalibrator, args)`` or
``(MyCalibrator, args, kwargs)``; the class must subclass
:class:`~modelopt_lite.nn.calibrators.Calibrator` (or one of the calibrators) and is constructed as
``MyCalibrator(*args, **kwargs)``.

Two attributes of the reference library transform the input around the quantization:

* ``rotate`` (``True`` or ``{"enable", "mode", "rotate_fp32", "block_size"}``): the input is multiplied by a
  normalized Hadamard matrix along its last dimension (:func:`~modelopt_lite.formats.hadamard_transform`)
  before anything else, also when the quantizer is disabled (a disabled ``q_bmm_quantizer`` with
  ``rotate=True`` rotates the query so that ``q k^T`` is unchanged when the keys are rotated).
  ``mode="rotate_back"`` rotates the output again (the transform is its own inverse).
* ``bias`` (affine quantization, e.g. ``{-2: None, -4: None, "type": "static"}``: the integer keys are the
  axes the bias is reduced over; ``"method"`` ``"mean"`` or ``"max_min"``): the bias is subtracted before the
  fake quantization and added back after. A static bias is calibrated with the amax (``bias_value``, the
  ``_bias_value`` buffer; the amax is calibrated on the input minus the bias); a dynamic one is taken from
  each input. As in the reference, formats with dynamic block scales (NVFP4, MX) quantize the input itself:
  there the bias only shifts the calibrated amax, and it is exported for the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ...formats import FormatSpec, learnable_amax_error, resolve_format
from ..calibrators import Calibrator, bias_settings

__all__ = ["CalibratorConstructor", "QuantizerAttributes", "calibrator_constructor"]

#: A custom calibrator: its class, positional and keyword arguments.
CalibratorConstructor = tuple[type[Calibrator], tuple[Any, ...], dict[str, Any]]

#: What ``use_constant_amax=True`` pins the amax to: the FP8 E4M3 maximum.
E4M3_MAX = 448.0


def calibrator_constructor(value: Any) -> CalibratorConstructor | None:
    """``(cls, args, kwargs)`` of a custom ``calibrator`` value (a class, or a tuple ``(cls,)``, ``(cls,
    args)``, ``(cls, args, kwargs)``); ``None`` for a calibrator name. Raises ``TypeError`` naming what is
    not a calibrator class or not an argument tuple / dict."""
    if isinstance(value, str):
        return None
    parts = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not 1 <= len(parts) <= 3:
        raise TypeError(
            f"calibrator={value!r}: a calibrator name, a class, or (class, args) / (class, args, kwargs)"
        )
    cls, args, kwargs = (*parts, (), {})[:3] if len(parts) == 1 else (*parts, {})[:3]
    if not (isinstance(cls, type) and issubclass(cls, Calibrator)):
        what = getattr(cls, "__qualname__", None) or repr(cls)
        raise TypeError(
            f"calibrator={what} is not a calibrator class: subclass "
            "modelopt_lite.quantization.calib.MaxCalibrator (or Calibrator / HistogramCalibrator) and give "
            f"(class, args, kwargs), or one of the names 'max', 'histogram', 'percentile', 'mse', 'entropy'"
        )
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"calibrator {cls.__qualname__}: its arguments must be a tuple, got {args!r}")
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(
            f"calibrator {cls.__qualname__}: its keyword arguments must be a dict, got {kwargs!r}"
        )
    return cls, tuple(args), dict(kwargs)


def _pinnable(spec: FormatSpec) -> bool:
    """Whether ``spec`` keeps one amax per tensor (what ``constant_amax`` / ``use_constant_amax`` pin)."""
    if spec.kind == "nvfp4":
        return spec.dynamic  # the global amax next to block scales taken from each block
    return spec.kind in ("int", "fp8") and not spec.dynamic and spec.axis is None and not spec.block_axes


_ROTATE_KEYS = {"enable": False, "mode": "rotate", "rotate_fp32": False, "block_size": None}


@dataclass(frozen=True)
class QuantizerAttributes:
    """The user-facing attributes of a :class:`TensorQuantizer` (immutable; replace to change)."""

    num_bits: int | tuple[int, int] = 8
    axis: int | tuple[int, ...] | None = None
    block_sizes: dict[Any, Any] | None = None
    unsigned: bool = False
    narrow_range: bool = False
    enable: bool = True
    fake_quant: bool = True
    backward: Literal["pass_through", "clipped"] = "pass_through"
    calibrator: str | CalibratorConstructor = "max"
    calibrator_options: dict[str, Any] = field(default_factory=dict)
    learn_amax: bool = False
    type: Literal["static", "dynamic"] = "static"  # dynamic: amax taken from each input (axis / blocks)
    bias: dict[Any, Any] | None = None  # affine quantization (see the module docstring)
    rotate: bool | dict[str, Any] = False  # Hadamard rotation of the input (see the module docstring)
    use_constant_amax: bool = False  # amax pinned to 448 (see the module docstring)
    constant_amax: float | None = None  # amax pinned to this value (see the module docstring)

    @property
    def pinned_amax(self) -> float | None:
        """The amax ``constant_amax`` / ``use_constant_amax`` pin, else ``None``."""
        return E4M3_MAX if self.use_constant_amax is True else self.constant_amax

    def _check_pinned_value(self) -> None:
        """The checks of ``constant_amax`` / ``use_constant_amax`` that need no format (run first)."""
        if not isinstance(self.use_constant_amax, bool):
            raise ValueError(f"use_constant_amax={self.use_constant_amax!r} must be True or False")
        value = self.constant_amax
        if value is not None:
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(
                    f"constant_amax must be a positive value (a finite number > 0), got {value!r}"
                )
            if self.use_constant_amax:
                raise ValueError(
                    "use_constant_amax and constant_amax are mutually exclusive (448 or the given value); "
                    "set only one"
                )

    def _check_pinned_amax(self, spec: FormatSpec) -> None:
        value = self.constant_amax
        if self.pinned_amax is not None and self.enable:
            which = "constant_amax" if value is not None else "use_constant_amax"
            if not _pinnable(spec):
                raise ValueError(
                    f"{which}: {spec.name} {spec.granularity} has no single per-tensor amax to pin "
                    "(allowed: INT / FP8 per tensor, NVFP4 with dynamic blocks)"
                )
            if self.learn_amax:
                raise ValueError(f"{which} and learn_amax=True: a pinned amax is not learned; set only one")

    def rotation(self) -> dict[str, Any] | None:
        """The rotation settings (``enable``, ``mode``, ``rotate_fp32``, ``block_size``) when ``rotate`` is
        on, else ``None``."""
        rotate = self.rotate
        if isinstance(rotate, bool):
            return {**_ROTATE_KEYS, "enable": True} if rotate else None
        if not isinstance(rotate, Mapping) or set(rotate) - set(_ROTATE_KEYS):
            raise ValueError(f"rotate={rotate!r}: True, False or a dict with keys {sorted(_ROTATE_KEYS)}")
        settings = {**_ROTATE_KEYS, **rotate}
        if settings["mode"] not in ("rotate", "rotate_back"):
            raise ValueError(f"rotate mode={settings['mode']!r} (allowed: 'rotate', 'rotate_back')")
        block = settings["block_size"]
        if block is not None and (
            isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1)
        ):
            raise ValueError(
                f"rotate block_size={block!r} must be a power of two (or None: the whole dimension)"
            )
        return settings if settings["enable"] else None

    def spec(self) -> FormatSpec:
        self._check_pinned_value()
        spec = resolve_format(
            self.num_bits, self.axis, self.block_sizes, self.unsigned, self.narrow_range, self.type
        )
        self.rotation()
        calibrator_constructor(self.calibrator)
        self._check_pinned_amax(spec)
        if self.bias is not None:
            bias_settings(self.bias)
        if self.learn_amax is not False:
            if self.learn_amax is not True:
                raise ValueError(f"learn_amax={self.learn_amax!r} must be True or False")
            reason = learnable_amax_error(spec)
            if reason is not None and self.enable:
                raise ValueError(f"learn_amax=True: {reason}")
        return spec
