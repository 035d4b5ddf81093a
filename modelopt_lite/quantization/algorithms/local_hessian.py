"""Local-Hessian calibration (the reference's ``local_hessian``): the weight amax search of ``mse`` with each
candidate's error weighted by the layer's inputs, block by block.

1. Max calibration.
2. One pass of the calibration data with the weight quantizers off (activation quantizers as configured)
   records, for every quantized linear map, the diagonal blocks of its input Gram matrix:
   ``H_b = X_b^T X_b / tokens`` for every ``block_size`` consecutive input channels ``b``.
3. The search of :func:`~.mse.search_weight_amax` (the FP8 scale sweep for static NVFP4 by default, or the
   multiplier grid) with the error of a weight block ``d_b`` (one output row, one input block) taken as
   ``d_b^T H_b d_b``, its contribution to the output error, instead of ``|d_b|^2``.

Weights whose input features are not a multiple of ``block_size``, or that received no tokens, are searched
with the plain squared error (logged). ``block_size`` should equal the weight quantizer's block (16 for
NVFP4); a different one is logged, as the reference warns. ``debug=True`` keeps the per-block Hessians on
the model as ``model._local_hessian_accumulators`` (quantizer name -> tensor).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...logging import get_logger
from ...nn import Quantizer, TensorQuantizer, iter_quantizers
from ..calibration.calibrate import ForwardLoop, register_algorithm, require_data, run_forward_loop
from ..calibration.max_calib import calibration_mode, max_calibrate, weight_quantizers
from ..calibration.search import block_weighted_error
from ..calibration.targets import capture, linear_targets
from .mse import ErrorMeasure, search_options, search_weight_amax, sync_options

__all__ = ["hessian_error", "local_hessian_calibrate"]

logger = get_logger(__name__)


def hessian_error(hessian: torch.Tensor) -> ErrorMeasure:
    """The error measure of per-block Hessians ``(in / b, b, b)``: ``d_b^T H_b d_b`` of every output row
    and input block, spread evenly over the block's ``b`` elements."""
    blocks, b, _ = hessian.shape

    def error(d: torch.Tensor) -> torch.Tensor:
        db = d.reshape(d.shape[0], blocks, b)
        return (block_weighted_error(db, hessian) / b).unsqueeze(-1).expand_as(db).reshape(d.shape)

    return error


@register_algorithm("local_hessian")
def local_hessian_calibrate(model: nn.Module, forward_loop: ForwardLoop | None, **options: Any) -> None:
    block = options.pop("block_size", 16)
    debug = options.pop("debug", False)
    sync = sync_options(options)
    grid, sweep = search_options(
        "local_hessian", options, 0.25, 4.0, 0.1, True, extra=", block_size, debug"
    )  # the reference's defaults
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ValueError(f"local_hessian: block_size={block!r} must be a positive integer")
    if not isinstance(debug, bool):
        raise TypeError(f"local_hessian: debug={debug!r} must be True or False")
    require_data("local_hessian", forward_loop)
    max_calibrate(model, forward_loop, **sync)
    targets = [t for t in linear_targets(model) if isinstance(t.weight_quantizer, TensorQuantizer)]
    targets = [t for t in targets if t.weight_quantizer.is_enabled]
    weights = {id(q) for q, _ in weight_quantizers(model, gather=False)}
    active = [q for _, q in iter_quantizers(model) if isinstance(q, TensorQuantizer) and id(q) not in weights]
    active = [q for q in active if q._quant_enabled]
    with calibration_mode(model), capture(targets, gram_block=block) as stats:
        for q in active:  # as in the reference: the weights unquantized, the activations quantized
            q.enable_quant()
        run_forward_loop(model, forward_loop, desc="local_hessian")
    hessians: dict[int, torch.Tensor] = {}
    plain, misaligned = [], []
    for t in targets:
        st = stats.pop(t.name)
        if st.gram is None or not st.count:
            plain.append(t.name)
            continue
        hessians[id(t.weight_quantizer)] = st.gram.div_(st.count)
        if (t.weight_quantizer.block_sizes or {}).get(-1, block) != block:
            misaligned.append(t.name)
    if plain:
        logger.warning(
            "local_hessian: %d weight(s) (%s, ...) received no tokens or have input features that are not a "
            "multiple of block_size=%d: searched with the plain squared error",
            len(plain), plain[0], block,
        )  # fmt: skip
    if misaligned:
        logger.warning(
            "local_hessian: block_size=%d differs from the weight quantizer's block for %d weight(s) "
            "(%s, ...): the Hessian blocks do not align with the scale blocks",
            block, len(misaligned), misaligned[0],
        )  # fmt: skip

    def measure(q: Quantizer) -> ErrorMeasure | None:
        h = hessians.get(id(q))
        return None if h is None else hessian_error(h)

    search_weight_amax(model, grid, sweep, "local_hessian", measure)
    if debug:
        model._local_hessian_accumulators = {t.weight_quantizer.name: hessians.get(id(t.weight_quantizer))
                                             for t in targets}  # fmt: skip
