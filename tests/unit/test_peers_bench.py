"""The pure parts of ``benchmarks/peers.py``: the data a peer's worker reads, and the recovery of its rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import accuracy
import peers


def test_export_data_round_trip(tmp_path: Path) -> None:
    """The worker rebuilds exactly the windows our rows use: training windows (same length, so the same
    shuffled order), calibration batches and evaluation windows."""
    g = torch.Generator().manual_seed(0)
    train_set = accuracy.TokenWindows(torch.randint(0, 100, (1000,), generator=g), 16)
    calib = list(torch.randint(0, 100, (6, 32), generator=g).split(accuracy.CALIB_BATCH))
    evals = {s: torch.randint(0, 100, (3, 32), generator=g) for s in ("validation", "test")}
    path = str(tmp_path / "data.safetensors")
    peers.export_data(path, evals, calib, train_set)

    data = load_file(path)
    rebuilt = accuracy.TokenWindows(data["train"].reshape(-1), data["train"].shape[1])  # as the worker does
    assert len(rebuilt) == len(train_set) == 62
    assert torch.equal(rebuilt.ids, train_set.ids)
    assert all(
        torch.equal(a, b) for a, b in zip(data["calib"].split(accuracy.CALIB_BATCH), calib, strict=True)
    )
    assert all(torch.equal(data[s], evals[s]) for s in evals)


def _row(library: str, method: str, fmt: str, ppl: float, kl: float = 0.0) -> dict:
    return {"library": library, "method": method, "format": fmt, "val_ppl": ppl, "test_ppl": ppl, "kl": kl}


def test_recovery_against_own_ptq_row() -> None:
    """QAT is measured against ``ft``, QAD against our unquantized model, each from its own library's PTQ
    row of the same format, also when ours and a peer ran separately and were merged."""
    ours = [
        _row("ours", "baseline", "", 100.0),
        _row("ours", "ft", "", 98.0),
        _row("ours", "ptq", "int4", 104.0, kl=0.01),
        _row("ours", "qat", "int4", 100.0, kl=0.02),
        _row("ours", "qad", "int4", 101.0, kl=0.004),
    ]
    peer = [
        _row("torchao", "baseline", "", 100.5),
        _row("torchao", "ptq", "int4", 102.0, kl=0.01),
        _row("torchao", "qat", "int4", 101.0, kl=0.01),
        _row("torchao", "qat", "fp8", 101.0),  # no PTQ row of its own: no recovery
    ]
    merged = peers.combine(
        [
            {"kind": "m", "seconds": 1.0, "peers": {}, "rows": ours},
            {"kind": "m", "seconds": 2.0, "peers": {}, "rows": peer},
        ]
    )
    assert len(merged) == 1
    assert merged[0]["seconds"] == 3.0
    rows = merged[0]["rows"]
    assert rows[3]["test_recovery"] == pytest.approx(4 / 6)  # (104 - 100) / (104 - 98)
    assert rows[4]["val_recovery"] == pytest.approx(3 / 4)  # (104 - 101) / (104 - 100): our baseline
    assert rows[4]["kl_recovery"] == pytest.approx(0.6)
    assert rows[7]["test_recovery"] == pytest.approx(1 / 4)  # (102 - 101) / (102 - 98)
    assert "test_recovery" not in rows[8]


def _acc_row(name: str, method: str, test_ppl: float, seed=None, steps=None, rec=None) -> dict:
    return {"name": name, "method": method, "val_ppl": test_ppl, "test_ppl": test_ppl, "kl": 0.0,
            "seed": seed, "steps": steps, "test_recovery": rec, "val_recovery": rec}  # fmt: skip


def test_accuracy_merge_combines_runs_of_one_model() -> None:
    """``accuracy.py --merge`` adds a later run's seeds of the same model (e.g. a longer budget) to the
    first run's rows, so the summary averages all of them; the shared PTQ rows must agree."""
    base = [_acc_row("unquantized", "baseline", 10.0), _acc_row("ptq nvfp4", "ptq", 11.0)]
    first = {"kind": "m", "rows": [*base, _acc_row("qad nvfp4", "qad", 10.2, 0, 800, 0.8)]}
    later = {"kind": "m", "rows": [*base, *(_acc_row("qad nvfp4", "qad", 10.1, s, 800, 0.9) for s in (1, 2))]}
    other = {"kind": "other", "rows": list(base)}
    merged = accuracy.merge_runs([{"models": [first, other]}, {"models": [later]}])
    assert [m["kind"] for m in merged] == ["m", "other"]
    line = next(s for s in accuracy.summarize(merged[0]) if s["name"] == "qad nvfp4")
    assert (line["seeds"], line["steps"]) == (3, 800)
    assert line["test_recovery"] == pytest.approx((0.8 + 0.9 + 0.9) / 3)
    assert line["test_recovery_range"] == [0.8, 0.9]
    assert sum(r["name"] == "ptq nvfp4" for r in merged[0]["rows"]) == 1
    changed = {"kind": "m", "rows": [_acc_row("ptq nvfp4", "ptq", 11.5)]}
    with pytest.raises(SystemExit, match="differs between runs"):
        accuracy.merge_runs([{"models": [dict(first, rows=list(first["rows"]))]}, {"models": [changed]}])
