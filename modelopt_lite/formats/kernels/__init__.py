"""The fast paths of :func:`~modelopt_lite.formats.fake_quant`, each equal to the reference formulas of
the format modules: fused CPU kernels compiled by ``torch.compile`` (:mod:`.fused`), small C kernels built
once per machine (:mod:`.native`) and Triton kernels on CUDA (:mod:`.triton_kernels`). They import the format
modules of :mod:`modelopt_lite.formats` (never ``functional``, which dispatches to them).
"""

from .fused import fused_call_count, fused_fake_quant_enabled, set_fused_fake_quant
from .native import native_call_count, native_fake_quant_enabled, set_native_fake_quant

__all__ = [
    "fused_call_count",
    "fused_fake_quant_enabled",
    "native_call_count",
    "native_fake_quant_enabled",
    "set_fused_fake_quant",
    "set_native_fake_quant",
]
