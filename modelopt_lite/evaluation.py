"""Held-out evaluation of a causal LM, one protocol for every command: perplexity over fixed windows and the
KL divergence to a reference model per predicted token.

The protocol (what :func:`describe` states in each command's output):

* the documents become one token stream, each as ``bos text eos`` (``data.token_stream``), in order;
* the stream is cut into consecutive, non-overlapping windows of ``window`` tokens (stride = window); the
  tail shorter than a window is dropped (``data.windows``); every window is scored on its own, with no
  context carried over from the one before and no extra ``bos`` (a window may start inside a document);
* a window's first token is context only: each window predicts its ``window - 1`` other tokens, and every
  predicted token counts the same;
* perplexity = ``exp(total negative log-likelihood / predicted tokens)`` over all windows (or the first
  ``N`` where a command caps them);
* KL = mean over predicted tokens of ``KL(reference || model)`` between the next-token distributions, in
  nats;
* ``window``: :func:`default_window`, the model's ``max_position_embeddings`` up to ``MAX_WINDOW`` tokens,
  unless a command is told another (``--eval_seq``, ``--eval_seq_len``).

The default models and the benchmark figures (``docs/accuracy.md``) were measured with exactly this
protocol. This module imports only torch (scripts in other environments use it: ``benchmarks/``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .logging import get_logger

__all__ = [
    "KL_MAX_BYTES",
    "MAX_WINDOW",
    "default_window",
    "describe",
    "kl_per_token",
    "perplexity",
    "reference_logprobs",
    "reference_within",
]

logger = get_logger(__name__)

MAX_WINDOW = 512
KL_MAX_BYTES = 2 << 30  # the commands keep a reference's log-probabilities for the KL up to this size


def default_window(config: Any) -> int:
    """The protocol's window for a model config: ``max_position_embeddings``, at most ``MAX_WINDOW``."""
    limit = getattr(config, "max_position_embeddings", None)
    return min(MAX_WINDOW, limit) if isinstance(limit, int) and limit > 1 else MAX_WINDOW


def describe(windows: torch.Tensor) -> str:
    """The protocol as one line, for the output of a command that measured on ``windows``."""
    count, window = windows.shape
    return (
        f"{count} windows of {window} tokens (stride {window}, tail dropped; documents as bos text eos; "
        f"a window's first token is context only: {count * (window - 1)} predicted tokens)"
    )


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Perplexity of ``model`` on ``windows`` (``(count, window)`` token ids) by the protocol; the model's
    train / eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    windows = windows.to(_device(model))
    total, tokens = 0.0, 0
    for batch in windows.split(batch_size):
        n = batch.numel() - batch.shape[0]
        total += float(model(input_ids=batch, labels=batch).loss) * n
        tokens += n
    model.train(was_training)
    return math.exp(total / tokens)


def _logprobs(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch.to(_device(model))).logits[:, :-1].float().log_softmax(-1)


@torch.no_grad()
def reference_logprobs(
    model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8
) -> list[torch.Tensor]:
    """The reference model's next-token log-probabilities on ``windows``, one tensor per batch (for
    :func:`kl_per_token` with the same ``batch_size``)."""
    return [_logprobs(model, batch) for batch in windows.split(batch_size)]


def reference_within(
    model: torch.nn.Module, windows: torch.Tensor, max_bytes: int = KL_MAX_BYTES
) -> list[torch.Tensor] | None:
    """:func:`reference_logprobs`, or None (logged) when they would take more than ``max_bytes``."""
    vocab = model.get_output_embeddings().weight.shape[0]
    size = windows.shape[0] * (windows.shape[1] - 1) * vocab * 4
    if size > max_bytes:
        logger.info(
            "held-out KL skipped: the reference log-probabilities would take %.1f GB (%d windows x %d tokens "
            "x %d vocabulary); evaluate fewer windows to get it", size / 1e9, windows.shape[0],
            windows.shape[1] - 1, vocab,
        )  # fmt: skip
        return None
    return reference_logprobs(model, windows)


@torch.no_grad()
def kl_per_token(
    reference: list[torch.Tensor], model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8
) -> float:
    """Mean ``KL(reference || model)`` in nats per predicted token on ``windows``; ``reference``: from
    :func:`reference_logprobs` on the same windows and ``batch_size``."""
    total, count = 0.0, 0
    for ref, batch in zip(reference, windows.split(batch_size), strict=True):
        out = _logprobs(model, batch).to(ref.device)
        total += float((ref.exp() * (ref - out)).sum())
        count += ref.shape[0] * ref.shape[1]
    return total / count
