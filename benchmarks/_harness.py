"""The one harness of the benchmark scripts (standard library; torch and transformers imported on use).

Each script imports it as a sibling module (``import _harness as h``: Python puts a script's own folder first
on ``sys.path``), also in children started under another interpreter (a peer library's virtualenv) from
another working directory. What it holds, so that no script writes it again:

* arguments: :func:`parser` (the description: the script's question), :func:`common` (``--threads``,
  ``--repeats``, ``--quick``, ``--seed``, ``--json`` / ``--md`` / ``--png``, ``--reference-python``),
  :func:`load_flags`, :func:`real_model_flags`, :func:`hidden` (a child's flags), :func:`csv`;
* setting up and models: :func:`pin_threads`, :func:`tiny_model`, :func:`random_batches`,
  :func:`cpu_training_args`;
* timing: :func:`time_calls`, :func:`time_interleaved`, :func:`time_stats`, :func:`pool`, :func:`ratio`,
  :class:`CpuMark` and :func:`wait_quiet` (load from other processes), :func:`timed_train_step`;
* memory (``/proc``): :func:`status_mb`, :func:`peak_rss_mb`, :func:`reset_peak_rss`, :func:`malloc_trim`;
* peers' virtualenvs: :func:`default_reference_python`, :func:`reference_usable`, :func:`borrow`,
  :func:`make_venv`;
* children: one ``@@RESULT <json>`` line (:func:`run_and_emit`, :func:`emit_result`, :func:`error_result`),
  read back by :func:`run_child`, :func:`parse_results`, :func:`run_child_when_quiet` (which reruns a child
  that other processes disturbed), with :func:`child_env`;
* output: :func:`write_json`, :func:`write_text`, :func:`table_head` / :func:`table_row`, :func:`pyplot` /
  :func:`save_figure`, :func:`run_meta`, :func:`command`, the ``fmt_*`` cells, :func:`print_failures`.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import ctypes.util
import glob
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The repository root, for the children's ``PYTHONPATH`` (they may run from another working directory).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The prefix of the one stdout line that carries a child's JSON result.
RESULT_PREFIX = "@@RESULT "


# ------------------------------------------------------------------------------------------- arguments


def parser(doc: str | None, *, full: bool = False) -> argparse.ArgumentParser:
    """A script's parser: its description is the first line of ``doc`` (the question the script answers),
    or with ``full`` the whole docstring as written."""
    if full:
        return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)


def _help_default(value: Any, default_help: str) -> tuple[Any, str]:
    """``value`` or ``(value, help)`` -> ``(value, help)``."""
    return value if isinstance(value, tuple) else (value, default_help)


def common(
    p: argparse.ArgumentParser, *, threads: Any = None, repeats: Any = None, quick: str | None = None,
    seed: int | None = None, json: str | None = None, md: str | None = None, png: str | None = None,
    reference: str | None = None,
) -> argparse.ArgumentParser:  # fmt: skip
    """The flags the scripts share, each added when its argument is not None: ``--threads N`` (a list: one
    or more thread counts), ``--repeats N``, ``--quick`` (``quick`` is its help: what the smoke run cuts),
    ``--seed N``, ``--json`` / ``--md`` / ``--png F`` (the argument is the help), ``--reference-python PY``
    (default ``$MODELOPT_REFERENCE_PYTHON``). ``threads`` and ``repeats`` take ``(default, help)`` too."""
    if threads is not None:
        value, text = _help_default(threads, "torch / OpenMP threads of each measuring process")
        many = isinstance(value, list)
        p.add_argument("--threads", type=int, default=value, help=text, **({"nargs": "+"} if many else {}))
    if repeats is not None:
        value, text = _help_default(repeats, "timed repeats (min and median reported)")
        p.add_argument("--repeats", type=int, default=value, help=text)
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    if seed is not None:
        p.add_argument("--seed", type=int, default=seed)
    for flag, text in (("--json", json), ("--md", md), ("--png", png)):
        if text is not None:
            p.add_argument(flag, metavar="F", help=text)
    if reference is not None:
        text = f"{reference} (default ${REFERENCE_PYTHON_ENV})"
        p.add_argument("--reference-python", metavar="PY", default=default_reference_python(), help=text)
    return p


def load_flags(
    p: argparse.ArgumentParser, *, max_wait: float | None = None, retries: Any = None,
    mmap_threshold: str | None = None, max_other: float | None = 0.25,
) -> argparse.ArgumentParser:  # fmt: skip
    """Flags of the scripts that guard their timings against other processes: ``--max-other-load`` (rerun
    or flag a run during which other processes kept more cores busy), ``--max-wait`` (s to wait for a quiet
    machine per run), ``--retries`` and ``--mmap-threshold`` (``MALLOC_MMAP_THRESHOLD_`` of the children,
    131072 by default; ``mmap_threshold`` names them), each when its argument is not None."""
    text = "rerun (or flag) a run during which other processes kept more than this many cores busy"
    p.add_argument("--max-other-load", type=float, default=max_other, help=text)
    if max_wait is not None:
        text = "s to wait for a quiet machine per run"
        p.add_argument("--max-wait", type=float, default=max_wait, help=text)
    if retries is not None:
        value, text = _help_default(retries, "reruns of a disturbed child")
        p.add_argument("--retries", type=int, default=value, help=text)
    if mmap_threshold is not None:
        text = f"MALLOC_MMAP_THRESHOLD_ for {mmap_threshold} (0: glibc's dynamic default)"
        p.add_argument("--mmap-threshold", type=int, default=131072, help=text)
    return p


def real_model_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A real pretrained model and its windows: ``--model``, ``--model-dir``, ``--calib-size``,
    ``--calib-seq``, ``--batch-size``, ``--eval-seq``."""
    p.add_argument("--model", default="smollm2-135m", help="a real model of modelopt_lite.models.REAL_MODELS")
    p.add_argument("--model-dir", help="a Hugging Face checkpoint folder instead of --model")
    p.add_argument("--calib-size", type=int, default=32)
    p.add_argument("--calib-seq", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4, help="calibration and evaluation batch")
    p.add_argument("--eval-seq", type=int, default=512)
    return p


