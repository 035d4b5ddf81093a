"""Shared harness of the benchmark scripts (standard library only).

The scripts import it as a sibling module (``import _harness as h``): Python puts a script's own folder
first on ``sys.path``, so this works for ``python benchmarks/X.py`` from the repository root, for
``cd benchmarks && python X.py``, and in children that a script starts under another interpreter (the
nvidia-modelopt reference) from another working directory. It imports neither torch nor this library.

* Load from other processes: :func:`busy_cpu_seconds`, :class:`CpuMark` (the cores other processes kept
  busy over a stretch of time) and :func:`wait_quiet` (wait until they go quiet).
* Peak memory (Linux ``/proc``): :func:`status_mb`, :func:`reset_peak_rss`.
* The child-process protocol: a child prints its result as one line ``@@RESULT <json>``
  (:func:`emit_result`, :func:`run_and_emit`, :func:`error_result`); the parent starts it with
  :func:`child_env` and reads it back with :func:`run_child`, :func:`parse_results` or
  :func:`run_child_when_quiet` (which also reruns a child that other processes disturbed).
* Summaries: :func:`time_stats`, :func:`fmt_median_min`, :func:`fmt_or_na`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

#: The repository root, for the children's ``PYTHONPATH`` (they may run from another working directory).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The prefix of the one stdout line that carries a child's JSON result.
RESULT_PREFIX = "@@RESULT "


# ------------------------------------------------------------------------------------- load from others


#: The reference interpreter (a virtualenv with nvidia-modelopt) of the side-by-side benchmarks, when
#: ``--reference-python`` is not given; without either, the reference side is skipped.
REFERENCE_PYTHON_ENV = "MODELOPT_REFERENCE_PYTHON"


def default_reference_python() -> str | None:
    """``$MODELOPT_REFERENCE_PYTHON`` (``None`` when unset or empty)."""
    return os.environ.get(REFERENCE_PYTHON_ENV) or None


def no_reference_python(flag: str = "--reference-python", env: str = REFERENCE_PYTHON_ENV) -> str:
    """What to do when no reference interpreter was given (no machine has a default one)."""
    return (
        f"no reference interpreter: pass {flag} PATH/bin/python or set ${env} to the Python of a virtualenv "
        "with the peer library (python benchmarks/peers.py --make-venvs DIR creates them)"
    )


def busy_cpu_seconds() -> float | None:
    """Busy CPU seconds of the whole machine so far (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuMark:
    """A point in time: the machine's busy CPU seconds (None without /proc), this process's CPU time and
    the wall clock. ``CpuMark.now()`` before some work, ``mark.since()`` after it."""

    busy: float | None
    own: float
    wall: float

    @classmethod
    def now(cls) -> CpuMark:
        """The mark of this moment (the wall clock read last, right before the work)."""
        return cls(busy_cpu_seconds(), time.process_time(), time.perf_counter())

    def since(self) -> tuple[float, float]:
        """(Wall seconds since the mark, cores other processes kept busy meanwhile): the machine's busy CPU
        time less this process's own, per wall second; nan without /proc/stat."""
        seconds = time.perf_counter() - self.wall
        busy, own = busy_cpu_seconds(), time.process_time()
        if busy is None or self.busy is None:
            return seconds, float("nan")
        return seconds, max(0.0, (busy - self.busy - (own - self.own)) / seconds)


def timed_train_step(model: Any, opt: Any, ids: Any) -> tuple[float, float, float, float]:
    """One causal-LM training step on ``ids`` (labels = ids): forward, backward, ``opt.step()``,
    ``opt.zero_grad()``. Returns (wall seconds, cores other processes kept busy meanwhile, this process's CPU
    seconds, the loss)."""
    start = CpuMark.now()
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    seconds, others = start.since()
    return seconds, others, time.process_time() - start.own, loss.item()


def wait_quiet(max_other: float, max_wait: float) -> None:
    """Wait (at most ``max_wait`` s) until other processes keep <= ``max_other`` cores busy over 2 s."""
    deadline, said = time.monotonic() + max_wait, False
    while time.monotonic() < deadline:
        before = busy_cpu_seconds()
        time.sleep(2)
        after = busy_cpu_seconds()
        if before is None or after is None or (after - before) / 2 <= max_other:
            return
        if not said:
            print(f"  waiting for other processes to go quiet (up to {max_wait:.0f} s)", flush=True)
            said = True


# -------------------------------------------------------------------------------------------- memory


def status_mb(key: str) -> float:
    """A size field of ``/proc/self/status`` (e.g. ``VmRSS``, ``VmHWM``: the peak RSS) in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def reset_peak_rss(fallback: str) -> tuple[str, float]:
    """Reset the peak-RSS mark (VmHWM) to the current RSS by writing ``5`` to ``/proc/self/clear_refs``.

    Returns ``(method, baseline MB)`` for a later ``status_mb("VmHWM") - baseline``: ``("clear_refs",
    VmRSS)``, or, when the kernel refuses the reset, ``(fallback, VmHWM so far)`` -- a peak that already
    includes whatever ran before, which ``fallback`` should name."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return "clear_refs", status_mb("VmRSS")
    except OSError:
        return fallback, status_mb("VmHWM")


# ----------------------------------------------------------------------------- child-process protocol


def emit_result(result: dict) -> None:
    """Print ``result`` as the child's ``@@RESULT`` line."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def error_result(err: BaseException, limit: int = 200) -> dict:
    """``{"error": "Type: first line of the message", "traceback": ...}`` for an exception being handled
    (call it inside the ``except`` block); the error string is cut to ``limit`` characters."""
    first = (str(err).strip().splitlines() or [""])[0]
    return {"error": f"{type(err).__name__}: {first}"[:limit], "traceback": traceback.format_exc()}


def run_and_emit(work: Callable[[], dict], limit: int = 200) -> None:
    """A child's main: emit ``work()``'s result, or :func:`error_result` when it raises."""
    try:
        result = work()
    except Exception as err:
        result = error_result(err, limit)
    emit_result(result)


def child_env(
    threads: int, pythonpath: str | None = None, *, keep_pythonpath: bool = True, **extra: str
) -> dict[str, str]:
    """The environment of a child: this one with ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` = ``threads``,
    ``HF_HUB_OFFLINE=1``, then ``extra``, and ``TRANSFORMERS_VERBOSITY=error`` unless set by now.
    ``pythonpath`` goes first on ``PYTHONPATH``, before the inherited one unless ``keep_pythonpath`` is
    False (which drops the inherited one)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    env.update(extra)
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if not keep_pythonpath:
        env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    return env


def parse_results(stdout: str) -> list[dict]:
    """Every ``@@RESULT`` line of a child's stdout, decoded, in order."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    return [json.loads(ln[len(RESULT_PREFIX) :]) for ln in lines]


def crash_error(proc: subprocess.CompletedProcess, limit: int = 200) -> dict:
    """``{"error": "child exited N: <last stderr line>", "traceback": <stderr tail>}`` for a child that
    printed no result; the error string is cut to ``limit`` characters."""
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"child exited {proc.returncode}: {tail}"[:limit], "traceback": proc.stderr[-4000:]}


def run_child(
    cmd: Sequence[str],
    env: dict[str, str],
    cwd: str | None = None,
    limit: int = 200,
    timeout: float | None = None,
) -> dict:
    """Run a child to the end and return its last ``@@RESULT``, else :func:`crash_error`. A child still
    running after ``timeout`` seconds is killed: ``{"error": "timed out after N s", "timed_out_s": N}``."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s", "timed_out_s": timeout}
    results = parse_results(proc.stdout)
    return results[-1] if results else crash_error(proc, limit)


def run_child_when_quiet(
    cmd: Sequence[str],
    env: dict[str, str],
    *,
    max_other: float,
    max_wait: float,
    retries: int = 0,
    cwd: str | None = None,
    limit: int = 200,
    keep_least_disturbed: bool = False,
    on_result: Callable[[dict], None] | None = None,
    on_disturbed: Callable[[dict, bool], None] | None = None,
) -> dict:
    """Run a child after :func:`wait_quiet`; rerun it while other processes kept > ``max_other`` cores busy.

    The child reports those cores as ``other_cores_busy`` (none: 0); each result gets ``loaded`` = it was
    above ``max_other``. A crash or an ``error`` result is returned at once (without ``loaded``);
    ``on_result(res)`` sees every other try, ``on_disturbed(res, retrying)`` every disturbed one. When all
    ``retries + 1`` tries were disturbed, the last one is returned, or with ``keep_least_disturbed`` the
    least disturbed one."""
    best = None
    for attempt in range(retries + 1):
        wait_quiet(max_other, max_wait)
        res = run_child(cmd, env, cwd, limit)
        if "error" in res:
            return res
        res["loaded"] = bool(res.get("other_cores_busy", 0) > max_other)
        if on_result is not None:
            on_result(res)
        if not res["loaded"]:
            return res
        if best is None or not keep_least_disturbed or res["other_cores_busy"] < best["other_cores_busy"]:
            best = res
        if on_disturbed is not None:
            on_disturbed(res, attempt < retries)
    assert best is not None
    return best


# ------------------------------------------------------------------------------------------- summaries


def time_stats(seconds: Iterable[float]) -> dict[str, float]:
    """``{"median_s": ..., "min_s": ...}`` of some timings."""
    values = list(seconds)
    return {"median_s": statistics.median(values), "min_s": min(values)}


def fmt_median_min(m: dict, spec: str = ".3f") -> str:
    """``"median (min)"`` of a :func:`time_stats` dict, both formatted with ``spec``."""
    return f"{format(m['median_s'], spec)} ({format(m['min_s'], spec)})"


def fmt_or_na(x: float | None, spec: str = ".3f") -> str:
    """``x`` formatted with ``spec``, or ``n/a`` for None."""
    return "n/a" if x is None else format(x, spec)
