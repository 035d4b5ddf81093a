"""What NVIDIA Model-Optimizer's ``mtq`` has and this library deliberately does not (custom quantization
backends, attention classes rewritten from their source): each exists under its name and raises
:class:`~.config.UnsupportedFeatureError` (a ``NotImplementedError``) naming what to use instead, so a
migrated script learns it at the first call."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..nn import QUANT_MODULES
from ..nn.errors import UnsupportedFeatureError

__all__ = [
    "is_registered_quant_backend",
    "register_attention_for_kv_quant",
    "register_quant_backend",
    "unregister_quant_backend",
]


def register_quant_backend(name: str, entrypoint: Callable[..., torch.Tensor]) -> None:
    """The reference's custom fake-quant backends: not implemented (the built-in fake quant runs on every
    device, with Triton kernels on CUDA)."""
    raise UnsupportedFeatureError(
        f"register_quant_backend({name!r}): custom quantization backends are not implemented; the built-in "
        "fake quant (modelopt_lite.formats) covers INT, FP8, NVFP4 and MX; a new format is a new formats "
        "module"
    )


def unregister_quant_backend(name: str) -> None:
    """No backend is ever registered (see :func:`register_quant_backend`)."""
    raise UnsupportedFeatureError(
        f"unregister_quant_backend({name!r}): custom quantization backends are not implemented"
    )


def is_registered_quant_backend(name: str) -> bool:
    """Always ``False``: custom backends are not implemented."""
    return False


def register_attention_for_kv_quant(attention_cls: type) -> bool:
    """``True`` when ``attention_cls`` already gets KV-cache quantizers: every transformers attention class
    that calls ``ALL_ATTENTION_FUNCTIONS`` does (see :mod:`modelopt_lite.nn.kv_attention`). The reference
    rewrites other classes from their source code, which this library does not do: they raise, naming what
    to write."""
    if not (isinstance(attention_cls, type) and issubclass(attention_cls, nn.Module)):
        raise TypeError(f"attention_cls must be an nn.Module subclass, got {attention_cls!r}")
    if attention_cls in QUANT_MODULES:
        return True
    raise UnsupportedFeatureError(
        f"register_attention_for_kv_quant({attention_cls.__qualname__}): this class does not call "
        "transformers' attention interface and classes are not rewritten from their source here; write a "
        "quantized class whose _setup adds k_bmm_quantizer / v_bmm_quantizer (TensorQuantizer) and whose "
        "forward applies them to the keys and values, and register it with "
        "mtq.register(original_cls=..., quantized_cls=...)"
    )
