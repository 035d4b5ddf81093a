"""Preset configs under the names users know from the reference library, as plain list-form dicts (copy
and edit them like the reference's: ``cfg = copy.deepcopy(mtq.INT4_AWQ_CFG); cfg["quant_cfg"].append(...)``).

Every model preset disables all quantizers first, enables weight / input quantizers, then excludes the
layers engines keep in high precision (``lm_head``, routers and gates, vision towers, ...). KV presets hold
only the ``*[kv]_bmm_quantizer`` rule; merge one into a model preset with :func:`with_kv_cache`.
"""

from __future__ import annotations

import copy
from typing import Any

from .rules import QuantizeConfig

__all__ = [
    "AUTO_QUANTIZE_DISABLED",
    "EXTRA_PRESETS",
    "KV_PRESETS",
    "PRESETS",
    "STANDARD_EXCLUSIONS",
    "get_preset",
    "preset_names",
    "with_kv_cache",
]

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

#: The ``disabled_layers`` of ``mtq.auto_quantize`` in the PTQ command line and ``QATTrainer``: the standard
#: exclusions (routers, gates, convolutions, vision towers) but ``lm_head``, which the reference's ``hf_ptq``
#: searches too.
AUTO_QUANTIZE_DISABLED = [
    r["quantizer_name"]
    for r in STANDARD_EXCLUSIONS
    if "parent_class" not in r and r["quantizer_name"] != "*lm_head*"
]


def _build(rules: list[dict[str, Any]], algorithm: Any, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """``"*"`` disabled, then ``rules``, the standard exclusions and ``extra`` patterns disabled."""
    tail = copy.deepcopy(list(STANDARD_EXCLUSIONS)) + [{"quantizer_name": p, "enable": False} for p in extra]
    return {"quant_cfg": [{"quantizer_name": "*", "enable": False}, *rules, *tail], "algorithm": algorithm}


def _model(
    weight: Any, inputs: Any = None, algorithm: Any = "max", extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    rules: list[dict[str, Any]] = [{"quantizer_name": "*weight_quantizer", "cfg": copy.deepcopy(weight)}]
    if inputs is None:
        rules.append({"quantizer_name": "*input_quantizer", "enable": False})
    elif inputs != "absent":
        rules.append({"quantizer_name": "*input_quantizer", "cfg": copy.deepcopy(inputs)})
    return _build(rules, algorithm, extra)


def _scoped(
    scopes: tuple[str, ...], weight: Any, inputs: Any = None, algorithm: Any = "max"
) -> dict[str, Any]:
    """Only the quantizers under ``scopes`` (``"*mlp*"`` matches ``*mlp*weight_quantizer``, ...)."""
    rules = []
    for scope in scopes:
        rules.append({"quantizer_name": f"{scope}weight_quantizer", "cfg": copy.deepcopy(weight)})
        if inputs is not None:
            rules.append({"quantizer_name": f"{scope}input_quantizer", "cfg": copy.deepcopy(inputs)})
    return _build(rules, algorithm)


def _kv(*rules: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {"quant_cfg": [{"quantizer_name": n, "cfg": copy.deepcopy(c)} for n, c in rules]}


_AFFINE = {"bias": {-2: None, -4: None, "type": "static"}}  # a bias per KV head and channel
_NVFP4_BS32 = {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (4, 3)}}
_NVFP4_STATIC = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}
_MAMBA_EXCLUDED = ("*fc1_latent_proj*", "*fc2_latent_proj*", "*q_proj*", "*k_proj*", "*v_proj*", "*o_proj*",
                   "*self_attention.linear_qkv*", "*self_attention.linear_proj*")  # fmt: skip
_MAMBA_CONSERVATIVE = (*_MAMBA_EXCLUDED, "*mixer.in_proj*", "*mixer.out_proj*")
_MLP = ("*mlp*", "*.mixer.up_proj.", "*.mixer.down_proj.", "*block_sparse_moe*", "*.experts.*")

#: Model presets that quantize every linear layer (but the standard exclusions).
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

#: The reference's other model presets: whole-model ones in further formats and algorithms, presets scoped to
#: some layers (MLP, experts, Mamba-MoE), static NVFP4 block scales (four-over-six, the MSE FP8 sweep), and
#: those whose algorithm this library does not implement (SVDQuant, local Hessian): they exist, and
#: quantizing with them raises :class:`~.rules.UnsupportedFeatureError` (a ``NotImplementedError``) naming
#: what to use.
EXTRA_PRESETS: dict[str, dict[str, Any]] = {
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG": _model(
        {"num_bits": (4, 3), "axis": None, "block_sizes": {-1: 128, -2: 128}}
    ),
    "NVFP4_AWQ_CLIP_CFG": _model(_NVFP4, _NVFP4, {"method": "awq_clip"}),
    "NVFP4_AWQ_FULL_CFG": _model(_NVFP4, _NVFP4, {"method": "awq_full", "alpha_step": 0.1}),
    "W4A8_NVFP4_FP8_CFG": _model(_NVFP4_BS32, _FP8),
    # The reference leaves this one uncalibrated (algorithm None): its FP8 input amax is then taken from each
    # input at run time. Our per-tensor FP8 input quantizers need a calibrated amax, hence "max".
    "W4A8_MXFP4_FP8_CFG": _model(_mx((2, 1)), _FP8, "max"),
    "MAMBA_MOE_FP8_AGGRESSIVE_CFG": _model(_FP8, _FP8, extra=_MAMBA_EXCLUDED),
    "MAMBA_MOE_FP8_CONSERVATIVE_CFG": _model(_FP8, _FP8, extra=_MAMBA_CONSERVATIVE),
    "MAMBA_MOE_NVFP4_AGGRESSIVE_CFG": _model(_NVFP4, _NVFP4, extra=_MAMBA_EXCLUDED),
    "MAMBA_MOE_NVFP4_CONSERVATIVE_CFG": _model(_NVFP4, _NVFP4, extra=_MAMBA_CONSERVATIVE),
    "NVFP4_MLP_ONLY_CFG": _scoped(_MLP, _NVFP4, _NVFP4),
    "NVFP4_OMLP_ONLY_CFG": _scoped(("*o_proj*", *_MLP[:4]), _NVFP4, _NVFP4),
    "NVFP4_EXPERTS_ONLY_CFG": _scoped(_MLP[3:], _NVFP4, _NVFP4),
    "NVFP4_MLP_WEIGHT_ONLY_CFG": _scoped(("*mlp*", "*block_sparse_moe*"), _NVFP4_BS32),
    "MXFP4_MLP_WEIGHT_ONLY_CFG": _scoped(("*mlp*", "*block_sparse_moe*"), _mx((2, 1)), None, None),
    "NVFP4_FOUR_OVER_SIX_CFG": _model(
        {**_NVFP4_STATIC, "block_sizes": {**_NVFP4_STATIC["block_sizes"], "four_over_six": 1}},
        _NVFP4,
        {
            "method": "mse",
            "fp8_scale_sweep": False,
            "start_multiplier": 1.0,
            "stop_multiplier": 1.5,
            "step_size": 0.5,
        },
    ),
    "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG": _model(
        _NVFP4_STATIC, _NVFP4, {"method": "mse", "fp8_scale_sweep": True}
    ),
    "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG": _model(
        _NVFP4_STATIC, _NVFP4, {"method": "local_hessian", "fp8_scale_sweep": True}
    ),
    "NVFP4_SVDQUANT_DEFAULT_CFG": _model(_NVFP4, _NVFP4, {"method": "svdquant", "lowrank": 32}),
    # Diffusion-model attention (q / k / v, softmax and p BMM quantizers), without the standard exclusions.
    "NVFP4_FP8_MHA_CONFIG": {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": copy.deepcopy(_NVFP4)},
            {"quantizer_name": "*input_quantizer", "cfg": copy.deepcopy(_NVFP4)},
            {"quantizer_name": "*output_quantizer", "enable": False},
            *[
                {"quantizer_name": n, "cfg": dict(_FP8)}
                for n in (
                    "*[qkv]_bmm_quantizer",
                    "*softmax_quantizer",
                    "*p_bmm_quantizer",
                    "transformer_blocks*bmm2_output_quantizer",
                )
            ],
        ],
        "algorithm": "max",
    },
}

