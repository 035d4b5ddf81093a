"""``mtq.compress``: real low-bit weights in memory, after ``mtq.quantize`` or QAT (docs/compress.md).

Each quantized linear layer keeps its weight as the packer's tensors (:mod:`.packers`, the tensors an export
writes: ``weight`` codes, ``weight_scale``, ``weight_scale_2``) instead of a full-precision parameter, and
computes with them in one of two ways:

* a torchao kernel: W8A8 (INT8 per-channel weight, INT8 per-tensor static input, SmoothQuant's
  ``pre_quant_scale``) runs torchao's ``Int8Tensor`` linear, a real int8 x int8 GEMM with int32 accumulation
  (the activation is quantized by torchao with the calibrated input scale), where that GEMM is fast
  (:func:`fast_int8_gemm`; ``compress(int8_gemm=...)`` decides otherwise). Its outputs differ from the
  fake-quant model's by the float rounding of a different order of operations (:data:`W8A8_TOLERANCE`). On
  a CPU that linear runs under ``torch.compile`` (inductor fuses the ops around the GEMM; eager after a
  compilation failure, under autograd, inside an outer compilation, or with ``layer.compile_int8 = False``),
  and each layer keeps its ``Int8Tensor`` between calls until its tensors change.
* dequantize on the fly, every other layer: the layer's weight is rebuilt from the codes for each forward
  (peak extra memory: one layer's weight) and the layer computes what the fake-quant layer computes, bit for
  bit. Where the packer's dequantization is within one ulp of the fake-quantized weight (INT and FP8, whose
  stored scale is ``amax / max_bound``), the calibrated weight quantizer is applied to it once more, which
  maps it back exactly onto the fake-quantized value.

The input quantizer (activation fake quant, ``pre_quant_scale``) stays as it was on the dequantize path.
Fine-tuning on top of frozen compressed weights trains LoRA adapters beside them (QLoRA:
:func:`modelopt_lite.quantization.add_lora`, served); the weights themselves train before compressing.

Fused MoE experts (:class:`~modelopt_lite.moe.QuantExperts`) are compressed per projection: each expert's
weight is packed by the same packer and the experts' tensors are stacked along a leading experts dimension
(:class:`CompressedExperts`); the forward dequantizes one projection, all its experts, on the fly and runs
the experts backend as before, bit for bit.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from typing import Any

import torch
from torch import nn

from ...logging import get_logger
from ...moe import QuantExperts
from ...nn import QuantLinear
from ..calibration.calibrate import check_calibrated
from ..config.config_models import CompressConfig
from .experts import (
    CompressedExperts,
    _compress_experts,
    _convert_experts,
    _expert_names,
    _experts_plan,
    packed_experts,
)
from .linear import (
    _TENSORS,
    KERNELS,
    W8A8_TOLERANCE,
    CompressedLinear,
    _compress_layer,
    _convert,
    fast_int8_gemm,
    packed_linear,
    require_torchao,
    use_int8_gemm,
)
from .packers import UnsupportedFormatError, get_packer, linear_format

__all__ = [
    "W8A8_TOLERANCE",
    "CompressedExperts",
    "CompressedLinear",
    "compress",
    "compressed_layers",
    "compressed_state",
    "fast_int8_gemm",
    "is_compressed",
    "packed_experts",
    "packed_linear",
    "require_torchao",
    "restore_compressed",
    "use_int8_gemm",
]

logger = get_logger(__name__)


def is_compressed(model: nn.Module) -> bool:
    """Whether some layer of ``model`` holds compressed weights (:func:`compress`)."""
    return any(isinstance(m, (CompressedLinear, CompressedExperts)) for m in model.modules())


def compressed_layers(model: nn.Module) -> dict[str, str]:
    """``{layer name: quant_algo}`` of the compressed layers of ``model``; a compressed fused experts
    projection is named ``<experts module>.<proj>``."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, CompressedLinear):
            out[name] = m.quant_algo
        elif isinstance(m, CompressedExperts):
            out.update({f"{name}.{proj}": algo for proj, algo in m.quant_algos.items()})
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compressed_state(model: nn.Module) -> dict[str, Any]:
    """JSON description of the compressed layers (format, packed tensor shapes and dtypes, compute dtype),
    from which :func:`restore_compressed` re-creates them empty for a checkpoint loader to fill."""
    out: dict[str, Any] = {}
    for name, m in model.named_modules():
        if isinstance(m, CompressedLinear):
            out[name] = {
                "quant_algo": m.quant_algo,
                "weight_dtype": _dtype_name(m._weight_dtype),
                "weight_shape": list(m._weight_shape),
                "group_size": m.group_size,
                "tensors": {n: [list(t.shape), _dtype_name(t.dtype)] for n, t in m._packed().items()},
            }
        elif isinstance(m, CompressedExperts):
            packed = m._packed()
            out[name] = {
                "weight_dtype": _dtype_name(m._weight_dtype),
                "experts": {
                    proj: {
                        "quant_algo": algo,
                        "group_size": m.group_sizes.get(proj),
                        "tensors": {
                            t: [list(packed[n].shape), _dtype_name(packed[n].dtype)]
                            for t, n in zip(_TENSORS, _expert_names(proj), strict=True)
                            if n in packed
                        },
                    }
                    for proj, algo in m.quant_algos.items()
                },
            }
    return out


