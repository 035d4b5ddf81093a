"""Static NVFP4 (a calibrated amax per block next to the global amax) and four-over-six, against the reference
library's arithmetic written out independently here (``static_blockwise_fp4_fake_quant`` /
``compute_fp4_scales`` / ``_fp8_eager`` / ``nvfp4_scalar_quant``, and the static export scales of
``NVFP4QTensor``), and the presets that use them (``NVFP4_FOUR_OVER_SIX_CFG``,
``NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint
from modelopt_lite.formats import fake_quant, nvfp4_fake_quant, resolve_format
from modelopt_lite.formats.nvfp4 import nvfp4_static_fake_quant
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.quantization.compress.packers import NVFP4Packer

from ._export_cases import tensors
from ._models import batches, tiny_llama

STATIC = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}
FOUR_OVER_SIX = {**STATIC, "block_sizes": {**STATIC["block_sizes"], "four_over_six": True}}


def _e2m1(a: torch.Tensor) -> torch.Tensor:
    """The reference kernel's ``fp4_round_magnitude`` thresholds."""
    out = torch.full_like(a, 6.0)
    for bound, value, inclusive in reversed([(0.25, 0.0, True), (0.75, 0.5, False), (1.25, 1.0, True),
                                             (1.75, 1.5, False), (2.5, 2.0, True), (3.5, 3.0, False),
                                             (5.0, 4.0, True)]):  # fmt: skip
        out = torch.where(a <= bound if inclusive else a < bound, torch.full_like(a, value), out)
    return out


def expected_static(x: torch.Tensor, block_amax: torch.Tensor, global_amax: torch.Tensor, fp8_max: float):
    """The reference's static NVFP4 fake quant, step by step, on ``(num_blocks, 16)`` rows."""
    rows = x.float().reshape(-1, 16)
    scale = block_amax.float().reshape(-1, 1) / 6.0  # compute_fp4_scales
    fp8_amax = global_amax.float() * (448.0 / fp8_max) / 6.0
    safe = torch.where(fp8_amax <= 1.0 / (1 << 24), torch.ones_like(fp8_amax), fp8_amax)  # _fp8_eager
    fp8_scale = 448.0 / safe
    scale = (scale * fp8_scale).clamp(min=-448.0, max=448.0).to(torch.float8_e4m3fn).float() * (1 / fp8_scale)
    zero = scale == 0  # nvfp4_scalar_quant
    safe_scale = torch.where(zero | scale.isnan() | (scale.abs() == float("inf")), 1.0, scale)
    q = _e2m1(rows.abs() / safe_scale) * safe_scale
    q = torch.where(rows >= 0, q, -q)
    return torch.where(zero, 0.0, q).reshape(x.shape)


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 128, generator=g) * torch.rand(32, 1, generator=g) * 10.0 ** (seed % 7 - 3)
    w[3] = 0.0  # all-zero blocks
    w[5, :16] *= 1e-6  # a block whose FP8 scale underflows
    block_max = w.reshape(-1, 16).abs().amax(-1, keepdim=True)
    return w, block_max


@pytest.mark.parametrize("fp8_max", [448.0, 256.0])
@pytest.mark.parametrize("seed", range(6))
def test_static_fake_quant_equals_the_reference_arithmetic_bit_for_bit(fp8_max, seed):
    w, block_max = _weights(seed)
    g = torch.Generator().manual_seed(100 + seed)
    block_amax = block_max * torch.where(torch.rand(block_max.shape, generator=g) < 0.5, 1.0, 1.5)
    global_amax = block_max.amax()
    out = nvfp4_static_fake_quant(w, block_amax, global_amax, fp8_max)
    assert torch.equal(out, expected_static(w, block_amax, global_amax, fp8_max))
    spec = resolve_format(**(FOUR_OVER_SIX if fp8_max == 256.0 else STATIC))
    assert torch.equal(fake_quant(w, spec, block_amax, global_amax=global_amax), out)  # the dispatch
    assert torch.equal(out[3], torch.zeros(128))
    bf16 = nvfp4_static_fake_quant(w.bfloat16(), block_amax, global_amax, fp8_max)
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, expected_static(w.bfloat16(), block_amax, global_amax, fp8_max).bfloat16())


