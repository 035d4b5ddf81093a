"""Fused fake quant on CPU: the reference formulas of each format compiled by ``torch.compile`` into one
loop over the data (inductor's C++ backend), with the eager reference as fallback and oracle.

The compiled kernels call the same primitive functions as the reference (:func:`..integer.int_apply`,
:func:`..fp8.fp8_apply`, :func:`..nvfp4.nvfp4_block_scales`, :func:`..rounding.minifloat_round`, ...), so
every element gets the same float32 operations in the same order; NVFP4's E2M1 rounding is written as compares
(:func:`_e2m1_round_steps`), which vectorize where the reference's bit casts do not. Results equal the
reference bit for bit (tested). Inductor on CPU keeps true divisions (no reciprocal multiply) and does not
contract into FMAs. What stays eager is the data-dependent part of a format (an amax of zero, a global amax
computed from the input, NVFP4's per-block scales between its two passes).

One kernel is compiled per format (spec), dtype and shape class (number of dimensions, last dimension,
contiguity; inputs of more than two dimensions run as ``(rows, cols)`` where the amax allows), lazily on the
first call that needs it, never at import; the leading dimensions are dynamic, so other sizes of the same
class reuse it. Compile time is logged at DEBUG.

Controls:

- Off by default (opt-in): ``MODELOPT_LITE_FUSED_FAKE_QUANT=1`` in the environment (read at the first
  fake-quant call) or :func:`set_fused_fake_quant` (``enabled=True``) turns it on, ``0`` / ``False`` off;
  :func:`fused_fake_quant_enabled` says whether it is on. Measured on a 2-core CPU (2026-12-02) it is not
  faster everywhere: FP8 1.2-3.2x the eager formulas, INT8 per channel 1.0-1.6x, but INT4 blocks 0.55-0.84x
  at 4096x4096, and NVFP4 1.27x when a process compiles one shape class, 0.67-0.80x after it compiled
  another first; the first calls also pay seconds of compile. So it stays a switch until it wins on every
  format.
- Tensors with fewer than ``min_numel`` elements (default :data:`DEFAULT_MIN_NUMEL`) run the reference: a
  compile costs seconds, which small tensors (tiny models, unit tests) would not win back.
- :func:`fused_call_count` counts the calls the fused path answered, so a test can tell when it silently
  fell back.
- An input the fused path does not cover (not CPU, a dtype other than float32 / bfloat16 / float16, a
  tensor subclass, a batch of NVFP4 global amax, ...) runs the reference, with one DEBUG line per reason.
- A compile failure (no C++ compiler, ...) logs one WARNING and the rest of the process uses the reference.
"""

from __future__ import annotations

import os
import threading
import time
import types
from collections.abc import Callable

import torch

from ...logging import get_logger
from .._blocks import BlockLayout
from ..fp8 import fp8_apply, fp8_scales, fp8_spec
from ..integer import check_unsigned, int_apply, int_bounds
from ..mx import _MXINT8_FRAC_BITS, _element, mx_scale_exponent
from ..nvfp4 import nvfp4_block_scales, nvfp4_global_scale
from ..rounding import TINY_AMAX, minifloat_round
from ..spec import FormatSpec
from .native import cpu_input_reason

__all__ = [
    "DEFAULT_MIN_NUMEL",
    "ENV_VAR",
    "FUSED_KINDS",
    "fused_call_count",
    "fused_fake_quant_enabled",
    "set_fused_fake_quant",
    "try_fused_fake_quant",
]

logger = get_logger(__name__)

#: environment variable: ``1`` / ``true`` / ``on`` turns the fused path on (``0`` / ``false`` / ``off``: off)
ENV_VAR = "MODELOPT_LITE_FUSED_FAKE_QUANT"
#: smallest input the fused path takes by default (elements); smaller ones run the reference
DEFAULT_MIN_NUMEL = 1 << 20
#: the format kinds with a fused kernel
FUSED_KINDS = frozenset({"int", "fp8", "nvfp4", "mx"})
#: the compile backend (a test replaces it to simulate a compile failure)
_BACKEND: str | Callable = "inductor"

_lock = threading.Lock()
_state: dict = {"enabled": None, "min_numel": DEFAULT_MIN_NUMEL, "broken": False, "calls": 0}
_kernels: dict[tuple, Callable] = {}
_logged_reasons: set[str] = set()


