"""The reference library's documented config, recipe and error behaviour, written out as a user of it writes
it (issue 46): the older flat ``quant_cfg`` dict in ``QuantizeConfig``, malformed ``quant_cfg`` entries, the
error types and key phrases that ``pytest.raises(..., match=...)`` / ``except`` clauses written for the
reference look for, and the reference's recipe names."""

import re

import pytest
import torch
from pydantic import ValidationError

import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq
from modelopt_lite.quantization import tensor_quant
from modelopt_lite.quantization.nn import TensorQuantizer

from ._models import batches, tiny_llama, tiny_qwen3_moe


def _loop(model):
    for batch in batches(1):
        model(batch)


def _enabled(model):
    return {n for n, m in model.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled}


# ------------------------------------------------------------------ 4: the flat dict form in QuantizeConfig
OLD_DICT = {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "default": {"enable": False}}


def test_quantize_config_takes_the_older_flat_dict_as_mtq_quantize_does():
    cfg = mtq.QuantizeConfig(quant_cfg=OLD_DICT, algorithm="max")
    assert all("quantizer_name" in e for e in cfg.quant_cfg)
    assert [e["quantizer_name"] for e in cfg.quant_cfg] == ["*weight_quantizer", "default"]
    # the same config as the dict given to mtq.quantize, and the same quantized model
    assert cfg.same_as(mtq.QuantizeConfig.from_dict({"quant_cfg": OLD_DICT, "algorithm": "max"}))
    by_config, by_dict = tiny_llama(layers=1), tiny_llama(layers=1)
    mtq.quantize(by_config, cfg, _loop)
    mtq.quantize(by_dict, {"quant_cfg": OLD_DICT, "algorithm": "max"}, _loop)
    enabled = _enabled(by_config)
    assert enabled == _enabled(by_dict)
    # "default" is the fallback (written last, it does not disable the weight quantizers before it)
    assert enabled
    assert all(n.endswith("weight_quantizer") for n in enabled)
    assert not any(n.endswith("input_quantizer") for n in enabled)


def test_quantize_config_flat_dict_with_class_scoped_keys_and_bad_values():
    cfg = mtq.QuantizeConfig(
        quant_cfg={"default": {"enable": False}, "nn.Linear": {"*input_quantizer": {"num_bits": 8}}}
    )
    assert [(r.quantizer_name, r.parent_class) for r in cfg.quant_cfg] == [
        ("default", None),
        ("*input_quantizer", "nn.Linear"),
    ]
    with pytest.raises(ValidationError, match="unknown quantizer attribute"):
        mtq.QuantizeConfig(quant_cfg={"*weight_quantizer": {"num_bitz": 8}})
    with pytest.raises(ValidationError, match="must be a sequence of entries"):
        mtq.QuantizeConfig(quant_cfg="*weight_quantizer")


@pytest.mark.parametrize("entry", [{}, "*weight_quantizer", 3, None])
def test_normalize_quant_cfg_list_refuses_an_empty_or_non_mapping_entry(entry):
    with pytest.raises(ValueError, match="Invalid quant_cfg entry"):
        mtq.normalize_quant_cfg_list([entry])
    with pytest.raises(ValueError, match="Invalid quant_cfg entry"):
        mtq.quantize(tiny_llama(layers=1), {"quant_cfg": [entry]}, _loop)


def test_a_list_entry_without_quantizer_name_holds_one_pattern_unless_class_scoped():
    two = {"*weight_quantizer": {"num_bits": 8}, "*input_quantizer": {"num_bits": 8}}
    with pytest.raises(ValueError, match="Invalid quant_cfg entry"):
        mtq.normalize_quant_cfg_list([two])
    # the same pairs as the whole (flat) quant_cfg, or as one entry each, are fine
    assert len(mtq.normalize_quant_cfg_list(two)) == 2
    assert len(mtq.normalize_quant_cfg_list([{k: v} for k, v in two.items()])) == 2
    # an nn.*-scoped entry may sit beside other keys, as in the reference
    scoped = mtq.normalize_quant_cfg_list(
        [{"nn.Linear": {"*input_quantizer": {"num_bits": 8}}, "*": {"enable": False}}]
    )
    assert [(e["quantizer_name"], e["parent_class"]) for e in scoped] == [
        ("*input_quantizer", "nn.Linear"),
        ("*", None),
    ]


