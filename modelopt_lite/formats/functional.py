"""One entry point over every format: ``fake_quant(x, spec, amax)`` with a straight-through backward, and
``reduce_amax(x, spec)``, the statistic a calibrator collects for that spec.

On CUDA tensors the Triton kernels of :mod:`.triton_kernels` run when triton is installed and the layout is
one they cover; everything else runs the pure-PyTorch reference functions, which the kernels match bit for
bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._blocks import BlockLayout
from .fp8 import fp8_fake_quant
from .integer import int_fake_quant
from .mx import mx_fake_quant
from .nvfp4 import nvfp4_fake_quant
from .spec import FormatSpec

__all__ = ["fake_quant", "fake_quant_reference", "reduce_amax", "reduce_axes"]


def reduce_axes(spec: FormatSpec, ndim: int) -> tuple[int, ...] | None:
    """Axes a per-tensor / per-channel amax reduces over (``None`` for per-block specs)."""
    if spec.block_axes and spec.kind in ("int", "fp8"):
        return None
    if spec.axis is None or spec.kind == "nvfp4":
        return tuple(range(ndim))
    keep = spec.axis if isinstance(spec.axis, tuple) else (spec.axis,)
    for a in keep:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis={spec.axis!r} is out of range for a {ndim}-D input")
    keep_pos = {a % ndim for a in keep}
    return tuple(d for d in range(ndim) if d not in keep_pos)


def reduce_amax(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """The amax of ``x`` with the shape the spec's quantizer stores (float32).

    Per tensor: a scalar; per channel: ``keepdim`` shape; static blocks: ``(num_blocks, 1)``;
    NVFP4: the per-tensor (global) amax.
    """
    mag = x.detach().abs().float()
    axes = reduce_axes(spec, x.ndim)
    if axes is None:
        layout = BlockLayout.build(x.shape, spec.block_sizes)
        return layout.split(mag).amax(dim=-1, keepdim=True)
    if len(axes) == x.ndim:
        return mag.amax()
    return mag.amax(dim=axes, keepdim=True)


def _elementwise(spec: FormatSpec) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if spec.kind == "int":
        return lambda v, a: int_fake_quant(v, a, spec.num_bits, spec.unsigned, spec.narrow_range)
    return lambda v, a: fp8_fake_quant(v, a, spec.num_bits)


def fake_quant_reference(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None = None) -> torch.Tensor:
    """The pure-PyTorch reference (any device, no autograd handling)."""
    if spec.kind == "nvfp4":
        return nvfp4_fake_quant(x, amax, spec.block_axes[0][1])
    if spec.kind == "mx":
        return mx_fake_quant(x, spec.num_bits, spec.block_axes[0][1])
    fn = _elementwise(spec)
    if not spec.block_axes:
        if amax is None:
            raise ValueError(f"{spec.name} {spec.granularity} needs a calibrated amax")
        return fn(x, amax)
    layout = BlockLayout.build(x.shape, spec.block_sizes)
    blocks = layout.split(x)
    if spec.dynamic:
        amax = blocks.detach().abs().amax(dim=-1, keepdim=True)
    elif amax is None:
        raise ValueError(f"{spec.name} {spec.granularity} needs a calibrated amax per block")
    elif amax.numel() != blocks.shape[0]:
        raise ValueError(
            f"amax has {amax.numel()} values but the input splits into {blocks.shape[0]} blocks "
            f"({spec.granularity}, input shape {tuple(x.shape)})"
        )
    return layout.merge(fn(blocks, amax.reshape(-1, 1)))


def _dispatch(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None) -> torch.Tensor:
    if x.is_cuda:
        from . import triton_kernels

        out = triton_kernels.try_fake_quant(x, spec, amax)
        if out is not None:
            return out
    return fake_quant_reference(x, spec, amax)


def _clip_amax(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None):
    """The calibrated amax broadcast against ``x`` for clipped backward; ``None`` when nothing clips."""
    if amax is None or spec.kind == "mx" or (spec.dynamic and spec.kind != "nvfp4"):
        return None
    amax = amax.detach()
    if spec.block_axes and spec.kind != "nvfp4":
        layout = BlockLayout.build(x.shape, spec.block_sizes)
        per_block = amax.reshape(-1, 1).expand(layout.num_blocks(), layout.block_numel)
        return layout.merge(per_block.contiguous())
    return amax


class _FakeQuantSTE(torch.autograd.Function):
    """Fake quantization forward; straight-through backward (identity, or zero where |x| > amax)."""

    @staticmethod
    def forward(ctx, x, spec, amax, clip_amax):  # type: ignore[override]
        if clip_amax is not None:
            ctx.save_for_backward(x, clip_amax)
        ctx.clip = clip_amax is not None
        return _dispatch(x, spec, amax)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        if not ctx.clip:
            return grad_out, None, None, None
        x, clip_amax = ctx.saved_tensors
        inside = x.abs() <= clip_amax.to(x.dtype)
        return grad_out * inside, None, None, None


def fake_quant(
    x: torch.Tensor,
    spec: FormatSpec,
    amax: torch.Tensor | None = None,
    clip_gradient: bool = False,
) -> torch.Tensor:
    """Fake-quantize ``x`` (same dtype and shape out) with a straight-through-estimator backward.

    ``clip_gradient=True`` zeroes the gradient where ``|x| > amax`` (the calibrated amax: per tensor, per
    channel, per static block, or NVFP4's global amax); a dynamic amax never clips.
    """
    clip_amax = _clip_amax(x, spec, amax) if clip_gradient and x.requires_grad else None
    if not torch.is_grad_enabled() or not x.requires_grad:
        return _dispatch(x, spec, amax)
    return _FakeQuantSTE.apply(x, spec, amax, clip_amax)
