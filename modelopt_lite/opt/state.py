"""Quantizer state: capture it as JSON (``modelopt_state``) and re-create it on a fresh model
(``restore_from_modelopt_state``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._version import __version__
from ..logging import get_logger
from ..nn import QUANT_MODULES, QuantModule, SequentialQuantizer, TensorQuantizer, iter_quantizers
from ..nn.errors import ModelAlreadyQuantizedError
from ..nn.lora import adapter_modules
from ..nn.quant_linear import LOWRANK_BUFFERS, lowrank_factors, set_lowrank_factors
from ..quantization import QuantizeConfig, quant_state, quantizer_attributes
from ..quantization.compress import CompressedExperts, CompressedLinear, compressed_state, restore_compressed
from ..quantization.config import plain
from ..quantization.insertion import (
    Provenance,
    name_quantizers,
    remove_quantizers,
    snapshot_implementations,
    use_experts_implementation,
)
from ..quantization.model_quant import QuantState, set_quant_state

__all__ = ["convert_flat_block_amax", "modelopt_state", "restore_from_modelopt_state"]

_FORMAT = 1
logger = get_logger(__name__)


def _portable(value: Any, custom: set[str]) -> Any:
    """``value`` with every custom calibrator (a class, or ``(class, args, kwargs)``, under a
    ``"calibrator"`` key) recorded as ``"max"``: a Python class has no JSON form, and the state holds the
    calibrated amax, which does not depend on it. The class names go into ``custom``."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "calibrator" and not isinstance(v, str):
                cls = v[0] if isinstance(v, (tuple, list)) else v
                custom.add(getattr(cls, "__qualname__", repr(cls)))
                v = "max"
            out[k] = _portable(v, custom)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v, custom) for v in value)
    return value


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _quantizer_entry(q: TensorQuantizer) -> dict[str, Any]:
    factors = lowrank_factors(q)  # SVDQuant's low-rank branch: allocated again on restore
    shapes = [] if factors is None else [list(t.shape) for t in factors]
    lowrank = dict(zip(LOWRANK_BUFFERS, shapes, strict=False))
    return {
        "attributes": plain(q.attribute_dict(), str_keys=True),  # (custom calibrators: see _portable)
        "quant_enabled": q._quant_enabled,
        "buffers": {**q.buffer_shapes(), **lowrank},
    }


def modelopt_state(model: nn.Module) -> dict[str, Any]:
    """A JSON-serialisable description of every quantized module and quantizer of ``model``."""
    modules: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantModule):
            weight = getattr(module, "weight", None)
            shape = list(weight.shape) if isinstance(weight, torch.Tensor) else None
            modules[name] = {
                "class": _class_name(module.original_cls),
                "weight_shape": module.parameter_shape() if isinstance(module, CompressedLinear) else shape,
            }
    if not modules:
        raise ValueError(f"{type(model).__name__} is not quantized: no quantizer state to capture")
    quantizers: dict[str, Any] = {}
    for name, q in iter_quantizers(model):
        if isinstance(q, SequentialQuantizer):
            quantizers[name] = {"stages": [_quantizer_entry(s) for s in q]}
        else:
            quantizers[name] = _quantizer_entry(q)
    state = quant_state(model)
    config = getattr(model, "config", None)
    custom: set[str] = set()
    quantizers = _portable(quantizers, custom)
    quant_config = _portable(plain(state.config.to_dict(), str_keys=True), custom) if state else None
    if custom:
        logger.info(
            "modelopt state: the custom calibrator(s) %s are recorded as 'max' (a class has no JSON form; "
            "the calibrated amax values are saved)",
            ", ".join(sorted(custom)),
        )
    return {
        "format": _FORMAT,
        "producer": {"name": "modelopt_lite", "version": __version__},
        "quant_config": quant_config,
        "provenance": state.provenance.rules if state else {},
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "modules": modules,
        "quantizers": quantizers,
        **({"compressed": compressed} if (compressed := compressed_state(model)) else {}),
    }


def _owner(quantizer_name: str, modules: dict[str, Any]) -> str:
    """The quantized module (longest matching prefix) that holds ``quantizer_name``."""
    best = ""
    for name in modules:
        if (quantizer_name.startswith(name + ".") or not name) and len(name) >= len(best):
            best = name
    return best


def _check_modules(model: nn.Module, state: dict[str, Any]) -> None:
    """Check, in the saved quantizer order, that each quantizer's module exists and fits."""
    modules = state["modules"]
    order: dict[str, str] = {}
    for qname in state["quantizers"]:
        order.setdefault(_owner(qname, modules), qname)
    for name in modules:
        order.setdefault(name, name)
    for name, qname in order.items():
        info, label = modules[name], f"quantizer {qname!r}"
        try:
            module = model.get_submodule(name) if name else model
        except AttributeError:
            raise ValueError(
                f"cannot restore {label}: the model has no module {name!r} "
                "(saved from a different architecture?)"
            ) from None
        cls = getattr(module, "original_cls", type(module))
        if _class_name(cls) != info["class"]:
            raise ValueError(
                f"cannot restore {label}: {name!r} is {_class_name(cls)}, the state expects {info['class']}"
            )
        weight = getattr(module, "weight", None)
        if info.get("weight_shape") is not None and isinstance(weight, torch.Tensor):
            if list(weight.shape) != info["weight_shape"]:
                raise ValueError(
                    f"cannot restore {label}: {name}.weight has shape {list(weight.shape)}, the state "
                    f"expects {info['weight_shape']}"
                )
    quantizers = (TensorQuantizer, SequentialQuantizer, QuantModule)
    adapters = adapter_modules(model)  # peft's lora_A / lora_B are never quantized
    extra = [
        n
        for n, m in model.named_modules()
        if n not in modules
        and not isinstance(m, quantizers)
        and type(m) in QUANT_MODULES
        and id(m) not in adapters
    ]
    if extra:
        raise ValueError(
            f"cannot restore: module {extra[0]!r} (and {len(extra) - 1} more) of the model has no quantizer "
            "state (saved from a different architecture?)"
        )


