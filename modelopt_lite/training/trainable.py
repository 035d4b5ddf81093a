"""What trains in a QAT / QAD run besides the defaults: ``QuantizationArguments.trainable_params`` /
``frozen_params`` (the reference's names; scale-only training is ``trainable_params:
["*weight_quantizer._amax"]``), and the fused siblings' shared NVFP4 global amax before block scales are
learned."""

from __future__ import annotations

from fnmatch import fnmatch

import torch

from ..export.layers import unify_shared_scales
from ..logging import get_logger
from ..nn import TensorQuantizer, iter_quantizers
from .arguments import QuantizationArguments

__all__ = ["choose_trainable", "unify_learned_static_scales"]

logger = get_logger(__name__)


def choose_trainable(model: torch.nn.Module, quant: QuantizationArguments) -> None:
    """``quant_args.trainable_params`` / ``frozen_params`` (fnmatch patterns of parameter names, as the
    reference's trainer arguments): freeze every other / every matching parameter. A pattern that matches
    no parameter, or a choice that leaves nothing to train, raises."""
    patterns = quant.trainable_params if quant.trainable_params is not None else quant.frozen_params
    if patterns is None:
        return
    which = "trainable_params" if quant.trainable_params is not None else "frozen_params"
    params = dict(model.named_parameters())
    unmatched = [p for p in patterns if not any(fnmatch(n, p) for n in params)]
    if unmatched:
        amax = [n for n in params if n.endswith("._amax")][:2]
        raise ValueError(
            f"{which}: pattern(s) {unmatched} match no parameter of the model (e.g. "
            f"{', '.join(list(params)[:2] + amax)}); learnable scales are '*weight_quantizer._amax' "
            "and exist with learn_amax=True on a recipe with static scales"
        )
    for name, param in params.items():
        matched = any(fnmatch(name, p) for p in patterns)
        param.requires_grad_(matched if which == "trainable_params" else not matched)
    training = [n for n, p in params.items() if p.requires_grad]
    if not training:
        raise ValueError(f"{which}={patterns}: no parameter is left to train")
    logger.info(
        "%s: %d of %d parameter tensor(s) train (%d elements)",
        which, len(training), len(params), sum(params[n].numel() for n in training),
    )  # fmt: skip


def unify_learned_static_scales(model: torch.nn.Module) -> None:
    """Before learning static NVFP4 block scales: give q/k/v and gate/up one weight global amax now (the
    export does it, :func:`~modelopt_lite.export.unify_shared_scales`), so that the block scales are learned
    on the FP8 grid the checkpoint is written with and the export leaves the trained model as it is."""
    if any(
        isinstance(q, TensorQuantizer) and q.spec.static_nvfp4 and q.learnable_amax is not None
        for _, q in iter_quantizers(model)
    ):
        changed = unify_shared_scales(model)
        if changed:
            logger.info(
                "learned static NVFP4 block scales: %d fused sibling(s) now share the export's global amax",
                len(changed),
            )
