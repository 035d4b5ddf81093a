"""Rounding primitives shared by the formats (float32 in, float32 out, round-half-to-even everywhere)."""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_BOUNDARIES",
    "E2M1_VALUES",
    "TINY_AMAX",
    "MinifloatSpec",
    "e2m1_round",
    "minifloat_round",
    "true_div",
]

#: amax at or below this is treated as "no signal" (docs/numerics.md: 2**-24).
TINY_AMAX = 2.0**-24


class MinifloatSpec:
    """An IEEE-like element format without inf / NaN encodings, saturating at ``max_value``."""

    __slots__ = ("emax", "exp_bits", "man_bits", "max_value", "min_exp", "name")

    def __init__(self, name: str, exp_bits: int, man_bits: int, max_value: float, emax: int):
        self.name = name
        self.exp_bits = exp_bits
        self.man_bits = man_bits
        self.max_value = max_value
        self.emax = emax  # exponent of the largest normal value
        self.min_exp = 2 - 2 ** (exp_bits - 1)  # exponent of the smallest normal value (1 - bias)

    def __repr__(self) -> str:
        return f"MinifloatSpec({self.name})"


E4M3 = MinifloatSpec("e4m3", 4, 3, 448.0, 8)
E5M2 = MinifloatSpec("e5m2", 5, 2, 57344.0, 15)
E3M2 = MinifloatSpec("e3m2", 3, 2, 28.0, 4)
E2M3 = MinifloatSpec("e2m3", 2, 3, 7.5, 2)
E2M1 = MinifloatSpec("e2m1", 2, 1, 6.0, 2)
MINIFLOATS = {(4, 3): E4M3, (5, 2): E5M2, (3, 2): E3M2, (2, 3): E2M3, (2, 1): E2M1}


def true_div(num: torch.Tensor, den: float) -> torch.Tensor:
    """``num / den`` as an IEEE division even on CUDA.

    PyTorch turns a division by a Python scalar into a multiplication by its reciprocal on some devices,
    which differs by one ulp on part of the outputs; a same-device tensor divisor keeps the true division.
    """
    return num / torch.full((), den, dtype=num.dtype, device=num.device)


def minifloat_round(
    a: torch.Tensor, spec: MinifloatSpec, out: torch.Tensor | None = None, signed: bool = False
) -> torch.Tensor:
    """Round float32 ``a`` to the nearest value of ``spec`` (ties to even), saturating at its maximum.

    ``a`` must be non-negative unless ``signed=True``. The spacing of representable values around ``|a|``
    is ``2**(max(floor(log2 |a|), min_exp) - man_bits)``; dividing by that power of two is exact, so
    ``torch.round`` (half to even) does the rounding. ``out`` may be ``a`` itself.

    The spacing is built on the bit patterns in three passes: ``a``'s biased exponent field (the sign bit
    masked off, so no ``abs`` pass), raised to ``min_exp``'s, minus ``man_bits`` in the exponent field.
    """
    exp_field = torch.bitwise_and(a.view(torch.int32), 0x7F800000)
    step = exp_field.clamp_(min=(spec.min_exp + 127) << 23).sub_(spec.man_bits << 23).view(torch.float32)
    res = torch.div(a, step, out=out).round_().mul_(step)
    return res.clamp_(-spec.max_value, spec.max_value) if signed else res.clamp_(max=spec.max_value)


#: E2M1 magnitudes and the decision boundaries between neighbours (docs/numerics.md). A value equal to a
#: boundary goes to the neighbour with the even mantissa:
#: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
#: ``bucketize(right=False)`` sends a value equal to a boundary to the lower bucket, so the
#: boundaries whose tie goes up are moved one ulp down.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_TIE_UP = {0.75, 1.75, 3.5}
E2M1_BOUNDARIES = tuple(
    float(torch.nextafter(torch.tensor(b), torch.tensor(0.0))) if b in _TIE_UP else b
    for b in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
)
_E2M1_CACHE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def e2m1_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tables = _E2M1_CACHE.get(device)
    if tables is None:
        tables = (
            torch.tensor(E2M1_BOUNDARIES, dtype=torch.float32, device=device),
            torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device),
        )
        _E2M1_CACHE[device] = tables
    return tables


def e2m1_index(a: torch.Tensor) -> torch.Tensor:
    """Index into :data:`E2M1_VALUES` of the rounded non-negative float32 ``a`` (int64)."""
    boundaries, _ = e2m1_tables(a.device)
    return torch.bucketize(a.contiguous(), boundaries)  # (it copies a strided input anyway, with a warning)


def e2m1_round(a: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Round non-negative float32 ``a`` to an E2M1 magnitude with the thresholds of docs/numerics.md.

    Those thresholds are round-to-nearest with ties to the even mantissa, i.e. :func:`minifloat_round`
    for E2M1 (several times faster than a table look-up; the tests check the two agree). ``out`` may be
    ``a`` itself.

    Computed in fewer passes than :func:`minifloat_round`: ``a`` is saturated at 6 first, then adding and
    subtracting ``M = 1.5 * 2**23 * spacing`` (``spacing``: the distance between the E2M1 values around
    ``a``, 0.5, 1 or 2, a power of two read from ``a``'s exponent) rounds it, as the float32 sum ``a + M``
    has exactly that spacing and rounds half to even; ``M`` is built from ``a``'s exponent bits.
    """
    x = torch.clamp(a, max=E2M1.max_value, out=out)
    spacing_exp = torch.bitwise_and(x.view(torch.int32), 0x7F800000).clamp_(min=127 << 23)  # >= 2**0
    # 1.5 * 2**(23 + e - man_bits) for 2**e <= x < 2**(e + 1): exponent bits + 22, top mantissa bit set
    magic = spacing_exp.add_(((23 - E2M1.man_bits) << 23) | (1 << 22)).view(torch.float32)
    return x.add_(magic).sub_(magic)
