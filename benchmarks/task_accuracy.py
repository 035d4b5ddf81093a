"""Task accuracy (lm-evaluation-harness) of a real LLM: the float model, PTQ in each format, and QAD / QAT
checkpoints, on the same documents; the share of PTQ's accuracy drop that training wins back.

Published in ``docs/tasks.md`` ("Measured: formats and recipes"), for example:

    python examples/llm_qat/main.py --config examples/llm_qat/configs/smollm2_qad_nvfp4.yaml
    python benchmarks/task_accuracy.py --model smollm2-135m --limit 200 \\
        --trained "qad nvfp4=runs/smollm2_qad_nvfp4@nvfp4" --json tasks.json --md tasks.md --png tasks.png

One model in the process at a time, each row on its own float32 copy read from the checkpoint:

* ``float``: the model as loaded;
* one row per ``--formats`` name (``modelopt_lite.cli.ptq.QFORMATS``, KV cache unquantized): ``mtq.quantize``
  with ``build_config(name)`` on the first ``--calib-size`` windows of ``--calib-seq`` tokens of the default
  corpus' ``fit`` split (batches of ``--batch-size``; the defaults are the shipped QAD / QAT recipes'
  calibration, so a trained row's PTQ row is its starting point), then q/k/v and gate/up scales unified as
  the export does: the model that would be exported;
* one row per ``--reference-formats`` name: nvidia-modelopt's PTQ with the same preset on the same
  calibration batches, changed as its export changes the model, scored by the same lm-eval, configs,
  documents and batch size (``_task_accuracy_peer.py`` under ``--reference-python``, a virtualenv with
  nvidia-modelopt and lm-eval: ``python benchmarks/peers.py --make-venvs DIR``, then
  ``DIR/modelopt/bin/python -m pip install lm_eval==<ours>``); named ``<format> (modelopt)``;
* one row per ``--trained NAME=DIR@FORMAT``: a directory saved by ``QADTrainer`` / ``QATTrainer``
  (``examples/llm_qat/main.py`` writes one to its ``output_dir``), loaded with
  ``mto.enable_huggingface_checkpointing()`` (its quantizers and amax restored, not recalibrated); ``FORMAT``
  names the PTQ row it started from.

Each row runs ``modelopt_lite.evaluation.evaluate_tasks`` on ``--tasks`` (0-shot, MMLU ``--num-fewshot``;
``--limit``: the first N
documents of each task, the same for every row). The headline metric of a task is lm-eval's ``acc_norm``
where the task has it (HellaSwag, PIQA, ARC), else ``acc`` (WinoGrande, BoolQ, LAMBADA, MMLU); ``mean`` is
their mean over the tasks. A PTQ row's ``drop`` is ``mean_float - mean_row``; a trained row's
``recovered`` is ``(mean_row - mean_ptq) / (mean_float - mean_ptq)`` against its ``FORMAT`` row (none when
PTQ lost under one standard error of the mean: nothing to win back), given per task too. ``--json`` is
rewritten after every row; ``--report F`` rebuilds the tables and figure from such a file, ``--merge F ...``
from several (for example a trained row measured later, beside the PTQ rows of an earlier run).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h
import _real_ptq_peer as peer

TASKS = ("hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande", "boolq", "lambada_openai")
FORMATS = ("fp8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4", "nvfp4_awq", "w4a16_nvfp4", "mxfp8")
REFERENCE_ON_CPU = ("fp8", "int8_sq", "int4_awq", "w4a8_awq")  # its NVFP4 / MX presets need CUDA
WORKER = str(Path(__file__).with_name("_task_accuracy_peer.py"))
NORMED = ("hellaswag", "piqa", "arc_easy", "arc_challenge")  # lm-eval's acc_norm is their usual figure


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__)
    p.add_argument("--model", default="smollm2-135m", help="a real model's name or a checkpoint directory")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated --qformat names")
    p.add_argument(
        "--trained",
        default="",
        help="comma-separated NAME=DIR@FORMAT: a QAD / QAT output directory and the PTQ row it started from",
    )
    p.add_argument(
        "--trained-only",
        action="store_true",
        help="measure only the --trained rows (to --merge with an earlier run holding float and PTQ rows)",
    )
    p.add_argument(
        "--reference-formats",
        default="",
        help="comma-separated --qformat names for nvidia-modelopt's PTQ rows (on a CPU: "
        + ",".join(REFERENCE_ON_CPU)
        + ")",
    )
    p.add_argument("--peer-timeout", type=float, default=None, help="s before the reference worker stops")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated local lm-eval tasks")
    p.add_argument("--limit", type=int, default=None, help="the first N documents of each task (default all)")
    p.add_argument("--eval-batch-size", type=int, default=8, help="lm-eval's batch size")
    p.add_argument("--num-fewshot", type=int, default=None, help="MMLU only: examples from its dev split")
    p.add_argument("--calib-size", type=int, default=32, help="calibration windows (the recipes': 32)")
    p.add_argument("--calib-seq", type=int, default=256, help="tokens per calibration window (recipes: 256)")
    p.add_argument("--batch-size", type=int, default=4, help="calibration batch")
    p.add_argument("--task-dir", help="an extracted task folder (default: the cached one)")
    p.add_argument("--report", metavar="F", help="only rebuild the tables / figure from this --json file")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="F",
        help="join --json files of runs on the same model, tasks and --limit (a later run's trained rows "
        "beside an earlier run's PTQ rows; a row measured twice must agree) into --json / --md / --png",
    )
    h.common(p, threads=1, json="results (rewritten after each row)", md="tables", png="figure",
             reference="nvidia-modelopt (and lm-eval) interpreter for --reference-formats")  # fmt: skip
    args = p.parse_args(argv)
    args.formats = h.csv(args.formats)
    args.reference_formats = h.csv(args.reference_formats)
    if args.reference_formats and not args.reference_python:
        p.error(f"--reference-formats: {h.no_reference_python()}")
    args.tasks = h.csv(args.tasks)
    args.trained = [parse_trained(t) for t in h.csv(args.trained)]
    if args.trained_only and not args.trained:
        p.error("--trained-only: name the rows with --trained NAME=DIR@FORMAT")
    if args.limit is not None and args.limit < 1:
        p.error("--limit: a positive number of documents")
    return args


def parse_trained(text: str) -> dict[str, str]:
    """``NAME=DIR@FORMAT`` -> ``{"name", "dir", "format"}``."""
    name, sep, rest = text.partition("=")
    path, at, fmt = rest.rpartition("@")
    if not (sep and at and name.strip() and path and fmt):
        raise SystemExit(f"--trained {text!r}: write NAME=DIR@FORMAT, e.g. 'qad nvfp4=runs/qad@nvfp4'")
    return {"name": name.strip(), "dir": path, "format": fmt.strip()}


# ------------------------------------------------------------------------------------------------ scores


def headline(task: str) -> str:
    return "acc_norm" if task in NORMED else "acc"


def scores(results: dict[str, Any], tasks: list[str]) -> dict[str, dict[str, float]]:
    """Per task: every ``metric,none`` lm-eval reported (``acc``, ``acc_stderr``, ``acc_norm``, ...)."""
    from modelopt_lite.evaluation import task_scores

    found = task_scores(results)
    return {task: found.get(task, {}) for task in tasks}


def mean_score(row: dict[str, Any]) -> float:
    return sum(row["tasks"][t][headline(t)] for t in row["tasks"]) / len(row["tasks"])


def mean_stderr(row: dict[str, Any]) -> float:
    """Standard error of the mean over tasks (the tasks' errors taken as independent)."""
    errs = [row["tasks"][t].get(f"{headline(t)}_stderr", 0.0) for t in row["tasks"]]
    return math.sqrt(sum(e * e for e in errs)) / len(errs)


def summarize(rows: list[dict[str, Any]]) -> None:
    """``mean`` / ``mean_stderr`` on every row; ``drop`` on PTQ rows; ``recovered`` on trained rows."""
    by_name = {r["name"]: r for r in rows}
    for row in rows:
        row["mean"], row["mean_stderr"] = mean_score(row), mean_stderr(row)
    base = by_name.get("float")
    if base is None:
        return
    for row in rows:
        if row["kind"] == "ptq":
            row["drop"] = base["mean"] - row["mean"]
        start = by_name.get(row.get("starts_from", ""))
        if row["kind"] != "trained" or start is None:
            continue
        lost = base["mean"] - start["mean"]
        row["recovered"] = (row["mean"] - start["mean"]) / lost if lost > start["mean_stderr"] else None
        row["recovered_per_task"] = {}
        for t in row["tasks"]:
            m = headline(t)
            f, s, r = base["tasks"][t][m], start["tasks"][t][m], row["tasks"][t][m]
            err = start["tasks"][t].get(f"{m}_stderr", 0.0)
            row["recovered_per_task"][t] = (r - s) / (f - s) if f - s > err else None


# ------------------------------------------------------------------------------------------------- rows


def calibration(args: argparse.Namespace, tokenizer: Any) -> list[Any]:
    from modelopt_lite.data import token_stream, windows
    from modelopt_lite.models import corpus_texts

    calib = windows(
        token_stream(tokenizer, corpus_texts("fit")), args.calib_seq, args.calib_size, "fit split"
    )
    if len(calib) < args.calib_size:
        raise SystemExit(f"the corpus has {len(calib)} calibration windows of {args.calib_seq}; fewer asked")
    return list(calib.split(args.batch_size))


def model_dir(name: str) -> str:
    from modelopt_lite.models import REAL_MODELS, real_model_path

    return str(real_model_path(name)) if name in REAL_MODELS else name


def evaluate(model: Any, tokenizer: Any, args: argparse.Namespace) -> tuple[dict[str, Any], float]:
    from modelopt_lite.evaluation import evaluate_tasks

    start = time.perf_counter()
    results = evaluate_tasks(model, args.tasks, tokenizer=tokenizer, limit=args.limit,
                             batch_size=args.eval_batch_size, num_fewshot=args.num_fewshot,
                             task_dir=args.task_dir)  # fmt: skip
    return scores(results, args.tasks), time.perf_counter() - start


def check_reference(python: str) -> None:
    """The reference interpreter imports nvidia-modelopt and our lm-eval version, or the fix is named."""
    import lm_eval

    probe = "import lm_eval, modelopt, sys; sys.exit(lm_eval.__version__ != sys.argv[1])"
    proc = subprocess.run([python, "-c", probe, lm_eval.__version__], capture_output=True, text=True)
    if proc.returncode:
        why = (proc.stderr.strip().splitlines() or ["another lm-eval version"])[-1]
        raise SystemExit(f"--reference-python {python}: it must import nvidia-modelopt and lm-eval "
                         f"{lm_eval.__version__} (ours); install it there with: {python} -m pip install "
                         f"lm_eval=={lm_eval.__version__}  ({why})")  # fmt: skip


def reference_rows(args: argparse.Namespace, path: str, batches: list[Any]) -> list[dict[str, Any]]:
    """nvidia-modelopt's rows, scored in its own interpreter (``_task_accuracy_peer.py``)."""
    import torch
    from safetensors.torch import save_file

    from modelopt_lite.cli.ptq import QFORMATS
    from modelopt_lite.evaluation import load_local_tasks

    work = Path(tempfile.mkdtemp(prefix="task_accuracy_reference_"))
    include = str(load_local_tasks(args.task_dir).include_path)
    save_file({"calib": torch.cat(batches).contiguous()}, str(work / "calib.safetensors"))
    spec = {"model_dir": path, "data": str(work / "calib.safetensors"), "calib_batch": args.batch_size,
            "threads": args.threads, "seed": 0, "tasks": args.tasks, "limit": args.limit,
            "eval_batch": args.eval_batch_size, "include_path": include, "num_fewshot": args.num_fewshot,
            "rows": [{"name": f"{n} (modelopt)", "preset": QFORMATS[n], "kv": None}
                     for n in args.reference_formats]}  # fmt: skip
    h.log(f"nvidia-modelopt's rows {args.reference_formats} (log: {work}/modelopt.log)")
    out = peer.run_worker(WORKER, args.reference_python, spec, work, "modelopt", threads=args.threads,
                          timeout=args.peer_timeout)  # fmt: skip
    rows = []
    if out.get("error"):  # the worker itself failed (or was stopped): kept in the JSON's errors
        rows.append({"name": "nvidia-modelopt's worker", "kind": "ptq", "library": "modelopt",
                     "error": out["error"]})  # fmt: skip
    for r in out["rows"]:
        row = {"name": r["name"], "kind": "ptq", "library": "modelopt", "preset": r["preset"],
               "versions": out.get("versions")}  # fmt: skip
        if r.get("error"):
            rows.append({**row, "error": r["error"]})
            continue
        rows.append({**row, "tasks": scores(r["results"], args.tasks), "tasks_s": r["tasks_s"],
                     "calib_s": round(r["calib_s"], 1), "shipped_changed": r["shipped_changed"],
                     "peak_rss_mb": r["peak_rss_mb"]})  # fmt: skip
    return rows


def measure(args: argparse.Namespace, save: Any) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modelopt_lite.opt as mto
    import modelopt_lite.quantization as mtq
    from modelopt_lite.cli.ptq import QFORMATS, build_config
    from modelopt_lite.evaluation import check_tasks
    from modelopt_lite.export.layers import unify_shared_scales

    check_tasks(args.tasks, args.task_dir)  # before any model loads: the fix is named
    for name in args.formats + args.reference_formats:
        if name not in QFORMATS:
            raise SystemExit(f"--formats {name!r}: one of {sorted(QFORMATS)}")
    if args.reference_formats:
        check_reference(args.reference_python)
    for t in args.trained:
        config = Path(t["dir"], "config.json")
        quant = json.loads(config.read_text()).get("quantization_config", {}) if config.is_file() else {}
        if quant.get("quant_method") != "modelopt_lite":
            raise SystemExit(f"--trained {t['name']!r}: {t['dir']} is not a quantized model saved by this "
                             "library (QADTrainer / QATTrainer save_model, or save_pretrained after "
                             "mto.enable_huggingface_checkpointing())")  # fmt: skip
        if t["format"] not in args.formats and not args.trained_only:
            raise SystemExit(f"--trained {t['name']!r}: its PTQ row {t['format']!r} is not in --formats")
    path = model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    batches = calibration(args, tokenizer)
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []  # rows that raised (the reference's), kept in the JSON

    def load(where: str) -> Any:
        return AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32).eval()

    def scored(row: dict[str, Any]) -> None:
        if row.get("error"):
            errors.append(row)
            h.log(f"  {row['name']:<16} {row['error']}")
        else:
            rows.append(row)
            summarize(rows)
            cells = "  ".join(f"{t} {row['tasks'][t][headline(t)]:.3f}" for t in args.tasks)
            h.log(f"  {row['name']:<16} mean {row['mean']:.4f}  {cells}  ({row['tasks_s']:.0f} s)")
        save(rows, errors)

    def add(row: dict[str, Any], model: Any) -> None:
        row["tasks"], row["tasks_s"] = evaluate(model, tokenizer, args)
        row["peak_rss_mb"] = h.peak_rss_mb()
        scored(row)

    if not args.trained_only:
        add({"name": "float", "kind": "float"}, load(path))
    for name in [] if args.trained_only else args.formats:
        model = load(path)
        start = time.perf_counter()
        with torch.no_grad():
            mtq.quantize(model, build_config(name), batches)
        unify_shared_scales(model)
        add({"name": name, "kind": "ptq", "preset": QFORMATS[name],
             "calib_s": round(time.perf_counter() - start, 1)}, model)  # fmt: skip
        del model
    for row in reference_rows(args, path, batches) if args.reference_formats else []:
        scored(row)
    mto.enable_huggingface_checkpointing()
    for t in args.trained:
        add(
            {"name": t["name"], "kind": "trained", "dir": t["dir"], "starts_from": t["format"]},
            load(t["dir"]),
        )
    return rows


