"""Calibration: the algorithm registry, ``mtq.calibrate`` (each algorithm of a config in turn, then every
enabled static quantizer checked by :func:`check_calibrated`) and the forward loop (a function of the
model, or an iterable of batches). Max calibration, the default algorithm, is :mod:`.max_calib`.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ...data import check_sequence_length
from ...distributed import (
    broadcast_tensors,
    check_same_on_all_ranks,
    has_offloaded_weights,
    is_distributed,
    is_sharded,
    naming_lost_rank,
)
from ...logging import get_logger, get_rank
from ...nn import QuantModule, SequentialQuantizer, TensorQuantizer, iter_quantizers
from ..config import ALGORITHMS, EXPERTS_WITHOUT_TOKENS, algorithm_step, experts_without_tokens
from .idle_experts import experts_without_tokens_policy

__all__ = [
    "ForwardLoop",
    "algorithm_steps",
    "calibrate",
    "check_algorithm",
    "check_calibrated",
    "register_algorithm",
    "require_data",
    "run_forward_loop",
]

logger = get_logger(__name__)

ForwardLoop = Callable[[nn.Module], Any] | Iterable[Any]
_ALGORITHMS: dict[str, Callable[..., None]] = {}


def register_algorithm(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register ``fn(model, forward_loop, **options)`` as the calibration algorithm ``name``."""
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm {name!r} must be listed in quantization.config.ALGORITHMS")

    def add(fn: Callable[..., None]) -> Callable[..., None]:
        _ALGORITHMS[name] = fn
        return fn

    return add


