"""Quantizers under ``torch.compile``: quantizing a compiled wrapper reaches the original model's modules, and
a quantized model traced by dynamo computes exactly what it computes in eager mode."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from transformers import LlamaConfig, LlamaForCausalLM

import modelopt_lite.quantization as mtq

pytestmark = pytest.mark.slow  # dynamo tracing: about 15 s each on 2 CPU cores


def _pair() -> tuple[LlamaForCausalLM, LlamaForCausalLM, torch.Tensor]:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    a = LlamaForCausalLM(cfg).eval()
    b = LlamaForCausalLM(cfg).eval()
    b.load_state_dict(a.state_dict())
    return a, b, torch.randint(0, 128, (2, 16))


def test_quantizing_a_compiled_wrapper_calibrates_every_quantizer() -> None:
    model, reference, ids = _pair()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    mtq.quantize(compiled, mtq.INT8_DEFAULT_CFG, [ids])  # raises if a quantizer received no data
    mtq.quantize(reference, mtq.INT8_DEFAULT_CFG, [ids])
    ours, theirs = list(mtq.iter_quantizers(compiled)), list(mtq.iter_quantizers(reference))
    assert [n.removeprefix("_orig_mod.") for n, _ in ours] == [n for n, _ in theirs]
    assert sum(q.is_enabled for _, q in ours) > 0
    for (name, q), (_, r) in zip(ours, theirs, strict=True):
        if q.is_enabled:
            assert torch.equal(q.amax, r.amax), name
    assert torch.equal(compiled(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_quantized_model_traced_by_dynamo_equals_eager() -> None:
    model, _, ids = _pair()
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, [ids])
    eager = model(input_ids=ids).logits
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    traced = torch.compile(model, backend=counter)(input_ids=ids).logits
    assert counter.frame_count > 0  # dynamo traced graphs (the quantizers run inside them)
    assert torch.equal(traced, eager)
