"""``SequentialQuantizer``: two or more quantizers applied one after the other to the same tensor.

A config rule whose ``cfg`` is a list (``W4A8_AWQ_BETA_CFG``: INT4 blocks, then FP8 per tensor) installs one
in the quantizer's slot. Each stage is an ordinary :class:`TensorQuantizer` named ``<slot>.<i>``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .quantizer_attributes import QuantizerAttributes
from .tensor_quantizer import TensorQuantizer

__all__ = ["SequentialQuantizer"]


class SequentialQuantizer(nn.ModuleList):
    """Stages run in order; calibrating from a tensor calibrates stage ``i`` on stage ``i - 1``'s output."""

    def __init__(self, *args: str | Sequence[QuantizerAttributes] | TensorQuantizer):
        """``SequentialQuantizer(name, [attributes, ...])`` (one stage per attributes), or the reference's
        ``SequentialQuantizer(*quantizers)`` (the given :class:`TensorQuantizer` objects are the stages)."""
        if args and isinstance(args[0], str):
            if len(args) != 2:
                raise TypeError("SequentialQuantizer(name, attributes) takes a name and a list of attributes")
            name, attributes = args
            if len(attributes) < 2:
                raise ValueError(
                    f"{name}: a sequential quantizer needs two or more stages, got {len(attributes)}"
                )
            stages = [TensorQuantizer(f"{name}.{i}").set_attributes(a) for i, a in enumerate(attributes)]
        else:
            name, stages = "SequentialQuantizer", list(args)
            bad = [type(q).__name__ for q in stages if not isinstance(q, TensorQuantizer)]
            if not stages or bad:
                raise TypeError(
                    f"SequentialQuantizer(*quantizers) takes TensorQuantizer objects, got {bad or 'none'}"
                )
        super().__init__(stages)
        self.name = name

    @property
    def name(self) -> str:
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        self._name = value
        for i, q in enumerate(self):
            q.name = f"{value}.{i}"

    @property
    def is_enabled(self) -> bool:
        return any(q.is_enabled for q in self)

    @property
    def _quant_enabled(self) -> bool:
        """Whether fake quantization is on (for code that checks a slot without knowing its type)."""
        return any(q._quant_enabled for q in self)

    def enable(self) -> None:
        for q in self:
            q.enable()

    def disable(self) -> None:
        for q in self:
            q.disable()

    def calibrate(self, x: torch.Tensor) -> SequentialQuantizer:
        for q in self:
            q.calibrate(x)
            with torch.no_grad():
                x = q(x)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for q in self:
            x = q(x)
        return x

    def extra_repr(self) -> str:
        return " -> ".join(q.extra_repr() for q in self)
