"""``TensorQuantizer``: the module that fake-quantizes one tensor (a weight, an input, a KV projection).

Its attributes (what they mean, how they are validated): :mod:`.quantizer_attributes`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import nn

from ..distributed import is_distributed
from ..formats import (
    FormatSpec,
    fake_quant,
    fake_quant_learnable,
    hadamard_transform,
)
from .calibrators import BiasCalibrator, Calibrator, bias_settings, make_calibrator
from .quantizer_attributes import QuantizerAttributes

__all__ = ["QuantizerAttributes", "TensorQuantizer"]

_BACKWARDS = ("pass_through", "clipped")
_OPTIONAL_BUFFERS = ("_amax", "_pre_quant_scale", "_global_amax", "_bias_value")


class TensorQuantizer(nn.Module):
    """Fake-quantize a tensor in one format; calibrate its amax; keep it in ``state_dict``."""

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
        if isinstance(quant_attribute_cfg, str):
            name, quant_attribute_cfg = quant_attribute_cfg, None
        self._name = name
        self._attrs = QuantizerAttributes()
        self._spec = self._attrs.spec()
        self.register_buffer("_amax", None)
        self._scalar_amax = False  # a learnable per-tensor amax, stored with shape (1,)
        self.register_buffer("_pre_quant_scale", None)
        self.register_buffer("_global_amax", None)  # static NVFP4: the per-tensor amax next to the block amax
        self.register_buffer("_bias_value", None)  # affine quantization: the calibrated (static) bias
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
            calibrator = make_calibrator(new.calibrator, spec, self.name, **new.calibrator_options)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{self.name}: {err}") from None
        if spec != self._spec:
            self._store_amax(None)  # an amax of another format / granularity means nothing here
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

    # ----------------------------------------------------------------------- amax / scales
    @property
    def amax(self) -> torch.Tensor | None:
        """The amax tensor (float32); with ``learn_amax``, the ``nn.Parameter`` (a per-tensor amax is held as
        a 1-element vector, as FSDP2 cannot shard scalars, and read here as a scalar view of it)."""
        amax = self._amax
        if amax is not None and self._scalar_amax and amax.dim() == 1 and not hasattr(amax, "placements"):
            return amax.view(())  # (a DTensor shard under FSDP2 is returned as it is)
        return amax

    @amax.setter
    def amax(self, value: torch.Tensor | float | None) -> None:
        if value is None:
            self._store_amax(None)
            return
        value = torch.as_tensor(value, dtype=torch.float32).detach().clone()
        if not bool(torch.isfinite(value).all()) or bool((value < 0).any()):
            raise ValueError(f"{self.name}: amax must be finite and non-negative")
        self._store_amax(value)

    @property
    def learnable_amax(self) -> torch.nn.Parameter | None:
        """The amax ``Parameter`` an optimizer trains (``learn_amax=True`` and an amax set), else ``None``."""
        amax = self._parameters.get("_amax")
        return amax if isinstance(amax, nn.Parameter) else None

    def _store_amax(self, value: torch.Tensor | None) -> None:
        """Set ``_amax``: a buffer, or a Parameter with ``learn_amax``. A Parameter of the same shape is
        updated in place, so that an optimizer that holds it keeps training the new values."""
        if value is None:
            self._global_amax = None
        if value is None or not self._attrs.learn_amax:
            self._scalar_amax = False
            if "_amax" in self._parameters:
                del self._parameters["_amax"]
                self.register_buffer("_amax", value)
            else:
                self._amax = value
            return
        self._scalar_amax = value.dim() == 0
        value = value.reshape(1) if self._scalar_amax else value
        current = self.learnable_amax
        if current is not None and current.shape == value.shape:
            with torch.no_grad():
                current.copy_(value)
            return
        device = current.device if current is not None else value.device
        self._amax = nn.Parameter(value.detach().to(device=device, dtype=torch.float32), requires_grad=True)

    @property
    def global_amax(self) -> torch.Tensor | None:
        """Static NVFP4's per-tensor amax (float32 scalar), set by calibration to the largest block amax and
        kept when a search (MSE) changes the block amax; ``None`` otherwise (then the largest block amax)."""
        return self._global_amax

    @global_amax.setter
    def global_amax(self, value: torch.Tensor | float | None) -> None:
        if value is not None:
            value = torch.as_tensor(value, dtype=torch.float32).detach().clone().reshape(())
            if not bool(torch.isfinite(value)) or bool(value < 0):
                raise ValueError(f"{self.name}: global_amax must be finite and non-negative")
        self._global_amax = value

    @property
    def pre_quant_scale(self) -> torch.Tensor | None:
        return self._pre_quant_scale

    @pre_quant_scale.setter
    def pre_quant_scale(self, value: torch.Tensor | None) -> None:
        if value is None:
            self._pre_quant_scale = None
            return
        value = torch.as_tensor(value).detach().to(torch.float32, copy=True)
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"{self.name}: pre_quant_scale has NaN / inf values")
        self._pre_quant_scale = value

    def reset_amax(self) -> None:
        """Forget the amax (and, as in the reference, the bias) and the statistics collected so far."""
        self._store_amax(None)
        self._calibrator.reset()
        self.reset_bias()

    # ----------------------------------------------------------------------- modes
    def enable(self) -> None:
        self.configure(enable=True)

    def disable(self) -> None:
        self.configure(enable=False)

    @property
    def is_enabled(self) -> bool:
        return self._attrs.enable

    def enable_quant(self) -> None:
        self._quant_enabled = True

    def disable_quant(self) -> None:
        self._quant_enabled = False

    def enable_calib(self) -> None:
        self._calib_enabled = True

    def disable_calib(self) -> None:
        self._calib_enabled = False

    @property
    def calibrator(self) -> Calibrator:
        return self._calibrator

    @property
    def bias_calibrator(self) -> BiasCalibrator | None:
        """The calibrator of an affine quantizer's bias (``None`` without ``bias``)."""
        return self._bias_calibrator

    @property
    def bias_value(self) -> torch.Tensor | None:
        """The calibrated bias of an affine quantizer with a static ``bias`` (float32), else ``None``."""
        return self._bias_value

    @bias_value.setter
    def bias_value(self, value: torch.Tensor | None) -> None:
        value = None if value is None else torch.as_tensor(value).detach().to(torch.float32, copy=True)
        if value is not None and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{self.name}: bias_value has NaN / inf values")
        self._bias_value = value

    def reset_bias(self) -> None:
        self._bias_value = None
        if self._bias_calibrator is not None:
            self._bias_calibrator.reset()

    def reset_calibration(self) -> None:
        """Forget the statistics collected so far (amax and bias calibrators); loaded values stay."""
        self._calibrator.reset()
        if self._bias_calibrator is not None:
            self._bias_calibrator.reset()

    def _static_bias(self) -> bool:
        return self._bias_calibrator is not None and bias_settings(self._attrs.bias)[2] == "static"

    def load_calib_bias(self) -> None:
        """Move the bias calibrator's result into ``bias_value`` (an affine quantizer with a static bias)."""
        if not self._static_bias():
            return
        if is_distributed():
            raise NotImplementedError(
                f"{self.name}: affine (bias) calibration is not merged across ranks; calibrate in one process"
            )
        bias = self._bias_calibrator.compute_bias()
        if bias is None:
            raise RuntimeError(f"{self.name}: no data reached this quantizer's bias calibration")
        self.bias_value = bias

    def load_calib_amax(self) -> None:
        """Move the calibrator's result into the ``amax`` buffer (no-op for formats without amax), and a
        static bias into ``bias_value``."""
        self.load_calib_bias()
        if not self._spec.needs_amax:
            return
        amax = self._calibrator.compute_amax()
        if amax is None:
            raise RuntimeError(
                f"{self.name}: no data reached this quantizer during calibration; "
                "run a forward pass over calibration data or disable the quantizer"
            )
        self._store_amax(amax.float())
        if self._spec.static_nvfp4:
            self._global_amax = amax.float().amax()

    def calibrate(self, x: torch.Tensor) -> TensorQuantizer:
        """Set ``amax`` from ``x`` alone (e.g. a weight): reset, collect ``x``, load the result."""
        self.reset_calibration()
        if self._spec.needs_amax:
            self._collect(self._transform(x))
            self.load_calib_amax()
        return self

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

    def _collect(self, x: torch.Tensor) -> None:
        """Calibration: a static bias from ``x``, then the amax of ``x`` minus the bias so far."""
        if self._static_bias():
            self._bias_calibrator.collect(x)
            x = x - self._bias_calibrator.compute_bias()
        if self._spec.needs_amax:
            self._calibrator.collect(x)

    def _bias(self, x: torch.Tensor) -> torch.Tensor | None:
        """The bias subtracted before the fake quantization (``None``: none, or dynamic block scales)."""
        if self._bias_calibrator is None or (self._spec.kind in ("nvfp4", "mx") and self._spec.dynamic):
            return None
        if not self._static_bias():
            return self._bias_calibrator.compute_dynamic_bias(x)
        if self._bias_value is None:
            raise RuntimeError(
                f"{self.name}: bias={self._attrs.bias!r} has no calibrated bias_value; calibrate it first"
            )
        return self._bias_value.to(x.dtype)

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
            if self._spec.kind == "int" and self._attrs.unsigned and bool((x < 0).any()):
                raise ValueError(f"{self.name}: unsigned=True quantizer received negative input")
            if self._attrs.type == "static":
                self._collect(x)
        if not self._quant_enabled:
            return x
        if not self._attrs.fake_quant:
            raise NotImplementedError(
                f"{self.name}: fake_quant=False (real quantized compute) is not supported in forward; "
                "real quantized tensors are produced by export"
            )
        if self._spec.needs_amax and self._amax is None:
            raise RuntimeError(
                f"{self.name}: {self._spec.name} {self._spec.granularity} has no amax; calibrate it "
                "first (enable_calib, forward over data, load_calib_amax) or set .amax"
            )
        bias = self._bias(x)
        x = x if bias is None else x - bias
        try:
            if self._attrs.learn_amax:
                out = fake_quant_learnable(x, self._spec, self._amax)
            else:
                clip = self._attrs.backward == "clipped"
                out = fake_quant(x, self._spec, self._amax, clip, self._global_amax)
        except ValueError as err:
            raise ValueError(f"{self.name}: {err}") from None
        return out if bias is None else out + bias

    # ----------------------------------------------------------------------- device / dtype / state_dict
    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # amax and pre_quant_scale stay float32 under model.to(bfloat16) / .half(): a rounded amax would
        # change every quantized value. Device moves apply as usual.
        # (A learnable amax Parameter gets its new data assigned in place, hence the detached references.)
        saved = {b: getattr(self, b) for b in _OPTIONAL_BUFFERS}
        saved = {b: (t.detach() if t is not None else None) for b, t in saved.items()}
        super()._apply(fn, recurse)
        for buf, old in saved.items():
            new = getattr(self, buf)
            if old is not None and new is not None and new.dtype != old.dtype:
                if isinstance(new, nn.Parameter):
                    new.data = old.to(device=new.device)
                else:
                    setattr(self, buf, old.to(device=new.device))
        return self

    def allocate_buffers(self, shapes: dict[str, list[int]], device: torch.device | str = "cpu") -> None:
        """Create ``amax`` / ``pre_quant_scale`` placeholders (zeros) of the given shapes so that a
        checkpoint loader that only fills existing buffers can load them."""
        for buf, shape in shapes.items():
            if buf not in _OPTIONAL_BUFFERS:
                raise ValueError(f"{self.name}: unknown buffer {buf!r} (allowed: {_OPTIONAL_BUFFERS})")
            value = torch.zeros(shape, dtype=torch.float32, device=device)
            self._store_amax(value) if buf == "_amax" else setattr(self, buf, value)

    def buffer_shapes(self) -> dict[str, list[int]]:
        shapes = {b: list(t.shape) for b in _OPTIONAL_BUFFERS if (t := getattr(self, b)) is not None}
        if self._scalar_amax:
            shapes["_amax"] = []  # a learnable scalar is stored as (1,)
        return shapes

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        # ``amax`` / ``pre_quant_scale`` exist only once set; create them from the checkpoint.
        for buf in _OPTIONAL_BUFFERS:
            key = prefix + buf
            if key in state_dict:
                ref = getattr(self, buf)
                device = ref.device if ref is not None else state_dict[key].device
                value = state_dict[key].detach().clone().to(device=device, dtype=torch.float32)
                if buf == "_amax" and ref is not None and self.amax.dim() == 0 and value.numel() == 1:
                    value = value.reshape(())  # a learnable scalar saved in its (1,) storage layout
                self._store_amax(value) if buf == "_amax" else setattr(self, buf, value)
                # what the parent loads: the stored layout ((1,) for a learnable scalar)
                state_dict[key] = getattr(self, buf).detach()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

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
            parts.append("amax=None")
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
        return " ".join(parts)
