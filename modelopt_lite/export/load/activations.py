"""The loader's ``activations="fake"`` option: after the weights load (dequantized or kept packed), every
quantized linear map gets back the activation fake quantization its format prescribes, and an exported KV
cache its K / V fake quantization, from the scales the checkpoint stores.

Each layer's ``input_quantizer`` (a :class:`~modelopt_lite.nn.TensorQuantizer`, the module made a
:class:`~modelopt_lite.nn.QuantLinear` with its weight quantizer off where it was a plain linear layer) takes
the input rule of the preset that defines the format (:data:`INPUT_PRESETS`), and a static amax from the
stored scale: ``input_scale * 448`` (FP8, the FP8 stage of W4A8_AWQ), ``input_scale * 127`` (W8A8),
``input_scale * 6 * 448`` (the NVFP4 per-tensor global amax; the 16-element block scales stay dynamic).
Formats whose activation scales are dynamic (MXFP8, FP8 per token) store none and need none. A
``pre_quant_scale`` the export could not fold into a norm scales the quantizer's input instead of the
weight's columns (the fake-quant layer's order). Fused MoE experts get one input quantizer per projection,
as quantized experts have. The KV cache (``k_scale`` / ``v_scale`` on ``k_proj`` / ``v_proj``; FP8 and NVFP4
alike store ``amax / 448``; an affine cache's ``k_bias`` / ``v_bias``) goes to the attention module's
``k_bmm_quantizer`` / ``v_bmm_quantizer``, with the attention implementation that runs them.

The fake quantization is the quantizers' own; the only difference from the exported fake-quant model is
the amax recovered from the stored scale (``amax / max`` then ``* max`` in float32), which may differ from
the calibrated one by an ulp.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ...logging import get_logger
from ...moe import QuantExperts
from ...nn import QUANT_MODULES, QuantLinear, TensorQuantizer
from ...nn.kv_attention import QuantAttention, kv_attention_name
from ...nn.quantizer.attribute_dict import quantizer_attributes
from ...quantization.compress.packers import INPUT_SCALE_BOUND
from ...quantization.config.presets import KV_PRESETS, PRESETS
from ...quantization.insertion import use_experts_implementation
from .packed import _read_tensors, _stored_meta

__all__ = ["ACTIVATIONS", "INPUT_PRESETS", "KV_CACHE_PRESETS", "plan_activations", "quantize_activations"]

logger = get_logger(__name__)

#: the loader's ``activations`` values: ``"dense"`` (the stored activation scales are not used) or ``"fake"``
ACTIVATIONS = ("dense", "fake")
#: quant_algo -> the preset whose ``*input_quantizer`` rule is the format's activation quantization
INPUT_PRESETS = {
    "FP8": "FP8_DEFAULT_CFG",
    "FP8_PER_CHANNEL_PER_TOKEN": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "W8A8_SQ_PER_CHANNEL": "INT8_SMOOTHQUANT_CFG",
    "W8A16": "INT8_WEIGHT_ONLY_CFG",
    "W4A16_AWQ": "INT4_AWQ_CFG",
    "W4A8_AWQ": "W4A8_AWQ_BETA_CFG",
    "NVFP4": "NVFP4_DEFAULT_CFG",
    "NVFP4_AWQ": "NVFP4_AWQ_LITE_CFG",
    "W4A16_NVFP4": "W4A16_NVFP4_CFG",
    "MXFP8": "MXFP8_DEFAULT_CFG",
}
#: (kv_cache_quant_algo, affine: k_bias / v_bias stored) -> the KV preset the export recognised as it
KV_CACHE_PRESETS = {
    ("FP8", False): "FP8_KV_CFG",
    ("FP8", True): "FP8_AFFINE_KV_CFG",
    ("NVFP4", False): "NVFP4_KV_CFG",
    ("NVFP4_AFFINE", True): "NVFP4_AFFINE_KV_CFG",
}
_KV_MAX = 448.0  # k_scale / v_scale = amax / 448, FP8 and NVFP4 KV caches alike


def _last_cfg(preset: dict[str, Any], names: Iterable[str]) -> dict[str, Any] | None:
    """The attributes of the preset's last rule for one of ``names`` (``None``: disabled or absent)."""
    found: dict[str, Any] | None = None
    for rule in preset["quant_cfg"]:
        if rule.get("quantizer_name") in names:
            found = None if rule.get("enable", True) is False or "cfg" not in rule else rule["cfg"]
    return copy.deepcopy(found)


