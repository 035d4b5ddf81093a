"""Loading an exported checkpoint back into transformers, dequantized to a floating dtype.

``import modelopt_lite.export`` registers ``quant_method: "modelopt"`` with transformers' public registration
API (``register_quantization_config`` / ``register_quantizer``), so ``AutoModelForCausalLM.from_pretrained
(export_dir)`` works. By default the quantizer dequantizes: each layer's stored tensors (``weight``, its
scales, an unfolded ``pre_quant_scale``) become one dense weight in the loading op that transformers runs
before its own conversions (so per-expert tensors are dequantized before they are merged into fused experts).
``input_scale`` / ``k_scale`` / ``v_scale`` (and an affine KV cache's ``k_bias`` / ``v_bias``) are dropped:
the loaded model computes with dense activations.

With ``dequantize=False`` in the quantization config (transformers' name for this loading option;
:func:`load_hf_checkpoint` ``compress=True`` sets it) the linear layers keep the stored tensors packed: each
becomes the compressed layer of ``mtq.compress`` (:func:`~modelopt_lite.quantization.compress.packed_linear`),
which dequantizes its weight on the fly in each forward and computes what the dequantized load computes
(bit for bit, a ``pre_quant_scale`` aside: it scales the input instead of the weight's columns). With
``int8_gemm=True`` (``None``: where it is fast) W8A8 layers run torchao's int8 GEMM instead, quantizing
activations with the stored ``input_scale`` as an engine does (outputs then differ from the dequantized load
by that activation quantization). Fused MoE experts written per expert (``...experts.{i}.gate_proj`` /
``up_proj`` / ``down_proj``) become the compressed experts of ``mtq.compress``
(:func:`~modelopt_lite.quantization.compress.packed_experts`): each projection's per-expert tensors are
merged as the model fuses them (gate and up rows concatenated, or interleaved for GPT-OSS; every expert
stays packed ``(out, in)``), never materialising the full-precision 3-D weight, and the forward gives the
dequantized load's outputs bit for bit. A projection whose experts cannot be merged packed (an unfolded
``pre_quant_scale``, formats or block sizes that differ between experts, gate and up halves with different
per-tensor scales) loads dequantized: one INFO line per format names every quantized weight that loads in
full precision.

:func:`load_hf_checkpoint` adds the checks of ``hf_quant_config.json`` (missing or malformed: a clear error).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.core_model_loading import (
    Concatenate,
    ConversionOps,
    Interleave,
    MergeModulelist,
    Transpose,
    WeightConverter,
)
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..logging import get_logger
from ..moe import QuantExperts
from ..nn import QUANT_MODULES
from ..quantization.compress import (
    KERNELS,
    CompressedExperts,
    CompressedLinear,
    compressed_layers,
    fast_int8_gemm,
    packed_experts,
    packed_linear,
    require_torchao,
    use_int8_gemm,
)
from .hf_config import QUANT_METHOD, validate_hf_quant_config
from .layers import _interleaved
from .packers import PACKERS, Packer

__all__ = ["ModeloptExportConfig", "ModeloptExportQuantizer", "dequantize_layer", "load_hf_checkpoint"]

logger = get_logger(__name__)
_COMPANIONS = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "k_scale", "v_scale")
_COMPANIONS += ("k_bias", "v_bias")  # an affine KV cache


class ModeloptExportConfig(QuantizationConfigMixin):
    """``config.json["quantization_config"]`` of an exported checkpoint (the fields engines read)."""

    def __init__(
        self,
        quant_algo: str | None = None,
        config_groups: dict[str, Any] | None = None,
        ignore: list[str] | None = None,
        kv_cache_quant_algo: str | None = None,
        group_size: int | None = None,
        quantized_layers: dict[str, Any] | None = None,
        producer: dict[str, Any] | None = None,
        dequantize: bool = True,
        int8_gemm: bool | None = False,
        **kwargs: Any,
    ):
        """``dequantize=False`` keeps the linear layers' weights packed (see the module docstring);
        ``int8_gemm``: whether W8A8 layers kept packed run torchao's int8 GEMM (``None``: where fast)."""
        self.quant_method = QUANT_METHOD  # type: ignore[assignment]
        self.quant_algo = quant_algo
        self.config_groups = config_groups or {}
        self.ignore = list(ignore or [])
        self.kv_cache_quant_algo = kv_cache_quant_algo
        self.group_size = group_size
        self.quantized_layers = quantized_layers
        self.producer = producer
        self.extra = {k: v for k, v in kwargs.items() if k != "quant_method"}
        self.dequantize = dequantize
        self.int8_gemm = int8_gemm
        self.post_init()

    def post_init(self) -> None:
        if not isinstance(self.dequantize, bool) or self.int8_gemm not in (None, True, False):
            raise ValueError(
                "quantization_config (quant_method 'modelopt'): dequantize must be a bool and int8_gemm a "
                f"bool or None (got dequantize={self.dequantize!r}, int8_gemm={self.int8_gemm!r})"
            )
        if not isinstance(self.quant_algo, str):
            raise ValueError(
                f"quantization_config (quant_method 'modelopt') has no quant_algo (got {self.quant_algo!r}); "
                "the checkpoint was not written by a modelopt export"
            )

    def algorithms(self) -> set[str]:
        if self.quant_algo == "MIXED_PRECISION":
            return {entry["quant_algo"] for entry in (self.quantized_layers or {}).values()}
        return {self.quant_algo} if self.quant_algo else set()

    def layer_algo(self, layer: str) -> str | None:
        """The ``quant_algo`` of one layer (``None``: a MIXED_PRECISION checkpoint does not list it)."""
        if self.quant_algo == "MIXED_PRECISION":
            entry = (self.quantized_layers or {}).get(layer)
            return entry.get("quant_algo") if isinstance(entry, dict) else None
        return self.quant_algo

    def layer_group_size(self, layer: str) -> int | None:
        """The ``group_size`` of one layer (a MIXED_PRECISION layer's own, else the checkpoint's)."""
        if self.quant_algo == "MIXED_PRECISION":
            entry = (self.quantized_layers or {}).get(layer)
            return entry.get("group_size") if isinstance(entry, dict) else None
        return self.group_size


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


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _packer_for(tensors: dict[str, torch.Tensor], allowed: set[str]) -> Packer | None:
    """The packer whose stored layout these tensors have, among the checkpoint's formats."""
    weight = tensors["weight"]
    if "weight_scale" not in tensors:
        return None
    scale = tensors["weight_scale"]
    for algo in sorted(allowed):
        packer = PACKERS.get(algo)
        if packer is None or packer.weight_dtype != weight.dtype:
            continue
        if algo in ("W4A8_AWQ",) and "weight_scale_2" not in tensors:
            continue
        if (algo == "MXFP8") != (scale.dtype == torch.uint8):  # E8M0 exponent bytes are MXFP8's alone
            continue
        return packer
    raise ValueError(
        f"stored weight {weight.dtype} {tuple(weight.shape)} with weight_scale {scale.dtype} "
        f"{tuple(scale.shape)} matches none of the checkpoint's formats {sorted(allowed)}"
    )


