"""Model-Optimizer's documented config-side usage works unchanged (issue 31, items 4, 5, 10 and the smaller
ones): normalized ``quant_cfg`` entries, configs that survive their own ``model_dump()``, ``QuantLinear``
subclasses and its per-channel weight default, ``need_calibration`` on dynamic inputs,
``temporarily_fold_weights`` past a layer without weight, pydantic ``ValidationError`` for bad configs and a
``LayerwiseConfig`` that builds. GPT-2's ``Conv1D`` keeps its layout (a deliberate difference, see
``docs/migrating.md``)."""

import copy

import pytest
import torch
from pydantic import ValidationError
from torch import nn

import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq
from modelopt_lite.quantization import tensor_quant

from ._models import batches, tiny_gpt2, tiny_llama

FP8 = {"num_bits": (4, 3), "axis": None}
FP8_DYNAMIC = {"num_bits": (4, 3), "axis": None, "type": "dynamic"}


# -------------------------------------------------------------------------------- normalize_quant_cfg_list
def test_normalized_entries_are_filled_like_the_reference():
    entries = mtq.normalize_quant_cfg_list(mtq.FP8_DEFAULT_CFG["quant_cfg"])
    assert all(isinstance(e, mtq.QuantizerCfgEntry) for e in entries)
    for entry in entries:
        assert set(entry) == {"quantizer_name", "parent_class", "cfg", "enable"}
        assert isinstance(entry["enable"], bool)
        assert entry["cfg"] is None or isinstance(entry["cfg"], mtq.QuantizerAttributeConfig)
    first = entries[0]
    assert (first["quantizer_name"], first["cfg"], first["enable"]) == ("*", None, False)
    assert first["parent_class"] is None
    entry = mtq.find_quant_cfg_entry_by_path(entries, "*input_quantizer")
    assert entry["cfg"]["num_bits"] == (4, 3)
    assert entry.cfg.axis is None
    assert entry["enable"] is True
    assert entry.get("parent_class") is None


def test_normalize_reads_the_legacy_forms_and_default_becomes_star_applied_first():
    entries = mtq.normalize_quant_cfg_list(
        {
            "*weight_quantizer": {"num_bits": 8, "axis": 0},
            "nn.Linear": {"*input_quantizer": {"num_bits": 8, "enable": True}},
            "default": {"enable": False},
        }
    )
    assert [(e["quantizer_name"], e["parent_class"], e["enable"]) for e in entries] == [
        ("*", None, False),  # the fallback: first, so that the entries apply in order as meant
        ("*weight_quantizer", None, True),
        ("*input_quantizer", "nn.Linear", True),
    ]
    assert dict(entries[1]["cfg"]) == {"num_bits": 8, "axis": 0}
    assert mtq.find_quant_cfg_entry_by_path(entries, "*")["enable"] is False
    # single-key legacy list entries, a sequential cfg, and a whole config
    int4 = {"num_bits": 4, "block_sizes": {-1: 128}}
    seq = mtq.normalize_quant_cfg_list([{"*weight_quantizer": [int4, FP8]}])
    assert [type(c) for c in seq[0]["cfg"]] == [mtq.QuantizerAttributeConfig] * 2
    assert seq[0]["enable"] is True
    assert mtq.normalize_quant_cfg_list(mtq.INT8_DEFAULT_CFG) == mtq.normalize_quant_cfg_list(
        mtq.INT8_DEFAULT_CFG["quant_cfg"]
    )
    # a cfg that disables takes enable from it; normalizing twice changes nothing
    off = mtq.normalize_quant_cfg_list([{"quantizer_name": "*k_bmm*", "cfg": {**FP8, "enable": False}}])
    assert off[0]["enable"] is False
    assert mtq.normalize_quant_cfg_list(entries) == entries


def test_normalized_entries_quantize_as_the_raw_config():
    legacy = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "default": {"enable": False}}}

    def weights(config):
        model = mtq.quantize(tiny_llama(layers=1), config)
        return {n: (q.is_enabled, q.amax) for n, q in mtq.iter_quantizers(model)}

    raw, normalized = weights(legacy), weights({"quant_cfg": mtq.normalize_quant_cfg_list(legacy)})
    assert raw.keys() == normalized.keys()
    for name, (enabled, amax) in raw.items():
        assert normalized[name][0] == enabled
        assert (amax is None and normalized[name][1] is None) or torch.equal(amax, normalized[name][1])
    assert {n.rpartition(".")[2] for n, (enabled, _) in raw.items() if enabled} == {"weight_quantizer"}


