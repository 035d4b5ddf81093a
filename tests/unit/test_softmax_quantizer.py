"""``p_bmm_quantizer``: the attention probabilities (softmax output, before the product with the values)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint

from ._models import batches, tiny_llama

P_FP8 = {
    "quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*p_bmm_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}},
    ],
    "algorithm": "max",
}


def _fp8(x: torch.Tensor, amax: float) -> torch.Tensor:
    """Per-tensor E4M3 fake quant through torch's own float8 cast."""
    scale = 448.0 / amax
    return (x * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = batches()[0]
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding on the first row
    return ids, mask


def test_p_bmm_quantizer_is_off_by_default_and_needs_calibration():
    model = mtq.quantize(tiny_llama(), "FP8_KV_CFG", batches())  # no "*" rule: the defaults stay
    assert not model.model.layers[0].self_attn.p_bmm_quantizer.is_enabled
    assert model.model.layers[0].self_attn.k_bmm_quantizer.is_enabled
    assert mtq.need_calibration(P_FP8)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_fp8_probabilities_match_an_independent_computation(attn):
    model = mtq.quantize(tiny_llama(attn=attn), P_FP8, batches())
    module = model.model.layers[0].self_attn
    assert module.p_bmm_quantizer.amax.item() == 1.0  # calibrated: the first causal row is one-hot
    module.p_bmm_quantizer.amax = 0.5  # values above it saturate: the quantizer does act
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 6, 16, generator=g) for h in (4, 2, 2))
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    keep[0, ..., :2] = False  # padding
    keep[0, ..., :2, :2] = torch.eye(2, dtype=torch.bool)  # padded rows attend to themselves only
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    mask = keep if attn == "sdpa" else additive
    fn = ALL_ATTENTION_FUNCTIONS[f"modelopt_lite_{attn}"]
    out, _ = fn(module, q, k, v, mask, scaling=0.25, dropout=0.0)

    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.25).masked_fill(~keep, float("-inf"))
    expected = _fp8(scores.softmax(-1), 0.5) @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-6, atol=1e-6)
    plain = scores.softmax(-1) @ v.repeat_interleave(2, dim=1)
    assert (out - plain.transpose(1, 2)).abs().max() > 1e-3


def test_sdpa_without_a_mask_is_causal_like_sdpa():
    model = mtq.quantize(tiny_llama(), P_FP8, batches())
    module = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 5, 16, generator=g) for h in (4, 2, 2))
    out, _ = ALL_ATTENTION_FUNCTIONS["modelopt_lite_sdpa"](module, q, k, v, None, scaling=0.25, dropout=0.0)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.25).masked_fill(~causal, float("-inf"))
    expected = _fp8(scores.softmax(-1), 1.0) @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_sdpa_and_eager_agree_with_padding():
    ids, mask = _padded_batch()
    logits = []
    for attn in ("sdpa", "eager"):
        model = mtq.quantize(tiny_llama(attn=attn), P_FP8, batches())
        logits.append(model(ids, attention_mask=mask).logits)
    torch.testing.assert_close(logits[0][:, 5:], logits[1][:, 5:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_disabled_p_bmm_quantizer_is_bit_identical(attn):
    ids, mask = _padded_batch()
    expected = tiny_llama(attn=attn)(ids, attention_mask=mask).logits
    model = mtq.quantize(tiny_llama(attn=attn), P_FP8, batches())
    assert not torch.equal(model(ids, attention_mask=mask).logits, expected)
    mtq.disable_quantizer(model, "*p_bmm_quantizer")
    assert torch.equal(model(ids, attention_mask=mask).logits, expected)


def test_nvfp4_fp8_mha_config_enables_the_softmax_quantizer(tmp_path, lib_caplog):
    model = tiny_llama()
    model.config.attention_dropout = 0.1
    mtq.quantize(model, mtq.NVFP4_FP8_MHA_CONFIG, batches())
    attn = model.model.layers[1].self_attn
    assert attn.p_bmm_quantizer.is_enabled
    assert attn.p_bmm_quantizer.spec.name == "fp8_e4m3"
    assert 0 < attn.p_bmm_quantizer.amax.item() <= 1.0
    assert all(getattr(attn, f"{s}_bmm_quantizer").is_enabled for s in "qkv")
    model.train()  # dropout on the quantized probabilities, gradients through the straight-through estimator
    out = model(batches()[0], labels=batches()[0])
    out.loss.backward()
    assert torch.isfinite(model.model.layers[0].self_attn.q_proj.weight.grad).all()
    model.eval()
    with lib_caplog.at_level(logging.WARNING):
        export_hf_checkpoint(model, export_dir=tmp_path)
    assert "p_bmm_quantizer is fake quant only" in lib_caplog.text


SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
SMALL |= {"head_dim": 16, "vocab_size": 128, "sliding_window": 8, "attn_implementation": "eager"}


def _gemma2():  # logit softcapping and a sliding window in its eager attention
    return Gemma2ForCausalLM(Gemma2Config(**SMALL, intermediate_size=128, attn_logit_softcapping=2.0))


def _gpt_oss():  # attention sinks (an extra softmax column per head) in its eager attention
    cfg = GptOssConfig(**SMALL, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    return GptOssForCausalLM(cfg)


@pytest.mark.parametrize("build", [_gemma2, _gpt_oss])
def test_the_models_own_eager_attention_runs_with_the_quantizer(build):
    torch.manual_seed(0)
    model = build().eval()
    ids = batches()[0]
    expected = model(ids).logits
    mtq.quantize(model, P_FP8, batches())
    out = model(ids).logits
    assert not torch.equal(out, expected)
    assert (out - expected).abs().max() < 0.05  # sinks kept (another eager function fails here)
