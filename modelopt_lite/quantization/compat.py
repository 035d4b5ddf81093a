"""``mtq`` entry points under the reference library's names and signatures, built on ours.

Quantizers are selected as in the reference: ``wildcard_or_filter_func`` is an fnmatch pattern on the
quantizer's dotted name (per-expert indices folded, as in config rules) or a function of the name, and
``parent_class`` restricts the match to quantizers whose module is an instance of that class. Attributes are
given in the reference's vocabulary (a dict or a :class:`~.config.QuantizerAttributeConfig`) and
validated by the same checks as config rules.

What the reference has and this library deliberately does not is in :mod:`.unsupported`.
"""

from __future__ import annotations

import copy
import fnmatch
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from ..distributed import is_sharded
from ..logging import get_logger
from ..nn import (
    QUANT_MODULES,
    QuantizerAttributes,
    QuantModule,
    SequentialQuantizer,
    TensorQuantizer,
    iter_quantizers,
)
from ..nn.errors import UnsupportedFeatureError
from .calibration.calibrate import ForwardLoop, run_forward_loop
from .config import QuantizeConfig, quantizer_attributes
from .config.config_models import QuantizerCfgEntry
from .config.presets import with_kv_cache
from .insertion import _parent_matches, _set, _slots, insert_quantizers, match_name
from .model_quant import fold_weight, quant_state, set_quantizer_by_cfg

__all__ = [
    "compute_quantization_mse",
    "find_quant_cfg_entry_by_path",
    "normalize_quant_cfg_list",
    "postprocess_amax",
    "preserve_quantizer_attributes_context",
    "replace_quant_module",
    "set_quantizer_attribute",
    "set_quantizer_attributes_full",
    "set_quantizer_attributes_partial",
    "set_quantizer_by_cfg_context",
    "temporarily_fold_weights",
    "update_quant_cfg_with_kv_cache_quant",
]

NameFilter = str | Callable[[str], bool]
logger = get_logger(__name__)


# --------------------------------------------------------------------------------------------- selection
def _name_matches(name: str, wildcard_or_filter_func: NameFilter) -> bool:
    if isinstance(wildcard_or_filter_func, str):
        return fnmatch.fnmatchcase(name, wildcard_or_filter_func) or fnmatch.fnmatchcase(
            match_name(name), wildcard_or_filter_func
        )
    if callable(wildcard_or_filter_func):
        return bool(wildcard_or_filter_func(name))
    raise TypeError(
        f"wildcard_or_filter_func must be a pattern string or a function of the quantizer name, got "
        f"{type(wildcard_or_filter_func).__name__}"
    )


def _selected(
    model: nn.Module, wildcard_or_filter_func: NameFilter, parent_class: type[nn.Module] | str | None
) -> list[tuple[str, Any, nn.Module, str]]:
    """``(name, quantizer, parent module, slot)`` of the matching quantizer slots."""
    out = []
    for name, quantizer, parent, slot in _slots(model):
        if not _name_matches(name, wildcard_or_filter_func):
            continue
        if isinstance(parent_class, type) and not isinstance(parent, parent_class):
            continue
        if (parent_class is None or isinstance(parent_class, str)) and not _parent_matches(
            parent, parent_class
        ):
            continue
        out.append((name, quantizer, parent, slot))
    if not out:
        logger.warning("%r matched no quantizer", wildcard_or_filter_func)
    return out


def _attributes(attributes: Any, where: str) -> QuantizerAttributes:
    if isinstance(attributes, QuantizerAttributes):
        return attributes
    if not isinstance(attributes, Mapping):
        raise TypeError(
            f"{where}: expected a QuantizerAttributeConfig or a dict of attributes, got "
            f"{type(attributes).__name__}"
        )
    return quantizer_attributes(attributes, attributes.get("enable", True), where)


def _stages(quantizer: TensorQuantizer | SequentialQuantizer) -> list[TensorQuantizer]:
    return list(quantizer) if isinstance(quantizer, SequentialQuantizer) else [quantizer]


