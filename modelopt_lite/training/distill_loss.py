"""Distillation loss computed in chunks of the sequence, so that the full-vocabulary float32 logits of
the student and the teacher are never materialised at once.

``loss = kd_weight * T^2 * KL(teacher_T || student_T) + ce_weight * CE(student, labels)``, averaged over the
tokens whose (shifted) label is not ``-100``. Position ``t`` predicts label ``t + 1``. Each chunk's student
logits are recomputed in backward (activation checkpointing), so memory holds one chunk of logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_distillation_loss"]


def _chunk_sums(
    hs: torch.Tensor,
    ht: torch.Tensor,
    labels: torch.Tensor,
    student_head: Callable[[torch.Tensor], torch.Tensor],
    teacher_head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    kd_weight: float,
    ce_weight: float,
) -> torch.Tensor:
    mask = labels != -100
    student = student_head(hs).float()
    with torch.no_grad():
        teacher = teacher_head(ht).float()
    if student.shape[-1] != teacher.shape[-1]:
        raise ValueError(
            f"student vocabulary ({student.shape[-1]}) differs from the teacher's ({teacher.shape[-1]}): "
            "distillation needs the same tokenizer"
        )
    teacher_logp = F.log_softmax(teacher / temperature, dim=-1)
    student_logp = F.log_softmax(student / temperature, dim=-1)
    kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    total = kd_weight * temperature**2 * (kl * mask).sum()
    if ce_weight:
        ce = F.cross_entropy(student, labels.clamp_min(0), reduction="none")
        total = total + ce_weight * (ce * mask).sum()
    return total


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
    chunk_size: int = 512,
    num_items: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Distillation loss from the last hidden states ``(batch, seq, hidden)`` and the two LM heads (modules
    or functions: a quantized ``lm_head`` runs with its quantizers; ``nn.Identity`` turns the hidden states
    into logits). Divided by the number of predicted tokens, or by ``num_items`` when given (the token count
    of a whole accumulated batch)."""
    if temperature <= 0 or chunk_size < 1:
        raise ValueError(f"temperature={temperature} must be > 0 and chunk_size={chunk_size} >= 1")
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
    hs = student_hidden[:, :-1].reshape(-1, student_hidden.shape[-1])
    ht = teacher_hidden[:, :-1].reshape(-1, teacher_hidden.shape[-1]).detach()
    lab = labels[:, 1:].reshape(-1)
    count = (lab != -100).sum() if num_items is None else torch.as_tensor(num_items, device=hs.device)
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
            use_reentrant=False,
        )
    return total / count.clamp_min(1)
