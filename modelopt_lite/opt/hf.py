"""``save_pretrained`` / ``from_pretrained`` that carry quantizer state, through transformers' public
quantization registration API (no patching).

After :func:`enable_huggingface_checkpointing`, every model quantized by ``mtq.quantize`` (or restored by
``mto.restore``) gets ``config.quantization_config = {"quant_method": "modelopt_lite", "modelopt_lite_state":
...}``. The state is computed when the config is serialised, so later changes (a disabled quantizer, a new
amax shape) are saved too; amax and scales travel as ordinary buffers in ``model.safetensors``.
``from_pretrained`` finds ``quant_method: "modelopt_lite"``, and our ``HfQuantizer`` re-creates the quantizers
before the weights load. Call it before ``mtq.quantize`` and before ``from_pretrained``.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..logging import get_logger
from ..quantization.model_quant import add_post_quantize_hook, remove_post_quantize_hook
from .state import convert_flat_block_amax, modelopt_state, restore_from_modelopt_state

__all__ = [
    "QUANT_METHOD",
    "ModeloptLiteStateConfig",
    "disable_huggingface_checkpointing",
    "enable_huggingface_checkpointing",
]

logger = get_logger(__name__)
QUANT_METHOD = "modelopt_lite"


class ModeloptLiteStateConfig(QuantizationConfigMixin):
    """``quantization_config`` holding the quantizer state (live while attached to a model)."""

    def __init__(self, modelopt_lite_state: dict[str, Any] | None = None, **kwargs: Any):
        self.quant_method = QUANT_METHOD  # type: ignore[assignment]
        self.modelopt_lite_state = modelopt_lite_state
        self._model: weakref.ref[nn.Module] | None = None

    def to_dict(self) -> dict[str, Any]:
        model = self._model() if self._model is not None else None
        state = modelopt_state(model) if model is not None else self.modelopt_lite_state
        if state is None:
            raise RuntimeError(
                "quantization_config 'modelopt_lite' lost its model (garbage-collected) and holds no state; "
                "save the quantized model itself"
            )
        return {"quant_method": QUANT_METHOD, "modelopt_lite_state": state}

    def __deepcopy__(self, memo: dict[int, Any]) -> ModeloptLiteStateConfig:
        # A deep copy of the model copies its config: point the copy at the copied model (in ``memo``), or,
        # when the config alone is copied, freeze the state as it is now.
        model = self._model() if self._model is not None else None
        new = ModeloptLiteStateConfig(copy.deepcopy(self.modelopt_lite_state, memo))
        if model is not None and id(model) in memo:
            new._model = weakref.ref(memo[id(model)])
        elif model is not None:
            new.modelopt_lite_state = modelopt_state(model)
        return new

    def __iter__(self):
        yield from self.to_dict().items()


class ModeloptLiteStateQuantizer(HfQuantizer):
    """Re-creates fake quantizers on the freshly built model before its weights load."""

    requires_calibration = False

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        state = self.quantization_config.modelopt_lite_state
        if not state:
            raise ValueError(
                "quantization_config has quant_method 'modelopt_lite' but no modelopt_lite_state"
            )
        restore_from_modelopt_state(model, state)
        attach(model)

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        convert_flat_block_amax(model)  # (a block amax saved before issue 46)
        return model

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True


def attach(model: nn.Module) -> None:
    """Give a quantized transformers model a live ``quantization_config`` (no-op for other modules)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    live = ModeloptLiteStateConfig()
    live._model = weakref.ref(model)
    config.quantization_config = live


@contextmanager
def attached(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model.config`` carries the live quantizer-state config (for one
    ``save_pretrained``); the previous ``quantization_config`` is put back afterwards."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        yield
        return
    missing = object()
    previous = getattr(config, "quantization_config", missing)
    attach(model)
    try:
        yield
    finally:
        if previous is missing:
            del config.quantization_config
        else:
            config.quantization_config = previous


def enable_huggingface_checkpointing() -> None:
    """Make ``save_pretrained`` / ``from_pretrained`` save and restore quantizer state (idempotent)."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not ModeloptLiteStateConfig:
        register_quantization_config(QUANT_METHOD)(ModeloptLiteStateConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not ModeloptLiteStateQuantizer:
        register_quantizer(QUANT_METHOD)(ModeloptLiteStateQuantizer)
    add_post_quantize_hook(attach)
    logger.info("Hugging Face checkpointing of quantizer state enabled (quant_method %r)", QUANT_METHOD)


def disable_huggingface_checkpointing() -> None:
    """Undo :func:`enable_huggingface_checkpointing` (models quantized since keep their config)."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is ModeloptLiteStateConfig:
        del AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD]
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is ModeloptLiteStateQuantizer:
        del AUTO_QUANTIZER_MAPPING[QUANT_METHOD]
    remove_post_quantize_hook(attach)


def checkpointing_enabled() -> bool:
    return AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is ModeloptLiteStateQuantizer
