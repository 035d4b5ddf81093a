"""A training ``TensorQuantizer`` writes its fake quant into a float32 buffer kept from step to step (issue
19): same bits forward and backward as a fresh output, the buffer reused once the previous step's graph is
gone and never while its output is still referenced, released outside training."""

import pytest
import torch

from modelopt_lite.formats import fake_quant_reference
from modelopt_lite.nn import TensorQuantizer

ATTRS = {
    "fp8": {"num_bits": (4, 3), "axis": None},
    "fp8_clipped": {"num_bits": (4, 3), "axis": None, "backward": "clipped"},
    "int8_channel": {"num_bits": 8, "axis": 0},
    "nvfp4": {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}},
}


def _quantizer(kind: str, x: torch.Tensor, reuse: bool) -> TensorQuantizer:
    q = TensorQuantizer("q", **ATTRS[kind])
    axis = ATTRS[kind].get("axis", None)
    amax = x.abs().amax(dim=1, keepdim=True) if axis == 0 else x.abs().amax()
    q.amax = amax * 0.7  # some values beyond amax: saturation, and the clipped gradient
    q.reuse_output_buffer = reuse
    return q.train()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", sorted(ATTRS))
def test_same_bits_and_gradients_and_the_buffer_is_reused(kind):
    torch.manual_seed(0)
    data = [torch.randn(64, 96) for _ in range(3)]
    data[0][0, :5] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 50.0])  # signed zeros, tiny, beyond amax
    reused, fresh = _quantizer(kind, data[0], True), _quantizer(kind, data[0], False)
    grad = torch.randn(64, 96)
    ptrs = []
    for x in data:
        outs, grads = [], []
        for q in (reused, fresh):
            xi = x.clone().requires_grad_(True)
            out = q(xi)
            outs.append(_bits(out))
            if q is reused:
                ptrs.append(out.data_ptr())
            out.backward(grad)
            grads.append(_bits(xi.grad))
            del out
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(grads[0], grads[1])
        expect = fake_quant_reference(x, reused.spec, reused.amax)  # the eager formula, fresh output
        assert torch.equal(outs[0], _bits(expect))
    assert len(set(ptrs)) == 1, "the buffer was not reused from step to step"
    assert "_output_buffer" not in fresh.__dict__


def test_not_reused_while_the_previous_output_is_referenced():
    x = torch.randn(32, 64, requires_grad=True)
    q = _quantizer("fp8", x.detach(), True)
    first = q(x)
    kept = first.detach().clone()
    second = q(x * 2)  # the first output is still alive: a new buffer
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(_bits(first), _bits(kept))
    second_ptr = second.data_ptr()
    del second
    third = q(x * 3)  # the second output is gone: its buffer is written again; `first` is never touched
    assert third.data_ptr() == second_ptr
    assert torch.equal(_bits(first), _bits(kept))


def test_released_outside_training_and_no_buffer_for_other_inputs():
    x = torch.randn(32, 64, requires_grad=True)
    q = _quantizer("fp8", x.detach(), True)
    q(x)
    assert "_output_buffer" in q.__dict__
    with torch.no_grad():
        q(x)
    assert "_output_buffer" not in q.__dict__
    q(x)
    q.eval()
    q(x)
    assert "_output_buffer" not in q.__dict__
    q.train()
    q(x.detach())  # no gradient needed: nothing kept
    q(x.t())  # not contiguous
    q(x.double())
    assert "_output_buffer" not in q.__dict__


@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_the_output_can_be_modified_in_place(kind):
    # a view of the kept buffer returned by the autograd function could not be (autograd forbids it)
    x = torch.randn(16, 32, requires_grad=True)
    q = _quantizer(kind, x.detach(), True)
    for _ in range(2):
        out = q(x)
        assert out._base is None
        out.mul_(2)
        out.sum().backward()
        del out
    assert torch.equal(x.grad, torch.full_like(x, 4.0))


def test_no_buffer_while_torch_compile_traces(monkeypatch):
    x = torch.randn(32, 64, requires_grad=True)
    q = _quantizer("fp8", x.detach(), True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert q.output_buffer(x) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert q.output_buffer(x) is not None
