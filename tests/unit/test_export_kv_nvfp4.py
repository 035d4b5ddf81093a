"""NVFP4 KV-cache export (issue 17), as nvidia-modelopt 0.47's unified export writes it:
``kv_cache_quant_algo`` ``"NVFP4"`` (``"NVFP4_AFFINE"`` with a calibrated bias on K and V) in
hf_quant_config.json, the same name as ``kv_cache_scheme`` in config.json, and per attention module
``k_proj.k_scale`` / ``v_proj.v_scale`` = the calibrated amax / 448 (float32 scalars, no clamping); rotated,
mixed or non-standard KV caches are refused, naming the module."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import modelopt_lite.quantization as mtq
from modelopt_lite.cli.ptq import parse_args
from modelopt_lite.export import export_hf_checkpoint, load_hf_checkpoint, read_hf_quant_config
from modelopt_lite.export.layers import UnsupportedFormatError
from modelopt_lite.export.verify import ExportVerificationError, verify_export
from modelopt_lite.nn import QuantLinear

from ._export_cases import hf_quant, tensors
from ._models import batches, tiny_llama

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
FP8 = {"num_bits": (4, 3), "axis": None}
CALIB = batches(n=3, seed=5)


def _quantize(kv_rules, observed=None):
    """A tiny Llama, NVFP4 W4A4 with ``kv_rules`` for the KV cache, calibrated on three random batches;
    ``observed`` (a dict) collects, independently of the calibrator, max |input| of every KV quantizer."""
    cfg = mtq.update_quant_cfg_with_kv_cache_quant(mtq.NVFP4_DEFAULT_CFG, kv_rules)

    def forward_loop(model):
        hooks = []
        if observed is not None:
            for name, q in mtq.iter_quantizers(model):
                if name.endswith(("k_bmm_quantizer", "v_bmm_quantizer")):

                    def keep(mod, args, name=name):
                        amax = args[0].detach().abs().amax().float()
                        observed[name] = torch.maximum(observed.get(name, amax), amax)

                    hooks.append(q.register_forward_pre_hook(keep))
        with torch.no_grad():
            for batch in CALIB:
                model(batch)
        for h in hooks:
            h.remove()

    return mtq.quantize(tiny_llama(), cfg, forward_loop)


def _preset(name):
    return mtq.get_preset(name)["quant_cfg"]


@pytest.fixture(scope="module")
def nvfp4_kv(tmp_path_factory):
    observed: dict[str, torch.Tensor] = {}
    model = _quantize(_preset("NVFP4_KV_CFG"), observed)
    directory = tmp_path_factory.mktemp("kv") / "nvfp4"
    export_hf_checkpoint(model, directory)
    return model, directory, observed


def test_scales_are_the_calibrated_amax_over_448(nvfp4_kv):
    _, directory, observed = nvfp4_kv
    written = tensors(directory)
    assert len(observed) == 4  # 2 layers x (k, v)
    for name, amax in observed.items():
        attn, _, slot = name.rpartition(".")
        x = slot[0]
        scale = written[f"{attn}.{x}_proj.{x}_scale"]
        assert scale.dtype == torch.float32
        assert scale.shape == ()
        expected = np.float32(amax.item()) / np.float32(448)  # IEEE float32 division, as the reference's
        assert scale.item() == expected, name
        assert scale.item() != np.float32(amax.item()) / np.float32(6 * 448)  # not the NVFP4 global scale
    assert not [k for k in written if "bmm_quantizer" in k or k.endswith("_amax")]


def test_configs_name_the_kv_cache_as_the_reference(nvfp4_kv):
    _, directory, _ = nvfp4_kv
    q = hf_quant(directory)["quantization"]
    assert (q["quant_algo"], q["kv_cache_quant_algo"]) == ("NVFP4", "NVFP4")
    qc = json.loads((directory / "config.json").read_text())["quantization_config"]
    assert (qc["kv_cache_scheme"], qc["kv_cache_quant_algo"]) == ("NVFP4", "NVFP4")


def test_verify_accepts_the_export_and_wants_the_kv_cache_declared(nvfp4_kv, tmp_path):
    model, directory, _ = nvfp4_kv
    assert set(verify_export(model, directory)) == {"NVFP4"}
    shutil.copytree(directory, tmp_path / "copy")
    hf = hf_quant(directory)
    hf["quantization"]["kv_cache_quant_algo"] = None
    (tmp_path / "copy" / "hf_quant_config.json").write_text(json.dumps(hf))
    with pytest.raises(
        ExportVerificationError, match=r"k_proj\.k_scale \(and 3 more\): .*no kv_cache_quant_algo"
    ):
        verify_export(model, tmp_path / "copy")


def test_round_trip_through_our_loader(nvfp4_kv):
    model, directory, _ = nvfp4_kv
    assert read_hf_quant_config(directory)["quantization"]["kv_cache_quant_algo"] == "NVFP4"
    loaded = load_hf_checkpoint(directory, dtype=torch.float32)
    params = dict(loaded.named_parameters())
    assert not [n for n in params if n.endswith(("k_scale", "v_scale"))]  # read, and dropped: dense KV
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, QuantLinear) and m.weight_quantizer.is_enabled:
                assert torch.equal(params[f"{name}.weight"], m.quantized_weight().float()), name


def test_affine_nvfp4_writes_the_bias_as_the_reference(tmp_path):
    model = _quantize(_preset("NVFP4_AFFINE_KV_CFG"))
    export_hf_checkpoint(model, tmp_path / "out")
    assert hf_quant(tmp_path / "out")["quantization"]["kv_cache_quant_algo"] == "NVFP4_AFFINE"
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == "NVFP4_AFFINE"
    written = tensors(tmp_path / "out")
    attn = model.model.layers[1].self_attn
    for x in "kv":
        q = getattr(attn, f"{x}_bmm_quantizer")
        prefix = f"model.layers.1.self_attn.{x}_proj.{x}"
        assert torch.equal(written[f"{prefix}_bias"], q.bias_value)  # (1, KV heads, 1, head_dim)
        assert written[f"{prefix}_scale"].item() == np.float32(q.amax.item()) / np.float32(448)
    loaded = load_hf_checkpoint(tmp_path / "out", dtype=torch.float32)
    assert not [n for n, _ in loaded.named_parameters() if n.endswith(("k_bias", "v_bias"))]


def _rule(pattern, cfg):
    return {"quantizer_name": pattern, "cfg": cfg}


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        (
            _preset("NVFP4_KV_ROTATE_CFG"),
            r"model\.layers\.0\.self_attn: KV cache k_bmm_quantizer has a Hadamard rotation",
        ),
        (
            [_rule("*k_bmm_quantizer", NVFP4), _rule("*v_bmm_quantizer", FP8)],
            r"model\.layers\.0\.self_attn: KV cache k_bmm_quantizer is nvfp4 block16 but v_bmm_quantizer is "
            r"fp8_e4m3 per-tensor; the checkpoint records one kv_cache_quant_algo",
        ),
        (
            [_rule("*layers.0.*[kv]_bmm_quantizer", FP8), _rule("*layers.1.*[kv]_bmm_quantizer", NVFP4)],
            r"KV caches in different formats \(FP8 in model\.layers\.0\.self_attn, NVFP4 in "
            r"model\.layers\.1\.self_attn\)",
        ),
        (
            [_rule("*[kv]_bmm_quantizer", {**NVFP4, "block_sizes": {**NVFP4["block_sizes"], -1: 32}})],
            r"model\.layers\.0\.self_attn: KV cache k_bmm_quantizer is nvfp4 block32; .*16-element",
        ),
        (
            [
                _rule("*[kv]_bmm_quantizer", NVFP4),
                _rule("*k_bmm_quantizer", {**NVFP4, "bias": {-2: None, -4: None, "type": "static"}}),
            ],
            r"model\.layers\.0\.self_attn: only k_bmm_quantizer has a calibrated bias; an NVFP4_AFFINE",
        ),
    ],
    ids=["rotated", "k_nvfp4_v_fp8", "layers_differ", "block32", "bias_on_k_only"],
)
def test_refusals_name_the_attention_module(tmp_path, rules, message):
    model = _quantize(rules)
    with pytest.raises(UnsupportedFormatError, match=message):
        export_hf_checkpoint(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_ptq_command_line_exports_an_nvfp4_kv_cache(tmp_path):
    argv = ["--pyt_ckpt_path", str(tmp_path), "--qformat", "nvfp4", "--kv_cache_qformat", "nvfp4"]
    assert parse_args([*argv, "--export_path", str(tmp_path / "out")]).kv_cache_qformat == "nvfp4"
