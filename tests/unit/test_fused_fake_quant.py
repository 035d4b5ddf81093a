"""The fused (compiled) CPU fake-quant path: bit for bit the eager reference, forward and straight-through
backward; it is really taken (counted); the off switch; inputs it does not cover and a failing compiler fall
back to the reference with one log line.

Every compile costs seconds on CPU, so the shapes stay in a few shape classes (the last dimension is static,
the leading ones are dynamic) and the randomized test runs few examples."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelopt_lite.formats import (
    fake_quant_reference,
    fused_call_count,
    fused_fake_quant_enabled,
    reduce_amax,
    resolve_format,
    set_fused_fake_quant,
)
from modelopt_lite.formats.functional import dispatch_fake_quant
from modelopt_lite.formats.kernels import fused as fused_mod
from modelopt_lite.formats.kernels import native as native_mod
from modelopt_lite.formats.rounding import e2m1_round

from ._fast_paths import (
    check_failure_warns_once_then_reference,
    check_forward_and_clipped_backward,
    check_uncovered_runs_reference,
)

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
MXFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}
MXINT8 = {"num_bits": 8, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}
FORMATS = {
    "int8 per-channel": {"num_bits": 8, "axis": 0},
    "int4 per-tensor narrow": {"num_bits": 4, "narrow_range": True},
    "int4 block-32": {"num_bits": 4, "block_sizes": {-1: 32}},
    "fp8 per-tensor": {"num_bits": (4, 3)},
    "fp8 per-token dynamic": {"num_bits": (4, 3), "block_sizes": {-1: None, "type": "dynamic"}},
    "nvfp4": NVFP4,
    "mxfp4": MXFP4,
    "mxint8": MXINT8,
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture
def fused_on():
    """The fused path forced on for every size (the native kernels, tried first, off); the modules' state
    restored afterwards."""
    saved, saved_native = dict(fused_mod._state), dict(native_mod._state)
    set_fused_fake_quant(True, min_numel=0)
    native_mod.set_native_fake_quant(False)
    fused_mod._logged_reasons.clear()
    try:
        yield
    finally:
        fused_mod._state.update(saved)
        native_mod._state.update(saved_native)


def _input(
    rows: int, cols: int, dtype: torch.dtype, scale_exp: int, zero_row: bool, strided: bool, seed: int
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * cols if strided else cols, generator=gen) * 10.0**scale_exp
    if zero_row:
        x[rows // 2] = 0  # a zero amax (per channel / block) and exact zeros
    x = x.to(dtype)
    return x[:, ::2] if strided else x  # strided: every other column, not contiguous


def _quantize(x: torch.Tensor, spec, amax) -> tuple[torch.Tensor, int]:
    before = fused_call_count()
    out = dispatch_fake_quant(x, spec, amax)
    return out, fused_call_count() - before


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(sorted(FORMATS)),
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(2, 33),
    scale_exp=st.integers(-4, 4),
    zero_row=st.booleans(),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fused_equals_reference_bit_for_bit(fused_on, name, dtype, rows, scale_exp, zero_row, strided, seed):
    spec = resolve_format(**FORMATS[name])
    # 100 columns: an odd remainder for every block size; one shape class per format, dtype, stride
    x = _input(rows, 100, dtype, scale_exp, zero_row, strided, seed)
    amax = reduce_amax(x, spec) if spec.needs_amax else None
    out, fused_calls = _quantize(x, spec, amax)
    assert fused_calls == 1, f"{name}: the fused path fell back to the reference"
    expected = fake_quant_reference(x, spec, amax)
    assert out.dtype == x.dtype
    assert out.shape == x.shape
    assert torch.equal(out, expected), f"{name} {dtype} {tuple(x.shape)}"
    assert torch.equal(out.signbit(), expected.signbit())  # -0.0 kept where the reference has it


@pytest.mark.parametrize("name", ["int8 per-channel", "nvfp4"])
def test_fused_forward_and_straight_through_backward(fused_on, name):
    spec = resolve_format(**FORMATS[name])
    x = torch.randn(3, 5, 64) * 3  # 3-D: NVFP4 runs on the (rows, cols) view, per channel keeps its shape
    amax = reduce_amax(x, spec) * 0.5  # a clipped amax: the clipped backward zeroes part of the gradient
    check_forward_and_clipped_backward(spec, x, amax, set_fused_fake_quant, fused_call_count)


def test_off_switch_and_environment_variable(fused_on, monkeypatch):
    spec = resolve_format(num_bits=8)
    x = torch.randn(8, 64)
    amax = reduce_amax(x, spec)
    set_fused_fake_quant(False)
    assert not fused_fake_quant_enabled()
    out, calls = _quantize(x, spec, amax)
    assert calls == 0
    assert torch.equal(out, fake_quant_reference(x, spec, amax))
    fused_mod._state["enabled"] = None  # as at start-up: the environment decides; unset means off (opt-in)
    monkeypatch.delenv(fused_mod.ENV_VAR, raising=False)
    assert not fused_fake_quant_enabled()
    fused_mod._state["enabled"] = None
    monkeypatch.setenv(fused_mod.ENV_VAR, "0")
    assert not fused_fake_quant_enabled()
    fused_mod._state["enabled"] = None
    monkeypatch.setenv(fused_mod.ENV_VAR, "1")
    assert fused_fake_quant_enabled()
    assert _quantize(x, spec, amax)[1] == 1


def test_small_inputs_run_the_reference_by_default(fused_on):
    set_fused_fake_quant(min_numel=fused_mod.DEFAULT_MIN_NUMEL)
    spec = resolve_format(num_bits=8)
    x = torch.randn(8, 64)
    assert _quantize(x, spec, reduce_amax(x, spec))[1] == 0
    with pytest.raises(ValueError, match="min_numel"):
        set_fused_fake_quant(min_numel=-1)


@pytest.mark.parametrize(
    "case",
    ["float64", "2-D blocks", "NVFP4 global amax per expert"],
)
def test_uncovered_input_runs_the_reference_with_one_debug_line(fused_on, lib_caplog, case):
    if case == "float64":
        spec, x = resolve_format(num_bits=8), torch.randn(4, 64, dtype=torch.float64)
        amax = reduce_amax(x, spec)
    elif case == "2-D blocks":
        spec, x = resolve_format(num_bits=4, block_sizes={-1: 16, -2: 16}), torch.randn(32, 64)
        amax = reduce_amax(x, spec)
    else:
        spec, x = resolve_format(**NVFP4), torch.randn(2, 8, 64)
        amax = x.abs().amax(dim=(1, 2), keepdim=True)
    check_uncovered_runs_reference(_quantize, x, spec, amax, lib_caplog, "fused fake quant")


def test_e2m1_steps_equal_the_reference_rounding_at_every_boundary():
    """The compare-and-sum E2M1 rounding of the fused NVFP4 kernel against the reference's, at each decision
    boundary, one float32 ulp either side of it, and the special values."""
    points = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e30]
    base = torch.tensor(points, dtype=torch.float32)
    near = torch.cat([base, torch.nextafter(base, base + 1), torch.nextafter(base, base - 1).clamp(min=0)])
    a = torch.cat([near, torch.tensor([float("inf"), 2.0**-149, 2.0**-126])])
    expected = e2m1_round(a.clone())
    assert torch.equal(fused_mod._e2m1_round_steps(a), expected)
    assert torch.isnan(fused_mod._e2m1_round_steps(torch.tensor([float("nan")]))).all()


def test_under_a_callers_torch_compile_the_reference_is_traced(fused_on):
    spec = resolve_format(num_bits=8)
    x = torch.randn(8, 64)
    amax = reduce_amax(x, spec)
    torch._dynamo.reset()
    traced = torch.compile(lambda t: dispatch_fake_quant(t, spec, amax), backend="eager")
    before = fused_call_count()
    out = traced(x)
    assert fused_call_count() == before  # no compiled kernel called from inside the caller's graph
    assert torch.equal(out, fake_quant_reference(x, spec, amax))


def test_wrong_amax_still_raises_the_reference_error(fused_on):
    spec = resolve_format(num_bits=4, block_sizes={-1: 32})
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="splits into 8 blocks"):
        dispatch_fake_quant(x, spec, torch.ones(3, 1))
    assert fused_fake_quant_enabled()  # a user error is not a compile failure


def test_compile_failure_warns_once_then_reference(fused_on, lib_caplog, monkeypatch):
    def no_compiler(gm, example_inputs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(fused_mod, "_BACKEND", no_compiler)
    monkeypatch.setattr(fused_mod, "_kernels", {})
    check_failure_warns_once_then_reference(_quantize, lib_caplog, "no C++ compiler")
    assert not fused_fake_quant_enabled()
