"""Post-export verification: read the written checkpoint back and check it against the model's quantizers.

* every enabled weight quantizer's layer is stored quantized (its format's dtype and exact packed size),
  every enabled static input quantizer has its ``input_scale``, every KV quantizer (FP8, NVFP4) its
  ``k_scale`` / ``v_scale`` (and ``k_bias`` / ``v_bias`` when affine) and a ``kv_cache_quant_algo``;
* the on-disk size of the quantized layers (weight and weight scales) is what the format implies
  (e.g. NVFP4 about 0.28x of bf16);
* no scale is NaN, inf or zero (an E8M0 scale byte is never 255, its NaN).

The expectations come from the model's quantizers (``iter_quantizers``), not from the writer's own plan, so
a layer the writer skipped or wrote in high precision is caught. Any mismatch raises
:class:`ExportVerificationError` naming the layers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ..nn import iter_quantizers
from ..quantization.compress.packers import get_packer

__all__ = ["ExportVerificationError", "read_checkpoint", "verify_export"]

_SCALES = ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale", "pre_quant_scale")
_EXPERT = re.compile(r"^(.*)\.(gate_up_proj|up_proj|down_proj)_(weight_quantizers\.(\d+)|input_quantizer)$")
_HALVES = {"gate_up_proj": ("gate_proj", "up_proj"), "up_proj": ("up_proj",), "down_proj": ("down_proj",)}
_SLACK = 1.25  # layers smaller than a block (tiny models) carry relatively more scale bytes


class ExportVerificationError(RuntimeError):
    """The written checkpoint does not hold what the model's quantizers ask for."""


