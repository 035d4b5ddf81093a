"""``modelopt_lite.quantization.nn`` (``mtq.nn``): the reference library's ``quantization.nn`` names.

The classes are :mod:`modelopt_lite.nn`'s (one implementation): ``TensorQuantizer``,
``SequentialQuantizer``, ``QuantLinear`` (also ``Linear``), ``QuantModule``, and ``QuantModuleRegistry`` (the
registry object, ``mtq.register``'s). The reference's quantized CNN / RNN / embedding / pooling modules,
real-quant and SVDQuant linears and its special quantizer classes exist under their names; constructing one
raises :class:`~modelopt_lite.nn.errors.UnsupportedFeatureError` naming what to use. This library quantizes
the linear layers, fused MoE experts and KV caches of transformers LLMs.
"""

from __future__ import annotations

from ...nn import QUANT_MODULES, QuantLinear, QuantModule, SequentialQuantizer, TensorQuantizer
from ...nn.errors import unsupported_class
from ..tensor_quant import QUANT_DESC_8BIT_PER_TENSOR
from ..unsupported import is_registered_quant_backend, register_quant_backend, unregister_quant_backend

QuantModuleRegistry = QUANT_MODULES
Linear = QuantLinear
#: Every quantizer type a quantizer slot may hold.
AnyQuantizer = (TensorQuantizer, SequentialQuantizer)

_CNN = "quantized CNN layers are not supported (this library quantizes LLM linear layers); exclude the layer"
_WHAT: dict[str, str] = {
    **{f"{p}Conv{k}{d}d": _CNN for p in ("Quant", "") for k in ("", "Transpose") for d in (1, 2, 3)},
    **{
        f"{p}{k}Pool{d}d": _CNN
        for p in ("Quant", "")
        for k in ("Max", "Avg", "AdaptiveAvg")
        for d in (1, 2, 3)
    },
    **{f"QuantInstanceNorm{d}d": _CNN for d in (1, 2, 3)},
    "QuantInputBase": _CNN,
    "QuantLinearConvBase": "use QuantLinear (or QuantModule for a custom module, registered with "
    "mtq.register)",
    "QuantEmbedding": "embeddings are not quantized (they are exported in high precision)",
    "QuantRNNBase": "quantized RNNs are not supported",
    "QuantRNNFullBase": "quantized RNNs are not supported",
    "RNNLayerForward": "quantized RNNs are not supported",
    "VFRNNForward": "quantized RNNs are not supported",
    "RealQuantLinear": "there is no real-quant linear class: mtq.compress(model) keeps each quantized "
    "layer's weight packed (real low-bit, in memory); modelopt_lite.export.export_hf_checkpoint writes it",
    "SVDQuantLinear": "the svdquant algorithm gives QuantLinear its low-rank branch (no class swap); "
    "quantize with NVFP4_SVDQUANT_DEFAULT_CFG or algorithm 'svdquant'",
    "GroupedQuantizer": "grouped quantizers are not implemented: fused MoE experts get one quantizer per "
    "expert",
    "NVFP4StaticQuantizer": "use TensorQuantizer with block_sizes type 'static' and scale_bits (4, 3) "
    "(static NVFP4: amax per block, global_amax)",
    "StaticBlockScaleQuantizer": "use TensorQuantizer with static block_sizes (INT blocks, or static NVFP4)",
    "HardDisabledTensorQuantizer": "use TensorQuantizer(...) and quantizer.disable()",
    "TensorQuantizerCache": "not implemented; quantizers hold no cache",
}


globals().update({name: unsupported_class(name, why, __name__) for name, why in _WHAT.items()})

__all__ = [
    "QUANT_DESC_8BIT_PER_TENSOR",
    "AnyQuantizer",
    "Linear",
    "QuantLinear",
    "QuantModule",
    "QuantModuleRegistry",
    "SequentialQuantizer",
    "TensorQuantizer",
    "is_registered_quant_backend",
    "register_quant_backend",
    "unregister_quant_backend",
    *_WHAT,
]
