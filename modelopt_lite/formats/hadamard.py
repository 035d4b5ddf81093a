"""The normalized Walsh-Hadamard transform: Sylvester's ``H`` (``H_1 = [1]``, ``H_2n = [[H, H], [H, -H]]``)
scaled by ``1 / sqrt(n)``, which is orthogonal and its own inverse.

:func:`hadamard_transform` applies it to the last dimension of a tensor, in blocks of ``block_size`` (a
power of two dividing that dimension; by default the whole dimension when it is a power of two, else its
largest power-of-two divisor). A quantizer with ``rotate=True`` uses it on its input.
"""

from __future__ import annotations

import math

import torch

__all__ = ["hadamard_block_size", "hadamard_matrix", "hadamard_transform"]


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Sylvester's ``(n, n)`` Hadamard matrix of ``+-1`` (not normalized); ``n`` a power of two."""
    if not _is_pow2(n):
        raise ValueError(f"a Hadamard matrix needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_block_size(dim: int, block_size: int | None = None) -> int:
    """The block the transform of a last dimension of size ``dim`` uses (see the module docstring)."""
    if block_size is None:
        block_size = dim & -dim  # the largest power-of-two divisor (dim itself when a power of two)
        if block_size < 2:
            raise ValueError(
                f"Hadamard rotation: the last dimension {dim} has no power-of-two divisor >= 2; set "
                "rotate={'enable': True, 'block_size': ...} to a power of two dividing it, or do not rotate"
            )
    if not _is_pow2(block_size) or dim % block_size:
        raise ValueError(
            f"Hadamard rotation: block_size={block_size} must be a power of two dividing the last dimension "
            f"{dim} (e.g. {max(dim & -dim, 1)})"
        )
    return block_size


def hadamard_transform(x: torch.Tensor, block_size: int | None = None, fp32: bool = False) -> torch.Tensor:
    """``x`` with each block of ``block_size`` along its last dimension multiplied by ``H / sqrt(block)``;
    same shape and dtype. ``fp32=True`` computes in float32 (else in ``x``'s dtype)."""
    dim = x.shape[-1]
    block = hadamard_block_size(dim, block_size)
    dtype = torch.float32 if fp32 else x.dtype
    h = hadamard_matrix(block, dtype, x.device) / math.sqrt(block)
    y = x.to(dtype).reshape(*x.shape[:-1], dim // block, block) @ h  # H is symmetric: x H = x H^T
    return y.reshape(x.shape).to(x.dtype)
