"""Views of a tensor as rows of quantization blocks, and back.

A block layout is described by ``block_sizes``: ``{axis: size}`` for one or two axes. ``size=None`` means the
whole axis (one block per row of that axis: per-token quantization when the axis is the last one). A length
that is not a multiple of the block is padded with zeros; the padding is dropped again by :func:`merge`.

Blocks are numbered in row-major order over the block grid: the tensor's axes in their order, each blocked
axis counted in blocks (``ceil(length / size)``). A per-block amax has the reference library's shape
(:meth:`BlockLayout.amax_shape`): ``(num_blocks, 1)`` for blocks along the last axis alone (a tensor of
shape ``(R, C)`` with ``{-1: 128}``: ``(R * ceil(C / 128), 1)``); otherwise the tensor's shape with each
blocked axis split into ``(blocks, 1)`` (``(R, C)`` with ``{-1: 128, -2: 128}``:
``(ceil(R / 128), 1, ceil(C / 128), 1)``); and with every size ``None`` (whole axes), the tensor's shape with
those axes 1 (a per-channel amax).
Releases before issue 46 numbered blocks with the unblocked axes first and stored a ``(num_blocks, 1)`` amax;
:meth:`BlockLayout.from_flat_amax` converts such an amax.
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
    whole: bool = False  # every size was None (whole axes): the amax is a per-channel one

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
        return cls(shape, axes, tuple(sizes), all(norm[a] is None for a in axes))

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

    def _last_axis_only(self) -> bool:
        return len(self.axes) == 1 and self.axes[0] == len(self.shape) - 1

    def grid(self) -> tuple[int, ...]:
        """Blocks per axis (the length of an axis without blocks), in the tensor's axis order."""
        padded = self._padded()
        return tuple(
            padded[d] // self.sizes[self.axes.index(d)] if d in self.axes else padded[d]
            for d in range(len(self.shape))
        )

    def amax_shape(self) -> tuple[int, ...]:
        """The shape of a per-block amax (the reference library's; see the module docstring)."""
        grid = self.grid()
        if self.whole:
            return () if len(self.axes) == len(self.shape) else grid
        if self._last_axis_only():
            return (self.num_blocks(), 1)
        shape: list[int] = []
        for d, g in enumerate(grid):
            shape += [g, 1] if d in self.axes else [g]
        return tuple(shape)

    def from_flat_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """A ``(num_blocks, 1)`` amax of releases before issue 46 (blocks numbered with the unblocked axes
        first, then the blocked ones) as an amax of :meth:`amax_shape` (same values, this numbering)."""
        if amax.numel() != self.num_blocks():
            raise ValueError(
                f"amax has {amax.numel()} values but a tensor of shape {self.shape} splits into "
                f"{self.num_blocks()} blocks"
            )
        grid, ndim = self.grid(), len(self.shape)
        rest = [d for d in range(ndim) if d not in self.axes]
        old = amax.reshape([grid[d] for d in rest] + [grid[d] for d in self.axes])
        return old.movedim(tuple(range(len(rest), ndim)), self.axes).reshape(self.amax_shape())

    def _expanded(self) -> tuple[list[int], list[int], list[int]]:
        """The padded shape with each blocked axis split into ``(blocks, size)``, and the positions in it of
        the grid dimensions and of the in-block ones (each in axis order)."""
        padded = self._padded()
        expanded: list[int] = []
        grid_dims: list[int] = []
        block_dims: list[int] = []
        for d, n in enumerate(padded):
            grid_dims.append(len(expanded))
            if d in self.axes:
                size = self.sizes[self.axes.index(d)]
                block_dims.append(len(expanded) + 1)
                expanded += [n // size, size]
            else:
                expanded.append(n)
        return expanded, grid_dims, block_dims

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` as a ``(num_blocks, block_numel)`` tensor (a view when no copy is needed)."""
        padded = self._padded()
        if padded != self.shape:
            pad: list[int] = []
            for axis in reversed(range(x.ndim)):
                pad += [0, padded[axis] - self.shape[axis]]
            x = F.pad(x, pad)
        if self._last_axis_only():
            return x.reshape(-1, self.sizes[0])
        expanded, grid_dims, block_dims = self._expanded()
        return x.reshape(expanded).permute(grid_dims + block_dims).reshape(-1, self.block_numel)

    def merge(self, blocks: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`split`: back to ``shape``, padding removed."""
        padded = self._padded()
        if self._last_axis_only():
            x = blocks.reshape(padded)
        else:
            expanded, grid_dims, block_dims = self._expanded()
            order = grid_dims + block_dims
            inverse = [order.index(i) for i in range(len(order))]
            x = blocks.reshape([expanded[i] for i in order]).permute(inverse).reshape(padded)
        if padded != self.shape:
            x = x[tuple(slice(0, s) for s in self.shape)]
        return x
