"""``export_hf_checkpoint``: a quantized model as a deployable Hugging Face checkpoint (``quant_method:
"modelopt"``): real quantized tensors in (sharded) safetensors, ``config.json`` with ``quantization_config``,
``hf_quant_config.json``, the tokenizer when given. Everything is written into a temporary sibling directory,
verified, and renamed into place, so a failed export leaves nothing behind."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from ..distributed import is_sharded
from ..logging import get_logger, get_rank
from ..nn import iter_quantizers
from .hf_config import hf_quant_config, quantization_config
from .layers import ExportLayer, export_layers, foldable_norms, kv_layers, unify_shared_scales
from .packers import get_packer, scale_of_amax
from .verify import verify_export

__all__ = ["ExportResult", "export_hf_checkpoint", "parse_size"]

logger = get_logger(__name__)
_INPUT_MAX = {"fp8": 448.0, "int": 127.0, "nvfp4": 6.0 * 448.0}  # by FormatSpec.kind
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


@dataclass
class ExportResult:
    """What was written: the directory, the files, and the facts that ``hf_quant_config.json`` holds."""

    export_dir: Path
    files: list[str]
    hf_quant_config: dict[str, Any]
    quantized_layers: dict[str, str]  # hub name -> quant_algo
    total_bytes: int
    ratios: dict[str, float] = field(default_factory=dict)  # quant_algo -> bytes on disk / bf16 bytes


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` / ``"500MiB"``."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = _SIZE.match(str(size)) if isinstance(size, str) else None
    if match is None:
        raise ValueError(f"max_shard_size={size!r}: expected a positive int of bytes or a string like '5GB'")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


def _is_quantizer_key(key: str) -> bool:
    return any(p.endswith(("_quantizer", "_quantizers")) for p in key.split(".")[:-1])


def _input_scale(layer: ExportLayer) -> torch.Tensor | None:
    iq = layer.input_quantizer
    if iq is None or not iq.is_enabled or not iq.spec.needs_amax:
        return None
    if iq.spec.dynamic and iq.spec.kind != "nvfp4":  # per-token / MX: no static scale
        return None
    if iq.amax is None:
        raise RuntimeError(f"{iq.name}: no amax to export; calibrate the model with data before exporting it")
    return scale_of_amax(iq.amax.reshape(()), _INPUT_MAX[iq.spec.kind])


def _layer_tensors(layer: ExportLayer, folded: set[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one linear map, under their full names (the two halves for experts' gate_up)."""
    if layer.quant_algo is None:
        tensors = {"weight": layer.weight.detach().to(dtype)}
    else:
        with torch.no_grad():
            tensors = get_packer(layer.quant_algo).pack(layer.weight.detach(), layer.weight_quantizer)
        scale = _input_scale(layer)
        if scale is not None:
            tensors["input_scale"] = scale
        pqs = layer.input_quantizer.pre_quant_scale if layer.input_quantizer is not None else None
        if pqs is not None and layer.name not in folded:
            tensors["pre_quant_scale"] = pqs.detach().float().clone()
    if layer.bias is not None:
        tensors["bias"] = layer.bias.detach().to(dtype)
    if layer.split is None:
        return {f"{layer.name}.{k}": v for k, v in tensors.items()}
    out = {}
    for half, name in enumerate(layer.split):
        for k, v in tensors.items():
            per_row = v.ndim >= 1 and k not in ("pre_quant_scale",)
            out[f"{name}.{k}"] = (v.chunk(2, dim=0)[half] if per_row else v).clone()  # no shared storage
    return out


def _build_state_dict(model: nn.Module, dtype: torch.dtype | None):
    layers, replaced = export_layers(model)
    if not any(layer.quant_algo for layer in layers):
        raise ValueError(
            "the model has quantizers but no enabled weight quantizer: nothing would be stored quantized. "
            "Check the config's rules (mtq.print_quant_summary(model))"
        )
    unify_shared_scales(model)
    norms = foldable_norms(model)
    folded = {name for _, names in norms.values() for name in names}
    state: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    for key, value in model.state_dict().items():
        if _is_quantizer_key(key) or key in replaced:
            continue
        ident = (value.data_ptr(), value.shape, value.stride(), value.dtype)
        if value.numel() and ident in seen:  # tied weights: transformers re-ties them from the config
            logger.debug("export: %s is tied to %s; written once", key, seen[ident])
            continue
        seen[ident] = key
        state[key] = value.detach().to(dtype) if dtype is not None and value.is_floating_point() else value
    for norm, (scale, _) in norms.items():
        for part in ("weight", "bias"):
            key = f"{norm}.{part}"
            if key in state:
                state[key] = (state[key].float() * scale.to(state[key].device)).to(state[key].dtype)
    model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    quantized: dict[str, str] = {}
    show = get_rank() == 0 and logger.isEnabledFor(logging.INFO)
    for layer in tqdm(layers, desc="export: packing", disable=not show, leave=False):
        tensors = _layer_tensors(layer, folded, dtype or model_dtype)
        state.update(tensors)
        if layer.quant_algo is not None:
            for name in layer.split or (layer.name,):
                quantized[name] = layer.quant_algo
    kv = False
    for name, attn in kv_layers(model):
        kv = True
        state[f"{name}.k_proj.k_scale"] = scale_of_amax(attn.k_bmm_quantizer.amax.reshape(()), 448.0)
        state[f"{name}.v_proj.v_scale"] = scale_of_amax(attn.v_bmm_quantizer.amax.reshape(()), 448.0)
    if norms:
        logger.info("export: pre_quant_scale folded into %d norm(s) (%s, ...)", len(norms), next(iter(norms)))
    groups = {layer.quant_algo: get_packer(layer.quant_algo).group_size(layer.weight_quantizer)
              for layer in layers if layer.quant_algo}  # fmt: skip
    return state, quantized, groups, "FP8" if kv else None


