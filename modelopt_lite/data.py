"""Text data for calibration, training and evaluation, read through Hugging Face ``datasets``, offline.

One loader (:func:`load_texts`) serves ``modelopt-lite-ptq`` / ``hf_ptq.py``, ``examples/llm_qat/main.py``
and the trainers' ``calib_dataset``. A source is

* a local file: ``.txt`` / ``.md`` (one document per paragraph, paragraphs separated by a blank line),
  ``.json`` (a list of records) or ``.jsonl`` (one record a line), ``.csv`` or ``.parquet`` (one record a
  row); a record's document is its ``text_field`` column (``"text"`` unless told);
* a directory written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` of which
  ``split`` is read);
* or the name of a dataset already in the local ``datasets`` cache (``load_dataset(name, split=split)``).

Documents are kept whole: :func:`token_stream` joins them, each as ``bos text eos``, into one token stream
and :func:`windows` cuts it into consecutive windows, so a document longer than a window spans several
windows (nothing is truncated) and a window may hold the end of one document and the start of the next.
:func:`heldout_split` keeps the last documents of a source for evaluation.

This module imports only torch (``datasets`` on first read), so that scripts run in other environments
(``benchmarks/_peer_worker.py``) can use its windows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SUPPORTED_SUFFIXES",
    "TokenWindows",
    "check_sequence_length",
    "heldout_split",
    "load_texts",
    "token_stream",
    "windows",
]

_BUILDERS = {
    ".txt": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}
SUPPORTED_SUFFIXES: tuple[str, ...] = tuple(_BUILDERS)
_SUPPORTED = f"{', '.join(SUPPORTED_SUFFIXES)} files or a directory written by datasets' save_to_disk"


def check_sequence_length(model: Any, input_ids: Any, where: str) -> None:
    """Raise when ``input_ids`` (a tensor, last dimension the sequence) is longer than the positions of
    ``model`` (``config.max_position_embeddings``, unless a ``rope_scaling`` extends them): past them a
    learned position table fails and rotary positions compute what the model never saw."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or not isinstance(input_ids, torch.Tensor) or input_ids.dim() == 0:
        return
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
    extended = isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default"
    if input_ids.shape[-1] > limit and not extended:
        raise ValueError(
            f"{where}: a sequence of {input_ids.shape[-1]} tokens is longer than the model's "
            f"max_position_embeddings={limit}; cut the data into windows of at most {limit} tokens "
            "(seq_len / calib_seq_len)"
        )


def _datasets() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read before the first import of datasets
    try:
        import datasets
    except ImportError:
        raise ImportError("reading data needs `datasets`: pip install 'datasets>=3.0'") from None
    return datasets


def _read(source: str | Path, text_field: str, split: str) -> list[str]:
    datasets = _datasets()
    path = Path(source)
    what = str(source)
    if path.is_dir():
        try:
            data = datasets.load_from_disk(str(path))
        except Exception as err:  # datasets raises many types here; the message says what happened
            raise ValueError(
                f"{path}: a directory datasets' load_from_disk cannot read ({type(err).__name__}: {err})"
            ) from None
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"{path}: no split {split!r}; its splits: {sorted(data)}")
            data, what = data[split], f"split {split!r} of {path}"
    elif path.is_file():
        builder = _BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"{path}: unsupported extension {path.suffix!r}; supported: {_SUPPORTED}")
        if path.stat().st_size == 0 or (
            builder != "parquet" and not path.read_text(encoding="utf-8").strip()
        ):
            raise ValueError(f"{path}: empty file (no documents)")
        if builder == "text":  # the text builder names its one column "text", whatever text_field says
            data = datasets.load_dataset("text", data_files=str(path), split="train", sample_by="paragraph")
            text_field = "text"
        else:
            data = datasets.load_dataset(builder, data_files=str(path), split="train")
    elif path.suffix.lower() in _BUILDERS or path.is_absolute():
        raise ValueError(f"{path}: no such file or directory")
    else:
        try:
            data = datasets.load_dataset(str(source), split=split)
        except Exception as err:  # datasets raises many types here; the message says what happened
            raise ValueError(
                f"{source}: no such file or directory, and no dataset of that name in the local datasets "
                f"cache ({type(err).__name__}: {err}); supported: {_SUPPORTED}"
            ) from None
        what = f"split {split!r} of {source}"
    if len(data) == 0:
        raise ValueError(f"{what}: empty (no records)")
    if text_field not in data.column_names:
        raise ValueError(
            f"{what}: no text field {text_field!r}; its fields: {data.column_names} (choose one with the "
            "text field option: --text_field, calib_text_field)"
        )
    texts = data[text_field]
    bad = next((t for t in texts if not isinstance(t, str)), None)
    if bad is not None:
        raise ValueError(f"{what}: field {text_field!r} holds a {type(bad).__name__}, not text")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"{what}: every {text_field!r} is empty")
    return texts


def load_texts(
    source: str | Path | Sequence[str | Path], *, text_field: str = "text", split: str = "train"
) -> list[str]:
    """The documents of one source or several (concatenated in order); see the module docstring for what a
    source may be. ``split``: which split of a saved ``DatasetDict`` or a cached dataset name. Raises
    ``ValueError`` naming the source for an unsupported extension (listing the supported ones), a missing
    text field (listing the fields), an empty file or split, or a missing split (listing the splits)."""
    sources = [source] if isinstance(source, (str, Path)) else list(source)
    if not sources:
        raise ValueError("no data source given")
    return [text for src in sources for text in _read(src, text_field, split)]


def heldout_split(
    texts: Sequence[str], percent: float, source: str = "the data"
) -> tuple[list[str], list[str]]:
    """(kept, held out): the last ``percent`` % of the documents (at least one) are held out."""
    if not 0 < percent < 100:
        raise ValueError(f"held-out percent {percent}: must be between 0 and 100 (exclusive)")
    cut = max(1, int(len(texts) * (1 - percent / 100)))
    if cut >= len(texts):
        raise ValueError(
            f"{source}: {len(texts)} document(s), too few to hold out {percent}% for evaluation; add "
            "documents (a .txt file holds one per paragraph)"
        )
    return list(texts[:cut]), list(texts[cut:])


def token_stream(tokenizer: Any, texts: Sequence[str]) -> torch.Tensor:
    """All texts as one 1-D id tensor, each wrapped as ``bos text eos`` (either left out when the tokenizer
    has none), tokenized without the tokenizer's own special tokens."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    head, tail = ([bos] if bos is not None else []), ([eos] if eos is not None else [])
    ids: list[int] = []
    for row in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids += [*head, *row, *tail]
    return torch.tensor(ids, dtype=torch.long)


def windows(
    stream: torch.Tensor, window: int, limit: int | None = None, what: str = "the data"
) -> torch.Tensor:
    """Consecutive, non-overlapping ``window``-token windows of ``stream`` (stride = window), the tail shorter
    than a window dropped; the first ``limit`` only when given. Shape ``(count, window)``."""
    count = stream.numel() // window
    if count == 0:
        raise ValueError(f"{what}: {stream.numel()} tokens, fewer than one window of {window}")
    return stream[: count * window].view(count, window)[:limit]


class TokenWindows(torch.utils.data.Dataset):
    """Consecutive ``seq_len`` windows of a token stream (:func:`windows`) as causal-LM samples."""

    def __init__(self, stream: torch.Tensor, seq_len: int, limit: int | None = None):
        self.ids = windows(stream, seq_len, limit)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
