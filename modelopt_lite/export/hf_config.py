"""``hf_quant_config.json`` and ``config.json["quantization_config"]`` (``quant_method: "modelopt"``), the
facts inference engines read: ``quant_algo``, ``kv_cache_quant_algo``, ``group_size``, ``exclude_modules``
(and, for a model mixing formats, ``quantized_layers`` under ``quant_algo: "MIXED_PRECISION"``)."""

from __future__ import annotations

from typing import Any

from .._version import __version__

__all__ = ["PRODUCER", "QUANT_METHOD", "hf_quant_config", "quantization_config", "validate_hf_quant_config"]

QUANT_METHOD = "modelopt"
PRODUCER = {"name": "modelopt_lite", "version": __version__}
_AWQ = {"W4A16_AWQ", "W4A8_AWQ", "NVFP4_AWQ"}
_FLOAT = {"type": "float", "dynamic": False}


def _layer_entry(algo: str, group_size: int | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"quant_algo": algo}
    if group_size is not None:
        entry["group_size"] = group_size
    if algo in _AWQ:
        entry.update(has_zero_point=False, pre_quant_scale=True)
    return entry


def hf_quant_config(
    layers: dict[str, tuple[str, int | None]], exclude_modules: list[str], kv_cache_quant_algo: str | None
) -> dict[str, Any]:
    """``layers`` maps each quantized layer to ``(quant_algo, group_size)``."""
    entries = {name: _layer_entry(algo, group) for name, (algo, group) in sorted(layers.items())}
    distinct = {tuple(sorted(e.items())) for e in entries.values()}
    quantization: dict[str, Any] = {"quant_algo": None, "kv_cache_quant_algo": kv_cache_quant_algo}
    if len(distinct) == 1:
        quantization.update(next(iter(entries.values())))
    else:
        quantization.update(quant_algo="MIXED_PRECISION", quantized_layers=entries)
    quantization["exclude_modules"] = sorted(exclude_modules)
    return {"producer": dict(PRODUCER), "quantization": quantization}


def _group(algo: str, group_size: int | None) -> dict[str, Any]:
    """compressed-tensors style description of weights and input activations."""
    weights: dict[str, Any]
    inputs: dict[str, Any] | None
    if algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
        weights, inputs = {**_FLOAT, "num_bits": 8}, {**_FLOAT, "num_bits": 8}
        if algo != "FP8":
            weights["strategy"] = "channel"
    elif algo in ("W8A8_SQ_PER_CHANNEL", "W8A16"):
        weights = {"type": "int", "dynamic": False, "num_bits": 8, "strategy": "channel"}
        inputs = {"type": "int", "dynamic": False, "num_bits": 8} if algo != "W8A16" else None
    elif algo in ("W4A16_AWQ", "W4A8_AWQ"):
        weights = {"type": "int", "dynamic": False, "num_bits": 4, "group_size": group_size}
        inputs = {**_FLOAT, "num_bits": 8} if algo == "W4A8_AWQ" else None
    elif algo in ("NVFP4", "NVFP4_AWQ", "W4A16_NVFP4"):
        weights = {**_FLOAT, "num_bits": 4, "group_size": group_size}
        inputs = None if algo == "W4A16_NVFP4" else {**_FLOAT, "num_bits": 4, "group_size": group_size}
    else:  # MXFP8
        weights = {**_FLOAT, "num_bits": 8, "group_size": group_size}
        inputs = {**_FLOAT, "num_bits": 8, "group_size": group_size}
    out: dict[str, Any] = {"weights": weights}
    if inputs is not None:
        out["input_activations"] = inputs
    return out


def quantization_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """``config.json["quantization_config"]`` from the ``hf_quant_config.json`` dict."""
    q = hf_config["quantization"]
    if q["quant_algo"] == "MIXED_PRECISION":
        by_entry: dict[tuple, list[str]] = {}
        for name, entry in q["quantized_layers"].items():
            by_entry.setdefault(tuple(sorted(entry.items())), []).append(name)
        groups = {}
        for i, (key, names) in enumerate(by_entry.items()):
            entry = dict(key)
            groups[f"group_{i}"] = {**_group(entry["quant_algo"], entry.get("group_size")), "targets": names}
    else:
        groups = {"group_0": {**_group(q["quant_algo"], q.get("group_size")), "targets": ["Linear"]}}
    out: dict[str, Any] = {
        "quant_method": QUANT_METHOD,
        "quant_algo": q["quant_algo"],
        "config_groups": groups,
    }
    for key in ("group_size", "quantized_layers"):
        if key in q:
            out[key] = q[key]
    out["ignore"] = list(q["exclude_modules"])
    if q.get("kv_cache_quant_algo"):
        out["kv_cache_quant_algo"] = q["kv_cache_quant_algo"]
        fp8 = q["kv_cache_quant_algo"] == "FP8"  # the others by name, as the reference writes them
        out["kv_cache_scheme"] = {**_FLOAT, "num_bits": 8} if fp8 else q["kv_cache_quant_algo"]
    out["producer"] = dict(hf_config["producer"])
    return out


def validate_hf_quant_config(data: Any, source: str) -> dict[str, Any]:
    """Check the keys a loader relies on; raise ``ValueError`` naming the file and the problem."""
    if not isinstance(data, dict) or not isinstance(data.get("quantization"), dict):
        raise ValueError(f"{source}: expected a JSON object with a 'quantization' object (modelopt export)")
    q = data["quantization"]
    algo = q.get("quant_algo")
    if not isinstance(algo, str):
        raise ValueError(f"{source}: quantization.quant_algo is missing or not a string (got {algo!r})")
    if algo == "MIXED_PRECISION" and not isinstance(q.get("quantized_layers"), dict):
        raise ValueError(f"{source}: quant_algo MIXED_PRECISION needs a quantization.quantized_layers object")
    if not isinstance(q.get("exclude_modules", []), list):
        raise ValueError(f"{source}: quantization.exclude_modules must be a list of module names")
    return data
