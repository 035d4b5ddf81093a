"""Activation-aware weight quantization.

* ``awq_lite``: per group of layers reading the same input (one shared scale, which export folds into the
  preceding norm), search ``alpha`` on a grid of step ``alpha_step`` for the input-channel scale
  ``s = mean|X|**alpha / w_mag**(1 - alpha)`` (normalised so that ``max(s) * min(s) = 1``) minimising the
  sum over the group's layers of each layer's *relative* output error
  ``|| X W^T - (X / s) Q(W s)^T ||^2 / || X W^T + b ||^2`` on sample inputs (``b``: the layer's bias, if
  any), with no scaling as a candidate too; apply it like SmoothQuant (``pre_quant_scale = 1 / s``, weight
  columns times ``s``). The relative error keeps the layer with the largest outputs (often ``v_proj``) from
  deciding the scale of the whole group alone; the bias in the denominator keeps a layer whose output is
  mostly bias (Qwen2's ``k_proj``, where ``||X W^T||^2`` can be 1/5000 of the whole) from deciding it
  instead. (The reference library searches each layer's own scale; a shared one is what export can fold
  into the norm.)
* ``awq_clip``: per weight block (per channel for per-channel formats), search the amax ratio on
  ``clip_ratios`` minimising the block's contribution to the output error ``d^T (X_b^T X_b) d``; formats
  with one global amax (NVFP4, FP8 per tensor) search one ratio per weight.
* ``awq_full``: lite, then clip.

Options: ``alpha_step``, ``clip_ratios`` (or the reference's ``min_clip_ratio`` / ``shrink_step``, which give
the same grid), ``max_tokens`` (sample rows kept per layer), ``group_scale`` (``"joint"``, the default: one
search for the group as above; ``"mean"``: each layer of the group searched alone, then the group given the
mean of their ``pre_quant_scale``, what the reference's export makes of its per-layer scales),
``group_loss`` (how the joint search weighs the group's layers: ``"output"``, the default, as above;
``"relative"``: each error divided by ``||X W^T||^2`` without the bias, the default until 2026-12-07, which
differs only for layers with a bias; ``"regret"``: each layer's ``"relative"`` error divided by the smallest
it reaches searched alone), ``debug``
(log each group's alpha at INFO).

Each expert is searched on its own tokens; an expert that received none keeps its max-calibrated amax
(logged at INFO with the count). Targets are processed one transformer block at a time, layer by layer
where the model allows (see ``layerwise``: one pass of the calibration data in all, max calibration and the
clip statistics fused into each layer's second run), otherwise with one pass of the data per block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...formats import BlockLayout
from ...logging import get_logger
from ...nn import TensorQuantizer
from ..calibration.calibrate import ForwardLoop, register_algorithm, require_data, run_forward_loop
from ..calibration.layerwise import layerwise
from ..calibration.max_calib import calibration_mode, max_calibrate
from ..calibration.search import block_gram, block_weighted_error, quantize_like
from ..calibration.targets import Target, blocks, capture, groups, linear_targets
from .smoothquant import apply_input_scale

__all__ = ["awq_clip", "awq_full", "awq_lite"]

logger = get_logger(__name__)
GROUP_LOSSES = ("output", "relative", "regret")  # the first is the default
_CLIP_RATIOS = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))  # 1.0 .. 0.5


def _weight_targets(model: nn.Module, name: str) -> list[Target]:
    targets = [t for t in linear_targets(model) if t.weight_quantizer.is_enabled]
    if not targets:
        raise ValueError(f"{name}: no enabled weight quantizer to search for")
    return targets


def _weight_magnitude(group: list[Target], block: int) -> torch.Tensor:
    """Mean over output rows of ``|W|`` normalised by each row-block's max (one value per input channel)."""
    mags = []
    for t in group:
        w = t.weight().detach().abs().float()
        layout = BlockLayout.build(w.shape, {-1: min(block, w.shape[-1])})
        blocks_ = layout.split(w)
        norm = blocks_ / blocks_.amax(-1, keepdim=True).clamp_min(1e-12)
        mags.append(layout.merge(norm).mean(0))
    return torch.stack(mags).mean(0)


