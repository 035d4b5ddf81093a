"""``benchmarks/moe.py``'s summary of the QAT step ratios (issue 17): the reference's (or our eager) step
over ours, from the medians and from the mins, and no figure when a side failed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import moe  # the benchmark script, importable without torch


def test_speedup_divides_medians_and_mins_separately():
    slow = {"median_s": 9.0, "min_s": 6.0}
    fast = {"median_s": 0.75, "min_s": 0.8}
    assert moe.speedup(slow, fast) == pytest.approx({"median": 12.0, "min": 7.5})


@pytest.mark.parametrize("failed", ["slow", "fast"])
def test_speedup_is_none_when_a_side_failed(failed):
    ok = {"median_s": 1.0, "min_s": 1.0}
    err = {"error": "ImportError: no modelopt"}
    sides = (err, ok) if failed == "slow" else (ok, err)
    assert moe.speedup(*sides) is None


def test_speedup_line_verdict_follows_the_median():
    met = moe.speedup_line("ref / ours", {"median": 10.5, "min": 9.25}, 10)
    assert met == "ref / ours: 10.50x from medians, 9.25x from mins (target >= 10x: met)"
    missed = moe.speedup_line("ref / ours", {"median": 9.99, "min": 12.0}, 10)
    assert missed.endswith("(target >= 10x: NOT met)")
    assert "9.99x from medians, 12.00x from mins" in missed


def test_speedup_line_without_a_ratio_prints_no_figure():
    line = moe.speedup_line("ref / ours", None, 10)
    assert line == "ref / ours: n/a (a side failed)"
    assert "x from" not in line
