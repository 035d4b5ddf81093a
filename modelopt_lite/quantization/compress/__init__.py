"""``mtq.compress`` and real quantized tensors: which real format a layer's quantizers amount to
(:mod:`.real_format`), the packer registry (:mod:`.packers`, what an export writes), the compressed
linear layers (:mod:`.linear`) and fused MoE experts (:mod:`.experts`), compressing a model (:mod:`.model`).
May import ``quantization.calibration`` (``check_calibrated``) and ``config``; never ``algorithms``.
"""

from .experts import CompressedExperts, packed_experts
from .linear import (
    KERNELS,
    W8A8_TOLERANCE,
    CompressedLinear,
    fast_int8_gemm,
    packed_linear,
    require_torchao,
    use_int8_gemm,
)
from .model import compress, compressed_layers, compressed_state, is_compressed, restore_compressed
from .packers import PACKERS, Packer, UnsupportedFormatError, get_packer, register_packer

__all__ = [
    "KERNELS",
    "PACKERS",
    "W8A8_TOLERANCE",
    "CompressedExperts",
    "CompressedLinear",
    "Packer",
    "UnsupportedFormatError",
    "compress",
    "compressed_layers",
    "compressed_state",
    "fast_int8_gemm",
    "get_packer",
    "is_compressed",
    "packed_experts",
    "packed_linear",
    "register_packer",
    "require_torchao",
    "restore_compressed",
    "use_int8_gemm",
]
