"""glibc ``malloc`` thresholds for CPU training loops: keep freed memory in the heap instead of returning it.

glibc serves a request at or above its *mmap threshold* with a fresh ``mmap`` and unmaps it on ``free``; it
also gives the top of the heap back to the kernel once more than the *trim threshold* is free there. Both
start at 128 KiB and move with glibc's *dynamic threshold* (freeing an mmapped block of size s raises the
mmap threshold to s and the trim threshold to 2 s), which stops at 32 MiB (``DEFAULT_MMAP_THRESHOLD_MAX``:
4 MiB times ``sizeof(long)``). So every tensor above 32 MiB -- and every temporary at the heap's top beyond
the trim threshold -- is page-faulted in again each time it is allocated: a CPU training step pays that for
every large activation, gradient and fake-quant output, each step.

:class:`MallocPolicy` raises both thresholds for a stretch of work (``apply()`` ... ``close()``, or
``with malloc_tuned():``) through ``mallopt`` (ctypes), so those blocks come from the heap and are reused by
the next step. What it does, exactly:

* ``apply()``: ``mallopt(M_MMAP_THRESHOLD, mmap_threshold)`` (default 1 GiB: larger blocks are still
  mmapped) and ``mallopt(M_TRIM_THRESHOLD, min(2 * mmap_threshold, INT_MAX))`` (glibc's own 2x rule). It
  changes nothing when the user set the allocator through the environment (``MALLOC_MMAP_THRESHOLD_``,
  ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_MAX_``, ``MALLOC_TOP_PAD_`` or those ``glibc.malloc.*`` names in
  ``GLIBC_TUNABLES``): one INFO line says so. On a C library that is not glibc (musl, macOS, Windows) it is
  a no-op with one INFO line.
* ``close()`` ("restore"): glibc has no getter for these parameters, and any ``mallopt`` of them switches the
  dynamic threshold off for the rest of the process (there is no call that switches it back on). So
  ``close()`` sets the values the dynamic threshold ends at -- mmap threshold 32 MiB, trim threshold 64 MiB
  (on 64-bit) -- which are the values in force in any process that has already freed a block of 32 MiB or
  more (loading a model does), and which the dynamic rule never moves from once reached. Then
  ``malloc_trim(0)`` hands the memory kept during the stretch back to the kernel. The glibc start values
  (128 KiB) are deliberately not restored: fixed at 128 KiB, every tensor above 128 KiB would be mmapped for
  the rest of the process, slower than before ``apply()``. ``close()`` is safe to call twice and after an
  error; it restores only what ``apply()`` set.

Memory: while applied, freed blocks up to ``mmap_threshold`` stay with the process (resident size stays at
the loop's peak, plus up to the trim threshold free at the heap's top) until ``close()``.

Never changed at import: only ``apply()`` (the trainers call it in ``train()``) touches the allocator.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator
from typing import Any

from .logging import get_logger

__all__ = [
    "DEFAULT_MMAP_THRESHOLD",
    "USER_ENV_VARS",
    "MallocPolicy",
    "dynamic_threshold_ceiling",
    "malloc_tuned",
]

logger = get_logger(__name__)

#: ``mallopt`` parameter numbers (glibc ``malloc.h``).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
_INT_MAX = 2**31 - 1
#: The mmap threshold while applied: blocks up to 1 GiB come from the heap.
DEFAULT_MMAP_THRESHOLD = 2**30
#: Environment settings of the allocator by the user; any of them set: :class:`MallocPolicy` leaves it alone.
USER_ENV_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_")
_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold", "glibc.malloc.mmap_max",
             "glibc.malloc.top_pad")  # fmt: skip


def dynamic_threshold_ceiling() -> tuple[int, int]:
    """``(mmap threshold, trim threshold)`` where glibc's dynamic threshold stops: ``4 MiB * sizeof(long)``
    and twice that (32 / 64 MiB on 64-bit)."""
    mmap = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
    return mmap, 2 * mmap


def _user_setting() -> str | None:
    """The environment setting of the allocator the user made, as ``NAME=value``, or None."""
    for name in USER_ENV_VARS:
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    for item in tunables.split(":"):
        if item.split("=", 1)[0].strip() in _TUNABLES:
            return f"GLIBC_TUNABLES={tunables}"
    return None


def _load_glibc() -> Any | None:
    """This process's C library when it is glibc (it exports ``gnu_get_libc_version`` and ``mallopt``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:  # pragma: no cover - a static interpreter
        return None
    if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
        return None  # musl has a mallopt that does nothing
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


