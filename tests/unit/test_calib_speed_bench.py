"""``benchmarks/calib_speed.py --quick`` on a tiny Llama built in code: our side only (the reference needs
its own virtualenv); every row and forward ratio is measured and the JSON written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import calib_speed  # the benchmark script


def test_quick_run_measures_every_row_and_the_forward_ratios(tmp_path: Path) -> None:
    out_file = tmp_path / "out.json"
    rows = "smoothquant"
    out = calib_speed.main(
        ["--quick", "--no-reference", "--threads", "1", "--rows", rows, "--json", str(out_file)]
    )
    assert json.loads(out_file.read_text())["rows"].keys() == out["rows"].keys()
    assert list(out["rows"]) == ["smoothquant INT8"]
    for row in out["rows"].values():
        assert "ref" not in row
        assert row["ours"]["median_s"] > 0, row
    (forward,) = out["forward"].values()
    ours = forward["ours"]
    assert ours["unquantized"]["ratio"] == 1.0
    assert ours["calibration"]["ratio"] > 0
    assert ours["evaluation"]["ratio"] > 0
    assert ours["folded"]["ratio"] > 0  # the evaluation with the weights' fake quant folded in once