def restore_compressed(model: nn.Module, state: dict[str, Any]) -> None:
    """Turn the quantized layers (and fused experts) named in ``state`` (from :func:`compressed_state`) into
    compressed ones with empty packed tensors (load the checkpoint's tensors into them afterwards)."""
    if state:
        require_torchao()
    for name, entry in state.items():
        module = model.get_submodule(name)
        if "experts" in entry:
            if not isinstance(module, QuantExperts):
                raise ValueError(
                    f"cannot restore the compressed experts {name!r}: it is not a quantized experts module"
                )
            device = getattr(module, next(iter(entry["experts"]))).device
            projections = {
                proj: (
                    e["quant_algo"],
                    e.get("group_size"),
                    {
                        n: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                        for n, (shape, dtype) in e["tensors"].items()
                    },
                )
                for proj, e in entry["experts"].items()
            }
            _convert_experts(module, projections, getattr(torch, entry["weight_dtype"]))
            continue
        if not isinstance(module, QuantLinear):
            raise ValueError(f"cannot restore the compressed layer {name!r}: it is not a quantized linear")
        device = module.weight.device
        tensors = {
            n: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            for n, (shape, dtype) in entry["tensors"].items()
        }
        _convert(
            module,
            entry["quant_algo"],
            tensors,
            getattr(torch, entry["weight_dtype"]),
            torch.Size(entry["weight_shape"]),
            group_size=entry.get("group_size"),
        )


def _patterns(config: Any) -> dict[str, bool]:
    if isinstance(config, CompressConfig):
        config = config.compress
    if config is None:
        return {"*": True}
    if not isinstance(config, dict) or not all(isinstance(v, bool) for v in config.values()):
        raise ValueError(
            f"mtq.compress(config={config!r}): expected None, a CompressConfig or {{layer pattern: bool}} "
            "such as {'*lm_head*': False, 'default': True}"
        )
    return config


def _selected(name: str, patterns: dict[str, bool]) -> bool:
    selected = patterns.get("default", False)
    for pattern, flag in patterns.items():
        if pattern != "default" and fnmatch.fnmatch(name, pattern):
            selected = flag
    return selected


