"""Calibration samples from ``QuantizationArguments.calib_dataset``: any source ``modelopt_lite.data`` reads
(a local ``.txt`` / ``.md`` / ``.json`` / ``.jsonl`` / ``.csv`` / ``.parquet`` file, a ``save_to_disk``
directory, a cached dataset name), its documents joined as ``bos text eos`` and cut into consecutive
samples of ``seq_len`` tokens (a long document spans several samples)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..data import load_texts, token_stream, windows

__all__ = ["calibration_samples", "read_texts"]


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
