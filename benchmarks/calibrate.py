"""How long does max calibration (``mtq.quantize``) take, and how much memory, against nvidia-modelopt?

Published in ``docs/benchmarks.md``, "Calibration time and memory" (measured 2026-11-29):

    OMP_NUM_THREADS=2 python benchmarks/calibrate.py --repeats 5 --reference-python PY

Model: ``LlamaForCausalLM`` from a config (hidden 256, intermediate 688, 4 layers, 4 heads / 2 KV heads,
vocab 2048), fp32, eval mode, weights from ``torch.manual_seed(0)``. Calibration data: 8 batches of
``input_ids`` shaped 2x128 (fixed seed). Measured: the wall time of the whole
``mtq.quantize(model, cfg, forward_loop)`` call (quantizer insertion + max calibration) and the peak RSS
(``ru_maxrss``) of the process, plus its increase over the RSS right before ``quantize``.

Every measurement runs in a fresh subprocess (this file re-invoked with ``--child ours|ref --config NAME``) so
that peak RSS is not polluted by earlier runs; the child prints one JSON line. Ours runs under this
interpreter; the reference under ``--reference-python`` (default ``$MODELOPT_REFERENCE_PYTHON``; neither: the
reference side is skipped), which needs only torch, transformers and ``modelopt`` -- this file imports neither
library at module level; when that interpreter has no transformers, this interpreter's copy (and whichever of
its dependencies the reference lacks) is lent to it through a folder of symlinks on PYTHONPATH. A reference
failure for a config (e.g. a CUDA-only fake-quant path) shows as ``n/a (reason: ...)``.

Both sides run the same forward loop (under ``torch.no_grad``), interleaved run by run. On a shared machine
a run with threads pinned to the core count slows down many times over when other processes want a core, so
the child also reports how many cores other processes kept busy while ``quantize`` ran; a run above
``--max-other-load`` is retried (``--retries``) and, if still disturbed, kept and flagged ``loaded``.
"""

from __future__ import annotations

import os
import sys
import time

import _harness as h

CONFIGS = ["FP8_DEFAULT_CFG", "INT8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"]
QUICK_CONFIGS = ["FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG"]
NUM_BATCHES, BATCH, SEQ, VOCAB = 8, 2, 128, 2048


# ----------------------------------------------------------------------------------------------- child


