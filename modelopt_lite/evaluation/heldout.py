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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..logging import get_logger

__all__ = [
    "KL_MAX_BYTES",
    "MAX_WINDOW",
    "Comparison",
    "StoredLogits",
    "compare",
    "default_window",
    "describe",
    "greedy_continuations",
    "kl_per_token",
    "perplexity",
    "reference_logprobs",
    "reference_within",
    "store_logits",
    "stored_logits_bytes",
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


@dataclass(frozen=True)
class Comparison:
    """A model against its reference on the same windows, by the protocol: both perplexities, the mean
    ``KL(reference || model)`` in nats per predicted token, and top-1 agreement (the share of predicted
    tokens where both models' most likely next token is the same)."""

    reference_perplexity: float
    perplexity: float
    kl: float
    top1_agreement: float
    tokens: int


class StoredLogits:
    """A model's logits on evaluation windows in a file (raw, in the logits' dtype), read back one window at a
    time: the reference of :func:`compare` when the reference model cannot stay in memory beside the model
    compared with it (the PTQ command line quantizes in place). Written by :func:`store_logits`; the values
    read back are the ones computed, bit for bit."""

    def __init__(
        self, path: str | os.PathLike[str], windows: int, length: int, vocab: int, dtype: torch.dtype
    ):
        self.path, self.windows, self.length, self.vocab, self.dtype = (
            Path(path),
            windows,
            length,
            vocab,
            dtype,
        )
        self.row_bytes = length * vocab * torch.empty((), dtype=dtype).element_size()

    def read(self, index: int, positions: slice) -> torch.Tensor:
        """The logits of window ``index`` at ``positions`` (a step-1 slice), ``(positions, vocab)``."""
        start, stop, _ = positions.indices(self.length)
        if not 0 <= index < self.windows:
            raise IndexError(f"window {index} of {self.windows} stored")
        per_token = self.row_bytes // self.length
        with open(self.path, "rb") as handle:
            handle.seek(index * self.row_bytes + start * per_token)
            data = bytearray(handle.read((stop - start) * per_token))
        return torch.frombuffer(data, dtype=torch.uint8).view(self.dtype).view(stop - start, self.vocab)


def stored_logits_bytes(windows: torch.Tensor, vocab: int, dtype: torch.dtype) -> int:
    """What :func:`store_logits` writes for ``windows`` at a vocabulary of ``vocab`` in ``dtype``."""
    return windows.numel() * vocab * torch.empty((), dtype=dtype).element_size()


@torch.no_grad()
def store_logits(
    model: torch.nn.Module, windows: torch.Tensor, path: str | os.PathLike[str], batch_size: int = 4
) -> StoredLogits:
    """Run ``model`` on ``windows`` batch by batch and write its logits to ``path`` (one batch's logits in
    memory at a time): the reference of a later :func:`compare`. The model's train / eval mode is restored."""
    was_training = model.training
    model.eval()
    shape: tuple[int, torch.dtype] | None = None
    with open(path, "wb") as handle:
        for batch in windows.split(batch_size):
            logits = model(input_ids=batch.to(_device(model))).logits.contiguous().cpu()
            shape = (logits.shape[-1], logits.dtype)
            logits.view(torch.uint8).numpy().tofile(handle)  # no copy of the batch's logits
            del logits
    model.train(was_training)
    if shape is None:
        raise ValueError("store_logits: no windows to evaluate")
    return StoredLogits(path, windows.shape[0], windows.shape[1], shape[0], shape[1])


@torch.no_grad()
def compare(
    reference: torch.nn.Module | StoredLogits,
    model: torch.nn.Module,
    windows: torch.Tensor,
    batch_size: int = 4,
    chunk_tokens: int | None = None,
) -> Comparison:
    """:class:`Comparison` of ``model`` with ``reference`` (a model, or its :class:`StoredLogits` on the same
    ``windows``) on ``windows``, batch by batch: nothing of a whole evaluation is kept, only one batch's
    logits of each model (``batch_size x window x vocab``; of a stored reference: one chunk) and
    ``chunk_tokens`` rows of log-probabilities at a time (default: 256, fewer where the vocabulary is larger
    than 65536, so that a chunk's float32 log-probabilities stay under 64 MB). Train / eval modes are
    restored."""
    stored = isinstance(reference, StoredLogits)
    if stored and (reference.windows, reference.length) != tuple(windows.shape):
        raise ValueError(
            f"compare: the stored reference has {reference.windows} windows of {reference.length} tokens, "
            f"the evaluation {windows.shape[0]} of {windows.shape[1]}; store it on the same windows"
        )
    modes = [(m, m.training) for m in ((model,) if stored else (reference, model))]
    for m, _ in modes:
        m.eval()
    nll_ref = nll = kl = 0.0
    agree = count = 0
    for first, batch in zip(range(0, windows.shape[0], batch_size), windows.split(batch_size), strict=True):
        ref_logits = None if stored else reference(input_ids=batch.to(_device(reference))).logits
        logits = model(input_ids=batch.to(_device(model))).logits
        device = logits.device if ref_logits is None else ref_logits.device
        logits = logits.to(device)
        targets = batch[:, 1:].to(device)
        for row in range(batch.shape[0]):  # [row, :-1] of a contiguous (batch, window, vocab) is no copy
            chunk = chunk_tokens or max(1, min(256, (64 << 20) // (4 * logits.shape[-1])))
            for start in range(0, targets.shape[1], chunk):
                positions = slice(start, min(start + chunk, targets.shape[1]))
                ref = (
                    reference.read(first + row, positions).to(device)
                    if stored
                    else ref_logits[row, positions]
                )
                ref_lp = ref.float().log_softmax(-1)
                lp = logits[row, positions].float().log_softmax(-1)
                target = targets[row, positions, None]
                nll_ref -= float(ref_lp.gather(1, target).sum())
                nll -= float(lp.gather(1, target).sum())
                kl += float((ref_lp.exp() * (ref_lp - lp)).sum())
                agree += int((ref_lp.argmax(-1) == lp.argmax(-1)).sum())
        count += targets.numel()
        del ref_logits, logits
    for m, was_training in modes:
        m.train(was_training)
    return Comparison(math.exp(nll_ref / count), math.exp(nll / count), kl / count, agree / count, count)


@torch.no_grad()
def greedy_continuations(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int) -> list[str]:
    """The greedy (argmax) continuation of each prompt, ``max_new_tokens`` tokens at most, decoded without
    the prompt; the model's train / eval mode is restored."""
    was_training = model.training
    model.eval()
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(_device(model))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        generated = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=pad,
        )  # fmt: skip
        out.append(tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True))
    model.train(was_training)
    return out
