"""``mto`` entry points under the reference library's names and signatures, over our implementations.

The state is JSON (in safetensors metadata, or ``modelopt_state.json`` next to the weights), never a pickled
``torch.save`` file: a path to one raises :class:`~modelopt_lite.nn.errors.UnsupportedFeatureError` naming
what to use. Optimization modes other than quantization (NAS, pruning, sparsity, distillation as a mode) are
not part of this library; ``apply_mode`` and ``ModeloptStateManager`` exist and say so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from ..nn.errors import UnsupportedFeatureError
from .checkpoint import load_state
from .state import restore_from_modelopt_state as _restore_state

__all__ = ["ModeloptStateManager", "apply_mode", "load_modelopt_state", "restore_from_modelopt_state"]

_PICKLED = (".pt", ".pth", ".bin", ".pkl", ".ckpt")


def load_modelopt_state(modelopt_state_path: str | os.PathLike[str], **kwargs: Any) -> dict[str, Any]:
    """The modelopt state saved with a model: a file written by :func:`mto.save` or a directory saved by
    ``save_pretrained`` / ``QATTrainer`` (the same as :func:`mto.load_state`). ``kwargs`` are the reference's
    ``torch.load`` options (``map_location``, ``weights_only``); the state is JSON, so they change nothing."""
    path = Path(modelopt_state_path)
    if path.suffix in _PICKLED:
        raise UnsupportedFeatureError(
            f"{path}: a pickled (torch.save) modelopt_state is not read, as this library never unpickles; "
            "save the model with mto.save(model, 'model.safetensors') (or save_pretrained with "
            "mto.enable_huggingface_checkpointing()) and load that path"
        )
    return load_state(path)


def restore_from_modelopt_state(
    model: nn.Module,
    modelopt_state: dict[str, Any] | None = None,
    modelopt_state_path: str | os.PathLike[str] | None = None,
) -> nn.Module:
    """Re-create the quantizers recorded in ``modelopt_state`` (from :func:`mto.modelopt_state`) or in the
    file / directory ``modelopt_state_path``; load the weights afterwards (``load_state_dict``)."""
    if (modelopt_state is None) == (modelopt_state_path is None):
        raise ValueError("give exactly one of modelopt_state and modelopt_state_path")
    state = modelopt_state if modelopt_state is not None else load_modelopt_state(modelopt_state_path)  # type: ignore[arg-type]
    return _restore_state(model, state)


def apply_mode(model: nn.Module, mode: Any, registry: Any = None, init_state: Any = None) -> nn.Module:
    """The reference's generic mode entry point; the one mode here, quantization, is :func:`mtq.quantize`."""
    raise UnsupportedFeatureError(
        f"mto.apply_mode(model, {mode!r}): optimization modes (NAS, pruning, sparsity, distillation modes) "
        "are not part of this library; quantize with mtq.quantize(model, config, forward_loop) and "
        "distill with modelopt_lite.training.QADTrainer"
    )


class ModeloptStateManager:
    """The reference's per-model mode-state manager; here the state is :func:`mto.modelopt_state(model)` and
    what :func:`mtq.quant_state` records."""

    def __init__(self, model: nn.Module | None = None, init_state: bool = False) -> None:
        raise UnsupportedFeatureError(
            "ModeloptStateManager is not implemented (there is one mode, quantization): read the state with "
            "mto.modelopt_state(model) or mtq.quant_state(model)"
        )
