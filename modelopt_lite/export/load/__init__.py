"""Loading an exported checkpoint back into transformers (``load_hf_checkpoint``, :mod:`.loader`): its
``quantization_config`` (:mod:`.config`), the dequantized load (:mod:`.dequantize`), the compressed load that
keeps the packed tensors (:mod:`.packed`) and fake-quant activations on top (:mod:`.activations`). May import
the writer's side of ``export`` (``hf_config``, ``layers``) and ``quantization``; the writer never imports it.
"""

from .config import ModeloptExportConfig
from .loader import ModeloptExportQuantizer, load_hf_checkpoint, read_hf_quant_config

__all__ = ["ModeloptExportConfig", "ModeloptExportQuantizer", "load_hf_checkpoint", "read_hf_quant_config"]