class MallocPolicy:
    """Raise glibc's mmap and trim thresholds between :meth:`apply` and :meth:`close` (see the module
    docstring for what "restore" means).

    Args:
        enabled: False: :meth:`apply` and :meth:`close` do nothing.
        mmap_threshold: bytes; blocks up to this size come from the heap while applied (the trim threshold
            is twice this, capped at ``INT_MAX``).
        libc: the C library to call (tests pass a fake one); default: this process's, when it is glibc.

    After :meth:`apply`, ``state`` is one of ``"off"``, ``"applied"``, ``"user_env"`` (the user's
    environment setting was kept) or ``"unsupported"`` (no glibc ``mallopt``), and ``applied`` maps the
    ``mallopt`` parameter names set to their values (empty unless ``"applied"``).
    """

    def __init__(self, enabled: bool = True, mmap_threshold: int = DEFAULT_MMAP_THRESHOLD, libc: Any = None):
        if isinstance(mmap_threshold, bool) or not isinstance(mmap_threshold, int) or mmap_threshold < 1:
            raise ValueError(f"mmap_threshold={mmap_threshold!r} must be a positive number of bytes")
        if mmap_threshold > _INT_MAX:
            raise ValueError(f"mmap_threshold={mmap_threshold} exceeds mallopt's limit ({_INT_MAX} bytes)")
        self.enabled = enabled
        self.mmap_threshold = mmap_threshold
        self.trim_threshold = min(2 * mmap_threshold, _INT_MAX)
        self._libc = libc
        self.state = "off"
        self.applied: dict[str, int] = {}

    def _glibc(self) -> Any | None:
        libc = self._libc if self._libc is not None else _load_glibc()
        return libc if libc is not None and hasattr(libc, "mallopt") else None

    def apply(self) -> bool:
        """Set the thresholds; True when they were set. Idempotent while applied."""
        if not self.enabled:
            self.state = "off"
            return False
        if self.state == "applied":
            return True
        user = _user_setting()
        if user is not None:
            self.state = "user_env"
            logger.info("malloc: %s set in the environment, kept (the allocator setting is off)", user)
            return False
        libc = self._glibc()
        if libc is None:
            self.state = "unsupported"
            logger.info(
                "malloc: this C library has no glibc mallopt; the allocator setting does nothing here"
            )
            return False
        for name, param, value in (("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, self.mmap_threshold),
                                   ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, self.trim_threshold)):  # fmt: skip
            if libc.mallopt(param, value) == 1:
                self.applied[name] = value
            else:
                logger.info(
                    "malloc: glibc refused mallopt(%s, %d); that threshold is left as it was", name, value
                )
        self.state = "applied"
        logger.debug(
            "malloc: %s until the end of the loop", ", ".join(f"{k}={v}" for k, v in self.applied.items())
        )
        return True

    def close(self) -> None:
        """Set what :meth:`apply` set to the dynamic threshold's ceiling, then ``malloc_trim(0)``. Safe to
        call twice and after an error."""
        if self.state != "applied":
            return
        libc = self._glibc()
        mmap, trim = dynamic_threshold_ceiling()
        restored = {}
        for name, param, value in (("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, mmap),
                                   ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, trim)):  # fmt: skip
            if name in self.applied and libc.mallopt(param, value) == 1:
                restored[name] = value
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
        self.applied = {}
        self.state = "off"
        logger.debug(
            "malloc: restored %s; freed heap trimmed", ", ".join(f"{k}={v}" for k, v in restored.items())
        )


@contextlib.contextmanager
def malloc_tuned(
    enabled: bool = True, mmap_threshold: int = DEFAULT_MMAP_THRESHOLD
) -> Iterator[MallocPolicy]:
    """``with malloc_tuned():`` -- :class:`MallocPolicy` applied for the block (calibration, a custom loop),
    closed on exit, also after an error."""
    policy = MallocPolicy(enabled, mmap_threshold)
    policy.apply()
    try:
        yield policy
    finally:
        policy.close()
