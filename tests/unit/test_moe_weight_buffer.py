"""The fake-quantized expert weight written into a buffer kept from step to step (NVFP4, CPU, float32
training): the same bits as a fresh output, the same memory each step once the previous graph is freed, a
new buffer while something still references the old one, and nothing kept outside training."""

import pytest
import torch

from modelopt_lite.formats import nvfp4_fake_quant
from modelopt_lite.formats._chunks import CHUNK_ELEMENTS
from modelopt_lite.formats.kernels import fused
from modelopt_lite.moe import QuantExperts

from .test_moe_batched_quant import _check_against_loop, _experts


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # -0.0 and 0.0 differ here, unlike torch.equal


@pytest.mark.parametrize("shape", [(3, 8, 64), (2, CHUNK_ELEMENTS // 128 + 5, 256)])  # one slice / chunked
def test_nvfp4_out_is_bit_exact_and_written_in_place(shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * torch.tensor([1.0, 30.0, 0.01][: shape[0]]).view(-1, 1, 1)
    amaxes = [x.abs().amax(dim=(1, 2), keepdim=True), x.abs().amax()]
    zero_one = amaxes[0].clone()
    zero_one[1] = 0.0  # one tensor of the batch with a zero global amax: all zero
    for amax in (*amaxes, zero_one, torch.zeros(())):
        buf = torch.full(shape, float("nan"))
        got = nvfp4_fake_quant(x, amax, out=buf)
        assert got.data_ptr() == buf.data_ptr()
        assert torch.equal(_bits(got), _bits(nvfp4_fake_quant(x, amax)))


def test_nvfp4_out_is_refused_where_it_cannot_hold_the_blocks():
    x = torch.randn(4, 40)  # 40 columns: the last block is padded
    with pytest.raises(ValueError, match="multiple of the block"):
        nvfp4_fake_quant(x, x.abs().amax(), out=torch.empty(4, 40))
    with pytest.raises(ValueError, match="shape"):
        nvfp4_fake_quant(x[:, :32], x.abs().amax(), out=torch.empty(4, 16))


def _buffers(experts: QuantExperts) -> dict[str, int]:
    return {p: buf.data_ptr() for p, (buf, _) in experts.__dict__.get("_weight_buffers", {}).items()}


@pytest.mark.parametrize("backward", ["pass_through", "clipped"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_training_reuses_the_buffer_bit_for_bit(family, backward):
    experts = _experts(family, "nvfp4", torch.float32, backward).train()
    seen = []
    for _ in range(3):  # forward and backward bit for bit the per-expert quantizers', every step
        for proj in experts._projections:
            _check_against_loop(experts, proj)
        seen.append(_buffers(experts))
    assert set(seen[0]) == set(experts._projections)
    assert seen[0] == seen[1] == seen[2], "the buffer was not reused from step to step"
    out = experts.quantized_weight(experts._projections[0])
    assert out.untyped_storage().data_ptr() == seen[0][experts._projections[0]]


def test_a_referenced_buffer_is_not_overwritten():
    experts = _experts("qwen3_moe", "nvfp4", torch.float32, "pass_through").train()
    proj = experts._projections[0]
    held = experts.quantized_weight(proj)  # e.g. a graph whose backward has not run yet
    kept = held.detach().clone()
    again = experts.quantized_weight(proj)
    assert again.data_ptr() != held.data_ptr()
    assert torch.equal(_bits(held), _bits(kept)), "a buffer still in use was overwritten"
    ptr = again.data_ptr()
    del held, again
    assert experts.quantized_weight(proj).data_ptr() == ptr  # the new buffer, reused once released


@pytest.mark.parametrize("case", ["eval", "no_grad", "bfloat16", "switched_off"])
def test_no_buffer_kept_outside_float32_training(case):
    experts = _experts("qwen3_moe", "nvfp4", torch.float32, "pass_through").train()
    proj = experts._projections[0]
    experts.quantized_weight(proj)
    assert _buffers(experts)
    if case == "eval":
        experts.eval()
        out = experts.quantized_weight(proj)
    elif case == "no_grad":
        with torch.no_grad():
            out = experts.quantized_weight(proj)
    elif case == "bfloat16":
        experts.to(torch.bfloat16)
        out = experts.quantized_weight(proj)
    else:
        experts.reuse_weight_buffers = False
        out = experts.quantized_weight(proj)
    assert proj not in _buffers(experts)
    assert out.dtype == getattr(experts, proj).dtype


def test_a_weight_off_the_cpu_releases_the_buffer():
    experts = _experts("qwen3_moe", "nvfp4", torch.float32, "pass_through").train()
    proj = experts._projections[0]
    experts.quantized_weight(proj)
    assert proj in _buffers(experts)
    assert experts.weight_buffer(proj, torch.empty(getattr(experts, proj).shape, device="meta")) is None
    assert proj not in _buffers(experts)


def test_the_opt_in_fused_path_keeps_the_buffer_for_a_batch_of_experts(monkeypatch):
    """The fused CPU path does not take a batch of NVFP4 global amax: the buffer stays in use with it on."""
    monkeypatch.setitem(fused._state, "enabled", True)
    monkeypatch.setitem(fused._state, "min_numel", 0)
    experts = _experts("qwen3_moe", "nvfp4", torch.float32, "clipped").train()
    for _ in range(2):
        for proj in experts._projections:
            _check_against_loop(experts, proj)
    assert set(_buffers(experts)) == set(experts._projections)


def test_the_buffered_weight_can_be_modified_in_place():
    # a view of the kept buffer returned by the autograd function could not be (autograd forbids it)
    experts = _experts("qwen3_moe", "nvfp4", torch.float32, "pass_through").train()
    proj = experts._projections[0]
    for _ in range(2):
        out = experts.quantized_weight(proj)
        assert out._base is None
        assert out.untyped_storage().data_ptr() == _buffers(experts)[proj]
        out.mul_(2)
        out.sum().backward()
        del out
    assert torch.equal(getattr(experts, proj).grad, torch.full_like(getattr(experts, proj), 4.0))
