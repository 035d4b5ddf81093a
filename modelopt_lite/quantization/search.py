"""Helpers shared by the search algorithms (AWQ, MSE, GPTQ): quantize a weight with a throw-away copy of
its quantizer, and the error of a quantized weight on sample inputs."""

from __future__ import annotations

import torch

from ..nn import Quantizer, SequentialQuantizer, TensorQuantizer

__all__ = ["clone_quantizer", "quantize_like"]


def clone_quantizer(q: Quantizer) -> Quantizer:
    """A fresh quantizer with ``q``'s attributes, enabled and uncalibrated."""
    if isinstance(q, SequentialQuantizer):
        return SequentialQuantizer(q.name, [s.attributes for s in q])
    return TensorQuantizer(q.name).set_attributes(q.attributes)


@torch.no_grad()
def quantize_like(q: Quantizer, w: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` fake-quantized by a copy of ``q`` max-calibrated on ``w`` (or given ``amax``)."""
    c = clone_quantizer(q)
    c.calibrate(w)
    if amax is not None and isinstance(c, TensorQuantizer) and c.spec.needs_amax:
        c.amax = amax
    return c(w)
