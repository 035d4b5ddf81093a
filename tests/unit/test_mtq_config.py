"""Configs, presets and recipes (no model needed)."""

import copy

import pytest
import yaml

import modelopt_lite.quantization as mtq
from modelopt_lite.quantization import QuantizeConfig, QuantRule
from modelopt_lite.quantization.config.recipes import Recipe, _packaged

RECIPES = [
    "general/ptq/fp8_default-kv_fp8",
    "general/ptq/nvfp4_default-kv_fp8",
    "general/ptq/int4_awq",
    "general/ptq/int8_smoothquant",
    "general/ptq/int4_gptq",
    "general/qat/nvfp4",
    "general/qad/nvfp4-kv_fp8",
]


def test_every_preset_is_a_valid_config():
    names = [
        "FP8_DEFAULT_CFG",
        "FP8_PER_CHANNEL_PER_TOKEN_CFG",
        "INT8_DEFAULT_CFG",
        "INT8_SMOOTHQUANT_CFG",
        "INT8_WEIGHT_ONLY_CFG",
        "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
        "INT4_AWQ_CFG",
        "W4A8_AWQ_BETA_CFG",
        "NVFP4_DEFAULT_CFG",
        "NVFP4_AWQ_LITE_CFG",
        "W4A16_NVFP4_CFG",
        "MXFP8_DEFAULT_CFG",
        "MXFP4_DEFAULT_CFG",
        "FP8_KV_CFG",
        "NVFP4_KV_CFG",
    ]
    for name in names:
        cfg = QuantizeConfig.from_dict(getattr(mtq, name))
        assert cfg.to_dict()["quant_cfg"] == QuantizeConfig.from_dict(cfg.to_dict()).to_dict()["quant_cfg"]


def test_list_entry_semantics_match_the_reference():
    rule = QuantRule("*weight_quantizer", {"num_bits": (4, 3), "axis": None})
    (attrs,) = rule.attributes()
    assert attrs.enable
    assert attrs.num_bits == (4, 3)
    (attrs,) = QuantRule("*w", {"num_bits": 8}, enable=False).attributes()
    assert not attrs.enable
    assert QuantRule("*", enable=False).attributes() is None  # toggle only
    dyn = QuantRule("*i", {"num_bits": (4, 3), "axis": None, "type": "dynamic", "block_sizes": {-1: None}})
    assert dyn.attributes()[0].spec().dynamic
    assert QuantRule("*w", {"num_bits": 8, "pass_through_bwd": False}).attributes()[0].backward == "clipped"


def test_dict_form_default_is_the_fallback_wherever_it_is_written():
    cfg = QuantizeConfig.from_dict(
        {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "default": {"enable": False}}}
    )
    assert [(i, r.quantizer_name) for i, r in cfg.ordered_rules()] == [
        (1, "default"),
        (0, "*weight_quantizer"),
    ]
    scoped = QuantizeConfig.from_dict({"quant_cfg": {"nn.Linear": {"*input_quantizer": {"enable": False}}}})
    assert scoped.quant_cfg[0].parent_class == "nn.Linear"


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"quant_cfg": [], "algorithm": "max", "extra": 1}, "unknown config key"),
        (
            {"quant_cfg": [{"quantizer_name": "*", "cfg": {"num_bits": 8, "axes": 0}}]},
            "unknown quantizer attribute",
        ),
        ({"quant_cfg": [{"quantizer_name": "*", "cfg": {"num_bits": "8"}}]}, "num_bits"),
        ({"quant_cfg": [{"quantizer_name": "*", "cfg": {"num_bits": 17}}]}, "num_bits"),
        ({"quant_cfg": [{"quantizer_name": "*", "enable": "yes"}]}, "enable"),
        ({"quant_cfg": [{"quantizer_name": "*"}]}, "must specify 'cfg', 'enable', or both"),
        ({"quant_cfg": [{"quantizer_name": "*", "enable": False, "when": 1}]}, "unknown key"),
        (
            {"quant_cfg": [{"quantizer_name": "*", "cfg": {"num_bits": 8, "backend": "x"}}]},
            "not supported",
        ),
        (  # NVFP4's block scales come from the data: nothing to learn
            {
                "quant_cfg": [
                    {
                        "quantizer_name": "*weight_quantizer",
                        "cfg": {
                            "num_bits": (2, 1),
                            "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)},
                            "learn_amax": True,
                        },
                    }
                ]
            },
            "'\\*weight_quantizer'.*learn_amax=True: nvfp4 block16 has no amax to learn",
        ),
        (
            {"quant_cfg": [{"quantizer_name": "*", "cfg": {"num_bits": 8, "learn_amax": "yes"}}]},
            "learn_amax='yes' must be True or False",
        ),
        ({"quant_cfg": [], "algorithm": "magic"}, "algorithm='magic' is unknown"),
        ({"quant_cfg": "*"}, "quant_cfg must be"),
        ({"algorithm": "max"}, "needs 'quant_cfg'"),
        (
            {"quant_cfg": [{"quantizer_name": "*", "cfg": [8, 4]}]},
            r"rule '\*'.*cfg must be a valid list of attribute dictionaries",
        ),
        (
            {"quant_cfg": [{"quantizer_name": "*", "cfg": "num_bits=8"}]},
            r"rule '\*'.*cfg must be a valid dictionary",
        ),
        (
            {"quant_cfg": [{"quantizer_name": "*", "cfg": {"num_bits": 4, "block_sizes": [128]}}]},
            "block_sizes",
        ),
        (
            {"quant_cfg": [{"quantizer_name": "*", "enable": True, "cfg": {"num_bits": 8, "enable": False}}]},
            "enable=True but its cfg says enable=False",
        ),
    ],
)
def test_bad_configs_raise_naming_the_problem(config, match):
    with pytest.raises((ValueError, TypeError), match=match):
        QuantizeConfig.from_dict(config)


