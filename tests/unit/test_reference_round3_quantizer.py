"""Model-Optimizer's documented quantizer usage, round 3 (issue 46): a sequential (list ``cfg``) activation
quantizer, and the shape of a block amax over several axes. Each expectation is the reference's behaviour
(checked against nvidia-modelopt 0.47 on the same snippets); the expected values are written here by hand or
with plain torch expressions."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint
from modelopt_lite.quantization.nn import SequentialQuantizer

INT8_THEN_FP8 = [{"num_bits": 8, "axis": None}, {"num_bits": (4, 3), "axis": None}]


def _int8(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    scale = 127.0 / amax
    return torch.clamp(torch.round(x * scale), -128, 127) / scale


def _fp8(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    scale = torch.reciprocal(amax) * 448.0
    return torch.clamp(x * scale, -448.0, 448.0).to(torch.float8_e4m3fn).float() * torch.reciprocal(scale)


# ----------------------------------------------------------- item 9: a sequential activation quantizer
def _sequential_input_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    batches = [torch.randn(4, 16) * 3 for _ in range(3)]
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*input_quantizer", "cfg": INT8_THEN_FP8},
        ],
        "algorithm": "max",
    }
    mtq.quantize(model, cfg, lambda m: [m(b) for b in batches])
    return model, batches


def test_sequential_input_quantizer_calibrates_every_stage_on_the_raw_input():
    model, batches = _sequential_input_model()
    first = model[0].input_quantizer
    assert isinstance(first, SequentialQuantizer)
    assert isinstance(first, nn.Sequential)
    assert [type(q).__name__ for q in first] == ["TensorQuantizer"] * 2
    raw = torch.stack([b.abs().amax() for b in batches]).amax()
    # both stages saw the raw input (fake quant is off during calibration), not stage 0's output
    assert [q.amax.shape for q in first] == [torch.Size([]), torch.Size([])]
    assert torch.equal(first[0].amax, raw)
    assert torch.equal(first[1].amax, raw)
    with torch.no_grad():  # the second layer's input in calibration: the first layer ran unquantized
        hidden = [F.relu(F.linear(b, model[0].weight, model[0].bias)) for b in batches]
        second = torch.stack([h.abs().amax() for h in hidden]).amax()
    assert torch.equal(model[2].input_quantizer[0].amax, second)
    assert first.amax is first[0].amax  # the reference's delegation: the first stage's amax


def test_sequential_input_quantizer_forward_is_int8_then_fp8():
    model, _ = _sequential_input_model()
    layer, q = model[0], model[0].input_quantizer
    x = torch.randn(5, 16) * 2
    expected = _fp8(_int8(x, q[0].amax), q[1].amax)
    with torch.no_grad():
        assert torch.equal(q(x), expected)
        assert torch.equal(layer(x), F.linear(expected, layer.weight, layer.bias))


def test_sequential_amax_setter_sets_every_stage_and_refuses_none():
    model, _ = _sequential_input_model()
    q = model[0].input_quantizer
    q.amax = 2.5
    assert [float(s.amax) for s in q] == [2.5, 2.5]
    x = torch.linspace(-3, 3, 16).reshape(1, 16)
    assert torch.equal(q(x), _fp8(_int8(x, torch.tensor(2.5)), torch.tensor(2.5)))
    with pytest.raises(ValueError, match="reset_amax"):
        q.amax = None
    assert [float(s.amax) for s in q] == [2.5, 2.5]
    q.fake_quant = True  # delegated too
    assert all(s.fake_quant for s in q)


def test_sequential_input_quantizer_export_refuses_naming_it(tmp_path):
    model, _ = _sequential_input_model()
    mtq.set_quantizer_by_cfg(model, {"*weight_quantizer": {"num_bits": (4, 3), "axis": None, "enable": True}})
    for layer in (model[0], model[2]):
        layer.weight_quantizer.calibrate(layer.weight.detach())
    with pytest.raises(ValueError, match=r"0: the input quantizer is sequential \(int8 per-tensor -> fp8"):
        export_hf_checkpoint(model, export_dir=tmp_path / "export")
