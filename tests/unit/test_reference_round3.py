"""Model-Optimizer drop-in, third round: the reference's documented usage of each behaviour that used to
differ (replace_quant_module without calibration, a forward replaced on the instance, integer widths above
8, max_calibrate's options, SVDQuant's factor properties, folding a disabled weight quantizer that still
scales its weight, the query quantizer of KV attention). Expected values are written out here by hand."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelopt_lite.quantization as mtq
from modelopt_lite.nn import QUANT_MODULES
from modelopt_lite.quantization.config import QuantizerAttributeConfig
from modelopt_lite.quantization.model_calib import max_calibrate
from modelopt_lite.quantization.nn import TensorQuantizer

from ._models import batches, tiny_llama

X: torch.Tensor = torch.empty(0)  # each test's input, set by _fresh_input


@pytest.fixture(autouse=True)
def _fresh_input():
    """A new input per test, freed after it: a module-level tensor would keep the quantizers' shared outputs
    (keyed by the input, released with it) alive for the rest of the session."""
    global X
    X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    yield
    X = torch.empty(0)


def _int8_per_tensor(x: torch.Tensor) -> torch.Tensor:
    """INT8 with the tensor's own amax: clamp(round(x * 127 / amax), -128, 127) * amax / 127."""
    scale = torch.tensor(127.0) / x.abs().amax()
    return torch.clamp(torch.round(x * scale), -128, 127) / scale


def _int8_per_row(w: torch.Tensor) -> torch.Tensor:
    scale = torch.tensor(127.0) / w.abs().amax(dim=1, keepdim=True)
    return torch.clamp(torch.round(w * scale), -128, 127) / scale


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


# ---------------------------------------------------------------- 1. replace_quant_module, no calibration
def test_replace_quant_module_then_forward_quantizes_each_input_with_its_own_amax():
    model = _net()
    mtq.replace_quant_module(model)
    first = model[0]
    with torch.no_grad():
        out = first(X)
    expected = F.linear(_int8_per_tensor(X), _int8_per_row(first.weight), first.bias)
    assert torch.equal(out, expected)
    assert first.input_quantizer.amax is None  # nothing was calibrated


def test_replace_quant_module_then_calibrate_gives_calibrated_quantizers():
    model = _net()
    mtq.replace_quant_module(model)
    mtq.calibrate(model, "max", lambda m: m(X))
    assert model[0].input_quantizer.amax == X.abs().amax()


# ---------------------------------------------------------------- 2. a forward replaced on the instance
def test_quantize_runs_the_quantizers_around_a_forward_replaced_on_the_instance():
    lin = nn.Linear(8, 8)
    called = []

    def patched(x):  # a closure, as runtime patching libraries set it
        called.append(x)
        return F.linear(x, lin.weight, lin.bias)

    lin.forward = patched
    mtq.quantize(lin, mtq.INT8_DEFAULT_CFG, lambda m: m(X))
    assert len(called) == 1
    assert lin.input_quantizer.amax == X.abs().amax()
    with torch.no_grad():
        out = lin(X)
    amax = X.abs().amax()
    xq = torch.clamp(torch.round(X * (torch.tensor(127.0) / amax)), -128, 127) / (torch.tensor(127.0) / amax)
    assert torch.equal(called[-1], xq)  # the replacement got the quantized input ...
    assert torch.equal(out, F.linear(xq, _int8_per_row(lin.weight), lin.bias))  # ... and weight
    assert "weight" not in lin.__dict__  # (only inside the call)
    QUANT_MODULES.revert(lin)
    assert type(lin) is nn.Linear
    assert lin.forward is patched


def test_a_replaced_forward_that_calls_the_class_forward_does_not_recurse():
    lin = nn.Linear(8, 8)
    lin.forward = lambda x: nn.Linear.forward(lin, x) * 2
    mtq.quantize(lin, mtq.INT8_DEFAULT_CFG, lambda m: m(X))
    with torch.no_grad():
        out = lin(X)
    xq = _int8_per_tensor(X)
    assert torch.allclose(out, 2 * F.linear(xq, _int8_per_row(lin.weight), lin.bias))


# ---------------------------------------------------------------- 3. integer widths, FP4 without scales
@pytest.mark.parametrize("bits", [11, 13, 16])
def test_integer_widths_above_8_quantize_on_their_grid(bits):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=bits))
    out = q(x)
    max_bound = 2 ** (bits - 1) - 1
    scale = torch.tensor(float(max_bound)) / x.abs().amax()
    assert torch.equal(out, torch.clamp(torch.round(x * scale), -max_bound - 1, max_bound) / scale)


def test_integer_widths_outside_2_to_16_are_refused():
    with pytest.raises(ValueError, match=r"allowed: 2\.\.16"):
        QuantizerAttributeConfig(num_bits=17)
    with pytest.raises(ValueError, match=r"allowed: 2\.\.16"):
        QuantizerAttributeConfig(num_bits=1)