def test_unknown_preset_or_recipe_lists_the_available_ones():
    with pytest.raises(ValueError, match="NVFP4_DEFAULT_CFG") as err:
        mtq.resolve_config("NVFP5_CFG")
    assert "general/ptq/int4_awq" in str(err.value)
    with pytest.raises(ValueError, match="general/qat/nvfp4"):
        mtq.load_recipe("general/ptq/nope")


def test_presets_are_not_mutated_through_get_preset():
    cfg = mtq.get_preset("INT4_AWQ_CFG")
    cfg["quant_cfg"].append({"quantizer_name": "*x*", "enable": False})
    assert len(mtq.INT4_AWQ_CFG["quant_cfg"]) == len(cfg["quant_cfg"]) - 1


def test_with_kv_cache_appends_kv_rules_last():
    merged = mtq.with_kv_cache(mtq.NVFP4_DEFAULT_CFG, "FP8_KV_CFG")
    assert merged["quant_cfg"][-1]["quantizer_name"] == "*[kv]_bmm_quantizer"
    assert merged["quant_cfg"][:-1] == QuantizeConfig.from_dict(mtq.NVFP4_DEFAULT_CFG).to_dict()["quant_cfg"]
    with pytest.raises(ValueError, match="not a KV-cache rule"):
        mtq.with_kv_cache(mtq.NVFP4_DEFAULT_CFG, {"quant_cfg": [{"quantizer_name": "*", "enable": False}]})


def test_kv_cache_on_a_preset_without_calibration_gets_max():
    assert mtq.MXFP8_DEFAULT_CFG["algorithm"] is None
    assert mtq.with_kv_cache(mtq.MXFP8_DEFAULT_CFG, "FP8_KV_CFG")["algorithm"] == "max"
    assert mtq.with_kv_cache(mtq.INT4_AWQ_CFG, "FP8_KV_CFG")["algorithm"] == mtq.INT4_AWQ_CFG["algorithm"]


def test_need_calibration():
    assert mtq.need_calibration(mtq.FP8_DEFAULT_CFG)
    assert mtq.need_calibration("INT4_AWQ_CFG")  # a search algorithm
    assert not mtq.need_calibration(mtq.MXFP4_DEFAULT_CFG)  # MX scales come from each block
    for weight_only in ("INT8_WEIGHT_ONLY_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "W4A16_NVFP4_CFG"):
        assert not mtq.need_calibration(weight_only)  # weights calibrate from the weights
    assert mtq.need_calibration({"quant_cfg": [{"quantizer_name": "*input_quantizer", "enable": True}]})
    assert mtq.need_calibration(mtq.with_kv_cache(mtq.MXFP8_DEFAULT_CFG, "FP8_KV_CFG"))
    assert not mtq.need_calibration(
        mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG
        | {
            "quant_cfg": [
                {"quantizer_name": "*", "enable": False},
                {
                    "quantizer_name": "*input_quantizer",
                    "cfg": mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG["quant_cfg"][2]["cfg"],
                },
            ]
        }
    )


def test_packaged_recipes_exist_and_round_trip_unchanged():
    assert set(RECIPES) <= set(mtq.list_recipes())
    for name, path in _packaged().items():
        text = path.read_text()
        recipe = mtq.load_recipe(name)
        assert recipe.to_yaml() == text, name
        assert yaml.safe_load(recipe.to_yaml()) == yaml.safe_load(text)


def test_recipes_match_the_presets_they_name():
    kv = mtq.with_kv_cache
    expected = {
        "general/ptq/fp8_default-kv_fp8": kv(mtq.FP8_DEFAULT_CFG, "FP8_KV_CFG"),
        "general/ptq/nvfp4_default-kv_fp8": kv(mtq.NVFP4_DEFAULT_CFG, "FP8_KV_CFG"),
        "general/ptq/int4_awq": mtq.INT4_AWQ_CFG,
        "general/ptq/int8_smoothquant": mtq.INT8_SMOOTHQUANT_CFG,
        "general/ptq/int4_gptq": mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG
        | {"algorithm": {"method": "gptq", "block_size": 128, "damp": 0.01}},
        "general/qat/nvfp4": mtq.NVFP4_DEFAULT_CFG,
        "general/qad/nvfp4-kv_fp8": kv(mtq.NVFP4_DEFAULT_CFG, "FP8_KV_CFG"),
    }
    for name, preset in expected.items():
        ours = mtq.load_recipe(name).config
        assert [r.attributes() for r in ours.quant_cfg] == [
            r.attributes() for r in QuantizeConfig.from_dict(preset).quant_cfg
        ], name
        assert ours.algorithm == QuantizeConfig.from_dict(preset).algorithm


def test_recipe_from_path_and_bad_recipe(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text(Recipe("mine", "int8", QuantizeConfig.from_dict(mtq.INT8_DEFAULT_CFG)).to_yaml())
    assert mtq.resolve_config(str(good)) == QuantizeConfig.from_dict(copy.deepcopy(mtq.INT8_DEFAULT_CFG))
    bad = tmp_path / "bad.yaml"
    bad.write_text("quantize:\n  quant_cfg: []\nextra: 1\n")
    with pytest.raises(ValueError, match="keys must be"):
        mtq.load_recipe(bad)
