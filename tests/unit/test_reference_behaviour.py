"""The reference library's entry points behave as documented there (issue 15): pydantic configs,
constructors, quantizer-attribute functions and contexts, amax tools, the functional ``tensor_quant`` API,
``mto.load_modelopt_state`` and ``export_hf_checkpoint``'s reference argument order."""

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint
from modelopt_lite.nn.calibrators import HistogramCalibrator, MaxCalibrator
from modelopt_lite.quantization import tensor_quant

from ._models import batches, tiny_llama

FP8 = {"num_bits": (4, 3), "axis": None}


def _int8(x, amax, narrow=True):
    bound = 127
    low = -bound if narrow else -bound - 1
    return (x * (bound / amax)).round().clamp(low, bound) * (amax / bound)


# ------------------------------------------------------------------------------------------- pydantic configs
def test_quantizer_attribute_config_errors_are_pydantic_validation_errors_with_our_messages():
    cfg = mtq.QuantizerAttributeConfig(num_bits=(4, 3), axis=None)
    assert dict(cfg) == {"num_bits": (4, 3), "axis": None}
    assert cfg["enable"] is True
    assert cfg.attributes() == mtq.quantizer_attributes({"num_bits": (4, 3), "axis": None})
    cases = [
        ({"num_bits": 17}, "num_bits=17 is not a supported integer width"),
        ({"num_bit": 8}, r"unknown field\(s\) \['num_bit'\] \(allowed: \['axis'"),
        (
            {
                "num_bits": (2, 1),
                "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)},
                "learn_amax": True,
            },
            "nothing to learn|no amax to learn",
        ),
        ({"num_bits": 4, "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}, "scale_bits"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValidationError, match=message) as err:
            mtq.QuantizerAttributeConfig(**kwargs)
        assert isinstance(err.value, ValueError)
    with pytest.raises(ValidationError, match="constant_amax must be a positive value"):
        mtq.QuantizerAttributeConfig(constant_amax=0.0)


def test_calib_configs_validate_and_read_as_the_algorithm_dict():
    assert dict(mtq.MaxCalibConfig()) == {"method": "max"}
    assert dict(mtq.AWQLiteCalibConfig(alpha_step=0.2)) == {"method": "awq_lite", "alpha_step": 0.2}
    assert mtq.GPTQCalibConfig().perc_damp == 0.01
    assert mtq.AWQFullCalibConfig().method == "awq_full"
    with pytest.raises(ValidationError, match="alpha_step"):
        mtq.AWQLiteCalibConfig(alpha_step=2.0)
    with pytest.raises(ValidationError, match=r"unknown field\(s\) \['alpha'\]"):
        mtq.MaxCalibConfig(alpha=0.5)
    assert mtq.MaxCalibConfig(layerwise={"enable": True}).layerwise.enable  # builds; calibrating raises
    assert mtq.SVDQuantConfig(lowrank=8).config([]).algorithm == {"method": "svdquant", "lowrank": 8}


def test_quantize_takes_pydantic_entries_and_algorithm_configs(lib_caplog):
    weight = mtq.QuantizerAttributeConfig(num_bits=4, block_sizes={-1: 16})
    config = {
        "quant_cfg": [
            mtq.QuantizerCfgEntry(quantizer_name="*", enable=False),
            mtq.QuantizerCfgEntry(quantizer_name="*weight_quantizer", cfg=weight),
            {"quantizer_name": "*input_quantizer", "cfg": mtq.QuantizerAttributeConfig(**FP8)},
            {"quantizer_name": "*lm_head*", "enable": False},
        ],
        "algorithm": mtq.AWQLiteCalibConfig(alpha_step=0.5, debug=True),
    }
    model = tiny_llama(layers=1)
    with lib_caplog.at_level(logging.INFO, logger="modelopt_lite"):
        mtq.quantize(model, config, batches())
    q = model.model.layers[0].mlp.down_proj
    assert q.weight_quantizer.block_sizes == {-1: 16}
    assert q.input_quantizer.num_bits == (4, 3)
    assert "-> alpha" in lib_caplog.text  # AWQ's debug option logs each group's search
    typed = mtq.QuantizeConfig(quant_cfg=config["quant_cfg"], algorithm="max")
    assert typed.quant_cfg[1].cfg == dict(weight)
    assert typed.model_dump() == typed.to_dict()


def test_awq_clip_takes_the_reference_grid_options():
    def run(options):
        model = tiny_llama(layers=1)
        mtq.quantize(model, {**mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, "algorithm": options}, batches())
        return model.model.layers[0].mlp.down_proj.weight_quantizer.amax

    ours = run({"method": "awq_clip"})
    assert torch.equal(run(dict(mtq.AWQClipCalibConfig(min_clip_ratio=0.5, shrink_step=0.05))), ours)
    assert not torch.equal(run({"method": "awq_clip", "min_clip_ratio": 0.9, "shrink_step": 0.1}), ours)


# ------------------------------------------------------------------------------------------- constructors
def test_tensor_quantizer_takes_an_attribute_config_flags_and_amax():
    x = torch.linspace(-3, 3, 64)
    q = mtq.TensorQuantizer(mtq.QuantizerAttributeConfig(num_bits=8, axis=None), amax=2.0)
    assert float(q.amax) == 2.0
    assert torch.allclose(q(x), _int8(x, 2.0, narrow=False))
    assert torch.equal(mtq.TensorQuantizer(tensor_quant.QUANT_DESC_8BIT_PER_TENSOR, if_quant=False)(x), x)
    calib = mtq.TensorQuantizer({"num_bits": 8}, if_quant=False, if_calib=True)
    calib(x)
    calib.load_calib_amax()
    assert float(calib.amax) == 3.0
    assert mtq.TensorQuantizer("w", num_bits=4).name == "w"  # our form is unchanged


def test_sequential_quantizer_from_quantizers_applies_them_in_order():
    first = mtq.TensorQuantizer({"num_bits": 4, "block_sizes": {-1: 8}}, amax=torch.full((2, 1), 4.0))
    second = mtq.TensorQuantizer(FP8, amax=4.0)
    seq = mtq.SequentialQuantizer(first, second)
    x = torch.linspace(-4, 4, 16)
    assert list(seq) == [first, second]
    assert torch.equal(seq(x), second(first(x)))
    with pytest.raises(TypeError, match="TensorQuantizer objects"):
        mtq.SequentialQuantizer(nn.Linear(2, 2))


def test_quant_linear_and_calibrators_take_the_reference_arguments():
    layer = mtq.nn.QuantLinear(
        16, 8, bias=False, quant_desc_weight=tensor_quant.QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
    )
    assert isinstance(layer, nn.Linear)
    assert layer.bias is None
    assert layer.weight.shape == (8, 16)
    layer.input_quantizer.disable()
    layer.weight_quantizer.calibrate(layer.weight)
    x = torch.randn(3, 16)
    amax = layer.weight.detach().abs().amax(dim=1, keepdim=True)
    assert torch.allclose(layer(x), F.linear(x, _int8(layer.weight.detach(), amax, narrow=False)), atol=1e-6)
    calib = MaxCalibrator(8, 0)
    calib.collect(torch.tensor([[1.0, -2.0], [3.0, 0.5]]))
    assert torch.equal(calib.compute_amax(), torch.tensor([[2.0], [3.0]]))
    assert HistogramCalibrator(8, num_bins=64).spec.num_bits == 8
    assert MaxCalibrator(8, track_amax=True).amaxs == []


# ------------------------------------------------------------------------------------------- attribute tools
def _int8_model():
    model = tiny_llama(layers=1)
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, batches())
    return model


def test_set_quantizer_attributes_partial_full_and_filters():
    model = _int8_model()
    layer = model.model.layers[0]
    n = mtq.set_quantizer_attributes_partial(model, "*q_proj.weight_quantizer", {"pass_through_bwd": False})
    assert n == 1
    assert layer.self_attn.q_proj.weight_quantizer.backward == "clipped"
    assert layer.self_attn.q_proj.weight_quantizer.axis == 0  # the other attributes stay
    n = mtq.set_quantizer_attributes_full(
        model, lambda name: name.endswith("k_proj.input_quantizer"), mtq.QuantizerAttributeConfig(**FP8)
    )
    assert n == 1
    assert layer.self_attn.k_proj.input_quantizer.num_bits == (4, 3)
    n = mtq.set_quantizer_attributes_full(
        model, "*weight_quantizer", [{"num_bits": 4, "block_sizes": {-1: 16}}, FP8], parent_class=nn.Linear
    )
    assert n == 8
    assert isinstance(layer.mlp.up_proj.weight_quantizer, mtq.SequentialQuantizer)
    mtq.set_quantizer_attributes_partial(
        model, "*up_proj.weight_quantizer", [{"enable": True}, {"enable": False}]
    )
    assert [s.is_enabled for s in layer.mlp.up_proj.weight_quantizer] == [True, False]
    with pytest.raises(ValueError, match="sequential quantizer"):
        mtq.set_quantizer_attributes_partial(
            model, "*q_proj.input_quantizer", [{"enable": True}, {"enable": True}]
        )
    with pytest.warns(DeprecationWarning, match="deprecated"):
        mtq.set_quantizer_attribute(model, "*v_proj.input_quantizer", {"enable": False})
    assert not layer.self_attn.v_proj.input_quantizer.is_enabled


def test_contexts_restore_attributes_amax_and_the_recorded_rules():
    model = _int8_model()
    ids = batches()[0]
    before = model(ids).logits
    q = model.model.layers[0].mlp.down_proj.weight_quantizer
    amax = q.amax.clone()
    rules = mtq.quant_state(model).later_rules
    with mtq.set_quantizer_by_cfg_context(model, [{"quantizer_name": "*", "enable": False}]):
        assert not q.is_enabled
    assert q.is_enabled
    assert torch.equal(model(ids).logits, before)
    with mtq.preserve_quantizer_attributes_context(model):
        mtq.set_quantizer_attributes_full(
            model, "*down_proj.weight_quantizer", [{"num_bits": 4, "block_sizes": {-1: 16}}, FP8]
        )
        assert q.amax is None or isinstance(
            model.model.layers[0].mlp.down_proj.weight_quantizer, mtq.SequentialQuantizer
        )
    restored = model.model.layers[0].mlp.down_proj.weight_quantizer
    assert isinstance(restored, mtq.TensorQuantizer)
    assert torch.equal(restored.amax, amax)
    assert torch.equal(model(ids).logits, before)
    assert mtq.quant_state(model).later_rules == rules
    with pytest.raises(ValueError, match="sequential cfg lists"):
        with mtq.set_quantizer_by_cfg_context(model, [{"quantizer_name": "*", "cfg": [FP8, FP8]}]):
            pass


def test_postprocess_amax_mse_and_temporarily_fold_weights():
    model = _int8_model()
    q = model.model.layers[0].mlp.down_proj.weight_quantizer
    amax = q.amax.clone()
    mtq.postprocess_amax(model, "*down_proj.weight_quantizer", lambda a: a * 2)
    assert torch.equal(q.amax, amax * 2)
    mse = mtq.compute_quantization_mse(
        model, batches(), wildcards=["*down_proj*", lambda n: n.endswith("q_proj.input_quantizer")]
    )
    assert set(mse) == {
        "model.layers.0.mlp.down_proj.input_quantizer",
        "model.layers.0.mlp.down_proj.weight_quantizer",
        "model.layers.0.self_attn.q_proj.input_quantizer",
    }
    assert all(v > 0 for v in mse.values())
    ids = batches()[0]
    before = model(ids).logits
    weight = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    with mtq.temporarily_fold_weights(model):
        assert not q.is_enabled
        assert not torch.equal(model.model.layers[0].mlp.down_proj.weight, weight)
        assert torch.allclose(model(ids).logits, before, atol=1e-5)
    assert q.is_enabled
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, weight)


def test_config_list_helpers():
    kv = mtq.update_quant_cfg_with_kv_cache_quant(
        {"quant_cfg": None, "algorithm": None}, mtq.FP8_KV_CFG["quant_cfg"]
    )
    assert kv["quant_cfg"][0] == {"quantizer_name": "*", "enable": False}
    assert kv["algorithm"] == "max"
    rules = mtq.normalize_quant_cfg_list(
        {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "default": {"enable": False}}
    )
    assert rules[1]["quantizer_name"] == "*weight_quantizer"
    assert dict(rules[1]["cfg"]) == {"num_bits": 8, "axis": 0}
    assert (
        mtq.find_quant_cfg_entry_by_path(mtq.INT8_DEFAULT_CFG["quant_cfg"], "*input_quantizer")["cfg"][
            "num_bits"
        ]
        == 8
    )
    with pytest.raises(KeyError):
        mtq.find_quant_cfg_entry_by_path(mtq.INT8_DEFAULT_CFG["quant_cfg"], "*nothing*")


# ------------------------------------------------------------------------------------------- tensor_quant
def test_functional_tensor_quant_matches_the_reference_formulas():
    x = torch.linspace(-4, 4, 101)
    amax = torch.tensor(3.0)
    assert torch.allclose(tensor_quant.fake_tensor_quant(x, amax), _int8(x, amax))  # narrow range by default
    assert torch.equal(
        tensor_quant.FakeTensorQuantFunction.apply(x, amax), tensor_quant.fake_tensor_quant(x, amax)
    )
    xg = x.clone().requires_grad_(True)
    tensor_quant.fake_tensor_quant(xg, amax).sum().backward()
    assert torch.equal(xg.grad, (x.abs() <= 3).float())
    xg.grad = None
    tensor_quant.fake_tensor_quant(xg, amax, None, 8, False, True, None, True).sum().backward()
    assert torch.equal(xg.grad, torch.ones_like(x))
    small = torch.linspace(-400, 400, 77)
    assert torch.equal(tensor_quant.scaled_e4m3(small, None), small.to(torch.float8_e4m3fn).float())
    scaled = tensor_quant.scaled_e4m3(x, amax)
    assert torch.equal(scaled, mtq.TensorQuantizer(FP8, amax=amax)(x))
    formula = (x * (448 / 3.0)).clamp(-448, 448).to(torch.float8_e4m3fn).float() * (3.0 / 448)
    assert torch.allclose(scaled, formula, rtol=1e-6, atol=0)
    w = torch.randn(4, 32)
    nvfp4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
    expected = mtq.TensorQuantizer(nvfp4, amax=w.abs().amax())(w)
    assert torch.equal(
        tensor_quant.dynamic_block_quant(w, 16, w.abs().amax(), None, (2, 1), (4, 3)), expected
    )
    assert torch.equal(
        tensor_quant.int_cast_ste(torch.tensor([-9.4, 2.5, 200.0]), 8), torch.tensor([-9.0, 2.0, 127.0])
    )
    assert torch.equal(
        tensor_quant.fp4_cast_ste(torch.tensor([0.7, 2.6, 9.0])), torch.tensor([0.5, 3.0, 6.0])
    )


# ------------------------------------------------------------------------------------------- mto / export
def test_load_modelopt_state_and_restore_by_path(tmp_path):
    model = _int8_model()
    path = mto.save(model, tmp_path / "q.safetensors")
    state = mto.load_modelopt_state(path, map_location="cpu")  # torch.load's option: accepted, unused
    assert state == json.loads(json.dumps(mto.modelopt_state(model)))  # the state is JSON
    fresh = tiny_llama(layers=1)
    mto.restore_from_modelopt_state(fresh, modelopt_state_path=path)
    assert isinstance(fresh.model.layers[0].mlp.down_proj.weight_quantizer, mtq.TensorQuantizer)
    with pytest.raises(ValueError, match="exactly one"):
        mto.restore_from_modelopt_state(fresh)
    again = mto.restore(tiny_llama(layers=1), f=mto.save(model, f=tmp_path / "kw.safetensors"))
    assert torch.equal(
        again.model.layers[0].mlp.down_proj.weight_quantizer.amax,
        model.model.layers[0].mlp.down_proj.weight_quantizer.amax,
    )
    with pytest.raises(NotImplementedError, match="pass a path"), (tmp_path / "f.bin").open("wb") as handle:
        mto.save(model, handle)


def test_export_takes_the_reference_argument_order(tmp_path):
    model = _int8_model()
    ours = export_hf_checkpoint(model, tmp_path / "ours", torch.float32)
    theirs = export_hf_checkpoint(model, torch.float32, tmp_path / "theirs")
    keywords = export_hf_checkpoint(model, dtype=torch.float32, export_dir=tmp_path / "kw")
    names = [sorted(p.name for p in r.export_dir.iterdir()) for r in (ours, theirs, keywords)]
    assert names[0] == names[1] == names[2]
    assert (tmp_path / "theirs" / "model.safetensors").read_bytes() == (
        tmp_path / "ours" / "model.safetensors"
    ).read_bytes()
    with pytest.raises(TypeError, match="needs export_dir"):
        export_hf_checkpoint(model, torch.float32)
    with pytest.raises(TypeError, match="both positionally and by keyword"):
        export_hf_checkpoint(model, tmp_path / "x", export_dir=tmp_path / "y")
    with pytest.raises(NotImplementedError, match="save_modelopt_state"):
        export_hf_checkpoint(model, torch.float32, tmp_path / "st", save_modelopt_state=True)


def test_enable_disable_take_filter_functions_and_summary_writes_output_dir(tmp_path):
    model = _int8_model()
    assert mtq.disable_quantizer(model, lambda name: name.endswith("down_proj.input_quantizer")) == 1
    assert not model.model.layers[0].mlp.down_proj.input_quantizer.is_enabled
    assert mtq.enable_quantizer(model, lambda name: "down_proj.input" in name) == 1
    text = mtq.print_quant_summary(model, output_dir=tmp_path / "summary")
    assert (tmp_path / "summary" / ".quant_summary.txt").read_text() == text + "\n"
    q = model.model.layers[0].mlp.down_proj.weight_quantizer
    mtq.fold_weight(model, keep_attrs=True)
    assert not q.is_enabled
    assert q.amax is not None
