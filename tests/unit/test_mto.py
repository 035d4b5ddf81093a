"""mto: quantizer state save / restore (safetensors + JSON) and Hugging Face checkpointing."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq
from modelopt_lite.nn import QuantModule

from ._models import BUILDERS, batches, tiny_llama

CFG = mtq.with_kv_cache(mtq.get_preset("W4A8_AWQ_BETA_CFG") | {"algorithm": "max"}, "FP8_KV_CFG")


def _quantized(arch="llama", cfg=CFG):
    model = BUILDERS[arch]()
    mtq.quantize(model, cfg, batches())
    return model


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_restore_onto_a_fresh_model_reproduces_logits_bit_for_bit(arch, tmp_path):
    model = _quantized(arch, mtq.with_kv_cache(mtq.NVFP4_DEFAULT_CFG, "FP8_KV_CFG"))
    mtq.disable_quantizer(model, "*layers.0.mlp*")  # state, not just the config, is saved
    ids = batches(seed=5)[0]
    expected = model(ids).logits
    path = mto.save(model, tmp_path / "q.safetensors")
    fresh = BUILDERS[arch](seed=1)  # other weights: everything must come from the file
    mto.restore(fresh, path)
    assert torch.equal(fresh(ids).logits, expected)
    assert mtq.explain(fresh, "*layers.0.mlp.up_proj.weight_quantizer") == mtq.explain(
        model, "*layers.0.mlp.up_proj.weight_quantizer"
    )


def test_saved_file_is_safetensors_with_json_state(tmp_path):
    model = _quantized()
    path = mto.save(model, tmp_path / "q.safetensors")
    with safe_open(str(path), framework="pt") as f:
        state = json.loads(f.metadata()["modelopt_lite_state"])
        assert "model.layers.0.self_attn.k_proj.input_quantizer._amax" in set(f.keys())
    seq = state["quantizers"]["model.layers.0.mlp.up_proj.weight_quantizer"]
    assert [s["attributes"]["num_bits"] for s in seq["stages"]] == [4, [4, 3]]
    assert state == mto.modelopt_state(model) | {"provenance": state["provenance"]}


def test_restore_onto_another_architecture_names_the_first_mismatching_quantizer(tmp_path):
    path = mto.save(_quantized(), tmp_path / "q.safetensors")
    with pytest.raises(
        ValueError, match=r"quantizer 'model\.layers\.0\.self_attn\.q_proj\.input_quantizer'.*shape"
    ):
        mto.restore(tiny_llama(hidden=32), path)
    with pytest.raises(ValueError, match=r"module 'model\.layers\.2.*no quantizer state"):
        mto.restore(tiny_llama(layers=3), path)
    with pytest.raises(
        ValueError, match=r"quantizer 'model\.layers\.1\.self_attn\.q_proj\.input_quantizer'.*no module"
    ):
        mto.restore(tiny_llama(layers=1), path)
    with pytest.raises(ValueError, match="already quantized"):
        mto.restore(_quantized(), path)


def test_state_round_trips_through_json():
    model = _quantized()
    state = json.loads(json.dumps(mto.modelopt_state(model)))
    fresh = tiny_llama()
    mto.restore_from_modelopt_state(fresh, state)
    fresh.load_state_dict(model.state_dict())
    ids = batches()[0]
    assert torch.equal(fresh(ids).logits, model(ids).logits)


@pytest.fixture
def hf_checkpointing():
    mto.enable_huggingface_checkpointing()
    try:
        yield
    finally:
        mto.disable_huggingface_checkpointing()


def test_huggingface_checkpointing_round_trip(tmp_path, hf_checkpointing):
    model = _quantized()
    mtq.disable_quantizer(model, "*layers.1.mlp.down_proj.input_quantizer")  # saved at save time
    ids = batches()[0]
    expected = model(ids).logits
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt_lite"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not loaded.model.layers[1].mlp.down_proj.input_quantizer.is_enabled
    assert torch.equal(loaded(ids).logits, expected)
    half = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    amax = half.model.layers[0].self_attn.q_proj.input_quantizer.amax
    assert amax.dtype == torch.float32  # amax is never rounded to the model dtype
    assert torch.equal(amax, model.model.layers[0].self_attn.q_proj.input_quantizer.amax)


def test_a_deep_copy_saves_its_own_state(tmp_path, hf_checkpointing):
    import copy
    import gc

    model = _quantized()
    clone = copy.deepcopy(model)
    mtq.disable_quantizer(clone, "*layers.0.mlp.up_proj.input_quantizer")
    del model
    gc.collect()
    clone.save_pretrained(tmp_path)
    state = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["modelopt_lite_state"]
    entry = state["quantizers"]["model.layers.0.mlp.up_proj.input_quantizer"]
    assert entry["attributes"]["enable"] is False


def test_quant_off_and_restore_then_recalibrate_with_the_same_preset(tmp_path):
    model = _quantized(cfg=mtq.NVFP4_DEFAULT_CFG)
    model.model.layers[0].mlp.up_proj.input_quantizer.disable_quant()
    path = mto.save(model, tmp_path / "q.safetensors")
    fresh = mto.restore(tiny_llama(), path)
    assert not fresh.model.layers[0].mlp.up_proj.input_quantizer._quant_enabled
    mtq.quantize(fresh, mtq.NVFP4_DEFAULT_CFG, batches())  # same config after a JSON round trip
    with pytest.raises(ValueError, match="different config"):
        mtq.quantize(fresh, mtq.FP8_DEFAULT_CFG, batches())


def test_a_bf16_amax_in_a_state_dict_loads_as_float32():
    model = _quantized(cfg=mtq.INT8_DEFAULT_CFG)
    sd = {k: (v.bfloat16() if k.endswith("_amax") else v) for k, v in model.state_dict().items()}
    fresh = tiny_llama()
    mto.restore_from_modelopt_state(fresh, mto.modelopt_state(model))
    fresh.load_state_dict(sd)
    amax = fresh.model.layers[0].mlp.up_proj.input_quantizer.amax
    assert amax.dtype == torch.float32
    assert torch.equal(amax, model.model.layers[0].mlp.up_proj.input_quantizer.amax.bfloat16().float())


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda s: s.pop("quantizers"), "'quantizers' must be a non-empty mapping"),
        (
            lambda s: s["quantizers"]["model.layers.0.mlp.up_proj.input_quantizer"]["attributes"].pop(
                "enable"
            ),
            r"up_proj\.input_quantizer.*'enable'",
        ),
        (
            lambda s: s["quantizers"]["model.layers.0.mlp.up_proj.input_quantizer"]["attributes"].update(
                num_bits=99
            ),
            r"up_proj\.input_quantizer.*num_bits",
        ),
        (lambda s: s.update(format=7), "not a modelopt_lite quantizer state"),
    ],
)
def test_malformed_state_is_refused_before_the_model_changes(mutate, match):
    state = json.loads(json.dumps(mto.modelopt_state(_quantized())))
    mutate(state)
    fresh = tiny_llama()
    with pytest.raises(ValueError, match=match):
        mto.restore_from_modelopt_state(fresh, state)
    assert mtq.quant_state(fresh) is None
    assert not any(isinstance(m, QuantModule) for m in fresh.modules())


def test_a_file_that_does_not_fit_is_rolled_back(tmp_path):
    model = _quantized(cfg=mtq.INT8_DEFAULT_CFG)
    path = mto.save(model, tmp_path / "q.safetensors")
    other = tiny_llama()
    other.register_buffer("extra", torch.zeros(1))  # a key the file lacks
    with pytest.raises(ValueError, match="missing"):
        mto.restore(other, path)
    assert not any(isinstance(m, QuantModule) for m in other.modules())


def test_smoothing_scales_survive_save_and_restore(tmp_path):
    model = _quantized(cfg=mtq.INT8_SMOOTHQUANT_CFG)
    assert model.model.layers[0].mlp.down_proj.input_quantizer.pre_quant_scale is not None
    ids = batches(seed=4)[0]
    path = mto.save(model, tmp_path / "awq.safetensors")
    fresh = mto.restore(tiny_llama(seed=3), path)
    assert torch.equal(fresh(ids).logits, model(ids).logits)
