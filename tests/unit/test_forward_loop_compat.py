"""Model-Optimizer accepts a zero-argument ``forward_loop`` (deprecated); so do we, with a FutureWarning."""

from __future__ import annotations

import pytest
import torch

import modelopt_lite.quantization as mtq

from ._models import batches, tiny_llama


def test_zero_argument_forward_loop_is_accepted_with_a_warning():
    data = batches()
    reference = mtq.quantize(tiny_llama(), "INT8_DEFAULT_CFG", lambda m: [m(x) for x in data])
    model = tiny_llama()

    def forward_loop():  # the reference's deprecated form: the loop closes over the model
        for x in data:
            model(x)

    with pytest.warns(FutureWarning, match="forward_loop takes no argument"):
        mtq.quantize(model, "INT8_DEFAULT_CFG", forward_loop)
    amax = {n: q.amax for n, q in mtq.iter_quantizers(model) if q.is_enabled}
    for name, q in mtq.iter_quantizers(reference):
        if q.is_enabled:
            assert torch.equal(amax[name], q.amax), name
    with pytest.warns(FutureWarning):
        mtq.calibrate(model, "max", forward_loop)