def test_entries_need_an_instruction_and_empty_cfgs_are_refused_unless_disabling():
    with pytest.raises(ValidationError, match="'cfg', 'enable', or both"):
        mtq.normalize_quant_cfg_list([{"quantizer_name": "*"}])
    with pytest.raises(ValidationError, match="'cfg', 'enable', or both"):
        mtq.QuantizerCfgEntry(quantizer_name="*")
    with pytest.raises(ValidationError, match="cfg is empty"):
        mtq.normalize_quant_cfg_list([{"quantizer_name": "*", "cfg": {}}])
    with pytest.raises(ValidationError, match="cfg is empty"):
        mtq.quantize(tiny_llama(layers=1), {"quant_cfg": [{"quantizer_name": "*", "cfg": {}}]})
    entry = mtq.normalize_quant_cfg_list([{"quantizer_name": "*", "cfg": {}, "enable": False}])[0]
    assert (entry["cfg"], entry["enable"]) == (None, False)
    with pytest.raises(ValueError, match="quant_cfg must be a sequence of entries"):
        mtq.normalize_quant_cfg_list("*weight_quantizer")


# ------------------------------------------------------------------------------------ model_dump round trips
def _preset_cfgs():
    for name in mtq.preset_names():
        for entry in mtq.get_preset(name)["quant_cfg"]:
            cfg = entry.get("cfg")
            for c in cfg if isinstance(cfg, list) else [cfg] if cfg else []:
                yield name, c


def test_attribute_configs_survive_their_own_model_dump():
    configs = [mtq.QuantizerAttributeConfig(**c) for _, c in _preset_cfgs()]
    configs += [
        mtq.QuantizerAttributeConfig(),
        mtq.QuantizerAttributeConfig(num_bits=8, axis=0, pass_through_bwd=False),
        mtq.QuantizerAttributeConfig(num_bits=(4, 3), backward="clipped"),
        tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW,
    ]
    assert len(configs) > 40
    for cfg in configs:
        again = mtq.QuantizerAttributeConfig(**cfg.model_dump())
        assert again == cfg
        assert again.attributes() == cfg.attributes()
        assert mtq.QuantizerAttributeConfig.model_validate(cfg.model_dump()) == cfg
    assert mtq.QuantizerAttributeConfig(backward="clipped").attributes().backward == "clipped"
    with pytest.raises(ValidationError, match="contradicts"):
        mtq.QuantizerAttributeConfig(pass_through_bwd=True, backward="clipped")


def test_entries_and_algorithm_configs_survive_their_own_model_dump():
    for entry in mtq.normalize_quant_cfg_list(mtq.W4A8_AWQ_BETA_CFG["quant_cfg"]):
        assert mtq.QuantizerCfgEntry(**entry.model_dump()) == entry
    for cls in (mtq.MaxCalibConfig, mtq.MseCalibConfig, mtq.AWQLiteCalibConfig, mtq.GPTQCalibConfig):
        cfg = cls()
        assert cls(**cfg.model_dump()) == cfg
    layerwise = mtq.LayerwiseConfig(enable=True, save_every=2)
    assert mtq.LayerwiseConfig(**layerwise.model_dump()) == layerwise


