"""Property tests (hypothesis): idempotence, half-step error bound, odd symmetry, dtype / shape kept."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modelopt_lite.formats import (
    fake_quant_reference,
    fp8_fake_quant,
    int_fake_quant,
    nvfp4_fake_quant,
    resolve_format,
)

SPECS = {
    "int8": (resolve_format(8), True),
    "int4_channel": (resolve_format(4, axis=0), True),
    "int4_block": (resolve_format(4, block_sizes={-1: 16}), True),
    "fp8": (resolve_format((4, 3)), True),
    "fp8_e5m2": (resolve_format((5, 2)), True),
    # per token with the amax of x held (a dynamic amax recomputed from q(x) can move by an ulp)
    "fp8_token": (resolve_format((4, 3), block_sizes={-1: None}), True),
    "nvfp4": (resolve_format((2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}), True),
    "mxfp8": (resolve_format((4, 3), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)}), False),
    "mxfp4": (resolve_format((2, 1), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)}), False),
    "mxint8": (resolve_format(8, block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)}), False),
}

tensors = st.builds(
    lambda seed, rows, scale: torch.randn(rows, 32, generator=torch.Generator().manual_seed(seed)) * scale,
    st.integers(0, 2**31 - 1),
    st.integers(1, 6),
    st.sampled_from([1e-3, 1.0, 37.0, 1e4]),
)


def _amax(x, spec):
    from modelopt_lite.formats import reduce_amax

    return reduce_amax(x, spec)


@pytest.mark.parametrize("name", sorted(SPECS))
@settings(max_examples=40, deadline=None)
@given(x=tensors)
def test_idempotent_symmetric_shape_dtype(name, x):
    spec, static = SPECS[name]
    amax = _amax(x, spec) if static else None
    q = fake_quant_reference(x, spec, amax)
    assert q.shape == x.shape
    assert q.dtype == x.dtype
    assert torch.equal(fake_quant_reference(q, spec, amax), q), "q(q(x)) != q(x)"
    assert torch.equal(fake_quant_reference(-x, spec, amax), -q), "q(-x) != -q(x)"
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        out = fake_quant_reference(xd, spec, amax)
        assert out.dtype == dtype
        assert out.shape == x.shape


@settings(max_examples=60, deadline=None)
@given(x=tensors, num_bits=st.integers(2, 8), frac=st.floats(0.3, 1.0))
def test_int_error_within_half_step(x, num_bits, frac):
    amax = x.abs().amax() * frac
    step = amax / (2 ** (num_bits - 1) - 1)
    q = int_fake_quant(x, amax, num_bits)
    inside = x.abs() <= amax
    err = (q - x).abs()[inside]
    assert bool((err <= step / 2 * (1 + 1e-5)).all())


@settings(max_examples=60, deadline=None)
@given(x=tensors)
def test_fp8_error_within_half_ulp(x):
    amax = x.abs().amax()
    q = fp8_fake_quant(x, amax)
    scale = 448.0 / amax
    y = (x * scale).abs()
    # E4M3 spacing at y: 2**(max(floor(log2 y), -6) - 3)
    exp = torch.floor(torch.log2(y.clamp_min(2.0**-9))).clamp_min(-6)
    half_step = 2.0 ** (exp - 3) / 2 / scale
    assert bool(((q - x).abs() <= half_step * (1 + 1e-5) + 1e-30).all())


@settings(max_examples=60, deadline=None)
@given(x=tensors)
def test_nvfp4_error_within_half_step(x):
    q = nvfp4_fake_quant(x)
    blocks, qb = x.reshape(-1, 16), q.reshape(-1, 16)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    unit = amax / 6  # the block maps its amax to about 6: E2M1 steps are 0.5, 1, 2 units
    rel = blocks.abs() / unit
    step = torch.where(rel < 2, 0.5, torch.where(rel < 4, 1.0, 2.0)) * unit
    # the FP8 block scale rounds amax / 6 by up to 1/16 relative: allow for it
    assert bool(((qb - blocks).abs() <= step / 2 * 1.07 + 1e-30).all())
