"""Insert quantizers into a model and apply a :class:`QuantizeConfig` to them, recording which rule set
what (provenance, shown by :func:`explain` and the summary)."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from torch import nn

from ..logging import get_logger
from ..moe import (
    EXPERTS_IMPLEMENTATIONS,
    LEGACY_EXPERTS_IMPLEMENTATIONS,
    QuantExperts,
    experts_implementation_name,
    is_seam_experts,
)
from ..nn import QUANT_MODULES, QuantModule, SequentialQuantizer, TensorQuantizer, iter_quantizers
from ..nn.kv_attention import QuantAttention, kv_attention_name
from ..nn.lora import adapter_modules
from ..nn.quant_module import replaced_forward
from .config import QuantizeConfig, QuantRule
from .config.presets import STANDARD_EXCLUSIONS

__all__ = [
    "Provenance",
    "apply_config",
    "insert_quantizers",
    "match_name",
    "remove_quantizers",
    "set_enabled",
    "snapshot_implementations",
]

logger = get_logger(__name__)

# ``...weight_quantizers.3`` (fused experts, one quantizer per expert) matches ``*weight_quantizer``.
_PER_EXPERT = re.compile(r"(_quantizer)s\.\d+$")
_STANDARD = {(r["quantizer_name"], r.get("parent_class")) for r in STANDARD_EXCLUSIONS}
STATE_ATTR = "_modelopt_lite_quant"  # the QuantState that mtq.quantize records on the model


def match_name(name: str) -> str:
    """The name patterns are matched against (per-expert indices folded away; the ``.base_layer`` that
    peft puts between a LoRA-wrapped layer and its quantizers dropped, so ``*q_proj.weight_quantizer``
    matches with and without adapters)."""
    return _PER_EXPERT.sub(r"\1", name.replace(".base_layer.", "."))


def insert_quantizers(model: nn.Module, experts_implementation: str | None = None) -> list[str]:
    """Convert every module with a registered wrapper; return the converted module names. Quantizers are
    named by their dotted path. Raises when nothing in ``model`` can be quantized. Fused experts run on our
    ``grouped_mm`` path unless ``experts_implementation`` (or the model's own choice) is ``"eager"``."""
    converted: list[str] = []
    shadowed: dict[str, str] = {}
    replaced: dict[str, str] = {}  # a forward on the instance that does not run the quantized class forward
    adapters = adapter_modules(model)  # peft's lora_A / lora_B stay unquantized (the base layer is quantized)
    for name, module in list(model.named_modules()):
        if isinstance(module, (TensorQuantizer, SequentialQuantizer, QuantModule)) or id(module) in adapters:
            continue
        if type(module) in QUANT_MODULES:
            QUANT_MODULES.convert(module)
            converted.append(name)
            if (what := replaced_forward(module)) is not None and not isinstance(module, QuantExperts):
                replaced[name] = f"forward replaced by {what}"  # experts: disable_bypassed_experts
        elif (base := QUANT_MODULES.shadowed_subclasses(type(module))) is not None and not _excluded(name):
            shadowed[name] = f"{type(module).__qualname__} (overrides {base.__name__}.forward)"
    unwrapped_experts = [
        f"{name or '<model>'} ({type(module).__qualname__})"
        for name, module in model.named_modules()
        if not isinstance(module, QuantModule) and _holds_expert_weights(module)
    ]
    if unwrapped_experts:
        raise ValueError(
            f"{len(unwrapped_experts)} module(s) hold fused (3-D) expert weights in a class modelopt_lite "
            f"has no wrapper for, so they would stay unquantized: {', '.join(unwrapped_experts[:4])}. "
            "Supported: classes using transformers' @use_experts_implementation; register a wrapper with "
            "mtq.register"
        )
    for found, problem in (
        (replaced, "have a forward on the instance that skips their quantizers (quantize before setting it)"),
        (shadowed, "subclass a quantizable class but override its forward and stay unquantized; register a "
                   "wrapper with mtq.register to quantize them"),
    ):  # fmt: skip
        if found:
            logger.warning(
                "%d module(s) %s: %s",
                len(found),
                problem,
                ", ".join(f"{k}: {v}" for k, v in list(found.items())[:8]),
            )
    if not converted and not any(True for _ in iter_quantizers(model)):
        raise ValueError(
            f"{type(model).__name__} has no module that modelopt_lite can quantize (nn.Linear, Conv1D, "
            "attention, fused experts, or a class registered with mtq.register)"
        )
    name_quantizers(model)
    if any(isinstance(m, QuantAttention) for m in model.modules()):
        _use_kv_attention(model)
    use_experts_implementation(model, experts_implementation)
    return converted


def use_experts_implementation(model: nn.Module, choice: str | None = None) -> str | None:
    """Run the model's quantized fused experts on transformers' backend ``choice`` (``"eager"`` or
    ``"grouped_mm"``; default: the model's own choice). A backend the quantized experts cannot run
    (``batched_mm``, kernels from the hub) moves to ``grouped_mm`` with a WARNING naming the change. Returns
    the backend, or ``None`` when the model has no quantized fused experts."""
    if choice not in (None, *EXPERTS_IMPLEMENTATIONS, *LEGACY_EXPERTS_IMPLEMENTATIONS):
        raise ValueError(f"experts_implementation={choice!r} (allowed: 'eager', 'grouped_mm', or None)")
    experts = [m for m in model.modules() if isinstance(m, QuantExperts) and is_seam_experts(m.original_cls)]
    if not experts:
        return None
    config = getattr(model, "config", experts[0].config)
    current = getattr(config, "_experts_implementation", None)
    target = experts_implementation_name(choice or current)
    if choice is None and current not in (None, target, *LEGACY_EXPERTS_IMPLEMENTATIONS):
        logger.warning(
            "experts implementation %r does not run the expert quantizers: switched to %r "
            "(model.set_experts_implementation('eager') selects the other quantized backend)",
            current,
            target,
        )
    if target != current and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(target)
    for module in experts:  # a model without set_experts_implementation, or a config it does not reach
        if getattr(module.config, "_experts_implementation", None) != target:
            module.config._experts_implementation = target
    return target


def disable_bypassed_experts(model: nn.Module) -> list[str]:
    """Disable the quantizers of fused experts whose forward is replaced on the instance (a kernel, a
    wrapper set before quantizing): it would never run them. Logs an ERROR naming the module, its class and
    the disabled quantizers, so that the rest of the model quantizes; returns the modules' names."""
    bypassed = []
    for name, module in model.named_modules():
        if not isinstance(module, QuantExperts) or (what := replaced_forward(module)) is None:
            continue
        counts: dict[str, int] = {}
        for qname, q in iter_quantizers(module):
            if q.is_enabled:
                set_enabled(q, False)
                counts[match_name(qname)] = counts.get(match_name(qname), 0) + 1
        if counts:
            bypassed.append(name)
            logger.error(
                "%s (%s): its forward is replaced on the instance by %s, which cannot run the expert "
                "quantizers; disabled %s so that the rest of the model quantizes. Quantize before replacing "
                "the forward (or remove it) to quantize these experts",
                name,
                module.original_cls.__qualname__,
                what,
                ", ".join(f"{q} x{n}" if n > 1 else q for q, n in counts.items()),
            )
    return bypassed


def _holds_expert_weights(module: nn.Module) -> bool:
    """Fused expert weights held directly by a module: 3-D parameters, or an ``...Expert...`` class with its
    own parameters (Dbrx stores its experts as 2-D ``(experts * inter, hidden)`` matrices)."""
    own = list(module.parameters(recurse=False))
    return any(p.ndim == 3 for p in own) or (bool(own) and "expert" in type(module).__name__.lower())


def _excluded(module_name: str) -> bool:
    """Whether the standard exclusions (routers, lm_head, vision towers, ...) cover this module anyway."""
    probe = f"{module_name}.weight_quantizer"
    return any(p is None and fnmatch.fnmatchcase(probe, q) for q, p in _STANDARD)


def snapshot_implementations(model: nn.Module) -> dict[str, str | None]:
    """The model's attention and experts implementations (restored by :func:`remove_quantizers`)."""
    config = getattr(model, "config", None)
    return {
        "attn": getattr(config, "_attn_implementation", None),
        "experts": getattr(config, "_experts_implementation", None),
    }


def remove_quantizers(model: nn.Module, implementations: dict[str, str | None] | None = None) -> None:
    """Undo :func:`insert_quantizers`: original classes, no quantizers, the implementations of
    ``implementations`` (a :func:`snapshot_implementations`), no recorded config."""
    for module in list(model.modules()):
        QUANT_MODULES.revert(module)
    config = getattr(model, "config", None)
    if implementations and config is not None:
        attn, experts = implementations["attn"], implementations["experts"]
        if attn is not None and getattr(config, "_attn_implementation", None) != attn:
            model.set_attn_implementation(attn) if hasattr(model, "set_attn_implementation") else None
        if experts is not None and getattr(config, "_experts_implementation", None) != experts:
            model.set_experts_implementation(experts) if hasattr(
                model, "set_experts_implementation"
            ) else None
    model.__dict__.pop(STATE_ATTR, None)


def name_quantizers(model: nn.Module) -> None:
    """Name every quantizer by its dotted path and mark it as one to calibrate (``calibration_expected``:
    run without an amax it raises, where a quantizer built by hand takes each input's own amax)."""
    for name, quantizer in iter_quantizers(model):
        quantizer.name = name
        quantizer.calibration_expected = True


def _use_kv_attention(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    target = kv_attention_name(current)
    if config is None or target is None or target == current:
        if target is None:
            logger.info("attention implementation %r is not wrapped: KV-cache quantizers cannot run", current)
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(target)
    else:
        config._attn_implementation = target
    logger.debug("attention implementation %r -> %r (KV-cache quantizers)", current, target)


@dataclass
class Provenance:
    """For each quantizer, the rules (index, description) that set its attributes or toggled it."""

    rules: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    unmatched: list[str] = field(default_factory=list)

    def explain(self, name: str) -> str:
        steps = self.rules.get(name, [])
        if not steps:
            return "no rule matched (defaults)"
        return "; ".join(f"#{i} {d}" for i, d in steps)


def _parent_matches(parent: nn.Module, parent_class: str | None) -> bool:
    if parent_class is None:
        return True
    wanted = parent_class.removeprefix("nn.")
    cls = getattr(parent, "original_cls", type(parent))
    return any(c.__name__ == wanted for c in cls.__mro__)


def _matches(rule: QuantRule, name: str, parent: nn.Module) -> bool:
    if not rule.is_fallback and not fnmatch.fnmatchcase(match_name(name), rule.quantizer_name):
        return False
    return _parent_matches(parent, rule.parent_class)


def apply_config(model: nn.Module, config: QuantizeConfig, index_offset: int = 0) -> Provenance:
    """Apply the rules of ``config`` in order to every quantizer of ``model``. Rules are numbered as written
    (plus ``index_offset`` for rules appended to an earlier config)."""
    provenance = Provenance()
    slots = _slots(model)
    for index, rule in config.ordered_rules():
        index += index_offset
        attrs = rule.attributes()
        hits = 0
        replaced = False
        for name, quantizer, parent, slot in slots:
            if not _matches(rule, name, parent):
                continue
            hits += 1
            provenance.rules.setdefault(name, []).append((index, rule.describe()))
            if attrs is None:
                set_enabled(quantizer, rule.enable)
            else:
                replaced |= _set(parent, slot, name, quantizer, attrs)
        if hits == 0:
            if (rule.quantizer_name, rule.parent_class) in _STANDARD:
                logger.debug("standard exclusion %s matched no quantizer", rule.describe())
            else:
                provenance.unmatched.append(rule.describe())
                logger.warning(
                    "quant_cfg rule #%d %s matched no quantizer in the model", index, rule.describe()
                )
        if replaced:  # a rule swapped a slot between single and sequential quantizers
            slots = _slots(model)
    return provenance


def set_enabled(quantizer, enable: bool) -> None:
    """Enable or disable ``quantizer`` (a rule with ``enable`` and no ``cfg``, ``mtq.enable_quantizer`` /
    ``disable_quantizer``); as in the reference, disabling this way also stops a rotation."""
    if enable:
        quantizer.enable()
        return
    quantizer.disable()
    if isinstance(quantizer, TensorQuantizer) and quantizer.attributes.rotation() is not None:
        quantizer.configure(rotate=False)


def _slots(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module, str]]:
    out = []
    for name, quantizer in iter_quantizers(model):
        parent_name, _, slot = name.rpartition(".")
        out.append((name, quantizer, model.get_submodule(parent_name) if parent_name else model, slot))
    return out


def _set(parent: nn.Module, slot: str, name: str, quantizer, attrs) -> bool:
    """Apply ``attrs``; True when the slot's quantizer object was replaced."""
    if len(attrs) == 1 and isinstance(quantizer, TensorQuantizer):
        quantizer.set_attributes(attrs[0])
        return False
    if len(attrs) == 1:
        new = TensorQuantizer(name).set_attributes(attrs[0])
    else:
        new = SequentialQuantizer(name, attrs)
    new.calibration_expected = quantizer.calibration_expected  # (False after replace_quant_module)
    _replace(parent, slot, new)
    return True


def _replace(parent: nn.Module, slot: str, quantizer) -> None:
    if isinstance(parent, QuantModule):
        parent.replace_quantizer(slot, quantizer)
    else:  # a quantizer held in a container (per-expert lists)
        setattr(parent, slot, quantizer) if not slot.isdigit() else parent.__setitem__(int(slot), quantizer)
