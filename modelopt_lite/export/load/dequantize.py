"""The dequantized load of :mod:`.loader`: one layer's stored tensors (``weight``, its scales, an unfolded
``pre_quant_scale``) -> one dense weight, by the packer of its format (:func:`dequantize_layer`), and the
loading op that transformers runs on every stored weight (:class:`ModeloptDequantize`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps

from ...quantization.compress.packers import PACKERS, Packer

if TYPE_CHECKING:
    from .config import ExportQuantizerView

__all__ = ["ModeloptDequantize", "dequantize_layer"]

_COMPANIONS = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "k_scale", "v_scale")
_COMPANIONS += ("k_bias", "v_bias")  # an affine KV cache


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

    def __init__(self, hf_quantizer: ExportQuantizerView):
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
            if config.activations == "fake":  # the input quantizer applies it (load_activations)
                parts["pre_quant_scale"] = None
            dense = []
            for i, w in enumerate(weights):
                tensors = {"weight": w}
                for c, v in parts.items():
                    if v is not None:
                        tensors[c] = v[i] if isinstance(v, list) else v
                dense.append(dequantize_layer(tensors, allowed, dtype or torch.float32, group))
            if self._is_conv1d(model, full_layer_name):  # exported (out, in); GPT-2's Conv1D holds (in, out)
                dense = [d.t().contiguous() for d in dense]
            out[key] = dense if isinstance(value, list) else dense[0]
        if full_layer_name is not None and len(out) == 1 and not isinstance(next(iter(out.values())), list):
            return {full_layer_name: _first(next(iter(out.values())))}
        return out

    @staticmethod
    def _is_conv1d(model: nn.Module | None, name: str | None) -> bool:
        from transformers.pytorch_utils import Conv1D

        if model is None or name is None:
            return False
        try:
            return isinstance(model.get_submodule(name.rpartition(".")[0]), Conv1D)
        except AttributeError:
            return False

    @staticmethod
    def _target_dtype(model: nn.Module | None, name: str | None) -> torch.dtype | None:
        if model is None or name is None:
            return None
        try:
            param = model.get_parameter(name)
        except AttributeError:
            return None
        return param.dtype
