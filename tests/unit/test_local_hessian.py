"""Local-Hessian calibration (``local_hessian``, ``NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG``): each static NVFP4
block amax minimises the block's error weighted by its inputs' Gram matrix, checked against an independent
computation here and against the reference library's choice on the same data."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modelopt_lite.quantization as mtq
from modelopt_lite.quantization.algorithms.mse import fp8_scale_candidates, search_options

from ._models import batches, tiny_llama
from .test_nvfp4_static import expected_static

WEIGHT_ONLY = [{"quantizer_name": "*input_quantizer", "enable": False}]

# The reference (nvidia-modelopt 0.47) on _case(), on CPU, with its input quantizers off as here: the index of
# each of the 32 block amaxes in fp8_scale_candidates() (block amax = global amax * candidate). Obtained by
# running mtq.quantize with NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG / NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG in its
# virtualenv; its static NVFP4 fake quant (a Triton kernel it loads only on CUDA machines) was replaced for
# that run by the same arithmetic in torch (its compute_fp4_scales, then the kernel's rounding steps); the
# rest (Hessian capture, 126-candidate sweep, Hessian error, argmin) is its own code.
REFERENCE_LOCAL_HESSIAN = [
    115, 112, 108, 116, 125, 113, 109, 109, 113, 106, 106, 112, 112, 106, 110, 110,
    116, 107, 103, 112, 114, 113, 118, 106, 124, 112, 104, 107, 113, 112, 108, 109,
]  # fmt: skip
REFERENCE_MSE_SWEEP = [
    114, 109, 108, 112, 125, 113, 109, 113, 105, 105, 106, 107, 113, 105, 109, 110,
    115, 112, 102, 107, 114, 114, 108, 106, 119, 112, 110, 108, 112, 112, 108, 109,
]  # fmt: skip


def _case() -> tuple[torch.Tensor, torch.Tensor]:
    """A (8, 64) weight and inputs whose channels have scales from 0.1 to 10 and are correlated."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g)
    w[:, 5] *= 4.0
    col = torch.logspace(-1, 1, 64)[torch.randperm(64, generator=g)]
    mix = torch.eye(64) + 0.3 * torch.randn(64, 64, generator=g)
    x = (torch.randn(4, 32, 64, generator=g) * col) @ mix
    return w, x


