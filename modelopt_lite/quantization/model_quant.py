"""The ``mtq`` entry points: quantize, calibrate, summary / explain, fold, enable / disable."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..distributed import weight_access
from ..logging import get_logger
from ..moe import unquantized_experts
from ..nn import QuantizerAttributes, QuantModule, iter_quantizers
from .calibration.calibrate import ForwardLoop, algorithm_steps, calibrate
from .config import QuantizeConfig, QuantRule
from .config.presets import get_preset, preset_names
from .config.recipes import list_recipes, load_recipe
from .insertion import (
    STATE_ATTR,
    Provenance,
    apply_config,
    disable_bypassed_experts,
    insert_quantizers,
    match_name,
    remove_quantizers,
    set_enabled,
    snapshot_implementations,
    use_experts_implementation,
)

__all__ = [
    "QuantState",
    "add_post_quantize_hook",
    "disable_quantizer",
    "enable_quantizer",
    "explain",
    "fold_weight",
    "need_calibration",
    "print_quant_summary",
    "quant_state",
    "quantize",
    "remove_post_quantize_hook",
    "resolve_config",
    "set_quant_state",
    "set_quantizer_by_cfg",
]

logger = get_logger(__name__)
# Called with the model after each successful quantize; filled only by explicit opt-ins from the floors
# above (``mto.enable_huggingface_checkpointing()``), never at import.
_POST_QUANTIZE_HOOKS: list[Callable[[nn.Module], None]] = []


def add_post_quantize_hook(hook: Callable[[nn.Module], None]) -> None:
    """Run ``hook(model)`` after every successful :func:`quantize` (idempotent per hook)."""
    if hook not in _POST_QUANTIZE_HOOKS:
        _POST_QUANTIZE_HOOKS.append(hook)


def remove_post_quantize_hook(hook: Callable[[nn.Module], None]) -> None:
    if hook in _POST_QUANTIZE_HOOKS:
        _POST_QUANTIZE_HOOKS.remove(hook)


@dataclass
class QuantState:
    """What :func:`quantize` recorded on the model: the config, rules applied later by
    :func:`set_quantizer_by_cfg`, and which rule set each quantizer."""

    config: QuantizeConfig
    provenance: Provenance
    later_rules: tuple[QuantRule, ...] = ()


def quant_state(model: nn.Module) -> QuantState | None:
    return getattr(model, STATE_ATTR, None)


def set_quant_state(model: nn.Module, state: QuantState) -> None:
    setattr(model, STATE_ATTR, state)


def resolve_config(config: QuantizeConfig | Mapping[str, Any] | str | Path) -> QuantizeConfig:
    """A :class:`QuantizeConfig` from a config object, a dict (list or dict form), a preset name
    (``"NVFP4_DEFAULT_CFG"``), a packaged recipe name (``"general/ptq/int4_awq"``) or a recipe path."""
    if isinstance(config, QuantizeConfig):
        return config
    if isinstance(config, Mapping):
        return QuantizeConfig.from_dict(config)
    if isinstance(config, (str, Path)):
        name = str(config)
        if name in preset_names():
            return QuantizeConfig.from_dict(get_preset(name))
        if name.endswith((".yaml", ".yml")) or name in list_recipes():
            return load_recipe(name).config
        raise ValueError(
            f"unknown preset or recipe {name!r}; presets: {preset_names()}; recipes: {list_recipes()}"
        )
    raise TypeError(
        f"config must be a dict, a QuantizeConfig, or a preset / recipe name; got {type(config).__name__}"
    )


def quantize(
    model: nn.Module,
    config: QuantizeConfig | Mapping[str, Any] | str | Path,
    forward_loop: ForwardLoop | None = None,
    experts_implementation: str | None = None,
    *,
    skip_calibration: bool = False,
) -> nn.Module:
    """Insert quantizers into ``model`` (in place), apply ``config``, calibrate with its algorithm and
    return ``model``. ``forward_loop`` is a function of the model that runs calibration data through it, or
    an iterable of batches; weight-only configs need none. ``experts_implementation`` (``"grouped_mm"`` or
    ``"eager"``) chooses how fused MoE experts run; by default the model's own choice is kept.

    ``skip_calibration=True`` only inserts and configures the quantizers, e.g. before ``fully_shard``;
    calibrate afterwards with ``mtq.calibrate(model, algorithm, forward_loop)`` (on every rank)."""
    cfg = resolve_config(config)
    algorithm_steps(cfg.algorithm)  # unknown / unavailable algorithms fail before the model is touched
    previous = quant_state(model)
    if previous is not None:
        if not previous.config.same_as(cfg):
            raise ValueError(
                "the model is already quantized with a different config; quantize a fresh copy of the model, "
                "or change attributes in place with mtq.set_quantizer_by_cfg(model, quant_cfg)"
            )
        logger.info("model already quantized with this config: calibrating again")
        if experts_implementation is not None:
            use_experts_implementation(model, experts_implementation)
        calibrate(model, cfg.algorithm, forward_loop)
    else:
        implementations = snapshot_implementations(model)
        try:
            _insert_and_calibrate(model, cfg, forward_loop, experts_implementation, skip_calibration)
        except BaseException:
            remove_quantizers(model, implementations)  # nothing half-done: the model is as it was
            raise
    for hook in _POST_QUANTIZE_HOOKS:
        hook(model)
    return model


def _insert_and_calibrate(
    model: nn.Module,
    cfg: QuantizeConfig,
    forward_loop: ForwardLoop | None,
    experts_implementation: str | None,
    skip_calibration: bool = False,
) -> None:
    converted = insert_quantizers(model, experts_implementation)
    provenance = apply_config(model, cfg)
    bypassed = disable_bypassed_experts(model)  # logged as an ERROR naming them
    set_quant_state(model, QuantState(cfg, provenance))
    idle = [name for name in unquantized_experts(model) if name not in bypassed]
    if idle and any(q.is_enabled for _, q in iter_quantizers(model)):
        logger.warning(
            "the config enables quantizers but none of %d fused experts module(s) (%s); their "
            "patterns are *_weight_quantizer / *_input_quantizer (gate_up_proj_weight_quantizers.N match "
            "'*weight_quantizer')",
            len(idle),
            ", ".join(idle[:4]),
        )
    enabled = sum(q.is_enabled for _, q in iter_quantizers(model))
    then = "calibration skipped" if skip_calibration else f"calibrating with {cfg.algorithm_name}"
    logger.info(
        "inserted quantizers into %d module(s); %d quantizer(s) enabled; %s", len(converted), enabled, then
    )
    if not skip_calibration:
        calibrate(model, cfg.algorithm, forward_loop)


def set_quantizer_by_cfg(model: nn.Module, quant_cfg: Any) -> Provenance:
    """Apply rules (a ``quant_cfg`` list / dict, or a whole config) to the quantizers already in ``model``
    without calibrating; returns which rule set what."""
    config = quant_cfg if isinstance(quant_cfg, QuantizeConfig) else None
    if config is None:
        raw = (
            quant_cfg
            if isinstance(quant_cfg, Mapping) and "quant_cfg" in quant_cfg
            else {"quant_cfg": quant_cfg}
        )
        config = QuantizeConfig.from_dict({"quant_cfg": raw["quant_cfg"], "algorithm": None})
    if not any(True for _ in iter_quantizers(model)):
        raise ValueError("the model has no quantizers: call mtq.quantize first")
    state = quant_state(model)
    offset = len(state.config.quant_cfg) + len(state.later_rules) if state else 0
    provenance = apply_config(model, config, index_offset=offset)
    if state is not None:
        state.later_rules += config.quant_cfg
        for name, steps in provenance.rules.items():
            state.provenance.rules.setdefault(name, []).extend(steps)
    return provenance


_PROBE_SLOTS = ("m.input_quantizer", "m.weight_quantizer", "m.output_quantizer", "m.q_bmm_quantizer",
                "m.k_bmm_quantizer", "m.v_bmm_quantizer", "m.p_bmm_quantizer",
                "m.gate_up_proj_input_quantizer",
                "m.gate_up_proj_weight_quantizers.0", "m.down_proj_input_quantizer",
                "m.down_proj_weight_quantizers.0")  # fmt: skip


def need_calibration(config: QuantizeConfig | Mapping[str, Any] | str) -> bool:
    """Whether quantizing with ``config`` needs calibration data: the algorithm searches on data, or an
    activation / KV quantizer with a static (amax-based) format and no pinned amax (``constant_amax``,
    ``use_constant_amax``) ends up enabled. Weight quantizers are
    calibrated from the weights and never need data. Rules are resolved in order on the standard names."""
    cfg = resolve_config(config)
    if cfg.algorithm_name not in (None, "max"):
        return True
    default = QuantizerAttributes()
    off = ("output_quantizer", "p_bmm_quantizer")  # disabled until a rule enables them
    slots = {s: (default, not s.endswith(off)) for s in _PROBE_SLOTS}
    for _, rule in cfg.ordered_rules():
        if rule.parent_class is not None:  # scoped to other module classes (BatchNorm, Embedding, ...)
            continue
        attrs = rule.attributes()
        for slot, (current, _) in slots.items():
            if rule.is_fallback or fnmatch.fnmatchcase(match_name(slot), rule.quantizer_name):
                slots[slot] = (attrs[-1], attrs[-1].enable) if attrs else (current, bool(rule.enable))
    return any(
        enabled and attrs.spec().needs_amax and attrs.pinned_amax is None  # (a pinned amax needs no data)
        for slot, (attrs, enabled) in slots.items()
        if "weight_quantizer" not in slot
    )


def _set_enabled(model: nn.Module, pattern: str | Callable[[str], bool], enable: bool) -> int:
    count = 0
    for name, q in iter_quantizers(model):
        if (
            pattern(name)
            if callable(pattern)
            else (fnmatch.fnmatchcase(match_name(name), pattern) or fnmatch.fnmatchcase(name, pattern))
        ):
            set_enabled(q, enable)
            count += 1
    if count == 0:
        logger.warning("pattern %r matched no quantizer", pattern)
    return count


def disable_quantizer(model: nn.Module, pattern: str | Callable[[str], bool]) -> int:
    """Disable every quantizer whose name matches ``pattern`` (fnmatch, or a function of the name);
    returns how many."""
    return _set_enabled(model, pattern, False)


def enable_quantizer(model: nn.Module, pattern: str | Callable[[str], bool]) -> int:
    """Enable every quantizer whose name matches ``pattern`` (fnmatch, or a function of the name);
    returns how many."""
    return _set_enabled(model, pattern, True)


def fold_weight(model: nn.Module, keep_attrs: bool = False) -> nn.Module:
    """Replace each quantized weight by its fake-quantized value and disable its weight quantizer. The
    quantizer keeps its attributes and amax either way (``keep_attrs``, the reference's switch to keep
    them, changes nothing here)."""
    for module in model.modules():
        if isinstance(module, QuantModule):
            with weight_access(module, writeback=True):  # whole weights under FSDP2
                module.fold_weight()
    return model


def explain(model: nn.Module, pattern: str = "*") -> str:
    """One line per quantizer matching ``pattern``: its state and the rules that set it, in order."""
    state = quant_state(model)
    lines = []
    for name, q in iter_quantizers(model):
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        why = state.provenance.explain(name) if state else "unknown (not quantized through mtq.quantize)"
        lines.append(f"{name}: {q.extra_repr()} <- {why}")
    return "\n".join(lines)


def print_quant_summary(model: nn.Module, output_dir: str | Path | None = None) -> str:
    """Log (INFO) and return a table of every quantizer: state, format, amax, and the last rule that
    configured it; with ``output_dir``, also write it to ``output_dir/.quant_summary.txt``."""
    state = quant_state(model)
    rows = []
    enabled = 0
    for name, q in iter_quantizers(model):
        enabled += q.is_enabled
        steps = state.provenance.rules.get(name, []) if state else []
        last = f"#{steps[-1][0]} {steps[-1][1].split(':')[0]}" if steps else "-"
        rows.append(f"{name:<60} {q.extra_repr():<48} {last}")
    header = f"{len(rows)} quantizers, {enabled} enabled"
    text = "\n".join([header, *rows])
    logger.info("%s", text)
    if output_dir is not None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / ".quant_summary.txt").write_text(text + "\n", encoding="utf-8")
    return text