@pytest.mark.parametrize("seed", range(6))
def test_block_max_and_448_is_dynamic_nvfp4_up_to_one_ulp_of_the_scale(seed):
    # The reference forms the block scale as (amax / 6) * (448 / (global / 6)) and dequantizes with
    # 1 / (448 / (global / 6)); its dynamic path (ours) as amax / (6 * global / 2688) and * global / 2688. The
    # two round differently, so equal on most values but one float32 ulp apart on some. (Blocks whose scale
    # is below FP8's smallest value differ more: the dynamic path clamps the scale to 2**-9, the static
    # one lets it round; row 5 of the test weights has one.)
    w, block_max = _weights(seed)
    static = nvfp4_static_fake_quant(w, block_max, block_max.amax())
    dynamic = nvfp4_fake_quant(w, block_max.amax())
    rows = torch.arange(w.shape[0]) != 5
    torch.testing.assert_close(static[rows], dynamic[rows], rtol=2.0**-22, atol=0.0)


def _four_or_six_blocks() -> torch.Tensor:
    on_six = torch.tensor([6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0] * 2)  # the M=6 grid: exact with amax x 1
    on_four = torch.tensor(
        [4.0, 3.0, 1.5, 0.75, 0.5, 3.0, 1.5, 0.0] * 2
    )  # the M=4 grid: exact with amax x 1.5
    return torch.stack([on_six * 0.37, on_four * 0.52, -on_six * 0.11, on_four * 0.08])


def test_mse_four_over_six_picks_per_block_the_candidate_with_the_lower_error():
    w = _four_or_six_blocks()
    layer = nn.Sequential(nn.Linear(16, 4, bias=False))
    layer[0].weight.data = w.clone()
    search = {"method": "mse", "start_multiplier": 1.0, "stop_multiplier": 1.5, "step_size": 0.5}
    rules = [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": FOUR_OVER_SIX},
    ]
    cfg = {"quant_cfg": rules, "algorithm": search}
    mtq.quantize(layer, cfg, lambda m: m(torch.randn(2, 16)))
    q = layer[0].weight_quantizer
    block_max = w.abs().amax(-1, keepdim=True)
    assert torch.equal(q.global_amax, block_max.amax())
    errors = torch.stack([
        (nvfp4_static_fake_quant(w, block_max * m, q.global_amax, 256.0) - w).pow(2).sum(-1, keepdim=True)
        for m in (1.0, 1.5)
    ])  # fmt: skip
    assert torch.equal(q.amax, block_max * torch.tensor([1.0, 1.5])[errors.argmin(0)])
    assert torch.equal(q.amax / block_max, torch.tensor([[1.0], [1.5], [1.0], [1.5]]))  # 6, 4, 6, 4 win


def _weight_errors(model: nn.Module, reference: nn.Module) -> float:
    total = 0.0
    for name, module in model.named_modules():
        if (
            isinstance(getattr(module, "weight_quantizer", None), TensorQuantizer)
            and module.weight_quantizer.is_enabled
        ):
            w = reference.get_submodule(name).weight.detach()
            total += (module.weight_quantizer(w) - w).pow(2).sum().item()
    return total


def test_four_over_six_preset_quantizes_trains_and_beats_plain_nvfp4_on_the_weights():
    reference = tiny_llama(layers=1)
    errors = {}
    for preset in ("NVFP4_DEFAULT_CFG", "NVFP4_FOUR_OVER_SIX_CFG"):
        model = mtq.quantize(tiny_llama(layers=1), getattr(mtq, preset), batches(n=1))
        errors[preset] = _weight_errors(model, reference)
    q = model.model.layers[0].mlp.down_proj.weight_quantizer
    assert q.spec.four_over_six
    assert q.amax.shape == (q.amax.numel(), 1)
    assert q.global_amax.dim() == 0
    block_max = (
        reference.model.layers[0].mlp.down_proj.weight.detach().abs().reshape(-1, 16).amax(-1, keepdim=True)
    )
    assert bool(((q.amax == block_max) | (q.amax == block_max * 1.5)).all())
    assert errors["NVFP4_FOUR_OVER_SIX_CFG"] <= errors["NVFP4_DEFAULT_CFG"]
    model.train()
    loss = model(batches(n=1)[0], labels=batches(n=1)[0]).loss
    loss.backward()
    grad = model.model.layers[0].mlp.down_proj.weight.grad
    assert grad is not None
    assert bool(torch.isfinite(grad).all())
    assert bool(grad.abs().sum() > 0)


