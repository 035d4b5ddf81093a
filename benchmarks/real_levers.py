"""Which levers recover NVFP4 W4A4 PTQ accuracy on a real pretrained LLM (SmolLM2-135M by default)?

Published in ``docs/real_model.md``, "Levers on NVFP4 W4A4" (``docs/real_levers.json`` / ``.png``; two runs
of ``--levers`` subsets, then merged):

    python benchmarks/real_levers.py --calib-size 16 --workdir W --json a.json \\
        --levers max,awq_lite,weight_only,act_only,fp8,gptq,awq_lite+gptq,rotation,rotation+awq_lite,...
    python benchmarks/real_levers.py --calib-size 16 --workdir W --json b.json --aq-bits 5,4.5,6 \\
        --levers max,local_hessian,awq_full,smoothquant,auto_quantize
    python benchmarks/real_levers.py --merge a.json b.json --json docs/real_levers.json \\
        --png docs/real_levers.png

Every row quantizes a fresh copy of the unquantized model with NVFP4 weights and activations (W4A4, KV
cache unquantized, ``lm_head`` excluded as the presets do) and one lever, calibrated on the first
``--calib-size`` windows of ``--calib-seq`` tokens of the corpus' ``fit`` split (batches of
``--batch-size``). Each row is measured on the first ``--val-windows`` windows of the ``validation`` split
(where every choice is made: the best recipe is the W4A4 row with the lowest validation perplexity) and the
first ``--test-windows`` windows of the ``test`` split (reported only): perplexity, KL(unquantized ||
quantized) in nats per predicted token and top-1 agreement, against the unquantized model's log-probabilities
stored once per batch (``_real_ptq_peer.measure``, checked against ``modelopt_lite.evaluation.compare``).
"gap removed" is ``(ppl_max - ppl_row) / (ppl_max - ppl_float)`` on test, ``ppl_max`` the max-calibration
baseline's. Calibration seconds include the rotation where there is one and the auto_quantize search.

Rows (``--levers``, default all, in this order): see :data:`LEVERS`; ``auto_quantize`` searches once (the
gradient score, candidates NVFP4 / FP8 / unquantized on every searched linear layer, ``lm_head`` disabled;
calibration on the calibration batches, scores on the first ``--aq-score-steps`` of them) and measures each
budget of ``--aq-bits`` (``aq_4.5`` ...), reporting the share of uniform NVFP4's test-perplexity excess over
uniform FP8 it removes. A row that raises records its error and the run goes on; ``--json`` is rewritten
after every row. ``--merge`` joins the rows of runs made with the same protocol (rows run in parallel
processes) and writes the report. ``--quick``: 4 x 64 calibration tokens, 2 x 64 validation and test.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as h
import _real_ptq_peer as peer

GOAL_GAP = 0.60  # the best W4A4 recipe removes >= 60% of max calibration's test-perplexity gap
GOAL_AQ = 0.70  # auto_quantize at 5.0 bits removes >= 70% of uniform NVFP4's excess over uniform FP8


@dataclass(frozen=True)
class Lever:
    """A row: a preset, optionally another algorithm, optionally the residual rotation first."""

    label: str
    preset: str = "NVFP4_DEFAULT_CFG"
    algorithm: Any = None  # None: the preset's own
    rotate: bool = False
    weights_off: bool = False  # activation-only row: every weight quantizer disabled
    kind: str = "w4a4"  # w4a4 (a candidate for the best recipe), reference (decomposition / FP8), aq
    extra: dict[str, Any] = field(default_factory=dict)


LEVERS: dict[str, Lever] = {
    "max": Lever("max calibration (baseline)", kind="baseline"),
    "weight_only": Lever("NVFP4 weights only (W4A16_NVFP4_CFG)", "W4A16_NVFP4_CFG", kind="reference"),
    "act_only": Lever("NVFP4 activations only (weights unquantized)", weights_off=True, kind="reference"),
    "fp8": Lever("uniform FP8 (FP8_DEFAULT_CFG)", "FP8_DEFAULT_CFG", kind="reference"),
    "awq_lite": Lever("AWQ lite (NVFP4_AWQ_LITE_CFG)", "NVFP4_AWQ_LITE_CFG"),
    "awq_clip": Lever("AWQ clip", algorithm={"method": "awq_clip"}),
    "awq_full": Lever("AWQ full (lite + clip)", algorithm={"method": "awq_full"}),
    "gptq": Lever("GPTQ (block 128, damp 0.01)", algorithm={"method": "gptq"}),
    "mse": Lever("MSE, FP8 block-scale sweep (static)", "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG"),
    "local_hessian": Lever("local Hessian, FP8 sweep (static)", "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG"),
    "smoothquant": Lever("SmoothQuant alpha 0.5", algorithm={"method": "smoothquant", "alpha": 0.5}),
    "rotation": Lever("residual rotation + max", rotate=True),
    "four_over_six": Lever("adaptive block scales (NVFP4_FOUR_OVER_SIX_CFG)", "NVFP4_FOUR_OVER_SIX_CFG"),
    "rotation+awq_lite": Lever("rotation + AWQ lite", "NVFP4_AWQ_LITE_CFG", rotate=True),
    "rotation+gptq": Lever("rotation + GPTQ", algorithm={"method": "gptq"}, rotate=True),
    "rotation+local_hessian": Lever(
        "rotation + local Hessian", "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG", rotate=True
    ),
    "awq_lite+gptq": Lever("AWQ lite, then GPTQ", algorithm=["awq_lite", {"method": "gptq"}]),
    "rotation+awq_lite+gptq": Lever(
        "rotation + AWQ lite, then GPTQ", algorithm=["awq_lite", {"method": "gptq"}], rotate=True
    ),
    "auto_quantize": Lever("auto_quantize NVFP4 / FP8 / unquantized", kind="aq"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = h.real_model_flags(h.parser(__doc__))
    p.add_argument("--val-windows", type=int, default=8)
    p.add_argument("--test-windows", type=int, default=16)
    p.add_argument("--levers", default=",".join(LEVERS), help=f"comma-separated from {list(LEVERS)}")
    p.add_argument("--aq-bits", default="4.5,5,6", help="auto_quantize effective-bits budgets")
    p.add_argument(
        "--aq-score-steps", type=int, default=4, help="calibration batches that score auto_quantize"
    )
    p.add_argument("--workdir", help="keep the reference log-probabilities here (reused when present)")
    p.add_argument("--merge", nargs="+", help="join these JSON results (same protocol) instead of running")
    h.common(p, threads=2, seed=0, quick="4 x 64 calibration, 2 x 64 evaluation", json="", md="", png="")
    args = p.parse_args(argv)
    if args.quick:
        args.calib_size, args.calib_seq, args.batch_size = 4, 64, 2
        args.val_windows, args.test_windows, args.eval_seq, args.aq_score_steps = 2, 2, 64, 1
    args.levers = [x for x in args.levers.split(",") if x]
    bad = [x for x in args.levers if x not in LEVERS]
    if bad:
        p.error(f"unknown levers {bad}: choose from {list(LEVERS)}")
    args.aq_bits = [float(b) for b in args.aq_bits.split(",") if b]
    return args


# ------------------------------------------------------------------------------------------ measuring


def load(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The unquantized model and the windows of each split."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modelopt_lite.data import token_stream, windows
    from modelopt_lite.models import corpus_texts, real_model_path

    path = Path(args.model_dir) if args.model_dir else real_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    data = {}
    for split, count, seq in (
        ("fit", args.calib_size, args.calib_seq),
        ("validation", args.val_windows, args.eval_seq),
        ("test", args.test_windows, args.eval_seq),
    ):
        data[split] = windows(token_stream(tok, corpus_texts(split)), seq, count, what=f"the {split} split")
        if data[split].shape[0] < count:
            raise ValueError(f"the {split} split holds {data[split].shape[0]} windows of {seq}, not {count}")
    return model, data


def protocol(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model_dir or args.model,
        "calibration": f"{args.calib_size} x {args.calib_seq} tokens of the fit split",
        "validation": f"{args.val_windows} x {args.eval_seq} tokens",
        "test": f"{args.test_windows} x {args.eval_seq} tokens",
        "batch_size": args.batch_size,
        "aq_score_steps": args.aq_score_steps,
    }


def _metrics(m: dict[str, Any]) -> dict[str, float]:
    return {"ppl": m["ppl"], "kl": m["kl"], "top1": m["top1"]}


def measure_both(model: Any, data: dict[str, Any], refs: dict[str, Path], batch: int) -> dict[str, Any]:
    return {s: _metrics(peer.measure(model, data[s], refs[s], batch)) for s in ("validation", "test")}


def config_of(lever: Lever) -> dict[str, Any]:
    import modelopt_lite.quantization as mtq

    cfg = mtq.get_preset(lever.preset)
    if lever.algorithm is not None:
        cfg["algorithm"] = copy.deepcopy(lever.algorithm)
    if lever.weights_off:
        cfg["quant_cfg"] = [*cfg["quant_cfg"], {"quantizer_name": "*weight_quantizer", "enable": False}]
    return cfg


def run_lever(
    name: str,
    base: Any,
    calib: list[Any],
    data: dict[str, Any],
    refs: dict[str, Path],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """The row(s) of one lever (auto_quantize gives one per budget)."""
    import modelopt_lite.quantization as mtq

    lever = LEVERS[name]
    if lever.kind == "aq":
        return run_auto_quantize(base, calib, data, refs, args)
    model = copy.deepcopy(base)
    start = time.perf_counter()
    if lever.rotate:
        mtq.rotate_residual(model)
    cfg = config_of(lever)
    mtq.quantize(model, cfg, calib)
    seconds = time.perf_counter() - start
    row = {
        "name": name,
        "label": lever.label,
        "kind": lever.kind,
        "calib_s": seconds,
        "algorithm": cfg.get("algorithm"),
        "preset": lever.preset,
        "rotate": lever.rotate,
    }
    row.update(measure_both(model, data, refs, args.batch_size))
    return [row]


def run_auto_quantize(
    base: Any, calib: list[Any], data: dict[str, Any], refs: dict[str, Path], args: argparse.Namespace
) -> list[dict[str, Any]]:
    import modelopt_lite.quantization as mtq

    loader = [{"input_ids": b, "labels": b} for b in calib]
    model = copy.deepcopy(base)
    total = h.aq_budget(model)
    start = time.perf_counter()
    model, state = mtq.auto_quantize(
        model,
        constraints={"effective_bits": total(args.aq_bits[0])},
        quantization_formats=["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG", None],
        data_loader=loader,
        forward_step=lambda m, b: m(**b),
        loss_func=lambda out, b: out.loss,
        method="gradient",
        num_calib_steps=len(loader),
        num_score_steps=min(args.aq_score_steps, len(loader)),
        disabled_layers=["*lm_head*"],
    )
    search_s = time.perf_counter() - start
    rows = []
    for i, bits in enumerate(args.aq_bits):
        start = time.perf_counter()
        if i:  # the same scores, solved again; a fresh copy quantized with that assignment
            model = copy.deepcopy(base)
            mtq.quantize(model, mtq.get_auto_quantize_config(state, {"effective_bits": total(bits)}), calib)
        best = mtq.get_auto_quantize_config(state, {"effective_bits": total(bits)})
        formats = [
            r["cfg"]
            for r in best["quant_cfg"]
            if "cfg" in r and r["quantizer_name"].endswith("weight_quantizer")
        ]
        row = {
            "name": f"aq_{bits:g}",
            "label": f"auto_quantize {bits:g} bits",
            "kind": "aq",
            "bits": bits,
            "effective_bits_with_lm_head": total(bits),
            "calib_s": search_s + (time.perf_counter() - start),
            "search_s": search_s,
            "weight_formats": _count_formats(formats),
        }
        row.update(measure_both(model, data, refs, args.batch_size))
        rows.append(row)
    return rows


def _count_formats(cfgs: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in cfgs:
        key = (
            "nvfp4"
            if tuple(c.get("num_bits", ())) == (2, 1)
            else "fp8"
            if tuple(c.get("num_bits", ())) == (4, 3)
            else str(c.get("num_bits"))
        )
        out[key] = out.get(key, 0) + 1
    return out


# ------------------------------------------------------------------------------------------- summary


def _by_name(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in rows if "error" not in r}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Fill each row's gap removed, the decomposition, the best recipe and auto_quantize's excess removed."""
    rows = _by_name(result["rows"])
    float_test = result["float"]["test"]["ppl"]
    summary: dict[str, Any] = {}
    mx = rows.get("max")
    if mx is None:
        result["summary"] = summary
        return result
    gap = mx["test"]["ppl"] - float_test
    for r in result["rows"]:
        if "error" not in r:
            r["gap_removed"] = (mx["test"]["ppl"] - r["test"]["ppl"]) / gap if gap else float("nan")
    for part in ("weight_only", "act_only"):
        if part in rows:
            summary[f"{part}_share_of_gap"] = (rows[part]["test"]["ppl"] - float_test) / gap
    w4a4 = [r for r in rows.values() if r["kind"] in ("w4a4", "baseline")]
    best = min(w4a4, key=lambda r: r["validation"]["ppl"])
    summary["best"] = {
        "name": best["name"],
        "label": best["label"],
        "gap_removed": best["gap_removed"],
        "goal": GOAL_GAP,
        "met": best["gap_removed"] >= GOAL_GAP,
    }
    fp8 = rows.get("fp8")
    if fp8 is not None:
        excess = mx["test"]["ppl"] - fp8["test"]["ppl"]
        for r in rows.values():
            if r["kind"] == "aq":
                r["excess_removed"] = (
                    (mx["test"]["ppl"] - r["test"]["ppl"]) / excess if excess else float("nan")
                )
                if r["bits"] == 5.0:
                    summary["aq_5"] = {
                        "excess_removed": r["excess_removed"],
                        "goal": GOAL_AQ,
                        "met": r["excess_removed"] >= GOAL_AQ,
                    }
    result["summary"] = summary
    return result


