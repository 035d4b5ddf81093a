"""Writing a cache entry atomically: one builder per entry (an advisory lock beside it), a staging directory
renamed into place, and the SHA-256 of a file that a cache key or a pinned digest is checked with. Shared by
the default and real models (``models``) and the local task data of ``evaluation``: it imports none of the
floors."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .logging import get_logger

__all__ = ["builder_lock", "move_into_place", "sha256_file"]

logger = get_logger(__name__)
_BLOCK = 1 << 20


@contextlib.contextmanager
def builder_lock(target: Path) -> Iterator[bool]:
    """One builder per cache entry: a second process (another rank, another shell) waits for the first
    and then reuses its entry instead of building the same one again (training a model, converting one,
    extracting task data). Yields whether the lock is held (an
    advisory ``flock`` on ``.<name>.lock``, released by the kernel when a holder dies; where ``fcntl`` is
    missing, no lock: builders race and the first rename wins)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield False
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("cache entry %s: another process is building it; waiting", target.name)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def move_into_place(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``, replacing an old ``target`` (moved aside first, then deleted)."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, old / target.name)
    try:
        os.rename(staging, target)
    except OSError:
        if old is not None:  # put the previous model back
            os.rename(old / target.name, target)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The file's SHA-256 in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()
