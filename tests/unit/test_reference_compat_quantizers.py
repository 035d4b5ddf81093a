"""Model-Optimizer's documented quantizer / calibrator usage, run with only the import lines changed:
hand-built quantizers without an amax, the calibrators' constructors, a pinned amax (``constant_amax`` /
``use_constant_amax``), ``set_from_attribute_config`` and friends, ``tensor_quant``'s autograd functions and
custom calibrator classes in a config. Each expectation is the reference's behaviour (checked against
nvidia-modelopt 0.47 on the same snippets)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq
from modelopt_lite.quantization import QuantizerAttributeConfig, calib, tensor_quant
from modelopt_lite.quantization.nn import QuantLinear, SequentialQuantizer, TensorQuantizer

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}


def _int8(x, amax):  # the reference's TensorQuantizer INT8 default: full range
    return tensor_quant.fake_tensor_quant(x, amax, None, 8, False, False)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _batches():
    torch.manual_seed(1)
    return [torch.randn(4, 16) for _ in range(3)]


# ---------------------------------------------------------------- a static quantizer without an amax (item 2)
def test_hand_built_quant_linear_quantizes_with_the_inputs_own_amax():
    torch.manual_seed(0)
    layer = QuantLinear(16, 8)
    x = torch.randn(4, 16)
    w = layer.weight.detach()
    per_row = w.abs().amax(dim=1, keepdim=True)  # the reference's default weight descriptor: axis=0
    expected = F.linear(_int8(x, x.abs().amax()), _int8(w, per_row), layer.bias)
    assert torch.equal(layer(x), expected)
    assert "amax=dynamic" in repr(layer.input_quantizer)
    assert layer.input_quantizer.amax is None  # nothing is stored: the next input brings its own


@pytest.mark.parametrize(
    ("cfg", "shape", "reduce"),
    [
        ({}, (3, 7), None),
        ({"num_bits": 8, "axis": 0}, (5, 5, 4, 8), (1, 2, 3)),
        ({"num_bits": (4, 3)}, (6, 9), None),
    ],
)
def test_hand_built_tensor_quantizer_matches_its_own_calibration(cfg, shape, reduce):
    x = torch.randn(*shape)
    quantizer = TensorQuantizer(QuantizerAttributeConfig(**cfg))
    out = quantizer(x)
    if not cfg:  # the reference's test_simple_run
        assert torch.allclose(out, tensor_quant.fake_tensor_quant(x, x.abs().max(), None))
    if reduce is not None:
        assert torch.equal(out, _int8(x, x.abs().amax(dim=reduce, keepdim=True)))
    calibrated = TensorQuantizer(QuantizerAttributeConfig(**cfg)).calibrate(x)
    assert torch.equal(out, calibrated(x))
    block = TensorQuantizer(QuantizerAttributeConfig(num_bits=4, block_sizes={-1: 4}))
    a = torch.randn(4, 6, 8)
    assert torch.equal(
        block(a), TensorQuantizer(QuantizerAttributeConfig(num_bits=4, block_sizes={-1: 4})).calibrate(a)(a)
    )


def test_quantizers_that_mtq_inserts_still_raise_until_calibrated():
    model = mtq.quantize(_model(), mtq.INT8_DEFAULT_CFG, skip_calibration=True)
    with pytest.raises(RuntimeError, match=r"0\.input_quantizer: int8 per-tensor has no amax"):
        model(torch.randn(2, 16))
    assert "amax=None" in repr(model[0].input_quantizer)
    mtq.calibrate(model, "max", _batches())
    assert model(torch.randn(2, 16)).shape == (2, 8)
    model[0].input_quantizer.reset_amax()
    with pytest.raises(RuntimeError, match="has no amax"):
        model(torch.randn(2, 16))


# ---------------------------------------------------------------- calibrator constructors (item 3)
def test_max_calibrator_takes_the_reference_positional_arguments():
    x_1, x_2 = torch.rand(16), torch.rand(16)
    max_calibrator = calib.MaxCalibrator(8, None, False)
    max_calibrator.collect(x_1)
    max_calibrator.collect(x_2)
    assert torch.equal(max_calibrator.compute_amax(), torch.max(x_1.max(), x_2.max()))
    calib.MaxCalibrator(8, None, True)  # unsigned
    for axis in (0, -4):
        per_channel = calib.MaxCalibrator(8, axis, False)
        a, b = torch.rand(3, 4, 2, 2), torch.rand(3, 4, 2, 2)
        per_channel.collect(a)
        per_channel.collect(b)
        assert per_channel.compute_amax().shape[0] == 3
        assert torch.equal(per_channel.compute_amax().flatten(), torch.max(a, b).amax(dim=(1, 2, 3)))
        per_channel.reset()
        assert per_channel.compute_amax() is None
    tracked = calib.MaxCalibrator(8, None, False, track_amax=True)
    tracked.collect(x_1)
    tracked.collect(x_2)
    assert [float(a) for a in tracked.amaxs] == [float(x_1.max()), float(x_2.max())]
    changing = calib.MaxCalibrator(8, 0, False)
    changing.collect(torch.rand(3, 4, 2, 2))
    with pytest.raises(RuntimeError, match="shape changed"):
        changing.collect(torch.rand(4, 4, 2, 2))


def test_histogram_calibrator_takes_the_reference_arguments():
    zeros = calib.HistogramCalibrator(8, None, False, num_bins=2048, skip_zeros=True)
    zeros.collect(torch.tensor([0, 0, 0, 0, 0, 1, 2, 3, 4, 5.0]))
    zeros.collect(torch.tensor([0, 0, 0, 0, 0, 6, 7, 8, 9, 10.0]))
    amax = zeros.compute_amax("percentile", percentile=50, start_bin=128)
    assert abs(float(amax) - 5.0) < 10 / 2048  # the zeros are left out of the histogram
    counted = calib.HistogramCalibrator(8, None, False, 2048, None, False, True)
    counted.collect(torch.tensor([0, 0, 0, 0, 0, 1, 2, 3, 4, 5.0]))
    assert float(counted.compute_amax("percentile", percentile=50)) < 1.0  # with the zeros
    calib.HistogramCalibrator(8, None, False, num_bins=19, grow_method="append", torch_hist=False)
    with pytest.raises(NotImplementedError, match="per-tensor"):
        calib.HistogramCalibrator(8, 0, False)


def test_histogram_calibrator_named_by_a_quantizer_config():
    quantizer = TensorQuantizer(
        QuantizerAttributeConfig(calibrator="histogram"), if_calib=True, if_quant=False
    )
    x_1, x_2 = torch.rand(3, 6, 7, 7), torch.rand(3, 6, 7, 7)
    quantizer(x_1)
    quantizer(x_2)
    quantizer.load_calib_amax("entropy")
    assert torch.equal(quantizer.calibrator.compute_amax("entropy"), quantizer.amax)
    quantizer.load_calib_amax("percentile", percentile=99.99)
    assert torch.equal(quantizer.calibrator.compute_amax("percentile", percentile=99.99), quantizer.amax)


# ---------------------------------------------------------------- a pinned amax (item 6)
def test_constant_amax_pins_the_amax_for_forward_and_state():
    tq = TensorQuantizer(QuantizerAttributeConfig(**NVFP4, constant_amax=2688.0))
    assert float(tq.amax) == 2688.0
    assert float(tq.state_dict()["_amax"]) == 2688.0
    x = torch.randn(4, 32)
    expected = tensor_quant.dynamic_block_quant(x, 16, torch.tensor(2688.0), None, (2, 1), (4, 3))
    assert torch.equal(tq(x), expected)
    assert float(tq.amax) / (6 * 448) == 1.0  # the exported input_scale
    tq.calibrate(x * 100)  # calibration leaves it
    tq.load_calib_amax()
    assert float(tq.amax) == 2688.0
    assert TensorQuantizer(QuantizerAttributeConfig(**NVFP4)).amax is None


def test_use_constant_amax_quantizes_with_448():
    x = torch.randn(4, 8) * 300
    tq = TensorQuantizer(QuantizerAttributeConfig(num_bits=8, use_constant_amax=True))
    assert tq.use_constant_amax is True
    assert torch.equal(tq(x), _int8(x, torch.tensor(448.0)))
    fp8 = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), use_constant_amax=True))
    assert torch.equal(fp8(x), tensor_quant.scaled_e4m3(x, torch.tensor(448.0)))


def test_constant_amax_quantizers_are_not_calibrated_and_need_no_data():
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
            {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8, "constant_amax": 3.0}},
        ],
        "algorithm": "max",
    }
    assert not mtq.need_calibration(cfg)
    model = mtq.quantize(_model(), cfg)  # no forward_loop: nothing collects data
    assert float(model[0].input_quantizer.amax) == 3.0
    w = model[0].weight.detach()
    assert torch.equal(model[0].weight_quantizer.amax, w.abs().amax(dim=1, keepdim=True))
    with_data = mtq.quantize(_model(), cfg, _batches())
    assert float(with_data[2].input_quantizer.amax) == 3.0
    cfg["quant_cfg"][2]["cfg"] = {"num_bits": 8}
    assert mtq.need_calibration(cfg)


@pytest.mark.parametrize("value", [-1.0, 0.0, math.inf, math.nan])
def test_constant_amax_that_is_not_positive_and_finite_is_refused(value):
    with pytest.raises(ValueError, match="constant_amax must be a positive value"):
        QuantizerAttributeConfig(**NVFP4, constant_amax=value)
    with pytest.raises(ValueError, match="constant_amax must be a positive value"):
        TensorQuantizer("q", num_bits=8, constant_amax=value)


def test_constant_amax_combinations_that_are_refused():
    with pytest.raises(ValueError, match="mutually exclusive"):
        QuantizerAttributeConfig(num_bits=8, use_constant_amax=True, constant_amax=2688.0)
    with pytest.raises(ValueError, match=r"per-channel\(axis=0\) has no single per-tensor amax"):
        QuantizerAttributeConfig(num_bits=8, axis=0, constant_amax=2.0)
    with pytest.raises(ValueError, match="mxfp8 block32 has no single per-tensor amax"):
        QuantizerAttributeConfig(
            num_bits=(4, 3),
            block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)},
            use_constant_amax=True,
        )


# ---------------------------------------------------------------- set_from_attribute_config, ... (item 7)
def test_set_from_attribute_config_and_step_size():
    tq = TensorQuantizer()
    tq.set_from_attribute_config({"num_bits": 4})
    assert tq.num_bits == 4
    tq.set_from_attribute_config({"axis": -1})
    assert tq.axis == -1
    assert tq.num_bits == 4
    tq.set_from_attribute_config({"enable": False})
    assert not tq.is_enabled
    tq.set_from_attribute_config(QuantizerAttributeConfig(num_bits=(4, 3)))  # a config sets everything
    assert tq.is_enabled
    assert tq.axis is None
    assert tq.num_bits == (4, 3)
    with pytest.raises(ValueError, match="num_bits=17"):
        tq.set_from_attribute_config({"num_bits": 17})
    quantizer = TensorQuantizer(QuantizerAttributeConfig(), amax=3.14)
    quantizer.amax = 0.577
    assert quantizer.step_size == 0.577 / 127.0
    assert TensorQuantizer(QuantizerAttributeConfig(num_bits=4, unsigned=True), amax=3.0).step_size == 0.2
    assert TensorQuantizer().step_size is None


def test_rotation_queries_and_disable_rotate():
    tq = TensorQuantizer(QuantizerAttributeConfig(num_bits=8, rotate={"enable": True, "mode": "rotate_back"}))
    assert tq.rotate_is_enabled
    assert tq.rotate_back_is_enabled
    assert not tq.rotate_is_fp32
    assert tq.rotate_block_size is None
    tq.disable_rotate()
    tq.disable_rotate()  # idempotent
    assert not tq.rotate_is_enabled
    assert not tq.rotate_back_is_enabled
    assert tq.rotate == {"enable": False, "mode": "rotate_back"}  # its other settings kept
    x = torch.randn(3, 8)
    assert torch.equal(tq(x), _int8(x, x.abs().amax()))  # quantized, not rotated
    plain = TensorQuantizer(QuantizerAttributeConfig(rotate=True))
    plain.set_from_attribute_config({"enable": False})  # as in the reference, this also stops the rotation
    assert not plain.rotate_is_enabled


def test_sequential_quantizer_convert_to_single_quantizer():
    layer = QuantLinear(16, 8)
    stages = [
        TensorQuantizer(QuantizerAttributeConfig(num_bits=4, block_sizes={-1: 8})),
        TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3))),
    ]
    layer.weight_quantizer = SequentialQuantizer(*stages)
    model = nn.Sequential(layer)
    with SequentialQuantizer.convert_to_single_quantizer(model):
        assert layer.weight_quantizer is stages[0]
        layer.weight_quantizer.calibrate(layer.weight)  # calibrate the first stage alone
    assert isinstance(layer.weight_quantizer, SequentialQuantizer)
    seen = []

    def raise_inside():
        with SequentialQuantizer.convert_to_single_quantizer(model, 1):
            seen.append(layer.weight_quantizer)
            raise KeyError("the block raised")

    with pytest.raises(KeyError):
        raise_inside()
    assert seen == [stages[1]]
    assert isinstance(layer.weight_quantizer, SequentialQuantizer)  # put back all the same
    assert torch.equal(layer.weight_quantizer.amax, stages[0].amax)
    layer.weight_quantizer.set_from_attribute_config({"enable": False})
    assert not layer.weight_quantizer.is_enabled


# ---------------------------------------------------------------- tensor_quant's autograd functions (item 8)
class _UsesTheFunctions:
    fake_quant = tensor_quant.fake_tensor_quant
    e4m3 = tensor_quant.scaled_e4m3
    blocks = tensor_quant.dynamic_block_quant
    int_cast = tensor_quant.int_cast_ste
    fp4_cast = tensor_quant.fp4_cast_ste
    static_fp4 = tensor_quant.static_blockwise_fp4_fake_quant


def test_tensor_quant_functions_are_autograd_function_apply():
    for name, cls in [
        ("fake_tensor_quant", tensor_quant.FakeTensorQuantFunction),
        ("scaled_e4m3", tensor_quant.ScaledE4M3Function),
        ("dynamic_block_quant", tensor_quant.DynamicBlockQuantizationFunction),
        ("int_cast_ste", tensor_quant.IntCastSTEFunction),
        ("fp4_cast_ste", tensor_quant.FP4CastSTEFunction),
        ("static_blockwise_fp4_fake_quant", tensor_quant.StaticBlockwiseFP4FakeQuantFunction),
    ]:
        assert issubclass(cls, torch.autograd.Function)
        assert getattr(tensor_quant, name) == cls.apply
    used = _UsesTheFunctions()  # stored as class attributes, they do not bind self
    x, amax = torch.randn(4, 32), torch.tensor(1.5)
    assert torch.equal(used.fake_quant(x, amax), tensor_quant.FakeTensorQuantFunction.apply(x, amax))
    assert torch.equal(used.fake_quant(x, amax, num_bits=4), tensor_quant.fake_quant_impl(x, amax, 4))
    assert torch.equal(used.e4m3(x, amax, None, 4, 3), tensor_quant.scaled_e4m3_impl(x, amax))
    assert used.blocks(x, 16, x.abs().amax(), None, (2, 1), (4, 3)).shape == x.shape
    assert torch.equal(used.int_cast(torch.tensor([-9.4, 200.0]), 8), torch.tensor([-9.0, 127.0]))
    assert torch.equal(used.fp4_cast(torch.tensor([0.7, 9.0])), torch.tensor([0.5, 6.0]))
    assert used.static_fp4(x, x.reshape(-1, 16).abs().amax(-1)).shape == x.shape


def test_tensor_quant_backward_clips_as_the_reference():
    x = torch.linspace(-4, 4, 33, requires_grad=True)
    tensor_quant.fake_tensor_quant(x, torch.tensor(3.0)).sum().backward()
    assert torch.equal(x.grad, (x.detach().abs() <= 3).float())
    x.grad = None
    tensor_quant.fake_tensor_quant(x, 3.0, pass_through_bwd=True).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    x.grad = None
    bias = torch.tensor(1.0)
    tensor_quant.scaled_e4m3(x, torch.tensor(2.0), bias, 4, 3).sum().backward()
    assert torch.equal(x.grad, ((x.detach() - 1).abs() <= 2).float())  # the centred input is clipped
    x.grad = None
    tensor_quant.int_cast_ste(x * 40, 8).sum().backward()
    assert torch.equal(x.grad, 40 * ((x.detach() * 40).abs() <= 127).float())
    w = torch.randn(2, 32, requires_grad=True)
    block_amax = w.detach().reshape(-1, 16).abs().amax(-1) / 2
    tensor_quant.static_blockwise_fp4_fake_quant(w, block_amax).sum().backward()
    inside = (w.detach().reshape(-1, 16).abs() <= block_amax[:, None]).reshape(2, 32)
    assert torch.equal(w.grad, inside.float())


# ---------------------------------------------------------------- custom calibrator classes (item 9)
class NewMaxCalibrator(calib.MaxCalibrator):
    def compute_amax(self):
        return 2 * self._calib_amax


def _custom_calib_cfg(calibrator):
    return {
        "quant_cfg": [
            {
                "quantizer_name": "*",
                "cfg": {"num_bits": 4, "axis": None, "calibrator": calibrator},
                "enable": True,
            },
            {"quantizer_name": "*output_quantizer", "enable": False},
        ],
        "algorithm": "max",
    }


def test_custom_calibrator_class_in_a_config(tmp_path):
    batches = _batches()
    model = mtq.quantize(_model(), _custom_calib_cfg((NewMaxCalibrator, (4, None, False))), batches)
    assert isinstance(model[0].input_quantizer.calibrator, NewMaxCalibrator)
    seen = torch.stack([b.abs().amax() for b in batches]).amax()
    assert torch.equal(model[0].input_quantizer.amax, 2 * seen)
    assert torch.equal(model[0].weight_quantizer.amax, 2 * model[0].weight.detach().abs().amax())
    json.dumps(mto.modelopt_state(model))  # recorded as "max": the amax values are what is saved
    path = mto.save(model, tmp_path / "m.safetensors")
    restored = mto.restore(_model(), path)
    x = torch.randn(2, 16)
    assert torch.equal(restored(x), model(x))
    keyword = mtq.quantize(_model(), _custom_calib_cfg((NewMaxCalibrator, (), {"num_bits": 4})), batches)
    assert torch.equal(keyword[0].input_quantizer.amax, 2 * seen)


@pytest.mark.parametrize("bad", [(dict, ()), nn.Linear, ("not a class", ())])
def test_custom_calibrator_that_is_not_a_calibrator_is_refused_by_name(bad):
    name = getattr(bad[0] if isinstance(bad, tuple) else bad, "__qualname__", "'not a class'")
    model = _model()
    # a bad config is pydantic's ValidationError (a ValueError), as in the reference
    with pytest.raises(ValueError, match=f"rule '\\*': calibrator={name} is not a calibrator class"):
        mtq.quantize(model, _custom_calib_cfg(bad), _batches())
    assert not any(isinstance(m, TensorQuantizer) for m in model.modules())  # refused before any change
    with pytest.raises(ValueError, match="is not a calibrator class"):  # (pydantic's ValidationError)
        QuantizerAttributeConfig(calibrator=bad)
    with pytest.raises(ValueError, match=r"q: calibrator=.* is not a calibrator class"):
        TensorQuantizer("q", calibrator=bad)
