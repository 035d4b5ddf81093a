"""MSE calibration: max calibration, then for every enabled static weight quantizer a search of the amax
multiplier on a grid that minimises the squared quantization error; each amax element (channel, block) picks
its own multiplier, formats with one global amax (NVFP4, per tensor) one per weight. The grid is the
reference's: ``ceil((stop_multiplier - start_multiplier) / step_size) + 1`` evenly spaced multipliers from
``start_multiplier`` to ``stop_multiplier``. Static NVFP4 searches each block amax with the global amax of the
max calibration fixed: with four-over-six and the multipliers 1.0 and 1.5 each block picks whether its
largest element maps to 6 or to 4. ``fp8_scale_sweep=True`` (static NVFP4 weights only; the other weights
keep their max amax) instead tries, per block, every block amax ``global_amax * v / 448`` for the 126
positive FP8 values ``v``. Activation quantizers keep their max amax.

:func:`search_weight_amax` is the search itself; ``local_hessian`` runs it with another error measure."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...formats import reduce_like_amax
from ...logging import get_logger
from ...nn import Quantizer, TensorQuantizer
from ..calibration.calibrate import ForwardLoop, register_algorithm
from ..calibration.max_calib import max_calibrate, weight_quantizers
from ..calibration.search import quantize_like

__all__ = ["fp8_scale_candidates", "mse_calibrate", "search_options", "search_weight_amax", "sync_options"]

logger = get_logger(__name__)

#: ``error(d)`` of a weight's quantization error ``d = Q(W) - W`` (out, in): one non-negative value per weight
#: element whose sums over an amax element's entries are what that amax element is chosen to minimise.
ErrorMeasure = Callable[[torch.Tensor], torch.Tensor]


def search_options(
    name: str, options: dict[str, Any], start: float, stop: float, step: float, sweep: bool, extra: str = ""
) -> tuple[list[float], bool]:
    """``(grid, fp8_scale_sweep)`` from an algorithm's options (popped; ``start`` ... are the defaults);
    raises on unknown options (``extra`` names the algorithm's own, already popped ones)."""
    start = float(options.pop("start_multiplier", start))
    stop = float(options.pop("stop_multiplier", stop))
    step = float(options.pop("step_size", step))
    sweep = bool(options.pop("fp8_scale_sweep", sweep))
    if options:
        raise ValueError(
            f"{name}: unknown option(s) {sorted(options)} "
            f"(start_multiplier, stop_multiplier, step_size, fp8_scale_sweep{extra})"
        )
    if not 0 < start <= stop or step <= 0:
        raise ValueError(f"{name}: need 0 < start_multiplier <= stop_multiplier and step_size > 0")
    return torch.linspace(start, stop, math.ceil((stop - start) / step) + 1).tolist(), sweep


def sync_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options of the search algorithms that go to their max calibration (popped from ``options``):
    ``distributed_sync`` and ``shared_states``, as in the reference's ``MseCalibConfig``."""
    return {k: options.pop(k) for k in ("distributed_sync", "shared_states") if k in options}


@register_algorithm("mse")
def mse_calibrate(model: nn.Module, forward_loop: ForwardLoop | None, **options: Any) -> None:
    sync = sync_options(options)
    grid, sweep = search_options("mse", options, 0.5, 1.0, 0.05, False)
    max_calibrate(model, forward_loop, **sync)
    search_weight_amax(model, grid, sweep, "mse")


@torch.no_grad()
def search_weight_amax(
    model: nn.Module,
    grid: list[float],
    sweep: bool,
    name: str,
    measure: Callable[[Quantizer], ErrorMeasure | None] = lambda q: None,
) -> None:
    """Set every enabled static weight amax to the candidate with the lowest error: the squared error, or
    ``measure(quantizer)`` where that is not ``None``. Candidates are multiples of the max-calibrated amax
    on ``grid``, or with ``sweep`` (static NVFP4 only; the other weights are left as they are) the block
    amaxes that put the block scale on each positive FP8 value of the global amax's grid."""
    searched = 0
    for q, w in weight_quantizers(model):
        if not isinstance(q, TensorQuantizer) or not q.is_enabled or not q.spec.needs_amax:
            continue
        if sweep and not q.spec.static_nvfp4:
            continue  # the FP8 sweep applies to static NVFP4 weights only (the others keep max)
        w = w.detach().float()
        amax = q.amax
        per_element = amax.numel() > 1 and (q.spec.kind in ("int", "fp8") or q.spec.static_nvfp4)
        error = measure(q) or (lambda d: d.pow(2))
        # candidates: multiples of each max-calibrated amax, or (sweep) every block amax that puts the block
        # scale on one positive FP8 value of the global amax's grid
        base = q.global_amax * torch.ones_like(amax) if sweep else amax
        candidates = fp8_scale_candidates(amax.device) if sweep else amax.new_tensor(grid)
        errors = []
        for m in candidates:
            err = error(quantize_like(q, w, base * m).float() - w)
            errors.append(reduce_like_amax(err, q.spec).reshape(amax.shape) if per_element else err.sum())
        q.amax = base * candidates[torch.stack(errors).argmin(0)].reshape(amax.shape)
        searched += 1
    logger.info(
        "%s: searched the amax of %d weight quantizer(s) over %d candidates",
        name, searched, 126 if sweep else len(grid),
    )  # fmt: skip


def fp8_scale_candidates(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 126 positive finite FP8-E4M3 values divided by 448, ascending (the FP8 sweep's block amax as
    fractions of the global amax)."""
    values = torch.arange(128, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values) & (values > 0)] / 448.0
