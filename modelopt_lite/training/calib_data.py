"""Calibration samples from a local text file: ``.txt`` (the whole text) or ``.json`` / ``.jsonl`` (the
``"text"`` field of each record), tokenized with the trainer's tokenizer and cut into samples of
``seq_len`` tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["calibration_samples", "read_texts"]


def read_texts(path: Path) -> list[str]:
    """The texts of a local file: the whole ``.txt``, or the ``"text"`` field of each ``.json`` / ``.jsonl``
    record."""
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8")]
    if path.suffix in (".json", ".jsonl"):
        raw = path.read_text(encoding="utf-8")
        records = (
            json.loads(raw) if path.suffix == ".json" else [json.loads(x) for x in raw.splitlines() if x]
        )
        if isinstance(records, dict) or not all(isinstance(r, dict) and "text" in r for r in records):
            raise ValueError(f"{path}: expected a list of records with a 'text' field")
        return [r["text"] for r in records]
    raise ValueError(f"calibration data {path}: use a .txt, .json or .jsonl file (got {path.suffix!r})")


def calibration_samples(path: str | Path, tokenizer: Any, seq_len: int) -> list[dict[str, torch.Tensor]]:
    """Samples ``{"input_ids", "attention_mask"}`` of ``seq_len`` tokens from the file at ``path``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"calibration data {path} does not exist")
    if tokenizer is None:
        raise ValueError("calib_dataset is a file: pass processing_class=tokenizer to the trainer")
    ids: list[int] = []
    for text in read_texts(path):
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) < seq_len:
        raise ValueError(f"calibration data {path} has {len(ids)} tokens, fewer than calib_seq_len={seq_len}")
    samples = []
    for start in range(0, len(ids) - seq_len + 1, seq_len):
        chunk = torch.tensor(ids[start : start + seq_len])
        samples.append({"input_ids": chunk, "attention_mask": torch.ones_like(chunk)})
    return samples
