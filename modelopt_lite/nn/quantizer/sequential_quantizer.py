"""``SequentialQuantizer``: two or more quantizers applied one after the other to the same tensor.

A config rule whose ``cfg`` is a list (``W4A8_AWQ_BETA_CFG``: INT4 blocks, then FP8 per tensor) installs one
in the quantizer's slot, of a weight or of an activation. Each stage is an ordinary :class:`TensorQuantizer`
named ``<slot>.<i>``. As in the reference it is an ``nn.Sequential`` (indexing, ``len``, iteration), and
setting ``amax`` or ``fake_quant`` on it sets every stage.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..errors import InvalidValueError
from .attributes import QuantizerAttributes
from .tensor_quantizer import TensorQuantizer

__all__ = ["SequentialQuantizer"]


class SequentialQuantizer(nn.Sequential):
    """Stages run in order. Calibrating an activation over data gives every stage the statistics of the raw
    input (fake quantization is off while statistics are collected, as in the reference); :meth:`calibrate`
    from a tensor (how weights are calibrated) calibrates stage ``i`` on stage ``i - 1``'s output."""

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
        super().__init__(*stages)
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
    def calibration_expected(self) -> bool:
        """Whether the stages are meant to be calibrated (see :class:`TensorQuantizer`)."""
        return any(q.calibration_expected for q in self)

    @calibration_expected.setter
    def calibration_expected(self, value: bool) -> None:
        for q in self:
            q.calibration_expected = value

    # The reference's delegation: properties read from the first stage, methods run on every stage.
    @property
    def amax(self) -> torch.Tensor | None:
        return self[0].amax

    @amax.setter
    def amax(self, value: torch.Tensor | float) -> None:
        """Give every stage this amax (the reference's delegation); ``None`` raises: use
        :meth:`reset_amax` to forget the stages' amax."""
        if value is None:
            raise InvalidValueError(
                f"{self.name}: amax cannot be set to None; call reset_amax() to forget it"
            )
        for q in self:
            q.amax = value

    @property
    def fake_quant(self) -> bool:
        return self[0].fake_quant

    @fake_quant.setter
    def fake_quant(self, value: bool) -> None:
        for q in self:
            q.fake_quant = value

    def reset_amax(self) -> None:
        for q in self:
            q.reset_amax()

    def disable_rotate(self) -> None:
        for q in self:
            q.disable_rotate()

    def load_calib_amax(self, *args: Any, **kwargs: Any) -> None:
        for q in self:
            q.load_calib_amax(*args, **kwargs)

    def load_calib_bias(self) -> None:
        for q in self:
            q.load_calib_bias()

    def set_from_attribute_config(self, attributes: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """One attribute mapping for every stage, or a list of one per stage."""
        if isinstance(attributes, Mapping) or callable(getattr(attributes, "attributes", None)):
            attributes = [attributes] * len(self)
        if not isinstance(attributes, Sequence) or len(attributes) != len(self):
            raise ValueError(
                f"{self.name}: set_from_attribute_config takes one attribute mapping or a list of "
                f"{len(self)} (one per stage)"
            )
        for q, cfg in zip(self, attributes, strict=True):
            q.set_from_attribute_config(cfg)

    @staticmethod
    @contextmanager
    def convert_to_single_quantizer(model: nn.Module, indx: int = 0) -> Iterator[None]:
        """Within the block, every :class:`SequentialQuantizer` of ``model`` is replaced by its stage
        ``indx`` (e.g. to calibrate that stage alone); the sequential quantizers are put back on exit, also
        when the block raises."""
        found = [(n, m) for n, m in model.named_modules() if isinstance(m, SequentialQuantizer)]
        short = [n for n, m in found if not -len(m) <= indx < len(m)]
        if short:
            raise IndexError(f"convert_to_single_quantizer: {short[0]} has no stage {indx}")
        swapped: list[tuple[nn.Module, str, SequentialQuantizer]] = []
        try:
            for name, seq in found:
                parent_name, _, slot = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, slot, seq[indx])
                swapped.append((parent, slot, seq))
            yield
        finally:
            for parent, slot, seq in reversed(swapped):
                setattr(parent, slot, seq)

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