def _pct(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def table(result: dict[str, Any]) -> str:
    cols = "validation ppl | test ppl | gap removed (test) | KL (test) | top-1 (test) | calibration s"
    head = h.table_head(f"| row | {cols} |") + "\n"
    f = result["float"]
    lines = [f"| unquantized | {f['validation']['ppl']:.2f} | {f['test']['ppl']:.2f} | | 0 | 1 | |"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | error: {r['error']} | | | | | |")
            continue
        extra = (
            f" (removes {_pct(r['excess_removed'])} of NVFP4's excess over FP8)"
            if "excess_removed" in r
            else ""
        )
        lines.append(
            f"| {r['label']}{extra} | {r['validation']['ppl']:.2f} | {r['test']['ppl']:.2f} | "
            f"{_pct(r.get('gap_removed'))} | {r['test']['kl']:.3f} | "
            f"{r['test']['top1']:.3f} | {r['calib_s']:.0f} |"
        )
    return head + "\n".join(lines) + "\n"


def markdown(result: dict[str, Any]) -> str:
    s = result.get("summary", {})
    out = [table(result), ""]
    if "weight_only_share_of_gap" in s or "act_only_share_of_gap" in s:
        out.append(
            f"Decomposition of max calibration's test-perplexity gap: NVFP4 weights alone give "
            f"{_pct(s.get('weight_only_share_of_gap'))} of it, NVFP4 activations alone "
            f"{_pct(s.get('act_only_share_of_gap'))}."
        )
    if "best" in s:
        b = s["best"]
        out.append(
            f"Best W4A4 recipe on validation: {b['label']}, removes {100 * b['gap_removed']:.0f}% of the "
            f"gap on test (goal {100 * b['goal']:.0f}%: {'met' if b['met'] else 'not met'})."
        )
    if "aq_5" in s:
        a = s["aq_5"]
        out.append(
            f"auto_quantize at 5.0 bits removes {100 * a['excess_removed']:.0f}% of uniform NVFP4's excess "
            f"over uniform FP8 (goal {100 * a['goal']:.0f}%: {'met' if a['met'] else 'not met'})."
        )
    return "\n".join(out) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    rows = [r for r in result["rows"] if "error" not in r and "gap_removed" in r]
    labels = [r["name"] for r in rows]
    fig, (a, b) = h.pyplot().subplots(1, 2, figsize=(12, 0.35 * len(rows) + 2), sharey=True)
    y = range(len(rows))
    a.barh(list(y), [r["test"]["ppl"] for r in rows], color="tab:blue")
    a.axvline(result["float"]["test"]["ppl"], color="k", ls="--", label="unquantized")
    a.set_xlabel("test perplexity")
    a.legend(loc="lower right")
    b.barh(list(y), [100 * r["gap_removed"] for r in rows], color="tab:green")
    b.axvline(100 * GOAL_GAP, color="r", ls=":", label=f"goal {100 * GOAL_GAP:.0f}%")
    b.axvline(0, color="k", lw=0.8)
    b.set_xlabel("% of max calibration's test-perplexity gap removed")
    b.legend(loc="lower right")
    a.set_yticks(list(y), labels)
    a.invert_yaxis()
    fig.suptitle(f"NVFP4 W4A4 levers on {result['protocol']['model']}")
    h.save_figure(fig, path)


def write_outputs(result: dict[str, Any], args: argparse.Namespace) -> None:
    h.write_json(args.json, result)
    h.write_text(args.md, markdown(result))
    if args.png and result["rows"]:
        plot(result, args.png)


# ---------------------------------------------------------------------------------------------- main


def _git() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "modelopt_lite"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    changed = sorted(line[3:] for line in dirty if line.strip())
    return head + (f" + uncommitted {', '.join(changed)}" if changed else "")


def merge(args: argparse.Namespace) -> dict[str, Any]:
    parts = [json.loads(Path(f).read_text()) for f in args.merge]
    if any(p["protocol"] != parts[0]["protocol"] for p in parts):
        raise ValueError(
            "--merge: the runs differ in protocol: " + "; ".join(str(p["protocol"]) for p in parts)
        )
    rows: dict[str, dict[str, Any]] = {}
    for p in parts:
        rows.update({r["name"]: r for r in p["rows"]})
    order = [
        n
        for lever in LEVERS
        for n in rows
        if n == lever or (lever == "auto_quantize" and n.startswith("aq_"))
    ]
    result = {**parts[0], "rows": [rows[n] for n in order], "runs": [p["run"] for p in parts]}
    return summarize(result)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        result = merge(args)
        print(table(result))
        write_outputs(result, args)
        return 0
    if args.workdir:
        return run(args, argv, Path(args.workdir))
    with tempfile.TemporaryDirectory(prefix="real_levers_") as work:
        return run(args, argv, Path(work))


def run(args: argparse.Namespace, argv: list[str] | None, work: Path) -> int:
    """Every lever of ``args.levers``; the unquantized log-probabilities in ``work`` (reused when there)."""
    h.pin_threads(args.threads, args.seed)
    import torch

    base, data = load(args)
    calib = list(data["fit"].split(args.batch_size))
    refs, float_row = {}, {}
    for split in ("validation", "test"):
        refs[split] = work / f"ref_{split}_{data[split].shape[0]}x{data[split].shape[1]}_b{args.batch_size}"
        if not (refs[split] / "done").exists():
            peer.write_reference(base, data[split], refs[split], args.batch_size)
            (refs[split] / "done").write_text("")
        cached = refs[split] / "float.json"  # the unquantized model's own row, measured once per workdir
        if not cached.exists():
            cached.write_text(
                json.dumps(_metrics(peer.measure(base, data[split], refs[split], args.batch_size)))
            )
        float_row[split] = json.loads(cached.read_text())
    result: dict[str, Any] = {
        "protocol": protocol(args),
        "float": float_row,
        "run": {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": h.command(__file__, argv),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{args.threads} threads",
            "code": _git(),
        },
        "rows": [],
    }
    print(
        f"unquantized: validation {float_row['validation']['ppl']:.3f}, test {float_row['test']['ppl']:.3f}",
        flush=True,
    )
    for name in args.levers:
        print(f"-- {name}", flush=True)
        try:
            rows = run_lever(name, base, calib, data, refs, args)
        except Exception as err:  # a lever that fails on this model is a result: record it, go on
            lever = LEVERS[name]
            rows = [{"name": name, "label": lever.label, "kind": lever.kind, **h.error_result(err, 300)}]
            print(rows[0]["traceback"], file=sys.stderr, flush=True)
        for r in rows:
            if "error" not in r:
                print(
                    f"   {r['name']}: validation {r['validation']['ppl']:.3f} test {r['test']['ppl']:.3f} "
                    f"kl {r['test']['kl']:.4f} ({r['calib_s']:.0f} s)",
                    flush=True,
                )
        result["rows"] += rows
        summarize(result)
        write_outputs(result, args)
    print(markdown(summarize(result)))
    write_outputs(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
