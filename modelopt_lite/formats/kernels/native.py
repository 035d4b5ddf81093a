"""One-pass fake quant on CPU: small C kernels (``native_kernels.c``) built once per machine with the
system C compiler and loaded with :mod:`ctypes`, with the eager reference as fallback and oracle.

The eager formulas make 8-15 passes over a tensor (scale, exponent bits, round, clamp, rescale, ...); each
kernel makes one (NVFP4: one per block of 16, read twice from cache), computing every element with the
same float32 operations in the same order, so results equal the reference bit for bit (tested, with
hypothesis). The C file is compiled without fused multiply-add contraction and without fast-math; clamps
keep NaN as ``torch.clamp`` does. The kernels split the rows between OpenMP threads (the OpenMP runtime
PyTorch already loaded, as many threads as ``torch.get_num_threads()``) when a tensor has at least 64K
elements.

Covered (float32, bfloat16 or float16 input, contiguous, on the CPU, no autograd through the formula; a
bfloat16 tensor is read and written as bfloat16 in the same pass, a float16 one through a float32 copy):

- INT-k and FP8 (E4M3, E5M2) with one amax for the tensor, one per row of the first axis (per channel,
  ``axis=0``) or per index of the leading dimensions (one per expert, ``(E, 1, 1)``), a calibrated amax per
  block along the last axis, or each block's own amax (dynamic blocks, per token); a shorter last block
  included;
- NVFP4 with dynamic block scales and one global amax (calibrated, or taken from the input) or one per
  index of the leading dimensions (one per expert), when the last axis divides into blocks;
- MX (MXFP8, MXFP6, MXFP4, MXINT8) along the last axis.

Everything else (static NVFP4, per-channel on another axis or 2-D blocks, strided layouts) runs the
reference, with one DEBUG line per reason.

Build (:mod:`.native_build`): ``$CC`` (else ``cc``, ``gcc``, ``clang``) with ``-O3 -march=native
-ffp-contract=off`` and OpenMP (without it where the compiler lacks it), into
``$MODELOPT_LITE_CACHE/native/`` (default ``~/.cache/modelopt_lite/native/``), named by a hash of the
source, the compiler and the CPU, written to a temporary file and renamed into place (concurrent ranks build
it once each at worst, never half). A build takes about a second once per machine; later processes load the
file. A failed build (no compiler) or load logs one WARNING and the reference runs for the rest of the
process.

Controls: on by default; ``MODELOPT_LITE_NATIVE_FAKE_QUANT=0`` in the environment (read at the first call)
or :func:`set_native_fake_quant` (``False``) turns it off. :func:`native_call_count` counts the calls it
answered, so a test can tell when it silently fell back.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

import torch

from ...logging import get_logger
from ..fp8 import fp8_spec
from ..integer import check_unsigned, int_bounds
from ..mx import _element
from ..spec import FormatSpec
from .native_build import SIGNATURES, bf16_cast_check, compile_library, compiler, library_path

__all__ = [
    "ENV_VAR",
    "native_call_count",
    "native_fake_quant_enabled",
    "native_library_path",
    "set_native_fake_quant",
    "takes",
    "try_native_fake_quant",
]

logger = get_logger(__name__)

#: environment variable: ``0`` / ``false`` / ``off`` turns the native kernels off (default on)
ENV_VAR = "MODELOPT_LITE_NATIVE_FAKE_QUANT"
#: input dtypes the CPU kernel paths take (computed in float32, cast back)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the float32 chunk (elements) a bfloat16 kernel computes in (native_kernels.c's CHUNK): an NVFP4 or MX
#: block must fit in one
_CHUNK = 256

_lock = threading.Lock()
_state: dict = {"enabled": None, "lib": None, "broken": False, "calls": 0, "path": None, "nan16": None}
_logged_reasons: set[str] = set()


def set_native_fake_quant(enabled: bool | None = None) -> None:
    """Turn the native CPU kernels on or off for this process (``None``: leave as is). Turning them on
    again retries a build that failed."""
    if enabled is not None:
        _state["enabled"] = bool(enabled)
        if enabled:
            _state["broken"] = False


def native_fake_quant_enabled() -> bool:
    """Whether the native kernels are on (the environment variable decides until
    :func:`set_native_fake_quant`); a failed build turns them off for the process."""
    if _state["enabled"] is None:
        value = os.environ.get(ENV_VAR, "1").strip().lower()
        _state["enabled"] = value not in ("0", "false", "off", "no")
    return bool(_state["enabled"]) and not _state["broken"]


def native_call_count() -> int:
    """How many fake-quant calls the native kernels have answered in this process."""
    return _state["calls"]


def native_library_path() -> Path | None:
    """The shared library this process loaded (``None`` before the first call or after a failed build)."""
    return _state["path"]


# --------------------------------------------------------------------------- build and load
def _load() -> ctypes.CDLL:
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")
    target = library_path(cc)
    if not target.is_file():
        start = time.perf_counter()
        flags = compile_library(cc, target)
        logger.debug(
            "native fake quant: built %s with %s in %.2f s",
            target,
            " ".join(flags) or "no extra flags",
            time.perf_counter() - start,
        )
    lib = ctypes.CDLL(str(target))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    _state["path"] = target
    _state["nan16"] = bf16_cast_check(lib)
    logger.debug(
        "native fake quant: loaded %s (OpenMP: %s; bfloat16 in and out: %s)",
        target,
        bool(lib.mol_openmp()),
        _state["nan16"] is not None,
    )
    return lib


def _library() -> ctypes.CDLL | None:
    lib = _state["lib"]
    if lib is not None:
        return lib
    with _lock:
        if _state["lib"] is None and not _state["broken"]:
            try:
                _state["lib"] = _load()
            except Exception as err:  # no compiler, a failed build, a library that does not load
                _state["broken"] = True
                logger.warning(
                    "native fake quant: %s; the eager reference runs for the rest of this process (set %s=0 "
                    "to skip the attempt)",
                    err,
                    ENV_VAR,
                )
    return _state["lib"]


# --------------------------------------------------------------------------- dispatch
def _debug_once(reason: str) -> None:
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.debug("native fake quant: %s; the reference path runs", reason)


#: how the kernels index the amax (native_kernels.c): one, one per row, one per block along the rows, each
#: block's own
_AMAX_TENSOR, _AMAX_ROW, _AMAX_BLOCK, _AMAX_DYNAMIC = 0, 1, 2, 3


def _leading_rows(x: torch.Tensor, amax: torch.Tensor) -> int | None:
    """The number of rows when ``amax`` holds one value per index of ``x``'s leading dimensions and
    broadcasts over the rest (shape ``(*x.shape[:k], 1, ..., 1)``, e.g. one per expert ``(E, 1, 1)``)."""
    if amax.ndim != x.ndim:
        return None
    k = 0
    while k < x.ndim and amax.shape[k] == x.shape[k] and x.shape[k] != 1:
        k += 1
    if any(d != 1 for d in amax.shape[k:]):
        return None
    return amax.numel()


def _layout(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None) -> tuple[int, int, int, int] | str:
    """``(rows, cols, block, amax mode)`` of the kernel's view of ``x`` (NVFP4: ``(blocks, block, block,
    blocks per global amax)``), or why it is not covered."""
    cols = max(x.shape[-1] if x.ndim else 1, 1)
    if spec.kind == "nvfp4":
        block = spec.block_axes[0][1]
        if spec.static_nvfp4:
            return "static NVFP4 (calibrated block amax)"
        if x.ndim == 0 or cols % block:
            return "NVFP4 last axis not a whole number of blocks"
        blocks = x.numel() // block
        groups = 1 if amax is None or amax.numel() == 1 else _leading_rows(x, amax)
        if groups is None:
            return f"NVFP4 global amax {tuple(amax.shape)} not one per leading index"
        return blocks, block, block, blocks // groups
    if spec.kind == "mx":
        return x.numel() // cols, cols, spec.block_axes[0][1], 0
    if spec.kind not in ("int", "fp8"):
        return f"format {spec.name}"
    if spec.block_axes:
        ((axis, block),) = spec.block_axes if len(spec.block_axes) == 1 else ((None, 0),)
        if axis is None or axis % x.ndim != x.ndim - 1:
            return f"blocks {spec.granularity}"
        block = cols if block is None else block
        if spec.dynamic:
            return x.numel() // cols, cols, block, _AMAX_DYNAMIC
        if amax is None or amax.numel() != x.numel() // cols * -(-cols // block):
            return "no amax, or an amax per block of another count"  # the reference raises its own error
        return x.numel() // cols, cols, block, _AMAX_BLOCK
    if amax is None:
        return "no amax"
    if amax.numel() == 1:
        return x.numel() // cols, cols, cols, _AMAX_TENSOR
    rows = x.shape[0] if spec.axis in (0, -x.ndim) and amax.numel() == x.shape[0] else _leading_rows(x, amax)
    if rows is None:
        return f"amax {tuple(amax.shape)} on axis {spec.axis}"
    cols = x.numel() // rows
    return rows, cols, cols, _AMAX_ROW


def cpu_input_reason(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = DTYPES) -> str | None:
    """Why a CPU kernel path (native or fused) does not take ``x``: not on the CPU, a tensor subclass or
    another dtype; ``None`` when it is a plain CPU tensor of one of ``dtypes``."""
    if x.device.type != "cpu":
        return f"device {x.device.type}"
    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        return f"tensor subclass {type(x).__name__}"
    if x.dtype not in dtypes:
        return f"dtype {x.dtype}"
    return None


def _not_covered(x: torch.Tensor, spec: FormatSpec, amax, global_amax, autograd: bool = True) -> str | None:
    reason = cpu_input_reason(x)
    if reason is not None:
        return reason
    if not x.is_contiguous():
        return "strided input"
    if autograd and torch.is_grad_enabled() and x.requires_grad:
        return "autograd through the formula"
    for t in (amax, global_amax):
        if t is not None and (t.device.type != "cpu" or type(t) not in (torch.Tensor, torch.nn.Parameter)):
            return "amax not a plain CPU tensor"
    return None


def takes(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None) -> bool:
    """Whether a fake quant of ``x`` (autograd aside: the straight-through function calls the kernel with
    grad off) would run a native kernel, which writes into an ``out`` buffer for any layout it covers."""
    if x.numel() == 0 or not native_fake_quant_enabled() or _state["lib"] is None:
        return False
    return _not_covered(x, spec, amax, None, autograd=False) is None and not isinstance(
        _layout(x, spec, amax), str
    )


def try_native_fake_quant(
    x: torch.Tensor,
    spec: FormatSpec,
    amax: torch.Tensor | None,
    global_amax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The fake quant of ``x`` by a native kernel (no autograd), or ``None`` when the reference should
    answer instead (not covered, or the kernels are off or failed to build). ``out``: a contiguous float32
    tensor shaped like ``x`` to write the float32 result into; it is returned itself for a float32 ``x``."""
    if x.numel() == 0 or not native_fake_quant_enabled() or torch.compiler.is_compiling():
        return None
    reason = _not_covered(x, spec, amax, global_amax)
    layout = _layout(x, spec, amax) if reason is None else reason
    if isinstance(layout, str):
        _debug_once(layout)
        return None
    lib = _library()
    if lib is None:
        return None
    rows, cols, block, mode = layout
    if spec.kind == "int":
        check_unsigned(x, spec.unsigned)
    if spec.kind == "nvfp4" and amax is None:
        amax = x.detach().abs().amax()  # the reference's dynamic global amax
    if amax is not None:
        amax = amax.detach().to(dtype=torch.float32).contiguous()
    direct = x.dtype == torch.bfloat16 and x.ndim > 0 and _state["nan16"] is not None
    direct = direct and (spec.kind not in ("nvfp4", "mx") or block <= _CHUNK)
    nan16 = _state["nan16"] if direct else -1
    if direct:  # read and written as bfloat16 in one pass (``out`` is not needed)
        src, out = x.detach(), torch.empty(x.shape, dtype=torch.bfloat16)
    else:
        if out is None or out.shape != x.shape or out.dtype != torch.float32 or not out.is_contiguous():
            out = torch.empty(x.shape, dtype=torch.float32)
        src = x.detach() if x.dtype == torch.float32 else out.copy_(x.detach())
    threads = torch.get_num_threads()
    amax_ptr = None if amax is None else amax.data_ptr()
    if spec.kind == "nvfp4":
        lib.mol_nvfp4(src.data_ptr(), out.data_ptr(), rows, cols, amax_ptr, mode, threads, nan16)
    elif spec.kind == "mx":
        element = _element(spec.num_bits)
        if element is None:  # MXINT8
            lib.mol_mx(src.data_ptr(), out.data_ptr(), rows, cols, block, 0, -1, 0.0, 0, threads, nan16)
        else:
            lib.mol_mx(
                src.data_ptr(),
                out.data_ptr(),
                rows,
                cols,
                block,
                element.min_exp,
                element.man_bits,
                element.max_value,
                element.emax,
                threads,
                nan16,
            )
    elif spec.kind == "fp8":
        fmt, _ = fp8_spec(spec.num_bits)
        lib.mol_fp8(
            src.data_ptr(),
            out.data_ptr(),
            rows,
            cols,
            block,
            amax_ptr,
            mode,
            fmt.min_exp,
            fmt.man_bits,
            fmt.max_value,
            threads,
            nan16,
        )
    else:
        lo, hi = int_bounds(spec.num_bits, spec.unsigned, spec.narrow_range)
        lib.mol_int(src.data_ptr(), out.data_ptr(), rows, cols, block, amax_ptr, mode, lo, hi, threads, nan16)
    _state["calls"] += 1
    return out if out.dtype == x.dtype else out.to(x.dtype)
