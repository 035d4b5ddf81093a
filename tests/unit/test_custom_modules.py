"""Custom modules registered in Model-Optimizer's documented form: ``mtq.register(original_cls=...,
quantized_cls=...)`` with a subclass of the original that adds ``_setup`` and calls its quantizers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modelopt_lite.quantization as mtq
from modelopt_lite.nn import QUANT_MODULES, QuantLinear, TensorQuantizer
from modelopt_lite.quantization.insertion import remove_quantizers

CFG = {
    "quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8}},
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8}},
    ],
    "algorithm": "max",
}


class Scale(nn.Module):
    """A custom layer: an elementwise learned scale."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 2.0, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class QuantScale(Scale):
    def _setup(self) -> None:
        self.input_quantizer = TensorQuantizer()
        self.weight_quantizer = TensorQuantizer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_quantizer(x) * self.weight_quantizer(self.weight)


@pytest.fixture
def registered():
    mtq.register(original_cls=Scale, quantized_cls=QuantScale)
    yield
    mtq.unregister(Scale)


def _fq8(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    scale = torch.tensor(127.0) / amax
    return torch.clamp(torch.round(x * scale), -128, 127) / scale


def test_reference_style_subclass_is_quantized_and_calibrated(registered):
    torch.manual_seed(0)
    model = nn.Sequential(Scale(), nn.Linear(4, 4))
    data = [torch.randn(3, 4) for _ in range(2)]
    mtq.quantize(model, CFG, data)
    scale = model[0]
    assert isinstance(scale, QuantScale)
    assert isinstance(scale, Scale)
    assert scale.input_quantizer.name == "0.input_quantizer"
    # max calibration: the input amax from the data, the weight amax from the weight seen in forward
    assert torch.equal(scale.input_quantizer.amax, torch.stack([d.abs().max() for d in data]).max())
    assert torch.equal(scale.weight_quantizer.amax, scale.weight.detach().abs().max())
    x = data[0]
    want = _fq8(x, scale.input_quantizer.amax) * _fq8(scale.weight.detach(), scale.weight_quantizer.amax)
    with torch.no_grad():
        assert torch.equal(scale(x), want)
    remove_quantizers(model)
    assert type(model[0]) is Scale
    assert not hasattr(model[0], "input_quantizer")


def test_register_keywords_decorator_and_mapping_forms():
    @QUANT_MODULES.register({Scale: "Scale"})
    class QuantScaleMixinFree(Scale):
        def _setup(self) -> None:
            self.input_quantizer = TensorQuantizer()

    try:
        assert QUANT_MODULES.wrapper_for(Scale) is QuantScaleMixinFree
        with pytest.raises(ValueError, match="already has the wrapper"):
            mtq.register(original_cls=Scale, quantized_cls=QuantScale)
    finally:
        mtq.unregister(Scale)
    with pytest.raises(TypeError, match="_setup"):
        mtq.register(original_cls=Scale, quantized_cls=Scale)


def test_convert_returns_the_module_and_raises_when_unregistered():
    linear = nn.Linear(4, 4)
    out = QUANT_MODULES.convert(linear)
    assert out is linear
    assert isinstance(out, QuantLinear)
    assert hasattr(out, "weight_quantizer")
    with pytest.raises(KeyError, match="ReLU"):
        QUANT_MODULES.convert(nn.ReLU())