def _validate_state(state: Any) -> None:
    """Check the whole state before anything is changed; errors name the entry."""
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(f"not a modelopt_lite quantizer state (format {_FORMAT} expected)")
    for key in ("modules", "quantizers"):
        if not isinstance(state.get(key), dict) or not state[key]:
            raise ValueError(f"quantizer state: {key!r} must be a non-empty mapping")
    for name, info in state["modules"].items():
        if not isinstance(info, dict) or not isinstance(info.get("class"), str):
            raise ValueError(f"quantizer state: module {name!r} has no 'class'")
    for qname, entry in state["quantizers"].items():
        stages = entry.get("stages", [entry]) if isinstance(entry, dict) else None
        if not stages or not all(
            isinstance(s, dict) and isinstance(s.get("attributes"), dict) for s in stages
        ):
            raise ValueError(f"quantizer state: {qname!r} needs 'attributes' (or 'stages' of them)")
        for stage in stages:
            _attributes(stage, qname)


def _attributes(entry: dict[str, Any], qname: str):
    attrs = entry["attributes"]
    if not isinstance(attrs.get("enable"), bool):
        raise ValueError(f"quantizer state: {qname!r} attributes need 'enable' (True / False)")
    return quantizer_attributes(attrs, attrs["enable"], f"quantizer state {qname!r}")


def _restore_quantizer(q: TensorQuantizer, entry: dict[str, Any], device: torch.device) -> None:
    q.set_attributes(_attributes(entry, q.name))
    q._quant_enabled = bool(entry.get("quant_enabled", True))
    buffers = dict(entry.get("buffers", {}))
    lowrank = [buffers.pop(n) for n in LOWRANK_BUFFERS if n in buffers]
    q.allocate_buffers(buffers, device)
    if lowrank:
        set_lowrank_factors(q, *(torch.zeros(shape, device=device) for shape in lowrank))


def restore_from_modelopt_state(model: nn.Module, state: dict[str, Any]) -> nn.Module:
    """Insert and configure the quantizers recorded in ``state`` on an unquantized ``model`` of the same
    architecture (amax / scale buffers are allocated; load the tensors afterwards). Raises naming the first
    quantizer that does not fit."""
    _validate_state(state)
    if quant_state(model) is not None or any(isinstance(m, QuantModule) for m in model.modules()):
        raise ModelAlreadyQuantizedError(
            f"Model already has modelopt state! This {type(model).__name__} is already quantized (it holds "
            "quantizers); restore onto a fresh, unquantized model of the same architecture"
        )
    _check_modules(model, state)
    implementations = snapshot_implementations(model)
    try:
        _apply_state(model, state)
    except BaseException:
        remove_quantizers(model, implementations)
        raise
    return model


def _apply_state(model: nn.Module, state: dict[str, Any]) -> None:
    for name in state["modules"]:
        module = model.get_submodule(name) if name else model
        if type(module) not in QUANT_MODULES:
            raise ValueError(f"cannot restore quantizers of {name!r}: no wrapper is registered for its class")
        QUANT_MODULES.convert(module)
    name_quantizers(model)
    use_experts_implementation(model)  # the model's own backend (from_pretrained(experts_implementation=...))
    present = dict(iter_quantizers(model))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for qname, entry in state["quantizers"].items():
        if qname not in present:
            raise ValueError(f"cannot restore quantizer {qname!r}: the model has no such quantizer")
        parent_name, _, slot = qname.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if "stages" in entry:
            attrs = [_attributes(s, qname) for s in entry["stages"]]
            seq = SequentialQuantizer(qname, attrs)
            seq.calibration_expected = True
            parent.replace_quantizer(slot, seq) if isinstance(parent, QuantModule) else setattr(
                parent, slot, seq
            )
            for stage, sub in zip(seq, entry["stages"], strict=True):
                _restore_quantizer(stage, sub, device)
        else:
            _restore_quantizer(present[qname], entry, device)
    impl = state.get("attn_implementation")
    config = getattr(model, "config", None)
    if impl and config is not None and getattr(config, "_attn_implementation", None) != impl:
        model.set_attn_implementation(impl) if hasattr(model, "set_attn_implementation") else None
    restore_compressed(model, state.get("compressed", {}))
    if state.get("quant_config") is not None:
        provenance = Provenance({k: [tuple(s) for s in v] for k, v in state.get("provenance", {}).items()})
        set_quant_state(model, QuantState(QuantizeConfig.from_dict(state["quant_config"]), provenance))


def convert_flat_block_amax(model: nn.Module) -> list[str]:
    """After loading a checkpoint: give every weight quantizer's block amax saved flat, ``(num_blocks, 1)``,
    by releases before issue 46 for blocks over several axes or a non-last axis, the reference's shape and
    block order (:meth:`TensorQuantizer.convert_flat_block_amax`; an activation quantizer's is converted at
    its first forward). Returns the names of the converted quantizers."""
    converted = []
    for module in model.modules():
        if isinstance(module, QuantModule) and not isinstance(module, (CompressedLinear, CompressedExperts)):
            for q, weight in module.weight_quantizer_pairs():  # (compressed layers hold no block amax)
                for stage in q if isinstance(q, SequentialQuantizer) else [q]:
                    if stage.convert_flat_block_amax(weight.shape):
                        converted.append(stage.name)
    return converted