def test_fp8_sweep_preset_puts_every_block_amax_on_the_fp8_grid_of_the_global_amax():
    reference = tiny_llama(layers=1)
    model = mtq.quantize(tiny_llama(layers=1), mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG, batches(n=1))
    plain = mtq.quantize(tiny_llama(layers=1), mtq.NVFP4_DEFAULT_CFG, batches(n=1))
    q = model.model.layers[0].self_attn.o_proj.weight_quantizer
    fraction = (q.amax / q.global_amax * 448.0).to(torch.float8_e4m3fn).float() / 448.0
    assert torch.equal(q.global_amax * fraction, q.amax)
    assert _weight_errors(model, reference) <= _weight_errors(plain, reference)


def test_static_amax_survives_the_state_dict_and_the_reference_tensor_quant_function():
    w, block_max = _weights(0)
    q = TensorQuantizer(FOUR_OVER_SIX).calibrate(w)
    assert torch.equal(q.global_amax, block_max.amax())
    assert torch.equal(q.amax, block_max)
    q.amax = block_max * 1.5  # a search changes the block amax, not the global amax
    assert torch.equal(q.global_amax, block_max.amax())
    restored = TensorQuantizer(FOUR_OVER_SIX)
    restored.load_state_dict(q.state_dict())
    assert torch.equal(restored.global_amax, q.global_amax)
    assert torch.equal(restored(w), q(w))
    assert torch.equal(q(w), expected_static(w, block_max * 1.5, block_max.amax(), 256.0))
    x = w.clone().requires_grad_(True)
    out = mtq.tensor_quant.static_blockwise_fp4_fake_quant(x, block_max * 1.5, block_max.amax(), True, 256.0)
    assert torch.equal(out, q(w))
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(w))  # every |x| is within its block amax: nothing clipped


def test_static_export_writes_the_reference_scales_and_dequantizes_to_the_fake_quant():
    w, block_max = _weights(1)
    w[3] = 0.1  # (the export's zero-scale rule differs from the fake quant's: no all-zero blocks here)
    block_max = w.reshape(-1, 16).abs().amax(-1, keepdim=True)
    q = TensorQuantizer(FOUR_OVER_SIX).calibrate(w)
    q.amax = block_max * torch.where(torch.arange(block_max.numel()).reshape(-1, 1) % 3 == 0, 1.5, 1.0)
    packed = NVFP4Packer().pack(w, q)
    g = q.global_amax
    expected_scale = (q.amax / 6.0 * 256.0 / (g / 6.0)).clamp(min=2.0**-9, max=448.0).to(torch.float8_e4m3fn)
    assert torch.equal(
        packed["weight_scale"].view(torch.uint8), expected_scale.reshape(32, 8).view(torch.uint8)
    )
    assert torch.equal(packed["weight_scale_2"], g / (6.0 * 256.0))
    torch.testing.assert_close(NVFP4Packer().dequantize(packed), q(w), rtol=2.0**-21, atol=0.0)


def test_four_over_six_checkpoint_exports_as_nvfp4(tmp_path):
    model = mtq.quantize(tiny_llama(layers=1), mtq.NVFP4_FOUR_OVER_SIX_CFG, batches(n=1))
    layer = model.model.layers[0].mlp.gate_proj
    export_hf_checkpoint(model, tmp_path)
    out = tensors(tmp_path)
    q = layer.weight_quantizer
    assert torch.equal(out["model.layers.0.mlp.gate_proj.weight_scale_2"], q.global_amax / (6.0 * 256.0))
    dequantized = NVFP4Packer().dequantize({k.rsplit(".", 1)[-1]: v for k, v in out.items()
                                             if k.startswith("model.layers.0.mlp.gate_proj.")})  # fmt: skip
    torch.testing.assert_close(dequantized, q(layer.weight.detach()).float(), rtol=2.0**-21, atol=0.0)


def test_four_over_six_needs_static_nvfp4():
    with pytest.raises(ValueError, match="four_over_six"):
        resolve_format((2, 1), None, {-1: 16, "type": "dynamic", "scale_bits": (4, 3), "four_over_six": True})
    with pytest.raises(ValueError, match="four_over_six"):
        resolve_format(4, None, {-1: 16, "four_over_six": True})
