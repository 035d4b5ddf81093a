"""The compressed load of :mod:`.loader` (``dequantize=False``): before the weights load, the model's plain
linear layers and fused MoE experts whose checkpoint tensors are stored packed become the compressed modules
of ``mtq.compress`` with ``meta`` placeholders (:class:`PackedLoading`, shapes read from the safetensors
headers); the loading ops then put the stored tensors into them as they are (:class:`ModeloptKeepPacked`;
:class:`ModeloptKeepPackedExperts` merges per-expert tensors into the fused experts' packed buffers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps

from ...moe import QuantExperts
from ...nn import QUANT_MODULES
from ...quantization.compress import KERNELS, CompressedLinear, packed_experts, packed_linear
from ..layers import _interleaved
from .dequantize import _COMPANIONS, ModeloptDequantize, _first, _packer_for

if TYPE_CHECKING:
    from .config import ExportQuantizerView, ModeloptExportConfig

__all__ = ["ModeloptKeepPacked", "ModeloptKeepPackedExperts", "PackedLoading"]

#: safetensors header dtype -> torch dtype (those an export writes)
_ST_DTYPES = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def _stored_meta(checkpoint_files: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """``{layer: {tensor name: meta tensor}}`` of the checkpoint's ``weight`` and companions, from the
    safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    out: dict[str, dict[str, torch.Tensor]] = {}
    for path in checkpoint_files:
        if not str(path).endswith(".safetensors"):
            continue
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                stem, _, name = key.rpartition(".")
                if name != "weight" and name not in _COMPANIONS:
                    continue
                sl = f.get_slice(key)
                dtype = _ST_DTYPES.get(sl.get_dtype())
                if dtype is not None:
                    out.setdefault(stem, {})[name] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")
    return {stem: t for stem, t in out.items() if "weight" in t}


