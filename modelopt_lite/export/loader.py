"""Loading an exported checkpoint back into transformers, dequantized to a floating dtype.

``import modelopt_lite.export`` registers ``quant_method: "modelopt"`` with transformers' public registration
API (``register_quantization_config`` / ``register_quantizer``), so ``AutoModelForCausalLM.from_pretrained
(export_dir)`` works. The quantizer only dequantizes: each layer's stored tensors (``weight``, its scales, an
unfolded ``pre_quant_scale``) become one dense weight in the loading op that transformers runs before its own
conversions (so per-expert tensors are dequantized before they are merged into fused experts).
``input_scale`` / ``k_scale`` / ``v_scale`` (and an affine KV cache's ``k_bias`` / ``v_bias``) are dropped:
the loaded model computes with dense activations.

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
from .hf_config import QUANT_METHOD, validate_hf_quant_config
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
        **kwargs: Any,
    ):
        self.quant_method = QUANT_METHOD  # type: ignore[assignment]
        self.quant_algo = quant_algo
        self.config_groups = config_groups or {}
        self.ignore = list(ignore or [])
        self.kv_cache_quant_algo = kv_cache_quant_algo
        self.group_size = group_size
        self.quantized_layers = quantized_layers
        self.producer = producer
        self.extra = {k: v for k, v in kwargs.items() if k not in ("quant_method", "dequantize")}
        self.dequantize = True  # the only mode: weights load dense
        self.post_init()

    def post_init(self) -> None:
        if not isinstance(self.quant_algo, str):
            raise ValueError(
                f"quantization_config (quant_method 'modelopt') has no quant_algo (got {self.quant_algo!r}); "
                "the checkpoint was not written by a modelopt export"
            )

    def algorithms(self) -> set[str]:
        if self.quant_algo == "MIXED_PRECISION":
            return {entry["quant_algo"] for entry in (self.quantized_layers or {}).values()}
        return {self.quant_algo} if self.quant_algo else set()


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


def dequantize_layer(tensors: dict[str, torch.Tensor], allowed: set[str], dtype: torch.dtype) -> torch.Tensor:
    """One layer's dense weight from its stored tensors (``pre_quant_scale`` folded into the columns)."""
    packer = _packer_for(tensors, allowed)
    weight = tensors["weight"].float() if packer is None else packer.dequantize(tensors)
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
        allowed = self.hf_quantizer.quantization_config.algorithms()
        dtype = self._target_dtype(model, full_layer_name)
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
                dense.append(dequantize_layer(tensors, allowed, dtype or torch.float32))
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
    """Dequantizes an exported checkpoint while transformers loads it (no quantized compute)."""

    requires_calibration = True  # only pre-quantized checkpoints
    quantization_config: ModeloptExportConfig
    serialized_names: ClassVar[dict[str, list[str]]] = {"weight": ["weight", *_COMPANIONS]}

    def get_load_operations(self) -> dict:
        return {"dequantize": ModeloptDequantize}

    def update_weight_conversions(self, weight_conversions: list, model: nn.Module) -> list:
        """The model's conversions, plus the merge of per-expert Llama 4 / GPT-OSS experts (dequantized
        first)."""
        present = {type(m) for m in model.modules()}
        for cls, (experts, interleaved, bias) in _FUSED_TRANSPOSED.items():
            if cls in present:
                weight_conversions = [
                    *weight_conversions,
                    *_fused_experts_conversions(experts, interleaved, bias),
                ]
        return super().update_weight_conversions(weight_conversions, model)

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        unknown = self.quantization_config.algorithms() - set(PACKERS)
        if unknown:
            raise ValueError(
                f"the checkpoint's quant_algo {sorted(unknown)} cannot be dequantized by modelopt_lite "
                f"(supported: {sorted(PACKERS)})"
            )

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return True


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
    export_dir: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16, **kwargs: Any
) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(export_dir, dtype=dtype)`` after checking
    ``hf_quant_config.json`` against ``config.json``; weights are dequantized to ``dtype``."""
    from transformers import AutoModelForCausalLM

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
    return AutoModelForCausalLM.from_pretrained(export_dir, dtype=dtype, **kwargs)
