"""Distillation loss from the two models' last hidden states and LM heads, whole or in chunks of the sequence.

``loss = kd_weight * sum_t(T^2 * KL(teacher_T || student_T)) + ce_weight * sum_t(CE(student, labels))``,
divided by the number of tokens whose (shifted) label is not ``-100``. Position ``t`` predicts label
``t + 1``.

Default (``chunk_size=None``): nvidia-modelopt's ``KDTrainer`` loss bit for bit (its
``LogitsDistillationLoss`` with ``reduction="none"``, masked mean): the LM heads run on every position at
once as the models' own forwards do, the last position is dropped, and the per-token KL is
``kl_div(log_softmax(student / T), softmax(teacher / T)).sum(-1) * T^2``. With ``chunk_size`` the same loss
runs ``chunk_size`` predicted tokens at a time and each chunk's student logits are recomputed in backward
(activation checkpointing): memory holds one chunk's full-vocabulary logits instead of the batch's; the
gradients are the same up to float rounding (the LM head's weight gradient is summed chunk by chunk), which
is enough to part a quantized training run from the reference's.

Other divergences (``loss``), per predicted position, with ``p = softmax(teacher / T)`` and
``q = softmax(student / T)`` over the vocabulary, each times ``T^2`` like the default (so that the gradient's
scale does not depend on ``T``; Liger's and TRL's JSD do not multiply by ``T^2``):

* ``"forward_kl"`` (default): ``KL(p || q) = sum_v p_v (log p_v - log q_v)``, mode-covering.
* ``"reverse_kl"``: ``KL(q || p) = sum_v q_v (log q_v - log p_v)``, mode-seeking (MiniLLM).
* ``"jsd"``: the generalized Jensen-Shannon divergence of the GKD paper (Agarwal et al. 2024,
  arXiv:2306.13649) as TRL's ``GKDTrainer.generalized_jsd_loss`` and Liger-Kernel's ``LigerFusedLinearJSD``
  (whose ``jsd_beta`` nvidia-modelopt passes as ``liger_jsd_beta``) define it:
  ``beta * KL(p || m) + (1 - beta) * KL(q || m)`` with the mixture ``m = beta * p + (1 - beta) * q``;
  ``beta = 0`` is taken to mean the forward KL and ``beta = 1`` the reverse KL (both references special-case
  the two ends so: "0 = forward KL, 1 = reverse KL"); ``beta = 0.5`` is the symmetric JSD, bounded by
  ``log 2``. Inside ``(0, 1)`` the divergence tends to 0 near either end (``m`` tends to one of the two).
* ``"top_k_kl"``: the forward KL restricted to the teacher's ``top_k`` most likely tokens ``S`` at that
  position, both distributions renormalized on ``S``: ``sum_{v in S} p~_v (log p~_v - log q~_v)`` with
  ``p~_v = p_v / sum_{u in S} p_u`` and ``q~_v = q_v / sum_{u in S} q_u`` (the softmax of the logits gathered
  at ``S``). With ``top_k`` at least the vocabulary size it is the forward KL; ``top_k >= 2`` (one token
  renormalized gives zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["DISTILL_LOSSES", "check_loss_options", "chunked_distillation_loss"]

#: The divergences ``loss`` names (module docstring).
DISTILL_LOSSES = ("forward_kl", "reverse_kl", "jsd", "top_k_kl")


def check_loss_options(loss: str, beta: float, top_k: int) -> None:
    """Raise ``ValueError`` naming the allowed values for an unknown ``loss``, a ``beta`` outside ``[0, 1]``
    or a ``top_k`` below 2 (one token renormalized is probability 1 for both models: the loss would be
    identically zero)."""
    if loss not in DISTILL_LOSSES:
        raise ValueError(f"distill_loss={loss!r} is unknown (allowed: {', '.join(DISTILL_LOSSES)})")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(
            f"jsd_beta={beta!r} must be a number in [0, 1] (0: forward KL, 1: reverse KL, 0.5: symmetric JSD)"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 2:
        raise ValueError(
            f"distill_top_k={top_k!r} must be an integer >= 2: the number of the teacher's most likely "
            "tokens compared (with 1, both renormalized distributions are 1 and the loss is always zero)"
        )


def _kd_per_token(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` per position (the last dimension is the
    vocabulary), in the reference's expression and order of operations: ``kl_div`` of the student's
    log-softmax against the teacher's softmax (not its log-softmax), summed over the vocabulary, then times
    ``T^2``."""
    soft_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    soft_targets = F.softmax(teacher_logits / temperature, dim=-1)
    return F.kl_div(soft_log_probs, soft_targets.detach(), reduction="none").sum(-1) * temperature**2


def _divergence_per_token(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float,
    loss: str,
    beta: float,
    top_k: int,
) -> torch.Tensor:
    """``T^2`` times the divergence ``loss`` per position (module docstring); ``"forward_kl"`` is
    :func:`_kd_per_token`, the reference's expression."""
    if loss == "forward_kl" or (loss == "jsd" and beta == 0.0):
        return _kd_per_token(student_logits, teacher_logits, temperature)
    teacher_logits = teacher_logits.detach()
    if loss == "top_k_kl":
        k = min(top_k, teacher_logits.shape[-1])
        index = teacher_logits.topk(k, dim=-1).indices
        return _kd_per_token(student_logits.gather(-1, index), teacher_logits.gather(-1, index), temperature)
    log_q = F.log_softmax(student_logits / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits / temperature, dim=-1)
    if loss == "reverse_kl" or beta == 1.0:  # KL(q || p) = sum q (log q - log p)
        return F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1) * temperature**2
    # jsd: log m = log(beta p + (1 - beta) q), in log space
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    kl_p = F.kl_div(log_m, log_p, reduction="none", log_target=True).sum(-1)
    kl_q = F.kl_div(log_m, log_q, reduction="none", log_target=True).sum(-1)
    return (beta * kl_p + (1.0 - beta) * kl_q) * temperature**2


