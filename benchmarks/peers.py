"""How much PTQ gap do our QAT / QAD recover against torchao's and nvidia-modelopt's, on one model and budget?

Published in ``docs/accuracy.md``, "Side by side with the peers" (``docs/peers.json``: the commands there,
run side by side, then merged) and ``docs/real_qad.md`` (FP8 on SmolLM2-135M), for example:

    python benchmarks/peers.py --make-venvs DIR          # once: DIR/torchao and DIR/modelopt virtualenvs
    TORCHAO_PYTHON=DIR/torchao/bin/python MODELOPT_REFERENCE_PYTHON=DIR/modelopt/bin/python \\
    MODELOPT_LITE_CACHE=... OMP_WAIT_POLICY=PASSIVE python benchmarks/peers.py --models bench-dense \\
        --formats int4,fp8 --no-ours --json peers.json
    python benchmarks/peers.py --merge ours.json peers.json --json docs/peers.json

(``--quick``: 4 steps, 4 calibration / evaluation windows, a smoke run).

Rows, per format (``nvfp4`` W4A4 NVFP4, ``int4`` INT4 weight-only groups of 128, ``fp8`` W8A8 FP8):

* ours: ``benchmarks/accuracy.py``'s PTQ / ``qat`` / ``qad`` rows (``nvfp4_nokv``, ``int4``, ``fp8``) and
  its ``ft`` control, measured by its own ``measure``;
* torchao (``--torchao-python``, default ``$TORCHAO_PYTHON``): ``QATConfig(base, step="prepare")`` with
  ``NVFP4DynamicActivationNVFP4WeightConfig``, ``Int4WeightOnlyConfig(group_size=128)`` and
  ``Float8DynamicActivationFloat8WeightConfig``, trained by a plain ``transformers.Trainer``; its "ptq" row
  is the prepared (fake-quantized) model before training; torchao has no QAD;
* nvidia-modelopt (``--modelopt-python``, default ``$MODELOPT_REFERENCE_PYTHON``): ``mtq.quantize`` with
  ``NVFP4_DEFAULT_CFG`` / ``INT4_BLOCKWISE_WEIGHT_ONLY_CFG`` / ``FP8_DEFAULT_CFG``, then its ``QATTrainer``
  and ``QADTrainer``.

A peer runs in its own interpreter (``benchmarks/_peer_worker.py``); a peer left unset is skipped. This
script exports the data our rows use (the ``fit`` training windows, which every trainer shuffles the
same way since they share the training arguments and seed, the calibration windows, the validation and
test windows) to a safetensors file and passes the benchmark model's folder (a Hugging Face checkpoint).
Every model is measured by ``accuracy.py``'s perplexity and KL. Recovery as in ``accuracy.py``: QAT against
the ``ft`` control, QAD against the unquantized model, each against its own library's PTQ row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h
import accuracy

FORMATS = ("nvfp4", "int4", "fp8")
OUR_PTQ = {"nvfp4": "nvfp4_nokv", "int4": "int4", "fp8": "fp8"}  # format -> accuracy.py PTQ row
WORKER = str(Path(__file__).with_name("_peer_worker.py"))
#: what --make-venvs installs next to this interpreter's torch / transformers / accelerate / safetensors
#: (nvidia-modelopt 0.47 imports ``requests`` without declaring it)
PEER_PACKAGES = {"torchao": ["torchao==0.18.*"], "modelopt": ["nvidia-modelopt==0.47.*", "requests"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = h.common(h.parser(__doc__), threads=1, seed=0, quick="4 steps, 4 calibration / eval windows")
    p.add_argument("--models", default="bench-dense", help="comma-separated benchmark models")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated: {', '.join(FORMATS)}")
    p.add_argument("--torchao-python", default=h.default_reference_python(h.TORCHAO_PYTHON_ENV))
    p.add_argument("--modelopt-python", default=h.default_reference_python())
    p.add_argument("--make-venvs", metavar="DIR", help="create DIR/torchao and DIR/modelopt, then exit")
    p.add_argument("--no-ours", dest="ours", action="store_false", help="skip our rows (peers only)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--calib-size", type=int, default=32)
    p.add_argument("--eval-windows", type=int, default=None)
    p.add_argument(
        "--merge", nargs="+", metavar="JSON", help="measure nothing: combine the --json files of earlier runs"
    )
    args = h.common(p, json="write the numbers here", md="write the markdown table here").parse_args(argv)
    args.models, args.formats = h.csv(args.models), h.csv(args.formats)
    bad = [f for f in args.formats if f not in FORMATS] + [m for m in args.models if m not in accuracy.MODELS]
    if bad:
        p.error(f"unknown {bad}: --formats from {list(FORMATS)}, --models from {list(accuracy.MODELS)}")
    if args.quick:
        args.steps, args.calib_size, args.eval_windows = 4, 4, args.eval_windows or 4
    return args


def make_venvs(root: str) -> None:
    """``root/torchao`` and ``root/modelopt``: torch, transformers, accelerate and safetensors at this
    interpreter's versions and the peer library. torch is pinned without its local tag (``+cpu``): pip
    takes a matching CPU build where one is at hand (a local wheel, or PyTorch's CPU index given in
    ``PIP_EXTRA_INDEX_URL``), else the registry's default build."""
    import accelerate
    import safetensors
    import torch
    import transformers

    common = [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}",
              f"accelerate=={accelerate.__version__}", f"safetensors=={safetensors.__version__}"]  # fmt: skip
    envs = {"torchao": h.TORCHAO_PYTHON_ENV, "modelopt": h.REFERENCE_PYTHON_ENV}
    for name, packages in PEER_PACKAGES.items():
        print(f"export {envs[name]}={h.make_venv(Path(root) / name, [*common, *packages])}")


