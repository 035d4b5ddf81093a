"""``export_hf_checkpoint``: a quantized model as a deployable Hugging Face checkpoint (``quant_method:
"modelopt"``): real quantized tensors in (sharded) safetensors, ``config.json`` with ``quantization_config``,
``hf_quant_config.json``, the tokenizer when given. Everything is written into a temporary sibling directory,
verified, and renamed into place, so a failed export leaves nothing behind.

The tensors are produced one module at a time, in state-dict order, and written as they come
(:class:`~.shards.ShardWriter`): the export holds one module's tensors and one output shard, never the
whole model. On an FSDP2-sharded model every rank calls the export: each quantized module is gathered
through a :func:`~modelopt_lite.distributed.weight_access` window, every other sharded tensor (embeddings,
norms, ``lm_head``) by ``DTensor.full_tensor()``, one at a time; every rank computes, rank 0 writes, and
all ranks agree after each step, so an error on one rank raises on all of them instead of hanging."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..distributed import (
    all_ranks_succeed,
    broadcast_json,
    is_distributed,
    is_sharded,
    naming_lost_rank,
    rank,
    unsharded_class,
    weight_access,
)
from ..logging import get_logger
from ..nn import iter_quantizers
from ..nn.errors import UnsupportedFeatureError
from ..nn.lora import is_peft_model
from ..quantization.compress.packers import INPUT_SCALE_BOUND, get_packer, scale_of_amax
from .hf_config import hf_quant_config, quantization_config
from .layers import ExportLayer, ExportModule, export_plan, foldable_norms, kv_layers, unify_shared_scales
from .lora import export_with_adapters
from .shards import ShardWriter, _check_target, _move_into_place, parse_size, staging_dir
from .verify import verify_export

__all__ = ["ExportResult", "export_hf_checkpoint", "parse_size"]

logger = get_logger(__name__)


@dataclass
class ExportResult:
    """What was written: the directory, the files, and the facts that ``hf_quant_config.json`` holds."""

    export_dir: Path
    files: list[str]
    hf_quant_config: dict[str, Any]
    quantized_layers: dict[str, str]  # hub name -> quant_algo
    total_bytes: int
    ratios: dict[str, float] = field(default_factory=dict)  # quant_algo -> bytes on disk / bf16 bytes


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
    return scale_of_amax(iq.amax.reshape(()), INPUT_SCALE_BOUND[iq.spec.kind])


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


def _together(what: str, collective: bool) -> AbstractContextManager[None]:
    """Under FSDP2, a block every rank finishes before any goes on (see ``all_ranks_succeed``)."""
    return all_ranks_succeed(what) if collective else nullcontext()


def _plan(model: nn.Module) -> tuple[list[ExportModule], dict[str, str], dict[str, int | None]]:
    """The modules to write, ``{hub name: quant_algo}`` and ``{quant_algo: group size}``; reads no weight."""
    plan = export_plan(model)
    quantized: dict[str, str] = {}
    groups: dict[str, int | None] = {}
    for m in plan:
        for names, algo, wq in m.formats():
            if algo is not None:
                quantized.update(dict.fromkeys(names, algo))
                groups[algo] = get_packer(algo).group_size(wq)
    if not quantized:
        raise ValueError(
            "the model has quantizers but no enabled weight quantizer: nothing would be stored quantized. "
            "Check the config's rules (mtq.print_quant_summary(model))"
        )
    return plan, quantized, groups


def _ident(value: torch.Tensor) -> tuple:
    """What tied tensors share: the parameter itself under FSDP2 (the same on every rank), else storage."""
    if hasattr(value, "full_tensor") or value.is_meta:  # DTensor, or offloaded by accelerate
        return ("param", id(value))
    return (value.data_ptr(), value.shape, value.stride(), value.dtype)


def _stream_tensors(
    model: nn.Module,
    plan: list[ExportModule],
    norms: dict[str, tuple[torch.Tensor, list[str]]],
    kv_attention: list[tuple[str, nn.Module]],
    dtype: torch.dtype | None,
    emit: Callable[[dict[str, torch.Tensor]], None],
    collective: bool,
) -> None:
    """Produce the checkpoint's tensors unit by unit (one planned module, or one other state-dict tensor)
    in state-dict order and pass each unit's tensors to ``emit``; KV-cache scales come last."""
    folded = {name for _, names in norms.values() for name in names}
    norm_scales = {f"{n}.{part}": scale for n, (scale, _) in norms.items() for part in ("weight", "bias")}
    model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    owners = {key: m for m in plan for key in m.replaced}
    pending = {id(m): m for m in plan}
    seen: dict[tuple, str] = {}

    def write_module(m: ExportModule) -> None:
        with _together(f"export: {m.name}", collective):
            with weight_access(m.module):  # full weights under FSDP2 (a collective)
                tensors: dict[str, torch.Tensor] = {}
                for layer in m.layers():
                    tensors.update(_layer_tensors(layer, folded, dtype or model_dtype))
            emit(tensors)

    state = model.state_dict(keep_vars=True)  # under FSDP2: the shards (DTensors), nothing gathered
    show = rank() == 0 and logger.isEnabledFor(logging.INFO)
    for key, value in tqdm(state.items(), desc="export: packing", disable=not show, leave=False):
        if _is_quantizer_key(key):
            continue
        owner = owners.get(key)
        if owner is not None:
            if pending.pop(id(owner), None) is not None:
                write_module(owner)
            continue
        ident = _ident(value)
        if value.numel() and ident in seen:  # tied weights: transformers re-ties them from the config
            logger.debug("export: %s is tied to %s; written once", key, seen[ident])
            continue
        seen[ident] = key
        with _together(f"export: {key}", collective):
            t = value.full_tensor() if hasattr(value, "full_tensor") else value  # gathered (a collective)
            if t.is_meta:  # offloaded to CPU / disk by accelerate: read through its hook
                owner, _, leaf = key.rpartition(".")
                with weight_access(model.get_submodule(owner)) as module:
                    t = getattr(module, leaf)
            t = t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t.detach()
            if key in norm_scales:
                t = (t.float() * norm_scales[key].to(t.device)).to(t.dtype)
            emit({key: t})
    for m in plan:  # modules whose keys a state-dict hook renamed: written all the same
        if pending.pop(id(m), None) is not None:
            write_module(m)
    kv = {}
    for name, attn in kv_attention:  # amax / 448 for FP8 and NVFP4 KV alike, as the reference writes it
        for x in "kv":
            q = getattr(attn, f"{x}_bmm_quantizer")
            kv[f"{name}.{x}_proj.{x}_scale"] = scale_of_amax(q.amax.reshape(()), 448.0)
            if q.bias_value is not None:  # an affine KV cache: the bias as the reference writes it
                kv[f"{name}.{x}_proj.{x}_bias"] = q.bias_value.to(dtype or model_dtype)
    if kv:
        with _together("export: KV-cache scales", collective):
            emit(kv)


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


