"""Save / restore a whole quantized model as one safetensors file whose metadata holds the quantizer state
as JSON. No pickle anywhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from ..logging import get_logger
from ..quantization.insertion import remove_quantizers, snapshot_implementations
from .hf import attach, checkpointing_enabled
from .state import modelopt_state, restore_from_modelopt_state

__all__ = ["load_state", "restore", "save"]

logger = get_logger(__name__)
_METADATA_KEY = "modelopt_lite_state"


def save(model: nn.Module, path: str | Path) -> Path:
    """Write weights, quantizer tensors and quantizer state of ``model`` to one safetensors file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = modelopt_state(model)
    save_model(model, str(path), metadata={_METADATA_KEY: json.dumps(state)})
    logger.info("saved quantized model (%d quantizers) to %s", len(state["quantizers"]), path)
    return path


def load_state(path: str | Path) -> dict[str, Any]:
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if _METADATA_KEY not in metadata:
        raise ValueError(f"{path} holds no modelopt_lite state (was it written by mto.save?)")
    return json.loads(metadata[_METADATA_KEY])


def restore(model: nn.Module, path: str | Path) -> nn.Module:
    """Re-create the quantizers saved by :func:`save` on a fresh ``model`` of the same architecture and
    load weights and quantizer tensors. Returns ``model``. If the file does not fit, the quantizers are
    removed again and the error names what differs."""
    state = load_state(path)
    implementations = snapshot_implementations(model)
    restore_from_modelopt_state(model, state)
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{path} does not match the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
    except BaseException:
        remove_quantizers(model, implementations)
        raise
    if checkpointing_enabled():
        attach(model)
    return model
