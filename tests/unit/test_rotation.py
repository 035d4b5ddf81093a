"""rotate_residual: the rotated model computes the same function, its weights change, and bad input fails."""

import pytest
import torch

import modelopt_lite.quantization as mtq
from modelopt_lite.quantization.rotation import rotation_matrix

from ._models import batches, tiny_llama, tiny_qwen3_moe


@pytest.mark.parametrize(("dim", "kind"), [(64, "hadamard"), (48, "random"), (64, "random")])
def test_rotation_matrices_are_orthogonal(dim, kind):
    q = rotation_matrix(dim, kind, seed=3)
    torch.testing.assert_close(q @ q.T, torch.eye(dim, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(q, rotation_matrix(dim, kind, seed=3))
    assert not torch.equal(q, rotation_matrix(dim, kind, seed=4))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3_moe])
def test_rotated_model_computes_the_same_function(make):
    model = make()
    for _, norm in model.named_modules():  # non-trivial norm scales, so that folding them matters
        if type(norm).__name__.endswith("RMSNorm"):
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    ids = batches(1)[0]
    before = _logits(model, ids)
    q_proj = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    record = mtq.rotate_residual(model, seed=1)
    assert record == {"kind": "hadamard", "dim": 64, "seed": 1}
    assert model.config.modelopt_lite_rotation == record
    assert not torch.allclose(model.model.layers[0].self_attn.q_proj.weight, q_proj)
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    torch.testing.assert_close(_logits(model, ids), before, atol=2e-5, rtol=1e-4)


def test_rotation_spreads_outlier_channels():
    model = tiny_llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 5] *= 40  # one outlier channel in the residual stream
    seen = {}
    hook = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("x", a[0].detach())
    )
    ids = batches(1)[0]
    _logits(model, ids)
    peak_before = (seen["x"].abs().amax() / seen["x"].abs().mean()).item()
    mtq.rotate_residual(model)
    _logits(model, ids)
    hook.remove()
    assert (seen["x"].abs().amax() / seen["x"].abs().mean()).item() < peak_before / 3


def test_tied_head_is_untied_and_still_equal():
    model = tiny_llama()
    model.lm_head.weight = model.model.embed_tokens.weight
    ids = batches(1)[0]
    before = _logits(model, ids)
    mtq.rotate_residual(model)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    torch.testing.assert_close(_logits(model, ids), before, atol=2e-5, rtol=1e-4)


def test_bad_input():
    model = tiny_llama()
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, batches())
    with pytest.raises(ValueError, match=r"before mtq\.quantize"):
        mtq.rotate_residual(model)
    with pytest.raises(ValueError, match="power-of-two"):
        rotation_matrix(48, "hadamard")
    with pytest.raises(ValueError, match="kind='x'"):
        rotation_matrix(64, "x")
    with pytest.raises(NotImplementedError, match="decoder-only"):
        mtq.rotate_residual(torch.nn.Linear(4, 4))