def input_cfg(algo: str) -> dict[str, Any] | None:
    """The input quantizer attributes of ``algo`` (``None``: a weight-only format); a format not listed in
    :data:`INPUT_PRESETS` raises, naming it."""
    preset = INPUT_PRESETS.get(algo)
    if preset is None:
        raise ValueError(
            f"activations='fake': the activation quantization of quant_algo {algo!r} cannot be rebuilt from "
            f"the checkpoint (formats with a known input quantization: {sorted(INPUT_PRESETS)}); load it "
            "with activations='dense'"
        )
    return _last_cfg(PRESETS[preset], ("*input_quantizer",))


def _configure(
    q: TensorQuantizer, cfg: dict[str, Any], name: str, scale: torch.Tensor | None, bound: float
) -> None:
    """``q`` enabled with the attributes ``cfg`` and, where they need a static amax, ``scale * bound``."""
    q.set_attributes(quantizer_attributes(cfg, True, name))
    q.name = name
    q.enable_quant()
    q.disable_calib()
    if q.spec.needs_amax:
        if scale is None:  # checked by plan_activations
            raise ValueError(f"activations='fake': {name} has no stored scale")
        q.amax = scale.detach().float().reshape(()) * bound


def _input_bound(cfg: dict[str, Any] | None) -> float | None:
    """``max`` of ``input_scale = amax / max`` for these input attributes (``None``: no static scale)."""
    if cfg is None:
        return None
    spec = quantizer_attributes(cfg, True, "input_quantizer").spec()
    return INPUT_SCALE_BOUND[spec.kind] if spec.needs_amax else None


def _planned_format(algo: str | None, where: str, stems: list[str], stored: dict) -> str:
    """``algo`` once its activation quantization is known to be rebuildable from what ``stems`` store."""
    if algo is None:
        raise ValueError(
            f"activations='fake': the checkpoint (MIXED_PRECISION) does not list {where}'s quant_algo; load "
            "with activations='dense'"
        )
    cfg = input_cfg(algo)
    if _input_bound(cfg) is not None:
        missing = [s for s in stems if "input_scale" not in stored[s]]
        if missing:
            raise ValueError(
                f"activations='fake': {algo} quantizes activations with a static per-tensor scale, but "
                f"{', '.join(missing[:4])} store(s) no input_scale; load with activations='dense'"
            )
    return algo


def _is_kind(module: nn.Module | None, cls: type[nn.Module]) -> bool:
    """``module`` is (or converts to) a ``cls`` quantized module."""
    if module is None:
        return False
    wrapper = QUANT_MODULES.wrapper_for(type(module))
    return isinstance(module, cls) or (wrapper is not None and issubclass(wrapper, cls))


