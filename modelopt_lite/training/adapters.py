"""LoRA adapters in the trainers: the model wrapped from ``lora_config``, and the frozen part of a LoRA
model in a checkpoint.

peft's ``save_pretrained`` (what ``Trainer`` calls for a ``PeftModel``) writes the adapters only. The base
is not always the model the run started from: calibration wrote amax and scales into the quantizers, and
AWQ / SmoothQuant rescaled weights. So a checkpoint also holds every tensor outside the adapters in
``FROZEN_FILE`` (safetensors, tied tensors once), and resume loads it back before the adapters: the run
continues from the same base, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..logging import get_logger
from ..nn.lora import adapter_modules, is_peft_model
from ..quantization.lora import add_lora

__all__ = ["FROZEN_FILE", "load_frozen_base", "save_frozen_base", "with_adapters"]

logger = get_logger(__name__)
FROZEN_FILE = "modelopt_lite_frozen_base.safetensors"


def _frozen_names(model: nn.Module) -> set[str]:
    """State-dict keys of the tensors that belong to an adapter module (to leave out)."""
    adapters = adapter_modules(model)
    return {
        f"{name}.{key}" if name else key
        for name, module in model.named_modules()
        if id(module) in adapters
        for key in list(module._parameters) + list(module._buffers)
    }


def save_frozen_base(model: nn.Module, output: Path) -> None:
    """Write every tensor of ``model`` outside its adapters to ``output / FROZEN_FILE``."""
    skip = _frozen_names(model)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in model.state_dict().items():
        if key in skip or id(value) in seen:
            continue
        seen.add(id(value))
        tensors[key] = value.detach().contiguous()
    save_file(tensors, str(output / FROZEN_FILE))


def load_frozen_base(model: nn.Module, checkpoint: Path) -> None:
    """Load ``checkpoint / FROZEN_FILE`` into ``model`` (before the adapters, which the Trainer loads)."""
    path = checkpoint / FROZEN_FILE
    if not path.is_file():
        raise ValueError(
            f"{checkpoint} holds no {FROZEN_FILE}: it was not saved by a QATTrainer / QADTrainer training "
            "LoRA adapters, so the quantized base it trained on cannot be restored"
        )
    result = model.load_state_dict(load_file(str(path)), strict=False)
    if result.unexpected_keys:
        raise ValueError(
            f"{path} holds {len(result.unexpected_keys)} tensor(s) this model does not have (e.g. "
            f"{result.unexpected_keys[0]}): resume with the model and lora_config of that run"
        )
    logger.info("restored the frozen quantized base from %s", path)


def with_adapters(
    args: tuple[Any, ...], kwargs: dict[str, Any], lora_config: Any, deploy: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The Trainer's arguments with the model (``model=`` or first positional) wrapped in LoRA adapters."""
    model = kwargs.get("model", args[0] if args else None)
    if model is None:
        raise ValueError("lora_config needs the model: pass model=... to the trainer")
    if is_peft_model(model):
        raise ValueError(
            "the model already carries peft adapters and lora_config asks for more: pass the wrapped model "
            "without lora_config (its adapters train), or the plain model with lora_config"
        )
    wrapped = add_lora(model, lora_config, deploy)
    if "model" in kwargs:
        return args, {**kwargs, "model": wrapped}
    return (wrapped, *args[1:]), kwargs
