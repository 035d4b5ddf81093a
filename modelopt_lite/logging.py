"""The library's one output channel.

``get_logger(__name__)`` returns a logger under the ``modelopt_lite`` hierarchy. In a multi-process run
INFO records are emitted by rank 0 only (so a progress line is not printed N times); DEBUG, WARNING and
above are emitted by every rank and carry a ``[rank N]`` prefix so their origin is visible.
"""

from __future__ import annotations

import logging
import os

__all__ = ["get_logger", "get_rank", "quiet_third_party_import_noise", "set_verbosity"]

_ROOT_NAME = "modelopt_lite"


def get_rank() -> int:
    """Global rank of this process: torch.distributed when initialised, else ``RANK``, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a core dependency
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _RankFilter(logging.Filter):
    """Drop INFO on ranks other than 0 and tag every record with its rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = get_rank()
        record.rank_prefix = f"[rank {rank}] " if rank != 0 else ""
        return not (rank != 0 and record.levelno == logging.INFO)


def _configure_root() -> logging.Logger:
    root = logging.getLogger(_ROOT_NAME)
    if not getattr(root, "_modelopt_lite_configured", False):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(rank_prefix)s%(levelname)s %(name)s: %(message)s"))
        handler.addFilter(_RankFilter())
        root.addHandler(handler)
        level = os.environ.get("MODELOPT_LITE_LOG_LEVEL", "INFO").upper()
        root.setLevel(getattr(logging, level, logging.INFO))
        root.propagate = False
        root._modelopt_lite_configured = True  # type: ignore[attr-defined]
    return root


def get_logger(name: str) -> logging.Logger:
    """Logger for a library module; pass ``__name__``."""
    _configure_root()
    if name != _ROOT_NAME and not name.startswith(_ROOT_NAME + "."):
        name = f"{_ROOT_NAME}.{name}"
    return logging.getLogger(name)


def set_verbosity(level: int | str) -> None:
    """Set the level of every modelopt_lite logger (e.g. ``"DEBUG"`` or ``logging.WARNING``)."""
    if isinstance(level, str):
        level = getattr(logging, level.upper())
    _configure_root().setLevel(level)


class _ImportNoiseFilter(logging.Filter):
    """Drops, at import time, the known lines that other libraries print and a user cannot act on:

    * ``torchao``: "Failed to load .../torchao/_C*.so: Could not load this library" for each of its prebuilt
      CUDA extensions, on a machine without CUDA (torchao tries to load them whenever it is imported, and
      transformers imports it whenever it is installed); kept where CUDA is available, since there a kernel
      that does not load is a real problem;
    * ``torch.utils._pytree``: "<enum ...> is an Enum subclass and is now natively supported by
      torch.compile" (a deprecation notice to torchao's authors, printed when torchao registers its enums).

    Each dropped line is logged once on ``modelopt_lite`` at DEBUG, naming the library it came from: run with
    ``MODELOPT_LITE_LOG_LEVEL=DEBUG`` to see them (and nothing is dropped then)."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source

    def filter(self, record: logging.LogRecord) -> bool:
        if _configure_root().isEnabledFor(logging.DEBUG) or not _is_import_noise(self.source, record):
            return True
        logging.getLogger(_ROOT_NAME).debug(
            "dropped a %s %s line (import noise, see modelopt_lite.logging): %s",
            self.source, record.levelname, record.getMessage(),
        )  # fmt: skip
        return False


def _is_import_noise(source: str, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if source == "torchao":
        import sys

        torch = sys.modules.get("torch")
        cuda = torch is not None and torch.cuda.is_available()
        return not cuda and message.startswith("Failed to load") and "torchao" in message and "_C" in message
    return "is an Enum subclass and is now natively supported by torch.compile" in message


_NOISY = ("torchao", "torch.utils._pytree")


def quiet_third_party_import_noise() -> None:
    """Install :class:`_ImportNoiseFilter` on the loggers of :data:`_NOISY` (idempotent). ``import
    modelopt_lite`` calls it, so it takes effect when modelopt_lite is imported before transformers /
    torchao; lines printed before that come from torchao, not from this library."""
    for name in _NOISY:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ImportNoiseFilter) for f in logger.filters):
            logger.addFilter(_ImportNoiseFilter(name))