def set_fused_fake_quant(enabled: bool | None = None, min_numel: int | None = None) -> None:
    """Turn the fused CPU fake-quant path on or off for this process (``None``: leave as is), and set the
    smallest input it takes (``min_numel`` elements; ``0``: every size). Turning it on again also clears an
    earlier compile failure."""
    if min_numel is not None:
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel={min_numel!r} must be a non-negative int")
        _state["min_numel"] = min_numel
    if enabled is not None:
        _state["enabled"] = bool(enabled)
        if enabled:
            _state["broken"] = False


def fused_fake_quant_enabled() -> bool:
    """Whether the fused path is on (the environment variable decides until :func:`set_fused_fake_quant`)."""
    if _state["enabled"] is None:
        value = os.environ.get(ENV_VAR, "0").strip().lower()
        _state["enabled"] = value in ("1", "true", "on", "yes")
    return bool(_state["enabled"]) and not _state["broken"]


def fused_call_count() -> int:
    """How many fake-quant calls the fused path has answered in this process."""
    return _state["calls"]


def _debug_once(reason: str) -> None:
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.debug("fused fake quant: %s; the reference path runs", reason)


# --------------------------------------------------------------------------- kernels (compiled)
def _int_kernel(spec: FormatSpec) -> Callable:
    bounds = int_bounds(spec.num_bits, spec.unsigned, spec.narrow_range)
    max_bound = float(bounds[1])

    def kernel(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        # int_scale_keep without its data-dependent branch: multiplying by a keep mask of ones is exact
        amax = amax.float()
        tiny = amax <= TINY_AMAX
        scale = torch.full((), max_bound, device=x.device) / amax.masked_fill(tiny, 1.0)
        return int_apply(x, scale, (~tiny).float(), bounds).to(x.dtype)

    return kernel


def _fp8_kernel(spec: FormatSpec) -> Callable:
    fmt, _ = fp8_spec(spec.num_bits)

    def kernel(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        scale, inv_scale = fp8_scales(amax, fmt)
        return fp8_apply(x, scale, inv_scale, fmt).to(x.dtype)

    return kernel


def _split_last(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as ``(*lead, blocks, block)`` along its last axis, zero-padded to a whole number of blocks (the
    layout of :class:`..BlockLayout` for ``{-1: block}``, whose blocks are numbered in this order)."""
    cols = x.shape[-1]
    pad = -cols % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.unflatten(-1, ((cols + pad) // block, block))


def _merge_last(blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of :func:`_split_last`. Cast ``blocks`` to the output dtype first: inductor 2.13 miscompiles a
    cast to bfloat16 / float16 after the slice that drops the padding (wrong values in the last block)."""
    out = blocks.flatten(-2)
    return out if out.shape[-1] == cols else out[..., :cols]


def _block_kernel(spec: FormatSpec) -> Callable:
    """INT / FP8 with blocks along the last axis: static (one calibrated amax per block) or dynamic (each
    block's own amax)."""
    elementwise = _int_kernel(spec) if spec.kind == "int" else _fp8_kernel(spec)
    ((_, block),) = spec.block_axes
    dynamic = spec.dynamic

    def kernel(x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        size = x.shape[-1] if block is None else block
        blocks = _split_last(x, size)
        if dynamic:
            block_amax = blocks.abs().amax(dim=-1, keepdim=True)
        else:
            block_amax = amax.reshape(*blocks.shape[:-1], 1)
        return _merge_last(elementwise(blocks, block_amax), x.shape[-1])

    return kernel


#: E2M1 rounding as a sum of steps: ``(boundary, inclusive, step)``; a value at a boundary goes to the
#: neighbour with the even mantissa (docs/numerics.md): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
#: 2.5 -> 2, 3.5 -> 4, 5 -> 4
_E2M1_STEPS = (
    (0.25, False, 0.5),
    (0.75, True, 0.5),
    (1.25, False, 0.5),
    (1.75, True, 0.5),
    (2.5, False, 1.0),
    (3.5, True, 1.0),
    (5.0, False, 2.0),
)


def _e2m1_round_steps(a: torch.Tensor) -> torch.Tensor:
    """:func:`..rounding.e2m1_round` of non-negative float32 ``a`` as compares and exact sums (NaN stays
    NaN, anything above 5 saturates at 6): the compiled loop vectorizes compares, where the bit-pattern
    form of the reference needs scalar bit casts on CPU. Equal bit for bit (tested)."""
    q = torch.zeros_like(a)
    for boundary, inclusive, step in _E2M1_STEPS:
        above = a >= boundary if inclusive else a > boundary
        q = q + torch.where(above, step, 0.0)
    return torch.where(a == a, q, a)


def _nvfp4_kernel(spec: FormatSpec) -> Callable:
    """The element pass of NVFP4, given each block's dequantized scale ``step`` (``(*lead, blocks, 1)``)."""
    block = spec.block_axes[0][1]

    def kernel(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        rows = _split_last(x, block)
        out = _e2m1_round_steps(rows.float().abs() / step).copysign_(rows).mul_(step)
        return _merge_last(out.to(x.dtype), x.shape[-1])

    return kernel


def _block_amax_kernel(spec: FormatSpec) -> Callable:
    """Each block's amax (float32, ``(*lead, blocks, 1)``): NVFP4's first pass."""
    block = spec.block_axes[0][1]

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return _split_last(x, block).float().abs().amax(dim=-1, keepdim=True)

    return kernel


def _mx_kernel(spec: FormatSpec) -> Callable:
    block = spec.block_axes[0][1]
    num_bits = spec.num_bits
    element = _element(num_bits)

    def kernel(x: torch.Tensor) -> torch.Tensor:
        v = _split_last(x.float(), block)
        exp = mx_scale_exponent(v.abs().amax(dim=-1, keepdim=True), num_bits)
        scale = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)
        v = v / scale
        if element is None:
            q = v.mul(2.0**_MXINT8_FRAC_BITS).round_().clamp_(-127, 127).div_(2.0**_MXINT8_FRAC_BITS)
        else:
            q = minifloat_round(v.abs(), element).copysign_(v)
        return _merge_last(q.mul_(scale).to(x.dtype), x.shape[-1])

    return kernel


def _fresh(fn: Callable) -> Callable:
    """``fn`` with its own copy of its code object: dynamo keeps its compiled graphs (and its limit on
    them) per code object, so every (format, dtype, shape class) gets its own cache instead of sharing one."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _kernel(key: tuple, make: Callable[[FormatSpec], Callable], spec: FormatSpec) -> tuple[Callable, bool]:
    """The compiled kernel for ``key`` and whether it is new (its first call compiles)."""
    with _lock:
        fn = _kernels.get(key)
        if fn is not None:
            return fn, False
        fn = torch.compile(_fresh(make(spec)), backend=_BACKEND, fullgraph=True)
        _kernels[key] = fn
        return fn, True


# --------------------------------------------------------------------------- dispatch
def _not_covered(x: torch.Tensor, spec: FormatSpec, amax, global_amax) -> str | None:
    """Why the fused path does not take this call, or ``None`` when it does."""
    reason = cpu_input_reason(x)
    if reason is not None:
        return reason
    if spec.kind not in FUSED_KINDS:
        return f"format {spec.name}"
    if torch.is_grad_enabled() and x.requires_grad:
        return "autograd through the formula"
    for t in (amax, global_amax):
        if t is not None and (t.device.type != "cpu" or t.requires_grad or not t.is_floating_point()):
            return "amax not a plain CPU float tensor"
    if spec.static_nvfp4:
        return "static NVFP4 (calibrated block amax)"
    if spec.kind == "nvfp4" and amax is not None and amax.numel() > 1:
        return "a batch of NVFP4 global amax"
    if spec.block_axes and (len(spec.block_axes) > 1 or spec.block_axes[0][0] % x.ndim != x.ndim - 1):
        return f"blocks {spec.granularity} not along the last axis"
    return None


class _CompileFailed(Exception):
    """A compiled kernel raised: treated as a compile failure."""


def _run(make: Callable[[FormatSpec], Callable], spec: FormatSpec, x: torch.Tensor, *args) -> torch.Tensor:
    """Call the compiled ``make(spec)`` kernel for ``x``'s shape class with ``(x, *args)``."""
    # the shape class: the leading dimensions are dynamic, the last one (the blocks' axis) stays static
    key = (
        make.__name__,
        spec,
        x.dtype,
        x.ndim,
        x.shape[-1],
        x.is_contiguous(),
        tuple(a is None for a in args),
    )
    fn, new = _kernel(key, make, spec)
    # fresh views carry the dynamic marks, so that the caller's tensors (a model's weights) keep none
    inputs = [t if t is None else t.view(t.shape) for t in (x, *args)]
    for t in inputs:
        if t is not None:
            for dim in range(t.ndim - 1):
                torch._dynamo.maybe_mark_dynamic(t, dim)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            out = fn(*inputs)
    except Exception as err:
        cause = getattr(err, "inner_exception", None) or err.__cause__ or err  # the backend's own error
        first_line = str(cause).splitlines()[0][:200] if str(cause) else ""
        raise _CompileFailed(f"{type(err).__name__}: {type(cause).__name__}: {first_line}") from err
    if new:
        logger.debug(
            "fused fake quant: compiled %s for %s %s, %s %d-D%s in %.2f s",
            make.__name__.strip("_"),
            spec.name,
            spec.granularity,
            str(x.dtype).removeprefix("torch."),
            x.ndim,
            "" if x.is_contiguous() else " strided",
            time.perf_counter() - start,
        )
    return out


def _fused(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None) -> torch.Tensor | None:
    """The fused result, or ``None`` when the eager reference must answer (an all-zero NVFP4 tensor,
    whose output is zeros; an amax the reference rejects with its own error)."""
    flat = x.ndim > 2 and x.is_contiguous() and (spec.block_axes or amax is None or amax.numel() == 1)
    if flat:  # one shape class (rows, cols) for every leading shape: fewer compiles, the same result
        out = _fused(x.reshape(-1, x.shape[-1]), spec, amax)
        return None if out is None else out.view(x.shape)
    if spec.kind == "mx":
        return _run(_mx_kernel, spec, x)
    if spec.kind == "nvfp4":
        global_amax = x.abs().amax() if amax is None else amax
        global_amax = global_amax.to(dtype=torch.float32).reshape(())
        if bool(global_amax <= TINY_AMAX):
            return None
        s2 = nvfp4_global_scale(global_amax)
        # two passes: the block amax, then the elements; the per-block scales in between run eagerly,
        # vectorized over all blocks (a single compiled pass computes them one block at a time: slower)
        step = nvfp4_block_scales(_run(_block_amax_kernel, spec, x), s2).mul_(s2)
        return _run(_nvfp4_kernel, spec, x, step)
    if spec.kind == "int":
        check_unsigned(x, spec.unsigned)
    if spec.block_axes:
        if not spec.dynamic:
            if amax is None or amax.numel() != BlockLayout.build(x.shape, spec.block_sizes).num_blocks():
                return None
        return _run(_block_kernel, spec, x, amax)
    if amax is None:
        return None
    return _run(_int_kernel if spec.kind == "int" else _fp8_kernel, spec, x, amax)


def try_fused_fake_quant(
    x: torch.Tensor,
    spec: FormatSpec,
    amax: torch.Tensor | None,
    global_amax: torch.Tensor | None,
    reference: Callable[[], torch.Tensor],
) -> torch.Tensor | None:
    """The fused fake quant of ``x`` (no autograd), or ``None`` when the reference should run instead.

    ``reference`` computes the reference result; it answers when the compiled kernel fails (after one
    WARNING; the fused path then stays off for the process) and raises the reference's own error when the
    input itself is wrong.
    """
    if torch.compiler.is_compiling():
        return None  # the caller's graph takes in the reference formula (no logging inside a trace)
    if not fused_fake_quant_enabled() or x.numel() < _state["min_numel"] or x.numel() == 0:
        return None
    reason = _not_covered(x, spec, amax, global_amax)
    if reason is not None:
        _debug_once(reason)
        return None
    try:
        out = _fused(x, spec, amax)
    except _CompileFailed as err:  # answer with the reference, which raises its own error on bad input
        result = reference()
        _state["broken"] = True
        logger.warning(
            "fused fake quant: compiling %s %s failed (%s); the reference path runs for the rest of this "
            "process (set %s=0 to skip the attempt)",
            spec.name,
            spec.granularity,
            err,
            ENV_VAR,
        )
        return result
    if out is not None:
        _state["calls"] += 1
    return out