# --------------------------------------------------------------------------------------------- attributes
def set_quantizer_attributes_full(
    quant_model: nn.Module,
    wildcard_or_filter_func: NameFilter,
    attributes: Any,
    parent_class: type[nn.Module] | None = None,
) -> int:
    """Replace every attribute of the matching quantizers (unspecified ones go back to their defaults);
    a list of attribute configs makes each a sequential quantizer. Returns how many quantizers matched."""
    stages = list(attributes) if isinstance(attributes, (list, tuple)) else [attributes]
    attrs = tuple(_attributes(a, "set_quantizer_attributes_full") for a in stages)
    hits = _selected(quant_model, wildcard_or_filter_func, parent_class)
    for name, quantizer, parent, slot in hits:
        _set(parent, slot, name, quantizer, attrs)
    return len(hits)


def _merged(stage: TensorQuantizer, partial: Mapping[str, Any], where: str) -> QuantizerAttributes:
    current = asdict(stage.attributes)
    if "pass_through_bwd" in partial:
        current.pop("backward")
    merged = {**current, **partial}
    if dict(partial) == {"enable": False}:  # as in the reference, this also stops a rotation
        merged["rotate"] = False
    return quantizer_attributes(merged, merged["enable"], where)


def set_quantizer_attributes_partial(
    quant_model: nn.Module,
    wildcard_or_filter_func: NameFilter,
    partial_attributes: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    parent_class: type[nn.Module] | None = None,
) -> int:
    """Change only the given attributes of the matching quantizers (the others stay). A dict applies to
    every stage of a sequential quantizer; a list gives one dict per stage and needs a sequential quantizer
    with that many stages. Returns how many quantizers matched."""
    where = "set_quantizer_attributes_partial"
    if not isinstance(partial_attributes, (Mapping, list, tuple)):
        raise TypeError(f"{where}: expected a dict of attributes or a list of them")
    hits = _selected(quant_model, wildcard_or_filter_func, parent_class)
    updates = []
    for name, quantizer, _, _ in hits:
        stages = _stages(quantizer)
        if isinstance(partial_attributes, Mapping):
            per_stage = [partial_attributes] * len(stages)
        elif isinstance(quantizer, SequentialQuantizer) and len(partial_attributes) == len(stages):
            per_stage = list(partial_attributes)
        else:
            raise ValueError(
                f"{where}: {name} has {len(stages)} stage(s) but {len(partial_attributes)} attribute dicts "
                "were given (a list needs a sequential quantizer with one stage per dict; use "
                "set_quantizer_attributes_full to make one)"
            )
        updates += [(s, _merged(s, p, f"{where} {name}")) for s, p in zip(stages, per_stage, strict=True)]
    for stage, attrs in updates:  # all validated before any is changed
        stage.set_attributes(attrs)
    return len(hits)


def set_quantizer_attribute(
    quant_model: nn.Module,
    wildcard_or_filter_func: NameFilter,
    attribute: Any,
    parent_class: type[nn.Module] | None = None,
) -> int:
    """Deprecated in the reference: use :func:`set_quantizer_attributes_partial` (the same here)."""
    warnings.warn(
        "set_quantizer_attribute is deprecated; use set_quantizer_attributes_partial or "
        "set_quantizer_attributes_full",
        DeprecationWarning,
        stacklevel=2,
    )
    return set_quantizer_attributes_partial(quant_model, wildcard_or_filter_func, attribute, parent_class)


def _snapshot(quantizer: TensorQuantizer | SequentialQuantizer) -> list[tuple[Any, ...]]:
    return [
        (s.attributes, s.amax, s.pre_quant_scale, s._quant_enabled, s._calib_enabled)
        for s in _stages(quantizer)
    ]