def dequantize_layer(
    tensors: dict[str, torch.Tensor], allowed: set[str], dtype: torch.dtype, group_size: int | None = None
) -> torch.Tensor:
    """One layer's dense weight from its stored tensors (``pre_quant_scale`` folded into the columns);
    ``group_size``: the checkpoint's, for a format whose last block may be partial (INT4)."""
    packer = _packer_for(tensors, allowed)
    weight = tensors["weight"].float() if packer is None else packer.dequantize(tensors, group_size)
    if "pre_quant_scale" in tensors:
        weight = weight * tensors["pre_quant_scale"].float().reshape(1, -1)
    return weight.to(dtype)


class ModeloptDequantize(ConversionOps):
    """Loading op: every stored weight with its companions -> one dense weight in the parameter's dtype."""

    def __init__(self, hf_quantizer: ModeloptExportQuantizer):
        self.hf_quantizer = hf_quantizer

    def convert(
        self,
        input_dict: dict[str, Any],
        full_layer_name: str | None = None,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        config = self.hf_quantizer.quantization_config
        allowed = config.algorithms()
        dtype = self._target_dtype(model, full_layer_name)
        group = config.layer_group_size((full_layer_name or "").removesuffix(".weight"))
        out: dict[str, Any] = {}
        for key, value in input_dict.items():
            if key.rpartition(".")[2] in _COMPANIONS or key in _COMPANIONS:
                continue
            stem = key[: -len("weight")] if key.endswith("weight") else None
            if stem is None:
                out[key] = value
                continue
            weights = value if isinstance(value, list) else [value]
            parts = {c: input_dict.get(stem + c) for c in _COMPANIONS}
            dense = []
            for i, w in enumerate(weights):
                tensors = {"weight": w}
                for c, v in parts.items():
                    if v is not None:
                        tensors[c] = v[i] if isinstance(v, list) else v
                dense.append(dequantize_layer(tensors, allowed, dtype or torch.float32, group))
            out[key] = dense if isinstance(value, list) else dense[0]
        if full_layer_name is not None and len(out) == 1 and not isinstance(next(iter(out.values())), list):
            return {full_layer_name: _first(next(iter(out.values())))}
        return out

    @staticmethod
    def _target_dtype(model: nn.Module | None, name: str | None) -> torch.dtype | None:
        if model is None or name is None:
            return None
        try:
            param = model.get_parameter(name)
        except AttributeError:
            return None
        return param.dtype


class ModeloptKeepPacked(ModeloptDequantize):
    """Loading op of ``dequantize=False``: the stored tensors of a layer prepared by
    :meth:`ModeloptExportQuantizer._process_model_before_weight_loading` (a compressed layer with ``meta``
    placeholders) go into its buffers as they are; its ``pre_quant_scale`` (and, for W8A8, ``input_scale`` as
    the activation amax) into its input quantizer. Any other weight is dequantized."""

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
    for experts prepared by :meth:`ModeloptExportQuantizer._prepare_packed` (compressed experts with ``meta``
    placeholders) the per-expert packed tensors are stacked along the experts dimension, the gate and up
    halves concatenated (or interleaved) along the rows, each expert staying ``(out, in)`` whatever the
    model's storage layout; any other merge runs ``fallback`` (dequantize, then the model's own ops)."""

    def __init__(self, hf_quantizer: ModeloptExportQuantizer, fallback: list[ConversionOps]):
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


def _fused_experts_conversions(experts: str, interleaved: bool, bias: bool) -> list[WeightConverter]:
    """Per-expert ``gate_proj`` / ``up_proj`` / ``down_proj`` maps, written ``(out, in)`` as every other
    linear map, merged into fused experts stored transposed, ``(experts, in, out)``: Llama 4 (``gate_up_proj``
    = [gate; up]) and GPT-OSS (gate and up rows interleaved, with biases). transformers has no such
    conversion for either."""

    def gate_up() -> list[ConversionOps]:
        ops: list[ConversionOps] = [MergeModulelist(dim=0), Concatenate(dim=1)]
        return [*ops, Interleave(dim=1, inverse=True)] if interleaved else ops

    halves = [f"{experts}.*.gate_proj.", f"{experts}.*.up_proj."]
    down = f"{experts}.*.down_proj."
    out = [
        WeightConverter(
            [h + "weight" for h in halves], f"{experts}.gate_up_proj", [*gate_up(), Transpose(1, 2)]
        ),
        WeightConverter(down + "weight", f"{experts}.down_proj", [MergeModulelist(dim=0), Transpose(1, 2)]),
    ]
    if bias:
        out.append(WeightConverter([h + "bias" for h in halves], f"{experts}.gate_up_proj_bias", gate_up()))
        out.append(WeightConverter(down + "bias", f"{experts}.down_proj_bias", [MergeModulelist(dim=0)]))
    return out


#: fused experts classes written per expert -> (their path under the decoder layer, interleaved, biases)
_FUSED_TRANSPOSED = {
    Llama4TextExperts: ("feed_forward.experts", False, False),
    GptOssExperts: ("mlp.experts", True, True),
}


class ModeloptExportQuantizer(HfQuantizer):
    """Loads an exported checkpoint: dequantized (the default), or with the linear layers' weights kept
    packed (``dequantize=False``, see the module docstring)."""

    requires_calibration = True  # only pre-quantized checkpoints
    quantization_config: ModeloptExportConfig
    serialized_names: ClassVar[dict[str, list[str]]] = {"weight": ["weight", *_COMPANIONS]}

    def __init__(self, quantization_config: ModeloptExportConfig, **kwargs: Any):
        super().__init__(quantization_config, **kwargs)
        self._stored: dict[str, str] = {}  # layers stored quantized in the checkpoint -> quant_algo
        self._covered: set[str] = set()  # per-expert layers kept packed in compressed experts
        #: compressed experts projection (``<experts>.<proj>``) -> (checkpoint halves, interleaved rows)
        self._packed_experts: dict[str, tuple[tuple[str, ...], bool]] = {}

    def get_load_operations(self) -> dict:
        return {"dequantize": ModeloptDequantize, "deserialize": ModeloptKeepPacked}

    def update_weight_conversions(self, weight_conversions: list, model: nn.Module) -> list:
        """The model's conversions, plus the merge of per-expert Llama 4 / GPT-OSS experts (dequantized
        first; with ``dequantize=False`` kept packed where the experts were prepared packed)."""
        present = {type(m) for m in model.modules()}
        for cls in _FUSED_TRANSPOSED:
            # before weight loading a fused experts module may already be its compressed class
            if any(issubclass(p, cls) for p in present):
                experts, interleaved, bias = _FUSED_TRANSPOSED[cls]
                weight_conversions = [
                    *weight_conversions,
                    *_fused_experts_conversions(experts, interleaved, bias),
                ]
        converters = super().update_weight_conversions(weight_conversions, model)
        if self.quantization_config.dequantize:
            return converters
        out = []
        for c in converters:
            ops = getattr(c, "operations", None) or []
            if len(ops) > 1 and type(ops[0]) is ModeloptDequantize:  # a merge of per-expert weights
                c = c.copy(
                    c._original_source_patterns,
                    c._original_target_patterns,
                    operations=[ModeloptKeepPackedExperts(self, list(ops))],
                )
            out.append(c)
        return out

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        unknown = self.quantization_config.algorithms() - set(PACKERS)
        if unknown:
            raise ValueError(
                f"the checkpoint's quant_algo {sorted(unknown)} cannot be dequantized by modelopt_lite "
                f"(supported: {sorted(PACKERS)})"
            )
        if not self.quantization_config.dequantize:
            require_torchao()
            self._prepare_packed(model, kwargs.get("checkpoint_files") or [])

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

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        if self.quantization_config.dequantize:
            return model
        int8_gemm = self.quantization_config.int8_gemm
        for name, module in model.named_modules():
            if isinstance(module, CompressedExperts):
                unloaded = [n for n, b in module._packed().items() if b.is_meta]
                if unloaded:
                    raise ValueError(
                        f"{name}: the checkpoint's per-expert tensors did not load into the packed experts "
                        f"({', '.join(unloaded)} still empty); load with dequantize=True"
                    )
        layers = compressed_layers(model)
        linear = {n for n, m in model.named_modules() if isinstance(m, CompressedLinear)}
        kernel = {n: use_int8_gemm(model.get_submodule(n), int8_gemm) for n in linear if layers[n] in KERNELS}
        for algo in sorted(set(layers.values())):
            on_kernel = sum(1 for n, a in layers.items() if a == algo and kernel.get(n))
            if on_kernel:
                logger.info(
                    "from_pretrained(dequantize=False): %d %s layer(s) keep packed weights and run %s "
                    "(activations quantized with the stored input_scale)",
                    on_kernel,
                    algo,
                    KERNELS[algo],
                )
            rest = sum(1 for n, a in layers.items() if a == algo and not kernel.get(n) and n in linear)
            if rest:
                why = ""
                if algo in KERNELS:
                    why = (
                        "; torch._int_mm is slow on a CPU without AVX512-VNNI / AMX, int8_gemm=True forces it"
                        if int8_gemm is None and not fast_int8_gemm(next(iter(model.buffers())).device)
                        else "; int8_gemm=True runs the int8 GEMM on quantized activations"
                    )
                logger.info(
                    "from_pretrained(dequantize=False): %d %s layer(s) keep packed weights and dequantize "
                    "them on the fly (dense activations, as the dequantized load%s)",
                    rest,
                    algo,
                    why,
                )
            experts = sum(1 for n, a in layers.items() if a == algo and n not in linear)
            if experts:
                logger.info(
                    "from_pretrained(dequantize=False): %d fused MoE experts projection(s) in %s keep packed "
                    "weights and dequantize them on the fly (all experts of a projection per forward, as the "
                    "dequantized load)",
                    experts,
                    algo,
                )
        by_algo: dict[str, list[str]] = {}
        for name, algo in sorted(self._stored.items()):
            if name not in layers and name not in self._covered:
                by_algo.setdefault(algo, []).append(name)
        for algo, names in sorted(by_algo.items()):
            logger.info(
                "from_pretrained(dequantize=False): %d %s weight(s) load dequantized to full precision (not "
                "a plain linear layer of the model, nor fused MoE experts stored packed in one format with "
                "the gate and up halves sharing their per-tensor scales, without pre_quant_scale): %s",
                len(names),
                algo,
                ", ".join(names[:4]) + (" ..." if len(names) > 4 else ""),
            )
        return model

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return self.quantization_config.dequantize  # packed weights: train before compressing


def _register() -> None:
    """Definition-time registration under ``modelopt`` unless another library holds the name."""
    owner = AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD)
    if owner is None and QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(ModeloptExportConfig)
        register_quantizer(QUANT_METHOD)(ModeloptExportQuantizer)
    elif owner is not ModeloptExportQuantizer:
        logger.warning(
            "transformers already has a quantizer for quant_method %r (%s): from_pretrained on exported "
            "checkpoints uses it instead of modelopt_lite's dequantizing loader",
            QUANT_METHOD,
            getattr(owner, "__name__", owner),
        )


_register()


def read_hf_quant_config(export_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``hf_quant_config.json`` of ``export_dir``, validated (missing or malformed: a clear error)."""
    path = Path(export_dir) / "hf_quant_config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: {export_dir} is not a modelopt export (export_hf_checkpoint writes it "
            "next to config.json)"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno}); re-export the model"
        ) from None
    return validate_hf_quant_config(data, str(path))