def hidden(p: argparse.ArgumentParser, *, child: Sequence[str] | None = None, **flags: Any) -> None:
    """Flags only the parent passes to a child of the same script (hidden from ``--help``): ``--child``
    (``child``: its choices, or ``()`` for any value) and ``--NAME`` of type ``flags[NAME]`` (``str``,
    ``int``; underscores become dashes)."""
    if child is not None:
        p.add_argument("--child", choices=list(child) or None, help=argparse.SUPPRESS)
    for name, kind in flags.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, help=argparse.SUPPRESS)


def csv(text: str) -> list[str]:
    """The items of a comma-separated flag, blanks dropped."""
    return [t.strip() for t in text.split(",") if t.strip()]


# ---------------------------------------------------------------------------------- setting up, building


def pin_threads(threads: int, seed: int | None = 0) -> None:
    """``threads`` OpenMP / MKL / torch threads (the environment first, for a torch not loaded yet), offline
    and quiet transformers, and ``torch.manual_seed(seed)`` unless ``seed`` is None."""
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    torch.set_num_threads(threads)
    if seed is not None:
        torch.manual_seed(seed)


def tiny_model(arch: str = "Llama", seed: int | None = 0, **config: Any) -> Any:
    """``transformers``' ``{arch}ForCausalLM`` from ``{arch}Config(**config)`` (``Llama``, ``Qwen3Moe``),
    its weights drawn after ``torch.manual_seed(seed)`` (None: the generator as it is), in float32."""
    import torch
    import transformers

    cfg = getattr(transformers, f"{arch}Config")(**config)
    if seed is not None:
        torch.manual_seed(seed)
    return getattr(transformers, f"{arch}ForCausalLM")(cfg).float()


