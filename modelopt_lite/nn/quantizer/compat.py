"""The reference library's ``TensorQuantizer`` methods that have a direct counterpart here:
``set_from_attribute_config``, ``step_size`` and the rotation queries (``rotate_is_enabled``, ...,
``disable_rotate``). One implementation: each is written on :meth:`TensorQuantizer.configure` and the
validated attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ...logging import get_logger
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