def _quantize(preset: str, algorithm: dict | None = None) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    w, x = _case()
    model = nn.Sequential(nn.Linear(64, 8, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(w)
    cfg = copy.deepcopy(mtq.get_preset(preset))
    cfg["quant_cfg"] += WEIGHT_ONLY
    if algorithm is not None:
        cfg["algorithm"] = algorithm
    mtq.quantize(model, cfg, lambda m: [m(x[i]) for i in range(4)])
    return model, w, x


def _indices(q) -> list[int]:
    ratio = (q.amax.reshape(-1, 1) / q.global_amax).float()
    return (ratio - fp8_scale_candidates()).abs().argmin(1).tolist()


def test_block_amax_minimises_the_hessian_weighted_error_and_matches_the_reference():
    model, w, x = _quantize("NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG")
    q = model[0].weight_quantizer
    xb = x.reshape(-1, 4, 16)  # independently: H_b = X_b^T X_b / tokens for the 4 blocks of 16 columns
    hessian = torch.stack([xb[:, n].t() @ xb[:, n] for n in range(4)]) / xb.shape[0]
    global_amax = w.abs().amax()
    candidates = fp8_scale_candidates().tolist()
    errors = torch.empty(len(candidates), 8, 4)
    for i, c in enumerate(candidates):
        d = (expected_static(w, torch.full((32, 1), c) * global_amax, global_amax, 448.0) - w).reshape(
            8, 4, 16
        )
        for o in range(8):
            for n in range(4):
                errors[i, o, n] = d[o, n] @ hessian[n] @ d[o, n]
    best = errors.argmin(0).reshape(-1)
    assert torch.equal(q.global_amax, global_amax)
    chosen = torch.tensor(_indices(q))
    assert torch.equal(errors.gather(0, chosen.view(1, 8, 4)), errors.min(0).values.view(1, 8, 4))
    assert torch.equal(chosen, best)
    assert chosen.tolist() == REFERENCE_LOCAL_HESSIAN
    # the inputs are anisotropic: the plain squared error picks other amaxes for many blocks
    mse, _, _ = _quantize("NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG")
    assert _indices(mse[0].weight_quantizer) == REFERENCE_MSE_SWEEP
    assert sum(a != b for a, b in zip(REFERENCE_LOCAL_HESSIAN, REFERENCE_MSE_SWEEP, strict=True)) >= 10
    assert float(errors.gather(0, torch.tensor(REFERENCE_MSE_SWEEP).view(1, 8, 4)).sum()) > float(
        errors.min(0).values.sum()
    )


def test_multiplier_grid_and_a_block_size_that_does_not_divide_the_inputs(lib_caplog):
    grid = {
        "method": "local_hessian",
        "fp8_scale_sweep": False,
        "start_multiplier": 0.5,
        "stop_multiplier": 1.5,
        "step_size": 0.1,
    }
    model, w, _ = _quantize("NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG", grid)
    q = model[0].weight_quantizer
    block_max = w.abs().reshape(-1, 1, 16).amax(-1)
    ratio = (q.amax / block_max).reshape(-1)
    multipliers = torch.linspace(0.5, 1.5, 11)
    reference_grid, _ = search_options("local_hessian", {}, 0.25, 4.0, 0.1, True)  # the reference's defaults:
    assert len(reference_grid) == 39  # ceil((4.0 - 0.25) / 0.1) + 1 evenly spaced points, both ends included
    assert (reference_grid[0], reference_grid[-1]) == (0.25, 4.0)
    assert torch.isclose(ratio.unsqueeze(1), multipliers).any(1).all()  # each block: one grid multiplier
    # 64 inputs are no multiple of 24: no Hessian, the plain squared error (= mse on the same grid)
    plain, _, _ = _quantize("NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG", {**grid, "block_size": 24})
    assert "plain squared error" in lib_caplog.text
    mse, _, _ = _quantize("NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG", {**grid, "method": "mse"})
    assert torch.equal(plain[0].weight_quantizer.amax, mse[0].weight_quantizer.amax)
    assert not torch.equal(q.amax, mse[0].weight_quantizer.amax)


def test_preset_on_a_model_and_the_config_class():
    model = tiny_llama(layers=1)
    data = batches(2)
    mtq.quantize(model, mtq.NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG, lambda m: [m(b) for b in data])
    q = model.model.layers[0].mlp.down_proj.weight_quantizer
    ratio = (q.amax.reshape(-1, 1) / q.global_amax).float()
    assert torch.isclose(ratio, fp8_scale_candidates(), rtol=1e-6, atol=0).any(1).all()  # on the FP8 grid
    assert model.model.layers[0].self_attn.q_proj.input_quantizer.is_enabled  # W4A4
    assert torch.isfinite(model(data[0]).logits).all()
    cfg = mtq.LocalHessianCalibConfig()
    assert (cfg.step_size, cfg.start_multiplier, cfg.stop_multiplier) == (0.1, 0.25, 4.0)  # the reference's
    assert (cfg.fp8_scale_sweep, cfg.block_size, cfg.debug) == (True, 16, False)
    debug = tiny_llama(layers=1)
    mtq.quantize(debug, {**mtq.NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG, "algorithm": dict(
        mtq.LocalHessianCalibConfig(debug=True))}, lambda m: [m(b) for b in data])  # fmt: skip
    kept = debug._local_hessian_accumulators["model.layers.0.mlp.down_proj.weight_quantizer"]
    assert kept.shape == (128 // 16, 16, 16)
    bad = {**mtq.NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG, "algorithm": {"method": "local_hessian", "alpha": 1}}
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['alpha'\]"):
        mtq.quantize(tiny_llama(layers=1), bad, data)


def test_hessians_come_from_a_pass_with_quantized_activations_and_unquantized_weights():
    g = torch.Generator().manual_seed(5)
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16))
    x = torch.randn(3, 8, 32, generator=g) * torch.logspace(-1, 1, 32)
    w0 = model[0].weight.detach().clone()
    cfg = {**mtq.NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG, "algorithm": {"method": "local_hessian", "debug": True}}
    mtq.quantize(model, cfg, lambda m: [m(b) for b in x])
    kept = model._local_hessian_accumulators["1.weight_quantizer"]
    with torch.no_grad():
        y = (model[0].input_quantizer(x) @ w0.t() + model[0].bias).reshape(-1, 3, 16)  # what layer 1 reads
        plain = (x @ w0.t() + model[0].bias).reshape(-1, 3, 16)
    expected = torch.stack([y[:, n].t() @ y[:, n] for n in range(3)]) / y.shape[0]
    assert torch.allclose(kept, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(kept, torch.stack([plain[:, n].t() @ plain[:, n] for n in range(3)]) / 24)
