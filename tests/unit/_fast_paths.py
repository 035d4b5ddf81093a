"""Shared check of the CPU fast paths (native kernels, fused kernels): forward and clipped straight-through
backward equal the reference path's, and the path really ran."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from modelopt_lite.formats import fake_quant, fake_quant_reference, reduce_amax, resolve_format


def check_forward_and_clipped_backward(
    spec,
    x: torch.Tensor,
    amax: torch.Tensor,
    set_enabled: Callable[[bool], None],
    call_count: Callable[[], int],
) -> None:
    """``fake_quant`` with ``clip_gradient=True`` through the path (``set_enabled(True)``) and through the
    reference (``False``): one call counted, none for the reference, the same output and input gradient,
    and a clip that zeroes part of the gradient."""
    grad = torch.randn_like(x)

    def run(enabled: bool):
        set_enabled(enabled)
        leaf = x.clone().requires_grad_()
        before = call_count()
        out = fake_quant(leaf, spec, amax, clip_gradient=True)
        out.backward(grad)
        return out.detach(), leaf.grad, call_count() - before

    out, x_grad, calls = run(True)
    ref_out, ref_grad, ref_calls = run(False)
    assert (calls, ref_calls) == (1, 0)
    assert torch.equal(out, ref_out)
    assert torch.equal(x_grad, ref_grad)
    assert 0 < int((x_grad == 0).sum()) < x.numel()  # the clip zeroed some, not all


def check_failure_warns_once_then_reference(quantize: Callable, caplog, message: str) -> None:
    """A path whose build / compile fails: two FP8 fake quants (``quantize(x, spec, amax)`` returning the
    result and the path's call count) both answered by the reference, none counted, one WARNING that
    contains ``message``."""
    spec = resolve_format(num_bits=(4, 3))
    x = torch.randn(8, 64)
    amax = reduce_amax(x, spec)
    with caplog.at_level(logging.DEBUG, logger="modelopt_lite"):
        first, calls = quantize(x, spec, amax)
        second, second_calls = quantize(x, spec, amax)
    expected = fake_quant_reference(x, spec, amax)
    assert torch.equal(first, expected)
    assert torch.equal(second, expected)
    assert calls == second_calls == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert message in warnings[0].getMessage()


def check_uncovered_runs_reference(quantize: Callable, x, spec, amax, caplog, logger_text: str) -> None:
    """An input the path does not cover, quantized twice: the reference's result, no call counted, one
    DEBUG line (``logger_text`` in it) for both calls."""
    with caplog.at_level(logging.DEBUG, logger="modelopt_lite"):
        first, calls = quantize(x, spec, amax)
        second, _ = quantize(x, spec, amax)
    assert calls == 0
    assert torch.equal(first, fake_quant_reference(x, spec, amax))
    assert torch.equal(first, second)
    lines = [r for r in caplog.records if logger_text in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].levelno == logging.DEBUG