def plan_activations(model: nn.Module, config: Any, checkpoint_files: list[str]) -> dict[str, Any]:
    """Check, before the weights load, that the activation quantization of every layer the checkpoint stores
    quantized (and of its KV cache) can be rebuilt: a known format with its static scales stored, on a
    linear layer or fused experts; returns the plan :func:`quantize_activations` applies after loading."""
    stored = _stored_meta(checkpoint_files)
    if not stored:
        raise ValueError(
            "activations='fake' reads input_scale / k_scale / v_scale from the safetensors files, but no "
            f"safetensors checkpoint file was given ({checkpoint_files!r}); load with activations='dense'"
        )
    quantized = {stem for stem, t in stored.items() if "weight_scale" in t}
    modules = dict(model.named_modules())
    plan: dict[str, Any] = {"files": list(checkpoint_files), "linear": {}, "experts": {}, "kv": {}}
    covered: set[str] = set()
    for name, module in modules.items():
        if not _is_kind(module, QuantExperts) or not isinstance(getattr(module, "num_experts", None), int):
            continue
        gated = f"{name}.0.gate_proj" in stored
        layout = {"gate_up_proj" if gated else "up_proj": ("gate_proj", "up_proj") if gated else ("up_proj",)}
        layout["down_proj"] = ("down_proj",)
        for proj, halves in layout.items():
            stems = [f"{name}.{e}.{h}" for e in range(module.num_experts) for h in halves]
            if not any(s in quantized for s in stems):
                continue
            unquantized = [s for s in stems if s not in quantized]
            algos = {config.layer_algo(s) for s in stems}
            if unquantized or len(algos) != 1:
                raise ValueError(
                    f"activations='fake': {name}.{proj} has one input quantizer for all its experts, but the "
                    f"checkpoint stores them in formats {sorted(map(str, algos))}"
                    + (f" and some unquantized ({', '.join(unquantized[:3])})" if unquantized else "")
                    + "; load with activations='dense'"
                )
            algo = _planned_format(algos.pop(), f"{name}.{proj}", stems, stored)
            plan["experts"][f"{name}.{proj}"] = (name, proj, algo, stems)
            covered.update(stems)
    for stem in sorted(quantized - covered):
        module = modules.get(stem)
        if type(module) is not nn.Linear and not isinstance(module, QuantLinear):
            raise ValueError(
                f"activations='fake': {stem} is stored quantized but the model's module there is "
                f"{type(module).__name__}, not a plain linear layer nor a projection of fused MoE experts: "
                "its input quantization cannot be rebuilt; load with activations='dense'"
            )
        plan["linear"][stem] = _planned_format(config.layer_algo(stem), stem, [stem], stored)
    kv_algo = config.kv_cache_quant_algo
    for name, module in modules.items():
        k, v = stored.get(f"{name}.k_proj", {}), stored.get(f"{name}.v_proj", {})
        if "k_scale" not in k and "v_scale" not in v:
            continue
        if "k_scale" not in k or "v_scale" not in v:
            raise ValueError(f"activations='fake': {name} stores only one of k_scale / v_scale")
        if not _is_kind(module, QuantAttention):
            raise ValueError(
                f"activations='fake': the checkpoint stores KV-cache scales for {name}, a "
                f"{type(module).__name__} that does not run attention through transformers' "
                "AttentionInterface, so its KV cache cannot be fake-quantized; load with activations='dense'"
            )
        affine = "k_bias" in k or "v_bias" in v
        preset = KV_CACHE_PRESETS.get((kv_algo, affine))
        if preset is None:
            raise ValueError(
                f"activations='fake': the KV cache of {name} (kv_cache_quant_algo {kv_algo!r}"
                f"{', with k_bias / v_bias' if affine else ''}) cannot be rebuilt (known: "
                f"{sorted(KV_CACHE_PRESETS)}); load with activations='dense'"
            )
        plan["kv"][name] = preset
    return plan


def _one(values: dict[str, torch.Tensor], keys: list[str], where: str) -> torch.Tensor | None:
    """The one value the stored tensors ``keys`` share (``None``: none stored); different values raise."""
    found = [values[k] for k in keys if k in values]
    if not found:
        return None
    if len(found) != len(keys) or not all(torch.equal(f, found[0]) for f in found[1:]):
        raise ValueError(
            f"activations='fake': {where} has one input quantizer, but the checkpoint's "
            f"{keys[0].rpartition('.')[2]} differs between {keys[0]} and the others; load with "
            "activations='dense'"
        )
    return found[0]


def _device(module: nn.Module) -> torch.device:
    """Where the module's weights are (a scale set on its quantizers goes there)."""
    t = next(module.parameters(), None)
    if t is None:
        t = next(module.buffers(), None)
    return torch.device("cpu") if t is None else t.device


def _set_input(
    q: TensorQuantizer, name: str, algo: str, scale: torch.Tensor | None, pqs: torch.Tensor | None
) -> None:
    """The input quantizer of one layer (or experts projection): ``algo``'s activation quantization with the
    stored scale, and an unfolded ``pre_quant_scale``."""
    cfg = input_cfg(algo)
    if cfg is None:  # a weight-only format: the quantizer only applies an unfolded pre_quant_scale
        q.disable()
        q.name = name
    else:
        _configure(q, cfg, name, scale, _input_bound(cfg) or 0.0)
    q.pre_quant_scale = None if pqs is None else pqs.float()


