"""Quantizers that get the very same input share one fake quant (q / k / v, gate / up): the same logits and
gradients bit for bit as when each computes its own, fewer kernel calls; not shared when the amax, the input
(modified in place) or the grad mode differ; nothing kept once the input is freed."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modelopt_lite import quantization as mtq
from modelopt_lite.formats import native_call_count
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.nn.quantizer import shared_outputs

CFG = LlamaConfig(
    hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128,
)  # fmt: skip


@pytest.fixture
def sharing():
    saved = TensorQuantizer.share_outputs
    try:
        yield
    finally:
        TensorQuantizer.share_outputs = saved


def _model(preset: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    model = LlamaForCausalLM(CFG)
    mtq.quantize(model, getattr(mtq, preset), lambda m: m(ids))
    return model.train(), ids


def _step(model, ids, share: bool):
    TensorQuantizer.share_outputs = share
    model.zero_grad(set_to_none=True)
    calls = native_call_count()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), [p.grad for p in model.parameters()], native_call_count() - calls


@pytest.mark.parametrize("preset", ["FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", "INT8_DEFAULT_CFG"])
def test_shared_fake_quant_is_bit_identical_and_saves_calls(sharing, preset):
    model, ids = _model(preset)
    logits, grads, calls = _step(model, ids, share=True)
    ref_logits, ref_grads, ref_calls = _step(model, ids, share=False)
    assert torch.equal(logits, ref_logits)
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert torch.equal(grad, ref)
    if ref_calls:  # the native kernels ran (a machine with a C compiler): q / k / v and gate / up share
        assert ref_calls - calls == 3 * CFG.num_hidden_layers


def test_not_shared_when_amax_input_or_grad_mode_differ(sharing):
    spec_attrs = {"num_bits": (4, 3)}
    a, b = TensorQuantizer("a", **spec_attrs), TensorQuantizer("b", **spec_attrs)
    x = torch.randn(8, 32, requires_grad=True) * 1
    a.amax, b.amax = torch.tensor(3.0), torch.tensor(3.0)
    first = a(x)
    assert b(x) is first  # same input, format and amax: shared
    b.amax = torch.tensor(2.0)
    assert b(x) is not first  # another amax
    b.amax = torch.tensor(3.0)
    with torch.no_grad():
        assert b(x) is not first  # made with a graph; asked without one (and the other way round below)
        plain = a(x)
    assert b(x) is not plain
    assert b(x).grad_fn is not None
    with torch.no_grad():
        x.mul_(2.0)  # modified in place: its version moves
    assert not torch.equal(b(x), first)


def test_entries_go_with_the_input(sharing):
    model, ids = _model("FP8_DEFAULT_CFG")
    _step(model, ids, share=True)
    gc.collect()
    assert not shared_outputs._entries  # every input of the forward was freed after its backward
    weight = model.model.layers[0].self_attn.q_proj
    weight.weight_quantizer(weight.weight)
    assert not shared_outputs._entries  # a weight (it lives on) is never entered


def test_inference_mode_runs_without_sharing(sharing):
    """Inference tensors have no version counter: under ``torch.inference_mode`` nothing is shared, and the
    logits are those of ``no_grad``."""
    model, ids = _model("FP8_DEFAULT_CFG")
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    with torch.inference_mode():
        got = model(input_ids=ids).logits
    assert torch.equal(got, expected)
    assert not shared_outputs._entries
