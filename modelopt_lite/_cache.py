"""The library's cache directory, shared by the default models and the native kernels."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_base"]


def cache_base() -> Path:
    """``$MODELOPT_LITE_CACHE``, else ``$XDG_CACHE_HOME/modelopt_lite``, else ``~/.cache/modelopt_lite``."""
    base = os.environ.get("MODELOPT_LITE_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = os.path.join(xdg, "modelopt_lite") if xdg else os.path.join("~", ".cache", "modelopt_lite")
    return Path(base).expanduser()
