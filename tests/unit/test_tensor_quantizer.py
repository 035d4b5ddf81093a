"""TensorQuantizer: attributes, calibration, state_dict, repr, and every bad input of the issue."""

import pytest
import torch

from modelopt_lite.formats import int_fake_quant, nvfp4_fake_quant
from modelopt_lite.nn import HistogramCalibrator, TensorQuantizer

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
MXFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}


def _calibrate(q, *batches):
    q.enable_calib()
    q.disable_quant()
    for b in batches:
        seen = b if q.pre_quant_scale is None else b * q.pre_quant_scale
        assert torch.equal(q(b), seen)  # calibration observes without quantizing
    q.load_calib_amax()
    q.disable_calib()
    q.enable_quant()


def test_max_calibration_per_channel_running_max():
    q = TensorQuantizer("w", num_bits=8, axis=0)
    a, b = torch.randn(4, 32), torch.randn(4, 32) * 3
    _calibrate(q, a, b)
    expect = torch.maximum(a.abs().amax(1, keepdim=True), b.abs().amax(1, keepdim=True))
    assert torch.equal(q.amax, expect)
    assert torch.equal(q(a), int_fake_quant(a, expect, 8))


def test_calibrate_from_a_tensor_matches_the_calibration_passes():
    w = torch.randn(8, 64)
    one_shot = TensorQuantizer("w", num_bits=4, block_sizes={-1: 16}).calibrate(w)
    passes = TensorQuantizer("w", num_bits=4, block_sizes={-1: 16})
    _calibrate(passes, w)
    assert torch.equal(one_shot.amax, passes.amax)
    assert TensorQuantizer("m", **MXFP4).calibrate(w).amax is None  # MX has no amax


def test_static_block_calibration_and_padding():
    q = TensorQuantizer("w", num_bits=4, block_sizes={-1: 128})
    w = torch.randn(8, 200)
    _calibrate(q, w)
    assert q.amax.shape == (16, 1)  # 8 rows x ceil(200 / 128) blocks
    assert q(w).shape == w.shape


def test_nvfp4_needs_calibrated_global_amax():
    q = TensorQuantizer("x", **NVFP4)
    x = torch.randn(4, 64)
    assert torch.equal(q(x), nvfp4_fake_quant(x, x.abs().amax()))  # built by hand: the input's own amax
    q.calibration_expected = True  # (as mtq.quantize marks the quantizers it inserts)
    with pytest.raises(RuntimeError, match="x: nvfp4 block16 has no amax"):
        q(x)
    _calibrate(q, x)
    assert torch.equal(q.amax, x.abs().amax())
    assert torch.equal(q(x), nvfp4_fake_quant(x, x.abs().amax()))


def test_mx_and_dynamic_need_no_calibration():
    x = torch.randn(4, 64)
    assert TensorQuantizer("m", **MXFP4)(x).shape == x.shape
    tok = TensorQuantizer("t", num_bits=(4, 3), block_sizes={-1: None, "type": "dynamic"})
    assert tok(x).shape == x.shape


def test_uncalibrated_static_quantizer_raises_and_no_data_raises():
    q = TensorQuantizer("layers.0.q_proj.input_quantizer", num_bits=8)
    q.calibration_expected = True
    with pytest.raises(RuntimeError, match=r"layers\.0\.q_proj\.input_quantizer.*has no amax"):
        q(torch.randn(3))
    q.enable_calib()
    with pytest.raises(RuntimeError, match="no data reached"):
        q.load_calib_amax()


def test_state_dict_round_trip_and_pre_quant_scale():
    q = TensorQuantizer("w", num_bits=4, block_sizes={-1: 16}, pre_quant_scale=torch.rand(32) + 0.5)
    w = torch.randn(4, 32)
    _calibrate(q, w)
    sd = q.state_dict()
    assert set(sd) == {"_amax", "_pre_quant_scale"}
    fresh = TensorQuantizer("w", num_bits=4, block_sizes={-1: 16})
    fresh.load_state_dict(sd)
    assert torch.equal(fresh(w), q(w))
    assert torch.equal(fresh.pre_quant_scale, q.pre_quant_scale)
    # pre_quant_scale is applied before quantization
    manual = int_fake_quant((w * q.pre_quant_scale).reshape(-1, 16), q.amax, 4).reshape(4, 32)
    assert torch.equal(q(w), manual)


def test_disable_enable_and_repr():
    q = TensorQuantizer("w", num_bits=8, axis=0)
    q.amax = torch.tensor([[1.0], [2.0]])
    assert repr(q) == "TensorQuantizer(int8 per-channel(axis=0) amax=[1, 2] (2, 1))"
    q.disable()
    x = torch.randn(2, 4)
    assert q(x) is x
    assert repr(q) == "TensorQuantizer(disabled)"
    q.enable()
    assert not torch.equal(q(x), x)
    assert repr(TensorQuantizer("n", **NVFP4)) == "TensorQuantizer(nvfp4 block16 amax=dynamic)"  # by hand
    expected = TensorQuantizer("n", **NVFP4)
    expected.calibration_expected = True
    assert repr(expected) == "TensorQuantizer(nvfp4 block16 amax=None)"
    assert "per-token(axis=-1) dynamic amax=dynamic" in repr(
        TensorQuantizer("t", num_bits=8, block_sizes={-1: None, "type": "dynamic"})
    )


