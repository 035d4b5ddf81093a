"""Export round trips per format on a tiny Llama and a tiny Qwen3-MoE: real quantized tensors on disk,
loaded back through ``AutoModelForCausalLM.from_pretrained`` (quant_method "modelopt"), dequantized weights
equal to the fake-quantized ones, logits equal within float tolerance."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM

import modelopt_lite.quantization as mtq
from modelopt_lite.moe import QuantExperts
from modelopt_lite.nn import QuantLinear

from ._export_cases import BIT_EXACT, FORMATS, assert_within_ulp, export, hf_quant, quantized, tensors
from ._models import batches


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``(model, directory)`` per (model, preset), exported once for the module."""
    cache = {}

    def get(model_name: str, preset: str, kv: str | None = None):
        key = (model_name, preset, kv)
        if key not in cache:
            model = quantized(model_name, preset, kv)
            directory = tmp_path_factory.mktemp("export") / f"{model_name}-{preset}"
            result = export(model, directory)
            cache[key] = (model, directory, result)
        return cache[key]

    return get


def _fake_quant_weights(model):
    """``{name: (weight as computed, pre_quant_scale applied to its input or None)}``."""
    out = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, QuantLinear) and m.weight_quantizer.is_enabled:
                out[f"{name}.weight"] = (m.quantized_weight(), m.input_quantizer.pre_quant_scale)
            elif isinstance(m, QuantExperts):
                for proj in m._projections:
                    pqs = getattr(m, f"{proj}_input_quantizer").pre_quant_scale
                    out[f"{name}.{proj}"] = (m.quantized_weight(proj), pqs)
    return out


@contextmanager
def activations_unquantized(model):
    """The model's input and KV quantizers off (the loaded model computes with dense activations)."""
    on = [q for name, q in mtq.iter_quantizers(model) if q.is_enabled and "weight_quantizer" not in name]
    for q in on:
        q.disable()
    try:
        yield
    finally:
        for q in on:
            q.enable()


