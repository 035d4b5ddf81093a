"""Fake quantization with a learnable amax (``learn_amax=True``): LSQ-style gradients for the clipping range.

The forward is exactly :func:`.functional.fake_quant` (bit for bit: same formulas, same kernels). The
backward treats rounding as the identity (straight-through) and differentiates the scale:

* with respect to ``x``: the gradient passes where ``x`` lies inside the clipping range
  ``[lo * amax, amax]`` and is zero where it was clipped (PACT's clipped straight-through estimator);
  ``lo = min_bound / max_bound`` (``-128 / 127`` for INT8, ``-1`` for FP8 and narrow-range integers, ``0``
  for unsigned ones);
* with respect to ``amax`` (LSQ): ``out = s * round(x / s)`` with ``s = amax / max_bound`` gives
  ``d out / d amax = (out - x) / amax`` inside the range and ``out / amax`` where ``x`` was clipped; the
  gradients of all elements that share an amax (the tensor, a channel, a block) are summed. An amax at or
  below 2**-24 (whose output is zero) gets no gradient.

Only static amax have something to learn: integer and FP8 quantizers per tensor, per channel or per static
block. NVFP4's global amax does not qualify (under the straight-through estimator it cancels out of every
element: each block scale is the block's own maximum divided by 6), and dynamic or MX block scales are
computed from the data.
"""

from __future__ import annotations

import torch

from .functional import broadcast_amax, dispatch_fake_quant, reduce_like_amax
from .integer import int_bounds
from .rounding import TINY_AMAX
from .spec import FormatSpec

__all__ = ["fake_quant_learnable", "learnable_amax_error"]


def learnable_amax_error(spec: FormatSpec) -> str | None:
    """Why ``spec`` cannot have a learnable amax (``None`` when it can)."""
    if spec.kind in ("nvfp4", "mx"):
        return (
            f"{spec.name} {spec.granularity} has no amax to learn: its block scales are computed from each "
            "block's data (and NVFP4's global amax cancels out of every element under the straight-through "
            "estimator); learn_amax applies to static INT / FP8 quantizers (per tensor, channel or block)"
        )
    if spec.dynamic:
        return (
            f"{spec.name} {spec.granularity} has no amax to learn: a dynamic scale is computed from the "
            "input at every call; use a static quantizer (no 'type': 'dynamic') with learn_amax"
        )
    return None


def _low_ratio(spec: FormatSpec) -> float:
    """``min_bound / max_bound`` of the grid: the lower clipping edge is ``low_ratio * amax``."""
    if spec.kind == "int":
        lo, hi = int_bounds(spec.num_bits, spec.unsigned, spec.narrow_range)
        return lo / hi
    return -1.0


class _LearnableAmaxFakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, amax, spec):  # type: ignore[override]
        ctx.spec = spec
        ctx.save_for_backward(x, amax)
        return dispatch_fake_quant(x, spec, amax.detach())

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, amax = ctx.saved_tensors
        spec = ctx.spec
        # recomputed instead of saved: one weight-sized tensor less held between forward and backward
        out = dispatch_fake_quant(x, spec, amax.detach()).float()
        xf = x.float()
        a = broadcast_amax(x, spec, amax.detach().float())
        clipped = (xf > a) | (xf < a * _low_ratio(spec))
        grad_x = grad_out.masked_fill(clipped, 0) if ctx.needs_input_grad[0] else None
        grad_amax = None
        if ctx.needs_input_grad[1]:
            d_out = torch.where(clipped, out, out - xf).div_(a.clamp_min(TINY_AMAX))
            d_out.masked_fill_(a <= TINY_AMAX, 0)
            grad_amax = reduce_like_amax(d_out.mul_(grad_out.float()), spec, "sum")
            grad_amax = grad_amax.reshape(amax.shape).to(amax.dtype)
        return grad_x, grad_amax, None


def fake_quant_learnable(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor) -> torch.Tensor:
    """Fake-quantize ``x`` with ``amax`` (a static amax of ``spec``'s shape) so that gradients reach both
    ``x`` and ``amax`` (module docstring). Raises ``ValueError`` for a spec without a learnable amax."""
    reason = learnable_amax_error(spec)
    if reason is not None:
        raise ValueError(reason)
    if not torch.is_grad_enabled() or not (x.requires_grad or amax.requires_grad):
        return dispatch_fake_quant(x, spec, amax.detach())
    return _LearnableAmaxFakeQuant.apply(x, amax, spec)
