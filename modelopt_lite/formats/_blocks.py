"""Views of a tensor as rows of quantization blocks, and back.

A block layout is described by ``block_sizes``: ``{axis: size}`` for one or two axes. ``size=None`` means the
whole axis (one block per row of that axis: per-token quantization when the axis is the last one). A length
that is not a multiple of the block is padded with zeros; the padding is dropped again by :func:`merge`.

Blocks are numbered in row-major order over the block grid, so a tensor of shape ``(R, C)`` with
``{-1: 128}`` has ``R * ceil(C / 128)`` blocks and its per-block amax has shape ``(R * ceil(C / 128), 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["BlockLayout", "normalize_block_axes"]


def normalize_block_axes(block_sizes: dict[int, int | None], ndim: int) -> dict[int, int | None]:
    """Map negative axes to positive ones and check them against ``ndim``."""
    out: dict[int, int | None] = {}
    for axis, size in block_sizes.items():
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"block_sizes axis {axis} is out of range for a {ndim}-D tensor "
                f"(allowed: {-ndim}..{ndim - 1})"
            )
        out[axis % ndim] = size
    return out


@dataclass(frozen=True)
class BlockLayout:
    """How a tensor of ``shape`` splits into blocks along at most two axes."""

    shape: tuple[int, ...]
    axes: tuple[int, ...]  # positive, sorted ascending
    sizes: tuple[int, ...]  # resolved block sizes, same order as axes

    @classmethod
    def build(cls, shape: torch.Size | tuple[int, ...], block_sizes: dict[int, int | None]):
        shape = tuple(shape)
        norm = normalize_block_axes(block_sizes, len(shape))
        if not 1 <= len(norm) <= 2:
            raise ValueError(
                f"block_sizes must name one or two axes, got {sorted(norm)} "
                "(e.g. {-1: 128} or {-1: 128, -2: 128})"
            )
        axes = tuple(sorted(norm))
        sizes = []
        for axis in axes:
            size = norm[axis]
            size = shape[axis] if size is None else size
            sizes.append(max(int(size), 1))
        return cls(shape, axes, tuple(sizes))

    @property
    def block_numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def _padded(self) -> tuple[int, ...]:
        padded = list(self.shape)
        for axis, size in zip(self.axes, self.sizes, strict=True):
            padded[axis] = -(-self.shape[axis] // size) * size
        return tuple(padded)

    def num_blocks(self) -> int:
        total = 1
        for s in self._padded():
            total *= s
        return total // self.block_numel

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` as a ``(num_blocks, block_numel)`` tensor (a view when no copy is needed)."""
        padded = self._padded()
        if padded != self.shape:
            pad: list[int] = []
            for axis in reversed(range(x.ndim)):
                pad += [0, padded[axis] - self.shape[axis]]
            x = F.pad(x, pad)
        if len(self.axes) == 1:
            (axis,) = self.axes
            if axis != x.ndim - 1:
                x = x.movedim(axis, -1)
            return x.reshape(-1, self.sizes[0])
        a0, a1 = self.axes
        # Move the two block axes to the end, split each into (grid, block), group the blocks.
        x = x.movedim((a0, a1), (-2, -1))
        lead = x.shape[:-2]
        g0, g1 = x.shape[-2] // self.sizes[0], x.shape[-1] // self.sizes[1]
        x = x.reshape(*lead, g0, self.sizes[0], g1, self.sizes[1])
        x = x.transpose(-3, -2)
        return x.reshape(-1, self.block_numel)

    def merge(self, blocks: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`split`: back to ``shape``, padding removed."""
        padded = self._padded()
        if len(self.axes) == 1:
            (axis,) = self.axes
            # the block axis last (no list.pop(axis): torch.compile may see ``axis`` as a symbolic int)
            moved = [s for i, s in enumerate(padded) if i != axis] + [padded[axis]]
            x = blocks.reshape(moved)
            if axis != len(padded) - 1:
                x = x.movedim(-1, axis)
        else:
            a0, a1 = self.axes
            lead = [s for i, s in enumerate(padded) if i not in (a0, a1)]
            g0, g1 = padded[a0] // self.sizes[0], padded[a1] // self.sizes[1]
            x = blocks.reshape(*lead, g0, g1, self.sizes[0], self.sizes[1]).transpose(-3, -2)
            x = x.reshape(*lead, padded[a0], padded[a1]).movedim((-2, -1), (a0, a1))
        if padded != self.shape:
            x = x[tuple(slice(0, s) for s in self.shape)]
        return x