KV_PRESETS: dict[str, dict[str, Any]] = {
    "FP8_KV_CFG": _kv(("*[kv]_bmm_quantizer", _FP8)),
    "NVFP4_KV_CFG": _kv(("*[kv]_bmm_quantizer", _NVFP4)),
    "FP8_AFFINE_KV_CFG": _kv(("*[kv]_bmm_quantizer", _FP8), ("*[kv]_bmm_quantizer", {**_FP8, **_AFFINE})),
    "NVFP4_AFFINE_KV_CFG": _kv(
        ("*[kv]_bmm_quantizer", _NVFP4), ("*[kv]_bmm_quantizer", {**_NVFP4, **_AFFINE})
    ),
    "NVFP4_KV_ROTATE_CFG": {
        "quant_cfg": [
            {"quantizer_name": "*q_bmm_quantizer", "cfg": {"rotate": True}, "enable": False},
            {"quantizer_name": "*k_bmm_quantizer", "cfg": {**_NVFP4, "rotate": True}},
            {"quantizer_name": "*v_bmm_quantizer", "cfg": copy.deepcopy(_NVFP4)},
        ],
        "algorithm": "max",
    },
}


def preset_names() -> list[str]:
    """Every preset name (model, extra and KV presets), sorted."""
    return sorted({**PRESETS, **EXTRA_PRESETS, **KV_PRESETS})


def get_preset(name: str) -> dict[str, Any]:
    """A deep copy of the preset ``name`` (model or KV preset); unknown names list the available ones."""
    table = {**PRESETS, **EXTRA_PRESETS, **KV_PRESETS}
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
