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
from collections.abc import Callable, Iterator
from pathlib import Path

from .logging import get_logger

__all__ = ["build_once", "builder_lock", "move_into_place", "sha256_file"]

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


def build_once(
    target: Path, complete: Callable[[Path], bool], write: Callable[[Path], None], *, force: bool = False
) -> bool:
    """Write the cache entry ``target`` unless ``complete(target)`` (or ``force``): under
    :func:`builder_lock` (a second builder waits, then finds it complete), ``write(staging)`` fills a fresh
    hidden staging folder beside ``target`` (those a killed builder left are removed first), renamed into
    place when it returns; a failure removes the staging folder and re-raises. Whether this call wrote it."""
    if complete(target) and not force:
        return False
    with builder_lock(target) as exclusive:
        if complete(target) and not force:  # another process wrote it while this one waited
            return False
        if exclusive:  # no other builder runs: a staging folder left is a killed one's
            for stale in target.parent.glob(f".{target.name}.partial-*"):
                shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        try:
            write(staging)
            move_into_place(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return True


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The file's SHA-256 in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()
