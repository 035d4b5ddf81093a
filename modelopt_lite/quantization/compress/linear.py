"""The compressed linear layers of ``mtq.compress`` (:mod:`.model`): a quantized linear layer whose
weight is the packer's tensors (:mod:`.packers`) instead of a full-precision parameter, how one is built
from a fake-quantized layer (:func:`packed_linear`) or chosen to run torchao's int8 GEMM
(:func:`use_int8_gemm`), and the base both compressed kinds share. Fused experts:
:mod:`.experts`. How they compute is described in :mod:`.model`.
"""

from __future__ import annotations

import importlib
import types
import weakref
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...logging import get_logger
from ...nn import QUANT_MODULES, QuantLinear
from ...nn.errors import UnsupportedFeatureError
from .packers import Packer, get_packer

__all__ = [
    "KERNELS",
    "W8A8_TOLERANCE",
    "CompressedLinear",
    "fast_int8_gemm",
    "packed_linear",
    "require_torchao",
    "use_int8_gemm",
]


#: ``(rtol, atol)`` within which the W8A8 torchao kernel's outputs equal the fake-quant layer's (tested)
W8A8_TOLERANCE = (1e-5, 1e-5)
#: quant_algo -> the torchao kernel that runs it (the other formats dequantize on the fly)
KERNELS = {"W8A8_SQ_PER_CHANNEL": "torchao Int8Tensor (int8 x int8 GEMM)"}
_TENSORS = ("weight", "weight_scale", "weight_scale_2")
logger = get_logger(__name__)


def require_torchao() -> Any:
    """The ``torchao`` module, or an ``ImportError`` naming the extra that installs it."""
    try:
        return importlib.import_module("torchao")
    except ImportError as err:
        raise ImportError(
            f"mtq.compress needs torchao ({err}); install it with: pip install 'modelopt_lite[torchao]'"
        ) from err


#: CompressedLinear -> {(dtype, ndim): (source tensors, their versions, Int8Tensor)} (not in the module's
#: __dict__: a deepcopy or pickle of the model does not carry it)
_INT8_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[torch.dtype, int], tuple[Any, ...]]] = (
    weakref.WeakKeyDictionary()
)


