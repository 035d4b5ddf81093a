"""Safetensors shards written as the tensors arrive: :class:`ShardWriter` holds at most one shard in memory,
so an export never keeps the whole packed model (let alone the unpacked one) at once.

Tensors go into the current shard in the order they are added; a tensor that would take the shard past
``max_bytes`` starts the next one (a tensor larger than ``max_bytes`` gets a shard of its own). Full shards
are saved under provisional names; :meth:`ShardWriter.close` renames them ``model.safetensors`` (one shard)
or ``model-0000i-of-0000N.safetensors`` with a ``model.safetensors.index.json``.

Also the shard size limit (:func:`parse_size`) and the target directory: refused when it holds files
without ``overwrite``, replaced only once the new one is complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..logging import get_logger

__all__ = ["ShardWriter", "parse_size", "staging_dir", "umask"]

logger = get_logger(__name__)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


class ShardWriter:
    """Collect tensors for ``directory`` and save a shard each time it reaches ``max_bytes``."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._shard: dict[str, torch.Tensor] = {}
        self._size = 0
        self._parts: list[tuple[str, list[str]]] = []  # (provisional file name, its keys)
        self._keys: set[str] = set()
        self.total_bytes = 0
        self.peak_bytes = 0  # the most bytes held in memory by one shard (for tests and benchmarks)

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, tensor in tensors.items():
            if key in self._keys:
                raise RuntimeError(f"export: the tensor {key} was written twice (a bug in the export)")
            self._keys.add(key)
            t = tensor.detach().contiguous().cpu()
            nbytes = t.numel() * t.element_size()
            if self._shard and self._size + nbytes > self.max_bytes:
                self._flush()
            self._shard[key] = t
            self._size += nbytes
            self.total_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self._size)

    def _flush(self) -> None:
        name = f"part-{len(self._parts) + 1:05d}.safetensors"
        save_file(self._shard, str(self.directory / name), metadata={"format": "pt"})
        (self.directory / name).chmod(0o666 & ~umask())  # safetensors writes 0600
        self._parts.append((name, list(self._shard)))
        self._shard, self._size = {}, 0

    def close(self) -> list[str]:
        """Save the last shard, give every shard its final name, write the index; the file names."""
        if self._shard or not self._parts:
            self._flush()
        if len(self._parts) == 1:
            os.replace(self.directory / self._parts[0][0], self.directory / "model.safetensors")
            return ["model.safetensors"]
        count = len(self._parts)
        names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        for name, (part, keys) in zip(names, self._parts, strict=True):
            os.replace(self.directory / part, self.directory / name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return [*names, "model.safetensors.index.json"]


def umask() -> int:
    """The process umask (read without changing it for longer than the call)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` / ``"500MiB"``."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = _SIZE.match(str(size)) if isinstance(size, str) else None
    if match is None:
        raise ValueError(f"max_shard_size={size!r}: expected a positive int of bytes or a string like '5GB'")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


def _check_target(export_dir: Path, overwrite: bool) -> None:
    if export_dir.exists() and not export_dir.is_dir():
        raise FileExistsError(f"export_dir {export_dir} exists and is not a directory")
    if export_dir.is_dir() and any(export_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"export_dir {export_dir} exists and is not empty; choose a new directory or pass overwrite=True "
            "(hf_ptq.py: --overwrite) to replace it"
        )


def staging_dir(export_dir: Path) -> Path:
    """A fresh hidden folder beside ``export_dir`` to write the export into, ``.<name>.<pid>.<random>.tmp``;
    those (and the ``.old`` ones of :func:`_move_into_place`) that a process no longer running left there,
    killed while exporting, are removed first."""
    for suffix in ("tmp", "old"):
        for stale in export_dir.parent.glob(f".{export_dir.name}.*.*.{suffix}"):
            owner = stale.name[len(export_dir.name) + 2 :].split(".", 1)[0]
            if owner.isdigit() and not _alive(int(owner)):
                shutil.rmtree(stale, ignore_errors=True)
                logger.info("removed %s, left by a killed export", stale.name)
    return _hidden(export_dir, "tmp")


def _hidden(export_dir: Path, suffix: str) -> Path:
    prefix = f".{export_dir.name}.{os.getpid()}."
    made = tempfile.mkdtemp(prefix=prefix, suffix=f".{suffix}", dir=export_dir.parent)
    Path(made).chmod(0o777 & ~umask())  # mkdtemp makes it 0700; the export is an ordinary directory
    return Path(made)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    return True


def _move_into_place(tmp: Path, export_dir: Path) -> None:
    """Rename ``tmp`` to ``export_dir``; an existing (empty or overwritten) directory is moved aside first and
    removed only once the new one is in place."""
    if not export_dir.exists():
        os.replace(tmp, export_dir)
        return
    old = Path(
        tempfile.mkdtemp(prefix=f".{export_dir.name}.{os.getpid()}.", suffix=".old", dir=export_dir.parent)
    )
    os.replace(export_dir, old / "previous")
    os.replace(tmp, export_dir)
    shutil.rmtree(old, ignore_errors=True)
