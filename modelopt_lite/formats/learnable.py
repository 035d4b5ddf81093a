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
block, and static NVFP4's per-block amax (its FP8 block scales). Dynamic NVFP4 and MX block scales are
computed from the data, and so is NVFP4's global amax of a dynamic quantizer.

Static NVFP4 (``block_sizes`` ``{-1: 16, "type": "static", "scale_bits": (4, 3)}``, e.g. the weights of
``NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG``) learns its block amax as nvidia-modelopt's tied LSQ does
(``method: lsq``, ``tied_amax: true``; arXiv:1902.08153): the forward is the static fake quant bit for bit,
``out = S * e2m1(x / S)`` with the block's step ``S = fp8(block_amax / 6 on the global amax's grid)``; the
backward is straight-through for the E2M1 rounding (zero where ``|x| / S > 6``, the reference's
``fp4_cast_ste``) and for the FP8 rounding of the scale (``dS / d block_amax = 1 / 6``, zero where the scale
saturated at 448, as its clipped ``scaled_e4m3``), so ``d out / d block_amax = (out - x) / (6 S)`` inside
the range and ``out / (6 S)`` where ``x`` was clipped, summed over the block's elements. The global amax is
not learned (a buffer, as in the reference): under the straight-through FP8 cast it only sets the grid of the
block scales and its gradient is zero. A block whose scale rounds to zero (output zero) gets no gradient.
"""

from __future__ import annotations

import torch

from ._blocks import BlockLayout
from .functional import broadcast_amax, dispatch_fake_quant, reduce_like_amax
from .integer import int_bounds
from .nvfp4 import nvfp4_static_steps
from .rounding import TINY_AMAX, e2m1_round
from .spec import FormatSpec

__all__ = ["fake_quant_learnable", "learnable_amax_error"]


def learnable_amax_error(spec: FormatSpec) -> str | None:
    """Why ``spec`` cannot have a learnable amax (``None`` when it can)."""
    if spec.static_nvfp4:
        return None
    if spec.kind in ("nvfp4", "mx"):
        return (
            f"{spec.name} {spec.granularity} has no amax to learn: its block scales are computed from each "
            "block's data (and NVFP4's global amax cancels out of every element under the straight-through "
            "estimator); learn_amax applies to static INT / FP8 quantizers (per tensor, channel or block) "
            "and to static NVFP4 block scales (block_sizes {-1: 16, 'type': 'static', 'scale_bits': (4, 3)}, "
            "e.g. the weights of NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG)"
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


class _LearnableStaticNVFP4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, amax, global_amax, spec):  # type: ignore[override]
        ctx.spec = spec
        ctx.save_for_backward(x, amax, global_amax)
        return dispatch_fake_quant(x, spec, amax.detach(), global_amax)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, amax, global_amax = ctx.saved_tensors
        spec = ctx.spec
        layout = BlockLayout.build(x.shape, spec.block_sizes)
        step, zero, saturated = nvfp4_static_steps(amax.detach(), global_amax, spec.nvfp4_fp8_max)
        v = layout.split(x).float() / step  # x / S, per block row
        inside = (v.abs() <= 6.0) & ~zero
        g = layout.split(grad_out).float()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = layout.merge(g.masked_fill(~inside, 0.0)).to(x.dtype)
        grad_amax = None
        if ctx.needs_input_grad[1]:
            q = e2m1_round(v.abs()).copysign_(v)  # the E2M1 value of each element (clipped at 6)
            d_out = torch.where(inside, q - v, q).div_(6.0)  # d out / d S * dS / d block_amax
            d_out.masked_fill_(zero | saturated, 0.0)
            grad_amax = (d_out * g).sum(dim=-1, keepdim=True).reshape(amax.shape).to(amax.dtype)
        return grad_x, grad_amax, None, None


def fake_quant_learnable(
    x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor, global_amax: torch.Tensor | None = None
) -> torch.Tensor:
    """Fake-quantize ``x`` with ``amax`` (a static amax of ``spec``'s shape) so that gradients reach both
    ``x`` and ``amax`` (module docstring). ``global_amax``: static NVFP4's per-tensor amax (``None``: the
    largest block amax, as the plain fake quant takes it; never learned). Raises ``ValueError`` for a spec
    without a learnable amax."""
    reason = learnable_amax_error(spec)
    if reason is not None:
        raise ValueError(reason)
    if spec.static_nvfp4:
        if global_amax is None:
            global_amax = amax.detach().amax()
        if not torch.is_grad_enabled() or not (x.requires_grad or amax.requires_grad):
            return dispatch_fake_quant(x, spec, amax.detach(), global_amax)
        return _LearnableStaticNVFP4.apply(x, amax, global_amax.detach(), spec)
    if not torch.is_grad_enabled() or not (x.requires_grad or amax.requires_grad):
        return dispatch_fake_quant(x, spec, amax.detach())
    return _LearnableAmaxFakeQuant.apply(x, amax, spec)
