"""Integer fake quantization (INT-k, k = 2..16), docs/numerics.md "Integer, k bits"."""

from __future__ import annotations

import torch

from .rounding import TINY_AMAX

__all__ = [
    "INT_BITS",
    "UnsignedNegativeInputError",
    "check_unsigned",
    "int_apply",
    "int_bounds",
    "int_fake_quant",
    "int_scale_keep",
    "validate_int_bits",
]


#: The integer widths fake quantization computes exactly (in float32 every grid point up to 2**15 is exact).
#: Checkpoints store 4 and 8 bits; other widths are for fake quant and research.
INT_BITS = range(2, 17)


def validate_int_bits(num_bits: object) -> int:
    if isinstance(num_bits, bool) or not isinstance(num_bits, int) or num_bits not in INT_BITS:
        raise ValueError(
            f"num_bits={num_bits!r} is not a supported integer width (allowed: "
            f"{INT_BITS.start}..{INT_BITS.stop - 1})"
        )
    return num_bits


def int_bounds(num_bits: int, unsigned: bool = False, narrow_range: bool = False) -> tuple[int, int]:
    """``(min_bound, max_bound)`` of the integer grid."""
    validate_int_bits(num_bits)
    if unsigned:
        return 0, 2**num_bits - 1
    max_bound = 2 ** (num_bits - 1) - 1
    return (-max_bound if narrow_range else -max_bound - 1), max_bound


def int_scale_keep(
    amax: torch.Tensor, max_bound: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(scale, keep)`` for :func:`int_apply`: ``scale = max_bound / amax`` as a true division, and a
    0 / 1 mask of the amax values above 2**-24 (``None`` when all are)."""
    amax = amax.to(device=device, dtype=torch.float32)
    tiny = amax <= TINY_AMAX
    keep = None
    if bool(tiny.any()):
        keep = (~tiny).float()
        amax = amax.masked_fill(tiny, 1.0)
    return torch.full((), float(max_bound), device=amax.device) / amax, keep


def int_apply(
    x: torch.Tensor,
    scale: torch.Tensor,
    keep: torch.Tensor | None,
    bounds: tuple[int, int],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``clamp(round_half_even(x * scale), *bounds) / scale`` in float32 (into ``out`` when given)."""
    res = torch.mul(x.float(), scale, out=out).round_().clamp_(*bounds).div_(scale)
    return res if keep is None else res.mul_(keep)


def int_fake_quant(
    x: torch.Tensor,
    amax: torch.Tensor,
    num_bits: int = 8,
    unsigned: bool = False,
    narrow_range: bool = False,
) -> torch.Tensor:
    """Quantize ``x`` to the ``num_bits`` integer grid scaled by ``amax`` and back, in ``x``'s dtype.

    ``amax`` broadcasts against ``x`` (a scalar for per-tensor, ``keepdim`` shape for per-channel, one
    value per block row for block-wise). ``scale = max_bound / amax`` is a true division; an amax at or
    below 2**-24 gives 0. A negative input to an unsigned quantizer raises.
    """
    bounds = int_bounds(num_bits, unsigned, narrow_range)
    check_unsigned(x, unsigned)
    scale, keep = int_scale_keep(amax, bounds[1], x.device)
    return int_apply(x, scale, keep, bounds).to(x.dtype)


class UnsignedNegativeInputError(ValueError, TypeError):
    """An ``unsigned=True`` integer quantizer was given negative values.

    A ``ValueError`` (a bad input value) and a ``TypeError`` (what the reference library raises here), so
    that ``except`` clauses written for either catch it."""


def check_unsigned(x: torch.Tensor, unsigned: bool, name: str = "") -> None:
    """Raise :class:`UnsignedNegativeInputError` if ``unsigned`` and ``x`` holds a negative value."""
    if unsigned and bool((x < 0).any()):
        where = f"{name}: " if name else ""
        raise UnsignedNegativeInputError(
            f"{where}Negative values encountered in the input of an unsigned=True quantizer (min "
            f"{x.min().item():g}); use unsigned=False for signed data, or make the input non-negative"
        )