def _dir_and_dtype(args: tuple[Any, ...], export_dir: Any, dtype: Any) -> tuple[Path, torch.dtype | None]:
    """``(export_dir, dtype)`` from positional arguments in our order ``(export_dir, dtype)`` or the
    reference's ``(dtype, export_dir)`` (a ``torch.dtype`` / ``None`` is the dtype, anything else the
    directory) and the keywords."""
    if len(args) > 2:
        raise TypeError(
            "export_hf_checkpoint takes at most two positional arguments after the model (export_dir and "
            "dtype, "
            "in either order); pass the others by keyword"
        )
    if len(args) == 2 and sum(a is None or isinstance(a, torch.dtype) for a in args) != 1:
        raise TypeError(
            f"export_hf_checkpoint(model, {args[0]!r}, {args[1]!r}): expected a directory and a torch.dtype "
            "(or None), in either order"
        )
    for value in args:
        name = "dtype" if value is None or isinstance(value, torch.dtype) else "export_dir"
        if (dtype if name == "dtype" else export_dir) is not None:
            raise TypeError(f"export_hf_checkpoint got {name} both positionally and by keyword")
        dtype, export_dir = (value, export_dir) if name == "dtype" else (dtype, value)
    if export_dir is None:
        raise TypeError(
            "export_hf_checkpoint needs export_dir (the reference's default '/tmp' is not used, as an export "
            "replaces its directory): export_hf_checkpoint(model, 'out/dir') or (model, dtype, 'out/dir')"
        )
    return Path(export_dir), dtype


