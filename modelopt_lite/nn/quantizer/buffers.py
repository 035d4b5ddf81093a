"""``QuantizerBuffers``: the optional tensors a :class:`~.tensor_quantizer.TensorQuantizer` holds (``amax``,
a learnable amax ``Parameter``, static NVFP4's ``global_amax``, ``pre_quant_scale``, an affine quantizer's
``bias_value``): their validation, storage, and how they move with the module, keep float32 under a dtype cast
and load from a ``state_dict`` that creates them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .attributes import QuantizerAttributes

__all__ = ["QuantizerBuffers", "reusable_buffer", "storage_refs"]


def storage_refs(t: torch.Tensor) -> int | None:
    """References to ``t``'s storage (tensors and views sharing it, autograd's saved copies included);
    ``None`` where this PyTorch has no way to tell."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return None if use_count is None else int(use_count(t.untyped_storage()._cdata))


def reusable_buffer(cache: dict[str, Any], key: str, shape: torch.Size) -> torch.Tensor | None:
    """A float32 CPU tensor of ``shape`` kept as ``cache[key]`` (with its reference count) and handed out
    again while nothing else references its memory (the graph that used it last was freed); a new one when
    something still does or the shape changed; ``None`` (and nothing kept) where this PyTorch cannot count
    the references."""
    held = cache.get(key)
    if held is not None and held[0].shape == shape and storage_refs(held[0]) == held[1]:
        return held[0]
    buf = torch.empty(shape, dtype=torch.float32)
    refs = storage_refs(buf)
    if refs is None:
        cache.pop(key, None)
        return None
    cache[key] = (buf, refs)
    return buf


_OPTIONAL_BUFFERS = ("_amax", "_pre_quant_scale", "_global_amax", "_bias_value")


class QuantizerBuffers(nn.Module):
    """The base of :class:`~.tensor_quantizer.TensorQuantizer` that holds its optional tensors (``None`` until
    set); the subclass provides ``name`` (in every message) and ``_attrs`` (``learn_amax``)."""

    name: str
    _attrs: QuantizerAttributes

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("_amax", None)
        self._scalar_amax = False  # a learnable per-tensor amax, stored with shape (1,)
        self.register_buffer("_pre_quant_scale", None)
        self.register_buffer("_global_amax", None)  # static NVFP4: the per-tensor amax next to the block amax
        self.register_buffer("_bias_value", None)  # affine quantization: the calibrated (static) bias

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

    #: Keep the fake-quant output buffer from step to step while training (see :meth:`output_buffer`).
    #: Only ``benchmarks`` / tests turn this off, to measure or check what it changes.
    reuse_output_buffer: bool = True

    def output_buffer(self, x: torch.Tensor) -> torch.Tensor | None:
        """The float32 tensor this quantizer's fake quant of ``x`` is written into, kept on the module from
        one training step to the next; ``None`` (a fresh output each call) unless the module is training
        with grad enabled and ``x`` is a float32, contiguous CPU tensor (no subclass) that needs a gradient,
        outside ``torch.compile`` tracing.

        A fresh output each step comes from the allocator as memory that glibc may have handed back to the
        kernel (outputs above its mmap threshold, freed space above its trim threshold at the heap's top)
        and is then page-faulted in while written. Kept, it is written in place. It is reused only when
        nothing else references its memory any more (the previous step's graph was freed: its backward
        ran, or it was dropped; a caller that kept the output keeps its own copy of the memory); otherwise
        a new one replaces it. Memory: one output per quantizer stays allocated between steps (in training
        each output lives until the backward anyway). Released by a call outside training (``eval()`` or
        ``no_grad``). The same policy as the MoE experts' weight buffers."""
        if not (
            self.reuse_output_buffer and self.training and torch.is_grad_enabled() and x.requires_grad
            and x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
            and type(x) in (torch.Tensor, nn.Parameter)  # no tensor subclass (DTensor, ...)
            and not torch.compiler.is_compiling()  # a traced graph gets no reference counts
        ):  # fmt: skip
            self.__dict__.pop("_output_buffer", None)
            return None
        return reusable_buffer(self.__dict__, "_output_buffer", x.shape)

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
                scalar = buf == "_amax" and ref is not None and self._scalar_amax and value.numel() == 1
                if scalar and not hasattr(value, "placements"):
                    value = value.reshape(())  # a learnable scalar saved in its (1,) storage layout
                self._store_amax(value) if buf == "_amax" else setattr(self, buf, value)
                if scalar:  # (under FSDP2 a DTensor of the (1,) storage, loaded as it is: still a scalar)
                    self._scalar_amax = True
                # what the parent loads: the stored layout ((1,) for a learnable scalar)
                state_dict[key] = getattr(self, buf).detach()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
