"""MallocPolicy: glibc's mmap / trim thresholds raised between apply() and close(), set back to the dynamic
threshold's ceiling after; a no-op without glibc, when disabled, and when the user set the allocator."""

import ctypes
import logging
import os
import subprocess
import sys

import pytest

from modelopt_lite import allocator
from modelopt_lite.allocator import (
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    USER_ENV_VARS,
    MallocPolicy,
    dynamic_threshold_ceiling,
    malloc_tuned,
)


class FakeGlibc:
    """Records mallopt / malloc_trim calls; ``values`` is the allocator state they would leave."""

    def __init__(self, accept: bool = True):
        self.accept = accept
        self.values: dict[int, int] = {}
        self.calls: list[tuple[int, int]] = []
        self.trims = 0

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        if not self.accept:
            return 0
        self.values[param] = value
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.trims += 1
        return 1


class NoMallopt:
    """A C library without mallopt (musl's, macOS's)."""


@pytest.fixture(autouse=True)
def _no_user_setting(monkeypatch):
    for name in (*USER_ENV_VARS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)


def test_apply_raises_both_thresholds_and_close_sets_the_dynamic_ceiling():
    libc = FakeGlibc()
    policy = MallocPolicy(mmap_threshold=256 * 2**20, libc=libc)
    assert policy.apply() is True
    assert libc.values == {M_MMAP_THRESHOLD: 256 * 2**20, M_TRIM_THRESHOLD: 512 * 2**20}
    assert policy.state == "applied"
    assert policy.applied == {"M_MMAP_THRESHOLD": 256 * 2**20, "M_TRIM_THRESHOLD": 512 * 2**20}
    policy.close()
    mmap, trim = dynamic_threshold_ceiling()
    assert (mmap, trim) == (
        4 * 2**20 * ctypes.sizeof(ctypes.c_long),
        8 * 2**20 * ctypes.sizeof(ctypes.c_long),
    )
    assert libc.values == {M_MMAP_THRESHOLD: mmap, M_TRIM_THRESHOLD: trim}
    assert libc.trims == 1
    assert policy.state == "off"
    assert policy.applied == {}
    calls = len(libc.calls)
    policy.close()  # twice is harmless
    assert len(libc.calls) == calls
    assert libc.trims == 1


def test_trim_threshold_is_capped_at_int_max():
    libc = FakeGlibc()
    MallocPolicy(mmap_threshold=2**31 - 1, libc=libc).apply()
    assert libc.values[M_TRIM_THRESHOLD] == 2**31 - 1


def test_context_manager_restores_after_an_error(monkeypatch):
    libc = FakeGlibc()
    monkeypatch.setattr(allocator, "_load_glibc", lambda: libc)
    seen = {}

    def work():
        with malloc_tuned(mmap_threshold=2**20) as policy:
            seen.update(libc.values, policy=policy)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        work()
    policy = seen.pop("policy")
    assert seen == {M_MMAP_THRESHOLD: 2**20, M_TRIM_THRESHOLD: 2**21}
    assert policy.state == "off"
    assert libc.values[M_MMAP_THRESHOLD] == dynamic_threshold_ceiling()[0]
    assert libc.values[M_TRIM_THRESHOLD] == dynamic_threshold_ceiling()[1]


def test_disabled_does_nothing():
    libc = FakeGlibc()
    policy = MallocPolicy(enabled=False, libc=libc)
    assert policy.apply() is False
    policy.close()
    assert libc.calls == []
    assert libc.trims == 0
    assert policy.state == "off"


def test_without_mallopt_one_info_line_and_nothing_else(lib_caplog):
    lib_caplog.set_level(logging.INFO, logger="modelopt_lite")
    policy = MallocPolicy(libc=NoMallopt())
    assert policy.apply() is False
    policy.close()
    assert policy.state == "unsupported"
    lines = [r for r in lib_caplog.records if r.name == "modelopt_lite.allocator"]
    assert len(lines) == 1
    assert lines[0].levelno == logging.INFO
    assert "no glibc mallopt" in lines[0].getMessage()


@pytest.mark.parametrize(
    ("name", "value"),
    [("MALLOC_MMAP_THRESHOLD_", "65536"), ("MALLOC_TRIM_THRESHOLD_", "0"),
     ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")],
)  # fmt: skip
def test_a_user_environment_setting_is_kept(monkeypatch, lib_caplog, name, value):
    monkeypatch.setenv(name, value)
    lib_caplog.set_level(logging.INFO, logger="modelopt_lite")
    libc = FakeGlibc()
    policy = MallocPolicy(libc=libc)
    assert policy.apply() is False
    policy.close()
    assert libc.calls == []
    assert libc.trims == 0
    assert policy.state == "user_env"
    lines = [r.getMessage() for r in lib_caplog.records if r.name == "modelopt_lite.allocator"]
    assert len(lines) == 1
    assert f"{name}={value}" in lines[0]


def test_other_tunables_do_not_count_as_a_setting(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    libc = FakeGlibc()
    assert MallocPolicy(libc=libc).apply() is True


def test_a_refused_threshold_is_logged_and_not_restored(lib_caplog):
    lib_caplog.set_level(logging.INFO, logger="modelopt_lite")
    libc = FakeGlibc(accept=False)
    policy = MallocPolicy(libc=libc)
    assert policy.apply() is True
    assert policy.applied == {}
    assert sum("refused" in r.getMessage() for r in lib_caplog.records) == 2
    policy.close()
    assert len(libc.calls) == 2  # only apply()'s two attempts: nothing to restore


def test_bad_threshold_raises():
    for bad in (0, -1, 2**31, 1.5, True):
        with pytest.raises(ValueError, match="mmap_threshold"):
            MallocPolicy(mmap_threshold=bad)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _glibc_with_mallinfo2():
    libc = allocator._load_glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _is_mmapped(libc, size: int) -> bool:
    """Whether glibc serves a fresh ``size``-byte malloc with its own mmap (``mallinfo2().hblks`` grows)."""
    before = libc.mallinfo2().hblks
    ptr = libc.malloc(size)
    try:
        return libc.mallinfo2().hblks == before + 1
    finally:
        libc.free(ptr)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_real_glibc_serves_large_blocks_from_the_heap_while_applied():
    libc = _glibc_with_mallinfo2()
    size = 2 * dynamic_threshold_ceiling()[0]  # above anything the dynamic threshold reaches
    with malloc_tuned(mmap_threshold=4 * size) as policy:
        assert policy.state == "applied"
        assert not _is_mmapped(libc, size)
    assert _is_mmapped(libc, size)  # back at the ceiling: a block above it is mmapped again
    assert not _is_mmapped(libc, 1024)


_IMPORT_THEN_PROBE = """
import ctypes, sys
import modelopt_lite, modelopt_lite.allocator, modelopt_lite.training
sys.path.insert(0, sys.argv[1])
from test_allocator import _glibc_with_mallinfo2, _is_mmapped
print(_is_mmapped(_glibc_with_mallinfo2(), 64 * 2**20))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_importing_the_library_leaves_the_allocator_alone():
    _glibc_with_mallinfo2()  # skips without glibc >= 2.33
    env = {k: v for k, v in os.environ.items() if k not in (*USER_ENV_VARS, "GLIBC_TUNABLES")}
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_THEN_PROBE, here], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"  # 64 MiB above glibc's ceiling: still mmapped