@pytest.mark.parametrize("model_name", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("preset", list(FORMATS))
def test_round_trip(exported, model_name, preset):
    model, directory, _ = exported(model_name, preset)
    algo = FORMATS[preset]
    assert hf_quant(directory)["quantization"]["quant_algo"] == algo
    on_disk = tensors(directory)
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    params = dict(loaded.named_parameters())
    for name, (weight, pqs) in _fake_quant_weights(model).items():
        stem = name.removesuffix(".weight")
        folded = name.endswith(".weight") and f"{stem}.pre_quant_scale" not in on_disk  # into a norm
        expected = weight.float() if pqs is None or folded else weight.float() * pqs.float().reshape(1, -1)
        if algo in BIT_EXACT:
            assert torch.equal(params[name], expected), name
        else:
            assert_within_ulp(params[name], expected)
    x = batches(n=1, seed=7)[0]
    with torch.no_grad(), activations_unquantized(model):
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- tensors as docs/export.md


F8 = torch.float8_e4m3fn


def _div(amax, bound):
    return amax.float() / torch.tensor(bound)


@pytest.mark.parametrize(
    ("preset", "layout"),
    [
        ("FP8_DEFAULT_CFG", {"weight": (torch.float8_e4m3fn, "o,i"), "weight_scale": (torch.float32, "")}),
        ("INT8_SMOOTHQUANT_CFG", {"weight": (torch.int8, "o,i"), "weight_scale": (torch.float32, "o")}),
        ("INT4_AWQ_CFG", {"weight": (torch.uint8, "o/2,i"), "weight_scale": (torch.float32, "o,i/128")}),
        ("W4A8_AWQ_BETA_CFG", {"weight": (torch.uint8, "o/2,i"), "weight_scale_2": (torch.float32, "")}),
        ("NVFP4_DEFAULT_CFG", {"weight": (torch.uint8, "o,i/2"), "weight_scale": (F8, "o,i/16"),
                               "weight_scale_2": (torch.float32, ""), "input_scale": (torch.float32, "")}),
        ("MXFP8_DEFAULT_CFG", {"weight": (F8, "o,i"), "weight_scale": (torch.uint8, "o,i/32")}),
    ],
)  # fmt: skip
def test_tensor_names_dtypes_shapes(exported, preset, layout):
    model, directory, _ = exported("llama", preset)
    stored = tensors(directory)
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        out_f, in_f = model.get_submodule(name).weight.shape
        dims = {"o": out_f, "o/2": out_f // 2, "i": in_f, "i/2": in_f // 2, "i/16": in_f // 16,
                "i/32": in_f // 32, "i/128": -(-in_f // 128)}  # fmt: skip
        for suffix, (dtype, shape) in layout.items():
            t = stored[f"{name}.{suffix}"]
            assert t.dtype == dtype, (name, suffix)
            assert list(t.shape) == [dims[d] for d in shape.split(",") if d], (name, suffix)


def test_scale_definitions(exported):
    """Scales are the calibrated amax over the format's bound, as a true division."""
    model, d, _ = exported("llama", "FP8_DEFAULT_CFG")
    q = model.model.layers[0].self_attn.o_proj
    t = tensors(d)
    assert torch.equal(t["model.layers.0.self_attn.o_proj.weight_scale"], _div(q.weight_quantizer.amax, 448))
    assert torch.equal(t["model.layers.0.self_attn.o_proj.input_scale"], _div(q.input_quantizer.amax, 448))
    model, d, _ = exported("llama", "NVFP4_DEFAULT_CFG")
    q, t = model.model.layers[0].self_attn.o_proj, tensors(d)
    assert torch.equal(
        t["model.layers.0.self_attn.o_proj.weight_scale_2"], _div(q.weight_quantizer.amax, 2688)
    )
    assert torch.equal(t["model.layers.0.self_attn.o_proj.input_scale"], _div(q.input_quantizer.amax, 2688))
    model, d, _ = exported("llama", "INT8_SMOOTHQUANT_CFG")
    q, t = model.model.layers[0].self_attn.o_proj, tensors(d)
    assert torch.equal(
        t["model.layers.0.self_attn.o_proj.weight_scale"], _div(q.weight_quantizer.amax, 127).flatten()
    )
    assert torch.equal(t["model.layers.0.self_attn.o_proj.input_scale"], _div(q.input_quantizer.amax, 127))
    model, d, _ = exported("llama", "W4A8_AWQ_BETA_CFG")
    q, t = model.model.layers[0].mlp.down_proj, tensors(d)
    scale = t["model.layers.0.mlp.down_proj.weight_scale"]
    assert torch.equal(scale, _div(q.weight_quantizer[0].amax, 7).reshape(scale.shape))
    assert torch.equal(
        t["model.layers.0.mlp.down_proj.weight_scale_2"], _div(q.weight_quantizer[1].amax, 448)
    )


def test_int4_packs_two_output_rows_per_byte(exported):
    model, d, _ = exported("llama", "INT4_AWQ_CFG")
    q = model.model.layers[0].mlp.down_proj
    t = tensors(d)
    packed, scale = t["model.layers.0.mlp.down_proj.weight"], t["model.layers.0.mlp.down_proj.weight_scale"]
    with torch.no_grad():
        codes = torch.round(q.quantized_weight().float() / scale.repeat_interleave(128, dim=1)).to(torch.int8)
    assert codes.min() >= -8
    assert codes.max() <= 7
    assert torch.equal(packed & 0x0F, (codes[0::2] & 0x0F).to(torch.uint8))  # even row in the low nibble
    assert torch.equal(packed >> 4, (codes[1::2] & 0x0F).to(torch.uint8))


def test_fused_layers_share_input_scale_and_weight_scale_2(exported):
    _, d, _ = exported("llama", "NVFP4_DEFAULT_CFG")
    t = tensors(d)
    for group in (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("mlp.gate_proj", "mlp.up_proj"),
    ):
        for suffix in ("input_scale", "weight_scale_2"):
            values = [t[f"model.layers.1.{name}.{suffix}"] for name in group]
            assert all(torch.equal(v, values[0]) for v in values), (group, suffix)
    _, d, _ = exported("qwen3_moe", "NVFP4_DEFAULT_CFG")
    t = tensors(d)
    for suffix in ("input_scale", "weight_scale_2"):
        assert torch.equal(t[f"model.layers.0.mlp.experts.2.gate_proj.{suffix}"],
                           t[f"model.layers.0.mlp.experts.2.up_proj.{suffix}"])  # fmt: skip


def test_experts_per_expert_hub_names_and_exclusions(exported):
    _model, d, _ = exported("qwen3_moe", "NVFP4_DEFAULT_CFG")
    t = tensors(d)
    assert not [k for k in t if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    for layer in range(2):
        for e in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert t[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"].dtype == torch.uint8
        assert t[f"model.layers.{layer}.mlp.gate.weight"].dtype == torch.float32  # the router stays dense
    q = hf_quant(d)
    assert q["producer"]["name"] == "modelopt_lite"
    assert {"lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"} <= set(
        q["quantization"]["exclude_modules"]
    )


def test_configs_for_engines(exported):
    model, d, _ = exported("llama", "NVFP4_DEFAULT_CFG")
    q = hf_quant(d)["quantization"]
    assert (q["quant_algo"], q["group_size"], q["kv_cache_quant_algo"]) == ("NVFP4", 16, None)
    config = json.loads((d / "config.json").read_text())
    assert model.config.architectures is None
    assert config["architectures"] == ["LlamaForCausalLM"]
    qc = config["quantization_config"]
    assert qc["quant_method"] == "modelopt"
    assert qc["quant_algo"] == "NVFP4"
    assert qc["config_groups"]["group_0"]["weights"] == {"type": "float", "dynamic": False, "num_bits": 4,
                                                         "group_size": 16}  # fmt: skip
    assert qc["ignore"] == q["exclude_modules"]
    q = hf_quant(exported("llama", "INT4_AWQ_CFG")[1])["quantization"]
    assert (q["quant_algo"], q["group_size"], q["pre_quant_scale"], q["has_zero_point"]) == (
        "W4A16_AWQ", 128, True, False)  # fmt: skip


def test_fp8_kv_cache_scales(exported):
    model, d, _ = exported("llama", "FP8_DEFAULT_CFG", "FP8_KV_CFG")
    attn, t = model.model.layers[1].self_attn, tensors(d)
    assert torch.equal(t["model.layers.1.self_attn.k_proj.k_scale"], _div(attn.k_bmm_quantizer.amax, 448))
    assert torch.equal(t["model.layers.1.self_attn.v_proj.v_scale"], _div(attn.v_bmm_quantizer.amax, 448))
    assert hf_quant(d)["quantization"]["kv_cache_quant_algo"] == "FP8"
    loaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)  # the scales load (and are dropped)
    assert not any("k_scale" in n for n, _ in loaded.named_parameters())


def test_pre_quant_scale_folded_into_norms(exported):
    model, d, _ = exported("llama", "INT8_SMOOTHQUANT_CFG")
    t, layer = tensors(d), model.model.layers[0]
    pqs = layer.self_attn.q_proj.input_quantizer.pre_quant_scale
    assert torch.equal(
        t["model.layers.0.input_layernorm.weight"], layer.input_layernorm.weight.detach() * pqs
    )
    mlp_pqs = layer.mlp.gate_proj.input_quantizer.pre_quant_scale
    norm = layer.post_attention_layernorm.weight.detach()
    assert torch.equal(t["model.layers.0.post_attention_layernorm.weight"], norm * mlp_pqs)
    assert not [k for k in t if k.endswith(("q_proj.pre_quant_scale", "gate_proj.pre_quant_scale"))]
    o_pqs = layer.self_attn.o_proj.input_quantizer.pre_quant_scale
    assert torch.equal(t["model.layers.0.self_attn.o_proj.pre_quant_scale"], o_pqs)
    # the MoE block's norm also feeds the router: nothing folded, the experts keep their scale
    model, d, _ = exported("qwen3_moe", "INT8_SMOOTHQUANT_CFG")
    t, layer = tensors(d), model.model.layers[0]
    assert torch.equal(
        t["model.layers.0.post_attention_layernorm.weight"], layer.post_attention_layernorm.weight
    )
    assert "model.layers.0.mlp.experts.1.up_proj.pre_quant_scale" in t


def test_size_ratio_reported(exported):
    assert 0.27 < exported("llama", "NVFP4_DEFAULT_CFG")[2].ratios["NVFP4"] < 0.30
    assert 0.49 < exported("llama", "FP8_DEFAULT_CFG")[2].ratios["FP8"] < 0.51


@pytest.mark.parametrize("imported", ["modelopt_lite", "modelopt_lite.quantization", None])
def test_an_export_loads_whichever_module_was_imported(tmp_path, imported):
    """An NVFP4 export loads with from_pretrained after a bare ``import modelopt_lite`` (or any submodule),
    not only after ``import modelopt_lite.export``; without any import of the library transformers does not
    know the packed format and fails on the packed shapes (the control that shows the test can fail)."""
    import subprocess
    import sys

    import modelopt_lite.quantization as mtq
    from modelopt_lite.export import export_hf_checkpoint

    from ._models import batches, tiny_llama

    model = tiny_llama()
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, batches())
    export_hf_checkpoint(model, tmp_path / "out")
    code = (f"import {imported}\n" if imported else "") + (
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'out')!r})\n"
        "print(tuple(m.model.layers[0].mlp.down_proj.weight.shape))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}  # (its report: the shapes)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    if imported is None:
        assert run.returncode != 0
        assert "size mismatch" in run.stderr or "shape" in run.stderr
    else:
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.strip().endswith("(64, 128)")
