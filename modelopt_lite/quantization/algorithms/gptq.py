"""GPTQ: quantize a weight column by column and spread each column's error over the columns not yet
quantized, using the inverse Hessian ``H = 2 X^T X / n`` of the layer inputs (Frantar et al., 2022).

* Formats: INT-k (per tensor, per output channel, last-axis blocks), FP8 (per tensor / channel), NVFP4.
  Block scales are taken from the updated weights when a block starts (static scales from the original
  weights with ``act_order``); the weight is then replaced by its quantized values, and static block /
  channel amaxes are set to the ones GPTQ used so that fake quant reproduces them exactly.
* Memory: Hessians are accumulated for one transformer block at a time, on the inputs that the already
  quantized earlier blocks produce (layer by layer, see ``layerwise``: one pass of ``forward_loop`` in
  all; otherwise one pass per block), so host memory grows with the largest block.
* A singular Hessian is damped (``damp`` times its mean diagonal, increased until Cholesky succeeds); dead
  input channels (never active) get their weight column zeroed. Experts with no tokens keep max calibration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...formats import fp8_fake_quant, int_fake_quant, nvfp4_block_scales, nvfp4_global_scale
from ...formats.rounding import e2m1_round
from ...logging import get_logger
from ...nn import TensorQuantizer
from ..calibration.calibrate import ForwardLoop, register_algorithm, require_data, run_forward_loop
from ..calibration.layerwise import layerwise
from ..calibration.max_calib import calibration_mode, max_calibrate
from ..calibration.targets import blocks, capture, linear_targets

__all__ = ["gptq", "gptq_quantize_weight"]

logger = get_logger(__name__)


def _group_size(q: TensorQuantizer, cols: int) -> int:
    spec = q.spec
    if spec.kind == "nvfp4" or (spec.kind == "int" and list(spec.block_sizes) == [-1]):
        return spec.block_sizes[-1] or cols
    return cols


def _column_quantizer(q: TensorQuantizer, w: torch.Tensor) -> Callable[[torch.Tensor, int], Callable]:
    """``scales(group_weights, start)`` -> a function quantizing one column with those fixed scales."""
    spec = q.spec
    if spec.kind == "int" and (spec.block_axes or spec.axis in (None, 0, -2)):
        blocks = bool(spec.block_axes)
        fixed = (
            None
            if blocks
            else (w.abs().amax(1) if spec.axis is not None else w.abs().amax().expand(w.shape[0]))
        )

        def int_scales(group: torch.Tensor, start: int):
            amax = group.abs().amax(1) if blocks else fixed
            return amax, lambda col: int_fake_quant(
                col, amax, spec.num_bits, spec.unsigned, spec.narrow_range
            )

        return int_scales
    if spec.kind == "fp8" and not spec.block_axes and spec.axis in (None, 0, -2):
        amax = w.abs().amax(1) if spec.axis is not None else w.abs().amax().expand(w.shape[0])
        return lambda group, start: (amax, lambda col: fp8_fake_quant(col, amax, spec.num_bits))
    if spec.kind == "nvfp4":
        s2 = nvfp4_global_scale(w.abs().amax())

        def nvfp4_scales(group: torch.Tensor, start: int):
            step = nvfp4_block_scales(group.abs().amax(1), s2) * s2
            return step, lambda col: e2m1_round(col.abs() / step).copysign(col) * step

        return nvfp4_scales
    raise ValueError(
        f"{q.name}: gptq supports INT-k (per tensor / channel / last-axis blocks), FP8 per tensor / channel "
        f"and NVFP4 weights, not {spec.name} {spec.granularity}"
    )


def _inverse_hessian(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``H^-1`` after damping; more damping until the factorisation succeeds."""
    mean_diag = float(h.diagonal().mean()) or 1.0
    for attempt in range(8):
        hd = h.clone()
        hd.diagonal().add_(damp * (10**attempt) * mean_diag)
        chol, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)
    raise RuntimeError("gptq: the Hessian stays singular after damping; check the calibration data")


