"""SmoothQuant: move activation outliers into the weights with a per-input-channel scale
``s_j = max|X_j|**alpha / max|W_:j|**(1 - alpha)``. The input quantizer gets ``pre_quant_scale = 1 / s``
and the weight's column ``j`` is multiplied by ``s_j``, so the layer computes the same function; then
everything is max-calibrated. Layers that read the same input share one scale (export folds it into the
preceding norm).

The statistics of each decoder layer are taken with the layers before it already smoothed; layer by layer
(see ``layerwise``) that is one pass of the calibration data through the model, with the final max
calibration of the layers' activations fused into it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..logging import get_logger
from .calibrate import (
    ForwardLoop,
    calibration_mode,
    max_calibrate,
    register_algorithm,
    require_data,
    run_forward_loop,
)
from .layers import Target, blocks, capture, groups, linear_targets
from .layerwise import layerwise

__all__ = ["apply_input_scale", "smoothquant"]

logger = get_logger(__name__)


@torch.no_grad()
def apply_input_scale(group: list[Target], s: torch.Tensor) -> None:
    """``W[:, j] *= s_j`` for every target and ``pre_quant_scale = 1 / s`` on their input quantizers
    (composed with any scale already there)."""
    for t in group:
        w = t.weight()
        w.mul_(s.to(w.dtype))
    for q in {id(t.input_quantizer): t.input_quantizer for t in group}.values():
        inv = 1.0 / s
        q.pre_quant_scale = inv if q.pre_quant_scale is None else q.pre_quant_scale * inv


@register_algorithm("smoothquant")
def smoothquant(
    model: nn.Module, forward_loop: ForwardLoop | None, alpha: float = 1.0, **options: Any
) -> None:
    if options:
        raise ValueError(f"smoothquant options: alpha; got unknown {sorted(options)}")
    if not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"smoothquant alpha={alpha!r} must lie in [0, 1]")
    require_data("smoothquant", forward_loop)
    targets = [
        t for t in linear_targets(model) if t.input_quantizer.is_enabled and t.weight_quantizer.is_enabled
    ]
    if not targets:
        raise ValueError(
            "smoothquant needs layers whose input and weight quantizers are both enabled (W8A8); this config "
            "quantizes weights only: use max, awq_lite or gptq"
        )
    with calibration_mode(model):
        run = layerwise(model, forward_loop, targets, "smoothquant")
        if run is not None:  # each layer: statistics of the layer as it is, smoothing, its outputs
            for layer in run.layers:
                if layer.targets:
                    with capture(layer.targets) as stats:
                        layer.replay()
                    _smooth(layer.targets, stats, alpha)
                if layer.activations or layer.index < len(run.layers) - 1:
                    layer.advance()
    if run is not None:
        run.finish()  # outside calibration_mode, as max calibration runs
    else:
        for block in blocks(targets):
            with calibration_mode(model), capture(block) as stats:
                run_forward_loop(model, forward_loop, desc="smoothquant statistics")
            _smooth(block, stats, alpha)
    logger.info("smoothquant (alpha=%s): smoothed %d layer(s)", alpha, len(targets))
    if run is None:
        max_calibrate(model, forward_loop)


def _smooth(block: list[Target], stats: dict, alpha: float) -> None:
    for group in groups(block, stats):
        seen = [stats[t.name].absmax for t in group if stats[t.name].absmax is not None]
        if not seen:
            continue
        act = torch.stack(seen).amax(0)
        wmax = torch.stack([t.weight().detach().abs().float().amax(0) for t in group]).amax(0)
        s = act.pow(alpha) / wmax.pow(1.0 - alpha)
        s = torch.where((act > 0) & (wmax > 0), s, torch.ones_like(s)).clamp(1e-5, 1e5)
        apply_input_scale(group, s)