# ------------------------------------------------------------------ 12: error types and key phrases
@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ([{"quantizer_name": "*"}], "must specify 'cfg', 'enable'"),
        ([{"quantizer_name": "*weight_quantizer", "cfg": {}}], "at least one quantizer attribute"),
        (
            [{"quantizer_name": "*weight_quantizer", "cfg": {}, "enable": True}],
            "at least one quantizer attribute",
        ),
        (
            [{"quantizer_name": "*weight_quantizer", "cfg": [], "enable": True}],
            "at least one quantizer attribute",
        ),
        (
            [{"quantizer_name": "*weight_quantizer", "cfg": [{}], "enable": True}],
            "at least one quantizer attribute",
        ),
        (
            [{"quantizer_name": "*weight_quantizer", "cfg": 42, "enable": True}],
            r"(?s)cfg.*(non-empty|valid dictionary|valid list)",
        ),
        (
            [{"quantizer_name": "*weight_quantizer", "cfg": [42], "enable": True}],
            r"(?s)cfg.*(non-empty|valid dictionary|valid list)",
        ),
        ([{"nn.Linear": 3}], "value must be a mapping"),
    ],
)
def test_normalize_quant_cfg_list_messages_carry_the_reference_phrases(entries, match):
    with pytest.raises(ValueError, match=match):
        mtq.normalize_quant_cfg_list(entries)


def test_entry_model_messages_carry_the_reference_phrases():
    with pytest.raises(ValidationError, match="must specify 'cfg', 'enable'"):
        mtq.QuantizerCfgEntry(quantizer_name="*")
    with pytest.raises(ValidationError, match="at least one quantizer attribute"):
        mtq.QuantizerCfgEntry(quantizer_name="*", cfg={})
    with pytest.raises(ValueError, match="must be a sequence of entries"):
        mtq.normalize_quant_cfg_list(5)


def test_unsigned_quantization_of_a_negative_input_is_a_type_error_too():
    x = torch.randn(3, 7)
    with pytest.raises(TypeError, match="Negative values encountered"):
        tensor_quant.fake_tensor_quant(x, torch.max(torch.abs(x)), None, 8, True)
    quantizer = TensorQuantizer(mtq.QuantizerAttributeConfig(num_bits=8, unsigned=True), amax=1.0)
    with pytest.raises(TypeError, match="Negative values encountered"):
        quantizer(x)
    with pytest.raises(ValueError, match="use unsigned=False"):  # still a ValueError, and says what to do
        quantizer(x)


def test_restoring_onto_a_quantized_model_is_an_assertion_error_too():
    model = tiny_llama(layers=1)
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, _loop)
    state = mto.modelopt_state(model)
    target = tiny_llama(layers=1)
    mtq.quantize(target, mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, _loop)
    with pytest.raises(AssertionError, match="Model already has modelopt state!"):
        mto.restore_from_modelopt_state(target, state)
    with pytest.raises(ValueError, match="restore onto a fresh, unquantized model"):
        mto.restore_from_modelopt_state(target, state)


def test_quantizer_attribute_and_calibration_messages_carry_the_reference_phrases():
    with pytest.raises(ValidationError, match=r"axis must be None when block_sizes is not None."):
        mtq.QuantizerAttributeConfig(num_bits=4, axis=0, block_sizes={-1: 128})
    for value in (-1.0, 0.0):  # checked before the format (here an FP4 without blocks)
        with pytest.raises(ValidationError, match="constant_amax must be a positive value"):
            mtq.QuantizerAttributeConfig(num_bits=(2, 1), constant_amax=value)
    quantizer = TensorQuantizer(mtq.QuantizerAttributeConfig(axis=0))
    quantizer.enable_calib()
    with pytest.raises(RuntimeError, match="Calibrator returned None"):
        quantizer.load_calib_amax()


