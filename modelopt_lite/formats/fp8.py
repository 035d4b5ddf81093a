"""FP8 fake quantization (E4M3 and E5M2), NUMERICS.md "FP8 E4M3"."""

from __future__ import annotations

import torch

from .rounding import E4M3, E5M2, TINY_AMAX, MinifloatSpec

__all__ = ["FP8_FORMATS", "fp8_fake_quant", "fp8_spec"]

FP8_FORMATS: dict[tuple[int, int], tuple[MinifloatSpec, torch.dtype]] = {
    (4, 3): (E4M3, torch.float8_e4m3fn),
    (5, 2): (E5M2, torch.float8_e5m2),
}


def fp8_spec(num_bits: tuple[int, int]) -> tuple[MinifloatSpec, torch.dtype]:
    try:
        return FP8_FORMATS[tuple(num_bits)]
    except (KeyError, TypeError):
        raise ValueError(
            f"num_bits={num_bits!r} is not an FP8 format (allowed: (4, 3) for E4M3, (5, 2) for E5M2)"
        ) from None


def fp8_fake_quant(x: torch.Tensor, amax: torch.Tensor, num_bits: tuple[int, int] = (4, 3)) -> torch.Tensor:
    """Scale ``x`` so that ``amax`` maps to the FP8 maximum, round to FP8 and scale back.

    ``scale = fp8_max / amax`` is computed as ``reciprocal(amax) * fp8_max`` (the reference behaviour), the
    scaled value is clamped to the FP8 range and cast with round-to-nearest-even, and the result is
    multiplied by ``reciprocal(scale)``. An amax at or below 2**-24 is replaced by 1.0.
    """
    spec, dtype = fp8_spec(num_bits)
    xf = x.float()
    amax = amax.to(device=xf.device, dtype=torch.float32)
    amax = torch.where(amax <= TINY_AMAX, torch.ones_like(amax), amax)
    scale = torch.reciprocal(amax).mul_(spec.max_value)
    y = torch.mul(xf, scale).clamp_(-spec.max_value, spec.max_value).to(dtype).float()
    return y.mul_(torch.reciprocal(scale)).to(x.dtype)
