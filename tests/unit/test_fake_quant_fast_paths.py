"""The fewer-pass FP8 / minifloat rounding (``minifloat_round`` builds its step from the exponent field,
``fp8_apply`` leaves the saturation to it) against independent expectations, bit for bit: signed zeros,
saturation, inf and NaN included (``torch.equal`` alone would let ``-0.0`` pass as ``0.0``)."""

import pytest
import torch

from modelopt_lite.formats import fp8_fake_quant
from modelopt_lite.formats.fp8 import FP8_FORMATS
from modelopt_lite.formats.rounding import MINIFLOATS, minifloat_round


def _float32_sweep() -> torch.Tensor:
    """Every 1009th float32 bit pattern, both signs (zeros, subnormals, normals, inf and NaN), and every
    float32 from 2**-12 to 2**10 whose low 16 mantissa bits are zero (the E4M3 / E5M2 / FP6 / FP4 grid
    points, the ties between them and their neighbours), both signs."""
    bits = torch.arange(-(2**31), 2**31, 1009, dtype=torch.int64).to(torch.int32)
    lo, hi = (int(torch.tensor(v).view(torch.int32)) for v in (2.0**-12, 2.0**10))
    dense = torch.arange(lo, hi, 1 << 16, dtype=torch.int32).view(torch.float32)
    extra = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 448.0, -448.0, 57344.0, 1e-45])
    return torch.cat([bits.view(torch.float32), dense, -dense, extra])


def _same_bits(out: torch.Tensor, expect: torch.Tensor) -> None:
    nan = expect.isnan()
    assert torch.equal(out.isnan(), nan), "NaN in different places"
    diff = out[~nan].view(torch.int32) != expect[~nan].view(torch.int32)
    assert not bool(diff.any()), f"{int(diff.sum())} values differ in their bits, e.g. {out[~nan][diff][:4]}"


@pytest.mark.parametrize("num_bits", [(4, 3), (5, 2)])
@pytest.mark.parametrize("amax", [448.0, 3.0, 1e-3])
def test_fp8_fake_quant_equals_the_cast_bit_for_bit(num_bits, amax):
    spec, dtype = FP8_FORMATS[num_bits]
    x = _float32_sweep()
    amax_t = torch.tensor(amax)
    scale = torch.reciprocal(amax_t) * spec.max_value
    expect = (x * scale).clamp(-spec.max_value, spec.max_value).to(dtype).float() * torch.reciprocal(scale)
    _same_bits(fp8_fake_quant(x, amax_t, num_bits), expect)


def _plain_minifloat(a: torch.Tensor, spec, signed: bool) -> torch.Tensor:
    """Written from the definition: exponent from frexp, spacing 2**(max(e, min_exp) - man_bits), half to
    even, saturated (NaN stays NaN)."""
    a64 = a.double()
    _, e = torch.frexp(a64.abs())
    e = torch.where(a64 == 0, torch.zeros_like(e), e - 1).clamp(min=spec.min_exp)
    step = torch.pow(2.0, (e - spec.man_bits).double())
    r = torch.round(a64 / step) * step
    r = torch.where(torch.isinf(a64), a64, r)
    lo = -spec.max_value if signed else None
    return r.clamp(lo, spec.max_value).float()


@pytest.mark.parametrize("key", sorted(MINIFLOATS))
@pytest.mark.parametrize("signed", [True, False])
def test_minifloat_round_against_its_definition(key, signed):
    spec = MINIFLOATS[key]
    a = _float32_sweep()
    a = a if signed else a.abs()
    _same_bits(minifloat_round(a.clone(), spec, signed=signed), _plain_minifloat(a, spec, signed))
