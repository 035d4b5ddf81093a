"""LoRA adapters (``peft``) on quantized linear layers, in one of two deployments.

peft wraps a linear layer in a ``LoraLayer`` whose ``base_layer`` is the original module; a quantized base
layer is a :class:`~modelopt_lite.nn.QuantLinear` (still an ``nn.Linear``), so peft wraps it as it wraps
any linear layer, before or after :func:`mtq.quantize` (insertion skips the adapters' own ``lora_A`` /
``lora_B`` layers: they stay unquantized, in the compute dtype). What the adapter does to the quantized
forward is the deployment:

* ``"served"`` (peft's own layer): ``y = Q(x, W) + s B A x``. The base weight alone is quantized and the
  adapter runs beside it in high precision: what vLLM / SGLang compute for a LoRA adapter served on a
  quantized base checkpoint. Works on compressed bases (QLoRA: ``mtq.compress`` first).
* ``"merged"``: ``y = Q(x, W + s B A)``. The weight quantizer sees the merged weight during training, so
  merging the adapter (``W += s B A``, exactly what peft's merge computes) and exporting gives the model that
  was trained. Needs ``lora_dropout=0`` (dropout on the adapter's input has no merged form), no DoRA and no
  adapter bias, and a fake-quantized base (a compressed weight cannot take the delta).

:func:`set_lora_deploy` switches every peft LoRA linear layer of a model between the two by changing its
class to a subclass of its own (no state changes; peft's methods, save and load keep working).
peft is an optional dependency (``pip install 'modelopt_lite[peft]'``), imported only when used.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn

from ..logging import get_logger
from .quant_linear import QuantLinear

__all__ = [
    "DEPLOYMENTS",
    "adapter_modules",
    "is_peft_model",
    "lora_deploy",
    "lora_layers",
    "require_peft",
    "set_lora_deploy",
]

logger = get_logger(__name__)
Deploy = Literal["merged", "served"]
#: the two deployments of an adapter trained on a quantized model (see the module docstring)
DEPLOYMENTS: tuple[str, ...] = ("merged", "served")


def require_peft() -> Any:
    """The ``peft`` module, or an ``ImportError`` naming the extra that installs it."""
    try:
        return importlib.import_module("peft")
    except ImportError as err:
        raise ImportError(
            f"LoRA adapters need peft ({err}); install it with: pip install 'modelopt_lite[peft]'"
        ) from err


def _tuner_layer_class() -> type | None:
    """peft's ``BaseTunerLayer`` if peft was imported (a model with adapters implies it was), else None."""
    if "peft" not in sys.modules:
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer

    return BaseTunerLayer


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (``get_peft_model``'s result)."""
    return "peft" in sys.modules and isinstance(model, sys.modules["peft"].PeftModel)


def adapter_modules(model: nn.Module) -> set[int]:
    """``id`` of every module inside a peft adapter (``lora_A`` / ``lora_B`` / embeddings' adapters and
    whatever else a tuner layer lists as its adapter layers): the modules quantization leaves alone."""
    tuner = _tuner_layer_class()
    if tuner is None:
        return set()
    found: set[int] = set()
    for module in model.modules():
        if isinstance(module, tuner):
            for attr in getattr(module, "adapter_layer_names", ()):
                holder = getattr(module, attr, None)
                if isinstance(holder, nn.Module):
                    found.update(id(m) for m in holder.modules())
    return found


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, layer)`` of every peft LoRA linear layer (``peft.tuners.lora.Linear`` and subclasses)."""
    if "peft" not in sys.modules:
        return
    from peft.tuners.lora import Linear as LoraLinear

    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            yield name, module


class _MergedLora:
    """Mixin of a peft LoRA linear layer deployed merged: the base layer's weight quantizer sees
    ``W + sum_a s_a B_a A_a`` over the active adapters (peft's ``get_delta_weight``, bit for bit what
    ``merge`` adds). Falls back to peft's forward with adapters disabled or merged, with per-request
    ``adapter_names``, or on a base layer that is not quantized (the two deployments agree there)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        base = self.get_base_layer()  # type: ignore[attr-defined]
        if (
            self.disable_adapters  # type: ignore[attr-defined]
            or self.merged  # type: ignore[attr-defined]
            or kwargs.get("adapter_names") is not None
            or not isinstance(base, QuantLinear)
        ):
            return super().forward(x, *args, **kwargs)  # type: ignore[misc]
        delta = None
        for name in self.active_adapters:  # type: ignore[attr-defined]
            if name in self.lora_A:  # type: ignore[attr-defined]
                step = self.get_delta_weight(name)  # type: ignore[attr-defined]
                delta = step if delta is None else delta + step
        return base.forward_with_delta(x, delta)


