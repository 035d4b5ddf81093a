"""``q_bmm_quantizer`` on the query after RoPE (Model-Optimizer's name), off unless a config enables it."""

from __future__ import annotations

import pytest
import torch

import modelopt_lite.quantization as mtq

from ._models import batches, tiny_llama

FP8 = {"num_bits": (4, 3), "axis": None}


def _cfg(pattern: str) -> dict:
    return {
        "quant_cfg": [{"quantizer_name": "*", "enable": False}, {"quantizer_name": pattern, "cfg": FP8}],
        "algorithm": "max",
    }


def test_q_bmm_quantizer_is_off_by_default():
    model = mtq.quantize(tiny_llama(), "FP8_DEFAULT_CFG", batches())
    attn = model.model.layers[0].self_attn
    assert not attn.q_bmm_quantizer.is_enabled
    assert mtq.need_calibration(_cfg("*q_bmm_quantizer"))  # a static amax from data
    assert not mtq.need_calibration(_cfg("*weight_quantizer"))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_q_bmm_quantizer_quantizes_the_query_after_rope(attn):
    data = batches()
    plain = tiny_llama(attn=attn)
    kv = mtq.quantize(tiny_llama(attn=attn), _cfg("*[kv]_bmm_quantizer"), data)
    qkv = mtq.quantize(tiny_llama(attn=attn), _cfg("*[qkv]_bmm_quantizer"), data)
    q = qkv.model.layers[0].self_attn.q_bmm_quantizer
    seen = []
    handle = q.register_forward_hook(lambda mod, args, out: seen.append((args[0], out)))
    with torch.no_grad():
        out_qkv = qkv(data[0]).logits
        out_kv, out_plain = kv(data[0]).logits, plain(data[0]).logits
    handle.remove()
    query, quantized = seen[0]
    assert query.shape == (2, 4, 16, 16)  # (batch, query heads, tokens, head_dim): not the 2 KV heads
    assert q.amax is not None
    assert not torch.equal(quantized, query)
    assert not torch.equal(out_qkv, out_kv)
    assert not torch.equal(out_kv, out_plain)
