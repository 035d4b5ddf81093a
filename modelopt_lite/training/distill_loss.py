"""Distillation loss computed in chunks of the sequence, so that the full-vocabulary float32 logits of
the student and the teacher are never materialised at once.

``loss = kd_weight * T^2 * KL(teacher_T || student_T) + ce_weight * CE(student, labels)``, averaged over the
tokens whose (shifted) label is not ``-100``. Position ``t`` predicts label ``t + 1``. Each chunk's student
logits are recomputed in backward (activation checkpointing), so memory holds one chunk of logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_distillation_loss"]


def _chunk_sums(
    hs: torch.Tensor, ht: torch.Tensor, labels: torch.Tensor, ws: torch.Tensor, bs: torch.Tensor | None,
    wt: torch.Tensor, bt: torch.Tensor | None, temperature: float, kd_weight: float, ce_weight: float,
) -> torch.Tensor:  # fmt: skip
    mask = labels != -100
    student = F.linear(hs, ws, bs).float()
    with torch.no_grad():
        teacher_logp = F.log_softmax(F.linear(ht, wt, bt).float() / temperature, dim=-1)
    student_logp = F.log_softmax(student / temperature, dim=-1)
    kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    total = kd_weight * temperature**2 * (kl * mask).sum()
    if ce_weight:
        ce = F.cross_entropy(student, labels.clamp_min(0), reduction="none")
        total = total + ce_weight * (ce * mask).sum()
    return total


def chunked_distillation_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    labels: torch.Tensor,
    student_head: torch.nn.Module,
    teacher_head: torch.nn.Module,
    temperature: float = 1.0,
    kd_weight: float = 1.0,
    ce_weight: float = 0.0,
    chunk_size: int = 512,
) -> torch.Tensor:
    """Distillation loss from the last hidden states ``(batch, seq, hidden)`` and the two LM heads."""
    if temperature <= 0 or chunk_size < 1:
        raise ValueError(f"temperature={temperature} must be > 0 and chunk_size={chunk_size} >= 1")
    if student_head.weight.shape[0] != teacher_head.weight.shape[0]:
        raise ValueError(
            f"student vocabulary ({student_head.weight.shape[0]}) differs from the teacher's "
            f"({teacher_head.weight.shape[0]}): distillation needs the same tokenizer"
        )
    if student_hidden.shape[:2] != labels.shape or teacher_hidden.shape[:2] != labels.shape:
        raise ValueError(
            f"hidden states {tuple(student_hidden.shape)} / {tuple(teacher_hidden.shape)} do not match "
            f"labels {tuple(labels.shape)}"
        )
    hs = student_hidden[:, :-1].reshape(-1, student_hidden.shape[-1])
    ht = teacher_hidden[:, :-1].reshape(-1, teacher_hidden.shape[-1]).detach()
    lab = labels[:, 1:].reshape(-1)
    count = (lab != -100).sum()
    total = student_hidden.new_zeros((), dtype=torch.float32)
    params = (student_head.weight, getattr(student_head, "bias", None))
    teacher = (teacher_head.weight.detach(), getattr(teacher_head, "bias", None))
    for start in range(0, hs.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        total = total + checkpoint(
            _chunk_sums, hs[part], ht[part], lab[part], *params, *teacher, temperature, kd_weight, ce_weight,
            use_reentrant=False,
        )  # fmt: skip
    return total / count.clamp_min(1)
