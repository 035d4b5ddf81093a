"""One fake quant for quantizers that see the same input: the query / key / value projections of an
attention block read one tensor, as do an MLP's gate and up projections, and their input quantizers (the
same format and, after max calibration on that tensor, the same amax) compute the same output three (two)
times. The first one's output is handed to the others instead.

An entry is kept per input tensor while its Python object lives (a weak reference drops it when the
tensor is freed: an activation after the forward pass, or after the backward that saved it; weights, which
live on, are never entered); it refers to the output weakly too, so it serves while the output is alive: in
training until the backward (the next layer saved it), in evaluation only while the caller holds it. It is
used only when the input is the very same tensor, unmodified since (its
version counter), in the same grad mode, and the quantizer asking has the same format, backward mode and
amax / global amax values (compared element by element, and the stored ones unmodified since). The
gradient reaching the shared output is then the sum of what each consumer sends, passed through once; with
the straight-through backward that equals the per-quantizer sum (tested bit for bit on a Llama).
"""

from __future__ import annotations

import functools
import weakref

import torch

from ...formats import FormatSpec

__all__ = ["lookup", "shareable", "store"]

_Entry = tuple  # (x version, grad, spec, clip, amax, amax version, global amax, its version, output)
_entries: dict[int, tuple[weakref.ref, list[_Entry]]] = {}
#: entries kept per input (formats / amax seen for it); older ones are dropped
_PER_INPUT = 4


def _same(held: torch.Tensor | None, version: int, given: torch.Tensor | None) -> bool:
    if held is None or given is None:
        return held is given
    if held._version != version:
        return False
    return held is given or (held.shape == given.shape and bool(torch.equal(held, given)))


def shareable(x: torch.Tensor) -> bool:
    """Whether ``x`` may have an entry: not a weight (it lives on, and no two quantizers share one), not an
    inference tensor (it has no version counter), not while ``torch.compile`` traces."""
    return (
        not isinstance(x, torch.nn.Parameter) and not x.is_inference() and not torch.compiler.is_compiling()
    )


def lookup(
    x: torch.Tensor,
    spec: FormatSpec,
    clip: bool,
    amax: torch.Tensor | None,
    global_amax: torch.Tensor | None,
) -> torch.Tensor | None:
    """The output an earlier quantizer computed for this very ``x`` with the same format and amax, or
    ``None``."""
    found = _entries.get(id(x))
    if found is None or found[0]() is not x:
        return None
    grad = torch.is_grad_enabled() and x.requires_grad
    for version, e_grad, e_spec, e_clip, e_amax, amax_version, e_global, global_version, out in found[1]:
        if (
            version == x._version
            and e_grad == grad
            and e_clip == clip
            and e_spec == spec
            and _same(e_amax, amax_version, amax)
            and _same(e_global, global_version, global_amax)
        ):
            return out()
    return None


def store(
    x: torch.Tensor,
    spec: FormatSpec,
    clip: bool,
    amax: torch.Tensor | None,
    global_amax: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Remember ``out`` as the fake quant of ``x`` (until ``x``'s Python object is freed). Nothing is kept
    for an amax made under ``torch.inference_mode`` (it has no version counter to check)."""
    if any(t is not None and t.is_inference() for t in (amax, global_amax)):
        return
    key = id(x)
    found = _entries.get(key)
    if found is None or found[0]() is not x:
        found = (weakref.ref(x, functools.partial(_drop, _entries, key)), [])
        _entries[key] = found
    versions = [None if t is None else t._version for t in (amax, global_amax)]
    grad = torch.is_grad_enabled() and x.requires_grad  # an output made without a graph serves no backward
    # the output by weak reference too: held strongly, it would hold its graph, and through the graph a leaf
    # input (autograd's AccumulateGrad keeps it), whose entry would then never go
    found[1].append(
        (x._version, grad, spec, clip, amax, versions[0], global_amax, versions[1], weakref.ref(out))
    )
    del found[1][:-_PER_INPUT]


def _drop(entries: dict, key: int, ref: weakref.ref) -> None:
    """Weak-reference callback: ``x`` was freed. (The dict is bound, as module globals may already be
    gone when the callbacks of the last tensors run at interpreter exit.)"""
    found = entries.get(key)
    if found is not None and found[0] is ref:
        del entries[key]