@contextmanager
def preserve_quantizer_attributes_context(quant_model: nn.Module) -> Iterator[None]:
    """Restore every quantizer's attributes (and single / sequential form) on exit, with what
    :func:`mtq.quant_state` records. An amax that an attribute change inside the block discarded (a new
    format) comes back with its format; amax values changed inside the block otherwise stay."""
    saved = {name: _snapshot(q) for name, q, _, _ in _slots(quant_model)}
    state = quant_state(quant_model)
    record = (state.later_rules, copy.deepcopy(state.provenance)) if state is not None else None
    try:
        yield
    finally:
        for name, quantizer, parent, slot in _slots(quant_model):
            if name not in saved:
                continue
            stages = saved[name]
            if len(stages) != len(_stages(quantizer)):
                _set(parent, slot, name, quantizer, tuple(s[0] for s in stages))
                quantizer = getattr(parent, slot)
            for stage, (attrs, amax, pre_quant_scale, quant_on, calib_on) in zip(
                _stages(quantizer), stages, strict=True
            ):
                stage.set_attributes(attrs)
                if stage.amax is None and amax is not None:
                    stage.amax = amax
                stage.pre_quant_scale = pre_quant_scale
                stage._quant_enabled, stage._calib_enabled = quant_on, calib_on
        if state is not None and record is not None:
            state.later_rules, state.provenance = record


@contextmanager
def set_quantizer_by_cfg_context(quant_model: nn.Module, quant_cfg: Any) -> Iterator[None]:
    """Apply ``quant_cfg`` (rules, as :func:`mtq.set_quantizer_by_cfg`) for the duration of the block, then
    restore every quantizer (:func:`preserve_quantizer_attributes_context`). Sequential ``cfg`` lists are
    refused, as in the reference."""
    rules = normalize_quant_cfg_list(quant_cfg)
    if any(isinstance(r.get("cfg"), list) for r in rules):
        raise ValueError(
            "set_quantizer_by_cfg_context: sequential cfg lists are not allowed; give one dict per rule"
        )
    with preserve_quantizer_attributes_context(quant_model):
        set_quantizer_by_cfg(quant_model, rules)
        yield


# --------------------------------------------------------------------------------------------- configs
def normalize_quant_cfg_list(v: Any) -> list[QuantizerCfgEntry]:
    """``quant_cfg`` (the list form, the older dict form with ``"default"`` and ``"nn.*"``-scoped keys, or a
    whole config) as validated :class:`~.config.QuantizerCfgEntry` objects in the order they apply,
    each with ``quantizer_name``, ``parent_class``, ``cfg`` (a ``QuantizerAttributeConfig``, a list of them,
    or ``None``) and ``enable`` filled in, as the reference returns them. The legacy key ``"default"``
    becomes ``"*"`` and, being the fallback (:mod:`.config`), comes first. A bad entry raises
    ``pydantic.ValidationError``; a ``quant_cfg`` that is neither a list nor a mapping ``ValueError``."""
    raw = v["quant_cfg"] if isinstance(v, Mapping) and "quant_cfg" in v else v
    if isinstance(raw, (str, bytes)) or not isinstance(raw, (Mapping, Sequence)):
        raise ValueError(
            f"quant_cfg must be a sequence of entries (a list; or the older flat mapping), got "
            f"{type(raw).__name__}: {raw!r}"
        )
    config = QuantizeConfig.from_dict({"quant_cfg": raw, "algorithm": None})
    return [
        QuantizerCfgEntry(**{**r.to_dict(), "quantizer_name": "*" if r.is_fallback else r.quantizer_name})
        for _, r in config.ordered_rules()
    ]


def find_quant_cfg_entry_by_path(quant_cfg_list: Sequence[Mapping[str, Any]], quantizer_name: str) -> Any:
    """The last entry whose ``quantizer_name`` is exactly ``quantizer_name`` (no wildcard matching: the
    entry as written; the last one, as later entries win), in a raw or a normalized list (``KeyError`` if
    none)."""
    found = [e for e in quant_cfg_list if e.get("quantizer_name") == quantizer_name]
    if not found:
        raise KeyError(f"no quant_cfg entry with quantizer_name={quantizer_name!r}")
    return found[-1]


