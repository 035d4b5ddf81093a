"""NVFP4 fake quantization and packing, docs/numerics.md "NVFP4".

E2M1 elements in blocks of 16 along the last axis, one FP8-E4M3 scale per block, one FP32 global scale.
The dequantized block scale ``S = fp8(s) * s2`` is formed once per block; elements are ``e2m1(|x| / S) * S``
(docs/numerics.md's ``q * s * s2`` with the two scales multiplied first, as the reference library and the
deployment kernels do).

Degenerate scales (the rule we picked, used by the reference functions and the Triton kernel alike):
a block scale that comes out zero becomes 1 and every block scale is clamped to ``[2**-9, 448]`` before the
FP8 cast, as docs/numerics.md states. A global amax at or below 2**-24 (an all-zero tensor, or a quantizer
calibrated on zeros) gives an all-zero output instead of dividing by a zero global scale.
"""

from __future__ import annotations

import torch

from ._blocks import BlockLayout
from ._chunks import map_rows
from .rounding import E4M3, TINY_AMAX, e2m1_index, e2m1_round, e2m1_tables, minifloat_round, true_div

__all__ = [
    "NVFP4_BLOCK",
    "nvfp4_block_scales",
    "nvfp4_fake_quant",
    "nvfp4_global_scale",
    "nvfp4_static_fake_quant",
    "nvfp4_static_scales",
    "nvfp4_static_steps",
    "pack_e2m1",
    "unpack_e2m1",
]

NVFP4_BLOCK = 16
_FP4_X_FP8 = 6.0 * 448.0  # 2688: the largest NVFP4 magnitude times the largest block scale
_MIN_BLOCK_SCALE = 2.0**-9
FP8_MAX = 448.0
FP8_MAX_FOUR_OVER_SIX = 256.0  # block scales normalized to 256 leave room for a 1.5x larger block amax


def nvfp4_global_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """``s2 = global_amax / (6 * 448)`` (``weight_scale_2`` / ``input_scale`` on export)."""
    return true_div(global_amax.float(), _FP4_X_FP8)


