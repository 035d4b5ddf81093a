"""Quantized module wrappers and the registry that maps a module class to its wrapper.

A wrapper is a mixin (a subclass of :class:`QuantModule`). Converting a module swaps its class for a
subclass ``Quant<Original>(wrapper, original)`` created once per pair, then calls ``_setup`` to add the
quantizers. Parameters, buffers, hooks and ``state_dict`` keys of the original stay as they were, and
``isinstance(module, nn.Linear)`` still holds, so transformers, accelerate and PEFT keep working.

Users register their own wrappers, either a :class:`QuantModule` mixin::

    @QUANT_MODULES.register(MyLinear)
    class QuantMyLinear(QuantModule):
        def _setup(self): ...

or, as in Model-Optimizer, a subclass of the original class with a ``_setup`` and a forward that calls the
quantizers (``mtq.register(original_cls=MyLinear, quantized_cls=QuantMyLinear)``).

A forward replaced on the instance (accelerate's hooks for ``device_map`` and CPU / disk offload keep the
class forward they wrap in ``module._old_forward``) would keep calling the original class's forward after
the class swap and bypass the quantizers. :meth:`QuantModuleRegistry.convert` therefore re-binds such a
bound forward (``_old_forward``, or ``forward`` itself) to the quantized class, and :meth:`revert` binds it
back. Any other forward set on the instance before the conversion (a closure, a runtime patch) is, for
wrappers that declare ``runs_replaced_forward`` (the linear layers), moved to the attribute
``REPLACED_FORWARD``: the quantized forward quantizes the input, then calls it with the weight read as its
fake-quantized value, as the reference library does; :meth:`revert` puts it back. :func:`replaced_forward`
names the instance forwards still left in place (other wrappers, or set after the conversion). Hooks added
after the conversion wrap the quantized forward and need nothing.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from ..logging import get_logger
from .quantizer.sequential_quantizer import SequentialQuantizer
from .quantizer.tensor_quantizer import TensorQuantizer

__all__ = [
    "QUANT_MODULES",
    "REPLACED_FORWARD",
    "QuantModule",
    "QuantModuleRegistry",
    "Quantizer",
    "iter_quantizers",
    "replaced_forward",
]

logger = get_logger(__name__)

Quantizer = TensorQuantizer | SequentialQuantizer

#: Where :meth:`QuantModuleRegistry.convert` keeps a forward that was set on the instance before conversion
#: (for wrappers with ``runs_replaced_forward``; their forward calls it, see the module docstring).
REPLACED_FORWARD = "_forward_before_quant"


class QuantModule(nn.Module):
    """Base of every wrapper. Subclasses implement ``_setup`` and, when they quantize weights,
    ``weight_quantizer_pairs`` (what each weight quantizer calibrates from) and ``fold_weight``."""

    original_cls: type[nn.Module]
    #: Whether the wrapper's forward runs a forward replaced on the instance before conversion (kept as
    #: ``REPLACED_FORWARD``) between its quantizers; wrappers that do not leave such a forward in place.
    runs_replaced_forward: bool = False

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


def _rebind_forward(module: nn.Module, old_cls: type[nn.Module]) -> None:
    """Point a bound forward stored on the instance (accelerate's ``_old_forward``, or ``forward``) that
    runs ``old_cls.forward`` at the forward of the module's current class."""
    for attr in ("_old_forward", "forward"):
        bound = module.__dict__.get(attr)
        if (
            isinstance(bound, types.MethodType)
            and bound.__self__ is module
            and bound.__func__ is old_cls.forward
        ):
            setattr(module, attr, types.MethodType(type(module).forward, module))


def replaced_forward(module: nn.Module) -> str | None:
    """What replaced ``module.forward`` on the instance when the class forward will not run (``None`` when
    it will: no instance forward, or accelerate's hook around the class forward)."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return None
    own = type(module).forward
    inner = module.__dict__.get("_old_forward") if "_hf_hook" in module.__dict__ else forward
    if isinstance(inner, types.MethodType) and inner.__self__ is module and inner.__func__ is own:
        return None
    return getattr(forward, "__qualname__", None) or type(forward).__name__


def _is_quantized_class(cls: type) -> bool:
    """A wrapper: a :class:`QuantModule` mixin, or (Model-Optimizer's form) a module class with ``_setup``."""
    return isinstance(cls, type) and (
        issubclass(cls, QuantModule)
        or (issubclass(cls, nn.Module) and callable(getattr(cls, "_setup", None)))
    )


class QuantModuleRegistry:
    """Module class -> wrapper. Exact classes first, then rules (a predicate on the class)."""

    def __init__(self) -> None:
        self._by_class: dict[type[nn.Module], type[nn.Module]] = {}
        self._rules: list[tuple[str, Callable[[type[nn.Module]], bool], type[QuantModule]]] = []
        self._dynamic: dict[tuple[type, type], type[nn.Module]] = {}

    def register(
        self,
        original_cls: type[nn.Module] | Mapping[type[nn.Module], str],
        quantized_cls: type[nn.Module] | None = None,
    ) -> Callable[[type[nn.Module]], type[nn.Module]] | type[nn.Module]:
        """Register ``quantized_cls`` for ``original_cls`` (usable as a decorator; ``original_cls`` may be
        Model-Optimizer's ``{cls: "name"}`` mapping). ``quantized_cls`` is a :class:`QuantModule` mixin or a
        module class with a ``_setup`` that creates the quantizers and a forward that calls them (usually a
        subclass of ``original_cls``). Re-registering a class raises; call :meth:`unregister` first."""
        originals = list(original_cls) if isinstance(original_cls, Mapping) else [original_cls]

        def add(wrapper_cls: type[nn.Module]) -> type[nn.Module]:
            names = ", ".join(getattr(c, "__name__", repr(c)) for c in originals)
            if not _is_quantized_class(wrapper_cls):
                raise TypeError(
                    f"quantized class for {names} must subclass QuantModule or be a module class with a "
                    f"_setup method that creates its quantizers; got {wrapper_cls!r}"
                )
            for cls in originals:
                if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                    raise TypeError(f"original_cls must be a torch.nn.Module subclass, got {cls!r}")
                if cls in self._by_class:
                    raise ValueError(
                        f"{cls.__qualname__} already has the wrapper "
                        f"{self._by_class[cls].__qualname__}; unregister it first"
                    )
            for cls in originals:
                self._by_class[cls] = wrapper_cls
            return wrapper_cls

        return add if quantized_cls is None else add(quantized_cls)

    def register_rule(
        self, name: str, predicate: Callable[[type[nn.Module]], bool], wrapper: type[QuantModule]
    ) -> None:
        """Wrap every class ``predicate`` accepts (e.g. all attention classes of transformers)."""
        self._rules.append((name, predicate, wrapper))

    def unregister(self, original_cls: type[nn.Module]) -> None:
        self._by_class.pop(original_cls, None)

    def wrapper_for(self, cls: type[nn.Module]) -> type[nn.Module] | None:
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

    def quantized_class(
        self, wrapper: type[nn.Module], cls: type[nn.Module], keep_name: bool = False
    ) -> type[nn.Module]:
        """The class a ``cls`` module becomes with ``wrapper`` (made once per pair): ``Quant<cls>``, or the
        wrapper's own name with ``keep_name`` (a user's subclass of ``QuantLinear``)."""
        key = (wrapper, cls)
        if key not in self._dynamic:
            # Model-Optimizer's form (a subclass of the original with _setup) gets QuantModule's defaults
            # behind its own methods; QuantModule mixins come first as they are.
            bases = (wrapper, cls) if issubclass(wrapper, QuantModule) else (wrapper, QuantModule, cls)
            name = wrapper.__name__ if keep_name else f"Quant{cls.__name__}"
            attrs = {"original_cls": cls, "__module__": wrapper.__module__}
            self._dynamic[key] = type(name, bases, attrs)
        return self._dynamic[key]

    def convert(self, module: nn.Module) -> QuantModule:
        """Swap ``module`` to its quantized class, add its quantizers and return it (the same object).
        Raises ``KeyError`` when no wrapper applies (test with ``type(module) in registry``)."""
        cls = type(module)
        wrapper = self.wrapper_for(cls)
        if wrapper is None:
            raise KeyError(f"{cls.__qualname__} has no registered quantized class")
        module.__class__ = self.quantized_class(wrapper, cls)
        _rebind_forward(module, cls)
        if getattr(module, "runs_replaced_forward", False) and "_hf_hook" not in module.__dict__:
            if (what := replaced_forward(module)) is not None:
                module.__dict__[REPLACED_FORWARD] = module.__dict__.pop("forward")
                logger.info(
                    "%s: its forward was replaced on the instance (%s); the quantized forward quantizes the "
                    "input and calls it, with the weight read as its fake-quantized value",
                    type(module).__qualname__,
                    what,
                )
        module._setup()
        return module

    @staticmethod
    def revert(module: nn.Module) -> None:
        """Turn a converted module back into its original class, without quantizers."""
        if isinstance(module, QuantModule):
            module._teardown()
            quantized = type(module)
            module.__class__ = module.original_cls
            _rebind_forward(module, quantized)
            if (replaced := module.__dict__.pop(REPLACED_FORWARD, None)) is not None:
                module.forward = replaced

    def __contains__(self, cls: type[nn.Module]) -> bool:
        return self.wrapper_for(cls) is not None


QUANT_MODULES = QuantModuleRegistry()
