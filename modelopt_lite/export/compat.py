"""The reference library's other export entry points. This library writes one deployable format, the unified
Hugging Face checkpoint (:func:`~.writer.export_hf_checkpoint`); the TensorRT-LLM, Megatron-Core, vLLM
fake-quant, speculative-decoding and Transformer-Engine paths exist under their names and raise
:class:`~modelopt_lite.nn.errors.UnsupportedFeatureError` naming what to use."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from ..nn import iter_quantizers
from ..nn.errors import UnsupportedFeatureError

__all__ = [
    "convert_hf_quant_config_format",
    "convert_to_transformer_engine",
    "export_hf_vllm_fq_checkpoint",
    "export_mcore_gpt_to_hf",
    "export_mcore_gpt_to_hf_vllm_fq",
    "export_speculative_decoding",
    "export_tensorrt_llm_checkpoint",
    "has_quant_opt",
    "import_mcore_gpt_from_hf",
    "torch_to_tensorrt_llm_checkpoint",
]

_HF = (
    "export a unified Hugging Face checkpoint with export_hf_checkpoint(model, export_dir), which "
    "TensorRT-LLM, vLLM and SGLang load"
)
_MCORE = "Megatron-Core models are not supported; quantize and export a transformers model"


def _refuse(name: str, instead: str) -> NoReturn:
    raise UnsupportedFeatureError(f"{name} is not supported: {instead}")


def has_quant_opt(model: nn.Module) -> bool:
    """Whether ``model`` holds quantizers (was quantized with ``mtq.quantize`` or restored)."""
    return any(True for _ in iter_quantizers(model))


def export_tensorrt_llm_checkpoint(
    model: nn.Module,
    decoder_type: str,
    dtype: torch.dtype | None = None,
    export_dir: Path | str = "/tmp",
    inference_tensor_parallel: int = 0,
    inference_pipeline_parallel: int = 1,
    use_nfs_workspace: bool = False,
) -> None:
    """The reference's TensorRT-LLM checkpoint: not supported."""
    _refuse("export_tensorrt_llm_checkpoint", _HF)


def torch_to_tensorrt_llm_checkpoint(
    model: nn.Module,
    decoder_type: str,
    dtype: torch.dtype | None = None,
    inference_tensor_parallel: int = 0,
    inference_pipeline_parallel: int = 1,
    workspace_path: Path | str | None = None,
) -> Any:
    """The reference's in-memory TensorRT-LLM conversion: not supported."""
    _refuse("torch_to_tensorrt_llm_checkpoint", _HF)


def export_mcore_gpt_to_hf(
    model: nn.Module, pretrained_model_name_or_path: str | os.PathLike[str], *args: Any, **kwargs: Any
) -> None:
    """The reference's Megatron-Core export: not supported."""
    _refuse("export_mcore_gpt_to_hf", _MCORE)


def export_mcore_gpt_to_hf_vllm_fq(
    model: nn.Module, pretrained_model_name_or_path: str | os.PathLike[str], *args: Any, **kwargs: Any
) -> None:
    """The reference's Megatron-Core vLLM fake-quant export: not supported."""
    _refuse("export_mcore_gpt_to_hf_vllm_fq", _MCORE)


def import_mcore_gpt_from_hf(model: nn.Module, pretrained_model_path: str, *args: Any, **kwargs: Any) -> None:
    """The reference's Megatron-Core import: not supported."""
    _refuse("import_mcore_gpt_from_hf", _MCORE)


def export_hf_vllm_fq_checkpoint(
    model: nn.Module, export_dir: Path | str, inplace_mem_efficient: bool = False
) -> None:
    """The reference's vLLM fake-quant checkpoint: not supported."""
    _refuse("export_hf_vllm_fq_checkpoint", _HF)


def export_speculative_decoding(
    model: nn.Module, dtype: torch.dtype | None = None, export_dir: Path | str = "/tmp"
) -> None:
    """The reference's speculative-decoding (EAGLE / Medusa) export: not supported."""
    _refuse("export_speculative_decoding", "speculative-decoding heads are not part of this library; " + _HF)


def convert_to_transformer_engine(model: nn.Module) -> nn.Module:
    """The reference's Transformer-Engine conversion: not supported."""
    _refuse("convert_to_transformer_engine", "Transformer-Engine models are not supported")


def convert_hf_quant_config_format(input_config: dict[str, Any]) -> dict[str, Any]:
    """The reference's hf_quant_config.json -> config.json conversion: not supported here."""
    _refuse(
        "convert_hf_quant_config_format",
        "export_hf_checkpoint writes both files; read them with modelopt_lite.export.read_hf_quant_config",
    )
