"""The compressed fused MoE experts of ``mtq.compress`` (:mod:`.model`): a
:class:`~modelopt_lite.moe.QuantExperts` whose projections hold the packer's tensors (:mod:`.packers`) of
every expert, stacked, instead of full-precision parameters, and how one is built from fake-quantized
experts (``mtq.compress``) or from a checkpoint's tensors (:func:`packed_experts`).
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from ...moe import QuantExperts
from ...nn import QUANT_MODULES
from ...nn.errors import UnsupportedFeatureError
from .linear import _TENSORS, _KeepsPackedDtypes, require_torchao
from .packers import UnsupportedFormatError, detect_format, get_packer

__all__ = ["CompressedExperts", "packed_experts"]


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
