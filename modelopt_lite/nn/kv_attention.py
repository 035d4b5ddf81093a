"""KV-cache quantization through transformers' ``AttentionInterface``.

Attention classes of transformers call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v,
mask, ...)`` on the keys and values after RoPE, which is what a KV cache stores. We register two attention
functions under our own names, ``modelopt_lite_sdpa`` and ``modelopt_lite_eager``, each with the mask function
of the implementation it wraps (transformers' documented seam for custom attention). They apply the
attention module's ``q_bmm_quantizer`` / ``k_bmm_quantizer`` / ``v_bmm_quantizer`` to the query, keys and
values and call the wrapped implementation unchanged. As in the reference, the three start enabled with the
default attributes (8 bits per tensor, calibrated): a config that does not disable them quantizes them.
``q_bmm_quantizer`` (the query, for FP8 attention) is fake quant only: the checkpoint format has no scale
for it.

``p_bmm_quantizer`` (also disabled until a config enables it) quantizes the attention probabilities: the
softmax output, before the dropout and the product with the values. SDPA computes them inside its kernel, so
while it is enabled both of our functions run the model's own ``eager_attention_forward`` (mask, scaling, GQA
repeat, dropout, sinks and softcapping as the model defines them) under a ``TorchFunctionMode`` that passes
the result of its softmax call through the quantizer; for the SDPA name the mask is first turned into the
additive form the eager function expects. Disabled, the wrapped implementation runs unchanged.

Inserting quantizers switches a model on ``sdpa`` / ``eager`` to the matching name (outputs are identical
while the KV quantizers are disabled). If the implementation is changed afterwards to one we do not wrap
(``flash_attention_2``, ...), an attention forward with enabled KV quantizers raises instead of silently
skipping them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .quant_module import QUANT_MODULES, QuantModule
from .quantizer.tensor_quantizer import TensorQuantizer

__all__ = ["KV_ATTENTION_IMPLEMENTATIONS", "QuantAttention", "kv_attention_name"]

_PREFIX = "modelopt_lite_"
KV_ATTENTION_IMPLEMENTATIONS = {"sdpa": _PREFIX + "sdpa", "eager": _PREFIX + "eager"}


def kv_attention_name(implementation: str | None) -> str | None:
    """Our name for ``implementation`` (``None`` when we do not wrap it); ours map to themselves."""
    if implementation is None:
        return KV_ATTENTION_IMPLEMENTATIONS["eager"]
    if implementation in KV_ATTENTION_IMPLEMENTATIONS.values():
        return implementation
    return KV_ATTENTION_IMPLEMENTATIONS.get(implementation)


def _model_eager_attention(module: nn.Module) -> Callable[..., Any]:
    """The ``eager_attention_forward`` of the modeling file that defines ``module``'s class."""
    cls = getattr(module, "original_cls", type(module))
    fn = getattr(inspect.getmodule(cls), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(
            f"{cls.__qualname__}: its modeling file defines no eager_attention_forward; use "
            f"attn_implementation='sdpa' for KV-cache quantization of this model"
        )
    return fn


_SLOTS = ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer")


def _quantize_qkv(module: nn.Module, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Query, keys and values through the module's quantizers (a module without them: unchanged)."""
    out = []
    for slot, t in zip(_SLOTS, tensors, strict=True):
        q = getattr(module, slot, None)
        out.append(t if q is None else q(t))
    return out


_SOFTMAX = (torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax)


class _QuantizedSoftmax(TorchFunctionMode):
    """Passes every softmax result computed inside the mode through ``quantizer`` (torch's documented seam for
    intercepting functions; the quantizer itself runs with the mode off)."""

    def __init__(self, quantizer: nn.Module) -> None:
        super().__init__()
        self.quantizer = quantizer
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _SOFTMAX:
            self.calls += 1
            out = self.quantizer(out)
        return out


def _eager_mask(module, query, key, attention_mask, is_causal=None):
    """An SDPA mask (boolean, True = attend, or ``None`` for "causal when SDPA would be") as the additive mask
    of eager attention, following transformers' ``sdpa_attention_forward`` rule for ``is_causal``."""
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if query.shape[2] <= 1 or not causal:
            return None
        shape = (query.shape[2], key.shape[2])
        attention_mask = torch.ones(shape, dtype=torch.bool, device=query.device).tril()
    if attention_mask.dtype != torch.bool:
        return attention_mask
    blocked = torch.tensor(torch.finfo(query.dtype).min, dtype=query.dtype, device=query.device)
    return torch.where(attention_mask, torch.zeros((), dtype=query.dtype, device=query.device), blocked)


def _attention(wrapped, module, query, key, value, attention_mask, **kwargs):
    query, key, value = _quantize_qkv(module, query, key, value)
    p_quantizer = getattr(module, "p_bmm_quantizer", None)
    if p_quantizer is None or not p_quantizer.is_enabled:
        fn = _model_eager_attention(module) if wrapped == "eager" else ALL_ATTENTION_FUNCTIONS[wrapped]
        return fn(module, query, key, value, attention_mask, **kwargs)
    if wrapped == "sdpa":
        attention_mask = _eager_mask(module, query, key, attention_mask, kwargs.get("is_causal"))
    mode = _QuantizedSoftmax(p_quantizer)
    with mode:
        out = _model_eager_attention(module)(module, query, key, value, attention_mask, **kwargs)
    if mode.calls == 0:
        raise RuntimeError(
            f"{type(module).__name__}: p_bmm_quantizer is enabled but the model's eager_attention_forward "
            f"computes no softmax to quantize; disable the *p_bmm_quantizer rule for this model"
        )
    return out


def _sdpa_with_kv(module, query, key, value, attention_mask, **kwargs):
    return _attention("sdpa", module, query, key, value, attention_mask, **kwargs)


def _eager_with_kv(module, query, key, value, attention_mask, **kwargs):
    return _attention("eager", module, query, key, value, attention_mask, **kwargs)


# Definition-time registration under our own names (never replacing a name transformers defines).
AttentionInterface.register(KV_ATTENTION_IMPLEMENTATIONS["sdpa"], _sdpa_with_kv)
AttentionInterface.register(KV_ATTENTION_IMPLEMENTATIONS["eager"], _eager_with_kv)
AttentionMaskInterface.register(KV_ATTENTION_IMPLEMENTATIONS["sdpa"], sdpa_mask)
AttentionMaskInterface.register(KV_ATTENTION_IMPLEMENTATIONS["eager"], eager_mask)


class QuantAttention(QuantModule):
    """Adds ``q_bmm_quantizer``, ``k_bmm_quantizer`` and ``v_bmm_quantizer`` (8 bits per tensor by default,
    like every quantizer, and enabled, as in the reference) and ``p_bmm_quantizer`` (the softmax
    probabilities), disabled until a config enables it (enabled, it runs the eager attention)."""

    def _setup(self) -> None:
        self.q_bmm_quantizer = TensorQuantizer("q_bmm_quantizer")
        self.k_bmm_quantizer = TensorQuantizer("k_bmm_quantizer")
        self.v_bmm_quantizer = TensorQuantizer("v_bmm_quantizer")
        self.p_bmm_quantizer = TensorQuantizer("p_bmm_quantizer")
        self.p_bmm_quantizer.disable()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        quantizers = [getattr(self, slot) for slot in (*_SLOTS, "p_bmm_quantizer")]
        if any(q.is_enabled or q.attributes.rotation() for q in quantizers):  # (a disabled one may rotate)
            impl = getattr(getattr(self, "config", None), "_attn_implementation", None)
            if impl not in KV_ATTENTION_IMPLEMENTATIONS.values():
                raise RuntimeError(
                    f"{type(self).__name__}: q / k / v / p quantizers are enabled but the model's attention "
                    f"implementation is {impl!r}, which would bypass them. Use "
                    f"model.set_attn_implementation({KV_ATTENTION_IMPLEMENTATIONS['sdpa']!r}) (or "
                    f"{KV_ATTENTION_IMPLEMENTATIONS['eager']!r}), or disable the *_bmm_quantizer rules"
                )
        return super().forward(*args, **kwargs)


def _is_interface_attention(cls: type[nn.Module]) -> bool:
    """Attention classes of transformers' modeling files that dispatch through the AttentionInterface."""
    if not cls.__name__.endswith("Attention") or not cls.__module__.startswith("transformers.models."):
        return False
    module = inspect.getmodule(cls)
    if getattr(module, "ALL_ATTENTION_FUNCTIONS", None) is None:
        return False
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source or "eager_attention_forward" in source


QUANT_MODULES.register_rule(
    "transformers attention (AttentionInterface)", _is_interface_attention, QuantAttention
)
