"""Layer-by-layer calibration: one pass of ``forward_loop`` records the inputs of the decoder layers, then
each layer runs alone on its inputs, as often as an algorithm needs, and its outputs become the next layer's
inputs.

AWQ and GPTQ take each decoder layer's statistics with the layers before it already changed (smoothed,
or replaced by their quantized weights), which through the whole model costs one pass of ``forward_loop``
per decoder layer. Layer by layer, each layer runs twice (once unchanged for its statistics, once changed to
make the next layer's inputs) and the embeddings and the head once, with the same numbers: every layer
receives bit for bit the tensors it would receive in the whole model (fake quant is off during
calibration) and the same keyword arguments (attention mask, position embeddings: recorded per layer and
per batch).

The recording pass runs the first decoder layer and stands a stub in for the others (swapped into their
``nn.ModuleList`` and back, also when the pass raises) that records its arguments and returns the first
layer's output, so the head runs on real tensors. :func:`layerwise` returns ``None`` (and the algorithm
runs one pass per layer as before) when the model is not a stack of decoder layers that the parent calls
once each, in order, passing each one's output unchanged to the next (checked in the recording pass), when
a calibrated layer lies outside the stack, when the loop decodes with a filled KV cache, and under
``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...distributed import is_distributed
from ...logging import get_logger
from ...moe import reset_coverage
from ...nn import SequentialQuantizer, TensorQuantizer
from .calibrate import ForwardLoop, run_forward_loop
from .max_calib import _collect_activations, activation_quantizers, calibrate_weights, load_activations
from .targets import Target, blocks

__all__ = ["Layer", "Layerwise", "decoder_layers", "layerwise"]

logger = get_logger(__name__)

# keyword arguments holding a KV cache: a replay must not append to it again (the layer's arithmetic does
# not depend on it when it starts empty, as it does in a calibration forward)
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


class _Unsupported(Exception):
    """The recording pass found a model that layer-by-layer calibration cannot reproduce."""


def _hidden(output: Any) -> torch.Tensor | None:
    """The hidden state in a decoder layer's output: the tensor, or the first element of a tuple / list."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _hidden_input(args: tuple, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    value = kwargs.get("hidden_states")
    return value if isinstance(value, torch.Tensor) else None