class _KeepsPackedDtypes(nn.Module):
    """Packed tensors (``_packed()``: buffer name -> tensor) keep their dtypes under ``model.to(bfloat16)`` /
    ``.half()`` (a cast would change every code and scale); the compute dtype ``_weight_dtype`` follows."""

    _weight_dtype: torch.dtype

    def _packed(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        _INT8_WEIGHTS.pop(self, None)  # the cached Int8Tensor would keep the old buffers alive
        saved = self._packed()
        super()._apply(fn, recurse)
        for name, old in saved.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        self._weight_dtype = fn(torch.empty(0, dtype=self._weight_dtype)).dtype
        return self


class CompressedLinear(_KeepsPackedDtypes):
    """Mixin of a compressed :class:`~modelopt_lite.nn.QuantLinear` (see the module docstring): the packed
    tensors are buffers under the export's names, ``quant_algo`` names the format."""

    quant_algo: str
    _weight_dtype: torch.dtype
    _weight_shape: torch.Size
    #: the format's block where the tensors' shapes do not tell it (INT4 with a partial last block)
    group_size: int | None = None

    def _packed(self) -> dict[str, torch.Tensor]:
        return {n: b for n in _TENSORS if (b := self._buffers.get(n)) is not None}

    @property
    def packer(self) -> Packer:
        return get_packer(self.quant_algo)

    def _weight_view(self) -> torch.Tensor:
        """The ``(out, in)`` weight, dequantized (what the fake-quant layer's weight quantizer returned)."""
        weight = self.packer.dequantize(self._packed(), self.group_size)
        if not self.packer.exact_dequantize:
            weight = self.weight_quantizer(weight)
        return weight.to(self._weight_dtype)

    def quantized_weight(self, delta: torch.Tensor | None = None) -> torch.Tensor:
        if delta is not None:
            raise UnsupportedFeatureError(
                f"{self.weight_quantizer.name}: the layer is compressed (real {self.quant_algo} weights), so "
                "a LoRA adapter cannot be merged into it: train it as a served adapter "
                "(mtq.add_lora(..., deploy='served')), or merge on the fake-quantized model before "
                "mtq.compress"
            )
        return self._from_view(self._weight_view())

    def parameter_shape(self) -> list[int]:
        """The shape of the full-precision ``weight`` parameter the layer had (Conv1D: ``(in, out)``)."""
        return list(self._from_view(torch.empty(self._weight_shape, device="meta")).shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_kernel:
            return super().forward(x)
        weight = self._cached_int8_weight(x.dtype, x.ndim)
        if self.compile_int8 and _compile_fits(x):
            try:
                return _compiled_int8_linear(x, weight)(x, weight, self.bias)
            except Exception as err:  # no C++ compiler, an inductor failure: eager from now on
                out = F.linear(x, weight, self.bias)  # (a bad input raises its own error here)
                _compile_failed(err)
                return out
        return F.linear(x, weight, self.bias)

    def fold_weight(self) -> None:
        raise UnsupportedFeatureError(
            f"{self.weight_quantizer.name}: the layer is compressed (its weight is already real "
            f"{self.quant_algo}); fold_weight applies to fake-quantized layers, before mtq.compress"
        )

    def weight_quantizer_pairs(self):  # type: ignore[override]
        """Calibration reads the weights through these pairs: a compressed layer refuses (its codes would
        no longer match a recalibrated amax)."""
        raise UnsupportedFeatureError(
            f"{self.weight_quantizer.name}: the layer is compressed; calibrate (mtq.quantize, mtq.calibrate) "
            "before mtq.compress"
        )

    # ---- the torchao W8A8 kernel
    uses_kernel: bool = False
    #: on a CPU, run torchao's Int8Tensor linear under ``torch.compile`` (:func:`_compiled_int8_linear`)
    compile_int8: bool = True

    def _int8_sources(self) -> tuple[torch.Tensor | None, ...]:
        """The tensors :meth:`_int8_weight` reads (buffers, not views: a view is a new object per access)."""
        iq = self.input_quantizer
        return self.weight, self.weight_scale, iq._amax, iq._pre_quant_scale

    def _cached_int8_weight(self, dtype: torch.dtype, ndim: int) -> torch.Tensor:
        """:meth:`_int8_weight`, kept between calls per ``(dtype, ndim)`` while the tensors it is built from
        are the same objects, unmodified (same version counters): rebuilding it per call costs as much as
        a small layer's int8 GEMM. A buffer replaced (``model.to``, a new ``amax``) or changed in place
        (``load_state_dict``) rebuilds it; tensors without a version counter (made under
        ``torch.inference_mode``) are never cached."""
        sources = self._int8_sources()
        try:
            versions = tuple(-1 if t is None else t._version for t in sources)
        except RuntimeError:  # inference tensors have no version counter
            return self._int8_weight(dtype, ndim)
        cache = _INT8_WEIGHTS.setdefault(self, {})
        hit = cache.get((dtype, ndim))
        if (
            hit is not None
            and hit[1] == versions
            and all(a is b for a, b in zip(hit[0], sources, strict=True))
        ):
            return hit[2]
        weight = self._int8_weight(dtype, ndim)
        cache[(dtype, ndim)] = (sources, versions, weight)
        return weight

    def _int8_weight(self, dtype: torch.dtype, ndim: int) -> torch.Tensor:
        """The int8 codes and scales as torchao's ``Int8Tensor`` with a static per-tensor activation scale
        (shares the codes and weight scales; for the input's dtype and rank)."""
        from torchao.quantization import Int8Tensor, PerTensor
        from torchao.quantization.quantize_.workflows import QuantizeTensorToInt8Kwargs

        iq = self.input_quantizer
        act_scale = (iq.amax.float() / 127.0).reshape([1] * ndim)
        pre_scale = iq.pre_quant_scale
        return Int8Tensor(
            self.weight,
            self.weight_scale.reshape(-1, 1),
            list(self._weight_shape),
            dtype,
            act_quant_scale=act_scale,
            act_quant_kwargs=QuantizeTensorToInt8Kwargs(granularity=PerTensor()),
            act_pre_scale=None if pre_scale is None else pre_scale.to(dtype),
        )


_COMPILE = {"failed": False}
#: (input dtype, rank, weight shape) -> its compiled linear (see :func:`_compiled_int8_linear`)
_COMPILED: dict[tuple[torch.dtype, int, tuple[int, ...]], Any] = {}


def _int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _compile_fits(x: torch.Tensor) -> bool:
    """Whether the W8A8 layer compiles its linear for ``x``: on a CPU, for inference (no autograd graph),
    not inside a graph being compiled already (the outer compilation traces it), and not after a failure."""
    return (
        x.device.type == "cpu"
        and not _COMPILE["failed"]
        and not (torch.is_grad_enabled() and x.requires_grad)
        and not torch.compiler.is_compiling()
    )


def _compiled_int8_linear(x: torch.Tensor, weight: torch.Tensor) -> Any:
    """``F.linear`` on torchao's ``Int8Tensor`` under ``torch.compile`` (dynamic token count), the CPU route
    torchao's int8 linear is written for: inductor fuses the activation quantization (pre-scale, scale,
    round, clamp, int8 and uint8 casts), the weight's column sums and the dequantization around
    ``torch._int_mm`` into a few kernels, which eager runs as some 20 separate ops (2026-12-02, 2 CPU threads:
    6-7x fp32 and 3-7x the eager path on 4096 x 4096 layers, ~1.2x the eager path on the default dense model;
    the eager path's outputs). One compiled function per (dtype, input rank, weight shape): the tensor
    subclass's shape metadata is guarded on, so one shared function would reach dynamo's recompile limit on a
    model with more than a few distinct layer shapes."""
    key = (x.dtype, x.ndim, tuple(weight.shape))
    compiled = _COMPILED.get(key)
    if compiled is None:
        # a copy of the code object: dynamo keeps its compiled graphs per code object
        fn = types.FunctionType(_int8_linear.__code__.replace(), _int8_linear.__globals__, "_int8_linear")
        compiled = _COMPILED[key] = torch.compile(fn, dynamic=True)
    return compiled


def _compile_failed(err: Exception) -> None:
    _COMPILE["failed"] = True
    logger.warning(
        "mtq.compress: torch.compile of the W8A8 int8 linear failed (%s: %s); W8A8 layers run torchao's "
        "Int8Tensor linear eagerly from now on (same outputs, slower)",
        type(err).__name__,
        str(err).splitlines()[0] if str(err) else "",
    )


@cache
def _compressed_class(cls: type[nn.Module]) -> type[nn.Module]:
    # original_cls in the class dict: QuantLinear.__new__ then knows a copy is being made (deepcopy)
    attrs = {"__module__": __name__, "original_cls": cls.original_cls}
    return type(f"Compressed{cls.__name__}", (CompressedLinear, cls), attrs)


def fast_int8_gemm(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` (torchao's int8 GEMM) is fast on ``device``: CUDA, or a CPU with
    AVX512-VNNI or AMX (on others, AVX2 only, it is several times slower than an fp32 GEMM)."""
    if device.type == "cuda":
        return True
    from torchao.utils import _cpu_is_amx_tile_supported, _cpu_is_vnni_supported

    return device.type == "cpu" and (_cpu_is_vnni_supported() or _cpu_is_amx_tile_supported())


def _kernel_fits(module: QuantLinear, algo: str, int8_gemm: bool | None) -> bool:
    """Whether the torchao kernel computes this layer: W8A8 on a plain linear (not Conv1D, no low-rank
    branch), an input quantizer without rotation or bias (torchao quantizes the activation itself), and
    ``int8_gemm`` (``None``: :func:`fast_int8_gemm` on the weight's device)."""
    iq = module.input_quantizer
    cls = next(c for c in type(module).__mro__ if not issubclass(c, _KeepsPackedDtypes))  # quantized class
    fits = (
        algo in KERNELS
        and cls.forward is QuantLinear.forward
        and cls.forward_with_delta is QuantLinear.forward_with_delta  # Conv1D overrides this one
        and iq.attributes.rotation() is None
        and iq.bias_calibrator is None
    )
    return fits and (fast_int8_gemm(module.weight.device) if int8_gemm is None else int8_gemm)


def _convert(
    module: QuantLinear,
    algo: str,
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    shape: torch.Size,
    int8_gemm: bool | None = None,
    group_size: int | None = None,
) -> None:
    kernel = _kernel_fits(module, algo, int8_gemm)
    del module.weight  # the full-precision parameter goes; the codes take its name
    module.__class__ = _compressed_class(type(module))
    module.quant_algo = algo
    module.group_size = group_size
    module._weight_dtype, module._weight_shape = dtype, shape
    for name, tensor in tensors.items():
        module.register_buffer(name, tensor.contiguous())
    module.uses_kernel = kernel


@torch.no_grad()
def _compress_layer(module: QuantLinear, algo: str, int8_gemm: bool | None) -> None:
    weight = module._weight_view()
    packer = get_packer(algo)
    tensors = packer.pack(weight.detach(), module.weight_quantizer)
    group = packer.group_size(module.weight_quantizer)
    _convert(module, algo, tensors, weight.dtype, weight.shape, int8_gemm, group)


def packed_linear(
    module: nn.Linear, quant_algo: str, tensors: dict[str, torch.Tensor], group_size: int | None = None
) -> nn.Module:
    """Turn a plain ``nn.Linear`` (on any device, ``meta`` included) into a compressed layer that holds
    ``tensors``, the packed tensors an export stores for it (``weight`` codes, ``weight_scale``,
    ``weight_scale_2``; ``meta`` placeholders that a checkpoint loader fills are fine), in place; returns the
    module. Its weight and input quantizers are disabled: it computes ``F.linear(x, W, b)`` with ``W`` the
    packer's dequantization of the tensors in the weight's dtype, what a dequantizing load computes (an
    input quantizer ``pre_quant_scale`` set afterwards scales ``x``). ``group_size``: the format's block
    (the checkpoint's ``group_size``; INT4 needs it when the last block of a row is partial). Raises
    ``ValueError`` when the tensors do not dequantize to the weight's shape."""
    require_torchao()
    if type(module) is not nn.Linear:
        raise ValueError(f"packed_linear: expected a plain nn.Linear, got {type(module).__name__}")
    missing = {"weight", "weight_scale"} - set(tensors)
    unknown = set(tensors) - set(_TENSORS)
    if missing or unknown:
        raise ValueError(
            f"packed_linear: {quant_algo} tensors {sorted(tensors)}: missing {sorted(missing)}, "
            f"unknown {sorted(unknown)} (expected some of {list(_TENSORS)})"
        )
    meta = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in tensors.items()}
    shape = get_packer(quant_algo).dequantize(meta, group_size).shape
    if shape != module.weight.shape:
        raise ValueError(
            f"packed_linear: {quant_algo} tensors "
            f"{ {n: tuple(t.shape) for n, t in tensors.items()} } dequantize to {tuple(shape)}, but the "
            f"layer's weight is {tuple(module.weight.shape)}"
        )
    dtype = module.weight.dtype
    QUANT_MODULES.convert(module)
    module.weight_quantizer.disable()
    module.input_quantizer.disable()
    _convert(module, quant_algo, tensors, dtype, shape, int8_gemm=False, group_size=group_size)
    return module


def use_int8_gemm(module: nn.Module, int8_gemm: bool | None = None) -> bool:
    """Let a compressed W8A8 layer run torchao's int8 GEMM when it fits (an input quantizer with an amax,
    the static per-tensor activation scale, ``int8_gemm`` or, for ``None``, :func:`fast_int8_gemm` on its
    device); returns whether it does."""
    if not isinstance(module, CompressedLinear):
        raise ValueError(f"use_int8_gemm: {type(module).__name__} is not a compressed layer")
    fits = module.input_quantizer.amax is not None and _kernel_fits(module, module.quant_algo, int8_gemm)
    module.uses_kernel = fits
    return fits