def nvfp4_block_scales(block_amax: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """Per-block scale ``fp8(clamp(block_amax / (6 * s2), 2**-9, 448))`` as float32 (zero becomes 1)."""
    s = block_amax / (s2 * 6.0)
    s = s.masked_fill_(s == 0, 1.0).clamp_(_MIN_BLOCK_SCALE, 448.0)
    # the FP8 cast's value (s lies in E4M3's range), several times faster on the CPU than the cast
    return minifloat_round(s, E4M3, out=s)


def nvfp4_fake_quant(
    x: torch.Tensor,
    global_amax: torch.Tensor | None = None,
    block_size: int = NVFP4_BLOCK,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 fake quantization of ``x`` along its last axis.

    ``global_amax`` is the calibrated per-tensor amax; ``None`` takes ``max|x|`` (dynamic). A batch of
    tensors quantized at once (the experts of a ``(experts, out, in)`` weight) takes one global amax per
    tensor, shaped to broadcast against ``x`` with size 1 in the last axis (``(experts, 1, 1)``): each
    tensor's result is the one it gets alone, bit for bit.

    ``out``: a contiguous float32 tensor shaped like ``x`` (whose last axis must then be a multiple of the
    block) that receives the float32 result, so that a caller can reuse one buffer from call to call instead
    of the allocator handing out (and the kernel faulting in) fresh memory each time; the return value is a
    view of it when ``x`` is float32. The arithmetic is the same either way.
    """
    if block_size <= 0:
        raise ValueError(f"block_sizes[-1]={block_size} must be a positive block length (NVFP4: 16)")
    layout = BlockLayout.build(x.shape, {-1: block_size})
    blocks = layout.split(x)
    if out is not None:
        if out.shape != x.shape or not out.is_contiguous() or x.shape[-1] % layout.sizes[0]:
            raise ValueError(
                f"out must be a contiguous tensor of the input's shape {tuple(x.shape)} whose last axis "
                f"is a multiple of the block ({layout.sizes[0]}); got shape {tuple(out.shape)}"
            )
        out = out.view(blocks.shape)
    if global_amax is None:
        global_amax = blocks.abs().amax()
    global_amax = global_amax.to(device=x.device, dtype=torch.float32)
    tiny = global_amax <= TINY_AMAX
    if bool(tiny.all()):
        return torch.zeros_like(x) if out is None else layout.merge(out.zero_()).to(x.dtype)
    s2, zero = nvfp4_global_scale(global_amax), None
    if global_amax.numel() > 1:  # a batch: one scale per block, in the blocks' (row-major) order
        if global_amax.ndim > x.ndim or global_amax.shape[-1:] != (1,):
            raise ValueError(
                f"a global amax of shape {tuple(global_amax.shape)} must broadcast against the input "
                f"{tuple(x.shape)} with size 1 in the last axis, e.g. one per expert as (experts, 1, 1)"
            )
        blocks_per_row = blocks.shape[0] // max(x.numel() // max(x.shape[-1], 1), 1)

        def per_block(t: torch.Tensor) -> torch.Tensor:
            return t.broadcast_to((*x.shape[:-1], 1)).expand(*x.shape[:-1], blocks_per_row).reshape(-1, 1)

        # a tensor of the batch with a zero global amax is all zero (it divides by 1, then is masked)
        zero = per_block(tiny) if bool(tiny.any()) else None
        s2 = per_block(s2 if zero is None else nvfp4_global_scale(global_amax.masked_fill(tiny, 1.0)))

    def quantize_rows(rows: torch.Tensor, out: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
        mag = torch.abs(rows, out=out) if rows.dtype == torch.float32 else out.copy_(rows).abs_()
        # the block amax: non-negative floats (inf and NaN included) order as their int32 bit patterns do,
        # and the integer reduction is several times faster on the CPU than the float one
        block_amax = mag.view(torch.int32).amax(dim=-1, keepdim=True).view(torch.float32)
        step = nvfp4_block_scales(block_amax, s2).mul_(s2)  # dequantized scale
        return e2m1_round(mag.div_(step), out=mag).copysign_(rows).mul_(step)

    out = map_rows(quantize_rows, blocks, s2, out=out)
    if zero is not None:
        out.masked_fill_(zero, 0.0)
    return layout.merge(out).to(x.dtype)


def nvfp4_static_fake_quant(
    x: torch.Tensor,
    block_amax: torch.Tensor,
    global_amax: torch.Tensor,
    fp8_max: float = FP8_MAX,
    block_size: int = NVFP4_BLOCK,
) -> torch.Tensor:
    """NVFP4 fake quantization with a calibrated (static) amax per block.

    ``block_amax`` holds one amax per block of ``block_size`` along the last axis (any shape with that many
    elements); ``global_amax`` is the per-tensor amax. The block scale ``block_amax / 6`` is cast to FP8-E4M3
    on the grid whose largest value ``fp8_max`` corresponds to ``global_amax / 6`` (448, or 256 for
    four-over-six, where a block amax up to 1.75x the global amax still fits); values saturate at 448. A
    block whose scale rounds to zero quantizes to zero. The operations and their order are the reference
    library's (``static_blockwise_fp4_fake_quant``), so results match it bit for bit.
    """
    layout = BlockLayout.build(x.shape, {-1: block_size})
    blocks = layout.split(x)
    if block_amax.numel() != blocks.shape[0]:
        raise ValueError(
            f"block amax has {block_amax.numel()} values but the input splits into {blocks.shape[0]} blocks "
            f"of {block_size} (input shape {tuple(x.shape)})"
        )
    step, zero, _ = nvfp4_static_steps(block_amax.to(device=x.device), global_amax.to(x.device), fp8_max)
    mag = e2m1_round(blocks.float().abs() / step).mul_(step)
    out = torch.where(blocks >= 0, mag, -mag).masked_fill_(zero, 0.0)
    return layout.merge(out).to(x.dtype)


def nvfp4_static_steps(
    block_amax: torch.Tensor, global_amax: torch.Tensor, fp8_max: float = FP8_MAX
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dequantized block scales of static NVFP4 as :func:`nvfp4_static_fake_quant` forms them, one per
    block as ``(num_blocks, 1)`` float32: ``(step, zero, saturated)``, the step each element of the block is
    divided by (1 where the FP8 scale is zero or not finite), whether the block's scale rounds to zero (the
    block quantizes to zero) and whether ``block_amax / 6`` lay above the FP8 grid's 448 (clamped there)."""
    scale = block_amax.to(dtype=torch.float32).reshape(-1, 1) / 6.0
    grid_amax = global_amax.to(device=scale.device, dtype=torch.float32) * (FP8_MAX / fp8_max) / 6.0
    grid = 448.0 / torch.where(grid_amax <= TINY_AMAX, torch.ones_like(grid_amax), grid_amax)
    on_grid = scale * grid
    saturated = on_grid.abs() > 448.0
    scale = on_grid.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).float() * (1 / grid)
    zero = scale == 0
    step = torch.where(zero | ~torch.isfinite(scale), torch.ones_like(scale), scale)
    return step, zero, saturated


def nvfp4_static_scales(
    block_amax: torch.Tensor, global_amax: torch.Tensor, fp8_max: float = FP8_MAX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Export scales of static NVFP4: ``(weight_scale, weight_scale_2)``, the per-block FP8 scale (float32
    values, shaped like ``block_amax``) and ``global_amax / (6 * fp8_max)``, as the reference library writes
    them (a zero block scale becomes 1, then ``block_amax / 6`` over ``global_amax / 6`` times ``fp8_max``
    is clamped to ``[2**-9, 448]`` and cast)."""
    global_amax = global_amax.float()
    s = block_amax.float() / 6.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    s = (s * fp8_max / (global_amax / 6.0)).clamp(min=_MIN_BLOCK_SCALE, max=448.0)
    return s.to(torch.float8_e4m3fn).float(), global_amax / (6.0 * fp8_max)


def pack_e2m1(x_scaled: torch.Tensor) -> torch.Tensor:
    """Pack values already divided by their scale into 4-bit codes, two per byte (even element low).

    Code = ``sign << 3 | index`` into ``(0, .5, 1, 1.5, 2, 3, 4, 6)``; output ``(..., cols / 2)`` uint8. The
    sign bit is the float's, so a negative value that rounds to zero (``-0.0``) is ``0x8``, as NVIDIA
    Model-Optimizer writes it (both decode to zero).
    """
    if x_scaled.shape[-1] % 2:
        raise ValueError(f"E2M1 packing needs an even last dimension, got {tuple(x_scaled.shape)}")
    xf = x_scaled.float()
    code = e2m1_index(xf.abs()).to(torch.uint8)
    code |= torch.signbit(xf).to(torch.uint8) << 3
    code = code.view(*code.shape[:-1], -1, 2)
    return code[..., 0] | (code[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: float32 E2M1 values, last dimension doubled."""
    low, high = packed & 0x0F, packed >> 4
    codes = torch.stack((low, high), dim=-1).flatten(-2).long()
    _, values = e2m1_tables(packed.device)
    mag = values[codes & 0x7]
    return torch.where(codes >= 8, -mag, mag)