def test_attribute_assignment_revalidates_and_drops_stale_amax():
    q = TensorQuantizer("w", num_bits=8)
    q.amax = 1.0
    q.num_bits = 4
    assert q.num_bits == 4
    assert q.amax is None
    with pytest.raises(ValueError, match="w: num_bits=17"):
        q.num_bits = 17
    assert q.num_bits == 4  # a rejected change leaves the quantizer as it was


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_bits": 17}, r"num_bits=17 .*allowed: 2\.\.16"),
        ({"num_bits": 1}, r"num_bits=1 .*allowed: 2\.\.16"),
        ({"num_bits": (3, 3)}, r"num_bits=\(3, 3\).*allowed"),
        ({"num_bits": "int8"}, r"num_bits='int8'"),
        ({"num_bits": 4, "block_sizes": {-1: 0}}, r"block_sizes\[-1\]=0 must be a positive int"),
        ({"num_bits": 4, "block_sizes": {-1: -16}}, r"block_sizes\[-1\]=-16"),
        ({"num_bits": 4, "block_sizes": {-1: 16, "type": "weird"}}, r"'type'.*allowed"),
        ({"num_bits": (4, 3), "block_sizes": {-1: 16, "scale_bits": (5, 5)}}, "scale_bits"),
        ({"num_bits": (4, 3), "unsigned": True}, "unsigned / narrow_range apply to integer"),
        ({"num_bits": 8, "axis": 0, "block_sizes": {-1: 16}}, "exclusive"),
        ({"num_bits": 8, "axis": "rows"}, r"axis='rows'"),
        ({"backward": "straight"}, r"backward='straight'.*allowed"),
        ({"calibrator": "kl"}, r"calibrator='kl'.*allowed"),
        ({"enable": "yes"}, r"enable='yes' must be True or False"),
        ({"nbits": 8}, r"unknown quantizer attribute\(s\) \['nbits'\]"),
    ],
)
def test_bad_attributes_raise_naming_quantizer_and_values(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        TensorQuantizer("model.layers.3.mlp.weight_quantizer", **kwargs)
    assert str(info.value).startswith("model.layers.3.mlp.weight_quantizer:")


def test_axis_out_of_range_raises_at_use():
    q = TensorQuantizer("w", num_bits=8, axis=3)
    q.enable_calib()
    with pytest.raises(ValueError, match=r"axis=3 is out of range for a 2-D input"):
        q(torch.randn(2, 2))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("calibrator", ["max", "percentile", "mse"])
def test_nan_inf_reaching_calibrator_raises(bad, calibrator):
    q = TensorQuantizer("decoder.input_quantizer", num_bits=8, calibrator=calibrator)
    x = torch.randn(16)
    x[3] = bad
    q.enable_calib()
    with pytest.raises(ValueError, match=r"decoder\.input_quantizer: 1 NaN / inf"):
        q(x)


def test_negative_input_to_unsigned_raises():
    q = TensorQuantizer("act", num_bits=8, unsigned=True)
    q.amax = 1.0
    with pytest.raises(ValueError, match="act: Negative values encountered"):
        q(torch.tensor([0.5, -0.1]))
    q.enable_calib()
    with pytest.raises(ValueError, match="act: Negative values encountered"):
        q(torch.tensor([-0.5]))


def test_bad_amax_values_raise():
    q = TensorQuantizer("w", num_bits=8)
    with pytest.raises(ValueError, match="amax must be finite and non-negative"):
        q.amax = float("nan")
    with pytest.raises(ValueError, match="amax must be finite and non-negative"):
        q.amax = -1.0
    b = TensorQuantizer("b", num_bits=4, block_sizes={-1: 16})
    b.amax = torch.ones(3, 1)
    with pytest.raises(ValueError, match="b: amax has 3 values but the input splits into 4 blocks"):
        b(torch.randn(2, 32))


def test_histogram_calibrators():
    torch.manual_seed(1)
    x = torch.randn(100_000)
    x[:10] = 40.0  # a few outliers
    pct = TensorQuantizer("p", num_bits=8, calibrator="percentile")
    _calibrate(pct, x[:50_000], x[50_000:] * 0.5)
    assert 3.0 < float(pct.amax) < 6.0  # outliers ignored, the rebinning kept the counts
    mse = TensorQuantizer("m", num_bits=4, calibrator="mse")
    _calibrate(mse, x)
    assert float(mse.amax) < 40.0
    err_mse = (mse(x) - x).pow(2).mean()
    mx = TensorQuantizer("x", num_bits=4)
    _calibrate(mx, x)
    assert err_mse < (mx(x) - x).pow(2).mean()
    with pytest.raises(ValueError, match="per-tensor INT / FP8 quantizers only"):
        TensorQuantizer("c", num_bits=8, axis=0, calibrator="mse")
    with pytest.raises(ValueError, match="percentile=150"):
        HistogramCalibrator(pct.spec, "c", percentile=150)


def test_fake_quant_false_is_explicit():
    q = TensorQuantizer("w", num_bits=8, fake_quant=False)
    q.amax = 1.0
    with pytest.raises(NotImplementedError, match="fake_quant=False"):
        q(torch.randn(2))


def test_amax_follows_module_device_and_dtype_preserved():
    q = TensorQuantizer("w", num_bits=8)
    q.amax = 2.0
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert q(x).dtype == torch.bfloat16
    q.to(torch.device("cpu"))
    assert q.amax.device.type == "cpu"


def test_pre_quant_scale_is_stored_in_float32():
    q = TensorQuantizer("x", num_bits=8)
    q.pre_quant_scale = torch.ones(4, dtype=torch.bfloat16) * 1.5
    assert q.pre_quant_scale.dtype == torch.float32
    q.to(torch.float16)
    assert q.pre_quant_scale.dtype == torch.float32
