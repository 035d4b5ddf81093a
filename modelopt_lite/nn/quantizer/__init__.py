"""The quantizer modules: :class:`TensorQuantizer` (one tensor's fake quant) and its parts (its attributes,
buffers, reference-named methods, attribute dicts in the reference's vocabulary, shared outputs) and
:class:`SequentialQuantizer`. Imports ``nn.calibrators``, ``nn.errors`` and the floors below ``nn``; the
quantized module wrappers of ``nn`` build on it.
"""

from .attributes import QuantizerAttributes
from .sequential_quantizer import SequentialQuantizer
from .tensor_quantizer import TensorQuantizer

__all__ = ["QuantizerAttributes", "SequentialQuantizer", "TensorQuantizer"]