# ------------------------------------------------------------------ 10: every recipe name of the reference
#: Model-Optimizer 0.47's recipe names that are shipped here, with how many quantizers (per-expert ones
#: counted once) its own mtq.quantize enables on the tiny dense / MoE models below (None: it raises, as the
#: recipe's patterns match no linear layer of that model; MSE recipes counted with max calibration, as their
#: CPU path needs triton there).
REFERENCE_SHIPPED = {
    "general/ptq/fp8_default-kv_fp8": (16, 14),
    "general/ptq/fp8_default-kv_fp8_cast": (16, 14),
    "general/ptq/int4_blockwise_weight_only": (7, 6),
    "general/ptq/mxfp4_mlp_weight_only": (3, 2),
    "general/ptq/nvfp4_default-kv_fp8": (16, 14),
    "general/ptq/nvfp4_default-kv_fp8_cast": (16, 14),
    "general/ptq/nvfp4_default-kv_nvfp4_cast": (16, 14),
    "general/ptq/nvfp4_experts_only-kv_fp8": (None, 6),
    "general/ptq/nvfp4_experts_only-kv_fp8_cast": (None, 6),
    "general/ptq/nvfp4_experts_only_input_scale1-kv_fp8_cast": (None, 6),
    "general/ptq/nvfp4_experts_only_mse-kv_fp8_cast": (None, 6),
    "general/ptq/nvfp4_mlp_only-kv_fp8": (8, 6),
    "general/ptq/nvfp4_mlp_only-kv_fp8_cast": (8, 6),
    "general/ptq/nvfp4_mlp_only-novit-kv_fp8": (8, 6),
    "general/ptq/nvfp4_mlp_only_mse-kv_fp8_cast": (8, 6),
    "general/ptq/nvfp4_mlp_weight_only": (3, 2),
    "general/ptq/nvfp4_omlp_only-kv_fp8": (10, 8),
    "general/ptq/nvfp4_omlp_only-kv_fp8_cast": (10, 8),
    "general/ptq/nvfp4_weight_only-kv_fp16": (7, 6),
    "general/ptq/nvfp4_weight_only-kv_fp8_cast": (9, 8),
    "general/qad/nvfp4_default-kv_fp8": (16, 14),
    "huggingface/diffusion_gemma/ptq/nvfp4_experts_only": (None, 6),
    "huggingface/gemma/ptq/int8_sq-kv_fp8_cast": (16, 14),
    "huggingface/gemma/ptq/w4a8_awq-kv_fp8_cast": (23, 32),
    "huggingface/gemma4/ptq/w4a8_awq-kv_fp8_cast": (23, 32),
    "huggingface/minimax_m3_vl/ptq/nvfp4_experts_only": (None, 4),
    "huggingface/mpt/ptq/w4a8_awq-kv_fp8_cast": (23, 32),
    "huggingface/nemotron_llama/ptq/fp8_output_quant_proj": (21, 16),
    "huggingface/nemotron_llama/ptq/nvfp4_output_quant_proj": (21, 16),
    "huggingface/nemotron_vl/ptq/nvfp4-kv_fp8_cast": (16, 14),
    "huggingface/qwen3_5/ptq/w4a16_nvfp4-fp8_attn-kv_fp8_cast": (14, 13),
    "huggingface/qwen3_5/ptq/w4a16_nvfp4_mse-fp8_attn-kv_fp8_cast": (14, 13),
    "huggingface/qwen3_5_moe/ptq/nvfp4_experts_mse-fp8_rest-kv_fp8": (16, 14),
    "huggingface/qwen3_5_moe/ptq/w4a16_nvfp4-fp8_attn-kv_fp8_cast": (14, 13),
    "huggingface/qwen3_5_moe/ptq/w4a16_nvfp4_mse-fp8_attn-kv_fp8_cast": (14, 13),
    "huggingface/step3p7/ptq/nvfp4_experts_only-kv_fp8_cast": (None, None),
    "huggingface/step3p7/ptq/nvfp4_mlp_only-kv_fp8": (8, 6),
    "models/deepseek-ai/DeepSeek-V4-Pro-0813/ptq/nvfp4_experts_only": (None, None),
    "models/mistralai/Mistral-Medium-3.5-128B/ptq/nvfp4-max-calib": (16, 14),
    "models/moonshotai/Kimi-K3/ptq/nvfp4_experts-fp8_pb_attention": (4, 4),
    "models/nvidia/NVIDIA-Nemotron-3-Nano-4B-BF16/ptq/nvfp4_w4a16": (15, 13),
    "models/nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16/ptq/nvfp4-max-calib": (None, 6),
    "models/nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16/ptq/nvfp4-mse": (None, 6),
    "models/nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16/ptq/nvfp4-4o6": (None, 6),
    "models/nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16/ptq/w4a16_nvfp4_4o6": (3, 5),
    "models/stepfun-ai/Step-3.5-Flash/ptq/nvfp4-mlp-only": (8, 6),
}
#: Its other recipe names: not shipped here, refused by name.
REFERENCE_REFUSED = [
    "general/auto_quantize/nvfp4_fp8_at_5p4bits",
    "general/auto_quantize/nvfp4_fp8_kl_div_at_5p4bits",
    "general/auto_quantize/nvfp4_mse_fp8_at_6p0bits",
    "general/auto_quantize/w4a16_nvfp4_fp8_at_6p0bits-active_moe",
    "general/auto_quantize/w4a8_awq_beta_fp8_at_6p0bits",
    "general/distillation/dmd2_qwen_image",
    "general/ptq/nvfp4_act_headroom-kv_fp8_cast",
    "general/ptq/nvfp4_default-kv_none-gptq",
    "general/ptq/nvfp4_experts_only-kv_fp8_layerwise",
    "general/ptq/nvfp4_experts_only-kv_fp8_layerwise_offload",
    "general/qad/nvfp4_dual_lsq-mse_init-fp8_kv",
    "general/qad/nvfp4_lsq-mse_init-fp8_kv",
    "general/speculative_decoding/dflash",
    "general/speculative_decoding/domino",
    "general/speculative_decoding/dspark",
    "general/speculative_decoding/eagle3",
    "huggingface/diffusion_gemma/ptq/disabled_quantizers",
    "huggingface/minimax_m3_vl/ptq/mxfp8_nvfp4_experts",
    "huggingface/nemotron_vl/ptq/disabled_quantizers",
    "huggingface/qwen3_5/ptq/w4a16_nvfp4-fp8_attn-kv_fp8_cast.quant_cfg",
    "huggingface/qwen3_5/ptq/w4a16_nvfp4_mse-fp8_attn-kv_fp8_cast.quant_cfg",
    "huggingface/qwen3_6_moe/auto_quantize/w4a16_nvfp4_fp8_at_6p0bits-active_moe",
    "huggingface/qwen3_6_moe/auto_quantize/w4a16_nvfp4_fp8_module_spaces_at_6p0bits-active_moe",
    "huggingface/vit/ptq/fp8",
    "models/meta-models/Muse-Glimmer-30B/auto_quantize/w4a16_nvfp4_4o6_mixed",
    "models/nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16/speculative_decoding/dspark_warmstart",
]


