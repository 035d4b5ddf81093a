"""One batched fake quant over a fused experts weight ``(experts, out, in)``: bit for bit what each expert's
quantizer gives its own weight (forward and straight-through backward), and a per-expert loop where the
quantizers cannot be batched."""

import pytest
import torch

import modelopt_lite.quantization as mtq
from modelopt_lite.formats import nvfp4_fake_quant
from modelopt_lite.moe import QuantExperts
from modelopt_lite.moe.experts import _batched_fake_quant

from ._models import batches, tiny_gpt_oss, tiny_qwen3_moe

PRESETS = {"nvfp4": "NVFP4_DEFAULT_CFG", "fp8": "FP8_DEFAULT_CFG", "int8": "FP8_DEFAULT_CFG"}


def _experts(family: str, fmt: str, dtype: torch.dtype, backward: str) -> QuantExperts:
    """The first experts module, quantized, with a different amax per expert: expert 1's is zero, the
    others clip their weight at 50%, 100%, 125% of its own max (so a broadcast along the wrong axis, or
    the experts' amax in the wrong order, changes the result)."""
    model = tiny_gpt_oss() if family == "gpt_oss" else tiny_qwen3_moe()
    mtq.quantize(model, mtq.get_preset(PRESETS[fmt]), batches())
    experts = next(m for m in model.modules() if isinstance(m, QuantExperts)).to(dtype)
    for proj in experts._projections:
        for i, q in enumerate(getattr(experts, f"{proj}_weight_quantizers")):
            if fmt == "int8":
                q.configure(num_bits=8, axis=None)
            q.configure(backward=backward)
            w_max = experts.expert_weight(proj, i).detach().float().abs().amax()
            q.amax = 0.0 if i == 1 else w_max * (0.25 + 0.25 * i)
    return experts


def _per_expert(experts: QuantExperts, proj: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: each expert's quantizer on its own ``(out, in)`` weight, one at a time."""
    outs, grads = [], []
    for i, q in enumerate(getattr(experts, f"{proj}_weight_quantizers")):
        w = getattr(experts, proj)[i].detach().clone().requires_grad_()
        out = q(w.t()).t() if experts.is_transposed else q(w)
        (out * grad[i]).sum().backward()
        outs.append(out.detach())
        grads.append(w.grad)
    return torch.stack(outs), torch.stack(grads)


def _check_against_loop(experts: QuantExperts, proj: str) -> None:
    weight = getattr(experts, proj)
    weight.grad = None
    out = experts.quantized_weight(proj)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.dtype)
    (out * grad).sum().backward()
    ref_out, ref_grad = _per_expert(experts, proj, grad)
    assert out.dtype == weight.dtype
    assert out.shape == weight.shape
    assert torch.equal(out, ref_out), f"{proj}: forward differs from the per-expert quantizers"
    assert torch.equal(weight.grad, ref_grad), f"{proj}: backward differs from the per-expert quantizers"


@pytest.mark.parametrize("backward", ["pass_through", "clipped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", sorted(PRESETS))
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_batched_weight_fake_quant_is_bit_exact_with_per_expert_quantizers(family, fmt, dtype, backward):
    experts = _experts(family, fmt, dtype, backward)
    for proj in experts._projections:
        weight = getattr(experts, proj)
        oi = weight.transpose(1, 2) if experts.is_transposed else weight
        assert _batched_fake_quant(getattr(experts, f"{proj}_weight_quantizers"), oi) is not None
        _check_against_loop(experts, proj)
        if fmt == "nvfp4" and backward == "pass_through":  # expert 1's zero amax: all zero, alone
            assert not experts.quantized_weight(proj)[1].any()


@pytest.mark.parametrize("change", ["one_disabled", "one_per_channel", "calibrating", "pre_quant_scale"])
def test_quantizers_that_cannot_be_batched_run_per_expert(change):
    experts = _experts("qwen3_moe", "fp8", torch.float32, "clipped")
    proj = experts._projections[0]
    quantizers = getattr(experts, f"{proj}_weight_quantizers")
    if change == "one_disabled":
        quantizers[2].disable()
    elif change == "one_per_channel":
        quantizers[2].configure(axis=0)
        quantizers[2].amax = experts.expert_weight(proj, 2).detach().abs().amax(dim=1, keepdim=True)
    elif change == "calibrating":
        quantizers[0].enable_calib()
    else:
        quantizers[3].pre_quant_scale = torch.full((experts.expert_weight(proj, 3).shape[1],), 0.5)
    assert _batched_fake_quant(quantizers, getattr(experts, proj)) is None
    _check_against_loop(experts, proj)


def test_nvfp4_global_amax_per_tensor_of_a_batch():
    """``nvfp4_fake_quant`` with one global amax per leading index (a width that pads the last block, one
    zero amax) equals the tensors quantized one at a time; an amax that does not broadcast is refused."""
    scales = torch.tensor([1.0, 30.0, 0.01]).view(3, 1, 1)
    x = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(0)) * scales
    for amax in (torch.tensor([2.0, 0.0, 0.005]).view(3, 1, 1), x.abs().amax(dim=-1, keepdim=True)):
        per_row = amax.expand(3, 5, 1)
        ref = [nvfp4_fake_quant(x[i, r], per_row[i, r]) for i in range(3) for r in range(5)]
        assert torch.equal(nvfp4_fake_quant(x, amax), torch.stack(ref).view(x.shape))
    with pytest.raises(ValueError, match="size 1 in the last axis"):
        nvfp4_fake_quant(x, torch.ones(3, 1, 40))