@pytest.mark.parametrize("blocks", [None, {-1: 16}])
def test_fp4_without_scale_bits_is_refused_naming_the_reference_behaviour(blocks):
    with pytest.raises(ValueError, match=r"NotImplementedError.*scale_bits': \(4, 3\)"):
        QuantizerAttributeConfig(num_bits=(2, 1), block_sizes=blocks)


# ---------------------------------------------------------------- 5. max_calibrate's options
def test_max_calibrate_takes_the_reference_options():
    model = _net()
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(X))
    max_calibrate(
        model, lambda m: m(2 * X), distributed_sync=False, skip_forward_without_activation_calib=True
    )
    assert model[0].input_quantizer.amax == (2 * X).abs().amax()
    mtq.calibrate(model, {"method": "max", "distributed_sync": False}, lambda m: m(X))
    mtq.calibrate(model, {"method": "mse", "distributed_sync": False}, lambda m: m(X))
    with pytest.raises(NotImplementedError, match="sync_expert_weight_amax"):
        max_calibrate(model, lambda m: m(X), sync_expert_weight_amax=True)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['bogus'\]"):
        max_calibrate(model, lambda m: m(X), bogus=1)


# ---------------------------------------------------------------- 6. SVDQuant's factors as properties
def test_svdquant_lora_properties_read_and_set_the_branch():
    lin = nn.Linear(8, 8)
    mtq.quantize(lin, mtq.INT8_DEFAULT_CFG, lambda m: m(X))
    q = lin.weight_quantizer
    assert q.svdquant_lora_a is None
    assert q.svdquant_lora_b is None
    a, b = torch.randn(2, 8), torch.randn(8, 2)
    with torch.no_grad():
        base = lin(X)
        q.svdquant_lora_a = a
        assert torch.equal(lin(X), base)  # one factor alone is no branch yet
        q.svdquant_lora_b = b
        assert torch.allclose(lin(X), base + X @ a.t() @ b.t(), atol=1e-6)
    assert torch.equal(q.svdquant_lora_a, a)
    assert "weight_quantizer._svdquant_lora_b" in lin.state_dict()
    with pytest.raises(AssertionError, match="cannot be set to None"):
        q.svdquant_lora_a = None
    with pytest.raises(RuntimeError, match="not allowed"):
        q.svdquant_lora_a = torch.zeros(3, 8)


# ---------------------------------------------------------------- 7. folding a weight pre_quant_scale
@pytest.mark.parametrize("enabled", [True, False])
def test_fold_bakes_a_weight_pre_quant_scale_in_once(enabled):
    lin = nn.Linear(8, 8)
    mtq.quantize(lin, mtq.INT8_DEFAULT_CFG, lambda m: m(X))
    scale = torch.linspace(0.5, 1.5, 8)
    lin.weight_quantizer.pre_quant_scale = scale
    if not enabled:
        lin.weight_quantizer.disable()
    w = lin.weight.detach().clone()
    step = torch.tensor(127.0) / lin.weight_quantizer.amax  # (calibrated on the weight before scaling)
    folded = torch.clamp(torch.round(w * scale * step), -128, 127) / step if enabled else w * scale
    with torch.no_grad():
        before = lin(X)
        with mtq.temporarily_fold_weights(lin):
            assert torch.allclose(lin.weight, folded, atol=1e-6)  # baked in ...
            assert torch.allclose(lin(X), before, atol=1e-6)  # ... and applied once
        assert torch.equal(lin.weight, w)
        assert torch.equal(lin.weight_quantizer.pre_quant_scale, scale)
        assert lin.weight_quantizer.is_enabled is enabled
        assert torch.equal(lin(X), before)
        mtq.fold_weight(lin)
        assert torch.allclose(lin(X), before, atol=1e-6)
    assert lin.weight_quantizer.pre_quant_scale is None
    assert not lin.weight_quantizer.is_enabled


# ---------------------------------------------------------------- 11. the query quantizer of KV attention
def test_q_bmm_quantizer_is_on_and_calibrated_unless_a_rule_turns_it_off():
    model = tiny_llama(layers=1)
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
            {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8, "axis": None}},
        ],
        "algorithm": "max",
    }
    mtq.quantize(model, cfg, batches(1))
    attn = model.model.layers[0].self_attn
    for slot in ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer"):
        q = getattr(attn, slot)
        assert q.is_enabled, slot
        assert q.amax is not None, slot
    assert not attn.p_bmm_quantizer.is_enabled  # (off until a rule enables it; it runs eager attention)
    model = tiny_llama(layers=1)
    mtq.quantize(
        model,
        mtq.update_quant_cfg_with_kv_cache_quant(mtq.FP8_DEFAULT_CFG, mtq.FP8_KV_CFG["quant_cfg"]),
        batches(1),
    )
    attn = model.model.layers[0].self_attn  # the presets start with {"quantizer_name": "*", "enable": False}
    assert not attn.q_bmm_quantizer.is_enabled
    assert attn.k_bmm_quantizer.is_enabled
