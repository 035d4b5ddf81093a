"""CUDA-only checks: the compiled Triton kernels equal the reference bit for bit on the GPU, and the
dispatch picks them for CUDA tensors. Skipped without CUDA."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from modelopt_lite.formats import (
    fake_quant,
    fake_quant_reference,
    reduce_amax,
    resolve_format,
)

SPECS = {
    "int8": resolve_format(8),
    "int8_channel": resolve_format(8, axis=0),
    "int4_block": resolve_format(4, block_sizes={-1: 128}),
    "fp8": resolve_format((4, 3)),
    "fp8_channel": resolve_format((4, 3), axis=0),
    "fp8_token": resolve_format((4, 3), block_sizes={-1: None, "type": "dynamic"}),
    "nvfp4": resolve_format((2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_equals_reference_on_gpu(name, dtype):
    spec = SPECS[name]
    x = (torch.randn(512, 4096, device="cuda") * 3).to(dtype)
    x[0, :128] = 0
    x[1, :128] *= 1e-7
    amax = reduce_amax(x, spec) if spec.needs_amax else None
    out = fake_quant(x, spec, amax)
    ref = fake_quant_reference(x, spec, amax)
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} mismatches"
    assert torch.equal(out.cpu(), fake_quant_reference(x.cpu(), spec, None if amax is None else amax.cpu()))