def _rss_now_mb() -> float:
    """Current resident set size (Linux /proc; falls back to ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return _peak_rss_mb()


def _peak_rss_mb() -> float:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def _build_model_and_batches():
    model = h.tiny_model(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
    ).eval()  # fmt: skip
    return model, h.random_batches(NUM_BATCHES, (BATCH, SEQ), VOCAB)


def _child(which: str, config: str, threads: int) -> dict:
    import copy

    import torch

    torch.set_num_threads(threads)
    model, batches = _build_model_and_batches()

    def forward_loop(m):
        with torch.no_grad():
            for b in batches:
                m(b)

    if which == "ours":
        import modelopt_lite.quantization as mtq
    else:
        import modelopt.torch.quantization as mtq
    if not hasattr(mtq, config):
        return {"error": f"config {config} not present in this library"}
    cfg = copy.deepcopy(getattr(mtq, config))
    rss_before = _rss_now_mb()
    start = h.CpuMark.now()
    mtq.quantize(model, cfg, forward_loop)
    # cores that other processes kept busy while quantize ran (they inflate the time; nan without /proc)
    seconds, others = start.since()
    peak = _peak_rss_mb()
    if which == "ours":
        mtq.check_calibrated(model)  # raises if an enabled quantizer that needs amax has none
    # TensorQuantizer and subclasses (the reference swaps in e.g. StaticBlockScaleQuantizer)
    quantizers = [m for m in model.modules() if any(c.__name__ == "TensorQuantizer" for c in type(m).__mro__)]
    return {
        "seconds": seconds, "peak_rss_mb": peak, "rss_before_mb": rss_before, "other_cores_busy": others,
        "quantizers": len(quantizers), "enabled_quantizers": sum(bool(q.is_enabled) for q in quantizers),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- parent


def _run_child(python: str, which: str, config: str, threads: int, extra_path: str | None) -> dict:
    cmd = [python, os.path.abspath(__file__), "--child", which, "--config", config, "--threads", str(threads)]
    # run from a neutral directory so the reference interpreter cannot pick up this checkout by accident
    return h.run_child(cmd, h.child_env(threads, extra_path), cwd=os.path.dirname(python) or None)


def _measure(
    config: str,
    repeats: int,
    threads: int,
    sides: dict[str, tuple[str, str | None]],
    max_other: float,
    retries: int,
) -> dict:
    """Run each side (name -> (python, extra PYTHONPATH)) ``repeats`` times, interleaving the sides run by
    run so that load from other processes hits both alike; a side stops at its first error. A run during
    which other processes kept more than ``max_other`` cores busy is run again, up to ``retries`` times
    (the last try is kept, flagged ``loaded``)."""
    results: dict[str, dict] = {which: {"runs": []} for which in sides}
    for i in range(repeats):
        for which, (python, extra_path) in sides.items():
            out = results[which]
            if "error" in out:
                continue
            for attempt in range(retries + 1):
                res = _run_child(python, which, config, threads, extra_path)
                if "error" in res or not res["other_cores_busy"] > max_other:
                    break
                wait = min(30, 5 * 2**attempt)  # let a burst of other work pass
                note = f", retrying in {wait} s" if attempt < retries else ""
                print(
                    f"  {which:<4} {config}: run {i + 1} disturbed ({res['seconds']:.3f} s; other processes "
                    f"kept {res['other_cores_busy']:.2f} cores busy){note}",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
                if attempt < retries:
                    time.sleep(wait)
            if "error" in res:
                out["error"], out["traceback"] = res["error"], res.get("traceback", "")
                print(
                    f"  {which:<4} {config}: run {i + 1} failed: {res['error']}", file=sys.stderr, flush=True
                )
                continue
            res["loaded"] = bool(res["other_cores_busy"] > max_other)
            out["runs"].append(res)
            print(
                f"  {which:<4} {config}: run {i + 1}/{repeats} {res['seconds']:.3f} s, peak RSS "
                f"{res['peak_rss_mb']:.0f} MB (+{res['peak_rss_mb'] - res['rss_before_mb']:.0f}), "
                f"{res['enabled_quantizers']}/{res['quantizers']} quantizers on; "
                f"others {res['other_cores_busy']:.2f} cores",
                file=sys.stderr, flush=True,
            )  # fmt: skip
    h.pool(
        results, lambda r: [r["seconds"]], median_peak_rss_mb=lambda r: r["peak_rss_mb"],
        median_rss_delta_mb=lambda r: r["peak_rss_mb"] - r["rss_before_mb"],
    )  # fmt: skip
    return results


def _rss_cell(m: dict | None) -> str:
    if m is None or "error" in m:
        return "n/a"
    return f"{m['median_peak_rss_mb']:.0f} (+{m['median_rss_delta_mb']:.0f})"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "n/a"


def main() -> None:
    parser = h.common(h.parser(__doc__), threads=2, repeats=5, quick="2 repeats, FP8 and NVFP4 only")
    h.common(parser, json="write the raw numbers here", reference="interpreter with nvidia-modelopt")
    h.load_flags(parser, retries=(3, "reruns per disturbed run, after 5, 10, 20, 30 s"))
    parser.add_argument("--configs", nargs="+", help=f"subset of {CONFIGS}")
    h.hidden(parser, child=["ours", "ref"], config=str)
    args = parser.parse_args()

    if args.child:
        h.run_and_emit(lambda: _child(args.child, args.config, args.threads))
        return

    repeats = 2 if args.quick else args.repeats
    configs = args.configs or (QUICK_CONFIGS if args.quick else CONFIGS)
    ref_ok, ref_note = h.reference_usable(args.reference_python)
    print(
        f"tiny Llama (hidden 256, 4 layers), {NUM_BATCHES} batches of {BATCH}x{SEQ}; threads {args.threads}; "
        f"repeats {repeats}; each run in a fresh process",
        flush=True,
    )
    ref_path = None
    if not ref_ok:
        print(f"note: reference column skipped ({ref_note})", flush=True)
    else:
        ref_path, borrowed, _ = h.borrow(args.reference_python)
        if borrowed:
            ref_note = (
                f"{args.reference_python} has no transformers: borrowed {', '.join(borrowed)} from "
                f"{sys.executable} via PYTHONPATH"
            )
            print(f"note: {ref_note}", flush=True)

    rows = []
    for config in configs:
        sides = {"ours": (sys.executable, h.REPO_ROOT)}  # importable from the child's neutral cwd
        if ref_ok:
            sides["ref"] = (args.reference_python, ref_path)
        measured = _measure(config, repeats, args.threads, sides, args.max_other_load, args.retries)
        ours, ref = measured["ours"], measured.get("ref")
        rows.append({"config": config, "threads": args.threads, "repeats": repeats, "ours": ours, "ref": ref})

    print("\n" + h.table_head(
        "| config | ours median s (min) | ref median s (min) | time ratio ours/ref "
        "| ours peak RSS MB (+delta) | ref peak RSS MB (+delta) | RSS-delta ratio |"
    ))  # fmt: skip
    for row in rows:
        ours, ref = row["ours"], row["ref"]
        ok_o, ok_r = "error" not in ours, ref is not None and "error" not in ref
        t_ratio = _ratio(ours["median_s"] if ok_o else None, ref["median_s"] if ok_r else None)
        if ok_o and ok_r:
            t_ratio += f" (mins: {_ratio(ours['min_s'], ref['min_s'])})"
        m_ratio = _ratio(
            ours["median_rss_delta_mb"] if ok_o else None, ref["median_rss_delta_mb"] if ok_r else None
        )
        print(
            f"| {row['config']} | {h.fmt_cell(ours)} | {h.fmt_cell(ref)} | {t_ratio} "
            f"| {_rss_cell(ours)} | {_rss_cell(ref)} | {m_ratio} |"
        )
    loaded = sum(m.get("loaded_runs", 0) for row in rows for m in (row["ours"], row["ref"] or {}))
    if loaded:
        print(
            f"\nwarning: {loaded} run(s) stayed disturbed by other processes after {args.retries} retries "
            "(flagged `loaded` in the JSON); their times are inflated -- compare the mins"
        )
    for row in rows:
        if "error" in row["ours"]:
            print(
                f"\nours failed on {row['config']}:\n{row['ours'].get('traceback') or row['ours']['error']}"
            )
    meta = {"reference_python": args.reference_python, "reference_note": ref_note}
    h.write_json(args.json, {**meta, "rows": rows})


if __name__ == "__main__":
    main()
