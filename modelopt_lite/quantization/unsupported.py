"""What NVIDIA Model-Optimizer's ``mtq`` has and this library deliberately does not (``auto_quantize``,
``compress``, custom quantization backends, attention classes rewritten from their source): each exists under
its name and raises :class:`~.config.UnsupportedFeatureError` (a ``NotImplementedError``) naming what to use
instead, so a migrated script learns it at the first call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..nn import QUANT_MODULES
from ..nn.errors import UnsupportedFeatureError

__all__ = [
    "auto_quantize",
    "compress",
    "get_auto_quantize_config",
    "is_registered_quant_backend",
    "register_attention_for_kv_quant",
    "register_quant_backend",
    "unregister_quant_backend",
]


def auto_quantize(
    model: nn.Module,
    constraints: dict[str, Any] | None = None,
    quantization_formats: list[dict[str, Any] | str] | None = None,
    data_loader: Any = None,
    forward_step: Any = None,
    loss_func: Any = None,
    forward_backward_step: Any = None,
    disabled_layers: list[str] | str | None = None,
    num_calib_steps: int = 512,
    num_score_steps: int = 128,
    verbose: bool = False,
    method: str = "gradient",
    checkpoint: str | None = None,
    module_search_spaces: list[dict[str, Any]] | None = None,
    fixed_quantization_config: dict[str, Any] | str | None = None,
) -> Any:
    """The reference's per-layer format search under an effective-bits constraint: not implemented."""
    raise UnsupportedFeatureError(
        "mtq.auto_quantize (a per-layer search over formats under an effective-bits constraint) is not "
        "implemented; quantize with one preset, mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop), "
        "and keep sensitive layers in high precision with rules such as "
        "{'quantizer_name': '*layers.0.*', 'enable': False} appended to its quant_cfg"
    )


def get_auto_quantize_config(search_state: Any, constraints: Any = None, verbose: bool = False) -> Any:
    """The config an ``auto_quantize`` search chose: not implemented (there is no search)."""
    raise UnsupportedFeatureError(
        "mtq.get_auto_quantize_config: mtq.auto_quantize is not implemented, so there is no search state; "
        "write the config as a preset plus rules"
    )


def compress(model: nn.Module, config: Any = None) -> nn.Module:
    """The reference's in-memory real low-bit weights: not implemented yet (planned in a later issue)."""
    raise UnsupportedFeatureError(
        "mtq.compress (real low-bit weights held in memory) is not implemented yet (planned in a later "
        "issue); modelopt_lite.export.export_hf_checkpoint writes the real quantized weights, and "
        "mtq.fold_weight bakes the fake-quantized values into the weights"
    )


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