def _folded_enabled(model):
    """Enabled quantizers, per-expert ones folded into one name (as the reference has one per projection)."""
    return {re.sub(r"_quantizers\.\d+$", "_quantizer", n) for n in _enabled(model)}


def _tiny(kind):
    return tiny_llama(layers=1) if kind == "dense" else _one_layer_moe()


def _one_layer_moe():
    model = tiny_qwen3_moe()
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    return model


def test_every_reference_recipe_name_is_shipped_or_refused_by_name():
    shipped = set(mtq.list_recipes())
    assert set(REFERENCE_SHIPPED) <= shipped
    for name in REFERENCE_SHIPPED:
        recipe = mtq.load_recipe(name)
        assert recipe.name == name
        assert recipe.description
        assert recipe.config.quant_cfg
    for name in REFERENCE_REFUSED:
        assert name not in shipped
        with pytest.raises(mtq.UnsupportedFeatureError, match=re.escape(repr(name))) as err:
            mtq.load_recipe(name)
        assert isinstance(err.value, ValueError)  # as an unknown recipe name is
        assert re.search(r"\b(use|load|call|quantize with|has the same|quantizes)\b", str(err.value)), name


@pytest.mark.parametrize("name", sorted(REFERENCE_SHIPPED))
def test_each_shipped_reference_recipe_quantizes_a_dense_and_a_moe_model_as_the_reference(name):
    for kind, expected in zip(("dense", "moe"), REFERENCE_SHIPPED[name], strict=True):
        model = _tiny(kind)
        mtq.quantize(model, name, _loop)
        enabled = _folded_enabled(model)
        if expected is None:  # the reference raises: nothing but (at most) the KV cache matches
            assert all(re.search(r"[kv]_bmm_quantizer$", n) for n in enabled), (name, kind, enabled)
        else:
            assert len(enabled) == expected, (name, kind, sorted(enabled))


