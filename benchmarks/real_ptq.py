"""How close is our PTQ of a real LLM to nvidia-modelopt's and torchao's, and does its export reload exactly?

Published in ``docs/real_model.md``, "PTQ on SmolLM2-135M" (``docs/real_ptq.json`` / ``.png``: these two runs,
joined with ``--report``; its other sections give their own commands):

    export MODELOPT_LITE_CACHE=... MODELOPT_REFERENCE_PYTHON=DIR/modelopt/bin/python \\
        TORCHAO_PYTHON=DIR/torchao/bin/python
    python benchmarks/real_ptq.py --calib-size 4 --calib-seq 256 --eval-windows 8 --roundtrip-windows 2 \\
        --peer-timeout 5600 --json run.json
    MODELOPT_REFERENCE_PYTHON= python benchmarks/real_ptq.py --calib-size 4 --calib-seq 256 \\
        --eval-windows 8 --roundtrip-windows 2 --formats int8_wo,int4_awq,w4a16_nvfp4 --kv-rows "" \\
        --torchao-rows intx4_wo_g64,nvfp4_wo --json fix.json

One model, one set of windows for every row: the first ``--calib-size`` windows of ``--calib-seq`` tokens of
the corpus' ``fit`` split calibrate (batches of ``--batch-size``), the first ``--eval-windows`` windows of
``--eval-seq`` tokens of its ``test`` split evaluate (``modelopt_lite.evaluation``'s protocol). The
unquantized model's next-token log-probabilities on them are written once, one safetensors file per batch,
and every row (ours, the reference's, torchao's; each library in its own interpreter) is measured by
``_real_ptq_peer.measure`` against them in one pass: perplexity, KL(unquantized || quantized) in nats per
predicted token, top-1 agreement. No process holds more than one batch of log-probabilities.

Rows:

* ours: each ``--qformat`` of ``modelopt_lite.cli.ptq.QFORMATS`` (``build_config``), and KV-cache rows
  (``nvfp4+fp8kv`` ...), each on its own float32 copy read from the checkpoint (one model in the process
  at a time). After calibration the shared scales are unified as the export does first (q/k/v,
  gate/up: ``unify_shared_scales``), so the measured fake-quant model is the one exported. Then
  (``--roundtrip``) the export (``export_hf_checkpoint``; unquantized tensors in float32, as the model) is
  reloaded with its activation and KV-cache quantization rebuilt from the stored scales
  (``load_hf_checkpoint(dir, activations="fake")``, dequantized and ``compress=True``), each measured on the
  first ``--roundtrip-windows`` test windows against the full fake-quant model; then (rows without KV cache,
  whose weights are their base row's) reloaded with dense activations, dequantized
  (``AutoModelForCausalLM.from_pretrained``) and packed (``load_hf_checkpoint(dir, compress=True)``), against
  the fake-quant model with only its weight quantizers enabled; the row records how the export wrote the
  tied ``lm_head``. ``--formats`` and ``--kv-rows`` choose the rows (``--kv-rows ''``: none).
* nvidia-modelopt (``--reference-python``, default ``$MODELOPT_REFERENCE_PYTHON``): the same preset names
  (``update_quant_cfg_with_kv_cache_quant`` for KV), calibrated on the same batches, measured fake-quantized;
  then measured again after ``requantize_resmooth_fused_llm_layers``, the in-place step its
  ``export_hf_checkpoint`` runs before writing (one averaged AWQ / SmoothQuant ``pre_quant_scale`` for q/k/v
  and for gate/up, folded into the norm; one input amax and NVFP4 global amax per group): the model it
  ships, activations still quantized. Then exported for its size (or its error).
* torchao (``--torchao-python``, default ``$TORCHAO_PYTHON``): ``quantize_`` with each config of
  ``_real_ptq_peer.TORCHAO_CONFIGS`` on every linear but ``lm_head``; a config that fails records its error.

A peer left unset is skipped; a row that fails records its error, and ``--json`` is rewritten after each of
our rows. The reference worker runs in the background while our rows run (``--threads`` each); torchao
runs after our rows. At 1.5B in float32 the two do not fit 24 GB side by side: run the reference with
``--no-ours`` and ours without ``--reference-python``, then join the two ``--json`` files with
``--report``. ``--quick``: 4 x 128 calibration tokens, 2 x 128 evaluation, rows fp8 and int4_awq.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _harness as h
import _real_ptq_peer as peer
from _real_ptq_report import GOAL, ROUNDTRIP_GOAL, comparison, markdown, plot, table

WORKER = str(Path(__file__).with_name("_real_ptq_peer.py"))
__all__ = [
    "GOAL",
    "KV_ROWS",
    "ROUNDTRIP_GOAL",
    "comparison",
    "main",
    "markdown",
    "parse_args",
    "plot",
    "table",
]
#: KV-cache rows: name -> (qformat, kv_cache_qformat)
KV_ROWS = {
    "nvfp4+fp8kv": ("nvfp4", "fp8"),
    "nvfp4+nvfp4kv": ("nvfp4", "nvfp4"),
    "fp8+fp8kv": ("fp8", "fp8"),
    "nvfp4+fp8affinekv": ("nvfp4", "fp8_affine"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from modelopt_lite.cli.ptq import QFORMATS

    p = h.real_model_flags(h.parser(__doc__))
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--formats", default=",".join(QFORMATS), help="comma-separated --qformat names")
    p.add_argument("--kv-rows", default=",".join(KV_ROWS), help=f"comma-separated from {list(KV_ROWS)}")
    p.add_argument("--torchao-rows", default=",".join(peer.TORCHAO_CONFIGS))
    h.common(
        p, threads=(1, "threads of each process (ours and a peer's)"), seed=0, reference="nvidia-modelopt's"
    )
    p.add_argument("--torchao-python", default=h.default_reference_python(h.TORCHAO_PYTHON_ENV))
    p.add_argument("--no-ours", dest="ours", action="store_false")
    p.add_argument("--no-roundtrip", dest="roundtrip", action="store_false", help="skip export and reload")
    p.add_argument(
        "--roundtrip-windows",
        type=int,
        default=None,
        help="the first this many test windows measure the export round trip (default: all)",
    )
    p.add_argument("--peer-timeout", type=float, default=3600, help="seconds per peer worker")
    p.add_argument("--workdir", help="keep the reference log-probabilities and exports here (default: temp)")
    h.common(p, quick="4 x 128 calibration, 2 x 128 evaluation", json="", md="", png="")
    p.add_argument(
        "--report",
        nargs="+",
        metavar="JSON",
        help="measure nothing: the tables and figure (with --json: the merged file) of the --json files of "
        "runs on the same windows (a later file's rows add to or replace earlier ones, by library and name)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.calib_size, args.calib_seq, args.eval_windows, args.eval_seq, args.batch_size = 4, 128, 2, 128, 2
        args.formats = "fp8,int4_awq" if args.formats == p.get_default("formats") else args.formats
        args.kv_rows = "" if args.kv_rows == p.get_default("kv_rows") else args.kv_rows
        args.torchao_rows = (
            "int8_wo" if args.torchao_rows == p.get_default("torchao_rows") else args.torchao_rows
        )
    if args.roundtrip_windows is None or args.roundtrip_windows > args.eval_windows:
        args.roundtrip_windows = args.eval_windows
    args.formats = [f for f in args.formats.split(",") if f]
    args.kv_rows = [k for k in args.kv_rows.split(",") if k]
    args.torchao_rows = [t for t in args.torchao_rows.split(",") if t]
    bad = [f for f in args.formats if f not in QFORMATS] + [k for k in args.kv_rows if k not in KV_ROWS]
    bad += [t for t in args.torchao_rows if t not in peer.TORCHAO_CONFIGS]
    if bad:
        p.error(f"unknown rows {bad}: --formats from {list(QFORMATS)}, --kv-rows from {list(KV_ROWS)}, "
                f"--torchao-rows from {list(peer.TORCHAO_CONFIGS)}")  # fmt: skip
    return args


def rows_of(args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """Our / the reference's rows: name -> (qformat, kv_cache_qformat)."""
    return {**{f: (f, "none") for f in args.formats}, **{k: KV_ROWS[k] for k in args.kv_rows}}


