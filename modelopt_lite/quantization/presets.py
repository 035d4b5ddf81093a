"""Preset configs under the names users know from the reference library, as plain list-form dicts (copy
and edit them like the reference's: ``cfg = copy.deepcopy(mtq.INT4_AWQ_CFG); cfg["quant_cfg"].append(...)``).

Every model preset disables all quantizers first, enables weight / input quantizers, then excludes the
layers engines keep in high precision (``lm_head``, routers and gates, vision towers, ...). KV presets hold
only the ``*[kv]_bmm_quantizer`` rule; merge one into a model preset with :func:`with_kv_cache`.
"""

from __future__ import annotations

import copy
from typing import Any

from .config import QuantizeConfig

__all__ = ["KV_PRESETS", "PRESETS", "STANDARD_EXCLUSIONS", "get_preset", "with_kv_cache"]

_NVFP4 = {
    "num_bits": (2, 1),
    "effective_bits": 4.5,
    "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)},
}
_FP8 = {"num_bits": (4, 3), "axis": None}
_INT4_BLOCK = {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}}


def _mx(bits: Any) -> dict[str, Any]:
    return {"num_bits": bits, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}


_EXCLUDED_PATTERNS = (
    "*block_sparse_moe.gate*", "*linear_attn.conv1d*", "*self_attention.conv1d*", "*linear_attn.in_proj_a*",
    "*linear_attn.in_proj_b*", "*lm_head*", "*mixer.conv1d*", "*mlp.gate.*", "*mlp.shared_expert_gate.*",
    "*output_layer*", "*proj_out.*", "*router*", "mtp.*", "output.*", "*embed_vision*", "*vision_tower*",
    "*visual*", "*vision_model*", "*multi_modal_projector*",
)  # fmt: skip
_EXCLUDED_PARENTS = ("nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d", "nn.LeakyReLU", "nn.Embedding")

#: Layers engines keep in high precision. These rules may match nothing in a given model without a warning.
STANDARD_EXCLUSIONS: tuple[dict[str, Any], ...] = tuple(
    [{"quantizer_name": p, "enable": False} for p in _EXCLUDED_PATTERNS]
    + [{"quantizer_name": "*", "parent_class": c, "enable": False} for c in _EXCLUDED_PARENTS]
)


def _model(weight: Any, inputs: Any = None, algorithm: Any = "max") -> dict[str, Any]:
    rules: list[dict[str, Any]] = [{"quantizer_name": "*", "enable": False}]
    rules.append({"quantizer_name": "*weight_quantizer", "cfg": weight})
    if inputs is None:
        rules.append({"quantizer_name": "*input_quantizer", "enable": False})
    elif inputs != "absent":
        rules.append({"quantizer_name": "*input_quantizer", "cfg": inputs})
    return {"quant_cfg": rules + copy.deepcopy(list(STANDARD_EXCLUSIONS)), "algorithm": algorithm}


PRESETS: dict[str, dict[str, Any]] = {
    "FP8_DEFAULT_CFG": _model(_FP8, _FP8),
    "FP8_PER_CHANNEL_PER_TOKEN_CFG": _model(
        {"num_bits": (4, 3), "axis": 0},
        {"num_bits": (4, 3), "axis": None, "type": "dynamic", "block_sizes": {-1: None}},
    ),
    "INT8_DEFAULT_CFG": _model({"num_bits": 8, "axis": 0}, {"num_bits": 8, "axis": None}),
    "INT8_SMOOTHQUANT_CFG": _model({"num_bits": 8, "axis": 0}, {"num_bits": 8, "axis": None}, "smoothquant"),
    "INT8_WEIGHT_ONLY_CFG": _model({"num_bits": 8, "axis": 0}),
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG": _model(_INT4_BLOCK),
    "INT4_AWQ_CFG": _model(_INT4_BLOCK, None, {"method": "awq_lite", "alpha_step": 0.1}),
    "W4A8_AWQ_BETA_CFG": _model([_INT4_BLOCK, _FP8], _FP8, "awq_lite"),
    "NVFP4_DEFAULT_CFG": _model(_NVFP4, _NVFP4),
    "NVFP4_AWQ_LITE_CFG": _model(_NVFP4, _NVFP4, "awq_lite"),
    "W4A16_NVFP4_CFG": _model(_NVFP4, "absent"),
    "MXFP8_DEFAULT_CFG": _model(_mx((4, 3)), _mx((4, 3)), None),
    "MXFP6_DEFAULT_CFG": _model(_mx((3, 2)), _mx((3, 2)), None),
    "MXFP4_DEFAULT_CFG": _model(_mx((2, 1)), _mx((2, 1)), None),
    "MXINT8_DEFAULT_CFG": _model(_mx(8), _mx(8), None),
}

KV_PRESETS: dict[str, dict[str, Any]] = {
    "FP8_KV_CFG": {"quant_cfg": [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": dict(_FP8)}]},
    "NVFP4_KV_CFG": {"quant_cfg": [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": copy.deepcopy(_NVFP4)}]},
}


def get_preset(name: str) -> dict[str, Any]:
    """A deep copy of the preset ``name`` (model or KV preset); unknown names list the available ones."""
    table = {**PRESETS, **KV_PRESETS}
    if name not in table:
        raise ValueError(f"unknown preset {name!r}; available presets: {sorted(table)}")
    return copy.deepcopy(table[name])


def with_kv_cache(config: dict[str, Any], kv_config: dict[str, Any] | str) -> dict[str, Any]:
    """A copy of the model config ``config`` with the KV-cache rules of ``kv_config`` (a KV preset dict or
    name) appended, so they win over the model config's ``"*"`` rule. A model config without calibration
    (``"algorithm": None``, the MX presets) gets ``"max"`` when the KV format needs a calibrated amax."""
    kv = get_preset(kv_config) if isinstance(kv_config, str) else kv_config
    model_cfg = QuantizeConfig.from_dict(config)
    kv_cfg = QuantizeConfig.from_dict({"quant_cfg": kv["quant_cfg"]})
    for rule in kv_cfg.quant_cfg:
        if "bmm_quantizer" not in rule.quantizer_name:
            raise ValueError(
                f"{rule.quantizer_name!r} is not a KV-cache rule (expected *_bmm_quantizer patterns)"
            )
    merged = model_cfg.with_rules(*kv_cfg.quant_cfg)
    if merged.algorithm is None and any(a.enable and a.spec().needs_amax for r in kv_cfg.quant_cfg
                                        for a in r.attributes() or ()):  # fmt: skip
        merged = merged.with_rules(algorithm="max")  # MX presets calibrate nothing; a static KV format must
    return merged.to_dict()
