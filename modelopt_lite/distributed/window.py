"""Weight-access windows: a module's full parameters under FSDP2, for code that needs whole weights
(weight calibration, folding, export) outside the forward pass.

::

    with weight_access(layer, root=model, writeback=True):
        layer.weight.mul_(2)          # a full, plain tensor here on every rank
    # layer.weight is the FSDP2 shard again, holding this rank's part of the doubled weight

Inside the window each DTensor parameter of ``module`` (recursively) is replaced by a plain parameter holding
the gathered full tensor (an all-gather per parameter); on exit the original sharded parameters are put
back, even when the body raises. With ``writeback=True`` each rank first copies its slice of the (possibly
modified) full tensor into its shard; no communication is needed for that. All ranks must open the same
windows in the same order. Outside FSDP2 (no DTensor parameters) the window only loads parameters that
accelerate offloads to CPU / disk (on the meta device outside forward; see :mod:`.offload`), and otherwise
changes nothing.

A rank that raises inside the window makes every rank raise on exit (:class:`~.comm.RankFailedError`)
instead of leaving the others waiting in their next collective; ``timeout`` (seconds, gloo) bounds how long
the others wait for a rank that never arrives. Windows do not nest.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .comm import all_ranks_succeed
from .offload import offloaded_weights

__all__ = ["is_sharded", "shard_frozen", "unsharded_class", "weight_access"]

_STATE = threading.local()


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def is_sharded(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor (FSDP2-sharded)."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters())


def unsharded_class(module: nn.Module) -> type:
    """The class ``module`` had before ``fully_shard`` (which swaps in a subclass named ``FSDP<Class>``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return type(module)
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


@contextmanager
def weight_access(
    module: nn.Module,
    root: nn.Module | None = None,
    writeback: bool = False,
    timeout: float | None = None,
) -> Iterator[nn.Module]:
    """Full weights of ``module`` inside the block (see the module docstring). ``root``: the model the
    module must belong to (checked)."""
    if root is not None and not any(m is module for m in root.modules()):
        raise ValueError(
            f"weight_access: the {type(module).__name__} given is not a submodule of the "
            f"{type(root).__name__} passed as root; open the window on a module of the model"
        )
    open_on = getattr(_STATE, "module", None)
    if open_on is not None:
        raise RuntimeError(
            f"weight_access: a window on a {type(open_on).__name__} is already open; windows do not nest "
            "(close it first, or open one window on a common parent module)"
        )
    dtensor = _dtensor_type()
    sharded = [
        (owner, name, p)
        for owner in module.modules()
        for name, p in owner._parameters.items()
        if dtensor is not None and isinstance(p, dtensor)
    ]
    if not sharded:
        _STATE.module = module
        try:
            with offloaded_weights(module, writeback):
                yield module
        finally:
            _STATE.module = None
        return
    _STATE.module = module
    try:
        with torch.no_grad():
            for owner, name, p in sharded:
                owner._parameters[name] = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
        with all_ranks_succeed(f"weight-access window on {type(module).__name__}", timeout):
            yield module
        if writeback:
            _write_back(sharded)
    finally:
        for owner, name, p in sharded:
            owner._parameters[name] = p
        _STATE.module = None


def _write_back(sharded: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        for owner, name, p in sharded:
            full = owner._parameters[name]
            if full.shape != p.shape:
                raise ValueError(
                    f"weight_access(writeback=True): {name} changed shape inside the window "
                    f"({tuple(p.shape)} -> {tuple(full.shape)})"
                )
            mine = distribute_tensor(full.detach(), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(mine.to_local())


def shard_frozen(model: nn.Module, block_classes: list[str] | tuple[str, ...]) -> nn.Module:
    """Shard a frozen model (a distillation teacher) with FSDP2: each module whose class name is in
    ``block_classes`` (e.g. the model's ``_no_split_modules``), then the root. Its forward gathers one block
    at a time; the root's parameters (embeddings, final norm, LM head) stay gathered after forward."""
    from torch.distributed.fsdp import fully_shard

    blocks = [m for m in model.modules() if type(m).__name__ in set(block_classes)]
    if not blocks:
        raise ValueError(
            f"shard_frozen: no module of {type(model).__name__} is one of {sorted(block_classes)}; name the "
            "class of its transformer blocks"
        )
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model