def export_hf_checkpoint(
    model: nn.Module,
    *args: str | os.PathLike[str] | torch.dtype | None,
    export_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
    tokenizer: Any = None,
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
    verify: bool = True,
    save_modelopt_state: bool = False,
    components: list[str] | None = None,
    extra_state_dict: dict[str, torch.Tensor] | None = None,
) -> ExportResult:
    """Write the quantized ``model`` to ``export_dir`` as a unified Hugging Face checkpoint.

    Called as ``export_hf_checkpoint(model, export_dir, dtype)`` or in the reference library's order,
    ``export_hf_checkpoint(model, dtype, export_dir)``: the types decide (a ``torch.dtype`` or ``None`` is the
    dtype, a path the directory); keywords are unambiguous. The reference's ``save_modelopt_state``,
    ``components`` and ``extra_state_dict`` raise :class:`~modelopt_lite.nn.errors.UnsupportedFeatureError`
    unless left at their defaults.

    ``dtype`` applies to the tensors stored unquantized (embeddings, norms, ``lm_head``, biases); by default
    they keep the model's dtype. Shards are split at ``max_shard_size`` (with a
    ``model.safetensors.index.json``).
    q/k/v and gate/up quantizers are raised to their group's amax first (in place; see
    :func:`~modelopt_lite.export.layers.unify_shared_scales`). With ``verify`` (default) the written files are
    read back and checked (:func:`~modelopt_lite.export.verify.verify_export`) before the directory appears.

    On an FSDP2-sharded model call it on every rank with the same arguments: the weights are gathered one
    module at a time, rank 0 writes, and every rank returns the same :class:`ExportResult`. (A model that is
    not sharded, e.g. under DDP, is exported by whichever process calls this, with no collective: call it
    from one rank.)
    """
    export_dir, dtype = _dir_and_dtype(args, export_dir, dtype)
    unsupported = {
        "save_modelopt_state": save_modelopt_state,
        "components": components,
        "extra_state_dict": extra_state_dict,
    }
    for what, value in unsupported.items():
        if value:
            raise UnsupportedFeatureError(
                f"export_hf_checkpoint({what}=...) is not supported: the export holds the model's own "
                "tensors; "
                "save the modelopt state with mto.save, or with save_pretrained after "
                "mto.enable_huggingface_checkpointing(); diffusers components are not exported"
            )
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype={dtype!r}: expected a floating torch.dtype such as torch.bfloat16, or None")
    if is_peft_model(model):  # LoRA adapters: merged into the weights, or served beside the base (.lora)
        rest = {"dtype": dtype, "tokenizer": tokenizer, "max_shard_size": max_shard_size, "verify": verify}
        return export_with_adapters(model, export_dir, export_hf_checkpoint, overwrite, **rest)
    max_bytes = parse_size(max_shard_size)
    if not any(True for _ in iter_quantizers(model)):
        raise ValueError(
            "the model is not quantized (it has no quantizers): call "
            "mtq.quantize(model, config, forward_loop) before export_hf_checkpoint"
        )
    collective = is_distributed() and is_sharded(model)  # every rank must call; rank 0 writes
    writes = not collective or rank() == 0
    tmp: Path | None = None
    with _together("export_hf_checkpoint: preparing the directory", collective):
        if writes:
            _check_target(export_dir, overwrite)
            export_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = staging_dir(export_dir)
    try:
        with _together("export_hf_checkpoint: planning", collective):
            plan, quantized, groups = _plan(model)
            kv_attention, kv_algo = kv_layers(model)
            hf_cfg = hf_quant_config(
                {n: (a, groups[a]) for n, a in quantized.items()}, _excluded(model, quantized), kv_algo
            )
            unify_shared_scales(model)
            norms = foldable_norms(model)  # gathers each candidate norm (collectives, the same on every rank)
        if norms:
            first = next(iter(norms))
            logger.info("export: pre_quant_scale folded into %d norm(s) (%s, ...)", len(norms), first)
        shards = ShardWriter(tmp, max_bytes) if tmp is not None else None
        emit = shards.add if shards is not None else (lambda _: None)  # ranks > 0 compute, rank 0 writes
        _stream_tensors(model, plan, norms, kv_attention, dtype, emit, collective)
        facts: dict[str, Any] = {}
        with _together("export_hf_checkpoint: writing the checkpoint", collective):
            if tmp is not None and shards is not None:
                facts = _finish(model, tmp, export_dir, shards, hf_cfg, dtype, tokenizer, verify)
                tmp = None  # moved into place
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if collective:  # (the checkpoint is in place; a rank lost now is still named)
        with naming_lost_rank("export_hf_checkpoint: sharing what was written"):
            facts = broadcast_json(facts)
    summary = ", ".join(f"{a} {r:.3f}x of bf16" for a, r in sorted(facts["ratios"].items()))
    logger.info("exported %d quantized layer(s) to %s (%.2f MB; %s)", len(quantized), export_dir,
                facts["total"] / 1e6, summary or "not verified")  # fmt: skip
    return ExportResult(export_dir, facts["files"], hf_cfg, quantized, facts["total"], facts["ratios"])


def _finish(
    model: nn.Module,
    tmp: Path,
    export_dir: Path,
    shards: ShardWriter,
    hf_cfg: dict[str, Any],
    dtype: torch.dtype | None,
    tokenizer: Any,
    verify: bool,
) -> dict[str, Any]:
    """Close the shards, write the configs (and the tokenizer), verify, move into place."""
    shards.close()
    config = model.config.to_dict()
    config["architectures"] = config.get("architectures") or [unsharded_class(model).__name__]
    config["quantization_config"] = quantization_config(hf_cfg)
    # the dtype of the unquantized tensors written (not whatever config.dtype was left at: a model that was
    # never saved in this process has None there)
    written = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    config["dtype"] = str(written).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (tmp / "hf_quant_config.json").write_text(json.dumps(hf_cfg, indent=4) + "\n")
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    ratios = verify_export(model, tmp) if verify else {}
    _move_into_place(tmp, export_dir)
    total = sum(f.stat().st_size for f in export_dir.iterdir() if f.is_file())
    return {"files": sorted(os.listdir(export_dir)), "total": total, "ratios": ratios}
