"""Quantized module wrappers and the registry that maps a module class to its wrapper.

A wrapper is a mixin (a subclass of :class:`QuantModule`). Converting a module swaps its class for a
subclass ``Quant<Original>(wrapper, original)`` created once per pair, then calls ``_setup`` to add the
quantizers. Parameters, buffers, hooks and ``state_dict`` keys of the original stay as they were, and
``isinstance(module, nn.Linear)`` still holds, so transformers, accelerate and PEFT keep working.

Users register their own wrappers::

    @QUANT_MODULES.register(MyLinear)
    class QuantMyLinear(QuantModule):
        def _setup(self): ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..logging import get_logger
from .sequential_quantizer import SequentialQuantizer
from .tensor_quantizer import TensorQuantizer

__all__ = ["QUANT_MODULES", "QuantModule", "QuantModuleRegistry", "Quantizer", "iter_quantizers"]

logger = get_logger(__name__)

Quantizer = TensorQuantizer | SequentialQuantizer


class QuantModule(nn.Module):
    """Base of every wrapper. Subclasses implement ``_setup`` and, when they quantize weights,
    ``weight_quantizer_pairs`` (what each weight quantizer calibrates from) and ``fold_weight``."""

    original_cls: type[nn.Module]

    def _setup(self) -> None:
        raise NotImplementedError

    def weight_quantizer_pairs(self) -> Iterator[tuple[Quantizer, torch.Tensor]]:
        """Yield ``(quantizer, weight)`` with the weight in the layout the quantizer sees in forward."""
        return iter(())

    def fold_weight(self) -> None:
        """Replace the weights by their fake-quantized values and disable the weight quantizers."""

    def _teardown(self) -> None:
        """Undo ``_setup``: remove every quantizer child (wrappers with more state extend this)."""
        for name, child in list(self._modules.items()):
            if isinstance(child, (TensorQuantizer, SequentialQuantizer)) or (
                isinstance(child, nn.ModuleList) and name.endswith("_quantizers")
            ):
                delattr(self, name)

    def replace_quantizer(self, slot: str, quantizer: Quantizer) -> None:
        """Put ``quantizer`` into the attribute ``slot`` (a rule may make a quantizer sequential)."""
        old = getattr(self, slot)
        if not isinstance(old, (TensorQuantizer, SequentialQuantizer)):
            raise ValueError(f"{type(self).__name__}.{slot} is not a quantizer slot")
        ref = next(iter(old.buffers()), None)
        setattr(self, slot, quantizer.to(ref.device) if ref is not None else quantizer)


def iter_quantizers(model: nn.Module) -> Iterator[tuple[str, Quantizer]]:
    """Yield ``(dotted name, quantizer)`` for every quantizer slot (stages of a sequential one are not
    yielded on their own)."""
    for name, module in model.named_modules():
        if isinstance(module, SequentialQuantizer):
            yield name, module
        elif isinstance(module, TensorQuantizer) and not _is_stage(name, model):
            yield name, module


def _is_stage(name: str, model: nn.Module) -> bool:
    parent, _, last = name.rpartition(".")
    return last.isdigit() and isinstance(
        model.get_submodule(parent) if parent else model, SequentialQuantizer
    )


class QuantModuleRegistry:
    """Module class -> wrapper. Exact classes first, then rules (a predicate on the class)."""

    def __init__(self) -> None:
        self._by_class: dict[type[nn.Module], type[QuantModule]] = {}
        self._rules: list[tuple[str, Callable[[type[nn.Module]], bool], type[QuantModule]]] = []
        self._dynamic: dict[tuple[type, type], type[nn.Module]] = {}

    def register(
        self, original_cls: type[nn.Module], wrapper: type[QuantModule] | None = None
    ) -> Callable[[type[QuantModule]], type[QuantModule]] | type[QuantModule]:
        """Register ``wrapper`` for ``original_cls`` (usable as a decorator). Re-registering a class
        raises; call :meth:`unregister` first to replace a wrapper."""

        def add(wrapper_cls: type[QuantModule]) -> type[QuantModule]:
            if not (isinstance(wrapper_cls, type) and issubclass(wrapper_cls, QuantModule)):
                raise TypeError(f"wrapper for {original_cls.__name__} must subclass QuantModule")
            if original_cls in self._by_class:
                raise ValueError(
                    f"{original_cls.__qualname__} already has the wrapper "
                    f"{self._by_class[original_cls].__qualname__}; unregister it first"
                )
            self._by_class[original_cls] = wrapper_cls
            return wrapper_cls

        return add if wrapper is None else add(wrapper)

    def register_rule(
        self, name: str, predicate: Callable[[type[nn.Module]], bool], wrapper: type[QuantModule]
    ) -> None:
        """Wrap every class ``predicate`` accepts (e.g. all attention classes of transformers)."""
        self._rules.append((name, predicate, wrapper))

    def unregister(self, original_cls: type[nn.Module]) -> None:
        self._by_class.pop(original_cls, None)

    def wrapper_for(self, cls: type[nn.Module]) -> type[QuantModule] | None:
        if issubclass(cls, QuantModule):
            return None
        if cls in self._by_class:
            return self._by_class[cls]
        for _, predicate, wrapper in self._rules:
            if predicate(cls):
                return wrapper
        # a subclass that keeps its registered parent's forward computes the same thing
        for base, wrapper in self._by_class.items():
            if issubclass(cls, base) and cls.forward is base.forward:
                return wrapper
        return None

    def shadowed_subclasses(self, cls: type[nn.Module]) -> type[nn.Module] | None:
        """The registered class that ``cls`` subclasses while overriding its forward (left unquantized)."""
        for base in self._by_class:
            if cls is not base and issubclass(cls, base) and cls.forward is not base.forward:
                return base
        return None

    def convert(self, module: nn.Module) -> bool:
        """Swap ``module`` to its quantized class and add its quantizers; False when no wrapper applies."""
        cls = type(module)
        wrapper = self.wrapper_for(cls)
        if wrapper is None:
            return False
        key = (wrapper, cls)
        if key not in self._dynamic:
            self._dynamic[key] = type(
                f"Quant{cls.__name__}",
                (wrapper, cls),
                {"original_cls": cls, "__module__": wrapper.__module__},
            )
        module.__class__ = self._dynamic[key]
        module._setup()
        return True

    @staticmethod
    def revert(module: nn.Module) -> None:
        """Turn a converted module back into its original class, without quantizers."""
        if isinstance(module, QuantModule):
            module._teardown()
            module.__class__ = module.original_cls

    def __contains__(self, cls: type[nn.Module]) -> bool:
        return self.wrapper_for(cls) is not None


QUANT_MODULES = QuantModuleRegistry()
