"""``benchmarks/real_levers.py --quick`` on a tiny tied Llama built in code: every lever's row is measured
(or records its error), the summary's ratios follow their definitions, --merge joins runs; and, where the
SmolLM2 package is installed, two levers on the real model with tiny windows."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_levers
from _models import VOCAB, word_tokenizer

from modelopt_lite.models import REAL_MODELS

SMOLLM2 = REAL_MODELS["smollm2-135m"]
try:
    importlib.metadata.distribution(SMOLLM2.distribution)
    HAS_SMOLLM2 = True
except importlib.metadata.PackageNotFoundError:
    HAS_SMOLLM2 = False


def _tiny_checkpoint(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    word_tokenizer().save_pretrained(path)


def test_quick_run_on_a_tiny_model(tmp_path: Path) -> None:
    _tiny_checkpoint(tmp_path / "m")
    has_mpl = importlib.util.find_spec("matplotlib") is not None  # the bench extra; CI has none
    out = {k: tmp_path / f"r.{k}" for k in ("json", "md", "png") if k != "png" or has_mpl}
    argv = [
        "--model-dir",
        str(tmp_path / "m"),
        "--quick",
        "--aq-bits",
        "4.5,5,6",
        "--workdir",
        str(tmp_path / "w"),
    ]
    assert real_levers.main([*argv, *[a for k, p in out.items() for a in (f"--{k}", str(p))]]) == 0
    result = json.loads(out["json"].read_text())
    rows = {r["name"]: r for r in result["rows"]}
    expected = [n for n in real_levers.LEVERS if n != "auto_quantize"] + ["aq_4.5", "aq_5", "aq_6"]
    assert sorted(rows) == sorted(expected)
    errors = {n: r["error"] for n, r in rows.items() if "error" in r}
    assert not errors, errors
    f_test = result["float"]["test"]["ppl"]
    m_test = rows["max"]["test"]["ppl"]
    for row in rows.values():
        assert math.isfinite(row["validation"]["ppl"])
        assert math.isfinite(row["test"]["ppl"])
        assert 0 < row["test"]["top1"] <= 1
        assert row["test"]["kl"] >= 0
        assert row["gap_removed"] == pytest.approx((m_test - row["test"]["ppl"]) / (m_test - f_test))
    assert rows["max"]["gap_removed"] == 0
    assert rows["max"]["test"]["kl"] > 0
    fp8 = rows["fp8"]["test"]["ppl"]
    assert rows["aq_5"]["excess_removed"] == pytest.approx(
        (m_test - rows["aq_5"]["test"]["ppl"]) / (m_test - fp8)
    )
    # 4.5 bits leaves every searched layer in NVFP4: the max-calibrated baseline's model
    assert rows["aq_4.5"]["test"]["ppl"] == pytest.approx(m_test, rel=1e-6)
    summary = result["summary"]
    best = rows[summary["best"]["name"]]
    w4a4 = [r for r in rows.values() if r["kind"] in ("w4a4", "baseline")]
    assert best["validation"]["ppl"] == min(r["validation"]["ppl"] for r in w4a4)
    assert summary["weight_only_share_of_gap"] == pytest.approx(
        (rows["weight_only"]["test"]["ppl"] - f_test) / (m_test - f_test)
    )
    assert "| AWQ lite" in out["md"].read_text()
    if has_mpl:
        assert out["png"].stat().st_size > 0
    # --merge joins two runs' rows (one protocol) and writes the same report
    part = tmp_path / "part.json"
    assert real_levers.main([*argv, "--levers", "fp8", "--json", str(part)]) == 0
    first = dict(result, rows=[r for r in result["rows"] if r["name"] != "fp8"])
    (tmp_path / "first.json").write_text(json.dumps(first))
    merged_path = tmp_path / "merged.json"
    assert (
        real_levers.main(["--merge", str(tmp_path / "first.json"), str(part), "--json", str(merged_path)])
        == 0
    )
    merged = json.loads(merged_path.read_text())
    assert [r["name"] for r in merged["rows"]] == [r["name"] for r in result["rows"]]


@pytest.mark.skipif(not HAS_SMOLLM2, reason=f"needs the SmolLM2 package: {SMOLLM2.install_command}")
def test_real_model_with_tiny_windows(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--quick", "--calib-size", "2", "--levers", "max,rotation", "--json", str(out)]
    assert real_levers.main(argv) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert all("error" not in r for r in rows.values()), rows
    assert rows["max"]["test"]["kl"] > 0
