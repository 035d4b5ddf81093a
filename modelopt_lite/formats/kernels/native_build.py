"""Building and loading the native fake-quant kernels (``native_kernels.c``) for :mod:`.native`: the system C
compiler, the library's cached path (a hash of the source, the compiler and the CPU), an atomic build that
tries flag sets in turn, the ctypes signatures, and the check of the kernels' bfloat16 cast against
PyTorch's."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..._cache import cache_base
from ...logging import get_logger

__all__ = ["SIGNATURES", "SOURCE", "bf16_cast_check", "compile_library", "compiler", "library_path"]

logger = get_logger(__name__)

SOURCE = Path(__file__).with_name("native_kernels.c")
_BASE_FLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared"]
#: flag sets tried in turn: the first that builds is used
_FLAG_SETS = (["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], [])

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # (the last argument of the kernels: -1 for float32 input and output, else bfloat16's NaN)
    "mol_fp8": [_P, _P, _I64, _I64, _I64, _P, _I32, _I32, _I32, _F32, _I32, _I32],
    "mol_int": [_P, _P, _I64, _I64, _I64, _P, _I32, _F32, _F32, _I32, _I32],
    "mol_nvfp4": [_P, _P, _I64, _I64, _P, _I64, _I32, _I32],
    "mol_mx": [_P, _P, _I64, _I64, _I64, _I32, _I32, _F32, _I32, _I32, _I32],
    "mol_bf16_narrow": [_P, _P, _I64, _I32],
}


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else the first of ``cc``, ``gcc``, ``clang`` on the PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name:
            path = shutil.which(name)
            if path:
                return path
    return None


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's feature flags where the OS lists them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def library_path(cc: str) -> Path:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cc.encode(), str(os.stat(cc).st_mtime_ns).encode()):
        digest.update(part)
    for part in (platform.machine(), platform.system(), _cpu_signature(), " ".join(_BASE_FLAGS)):
        digest.update(part.encode())
    return cache_base() / "native" / f"fake_quant-{digest.hexdigest()[:20]}.so"


def compile_library(cc: str, target: Path) -> list[str]:
    """Build ``target`` (atomically); returns the flags that worked. Raises ``RuntimeError`` with the
    compiler's last error when no flag set builds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    error = ""
    for extra in _FLAG_SETS:
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
        os.close(fd)
        cmd = [cc, *_BASE_FLAGS, *extra, str(SOURCE), "-o", tmp]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
            if run.returncode == 0:
                os.replace(tmp, target)
                return extra
            error = (run.stderr or run.stdout).strip().splitlines()[-1:] or [f"exit {run.returncode}"]
            error = error[0][:200]
        except (OSError, subprocess.TimeoutExpired) as err:
            error = f"{type(err).__name__}: {err}"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError(f"{cc} could not build {SOURCE.name}: {error}")


def bf16_cast_check(lib: ctypes.CDLL) -> int | None:
    """The bits PyTorch's float32 -> bfloat16 cast gives a NaN on this machine when the kernels' own cast
    (round to nearest even) equals PyTorch's on every probe value (NaNs of both signs and several payloads,
    infinities, subnormals, ties, the largest floats, random values); else ``None``, and bfloat16 tensors
    go through a float32 copy and PyTorch's cast, as float16 ones do."""
    special = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF, 0x7F800000, 0xFF800000,
               0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x807FFFFF, 0x00008000, 0x00018000, 0x3F808000,
               0x3F818000, 0x3F80FFFF, 0x7F7F8000, 0x00000000, 0x80000000]  # fmt: skip
    bits = torch.tensor(special, dtype=torch.int64).to(torch.int32)
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=g, dtype=torch.int64).to(torch.int32)
    probe = torch.cat([bits, noise, torch.randn(4096, generator=g).view(torch.int32)]).view(torch.float32)
    expected = probe.to(torch.bfloat16).view(torch.int16)
    nan16 = int(expected[0]) & 0xFFFF
    got = torch.empty_like(expected)
    lib.mol_bf16_narrow(probe.data_ptr(), got.data_ptr(), probe.numel(), nan16)
    if not torch.equal(got, expected):
        logger.debug("native fake quant: PyTorch's bfloat16 cast differs from the kernels' on this machine")
        return None
    return nan16
