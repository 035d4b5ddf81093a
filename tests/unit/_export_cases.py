"""Helpers for the export tests: quantize a tiny model with a preset, read an exported checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint

from ._models import batches, tiny_llama, tiny_qwen3_moe

MODELS = {"llama": tiny_llama, "qwen3_moe": tiny_qwen3_moe}
#: preset -> the quant_algo the checkpoint must declare
FORMATS = {
    "FP8_DEFAULT_CFG": "FP8",
    "FP8_PER_CHANNEL_PER_TOKEN_CFG": "FP8_PER_CHANNEL_PER_TOKEN",
    "INT8_SMOOTHQUANT_CFG": "W8A8_SQ_PER_CHANNEL",
    "INT8_WEIGHT_ONLY_CFG": "W8A16",
    "INT4_AWQ_CFG": "W4A16_AWQ",
    "W4A8_AWQ_BETA_CFG": "W4A8_AWQ",
    "NVFP4_DEFAULT_CFG": "NVFP4",
    "NVFP4_AWQ_LITE_CFG": "NVFP4_AWQ",
    "W4A16_NVFP4_CFG": "W4A16_NVFP4",
    "MXFP8_DEFAULT_CFG": "MXFP8",
}
#: formats whose dequantized weights equal the fake-quantized ones bit for bit (the others: within a few ulp,
#: see modelopt_lite/quantization/compress/packers.py)
BIT_EXACT = {"NVFP4", "NVFP4_AWQ", "W4A16_NVFP4", "MXFP8"}


def quantized(model_name: str, preset: str, kv: str | None = None):
    cfg = mtq.get_preset(preset)
    if "awq" in str(cfg["algorithm"]):  # a coarse search: the export does not depend on which scale AWQ picks
        cfg["algorithm"] = {"method": "awq_lite", "alpha_step": 0.5}
        if preset == "W4A8_AWQ_BETA_CFG" and model_name == "qwen3_moe":
            cfg["algorithm"] = "max"  # AWQ over sequential expert quantizers takes seconds; same tensors
    if kv is not None:
        cfg = mtq.with_kv_cache(cfg, kv)
    model = MODELS[model_name]()
    return mtq.quantize(model, cfg, batches(n=1))


def export(model, directory: Path, **kwargs):
    return export_hf_checkpoint(model, directory, **kwargs)


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else None
    out = {}
    for name in files or ["model.safetensors"]:
        with safe_open(str(directory / name), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def hf_quant(directory: Path) -> dict:
    return json.loads((directory / "hf_quant_config.json").read_text())


def assert_within_ulp(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 4) -> None:
    """The stored scale (amax / max_bound) and the fake quantization's factor (FP8:
    reciprocal(reciprocal(amax) * 448); INT: division by max_bound / amax) differ by up to two ulps, the
    products by a few."""
    actual, expected = actual.float(), expected.float()
    step = (torch.nextafter(expected.abs(), torch.tensor(float("inf"))) - expected.abs()) * ulps
    bad = (actual - expected).abs() > step
    assert not bool(bad.any()), f"{int(bad.sum())} of {bad.numel()} values differ by more than {ulps} ulp"