# ------------------------------------------------------------------------------------------------- data


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Model folder, windows (saved for the workers), the unquantized row and its stored log-probabilities."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modelopt_lite.data import token_stream, windows
    from modelopt_lite.models import corpus_texts, real_model_path

    model_dir = args.model_dir or str(real_model_path(args.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    calib = windows(token_stream(tok, corpus_texts("fit")), args.calib_seq, args.calib_size, "fit split")
    test = windows(token_stream(tok, corpus_texts("test")), args.eval_seq, args.eval_windows, "test split")
    if len(calib) < args.calib_size or len(test) < args.eval_windows:
        raise ValueError(f"the corpus has {len(calib)} calibration / {len(test)} test windows; fewer asked")
    data = str(work / "data.safetensors")
    save_file({"calib": calib.contiguous(), "test": test.contiguous()}, data)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref_dir = work / "reference_logprobs"
    start = time.perf_counter()
    peer.write_reference(base, test, ref_dir, args.batch_size)
    row = {"library": "baseline", "name": "unquantized", **peer.measure(base, test, ref_dir, args.batch_size)}
    row["seconds"] = time.perf_counter() - start
    print(
        f"unquantized: test ppl {row['ppl']:.4f} on {test.numel() - len(test)} predicted tokens", flush=True
    )
    del base  # every row loads its own copy: one model in this process, not two (1.5B in float32: 7 GB each)
    return {"model_dir": model_dir, "tokenizer": tok, "calib": calib, "test": test, "data": data,
            "ref_dir": str(ref_dir), "baseline": row}  # fmt: skip


# ------------------------------------------------------------------------------------------------- ours


def lm_head_report(export_dir: Path, reloaded: Any) -> dict[str, Any]:
    """How the export wrote the tied ``lm_head``: config flag, whether a separate tensor is stored, whether
    ``exclude_modules`` names it, and whether the reloaded model shares the embedding."""
    from safetensors import safe_open

    keys: set[str] = set()
    for f in export_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            keys |= set(st.keys())
    config = json.loads((export_dir / "config.json").read_text())
    hf = json.loads((export_dir / "hf_quant_config.json").read_text())["quantization"]
    head = getattr(reloaded, "lm_head", None)
    embed = reloaded.get_input_embeddings()
    return {
        "tie_word_embeddings": config.get("tie_word_embeddings"),
        "lm_head_tensor_stored": any(k.startswith("lm_head.") for k in keys),
        "lm_head_in_exclude_modules": "lm_head" in (hf.get("exclude_modules") or []),
        "embedding_dtype": str(embed.weight.dtype),
        "reloaded_tied": head is not None and head.weight.data_ptr() == embed.weight.data_ptr(),
    }


def weight_only(model: Any) -> int:
    """Disable every enabled quantizer but the weight quantizers (activations, KV cache), in place: the
    arithmetic a dequantized reload computes. Returns how many were disabled."""
    from modelopt_lite.nn import TensorQuantizer

    n = 0
    for name, module in model.named_modules():
        weight = any(part.endswith(("weight_quantizer", "weight_quantizers")) for part in name.split("."))
        if isinstance(module, TensorQuantizer) and module.is_enabled and not weight:
            module.disable()
            n += 1
    return n


def recovered_amax(model: Any, export_dir: Path) -> int:
    """Give the fake-quant model's static input and KV-cache quantizers the amax a reload recovers from the
    export (``stored scale * max``, within an ulp of the calibrated one), in place; returns how many amax
    changed. The model then differs from the reload with ``activations="fake"`` only by the weights'
    dequantization (bit-exact or within a few ulp)."""
    import torch
    from safetensors import safe_open

    from modelopt_lite.export.load.activations import _KV_MAX
    from modelopt_lite.nn import TensorQuantizer
    from modelopt_lite.quantization.compress.packers import INPUT_SCALE_BOUND

    stored: dict[str, torch.Tensor] = {}
    for f in Path(export_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                if key.endswith(("input_scale", "k_scale", "v_scale")):
                    stored[key] = st.get_tensor(key)
    changed = 0
    with torch.no_grad():
        for name, q in model.named_modules():
            if not isinstance(q, TensorQuantizer) or not q.is_enabled or q.amax is None:
                continue
            owner, _, slot = name.rpartition(".")
            if slot == "input_quantizer" and f"{owner}.input_scale" in stored:
                amax = stored[f"{owner}.input_scale"].float() * INPUT_SCALE_BOUND[q.spec.kind]
            elif slot in ("k_bmm_quantizer", "v_bmm_quantizer"):
                x = slot[0]
                amax = stored[f"{owner}.{x}_proj.{x}_scale"].float() * _KV_MAX
            else:
                continue
            amax = amax.to(q.amax.device).reshape(q.amax.shape)
            changed += int(not torch.equal(amax, q.amax))
            q.amax = amax
    return changed


def _reload_rows(
    row: dict[str, Any], loaders: dict[str, Any], target: float, windows: Any, prep: dict[str, Any], args: Any
) -> None:
    """Load each of ``loaders`` (``{row key: loader}``), measure it on ``windows`` and record its perplexity
    relative to ``target`` in ``row[key]`` (an error recorded instead)."""
    for kind, load in loaders.items():
        try:
            reloaded = load().eval()
            if kind == "dequantized":
                row["lm_head"] = lm_head_report(prep["export_dir"], reloaded)
            m = peer.measure(reloaded, windows, prep["ref_dir"], args.batch_size)
            row[kind] = {
                "ppl": m["ppl"],
                "kl": m["kl"],
                "top1": m["top1"],
                "rel_ppl_vs_fake": m["ppl"] / target - 1,
            }
            del reloaded
        except Exception as err:  # recorded in the row
            row[kind] = {"error": h.error_text(err, 400)}


def roundtrip(row: dict[str, Any], model: Any, prep: dict[str, Any], args: Any, out: Path) -> None:
    """Export ``model``; reload it with its activation (and KV-cache) quantization rebuilt from the stored
    scales (``load_hf_checkpoint(dir, activations="fake")``, dequantized and packed) and measure both on the
    first ``--roundtrip-windows`` windows against the full fake-quant model; unless it is a KV-cache row,
    also reload it with dense activations, dequantized and packed, against the fake-quant model with only its
    weight quantizers enabled (errors recorded per stage)."""
    import torch
    from transformers import AutoModelForCausalLM

    from modelopt_lite.export import export_hf_checkpoint, load_hf_checkpoint

    try:
        result = export_hf_checkpoint(model, out, tokenizer=prep["tokenizer"], overwrite=True)
        quant = result.hf_quant_config["quantization"]
        row["export_mb"] = sum(f.stat().st_size for f in Path(out).glob("*.safetensors")) / 1e6
        row["quant_algo"] = quant.get("quant_algo")
        row["kv_cache_quant_algo"] = quant.get("kv_cache_quant_algo")
        row["bytes_vs_bf16"] = result.ratios
    except Exception as err:  # recorded in the row
        row["export_error"] = h.error_text(err, 400)
        return
    windows = prep["test"][: args.roundtrip_windows]
    prep = {**prep, "export_dir": out}
    full = peer.measure(model, windows, prep["ref_dir"], args.batch_size)["ppl"]
    row["full_fake_ppl"] = {"ppl": full, "windows": len(windows)}
    _reload_rows(
        row,
        {
            "dequantized_act": lambda: load_hf_checkpoint(out, torch.float32, activations="fake"),
            "compressed_act": lambda: load_hf_checkpoint(
                out, torch.float32, compress=True, activations="fake"
            ),
        },
        full,
        windows,
        prep,
        args,
    )
    changed = recovered_amax(model, out)
    m = peer.measure(model, windows, prep["ref_dir"], args.batch_size)["ppl"]
    row["fake_recovered_amax_ppl"] = {"ppl": m, "rel_ppl_vs_fake": m / full - 1, "changed_amax": changed}
    if row["kv"] == "none":  # a KV-cache row's weights are those of the row without KV cache
        disabled = weight_only(model)
        target = peer.measure(model, windows, prep["ref_dir"], args.batch_size)["ppl"]
        row["weight_only_fake_ppl"] = {
            "ppl": target,
            "windows": len(windows),
            "disabled_quantizers": disabled,
        }
        loaders = {
            "dequantized": lambda: AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32),
            "compressed": lambda: load_hf_checkpoint(out, torch.float32, compress=True),
        }
        _reload_rows(row, loaders, target, windows, prep, args)
    shutil.rmtree(out, ignore_errors=True)


def our_rows(prep: dict[str, Any], args: argparse.Namespace, work: Path, sink: Any) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    import modelopt_lite.quantization as mtq
    from modelopt_lite.cli.ptq import NOT_EXPORTABLE, QFORMATS, build_config
    from modelopt_lite.export.layers import unify_shared_scales

    rows: list[dict[str, Any]] = []
    batches = list(prep["calib"].split(args.batch_size))
    for name, (qformat, kv) in rows_of(args).items():
        row: dict[str, Any] = {"library": "ours", "name": name, "preset": QFORMATS[qformat], "kv": kv}
        start = time.perf_counter()
        try:
            model = AutoModelForCausalLM.from_pretrained(prep["model_dir"], dtype=torch.float32).eval()
            clock = time.perf_counter()
            with torch.no_grad():
                mtq.quantize(model, build_config(qformat, kv), batches)
            row["calib_s"] = time.perf_counter() - clock
            row["unified_quantizers"] = len(unify_shared_scales(model))  # as the export does first
            row.update(peer.measure(model, prep["test"], prep["ref_dir"], args.batch_size))
            print(
                f"  ours {name:<14} ppl {row['ppl']:.4f}  KL {row['kl']:.4e}  top1 {row['top1']:.4f}",
                flush=True,
            )
            if args.roundtrip and qformat not in NOT_EXPORTABLE:
                roundtrip(row, model, prep, args, work / "ours" / name)
            elif args.roundtrip:
                row["export_error"] = f"not exportable ({qformat} is in cli.ptq.NOT_EXPORTABLE)"
            del model
        except Exception as err:  # recorded in the row
            row["error"] = h.error_text(err, 400)
            print(f"  ours {name}: {row['error']}", flush=True)
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        sink(rows)
    return rows


# ------------------------------------------------------------------------------------------------ peers


def run_worker(name: str, python: str, spec: dict[str, Any], work: Path, args: argparse.Namespace) -> dict:
    """A peer worker's rows (``@@ROW`` lines, kept when it is stopped at ``--peer-timeout``) and result."""
    result = peer.run_worker(WORKER, python, spec, work, name, threads=args.threads,
                             timeout=args.peer_timeout, args=["--peer", name])  # fmt: skip
    if result.get("error", "").startswith("stopped after"):
        result["error"] = f"stopped after --peer-timeout {args.peer_timeout:.0f} s"
    return result


def peer_spec(prep: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    return {"model_dir": prep["model_dir"], "data": prep["data"], "ref_dir": prep["ref_dir"],
            "eval_batch": args.batch_size, "calib_batch": args.batch_size, "threads": args.threads,
            "seed": args.seed}  # fmt: skip


def reference_run(prep: dict[str, Any], args: argparse.Namespace, work: Path, out: dict[str, Any]) -> None:
    from modelopt_lite.cli.ptq import KV_FORMATS, QFORMATS

    rows = [{"name": n, "preset": QFORMATS[q], "kv": KV_FORMATS[kv]} for n, (q, kv) in rows_of(args).items()]
    export_root = str(work / "reference_exports") if args.roundtrip else None
    spec = {**peer_spec(prep, args), "rows": rows, "export_root": export_root}
    out["modelopt"] = run_worker("modelopt", args.reference_python, spec, work, args)


def torchao_run(prep: dict[str, Any], args: argparse.Namespace, work: Path, out: dict[str, Any]) -> None:
    spec = {**peer_spec(prep, args), "rows": [{"name": t, "config": t} for t in args.torchao_rows]}
    out["torchao"] = run_worker("torchao", args.torchao_python, spec, work, args)


# ---------------------------------------------------------------------------------------------- main


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run with the rows of the later ones added (same name: replaced), per library; the runs must
    share the model, calibration and evaluation windows and the baseline."""
    first = copy.deepcopy(runs[0])
    keys = ("model", "calibration", "evaluation")
    for run in runs[1:]:
        same = all(run["meta"][k] == first["meta"][k] for k in keys) and math.isclose(
            run["baseline"]["ppl"], first["baseline"]["ppl"], rel_tol=1e-9
        )
        if not same:
            raise ValueError(
                f"--report: runs differ in {keys} or the baseline: {first['meta']} / {run['meta']}"
            )

        def combine(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
            by_name = {r["name"]: r for r in old}
            by_name.update({r["name"]: r for r in new})
            return list(by_name.values())

        first["ours"] = combine(first["ours"], run["ours"])
        for lib, res in run["peers"].items():
            mine = first["peers"].setdefault(lib, {**res, "rows": []})
            mine["rows"] = combine(mine["rows"], res.get("rows", []))
        first["meta"]["command"] += " + " + run["meta"]["command"]
    first["comparison"] = comparison(first)
    return first


def report(result: dict[str, Any], args: argparse.Namespace) -> int:
    """Print the tables; write ``--md`` and ``--png`` (and name ``--json``, written by now)."""
    print("\n" + table(result) + "\n")
    h.write_text(args.md, markdown(result))
    if args.png:
        plot(result, args.png)
    if args.report:  # the merged runs; a path of this machine in a run written by an older version: portable
        h.write_text(args.json, h.portable_text(json.dumps(result, indent=1, default=str)))
    for path in (args.md, args.png, args.json):
        if path:
            print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        return report(merge([json.loads(Path(f).read_text()) for f in args.report]), args)
    h.pin_threads(args.threads, args.seed)
    import torch
    import transformers

    command = h.command(__file__, argv)
    start = time.perf_counter()
    tmp = None
    if args.workdir:
        work = Path(args.workdir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="real-ptq-")
        work = Path(tmp.name)
    try:
        prep = prepare(args, work)
        result: dict[str, Any] = {
            "meta": {
                "command": command,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{os.cpu_count()} CPU cores, {args.threads} thread(s) per process",
                "model": args.model_dir or args.model,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "calibration": f"{args.calib_size} x {args.calib_seq} tokens of the fit split, "
                f"batch {args.batch_size}",
                "evaluation": f"{args.eval_windows} x {args.eval_seq} tokens of the test split "
                f"({prep['baseline']['tokens']} predicted tokens)",
            },
            "baseline": prep["baseline"],
            "ours": [],
            "peers": {},
        }

        def save(ours: list[dict[str, Any]] | None = None) -> None:
            if ours is not None:
                result["ours"] = ours
            h.write_json(
                args.json, result, default=str
            )  # also after each of our rows (a partial run keeps them)

        if not args.reference_python:
            print(f"reference rows skipped: {h.no_reference_python()}", flush=True)
        if not args.torchao_python and args.torchao_rows:
            print(f"torchao rows skipped: {h.no_reference_python('--torchao-python', h.TORCHAO_PYTHON_ENV)}")
        reference = None
        if args.reference_python:  # in the background, while our rows run
            reference = threading.Thread(target=reference_run, args=(prep, args, work, result["peers"]))
            reference.start()
        if args.ours:
            our_rows(prep, args, work, save)
        if args.torchao_python and args.torchao_rows:
            torchao_run(prep, args, work, result["peers"])
        if reference is not None:
            reference.join()
        result["comparison"] = comparison(result)
        result["meta"]["wall_minutes"] = round((time.perf_counter() - start) / 60, 1)
        result["meta"]["peak_rss_mb"] = h.peak_rss_mb()  # this process (our rows)
        save()
        report(result, args)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