# ------------------------------------------------------------------------------------ QuantLinear
class ScaledQuantLinear(mtq.nn.QuantLinear):
    """A user's QuantLinear with its own __init__ (the reference's customisation pattern)."""

    def __init__(self, in_features, out_features, scale=1.0, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self.scale = scale

    def forward(self, x):
        return super().forward(x) * self.scale


class Int4QuantLinear(mtq.nn.QuantLinear):
    default_quant_desc_weight = mtq.QuantizerAttributeConfig(num_bits=4, block_sizes={-1: 8})


def test_a_quant_linear_subclass_with_its_own_init_is_constructed():
    layer = ScaledQuantLinear(16, 8, scale=0.5, bias=False, quant_desc_input={"enable": False})
    assert isinstance(layer, ScaledQuantLinear)
    assert isinstance(layer, nn.Linear)
    assert type(layer).__name__ == "ScaledQuantLinear"
    assert layer.scale == 0.5
    assert layer.bias is None
    assert layer.weight.shape == (8, 16)
    assert not layer.input_quantizer.is_enabled
    layer.weight_quantizer.calibrate(layer.weight)
    x = torch.randn(3, 16)
    plain = mtq.nn.QuantLinear(16, 8, bias=False, quant_desc_input={"enable": False})
    plain.load_state_dict(layer.state_dict())
    assert torch.equal(layer(x), plain(x) * 0.5)
    twin = copy.deepcopy(layer)
    assert type(twin) is type(layer)
    assert torch.equal(twin(x), layer(x))
    assert Int4QuantLinear(16, 8).weight_quantizer.block_sizes == {-1: 8}


def test_the_default_weight_quantizer_is_int8_per_output_channel():
    layer = mtq.nn.QuantLinear(16, 8)
    assert (layer.weight_quantizer.num_bits, layer.weight_quantizer.axis) == (8, 0)
    assert (layer.input_quantizer.num_bits, layer.input_quantizer.axis) == (8, None)
    assert layer.input_quantizer.is_enabled
    assert not layer.output_quantizer.is_enabled
    # a config that only enables the weight quantizers gets the default: one amax per output row
    off = {"quantizer_name": "*", "enable": False}
    config = {"quant_cfg": [off, {"quantizer_name": "*weight_quantizer", "enable": True}]}
    model = mtq.quantize(tiny_llama(layers=1), config)
    proj = model.model.layers[0].mlp.down_proj
    assert proj.weight_quantizer.amax.shape == (proj.out_features, 1)
    assert torch.equal(proj.weight_quantizer.amax, proj.weight.detach().abs().amax(dim=1, keepdim=True))


# ------------------------------------------------------------------------------------ the smaller ones
def test_need_calibration_answers_for_the_quantizers_quantize_would_leave_enabled():
    off = {"quantizer_name": "*", "enable": False}
    dynamic = {"quantizer_name": "*input_quantizer", "cfg": FP8_DYNAMIC}
    weights = {"quantizer_name": "*weight_quantizer", "cfg": FP8}
    config = {"quant_cfg": [off, dynamic, weights], "algorithm": "max"}
    assert mtq.need_calibration(config) is False  # as the reference
    assert mtq.need_calibration(mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG) is False
    assert mtq.need_calibration({**config, "quant_cfg": [off, {**dynamic, "cfg": FP8}]}) is True
    # documented differences: without the "*" rule the KV quantizers keep their default (8-bit static, on)
    # and need data, which quantize asks for (the reference reads the entries only: False) ...
    only_inputs = {"quant_cfg": [dynamic], "algorithm": "max"}
    assert mtq.need_calibration(only_inputs) is True
    with pytest.raises(ValueError, match=r"need calibration data \(e\.g\. .*k_bmm_quantizer"):
        mtq.quantize(tiny_llama(layers=1), only_inputs)
    # ... and a dynamic amax given through block_sizes, or the algorithm list ["max"], needs none (it: True)
    per_token = {"num_bits": (4, 3), "block_sizes": {-1: None, "type": "dynamic"}}
    assert mtq.need_calibration({**config, "quant_cfg": [off, {**dynamic, "cfg": per_token}]}) is False
    assert mtq.need_calibration({**config, "algorithm": ["max"]}) is False
    mtq.quantize(tiny_llama(layers=1), {**config, "quant_cfg": [off, {**dynamic, "cfg": per_token}]})


def test_temporarily_fold_weights_skips_a_layer_without_weight():
    model = mtq.quantize(tiny_llama(layers=1), mtq.INT8_WEIGHT_ONLY_CFG)
    mlp = model.model.layers[0].mlp
    mlp.up_proj.weight = None  # e.g. a layer whose weight lives elsewhere
    weight = mlp.down_proj.weight.detach().clone()
    with mtq.temporarily_fold_weights(model):
        assert not torch.equal(mlp.down_proj.weight, weight)
        assert mlp.up_proj.weight is None
    assert torch.equal(mlp.down_proj.weight, weight)
    mtq.fold_weight(model)
    assert mlp.up_proj.weight_quantizer.is_enabled  # nothing to fold there


def test_conv1d_keeps_its_layout_in_the_state_dict_and_is_quantized_per_output_channel(tmp_path):
    model = tiny_gpt2()
    shape = model.transformer.h[0].attn.c_attn.weight.shape  # (in, out) = (hidden, 3 * hidden)
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, batches(n=1))
    c_attn = model.transformer.h[0].attn.c_attn
    assert model.state_dict()["transformer.h.0.attn.c_attn.weight"].shape == shape
    assert c_attn.weight_quantizer.amax.shape == (shape[1], 1)  # one amax per output feature
    ids = batches(n=1)[0]
    mto.save(model, tmp_path / "gpt2.safetensors")
    fresh = tiny_gpt2(seed=1)
    mto.restore(fresh, tmp_path / "gpt2.safetensors")
    assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_bad_configs_raise_pydantic_validation_errors():
    model = tiny_llama(layers=1)
    bad = {"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": {"num_bitz": 8}}], "algorithm": "max"}
    with pytest.raises(ValidationError, match=r"unknown quantizer attribute\(s\) \['num_bitz'\]"):
        mtq.quantize(model, bad, batches())
    with pytest.raises(ValidationError, match="algorithm='nope' is unknown"):
        mtq.QuantizeConfig.from_dict({"quant_cfg": [], "algorithm": "nope"})
    with pytest.raises(ValidationError, match="enable='yes'"):
        mtq.normalize_quant_cfg_list([{"quantizer_name": "*", "enable": "yes"}])
    with pytest.raises(ValidationError, match="num_bits=17"):
        mtq.QuantizeConfig(quant_cfg=[{"quantizer_name": "*", "cfg": {"num_bits": 17}}])
    with pytest.raises(mtq.UnsupportedFeatureError, match="nvfp4_act_headroom"):  # left out: named as such
        mtq.QuantizeConfig.from_dict({"quant_cfg": [], "algorithm": "nvfp4_act_headroom"})
    assert not any(isinstance(m, mtq.QuantModule) for m in model.modules())


