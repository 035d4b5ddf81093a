"""SmoothQuant: move activation outliers into the weights with a per-input-channel scale
``s_j = max|X_j|**alpha / max|W_:j|**(1 - alpha)``. The input quantizer gets ``pre_quant_scale = 1 / s``
and the weight's column ``j`` is multiplied by ``s_j``, so the layer computes the same function; then
everything is max-calibrated. Layers that read the same input share one scale (export folds it into the
preceding norm).

One pass of the calibration data, with fake quant off, gives every layer's statistics (as the reference
does): smoothing a layer changes its outputs by rounding only, so the layers after it need not see the
smoothed model. The same pass max-calibrates the other activation quantizers (e.g. KV cache), and a
per-tensor max-calibrated input quantizer takes its amax from the statistics, ``max_j max|X_j| / s_j``
(exact for those inputs: rounding is monotonic); any other input quantizer gets a second pass through the
smoothed model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...distributed import all_ranks_succeed
from ...logging import get_logger
from ...moe import reset_coverage
from ...nn import TensorQuantizer
from ...nn.calibrators import MaxCalibrator
from ..calibration.calibrate import ForwardLoop, register_algorithm, require_data, run_forward_loop
from ..calibration.max_calib import (
    _collect_activations,
    activation_quantizers,
    calibrate_weights,
    calibration_mode,
    load_activations,
)
from ..calibration.targets import Target, blocks, capture, groups, linear_targets

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
    acts = activation_quantizers(model)
    inputs = {id(t.input_quantizer) for t in targets}
    others = [
        q for q in acts if id(q) not in inputs
    ]  # e.g. KV-cache quantizers: smoothing keeps their inputs
    with calibration_mode(model, others), capture(targets) as stats:
        reset_coverage(model)
        with all_ranks_succeed("smoothquant forward_loop"):
            run_forward_loop(model, forward_loop, desc="smoothquant statistics")
        load_activations(model, others)
    fresh = {id(t.input_quantizer) for t in targets if t.input_quantizer.pre_quant_scale is None}
    for block in blocks(targets):
        _smooth(block, stats, alpha)
    derived = _input_amax_from_statistics(model, targets, stats, fresh)
    rest = [q for q in acts if id(q) in inputs and id(q) not in derived]
    if rest:  # amaxes that the statistics cannot give: a pass through the smoothed model
        _collect_activations(model, rest, forward_loop)
    logger.info(
        "smoothquant (alpha=%s): smoothed %d layer(s); %d input amax(es) from the statistics, %d from a "
        "second pass; weights max-calibrated", alpha, len(targets), len(derived), len(rest),
    )  # fmt: skip
    calibrate_weights(model)


def _derivable(q: TensorQuantizer) -> bool:
    """A per-tensor INT / FP8 quantizer with max calibration and nothing but ``pre_quant_scale`` before it
    (no rotation, no bias): its amax after smoothing is ``max_j max|X_j| * pre_quant_scale_j``."""
    spec = q.spec
    return (
        isinstance(q, TensorQuantizer)
        and isinstance(q.calibrator, MaxCalibrator)
        and spec.kind in ("int", "fp8")
        and spec.axis is None
        and not spec.block_axes
        and q._rotation is None
        and q.bias_calibrator is None
    )


@torch.no_grad()
def _input_amax_from_statistics(
    model: nn.Module, targets: list[Target], stats: dict, fresh: set[int]
) -> set[int]:
    """Calibrate each derivable input quantizer (read by linear layers, not experts, and without a
    ``pre_quant_scale`` before the smoothing) from its layers' per-channel ``max|X|``: the calibrator gets
    ``max|X_j|`` in the inputs' dtype times the new ``pre_quant_scale``, whose amax equals that of the
    scaled inputs themselves (rounding is monotonic). Returns the ids of the quantizers so calibrated."""
    by_quantizer: dict[int, tuple[TensorQuantizer, list]] = {}
    excluded: set[int] = set()
    for t in targets:
        q, st = t.input_quantizer, stats[t.name]
        if t.expert is not None or st.absmax is None or id(q) not in fresh or not _derivable(q):
            excluded.add(id(q))
            continue
        by_quantizer.setdefault(id(q), (q, []))[1].append(st)
    done = []
    for key, (q, seen) in by_quantizer.items():
        if key in excluded or len({st.dtype for st in seen}) != 1 or q.pre_quant_scale is None:
            continue
        absmax = torch.stack([st.absmax for st in seen]).amax(0).to(seen[0].dtype)
        q.reset_calibration()
        q._collect(q._transform(absmax.unsqueeze(0)))
        done.append(q)
    load_activations(model, done)
    for q in done:
        q.reset_calibration()
    return {id(q) for q in done}


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
