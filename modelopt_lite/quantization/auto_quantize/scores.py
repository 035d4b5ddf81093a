"""The scores of :func:`~modelopt_lite.quantization.auto_quantize`, per group and format with every other
group unquantized: ``"gradient"`` (the Fisher estimate ``sum((dL/dY * (Y_q - Y))**2)``, from forward hooks
that run each format on the layer's inputs and gradient hooks on its output) and ``"kl_div"`` (``KL(p ||
p_q)`` of the model's output distributions, summed over the tokens)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .groups import NONE, _Group, _install, _Unit

__all__: list[str] = []  # the helpers of searcher.py


# ------------------------------------------------------------------------------------------------ scores
def _zeros(groups: list[_Group]) -> np.ndarray:
    return np.zeros((len(groups), max(len(g.formats) for g in groups)))


def _logits(output: Any) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            "method='kl_div' needs forward_step(model, batch) to return the logits (a tensor, or an output "
            f"with .logits); got {type(output).__name__}"
        )
    return logits


def _gradient_scores(
    model: nn.Module,
    groups: list[_Group],
    bank: dict,
    step: Callable[[nn.Module, Any], Any],
    batches: Iterable,
) -> np.ndarray:
    """Accumulate ``sum((dL/dY * (Y_q - Y))**2)`` per group and format; every group unquantized."""
    scores = _zeros(groups)
    at: dict[nn.Module, list[tuple[int, _Unit]]] = {}
    for g, group in enumerate(groups):
        if not group.disabled:
            for unit in group.units:
                at.setdefault(unit.score_module, []).append((g, unit))
    busy, fired = [False], [False]

    def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if busy[0] or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return
        diffs = []
        busy[0] = True
        try:
            with torch.no_grad():
                for g, unit in at[module]:
                    for k, fmt in enumerate(groups[g].formats[:-1]):
                        _install(unit, bank[unit.name][fmt.name])
                        q = module(*args, **kwargs)
                        diffs.append((g, k, (q[0] if isinstance(q, tuple) else q) - out.detach()))
                    _install(unit, bank[unit.name][NONE])
        finally:
            busy[0] = False

        def on_grad(grad: torch.Tensor) -> None:
            fired[0] = True
            grad = grad.float()
            for g, k, diff in diffs:
                scores[g, k] += float((grad * diff.float()).clamp(-1e10, 1e10).square().sum())

        out.register_hook(on_grad)

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in at]
    try:
        with _activation_grads(model) as params:
            for batch in batches:
                step(model, batch)
                for p in params:
                    p.grad = None
                if not fired[0]:
                    raise RuntimeError(
                        "method='gradient': no gradient reached the quantized layers (does forward_step run "
                        "under torch.no_grad, or the loss not depend on the model?); use method='kl_div', "
                        "which needs only forward passes"
                    )
    finally:
        for h in handles:
            h.remove()
    return scores


def _default_step(forward_step: Callable, loss_func: Callable | None) -> Callable[[nn.Module, Any], None]:
    def step(model: nn.Module, batch: Any) -> None:
        loss_func(forward_step(model, batch), batch).backward()  # type: ignore[misc]

    return step


@contextmanager
def _activation_grads(model: nn.Module) -> Iterator[set[nn.Parameter]]:
    """Gradients on, ``requires_grad`` only on the parameters that make activation gradients flow: the input
    embeddings (the reference's choice for LLMs; no other weight gradient is computed), else all floating
    ones. Yields them; every flag restored on exit."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    weight = getattr(embeddings, "weight", None)
    params = (
        {weight}
        if isinstance(weight, nn.Parameter) and weight.is_floating_point()
        else {p for p in model.parameters() if p.is_floating_point()}
    )
    saved = {p: p.requires_grad for p in model.parameters()}
    try:
        for p in model.parameters():
            p.requires_grad_(p in params)
        with torch.enable_grad():
            yield params
    finally:
        for p, flag in saved.items():
            p.requires_grad_(flag)


@torch.no_grad()
def _kl_scores(
    model: nn.Module,
    groups: list[_Group],
    bank: dict,
    forward_step: Callable[[nn.Module, Any], Any],
    batches: Iterable,
) -> np.ndarray:
    """Accumulate ``KL(p || p_q)`` (summed over tokens) per group and format, only that group quantized."""
    scores = _zeros(groups)
    for batch in batches:
        reference = F.log_softmax(_logits(forward_step(model, batch)).float(), dim=-1)
        for g, group in enumerate(groups):
            if group.disabled:
                continue
            for k, fmt in enumerate(group.formats[:-1]):
                for unit in group.units:
                    _install(unit, bank[unit.name][fmt.name])
                quantized = F.log_softmax(_logits(forward_step(model, batch)).float(), dim=-1)
                scores[g, k] += float(F.kl_div(quantized, reference, reduction="sum", log_target=True))
            for unit in group.units:
                _install(unit, bank[unit.name][NONE])
    return scores
