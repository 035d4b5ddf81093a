"""Dynamic INT / FP8 quantization without blocks (``"type": "dynamic"`` with ``axis``), Model-Optimizer's
semantics: the amax is taken from each input, reduced over every axis except ``axis`` (``None``: per
tensor), exactly as a static amax of that granularity would be. ``axis=-1`` is therefore per channel of
the activation; per token is ``block_sizes={-1: None}`` (or ``axis`` naming every other axis)."""

from __future__ import annotations

import pytest
import torch

import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint
from modelopt_lite.export.layers import UnsupportedFormatError
from modelopt_lite.formats import reduce_amax
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.quantization.config import quantizer_attributes

from ._models import batches, tiny_llama

BITS = [8, (4, 3)]
DYNAMIC = "dynamic"


def _input():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16) * torch.logspace(-2, 1, 16)
    x[1, 2] = 0  # a zero token
    x[0, 0] *= 50  # a loud token
    return x


def _quantizer(cfg: dict) -> TensorQuantizer:
    return TensorQuantizer().set_attributes(quantizer_attributes(cfg))


@pytest.mark.parametrize("num_bits", BITS)
@pytest.mark.parametrize("axis", [None, -1, (0, 1)])
def test_dynamic_equals_static_with_this_inputs_amax(num_bits, axis):
    dynamic = _quantizer({"num_bits": num_bits, "axis": axis, "type": "dynamic"})
    static = _quantizer({"num_bits": num_bits, "axis": axis})
    assert not dynamic.spec.needs_amax
    for x in (_input(), _input().bfloat16()):
        static.amax = reduce_amax(x, static.spec)
        assert torch.equal(dynamic(x), static(x))
        assert not torch.equal(dynamic(x), x)
    assert dynamic.amax is None


@pytest.mark.parametrize("num_bits", BITS)
def test_per_token_forms_agree_and_per_channel_differs(num_bits):
    x = _input()
    per_token = _quantizer({"num_bits": num_bits, "type": "dynamic", "block_sizes": {-1: None}})(x)
    assert torch.equal(_quantizer({"num_bits": num_bits, "axis": (0, 1), "type": "dynamic"})(x), per_token)
    per_channel = _quantizer({"num_bits": num_bits, "axis": -1, "type": "dynamic"})(x)
    assert not torch.equal(per_channel, per_token)  # the loud token costs the other tokens precision


def test_straight_through_gradient():
    x = _input().requires_grad_(True)
    _quantizer({"num_bits": (4, 3), "axis": -1, "type": "dynamic"})(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_quantize_needs_no_data_and_export_refuses_per_channel(tmp_path):
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": (4, 3), "axis": 0}},
            {
                "quantizer_name": "*input_quantizer",
                "cfg": {"num_bits": (4, 3), "axis": -1, "type": "dynamic"},
            },
            {"quantizer_name": "*lm_head*", "enable": False},
        ],
        "algorithm": "max",
    }
    assert not mtq.need_calibration(cfg)
    model = tiny_llama()
    x = batches()[0]
    with torch.no_grad():
        plain = model(x).logits
    mtq.quantize(model, cfg)  # no forward_loop: dynamic inputs need no calibration
    iq = model.model.layers[0].mlp.down_proj.input_quantizer
    assert iq.is_enabled
    assert "per-channel(axis=-1) dynamic" in iq.extra_repr()
    with torch.no_grad():
        assert not torch.equal(model(x).logits, plain)
    # engines run FP8 activations per tensor (static) or per token: a per-channel dynamic input has no format
    with pytest.raises(UnsupportedFormatError, match=r"per-channel\(axis=-1\) dynamic"):
        export_hf_checkpoint(model, tmp_path / "out")


def test_per_token_preset_exports_as_fp8_per_channel_per_token(tmp_path):
    model = mtq.quantize(tiny_llama(), "FP8_PER_CHANNEL_PER_TOKEN_CFG")
    result = export_hf_checkpoint(model, tmp_path / "out")
    assert result.hf_quant_config["quantization"]["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN"
