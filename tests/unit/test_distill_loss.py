"""The distillation loss, whole (the default) or chunked, equals the straightforward full-logits computation
(value and gradients)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modelopt_lite.training.distill_loss import chunked_distillation_loss


def _reference(hs, ht, labels, head_s, head_t, temperature, kd_weight, ce_weight):
    ls = head_s(hs)[:, :-1].float()
    lt = head_t(ht)[:, :-1].float().detach()
    lab = labels[:, 1:]
    mask = lab != -100
    kl = F.kl_div(F.log_softmax(ls / temperature, -1), F.log_softmax(lt / temperature, -1), log_target=True,
                  reduction="none").sum(-1)  # fmt: skip
    loss = kd_weight * temperature**2 * (kl * mask).sum()
    if ce_weight:
        ce = F.cross_entropy(
            ls.reshape(-1, ls.shape[-1]), lab.reshape(-1), ignore_index=-100, reduction="sum"
        )
        loss = loss + ce_weight * ce
    return loss / mask.sum().clamp_min(1)


def _setup(vocab=50, hidden=16):
    torch.manual_seed(0)
    hs = torch.randn(2, 9, hidden, requires_grad=True)
    ht = torch.randn(2, 9, hidden)
    labels = torch.randint(0, vocab, (2, 9))
    labels[0, :3] = -100
    return hs, ht, labels, nn.Linear(hidden, vocab), nn.Linear(hidden, vocab)


@pytest.mark.parametrize("chunk_size", [None, 1, 5, 100])
@pytest.mark.parametrize(("temperature", "ce_weight"), [(1.0, 0.0), (2.0, 0.5)])
def test_chunked_loss_and_gradients_equal_the_full_computation(chunk_size, temperature, ce_weight):
    hs, ht, labels, head_s, head_t = _setup()
    expected = _reference(hs, ht, labels, head_s, head_t, temperature, 1.0, ce_weight)
    g_expected = torch.autograd.grad(expected, [hs, head_s.weight])
    loss = chunked_distillation_loss(hs, ht, labels, head_s, head_t, temperature, 1.0, ce_weight, chunk_size)
    grads = torch.autograd.grad(loss, [hs, head_s.weight])
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, g_expected, strict=True):
        assert torch.allclose(g, e, rtol=1e-4, atol=1e-6)
    assert head_t.weight.grad is None


def test_identical_models_have_zero_kl_and_masked_batches_no_nan():
    hs, _, labels, head_s, _ = _setup()
    loss = chunked_distillation_loss(hs, hs.detach(), labels, head_s, head_s, chunk_size=4)
    assert loss.abs() < 1e-6
    empty = torch.full_like(labels, -100)
    assert chunked_distillation_loss(hs, hs.detach(), empty, head_s, head_s) == 0


def test_bad_input_is_refused():
    hs, ht, labels, head_s, _ = _setup()
    with pytest.raises(ValueError, match="vocabulary"):
        chunked_distillation_loss(hs, ht, labels, head_s, nn.Linear(16, 51))
    with pytest.raises(ValueError, match="temperature"):
        chunked_distillation_loss(hs, ht, labels, head_s, head_s, temperature=0)
    with pytest.raises(ValueError, match="do not match labels"):
        chunked_distillation_loss(hs, ht, labels[:, :5], head_s, head_s)
