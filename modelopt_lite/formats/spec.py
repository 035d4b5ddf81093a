"""A validated description of one quantization format and granularity, built from the attributes users
write in configs (``num_bits``, ``axis``, ``block_sizes``, ``unsigned``, ``narrow_range``).

Recognised combinations (anything else raises, naming the attribute and the allowed values):

=====================  ==============================================  =====================================
format                 num_bits / block_sizes                          amax
=====================  ==============================================  =====================================
INT-k                  ``k`` in 2..16; no blocks, ``axis`` None or int   calibrated, per tensor / per channel
INT-k per block        ``k``; ``{-1: 128}`` (``type`` static)            calibrated, ``(num_blocks, 1)``;
                       or over two axes ``{-1: 128, -2: 128}``          over two axes the reference's shape
                                                                        (``BlockLayout.amax_shape``)
INT-k / FP8 dynamic    ``{-1: None, "type": "dynamic"}`` (per token)     from the input, per block
INT-k / FP8 dynamic    ``type="dynamic"``, ``axis`` None or int / tuple   from the input, per tensor / per
                       (no blocks)                                      ``axis`` (reduced over the others)
FP8                    ``(4, 3)`` E4M3, ``(5, 2)`` E5M2; 1-D / 2-D blocks  like INT
NVFP4                  ``(2, 1)``; ``{-1: 16, "type": "dynamic",          calibrated global amax (per tensor)
                       "scale_bits": (4, 3)}``
NVFP4 static scales    ``(2, 1)``; ``{-1: 16, "type": "static",           calibrated, ``(num_blocks, 1)``, and
                       "scale_bits": (4, 3)}``, optionally                the global amax (``global_amax``)
                       ``"four_over_six": True``
MX (MXFP8/6/4, MXINT8) ``(4, 3)``, ``(5, 2)``, ``(3, 2)``, ``(2, 3)``,      none (E8M0 scale per block)
                       ``(2, 1)``, ``8``; ``{-1: 32, "type": "dynamic",
                       "scale_bits": (8, 0)}``
=====================  ==============================================  =====================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .fp8 import FP8_FORMATS
from .integer import validate_int_bits
from .mx import MX_ELEMENTS
from .nvfp4 import FP8_MAX, FP8_MAX_FOUR_OVER_SIX

__all__ = ["FormatSpec", "resolve_format"]

Kind = Literal["int", "fp8", "nvfp4", "mx"]
_BLOCK_META_KEYS = ("type", "scale_bits", "scale_block_sizes", "four_over_six")
_MX_NAMES = {(4, 3): "mxfp8", (5, 2): "mxfp8_e5m2", (3, 2): "mxfp6_e3m2", (2, 3): "mxfp6_e2m3"}
_MX_NAMES.update({(2, 1): "mxfp4", 8: "mxint8"})


_FP4_HINT = (
    ". (The reference accepts FP4 E2M1 without scale_bits in a config and then raises NotImplementedError "
    "'Only support E=4 & M=3' at its first forward: FP4 needs the block scales of NVFP4, block_sizes="
    "{-1: 16, 'type': 'dynamic', 'scale_bits': (4, 3)}, or MXFP4, {-1: 32, 'type': 'dynamic', "
    "'scale_bits': (8, 0)})"
)


def _as_bits(num_bits: Any) -> int | tuple[int, int]:
    if isinstance(num_bits, (list, tuple)):
        if len(num_bits) != 2 or not all(isinstance(b, int) for b in num_bits):
            raise ValueError(
                f"num_bits={num_bits!r}: a float format is an (exponent, mantissa) pair such as (4, 3)"
            )
        return (int(num_bits[0]), int(num_bits[1]))
    if isinstance(num_bits, bool) or not isinstance(num_bits, int):
        raise ValueError(f"num_bits={num_bits!r}: expected an int 2..16 or an (exp, man) pair")
    return num_bits


@dataclass(frozen=True)
class FormatSpec:
    """What to compute; see the module docstring for the combinations."""

    kind: Kind
    num_bits: int | tuple[int, int]
    axis: int | tuple[int, ...] | None = None
    block_axes: tuple[tuple[int, int | None], ...] = ()  # ((axis, size), ...)
    dynamic: bool = False
    unsigned: bool = False
    narrow_range: bool = False
    four_over_six: bool = False  # static NVFP4: FP8 block scales normalized to 256 instead of 448

    @property
    def static_nvfp4(self) -> bool:
        """NVFP4 with a calibrated amax per block (and a global amax), not one taken from each block."""
        return self.kind == "nvfp4" and not self.dynamic

    @property
    def nvfp4_fp8_max(self) -> float:
        """The FP8 value static NVFP4 maps ``global_amax / 6`` to: 256 with four-over-six, else 448."""
        return FP8_MAX_FOUR_OVER_SIX if self.four_over_six else FP8_MAX

    @property
    def block_sizes(self) -> dict[int, int | None]:
        return dict(self.block_axes)

    @property
    def needs_amax(self) -> bool:
        """Whether a calibrated amax must be present before the quantizer can run."""
        if self.kind == "mx":
            return False
        if self.kind == "nvfp4":
            return True
        return not self.dynamic

    @property
    def name(self) -> str:
        if self.kind == "int":
            return f"{'u' if self.unsigned else ''}int{self.num_bits}"
        if self.kind == "fp8":
            return "fp8_e4m3" if self.num_bits == (4, 3) else "fp8_e5m2"
        if self.kind == "nvfp4":
            return "nvfp4"
        return _MX_NAMES[self.num_bits]

    @property
    def granularity(self) -> str:
        if self.static_nvfp4:
            return f"block{self.block_axes[0][1]} static{' four-over-six' if self.four_over_six else ''}"
        if self.kind in ("nvfp4", "mx"):
            return f"block{self.block_axes[0][1]}"
        if self.block_axes:
            if len(self.block_axes) == 1 and self.block_axes[0][1] is None:
                return f"per-token(axis={self.block_axes[0][0]}) dynamic"
            blocks = ",".join(f"{a}:{s}" for a, s in self.block_axes)
            return f"per-block({blocks}) {'dynamic' if self.dynamic else 'static'}"
        suffix = " dynamic" if self.dynamic else ""
        if self.axis is None:
            return f"per-tensor{suffix}"
        return f"per-channel(axis={self.axis}){suffix}"


def _check_block_sizes(block_sizes: Mapping[Any, Any]) -> tuple[dict[int, int | None], dict]:
    axes: dict[int, int | None] = {}
    meta: dict[str, Any] = {}
    for key, value in block_sizes.items():
        if key in _BLOCK_META_KEYS:
            meta[key] = value
            continue
        if isinstance(key, bool) or not isinstance(key, int):
            raise ValueError(
                f"block_sizes key {key!r} is neither an axis (int) nor one of {_BLOCK_META_KEYS}"
            )
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(
                f"block_sizes[{key}]={value!r} must be a positive int (or None for the whole axis)"
            )
        axes[key] = value
    if not 1 <= len(axes) <= 2:
        raise ValueError(f"block_sizes={dict(block_sizes)!r} must name one or two axes")
    block_type = meta.get("type", "static")
    if block_type not in ("static", "dynamic"):
        raise ValueError(f"block_sizes['type']={block_type!r} (allowed: 'static', 'dynamic')")
    if not isinstance(meta.get("four_over_six", False), (bool, int)):
        raise ValueError(f"block_sizes['four_over_six']={meta['four_over_six']!r} must be True or False")
    if meta.get("scale_block_sizes"):
        raise ValueError("block_sizes['scale_block_sizes'] (double quantization) is not supported")
    return axes, meta


def resolve_format(
    num_bits: Any = 8,
    axis: int | tuple[int, ...] | None = None,
    block_sizes: Mapping[Any, Any] | None = None,
    unsigned: bool = False,
    narrow_range: bool = False,
    quant_type: str = "static",
) -> FormatSpec:
    """Validate quantizer attributes and return the :class:`FormatSpec` they describe.
    ``quant_type="dynamic"`` (the attribute ``type``) takes the amax from each input: per tensor, per
    ``axis`` (reduced over the other axes, as a static amax is) or per block (``block_sizes``, whose own
    ``"type"`` key wins when given)."""
    if quant_type not in ("static", "dynamic"):
        raise ValueError(f"type={quant_type!r} (allowed: 'static', 'dynamic')")
    bits = _as_bits(num_bits)
    if axis is not None and block_sizes:
        raise ValueError(
            f"axis={axis!r} and block_sizes={dict(block_sizes)!r} are exclusive (axis must be None when "
            "block_sizes is not None): set axis for per-channel, block_sizes for per-block quantization"
        )
    if axis is not None and not isinstance(axis, int):
        if not (isinstance(axis, (list, tuple)) and all(isinstance(a, int) for a in axis)):
            raise ValueError(f"axis={axis!r} must be None, an int or a tuple of ints")
        axis = tuple(axis)
    if not block_sizes:
        dynamic = quant_type == "dynamic"
        if isinstance(bits, int):
            validate_int_bits(bits)
            return FormatSpec("int", bits, axis, (), dynamic, unsigned=unsigned, narrow_range=narrow_range)
        if bits in FP8_FORMATS:
            _reject_int_flags(unsigned, narrow_range, bits)
            return FormatSpec("fp8", bits, axis, (), dynamic)
        raise ValueError(
            f"num_bits={num_bits!r} without block_sizes: allowed 2..16 (INT), (4, 3) or (5, 2) (FP8); "
            "NVFP4 and MX formats need block_sizes with scale_bits" + _FP4_HINT * (bits == (2, 1))
        )
    axes, meta = _check_block_sizes(block_sizes)
    dynamic = meta.get("type", quant_type) == "dynamic"
    scale_bits = meta.get("scale_bits")
    scale_bits = tuple(scale_bits) if isinstance(scale_bits, (list, tuple)) else scale_bits
    block_axes = tuple(sorted(axes.items()))
    four_over_six = bool(meta.get("four_over_six", False))
    if four_over_six and (scale_bits != (4, 3) or dynamic):
        raise ValueError(
            "block_sizes['four_over_six'] applies to static NVFP4 only: num_bits=(2, 1), block_sizes "
            f"{{-1: 16, 'type': 'static', 'scale_bits': (4, 3)}}; got block_sizes={dict(block_sizes)!r}"
        )
    if scale_bits is None:
        if isinstance(bits, int):
            validate_int_bits(bits)
            return FormatSpec(
                "int", bits, None, block_axes, dynamic, unsigned=unsigned, narrow_range=narrow_range
            )
        if bits in FP8_FORMATS:
            _reject_int_flags(unsigned, narrow_range, bits)
            return FormatSpec("fp8", bits, None, block_axes, dynamic)
        raise ValueError(
            f"num_bits={num_bits!r} with block_sizes but no scale_bits: allowed 2..16, (4, 3), (5, 2); "
            "add block_sizes['scale_bits'] = (4, 3) for NVFP4 or (8, 0) for MX formats"
            + _FP4_HINT
            * (bits == (2, 1))
        )
    _reject_int_flags(unsigned, narrow_range, bits)
    last_axis_only = list(axes) == [-1]
    if scale_bits == (4, 3):
        if bits != (2, 1) or not last_axis_only:
            raise ValueError(
                f"scale_bits=(4, 3) is NVFP4 and needs num_bits=(2, 1) and block_sizes "
                f"{{-1: 16, 'type': 'dynamic' or 'static'}}; got num_bits={num_bits!r}, "
                f"block_sizes={dict(block_sizes)!r}"
            )
        return FormatSpec("nvfp4", bits, None, block_axes, dynamic, four_over_six=four_over_six)
    if scale_bits == (8, 0):
        if bits not in MX_ELEMENTS or not last_axis_only or not dynamic:
            raise ValueError(
                f"scale_bits=(8, 0) is an MX format and needs num_bits in {list(MX_ELEMENTS)} and "
                f"block_sizes {{-1: 32, 'type': 'dynamic'}}; got num_bits={num_bits!r}, "
                f"block_sizes={dict(block_sizes)!r}"
            )
        return FormatSpec("mx", bits, None, block_axes, True)
    raise ValueError(
        f"block_sizes['scale_bits']={scale_bits!r} (allowed: (4, 3) NVFP4, (8, 0) MX, or absent)"
    )


def _reject_int_flags(unsigned: bool, narrow_range: bool, bits: Any) -> None:
    if unsigned or narrow_range:
        raise ValueError(f"unsigned / narrow_range apply to integer formats only, not num_bits={bits!r}")
