"""The reference library's ``TensorQuantizer`` methods that have a direct counterpart here:
``set_from_attribute_config``, ``step_size``, the rotation queries (``rotate_is_enabled``, ...,
``disable_rotate``) and SVDQuant's ``svdquant_lora_a`` / ``svdquant_lora_b``. One implementation: each is
written on :meth:`TensorQuantizer.configure`, the validated attributes and the quantizer's buffers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ...logging import get_logger
from ..errors import InvalidValueError
from .attribute_dict import attribute_updates

if TYPE_CHECKING:
    from ...formats import FormatSpec
    from .attributes import QuantizerAttributes

__all__ = ["ReferenceQuantizerMethods"]

logger = get_logger(__name__)


class ReferenceQuantizerMethods:
    """Mixed into :class:`~.tensor_quantizer.TensorQuantizer`."""

    name: str
    _attrs: QuantizerAttributes
    _spec: FormatSpec
    _rotation: dict[str, Any] | None
    amax: torch.Tensor | None

    def configure(self, **attributes: Any) -> Any:  # (TensorQuantizer's)
        raise NotImplementedError

    def set_attributes(self, attributes: QuantizerAttributes) -> Any:  # (TensorQuantizer's)
        raise NotImplementedError

    def set_from_attribute_config(self, attribute_cfg: Mapping[str, Any]) -> None:
        """Set attributes from ``attribute_cfg``, in the reference's vocabulary: a
        ``QuantizerAttributeConfig`` sets every attribute (its defaults included), a dict only those it
        names (``{"num_bits": 4}``, ``{"axis": -1}``; ``block_sizes`` clears ``axis``; ``{"enable":
        False}`` alone also stops a rotation). Validated together, as :meth:`configure`: a bad value
        raises and changes nothing."""
        full = getattr(attribute_cfg, "attributes", None)  # a QuantizerAttributeConfig (the floor above)
        if callable(full) and not isinstance(attribute_cfg, dict):
            self.set_attributes(full())
            return
        if not isinstance(attribute_cfg, Mapping):
            raise TypeError(
                f"{self.name}: set_from_attribute_config takes a QuantizerAttributeConfig or a dict of "
                f"attributes, got {type(attribute_cfg).__name__}"
            )
        updates = attribute_updates(attribute_cfg, self.name)
        if updates.get("block_sizes") is not None and "axis" not in updates:
            updates["axis"] = None  # block_sizes and axis exclude each other (the reference clears axis)
        if dict(attribute_cfg) == {"enable": False}:
            updates["rotate"] = self._rotate_off()
        self.configure(**updates)

    @property
    def step_size(self) -> torch.Tensor | None:
        """The integer quantization step, ``amax / max_bound`` (``None``, with a WARNING, without an amax);
        ``ValueError`` for formats that are not integers."""
        if self._spec.kind != "int":
            raise ValueError(
                f"{self.name}: step_size is defined for integer formats only, not {self._spec.name}"
            )
        amax = self.amax
        if amax is None:
            logger.warning("%s: step_size is undefined without an amax (dynamic amax)", self.name)
            return None
        bits = int(self._spec.num_bits)  # type: ignore[arg-type]
        return amax / (2.0 ** (bits - 1 + int(self._spec.unsigned)) - 1.0)

    # ----------------------------------------------------------------------- rotation
    @property
    def rotate_is_enabled(self) -> bool:
        """Whether the input is rotated (``rotate`` on)."""
        return self._rotation is not None

    @property
    def rotate_is_fp32(self) -> bool:
        return self._rotation is not None and bool(self._rotation["rotate_fp32"])

    @property
    def rotate_block_size(self) -> int | None:
        return None if self._rotation is None else self._rotation["block_size"]

    @property
    def rotate_back_is_enabled(self) -> bool:
        return self._rotation is not None and self._rotation["mode"] == "rotate_back"

    def _rotate_off(self) -> bool | dict[str, Any]:
        """``rotate`` with the rotation off, keeping its form (a dict keeps its other settings)."""
        rotate = self._attrs.rotate
        return {**rotate, "enable": False} if isinstance(rotate, Mapping) else False

    def disable_rotate(self) -> None:
        """Stop rotating the input (idempotent); a ``rotate`` dict keeps its other settings."""
        self.configure(rotate=self._rotate_off())

    # ----------------------------------------------------------------------- SVDQuant's low-rank branch
    @property
    def svdquant_lora_a(self) -> torch.Tensor | None:
        """SVDQuant's ``A`` (rank, in) of a weight quantizer's low-rank branch (the buffer
        ``_svdquant_lora_a``), or ``None``. The branch runs once both ``A`` and ``B`` are set."""
        return self._lowrank("a")

    @svdquant_lora_a.setter
    def svdquant_lora_a(self, value: Any) -> None:
        self._set_lowrank("a", value)

    @property
    def svdquant_lora_b(self) -> torch.Tensor | None:
        """SVDQuant's ``B`` (out, rank), the buffer ``_svdquant_lora_b``, or ``None``."""
        return self._lowrank("b")

    @svdquant_lora_b.setter
    def svdquant_lora_b(self, value: Any) -> None:
        self._set_lowrank("b", value)

    def _lowrank(self, which: str) -> torch.Tensor | None:
        return self._buffers.get(f"_svdquant_lora_{which}")  # type: ignore[attr-defined]

    def _set_lowrank(self, which: str, value: Any) -> None:
        """Set (a copy of) ``value``: a new buffer, or copied into the existing one of the same shape."""
        name = f"svdquant_lora_{which}"
        if value is None:
            raise InvalidValueError(
                f"{self.name}: {name} cannot be set to None; remove the branch with delattr(quantizer, "
                f"'_{name}') on both factors"
            )
        value = torch.as_tensor(value).detach()
        current = self._lowrank(which)
        if current is None:
            self.register_buffer(f"_{name}", value.clone())  # type: ignore[attr-defined]
        elif current.shape != value.shape:
            raise RuntimeError(
                f"{self.name}: {name} has shape {tuple(current.shape)}; setting one of shape "
                f"{tuple(value.shape)} is not allowed (the rank and the layer's size are fixed)"
            )
        else:
            current.copy_(value.to(current.device, current.dtype))
