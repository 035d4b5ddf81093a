"""The compressed modules of ``mtq.compress`` (:mod:`.compress`): a quantized linear layer or fused-experts
module whose weights are the packer's tensors (:mod:`.packers`) instead of full-precision parameters, and how
one is built from a fake-quantized module (:func:`packed_linear`, :func:`packed_experts`) or chosen to run
torchao's int8 GEMM (:func:`use_int8_gemm`). How they compute is described in :mod:`.compress`.
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

from ..logging import get_logger
from ..moe import QuantExperts
from ..nn import QUANT_MODULES, QuantLinear
from ..nn.errors import UnsupportedFeatureError
from .packers import Packer, UnsupportedFormatError, detect_format, get_packer

__all__ = [
    "KERNELS",
    "W8A8_TOLERANCE",
    "CompressedExperts",
    "CompressedLinear",
    "fast_int8_gemm",
    "packed_experts",
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

    def quantized_weight(self) -> torch.Tensor:
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


class CompressedExperts(_KeepsPackedDtypes):
    """Mixin of a compressed :class:`~modelopt_lite.moe.QuantExperts`: for each compressed projection
    ``<proj>`` (``gate_up_proj`` / ``up_proj``, ``down_proj``) the buffers ``<proj>`` (the codes),
    ``<proj>_weight_scale`` and ``<proj>_weight_scale_2`` hold the packer's tensors of every expert stacked
    along a leading experts dimension (each expert packed as ``(out, in)``, whatever the storage layout);
    ``quant_algos`` names each compressed projection's format. :meth:`quantized_weight` (what every experts
    backend multiplies by) rebuilds one projection, all its experts, from them."""

    quant_algos: dict[str, str]
    group_sizes: dict[str, int | None]
    _weight_dtype: torch.dtype
    #: the 3-D parameter's shape per compressed projection (in the model's storage layout)
    _weight_shapes: dict[str, torch.Size]

    def _packed(self) -> dict[str, torch.Tensor]:
        return {
            n: self._buffers[n]
            for proj in self.quant_algos
            for n in _expert_names(proj)
            if n in self._buffers
        }

    def _expert_tensors(self, proj: str, expert: int) -> dict[str, torch.Tensor]:
        return {
            t: self._buffers[n][expert]
            for t, n in zip(_TENSORS, _expert_names(proj), strict=True)
            if n in self._buffers
        }

    def quantized_weight(self, proj: str) -> torch.Tensor:
        """The 3-D weight of ``proj``, each expert dequantized (what its fake quantization returned)."""
        if proj not in self.quant_algos:
            return super().quantized_weight(proj)  # type: ignore[misc]
        return self._dequantized(proj)

    @torch.no_grad()
    def _dequantized(self, proj: str) -> torch.Tensor:
        packer, group = get_packer(self.quant_algos[proj]), self.group_sizes.get(proj)
        quantizers = getattr(self, f"{proj}_weight_quantizers")
        out = torch.empty(
            self._weight_shapes[proj], dtype=self._weight_dtype, device=self._buffers[proj].device
        )
        for expert, q in enumerate(quantizers):
            w = packer.dequantize(self._expert_tensors(proj, expert), group)
            if not packer.exact_dequantize:
                w = q(w)  # within one ulp of the fake-quantized weight: the quantizer maps it back exactly
            out[expert] = w.t() if self.is_transposed else w  # type: ignore[attr-defined]
        return out

    def expert_weight(self, proj: str, expert: int) -> torch.Tensor:
        """Expert ``expert``'s weight of ``proj`` as ``(out, in)``, dequantized if ``proj`` is compressed."""
        if proj not in self.quant_algos:
            return super().expert_weight(proj, expert)  # type: ignore[misc]
        w = self.quantized_weight(proj)[expert]
        return w.t() if self.is_transposed else w  # type: ignore[attr-defined]

    def fold_weight(self) -> None:
        raise UnsupportedFeatureError(
            f"{type(self).__name__}: the experts are compressed (their weights are already real "
            f"{_algos(self.quant_algos)}); fold_weight applies to fake-quantized experts, before mtq.compress"
        )

    def weight_quantizer_pairs(self):  # type: ignore[override]
        raise UnsupportedFeatureError(
            f"{type(self).__name__}: the experts are compressed; calibrate (mtq.quantize, mtq.calibrate) "
            "before mtq.compress"
        )


def _expert_names(proj: str) -> tuple[str, str, str]:
    """The buffer names of a compressed experts projection, in the order of ``_TENSORS``."""
    return proj, f"{proj}_weight_scale", f"{proj}_weight_scale_2"


def _algos(algos: dict[str, str]) -> str:
    return "/".join(sorted(set(algos.values())))


@cache
def _compressed_experts_class(cls: type[nn.Module]) -> type[nn.Module]:
    attrs = {"__module__": __name__, "original_cls": cls.original_cls}
    return type(f"Compressed{cls.__name__}", (CompressedExperts, cls), attrs)


