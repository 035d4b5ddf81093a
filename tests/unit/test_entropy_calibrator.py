"""``HistogramCalibrator`` entropy (KL divergence) amax, against nvidia-modelopt 0.47's on the same data."""

from __future__ import annotations

import pytest
import torch

import modelopt_lite.quantization as mtq
from modelopt_lite.nn import HistogramCalibrator, TensorQuantizer


def _data(kind: str = "outliers") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "relu":  # half of the values exactly zero: the first bin is replaced by the second
        return [torch.relu(torch.randn(8192, generator=g))]
    a = torch.randn(8192, generator=g)
    a[:4] = torch.tensor([9.0, -7.5, 6.0, 5.5])  # a few outliers
    return [a, torch.randn(4096, generator=g) * 0.5]  # the second batch within the first one's range


# modelopt.torch.quantization.calib.HistogramCalibrator(num_bits, unsigned=...) fed the same batches, then
# compute_amax("entropy", **options) (nvidia-modelopt 0.47, torch 2.13 CPU).
REFERENCE = [
    ("outliers", 8, False, {}, 3.47607421875),
    ("outliers", 4, False, {}, 3.744140625),
    ("outliers", 8, False, {"stride": 4, "start_bin": 256}, 3.744140625),
    ("outliers", 8, True, {}, 3.11572265625),
    ("relu", 8, False, {}, 3.726991653442383),
]


@pytest.mark.parametrize(("kind", "bits", "unsigned", "options", "expected"), REFERENCE)
def test_entropy_amax_matches_the_reference(kind, bits, unsigned, options, expected):
    calib = HistogramCalibrator(bits, unsigned=unsigned)
    for x in _data(kind):
        calib.collect(x.abs() if unsigned else x)
    assert calib.compute_amax("entropy", **options).item() == pytest.approx(expected, rel=1e-6)
    assert torch.equal(calib.compute_amax(), calib.compute_amax("percentile"))  # the constructor's default


def test_entropy_as_a_quantizer_calibrator():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8, "calibrator": "entropy"}},
        ],
        "algorithm": "max",
    }
    data = [x.reshape(-1, 8) for x in _data()]
    mtq.quantize(model, cfg, data)
    quantizer = model[0].input_quantizer
    assert quantizer.amax.item() == pytest.approx(REFERENCE[0][-1], rel=1e-6)


def test_entropy_needs_an_int_format():
    with pytest.raises(ValueError, match="entropy method needs an INT format"):
        HistogramCalibrator((4, 3), method="entropy")
    with pytest.raises(ValueError, match="entropy method needs an INT format"):
        TensorQuantizer("q", num_bits=(4, 3), calibrator="entropy")
    calib = HistogramCalibrator(8)
    calib.collect(torch.randn(100))
    with pytest.raises(ValueError, match="start_bin"):
        calib.compute_amax("entropy", start_bin=4096)
