"""SVDQuant (the reference's ``svdquant``; Li et al., 2024, "SVDQuant: absorbing outliers by low-rank
components for 4-bit diffusion models"), as the reference implements it on top of AWQ:

1. ``awq_lite`` (our AWQ-lite: one smoothing scale per group of layers reading the same input), with the
   layers matching ``skip_layers`` left out (their quantizers off during the search).
2. For every other quantized linear layer, the smoothed weight ``W`` (out, in) is split by its SVD
   ``W = U S V^T`` (float64): the top ``lowrank`` components become the high-precision branch
   ``B = U_r S_r`` (out, rank) and ``A = V_r^T`` (rank, in), stored on the weight quantizer
   (``_svdquant_lora_b`` / ``_svdquant_lora_a``), and the weight keeps the residual ``W - B A``, the only
   part that is quantized. A rank above ``min(out, in)`` is padded with zeros (logged).
3. Max calibration of every quantizer again (on the residual weights; activations with the branch on).

The layer then computes ``Q_in(x / s) Q_w(W - B A)^T + (x / s) A^T B^T`` (``1 / s``: AWQ's
``pre_quant_scale``; see :mod:`modelopt_lite.nn.quant_linear`). MoE experts get the AWQ smoothing but no
branch: as in the reference, only linear layers have one. Other options are AWQ-lite's (``alpha_step``,
``max_tokens``, ``debug``). The export does not write the branch (it raises); save and restore keep it.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from ...logging import get_logger
from ...nn import TensorQuantizer
from ...nn.quant_linear import set_lowrank_factors
from ..calibration.calibrate import ForwardLoop, register_algorithm, require_data
from ..calibration.max_calib import max_calibrate
from ..calibration.targets import linear_targets
from .awq import awq_lite

__all__ = ["lowrank_split", "svdquant"]

logger = get_logger(__name__)


def lowrank_split(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)``: the top-``rank`` SVD components of ``w`` (out, in) as ``B = U_r S_r`` (out, rank) and
    ``A = V_r^T`` (rank, in), computed in float64, returned in ``w``'s dtype; zero-padded to ``rank``."""
    u, s, vt = torch.linalg.svd(w.detach().double(), full_matrices=False)
    b = torch.zeros(w.shape[0], rank, dtype=torch.float64, device=w.device)
    a = torch.zeros(rank, w.shape[1], dtype=torch.float64, device=w.device)
    kept = min(rank, s.numel())
    b[:, :kept] = u[:, :kept] * s[:kept]
    a[:kept] = vt[:kept]
    return a.to(w.dtype), b.to(w.dtype)


@register_algorithm("svdquant")
def svdquant(model: nn.Module, forward_loop: ForwardLoop | None, **options: Any) -> None:
    rank = options.pop("lowrank", 32)
    skip = options.pop("skip_layers", None) or []
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"svdquant: lowrank={rank!r} must be a positive integer")
    if isinstance(skip, str) or not all(isinstance(p, str) for p in skip):
        raise TypeError(f"svdquant: skip_layers={skip!r} must be a list of module-name wildcards")
    require_data("svdquant", forward_loop)
    layers = [t for t in linear_targets(model) if t.expert is None and t.weight_quantizer.is_enabled]
    skipped = [t for t in layers if any(fnmatch.fnmatch(t.name, p) for p in skip)]
    sequential = [
        t.name for t in layers if t not in skipped and not isinstance(t.weight_quantizer, TensorQuantizer)
    ]
    if sequential:
        raise ValueError(
            f"svdquant: {sequential[0]} (and {len(sequential) - 1} more) has a sequential weight quantizer "
            "(W4A8), which gets no low-rank branch (as in the reference): exclude it with skip_layers or use "
            "awq_lite"
        )
    paused = [q for t in skipped for q in (t.weight_quantizer, t.input_quantizer) if q.is_enabled]
    for q in paused:  # kept out of the AWQ search; max-calibrated like the rest at the end
        q.disable()
    try:
        awq_lite(model, forward_loop, **options)
    finally:
        for q in paused:
            q.enable()
    padded = 0
    with torch.no_grad():
        for t in layers:
            if t in skipped:
                continue
            w = t.weight()
            a, b = lowrank_split(w, rank)
            set_lowrank_factors(t.weight_quantizer, a, b)
            w.sub_(b @ a)
            padded += rank > min(w.shape)
    if padded:
        logger.warning("svdquant: lowrank=%d exceeds the rank of %d weight(s): zero-padded", rank, padded)
    logger.info(
        "svdquant: rank-%d branch on %d layer(s), %d skipped; max-calibrating", rank,
        len(layers) - len(skipped), len(skipped),
    )  # fmt: skip
    max_calibrate(model, forward_loop)
