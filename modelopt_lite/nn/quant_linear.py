"""Quantized ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2's linear with a transposed weight).

Both get ``input_quantizer``, ``weight_quantizer`` and ``output_quantizer`` (the last disabled by default).
Weight quantizers always see the weight as ``(out_features, in_features)``, so ``axis=0`` is per output
channel and ``block_sizes={-1: 128}`` blocks the input dimension for both classes; Conv1D's stored weight
is never transposed in place (its ``state_dict`` is unchanged).

SVDQuant (``algorithm="svdquant"``) gives a layer a high-precision low-rank branch: the weight quantizer's
buffers ``_svdquant_lora_a`` (rank, in) and ``_svdquant_lora_b`` (out, rank), the reference's names. The
layer then returns ``Q_out(F.linear(Q_in(x), Q_w(W), b)) + (x s) A^T B^T`` where ``s`` is the input
quantizer's ``pre_quant_scale`` (1 without one) and ``W`` holds the residual that SVDQuant left to quantize.
The branch is saved and restored with the quantizer state; :func:`mtq.fold_weight` folds ``Q_w(W)`` only and
keeps the branch (the layer computes the same function).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from .quant_module import QUANT_MODULES, REPLACED_FORWARD, Quantizer, QuantModule
from .quantizer.attribute_dict import quantizer_attributes
from .quantizer.attributes import QuantizerAttributes
from .quantizer.tensor_quantizer import TensorQuantizer

__all__ = ["LOWRANK_BUFFERS", "QuantConv1D", "QuantLinear", "lowrank_factors", "set_lowrank_factors"]

#: The weight quantizer buffers of SVDQuant's low-rank branch ``A`` (rank, in) and ``B`` (out, rank).
LOWRANK_BUFFERS = ("_svdquant_lora_a", "_svdquant_lora_b")


def lowrank_factors(quantizer: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(A, B)`` of a weight quantizer's low-rank branch, or ``None``."""
    a, b = (quantizer._buffers.get(n) for n in LOWRANK_BUFFERS)
    return None if a is None or b is None else (a, b)