def cpu_training_args(output_dir: str, steps: int, batch: int, lr: float, checkpointing: bool = False) -> Any:
    """The ``transformers.TrainingArguments`` of the step benchmarks: ``steps`` optimizer steps of ``batch``
    samples at ``lr`` (AdamW, linear schedule), on the CPU, seed 0, logging every step, no saving, no
    reporting, no progress bar, no data-loader workers; ``checkpointing``: activation (gradient)
    checkpointing of the blocks, non-reentrant. It is given when the arguments are built: transformers 5.25
    resolves ``gradient_checkpointing`` into ``activation_checkpointing`` then, and setting either attribute
    afterwards changes nothing (it silently did so for ``lora_memory.py --gradient-checkpointing``)."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    extra = {name: True, f"{name}_kwargs": {"use_reentrant": False}} if checkpointing else {}
    return TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch, learning_rate=lr,
        report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, seed=0, disable_tqdm=True,
        dataloader_num_workers=0, **extra,
    )  # fmt: skip


def fsdp2_on_cpu(base: type) -> type:
    """``base`` (``QATTrainer``, ``QADTrainer``) with FSDP2 put back after accelerate built its accelerator:
    on CPU accelerate silently makes FSDP into DDP (the library warns), so the 2-process benchmarks and tests
    that measure FSDP2 with gloo install it themselves (auto-wrap of ``LlamaDecoderLayer``, sharded
    checkpoints). Benchmark and test code only; the library patches nothing."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    class FSDP2OnCPU(base):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
                fsdp_version=2,
                auto_wrap_policy="transformer_based_wrap",
                transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                state_dict_type="SHARDED_STATE_DICT",
            )
            self.accelerator.state.distributed_type = DistributedType.FSDP
            self.is_fsdp_enabled = True

    FSDP2OnCPU.__name__ = FSDP2OnCPU.__qualname__ = f"{base.__name__}FSDP2OnCPU"
    return FSDP2OnCPU


def random_batches(count: int, shape: tuple[int, ...], vocab: int, seed: int = 1234) -> list[Any]:
    """``count`` tensors of random token ids in ``[0, vocab)``, drawn in turn from one generator."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, shape, generator=gen) for _ in range(count)]


# ---------------------------------------------------------------------------------------------- timing


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[list[float], Any, float]:
    """``(seconds of each of repeats timed calls, the last output, seconds of the warmup untimed calls)``;
    ``time.perf_counter`` around each call."""
    start, out = time.perf_counter(), None
    for _ in range(warmup):
        out = fn()  # a compile or a kernel build happens here
    warm = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out, warm


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2) -> dict[str, list]:
    """The seconds of ``repeats`` calls of each function, interleaved (one call of each per round, after
    ``warmup`` untimed calls of each), so that a burst of load on a shared machine hits every one alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def ratio(slow: dict, fast: dict) -> dict[str, float]:
    """``slow`` / ``fast`` of two :func:`time_stats` dicts, from the medians and from the mins."""
    return {"median": slow["median_s"] / fast["median_s"], "min": slow["min_s"] / fast["min_s"]}


# ------------------------------------------------------------------------------------- load from others


#: The interpreters (virtualenvs) of nvidia-modelopt and torchao when ``--reference-python`` /
#: ``--torchao-python`` are not given; without either, that side is skipped.
REFERENCE_PYTHON_ENV, TORCHAO_PYTHON_ENV = "MODELOPT_REFERENCE_PYTHON", "TORCHAO_PYTHON"


def default_reference_python(env: str = REFERENCE_PYTHON_ENV) -> str | None:
    """``$MODELOPT_REFERENCE_PYTHON`` (or ``$env``; ``None`` when unset or empty)."""
    return os.environ.get(env) or None


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


def peak_rss_mb() -> int | None:
    """This process's peak RSS (``VmHWM``) in whole MB, or None without ``/proc``."""
    try:
        return round(status_mb("VmHWM"))
    except (OSError, KeyError):
        return None


