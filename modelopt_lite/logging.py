"""The library's one output channel.

``get_logger(__name__)`` returns a logger under the ``modelopt_lite`` hierarchy. In a multi-process run
INFO records are emitted by rank 0 only (so a progress line is not printed N times); DEBUG, WARNING and
above are emitted by every rank and carry a ``[rank N]`` prefix so their origin is visible.
"""

from __future__ import annotations

import logging
import os

__all__ = ["get_logger", "get_rank", "set_verbosity"]

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
