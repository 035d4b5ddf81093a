"""Straight-through estimator: identity gradient by default, zero outside amax in clipped mode."""

import pytest
import torch

from modelopt_lite.formats import fake_quant, resolve_format
from modelopt_lite.nn import TensorQuantizer


@pytest.mark.parametrize(
    "spec_kwargs",
    [
        {"num_bits": 8},
        {"num_bits": (4, 3)},
        {"num_bits": 4, "block_sizes": {-1: 16}},
        {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}},
        {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
    ],
)
def test_identity_gradient(spec_kwargs):
    spec = resolve_format(**spec_kwargs)
    x = torch.randn(4, 64, requires_grad=True)
    from modelopt_lite.formats import reduce_amax

    amax = reduce_amax(x, spec) * 0.5 if spec.needs_amax else None
    out = fake_quant(x, spec, amax)
    g = torch.randn_like(out)
    out.backward(g)
    assert torch.equal(x.grad, g)


def test_clipped_gradient_zero_outside_amax():
    x = torch.tensor([-3.0, -1.0, 0.5, 1.0, 2.5], requires_grad=True)
    q = TensorQuantizer("q", num_bits=8, backward="clipped")
    q.amax = 1.0
    q(x).backward(torch.ones(5))
    assert torch.equal(x.grad, torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0]))


def test_clipped_gradient_per_channel_and_nvfp4():
    x = torch.tensor([[3.0, 0.5], [0.1, 0.3]], requires_grad=True)
    q = TensorQuantizer("q", num_bits=8, axis=0, backward="clipped")
    q.amax = torch.tensor([[1.0], [0.2]])
    q(x).backward(torch.ones(2, 2))
    assert torch.equal(x.grad, torch.tensor([[0.0, 1.0], [1.0, 0.0]]))

    y = torch.cat([torch.full((1, 16), 0.5), torch.full((1, 16), 4.0)]).requires_grad_()
    n = TensorQuantizer(
        "n",
        num_bits=(2, 1),
        block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)},
        backward="clipped",
    )
    n.amax = 1.0
    n(y).backward(torch.ones(2, 16))
    assert torch.equal(y.grad, torch.cat([torch.ones(1, 16), torch.zeros(1, 16)]))


def test_clipped_gradient_static_blocks():
    x = torch.tensor([[0.5, 2.0, 0.1, 0.3]], requires_grad=True)
    q = TensorQuantizer("q", num_bits=4, block_sizes={-1: 2}, backward="clipped")
    q.amax = torch.tensor([[1.0], [0.2]])
    q(x).backward(torch.ones(1, 4))
    assert torch.equal(x.grad, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))


def test_no_graph_kept_without_grad():
    x = torch.randn(8, 16)
    spec = resolve_format(8)
    assert fake_quant(x, spec, torch.tensor(1.0)).grad_fn is None


def test_nvfp4_linear_gradients_equal_an_independent_straight_through_computation():
    # W4A4 NVFP4 linear: y = fq(x) @ fq(W)^T. Under the straight-through estimator, dL/dx = g @ fq(W) and
    # dL/dW = g^T @ fq(x), both with the fake-quantized other operand; computed here by hand from the
    # independent docs/numerics.md expectation (tests/unit/_expect.py), not by the library's autograd.
    import numpy as np

    import modelopt_lite.quantization as mtq

    from ._expect import nvfp4_expect

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    x = torch.randn(2, 5, 64) * torch.linspace(0.1, 4, 64)  # uneven channels: blocks get different scales
    mtq.quantize(layer, mtq.NVFP4_DEFAULT_CFG, [x])
    lin = layer[0]
    x_amax, w_amax = lin.input_quantizer.amax, lin.weight_quantizer.amax
    xr = x.clone().requires_grad_(True)
    g = torch.randn(2, 5, 32)
    layer(xr).backward(g)
    fq_x = torch.from_numpy(nvfp4_expect(x.numpy(), np.float32(x_amax.item()))).float()
    fq_w = torch.from_numpy(nvfp4_expect(lin.weight.detach().numpy(), np.float32(w_amax.item()))).float()
    assert not torch.equal(fq_x, x)  # the activations really were quantized
    torch.testing.assert_close(xr.grad, g @ fq_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        lin.weight.grad, g.reshape(-1, 32).T @ fq_x.reshape(-1, 64), rtol=1e-5, atol=1e-5
    )
