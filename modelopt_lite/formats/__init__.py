"""Floor 1: reference fake quantization per format (pure PyTorch, any device), the straight-through
estimator, E2M1 packing, and the fast paths of :mod:`.kernels`: Triton kernels used automatically on CUDA
tensors, and on CPU tensors one-pass native kernels (:mod:`.kernels.native`, on by default) and compiled
(fused) kernels (:mod:`.kernels.fused`, opt-in)."""

from ._blocks import BlockLayout
from .fp8 import fp8_fake_quant
from .functional import fake_quant, fake_quant_reference, reduce_amax, reduce_axes, reduce_like_amax
from .hadamard import hadamard_block_size, hadamard_matrix, hadamard_transform
from .integer import int_bounds, int_fake_quant
from .kernels.fused import fused_call_count, fused_fake_quant_enabled, set_fused_fake_quant
from .kernels.native import native_call_count, native_fake_quant_enabled, set_native_fake_quant
from .learnable import fake_quant_learnable, learnable_amax_error
from .mx import mx_fake_quant, mx_scale_exponent
from .nvfp4 import (
    nvfp4_block_scales,
    nvfp4_fake_quant,
    nvfp4_global_scale,
    nvfp4_static_scales,
    pack_e2m1,
    unpack_e2m1,
)
from .rounding import E2M1_VALUES, e2m1_round, minifloat_round
from .spec import FormatSpec, resolve_format

__all__ = [
    "E2M1_VALUES",
    "BlockLayout",
    "FormatSpec",
    "e2m1_round",
    "fake_quant",
    "fake_quant_learnable",
    "fake_quant_reference",
    "fp8_fake_quant",
    "fused_call_count",
    "fused_fake_quant_enabled",
    "hadamard_block_size",
    "hadamard_matrix",
    "hadamard_transform",
    "int_bounds",
    "int_fake_quant",
    "learnable_amax_error",
    "minifloat_round",
    "mx_fake_quant",
    "mx_scale_exponent",
    "native_call_count",
    "native_fake_quant_enabled",
    "nvfp4_block_scales",
    "nvfp4_fake_quant",
    "nvfp4_global_scale",
    "nvfp4_static_scales",
    "pack_e2m1",
    "reduce_amax",
    "reduce_axes",
    "reduce_like_amax",
    "resolve_format",
    "set_fused_fake_quant",
    "set_native_fake_quant",
    "unpack_e2m1",
]
