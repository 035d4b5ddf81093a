"""Model-Optimizer's documented quantizer usage, round 3 (issue 46): a sequential (list ``cfg``) activation
quantizer, and the shape of a block amax over several axes. Each expectation is the reference's behaviour
(checked against nvidia-modelopt 0.47 on the same snippets); the expected values are written here by hand or
with plain torch expressions."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint
from modelopt_lite.quantization import QuantizerAttributeConfig
from modelopt_lite.quantization.nn import SequentialQuantizer, TensorQuantizer

INT8_THEN_FP8 = [{"num_bits": 8, "axis": None}, {"num_bits": (4, 3), "axis": None}]


def _int8(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    scale = torch.tensor(127.0) / amax  # (a true division: ``127.0 / amax`` multiplies by a reciprocal)
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


# ----------------------------------------------------------- item 8: the shape of a block amax
def _calibrated(block_sizes, x, num_bits=8):
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=num_bits, block_sizes=block_sizes))
    q.enable_calib()
    q.disable_quant()
    q(x)
    q.load_calib_amax()
    q.enable_quant()
    q.disable_calib()
    return q


@pytest.mark.parametrize(
    ("shape", "block_sizes", "view", "reduced", "amax_shape"),
    [
        # several axes: each blocked axis split into (blocks, block), the block dimensions reduced
        ((2, 8, 3, 3), {-1: 3, -3: 4}, (2, 2, 4, 3, 1, 3), (2, 5), (2, 2, 1, 3, 1, 1)),
        ((256, 384), {-1: 128, -2: 128}, (2, 128, 3, 128), (1, 3), (2, 1, 3, 1)),
        ((4, 6, 8), {-1: 4, -2: 3}, (4, 2, 3, 2, 4), (2, 4), (4, 2, 1, 2, 1)),
        # one axis that is not the last: the same rule
        ((2, 8, 3, 3), {-2: 3}, (2, 8, 1, 3, 3), (3,), (2, 8, 1, 1, 3)),
        ((4, 6, 8), {1: 3}, (4, 2, 3, 8), (2,), (4, 2, 1, 8)),
        # whole axes (size None): a per-channel amax
        ((4, 6, 8), {-1: None}, (4, 6, 8), (2,), (4, 6, 1)),
    ],
)
def test_block_amax_keeps_the_references_shape(shape, block_sizes, view, reduced, amax_shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    q = _calibrated(block_sizes, x)
    expected = x.reshape(view).abs().amax(dim=reduced, keepdim=True)
    assert tuple(q.amax.shape) == amax_shape
    assert torch.equal(q.amax, expected.reshape(amax_shape))
    # the forward quantizes each block with its amax (the amax broadcast over the block view)
    assert torch.equal(q(x), _int8(x.reshape(view), expected).reshape(shape))


def test_block_amax_along_the_last_axis_stays_flat():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 3, 3)
    q = _calibrated({-1: 3}, x)
    assert tuple(q.amax.shape) == (48, 1)
    assert torch.equal(q.amax, x.abs().reshape(48, 3).amax(1, keepdim=True))


def test_padded_2d_blocks_and_a_hand_set_amax_in_the_references_shape():
    torch.manual_seed(0)
    x = torch.randn(200, 300)
    q = _calibrated({-1: 128, -2: 128}, x, num_bits=(4, 3))
    assert tuple(q.amax.shape) == (2, 1, 3, 1)
    padded = F.pad(x, (0, 84, 0, 56)).reshape(2, 128, 3, 128)
    assert torch.equal(q.amax, padded.abs().amax(dim=(1, 3), keepdim=True))
    amax = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0, 5.0]).reshape(2, 1, 3, 1)  # one per block, by hand
    q.amax = amax
    expected = _fp8(padded, amax).reshape(256, 384)[:200, :300]
    assert torch.equal(q(x), expected)


def test_fp8_2d_blockwise_weight_amax_has_the_references_shape_and_survives_save_restore(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(384, 256))
    mtq.quantize(model, mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG, lambda m: m(torch.randn(2, 384)))
    wq, w = model[0].weight_quantizer, model[0].weight.detach()
    expected = w.reshape(2, 128, 3, 128).abs().amax(dim=(1, 3), keepdim=True)
    assert tuple(wq.amax.shape) == (2, 1, 3, 1)
    assert torch.equal(wq.amax, expected)
    x = torch.randn(3, 384)
    with torch.no_grad():
        want = F.linear(x, _fp8(w.reshape(2, 128, 3, 128), expected).reshape(256, 384), model[0].bias)
        assert torch.equal(model(x), want)
    mto.save(model, tmp_path / "m.safetensors")
    again = nn.Sequential(nn.Linear(384, 256))
    mto.restore(again, tmp_path / "m.safetensors")
    assert tuple(again[0].weight_quantizer.amax.shape) == (2, 1, 3, 1)
    with torch.no_grad():
        assert torch.equal(again(x), want)


def _rewrite_as_flat(path, flat):
    """Rewrite a saved model as releases before issue 46 saved it: each given block amax flat."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    state = json.loads(metadata["modelopt_lite_state"])
    for qname, amax in flat.items():
        tensors[f"{qname}._amax"] = amax
        state["quantizers"][qname]["buffers"]["_amax"] = list(amax.shape)
    save_file(tensors, str(path), metadata={**metadata, "modelopt_lite_state": json.dumps(state)})


def test_a_flat_block_amax_of_an_earlier_release_is_restored_in_the_references_shape(tmp_path):
    torch.manual_seed(0)
    batches = [torch.randn(4, 16) for _ in range(2)]
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "block_sizes": {-2: 4}}},
            {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8, "block_sizes": {-2: 2}}},
        ],
        "algorithm": "max",
    }
    model = nn.Sequential(nn.Linear(16, 8))
    mtq.quantize(model, cfg, lambda m: [m(b) for b in batches])
    wq, iq = model[0].weight_quantizer, model[0].input_quantizer
    w = model[0].weight.detach()
    assert tuple(wq.amax.shape) == (2, 1, 16)  # (8, 16) in blocks of 4 rows
    assert tuple(iq.amax.shape) == (2, 1, 16)  # (4, 16) in blocks of 2 rows
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = model(x)
    path = mto.save(model, tmp_path / "m.safetensors")
    # the earlier layout: blocks numbered along the unblocked axis first (column, then row block)
    old_w = w.abs().t().reshape(16, 2, 4).amax(-1).reshape(32, 1)
    old_i = torch.stack([b.abs().t().reshape(16, 2, 2).amax(-1) for b in batches]).amax(0).reshape(32, 1)
    _rewrite_as_flat(path, {"0.weight_quantizer": old_w, "0.input_quantizer": old_i})
    again = nn.Sequential(nn.Linear(16, 8))
    mto.restore(again, path)
    assert tuple(again[0].weight_quantizer.amax.shape) == (2, 1, 16)  # converted on restore
    assert torch.equal(again[0].weight_quantizer.amax, wq.amax)
    with torch.no_grad():
        assert torch.equal(again(x), want)  # the input's amax converted in its first forward
    assert torch.equal(again[0].input_quantizer.amax, iq.amax)
