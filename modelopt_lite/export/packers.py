"""The export packers, under their former import path: they live in :mod:`modelopt_lite.quantization.packers`
(``mtq.compress`` packs weights in memory with them, and the quantization floor cannot import the export)."""

from ..quantization.packers import *  # noqa: F403
from ..quantization.packers import (  # noqa: F401  (the classes and helpers by name, as before the move)
    FP8Packer,
    Int4BlockPacker,
    Int8Packer,
    MXFP8Packer,
    NVFP4Packer,
    W4A8Packer,
)
from ..quantization.packers import __all__ as __all__