def _convert_experts(
    module: QuantExperts,
    projections: dict[str, tuple[str, int | None, dict[str, torch.Tensor]]],
    dtype: torch.dtype,
) -> None:
    """``projections``: ``{proj: (quant_algo, group_size, stacked tensors)}``, the projections to compress."""
    if not isinstance(module, CompressedExperts):
        module.__class__ = _compressed_experts_class(type(module))
        module.quant_algos, module.group_sizes, module._weight_shapes = {}, {}, {}
        module._weight_dtype = dtype
    for proj, (algo, group, tensors) in projections.items():
        shape = getattr(module, proj).shape
        delattr(module, proj)  # the full-precision 3-D parameter goes; the codes take its name
        for tensor_name, buffer_name in zip(_TENSORS, _expert_names(proj), strict=True):
            if tensor_name in tensors:
                module.register_buffer(buffer_name, tensors[tensor_name].contiguous())
        module.quant_algos[proj], module.group_sizes[proj], module._weight_shapes[proj] = algo, group, shape


def _experts_plan(name: str, module: QuantExperts) -> tuple[dict[str, str], dict[str, str]]:
    """``({proj: quant_algo}, {proj: why not})``: the projections of ``module`` to compress (every expert in
    one format the packers write, shapes they can pack), and those left fake-quantized with the reason."""
    plan, skipped = {}, {}
    if isinstance(module, CompressedExperts):
        return plan, skipped
    for proj in module._projections:
        iq = getattr(module, f"{proj}_input_quantizer")
        quantizers = getattr(module, f"{proj}_weight_quantizers")
        algos = {detect_format(f"{name}.{proj}[{e}]", q, iq) for e, q in enumerate(quantizers)}
        if algos == {None}:
            continue
        if len(algos) > 1:
            skipped[proj] = f"its experts mix formats {sorted(str(a) for a in algos)}"
            continue
        algo = algos.pop()
        try:
            get_packer(algo).check_shape(module.expert_weight(proj, 0).shape)
        except ValueError as err:
            raise UnsupportedFormatError(
                f"{name}.{proj}: {err}; exclude the experts from quantization"
            ) from None
        groups = {get_packer(algo).group_size(q) for q in quantizers}
        if len(groups) > 1:
            skipped[proj] = f"its experts use different {algo} block sizes {sorted(groups)}"
            continue
        plan[proj] = algo
    return plan, skipped


@torch.no_grad()
def _compress_experts(module: QuantExperts, plan: dict[str, str]) -> None:
    projections = {}
    dtype = getattr(module, module._projections[0]).dtype
    for proj, algo in plan.items():
        packer = get_packer(algo)
        quantizers = getattr(module, f"{proj}_weight_quantizers")
        per_expert = [
            packer.pack(module.expert_weight(proj, e).detach(), q) for e, q in enumerate(quantizers)
        ]
        stacked = {t: torch.stack([p[t] for p in per_expert]) for t in per_expert[0]}
        projections[proj] = (algo, packer.group_size(quantizers[0]), stacked)
    _convert_experts(module, projections, dtype)


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


def packed_experts(
    module: nn.Module, projections: dict[str, tuple[str, int | None, dict[str, torch.Tensor]]]
) -> nn.Module:
    """Turn plain fused MoE experts (a module the quantized experts class wraps, on any device, ``meta``
    included) into :class:`CompressedExperts` holding, for each projection of ``projections`` (``{proj:
    (quant_algo, group_size, tensors)}``), the packed tensors of every expert stacked along a leading experts
    dimension (``weight`` codes, ``weight_scale``, ``weight_scale_2``, each expert packed ``(out, in)``;
    ``meta`` placeholders that a checkpoint loader fills are fine), in place; returns the module. Its
    quantizers are disabled: it computes with the packer's dequantization, what a dequantizing load
    computes. Raises ``ValueError`` when the tensors do not dequantize to the experts' weights."""
    require_torchao()
    if not isinstance(module, QuantExperts):
        wrapper = QUANT_MODULES.wrapper_for(type(module))
        if wrapper is None or not issubclass(wrapper, QuantExperts):
            raise ValueError(f"packed_experts: {type(module).__name__} is not a fused experts module")
        QUANT_MODULES.convert(module)
    elif isinstance(module, CompressedExperts):
        raise ValueError(f"packed_experts: {type(module).__name__} is already compressed")
    for proj, (algo, group, tensors) in projections.items():
        if proj not in module._projections:
            raise ValueError(f"packed_experts: {proj!r} is not one of {list(module._projections)}")
        first = {n: torch.empty(t.shape[1:], dtype=t.dtype, device="meta") for n, t in tensors.items()}
        shape = get_packer(algo).dequantize(first, group).shape
        expected = module.expert_weight(proj, 0).shape
        if shape != expected or any(t.shape[0] != module.num_experts for t in tensors.values()):
            raise ValueError(
                f"packed_experts: {proj} {algo} tensors { {n: tuple(t.shape) for n, t in tensors.items()} } "
                f"are not {module.num_experts} experts of {tuple(expected)} (out, in) weights"
            )
    for proj in module._projections:
        getattr(module, f"{proj}_input_quantizer").disable()
        for q in getattr(module, f"{proj}_weight_quantizers"):
            q.disable()
    _convert_experts(module, projections, getattr(module, module._projections[0]).dtype)
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