def _read_tensors(checkpoint_files: list[str], keys: set[str]) -> dict[str, torch.Tensor]:
    """The values of a few (small) checkpoint tensors."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in checkpoint_files:
        if not keys or not str(path).endswith(".safetensors"):
            continue
        with safe_open(str(path), "pt") as f:
            for key in keys & set(f.keys()):
                out[key] = f.get_tensor(key)
    return out


class ModeloptKeepPacked(ModeloptDequantize):
    """Loading op of ``dequantize=False``: the stored tensors of a layer prepared by
    :meth:`PackedLoading._prepare_packed` (a compressed layer with ``meta`` placeholders) go into its buffers
    as they are; its ``pre_quant_scale`` (and, for W8A8, ``input_scale`` as the activation amax) into its
    input quantizer. Any other weight is dequantized."""

    def convert(
        self,
        input_dict: dict[str, Any],
        full_layer_name: str | None = None,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        stem = None if full_layer_name is None else full_layer_name.removesuffix("weight")
        module = None
        if model is not None and stem is not None and stem != full_layer_name:
            try:
                module = model.get_submodule(stem.rstrip("."))
            except AttributeError:
                module = None
        if not isinstance(module, CompressedLinear):
            return super().convert(input_dict, full_layer_name=full_layer_name, model=model, **kwargs)
        stored = {k.rpartition(".")[2]: _first(v) for k, v in input_dict.items()}
        expected = set(module._packed())
        if expected - set(stored):
            raise ValueError(
                f"{stem}weight: the checkpoint has {sorted(stored)}, the packed {module.quant_algo} layer "
                f"needs {sorted(expected)}"
            )
        iq = module.input_quantizer
        if stored.get("pre_quant_scale") is not None:
            iq.pre_quant_scale = stored["pre_quant_scale"]
        if module.quant_algo in KERNELS and stored.get("input_scale") is not None:
            iq.amax = stored["input_scale"].float() * 127.0  # the static per-tensor activation amax
        return {stem + name: stored[name] for name in ("weight", *sorted(expected - {"weight"}))}


#: the packed tensors of one expert projection (``weight`` codes and scales); the stored others are dropped
_PACKED = ("weight", "weight_scale", "weight_scale_2")


class ModeloptKeepPackedExperts(ConversionOps):
    """Loading op of ``dequantize=False`` on a merge of per-expert weights into a fused experts projection:
    for experts prepared by :meth:`PackedLoading._prepare_packed` (compressed experts with ``meta``
    placeholders) the per-expert packed tensors are stacked along the experts dimension, the gate and up
    halves concatenated (or interleaved) along the rows, each expert staying ``(out, in)`` whatever the
    model's storage layout; any other merge runs ``fallback`` (dequantize, then the model's own ops)."""

    def __init__(self, hf_quantizer: ExportQuantizerView, fallback: list[ConversionOps]):
        self.hf_quantizer = hf_quantizer
        self.fallback = fallback

    def convert(
        self,
        input_dict: dict[str, Any],
        full_layer_name: str | None = None,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        layout = self.hf_quantizer._packed_experts.get(full_layer_name or "")
        if layout is None:
            for op in self.fallback:
                input_dict = op.convert(input_dict, full_layer_name=full_layer_name, model=model, **kwargs)
            return input_dict
        halves, interleaved = layout
        proj = (full_layer_name or "").rpartition(".")[2]
        groups: dict[tuple[str, str], list[torch.Tensor]] = {}
        for key, value in input_dict.items():
            stem, _, tensor = key.rpartition(".")
            if tensor in _PACKED:
                groups[(stem.rpartition(".")[2], tensor)] = value if isinstance(value, list) else [value]
        out: dict[str, torch.Tensor] = {}
        for tensor, buffer in zip(
            _PACKED, (proj, f"{proj}_weight_scale", f"{proj}_weight_scale_2"), strict=True
        ):
            if (halves[0], tensor) not in groups:
                continue
            parts = [torch.stack(groups[(half, tensor)]) for half in halves]
            if parts[0].ndim == 1:  # one per-tensor scale per expert: the halves share it
                if not all(torch.equal(p, parts[0]) for p in parts[1:]):
                    raise ValueError(f"{full_layer_name}: the {halves} experts' {tensor} differ")
                merged = parts[0]
            elif len(parts) == 1:
                merged = parts[0]
            elif interleaved:  # rows gate_0, up_0, gate_1, ... (GPT-OSS)
                merged = torch.stack(parts, dim=2).flatten(1, 2)
            else:
                merged = torch.cat(parts, dim=1)
            out[f"{full_layer_name}{buffer.removeprefix(proj)}"] = merged.contiguous()
        return out


class PackedLoading:
    """The ``dequantize=False`` preparation of the model: a base of :class:`~.loader.ModeloptExportQuantizer`,
    whose ``__init__`` creates the state it fills (what each attribute holds is said there)."""

    quantization_config: ModeloptExportConfig
    _stored: dict[str, str]
    _covered: set[str]
    _packed_experts: dict[str, tuple[tuple[str, ...], bool]]

    def _prepare_packed(self, model: nn.Module, checkpoint_files: list[str]) -> None:
        """Turn every plain linear layer whose checkpoint weight is stored quantized into a compressed layer
        with ``meta`` placeholders of the stored tensors' shapes and dtypes (read from the safetensors
        headers), for :class:`ModeloptKeepPacked` to fill."""
        stored = _stored_meta(checkpoint_files)
        if not stored:
            raise ValueError(
                "dequantize=False keeps the weights packed as the safetensors files store them, but no "
                f"safetensors checkpoint file was given ({checkpoint_files!r}); load with dequantize=True"
            )
        allowed = self.quantization_config.algorithms()
        modules = dict(model.named_modules())
        for stem, tensors in stored.items():
            if "weight_scale" not in tensors:
                continue  # stored unquantized
            algo = self.quantization_config.layer_algo(stem)
            self._stored[stem] = algo or self.quantization_config.quant_algo or "?"
            module = modules.get(stem)
            if type(module) is not nn.Linear:
                continue  # not a linear layer (a fused experts' projection): below
            packer = _packer_for(tensors, allowed if algo is None else {algo})
            if packer is None or algo is None:
                continue
            packed = {n: t for n, t in tensors.items() if n in ("weight", "weight_scale", "weight_scale_2")}
            try:
                packed_linear(module, algo, packed, self.quantization_config.layer_group_size(stem))
            except ValueError as err:
                raise ValueError(f"{stem}: cannot keep the checkpoint's weight packed: {err}") from None
        for name, module in modules.items():
            wrapper = QUANT_MODULES.wrapper_for(type(module))
            if wrapper is not None and issubclass(wrapper, QuantExperts):
                self._prepare_experts(name, module, stored, checkpoint_files)

    def _prepare_experts(
        self,
        name: str,
        module: nn.Module,
        stored: dict[str, dict[str, torch.Tensor]],
        checkpoint_files: list[str],
    ) -> None:
        """Turn fused experts whose per-expert weights the checkpoint stores packed into compressed experts
        with ``meta`` placeholders of the merged tensors, for :class:`ModeloptKeepPackedExperts` to fill;
        projections that cannot be kept packed stay full precision (dequantized on loading)."""
        n = getattr(module, "num_experts", None)
        if not isinstance(n, int) or n < 1:
            return
        gated = f"{name}.0.gate_proj" in stored
        layout = {"gate_up_proj" if gated else "up_proj": ("gate_proj", "up_proj") if gated else ("up_proj",)}
        layout["down_proj"] = ("down_proj",)
        planned: dict[str, tuple[str, int | None, dict[str, torch.Tensor]]] = {}
        shared: dict[str, list[str]] = {}  # proj -> the per-tensor scales gate and up must share
        for proj, halves in layout.items():
            param = getattr(module, proj, None)
            plan = self._experts_projection(name, n, halves, stored)
            if plan is None or not isinstance(param, torch.Tensor) or param.ndim != 3:
                continue
            planned[proj] = plan
            shared[proj] = [
                f"{name}.{e}.{h}.{t}"
                for e in range(n)
                for h in halves[1:]
                for t in _PACKED
                if t in stored[f"{name}.{e}.{h}"] and stored[f"{name}.{e}.{h}"][t].ndim == 0
            ]
        keys = {k for ks in shared.values() for k in ks}
        values = _read_tensors(checkpoint_files, keys | {k.replace(".up_proj.", ".gate_proj.") for k in keys})
        for proj, ks in shared.items():
            for k in ks:
                gate = values.get(k.replace(".up_proj.", ".gate_proj."))
                if gate is None or k not in values or not torch.equal(gate, values[k]):
                    del planned[proj]  # gate and up quantized with different per-tensor scales
                    break
        if not planned:
            return
        try:
            packed_experts(module, planned)
        except ValueError as err:
            raise ValueError(f"{name}: cannot keep the checkpoint's experts packed: {err}") from None
        for proj in planned:
            self._packed_experts[f"{name}.{proj}"] = (layout[proj], _interleaved(module))
            self._covered.update(f"{name}.{e}.{h}" for e in range(n) for h in layout[proj])

    def _experts_projection(
        self, name: str, n: int, halves: tuple[str, ...], stored: dict[str, dict[str, torch.Tensor]]
    ) -> tuple[str, int | None, dict[str, torch.Tensor]] | None:
        """``(quant_algo, group_size, meta tensors of all experts merged)`` of one fused projection whose
        per-expert weights are stored packed in one format, or ``None``."""
        config = self.quantization_config
        stems = [f"{name}.{e}.{h}" for e in range(n) for h in halves]
        if not all(s in stored and "weight_scale" in stored[s] for s in stems):
            return None
        if any("pre_quant_scale" in stored[s] for s in stems):
            return None  # folded into the weight's columns by the dequantized load, per expert
        algos = {config.layer_algo(s) for s in stems}
        groups = {config.layer_group_size(s) for s in stems}
        if len(algos) != 1 or None in algos or len(groups) != 1:
            return None
        algo, group = algos.pop(), groups.pop()
        if _packer_for(stored[stems[0]], {algo}) is None:
            return None
        merged: dict[str, torch.Tensor] = {}
        for t in _PACKED:
            per_half = [stored[f"{name}.0.{h}"].get(t) for h in halves]
            if per_half[0] is None:
                continue
            for e in range(n):
                for h, ref in zip(halves, per_half, strict=True):
                    got = stored[f"{name}.{e}.{h}"].get(t)
                    if got is None or ref is None or got.shape != ref.shape or got.dtype != ref.dtype:
                        return None
            ref = per_half[0]
            if ref.ndim == 0:
                shape: tuple[int, ...] = (n,)
            elif all(p.shape[1:] == ref.shape[1:] for p in per_half):
                shape = (n, sum(p.shape[0] for p in per_half), *ref.shape[1:])
            else:
                return None
            merged[t] = torch.empty(shape, dtype=ref.dtype, device="meta")
        return algo, group, merged
