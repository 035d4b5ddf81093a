"""A list of calibration algorithms (``mtq.calibrate(model, ["smoothquant", "max"], loop)``, or the same list
as a config's ``algorithm``) runs each one in order on the same data, as the reference does."""

from __future__ import annotations

import importlib

import pytest
import torch

import modelopt_lite.quantization as mtq

from ._models import batches, tiny_llama

INT8 = mtq.get_preset("INT8_DEFAULT_CFG")
calibrate_module = importlib.import_module(
    "modelopt_lite.quantization.calibration.calibrate"
)  # not mtq.calibrate


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def calls(monkeypatch):
    """Records (name, options) of every algorithm run, running it as well."""
    seen: list[tuple[str, dict]] = []
    registry = dict(calibrate_module._ALGORITHMS)
    for name, fn in registry.items():
        monkeypatch.setitem(
            calibrate_module._ALGORITHMS,
            name,
            lambda m, loop, _n=name, _f=fn, **o: (seen.append((_n, o)), _f(m, loop, **o))[1],
        )
    return seen


def test_calibrate_runs_a_list_in_order_like_successive_calls(calls):
    data = batches()
    listed = mtq.quantize(tiny_llama(), INT8, data)
    mtq.calibrate(listed, ["smoothquant", {"method": "max"}], data)
    assert calls[-2:] == [("smoothquant", {}), ("max", {})]

    one_by_one = mtq.quantize(tiny_llama(), INT8, data)
    mtq.calibrate(one_by_one, "smoothquant", data)
    mtq.calibrate(one_by_one, "max", data)
    plain = mtq.quantize(tiny_llama(), INT8, data)
    mtq.calibrate(plain, "max", data)
    expected, got = _state(one_by_one), _state(listed)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    q_proj = listed.model.layers[0].self_attn.q_proj
    assert q_proj.input_quantizer.pre_quant_scale is not None  # smoothquant ran
    assert not torch.equal(q_proj.weight, plain.model.layers[0].self_attn.q_proj.weight)


def test_a_config_may_list_its_algorithms(calls):
    cfg = {**INT8, "algorithm": ["max", {"method": "smoothquant", "alpha": 0.5}]}
    typed = mtq.QuantizeConfig.from_dict(cfg)
    assert typed.to_dict()["algorithm"] == cfg["algorithm"]
    assert typed.algorithm_steps == [("max", {}), ("smoothquant", {"alpha": 0.5})]
    assert typed.algorithm_name == "max + smoothquant"
    assert mtq.need_calibration(cfg)
    weight_only = {**mtq.get_preset("INT4_BLOCKWISE_WEIGHT_ONLY_CFG"), "algorithm": ["max", None]}
    assert not mtq.need_calibration(weight_only)
    mtq.quantize(tiny_llama(), cfg, batches())
    assert calls == [("max", {}), ("smoothquant", {"alpha": 0.5})]


def test_a_bad_entry_fails_before_anything_runs(calls):
    model = mtq.quantize(tiny_llama(), INT8, batches())
    before = _state(model)
    calls.clear()
    with pytest.raises(ValueError, match="unknown calibration algorithm 'nope'"):
        mtq.calibrate(model, ["smoothquant", "nope"], batches())
    with pytest.raises(TypeError, match="a list of these"):
        mtq.calibrate(model, ["max", ["max"]], batches())
    with pytest.raises(ValueError, match="unknown"):
        mtq.QuantizeConfig.from_dict({**INT8, "algorithm": ["max", "nope"]})
    assert calls == []
    assert all(torch.equal(before[k], v) for k, v in _state(model).items())