# ------------------------------------------------------------------------------------------------ output


def markdown(result: dict[str, Any]) -> str:
    rows, tasks = result["rows"], result["meta"]["tasks"]
    lines = [
        h.table_head(
            "| row | "
            + " | ".join(f"{t} {headline(t)}" for t in tasks)
            + " | mean | vs float / recovered | tasks s |"
        )
    ]
    for r in rows:
        cells = [
            f"{r['tasks'][t][headline(t)]:.3f} ± {r['tasks'][t].get(headline(t) + '_stderr', 0.0):.3f}"
            for t in tasks
        ]
        if r["kind"] == "ptq":
            extra = f"{-100 * r['drop']:+.1f} pts"
        elif r["kind"] == "trained":
            share = None if r.get("recovered") is None else 100 * r["recovered"]
            extra = f"{h.fmt_or_na(share, '.0f')}% of {r['starts_from']}'s drop"
        else:
            extra = "—"
        mean = f"{r['mean']:.3f} ± {r['mean_stderr']:.3f}"
        lines.append(h.table_row(r["name"], *cells, mean, extra, f"{r['tasks_s']:.0f}"))
    lam = [r for r in rows if "perplexity" in r["tasks"].get("lambada_openai", {})]
    if lam:
        lines += ["", "LAMBADA perplexity: " + ", ".join(
            f"{r['name']} {r['tasks']['lambada_openai']['perplexity']:.2f}" for r in lam)]  # fmt: skip
    trained = [r for r in rows if r.get("recovered_per_task")]
    for r in trained:
        per = ", ".join(f"{t} {h.fmt_or_na(None if v is None else 100 * v, '.0f')}%"
                        for t, v in r["recovered_per_task"].items())  # fmt: skip
        lines += ["", f"{r['name']}: share of {r['starts_from']}'s drop recovered per task: {per}"]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    plt = h.pyplot()
    rows, tasks = result["rows"], result["meta"]["tasks"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(tasks) + 2), 4))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        xs = [j + i * width for j in range(len(tasks))]
        ys = [r["tasks"][t][headline(t)] for t in tasks]
        es = [r["tasks"][t].get(headline(t) + "_stderr", 0.0) for t in tasks]
        ax.bar(xs, ys, width, yerr=es, label=r["name"], capsize=1)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], [f"{t}\n{headline(t)}" for t in tasks])
    ax.set_ylabel("accuracy (lm-eval, 0-shot)")
    limit = result["meta"]["limit"]
    ax.set_title(
        f"{result['meta']['model']}: " + ("all documents" if limit is None else f"first {limit} per task")
    )
    ax.legend(fontsize=7, ncol=2)
    h.save_figure(fig, path)