def check_algorithm(algorithm: str | Mapping[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
    """``(name, options)`` of an algorithm spec; raises before anything is changed when the name is
    unknown, not available in this release, options come without a method, or the option
    ``moe_experts_without_tokens`` (every algorithm's) has a value other than ``"warn"`` / ``"raise"``."""
    algorithm, options = algorithm_step(algorithm)
    if EXPERTS_WITHOUT_TOKENS in options:
        experts_without_tokens(options[EXPERTS_WITHOUT_TOKENS])
    if algorithm is None:
        if options:
            raise ValueError(f"algorithm options {sorted(options)} given with method None")
        return None, {}
    if algorithm not in _ALGORITHMS:
        if algorithm in ALGORITHMS:
            raise NotImplementedError(
                f"calibration algorithm {algorithm!r} is not available in this release (available: "
                f"{sorted(_ALGORITHMS)}); set 'algorithm': 'max' in the config to calibrate with max"
            )
        raise ValueError(f"unknown calibration algorithm {algorithm!r} (available: {sorted(_ALGORITHMS)})")
    return algorithm, options


def require_data(name: str, forward_loop: ForwardLoop | None) -> None:
    """Search algorithms need calibration data; raise before they change anything."""
    if forward_loop is None:
        raise ValueError(f"algorithm {name!r} needs calibration data: pass a forward_loop")


AlgorithmSpec = str | Mapping[str, Any] | None


def algorithm_steps(algorithm: AlgorithmSpec | Sequence[AlgorithmSpec]) -> list[tuple[str, dict[str, Any]]]:
    """``(name, options)`` of each algorithm of ``algorithm`` (one spec, or a list of specs to run in order;
    ``None`` runs nothing), every one checked by :func:`check_algorithm` before any runs."""
    specs = algorithm if isinstance(algorithm, (list, tuple)) else [algorithm]
    steps = [check_algorithm(spec) for spec in specs]
    return [(name, options) for name, options in steps if name is not None]


def calibrate(
    model: nn.Module,
    algorithm: AlgorithmSpec | Sequence[AlgorithmSpec] = "max",
    forward_loop: ForwardLoop | None = None,
) -> nn.Module:
    """Calibrate the quantizers of an already quantized ``model`` with ``algorithm`` (a name, a dict with
    ``"method"`` and options, or ``None`` for nothing; or a list of these, run one after the other on the
    same ``forward_loop``, as the reference does). Returns ``model``."""
    steps = algorithm_steps(algorithm)
    forward_loop = _taking_the_model(forward_loop)
    if not steps:
        try:
            check_calibrated(model)
        except RuntimeError as err:
            raise RuntimeError(f"{err}. The config's algorithm is None (no calibration): use 'max'") from None
        return model
    names = [name for name, _ in iter_quantizers(model)]
    if not names:
        raise ValueError("the model has no quantizers: call mtq.quantize(model, config, ...) first")
    with naming_lost_rank("calibration"):  # (every collective below: a lost rank is named, with the phase)
        if is_distributed():
            check_same_on_all_ranks(names, "the quantizers of the model")
        for algorithm, _ in steps:
            _check_placement(model, algorithm)
            _check_sequential_activations(model, algorithm)
        for algorithm, options in steps:
            options = dict(options)
            with experts_without_tokens_policy(options.pop(EXPERTS_WITHOUT_TOKENS, "warn")):
                _ALGORITHMS[algorithm](model, forward_loop, **options)
            if is_distributed() and algorithm != "max":
                # Search algorithms ran on each rank's data: make rank 0's result everyone's (weights they
                # changed and quantizer buffers; DDP would broadcast them at wrap time, FSDP2 does not).
                broadcast_tensors([*model.parameters(), *_quantizer_buffers(model)])
    check_calibrated(model)
    return model


def _check_placement(model: nn.Module, algorithm: str) -> None:
    """Search algorithms need whole weights: refuse FSDP2-sharded and (beyond max / mse) offloaded models."""
    if algorithm != "max" and is_distributed() and is_sharded(model):
        raise NotImplementedError(
            f"algorithm {algorithm!r} on an FSDP2-sharded model: quantize before fully_shard (the search "
            "algorithms change whole weights); max calibration works on sharded models"
        )
    if algorithm not in ("max", "mse") and has_offloaded_weights(model):
        raise NotImplementedError(
            f"algorithm {algorithm!r} reads and changes weights outside the forward pass, and accelerate "
            "offloads some of this model's weights to CPU / disk (device_map with 'cpu' / 'disk' entries, "
            "offload_folder): load the model without offloading for this algorithm, or use 'max' or 'mse' "
            "(they support offloaded weights)"
        )


def _check_sequential_activations(model: nn.Module, algorithm: str) -> None:
    """Sequential (list ``cfg``) activation quantizers calibrate with max (and mse, which max-calibrates the
    activations); the other algorithms read one quantizer per input: refuse them naming the quantizer."""
    if algorithm in ("max", "mse"):
        return
    weights = {
        id(q) for m in model.modules() if isinstance(m, QuantModule) for q, _ in m.weight_quantizer_pairs()
    }
    found = [
        name
        for name, q in iter_quantizers(model)
        if isinstance(q, SequentialQuantizer) and q.is_enabled and id(q) not in weights
    ]
    if found:
        more = " ..." if len(found) > 4 else ""
        raise NotImplementedError(
            f"algorithm {algorithm!r} with a sequential (list cfg) activation quantizer "
            f"({', '.join(found[:4])}{more}) is not supported; calibrate it with 'max' or 'mse', or give"
            " that input quantizer a single cfg"
        )


def _taking_the_model(forward_loop: ForwardLoop | None) -> ForwardLoop | None:
    """Accept a deprecated zero-argument ``forward_loop`` (Model-Optimizer does, with a warning)."""
    if not callable(forward_loop) or isinstance(forward_loop, nn.Module):
        return forward_loop
    try:
        takes_arguments = bool(inspect.signature(forward_loop).parameters)
    except (TypeError, ValueError):  # no signature to read (some builtins): call it with the model
        return forward_loop
    if takes_arguments:
        return forward_loop
    warnings.warn(
        "forward_loop takes no argument; it should take the model (def forward_loop(model): ...). "
        "Zero-argument forward loops are deprecated and will stop working in a future release",
        FutureWarning,
        stacklevel=3,
    )
    return lambda model: forward_loop()


def _quantizer_buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b for _, q in iter_quantizers(model) for s in _stages(q) for b in s.buffers()]


def _stages(q: TensorQuantizer | SequentialQuantizer) -> list[TensorQuantizer]:
    return list(q) if isinstance(q, SequentialQuantizer) else [q]


def _last_logit_only(model: nn.Module) -> dict[str, int]:
    """``{"logits_to_keep": 1}`` when the model's output layer has no enabled quantizer and its forward
    takes ``logits_to_keep`` (Hugging Face causal LMs): calibration then skips the output layer's work on
    every position but the last, which nothing calibrated reads (at SmolLM2-135M's vocabulary of 49152 that
    is a fifth of the forward's FLOPs and a 0.4 GB logits tensor per batch of 4 x 512 tokens); else ``{}``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Module) or any(q.is_enabled for _, q in iter_quantizers(head)):
        return {}
    try:
        accepted = "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": 1} if accepted else {}


def run_forward_loop(model: nn.Module, forward_loop: ForwardLoop, desc: str = "forward") -> None:
    """Call ``forward_loop(model)``, or feed every batch of an iterable (DataLoader, list) to the model
    (dict -> ``model(**batch)``, tuple -> ``model(*batch)``, tensor -> ``model(batch)``), with a progress
    bar. A Hugging Face causal LM whose output layer is not quantized computes the logits of the last
    position only (:func:`_last_logit_only`; not for a dict batch with ``labels``, whose loss needs them)."""
    if callable(forward_loop) and not isinstance(forward_loop, nn.Module):
        forward_loop(model)
        return
    if not isinstance(forward_loop, Iterable):
        raise TypeError(
            f"forward_loop must be a function of the model or an iterable of batches, got "
            f"{type(forward_loop).__name__}"
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    total = len(forward_loop) if hasattr(forward_loop, "__len__") else None
    extra = _last_logit_only(model)
    batches = tqdm(
        forward_loop,
        desc=desc,
        total=total,
        disable=get_rank() != 0 or not logger.isEnabledFor(logging.INFO),
        leave=False,
    )
    fed = 0
    for batch in batches:
        fed += 1
        if isinstance(batch, Mapping):
            inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            check_sequence_length(model, inputs.get("input_ids"), desc)
            model(**(inputs if "labels" in inputs else {**extra, **inputs}))
        elif isinstance(batch, (tuple, list)):
            check_sequence_length(model, batch[0] if batch else None, desc)
            model(*[v.to(device) if isinstance(v, torch.Tensor) else v for v in batch])
        elif isinstance(batch, torch.Tensor):
            check_sequence_length(model, batch, desc)
            model(batch.to(device), **extra)
        else:
            raise TypeError(f"cannot feed a batch of type {type(batch).__name__} to the model")
    if fed == 0:
        raise ValueError(
            f"{desc}: forward_loop ({type(forward_loop).__name__}) yielded no batch; give it data (an empty "
            "dataset or DataLoader calibrates nothing)"
        )


def check_calibrated(model: nn.Module) -> None:
    """Raise naming every enabled static quantizer whose ``amax`` is missing, NaN / inf, or zero."""
    problems: list[str] = []
    for _, q in iter_quantizers(model):
        for stage in _stages(q):
            if not stage.is_enabled or not stage.spec.needs_amax:
                continue
            amax = stage.amax
            if amax is None:
                problems.append(f"{stage.name} (no amax)")
            elif not bool(torch.isfinite(amax).all()):
                problems.append(f"{stage.name} (NaN / inf amax)")
            elif not bool((amax > 0).any()):
                problems.append(f"{stage.name} (amax is zero: only zeros were seen)")
    if problems:
        raise RuntimeError(
            f"{len(problems)} enabled quantizer(s) are not calibrated: {'; '.join(problems[:12])}"
            f"{' ...' if len(problems) > 12 else ''}. Calibrate them (a forward_loop that reaches them) "
            "or disable them in the config"
        )
