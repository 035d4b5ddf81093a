"""Weights of modules that accelerate offloads to CPU or disk (``device_map`` with ``"cpu"`` / ``"disk"``
entries, ``offload_folder``, ``cpu_offload``): outside the forward pass their parameters are on the meta
device and the values live in the ``weights_map`` of the module's ``AlignDevicesHook``.

:func:`offloaded_weights` materializes them for code that needs whole weights (weight calibration,
folding, export) through the hook's own ``pre_forward`` / ``post_forward``, accelerate's seam for exactly
this. With ``writeback=True`` the (possibly changed) values are stored in the hook's weights map first, so
the next forward loads them; values of disk-offloaded weights are then kept in memory (accelerate's
loader reads its in-memory state dict before the files).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["has_offloaded_weights", "offload_hook", "offloaded_weights"]


def offload_hook(module: nn.Module) -> Any | None:
    """The accelerate hook that offloads ``module``'s own tensors (``None`` when there is none)."""
    hook = module.__dict__.get("_hf_hook")
    hooks = getattr(hook, "hooks", (hook,))  # a SequentialHook chains several
    return next((h for h in hooks if getattr(h, "offload", False) and h.weights_map is not None), None)


@contextmanager
def offloaded_weights(module: nn.Module, writeback: bool = False) -> Iterator[None]:
    """Materialize the offloaded parameters of ``module`` and its submodules inside the block."""
    opened: list[tuple[nn.Module, Any]] = []
    try:
        for owner in module.modules():
            hook = offload_hook(owner)
            if hook is not None and any(p.is_meta for p in owner.parameters(recurse=hook.place_submodules)):
                hook.pre_forward(owner)
                hook.offload = False  # a forward inside the window keeps these weights (no reload / offload)
                opened.append((owner, hook))
        yield
        if writeback:
            for owner, hook in opened:
                _store(owner, hook)
    finally:
        for owner, hook in reversed(opened):
            hook.offload = True
            hook.post_forward(owner, None)


def has_offloaded_weights(model: nn.Module) -> bool:
    """Whether accelerate offloads any of ``model``'s weights to CPU / disk."""
    return any(offload_hook(m) is not None for m in model.modules())


def _store(owner: nn.Module, hook: Any) -> None:
    weights_map = hook.weights_map
    dataset, prefix = getattr(weights_map, "dataset", weights_map), getattr(weights_map, "prefix", "")
    target = getattr(dataset, "state_dict", dataset)  # OffloadedWeightsLoader, or a plain dict
    with torch.no_grad():
        for name, p in owner.named_parameters(recurse=hook.place_submodules):
            target[prefix + name] = p.detach().to("cpu", copy=True)