def compress(model: nn.Module, config: Any = None, *, int8_gemm: bool | None = None) -> nn.Module:
    """Store the weight of every quantized linear layer of a calibrated model in its real format, in place;
    returns ``model``. Formats: those of the export (:func:`.packers.detect_format`): INT8 per channel (W8A8,
    W8A16), INT4 block (W4A16_AWQ, W4A8_AWQ), FP8, NVFP4, MXFP8. ``config``, as the reference's: ``None``
    (every layer), ``{layer name pattern: bool}`` (``"default"`` first, then the patterns in order, the last
    match wins) or a :class:`~modelopt_lite.quantization.config.CompressConfig` (``quant_gemm=False``: no int8
    GEMM). ``int8_gemm``: whether W8A8 layers run torchao's int8 GEMM (``None``: where it is fast,
    :func:`fast_int8_gemm`; ``False``: they dequantize on the fly, bit-exact). Layers already compressed are
    left as they are. Fused MoE experts are compressed per projection (:class:`CompressedExperts`) when all
    experts of the projection share one format; a projection whose experts mix formats stays fake-quantized (a
    warning names it). Raises when a quantizer is not calibrated or a layer has no real format, before
    changing anything."""
    patterns = _patterns(config)
    if isinstance(config, CompressConfig) and not config.quant_gemm:
        int8_gemm = False
    require_torchao()
    check_calibrated(model)
    plan: list[tuple[str, QuantLinear, str]] = []
    experts_plan: list[tuple[str, QuantExperts, dict[str, str]]] = []
    skipped: dict[str, str] = {}  # fused experts projection -> why it stays fake-quantized
    for name, module in model.named_modules():
        if isinstance(module, QuantExperts) and _selected(name, patterns):
            projections, why = _experts_plan(name, module)
            skipped.update({f"{name}.{proj}": reason for proj, reason in why.items()})
            if projections:
                experts_plan.append((name, module, projections))
        if not isinstance(module, QuantLinear) or isinstance(module, CompressedLinear):
            continue
        if not _selected(name, patterns):
            continue
        algo = linear_format(name, module)
        if algo is not None:
            try:
                get_packer(algo).check_shape(module._weight_view().shape)
            except ValueError as err:
                raise UnsupportedFormatError(f"{name}: {err}; exclude the layer from quantization") from None
            plan.append((name, module, algo))
    if not plan and not experts_plan and not is_compressed(model):
        raise ValueError(
            f"mtq.compress: {type(model).__name__} has no quantized linear layer to compress; quantize it "
            "first (mtq.quantize(model, config, forward_loop), or train it with QATTrainer)"
        )
    for _, module, algo in plan:
        _compress_layer(module, algo, int8_gemm)
    for _, module, projections in experts_plan:
        _compress_experts(module, projections)
    kernels = {name: module.uses_kernel for name, module, _ in plan}
    for algo, count in sorted(Counter(a for n, _, a in plan if not kernels[n]).items()):
        why = "no torchao kernel runs them here"
        if algo in KERNELS and int8_gemm is None and not fast_int8_gemm(next(iter(model.buffers())).device):
            why = "torch._int_mm is slow on a CPU without AVX512-VNNI / AMX; int8_gemm=True forces it"
        logger.info(
            "mtq.compress: %d %s layer(s) dequantize on the fly (%s; their outputs equal the fake-quant "
            "model's)",
            count,
            algo,
            why,
        )
    for algo, count in sorted(Counter(a for n, _, a in plan if kernels[n]).items()):
        logger.info("mtq.compress: %d %s layer(s) run %s", count, algo, KERNELS[algo])
    for algo, count in sorted(Counter(a for _, _, p in experts_plan for a in p.values()).items()):
        logger.info(
            "mtq.compress: %d fused MoE experts projection(s) in %s dequantize on the fly (all experts of "
            "a projection per forward; their outputs equal the fake-quant model's)",
            count,
            algo,
        )
    if skipped:
        names = list(skipped)
        logger.warning(
            "mtq.compress: %d fused MoE experts projection(s) stay fake-quantized with full-precision "
            "weights (not compressed): %s",
            len(names),
            "; ".join(f"{n} ({skipped[n]})" for n in names[:4]) + (" ..." if len(names) > 4 else ""),
        )
    return model
