"""The typed quantization config: an ordered list of rules plus a calibration algorithm.

Accepted input (all validated at construction; a bad key or value raises naming what is allowed):

* the reference library's list form::

    {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                   {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}}],
     "algorithm": "max"}

* its older dict form ``{"quant_cfg": {"*weight_quantizer": {...}, "default": {"enable": False}}}``
  (also ``{"nn.Linear": {"*input_quantizer": {...}}}`` scoped entries).

Rules apply in order and later rules win. A rule with ``cfg`` replaces every attribute of the quantizers it
matches (unspecified attributes go back to their defaults) and enables them unless it says
``"enable": False``; a rule with only ``enable`` toggles them. ``cfg`` may be a list: a sequential
quantizer (W4A8). The pattern ``"default"`` is the fallback for quantizers no other rule matches: it is
applied first, whatever its position (configs written for older releases put it last and mean exactly
that; release 0.47 of the reference applies it in place, which disables everything).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ...nn import QuantizerAttributes
from ...nn.quantizer.attribute_dict import UnsupportedFeatureError, quantizer_attributes
from .algorithm_specs import (
    ALGORITHMS,
    EXPERTS_WITHOUT_TOKENS,
    EXPERTS_WITHOUT_TOKENS_CHOICES,
    LAYERWISE_UNSUPPORTED,
    UNSUPPORTED_ALGORITHMS,
    algorithm_step,
    experts_without_tokens,
)

__all__ = [
    "ALGORITHMS",
    "EXPERTS_WITHOUT_TOKENS",
    "EXPERTS_WITHOUT_TOKENS_CHOICES",
    "LAYERWISE_UNSUPPORTED",
    "UNSUPPORTED_ALGORITHMS",
    "QuantRule",
    "QuantizeConfig",
    "UnsupportedFeatureError",
    "experts_without_tokens",
    "plain",
    "quantizer_attributes",
    "validating",
]


@contextmanager
def validating(title: str) -> Iterator[None]:
    """Report a bad config as the reference does: a ``ValueError`` or ``TypeError`` raised inside becomes a
    ``pydantic.ValidationError`` (itself a ``ValueError``) titled ``title``, with the same message.
    :class:`UnsupportedFeatureError` (a feature we leave out) passes unchanged."""
    try:
        yield
    except (ValidationError, UnsupportedFeatureError):
        raise
    except (ValueError, TypeError) as err:
        details = {"type": "value_error", "loc": (), "input": None, "ctx": {"error": str(err)}}
        raise ValidationError.from_exception_data(title, [details], hide_input=True) from None  # type: ignore[list-item]


def plain(value: Any, str_keys: bool = False) -> Any:
    """Tuples -> lists (and, with ``str_keys``, keys -> strings) so that YAML / JSON write plain data."""
    if isinstance(value, dict):
        return {(str(k) if str_keys else k): plain(v, str_keys) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, str_keys) for v in value]
    return value


def is_empty_cfg(cfg: Any) -> bool:
    """``{}``, ``[]`` or a list of ``{}``."""
    if isinstance(cfg, Mapping):
        return len(cfg) == 0
    return isinstance(cfg, (list, tuple)) and all(isinstance(c, Mapping) and len(c) == 0 for c in cfg)


@dataclass(frozen=True)
class QuantRule:
    """One entry of ``quant_cfg``; ``cfg`` is kept as written so configs round-trip unchanged."""

    quantizer_name: str
    cfg: Mapping[str, Any] | tuple[Mapping[str, Any], ...] | None = None
    enable: bool | None = None
    parent_class: str | None = None

    def __post_init__(self) -> None:
        where = f"quant_cfg rule {self.quantizer_name!r}"
        if not isinstance(self.quantizer_name, str) or not self.quantizer_name:
            raise TypeError(f"quantizer_name must be a non-empty string, got {self.quantizer_name!r}")
        if self.enable is not None and not isinstance(self.enable, bool):
            raise TypeError(f"{where}: enable={self.enable!r} must be True, False or absent")
        if self.parent_class is not None and not isinstance(self.parent_class, str):
            raise TypeError(f"{where}: parent_class must be a class name such as 'nn.Linear'")
        if self.cfg is None and self.enable is None:
            raise ValueError(
                f"{where}: must specify 'cfg', 'enable', or both (a rule with only quantizer_name does "
                "nothing; enable=True keeps the quantizer's attributes, enable=False disables it)"
            )
        if is_empty_cfg(self.cfg):  # as in the reference: nothing to set when disabling, else a mistake
            if self.enable is not False:
                raise ValueError(
                    f"{where}: cfg is empty; it must specify at least one quantizer attribute, or drop cfg "
                    "and set enable (True keeps the quantizer's attributes, False disables it)"
                )
            object.__setattr__(self, "cfg", None)
        if isinstance(self.cfg, Sequence) and not isinstance(self.cfg, (str, bytes)):
            if not all(isinstance(c, Mapping) for c in self.cfg):
                raise TypeError(
                    f"{where}: cfg must be a valid list of attribute dictionaries (one per stage of a "
                    f"sequential quantizer), got {self.cfg!r}"
                )
            object.__setattr__(self, "cfg", tuple(copy.deepcopy(dict(c)) for c in self.cfg))
        elif self.cfg is not None:
            if not isinstance(self.cfg, Mapping):
                raise TypeError(
                    f"{where}: cfg must be a valid dictionary of quantizer attributes (or a list of them, "
                    f"one per stage), got {self.cfg!r}"
                )
            object.__setattr__(self, "cfg", copy.deepcopy(dict(self.cfg)))
        self.attributes()  # validate now

    _FIELDS = ("quantizer_name", "parent_class", "cfg", "enable")

    def __getitem__(self, key: str) -> Any:
        """Read a field by name (``rule["quantizer_name"]``), as the reference's entries read."""
        if key not in self._FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in self._FIELDS

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self._FIELDS else default

    @property
    def is_fallback(self) -> bool:
        return self.quantizer_name == "default"

    def attributes(self) -> tuple[QuantizerAttributes, ...] | None:
        """The attributes this rule sets (one per stage), or ``None`` for an enable-only rule."""
        if self.cfg is None:
            return None
        enable = True if self.enable is None else self.enable
        cfgs = self.cfg if isinstance(self.cfg, tuple) else (self.cfg,)
        where = f"quant_cfg rule {self.quantizer_name!r}"
        return tuple(quantizer_attributes(c, enable, where, self.enable is not None) for c in cfgs)

    def normalized(self) -> tuple[Any, ...]:
        """What the rule does, independent of how it was written (tuples vs lists, ``"-1"`` vs ``-1``)."""
        return (self.quantizer_name, self.parent_class, self.enable, self.attributes())

    def describe(self) -> str:
        what = []
        if self.cfg is not None:
            attrs = self.attributes() or ()
            what.append(" -> ".join(f"{a.spec().name} {a.spec().granularity}" for a in attrs))
        if self.enable is not None:
            what.append(f"enable={self.enable}")
        scope = f" [{self.parent_class}]" if self.parent_class else ""
        return f"{self.quantizer_name!r}{scope}: {', '.join(what)}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"quantizer_name": self.quantizer_name}
        if self.parent_class is not None:
            out["parent_class"] = self.parent_class
        if self.cfg is not None:
            out["cfg"] = copy.deepcopy(list(self.cfg) if isinstance(self.cfg, tuple) else dict(self.cfg))
        if self.enable is not None:
            out["enable"] = self.enable
        return out

    @classmethod
    def from_entry(cls, entry: Any) -> list[QuantRule]:
        """One list entry: ``{"quantizer_name": ..., ...}`` or the single-key legacy ``{pattern: cfg}``."""
        if not isinstance(entry, Mapping) or not entry:
            raise (ValueError if isinstance(entry, Mapping) else TypeError)(
                f"Invalid quant_cfg entry: {entry!r}; expected a mapping {{'quantizer_name': ..., "
                "'cfg': ..., 'enable': ...} (or the older single-key form {pattern: attributes})"
            )
        if "quantizer_name" in entry:
            unknown = sorted(set(entry) - {"quantizer_name", "cfg", "enable", "parent_class"})
            if unknown:
                raise ValueError(
                    f"quant_cfg entry {entry['quantizer_name']!r}: unknown key(s) {unknown} "
                    "(allowed: quantizer_name, cfg, enable, parent_class)"
                )
            return [cls(**entry)]
        if len(entry) > 1 and not any(isinstance(k, str) and k.startswith("nn.") for k in entry):
            raise ValueError(
                f"Invalid quant_cfg entry: {entry!r}; a list entry without 'quantizer_name' holds one "
                "{pattern: attributes} pair: write one entry per pattern, or pass the whole mapping as "
                "quant_cfg (the older flat dict form)"
            )
        rules: list[QuantRule] = []
        for key, value in entry.items():
            rules.extend(cls._legacy(key, value))
        return rules

    @classmethod
    def _legacy(cls, pattern: Any, value: Any, parent_class: str | None = None) -> list[QuantRule]:
        if not isinstance(pattern, str):
            raise TypeError(f"quant_cfg key {pattern!r} must be a string pattern")
        if pattern.startswith("nn.") and parent_class is None:
            if not isinstance(value, Mapping):
                raise TypeError(
                    f"quant_cfg[{pattern!r}]: for the 'nn.*' scoped format, value must be a mapping of "
                    f"quantizer patterns to attributes, got {value!r}"
                )
            return [r for k, v in value.items() for r in cls._legacy(k, v, parent_class=pattern)]
        if isinstance(value, Mapping):
            cfg = {k: v for k, v in value.items() if k != "enable"} or None
            return [cls(pattern, cfg, value.get("enable"), parent_class)]
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            return [cls(pattern, tuple(value), None, parent_class)]
        raise TypeError(f"quant_cfg[{pattern!r}]={value!r}: expected a mapping of attributes or a list")