def load_hf_checkpoint(
    export_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.bfloat16,
    *,
    compress: bool = False,
    int8_gemm: bool | None = False,
    **kwargs: Any,
) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(export_dir, dtype=dtype)`` after checking
    ``hf_quant_config.json`` against ``config.json``. Weights are dequantized to ``dtype``; with
    ``compress=True`` the linear layers keep them packed, as ``mtq.compress`` does (the quantization config's
    ``dequantize=False``; needs the torchao extra), and ``int8_gemm`` chooses whether W8A8 layers run
    torchao's int8 GEMM on activations quantized with the stored ``input_scale`` (``None``: where it is
    fast; ``False``, the default: dense activations, what the dequantized load computes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = read_hf_quant_config(export_dir)
    config_path = Path(export_dir) / "config.json"
    qcfg = json.loads(config_path.read_text()).get("quantization_config") or {}
    if qcfg.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"{config_path}: quantization_config.quant_method is {qcfg.get('quant_method')!r}, "
                         f"expected {QUANT_METHOD!r}")  # fmt: skip
    if qcfg.get("quant_algo") != hf_cfg["quantization"]["quant_algo"]:
        raise ValueError(
            f"{export_dir}: config.json says quant_algo {qcfg.get('quant_algo')!r} but hf_quant_config.json "
            f"says {hf_cfg['quantization']['quant_algo']!r}"
        )
    if compress:
        require_torchao()
        if "config" in kwargs:
            raise ValueError("load_hf_checkpoint(compress=True) sets the model config; do not pass config=")
        config = AutoConfig.from_pretrained(export_dir)
        config.quantization_config = {**qcfg, "dequantize": False, "int8_gemm": int8_gemm}
        kwargs["config"] = config
    elif int8_gemm is not False:
        raise ValueError("load_hf_checkpoint: int8_gemm applies to compress=True only")
    return AutoModelForCausalLM.from_pretrained(export_dir, dtype=dtype, **kwargs)
