"""Every format, bit for bit (torch.equal) against the independent numpy expectations of _expect.py."""

import numpy as np
import pytest
import torch

from modelopt_lite.formats import (
    e2m1_round,
    fake_quant_reference,
    fp8_fake_quant,
    int_fake_quant,
    mx_fake_quant,
    nvfp4_fake_quant,
    resolve_format,
)

from . import _expect as E

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _data(shape, dtype=torch.float32, scale=3.0):
    x = torch.randn(*shape) * scale
    x[..., 0] = 0.0  # zeros everywhere in the data
    return x.to(dtype)


def _check(out, expect, dtype):
    exp_t = torch.from_numpy(np.ascontiguousarray(expect)).to(dtype)
    assert out.dtype == dtype
    assert torch.equal(out, exp_t), f"{(out.float() != exp_t.float()).sum()} mismatches"


@pytest.mark.parametrize("num_bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int_per_tensor_and_channel(num_bits, dtype):
    x = _data((16, 40), dtype)
    xf = x.float().numpy()
    amax_t = x.float().abs().amax() * 0.7  # part of the data exceeds amax: clamping exercised
    _check(int_fake_quant(x, amax_t, num_bits), E.int_expect(xf, amax_t.numpy(), num_bits), dtype)
    amax_c = x.float().abs().amax(dim=1, keepdim=True)
    _check(int_fake_quant(x, amax_c, num_bits), E.int_expect(xf, amax_c.numpy(), num_bits), dtype)


@pytest.mark.parametrize("num_bits", [4, 8])
def test_int_narrow_and_unsigned(num_bits):
    x = _data((8, 33))
    amax = x.abs().amax() * 0.5
    out = int_fake_quant(x, amax, num_bits, narrow_range=True)
    _check(out, E.int_expect(x.numpy(), amax.numpy(), num_bits, narrow=True), torch.float32)
    assert out.min() >= -(2 ** (num_bits - 1) - 1) * (amax / (2 ** (num_bits - 1) - 1)) - 1e-6
    xu = x.abs()
    out = int_fake_quant(xu, amax, num_bits, unsigned=True)
    _check(out, E.int_expect(xu.numpy(), amax.numpy(), num_bits, unsigned=True), torch.float32)


def test_int_scale_is_a_true_division():
    # With 127.0 / amax PyTorch multiplies by the reciprocal; docs/numerics.md requires the division.
    x = torch.randn(4096) * 2
    amax = torch.rand(4096) * 3 + 0.1
    out = int_fake_quant(x, amax, 8)
    _check(out, E.int_expect(x.numpy(), amax.numpy(), 8), torch.float32)
    recip_scale = 127.0 / amax
    recip = torch.clamp(torch.round(x * recip_scale), -128, 127) / recip_scale
    assert not torch.equal(out, recip), "the two scale computations must differ on this data"


def test_int_min_bound_only_reached_by_activations_beyond_amax():
    w = _data((64, 64))
    out = int_fake_quant(w, w.abs().amax(), 8)
    scale = 127 / w.abs().amax()
    assert torch.round(out * scale).min() >= -127
    a = torch.tensor([-5.0, 5.0])
    assert torch.equal(int_fake_quant(a, torch.tensor(1.0), 8), torch.tensor([-128 / 127, 1.0]))


@pytest.mark.parametrize("amax", [0.0, 2.0**-24, 2.0**-30])
def test_int_tiny_amax_gives_zero(amax):
    x = _data((4, 8))
    assert torch.equal(int_fake_quant(x, torch.tensor(amax), 8), torch.zeros_like(x))
    per_row = torch.tensor([[amax], [1.0], [amax], [2.0]])
    _check(int_fake_quant(x, per_row, 8), E.int_expect(x.numpy(), per_row.numpy(), 8), torch.float32)


@pytest.mark.parametrize("cols", [256, 200])  # 200: padded to 256
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_block_static_with_padding(cols, dtype):
    x = _data((6, cols), dtype)
    spec = resolve_format(4, block_sizes={-1: 128})
    blocks, padded = E.blocks_last_axis(x.float().numpy(), 128)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    expect = E.unblock(E.int_expect(blocks, amax, 4), tuple(x.shape), padded)
    out = fake_quant_reference(x, spec, torch.from_numpy(amax))
    _check(out, expect, dtype)


@pytest.mark.parametrize("fmt", [(8, "int"), ((4, 3), "fp8")])
def test_per_token_dynamic(fmt):
    num_bits, kind = fmt
    x = _data((2, 5, 48))
    spec = resolve_format(num_bits, block_sizes={-1: None, "type": "dynamic"})
    amax = x.abs().amax(dim=-1, keepdim=True).numpy()
    fn = E.int_expect if kind == "int" else E.fp8_expect
    _check(fake_quant_reference(x, spec), fn(x.numpy(), amax, num_bits), torch.float32)


@pytest.mark.parametrize("num_bits", [(4, 3), (5, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_per_tensor_and_channel(num_bits, dtype):
    x = _data((16, 64), dtype)
    xf = x.float().numpy()
    amax_t = x.float().abs().amax() * 0.8
    _check(fp8_fake_quant(x, amax_t, num_bits), E.fp8_expect(xf, amax_t.numpy(), num_bits), dtype)
    amax_c = x.float().abs().amax(dim=1, keepdim=True)
    _check(fp8_fake_quant(x, amax_c, num_bits), E.fp8_expect(xf, amax_c.numpy(), num_bits), dtype)


def test_fp8_ties_round_to_even_and_tiny_amax():
    # amax = 448 makes the scale exactly 1: inputs are rounded as they are.
    x = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 0.0009765625 * 1.5, 464.0, -464.0, 500.0])
    out = fp8_fake_quant(x, torch.tensor(448.0))
    assert torch.equal(out, torch.tensor([1.0, 1.25, 16.0, 20.0, 0.001953125, 448.0, -448.0, 448.0]))
    # amax <= 2**-24 is replaced by 1.0
    y = torch.tensor([0.3, -0.7])
    assert torch.equal(fp8_fake_quant(y, torch.tensor(0.0)), fp8_fake_quant(y, torch.tensor(1.0)))


@pytest.mark.parametrize("num_bits", [(4, 3), (5, 2)])
def test_fp8_2d_block(num_bits):
    x = _data((256, 384))
    spec = resolve_format(num_bits, block_sizes={-1: 128, -2: 128, "type": "dynamic"})
    out = fake_quant_reference(x, spec)
    xn = x.numpy()
    expect = np.empty_like(xn)
    for i in range(0, 256, 128):
        for j in range(0, 384, 128):
            tile = xn[i : i + 128, j : j + 128]
            expect[i : i + 128, j : j + 128] = E.fp8_expect(tile, np.abs(tile).max(), num_bits)
    _check(out, expect, torch.float32)


def test_e2m1_thresholds_and_ties():
    a = torch.tensor(
        [
            0.0,
            0.25,
            0.2500001,
            0.75,
            0.7499999,
            1.25,
            1.2500001,
            1.75,
            1.7499999,
            2.5,
            2.5000002,
            3.5,
            3.4999998,
            5.0,
            5.0000005,
            7.0,
            100.0,
        ]
    )
    expect = torch.tensor(
        [0.0, 0.0, 0.5, 1.0, 0.5, 1.0, 1.5, 2.0, 1.5, 2.0, 3.0, 4.0, 3.0, 4.0, 6.0, 6.0, 6.0]
    )
    assert torch.equal(e2m1_round(a), expect)
    dense = torch.linspace(0, 7, 70001)
    assert torch.equal(e2m1_round(dense), torch.from_numpy(E.round_to_table(dense.numpy(), *E.E2M1)))


@pytest.mark.parametrize("cols", [64, 40])  # 40: padded to 48
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4(cols, dtype):
    x = _data((12, cols), dtype)
    x[3, :16] = 0.0  # an all-zero block: scale 0 -> 1
    x[5, 16:32] *= 1e-6  # tiny block scales: clamped to 2**-9
    xf = x.float().numpy()
    _check(nvfp4_fake_quant(x), E.nvfp4_expect(xf), dtype)
    g = x.float().abs().amax() * 0.5  # static global amax below the data max: saturation
    _check(nvfp4_fake_quant(x, g), E.nvfp4_expect(xf, g.numpy()), dtype)


def test_nvfp4_degenerate_global_amax():
    x = _data((2, 32))
    assert torch.equal(nvfp4_fake_quant(x, torch.tensor(0.0)), torch.zeros_like(x))
    assert torch.equal(nvfp4_fake_quant(torch.zeros(2, 32)), torch.zeros(2, 32))


@pytest.mark.parametrize("num_bits", [(4, 3), (5, 2), (3, 2), (2, 3), (2, 1), 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mx(num_bits, dtype):
    x = _data((6, 80), dtype, scale=5.0)  # 80: padded to 96
    x[1, :32] = 0.0
    x[2, 32:64] *= 1e-3
    _check(mx_fake_quant(x, num_bits), E.mx_expect(x.float().numpy(), num_bits), dtype)


def test_mx_scale_is_ocp_exponent():
    x = torch.zeros(1, 32)
    x[0, 0] = 6.0  # floor(log2 6) = 2; MXFP4 emax 2 -> exponent 0, values on the plain E2M1 grid
    x[0, 1] = 2.6
    out = mx_fake_quant(x, (2, 1))
    assert out[0, 0] == 6.0
    assert out[0, 1] == 3.0


def test_mxint8_grid_is_symmetric():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 1.0, -1.999  # scale 2**0; -1.999 * 64 rounds to -128, clamped to -127
    out = mx_fake_quant(x, 8)
    assert out[0, 1] == -127 / 64
    assert torch.equal(mx_fake_quant(-x, 8), -out)


def test_fp8_arithmetic_rounding_equals_the_cast():
    # every float32 bit pattern step across the E4M3 / E5M2 ranges, ties included
    from modelopt_lite.formats.fp8 import FP8_FORMATS
    from modelopt_lite.formats.rounding import minifloat_round

    for spec, dtype in FP8_FORMATS.values():
        lo = torch.tensor(2.0**-20).view(torch.int32)
        hi = torch.tensor(spec.max_value).view(torch.int32)
        bits = torch.arange(int(lo), int(hi) + 1, 97, dtype=torch.int32)
        a = torch.cat([bits.view(torch.float32), torch.tensor([0.0, spec.max_value])])
        a = torch.cat([a, -a])
        assert torch.equal(minifloat_round(a.clone(), spec, signed=True), a.to(dtype).float())


@pytest.mark.parametrize(
    "attrs",
    [
        {"num_bits": 8},
        {"num_bits": 8, "axis": 0},
        {"num_bits": 4, "block_sizes": {-1: 128}},
        {"num_bits": (4, 3)},
        {"num_bits": (4, 3), "block_sizes": {-1: None, "type": "dynamic"}},
        {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}},
        {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_sized_slices_give_the_same_bits(monkeypatch, attrs, dtype):
    from modelopt_lite.formats import _chunks, reduce_amax

    spec = resolve_format(**attrs)
    x = _data((24, 256), dtype)
    amax = reduce_amax(x, spec) * 0.9 if spec.needs_amax else None
    whole = fake_quant_reference(x, spec, amax)
    monkeypatch.setattr(_chunks, "CHUNK_ELEMENTS", 300)  # many slices, not aligned with rows or blocks
    assert torch.equal(fake_quant_reference(x, spec, amax), whole)


def test_e2m1_packing_layout_and_round_trip():
    from modelopt_lite.formats import pack_e2m1, unpack_e2m1

    vals = torch.tensor([[0.5, -6.0, 1.5, 0.0, -0.0, 3.0, -0.5, 4.0]])
    packed = pack_e2m1(vals)
    assert packed.dtype == torch.uint8
    assert packed.shape == (1, 4)
    # even element in the low nibble; code = sign << 3 | index into (0, .5, 1, 1.5, 2, 3, 4, 6); -0.0 is 0x8
    assert packed.tolist() == [[0x1 | (0xF << 4), 0x3 | (0x0 << 4), 0x8 | (0x5 << 4), 0x9 | (0x6 << 4)]]
    assert torch.equal(unpack_e2m1(packed), vals)
    assert torch.equal(torch.signbit(unpack_e2m1(packed)), torch.signbit(vals))
    with pytest.raises(ValueError, match="even last dimension"):
        pack_e2m1(torch.zeros(1, 3))


def test_fast_e2m1_rounding_and_nvfp4_block_scales_equal_the_plain_formulas():
    # e2m1_round (saturate, add and subtract a power-of-two constant) against minifloat_round, and the NVFP4
    # block scale (arithmetic E4M3 rounding) against the FP8 cast, over float32 bit patterns of every exponent
    from modelopt_lite.formats.nvfp4 import nvfp4_block_scales
    from modelopt_lite.formats.rounding import E2M1, minifloat_round

    bits = torch.arange(0, 0x7F800000 + 1, 997, dtype=torch.int32)
    a = torch.cat(
        [bits.view(torch.float32), torch.tensor([float("inf"), float("nan"), 0.25, 0.75, 5.0, 7.0])]
    )
    expect = minifloat_round(a.clone(), E2M1)
    assert torch.equal(e2m1_round(a.clone()).nan_to_num(-1.0), expect.nan_to_num(-1.0))
    s2 = torch.tensor(2.0**-7)
    s = a / (s2 * 6.0)
    s = s.masked_fill(s == 0, 1.0).clamp(2.0**-9, 448.0)  # the block scale before its FP8 cast
    cast = s.to(torch.float8_e4m3fn).float()
    assert torch.equal(nvfp4_block_scales(a, s2).nan_to_num(-1.0), cast.nan_to_num(-1.0))


def test_e2m1_rounding_of_a_transposed_tensor_is_silent_and_the_same():
    # transposed expert weights (GPT-OSS) reach the E2M1 rounding strided: same codes, no UserWarning
    import warnings

    from modelopt_lite.formats.rounding import e2m1_index

    a = (torch.rand(64, 48, generator=torch.Generator().manual_seed(0)) * 7).t()
    assert not a.is_contiguous()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = e2m1_index(a)
    assert torch.equal(got, e2m1_index(a.contiguous()))
