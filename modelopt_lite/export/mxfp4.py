"""GPT-OSS's own checkpoint layout for fused experts with MXFP4 weights (``quant_method: "mxfp4"``), which
transformers' MXFP4 loader reads (``from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))``
on CPU, its kernels on GPU).

Per experts module and projection (``gate_up_proj``, ``down_proj``), whatever the storage layout:

* ``<proj>_blocks`` uint8 ``(experts, out, in / 32, 16)``: the E2M1 codes of each expert's ``(out, in)``
  weight, two per byte (even element in the low nibble), 32 elements (16 bytes) per block;
* ``<proj>_scales`` uint8 ``(experts, out, in / 32)``: each block's E8M0 exponent byte (``exponent + 127``);
* ``<proj>_bias`` as stored, in the export dtype.

Everything else (attention, router, embeddings, norms, ``lm_head``) is stored unquantized, as GPT-OSS ships
it, and listed in ``quantization_config.modules_to_not_convert``. The codes and exponents are those of the
fake quantization (``modelopt_lite.formats.mx``), so the loaded weights equal the fake-quantized ones.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from ..formats.mx import mx_scale_exponent
from ..formats.nvfp4 import pack_e2m1
from ..logging import get_logger
from ..moe import QuantExperts
from ..nn import TensorQuantizer, iter_quantizers
from .layers import UnsupportedFormatError
from .shards import ShardWriter, _check_target, _move_into_place, parse_size, umask
from .writer import _excluded

__all__ = ["MXFP4_BLOCK", "export_gpt_oss_mxfp4", "mxfp4_experts_tensors"]

logger = get_logger(__name__)
MXFP4_BLOCK = 32


def _is_mxfp4(q: object) -> bool:
    return (
        isinstance(q, TensorQuantizer)
        and q.is_enabled
        and q.spec.kind == "mx"
        and q.spec.num_bits == (2, 1)
        and q.spec.block_axes == ((-1, MXFP4_BLOCK),)
    )


def mxfp4_experts_tensors(name: str, module: QuantExperts) -> dict[str, torch.Tensor]:
    """``<proj>_blocks`` / ``<proj>_scales`` of both projections of ``module``. Raises naming the layer when
    a projection's weights are not all MXFP4 or its input size is not a multiple of the 32-element block."""
    out: dict[str, torch.Tensor] = {}
    for proj in module._projections:
        layer = f"{name}.{proj}"
        quantizers = list(getattr(module, f"{proj}_weight_quantizers"))
        if not all(_is_mxfp4(q) for q in quantizers):
            raise UnsupportedFormatError(
                f"{layer}: every expert's weight quantizer must be MXFP4 (num_bits (2, 1), block 32 along "
                "the input) for the GPT-OSS MXFP4 layout; quantize with MXFP4_MLP_WEIGHT_ONLY_CFG"
            )
        weight = getattr(module, proj).detach()
        per_expert = weight.transpose(1, 2) if module.is_transposed else weight  # (experts, out, in)
        experts, rows, cols = per_expert.shape
        if cols % MXFP4_BLOCK:
            raise UnsupportedFormatError(
                f"{layer}: input size {cols} is not a multiple of the {MXFP4_BLOCK}-element MXFP4 block; "
                "the layout has no padding (keep this layer out of the MXFP4 config)"
            )
        blocks = per_expert.float().reshape(experts, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK)
        exp = mx_scale_exponent(blocks.abs().amax(-1, keepdim=True), (2, 1))
        scaled = blocks / torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)  # exact: a power of 2
        out[f"{layer}_blocks"] = pack_e2m1(scaled)
        out[f"{layer}_scales"] = (exp + 127).to(torch.uint8).squeeze(-1)
    return out


def _check_only_experts(model: nn.Module) -> list[tuple[str, QuantExperts]]:
    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantExperts)]
    if not experts:
        raise UnsupportedFormatError("the model has no quantized fused experts: nothing to write in MXFP4")
    inside = tuple(f"{n}." for n, _ in experts)
    others = [n for n, q in iter_quantizers(model) if q.is_enabled and not n.startswith(inside)]
    inputs = [n for n, q in iter_quantizers(model) if q.is_enabled and n.startswith(inside) and "input" in n]
    if others + inputs:
        raise UnsupportedFormatError(
            "the GPT-OSS MXFP4 layout stores only the experts' weights quantized, but "
            f"{len(others + inputs)} other quantizer(s) are enabled ({', '.join((others + inputs)[:3])}); "
            "quantize with MXFP4_MLP_WEIGHT_ONLY_CFG, or use export_hf_checkpoint"
        )
    return experts


def export_gpt_oss_mxfp4(
    model: nn.Module,
    export_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write ``model`` (GPT-OSS, its experts fake-quantized with MXFP4 weights and nothing else quantized)
    in the layout GPT-OSS ships: ``<experts>.<proj>_blocks`` / ``_scales`` and ``quantization_config
    {"quant_method": "mxfp4", "modules_to_not_convert": [...]}``. ``dtype`` applies to the unquantized
    tensors (default: the model's). Returns the directory."""
    experts = _check_only_experts(model)
    export_dir = Path(export_dir)
    _check_target(export_dir, overwrite)
    export_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{export_dir.name}.", suffix=".tmp", dir=export_dir.parent))
    tmp.chmod(0o777 & ~umask())
    try:
        shards = ShardWriter(tmp, parse_size(max_shard_size))
        replaced = {f"{n}.{p}" for n, m in experts for p in m._projections}
        with torch.no_grad():
            for name, module in experts:
                shards.add(mxfp4_experts_tensors(name, module))
            for key, value in model.state_dict().items():
                if key in replaced or any(p.endswith(("_quantizer", "_quantizers")) for p in key.split(".")):
                    continue
                shards.add(
                    {key: value.to(dtype) if dtype is not None and value.is_floating_point() else value}
                )
        shards.close()
        config = model.config.to_dict()
        quantized = {n: "MXFP4" for n in replaced}
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": _excluded(model, quantized),
        }
        if dtype is not None:
            config["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _move_into_place(tmp, export_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("exported %d experts module(s) in GPT-OSS's MXFP4 layout to %s", len(experts), export_dir)
    return export_dir