@torch.no_grad()
def _group_loss(
    group: list[Target], samples: dict[str, torch.Tensor], s: torch.Tensor,
    reference: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> float:  # fmt: skip
    """Sum over the group's layers of ``||X W^T - (X / s) Q(W s)^T||^2 / ||X W^T||^2``; ``reference``
    (from :func:`_group_reference`) holds each layer's ``X W^T`` and its squared norm, the same for every
    candidate ``s``."""
    loss = 0.0
    for t in group:
        x = samples.get(t.name)
        if x is None:
            continue
        w = t.weight().detach().float()
        xs = x / s
        if t.input_quantizer.is_enabled:
            xs = quantize_like(t.input_quantizer, xs)
        if reference is None:
            y = x @ w.t()
            norm = y.pow(2).sum().clamp_min(1e-30)
        else:
            y, norm = reference[t.name]
        out = xs @ quantize_like(t.weight_quantizer, w * s).t()
        loss += float((y - out).pow(2).sum() / norm)
    return loss


def _bias(t: Target) -> torch.Tensor | None:
    bias = getattr(t.module, "bias", None) if t.expert is None else None
    return bias.detach().float() if isinstance(bias, torch.Tensor) else None


@torch.no_grad()
def _group_reference(
    group: list[Target], samples: dict[str, torch.Tensor], group_loss: str = "output"
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's unquantized output ``X W^T`` on its samples and the squared norm its error is divided
    by (computed once per search, not once per candidate): that of the layer's whole output
    ``||X W^T + b||^2`` (``group_loss="output"``), or ``||X W^T||^2``."""
    out = {}
    for t in group:
        x = samples.get(t.name)
        if x is not None:
            y = x @ t.weight().detach().float().t()
            bias = _bias(t) if group_loss == "output" else None
            full = y if bias is None else y + bias
            out[t.name] = (y, full.pow(2).sum().clamp_min(1e-30))
    return out


def _exponents(alpha_step: float) -> list[tuple[float, float]]:
    """``(a, b)`` candidates of ``s = act**a / w_mag**b``: AWQ's line ``b = 1 - a`` on the ``alpha_step``
    grid."""
    steps = max(1, round(1.0 / alpha_step))
    return [(i / steps, 1.0 - i / steps) for i in range(steps + 1)]


def _search(
    group: list[Target], samples: dict[str, torch.Tensor], act: torch.Tensor, alpha_step: float,
    group_loss: str = "output",
) -> tuple[float | None, torch.Tensor | None, float]:  # fmt: skip
    """The group's best ``(alpha, s, loss)`` by :func:`_group_loss` (``alpha`` and ``s`` ``None`` when no
    scaling wins); ``group_loss="regret"`` divides each layer's term by the smallest it reaches alone."""
    block = getattr(group[0].weight_quantizer, "block_sizes", None) or {}
    wmag = _weight_magnitude(group, block.get(-1) or group[0].weight().shape[-1])
    reference = _group_reference(group, samples, group_loss)
    if group_loss == "regret" and len(reference) > 1:
        for t in group:
            if t.name in reference:
                y, norm = reference[t.name]
                reference[t.name] = (y, norm * _search([t], samples, act, alpha_step, "relative")[2])
    # no smoothing (s = 1) is a candidate too, so the search never ends worse than plain max calibration
    best, best_alpha, best_s = _group_loss(group, samples, torch.ones_like(act), reference), None, None
    for a, b in _exponents(alpha_step):
        s = act.clamp_min(1e-8).pow(a) / wmag.clamp_min(1e-8).pow(b)
        s = (s / (s.max() * s.min()).sqrt()).clamp(1e-4, 1e4)
        loss = _group_loss(group, samples, s, reference)
        if loss < best:
            best, best_alpha, best_s = loss, a, s
    return best_alpha, best_s, max(best, 1e-30)


def _lite_group(
    group: list[Target], stats: dict, alpha_step: float, group_scale: str = "joint",
    group_loss: str = "output",
) -> float | None:  # fmt: skip
    seen = [stats[t.name] for t in group if stats[t.name].count]
    if not seen:
        return None
    act = torch.stack([st.abssum for st in seen]).sum(0) / sum(st.count for st in seen)
    samples = {t.name: stats[t.name].sample() for t in group if stats[t.name].count}
    if group_scale == "joint" or len(samples) < 2:
        best_alpha, best_s, _ = _search(group, samples, act, alpha_step, group_loss)
    else:  # each layer's own search, then the mean of their pre_quant_scale (1 / s): the reference's export
        found = [_search([t], samples, act, alpha_step)[:2] for t in group if t.name in samples]
        alphas = [a for a, _ in found if a is not None]
        if not alphas:
            return None
        inverse = torch.stack([1 / s if s is not None else torch.ones_like(act) for _, s in found]).mean(0)
        best_alpha, best_s = sum(alphas) / len(alphas), 1 / inverse
    if best_s is not None:
        apply_input_scale(group, best_s)
    return best_alpha


@torch.no_grad()
def _clip_target(t: Target, x: torch.Tensor, ratios: tuple[float, ...]) -> None:
    """Search the amax ratio per amax element (last-axis blocks or output channels: the output error
    separates into one term per block, ``d_b^T G_b d_b`` with ``G_b = X_b^T X_b``), or one ratio for
    formats with a single amax."""
    q = t.weight_quantizer
    if not isinstance(q, TensorQuantizer) or not q.spec.needs_amax or q.amax is None:
        return
    w = t.weight().detach().float()
    spec, amax = q.spec, q.amax
    last_axis_blocks = spec.kind in ("int", "fp8") and list(spec.block_sizes) == [-1]
    per_channel = spec.kind in ("int", "fp8") and spec.axis in (0, -2) and amax.numel() == w.shape[0]
    if last_axis_blocks:
        layout = BlockLayout.build(w.shape, spec.block_sizes)
        xb = BlockLayout.build(x.shape, spec.block_sizes).split(x).view(x.shape[0], -1, layout.block_numel)
        gram = block_gram(xb)
    errors = []
    for r in ratios:
        d = w - quantize_like(q, w, amax * r).float()
        if last_axis_blocks:
            db = layout.split(d).view(d.shape[0], xb.shape[1], -1)
            errors.append(block_weighted_error(db, gram).reshape(amax.shape))
        elif per_channel:
            errors.append((x @ d.t()).pow(2).sum(0).reshape(amax.shape))
        else:
            errors.append((x @ d.t()).pow(2).sum().reshape(amax.shape if amax.numel() == 1 else ()))
    err = torch.stack(errors)
    best = torch.tensor(ratios, dtype=torch.float32, device=err.device)[err.argmin(0)]
    q.amax = amax * best


def _run(model: nn.Module, forward_loop: ForwardLoop | None, name: str, lite: bool, clip: bool, opts) -> None:
    require_data(name, forward_loop)
    alpha_step = float(opts.pop("alpha_step", 0.1))
    ratios = tuple(opts.pop("clip_ratios", _CLIP_RATIOS))
    if "min_clip_ratio" in opts or "shrink_step" in opts:  # the reference's way to give the same grid
        low, step = float(opts.pop("min_clip_ratio", 0.5)), float(opts.pop("shrink_step", 0.05))
        if not (0 < low < 1 and 0 < step <= 1):
            raise ValueError(f"{name}: need 0 < min_clip_ratio < 1 and 0 < shrink_step <= 1")
        ratios = tuple(round(1.0 - step * i, 6) for i in range(int((1.0 - low) / step + 1e-9) + 1))
    max_rows = int(opts.pop("max_tokens", 2048))
    group_scale = opts.pop("group_scale", "joint")
    if group_scale not in ("joint", "mean"):
        raise ValueError(f"{name}: group_scale={group_scale!r} must be 'joint' or 'mean'")
    group_loss = opts.pop("group_loss", GROUP_LOSSES[0])
    if group_loss not in GROUP_LOSSES:
        raise ValueError(f"{name}: group_loss={group_loss!r} must be one of {list(GROUP_LOSSES)}")
    debug = opts.pop("debug", False)
    if opts:
        raise ValueError(
            f"{name}: unknown option(s) {sorted(opts)} (alpha_step, clip_ratios, min_clip_ratio, "
            "shrink_step, max_tokens, group_scale, group_loss, debug)"
        )
    if not 0 < alpha_step <= 1:
        raise ValueError(f"{name}: alpha_step={alpha_step} must lie in (0, 1]")
    if not isinstance(debug, bool):
        raise TypeError(f"{name}: debug={debug!r} must be True or False")
    targets = _weight_targets(model, name)
    alphas, idle = [], 0

    def search(block: list[Target], stats: dict) -> None:
        nonlocal idle, alphas
        idle += sum(t.expert is not None and not stats[t.name].count for t in block)
        for g in groups(block, stats):
            alpha = _lite_group(g, stats, alpha_step, group_scale, group_loss)
            if debug:  # the reference's AWQ debug option: each group's alpha
                logger.info("%s: %s -> alpha %s", name, ", ".join(t.name for t in g), alpha)
            alphas += [] if alpha is None else [alpha]

    def clip_block(block: list[Target], stats: dict) -> None:
        nonlocal idle
        for t in block:
            if stats[t.name].count:
                _clip_target(t, stats[t.name].sample(), ratios)
            elif not lite and t.expert is not None:
                idle += 1

    with calibration_mode(model):
        run = layerwise(model, forward_loop, targets, name)
        if run is not None:
            # each layer: (lite) its inputs as it is -> search and smoothing; its weights max-calibrated;
            # its outputs, with (clip) its smoothed inputs -> clip search; the activations collected
            for layer in run.layers:
                if lite and layer.targets:
                    with capture(layer.targets, max_rows=max_rows) as stats:
                        layer.replay()
                    search(layer.targets, stats)
                    del stats
                if clip and layer.targets:
                    layer.calibrate_weights()
                    with capture(layer.targets, max_rows=max_rows) as stats:
                        layer.advance()
                    clip_block(layer.targets, stats)
                    del stats
                elif layer.activations or layer.index < len(run.layers) - 1:
                    layer.advance()
    if run is not None:
        run.finish()  # outside calibration_mode, as max calibration runs (sequential weight quantizers)
    else:
        if lite:
            for block in blocks(targets):
                with calibration_mode(model), capture(block, max_rows=max_rows) as stats:
                    run_forward_loop(model, forward_loop, desc=f"{name} block")
                search(block, stats)
        max_calibrate(model, forward_loop)
        if clip:
            for block in blocks(targets):
                with calibration_mode(model), capture(block, max_rows=max_rows) as stats:
                    run_forward_loop(model, forward_loop, desc=f"{name} clip block")
                clip_block(block, stats)
    if idle:
        logger.info(
            "%s: %d expert weight(s) received no calibration tokens and keep max calibration", name, idle
        )
    if alphas:
        logger.info("%s: %d group(s) smoothed, mean alpha %.2f", name, len(alphas), sum(alphas) / len(alphas))


@register_algorithm("awq_lite")
def awq_lite(model: nn.Module, forward_loop: ForwardLoop | None, **options: Any) -> None:
    _run(model, forward_loop, "awq_lite", True, False, dict(options))


@register_algorithm("awq_clip")
def awq_clip(model: nn.Module, forward_loop: ForwardLoop | None, **options: Any) -> None:
    _run(model, forward_loop, "awq_clip", False, True, dict(options))


@register_algorithm("awq_full")
def awq_full(model: nn.Module, forward_loop: ForwardLoop | None, **options: Any) -> None:
    _run(model, forward_loop, "awq_full", True, True, dict(options))
