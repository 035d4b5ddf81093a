"""MSE calibration: max calibration, then for every enabled static weight quantizer a search of the amax
multiplier on a grid (``start_multiplier`` to ``stop_multiplier`` in steps of ``step_size``) that minimises
the squared quantization error; each amax element (channel, block) picks its own multiplier, formats with
one global amax (NVFP4, per tensor) one per weight. Activation quantizers keep their max amax."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..formats import reduce_like_amax
from ..logging import get_logger
from ..nn import TensorQuantizer
from .calibrate import ForwardLoop, max_calibrate, register_algorithm, weight_quantizers
from .search import quantize_like

__all__ = ["mse_calibrate"]

logger = get_logger(__name__)


@register_algorithm("mse")
def mse_calibrate(model: nn.Module, forward_loop: ForwardLoop | None, **options: Any) -> None:
    start = float(options.pop("start_multiplier", 0.5))
    stop = float(options.pop("stop_multiplier", 1.0))
    step = float(options.pop("step_size", 0.05))
    if options.pop("fp8_scale_sweep", False):
        raise NotImplementedError("mse: the NVFP4 FP8 block-scale sweep (fp8_scale_sweep) is not implemented")
    if options:
        raise ValueError(
            f"mse: unknown option(s) {sorted(options)} (start_multiplier, stop_multiplier, step_size)"
        )
    if not 0 < start <= stop or step <= 0:
        raise ValueError("mse: need 0 < start_multiplier <= stop_multiplier and step_size > 0")
    grid = torch.arange(start, stop + step / 2, step).tolist()
    max_calibrate(model, forward_loop)
    searched = 0
    with torch.no_grad():
        for q, w in weight_quantizers(model):
            if not isinstance(q, TensorQuantizer) or not q.is_enabled or not q.spec.needs_amax:
                continue
            w = w.detach().float()
            amax = q.amax
            per_element = amax.numel() > 1 and q.spec.kind in ("int", "fp8")
            errors = []
            for m in grid:
                err = (quantize_like(q, w, amax * m).float() - w).pow(2)
                errors.append(reduce_like_amax(err, q.spec).reshape(amax.shape) if per_element else err.sum())
            best = torch.tensor(grid, device=amax.device)[torch.stack(errors).argmin(0)]
            q.amax = amax * best.reshape(amax.shape)
            searched += 1
    logger.info("mse: searched the amax of %d weight quantizer(s) over %d multipliers", searched, len(grid))
