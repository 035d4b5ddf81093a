"""The Triton kernels against the reference, bit for bit, on CPU tensors through TRITON_INTERPRET=1
(tests/conftest.py sets it when there is no CUDA). tests/gpu/ runs the same comparison on a GPU."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or CUDA", allow_module_level=True)

from modelopt_lite.formats import (  # noqa: E402
    fake_quant_reference,
    fp8_fake_quant,
    int_fake_quant,
    nvfp4_fake_quant,
    resolve_format,
)
from modelopt_lite.formats.kernels import triton_kernels as tk  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _x(shape, dtype, scale=4.0):
    x = torch.randn(*shape, device=DEV) * scale
    x[0, :16] = 0.0
    if shape[0] > 2:
        x[2, 16:32] *= 1e-7  # tiny values: FP8 subnormals, NVFP4 minimum block scale
    return x.to(dtype)


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int_rows(num_bits, dtype):
    x = _x((24, 300), dtype)
    per_row = x.float().abs().amax(1, keepdim=True) * 0.8
    per_row[1] = 0.0  # tiny amax row
    assert torch.equal(tk.int_rows(x, per_row, num_bits), int_fake_quant(x, per_row, num_bits))
    amax = x.float().abs().amax() * 0.5
    assert torch.equal(tk.int_rows(x, amax, num_bits), int_fake_quant(x, amax, num_bits))
    narrow = tk.int_rows(x, amax, num_bits, narrow_range=True)
    assert torch.equal(narrow, int_fake_quant(x, amax, num_bits, narrow_range=True))


@pytest.mark.parametrize("num_bits", [(4, 3), (5, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_rows(num_bits, dtype):
    x = _x((24, 300), dtype)
    per_row = x.float().abs().amax(1, keepdim=True) * 0.9
    per_row[1] = 0.0  # replaced by 1.0
    assert torch.equal(tk.fp8_rows(x, per_row, num_bits), fp8_fake_quant(x, per_row, num_bits))
    amax = x.float().abs().amax()
    assert torch.equal(tk.fp8_rows(x, amax, num_bits), fp8_fake_quant(x, amax, num_bits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4(dtype):
    x = _x((20, 128), dtype)
    for gamax in (x.float().abs().amax(), x.float().abs().amax() * 0.3, torch.tensor(0.0)):
        assert torch.equal(tk.nvfp4_rows(x, gamax.to(DEV)), nvfp4_fake_quant(x, gamax.to(DEV)))


def test_e2m1_ties_in_kernel():
    # amax 6 * 448 makes the global scale 1 and, with a block amax of 6, the block scale 1.
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -3.5, 0, 0, 0, 0, 0, 0])
    out = tk.nvfp4_rows(ties.reshape(1, 16).to(DEV), torch.tensor(2688.0))
    expect = torch.tensor([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0] + [0.0] * 6)
    assert torch.equal(out.cpu().flatten(), expect)


@pytest.mark.parametrize(
    "spec",
    [
        resolve_format(4, block_sizes={-1: 128}),
        resolve_format((4, 3), block_sizes={-1: None, "type": "dynamic"}),
        resolve_format(8, axis=0),
    ],
    ids=["int4_block", "fp8_token", "int8_channel"],
)
def test_try_fake_quant_layouts(spec):
    x = _x((8, 256), torch.float32)
    amax = None
    if not spec.dynamic:
        from modelopt_lite.formats import reduce_amax

        amax = reduce_amax(x, spec)
    out = tk.try_fake_quant(x, spec, amax)
    assert out is not None
    assert torch.equal(out, fake_quant_reference(x, spec, amax))


def test_try_fake_quant_declines_uncovered_layouts():
    x = _x((8, 200), torch.float32)
    spec = resolve_format(4, block_sizes={-1: 128})  # 200 is not a multiple of 128
    assert tk.try_fake_quant(x, spec, torch.ones(16, 1)) is None
    mx = resolve_format((2, 1), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)})
    assert tk.try_fake_quant(x, mx, None) is None
