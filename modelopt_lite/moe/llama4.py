"""Llama 4's text experts: 3-D weights outside transformers' experts seam (every token reaches every expert,
scaled by its router score, in one batched matmul per projection). An explicit wrapper with the same
quantizer names as :class:`~modelopt_lite.moe.QuantExperts`."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

from ..nn import QUANT_MODULES
from .experts import QuantExperts

__all__ = ["QuantLlama4TextExperts"]


@QUANT_MODULES.register(Llama4TextExperts)
class QuantLlama4TextExperts(QuantExperts):
    """``gate_up_proj`` is ``(experts, hidden, 2 * inter)`` and ``down_proj`` ``(experts, inter, hidden)``:
    stored ``(in, out)``, so weight quantizers see each expert's transpose."""

    has_gate = True
    has_bias = False
    is_transposed = True
    hidden_size: int

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = hidden_states.view(self.num_experts, -1, self.hidden_size)
        self.forward_calls += 1
        self.tokens_per_expert += x.shape[1]
        if self.input_observer is not None:
            for expert in range(self.num_experts):
                self.input_observer("gate_up_proj", expert, x[expert])
        x = self.gate_up_proj_input_quantizer(x)
        gate, up = torch.bmm(x, self.quantized_weight("gate_up_proj")).chunk(2, dim=-1)
        h = up * self.act_fn(gate)
        if self.input_observer is not None:
            for expert in range(self.num_experts):
                self.input_observer("down_proj", expert, h[expert])
        h = self.down_proj_input_quantizer(h)
        return torch.bmm(h, self.quantized_weight("down_proj")).view(-1, self.hidden_size)
