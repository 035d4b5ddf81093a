"""SVDQuant (``svdquant``, ``NVFP4_SVDQUANT_DEFAULT_CFG``): AWQ-lite smoothing, the weight's top SVD
components kept in a high-precision branch, the residual quantized; checked against computations written
out here, and the branch survives save / restore while the export refuses it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq
from modelopt_lite.export import UnsupportedFormatError, export_hf_checkpoint

from ._models import batches, tiny_llama

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}


def _lowrank_layer(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """A (48, 64) layer whose weight is a strong rank-4 part plus noise, and anisotropic inputs."""
    g = torch.Generator().manual_seed(seed)
    w = 3.0 * torch.randn(48, 4, generator=g) @ torch.randn(4, 64, generator=g) + 0.3 * torch.randn(
        48, 64, generator=g
    )
    model = nn.Sequential(nn.Linear(64, 48))
    with torch.no_grad():
        model[0].weight.copy_(w)
    x = torch.randn(4, 16, 64, generator=g) * torch.logspace(-1, 0.5, 64)
    return model, x


def _quantize(model: nn.Module, x: torch.Tensor, algorithm, inputs: bool = True) -> nn.Module:
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": NVFP4},
            {"quantizer_name": "*input_quantizer", "cfg": NVFP4, "enable": inputs},
        ],
        "algorithm": algorithm,
    }
    return mtq.quantize(model, cfg, lambda m: [m(b) for b in x])


def test_output_is_the_quantized_residual_plus_the_lowrank_branch():
    model, x = _lowrank_layer()
    original = model[0].weight.detach().clone()
    _quantize(model, x, {"method": "svdquant", "lowrank": 4})
    layer = model[0]
    a, b = layer.weight_quantizer._svdquant_lora_a, layer.weight_quantizer._svdquant_lora_b
    scale = layer.input_quantizer.pre_quant_scale  # AWQ's 1 / s
    assert a.shape == (4, 64)
    assert b.shape == (48, 4)
    assert scale is not None
    residual = layer.weight.detach()
    # the smoothed weight W s = residual + B A, and B A is its best rank-4 approximation
    smoothed = original / scale
    assert torch.allclose(residual + b @ a, smoothed, atol=1e-5)
    sv = torch.linalg.svdvals(smoothed.double())
    assert torch.allclose(
        torch.linalg.svdvals(residual.double())[:20], sv[4:24].to(residual.dtype).double(), atol=1e-4
    )
    with torch.no_grad():
        xs = x * scale
        expected = (
            layer.input_quantizer(x) @ layer.weight_quantizer(residual).t() + layer.bias + xs @ a.t() @ b.t()
        )
        assert torch.allclose(model(x), expected, atol=1e-5)
        # weights only: x (Q(W - L1 L2) + L1 L2)^T in the smoothed input space
        weight_only, _ = _lowrank_layer()
        _quantize(weight_only, x, {"method": "svdquant", "lowrank": 4}, inputs=False)
        wl = weight_only[0]
        low = wl.weight_quantizer._svdquant_lora_b @ wl.weight_quantizer._svdquant_lora_a
        xs = x * wl.input_quantizer.pre_quant_scale
        assert torch.allclose(
            weight_only(x), xs @ (wl.weight_quantizer(wl.weight) + low).t() + wl.bias, atol=2e-4
        )  # (outputs up to ~250, float32 steps of 1.5e-5 there: the two sums, in another order, were
        # 4.6e-5 apart on an AVX512 / AMX CPU)
        # fold_weight folds Q(W - L1 L2) and keeps the branch: the same function
        before = model(x)
        mtq.fold_weight(model)
        assert torch.allclose(model(x), before, atol=1e-5)


def test_the_branch_lowers_the_error_of_awq_nvfp4():
    errors = {}
    for algorithm in ("awq_lite", "svdquant"):
        model, x = _lowrank_layer()
        reference = model(x).detach()
        original = model[0].weight.detach().clone()
        _quantize(model, x, {"method": algorithm, "lowrank": 4} if algorithm == "svdquant" else algorithm,
                  inputs=False)  # fmt: skip
        layer = model[0]
        effective = layer.weight_quantizer(layer.weight).detach()
        if algorithm == "svdquant":
            effective = (
                effective + layer.weight_quantizer._svdquant_lora_b @ layer.weight_quantizer._svdquant_lora_a
            )
        effective = effective * layer.input_quantizer.pre_quant_scale  # back to the original input space
        errors[algorithm] = (
            float((effective - original).norm() / original.norm()),
            float((model(x).detach() - reference).norm() / reference.norm()),
        )
    assert errors["svdquant"][0] < 0.5 * errors["awq_lite"][0]  # weight error
    assert errors["svdquant"][1] < 0.5 * errors["awq_lite"][1]  # output error


def test_preset_save_restore_skip_layers_and_export_refusal(tmp_path):
    data = batches(2)
    model = tiny_llama(layers=1)
    skip = copy.deepcopy(mtq.NVFP4_SVDQUANT_DEFAULT_CFG)
    skip["algorithm"] = dict(mtq.SVDQuantConfig(lowrank=8, skip_layers=["*o_proj"]))
    before = model.model.layers[0].self_attn.o_proj.weight.detach().clone()
    mtq.quantize(model, skip, lambda m: [m(b) for b in data])
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight_quantizer._svdquant_lora_a.shape == (8, 64)
    assert attn.v_proj.weight_quantizer._svdquant_lora_b.shape == (32, 8)
    assert "_svdquant_lora_a" not in attn.o_proj.weight_quantizer._buffers  # skipped: max calibration only
    assert attn.o_proj.input_quantizer.pre_quant_scale is None
    assert torch.equal(attn.o_proj.weight, before)
    assert attn.o_proj.weight_quantizer.amax is not None
    out = model(data[0]).logits
    path = mto.save(model, tmp_path / "svdquant.safetensors")
    fresh = mto.restore(tiny_llama(layers=1, seed=3), path)
    restored = fresh.model.layers[0].self_attn.q_proj.weight_quantizer
    assert torch.equal(restored._svdquant_lora_a, attn.q_proj.weight_quantizer._svdquant_lora_a)
    assert torch.equal(fresh(data[0]).logits, out)
    with pytest.raises(UnsupportedFormatError, match=r"q_proj: has an SVDQuant low-rank branch"):
        export_hf_checkpoint(model, export_dir=tmp_path / "export")
    default = tiny_llama(layers=1)
    mtq.quantize(default, mtq.NVFP4_SVDQUANT_DEFAULT_CFG, lambda m: [m(b) for b in data])  # rank 32
    assert default.model.layers[0].mlp.down_proj.weight_quantizer._svdquant_lora_a.shape == (32, 128)
    w4a8 = {**mtq.W4A8_AWQ_BETA_CFG, "algorithm": {"method": "svdquant", "lowrank": 8}}
    with pytest.raises(ValueError, match="sequential weight quantizer"):
        mtq.quantize(tiny_llama(layers=1), w4a8, data)
    with pytest.raises(ValueError, match="lowrank=0 must be a positive integer"):
        mtq.quantize(tiny_llama(layers=1), {**skip, "algorithm": {"method": "svdquant", "lowrank": 0}}, data)
