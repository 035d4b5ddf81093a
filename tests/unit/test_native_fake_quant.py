"""The native (C, one pass) CPU fake-quant kernels: bit for bit the eager reference on randomized shapes,
dtypes, scales and special values (hypothesis), forward and straight-through backward; really taken (counted)
by ``fake_quant``, by a quantizer's output buffer and by a QAT training step; the off switch and its
environment variable; uncovered inputs and a failing build fall back to the reference with one log line."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelopt_lite.formats import (
    fake_quant_reference,
    native_call_count,
    native_fake_quant_enabled,
    reduce_amax,
    resolve_format,
    set_native_fake_quant,
)
from modelopt_lite.formats.functional import dispatch_fake_quant
from modelopt_lite.formats.kernels import native as native_mod
from modelopt_lite.formats.kernels import native_build

from ._fast_paths import (
    check_failure_warns_once_then_reference,
    check_forward_and_clipped_backward,
    check_uncovered_runs_reference,
)

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
FORMATS = {
    "int8 per-tensor": {"num_bits": 8},
    "int8 per-channel": {"num_bits": 8, "axis": 0},
    "int4 per-tensor narrow": {"num_bits": 4, "narrow_range": True},
    "uint8 per-tensor": {"num_bits": 8, "unsigned": True},
    "int4 block-32": {"num_bits": 4, "block_sizes": {-1: 32}},
    "fp8 per-tensor": {"num_bits": (4, 3)},
    "fp8 per-channel": {"num_bits": (4, 3), "axis": 0},
    "e5m2 per-tensor": {"num_bits": (5, 2)},
    "fp8 block-16": {"num_bits": (4, 3), "block_sizes": {-1: 16}},
    "nvfp4": NVFP4,
    "nvfp4 static global amax": NVFP4,
    "nvfp4 global amax per expert": NVFP4,
    "fp8 amax per expert": {"num_bits": (4, 3)},
    "int8 amax per expert": {"num_bits": 8},
    "fp8 per-token dynamic": {"num_bits": (4, 3), "block_sizes": {-1: None, "type": "dynamic"}},
    "int8 block-32 dynamic": {"num_bits": 8, "block_sizes": {-1: 32, "type": "dynamic"}},
    "mxfp8": {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
    "mxfp6 e3m2": {"num_bits": (3, 2), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
    "mxfp4": {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
    "mxint8": {"num_bits": 8, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SPECIAL = (0.0, -0.0, float("inf"), float("-inf"), float("nan"), 2.0**-149, -(2.0**-126), 1e30)


#: the tests that need the kernels built skip on a machine without a C compiler (the library then runs the
#: reference formulas, with one WARNING; the failed-build test covers that path everywhere)
needs_compiler = pytest.mark.skipif(
    native_build.compiler() is None,
    reason="no C compiler ($CC, cc, gcc, clang): the native kernels cannot build",
)


@pytest.fixture
def native_on():
    """The native kernels on (their build shared by the tests); the module's state restored afterwards."""
    saved = dict(native_mod._state)
    set_native_fake_quant(True)
    native_mod._logged_reasons.clear()
    try:
        yield
    finally:
        native_mod._state.update(saved)


def _amax(x: torch.Tensor, spec, name: str) -> torch.Tensor | None:
    """A calibrated amax of the finite part of ``x`` (NVFP4: its global amax; per expert: one per index of
    the first axis, shaped ``(E, 1, ...)``), scaled down so that values clip, and one row / block / expert
    amax zero when there are several; ``None`` for the formats that take their amax from the input."""
    finite = torch.where(torch.isfinite(x.float()), x.float(), torch.zeros(()))
    if name == "nvfp4" or (not spec.needs_amax and spec.kind != "nvfp4"):
        return None
    if "per expert" in name:
        amax = finite.abs().amax(dim=tuple(range(1, x.ndim)), keepdim=True) * 0.75
        amax.view(-1)[-1] = 0.0
        return amax
    if spec.kind == "nvfp4":
        return finite.abs().amax() * 0.75
    amax = reduce_amax(finite, spec) * 0.75
    if amax.numel() > 1:
        amax.view(-1)[1] = 0.0  # an amax at or below 2**-24: that row / block quantizes to zero
    return amax