def update_quant_cfg_with_kv_cache_quant(
    quant_cfg: Mapping[str, Any], kv_cache_quant_cfg: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """A copy of the config ``quant_cfg`` with the KV-cache rules appended (:func:`mtq.with_kv_cache`); a
    config without rules starts from "everything disabled", one without an algorithm gets ``"max"``."""
    base = dict(quant_cfg)
    base["quant_cfg"] = base.get("quant_cfg") or [{"quantizer_name": "*", "enable": False}]
    merged = with_kv_cache(base, {"quant_cfg": list(kv_cache_quant_cfg)})
    merged["algorithm"] = merged.get("algorithm") or "max"
    return merged


# --------------------------------------------------------------------------------------------- amax / weights
def postprocess_amax(model: nn.Module, key: str, post_process_fn: Callable[[torch.Tensor], Any]) -> nn.Module:
    """Replace the amax of every quantizer (stage) whose name matches the pattern ``key`` by
    ``post_process_fn(amax)`` (e.g. ``lambda a: a.clamp(min=1e-3)``); quantizers without an amax are
    skipped. Returns ``model``."""
    if not isinstance(key, str):
        raise TypeError(f"key must be a pattern string, got {type(key).__name__}")
    for name, module in model.named_modules():
        if isinstance(module, TensorQuantizer) and module.amax is not None and fnmatch.fnmatchcase(name, key):
            module.amax = post_process_fn(module.amax)
    return model


def compute_quantization_mse(
    model: nn.Module,
    forward_loop: ForwardLoop,
    wildcards: NameFilter | list[NameFilter] = "*",
) -> dict[str, float]:
    """Run ``forward_loop`` and return, for each enabled fake-quantizing quantizer (stage) whose name
    matches one of ``wildcards``, the mean over its calls of ``mean((x - Q(x))**2)``."""
    patterns = wildcards if isinstance(wildcards, list) else [wildcards]
    sums: dict[str, list[float]] = {}
    hooks = []

    def record(acc: list[float]) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            acc.append(torch.mean((inputs[0].detach().float() - output.detach().float()) ** 2).item())

        return hook

    for name, module in model.named_modules():
        if not isinstance(module, TensorQuantizer) or not (module.is_enabled and module._quant_enabled):
            continue
        if any(_name_matches(name, p) for p in patterns):
            sums[name] = []
            hooks.append(module.register_forward_hook(record(sums[name])))
    try:
        run_forward_loop(model, forward_loop, desc="quantization MSE")
    finally:
        for h in hooks:
            h.remove()
    return {name: sum(v) / len(v) for name, v in sums.items() if v}


@contextmanager
def temporarily_fold_weights(
    model: nn.Module, snapshot_device: torch.device | str | None = None
) -> Iterator[None]:
    """Fold the quantized weights (:func:`mtq.fold_weight`) for the duration of the block, then put back the
    original weights (copies kept on ``snapshot_device``, default: where they are) and the weight
    quantizers' attributes (enabled, ``pre_quant_scale``, rotation). A disabled weight quantizer that still
    scales or rotates its weight is folded too, as in the reference. Layers without a weight (``weight``
    set to ``None``) are left alone."""
    if is_sharded(model):
        raise NotImplementedError(
            "temporarily_fold_weights on an FSDP2-sharded model; fold before fully_shard"
        )
    modules = [m for m in model.modules() if isinstance(m, QuantModule)]
    saved = [
        (p, p.detach().to(snapshot_device or p.device, copy=True))
        for m in modules
        for p in m.parameters(recurse=False)
    ]
    with preserve_quantizer_attributes_context(model):
        fold_weight(model)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in saved:
                    p.copy_(value.to(p.device))


def replace_quant_module(model: nn.Module, version: Any = None, registry: Any = None) -> nn.Module:
    """Insert quantizers (turn every supported module into its quantized class) without configuring or
    calibrating them: :func:`mtq.insert_quantizers`. ``version`` (the reference's state version) is not
    used; ``registry`` may only be this library's registry."""
    if registry is not None and registry is not QUANT_MODULES:
        raise UnsupportedFeatureError(
            "replace_quant_module(registry=...): one registry exists here; register wrappers with "
            "mtq.register"
        )
    insert_quantizers(model)
    for _, quantizer in iter_quantizers(model):
        # as in the reference: until calibrated, each input is quantized with its own amax
        quantizer.calibration_expected = False
    return model