def _excluded(model: nn.Module, quantized: dict[str, str]) -> list[str]:
    """Modules with a 2-D (or larger) weight that is not stored quantized: lm_head, embeddings, routers..."""
    hub_prefixes = tuple(f"{n}." for n in quantized)
    out = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is None or weight.ndim < 2 or name in quantized or name.startswith(hub_prefixes):
            continue
        out.append(name)
    for name, module in model.named_modules():  # fused experts left unquantized
        if hasattr(module, "gate_up_proj_weight_quantizers") or hasattr(module, "up_proj_weight_quantizers"):
            if not any(q.startswith(f"{name}.") for q in quantized):
                out.append(name)
    return out


def _write_shards(state: dict[str, torch.Tensor], tmp: Path, max_bytes: int) -> list[str]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(state):
        t = state[key].detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*names, "model.safetensors.index.json"]


def _check_target(export_dir: Path, overwrite: bool) -> None:
    if export_dir.exists() and not export_dir.is_dir():
        raise FileExistsError(f"export_dir {export_dir} exists and is not a directory")
    if export_dir.is_dir() and any(export_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"export_dir {export_dir} exists and is not empty; choose a new directory or pass overwrite=True "
            "(hf_ptq.py: --overwrite) to replace it"
        )


def _move_into_place(tmp: Path, export_dir: Path) -> None:
    """Rename ``tmp`` to ``export_dir``; an existing (empty or overwritten) directory is moved aside first and
    removed only once the new one is in place."""
    if not export_dir.exists():
        os.replace(tmp, export_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{export_dir.name}.", suffix=".old", dir=export_dir.parent))
    os.replace(export_dir, old / "previous")
    os.replace(tmp, export_dir)
    shutil.rmtree(old, ignore_errors=True)


def export_hf_checkpoint(
    model: nn.Module,
    export_dir: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    tokenizer: Any = None,
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
    verify: bool = True,
) -> ExportResult:
    """Write the quantized ``model`` to ``export_dir`` as a unified Hugging Face checkpoint.

    ``dtype`` applies to the tensors stored unquantized (embeddings, norms, ``lm_head``, biases); by default
    they keep the model's dtype. Shards are split at ``max_shard_size`` (with a
    ``model.safetensors.index.json``).
    q/k/v and gate/up quantizers are raised to their group's amax first (in place; see
    :func:`~modelopt_lite.export.layers.unify_shared_scales`). With ``verify`` (default) the written files are
    read back and checked (:func:`~modelopt_lite.export.verify.verify_export`) before the directory appears.
    """
    export_dir = Path(export_dir)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype={dtype!r}: expected a floating torch.dtype such as torch.bfloat16, or None")
    max_bytes = parse_size(max_shard_size)
    if not any(True for _ in iter_quantizers(model)):
        raise ValueError(
            "the model is not quantized (it has no quantizers): call "
            "mtq.quantize(model, config, forward_loop) before export_hf_checkpoint"
        )
    if is_sharded(model):
        raise NotImplementedError(
            "export_hf_checkpoint on an FSDP2-sharded model is not supported yet: save it with "
            "trainer.save_model (FSDP state_dict_type FULL_STATE_DICT), restore it in one process with "
            "mto.restore(model, directory) and export there"
        )
    _check_target(export_dir, overwrite)
    state, quantized, groups, kv_algo = _build_state_dict(model, dtype)
    hf_cfg = hf_quant_config(
        {n: (a, groups[a]) for n, a in quantized.items()}, _excluded(model, quantized), kv_algo
    )
    export_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{export_dir.name}.", suffix=".tmp", dir=export_dir.parent))
    try:
        _write_shards(state, tmp, max_bytes)
        config = model.config.to_dict()
        config["architectures"] = config.get("architectures") or [type(model).__name__]
        config["quantization_config"] = quantization_config(hf_cfg)
        if dtype is not None:
            config["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "hf_quant_config.json").write_text(json.dumps(hf_cfg, indent=4) + "\n")
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        ratios = verify_export(model, tmp) if verify else {}
        _move_into_place(tmp, export_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(f.stat().st_size for f in export_dir.iterdir() if f.is_file())
    summary = ", ".join(f"{a} {r:.3f}x of bf16" for a, r in sorted(ratios.items()))
    logger.info("exported %d quantized layer(s) to %s (%.2f MB; %s)", len(quantized), export_dir, total / 1e6,
                summary or "not verified")  # fmt: skip
    return ExportResult(export_dir, sorted(os.listdir(export_dir)), hf_cfg, quantized, total, ratios)
