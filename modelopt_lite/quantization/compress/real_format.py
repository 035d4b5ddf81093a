"""Which real format (``quant_algo``) a layer's quantizers amount to: :func:`detect_format` /
:func:`linear_format`, the table of supported combinations and :class:`UnsupportedFormatError`. The export
and ``mtq.compress`` both ask it which packer (:mod:`.packers`) writes a layer."""

from __future__ import annotations

from ...nn import QuantLinear, SequentialQuantizer, TensorQuantizer
from ...nn.quant_linear import lowrank_factors
from ...nn.quant_module import Quantizer

__all__ = ["COMPRESS_ONLY", "SUPPORTED", "UnsupportedFormatError", "detect_format", "linear_format"]


#: (weight kind, input kind) -> quant_algo; "AWQ" variants are chosen by a pre_quant_scale
_FORMATS = {
    ("fp8", "fp8"): "FP8",
    ("fp8_per_channel", "fp8_per_token"): "FP8_PER_CHANNEL_PER_TOKEN",
    ("int8_per_channel", "int8"): "W8A8_SQ_PER_CHANNEL",
    ("int8_per_channel", "none"): "W8A16",
    ("int4_block", "none"): "W4A16_AWQ",
    ("int4_block+fp8", "fp8"): "W4A8_AWQ",
    ("nvfp4", "nvfp4"): "NVFP4",
    ("nvfp4", "none"): "W4A16_NVFP4",
    ("mxfp8", "mxfp8"): "MXFP8",
    ("mxfp4", "mxfp4"): "MXFP4",
    ("mxfp4", "none"): "MXFP4",
}
#: formats ``mtq.compress`` packs that the unified export does not write (no reference layout checked here)
COMPRESS_ONLY = frozenset({"MXFP4"})
SUPPORTED = "; ".join(f"weight {w} + input {i} -> {a}" for (w, i), a in _FORMATS.items())


class UnsupportedFormatError(ValueError):
    """A layer's quantization has no real format: it cannot be exported nor compressed."""


def _kind(q: TensorQuantizer) -> str:
    spec = q.spec
    if spec.dynamic and not spec.block_axes:  # dynamic per tensor / per axis: no deployable format
        return "other"
    if spec.kind == "fp8" and spec.num_bits == (4, 3):
        if not spec.block_axes:
            return {None: "fp8", 0: "fp8_per_channel"}.get(spec.axis, "other")  # type: ignore[arg-type]
        if spec.dynamic and spec.block_axes == ((-1, None),):
            return "fp8_per_token"
    if spec.kind == "int" and not spec.unsigned and not spec.block_axes:
        if spec.num_bits == 8:
            return {None: "int8", 0: "int8_per_channel"}.get(spec.axis, "other")  # type: ignore[arg-type]
    if spec.kind == "int" and spec.num_bits == 4 and not spec.dynamic and len(spec.block_axes) == 1:
        return "int4_block" if spec.block_axes[0][0] == -1 and not spec.unsigned else "other"
    if spec.kind == "nvfp4":
        return "nvfp4"
    if spec.kind == "mx" and spec.num_bits == (4, 3):
        return "mxfp8"
    if spec.kind == "mx" and spec.num_bits == (2, 1):
        return "mxfp4"
    return "other"


def _describe(q: Quantizer | None) -> str:
    if q is None or not q.is_enabled:
        return "none"
    if isinstance(q, SequentialQuantizer):
        return " -> ".join(_describe(s) for s in q)
    return f"{q.spec.name} {q.spec.granularity}"


def detect_format(name: str, wq: Quantizer | None, iq: Quantizer | None) -> str | None:
    """The ``quant_algo`` of a linear map with these quantizers (``None``: not quantized)."""
    if wq is not None and lowrank_factors(wq) is not None:
        raise UnsupportedFormatError(
            f"{name}: has an SVDQuant low-rank branch (weight_quantizer._svdquant_lora_a / _b), which this "
            "export does not write (the reference's NVFP4_SVD checkpoints keep it next to the NVFP4 residual "
            "weight): save the model with mto.save, or quantize with NVFP4_AWQ_LITE_CFG to export"
        )
    if wq is None or not wq.is_enabled:
        if iq is not None and iq.is_enabled:
            raise UnsupportedFormatError(
                f"{name}: input quantizer {_describe(iq)} is enabled but the weight is not quantized; the "
                "export writes quantized weights only (disable the input quantizer or quantize the weight)"
            )
        return None
    if isinstance(iq, SequentialQuantizer) and iq.is_enabled:
        raise UnsupportedFormatError(
            f"{name}: the input quantizer is sequential ({_describe(iq)}); no real format (export, "
            "mtq.compress) stores more than one input scale: give *input_quantizer a single cfg to export, "
            "or save the fake-quantized model with mto.save"
        )
    if isinstance(wq, SequentialQuantizer):
        kinds = [_kind(s) for s in wq if s.is_enabled]
        weight = "+".join(kinds) if kinds == ["int4_block", "fp8"] else "other"
    else:
        weight = _kind(wq)
    inputs = "none" if iq is None or not iq.is_enabled else _kind(iq)
    algo = _FORMATS.get((weight, inputs))
    if algo is None:
        raise UnsupportedFormatError(
            f"{name}: no real format (export, mtq.compress) for weight {_describe(wq)} with input "
            f"{_describe(iq)}. Supported: {SUPPORTED}"
        )
    if algo == "NVFP4" and iq is not None and iq.pre_quant_scale is not None:
        return "NVFP4_AWQ"
    return algo


def linear_format(name: str, module: QuantLinear) -> str | None:
    """The ``quant_algo`` of a quantized linear layer (``None``: not quantized); an enabled output quantizer
    has no real format."""
    if module.output_quantizer.is_enabled:
        raise UnsupportedFormatError(
            f"{name}: output quantizer {_describe(module.output_quantizer)} is enabled; the real formats "
            "(export, mtq.compress) have no tensor for output quantization (disable *output_quantizer)"
        )
    return detect_format(name, module.weight_quantizer, module.input_quantizer)