def export_data(path: str, evals: dict[str, Any], calib_batches: list[Any], train_set: Any) -> None:
    """The windows of every row, as ``accuracy.load_data`` made them, in one safetensors file."""
    import torch
    from safetensors.torch import save_file

    tensors = {"train": train_set.ids, "calib": torch.cat(calib_batches), **evals}
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def run_peer(peer: str, python: str, spec_path: str, threads: int) -> dict[str, Any]:
    """The worker's result under ``python`` (its progress goes to this stderr), or ``{"error": ...}``."""
    env = h.child_env(threads, h.REPO_ROOT, keep_pythonpath=False)
    cmd = [python, WORKER, "--peer", peer, "--spec", spec_path]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    results = h.parse_results(proc.stdout)
    return results[-1] if results else {"error": f"worker exited {proc.returncode} without a result"}


def accuracy_args(kind: str, args: argparse.Namespace) -> argparse.Namespace:
    """``accuracy.py``'s arguments for our rows and for the data every row shares: the formats' PTQ rows,
    their ``qat`` / ``qad`` rows, the ``ft`` control; a real model's evaluation windows as ``accuracy.py``
    cuts them (512 tokens), no off-distribution rows (the peers measure validation and test only)."""
    ptq = [OUR_PTQ[f] for f in args.formats]
    flags = {
        "--models": kind,
        "--threads": args.threads,
        "--seeds": args.seed,
        "--steps": args.steps,
        "--batch-size": args.batch_size,
        "--seq-len": args.seq_len,
        "--lr": repr(args.lr),
        "--temperature": repr(args.temperature),
        "--calib-size": args.calib_size,
        "--ptq": ",".join(ptq),
        "--rows": ",".join(f"{m} {r}" for r in ptq for m in ("qat", "qad")),
    }
    ns = accuracy.parse_args([str(x) for flag in flags.items() for x in flag])
    ns.eval_windows, ns.offdist_tokens = args.eval_windows, 0
    return ns


