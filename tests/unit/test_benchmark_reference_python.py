"""The side-by-side benchmarks take the reference interpreter (a virtualenv with nvidia-modelopt) from
``--reference-python`` or ``$MODELOPT_REFERENCE_PYTHON`` only, never from a path of one machine, and say how
to provide it when it is missing (issue 20)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _harness as h  # noqa: E402  (a sibling module of the benchmark scripts)


def test_no_benchmark_defaults_to_a_machine_path():
    for script in sorted(BENCHMARKS.glob("*.py")):
        lines = script.read_text().splitlines()
        code = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
        defaults = re.findall(r"default\s*=\s*[\"'](/[^\"']*)[\"']", code)
        assert not defaults, f"{script.name}: absolute default path(s) {defaults}"


def test_missing_reference_says_how_to_give_one():
    env = {k: v for k, v in os.environ.items() if k != h.REFERENCE_PYTHON_ENV}
    assert h.default_reference_python() is None or h.REFERENCE_PYTHON_ENV in os.environ
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "export_compat.py")], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "--reference-python" in proc.stderr
    assert "$MODELOPT_REFERENCE_PYTHON" in proc.stderr
    assert "peers.py --make-venvs" in proc.stderr


def test_the_environment_variable_is_the_default(monkeypatch):
    monkeypatch.setenv(h.REFERENCE_PYTHON_ENV, "/opt/ref/bin/python")
    assert h.default_reference_python() == "/opt/ref/bin/python"
    monkeypatch.setenv(h.REFERENCE_PYTHON_ENV, "")
    assert h.default_reference_python() is None


def test_a_child_past_its_timeout_is_stopped_and_says_so():
    """A reference calibration that takes far longer than ours must not hold a benchmark for an hour: the
    child is killed at ``timeout`` and the result says how long it was given (the table shows '> N')."""
    cmd = [sys.executable, "-c", "import time; time.sleep(30)"]
    res = h.run_child(cmd, dict(os.environ), timeout=0.5)
    assert res == {"error": "timed out after 0.5 s", "timed_out_s": 0.5}
    done = h.run_child([sys.executable, "-c", "print('@@RESULT {\"seconds\": 1.0}')"], dict(os.environ))
    assert done == {"seconds": 1.0}


def test_a_recorded_command_keeps_no_path_of_the_machine(tmp_path):
    inside = BENCHMARKS.parent / "docs" / "x.json"
    argv = ["--json", str(tmp_path / "run.json"), f"--torchao-python={tmp_path}/venv/bin/python"]
    argv += ["--md", str(inside), "--rows", "qad nvfp4", "--steps=16"]
    got = h.command("peers.py", argv)
    assert str(tmp_path) not in got
    assert got == (
        "python benchmarks/peers.py --json <outside>/run.json --torchao-python=<outside>/python "
        f"--md {inside} --rows qad nvfp4 --steps=16"
    )


def test_no_committed_result_file_records_a_path_of_the_machine():
    docs = BENCHMARKS.parent / "docs"
    for path in sorted(docs.glob("*.json")):
        found = re.findall(r"(?<![\w.<>-])/(?:tmp|work|root|home|Users)/[^\s\"]*", path.read_text())
        assert not found, f"{path.name}: {found[:3]}"


def test_an_error_text_keeps_no_path_of_the_machine():
    """Error texts and tracebacks that benchmarks store (a survivor's error, a failed resume's stderr) go
    through ``portable_text``: inside the repository relative, an installed package's file under
    ``<site-packages>/``, anything else ``<outside>/NAME``."""
    root = str(Path(h.REPO_ROOT).resolve())
    text = (
        f'File "{root}/modelopt_lite/training/callbacks.py", line 3\n'
        'File "/usr/lib/python3/site-packages/torch/nn/module.py", line 9\n'
        "[rank0]: RuntimeError: [/tmp/fsnap/gloo/pair.cc:537] reset; see /home/me/run/log.txt"
    )
    out = h.portable_text(text)
    assert 'File "modelopt_lite/training/callbacks.py"' in out
    assert 'File "/usr/lib/python3/site-packages/torch' in out  # (/usr is not a machine-private root)
    assert "[<outside>/pair.cc:537]" in out
    assert "see <outside>/log.txt" in out
    assert not re.findall(r"(?<![\w.<>-])/(?:tmp|work|root|home|Users)/[^\s\"]*", out)
    assert (
        h.portable_text(f"{root}/.venv/lib/python3.11/site-packages/x.py")
        == ".venv/lib/python3.11/site-packages/x.py"
    )
    assert h.portable_text("/root/venv/lib/site-packages/x.py") == "<site-packages>/x.py"


def test_an_error_text_keeps_no_path_of_a_checkout_under_any_root(monkeypatch):
    """CI clones the repository under a root the machine-path pattern does not know (``/check/...``)."""
    monkeypatch.setattr(h, "REPO_ROOT", "/check/work/main")
    out = h.portable_text('File "/check/work/main/modelopt_lite/x.py", line 3; not /check/work/mainly.py')
    assert out == 'File "modelopt_lite/x.py", line 3; not /check/work/mainly.py'
