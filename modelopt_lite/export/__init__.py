"""Floor 4: the unified Hugging Face checkpoint (``quant_method: "modelopt"``) that inference engines load.

    from modelopt_lite.export import export_hf_checkpoint, load_hf_checkpoint
    export_hf_checkpoint(model, "out/llama-nvfp4", tokenizer=tokenizer)
    model = load_hf_checkpoint("out/llama-nvfp4", dtype=torch.bfloat16)  # dequantized

Packers (format -> tensors) register with :func:`register_packer`; the layer walk recognises formats from
the quantizers' attributes; post-export verification reads the files back. The reference's other export
paths (TensorRT-LLM, Megatron-Core, vLLM fake quant) exist in :mod:`.compat` and raise, naming this one.
:func:`export_gpt_oss_mxfp4` writes GPT-OSS's own MXFP4 layout (``quant_method: "mxfp4"``).
"""

from ..quantization.compress.packers import PACKERS, Packer, get_packer, register_packer
from .compat import (
    convert_hf_quant_config_format,
    convert_to_transformer_engine,
    export_hf_vllm_fq_checkpoint,
    export_mcore_gpt_to_hf,
    export_mcore_gpt_to_hf_vllm_fq,
    export_speculative_decoding,
    export_tensorrt_llm_checkpoint,
    has_quant_opt,
    import_mcore_gpt_from_hf,
    torch_to_tensorrt_llm_checkpoint,
)
from .hf_config import QUANT_METHOD, hf_quant_config, quantization_config
from .layers import SHARED_INPUT_GROUPS, UnsupportedFormatError, detect_format, unify_shared_scales
from .load.loader import (
    ModeloptExportConfig,
    ModeloptExportQuantizer,
    load_hf_checkpoint,
    read_hf_quant_config,
)
from .mxfp4 import export_gpt_oss_mxfp4
from .verify import ExportVerificationError, read_checkpoint, verify_export
from .writer import ExportResult, export_hf_checkpoint, parse_size

__all__ = [
    "PACKERS",
    "QUANT_METHOD",
    "SHARED_INPUT_GROUPS",
    "ExportResult",
    "ExportVerificationError",
    "ModeloptExportConfig",
    "ModeloptExportQuantizer",
    "Packer",
    "UnsupportedFormatError",
    "convert_hf_quant_config_format",
    "convert_to_transformer_engine",
    "detect_format",
    "export_gpt_oss_mxfp4",
    "export_hf_checkpoint",
    "export_hf_vllm_fq_checkpoint",
    "export_mcore_gpt_to_hf",
    "export_mcore_gpt_to_hf_vllm_fq",
    "export_speculative_decoding",
    "export_tensorrt_llm_checkpoint",
    "get_packer",
    "has_quant_opt",
    "hf_quant_config",
    "import_mcore_gpt_from_hf",
    "load_hf_checkpoint",
    "parse_size",
    "quantization_config",
    "read_checkpoint",
    "read_hf_quant_config",
    "register_packer",
    "torch_to_tensorrt_llm_checkpoint",
    "unify_shared_scales",
    "verify_export",
]
