"""GGUF files before a conversion: what one holds (architecture, parameter count, read from its header and
tensor table without loading a tensor), joining a file shipped in chunks into one (digest checked while it
is written), and the memory check made before a large model is loaded.

Every check here runs before anything is written into the cache, and each refuses by name: a file that is
not GGUF or is cut short (its tensor table points past its end), an architecture transformers' GGUF reader
does not list, a joined file whose SHA-256 is not the one expected, a model larger than the memory left.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..logging import get_logger

__all__ = [
    "GGUF_INSTALL",
    "GGUFInfo",
    "NotEnoughMemoryError",
    "available_memory",
    "check_memory",
    "is_gguf_file",
    "join_parts",
    "read_gguf_info",
    "supported_architectures",
]

logger = get_logger(__name__)
GGUF_INSTALL = "pip install 'gguf>=0.10'"  # or the [real] extra
MAGIC = b"GGUF"
SKIP_MEMORY_CHECK = "MODELOPT_LITE_SKIP_MEMORY_CHECK"
_BLOCK = 1 << 20


class NotEnoughMemoryError(MemoryError):
    """Refused before loading: the estimate of what a step needs exceeds the memory this machine has left."""


@dataclass(frozen=True)
class GGUFInfo:
    """What the header of a GGUF file says: ``architecture`` (``general.architecture``), ``parameters``
    (elements of every tensor), ``file_bytes``."""

    path: Path
    architecture: str
    parameters: int
    file_bytes: int

    @property
    def float32_bytes(self) -> int:
        return 4 * self.parameters


def require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            "reading a GGUF file needs the gguf package, which is not installed; install it with: "
            f"{GGUF_INSTALL} (or pip install 'modelopt_lite[real]')"
        )


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as handle:
        return handle.read(4) == MAGIC


def supported_architectures() -> tuple[str, ...]:
    """The GGUF architectures this transformers converts (its GGUF reader's list, less its non-model keys)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return tuple(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def read_gguf_info(path: str | os.PathLike[str]) -> GGUFInfo:
    """The header of the GGUF file ``path``: a file that is not GGUF, or whose tensor data would run past its
    end (a truncated download or join), raises ``ValueError`` naming it; nothing is loaded."""
    require_gguf()
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    size = path.stat().st_size
    if not is_gguf_file(path):
        raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = gguf.GGUFReader(str(path), "r")
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        parameters = sum(int(t.n_elements) for t in reader.tensors)
    except Exception as err:  # the reader raises ValueError, KeyError, IndexError, struct errors, ...
        raise ValueError(
            f"{path} ({size} bytes) cannot be read as GGUF ({type(err).__name__}: {err}): a truncated or "
            "damaged file; download or join it again"
        ) from err
    if end > size:
        raise ValueError(
            f"{path} is truncated: its tensor table ends at byte {end}, the file has {size}; download or "
            "join it again"
        )
    return GGUFInfo(path, architecture, parameters, size)


def check_architecture(info: GGUFInfo) -> None:
    """``ValueError`` naming the architecture and the supported ones when transformers cannot convert it."""
    supported = supported_architectures()
    if info.architecture not in supported:
        raise ValueError(
            f"{info.path}: GGUF architecture {info.architecture!r} is not one this transformers can convert "
            f"(supported: {', '.join(sorted(supported))}); convert the model to a Hugging Face checkpoint "
            "another way and pass its directory"
        )


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux ``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(needed: int, what: str, advice: str) -> None:
    """Refuse (``NotEnoughMemoryError``) before ``what`` starts when ``needed`` bytes exceed the memory
    available; ``advice`` says what to change. ``MODELOPT_LITE_SKIP_MEMORY_CHECK=1`` skips the check (the
    estimate is an estimate)."""
    free = available_memory()
    if free is None or os.environ.get(SKIP_MEMORY_CHECK) == "1":
        return
    if needed > free:
        raise NotEnoughMemoryError(
            f"{what} needs about {needed / 1e9:.1f} GB of memory and {free / 1e9:.1f} GB is available: "
            f"{advice} (or set {SKIP_MEMORY_CHECK}=1 to try anyway)"
        )
    logger.debug("%s: about %.1f GB needed, %.1f GB available", what, needed / 1e9, free / 1e9)


def join_parts(parts: Sequence[Path], target: Path, sha256: str | None, what: str) -> Path:
    """Concatenate ``parts`` in order into ``target``, hashing while writing: a SHA-256 other than
    ``sha256`` raises ``ValueError`` (naming ``what`` and both digests) and leaves no file; the file appears
    at ``target`` only when whole (written beside it, then renamed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f"{target.name}.partial-", dir=target.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(handle, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    for block in iter(lambda src=src: src.read(_BLOCK), b""):  # type: ignore[misc]
                        digest.update(block)
                        out.write(block)
        if sha256 is not None and digest.hexdigest() != sha256:
            raise ValueError(
                f"{what}: the {len(parts)} parts joined give SHA-256 {digest.hexdigest()}, expected {sha256} "
                "(a damaged or different release of a part); reinstall the parts"
            )
        os.replace(partial, target)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    return target
