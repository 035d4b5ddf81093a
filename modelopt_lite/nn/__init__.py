"""Floor 2a: ``TensorQuantizer`` (:mod:`.quantizer`), calibrators (:mod:`.calibrators`), quantized module
wrappers (Linear, Conv1D, attention with KV-cache quantizers) and the module-class -> wrapper registry."""

from . import kv_attention, quant_linear  # noqa: F401  (their wrappers register at definition time)
from .calibrators import Calibrator, HistogramCalibrator, MaxCalibrator, make_calibrator
from .kv_attention import QuantAttention
from .quant_linear import QuantConv1D, QuantLinear
from .quant_module import QUANT_MODULES, Quantizer, QuantModule, QuantModuleRegistry, iter_quantizers
from .quantizer.attributes import QuantizerAttributes
from .quantizer.sequential_quantizer import SequentialQuantizer
from .quantizer.tensor_quantizer import TensorQuantizer

__all__ = [
    "QUANT_MODULES",
    "Calibrator",
    "HistogramCalibrator",
    "MaxCalibrator",
    "QuantAttention",
    "QuantConv1D",
    "QuantLinear",
    "QuantModule",
    "QuantModuleRegistry",
    "Quantizer",
    "QuantizerAttributes",
    "SequentialQuantizer",
    "TensorQuantizer",
    "iter_quantizers",
    "make_calibrator",
]
