"""``TensorQuantizer``: the module that fake-quantizes one tensor (a weight, an input, a KV projection).

Its attributes (what they mean, how they are validated): :mod:`.attributes`; its buffers: :mod:`.buffers`;
its calibration methods: :mod:`.calibration`.

A static quantizer without an amax: one built by hand (``TensorQuantizer(...)``, ``QuantLinear(16, 8)``) and
not calibrated quantizes each input with that input's own amax (per tensor, channel or block), as the
reference library does. The quantizers :func:`mtq.quantize` inserts are meant to be calibrated
(``calibration_expected``): there a missing amax raises, naming the quantizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

import torch

from ...formats import (
    BlockLayout,
    FormatSpec,
    fake_quant,
    fake_quant_learnable,
    hadamard_transform,
    reduce_amax,
)
from ...formats.functional import takes_out
from ...formats.integer import UnsignedNegativeInputError, check_unsigned
from ...logging import get_logger
from ..calibrators import BiasCalibrator, Calibrator, bias_settings, make_calibrator
from . import shared_outputs
from .attributes import QuantizerAttributes
from .buffers import QuantizerBuffers
from .calibration import QuantizerCalibration, build_calibrator
from .compat import ReferenceQuantizerMethods

__all__ = ["QuantizerAttributes", "TensorQuantizer"]

_BACKWARDS = ("pass_through", "clipped")
logger = get_logger(__name__)


class TensorQuantizer(ReferenceQuantizerMethods, QuantizerCalibration, QuantizerBuffers):
    """Fake-quantize a tensor in one format; calibrate its amax; keep it in ``state_dict``.

    ``calibration_expected``: ``False`` for a quantizer built by hand, which without an amax quantizes each
    input with its own amax (the reference's behaviour); :func:`mtq.quantize` sets it on the quantizers it
    inserts, which then raise until calibrated (or given an amax)."""

    #: Hand the fake quant this quantizer computed for an input to the next quantizer that gets the very same
    #: tensor with the same format and amax (q / k / v, gate / up projections; see :mod:`.shared_outputs`).
    #: ``False`` makes every quantizer compute its own (the same values).
    share_outputs: bool = True

    def __init__(
        self,
        quant_attribute_cfg: Mapping[str, Any] | str | None = None,
        if_quant: bool = True,
        if_calib: bool = False,
        amax: torch.Tensor | float | None = None,
        *,
        name: str = "TensorQuantizer",
        **attributes: Any,
    ):
        """``TensorQuantizer("input_quantizer", num_bits=8)`` (a name and attributes) or the reference's
        ``TensorQuantizer(QuantizerAttributeConfig(...), if_quant, if_calib, amax)``: an attribute mapping in
        the reference's vocabulary, whether fake quantization and calibration start on, and an amax."""
        super().__init__()
        self.calibration_expected = False
        if isinstance(quant_attribute_cfg, str):
            name, quant_attribute_cfg = quant_attribute_cfg, None
        self._name = name
        self._attrs = QuantizerAttributes()
        self._spec = self._attrs.spec()
        self._bias_calibrator: BiasCalibrator | None = None
        self._rotation: dict[str, Any] | None = None
        self._quant_enabled = True
        self._calib_enabled = False
        self._calibrator: Calibrator = make_calibrator("max", self._spec, name)
        pre_quant_scale = attributes.pop("pre_quant_scale", None)
        if quant_attribute_cfg is not None:
            if attributes:
                raise ValueError(f"{name}: give attributes as quant_attribute_cfg or as keywords, not both")
            from .attribute_dict import quantizer_attributes  # (it builds on this module)

            enable = (
                quant_attribute_cfg.get("enable", True) if isinstance(quant_attribute_cfg, Mapping) else True
            )
            self.set_attributes(quantizer_attributes(quant_attribute_cfg, enable, name))
        else:
            self.configure(**attributes)
        if pre_quant_scale is not None:
            self.pre_quant_scale = pre_quant_scale
        if amax is not None:
            self.amax = amax
        self._quant_enabled, self._calib_enabled = bool(if_quant), bool(if_calib)

    # ----------------------------------------------------------------------- attributes
    def configure(self, **attributes: Any) -> TensorQuantizer:
        """Validate and apply attributes (unknown names raise); returns ``self``."""
        known = set(QuantizerAttributes.__dataclass_fields__)
        unknown = sorted(set(attributes) - known - {"pre_quant_scale"})
        if unknown:
            raise ValueError(
                f"{self.name}: unknown quantizer attribute(s) {unknown} (allowed: {sorted(known)})"
            )
        if "pre_quant_scale" in attributes:
            self.pre_quant_scale = attributes.pop("pre_quant_scale")
        new = replace(self._attrs, **attributes)
        if new.backward not in _BACKWARDS:
            raise ValueError(f"{self.name}: backward={new.backward!r} (allowed: {_BACKWARDS})")
        for flag in ("unsigned", "narrow_range", "enable", "fake_quant"):
            if not isinstance(getattr(new, flag), bool):
                raise ValueError(f"{self.name}: {flag}={getattr(new, flag)!r} must be True or False")
        try:
            spec = new.spec()
            calibrator = build_calibrator(new, spec, self.name)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{self.name}: {err}") from None
        if spec != self._spec:
            self._store_amax(None)  # an amax of another format / granularity means nothing here
        pinned = new.pinned_amax
        if pinned is not None and (pinned != self._attrs.pinned_amax or self._amax is None):
            device = next((b.device for b in self.buffers()), None)
            self._store_amax(torch.tensor(float(pinned), dtype=torch.float32, device=device))
        learn_changed = new.learn_amax != self._attrs.learn_amax
        if new.bias != self._attrs.bias:
            self._bias_value, self._bias_calibrator = None, None
            if new.bias is not None:
                axes, method, _ = bias_settings(new.bias)
                self._bias_calibrator = BiasCalibrator(method, axes)
        self._attrs, self._spec, self._calibrator = new, spec, calibrator
        self._rotation = new.rotation()
        if learn_changed and self._amax is not None:
            self._store_amax(self.amax.detach().clone())  # a buffer becomes a Parameter, or back
        return self

    def set_attributes(self, attributes: QuantizerAttributes) -> TensorQuantizer:
        """Replace every attribute at once (a config rule with ``cfg`` does this); returns ``self``."""
        if not isinstance(attributes, QuantizerAttributes):
            raise TypeError(f"{self.name}: expected QuantizerAttributes, got {type(attributes).__name__}")
        return self.configure(**{k: getattr(attributes, k) for k in QuantizerAttributes.__dataclass_fields__})

    @property
    def attributes(self) -> QuantizerAttributes:
        return self._attrs

    @property
    def name(self) -> str:
        """The quantizer's dotted path in its model (set on insertion); used in every message."""
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        self._name = value
        self._calibrator.owner = value

    @property
    def spec(self) -> FormatSpec:
        return self._spec

    def __getattr__(self, name: str) -> Any:
        if name in QuantizerAttributes.__dataclass_fields__:
            return getattr(self.__dict__["_attrs"], name)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in QuantizerAttributes.__dataclass_fields__ and "_attrs" in self.__dict__:
            self.configure(**{name: value})
        else:
            super().__setattr__(name, value)

    def attribute_dict(self) -> dict[str, Any]:
        return asdict(self._attrs)

    # ----------------------------------------------------------------------- amax (held by QuantizerBuffers)
    def reset_amax(self) -> None:
        """Forget the amax (and, as in the reference, the bias) and the statistics collected so far."""
        self._store_amax(None)
        self._calibrator.reset()
        self.reset_bias()

    def convert_flat_block_amax(self, shape: torch.Size | tuple[int, ...]) -> bool:
        """Give a ``(num_blocks, 1)`` block amax, as releases before issue 46 stored every block amax (blocks
        numbered with the unblocked axes first), the shape and block order of the reference library for an
        input of ``shape`` (e.g. ``(R / 128, 1, C / 128, 1)`` for ``{-1: 128, -2: 128}``); the values of
        each block stay. Returns whether the amax was converted. A forward converts it too (from its input's
        shape); :func:`mto.restore` converts those of weights right after loading."""
        spec, amax = self._spec, self._amax
        if (
            amax is None
            or not spec.block_axes
            or spec.dynamic
            or spec.kind not in ("int", "fp8")
            or amax.dim() != 2
            or amax.shape[1] != 1
            or hasattr(amax, "placements")  # (a DTensor shard: left as it is)
        ):
            return False
        layout = BlockLayout.build(tuple(shape), spec.block_sizes)
        if tuple(amax.shape) == layout.amax_shape() or amax.numel() != layout.num_blocks():
            return False  # (already this layout's; or of another count: fake quant raises naming it)
        with torch.no_grad():
            converted = layout.from_flat_amax(amax.detach())
        logger.info(
            "%s: block amax %s (the layout of releases before issue 46) converted to %s",
            self.name, tuple(amax.shape), tuple(converted.shape),
        )  # fmt: skip
        self._store_amax(converted.clone())
        return True

    # ----------------------------------------------------------------------- modes
    def enable(self) -> None:
        self.configure(enable=True)

    def disable(self) -> None:
        self.configure(enable=False)

    @property
    def is_enabled(self) -> bool:
        return self._attrs.enable

    @property
    def transforms_input(self) -> bool:
        """Whether this quantizer changes its input: it quantizes, or (enabled or not) it applies a
        ``pre_quant_scale`` or a rotation. What folding it into a weight must bake in."""
        return self._attrs.enable or self._pre_quant_scale is not None or self._rotation is not None

    def mark_folded(self) -> None:
        """After its output was written into the weight (:func:`mtq.fold_weight`): quantize no more, and
        apply neither the ``pre_quant_scale`` nor the rotation again (both are in the folded weight)."""
        self.configure(enable=False, rotate=self._rotate_off())
        self.pre_quant_scale = None

    def enable_quant(self) -> None:
        self._quant_enabled = True

    def disable_quant(self) -> None:
        self._quant_enabled = False

    def enable_calib(self) -> None:
        self._calib_enabled = True

    def disable_calib(self) -> None:
        self._calib_enabled = False

    # ----------------------------------------------------------------------- input transforms
    def _transform(self, x: torch.Tensor) -> torch.Tensor:
        """``pre_quant_scale`` (SmoothQuant / AWQ smoothing, folded into the weight: part of the layer's
        math), then the rotation; both apply whether or not this quantizer quantizes."""
        if self._pre_quant_scale is not None:
            x = x * self._pre_quant_scale.to(x.dtype)
        return self._rotate(x)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self._rotation is None:
            return x
        try:
            return hadamard_transform(x, self._rotation["block_size"], self._rotation["rotate_fp32"])
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from None

    # ----------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._quantize(self._transform(x))
        if self._rotation is not None and self._rotation["mode"] == "rotate_back":
            out = self._rotate(out)
        return out

    def _quantize(self, x: torch.Tensor) -> torch.Tensor:
        if not self._attrs.enable or x.numel() == 0:
            return x
        if self._calib_enabled:
            if self._spec.kind == "int":
                check_unsigned(x, self._attrs.unsigned, self.name)
            if self._attrs.type == "static":
                self._collect(x)
        if not self._quant_enabled:
            return x
        if not self._attrs.fake_quant:
            raise NotImplementedError(
                f"{self.name}: fake_quant=False (real quantized compute) is not supported in forward; "
                "real quantized tensors are produced by export"
            )
        amax = self._amax
        blocks = self._spec.block_axes
        if amax is not None and amax.dim() == 2 and blocks and (len(blocks) > 1 or blocks[0][0] != -1):
            if self.convert_flat_block_amax(x.shape):  # (a block amax saved before issue 46)
                amax = self._amax
        if self._spec.needs_amax and amax is None:
            amax = self._amax_of_input(x)
        elif amax is not None and amax.device != x.device and not hasattr(amax, "placements"):
            amax = amax.to(x.device)  # (a pinned amax made before the module moved)
        bias = self._bias(x)
        x = x if bias is None else x - bias
        try:
            if self._attrs.learn_amax:
                out = fake_quant_learnable(x, self._spec, amax, self._global_amax)
            else:
                clip = self._attrs.backward == "clipped"
                share = bias is None and self.share_outputs and shared_outputs.shareable(x)
                out = shared_outputs.lookup(x, self._spec, clip, amax, self._global_amax) if share else None
                if out is None:
                    into = bias is None and takes_out(x, self._spec, amax)
                    buf = self.output_buffer(x) if into else None
                    out = fake_quant(x, self._spec, amax, clip, self._global_amax, buf)
                    if share:
                        shared_outputs.store(x, self._spec, clip, amax, self._global_amax, out)
        except UnsignedNegativeInputError as err:  # keeps its type (a TypeError too, as in the reference)
            raise UnsignedNegativeInputError(f"{self.name}: {err}") from None
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from None
        return out if bias is None else out + bias

    def _amax_of_input(self, x: torch.Tensor) -> torch.Tensor:
        """The amax of a static quantizer that has none: a pinned one, or (built by hand, never calibrated)
        ``x``'s own, reduced as calibration would reduce it. Raises where calibration was expected."""
        pinned = self._attrs.pinned_amax
        if pinned is not None:  # (its buffer was reset)
            return torch.tensor(float(pinned), dtype=torch.float32, device=x.device)
        if self.calibration_expected or self._attrs.learn_amax:
            raise RuntimeError(
                f"{self.name}: {self._spec.name} {self._spec.granularity} has no amax; calibrate it "
                "first (enable_calib, forward over data, load_calib_amax) or set .amax"
            )
        if not self.__dict__.get("_told_dynamic_amax"):
            self.__dict__["_told_dynamic_amax"] = True
            logger.debug(
                "%s: no amax (built by hand, not calibrated): each input is quantized with its own amax",
                self.name,
            )
        return reduce_amax(x.detach(), self._spec).float()

    # ----------------------------------------------------------------------- repr
    def extra_repr(self) -> str:
        if not self._attrs.enable:
            return "disabled" if self._rotation is None else f"disabled, {self._rotation['mode']}"
        parts = [f"{self._spec.name} {self._spec.granularity}"]
        if self._amax is not None:
            a = self._amax
            if a.numel() == 1:
                parts.append(f"amax={a.item():.4g}")
            else:
                parts.append(f"amax=[{a.min().item():.4g}, {a.max().item():.4g}] {tuple(a.shape)}")
        elif self._spec.needs_amax:
            parts.append("amax=None" if self.calibration_expected else "amax=dynamic")
        elif self._spec.kind != "mx":
            parts.append("amax=dynamic")
        if self._pre_quant_scale is not None:
            parts.append(f"pre_quant_scale{tuple(self._pre_quant_scale.shape)}")
        if self._bias_calibrator is not None and not self._static_bias():
            parts.append("bias=dynamic")
        elif self._bias_calibrator is not None:
            parts.append("bias=None" if self._bias_value is None else f"bias{tuple(self._bias_value.shape)}")
        if self._rotation is not None:
            parts.append(self._rotation["mode"])
        if not self._quant_enabled:
            parts.append("quant=off")
        if self._calib_enabled:
            parts.append("calib=on")
        if self._attrs.backward == "clipped":
            parts.append("backward=clipped")
        if self._attrs.learn_amax:
            parts.append("learn_amax")
        if self._attrs.pinned_amax is not None:
            parts.append("constant_amax")
        return " ".join(parts)
