"""Quantized ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2's linear with a transposed weight).

Both get ``input_quantizer``, ``weight_quantizer`` and ``output_quantizer`` (the last disabled by default).
Weight quantizers always see the weight as ``(out_features, in_features)``, so ``axis=0`` is per output
channel and ``block_sizes={-1: 128}`` blocks the input dimension for both classes; Conv1D's stored weight
is never transposed in place (its ``state_dict`` is unchanged).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from .quant_module import QUANT_MODULES, Quantizer, QuantModule
from .tensor_quantizer import TensorQuantizer

__all__ = ["QuantConv1D", "QuantLinear"]


@QUANT_MODULES.register(nn.Linear)
class QuantLinear(QuantModule):
    """``y = Q_out(F.linear(Q_in(x), Q_w(W), b))``."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def _setup(self) -> None:
        self.input_quantizer = TensorQuantizer("input_quantizer")
        self.weight_quantizer = TensorQuantizer("weight_quantizer")
        self.output_quantizer = TensorQuantizer("output_quantizer")
        self.output_quantizer.disable()

    def _weight_view(self) -> torch.Tensor:
        """The weight as ``(out, in)``."""
        return self.weight

    def _from_view(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def quantized_weight(self) -> torch.Tensor:
        return self._from_view(self.weight_quantizer(self._weight_view()))

    def weight_quantizer_pairs(self) -> Iterator[tuple[Quantizer, torch.Tensor]]:
        yield self.weight_quantizer, self._weight_view()

    @torch.no_grad()
    def fold_weight(self) -> None:
        if self.weight_quantizer.is_enabled:
            self.weight.copy_(self.quantized_weight())
            self.weight_quantizer.disable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = F.linear(self.input_quantizer(x), self.quantized_weight(), self.bias)
        return self.output_quantizer(out)


@QUANT_MODULES.register(Conv1D)
class QuantConv1D(QuantLinear):
    """GPT-2's ``Conv1D`` stores ``(in, out)`` and computes ``x @ W + b``."""

    nf: int

    def _weight_view(self) -> torch.Tensor:
        return self.weight.t()

    def _from_view(self, w: torch.Tensor) -> torch.Tensor:
        return w.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        size_out = (*x.shape[:-1], self.nf)
        x = self.input_quantizer(x)
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.quantized_weight()).view(size_out)
        return self.output_quantizer(out)
