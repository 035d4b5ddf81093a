"""Triton kernels for the hot formats: INT-k and FP8 with one amax per row (per tensor, per channel on
axis 0, per block, per token) and NVFP4. They reproduce the reference functions bit for bit:

* true divisions use ``div_rn`` (IEEE round-to-nearest), not the fast approximate division;
* round-half-to-even is done with the ``(v + 1.5 * 2**23) - 1.5 * 2**23`` identity on values clamped to
  the grid range first (clamping before rounding gives the same result for integer bounds);
* outputs are written in float32 and cast to the input dtype by PyTorch (round-to-nearest-even), the same
  final cast the reference does, instead of relying on the kernel's own narrowing store;
* FP8 E4M3 / E5M2 rounding is done arithmetically on the exponent bits rather than by a cast, so the
  kernel does not depend on hardware FP8 conversion (and runs in ``TRITON_INTERPRET=1`` on CPU tensors,
  where the tests exercise it).

``try_fake_quant`` is called for CUDA tensors only and returns ``None`` when triton is missing or the
layout is not one the kernels cover; the caller then runs the reference.
"""

from __future__ import annotations

import torch

from .._blocks import BlockLayout
from ..fp8 import fp8_spec
from ..integer import int_bounds
from ..rounding import TINY_AMAX
from ..spec import FormatSpec

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # triton is the optional "gpu" extra
    AVAILABLE = False

__all__ = ["AVAILABLE", "fp8_rows", "int_rows", "nvfp4_rows", "try_fake_quant"]

_BLOCK_COLS = 1024
_NVFP4_BLOCKS_PER_PROGRAM = 64

