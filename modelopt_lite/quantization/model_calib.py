"""The reference's ``modelopt.torch.quantization.model_calib``: its calibration functions under their names,
each the algorithm this library registers (``mtq.calibrate(model, {"method": ...})`` runs the same code)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .algorithms.awq import awq_clip, awq_full, awq_lite
from .algorithms.local_hessian import local_hessian_calibrate
from .algorithms.mse import mse_calibrate
from .algorithms.smoothquant import smoothquant
from .algorithms.svdquant import svdquant
from .calibration import ForwardLoop, max_calibrate

__all__ = [
    "awq",
    "awq_clip",
    "awq_full",
    "awq_lite",
    "local_hessian_calibrate",
    "max_calibrate",
    "mse_calibrate",
    "smoothquant",
    "svdquant",
]

_AWQ = {"awq_lite": awq_lite, "awq_clip": awq_clip, "awq_full": awq_full}


def awq(
    model: nn.Module, forward_loop: ForwardLoop | None = None, algorithm: str = "awq_lite", **options: Any
) -> None:
    """AWQ as the reference's ``model_calib.awq``: ``algorithm`` is ``"awq_lite"``, ``"awq_clip"`` or
    ``"awq_full"``; the options are that algorithm's (``alpha_step``, ``max_co_batch_size``, ...)."""
    if algorithm not in _AWQ:
        raise ValueError(f"awq: algorithm={algorithm!r} (allowed: {sorted(_AWQ)})")
    _AWQ[algorithm](model, forward_loop, **options)
