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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..formats import FormatSpec, learnable_amax_error, resolve_format
from .calibrators import bias_settings

__all__ = ["QuantizerAttributes"]

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
    calibrator: str = "max"
    calibrator_options: dict[str, Any] = field(default_factory=dict)
    learn_amax: bool = False
    type: Literal["static", "dynamic"] = "static"  # dynamic: amax taken from each input (axis / blocks)
    bias: dict[Any, Any] | None = None  # affine quantization (see the module docstring)
    rotate: bool | dict[str, Any] = False  # Hadamard rotation of the input (see the module docstring)

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
        spec = resolve_format(
            self.num_bits, self.axis, self.block_sizes, self.unsigned, self.narrow_range, self.type
        )
        self.rotation()
        if self.bias is not None:
            bias_settings(self.bias)
        if self.learn_amax is not False:
            if self.learn_amax is not True:
                raise ValueError(f"learn_amax={self.learn_amax!r} must be True or False")
            reason = learnable_amax_error(spec)
            if reason is not None and self.enable:
                raise ValueError(f"learn_amax=True: {reason}")
        return spec
