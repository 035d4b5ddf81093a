"""One entry point over every format: ``fake_quant(x, spec, amax)`` with a straight-through backward, and
``reduce_amax(x, spec)``, the statistic a calibrator collects for that spec.

On CUDA tensors the Triton kernels (:mod:`.kernels.triton_kernels`) run when triton is installed and the
layout is one they cover; everything else runs the pure-PyTorch reference functions, which the kernels match
bit for bit.
"""

from __future__ import annotations

import torch

from ._blocks import BlockLayout
from ._chunks import map_rows
from .fp8 import fp8_apply, fp8_scales, fp8_spec
from .integer import check_unsigned, int_apply, int_bounds, int_scale_keep
from .kernels import fused, native
from .mx import mx_fake_quant
from .nvfp4 import nvfp4_fake_quant, nvfp4_static_fake_quant
from .spec import FormatSpec

__all__ = [
    "broadcast_amax",
    "dispatch_fake_quant",
    "fake_quant",
    "fake_quant_reference",
    "out_supported",
    "reduce_amax",
    "reduce_axes",
    "reduce_like_amax",
    "takes_out",
]


def reduce_axes(spec: FormatSpec, ndim: int) -> tuple[int, ...] | None:
    """Axes a per-tensor / per-channel amax reduces over (``None`` for per-block specs)."""
    if spec.block_axes and (spec.kind in ("int", "fp8") or spec.static_nvfp4):
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

    Per tensor: a scalar; per channel: ``keepdim`` shape; static blocks (static NVFP4 included): the
    reference library's shape, :meth:`BlockLayout.amax_shape` (``(num_blocks, 1)`` for blocks along the last
    axis; e.g. ``(R / 128, 1, C / 128, 1)`` for ``{-1: 128, -2: 128}``); NVFP4: the per-tensor (global) amax.
    """
    return reduce_like_amax(x.detach().abs().float(), spec, "amax")


def reduce_like_amax(x: torch.Tensor, spec: FormatSpec, op: str = "sum") -> torch.Tensor:
    """Reduce ``x`` (``"sum"`` or ``"amax"``) to the shape of the spec's amax: one value per amax element
    (e.g. the squared quantization error that each per-channel / per-block amax is responsible for)."""
    axes = reduce_axes(spec, x.ndim)
    if axes is None:
        layout = BlockLayout.build(x.shape, spec.block_sizes)
        return getattr(layout.split(x), op)(dim=-1, keepdim=True).reshape(layout.amax_shape())
    if len(axes) == x.ndim:
        return getattr(x, op)()
    return getattr(x, op)(dim=axes, keepdim=True)


def _prepared(spec: FormatSpec, amax: torch.Tensor, device: torch.device):
    """``(fn, params)``: the INT / FP8 formula of ``spec`` with its scales computed once from ``amax``."""
    if spec.kind == "int":
        bounds = int_bounds(spec.num_bits, spec.unsigned, spec.narrow_range)
        scale, keep = int_scale_keep(amax, bounds[1], device)
        return (lambda v, o, s, k: int_apply(v, s, k, bounds, o)), (scale, keep)
    fp8, _ = fp8_spec(spec.num_bits)
    return (lambda v, o, s, r: fp8_apply(v, s, r, fp8, o)), fp8_scales(amax, fp8, device)


def _dynamic(spec: FormatSpec):
    """Row function for dynamic blocks: each block's amax is taken from the slice being quantized."""

    def fn(v: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        apply, params = _prepared(spec, v.abs().amax(dim=-1, keepdim=True), v.device)
        return apply(v, o, *params)

    return fn


def _rows(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A (rows, cols) view of ``x`` with one amax per row (or one in all), when the layout allows it."""
    if not x.is_contiguous():
        return None
    if amax.numel() == 1:
        return x.reshape(-1, 1), amax.reshape(())
    if spec.axis in (0, -x.ndim) and amax.numel() == x.shape[0]:
        return x.reshape(x.shape[0], -1), amax.reshape(-1, 1)
    return None


def _static_nvfp4(
    x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None, global_amax: torch.Tensor | None
) -> torch.Tensor:
    if amax is None:
        raise ValueError(f"{spec.name} {spec.granularity} needs a calibrated amax per block")
    if global_amax is None:  # the global amax a max calibration gives: the largest block amax
        global_amax = amax.detach().amax()
    return nvfp4_static_fake_quant(x, amax, global_amax, spec.nvfp4_fp8_max, spec.block_axes[0][1])


def out_supported(x: torch.Tensor, spec: FormatSpec) -> bool:
    """Whether :func:`fake_quant_reference` writes its result for ``x`` into a given ``out`` (a contiguous
    float32 CPU tensor shaped like ``x``, returned as is when ``x`` is float32): INT / FP8 per tensor or with
    one amax per row of a contiguous input, and NVFP4 (dynamic block scales, one global amax or a batch of
    them) whose last axis splits into whole blocks, contiguous or not (e.g. transposed expert weights).
    Elsewhere ``out`` is ignored and a new tensor is returned."""
    if x.device.type != "cpu" or spec.static_nvfp4 or spec.kind == "mx":
        return False
    if spec.kind == "nvfp4":
        return x.ndim > 0 and x.shape[-1] % spec.block_axes[0][1] == 0
    return x.is_contiguous() and not spec.block_axes and (spec.axis is None or spec.axis in (0, -x.ndim))


def takes_out(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None) -> bool:
    """Whether :func:`dispatch_fake_quant` writes its result for ``x`` into a given ``out``: where the native
    CPU kernel takes the call (any layout it covers) or where the reference does (:func:`out_supported`)."""
    return out_supported(x, spec) or native.takes(x, spec, amax)


def fake_quant_reference(
    x: torch.Tensor,
    spec: FormatSpec,
    amax: torch.Tensor | None = None,
    global_amax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The pure-PyTorch reference (any device, no autograd handling). ``global_amax``: static NVFP4's
    per-tensor amax (``None``: the largest block amax). ``out``: a contiguous float32 tensor shaped like
    ``x`` to write the float32 result into where :func:`out_supported` says so (same arithmetic; e.g. a buffer
    kept from step to step) and, for a float32 ``x``, return itself (not a view of it: the output of an
    autograd function may then be modified in place); ignored elsewhere."""
    if out is not None and not out_supported(x, spec):
        out = None
    if spec.static_nvfp4:
        return _static_nvfp4(x, spec, amax, global_amax)
    if spec.kind == "nvfp4":
        res = nvfp4_fake_quant(x, amax, spec.block_axes[0][1], out=out)
        return out if out is not None and x.dtype == torch.float32 else res  # ``out`` holds res
    if spec.kind == "mx":
        return mx_fake_quant(x, spec.num_bits, spec.block_axes[0][1])
    if spec.kind == "int":
        check_unsigned(x, spec.unsigned)
    if not spec.block_axes:
        if spec.dynamic and amax is None:
            amax = reduce_amax(x, spec)
        if amax is None:
            raise ValueError(f"{spec.name} {spec.granularity} needs a calibrated amax")
        rows = _rows(x, spec, amax)
        if rows is None:  # any other broadcastable amax: one pass over the whole tensor
            apply, params = _prepared(spec, amax, x.device)
            return apply(x, None, *params).to(x.dtype)
        apply, params = _prepared(spec, rows[1], x.device)
        into = None if out is None else out.view(rows[0].shape)
        res = map_rows(apply, rows[0], *params, out=into).view(x.shape).to(x.dtype)
        return out if out is not None and x.dtype == torch.float32 else res  # ``out`` itself, not a view
    layout = BlockLayout.build(x.shape, spec.block_sizes)
    blocks = layout.split(x)
    if spec.dynamic:
        return layout.merge(map_rows(_dynamic(spec), blocks)).to(x.dtype)
    if amax is None:
        raise ValueError(f"{spec.name} {spec.granularity} needs a calibrated amax per block")
    if amax.numel() != blocks.shape[0]:
        raise ValueError(
            f"amax has {amax.numel()} values but the input splits into {blocks.shape[0]} blocks "
            f"({spec.granularity}, input shape {tuple(x.shape)})"
        )
    apply, params = _prepared(spec, amax.reshape(-1, 1), x.device)
    return layout.merge(map_rows(apply, blocks, *params)).to(x.dtype)


def dispatch_fake_quant(
    x: torch.Tensor,
    spec: FormatSpec,
    amax: torch.Tensor | None,
    global_amax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fake quant without autograd: the Triton kernel on CUDA where it applies; on CPU the native kernel of
    :mod:`.kernels.native` (into ``out`` when given), else the fused (compiled) kernel of
    :mod:`.kernels.fused` when turned on, where they apply; else the reference (into ``out`` where it supports
    one)."""
    if spec.dynamic and not spec.block_axes and spec.kind in ("int", "fp8"):
        amax = reduce_amax(x, spec)  # dynamic per tensor / per axis: this input's own amax
    if x.is_cuda:
        from .kernels import triton_kernels

        res = triton_kernels.try_fake_quant(x, spec, amax)
        if res is not None:
            return res
    else:
        res = native.try_native_fake_quant(x, spec, amax, global_amax, out)
        if res is not None:
            return res
        res = fused.try_fused_fake_quant(
            x, spec, amax, global_amax, lambda: fake_quant_reference(x, spec, amax, global_amax)
        )
        if res is not None:
            return res
    return fake_quant_reference(x, spec, amax, global_amax, out)


def broadcast_amax(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor) -> torch.Tensor:
    """A static amax (per tensor, per channel or per block) as a tensor that broadcasts against ``x``:
    per-block amax are expanded to the elements of their blocks."""
    if spec.block_axes and (spec.kind in ("int", "fp8") or spec.static_nvfp4):
        layout = BlockLayout.build(x.shape, spec.block_sizes)
        per_block = amax.reshape(-1, 1).expand(layout.num_blocks(), layout.block_numel)
        return layout.merge(per_block.contiguous())
    return amax


def _clip_amax(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None):
    """The calibrated amax broadcast against ``x`` for clipped backward; ``None`` when nothing clips."""
    if amax is None or spec.kind == "mx" or (spec.dynamic and spec.kind != "nvfp4"):
        return None
    return broadcast_amax(x, spec, amax.detach())


def alias_of(t: torch.Tensor) -> torch.Tensor:
    """A new tensor on ``t``'s memory (same offset, shape and strides), for an autograd Function whose result
    lies in a buffer it was given: autograd turns an argument returned as it is (or a view of one) into a
    view, which callers could not modify in place."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


class _FakeQuantSTE(torch.autograd.Function):
    """Fake quantization forward; straight-through backward (identity, or zero where |x| > amax)."""

    @staticmethod
    def forward(ctx, x, spec, amax, clip_amax, global_amax, out):  # type: ignore[override]
        if clip_amax is not None:
            ctx.save_for_backward(x, clip_amax)
        ctx.clip = clip_amax is not None
        res = dispatch_fake_quant(x, spec, amax, global_amax, out)
        return alias_of(out) if out is not None and res is out else res

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        if not ctx.clip:
            return grad_out, None, None, None, None, None
        x, clip_amax = ctx.saved_tensors
        inside = x.abs() <= clip_amax.to(x.dtype)
        return grad_out * inside, None, None, None, None, None


def fake_quant(
    x: torch.Tensor,
    spec: FormatSpec,
    amax: torch.Tensor | None = None,
    clip_gradient: bool = False,
    global_amax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fake-quantize ``x`` (same dtype and shape out) with a straight-through-estimator backward.

    ``clip_gradient=True`` zeroes the gradient where ``|x| > amax`` (the calibrated amax: per tensor, per
    channel, per static block, or NVFP4's global amax); a dynamic amax never clips. ``global_amax``: the
    per-tensor amax of static NVFP4 (whose ``amax`` is per block). ``out``: a contiguous float32 tensor
    shaped like ``x`` that the eager CPU formulas write the result into where :func:`out_supported` says
    so (a float32 ``x`` then gets a view of it back), e.g. a buffer kept from step to step; nothing the
    backward needs is kept in it (the straight-through backward saves the input, and only when clipped).
    """
    clip_amax = _clip_amax(x, spec, amax) if clip_gradient and x.requires_grad else None
    if not torch.is_grad_enabled() or not x.requires_grad:
        return dispatch_fake_quant(x, spec, amax, global_amax, out)
    return _FakeQuantSTE.apply(x, spec, amax, clip_amax, global_amax, out)