_MERGED_CLASSES: dict[type, type] = {}


def _merged_class(cls: type) -> type:
    if issubclass(cls, _MergedLora):
        return cls
    if cls not in _MERGED_CLASSES:
        _MERGED_CLASSES[cls] = type(f"Merged{cls.__name__}", (_MergedLora, cls), {"__module__": __name__})
    return _MERGED_CLASSES[cls]


def _served_class(cls: type) -> type:
    while issubclass(cls, _MergedLora):
        cls = cls.__mro__[2]  # Merged<X>(_MergedLora, X) -> X
    return cls


def _why_not_merged(name: str, layer: nn.Module) -> str | None:
    base = layer.get_base_layer()  # type: ignore[operator]
    for adapter in layer.lora_A:  # type: ignore[union-attr]
        dropout = layer.lora_dropout[adapter]  # type: ignore[index]
        if not isinstance(dropout, nn.Identity) and getattr(dropout, "p", 0) > 0:
            return f"{name}: adapter {adapter!r} has lora_dropout={dropout.p} (no merged form; set 0)"
        if adapter in getattr(layer, "lora_variant", {}) or layer.use_dora.get(adapter):  # type: ignore[union-attr]
            return f"{name}: adapter {adapter!r} is a LoRA variant (DoRA, ...), which merges differently"
        if getattr(layer, "lora_bias", {}).get(adapter):
            return f"{name}: adapter {adapter!r} has lora_bias=True"
    if getattr(base, "quant_algo", None) is not None and hasattr(base, "_packed"):
        return (
            f"{name}: the base layer is compressed (real {base.quant_algo} weights), which cannot take the "
            "adapter's delta; deploy it served, or merge on the fake-quantized model before mtq.compress"
        )
    return None


def set_lora_deploy(model: nn.Module, deploy: Deploy) -> list[str]:
    """Make every peft LoRA linear layer of ``model`` compute as ``deploy`` (``"merged"`` or ``"served"``,
    the module docstring); returns their names. Raises when the model has none, or when a layer cannot be
    deployed merged (dropout, DoRA, adapter bias, compressed base), naming it."""
    if deploy not in DEPLOYMENTS:
        raise ValueError(f"deploy={deploy!r}: choose one of {', '.join(DEPLOYMENTS)}")
    layers = list(lora_layers(model))
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no peft LoRA linear layer: add adapters first (mtq.add_lora, "
            "get_peft_model or QATTrainer(lora_config=...))"
        )
    if deploy == "merged":
        problems = [p for name, layer in layers if (p := _why_not_merged(name, layer))]
        if problems:
            raise ValueError(
                f"{len(problems)} LoRA layer(s) cannot be trained merged: {'; '.join(problems[:4])}. "
                "Fix the LoraConfig, or use deploy='served'"
            )
    for _, layer in layers:
        cls = type(layer)
        layer.__class__ = _merged_class(cls) if deploy == "merged" else _served_class(cls)
    return [name for name, _ in layers]


def lora_deploy(model: nn.Module) -> Deploy | None:
    """``"merged"`` / ``"served"`` for a model with peft LoRA linear layers (all alike), ``None`` without.
    Raises when the layers disagree (set one deployment with :func:`set_lora_deploy`)."""
    kinds = {"merged" if isinstance(m, _MergedLora) else "served" for _, m in lora_layers(model)}
    if len(kinds) > 1:
        raise ValueError("the model's LoRA layers mix merged and served deployments: call set_lora_deploy")
    return next(iter(kinds), None)  # type: ignore[return-value]
