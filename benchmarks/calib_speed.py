"""How long does each calibration algorithm take on a real model, against nvidia-modelopt's?

Published in ``docs/real_model.md``, "Speed of calibration" (SmolLM2-135M, 8 x 256 tokens):

    python benchmarks/calib_speed.py --repeats 2 --reference-python PY          # rows max .. awq_lite
    python benchmarks/calib_speed.py --repeats 2 --timeout 600 \\
        --rows awq_clip,awq_full,gptq,mse,local_hessian --reference-python PY     # the rest, the forwards

Model: the real model ``--model`` (``modelopt_lite.models.load_real_model``; SmolLM2-135M-Instruct by
default), fp32, eval mode. Calibration data: the corpus's ``"fit"`` split as one token stream
(``modelopt_lite.data.token_stream``), cut into ``--calib`` windows (``COUNTxLEN``: 8 windows of 256 tokens
by default), fed as batches of one window, the same tensors to both sides.

Rows (``ROWS``): one per calibration algorithm with a preset it suits -- max (NVFP4, FP8), smoothquant
(INT8_SMOOTHQUANT_CFG), awq_lite (INT4_AWQ_CFG, W4A8_AWQ_BETA_CFG, NVFP4_AWQ_LITE_CFG), awq_clip and
awq_full (INT4_AWQ_CFG), gptq (INT4_AWQ_CFG's weights), mse and local_hessian (NVFP4_DEFAULT_CFG). Each row
times the wall clock of ``mtq.quantize(model, cfg, forward_loop)`` (quantizer insertion and calibration) in
a fresh subprocess per side and repeat, ours under this interpreter, the reference under
``--reference-python`` (default ``$MODELOPT_REFERENCE_PYTHON``; neither, or ``--no-reference``: skipped),
sides interleaved repeat by repeat; ``ratio`` is ours / the reference's (median). A reference failure shows
as ``n/a (reason)``. ``--before CHECKOUT`` times an earlier version of this library (e.g. a ``git
worktree`` of an older commit) as a third side, interleaved too. Each child also reports how many cores
other processes kept busy meanwhile (``others``).

Forward rows (``FORWARD``: NVFP4_DEFAULT_CFG and FP8_DEFAULT_CFG, max): in one process per side, over the
same calibration batches, the unquantized forward, the calibration forward (``mtq.calibrate(model, "max",
forward_loop)``: every activation quantizer collecting, weights calibrated) and the fake-quant evaluation
forward of the calibrated model, the latter also with the weights' fake quant folded in once (``folded``,
``mtq.fold_weight`` on a copy: what remains is the activations' fake quant), interleaved
``--forward-repeats`` times; reported as min and median seconds and as ratios to the unquantized forward
(target: at most 1.3x).

``--quick``: a 2-layer Llama built in code (hidden 64, vocab 128, random weights) and 2 batches of 32
random tokens instead of the real model, 1 repeat, our side only unless ``--reference-python`` is given (a
smoke test of the script; the unit tests run it). The child processes run from a neutral directory with
``PYTHONPATH`` = this checkout for ours; this file imports neither library at module level.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import _harness as h

#: (row name, preset, algorithm or None for the preset's own)
ROWS = [
    ("max NVFP4", "NVFP4_DEFAULT_CFG", "max"),
    ("max FP8", "FP8_DEFAULT_CFG", "max"),
    ("smoothquant INT8", "INT8_SMOOTHQUANT_CFG", None),
    ("awq_lite INT4", "INT4_AWQ_CFG", None),
    ("awq_lite W4A8", "W4A8_AWQ_BETA_CFG", None),
    ("awq_lite NVFP4", "NVFP4_AWQ_LITE_CFG", None),
    ("awq_clip INT4", "INT4_AWQ_CFG", "awq_clip"),
    ("awq_full INT4", "INT4_AWQ_CFG", "awq_full"),
    ("gptq INT4", "INT4_AWQ_CFG", "gptq"),
    ("mse NVFP4", "NVFP4_DEFAULT_CFG", "mse"),
    ("local_hessian NVFP4", "NVFP4_DEFAULT_CFG", "local_hessian"),
]
QUICK_ROWS = ["smoothquant INT8", "awq_lite INT4", "awq_full INT4"]
FORWARD = ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"]
QUICK_FORWARD = ["NVFP4_DEFAULT_CFG"]


# ----------------------------------------------------------------------------------------------- child


def _load(spec: dict):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
    calib = load_file(spec["data"])["calib"]
    batches = [calib[i : i + 1] for i in range(calib.shape[0])]

    def forward_loop(m):
        with torch.no_grad():
            for b in batches:
                m(b)

    return model, forward_loop


def _mtq(which: str):
    if which == "ours":
        import modelopt_lite.quantization as mtq
    else:
        import modelopt.torch.quantization as mtq
    return mtq


def _config(mtq, preset: str, algorithm: str | None):
    if not hasattr(mtq, preset):
        raise ValueError(f"config {preset} not present in this library")
    cfg = copy.deepcopy(getattr(mtq, preset))
    if algorithm is not None:
        cfg["algorithm"] = algorithm
    return cfg


def _child_row(spec: dict) -> dict:
    model, forward_loop = _load(spec)
    mtq = _mtq(spec["which"])
    cfg = _config(mtq, spec["preset"], spec["algorithm"])
    start = h.CpuMark.now()
    mtq.quantize(model, cfg, forward_loop)
    seconds, others = start.since()
    return {"seconds": seconds, "other_cores_busy": others}


def _child_forward(spec: dict) -> dict:
    """Unquantized, calibration and fake-quant evaluation forwards over the same batches, interleaved; the
    last also with the weights' fake quant folded into them once (``mtq.fold_weight``: ``folded``), so that
    the activations' share of the evaluation's cost shows."""
    model, forward_loop = _load(spec)
    mtq = _mtq(spec["which"])
    plain = copy.deepcopy(model)
    mtq.quantize(model, _config(mtq, spec["preset"], "max"), forward_loop)
    folded = copy.deepcopy(model)  # the weights' fake quant folded once, as a deployed evaluation runs
    mtq.fold_weight(folded)
    for m in (model, plain, folded):
        forward_loop(m)  # warm-up (kernels, allocator)
    start = h.CpuMark.now()
    times = h.time_interleaved(
        {
            "unquantized": lambda: forward_loop(plain),
            "calibration": lambda: mtq.calibrate(model, algorithm="max", forward_loop=forward_loop),
            "evaluation": lambda: forward_loop(model),
            "folded": lambda: forward_loop(folded),
        },
        spec["repeats"],
        warmup=0,
    )
    _, others = start.since()
    return {"times": times, "other_cores_busy": others}


def _child(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    h.run_and_emit(lambda: (_child_forward if spec["kind"] == "forward" else _child_row)(spec))


# ---------------------------------------------------------------------------------------------- parent


def _prepare(args: argparse.Namespace, workdir: str) -> tuple[str, str, str]:
    """(model directory, data file, description) of the model and calibration windows both sides use."""
    import torch
    from safetensors.torch import save_file

    if args.quick:
        model_dir = os.path.join(workdir, "model")
        model = h.tiny_model(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
        )  # fmt: skip
        model.eval().save_pretrained(model_dir)
        calib = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
        what = "tiny Llama (2 layers, hidden 64), 2 x 32 random tokens"
    else:
        from modelopt_lite.data import token_stream, windows
        from modelopt_lite.models import corpus_texts, load_real_model, real_model_path

        count, length = (int(v) for v in args.calib.lower().split("x"))
        model_dir = str(real_model_path(args.model))
        _, tokenizer = load_real_model(args.model)
        calib = windows(token_stream(tokenizer, corpus_texts("fit")), length, count, "the fit split")
        what = f"{args.model}, {count} x {length} tokens of the fit split"
    data = os.path.join(workdir, "data.safetensors")
    save_file({"calib": calib.contiguous()}, data)
    return model_dir, data, what


def _run(
    python: str,
    which: str,
    spec: dict,
    workdir: str,
    threads: int,
    before: str | None = None,
    timeout: float | None = None,
) -> dict:
    path = os.path.join(workdir, f"spec-{which}.json")
    with open(path, "w") as f:
        json.dump({**spec, "which": "ref" if which == "ref" else "ours", "threads": threads}, f)
    cmd = [python, os.path.abspath(__file__), "--child", path]
    pythonpath = {"ours": h.REPO_ROOT, "before": before}.get(which)
    return h.run_child(cmd, h.child_env(threads, pythonpath), cwd=workdir, timeout=timeout)


def _reference(args: argparse.Namespace) -> tuple[str | None, str]:
    if args.no_reference:
        return None, "--no-reference"
    python = args.reference_python or (None if args.quick else h.default_reference_python())
    if not python:
        return None, h.no_reference_python()
    if not os.path.exists(python):
        return None, f"{python} does not exist"
    return python, ""


def main(argv: list[str] | None = None) -> dict:
    parser = h.common(h.parser(__doc__), threads=2, repeats=1, quick="tiny model built in code, a few rows")
    h.hidden(parser, child=())
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calib", default="8x256", help="COUNTxLEN calibration windows (default 8x256)")
    parser.add_argument(
        "--rows", help=f"comma-separated subset of {[r[0] for r in ROWS]} (or algorithm names)"
    )
    parser.add_argument("--no-forward", action="store_true", help="skip the forward-ratio rows")
    parser.add_argument("--forward-repeats", type=int, default=3)
    parser.add_argument("--reference-python", default=None)
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument(
        "--before", help="a checkout of an earlier version of this library, timed as a third side 'before'"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="stop a calibration still running after this many seconds; the row shows '> N' and its ratio "
        "an upper bound (default 900)",
    )
    args = h.common(parser, json="write the results here (rewritten after every row)").parse_args(argv)
    if args.child:
        _child(args.child)
        return {}
    rows = [r for r in ROWS if r[0] in QUICK_ROWS] if args.quick else ROWS
    if args.rows:
        wanted = {w.strip() for w in args.rows.split(",")}
        rows = [r for r in ROWS if r[0] in wanted or r[0].split()[0] in wanted]
        if not rows:
            parser.error(f"--rows {args.rows!r} names none of {[r[0] for r in ROWS]}")
    forward = [] if args.no_forward else (QUICK_FORWARD if args.quick else FORWARD)
    repeats = 1 if args.quick else args.repeats
    ref_python, why = _reference(args)
    sides = {"ours": sys.executable, **({"before": sys.executable} if args.before else {}),
             **({"ref": ref_python} if ref_python else {})}  # fmt: skip
    if not ref_python:
        print(f"reference skipped: {why}", flush=True)
    out: dict = {
        "machine": f"{os.cpu_count()} cores",
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d"),
        "command": h.command(__file__, argv),
        "rows": {},
        "forward": {},
    }
    with tempfile.TemporaryDirectory(prefix="calib_speed_") as workdir:
        model_dir, data, what = _prepare(args, workdir)
        out["data"] = what
        print(f"model and data: {what}; {args.threads} threads, {repeats} repeat(s)", flush=True)
        for name, preset, algorithm in rows:
            spec = {
                "kind": "row",
                "model_dir": model_dir,
                "data": data,
                "preset": preset,
                "algorithm": algorithm,
            }
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            errors: dict[str, dict] = {}
            for _ in range(repeats):
                for side, python in sides.items():
                    if side in errors:
                        continue
                    res = _run(python, side, spec, workdir, args.threads, args.before, args.timeout)
                    if "error" in res:
                        errors[side] = res
                        print(f"  {name:<20} {side:<4} failed: {res['error']}", file=sys.stderr, flush=True)
                        continue
                    runs[side].append(res)
                    print(f"  {name:<20} {side:<4} {res['seconds']:8.1f} s (others "
                          f"{res['other_cores_busy']:.2f} cores)", file=sys.stderr, flush=True)  # fmt: skip
            row = {}
            for side in sides:
                if side in errors:
                    row[side] = {k: v for k, v in errors[side].items() if k in ("error", "timed_out_s")}
                else:
                    row[side] = {**h.time_stats(r["seconds"] for r in runs[side]), "runs": runs[side]}
            out["rows"][name] = {"preset": preset, "algorithm": algorithm or "preset's", **row}
            h.write_json(args.json, out)  # every finished row on disk at once
        for preset in forward:
            spec = {"kind": "forward", "model_dir": model_dir, "data": data, "preset": preset,
                    "algorithm": "max", "repeats": 1 if args.quick else args.forward_repeats}  # fmt: skip
            entry = {}
            for side, python in sides.items():
                if side == "before":
                    continue
                res = _run(python, side, spec, workdir, args.threads)
                if "error" in res:
                    entry[side] = {"error": res["error"]}
                    continue
                t = res["times"]
                base = statistics.median(t["unquantized"])
                entry[side] = {kind: {**h.time_stats(v), "ratio": statistics.median(v) / base}
                               for kind, v in t.items()}  # fmt: skip
                entry[side]["other_cores_busy"] = res["other_cores_busy"]
            out["forward"][preset] = entry
            h.write_json(args.json, out)  # every finished row on disk at once
    _print(out, sides)
    return out


def _ratio(ours: dict | None, ref: dict | None) -> str:
    """ours / reference (median); ``< x`` when the reference was stopped at the timeout."""
    if not ours or not ref or "error" in ours:
        return "n/a"
    if "timed_out_s" in ref:
        return f"< {ours['median_s'] / ref['timed_out_s']:.2f}"
    return "n/a" if "error" in ref else f"{ours['median_s'] / ref['median_s']:.2f}"


def _print(out: dict, sides: dict) -> None:
    print(f"\ncalibration time, seconds, median (min); {out['data']}; {out['threads']} threads")
    before = "before" in sides
    print(
        f"{'row':<22}{'ours':>18}"
        + (f"{'before':>18}" if before else "")
        + f"{'reference':>22}{'ours / ref':>12}"
    )
    for name, row in out["rows"].items():
        ours, ref = row.get("ours"), row.get("ref")
        ratio = _ratio(ours, ref)
        old = f"{h.fmt_cell(row.get('before'), '.1f', 60):>18}" if before else ""
        print(f"{name:<22}{h.fmt_cell(ours, '.1f', 60):>18}{old}{h.fmt_cell(ref, '.1f', 60):>22}{ratio:>12}")
    if out["forward"]:
        print("\nforward over the calibration batches, seconds median (min), / unquantized (target <= 1.3)")
        for preset, entry in out["forward"].items():
            for side, res in entry.items():
                if "error" in res:
                    print(f"{preset:<20}{side:<6}n/a ({res['error'][:60]})")
                    continue
                cells = "  ".join(f"{k} {h.fmt_median_min(v, '.2f')} = {v['ratio']:.2f}x"
                                  for k, v in res.items() if isinstance(v, dict))  # fmt: skip
                print(f"{preset:<20}{side:<6}{cells}")


if __name__ == "__main__":
    main()
