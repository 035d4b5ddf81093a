"""How much perplexity does ``mtq.auto_quantize`` buy at each effective-bits budget on a benchmark model?

Published in ``docs/quantization.md``, "Auto-quantize: a format per layer under a bit budget":

    MODELOPT_LITE_CACHE=... OMP_NUM_THREADS=1 python benchmarks/auto_quantize.py --model bench-dense
    OMP_NUM_THREADS=1 python benchmarks/auto_quantize.py --model bench-dense --methods gradient,kl_div \\
        --formats INT4_BLOCKWISE_WEIGHT_ONLY_CFG,INT8_WEIGHT_ONLY_CFG --bits 4.5,5,5.5,6,7,8 --repeats 3 \\
        --reference-python PY                              # side by side with nvidia-modelopt

(``--model bench-moe`` for the MoE model; ``--quick``: 4 windows everywhere, budgets 4.5, 6, 8).

Model and data as in ``benchmarks/accuracy.py`` (its ``load_data``): the ``modelopt_lite.models`` benchmark
model (fp32, from the user cache, never trained here), calibration and scoring on the ``fit`` split (the
first ``--calib-size`` windows of 256 tokens, batches of 4; the scores use the first ``--score-size`` of
them), perplexity on the ``test`` split (reported; the ``validation`` column is there for any choice made
from these figures; this script makes none).

Candidates ``NVFP4_DEFAULT_CFG`` (4.5 bits) and ``FP8_DEFAULT_CFG`` (8 bits), and unquantized (16), on every
linear layer including ``lm_head`` (as the reference's ``hf_ptq`` searches it); KV cache unquantized. Each
method searches once (calibration and scores); every budget is then solved from the stored scores
(``mtq.get_auto_quantize_config(state, {"effective_bits": b})``) and the model quantized with that config
(max calibration on the same windows). Rows per budget:

* ``gradient`` / ``kl_div``: the searched assignment;
* ``random``: the same solver and budget with random scores (uniform, decreasing with the bits, per group),
  the mean over ``--random-seeds``: what the measured scores add over any assignment that fills the budget.

``uniform NVFP4_DEFAULT_CFG`` / ``uniform FP8_DEFAULT_CFG``: every searched layer (``lm_head`` too) in one
format, from the same search state (4.5 and 8 bits); ``preset ...``: the presets as they are (``lm_head``
unquantized), for reference. At 6.0 bits ``removed`` is ``(ppl_nvfp4 - ppl_row) / (ppl_nvfp4 - ppl_fp8)``
with the uniform rows: the share of uniform NVFP4's perplexity excess over uniform FP8 that the mixed
assignment removes (issue target: >= 65%).

``--formats`` changes the candidates (narrowest first); ``--disabled-layers`` keeps layers unquantized (they
count at 16 bits, as in the reference). ``--reference-python PY`` (default ``$MODELOPT_REFERENCE_PYTHON``)
also runs nvidia-modelopt's ``mtq.auto_quantize`` under ``PY`` (``benchmarks/_peer_worker.py``, peer
``modelopt_auto_quantize``, as ``benchmarks/peers.py`` runs its peers): same model folder, calibration and
score batches, candidates, budgets and method, timed and measured by the same perplexity function
(``modelopt ...`` rows). Its formats must run on CPU: ``--formats
INT4_BLOCKWISE_WEIGHT_ONLY_CFG,INT8_WEIGHT_ONLY_CFG`` (its NVFP4 needs CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h
import accuracy
import peers

FORMATS = "NVFP4_DEFAULT_CFG,FP8_DEFAULT_CFG"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = h.common(h.parser(__doc__), threads=1, quick="4 windows everywhere, budgets 4.5,6,8")
    p.add_argument("--model", default="bench-dense", choices=accuracy.MODELS)
    p.add_argument("--bits", default="4.5,5,5.5,6,6.5,7,7.5,8,8.5")
    p.add_argument("--methods", default="gradient,kl_div")
    p.add_argument("--formats", default=FORMATS, help="candidates, narrowest first (unquantized is added)")
    p.add_argument("--disabled-layers", default="", help="comma-separated fnmatch patterns kept unquantized")
    h.common(p, reference="nvidia-modelopt's interpreter: its auto_quantize rows too")
    p.add_argument("--random-seeds", default="0,1,2")
    p.add_argument("--calib-size", type=int, default=32, help="calibration windows of 256 tokens")
    p.add_argument("--score-size", type=int, default=16, help="of them, the windows that score the formats")
    p.add_argument("--eval-windows", type=int, default=None, help="cap on validation / test windows")
    h.common(p, repeats=(1, "searches per method (and reference); median time"), json="write the rows here")
    p.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="also evaluate the K lowest-score assignments at 6.0 bits (narrowest / widest format per group)",
    )
    p.add_argument(
        "--bounds",
        action="store_true",
        help="also the largest group in each format, every other group unquantized / in the widest format",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.calib_size, args.score_size, args.eval_windows, args.bits = 4, 4, 4, "4.5,6,8"
    # load_data's other settings: training windows (unused here), the model's own evaluation windows, no
    # off-distribution windows (accuracy.py's defaults for a benchmark model)
    args.seq_len, args.eval_seq, args.train_windows, args.offdist_tokens = accuracy.CALIB_SEQ, None, None, 0
    args.formats, args.disabled_layers = h.csv(args.formats), h.csv(args.disabled_layers)
    return args


def _seconds(times: list[float]) -> dict[str, Any]:
    """The median of the search times, and all of them."""
    return {"seconds": round(statistics.median(times), 2), "all_seconds": [round(t, 2) for t in times]}


def _random_state(state: dict[str, Any], seed: int) -> dict[str, Any]:
    """``state`` with random scores: per group, decreasing with the bits, unquantized 0."""
    rng = random.Random(seed)
    stats = {}
    for name, stat in state["candidate_stats"].items():
        scores = [*sorted((rng.random() for _ in stat["formats"][:-1]), reverse=True), 0.0]
        stats[name] = {**stat, "scores": scores}
    return {**state, "candidate_stats": stats}


def _uniform(state: dict[str, Any], fmt: str) -> dict[str, Any]:
    """``state`` with every group choosing ``fmt``."""
    return {**state, "best": {"recipe": dict.fromkeys(state["candidate_stats"], fmt)}}


def reference_rows(args: argparse.Namespace, method: str, data: dict[str, Any], budgets: list[float]) -> list:
    """nvidia-modelopt's search and rows (``modelopt_auto_quantize`` peer under ``--reference-python``) on
    the data ``accuracy.load_data`` made (written to a safetensors file with ``peers.export_data``)."""
    from modelopt_lite.models import default_model_path

    with tempfile.TemporaryDirectory(prefix="aq-peer-") as work:
        data_path, spec_path = os.path.join(work, "data.safetensors"), os.path.join(work, "spec.json")
        peers.export_data(data_path, data["evals"], data["calib"], data["train"])
        aq = {
            "formats": args.formats,
            "method": method,
            "search_bits": data["search_bits"],
            "budgets": budgets,
            "score_steps": data["score_steps"],
            "disabled_layers": args.disabled_layers,
            "repeats": args.repeats,
        }
        spec = {
            "model_dir": str(default_model_path(args.model, train_if_missing=False)),
            "data": data_path,
            "formats": ["auto_quantize"],
            "threads": args.threads,
            "calib_batch": accuracy.CALIB_BATCH,
            "auto_quantize": aq,
        }
        Path(spec_path).write_text(json.dumps(spec))
        res = peers.run_peer("modelopt_auto_quantize", args.reference_python, spec_path, args.threads)
    if "error" in res or res.get("errors"):
        print(f"reference: {res.get('error') or res['errors']}", flush=True)
    out = []
    for r in res.get("rows", []):
        if r["name"].startswith("modelopt search"):
            out.append(
                {"row": r["name"].replace("modelopt search", "search modelopt"), **_seconds(r["times"])}
            )
        elif r["method"] == "auto_quantize":
            out.append(
                {
                    "row": r["name"],
                    "bits": r["bits"],
                    "validation_ppl": r["val_ppl"],
                    "test_ppl": r["test_ppl"],
                }
            )
    return out


def _bits(state: dict[str, Any], recipe: dict[str, str]) -> float:
    stats = state["candidate_stats"]
    cost = sum(stats[n]["costs"][stats[n]["formats"].index(f)] for n, f in recipe.items())
    return cost / state["cost_denominator"] * 16


def top_k_rows(state: dict[str, Any], k: int, bits: float, measure: Any) -> list[dict[str, Any]]:
    """The ``k`` assignments with the lowest summed score within ``bits``, each group in its narrowest or
    widest quantized format (enumerated: at most 20 groups), each quantized and evaluated: how much a
    better score could still gain over the searched assignment (rank 0)."""
    import itertools

    stats = state["candidate_stats"]
    names = list(stats)
    if len(names) > 20:
        raise SystemExit(f"--top-k enumerates 2**groups assignments; {len(names)} groups is too many")
    budget = state["cost_denominator"] * bits / 16
    options = [(0, len(stats[n]["formats"]) - 2) for n in names]  # narrowest, widest quantized
    feasible = []
    for choice in itertools.product(*options):
        cost = sum(stats[n]["costs"][j] for n, j in zip(names, choice, strict=True))
        if cost <= budget + 1e-6:
            feasible.append((sum(stats[n]["scores"][j] for n, j in zip(names, choice, strict=True)), choice))
    rows = []
    for rank, (score, choice) in enumerate(sorted(feasible)[:k]):
        recipe = {n: stats[n]["formats"][j] for n, j in zip(names, choice, strict=True)}
        row = {"row": f"top-{rank}", "score": score, "bits": round(_bits(state, recipe), 3)}
        rows.append({**row, **measure(mtq_config(state, recipe))})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bound_rows(state: dict[str, Any], measure: Any) -> list[dict[str, Any]]:
    """The largest group in each of its formats, every other group unquantized, then in the widest
    quantized format: what that group's format alone costs, whatever the budget."""
    stats = state["candidate_stats"]
    big = max(stats, key=lambda n: stats[n]["costs"][-1])
    rows = []
    for fmt in stats[big]["formats"][:-1]:
        for rest in (-1, -2):
            recipe = {n: fmt if n == big else stats[n]["formats"][rest] for n in stats}
            label = f"bound {big.removesuffix('.quant_recipe')} {fmt}, rest {stats[big]['formats'][rest]}"
            rows.append(
                {"row": label, "bits": round(_bits(state, recipe), 3), **measure(mtq_config(state, recipe))}
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def mtq_config(state: dict[str, Any], recipe: dict[str, str]) -> dict[str, Any]:
    import modelopt_lite.quantization as mtq

    return mtq.get_auto_quantize_config({**state, "best": {"recipe": recipe}})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    h.pin_threads(args.threads)
    import copy

    import modelopt_lite.quantization as mtq

    base, _, evals, calib, train = accuracy.load_data(args.model, args)
    data = [{"input_ids": b, "labels": b} for b in calib]
    score_steps = max(1, args.score_size // accuracy.CALIB_BATCH)
    budgets = [float(b) for b in args.bits.split(",")]
    search_bits = max(budgets)  # any budget would do: every row is solved again from the scores

    def measure(config: dict[str, Any]) -> dict[str, float]:
        model = mtq.quantize(copy.deepcopy(base), config, calib)
        return {f"{s}_ppl": accuracy._ppl(model, evals[s]) for s in ("validation", "test")}

    rows: list[dict[str, Any]] = [
        {"row": "unquantized", **{f"{s}_ppl": accuracy._ppl(base, evals[s]) for s in evals}}
    ]
    states = {}
    for method in args.methods.split(","):
        forward = (
            (lambda m, b: m(**b))
            if method == "gradient"
            else (lambda m, b: m(input_ids=b["input_ids"]).logits)
        )
        times, peak = [], 0.0
        for _ in range(args.repeats):  # a fresh copy each time; the last search's state is kept
            model = copy.deepcopy(base)
            _, before = h.reset_peak_rss("peak RSS of the process")
            start = time.perf_counter()
            _, states[method] = mtq.auto_quantize(
                model, {"effective_bits": search_bits}, args.formats, data, forward,
                (lambda out, b: out.loss) if method == "gradient" else None,
                num_calib_steps=len(data), num_score_steps=score_steps, method=method,
                disabled_layers=args.disabled_layers or None,
            )  # fmt: skip
            times.append(time.perf_counter() - start)
            peak = max(peak, h.status_mb("VmHWM") - before)
            del model
        rows.append({"row": f"search {method}", **_seconds(times), "peak_mb": round(peak, 1)})
    any_state = next(iter(states.values()))
    for fmt in args.formats:
        rows.append(
            {"row": f"uniform {fmt}", **measure(mtq.get_auto_quantize_config(_uniform(any_state, fmt)))}
        )
    for bits in budgets:
        for method, state in states.items():
            config = mtq.get_auto_quantize_config(state, {"effective_bits": bits})
            rows.append({"row": method, "bits": bits, **measure(config)})
        seeds = [int(s) for s in args.random_seeds.split(",") if s]
        randoms = [
            measure(mtq.get_auto_quantize_config(_random_state(any_state, s), {"effective_bits": bits}))
            for s in seeds
        ]
        if randoms:
            rows.append(
                {
                    "row": "random",
                    "bits": bits,
                    **{k: sum(r[k] for r in randoms) / len(randoms) for k in randoms[0]},
                }
            )
        print(json.dumps([r for r in rows if r.get("bits") == bits]), flush=True)
    if args.reference_python:
        shared = {"evals": evals, "calib": calib, "train": train, "search_bits": search_bits}
        for method in args.methods.split(","):
            rows += reference_rows(args, method, {**shared, "score_steps": score_steps}, budgets)
    else:
        print(f"nvidia-modelopt skipped ({h.no_reference_python()})", flush=True)
    if args.top_k:
        rows += top_k_rows(any_state, args.top_k, 6.0, measure)
    if args.bounds:
        rows += bound_rows(any_state, measure)
    for preset in args.formats:  # the presets themselves (lm_head excluded), for reference
        rows.append({"row": f"preset {preset}", **measure(mtq.get_preset(preset))})
    _summarize(rows, args.formats)
    h.write_json(args.json, rows)
    return 0


def _summarize(rows: list[dict[str, Any]], formats: list[str]) -> None:
    by = {r["row"]: r for r in rows}
    nvfp4, fp8 = by.get(f"uniform {formats[0]}"), by.get(f"uniform {formats[-1]}")
    print(h.table_head("| row | bits | val ppl | test ppl | removed (test) |"))
    for r in rows:
        if "test_ppl" not in r:
            peak = f", {r['peak_mb']} MB extra peak RSS" if "peak_mb" in r else ""
            print(f"| {r['row']} | | | | {r['seconds']} s{peak} |")
            continue
        removed = ""
        if nvfp4 and fp8 and r.get("bits") == 6.0 and nvfp4["test_ppl"] > fp8["test_ppl"]:
            removed = f"{(nvfp4['test_ppl'] - r['test_ppl']) / (nvfp4['test_ppl'] - fp8['test_ppl']):.0%}"
        ppl = f"{r['validation_ppl']:.3f} | {r['test_ppl']:.3f}"
        print(f"| {r['row']} | {r.get('bits', '')} | {ppl} | {removed} |")


if __name__ == "__main__":
    raise SystemExit(main())