def measure_ours(kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``accuracy.measure`` on :func:`accuracy_args`' rows, each row marked with its library and format."""
    rows = accuracy.measure(kind, accuracy_args(kind, args))["rows"]
    fmt_of = {f"ptq {row}": fmt for fmt, row in OUR_PTQ.items()}
    for row in rows:
        row["library"] = "ours"
        row["format"] = fmt_of.get(row.get("starts_from", row["name"]), "")
    return rows


def with_recovery(rows: list[dict[str, Any]]) -> None:
    """Recovery of every trained row against its own library's PTQ row of the same format: QAT against the
    ``ft`` control, QAD against the unquantized model (ours; a peer's when ours did not run)."""
    bases = [r for r in rows if r["method"] == "baseline"]
    if not bases:
        return
    baseline = next((r for r in bases if r["library"] == "ours"), bases[0])
    ft = next((r for r in rows if r["method"] == "ft"), None)
    ptq = {(r["library"], r["format"]): r for r in rows if r["method"] == "ptq"}
    for row in rows:
        start = ptq.get((row["library"], row["format"]))
        if row["method"] not in ("qat", "qad", "converted") or start is None:
            continue
        goal = ft if row["method"] in ("qat", "converted") else baseline
        for split in ("val", "test"):
            row[f"{split}_recovery"] = (
                None
                if goal is None
                else accuracy._share(start[f"{split}_ppl"], row[f"{split}_ppl"], goal[f"{split}_ppl"])
            )
        row["kl_recovery"] = 1 - row["kl"] / start["kl"] if start["kl"] > 0 else None


def measure(kind: str, args: argparse.Namespace, work: str) -> dict[str, Any]:
    from modelopt_lite.models import default_model_path

    t0 = time.perf_counter()
    _, _, evals, calib_batches, train_set = accuracy.load_data(kind, accuracy_args(kind, args))
    data = os.path.join(work, f"{kind}-data.safetensors")
    export_data(data, evals, calib_batches, train_set)
    spec = {
        "model_dir": str(default_model_path(kind, train_if_missing=False)),
        "data": data,
        "formats": args.formats,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "temperature": args.temperature,
        "threads": args.threads,
        "calib_batch": accuracy.CALIB_BATCH,
    }
    spec_path = os.path.join(work, f"{kind}-spec.json")
    Path(spec_path).write_text(json.dumps(spec))
    rows = measure_ours(kind, args) if args.ours else []
    peers: dict[str, Any] = {}
    for peer, python in (("torchao", args.torchao_python), ("modelopt", args.modelopt_python)):
        if not python:
            env = h.TORCHAO_PYTHON_ENV if peer == "torchao" else h.REFERENCE_PYTHON_ENV
            why = h.no_reference_python(f"--{peer}-python", env)
            print(f"\n## {kind}: {peer} skipped ({why})", flush=True)
            continue
        print(f"\n## {kind}: {peer} ({python})", flush=True)
        res = run_peer(peer, python, spec_path, args.threads)
        peers[peer] = {k: v for k, v in res.items() if k != "rows"}
        for row in res.get("rows", []):
            row["library"] = peer
            rows.append(row)
    with_recovery(rows)
    return {"kind": kind, "seconds": round(time.perf_counter() - t0, 1), "peers": peers, "rows": rows}


def combine(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result per model: the rows of runs on the same model together (e.g. ours and ``--no-ours``
    run side by side, then ``--merge``d), recovery recomputed over all of them."""
    by_kind: dict[str, dict[str, Any]] = {}
    for res in results:
        into = by_kind.setdefault(res["kind"], {"kind": res["kind"], "seconds": 0.0, "peers": {}, "rows": []})
        into["seconds"] += res["seconds"]
        into["peers"].update(res["peers"])
        into["rows"] += res["rows"]
    for res in by_kind.values():
        with_recovery(res["rows"])
    return list(by_kind.values())


# ---------------------------------------------------------------------------------------------- output


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def markdown(results: list[dict[str, Any]]) -> str:
    """Per model and format: each library's PTQ, QAT and QAD rows (perplexity, recovery, KL, train time)."""
    lines = [
        "| model | format | library | row | val ppl | test ppl | val recovery | test recovery | KL (1e-3) "
        "| train s |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    order = {"baseline": 0, "ft": 1, "ptq": 2, "qat": 3, "converted": 4, "qad": 5}
    libs = {"ours": 0, "torchao": 1, "modelopt": 2}
    for res in results:
        rows = [r for r in res["rows"] if not (r["method"] == "baseline" and r["library"] != "ours")]
        rows.sort(key=lambda r: (r["format"], order[r["method"]], libs[r["library"]]))
        for r in rows:
            lines.append(
                f"| {res['kind']} | {r['format'] or '-'} | {r['library']} | {r['name']} | {r['val_ppl']:.3f} "
                f"| {r['test_ppl']:.3f} | {_pct(r.get('val_recovery'))} | {_pct(r.get('test_recovery'))} "
                f"| {1e3 * r['kl']:.3f} | {r.get('train_seconds', '')} |"
            )
    return "\n".join(lines)


def errors(results: list[dict[str, Any]]) -> list[str]:
    """``model: peer: what failed: error`` for every peer error."""
    out = []
    for res in results:
        for peer, info in res["peers"].items():
            if "error" in info:
                out.append(f"{res['kind']}: {peer}: worker: {info['error']}")
            for key, err in info.get("errors", {}).items():
                out.append(f"{res['kind']}: {key}: {err}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_venvs:
        make_venvs(args.make_venvs)
        return 0
    h.pin_threads(args.threads)
    start = time.perf_counter()
    if args.merge:
        runs = [json.loads(Path(f).read_text()) for f in args.merge]
        results = combine([m for run in runs for m in run["models"]])
        budget = " | ".join(sorted({run["meta"]["budget"] for run in runs}))
    else:
        budget = (
            f"{args.steps} steps x {args.batch_size} x {args.seq_len} tokens, lr {args.lr:g} (warm-up 10%, "
            f"cosine), AdamW, QAD T={args.temperature:g}, seed {args.seed}, {args.threads} thread(s)"
        )
        with tempfile.TemporaryDirectory(prefix="peers-bench-") as work:
            results = [measure(kind, args, work) for kind in args.models]
    table, errs = markdown(results), errors(results)
    wall = time.perf_counter() - start
    text = "\n".join(
        [table, "", budget + ".", *(["", "Peer errors:", *(f"- {e}" for e in errs)] if errs else [])]
    )
    print(f"\n{text}\n\nTotal wall time {wall / 60:.1f} min.")
    h.write_text(args.md, text)
    if args.json:
        meta = {**h.run_meta(__file__, argv, wall), "budget": budget, "errors": errs}
        meta["merged"] = [run["meta"] for run in runs] if args.merge else None
        h.write_json(args.json, {"meta": meta, "models": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
