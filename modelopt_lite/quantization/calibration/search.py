"""Helpers shared by the search algorithms (AWQ, MSE, local Hessian, GPTQ): quantize a weight with a
throw-away copy of its quantizer, and the output error of a weight error block by block
(``d_b^T (X_b^T X_b) d_b``)."""

from __future__ import annotations

import torch

from ...nn import Quantizer, SequentialQuantizer, TensorQuantizer

__all__ = ["block_gram", "block_weighted_error", "clone_quantizer", "quantize_like"]


def clone_quantizer(q: Quantizer) -> Quantizer:
    """A fresh quantizer with ``q``'s attributes, enabled and uncalibrated (and, like the quantizers the
    search algorithms work on, raising when run without an amax)."""
    if isinstance(q, SequentialQuantizer):
        clone: Quantizer = SequentialQuantizer(q.name, [s.attributes for s in q])
    else:
        clone = TensorQuantizer(q.name).set_attributes(q.attributes)
    clone.calibration_expected = True
    return clone


@torch.no_grad()
def quantize_like(q: Quantizer, w: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` fake-quantized by a copy of ``q`` max-calibrated on ``w`` (or given ``amax``)."""
    c = clone_quantizer(q)
    c.calibrate(w)
    if amax is not None and isinstance(c, TensorQuantizer) and c.spec.needs_amax:
        c.amax = amax
    return c(w)


def block_gram(xb: torch.Tensor) -> torch.Tensor:
    """``X_b^T X_b`` of every block of input channels: ``xb`` is ``(rows, blocks, block)``, the result
    ``(blocks, block, block)`` (float32)."""
    xb = xb.float()
    return torch.einsum("tnb,tnc->nbc", xb, xb)


def block_weighted_error(db: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``d_b^T G_b d_b`` for every output row and block of a weight error ``db`` ``(out, blocks, block)``
    with the blocks' Gram matrices ``gram`` ``(blocks, block, block)``: ``(out, blocks)``. Summed over the
    blocks of a row it is that output channel's squared error on the inputs behind ``gram``, restricted to
    the diagonal blocks of ``X^T X``."""
    return torch.einsum("onb,nbc,onc->on", db, gram, db)