@torch.no_grad()
def quantize_activations(model: nn.Module, plan: dict[str, Any]) -> dict[str, int]:
    """Apply a :func:`plan_activations` plan to the loaded model (in place); returns how many linear layers,
    experts projections and attention modules got their activation / KV quantizers."""
    files = plan["files"]
    keys: set[str] = set()
    for stem in plan["linear"]:
        keys |= {f"{stem}.input_scale", f"{stem}.pre_quant_scale"}
    for *_, stems in plan["experts"].values():
        keys |= {f"{s}.{t}" for s in stems for t in ("input_scale", "pre_quant_scale")}
    for name in plan["kv"]:
        keys |= {f"{name}.{x}_proj.{x}_{t}" for x in "kv" for t in ("scale", "bias")}
    values = _read_tensors(files, keys)

    def stored(module: nn.Module, key: str) -> torch.Tensor | None:
        value = values.get(key)
        return None if value is None else value.to(_device(module))

    for stem, algo in plan["linear"].items():
        module = model.get_submodule(stem)
        if not isinstance(module, QuantLinear):
            QUANT_MODULES.convert(module)
            module.weight_quantizer.disable()
            module.weight_quantizer.name = f"{stem}.weight_quantizer"
        iq = module.input_quantizer
        _set_input(iq, f"{stem}.input_quantizer", algo, stored(module, f"{stem}.input_scale"),
                   stored(module, f"{stem}.pre_quant_scale"))  # fmt: skip
    converted_experts = False
    for where, (name, proj, algo, stems) in plan["experts"].items():
        module = model.get_submodule(name)
        if not isinstance(module, QuantExperts):
            QUANT_MODULES.convert(module)
            for p in module._projections:
                getattr(module, f"{p}_input_quantizer").disable()
                for q in getattr(module, f"{p}_weight_quantizers"):
                    q.disable()
            converted_experts = True
        scale = _one(values, [f"{s}.input_scale" for s in stems], where)
        pqs = _one(values, [f"{s}.pre_quant_scale" for s in stems], where)
        scale, pqs = (None if t is None else t.to(_device(module)) for t in (scale, pqs))
        _set_input(getattr(module, f"{proj}_input_quantizer"), f"{where}_input_quantizer", algo, scale, pqs)
    if converted_experts:
        use_experts_implementation(model)
    for name, preset in plan["kv"].items():
        module = model.get_submodule(name)
        if not isinstance(module, QuantAttention):
            QUANT_MODULES.convert(module)
            module.q_bmm_quantizer.disable()  # (the checkpoint holds no scale for the query)
        cfg = _last_cfg(KV_PRESETS[preset], ("*[kv]_bmm_quantizer",))
        for x in "kv":
            q = getattr(module, f"{x}_bmm_quantizer")
            scale = stored(module, f"{name}.{x}_proj.{x}_scale")
            _configure(q, cfg or {}, f"{name}.{x}_bmm_quantizer", scale, _KV_MAX)
            bias = stored(module, f"{name}.{x}_proj.{x}_bias")
            if bias is not None:
                q.bias_value = bias
    if plan["kv"]:
        config = getattr(model, "config", None)
        current = getattr(config, "_attn_implementation", None)
        target = kv_attention_name(current)
        if target is None:
            raise ValueError(
                f"activations='fake': the model's attention implementation {current!r} would bypass the "
                "KV-cache quantizers; load with attn_implementation='sdpa' or 'eager'"
            )
        if target != current:
            model.set_attn_implementation(target)
    counts = {"linear": len(plan["linear"]), "experts": len(plan["experts"]), "kv": len(plan["kv"])}
    logger.info(
        "activations='fake': input quantizers of %d linear layer(s) and %d fused experts projection(s), "
        "KV-cache quantizers of %d attention module(s) set from the checkpoint's scales",
        counts["linear"], counts["experts"], counts["kv"],
    )  # fmt: skip
    return counts
