"""FP8 fake quantization (E4M3 and E5M2), docs/numerics.md "FP8 (E4M3, E5M2)"."""

from __future__ import annotations

import torch

from .rounding import E4M3, E5M2, TINY_AMAX, MinifloatSpec, minifloat_round

__all__ = ["FP8_FORMATS", "fp8_apply", "fp8_fake_quant", "fp8_scales", "fp8_spec"]

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


def fp8_scales(amax: torch.Tensor, spec: MinifloatSpec, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, 1 / scale)``: ``scale = reciprocal(amax) * fp8_max``, amax <= 2**-24 replaced by 1."""
    amax = amax.to(device=device, dtype=torch.float32)
    amax = torch.where(amax <= TINY_AMAX, torch.ones_like(amax), amax)
    scale = torch.reciprocal(amax).mul_(spec.max_value)
    return scale, torch.reciprocal(scale)


def fp8_apply(
    x: torch.Tensor,
    scale: torch.Tensor,
    inv_scale: torch.Tensor,
    spec: MinifloatSpec,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fp8(clamp(x * scale)) * inv_scale`` in float32 (into ``out`` when given).

    The FP8 rounding is done arithmetically (:func:`minifloat_round`), which equals the
    ``float8_e4m3fn`` / ``float8_e5m2`` cast on clamped values bit for bit (tested) and keeps every step
    in float32 vector arithmetic. The clamp is the one :func:`minifloat_round` ends with: rounding is
    monotonic and the FP8 maximum is on the grid, so a value beyond it rounds to the maximum or further and
    is clamped to the maximum, as when clamped first (one pass fewer; tested bit for bit).
    """
    y = torch.mul(x.float(), scale, out=out)
    return minifloat_round(y, spec, out=y, signed=True).mul_(inv_scale)


def fp8_fake_quant(x: torch.Tensor, amax: torch.Tensor, num_bits: tuple[int, int] = (4, 3)) -> torch.Tensor:
    """Scale ``x`` so that ``amax`` maps to the FP8 maximum, round to FP8 and scale back.

    ``scale = fp8_max / amax`` is computed as ``reciprocal(amax) * fp8_max`` (the reference behaviour), the
    scaled value is clamped to the FP8 range and rounded to nearest even FP8, and the result is
    multiplied by ``reciprocal(scale)``. An amax at or below 2**-24 is replaced by 1.0.
    """
    spec, _ = fp8_spec(num_bits)
    scale, inv_scale = fp8_scales(amax, spec, x.device)
    return fp8_apply(x, scale, inv_scale, spec).to(x.dtype)