def _with_hidden(args: tuple, kwargs: dict[str, Any], h: torch.Tensor) -> tuple[tuple, dict[str, Any]]:
    if args and isinstance(args[0], torch.Tensor):
        return (h, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": h}


def _replayable(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}


class _Stub(nn.Module):
    """Stands in for decoder layer ``index`` during the recording pass: records its arguments and returns
    the first layer's output of the same batch. Other attributes are read from the layer it replaces."""

    def __init__(self, original: nn.Module, index: int, record: Callable[[int, tuple, dict], Any]):
        super().__init__()
        object.__setattr__(self, "_original", original)  # not a submodule: no parameters, no hooks
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_record", record)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_original"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._record(self._index, args, kwargs)


@dataclass(eq=False)
class Layer:
    """One decoder layer of a layer-by-layer run: its calibration targets and activation quantizers."""

    index: int
    name: str
    module: nn.Module
    targets: list[Target]
    activations: list[TensorQuantizer]
    run: Layerwise = field(repr=False)

    def replay(self) -> None:
        """Run the layer on its inputs (every batch); the outputs are dropped."""
        self.run._forward(self, keep=False, collect=False)

    def advance(self, collect: bool = True) -> None:
        """Run the layer on its inputs; its outputs become the next layer's inputs. ``collect``: the
        layer's activation quantizers collect their statistics (max calibration fused into the pass)."""
        self.run._forward(self, keep=True, collect=collect)

    @torch.no_grad()
    def calibrate_weights(self) -> None:
        """Max-calibrate the weight quantizers of the layer's targets from their (current) weights, with
        fake quant on as outside ``calibration_mode`` (a sequential quantizer calibrates each stage on the
        previous stages' output)."""
        wanted = {id(t.weight_quantizer) for t in self.targets}
        for module in {id(t.module): t.module for t in self.targets}.values():
            for q, w in module.weight_quantizer_pairs():
                if id(q) in wanted and q.is_enabled:
                    stages = list(q) if isinstance(q, SequentialQuantizer) else [q]
                    modes = [s._quant_enabled for s in stages]
                    try:
                        for s in stages:
                            s.enable_quant()
                        q.calibrate(w.detach())
                    finally:
                        for s, mode in zip(stages, modes, strict=True):
                            s._quant_enabled = mode
        self.run.weights_done |= wanted


class Layerwise:
    """The state of a layer-by-layer run (made by :func:`layerwise`; run the layers inside
    ``calibration_mode``). Visit :attr:`layers` in order; call each layer's :meth:`Layer.advance` before the
    next one runs; then :meth:`finish` outside ``calibration_mode``."""

    def __init__(self, model: nn.Module, forward_loop: ForwardLoop, stack: nn.ModuleList, prefix: str,
                 targets: list[Target]):  # fmt: skip
        self.model, self.forward_loop = model, forward_loop
        by_layer: dict[int, list[Target]] = {}
        for block in blocks(targets):
            by_layer.setdefault(int(block[0].name[len(prefix) + 1 :].split(".", 1)[0]), []).extend(block)
        acts: dict[int, list[TensorQuantizer]] = {}
        self.rest_activations: list[TensorQuantizer] = []
        for q in activation_quantizers(model):
            i = _layer_index(q.name, prefix)
            (acts.setdefault(i, []) if i is not None else self.rest_activations).append(q)
        self.layers = [
            Layer(i, f"{prefix}.{i}", m, by_layer.get(i, []), acts.get(i, []), self)
            for i, m in enumerate(stack)
        ]
        self.collected = [q for layer in self.layers for q in layer.activations]
        self.weights_done: set[int] = set()
        self._calls: list[list[tuple[tuple, dict]]] = []  # per batch, per layer: (args, kwargs)
        self._inputs: list[torch.Tensor] = []  # per batch: the hidden state entering the next layer
        self._next = 0  # the layer whose inputs _inputs holds
        self.layer_calls = 0  # decoder layer forwards run by this object (for tests and benchmarks)

    def _record_pass(self, stack: nn.ModuleList) -> None:
        first = stack[0]
        out0: list[Any] = []

        def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._calls and len(self._calls[-1]) != len(stack):
                raise _Unsupported("a batch did not reach every decoder layer once")
            if _hidden_input(args, kwargs) is None:
                raise _Unsupported("the first decoder layer received no hidden-state tensor")
            for key in _CACHE_KWARGS:  # a filled cache (generation): the layers read past keys / values
                cache = kwargs.get(key)
                if cache is not None and (not hasattr(cache, "get_seq_length") or cache.get_seq_length() > 0):
                    raise _Unsupported(f"the forward loop passes a filled KV cache ({key})")
            self._calls.append([(args, kwargs)])

        def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            h, x = _hidden(output), _hidden_input(args, kwargs)
            if h is None or h.shape != x.shape:
                raise _Unsupported("the first decoder layer's output is not a hidden state like its input")
            out0[:] = [output]

        def record(index: int, args: tuple, kwargs: dict) -> Any:
            calls = self._calls[-1] if self._calls else None
            if calls is None or len(calls) != index or _hidden_input(args, kwargs) is not _hidden(out0[0]):
                raise _Unsupported(
                    "the decoder layers are not called once each, in order, each on the previous one's output"
                )
            calls.append((args, kwargs))
            return out0[0]

        hooks = [first.register_forward_pre_hook(pre, with_kwargs=True),
                 first.register_forward_hook(post, with_kwargs=True)]  # fmt: skip
        originals = list(stack)
        try:
            for i in range(1, len(stack)):
                stack[i] = _Stub(originals[i], i, record)
            run_forward_loop(self.model, self.forward_loop, desc="layerwise: recording the layer inputs")
        finally:
            for h in hooks:
                h.remove()
            for i, m in enumerate(originals):
                stack[i] = m
        if not self._calls or len(self._calls[-1]) != len(stack):
            raise _Unsupported("the forward loop did not reach every decoder layer")
        self.layer_calls += len(self._calls)
        self._calls = [[(args, _replayable(kwargs)) for args, kwargs in batch] for batch in self._calls]
        self._inputs = [_hidden_input(*batch[0]) for batch in self._calls]

    def _forward(self, layer: Layer, keep: bool, collect: bool) -> None:
        if layer.index != self._next:
            raise RuntimeError(
                f"layerwise: layer {layer.index} runs before layer {self._next} has advanced; call advance() "
                "on every layer in order"
            )
        qs = layer.activations if collect else []
        for q in qs:
            q.enable_calib()
        try:
            outputs = []
            for b, h in enumerate(self._inputs):
                args, kwargs = self._calls[b][layer.index]
                args, kwargs = _with_hidden(args, kwargs, h)
                out = layer.module(*args, **kwargs)
                self.layer_calls += 1
                if keep:
                    outputs.append(_hidden(out))
        finally:
            for q in qs:
                q.disable_calib()
        if keep:
            self._inputs = outputs
            self._next += 1
            for batch in self._calls:  # the layer's recorded arguments are no longer needed
                batch[layer.index] = ((), {})

    def finish(self) -> None:
        """What max calibration does after the layers ran (call outside ``calibration_mode``): load the
        activation amaxes collected by :meth:`Layer.advance`, collect the other activation quantizers' in a
        pass of the whole model (only if there are any), calibrate the weights not calibrated yet."""
        if self._next != len(self.layers) and any(layer.activations for layer in self.layers[self._next :]):
            raise RuntimeError("layerwise: finish() before every layer with activation quantizers advanced")
        load_activations(self.model, self.collected)
        for q in self.collected:
            q.reset_calibration()
        if self.rest_activations:
            _collect_activations(self.model, self.rest_activations, self.forward_loop)
        logger.info(
            "max calibration: %d activation quantizer(s) from data (%d layer by layer), weight quantizers "
            "from the weights", len(self.collected) + len(self.rest_activations), len(self.collected),
        )  # fmt: skip
        calibrate_weights(self.model, self.weights_done)


def _layer_index(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix + "."):
        return None
    head = name[len(prefix) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def decoder_layers(model: nn.Module, targets: list[Target]) -> tuple[str, nn.ModuleList] | None:
    """``(name, ModuleList)`` of the decoder layers holding every target (``None`` if there is none)."""
    prefixes = set()
    for t in targets:
        parts = t.name.split(".")
        index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if not index or index == len(parts) - 1:  # no layer index, or the target is the layer itself
            return None
        prefixes.add(".".join(parts[:index]))
    if len(prefixes) != 1:
        return None
    (prefix,) = prefixes
    stack = model.get_submodule(prefix)
    if not isinstance(stack, nn.ModuleList) or len(stack) < 2:
        return None
    return prefix, stack


def layerwise(
    model: nn.Module, forward_loop: ForwardLoop, targets: list[Target], name: str
) -> Layerwise | None:
    """Record every decoder layer's inputs in one pass of ``forward_loop`` (call inside
    ``calibration_mode``); ``None`` (logged) when the model cannot be calibrated layer by layer."""
    why = None
    found = decoder_layers(model, targets)
    if is_distributed():
        why = "under torch.distributed"
    elif found is None:
        why = "the calibrated layers are not all inside one stack of decoder layers"
    if why is None:
        prefix, stack = found
        run = Layerwise(model, forward_loop, stack, prefix, targets)
        reset_coverage(model)
        for q in run.collected:
            q.reset_calibration()
        try:
            run._record_pass(stack)
        except _Unsupported as err:
            why = str(err)
        else:
            return run
    logger.info("%s: one pass of forward_loop per decoder layer (not layer by layer: %s)", name, why)
    return None