if AVAILABLE:
    _RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: v + M - M rounds |v| <= 2**22 half to even
    _TINY = tl.constexpr(TINY_AMAX)

    @triton.jit
    def _round_half_even(v):
        return (v + _RNE_MAGIC) - _RNE_MAGIC

    @triton.jit
    def _round_minifloat(a, MIN_EXP: tl.constexpr, MAN_BITS: tl.constexpr, MAX_VALUE: tl.constexpr):
        """Round non-negative a to the minifloat grid (ties to even), saturating at MAX_VALUE."""
        a = tl.minimum(a, MAX_VALUE)
        exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        exp = tl.maximum(exp, MIN_EXP)
        step = ((exp - MAN_BITS + 127) << 23).to(tl.float32, bitcast=True)
        inv_step = ((127 - exp + MAN_BITS) << 23).to(tl.float32, bitcast=True)
        return _round_half_even(a * inv_step) * step

    @triton.jit
    def _load_row_tile(x_ptr, amax_ptr, n_cols, AMAX_PER_ROW: tl.constexpr, BLOCK: tl.constexpr):
        """This program's tile of one row (float32), its offsets and mask, and the row's amax."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        offs = row.to(tl.int64) * n_cols + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if AMAX_PER_ROW:
            amax = tl.load(amax_ptr + row).to(tl.float32)
        else:
            amax = tl.load(amax_ptr).to(tl.float32)
        return x, amax, offs, mask

    @triton.jit
    def _int_rows_kernel(
        x_ptr, amax_ptr, out_ptr, n_cols,
        MIN_BOUND: tl.constexpr, MAX_BOUND: tl.constexpr, AMAX_PER_ROW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        x, amax, offs, mask = _load_row_tile(x_ptr, amax_ptr, n_cols, AMAX_PER_ROW, BLOCK)
        tiny = amax <= _TINY
        scale = tl.math.div_rn(tl.full((), MAX_BOUND, tl.float32), tl.where(tiny, 1.0, amax))
        v = tl.minimum(tl.maximum(x * scale, MIN_BOUND), MAX_BOUND)
        out = tl.math.div_rn(_round_half_even(v), scale)
        out = tl.where(tiny, 0.0, out)
        tl.store(out_ptr + offs, out, mask=mask)

    @triton.jit
    def _fp8_rows_kernel(
        x_ptr, amax_ptr, out_ptr, n_cols,
        MIN_EXP: tl.constexpr, MAN_BITS: tl.constexpr, MAX_VALUE: tl.constexpr,
        AMAX_PER_ROW: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        x, amax, offs, mask = _load_row_tile(x_ptr, amax_ptr, n_cols, AMAX_PER_ROW, BLOCK)
        amax = tl.where(amax <= _TINY, 1.0, amax)
        scale = tl.math.div_rn(tl.full((), 1.0, tl.float32), amax) * MAX_VALUE
        v = x * scale
        q = _round_minifloat(tl.abs(v), MIN_EXP, MAN_BITS, MAX_VALUE)
        q = tl.where(v < 0, -q, q)
        out = q * tl.math.div_rn(tl.full((), 1.0, tl.float32), scale)
        tl.store(out_ptr + offs, out, mask=mask)

    @triton.jit
    def _e2m1_round(a):
        return tl.where(
            a <= 0.25, 0.0,
            tl.where(a < 0.75, 0.5,
            tl.where(a <= 1.25, 1.0,
            tl.where(a < 1.75, 1.5,
            tl.where(a <= 2.5, 2.0,
            tl.where(a < 3.5, 3.0,
            tl.where(a <= 5.0, 4.0, 6.0)))))))  # fmt: skip

    @triton.jit
    def _nvfp4_kernel(x_ptr, gamax_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr, BS: tl.constexpr):
        blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        offs = blk.to(tl.int64)[:, None] * BS + tl.arange(0, BS)[None, :]
        mask = (blk < n_blocks)[:, None]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gamax = tl.load(gamax_ptr).to(tl.float32)
        s2 = tl.math.div_rn(gamax, tl.full((), 2688.0, tl.float32))
        mag = tl.abs(x)
        bamax = tl.max(mag, axis=1)
        s = tl.math.div_rn(bamax, s2 * 6.0)
        s = tl.where(s == 0.0, 1.0, s)
        s = tl.minimum(tl.maximum(s, 0.001953125), 448.0)
        s = _round_minifloat(s, -6, 3, 448.0)[:, None]
        step = s * s2
        q = _e2m1_round(tl.math.div_rn(mag, step))
        q = tl.where(x < 0, -q, q)
        out = q * step
        out = tl.where(gamax <= _TINY, 0.0, out)
        tl.store(out_ptr + offs, out, mask=mask)


def _require() -> None:
    if not AVAILABLE:
        raise RuntimeError("triton is not installed: pip install 'modelopt_lite[gpu]'")


def _amax_arg(amax: torch.Tensor, rows: int) -> tuple[torch.Tensor, bool]:
    amax = amax.detach().float().contiguous()
    if amax.numel() == 1:
        return amax.reshape(1), False
    if amax.numel() != rows:
        raise ValueError(f"amax has {amax.numel()} values for {rows} rows")
    return amax.reshape(rows), True


def int_rows(x2d: torch.Tensor, amax: torch.Tensor, num_bits: int, unsigned: bool = False,
             narrow_range: bool = False) -> torch.Tensor:  # fmt: skip
    """INT fake quant of a contiguous 2-D tensor with one amax per row (or one scalar)."""
    _require()
    lo, hi = int_bounds(num_bits, unsigned, narrow_range)
    amax, per_row = _amax_arg(amax, x2d.shape[0])
    out = torch.empty_like(x2d, dtype=torch.float32)
    grid = (x2d.shape[0], triton.cdiv(x2d.shape[1], _BLOCK_COLS))
    _int_rows_kernel[grid](x2d, amax, out, x2d.shape[1], lo, hi, per_row, _BLOCK_COLS)
    return out.to(x2d.dtype)


def fp8_rows(x2d: torch.Tensor, amax: torch.Tensor, num_bits: tuple[int, int] = (4, 3)) -> torch.Tensor:
    """FP8 fake quant of a contiguous 2-D tensor with one amax per row (or one scalar)."""
    _require()
    spec, _ = fp8_spec(num_bits)
    amax, per_row = _amax_arg(amax, x2d.shape[0])
    out = torch.empty_like(x2d, dtype=torch.float32)
    grid = (x2d.shape[0], triton.cdiv(x2d.shape[1], _BLOCK_COLS))
    _fp8_rows_kernel[grid](
        x2d, amax, out, x2d.shape[1], spec.min_exp, spec.man_bits, spec.max_value, per_row,
        _BLOCK_COLS,
    )  # fmt: skip
    return out.to(x2d.dtype)


def nvfp4_rows(x: torch.Tensor, global_amax: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """NVFP4 fake quant of a contiguous tensor whose last dimension is a multiple of ``block_size``."""
    _require()
    n_blocks = x.numel() // block_size
    gamax = global_amax.detach().float().reshape(1).contiguous()
    out = torch.empty_like(x, dtype=torch.float32)
    grid = (triton.cdiv(n_blocks, _NVFP4_BLOCKS_PER_PROGRAM),)
    _nvfp4_kernel[grid](x, gamax, out, n_blocks, _NVFP4_BLOCKS_PER_PROGRAM, block_size)
    return out.to(x.dtype)


def try_fake_quant(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None) -> torch.Tensor | None:
    """Run a kernel when one covers this spec and layout; ``None`` otherwise."""
    if not AVAILABLE or not x.is_contiguous() or x.numel() == 0 or x.ndim < 1:
        return None
    if spec.kind == "nvfp4":
        bs = spec.block_axes[0][1]
        if amax is None or bs is None or x.shape[-1] % bs or amax.numel() != 1 or spec.static_nvfp4:
            return None
        return nvfp4_rows(x, amax, bs)
    if spec.kind not in ("int", "fp8") or spec.unsigned:
        return None
    if spec.block_axes:
        if len(spec.block_axes) != 1 or spec.block_axes[0][0] not in (-1, x.ndim - 1):
            return None
        layout = BlockLayout.build(x.shape, spec.block_sizes)
        if x.shape[-1] % layout.sizes[0]:
            return None
        x2d = x.reshape(-1, layout.sizes[0])
        if spec.dynamic:
            amax = x2d.abs().amax(dim=-1).float()
        if amax is None or amax.numel() != x2d.shape[0]:
            return None
    elif amax is not None and amax.numel() == 1:
        x2d = x.reshape(-1, x.shape[-1])
    elif amax is not None and spec.axis in (0, -x.ndim) and amax.numel() == x.shape[0]:
        x2d = x.reshape(x.shape[0], -1)
    else:
        return None
    if spec.kind == "int":
        out = int_rows(x2d, amax, spec.num_bits, spec.unsigned, spec.narrow_range)
    else:
        out = fp8_rows(x2d, amax, spec.num_bits)
    return out.view(x.shape)