def dump(path: str | None, result: dict[str, Any]) -> None:
    """``--json``, each path of the machine written as :func:`_harness.command` writes one (a ``--trained``
    directory sits inside its ``NAME=DIR@FORMAT``, where ``command`` does not look)."""
    h.write_json(path, json.loads(h.portable_text(json.dumps(result))))


def write(result: dict[str, Any], args: argparse.Namespace) -> None:
    dump(args.json, result)
    if result["rows"]:
        h.write_text(args.md, markdown(result))
        if args.png:
            plot(result, args.png)


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result of several runs on the same documents; a row name measured twice must agree."""
    first = results[0]
    same = ("model", "tasks", "limit", "num_fewshot")
    rows = {r["name"]: r for r in first["rows"]}
    for other in results[1:]:
        differ = [k for k in same if other["meta"].get(k) != first["meta"].get(k)]
        if differ:
            raise SystemExit(f"--merge: the runs differ in {differ}: not the same documents")
        for row in other["rows"]:
            old = rows.setdefault(row["name"], row)
            if old["tasks"] != row["tasks"]:
                raise SystemExit(f"--merge: row {row['name']!r} was measured twice with other figures")
    commands = [r["meta"]["command"] for r in results]
    return {
        "meta": {**first["meta"], "command": commands, "merged": len(results)},
        "rows": list(rows.values()),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report or args.merge:
        runs = [json.loads(Path(f).read_text()) for f in ([args.report] if args.report else args.merge)]
        result = merge(runs)
        summarize(result["rows"])
        print(markdown(result))
        write(result, args)
        return 0
    h.pin_threads(args.threads)
    start = time.perf_counter()
    result: dict[str, Any] = {"meta": {}, "rows": []}

    def save(rows: list[dict[str, Any]], errors: list[dict[str, Any]]) -> None:
        result["meta"] = {
            **h.run_meta(__file__, argv, time.perf_counter() - start), "threads": args.threads,
            "model": args.model, "tasks": args.tasks, "limit": args.limit, "formats": args.formats,
            "num_fewshot": args.num_fewshot,
            "trained": args.trained, "calibration": f"{args.calib_size} x {args.calib_seq} tokens of fit",
            "reference_formats": args.reference_formats,
        }  # fmt: skip
        result["rows"] = rows
        if errors:
            result["errors"] = errors
        dump(args.json, result)

    measure(args, save)
    print(markdown(result))
    write(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