def malloc_trim() -> None:
    """Return the heap's free memory to the system (glibc ``malloc_trim(0)``; nothing elsewhere)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


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


# -------------------------------------------------------------------------------------- peer virtualenvs


def probe_error(python: str, code: str, extra_path: str | None = None) -> str | None:
    """None if ``code`` runs under ``python`` (only ``extra_path`` on ``PYTHONPATH``, from the interpreter's
    own folder), else the last line of its error."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    if extra_path:
        env["PYTHONPATH"] = extra_path
    cmd = [python, "-c", code]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(python) or None, env=env)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["unknown error"])[-1]


def reference_usable(python: str | None, module: str = "modelopt.torch.quantization") -> tuple[bool, str]:
    """(whether ``python`` imports ``module``, why not)."""
    if not python:
        return False, no_reference_python()
    if not os.path.exists(python):
        return False, f"{python} does not exist"
    err = probe_error(python, f"import {module}")
    return (True, "") if err is None else (False, f"`import {module}` failed: {err}")


def borrow(python: str, probe: str = "import transformers") -> tuple[str | None, list[str], str | None]:
    """Lend ``python`` (a peer's interpreter, same Python and torch build) whichever of this interpreter's
    packages it lacks to run ``probe``: a folder of symlinks to them and their ``.dist-info`` (which
    transformers' version checks read), for the peer child's ``PYTHONPATH``, removed at exit (never what
    the links point to). Returns (folder or None when nothing was missing, borrowed names, the error that
    remains or None)."""
    if probe_error(python, probe) is None:
        return None, [], None
    shim = tempfile.mkdtemp(prefix="bench_shim_")
    atexit.register(shutil.rmtree, shim, True)
    dists = importlib.metadata.packages_distributions()
    borrowed: list[str] = []
    err = None
    for _ in range(30):
        err = probe_error(python, probe, shim)
        if err is None:
            return shim, borrowed, None
        missing = re.search(r"No module named '([^'.]+)", err) or re.search(
            r"The '([A-Za-z0-9_.\-]+?)(?:[<>=!~ ].*)?' distribution was not found", err
        )
        name = missing.group(1).replace("-", "_") if missing else None
        spec = importlib.util.find_spec(name) if name else None
        if spec is None or not spec.origin or name in borrowed:
            break
        src = os.path.dirname(spec.origin) if spec.submodule_search_locations else spec.origin
        os.symlink(src, os.path.join(shim, os.path.basename(src)))
        site = os.path.dirname(src)
        for dist in dists.get(name, []):
            for info in glob.glob(os.path.join(site, f"{dist.replace('-', '_')}-*.dist-info")):
                target = os.path.join(shim, os.path.basename(info))
                if not os.path.exists(target):
                    os.symlink(info, target)
        borrowed.append(name)
    return shim, borrowed, err


def make_venv(path: str | os.PathLike[str], *installs: Sequence[str], log: str | None = None) -> str:
    """Create (or reuse) a virtualenv at ``path`` and ``pip install`` each of ``installs`` in turn (the
    first pins what the later ones must keep, e.g. this interpreter's torch); pip's output goes to ``log``
    (appended) or to this terminal. Exits with the failing command. Returns the venv's interpreter."""
    python = os.path.join(os.path.abspath(path), "bin", "python")
    steps = [[python, "-m", "pip", "install", *packages] for packages in installs]
    if not os.path.exists(python):
        steps.insert(0, [sys.executable, "-m", "venv", str(path)])
    for cmd in steps:
        print(f"venv {path}: {' '.join(cmd[3:])}" + (f" (log: {log})" if log else ""), file=sys.stderr)
        with open(log, "a") if log and os.path.isdir(path) else open(os.devnull, "w") as out:
            proc = subprocess.run(cmd, stdout=out if log else None, stderr=subprocess.STDOUT if log else None)
        if proc.returncode:
            sys.exit(f"`{' '.join(cmd)}` failed (exit {proc.returncode})" + (f"; see {log}" if log else ""))
    return python


# ----------------------------------------------------------------------------- child-process protocol


def emit_result(result: dict, prefix: str = RESULT_PREFIX) -> None:
    """Print ``result`` as one line of the child's protocol (``@@RESULT`` unless ``prefix`` says)."""
    print(prefix + json.dumps(result), flush=True)


