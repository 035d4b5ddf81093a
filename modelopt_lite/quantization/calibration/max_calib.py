"""Max calibration (the ``"max"`` algorithm, the default): it runs the user's ``forward_loop`` with every
quantizer's fake quant off while the enabled static activation quantizers collect their absolute maximum;
weight quantizers are calibrated from the weights themselves (independent of which tokens arrived). If the
loop raises, quantizers are put back in their previous mode and keep their previous ``amax``. Afterwards
every enabled static quantizer must hold a finite, positive ``amax``; otherwise
:func:`~.calibrate.check_calibrated` raises naming each one. MoE experts that received no tokens take the
amax of the other experts of their layer, with a WARNING (or raise, with the algorithm option
``moe_experts_without_tokens="raise"``; :mod:`.idle_experts`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ...distributed import all_ranks_succeed, is_distributed, weight_access
from ...logging import get_logger
from ...moe import expert_containers, record_amax_fills, reset_coverage
from ...moe.sequential import split_expert_name
from ...nn import QuantModule, SequentialQuantizer, TensorQuantizer, iter_quantizers
from ...nn.calibrators import sync_calibrators
from ...nn.errors import UnsupportedFeatureError
from ...nn.quant_module import replaced_forward
from .calibrate import ForwardLoop, _stages, register_algorithm, run_forward_loop
from .idle_experts import IdleExperts, fill_from_other_experts

__all__ = [
    "activation_quantizers",
    "calibrate_weights",
    "calibration_mode",
    "load_activations",
    "max_calibrate",
    "weight_quantizers",
]

logger = get_logger(__name__)


def weight_quantizers(
    model: nn.Module, gather: bool = True
) -> Iterator[tuple[TensorQuantizer | SequentialQuantizer, torch.Tensor]]:
    """``(quantizer, weight)`` of every quantized module. Under FSDP2 each module's full weights are
    gathered while its pairs are in use (``gather=False``: the quantizers only, weights as stored)."""
    for module in model.modules():
        if isinstance(module, QuantModule):
            if gather:
                with weight_access(module):
                    yield from module.weight_quantizer_pairs()
            else:
                yield from module.weight_quantizer_pairs()


@register_algorithm("max")
def max_calibrate(
    model: nn.Module,
    forward_loop: ForwardLoop | None = None,
    distributed_sync: bool | None = True,
    sync_expert_weight_amax: bool = False,
    shared_states: Mapping[str, Any] | None = None,
    skip_forward_without_activation_calib: bool = False,
    **options: Any,
) -> None:
    """Max calibration (the module docstring), with the reference's signature and options:

    * ``distributed_sync`` (default ``True``): merge the activation statistics of every rank, so that all
      ranks hold the same amax. ``False`` keeps each rank's own (a WARNING says so in a multi-process run;
      the ranks' quantizers then differ).
    * ``skip_forward_without_activation_calib``: accepted; ``forward_loop`` runs only when an activation
      quantizer needs data, whatever its value (weights are calibrated from the weights).
    * ``sync_expert_weight_amax=True`` (one weight amax for all the experts of a Megatron ``SequentialMLP``)
      and ``shared_states`` (the reference's shared NVFP4 global amax of q/k/v, gate/up, which the export
      here unifies itself) raise :class:`UnsupportedFeatureError`.
    """
    if not isinstance(skip_forward_without_activation_calib, bool):
        raise ValueError(
            f"skip_forward_without_activation_calib={skip_forward_without_activation_calib!r} must be True "
            "or False"
        )
    if options:
        raise ValueError(
            f"max calibration: unknown option(s) {sorted(options)} (allowed: distributed_sync, "
            "sync_expert_weight_amax, shared_states, skip_forward_without_activation_calib)"
        )
    if sync_expert_weight_amax:
        raise UnsupportedFeatureError(
            "max calibration: sync_expert_weight_amax=True (one weight amax shared by a Megatron "
            "SequentialMLP's experts) is not supported; each expert keeps its own weight quantizer and amax"
        )
    if shared_states:
        raise UnsupportedFeatureError(
            f"max calibration: shared_states={dict(shared_states)!r} is not supported; the export gives "
            "q/k/v and gate/up one NVFP4 global amax (weight_scale_2) by itself"
        )
    activations = activation_quantizers(model)
    if activations:
        if forward_loop is None:
            names = ", ".join(q.name for q in activations[:4])
            raise ValueError(
                f"{len(activations)} activation quantizer(s) need calibration data (e.g. {names}); pass a "
                "forward_loop (a function of the model, or an iterable of batches)"
            )
        _collect_activations(model, activations, forward_loop, sync=distributed_sync is not False)
    logger.info(
        "max calibration: %d activation quantizer(s) from data, weight quantizers from the weights",
        len(activations),
    )
    calibrate_weights(model)


def activation_quantizers(model: nn.Module) -> list[TensorQuantizer]:
    """The enabled static quantizers that max calibration fills from data (every one but the weights'); of a
    sequential activation quantizer, its stages, each of which collects the raw input (the reference's
    behaviour: no stage quantizes while statistics are collected)."""
    weights = {id(q) for q, _ in weight_quantizers(model, gather=False)}
    activations: list[TensorQuantizer] = []
    for _, q in iter_quantizers(model):
        if id(q) in weights or not q.is_enabled:
            continue
        for stage in _stages(q):
            if not stage.is_enabled or not stage.spec.needs_amax:
                continue
            if stage.attributes.pinned_amax is None:  # (a pinned amax is not calibrated)
                activations.append(stage)
    return activations


@torch.no_grad()
def calibrate_weights(model: nn.Module, done: frozenset[int] | set[int] = frozenset()) -> None:
    """Calibrate every enabled weight quantizer from its weight, but those whose ``id`` is in ``done``."""
    for q, weight in weight_quantizers(model):
        if q.is_enabled and id(q) not in done:
            q.calibrate(weight.detach())


@contextmanager
def calibration_mode(model: nn.Module, collect: list[TensorQuantizer] = ()) -> Iterator[None]:
    """Fake quant off everywhere, ``collect`` gathering statistics, eval mode; everything restored on exit
    (also when the body raises). Forward passes inside run under ``torch.no_grad``."""
    everything = [s for _, q in iter_quantizers(model) for s in _stages(q)]
    modes = [(q, q._quant_enabled, q._calib_enabled) for q in everything]
    training = [(m, m.training) for m in model.modules()]
    try:
        for q in everything:
            q.disable_quant()
        for q in collect:
            q.reset_calibration()
            q.enable_calib()
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for q, quant, calib in modes:
            q._quant_enabled, q._calib_enabled = quant, calib
        for q in collect:
            q.reset_calibration()
        for module, mode in training:
            module.training = mode


def _collect_activations(
    model: nn.Module, activations: list[TensorQuantizer], forward_loop: ForwardLoop, sync: bool = True
) -> None:
    with calibration_mode(model, activations):
        reset_coverage(model)
        with all_ranks_succeed("calibration forward_loop"):
            run_forward_loop(model, forward_loop, desc="calibration")
        load_activations(model, activations, sync=sync)


def load_activations(model: nn.Module, activations: list[TensorQuantizer], sync: bool = True) -> None:
    """After a calibration pass: merge the ranks' statistics (unless ``sync`` is false), raise naming the
    quantizers that saw no data (but those of MoE experts that the other experts of their layer stand in
    for, see :mod:`.idle_experts`), and load every one's ``amax``."""
    if sync:
        sync_calibrators({q.name: q.calibrator for q in activations})
    elif is_distributed():
        logger.warning(
            "max calibration with distributed_sync=False: each rank keeps the amax of its own data, so the "
            "ranks' %d activation quantizer(s) differ",
            len(activations),
        )
    idle = IdleExperts(model, activations)
    if idle.empty:
        empty = idle.empty
        raise RuntimeError(
            f"{len(empty)} enabled activation quantizer(s) received no data during calibration: "
            f"{', '.join(empty[:10])}{' ...' if len(empty) > 10 else ''}. {_why_no_data(model, empty)}"
        )
    idle.check_policy()
    for q in activations:
        if q.name not in idle.fills:
            q.load_calib_amax()
    fill_from_other_experts(activations, idle.fills)
    record_amax_fills(model, [q.name for q in activations], idle.fills)
    idle.log()


def _why_no_data(model: nn.Module, empty: list[str]) -> str:
    """The likely cause for quantizers that saw no data: a forward replaced on the instance of their module
    (named when found), or modules that forward_loop never reached."""
    replaced = [
        f"{name}: forward replaced by {what}"
        for name, module in model.named_modules()
        if isinstance(module, QuantModule)
        and (what := replaced_forward(module)) is not None
        and any(q.startswith(f"{name}.") for q in empty)
    ]
    if replaced:
        return (
            f"Their module's forward was replaced on the instance, which bypasses the quantized forward "
            f"({'; '.join(replaced[:4])}): quantize before replacing forward, or have the replacement call "
            "the module's class forward"
        )
    containers = expert_containers(model)
    experts = (
        " Those inside MoE experts received no tokens, and no other expert of their layer can stand in for "
        "them (none received data either, or the others have a pre_quant_scale of their own, e.g. after "
        "SmoothQuant / AWQ)"
        if any(split_expert_name(name, containers) is not None for name in empty)
        else ""
    )
    return (
        "Their modules never ran in forward_loop: feed data that reaches them or disable them in the config "
        f"(or a forward replaced on the instance bypassed the quantized class forward).{experts}"
    )