def _copy_step(algorithm: Any) -> Any:
    return copy.deepcopy(dict(algorithm)) if isinstance(algorithm, Mapping) else algorithm


@dataclass(frozen=True)
class QuantizeConfig:
    """Rules (applied in order) and the calibration algorithm (a name, ``{"method": ..., **options}``,
    ``None``, or a list of these, applied one after the other as in the reference).

    ``quant_cfg`` takes :class:`QuantRule` objects, the reference's list of entry dicts, or its older flat
    dict (``{"*weight_quantizer": {...}, "default": {"enable": False}}``, where ``"default"`` is the
    fallback, applied first: see the module docstring), exactly as :func:`mtq.quantize` takes them; it is
    held as a tuple of rules."""

    quant_cfg: tuple[QuantRule, ...]
    algorithm: str | Mapping[str, Any] | list[str | Mapping[str, Any] | None] | None = "max"

    def __post_init__(self) -> None:
        with validating(type(self).__name__):
            self._validate()

    def _validate(self) -> None:
        raw = self.quant_cfg
        if isinstance(raw, Mapping):  # the older flat dict form, as mtq.quantize takes it
            rules = [r for key, value in raw.items() for r in QuantRule._legacy(key, value)]
        elif isinstance(raw, (str, bytes)) or not isinstance(raw, (Sequence, Iterator)):
            raise TypeError(
                f"quant_cfg must be a sequence of entries (a list; or the older flat mapping), got "
                f"{type(raw).__name__}: {raw!r}"
            )
        else:  # the reference's keyword form QuantizeConfig(quant_cfg=[{...}, ...]) gives mappings
            rules = [r for e in raw for r in (QuantRule.from_entry(e) if isinstance(e, Mapping) else [e])]
        object.__setattr__(self, "quant_cfg", tuple(rules))
        for rule in self.quant_cfg:
            if not isinstance(rule, QuantRule):
                raise TypeError(f"quant_cfg must hold QuantRule objects, got {type(rule).__name__}")
        if isinstance(self.algorithm, (list, tuple)):
            object.__setattr__(self, "algorithm", [_copy_step(a) for a in self.algorithm])
        else:
            object.__setattr__(self, "algorithm", _copy_step(self.algorithm))
        for name, _ in self.algorithm_steps:
            if name not in ALGORITHMS:
                raise ValueError(f"algorithm={name!r} is unknown (allowed: {list(ALGORITHMS)} or None)")
            if name in UNSUPPORTED_ALGORITHMS:
                raise UnsupportedFeatureError(
                    f"algorithm={name!r} is not supported: {UNSUPPORTED_ALGORITHMS[name]}"
                )

    @property
    def algorithm_steps(self) -> list[tuple[str, dict[str, Any]]]:
        """``(name, options)`` of each algorithm to run, in order (``None`` entries run nothing)."""
        steps = self.algorithm if isinstance(self.algorithm, list) else [self.algorithm]
        return [(name, options) for a in steps for name, options in [algorithm_step(a)] if name is not None]

    @property
    def algorithm_name(self) -> str | None:
        """The algorithm's name; for a list, the names joined by ``" + "`` (``None``: no calibration)."""
        return " + ".join(name for name, _ in self.algorithm_steps) or None

    @property
    def algorithm_options(self) -> dict[str, Any]:
        """The options of a single algorithm (a list has them per step: :attr:`algorithm_steps`)."""
        steps = self.algorithm_steps
        return steps[0][1] if len(steps) == 1 else {}

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> QuantizeConfig:
        """The config of a dict (list or dict form); a bad one raises ``pydantic.ValidationError`` (a
        ``ValueError``) naming what is wrong, as the reference's config class does."""
        with validating(cls.__name__):
            return cls._from_dict(config)

    @classmethod
    def _from_dict(cls, config: Mapping[str, Any]) -> QuantizeConfig:
        if not isinstance(config, Mapping):
            raise TypeError(f"a quantization config must be a mapping, got {type(config).__name__}")
        unknown = sorted(set(config) - {"quant_cfg", "algorithm"})
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown} (allowed: 'quant_cfg', 'algorithm')")
        if "quant_cfg" not in config:
            raise ValueError("a quantization config needs 'quant_cfg' (a list of rules)")
        raw = config["quant_cfg"]
        if isinstance(raw, Mapping):
            rules = [r for key, value in raw.items() for r in QuantRule._legacy(key, value)]
        elif isinstance(raw, Sequence) and not isinstance(raw, (str, bytes)):
            rules = [r for entry in raw for r in QuantRule.from_entry(entry)]
        else:
            raise TypeError(f"quant_cfg must be a list of rules or a mapping, got {type(raw).__name__}")
        return cls(tuple(rules), config.get("algorithm", "max"))

    def to_dict(self) -> dict[str, Any]:
        """The list form (what the reference library and our YAML recipes use)."""
        return {
            "quant_cfg": [r.to_dict() for r in self.quant_cfg],
            "algorithm": copy.deepcopy(self.algorithm),
        }

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        """The reference's (pydantic) name for :meth:`to_dict`; its keyword options are not used."""
        return self.to_dict()

    def same_as(self, other: QuantizeConfig) -> bool:
        """Whether both configs do the same thing (e.g. a preset and its JSON / YAML round trip)."""
        return [r.normalized() for r in self.quant_cfg] == [r.normalized() for r in other.quant_cfg] and (
            self.algorithm_steps == other.algorithm_steps
        )

    def ordered_rules(self) -> list[tuple[int, QuantRule]]:
        """``(index as written, rule)`` in application order: fallback (``"default"``) rules first."""
        indexed = list(enumerate(self.quant_cfg))
        return [x for x in indexed if x[1].is_fallback] + [x for x in indexed if not x[1].is_fallback]

    def with_rules(self, *rules: QuantRule, algorithm: Any = ...) -> QuantizeConfig:
        """A copy with ``rules`` appended (they win over existing ones)."""
        return QuantizeConfig(self.quant_cfg + rules, self.algorithm if algorithm is ... else algorithm)
