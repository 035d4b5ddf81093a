"""MSE calibration: max calibration, then for every enabled static weight quantizer a search of the amax
multiplier on a grid (``start_multiplier`` to ``stop_multiplier`` in steps of ``step_size``) that minimises
the squared quantization error; each amax element (channel, block) picks its own multiplier, formats with
one global amax (NVFP4, per tensor) one per weight. Static NVFP4 searches each block amax with the global
amax of the max calibration fixed: with four-over-six and the multipliers 1.0 and 1.5 each block picks
whether its largest element maps to 6 or to 4. ``fp8_scale_sweep=True`` (static NVFP4 weights only; the
other weights keep their max amax) instead tries, per block, every block amax ``global_amax * v / 448`` for
the 126 positive FP8 values ``v``. Activation quantizers keep their max amax."""

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
    sweep = bool(options.pop("fp8_scale_sweep", False))
    if options:
        raise ValueError(
            f"mse: unknown option(s) {sorted(options)} "
            "(start_multiplier, stop_multiplier, step_size, fp8_scale_sweep)"
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
            if sweep and not q.spec.static_nvfp4:
                continue  # the FP8 sweep applies to static NVFP4 weights only (the others keep max)
            w = w.detach().float()
            amax = q.amax
            per_element = amax.numel() > 1 and (q.spec.kind in ("int", "fp8") or q.spec.static_nvfp4)
            # candidates: multiples of each max-calibrated amax, or (sweep) every block amax that puts the
            # block scale on one positive FP8 value of the global amax's grid
            base = q.global_amax * torch.ones_like(amax) if sweep else amax
            candidates = fp8_scale_candidates(amax.device) if sweep else amax.new_tensor(grid)
            errors = []
            for m in candidates:
                err = (quantize_like(q, w, base * m).float() - w).pow(2)
                errors.append(reduce_like_amax(err, q.spec).reshape(amax.shape) if per_element else err.sum())
            q.amax = base * candidates[torch.stack(errors).argmin(0)].reshape(amax.shape)
            searched += 1
    logger.info(
        "mse: searched the amax of %d weight quantizer(s) over %d candidates",
        searched, 126 if sweep else len(grid),
    )  # fmt: skip


def fp8_scale_candidates(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 126 positive finite FP8-E4M3 values divided by 448, ascending (the FP8 sweep's block amax as
    fractions of the global amax)."""
    values = torch.arange(128, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values) & (values > 0)] / 448.0
