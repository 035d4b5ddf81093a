"""What calibration algorithms work on: every quantized linear map of the model (a linear layer, or one
projection of one expert) as a :class:`Target`, and :func:`capture`, which records each target's inputs
during forward passes (per-channel statistics, a capped sample of rows, optionally ``X^T X`` or its
diagonal blocks).

Targets are processed one transformer block at a time (:func:`blocks`), so that memory holds the
statistics of one block, never of the whole model. Linear layers that read the same input tensor (q/k/v,
gate/up) and the experts of one projection (one input quantizer) form a *group* that shares one input scale.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ...moe import QuantExperts
from ...nn import Quantizer, QuantLinear, TensorQuantizer
from .search import block_gram

__all__ = ["Stats", "Target", "blocks", "capture", "groups", "linear_targets"]

_BLOCK = re.compile(r"^(.*?\.\d+)\.")


@dataclass(eq=False)
class Target:
    name: str
    module: nn.Module
    weight_quantizer: Quantizer
    input_quantizer: TensorQuantizer
    proj: str | None = None  # experts: projection and expert index
    expert: int | None = None

    def weight(self) -> torch.Tensor:
        """The weight as ``(out, in)``: a view, so ``copy_`` / ``mul_`` write the parameter."""
        if self.expert is None:
            return self.module._weight_view()
        return self.module.expert_weight(self.proj, self.expert)


@dataclass
class Stats:
    """Inputs seen by one target: ``absmax`` / ``abssum`` per input channel, the row ``count``, up to
    ``max_rows`` sample rows and ``gram`` = ``X^T X`` (float32) when asked, or with ``gram_block`` only its
    diagonal blocks ``(in / gram_block, gram_block, gram_block)`` (``None`` when ``in`` is not a multiple)."""

    absmax: torch.Tensor | None = None
    abssum: torch.Tensor | None = None
    count: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)
    gram: torch.Tensor | None = None
    dtype: torch.dtype | None = None  # of the inputs (the statistics are float32)

    def sample(self) -> torch.Tensor | None:
        return torch.cat(self.rows) if self.rows else None


def linear_targets(model: nn.Module) -> list[Target]:
    targets = []
    for name, module in model.named_modules():
        if isinstance(module, QuantExperts):
            for proj in module._projections:
                weights = getattr(module, f"{proj}_weight_quantizers")
                inputs = getattr(module, f"{proj}_input_quantizer")
                for e, wq in enumerate(weights):
                    targets.append(Target(f"{name}.{proj}.{e}", module, wq, inputs, proj, e))
        elif isinstance(module, QuantLinear):
            targets.append(Target(name, module, module.weight_quantizer, module.input_quantizer))
    return targets


def blocks(targets: list[Target]) -> list[list[Target]]:
    """Targets grouped by transformer block (``...layers.N``), in model order."""
    out: dict[str, list[Target]] = {}
    for t in targets:
        match = _BLOCK.match(t.name)
        out.setdefault(match.group(1) if match else t.name, []).append(t)
    return list(out.values())


def groups(targets: list[Target], stats: dict[str, Stats]) -> list[list[Target]]:
    """Targets that read the same input: one experts projection, or linear layers whose inputs were
    identical on every batch (same row count and bit-identical per-channel max and sum of ``|x|``; q/k/v and
    gate/up read one tensor). Memory addresses are not used: a freed tensor's address is reused."""
    out: dict[tuple, list[Target]] = {}
    for t in targets:
        st = stats[t.name]
        if t.expert is not None:
            key: tuple = (id(t.module), t.proj)
        elif st.count:
            key = (st.count, st.absmax.cpu().numpy().tobytes(), st.abssum.cpu().numpy().tobytes())
        else:
            key = (t.name,)
        out.setdefault(key, []).append(t)
    return list(out.values())


def _record(stats: Stats, x: torch.Tensor, max_rows: int, gram: bool, gram_block: int) -> None:
    stats.dtype = x.dtype
    x = x.detach().reshape(-1, x.shape[-1]).float()
    if x.shape[0] == 0:
        return
    mag = x.abs()
    if stats.absmax is None:
        stats.absmax, stats.abssum = mag.amax(0), mag.sum(0)
    else:
        torch.maximum(stats.absmax, mag.amax(0), out=stats.absmax)
        stats.abssum += mag.sum(0)
    stats.count += x.shape[0]
    room = max_rows - sum(r.shape[0] for r in stats.rows)
    if room > 0:
        stats.rows.append(x[:room].clone())
    if gram_block and x.shape[1] % gram_block == 0:
        g = block_gram(x.view(x.shape[0], -1, gram_block))
        stats.gram = g if stats.gram is None else stats.gram.add_(g)
    elif gram and not gram_block:
        g = x.t() @ x
        stats.gram = g if stats.gram is None else stats.gram.add_(g)


def _effective(x: torch.Tensor, input_quantizer: TensorQuantizer) -> torch.Tensor:
    """The input as the weight sees it: after an earlier smoothing step's ``pre_quant_scale``."""
    scale = input_quantizer.pre_quant_scale
    return x if scale is None else x * scale.to(x.dtype)


@contextmanager
def capture(
    targets: list[Target], max_rows: int = 0, gram: bool = False, gram_block: int = 0
) -> Iterator[dict[str, Stats]]:
    """Record the inputs of ``targets`` (times their input quantizer's ``pre_quant_scale``, as the weight
    sees them) during the forward passes run inside the block (see :class:`Stats` for ``gram`` and
    ``gram_block``)."""
    stats = {t.name: Stats() for t in targets}
    hooks = []
    experts: dict[QuantExperts, dict[tuple[str, int], Stats]] = {}
    for t in targets:
        if t.expert is not None:
            experts.setdefault(t.module, {})[(t.proj, t.expert)] = stats[t.name]
            continue

        def pre_hook(module, args, st=stats[t.name], q=t.input_quantizer):
            _record(st, _effective(args[0], q), max_rows, gram, gram_block)

        hooks.append(t.module.register_forward_pre_hook(pre_hook))
    for module, table in experts.items():

        def observe(proj, expert, x, table=table, module=module):
            if (proj, expert) in table:
                _record(
                    table[(proj, expert)],
                    _effective(x, getattr(module, f"{proj}_input_quantizer")),
                    max_rows,
                    gram,
                    gram_block,
                )

        module.input_observer = observe
    try:
        yield stats
    finally:
        for h in hooks:
            h.remove()
        for module in experts:
            module.input_observer = None