def read_checkpoint(directory: Path) -> dict[str, str]:
    """``{tensor name: file}`` of a single-file or sharded safetensors checkpoint."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = directory / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{directory}: neither model.safetensors nor model.safetensors.index.json")
    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), "model.safetensors")


def _expected(model: nn.Module) -> tuple[dict[str, tuple[int, int]], set[str]]:
    """``({layer: (out, in)} of quantized weights, {names of scalar scales that must exist})``."""
    layers: dict[str, tuple[int, int]] = {}
    scales: set[str] = set()
    for name, q in iter_quantizers(model):
        if not q.is_enabled:
            continue
        owner, _, slot = name.rpartition(".")
        match = _EXPERT.match(name)
        if match:
            experts = model.get_submodule(match.group(1))
            proj = match.group(2)
            ids = [int(match.group(4))] if match.group(4) is not None else range(experts.num_experts)
            shape = tuple(getattr(experts, proj).shape[1:])  # the shape alone: no indexing into a shard
            out_f, in_f = shape[::-1] if experts.is_transposed else shape
            for e in ids:
                for hub in _HALVES[proj]:
                    prefix = f"{match.group(1)}.{e}.{hub}"
                    if match.group(4) is not None:
                        layers[prefix] = (out_f // len(_HALVES[proj]), in_f)
                    elif q.spec.needs_amax and (not q.spec.dynamic or q.spec.kind == "nvfp4"):
                        scales.add(f"{prefix}.input_scale")
        elif slot == "weight_quantizer":
            layers[owner] = tuple(model.get_submodule(owner)._weight_view().shape)  # type: ignore[assignment]
        elif (
            slot == "input_quantizer" and q.spec.needs_amax and (not q.spec.dynamic or q.spec.kind == "nvfp4")
        ):
            if model.get_submodule(owner).weight_quantizer.is_enabled:
                scales.add(f"{owner}.input_scale")
        elif slot in ("k_bmm_quantizer", "v_bmm_quantizer"):
            scales.add(f"{owner}.{slot[0]}_proj.{slot[0]}_scale")
            if q.bias_value is not None:  # an affine KV cache
                scales.add(f"{owner}.{slot[0]}_proj.{slot[0]}_bias")
    return layers, scales


def _layer_algo(quantization: dict[str, Any], layer: str) -> str | None:
    if quantization.get("quant_algo") == "MIXED_PRECISION":
        entry = quantization.get("quantized_layers", {}).get(layer)
        return entry["quant_algo"] if entry else None
    return None if layer in quantization.get("exclude_modules", []) else quantization.get("quant_algo")


def _bad_scale(t: torch.Tensor) -> bool:
    if t.dtype == torch.uint8:  # E8M0 exponent bytes
        return bool((t == 255).any())
    t = t.float()
    return not bool(torch.isfinite(t).all()) or bool((t == 0).any())


def verify_export(model: nn.Module, directory: Path) -> dict[str, float]:
    """Check the checkpoint in ``directory``; returns ``{quant_algo: on-disk bytes / bf16 bytes}``."""
    weight_map = read_checkpoint(directory)
    quantization = json.loads((directory / "hf_quant_config.json").read_text())["quantization"]
    layers, scales = _expected(model)
    handles = {f: safe_open(str(directory / f), "pt") for f in set(weight_map.values())}

    def meta(key: str) -> tuple[str, list[int]]:
        s = handles[weight_map[key]].get_slice(key)
        return s.get_dtype(), list(s.get_shape())

    problems: list[str] = []
    sizes: dict[str, list[int]] = {}
    for layer, (out_f, in_f) in sorted(layers.items()):
        algo = _layer_algo(quantization, layer)
        key = f"{layer}.weight"
        if algo is None or key not in weight_map:
            problems.append(
                f"{layer}: its weight quantizer is enabled but hf_quant_config lists no format for it"
            )
            continue
        packer = get_packer(algo)
        dtype, shape = meta(key)
        want = str(packer.weight_dtype).removeprefix("torch.")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=_torch_dtype(dtype)).element_size()
        if _dtype_name(dtype) != want or nbytes * 8 != out_f * in_f * packer.weight_bits:
            problems.append(
                f"{layer}: stored as {dtype} {shape}, expected {algo} ({want}, {packer.weight_bits} bits)"
            )
            continue
        for part in ("weight_scale", "weight_scale_2"):
            if f"{layer}.{part}" in weight_map:
                d, s = meta(f"{layer}.{part}")
                nbytes += torch.Size(s).numel() * torch.empty((), dtype=_torch_dtype(d)).element_size()
        if f"{layer}.weight_scale" not in weight_map:
            problems.append(f"{layer}: {algo} weight without weight_scale")
        size = sizes.setdefault(algo, [0, 0])
        size[0] += nbytes
        size[1] += out_f * in_f * 2
    problems += [f"{name}: missing" for name in sorted(scales) if name not in weight_map]
    kv = sorted(n for n in scales if n.endswith(("k_scale", "v_scale")))
    if kv and not quantization.get("kv_cache_quant_algo"):
        problems.append(f"{kv[0]} (and {len(kv) - 1} more): KV quantizers, but no kv_cache_quant_algo")
    for key in sorted(k for k in weight_map if k.rpartition(".")[2] in _SCALES):
        if _bad_scale(handles[weight_map[key]].get_tensor(key)):
            problems.append(f"{key}: NaN, inf or zero scale")
    ratios = {algo: b / ref for algo, (b, ref) in sizes.items()}
    for algo, ratio in ratios.items():
        packer = get_packer(algo)
        if not packer.weight_bits / 16 <= ratio <= packer.nominal_bits / 16 * _SLACK:
            problems.append(
                f"{algo} layers: {ratio:.3f}x of bf16 on disk, expected about {packer.nominal_bits / 16:.3f}x"
            )
    if problems:
        shown = "\n  ".join(problems[:25]) + (
            f"\n  ... and {len(problems) - 25} more" if len(problems) > 25 else ""
        )
        raise ExportVerificationError(
            f"post-export verification failed ({len(problems)} problem(s)):\n  {shown}"
        )
    return ratios


def _dtype_name(safetensors_dtype: str) -> str:
    return str(_torch_dtype(safetensors_dtype)).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    table = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8,
             "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
             "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}  # fmt: skip
    if name not in table:
        raise ValueError(f"unexpected safetensors dtype {name!r}")
    return table[name]