def error_text(err: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters."""
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first}"[:limit]


def error_result(err: BaseException, limit: int = 200) -> dict:
    """``{"error": "Type: first line of the message", "traceback": ...}`` for an exception being handled
    (call it inside the ``except`` block); the error string is cut to ``limit`` characters."""
    return {"error": error_text(err, limit), "traceback": traceback.format_exc()}


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


def parse_results(stdout: str, prefix: str = RESULT_PREFIX) -> list[dict]:
    """Every ``@@RESULT`` line (or ``prefix`` line) of a child's stdout, decoded, in order."""
    return [json.loads(ln[len(prefix) :]) for ln in stdout.splitlines() if ln.startswith(prefix)]


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


# ---------------------------------------------------------------------------------------------- output


def print_failures(results: Iterable[tuple[str, dict | None]]) -> None:
    """After the tables: the traceback (else the error) of every entry that failed."""
    for name, res in results:
        if res is not None and "error" in res:
            print(f"\n{name} failed:\n{res.get('traceback') or res['error']}")


def log(text: str) -> None:
    """A progress line on stderr (stdout carries a child's result)."""
    print(text, file=sys.stderr, flush=True)


def write_json(path: str | os.PathLike[str] | None, obj: Any, indent: int = 1, **kw: Any) -> None:
    """``obj`` as JSON in ``path`` (nothing without a path); ``kw`` goes to ``json.dumps``."""
    if path:
        Path(path).write_text(json.dumps(obj, indent=indent, **kw) + "\n")


def write_text(path: str | os.PathLike[str] | None, text: str) -> None:
    """``text`` in ``path`` with a final newline (nothing without a path)."""
    if path:
        Path(path).write_text(text.rstrip("\n") + "\n")


def table_head(header: str) -> str:
    """A markdown table's header line ``| a | b |`` and its rule ``|---|---|``."""
    return header + "\n|" + "---|" * (header.count("|") - 1)


def table_row(*cells: Any) -> str:
    """``| a | b |``: one line of a markdown table."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str, dpi: int = 110) -> None:
    """Lay out ``fig``, write it to ``path`` and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def run_meta(script: str, argv: Sequence[str] | None, wall: float) -> dict[str, Any]:
    """What a result file says of its run: ``command``, ``date``, the ``torch`` and ``transformers``
    versions and ``wall_seconds``."""
    import torch
    import transformers

    return {
        "command": command(script, argv), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "transformers": transformers.__version__, "wall_seconds": round(wall, 1),
    }  # fmt: skip


def command(script: str, argv: Sequence[str] | None) -> str:
    """The command line of this run as ``python benchmarks/<script> ...`` (``argv``: None for sys.argv),
    each absolute path outside the repository written ``<outside>/NAME``: result files are committed, and
    the directories of the machine that made them are not theirs to record."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", f"benchmarks/{os.path.basename(script)}", *map(portable_arg, args)])


def portable_arg(arg: str) -> str:
    """``arg`` (or the value of ``--flag=arg``) as :func:`command` records it."""
    flag, eq, value = arg.partition("=") if arg.startswith("-") and "=" in arg else ("", "", arg)
    if os.path.isabs(value) and not Path(value).resolve().is_relative_to(Path(REPO_ROOT).resolve()):
        value = f"<outside>/{os.path.basename(value.rstrip('/'))}"
    return flag + eq + value


_MACHINE_PATH = re.compile(r"(?<![\w.<>-])/(?:tmp|work|root|home|Users)/[^\s\"'\\]*")


def portable_text(text: str) -> str:
    """``text`` (an error message, a traceback) with each absolute path of the machine written as
    :func:`command` writes one: relative inside the repository, ``<site-packages>/...`` for an installed
    package, else ``<outside>/NAME``."""

    root = str(Path(REPO_ROOT).resolve()) + "/"
    # the checkout may live anywhere (CI's is under no root _MACHINE_PATH knows): its own paths first
    text = re.sub(r"(?<![\w.<>-])" + re.escape(root), "", text)

    def one(match: re.Match[str]) -> str:
        path = match.group(0)
        if "site-packages/" in path:
            return "<site-packages>/" + path.split("site-packages/", 1)[1]
        return f"<outside>/{os.path.basename(path.rstrip('/'))}"

    return _MACHINE_PATH.sub(one, text)


def time_stats(seconds: Iterable[float]) -> dict[str, float]:
    """``{"median_s": ..., "min_s": ...}`` of some timings."""
    values = list(seconds)
    return {"median_s": statistics.median(values), "min_s": min(values)}


def run_modes(
    modes: Sequence[str], repeats: int, run: Callable[[str], dict], line: Callable[[str, dict], str]
) -> dict[str, dict]:
    """``{mode: {"runs": [...]}}`` of ``repeats`` rounds of ``run(mode)`` (a fresh child per call), the modes
    interleaved so that drift hits every mode alike; a mode whose child fails records ``error`` /
    ``traceback`` and is not run again. Prints ``line(mode, result)`` per run."""
    results: dict[str, dict] = {mode: {"runs": []} for mode in modes}
    for _ in range(repeats):
        for mode in modes:
            out = results[mode]
            if "error" in out:
                continue
            res = run(mode)
            if "error" in res:
                print(f"  {mode}: failed: {res['error']}", flush=True)
                out.update(error=res["error"], traceback=res.get("traceback"))
                continue
            print(line(mode, res), flush=True)
            out["runs"].append(res)
    return results


def pool(results: dict[str, dict], seconds: Callable[[dict], Iterable[float]], **medians: Callable) -> None:
    """Summarize each entry of ``results`` that did not fail (``{"runs": [...]}``, no ``error``): the
    :func:`time_stats` of ``seconds(run)`` over all its runs, ``loaded_runs`` (runs flagged ``loaded``) and,
    per keyword, the median over its runs of ``medians[key](run)``."""
    for out in results.values():
        if "error" not in out:
            runs = out["runs"]
            out.update(
                time_stats(t for r in runs for t in seconds(r)), loaded_runs=sum(r["loaded"] for r in runs)
            )
            out.update({key: statistics.median(f(r) for r in runs) for key, f in medians.items()})


def fmt_cell(m: dict | None, spec: str = ".3f", limit: int | None = None) -> str:
    """A table cell of a :func:`time_stats` dict: ``median (min)``; ``skipped`` for None, ``> N (stopped)``
    for a child stopped at its timeout, ``n/a (reason: ...)`` (the reason cut to ``limit``) for an error."""
    if m is None:
        return "skipped"
    if "timed_out_s" in m:
        return f"> {m['timed_out_s']:.0f} (stopped)"
    if "error" in m:
        return f"n/a (reason: {m['error'][:limit]})"
    return fmt_median_min(m, spec)


def fmt_median_min(m: dict, spec: str = ".3f") -> str:
    """``"median (min)"`` of a :func:`time_stats` dict, both formatted with ``spec``."""
    return f"{format(m['median_s'], spec)} ({format(m['min_s'], spec)})"


def fmt_ratio(a: dict, b: dict) -> str:
    """``"median ratio x (min ratio x)"`` of two :func:`time_stats` dicts, ``a`` / ``b``."""
    r = ratio(a, b)
    return f"{r['median']:.2f}x ({r['min']:.2f}x)"


def fmt_or_na(x: float | None, spec: str = ".3f", na: str = "n/a") -> str:
    """``x`` formatted with ``spec``, or ``na`` for None (or a NaN)."""
    return na if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def aq_budget(model: Any) -> Any:
    """``bits -> auto_quantize's effective_bits``: ``bits`` per weight of the decoder's linear layers, with
    ``lm_head`` disabled (unquantized, as in the presets), which auto_quantize's budget counts at 16 bits (as
    the reference's does); ``lm_head`` holds a fifth of SmolLM2-135M's searched weights, so without this
    translation no budget under 6.9 bits would be reachable."""
    from torch import nn

    head = model.get_output_embeddings()
    layers = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    n_head = head.weight.numel()
    return lambda bits: (layers * bits + n_head * 16) / (layers + n_head) + 1e-9
