"""The trainers' data checks and calibration samples from ``QuantizationArguments.calib_dataset``: any source
``modelopt_lite.data`` reads (a local ``.txt`` / ``.md`` / ``.json`` / ``.jsonl`` / ``.csv`` / ``.parquet``
file, a ``save_to_disk`` directory, a cached dataset name), its documents joined as ``bos text eos`` and cut
into consecutive samples of ``seq_len`` tokens (a long document spans several samples)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..data import load_texts, token_stream, windows
from ..logging import get_logger

__all__ = ["calibration_samples", "check_training_data", "read_texts"]

logger = get_logger(__name__)


def check_training_data(args: Any, data: Any) -> None:
    """Before training: an empty ``train_dataset`` raises; a WARNING when ``max_steps`` asks for more samples
    than it holds (the loop then repeats the data: recovery follows distinct tokens, not steps, once the
    data repeats)."""
    if data is None or not hasattr(data, "__len__"):
        return
    if len(data) == 0:
        raise ValueError("train_dataset is empty: give the trainer training samples")
    if args.max_steps <= 0:
        return
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    needed = args.max_steps * per_step
    if len(data) < needed:
        logger.warning(
            "max_steps=%d at %d samples a step (%d per device x %d accumulation x %d process(es)) needs "
            "%d samples; the training data holds %d: each sample is seen %.1f times. Give more distinct "
            "data or fewer steps",
            args.max_steps, per_step, args.per_device_train_batch_size, args.gradient_accumulation_steps,
            args.world_size, needed, len(data), needed / len(data),
        )  # fmt: skip


def read_texts(path: str | Path, text_field: str = "text") -> list[str]:
    """The documents of a calibration source (``modelopt_lite.data.load_texts``)."""
    return load_texts(path, text_field=text_field)


def calibration_samples(
    path: str | Path, tokenizer: Any, seq_len: int, text_field: str = "text"
) -> list[dict[str, torch.Tensor]]:
    """Samples ``{"input_ids", "attention_mask"}`` of ``seq_len`` tokens from the source at ``path``."""
    if tokenizer is None:
        raise ValueError("calib_dataset is a data source: pass processing_class=tokenizer to the trainer")
    stream = token_stream(tokenizer, read_texts(path, text_field))
    chunks = windows(stream, seq_len, what=f"calibration data {path} (calib_seq_len={seq_len})")
    return [{"input_ids": chunk, "attention_mask": torch.ones_like(chunk)} for chunk in chunks]
