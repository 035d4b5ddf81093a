"""Save / restore a whole quantized model as one safetensors file whose metadata holds the quantizer state
as JSON. No pickle anywhere."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, load_model, save_model
from torch import nn

from ..logging import get_logger
from ..nn.errors import UnsupportedFeatureError
from ..quantization.insertion import remove_quantizers, snapshot_implementations
from .hf import attach, checkpointing_enabled
from .state import convert_flat_block_amax, modelopt_state, restore_from_modelopt_state

__all__ = ["STATE_FILE", "first_difference", "load_state", "restore", "save"]

logger = get_logger(__name__)
_METADATA_KEY = "modelopt_lite_state"
STATE_FILE = "modelopt_lite_state.json"  # beside the weights in a save_pretrained / Trainer directory


def _path(f: str | os.PathLike[str]) -> Path:
    if not isinstance(f, (str, os.PathLike)):
        raise UnsupportedFeatureError(
            f"a {type(f).__name__} is not supported as the checkpoint: the state is safetensors metadata, "
            "written to and read from a path; pass a path such as 'model.safetensors'"
        )
    return Path(f)


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Name the file when what it holds cannot be read (cut short by a killed writer, or damaged)."""
    try:
        yield
    except (SafetensorError, json.JSONDecodeError, UnicodeDecodeError, KeyError) as err:
        raise ValueError(
            f"{path}: cannot be read, the file is truncated or corrupted ({type(err).__name__}: {err}); "
            "write it again (mto.save, QATTrainer.save_model) or use another checkpoint"
        ) from None


def save(model: nn.Module, f: str | os.PathLike[str]) -> Path:
    """Write weights, quantizer tensors and quantizer state of ``model`` to one safetensors file at the path
    ``f`` (the reference's argument name; a file object raises, naming the alternative)."""
    path = _path(f)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = modelopt_state(model)
    save_model(model, str(path), metadata={_METADATA_KEY: json.dumps(state)})
    logger.info("saved quantized model (%d quantizers) to %s", len(state["quantizers"]), path)
    return path


def load_state(path: str | Path) -> dict[str, Any]:
    """The quantizer state in a file written by :func:`save`, or in a directory saved by ``QATTrainer``."""
    path = Path(path)
    if path.is_dir():
        if not (path / STATE_FILE).is_file():
            raise ValueError(f"{path} holds no {STATE_FILE} (was it saved by QATTrainer.save_model?)")
        with _reading(path / STATE_FILE):
            return json.loads((path / STATE_FILE).read_text())["modelopt_state"]
    with _reading(path), safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if _METADATA_KEY not in metadata:
        raise ValueError(f"{path} holds no modelopt_lite state (was it written by mto.save?)")
    with _reading(path):
        return json.loads(metadata[_METADATA_KEY])


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    raise ValueError(f"{directory} holds no model.safetensors (or index)")


def _load_weights(model: nn.Module, path: Path) -> tuple[list[str], list[str]]:
    if not path.is_dir():
        with _reading(path):
            missing, unexpected = load_model(model, str(path), strict=False)
        return list(missing), list(unexpected)
    state_dict: dict[str, Any] = {}
    for file in _weight_files(path):
        with _reading(file):
            state_dict.update(load_file(str(file)))
    result = model.load_state_dict(state_dict, strict=False)
    # a tied weight (lm_head = embeddings) is saved once, under one of its names
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    tied = {n for names in groups.values() if len(names) > 1 and not set(names) <= set(result.missing_keys)
            for n in names}  # fmt: skip
    return [k for k in result.missing_keys if k not in tied], list(result.unexpected_keys)


def restore(model: nn.Module, f: str | os.PathLike[str]) -> nn.Module:
    """Re-create the quantizers saved by :func:`save` (a file) or ``QATTrainer.save_model`` (a directory) at
    the path ``f`` on a fresh ``model`` of the same architecture and load weights and quantizer tensors.
    Returns ``model``. If the checkpoint does not fit, the quantizers are removed again and the error names
    what differs."""
    path = _path(f)
    state = load_state(path)
    implementations = snapshot_implementations(model)
    restore_from_modelopt_state(model, state)
    try:
        missing, unexpected = _load_weights(model, path)
        if missing or unexpected:
            raise ValueError(
                f"{path} does not match the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
    except BaseException:
        remove_quantizers(model, implementations)
        raise
    convert_flat_block_amax(model)
    if checkpointing_enabled():
        attach(model)
    return model


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two plain JSON values first differ, as ``path: a != b``; None when equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return f"{path}.{key}: {'missing' if key not in a else a[key]!r} != " + (
                    "missing" if key not in b else repr(b[key])
                )
            found = first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} entries != {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"
