"""Attribute dicts in the reference library's vocabulary (``pass_through_bwd``, ``type``, ``effective_bits``,
...) translated into validated :class:`QuantizerAttributes`.

This is the one place quantizer attributes are checked: config rules, the pydantic
``QuantizerAttributeConfig`` and ``TensorQuantizer(cfg)`` all call :func:`quantizer_attributes`. A feature of
the reference we do not implement raises :class:`UnsupportedFeatureError`, which is both a
``NotImplementedError`` (what it is) and a ``ValueError`` (what a bad attribute value has always raised).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ..errors import UnsupportedFeatureError
from .attributes import QuantizerAttributes, calibrator_constructor

__all__ = ["ALLOWED_ATTRIBUTE_KEYS", "UnsupportedFeatureError", "attribute_updates", "quantizer_attributes"]


_OURS = {f.name for f in fields(QuantizerAttributes)} - {"enable"}
# Reference attributes we accept but that change nothing in fake quant (kept for round trips).
_INERT = {"effective_bits": (int, float, type(None)), "trt_high_precision_dtype": (str,)}
# Reference attributes whose non-default values we do not implement, with what to use instead.
_DEFAULT_ONLY: dict[str, tuple[Any, str]] = {
    "backend": (None, "custom quantization backends are not implemented; the fake quant is built in"),
    "backend_extra_args": (None, "custom quantization backends are not implemented"),
}
ALLOWED_ATTRIBUTE_KEYS = sorted(
    _OURS | set(_INERT) | set(_DEFAULT_ONLY) | {"type", "pass_through_bwd", "enable"}
)


def _int_key(key: Any) -> Any:
    return int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key


def _check_reference_only(where: str, cfg: Mapping[str, Any]) -> None:
    for key, (default, instead) in _DEFAULT_ONLY.items():
        if key in cfg and cfg[key] != default:
            raise UnsupportedFeatureError(
                f"{where}: {key}={cfg[key]!r} is not supported (only {default!r}): {instead}"
            )


def quantizer_attributes(
    cfg: Mapping[str, Any], enable: bool = True, where: str = "cfg", explicit_enable: bool = False
) -> QuantizerAttributes:
    """Translate one attribute dict (reference or our names) into validated :class:`QuantizerAttributes`.
    ``explicit_enable``: the rule itself sets ``enable``, so a different ``cfg["enable"]`` is a conflict."""
    out = attribute_updates(cfg, where)
    if "enable" in out:
        if out["enable"] != enable and explicit_enable:
            raise ValueError(
                f"{where}: the rule says enable={enable} but its cfg says enable={out['enable']}"
            )
        enable = out.pop("enable")
    if not isinstance(enable, bool):
        raise TypeError(f"{where}: enable={enable!r} must be True or False")
    try:
        attrs = QuantizerAttributes(**out, enable=enable)
        attrs.spec()
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None
    return attrs


def attribute_updates(cfg: Mapping[str, Any], where: str = "cfg") -> dict[str, Any]:
    """The attributes ``cfg`` gives (reference or our names), in our names, checked one by one but not yet
    together: what :meth:`TensorQuantizer.set_from_attribute_config` changes (``enable`` included when
    given)."""
    if not isinstance(cfg, Mapping):
        raise TypeError(f"{where}: expected a mapping of quantizer attributes, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(ALLOWED_ATTRIBUTE_KEYS))
    if unknown:
        raise ValueError(
            f"{where}: unknown quantizer attribute(s) {unknown} (allowed: {ALLOWED_ATTRIBUTE_KEYS})"
        )
    out: dict[str, Any] = {k: copy.deepcopy(v) for k, v in cfg.items() if k in _OURS and k != "calibrator"}
    if "calibrator" in cfg:
        try:
            constructor = calibrator_constructor(cfg["calibrator"])
        except TypeError as err:
            raise TypeError(f"{where}: {err}") from None
        out["calibrator"] = cfg["calibrator"] if constructor is None else constructor
    for key, types in _INERT.items():
        if key in cfg and not isinstance(cfg[key], types):
            raise TypeError(f"{where}: {key}={cfg[key]!r} has the wrong type")
    _check_reference_only(where, cfg)
    if isinstance(out.get("bias"), Mapping):  # axis keys written as strings (JSON) become ints
        out["bias"] = {_int_key(k): v for k, v in out["bias"].items()}
    if isinstance(out.get("rotate"), Mapping):  # a RotateConfig, or a dict
        out["rotate"] = dict(out["rotate"])
    if isinstance(out.get("num_bits"), list):
        out["num_bits"] = tuple(out["num_bits"])
    kind = cfg.get("type", "static")
    if kind not in ("static", "dynamic"):
        raise ValueError(f"{where}: type={kind!r} (allowed: 'static', 'dynamic')")
    if out.get("block_sizes") is not None:
        if not isinstance(out["block_sizes"], Mapping):
            raise TypeError(
                f"{where}: block_sizes={out['block_sizes']!r} must be a mapping such as {{-1: 128}}"
            )
        blocks = {_int_key(k): v for k, v in out["block_sizes"].items()}
        if isinstance(blocks.get("scale_bits"), list):
            blocks["scale_bits"] = tuple(blocks["scale_bits"])
        if kind == "dynamic":
            blocks.setdefault("type", "dynamic")
        out["block_sizes"] = blocks
    if out.get("backward", "pass_through") is None:  # (a model_dump of QuantizerAttributeConfig: not set)
        del out["backward"]
    if "pass_through_bwd" in cfg:
        if not isinstance(cfg["pass_through_bwd"], bool):
            raise TypeError(f"{where}: pass_through_bwd must be True or False")
        backward = "pass_through" if cfg["pass_through_bwd"] else "clipped"
        if out.get("backward", backward) != backward:
            raise ValueError(
                f"{where}: pass_through_bwd={cfg['pass_through_bwd']} contradicts "
                f"backward={out['backward']!r}; give one of them"
            )
        out["backward"] = backward
    if "enable" in cfg:
        out["enable"] = cfg["enable"]
    return out
