"""Which architectures pass which jobs? The table of docs/coverage.md, generated from the tests.

    python benchmarks/coverage_table.py

runs ``tests/unit/test_architecture_coverage.py`` with pytest in this process (a small plugin collects each
test's outcome and the table cell it fills), then writes the table between ``<!-- coverage:begin -->`` and
``<!-- coverage:end -->`` in docs/coverage.md (one row per architecture, one column per job) and every
outcome to docs/coverage.json. A cell says what passed on the tiny model (``pass (tiny)``), what is refused by
design and why, what fails (a known bug: its reason; anything else: the error), and which real pretrained
model the architecture has also been checked on for that job (``REAL_CHECKS`` below: data, not measured
here). The exit status is 1 when a test failed unexpectedly (the files are written all the same).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import _harness as h

TEST_FILE = "tests/unit/test_architecture_coverage.py"
#: the test of the page itself, left out: it compares the page this run is about to rewrite
PAGE_TEST = f"{TEST_FILE}::test_the_coverage_page_lists_exactly_these_architectures_and_jobs"
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"

_EVERY_PTQ = ["ptq_fp8", "ptq_int8_sq", "ptq_int4_awq", "ptq_nvfp4", "ptq_w4a16_nvfp4", "ptq_mxfp8"]
#: Real pretrained models each architecture has been checked on, and for which jobs (the test file's job
#: names) -> what was run ("" : the column's job as it is). Data, not measured by this script: update it when
#: a real-model run is added. ``where``: the page that has the runs (markdown, relative to docs/).
REAL_CHECKS = {
    "llama": {
        "model": "smollm2-135m",
        "jobs": dict.fromkeys([*_EVERY_PTQ, "export", "reload", "qad"], ""),
        "what": "SmolLM2-135M-Instruct: every PTQ format, export and dequantized reload of each, QAD",
        "where": "[real_model.md](real_model.md#ptq-on-smollm2-135m), [real_qad.md](real_qad.md)",
    },
    "gemma3_text": {
        "model": "gemma3-270m",
        "jobs": {"ptq_nvfp4": "", "export": "nvfp4"},
        "what": "Gemma-3-270M: NVFP4 PTQ through `examples/llm_ptq/hf_ptq.py`, export",
        "where": "issue 41; the model: [models.md](models.md)",
    },
    "qwen2": {
        "model": "qwen2.5-coder-1.5b",
        "jobs": {"ptq_nvfp4": "", "ptq_fp8": "", "export": "nvfp4, fp8", "reload": "nvfp4, fp8"},
        "what": "Qwen2.5-Coder-1.5B-Instruct: NVFP4 and FP8 PTQ through `examples/llm_ptq/hf_ptq.py`, "
        "export and reload",
        "where": "issue 41; the model: [models.md](models.md)",
    },
}

#: outcome -> its words in a cell, in the order a cell lists them
LABELS = {
    "pass": "pass (tiny)",
    "refused": "refused",
    "skipped": "not run",
    "xfail": "FAILS (known bug)",
    "fail": "FAILS",
}


class Collector:
    """A pytest plugin: ``results[nodeid]`` = {arch, job, format, outcome, detail, seconds} of every test
    that recorded its cell (the test file's ``coverage`` property)."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report) -> None:
        props = dict(report.user_properties)
        if "coverage" not in props:
            return
        new = {**props["coverage"], "outcome": "pass", "seconds": 0.0}
        entry = self.results.setdefault(report.nodeid, new)
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        outcome, detail = _outcome(report, props)
        if outcome is None or entry.get("detail") is not None:  # the first phase that says something wins
            return
        entry["outcome"], entry["detail"] = outcome, detail
        if outcome == "xfail":
            entry["error"] = _short(_crash(report))


def _crash(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    return crash.message if crash is not None else str(report.longrepr)


def _outcome(report, props: dict) -> tuple[str | None, str | None]:
    """(outcome, detail) of one phase's report, (None, None) for a phase that passed quietly."""
    if report.skipped:
        if hasattr(report, "wasxfail"):
            return "xfail", report.wasxfail
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return "skipped", _short(reason.removeprefix("Skipped: "))
    if report.failed:
        return "fail", _short(_crash(report))
    if report.when == "call":
        return ("refused", props["refused"]) if "refused" in props else ("pass", None)
    return None, None


def _short(text: str, limit: int = 160) -> str:
    """One line, no path of this machine, at most ``limit`` characters."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = re.sub(r"(?<![\w.<>-])/(?:[^\s\"'/]+/)+", "<dir>/", line)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def real_label(arch: str, job: str) -> str | None:
    check = REAL_CHECKS.get(arch)
    if check is None or job not in check["jobs"]:
        return None
    note = check["jobs"][job]
    return f"real: {check['model']}" + (f", {note}" if note else "")


def render_cell(outcomes: list[dict], real: str | None = None) -> str:
    """The words of one cell from the outcomes of its tests (one per format, or one)."""
    if outcomes and all(o["outcome"] == "pass" for o in outcomes):
        return f"pass (tiny + {real})" if real else "pass (tiny)"
    parts = []
    for kind, label in LABELS.items():
        groups: dict[str | None, list[str]] = {}
        for o in outcomes:
            if o["outcome"] == kind:
                groups.setdefault(o.get("detail"), []).append(o.get("format") or "")
        for detail, formats in groups.items():
            named = ", ".join(f for f in formats if f) if len(formats) < len(outcomes) else ""
            text = f"{label}: {named}" if named else label
            if detail:
                text += f" ({detail})" if named else f": {detail}"
            parts.append(text)
    if real:
        parts.append(real)
    return "; ".join(parts).replace("|", "\\|") or "not run"


def build_table(results: list[dict]) -> tuple[list[str], list[str], dict[str, dict[str, str]]]:
    """(architectures, jobs, cells[arch][job]) in the tests' order."""
    archs = list(dict.fromkeys(r["arch"] for r in results))
    jobs = list(dict.fromkeys(r["job"] for r in results))
    jobs = [j for j in jobs if j.startswith("ptq_")] + [j for j in jobs if not j.startswith("ptq_")]
    cells: dict[str, dict[str, str]] = {a: {} for a in archs}
    for a in archs:
        for j in jobs:
            mine = [r for r in results if (r["arch"], r["job"]) == (a, j)]
            cells[a][j] = render_cell(mine, real_label(a, j))
    return archs, jobs, cells


def markdown(archs: list[str], jobs: list[str], cells: dict, meta: dict) -> str:
    counts = meta["counts"]
    lines = [
        f"Generated by `python benchmarks/coverage_table.py` on {meta['date']}: {sum(counts.values())} tests "
        f"({', '.join(f'{n} {k}' for k, n in counts.items())}) in {meta['tests_seconds']:.0f} s on "
        f"{meta['cpu_cores']} CPU cores ({meta['threads']} thread), torch {meta['torch']}, transformers "
        f"{meta['transformers']}.",
        "",
        h.table_head(h.table_row("architecture", *jobs)),
        *(h.table_row(f"`{a}`", *(cells[a][j] for j in jobs)) for a in archs),
        "",
        "Real models (the data in `benchmarks/coverage_table.py`, `REAL_CHECKS`):",
        "",
        *(f"- `{a}`, `{c['model']}`: {c['what']} ({c['where']})" for a, c in REAL_CHECKS.items()),
    ]
    return "\n".join(lines)


def replace_between_markers(text: str, block: str) -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"the page needs one {BEGIN} line and, after it, one {END} line")
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__)
    p.add_argument("--md", default="docs/coverage.md", help="the page whose marked table is rewritten")
    p.add_argument("--json", default="docs/coverage.json", help="every test's outcome")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads")
    args = p.parse_args(argv)
    os.chdir(h.REPO_ROOT)
    sys.path.insert(0, h.REPO_ROOT)  # this checkout's modelopt_lite, whatever is installed
    h.pin_threads(args.threads)
    import pytest

    collector = Collector()
    start = time.perf_counter()
    pytest_args = [TEST_FILE, "-q", "-p", "no:cacheprovider", "--deselect", PAGE_TEST]
    code = pytest.main(pytest_args, plugins=[collector])
    seconds = time.perf_counter() - start
    results = list(collector.results.values())
    if not results:
        print(f"pytest collected no coverage test (exit status {int(code)})", file=sys.stderr)
        return 2
    archs, jobs, cells = build_table(results)
    counts: dict[str, int] = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    meta = {
        **h.run_meta(__file__, argv, seconds), "cpu_cores": os.cpu_count(), "threads": args.threads,
        "tests_seconds": round(seconds, 1), "pytest_exit_status": int(code), "counts": counts,
    }  # fmt: skip
    page = Path(args.md)
    page.write_text(replace_between_markers(page.read_text(), markdown(archs, jobs, cells, meta)))
    h.write_json(args.json, {**meta, "architectures": archs, "jobs": jobs, "cells": cells,
                             "real_checks": REAL_CHECKS, "outcomes": results})  # fmt: skip
    print(markdown(archs, jobs, cells, meta))
    failed = [r for r in results if r["outcome"] == "fail"]
    for r in failed:
        print(f"FAILED: {r['arch']} {r['job']} {r['format'] or ''}: {r['detail']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