@torch.no_grad()
def gptq_quantize_weight(
    q: TensorQuantizer, w: torch.Tensor, h: torch.Tensor, block_size: int = 128, damp: float = 0.01,
    act_order: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
    """GPTQ of ``w`` (out, in) with Hessian ``h`` (in, in): the quantized weight and the per-group scales
    (amax for INT, dequantized block scale for NVFP4) in group order."""
    w = w.detach().float().clone()
    h = h.float().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    cols = w.shape[1]
    group = _group_size(q, cols)
    scales_for = _column_quantizer(q, w)
    perm = torch.argsort(h.diagonal(), descending=True) if act_order else torch.arange(cols)
    static: dict[int, tuple] = {}
    if act_order:  # fixed group scales from the original weights (the groups are visited out of order)
        static = {g: scales_for(w[:, g : g + group], g) for g in range(0, cols, group)}
    w, h = w[:, perm], h[perm][:, perm]
    hinv = _inverse_hessian(h, damp)
    quantized = torch.zeros_like(w)
    current: dict[int, tuple] = {}
    for b0 in range(0, cols, block_size):
        b1 = min(b0 + block_size, cols)
        errors = torch.zeros(w.shape[0], b1 - b0, device=w.device)
        for i in range(b0, b1):
            col = int(perm[i])
            g = col - col % group
            if act_order:
                _, quant = static[g]
            else:
                if g not in current:
                    current[g] = scales_for(
                        w[:, i : i + group], g
                    )  # the group starts here (columns in order)
                _, quant = current[g]
            qcol = quant(w[:, i])
            quantized[:, i] = qcol
            err = (w[:, i] - qcol) / hinv[i, i]
            w[:, i:b1] -= err.unsqueeze(1) * hinv[i, i:b1].unsqueeze(0)
            errors[:, i - b0] = err
        w[:, b1:] -= errors @ hinv[b0:b1, b1:]
    out = torch.empty_like(quantized)
    out[:, perm] = quantized
    table = static if act_order else current
    return out, [table[g][0] for g in sorted(table)]


@register_algorithm("gptq")
def gptq(model: nn.Module, forward_loop: ForwardLoop | None, **options: Any) -> None:
    block_size = int(options.pop("block_size", 128))
    damp = float(options.pop("damp", options.pop("percdamp", 0.01)))
    act_order = bool(options.pop("act_order", False))
    if options:
        raise ValueError(f"gptq: unknown option(s) {sorted(options)} (block_size, damp, act_order)")
    require_data("gptq", forward_loop)
    targets = [t for t in linear_targets(model) if t.weight_quantizer.is_enabled]
    if not targets:
        raise ValueError("gptq: no enabled weight quantizer")
    for t in targets:
        if not isinstance(t.weight_quantizer, TensorQuantizer):
            raise ValueError(f"{t.weight_quantizer.name}: gptq does not support sequential weight quantizers")
        _column_quantizer(t.weight_quantizer, t.weight().detach().float())  # format check before any pass
    pinned: list[tuple[TensorQuantizer, torch.Tensor]] = []
    idle = 0

    def quantize_block(block: list, stats: dict) -> None:
        nonlocal idle
        for t in block:
            st = stats.pop(t.name)
            if not st.count:
                idle += t.expert is not None
                continue
            q = t.weight_quantizer
            h = st.gram.mul_(2.0 / st.count)
            st.gram = None
            quantized, scales = gptq_quantize_weight(q, t.weight(), h, block_size, damp, act_order)
            del h
            with torch.no_grad():
                t.weight().copy_(quantized.to(t.weight().dtype))
            if q.spec.kind == "int" and q.spec.block_axes:
                pinned.append((q, torch.stack(scales, 1).reshape(-1, 1)))
            elif q.spec.kind in ("int", "fp8") and q.spec.axis is not None:
                pinned.append((q, scales[0].reshape(-1, 1)))
            elif q.spec.kind in ("int", "fp8"):  # per tensor
                pinned.append((q, scales[0][0].reshape(())))

    with calibration_mode(model):
        run = layerwise(model, forward_loop, targets, "gptq")
        if run is not None:  # each layer: its Hessians as it is, GPTQ, its (quantized) outputs
            for layer in run.layers:
                if layer.targets:
                    with capture(layer.targets, gram=True) as stats:
                        layer.replay()
                    quantize_block(layer.targets, stats)
                    del stats
                if layer.activations or layer.index < len(run.layers) - 1:
                    layer.advance()
    if run is not None:
        run.finish()  # outside calibration_mode, as max calibration runs
    else:
        for block in blocks(targets):
            with calibration_mode(model), capture(block, gram=True) as stats:
                run_forward_loop(model, forward_loop, desc="gptq block")
            quantize_block(block, stats)
        max_calibrate(model, forward_loop)
    for q, amax in pinned:
        q.amax = amax
    if idle:
        logger.info("gptq: %d expert weight(s) received no calibration tokens and keep max calibration", idle)
    logger.info(
        "gptq: %d weight(s) quantized (block_size=%d, damp=%s, act_order=%s)", len(targets), block_size, damp,
        act_order,
    )  # fmt: skip
