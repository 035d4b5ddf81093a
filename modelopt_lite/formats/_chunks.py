"""Row-chunked evaluation of elementwise fake-quant on CPU.

A fake-quant formula is several elementwise passes (scale, round, clamp, rescale). On CPU, running all of
them on a cache-sized slice before moving to the next slice reads and writes main memory once instead of
once per pass: two to three times the throughput on large tensors, with bit-identical results (each
element's arithmetic is unchanged). Other devices get the whole tensor in one call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["CHUNK_ELEMENTS", "map_rows"]

#: elements per slice: 1 MiB of float32, which stays in a typical per-core L2 cache
CHUNK_ELEMENTS = 1 << 18

RowFn = Callable[..., torch.Tensor]


def map_rows(
    fn: RowFn, x2d: torch.Tensor, *params: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``fn(rows, out_rows, *params_rows)`` over slices of the rows of ``x2d``; returns the float32 output.

    Each of ``params`` is ``None``, a 0-dim tensor shared by every row, or a tensor with one leading entry
    per row (sliced with the rows). ``fn`` writes its result for the slice into ``out_rows`` (a float32 view)
    and returns it. ``out``: a float32 tensor shaped like ``x2d`` to write into (and return) instead of a new
    one, e.g. a buffer reused from step to step.
    """
    rows, cols = x2d.shape
    given = out is not None
    if out is None:
        out = torch.empty(x2d.shape, dtype=torch.float32, device=x2d.device)
    elif out.shape != x2d.shape or out.dtype != torch.float32 or out.device != x2d.device:
        raise ValueError(
            f"out must be a float32 tensor of shape {tuple(x2d.shape)} on {x2d.device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if x2d.device.type != "cpu" or x2d.numel() <= CHUNK_ELEMENTS:
        res = fn(x2d, out, *params)
        return out.copy_(res) if given and res.data_ptr() != out.data_ptr() else res
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    per_row = [p is not None and p.ndim > 0 and p.shape[0] == rows for p in params]
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        sliced = [p[start:stop] if r else p for p, r in zip(params, per_row, strict=True)]
        res = fn(x2d[start:stop], out[start:stop], *sliced)
        if res.data_ptr() != out[start:stop].data_ptr():  # fn returned a new tensor: keep its result
            out[start:stop].copy_(res)
    return out
