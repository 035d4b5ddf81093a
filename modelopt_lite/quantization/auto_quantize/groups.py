"""The layer groups of :func:`~modelopt_lite.quantization.auto_quantize` and their quantizers per format:
the candidate formats (resolved, with their bits per weight element), the searched units (a quantized layer,
or one projection of a fused-experts module), the groups of units that share a format (``q_proj`` /
``k_proj`` / ``v_proj``, ``gate_proj`` / ``up_proj``, the per-expert linears of one MoE block), and the
construction and installation of each unit's quantizers for a format."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ...moe import QuantExperts
from ...nn import QuantModule, SequentialQuantizer, TensorQuantizer, iter_quantizers
from ...nn.errors import UnsupportedFeatureError
from .. import model_quant
from ..config import QuantizeConfig, QuantRule
from ..config.presets import EXTRA_PRESETS, PRESETS, preset_names
from ..insertion import _replace, match_name

__all__ = ["GROUPING_RULES", "NONE", "SEARCHABLE_ALGORITHMS", "format_bits"]

NONE = "NONE"  # the name of "keep unquantized"
#: Algorithms that only set quantizer state (the weights stay as they are, so every candidate calibrates on
#: the same model). AWQ, SmoothQuant, GPTQ and SVDQuant change the weights.
SEARCHABLE_ALGORITHMS = ("max", "mse", "local_hessian")
#: Module-name rules whose first group is the key of units that must share a format (the reference's).
GROUPING_RULES = (
    r"^(.*?)\.(q_proj|k_proj|v_proj)$",
    r"^(.*?\.mlp\.experts)\.\d+\.(gate_proj|up_proj|down_proj)$",
    r"^(.*?)\.(gate_proj|up_proj)$",
    r"^(.*?)\.(\d+\.(w1|w2|w3))$",
)


@dataclass
class _Format:
    name: str
    config: QuantizeConfig | None  # None: unquantized
    bits: float


@dataclass
class _Unit:
    """One searchable piece: a quantized layer, or one projection of a fused-experts module."""

    name: str
    module_name: str
    module: QuantModule
    score_module: nn.Module  # where its output perturbation is measured
    slots: tuple[str, ...]  # its quantizer paths relative to ``module``
    numel: int


@dataclass
class _Group:
    name: str
    units: list[_Unit]
    formats: list[_Format]  # by increasing bits; unquantized last
    disabled: bool

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)


# ------------------------------------------------------------------------------------------------ formats
def _format_name(fmt: Any, index: int) -> str:
    if isinstance(fmt, (str, Path)):
        return str(fmt)
    named = {**PRESETS, **EXTRA_PRESETS}
    cfg = model_quant.resolve_config(fmt)
    for name, preset in named.items():
        if QuantizeConfig.from_dict(preset).same_as(cfg):
            return name
    return f"CUSTOM_{index}"


def format_bits(config: QuantizeConfig) -> float:
    """Bits per weight element of a format, counted as the reference does: the smallest over its enabled
    rules of ``effective_bits``, else ``num_bits`` (``E + M + 1`` for a float format); 16 when it
    quantizes nothing."""
    bits = [16.0]
    for rule in config.quant_cfg:
        if rule.enable is False or rule.cfg is None:
            continue
        raw = rule.cfg if isinstance(rule.cfg, tuple) else (rule.cfg,)
        for cfg, attrs in zip(raw, rule.attributes() or (), strict=True):
            if "effective_bits" in cfg:
                bits.append(float(cfg["effective_bits"]))
            elif isinstance(attrs.num_bits, tuple):
                bits.append(float(sum(attrs.num_bits) + 1))
            else:
                bits.append(float(attrs.num_bits))
    return min(bits)


def _resolve_formats(quantization_formats: Any) -> list[_Format]:
    if not isinstance(quantization_formats, list) or not quantization_formats:
        raise TypeError(
            "quantization_formats must be a non-empty list of preset names (e.g. ['NVFP4_DEFAULT_CFG', "
            f"'FP8_DEFAULT_CFG']), recipe names or config dicts, None meaning unquantized; presets: "
            f"{preset_names()}"
        )
    formats: dict[str, _Format] = {}
    for i, fmt in enumerate(quantization_formats):
        if fmt is None:
            continue
        config = model_quant.resolve_config(fmt)  # unknown names raise, listing presets and recipes
        bad = [name for name, _ in config.algorithm_steps if name not in SEARCHABLE_ALGORITHMS]
        name = _format_name(fmt, i)
        if bad:
            raise ValueError(
                f"quantization format {name} calibrates with {'+'.join(bad)}, which changes the weights; "
                f"auto_quantize calibrates every candidate on the same weights: use a format calibrated with "
                f"{' / '.join(SEARCHABLE_ALGORITHMS)} (e.g. NVFP4_DEFAULT_CFG for NVFP4_AWQ_LITE_CFG), then "
                "quantize the chosen assignment with mtq.get_auto_quantize_config(state) and set its "
                "'algorithm'"
            )
        formats[name] = _Format(name, config, format_bits(config))
    if not formats:
        raise ValueError("quantization_formats holds only None: give at least one format to search")
    return [*sorted(formats.values(), key=lambda f: f.bits), _Format(NONE, None, 16.0)]


def _check_sharded_formats(formats: list[_Format]) -> None:
    """On an FSDP2-sharded model only ``max`` calibration runs (the others need whole weights)."""
    whole = [
        f"{f.name} ({f.config.algorithm_name})"
        for f in formats
        if f.config is not None and f.config.algorithm_name not in ("max", None)
    ]
    if whole:
        raise UnsupportedFeatureError(
            f"auto_quantize on an FSDP2-sharded model calibrates with 'max' only, and format(s) "
            f"{', '.join(whole)} need whole weights: search before fully_shard (every rank with the whole "
            "model and its share of the batches), or give formats calibrated with 'max'"
        )


# ------------------------------------------------------------------------------------------------ groups
def _units(model: nn.Module) -> list[_Unit]:
    units = []
    for name, module in model.named_modules():
        if not isinstance(module, QuantModule):
            continue
        numel = {id(q): w.numel() for q, w in module.weight_quantizer_pairs()}
        if not numel:
            continue  # attention (KV-cache quantizers) and other weightless wrappers are not searched
        own = [rel for rel, _ in iter_quantizers(module) if "." not in match_name(rel)]
        if isinstance(module, QuantExperts):
            parts = [
                (f"{name}.{p}", tuple(s for s in own if s.startswith(f"{p}_"))) for p in module._projections
            ]
        else:
            parts = [(name, tuple(own))]
        for unit_name, slots in parts:
            size = sum(numel.get(id(module.get_submodule(s)), 0) for s in slots)
            units.append(_Unit(unit_name, name, module, module, slots, size))
    return units


def _group_key(name: str) -> str:
    for rule in GROUPING_RULES:
        if m := re.match(rule, name):
            return m.group(1)
    return name


def _is_disabled(unit: _Unit, patterns: Sequence[str]) -> bool:
    """A ``disabled_layers`` pattern matches the unit's module name (as in the reference) or one of its
    quantizer names (so the preset patterns ``*mlp.gate.*`` / ``*lm_head*`` work too)."""
    names = [unit.name, unit.module_name, *(f"{unit.module_name}.{s}" for s in unit.slots)]
    return any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns)


def _groups(units: list[_Unit], formats: list[_Format], disabled_layers: Sequence[str]) -> list[_Group]:
    by_key: dict[str, list[_Unit]] = {}
    for unit in units:
        by_key.setdefault(_group_key(unit.name), []).append(unit)
    groups = []
    for members in by_key.values():
        disabled = any(_is_disabled(u, disabled_layers) for u in members)
        groups.append(
            _Group(
                f"{members[0].name}.quant_recipe", members, formats[-1:] if disabled else formats, disabled
            )
        )
    return groups


# ------------------------------------------------------------------------------ quantizers per format
def _entries(unit: _Unit, fmt: _Format) -> list[dict[str, Any]]:
    """The config entries that give ``unit``'s quantizers ``fmt`` (none for unquantized): the format's
    rules resolved, in order, on each quantizer's own name (``weight_quantizer``, ...); output quantizers off
    as in the reference."""
    if fmt.config is None:
        return []
    rules = [r for _, r in fmt.config.ordered_rules()] + [QuantRule("*output_quantizer", enable=False)]
    owner = getattr(unit.module, "original_cls", type(unit.module))
    classes = {c.__name__ for c in owner.__mro__}
    out = []
    for slot in dict.fromkeys(match_name(s) for s in unit.slots):
        cfg, enable = None, False
        for rule in rules:
            if rule.parent_class is not None and rule.parent_class.removeprefix("nn.") not in classes:
                continue
            if rule.is_fallback or fnmatch.fnmatchcase(slot, rule.quantizer_name):
                if rule.cfg is not None:
                    cfg, enable = rule.to_dict()["cfg"], rule.enable is not False
                else:
                    enable = bool(rule.enable)
        if enable:
            entry = {"quantizer_name": f"{unit.module_name}.{slot}", "enable": True}
            out.append(entry if cfg is None else {**entry, "cfg": cfg})
    return out


def _make_quantizers(unit: _Unit, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Fresh quantizers for ``unit``'s slots configured by ``entries`` (the others disabled)."""
    rules = {e["quantizer_name"]: QuantRule.from_entry(e)[0] for e in entries}
    made: dict[str, Any] = {}
    for slot in unit.slots:
        name = f"{unit.module_name}.{slot}"
        rule = rules.get(f"{unit.module_name}.{match_name(slot)}")
        attrs = rule.attributes() if rule is not None else None
        if attrs is not None and len(attrs) > 1:
            made[slot] = SequentialQuantizer(name, list(attrs))
            made[slot].calibration_expected = True
            continue
        q = TensorQuantizer(name)
        q.calibration_expected = True  # (calibrated before it is scored)
        if attrs:
            q.set_attributes(attrs[0])
        elif rule is None:
            q.disable()
        made[slot] = q
    return made


def _install(unit: _Unit, quantizers: Mapping[str, Any]) -> None:
    for slot, q in quantizers.items():
        parent_path, _, leaf = slot.rpartition(".")
        _replace(unit.module.get_submodule(parent_path) if parent_path else unit.module, leaf, q)
