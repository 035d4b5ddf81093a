"""The callbacks :class:`~.qat_trainer.QATTrainer` adds to the training loop: the garbage-collector freeze
after the first optimizer step, and the check that no learnable amax went to zero or below."""

from __future__ import annotations

import math
from typing import Protocol

import torch
from transformers import TrainerCallback

from ..distributed import all_reduce_max, world_size
from .arguments import QuantizationArguments
from .gc_policy import GCPolicy

__all__: list[str] = []  # QATTrainer's own


class _AmaxOwner(Protocol):
    """What the amax check reads of its trainer (a ``QATTrainer``; named by shape, so that this module
    does not import the trainer that imports it)."""

    _amax_params: dict[str, torch.nn.Parameter]
    quant_args: QuantizationArguments


class _AmaxCheckCallback(TrainerCallback):
    """After each optimizer step: a learnable amax that reached zero or below quantizes everything it covers
    to zero; stop with the quantizer's name instead of training on silently."""

    def __init__(self, trainer: _AmaxOwner):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Check the learnable amax the model holds now, after ``accelerator.prepare`` and the checkpoint
        load. Under FSDP2 ``Trainer`` builds the optimizer first and ``fully_shard`` (in ``prepare``) then
        replaces every parameter by a sharded DTensor one, moving the optimizer onto the new ones: the
        Parameters ``create_optimizer`` saw are left behind, never trained (calibrated values in a fresh
        run; in a resumed one the zeros ``restore_from_modelopt_state`` allocated, as the checkpoint loads
        into the sharded parameters)."""
        params = self.trainer._amax_params
        if not params or model is None:
            return
        live = dict(model.named_parameters())
        self.trainer._amax_params = {n: live.get(n, p) for n, p in params.items()}

    def on_step_end(self, args, state, control, **kwargs):
        params = self.trainer._amax_params
        if not params:
            return
        with torch.no_grad():  # this rank's values (its shards under FSDP2), then the minimum over ranks
            local = {n: (p.to_local() if hasattr(p, "to_local") else p).detach() for n, p in params.items()}
            lows = {n: float(t.min()) for n, t in local.items() if t.numel()}
        name, low = min(lows.items(), key=lambda kv: kv[1], default=("", math.inf))
        if world_size() > 1:
            low = -float(all_reduce_max({"low": torch.tensor([-low])})["low"][0])
        if low <= 0:
            where = name if lows.get(name, math.inf) == low else "a learnable amax on another rank"
            raise RuntimeError(
                f"step {state.global_step}: the learnable amax {where} went to {low:.3g} (<= 0); lower "
                f"QuantizationArguments.amax_lr_multiplier ({self.trainer.quant_args.amax_lr_multiplier}) "
                "or the learning rate"
            )


class _GCCallback(TrainerCallback):
    """Freeze after the first optimizer step (``on_step_end`` runs after ``optimizer.step()``)."""

    def __init__(self, policy: GCPolicy):
        self.policy = policy

    def on_step_end(self, args, state, control, **kwargs):
        self.policy.after_optimizer_step()