def _quantize(x, spec, amax, out=None):
    before = native_call_count()
    res = dispatch_fake_quant(x, spec, amax, None, out)
    return res, native_call_count() - before


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns (NaN compared as NaN, -0.0 apart from 0.0)."""
    t = torch.where(torch.isnan(t), torch.full((), float("nan"), dtype=t.dtype), t)
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@needs_compiler
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(sorted(FORMATS)),
    dtype=st.sampled_from(DTYPES),
    lead=st.lists(st.integers(1, 9), min_size=0, max_size=2),
    blocks=st.integers(1, 12),
    remainder=st.sampled_from([0, 0, 5, 17]),
    scale_exp=st.integers(-6, 6),
    special=st.booleans(),
    buffer=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_native_equals_reference_bit_for_bit(
    native_on, name, dtype, lead, blocks, remainder, scale_exp, special, buffer, seed
):
    spec = resolve_format(**FORMATS[name])
    # a shorter last block (remainder) for INT / FP8 blocks; NVFP4 takes whole blocks only
    cols = 32 * blocks + (0 if spec.kind == "nvfp4" else remainder)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, 2, cols, generator=gen) * 10.0**scale_exp
    if spec.unsigned:
        x = x.abs()
    if special:
        values = torch.tensor([v for v in SPECIAL if not (spec.unsigned and v < 0)])
        x.view(-1)[torch.randint(x.numel(), (len(values),), generator=gen)] = values
    x = x.to(dtype)
    amax = _amax(x, spec, name)  # dynamic NVFP4 / blocks / MX: None, the input's own
    out = torch.empty(x.shape) if buffer else None
    res, calls = _quantize(x, spec, amax, out)
    assert calls == 1, f"{name}: the native kernel fell back to the reference"
    expected = fake_quant_reference(x, spec, amax)
    assert res.dtype == x.dtype
    assert res.shape == x.shape
    assert torch.equal(_bits(res), _bits(expected)), f"{name} {dtype} {tuple(x.shape)}"
    if buffer and dtype == torch.float32:
        assert res is out  # written into the given buffer and returned as is


@needs_compiler
@pytest.mark.parametrize("name", ["int8 per-channel", "fp8 per-tensor", "nvfp4 static global amax"])
def test_native_forward_and_straight_through_backward(native_on, name):
    spec = resolve_format(**FORMATS[name])
    x = torch.randn(3, 5, 64) * 3
    amax = reduce_amax(x, spec) * 0.5  # clipped: the clipped backward zeroes part of the gradient
    if spec.kind == "nvfp4":
        amax = x.abs().amax() * 0.5
    else:
        amax = reduce_amax(x.reshape(3, -1), spec).reshape(-1, 1, 1) * 0.5 if spec.axis == 0 else amax
    check_forward_and_clipped_backward(spec, x, amax, set_native_fake_quant, native_call_count)


@needs_compiler
def test_off_switch_and_environment_variable(native_on, monkeypatch):
    spec = resolve_format(num_bits=(4, 3))
    x = torch.randn(8, 64)
    amax = reduce_amax(x, spec)
    assert _quantize(x, spec, amax)[1] == 1
    set_native_fake_quant(False)
    assert not native_fake_quant_enabled()
    out, calls = _quantize(x, spec, amax)
    assert calls == 0
    assert torch.equal(out, fake_quant_reference(x, spec, amax))
    for value, enabled in (("0", False), ("off", False), ("1", True), (None, True)):  # unset: on (default)
        native_mod._state["enabled"] = None  # as at start-up: the environment decides
        if value is None:
            monkeypatch.delenv(native_mod.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(native_mod.ENV_VAR, value)
        assert native_fake_quant_enabled() is enabled, value


@pytest.mark.parametrize(
    "case",
    [
        "float64",
        "strided",
        "NVFP4 not whole blocks",
        "NVFP4 global amax shared across experts",
        "2-D blocks",
        "per-channel axis 1",
    ],
)
def test_uncovered_input_runs_the_reference_with_one_debug_line(native_on, lib_caplog, case):
    spec, x = resolve_format(num_bits=8), torch.randn(4, 64)
    if case == "float64":
        x = x.double()
    elif case == "strided":
        x = torch.randn(4, 128)[:, ::2]
    elif case == "NVFP4 not whole blocks":
        spec, x = resolve_format(**NVFP4), torch.randn(4, 40)
    elif case == "2-D blocks":
        spec, x = resolve_format(num_bits=4, block_sizes={-1: 16, -2: 16}), torch.randn(32, 64)
    elif case == "per-channel axis 1":
        spec = resolve_format(num_bits=8, axis=1)
    elif case == "NVFP4 global amax shared across experts":  # (1, 8, 1): not one per leading index
        spec, x = resolve_format(**NVFP4), torch.randn(2, 8, 64)
    amax = x.abs().amax(dim=(0, 2), keepdim=True) if x.ndim == 3 else None
    if amax is None and spec.needs_amax:
        amax = reduce_amax(x, spec)
    check_uncovered_runs_reference(_quantize, x, spec, amax, lib_caplog, "native fake quant")


def test_wrong_input_still_raises_the_reference_error(native_on):
    spec = resolve_format(num_bits=8, unsigned=True)
    with pytest.raises(ValueError, match="unsigned=True"):
        dispatch_fake_quant(-torch.ones(4, 64), spec, torch.ones(()))
    spec = resolve_format(num_bits=4, block_sizes={-1: 32})
    with pytest.raises(ValueError, match="splits into 8 blocks"):
        dispatch_fake_quant(torch.randn(4, 64), spec, torch.ones(3, 1))
    assert native_fake_quant_enabled()  # a user error does not turn the kernels off


@needs_compiler
def test_zero_global_amax_nvfp4_gives_zeros(native_on):
    spec = resolve_format(**NVFP4)
    x = torch.randn(4, 32)
    out, calls = _quantize(x, spec, torch.zeros(()))
    assert calls == 1
    assert torch.equal(out, torch.zeros_like(x))
    assert torch.equal(out, fake_quant_reference(x, spec, torch.zeros(())))


def test_failed_build_warns_once_then_reference(native_on, lib_caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails every build
    monkeypatch.setenv("MODELOPT_LITE_CACHE", str(tmp_path))  # no library built before
    monkeypatch.setitem(native_mod._state, "lib", None)
    monkeypatch.setitem(native_mod._state, "path", None)
    check_failure_warns_once_then_reference(_quantize, lib_caplog, "could not build")
    assert not native_fake_quant_enabled()
    assert not list(tmp_path.rglob("*.so"))
    assert not list(tmp_path.rglob("*.tmp"))


@needs_compiler
def test_build_lands_in_the_cache_and_is_reused(native_on, monkeypatch, tmp_path):
    monkeypatch.setenv("MODELOPT_LITE_CACHE", str(tmp_path))
    monkeypatch.setitem(native_mod._state, "lib", None)
    spec = resolve_format(num_bits=(4, 3))
    x = torch.randn(8, 64)
    assert _quantize(x, spec, reduce_amax(x, spec))[1] == 1
    (built,) = tmp_path.glob("native/fake_quant-*.so")
    assert native_mod.native_library_path() == built
    stamp = built.stat().st_mtime_ns
    monkeypatch.setitem(native_mod._state, "lib", None)
    assert _quantize(x, spec, reduce_amax(x, spec))[1] == 1
    assert built.stat().st_mtime_ns == stamp  # loaded, not rebuilt


@needs_compiler
def test_a_quantized_linear_in_training_takes_the_native_kernels(native_on):
    """A QAT forward / backward through QuantLinear: both quantizers answered by the native kernels, into
    the quantizer's output buffer, and the result equal to the reference path's."""
    from modelopt_lite import quantization as mtq

    def run(enabled: bool):
        set_native_fake_quant(enabled)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32))
        data = [torch.randn(4, 64) for _ in range(2)]
        mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: [m(d) for d in data])
        model.train()
        before = native_call_count()
        out = model(data[0])
        out.backward(torch.ones_like(out))
        return out.detach(), model[0].weight.grad, native_call_count() - before

    out, grad, calls = run(True)
    ref_out, ref_grad, ref_calls = run(False)
    assert calls == 2
    assert ref_calls == 0
    assert torch.equal(out, ref_out)
    assert torch.equal(grad, ref_grad)


@needs_compiler
@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("nvfp4", (2048, 1152)),  # 147K blocks: split between threads
        ("fp8 per-tensor", (2048, 2304)),  # 4.7M elements: split between threads
        ("fp8 per-token dynamic", (3, 1000)),  # rows longer than the kernels' float32 chunk
        ("int8 per-tensor", (1, 70001)),
        ("int4 block-32", (5, 600)),
        ("mxfp8", (1024, 2304)),
    ],
)
def test_bfloat16_is_read_and_written_in_one_pass_bit_for_bit(native_on, name, shape):
    """A bfloat16 input goes through the kernel as bfloat16: the float32 scratch ``out`` a caller may give
    stays untouched (the old path copied the input into it), and the result is the reference's bit for bit,
    on tensors large enough to be split between threads and rows longer than a chunk."""
    spec = resolve_format(**FORMATS[name])
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    x.view(-1)[:8] = torch.tensor(SPECIAL).to(torch.bfloat16)
    amax = _amax(x, spec, name)
    scratch = torch.full(shape, 7.0)
    res, calls = _quantize(x, spec, amax, scratch)
    assert calls == 1
    assert native_mod._state["nan16"] is not None  # the kernels' cast equals PyTorch's on this machine
    assert torch.equal(scratch, torch.full(shape, 7.0))
    assert res.dtype == torch.bfloat16
    assert torch.equal(_bits(res), _bits(fake_quant_reference(x, spec, amax)))


@needs_compiler
def test_a_cast_unlike_pytorchs_keeps_bfloat16_on_the_float32_copy(native_on, monkeypatch):
    lib = native_mod._library()
    assert native_build.bf16_cast_check(lib) == int(torch.tensor([float("nan")] * 4).bfloat16().view(
        torch.int16)[0]) & 0xFFFF  # fmt: skip

    class Skewed:  # a cast whose NaN is not the one PyTorch gives
        def mol_bf16_narrow(self, src, dst, n, nan16):
            lib.mol_bf16_narrow(src, dst, n, nan16 ^ 1)

    assert native_build.bf16_cast_check(Skewed()) is None
    monkeypatch.setitem(native_mod._state, "nan16", None)
    spec = resolve_format(**NVFP4)
    x = torch.randn(4, 64).to(torch.bfloat16)
    scratch = torch.zeros(4, 64)
    res, calls = _quantize(x, spec, None, scratch)
    assert calls == 1
    assert torch.equal(scratch.to(torch.bfloat16), res)  # computed in the float32 copy, then cast
    assert torch.equal(_bits(res), _bits(fake_quant_reference(x, spec, None)))