def _sums(
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    kd_weight: float,
    ce_weight: float,
    options: tuple[str, float, int] = ("forward_kl", 0.5, 1),
) -> torch.Tensor:
    """The weighted sums of the per-token losses over the positions whose label is not ``-100``."""
    if student.shape[-1] != teacher.shape[-1]:
        raise ValueError(
            f"student vocabulary ({student.shape[-1]}) differs from the teacher's ({teacher.shape[-1]}): "
            "distillation needs the same tokenizer"
        )
    mask = labels != -100
    total = kd_weight * (_divergence_per_token(student, teacher, temperature, *options) * mask).sum()
    if ce_weight:
        vocab = student.shape[-1]
        ce = F.cross_entropy(student.reshape(-1, vocab), labels.reshape(-1).clamp_min(0), reduction="none")
        total = total + ce_weight * (ce * mask.reshape(-1)).sum()
    return total


def _chunk_sums(
    hs: torch.Tensor,
    ht: torch.Tensor,
    labels: torch.Tensor,
    student_head: Callable[[torch.Tensor], torch.Tensor],
    teacher_head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    kd_weight: float,
    ce_weight: float,
    options: tuple[str, float, int],
) -> torch.Tensor:
    student, teacher = _logits(hs, ht, student_head, teacher_head)
    return _sums(student, teacher, labels, temperature, kd_weight, ce_weight, options)


def _logits(
    hs: torch.Tensor,
    ht: torch.Tensor,
    student_head: Callable[[torch.Tensor], torch.Tensor],
    teacher_head: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two heads' float32 logits; the teacher's without autograd."""
    student = student_head(hs).float()
    with torch.no_grad():
        teacher = teacher_head(ht).float()
    return student, teacher


def _out_features(head: Callable[[torch.Tensor], torch.Tensor]) -> int | None:
    weight = getattr(head, "weight", None)
    return weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def chunked_distillation_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    labels: torch.Tensor,
    student_head: Callable[[torch.Tensor], torch.Tensor],
    teacher_head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float = 1.0,
    kd_weight: float = 1.0,
    ce_weight: float = 0.0,
    chunk_size: int | None = None,
    num_items: int | torch.Tensor | None = None,
    loss: str = "forward_kl",
    beta: float = 0.5,
    top_k: int = 50,
) -> torch.Tensor:
    """Distillation loss from the last hidden states ``(batch, seq, hidden)`` and the two LM heads (modules
    or functions: a quantized ``lm_head`` runs with its quantizers; ``nn.Identity`` turns the hidden states
    into logits). Divided by the number of predicted tokens, or by ``num_items`` when given (the token count
    of a whole accumulated batch). ``chunk_size``: None (default) runs the heads on the whole batch at once,
    the reference's arithmetic bit for bit; a number of tokens runs them chunk by chunk (less memory, the
    same loss up to float rounding). ``loss``: the divergence (``"forward_kl"``, ``"reverse_kl"``,
    ``"jsd"`` with ``beta``, ``"top_k_kl"`` with ``top_k``; module docstring), whole or chunked alike."""
    check_loss_options(loss, beta, top_k)
    options = (loss, float(beta), int(top_k))
    if temperature <= 0 or (chunk_size is not None and chunk_size < 1):
        raise ValueError(f"temperature={temperature} must be > 0 and chunk_size={chunk_size} None or >= 1")
    vocab_s, vocab_t = _out_features(student_head), _out_features(teacher_head)
    if vocab_s is not None and vocab_t is not None and vocab_s != vocab_t:
        raise ValueError(
            f"student vocabulary ({vocab_s}) differs from the teacher's ({vocab_t}): distillation needs the "
            "same tokenizer"
        )
    if student_hidden.shape[:2] != labels.shape or teacher_hidden.shape[:2] != labels.shape:
        raise ValueError(
            f"hidden states {tuple(student_hidden.shape)} / {tuple(teacher_hidden.shape)} do not match "
            f"labels {tuple(labels.shape)}"
        )
    shifted = labels[:, 1:]
    count = (shifted != -100).sum() if num_items is None else torch.as_tensor(num_items, device=labels.device)
    if chunk_size is None:  # as the models' own forwards and the reference's loss: every position, then shift
        student, teacher = _logits(student_hidden, teacher_hidden.detach(), student_head, teacher_head)
        total = _sums(student[:, :-1], teacher[:, :-1], shifted, temperature, kd_weight, ce_weight, options)
        return total / count.clamp_min(1)
    hs = student_hidden[:, :-1].reshape(-1, student_hidden.shape[-1])
    ht = teacher_hidden[:, :-1].reshape(-1, teacher_hidden.shape[-1]).detach()
    lab = shifted.reshape(-1)
    total = student_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hs.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        total = total + checkpoint(
            _chunk_sums,
            hs[part],
            ht[part],
            lab[part],
            student_head,
            teacher_head,
            temperature,
            kd_weight,
            ce_weight,
            options,
            use_reentrant=False,
        )
    return total / count.clamp_min(1)
