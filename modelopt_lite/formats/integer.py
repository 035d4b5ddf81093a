"""Integer fake quantization (INT-k, k = 2..8), NUMERICS.md "Integer, k bits"."""

from __future__ import annotations

import torch

from .rounding import TINY_AMAX

__all__ = ["int_bounds", "int_fake_quant", "validate_int_bits"]


def validate_int_bits(num_bits: object) -> int:
    if isinstance(num_bits, bool) or not isinstance(num_bits, int) or not 2 <= num_bits <= 8:
        raise ValueError(f"num_bits={num_bits!r} is not a supported integer width (allowed: 2..8)")
    return num_bits


def int_bounds(num_bits: int, unsigned: bool = False, narrow_range: bool = False) -> tuple[int, int]:
    """``(min_bound, max_bound)`` of the integer grid."""
    validate_int_bits(num_bits)
    if unsigned:
        return 0, 2**num_bits - 1
    max_bound = 2 ** (num_bits - 1) - 1
    return (-max_bound if narrow_range else -max_bound - 1), max_bound


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
    min_bound, max_bound = int_bounds(num_bits, unsigned, narrow_range)
    xf = x.float()
    if unsigned and bool((xf < 0).any()):
        raise ValueError(
            "unsigned=True quantizer received negative input; use unsigned=False for signed data"
        )
    amax = amax.to(device=xf.device, dtype=torch.float32)
    tiny = amax <= TINY_AMAX
    any_tiny = bool(tiny.any())
    if any_tiny:
        amax = amax.masked_fill(tiny, 1.0)
    scale = torch.full((), float(max_bound), device=xf.device) / amax
    out = torch.mul(xf, scale).round_().clamp_(min_bound, max_bound).div_(scale)
    if any_tiny:
        out.masked_fill_(tiny, 0.0)
    return out.to(x.dtype)