def test_layerwise_config_builds_and_raises_when_calibration_would_use_it():
    on = mtq.MaxCalibConfig(layerwise=mtq.LayerwiseConfig(enable=True))
    assert on.layerwise.enable is True
    written = mtq.MaxCalibConfig(layerwise={"enable": True, "checkpoint_dir": "ckpt"})
    assert written.layerwise.checkpoint_dir == "ckpt"
    model = tiny_llama(layers=1)
    with pytest.raises(mtq.UnsupportedFeatureError, match="layerwise calibration"):
        mtq.quantize(model, {**mtq.INT8_DEFAULT_CFG, "algorithm": on}, batches())
    assert not any(isinstance(m, mtq.QuantModule) for m in model.modules())
    off = mtq.MaxCalibConfig(layerwise={"enable": False})
    mtq.quantize(model, {**mtq.INT8_DEFAULT_CFG, "algorithm": off}, batches())
    assert model.model.layers[0].mlp.down_proj.input_quantizer.amax is not None
    with pytest.raises(mtq.UnsupportedFeatureError, match="layerwise calibration"):
        mtq.calibrate(model, {"method": "max", "layerwise": {"enable": True}}, batches())


def test_the_reference_config_module_names_import_from_ours():
    from modelopt_lite.quantization.config import (  # was: from modelopt.torch.quantization.config import
        NVFP4_DEFAULT_CFG,
        LayerwiseConfig,
        QuantizerAttributeConfig,
        find_quant_cfg_entry_by_path,
        need_calibration,
        normalize_quant_cfg_list,
    )

    assert QuantizerAttributeConfig is mtq.QuantizerAttributeConfig
    assert LayerwiseConfig is mtq.LayerwiseConfig
    assert NVFP4_DEFAULT_CFG is mtq.NVFP4_DEFAULT_CFG
    assert (normalize_quant_cfg_list, find_quant_cfg_entry_by_path) == (
        mtq.normalize_quant_cfg_list,
        mtq.find_quant_cfg_entry_by_path,
    )
    assert need_calibration is mtq.need_calibration
    with pytest.raises(ImportError):
        from modelopt_lite.quantization.config import NO_SUCH_CFG  # noqa: F401
