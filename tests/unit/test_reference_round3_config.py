"""The reference library's documented config, recipe and error behaviour, written out as a user of it writes
it (issue 46): the older flat ``quant_cfg`` dict in ``QuantizeConfig``, malformed ``quant_cfg`` entries, the
error types and key phrases that ``pytest.raises(..., match=...)`` / ``except`` clauses written for the
reference look for, and the reference's recipe names."""

import pytest
import torch
from pydantic import ValidationError

import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq
from modelopt_lite.quantization import tensor_quant
from modelopt_lite.quantization.nn import TensorQuantizer

from ._models import batches, tiny_llama


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