NVFP4 = ((2, 1), 16)


def _formats(model):
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, TensorQuantizer) and m.is_enabled:
            short = re.sub(r"_quantizers\.\d+$", "_quantizer", n).removeprefix("model.layers.0.")
            block = (m.block_sizes or {}).get(-1)
            out.setdefault(short, set()).add(
                (tuple(m.num_bits) if isinstance(m.num_bits, (list, tuple)) else m.num_bits, block)
            )
    return out


def test_experts_only_recipe_enables_only_the_moe_expert_quantizers():
    model = _one_layer_moe()
    mtq.quantize(model, "general/ptq/nvfp4_experts_only-kv_fp8", _loop)
    experts = [
        f"mlp.experts.{p}_{w}_quantizer" for p in ("gate_up_proj", "down_proj") for w in ("input", "weight")
    ]
    assert _formats(model) == {
        **{n: {NVFP4} for n in experts},
        "self_attn.k_bmm_quantizer": {((4, 3), None)},
        "self_attn.v_bmm_quantizer": {((4, 3), None)},
    }
    per_expert = [n for n in _enabled(model) if "weight_quantizers." in n]
    assert len(per_expert) == 2 * model.config.num_experts  # every expert's own weight quantizer is on
    dense = tiny_llama(layers=1)
    mtq.quantize(dense, "general/ptq/nvfp4_experts_only-kv_fp8", _loop)
    assert _folded_enabled(dense) == {
        "model.layers.0.self_attn.k_bmm_quantizer",
        "model.layers.0.self_attn.v_bmm_quantizer",
    }


def test_mlp_only_and_weight_only_recipes_select_the_reference_layers():
    mlp = {
        f"mlp.{p}.{w}_quantizer" for p in ("gate_proj", "up_proj", "down_proj") for w in ("input", "weight")
    }
    kv = {"self_attn.k_bmm_quantizer", "self_attn.v_bmm_quantizer"}
    model = tiny_llama(layers=1)
    mtq.quantize(model, "general/ptq/nvfp4_mlp_only-kv_fp8", _loop)
    assert set(_formats(model)) == mlp | kv
    model = tiny_llama(layers=1)
    mtq.quantize(model, "general/ptq/nvfp4_omlp_only-kv_fp8", _loop)
    assert set(_formats(model)) == mlp | kv | {
        "self_attn.o_proj.input_quantizer",
        "self_attn.o_proj.weight_quantizer",
    }
    model = tiny_llama(layers=1)
    mtq.quantize(model, "general/ptq/nvfp4_weight_only-kv_fp16", _loop)
    linears = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert _formats(model) == {
        **{f"self_attn.{p}.weight_quantizer": {NVFP4} for p in linears},
        **{f"mlp.{p}.weight_quantizer": {NVFP4} for p in ("gate_proj", "up_proj", "down_proj")},
    }
    model = tiny_llama(layers=1)
    mtq.quantize(model, "general/ptq/nvfp4_default-kv_nvfp4_cast", _loop)
    formats = _formats(model)
    assert formats["self_attn.k_bmm_quantizer"] == {NVFP4}
    assert model.model.layers[0].self_attn.k_bmm_quantizer.attributes.pinned_amax is not None  # "cast"