def set_lowrank_factors(quantizer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> None:
    """Give a weight quantizer the low-rank branch ``B @ A`` (buffers, hence in its ``state_dict``)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(f"low-rank factors need shapes (rank, in) and (out, rank), got {a.shape}, {b.shape}")
    for name, value in zip(LOWRANK_BUFFERS, (a, b), strict=True):
        quantizer.register_buffer(name, value.detach().clone())


def _attributes(desc: Any, slot: str) -> QuantizerAttributes:
    if not isinstance(desc, Mapping):
        raise TypeError(
            f"{slot}: a quantizer descriptor is a mapping of attributes such as "
            f"QuantizerAttributeConfig(...), got {type(desc).__name__}"
        )
    return quantizer_attributes(desc, desc.get("enable", True), slot)


def _quantizer(slot: str, desc: Mapping[str, Any]) -> TensorQuantizer:
    return TensorQuantizer(slot).set_attributes(_attributes(desc, slot))


@QUANT_MODULES.register(nn.Linear)
class QuantLinear(QuantModule):
    """``y = Q_out(F.linear(Q_in(x), Q_w(W), b))``.

    Usually made by :func:`mtq.quantize`, which turns each ``nn.Linear`` of a model into one. It can also be
    built directly, as in the reference library: ``QuantLinear(in_features, out_features, bias=True,
    quant_desc_input=..., quant_desc_weight=...)`` (the descriptors are attribute mappings such as a
    ``QuantizerAttributeConfig``) makes an ``nn.Linear`` with the same arguments and converts it. A subclass
    may define its own ``__init__`` (calling ``super().__init__(...)`` with those arguments) and its own
    defaults ``default_quant_desc_input`` / ``default_quant_desc_weight`` / ``default_quant_desc_output``;
    as in the reference, the weight quantizer defaults to 8 bits per output channel (``axis=0``) and the
    input and output quantizers to 8 bits per tensor (the output one disabled)."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    _builds: type[nn.Module] = nn.Linear  # what the reference-style constructor makes and converts
    default_quant_desc_input: Mapping[str, Any] = MappingProxyType({"num_bits": 8, "axis": None})
    default_quant_desc_weight: Mapping[str, Any] = MappingProxyType({"num_bits": 8, "axis": 0})
    default_quant_desc_output: Mapping[str, Any] = MappingProxyType({"num_bits": 8, "axis": None})

    def __new__(cls, *args: Any, **kwargs: Any):
        if "original_cls" in cls.__dict__:  # a class the registry made (copy / unpickling land here too)
            return super().__new__(cls)
        # QuantLinear(...) or a user's subclass: an instance of that class combined with the module it
        # builds, whose __init__ (the subclass's, then ours) Python runs next
        quantized = QUANT_MODULES.quantized_class(cls, cls._builds, keep_name=cls is not QuantLinear)
        return super().__new__(quantized)

    def __init__(
        self, *args: Any, quant_desc_input: Any = None, quant_desc_weight: Any = None, **kwargs: Any
    ) -> None:
        """Build the module with the original class's ``__init__`` (``nn.Linear(in_features,
        out_features, bias, device, dtype)``), add the quantizers, then set the given descriptors."""
        self.original_cls.__init__(self, *args, **kwargs)
        self._setup()
        for slot, desc in (("input_quantizer", quant_desc_input), ("weight_quantizer", quant_desc_weight)):
            if desc is not None:
                getattr(self, slot).set_attributes(_attributes(desc, slot))

    def _setup(self) -> None:
        self.input_quantizer = _quantizer("input_quantizer", self.default_quant_desc_input)
        self.weight_quantizer = _quantizer("weight_quantizer", self.default_quant_desc_weight)
        self.output_quantizer = _quantizer("output_quantizer", self.default_quant_desc_output)
        self.output_quantizer.disable()

    def _weight_view(self) -> torch.Tensor:
        """The weight as ``(out, in)``."""
        return self.weight

    def _from_view(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def quantized_weight(self, delta: torch.Tensor | None = None) -> torch.Tensor:
        """``Q_w(W)`` in the stored layout; with ``delta`` (stored layout, e.g. a LoRA adapter's ``s B A``)
        ``Q_w(W + delta)``: what the layer computes once the delta is merged into its weight."""
        if delta is None:
            return self._from_view(self.weight_quantizer(self._weight_view()))
        merged = self.weight + delta.to(self.weight.dtype)
        return self._from_view(self.weight_quantizer(self._to_view(merged)))

    def _to_view(self, w: torch.Tensor) -> torch.Tensor:
        """A weight in the stored layout as ``(out, in)``."""
        return w

    def weight_quantizer_pairs(self) -> Iterator[tuple[Quantizer, torch.Tensor]]:
        if self.weight is not None:  # a layer whose weight was removed (set to None) has nothing to calibrate
            yield self.weight_quantizer, self._weight_view()

    @torch.no_grad()
    def fold_weight(self) -> None:
        """Write ``Q_w(W)`` into the weight: also when the weight quantizer is disabled but still scales
        (``pre_quant_scale``) or rotates the weight, as the reference folds it; then the quantizer does
        none of these any more."""
        if self.weight_quantizer.transforms_input and self.weight is not None:
            self.weight.copy_(self.quantized_weight())
            self.weight_quantizer.mark_folded()

    def _plus_lowrank(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out + (x s) A^T B^T`` when the layer has a low-rank branch (see the module docstring)."""
        factors = lowrank_factors(self.weight_quantizer)
        if factors is None:
            return out
        scale = self.input_quantizer.pre_quant_scale
        x = x if scale is None else x * scale.to(x.dtype)
        return out + F.linear(F.linear(x, factors[0].to(x.dtype)), factors[1].to(x.dtype))

    runs_replaced_forward = True

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        replaced = self.__dict__.get(REPLACED_FORWARD)
        if replaced is not None:
            return self._forward_replaced(replaced, x, *args, **kwargs)
        return self.forward_with_delta(x, None, *args, **kwargs)

    def _forward_replaced(self, replaced: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """``Q_out(replaced(Q_in(x), ...))`` with ``self.weight`` reading ``Q_w(W)`` inside ``replaced`` (a
        forward set on the instance before conversion, see :mod:`.quant_module`). Should ``replaced`` call
        this class's forward again, that call computes the original layer on what it is given."""
        if "weight" in self.__dict__:  # (re-entered from inside ``replaced``)
            return self.original_cls.forward(self, x, *args, **kwargs)
        xq = self.input_quantizer(x)
        self.__dict__["weight"] = self.quantized_weight()
        try:
            out = replaced(xq, *args, **kwargs)
        finally:
            del self.__dict__["weight"]
        if isinstance(out, torch.Tensor):
            return self._plus_lowrank(x, self.output_quantizer(out))
        return out

    def forward_with_delta(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The forward with ``delta`` added to the weight before its quantizer (see :meth:`quantized_weight`):
        how a LoRA adapter deployed merged trains (:mod:`modelopt_lite.nn.lora`)."""
        xq = self.input_quantizer(x)
        if delta is None and self._weight_is_frozen():
            out = _FrozenWeightLinear.apply(xq, self.bias, self)
        else:
            out = F.linear(xq, self.quantized_weight(delta), self.bias)
        return self._plus_lowrank(x, self.output_quantizer(out))

    def _weight_is_frozen(self) -> bool:
        """Whether a forward that builds a graph can recompute ``Q_w(W)`` in backward instead of keeping it:
        the weight and the weight quantizer's parameters take no gradient (a LoRA / QLoRA base), outside
        ``torch.distributed`` (sharded weights are only whole inside their window)."""
        if not torch.is_grad_enabled() or self.weight is None or self.weight.requires_grad:
            return False
        if any(p.requires_grad for p in self.weight_quantizer.parameters()):
            return False
        return not (torch.distributed.is_available() and torch.distributed.is_initialized())


class _FrozenWeightLinear(torch.autograd.Function):
    """``F.linear(x, layer.quantized_weight(), bias)`` for a layer whose weight takes no gradient. Autograd
    would keep the quantized (or, compressed, dequantized) weight of every layer alive from forward to
    backward, a whole full-precision copy of the frozen model; this recomputes it in backward instead
    (the same tensor, bit for bit: the weight does not change in between)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, layer: QuantLinear) -> torch.Tensor:
        ctx.layer = layer
        return F.linear(x, layer.quantized_weight(), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            with torch.no_grad():
                grad_x = grad.matmul(ctx.layer.quantized_weight().to(grad.dtype))
        if ctx.needs_input_grad[1]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_bias, None


@QUANT_MODULES.register(Conv1D)
class QuantConv1D(QuantLinear):
    """GPT-2's ``Conv1D`` stores ``(in, out)`` and computes ``x @ W + b``."""

    nf: int
    _builds = Conv1D  # QuantConv1D(nf, nx) as Conv1D(nf, nx)

    def _weight_view(self) -> torch.Tensor:
        return self.weight.t()

    def _to_view(self, w: torch.Tensor) -> torch.Tensor:
        return w.t()

    def _from_view(self, w: torch.Tensor) -> torch.Tensor:
        return w.t()

    def forward_with_delta(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        size_out = (*x.shape[:-1], self.nf)
        xq = self.input_quantizer(x)
        weight = self.quantized_weight(delta)
        out = torch.addmm(self.bias, xq.reshape(-1, xq.shape[-1]), weight).view(size_out)
        return self._plus_lowrank(x, self.output_quantizer(out))
