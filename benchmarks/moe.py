"""How fast is a QAT step on fused MoE experts (NVFP4, FP8), and how much memory does calibration add?

Published in ``docs/benchmarks.md``, "MoE QAT step and calibration memory" and its sections, ``docs/moe.md``
and the README (measured 2026-12-02; ``N`` = 1 and 2, two runs each, on a shared machine):

    OMP_NUM_THREADS=N python benchmarks/moe.py --threads N --repeats 7 --max-other-load 3 --max-wait 60 \\
        --skip-memory --reference-python PY
    OMP_NUM_THREADS=2 python benchmarks/moe.py          # the step times and the calibration memory

(``--quick``: 2 timed steps, 1 memory run per mode, a smoke run).

Model: ``Qwen3MoeForCausalLM`` from a config (hidden 512, intermediate 1024, moe_intermediate 256, 2
layers, 8 heads / 4 KV heads, head_dim 64, 64 experts, top-8, vocab 4096), fp32, ``torch.manual_seed(0)``.
Inputs: random ``input_ids`` 4x128 from a fixed generator. Config: ``NVFP4_DEFAULT_CFG``.

1. QAT step time. Per experts path: quantize (calibrating on 2 batches), ``train()``, AdamW(lr 1e-5), then
   time ``loss = model(ids, labels=ids).loss; loss.backward(); opt.step(); opt.zero_grad()`` for one
   warm-up step and ``--repeats`` steps. Paths: ours on ``grouped_mm``; the same with
   ``QuantExperts.reuse_weight_buffers = False`` (a fresh fake-quantized expert weight each step instead of
   the buffer kept from step to step); ours on ``grouped_mm`` with ``FP8_DEFAULT_CFG``; -- to show the cost
   of fake quant -- the unquantized model on transformers' own ``grouped_mm``; these four in one process,
   their steps interleaved (the order rotating from step to step), so that the ratios compare steps taken
   under the same load. And, in a fresh process of its own (about 10x slower), the NVFP4 model forced to
   ``eager`` (the reference library's only working path). Wall-clock seconds per step, and this process's
   CPU seconds (user + system, which other processes on a shared machine disturb less).

   With ``--reference-python PY`` (default ``$MODELOPT_REFERENCE_PYTHON``; without either, skipped):
   nvidia-modelopt's own step, in a process of its own under ``PY`` (``_peer_worker.py --peer
   modelopt_moe_step``): this model saved with ``save_pretrained`` and loaded there in fp32, ``mtq.quantize``
   with its ``FP8_DEFAULT_CFG`` on the same 2 calibration batches (the reference forces fused experts to
   transformers' ``eager`` and quantizes per expert; its NVFP4 fake quant needs CUDA, its FP8 one runs on
   CPU), then the same AdamW step on the same ids, one warm-up and ``--repeats`` timed. Printed: reference /
   our FP8 grouped_mm step, from the medians and from the mins (target >= 10x), next to our NVFP4 eager /
   grouped_mm ratio. When the reference fails, its error is printed and no ratio is.
2. Calibration memory (not with ``--skip-memory``). In fresh processes (grouped_mm): build the model, run
   one plain unquantized forward of a 4x128 batch under ``no_grad`` (so one-time allocations and
   activation-sized buffers exist before the baseline), then reset the peak-RSS mark by writing ``5`` to
   ``/proc/self/clear_refs`` and take the baseline = VmRSS (when the kernel refuses the reset, the baseline
   is VmHWM, the peak so far, which already includes that forward). Then run the measured work over 8
   batches of 4x128 and read the peak VmHWM:

   * ``plain``: the unquantized model, 8 forwards under ``no_grad`` (activations only);
   * ``calib, pass-through``: ``mtq.quantize(...)`` with the default ``QuantExperts.weight_pass_through``;
   * ``calib, no pass-through``: the same with ``QuantExperts.weight_pass_through = False`` (every experts
     forward stacks per-expert weight copies even while only collecting statistics).

   "calibration adds" = (calib increase - plain increase) / bytes of all experts' ``gate_up_proj`` and
   ``down_proj`` (numel * 4); target < 10% with pass-through.

   Memory children run with ``MALLOC_MMAP_THRESHOLD_=131072`` (``--mmap-threshold``): glibc's dynamic
   threshold rises (up to 32 MB) once large blocks are freed, and then freed MB-sized temporaries stay in the
   heap -- in about half of the runs the weight-calibration step kept 60-90 MB of freed memory resident
   (``malloc_trim`` returned it). With a fixed threshold, VmHWM follows the live memory.

Before each timed child the parent waits (``--max-wait``) until other processes keep at most
``--max-other-load`` cores busy: with threads pinned to the core count, one busy core elsewhere made a step
up to 30x slower here. A child that was still disturbed during its steps is rerun (``--retries``) and, if
disturbed again, kept and flagged ``loaded``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import _harness as h

BATCH, SEQ, VOCAB, CALIB_STEP, CALIB_MEM = 4, 128, 4096, 2, 8
# baseline: unquantized, transformers' grouped_mm; fp8_grouped_mm: ours with FP8_DEFAULT_CFG; others NVFP4
STEP_PATHS = ["baseline", "grouped_mm", "grouped_mm_fresh", "fp8_grouped_mm", "eager"]
INTERLEAVED = STEP_PATHS[:4]  # measured in one process, their steps interleaved
STEP_CHILDREN = {"interleaved": INTERLEAVED, "eager": ["eager"]}
MEM_MODES = ["plain", "pass", "nopass"]
LABELS = {
    "baseline": "unquantized, transformers grouped_mm", "grouped_mm": "NVFP4, ours grouped_mm",
    "grouped_mm_fresh": "NVFP4, ours grouped_mm, no weight buffer reuse", "eager": "NVFP4, forced eager",
    "fp8_grouped_mm": "FP8, ours grouped_mm", "reference": "FP8, nvidia-modelopt (forced eager, per expert)",
    "plain": "plain forward (no quantize)",
    "pass": "calibration, pass-through (default)", "nopass": "calibration, no pass-through",
}  # fmt: skip


# ----------------------------------------------------------------------------------------------- child


def _build(num_batches: int):
    model = h.tiny_model(
        "Qwen3Moe", hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
        vocab_size=VOCAB, max_position_embeddings=256,
    ).eval()  # fmt: skip
    return model, h.random_batches(num_batches, (BATCH, SEQ), VOCAB)


def _child_step(child: str, repeats: int) -> dict:
    import torch

    import modelopt_lite.quantization as mtq
    from modelopt_lite.moe import QuantExperts

    paths, runs = STEP_CHILDREN[child], {}
    for path in paths:
        model, batches = _build(CALIB_STEP)
        if path == "baseline":
            model.set_experts_implementation("grouped_mm")
        else:
            impl = "eager" if path == "eager" else "grouped_mm"
            preset = "FP8_DEFAULT_CFG" if path.startswith("fp8") else "NVFP4_DEFAULT_CFG"
            mtq.quantize(model, mtq.get_preset(preset), batches, impl)  # runs under no_grad
            for m in model.modules():
                if isinstance(m, QuantExperts):
                    m.reuse_weight_buffers = path != "grouped_mm_fresh"
        model.train()
        runs[path] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    ids, loads = batches[0], []
    out = {p: {"times": [], "cpu_s": []} for p in paths}
    for i in range(repeats + 1):
        for path in paths[i % len(paths) :] + paths[: i % len(paths)]:  # who goes first rotates
            model, opt = runs[path]
            seconds, others, cpu, loss = h.timed_train_step(model, opt, ids)
            if i:  # step 0 is the warm-up
                out[path]["times"].append(seconds)
                out[path]["cpu_s"].append(cpu)
                loads.append(others)
            out[path].update(impl=model.config._experts_implementation, loss=loss)
    return {"paths": out, "other_cores_busy": statistics.median(loads)}


def _child_mem(mode: str) -> dict:
    import gc

    import torch

    import modelopt_lite.quantization as mtq
    from modelopt_lite.moe import QuantExperts

    model, batches = _build(CALIB_MEM)
    model.set_experts_implementation("grouped_mm")
    with torch.no_grad():
        model(batches[0])  # warm-up: one-time allocations and activation buffers before the baseline
    gc.collect()
    method, before = h.reset_peak_rss("VmHWM after warm-up forward")
    if mode == "plain":
        with torch.no_grad():
            for b in batches:
                model(b)
    else:
        QuantExperts.weight_pass_through = mode == "pass"
        mtq.quantize(model, mtq.get_preset("NVFP4_DEFAULT_CFG"), batches, "grouped_mm")  # under no_grad
        mtq.check_calibrated(model)
    peak = h.status_mb("VmHWM")
    out = {"method": method, "before_mb": before, "peak_mb": peak, "increase_mb": peak - before}
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]  # none in "plain"
    out["expert_bytes"] = sum(m.gate_up_proj.numel() * 4 + m.down_proj.numel() * 4 for m in experts)
    return out


def _child_main(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.child == "step":
        h.run_and_emit(lambda: _child_step(args.path, args.repeats))
    else:
        h.run_and_emit(lambda: _child_mem(args.path))


# ---------------------------------------------------------------------------------------------- parent


def _run_child(
    kind: str, path: str, threads: int, repeats: int, max_other: float, retries: int, max_wait: float = 0,
    **extra_env: str,
) -> dict:  # fmt: skip
    """Run a child after waiting for a quiet machine; rerun while other processes kept > max_other cores
    busy during its timed steps (the last try is kept, flagged ``loaded``)."""
    env = h.child_env(threads, h.REPO_ROOT, **extra_env)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--path", path]
    cmd += ["--threads", str(threads), "--repeats", str(repeats)]
    return h.run_child_when_quiet(
        cmd,
        env,
        max_other=max_other,
        max_wait=max_wait,
        retries=retries,
        on_disturbed=_disturbed(f"{kind} {path}"),
    )


def _disturbed(what: str):
    """The ``on_disturbed`` report of a child."""

    def report(res: dict, retrying: bool) -> None:
        note = ", retrying" if retrying else ", kept (flagged loaded)"
        print(f"  {what}: disturbed (others {res['other_cores_busy']:.2f} cores){note}", flush=True)

    return report


def speedup(slow: dict, fast: dict) -> dict[str, float] | None:
    """``slow`` / ``fast`` step time from the medians and from the mins (``median_s`` / ``min_s`` of
    :func:`_harness.time_stats`), or None when either side failed (has an ``error``)."""
    return None if "error" in slow or "error" in fast else h.ratio(slow, fast)


def speedup_line(what: str, ratio: dict[str, float] | None, target: float) -> str:
    """One summary line: the ratio from the medians and the mins, and whether the median meets ``target``."""
    if ratio is None:
        return f"{what}: n/a (a side failed)"
    verdict = "met" if ratio["median"] >= target else "NOT met"
    return (
        f"{what}: {ratio['median']:.2f}x from medians, {ratio['min']:.2f}x from mins "
        f"(target >= {target:g}x: {verdict})"
    )


def _run_reference(python: str, threads: int, repeats: int, load_args: tuple[float, int, float]) -> dict:
    """nvidia-modelopt's FP8 QAT step (``_peer_worker.py --peer modelopt_moe_step``) under ``python``, on
    our benchmark model saved with ``save_pretrained`` and the same batches, in a process of its own (after
    waiting for a quiet machine, rerun while disturbed, as our children)."""
    import tempfile

    import torch
    from safetensors.torch import save_file

    max_other, retries, max_wait = load_args
    with tempfile.TemporaryDirectory(prefix="moe-bench-ref-") as tmp:
        model, batches = _build(CALIB_STEP)
        model.save_pretrained(os.path.join(tmp, "model"))
        del model
        data = os.path.join(tmp, "data.safetensors")
        save_file({"calib": torch.stack(batches), "step": batches[0].contiguous()}, data)
        spec = {"model_dir": os.path.join(tmp, "model"), "data": data, "preset": "FP8_DEFAULT_CFG"}
        spec.update(lr=1e-5, repeats=repeats, threads=threads)
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_peer_worker.py")
        cmd = [python, worker, "--peer", "modelopt_moe_step", "--spec", spec_path]
        env = h.child_env(threads, h.REPO_ROOT, keep_pythonpath=False)
        try:
            return h.run_child_when_quiet(
                cmd, env, max_other=max_other, max_wait=max_wait, retries=retries, limit=400,
                on_disturbed=_disturbed("step reference"),
            )  # fmt: skip
        except OSError as err:  # no such interpreter, not executable
            return h.error_result(err, limit=400)


def _print_memory(mem: dict[str, dict], mmap_threshold: int, mem_repeats: int) -> tuple[int | None, dict]:
    """The calibration-memory table and verdict; returns the expert weight bytes and the % added."""
    print(f"\n### Peak memory of calibration ({CALIB_MEM} batches of {BATCH}x{SEQ}, grouped_mm)\n")
    method = next((r["method"] for m in mem.values() for r in m["runs"]), "n/a")
    print(
        "peak increase = VmHWM after the work - baseline, the baseline taken after one plain warm-up forward "
        f"(method: {method}); MALLOC_MMAP_THRESHOLD_={mmap_threshold or 'glibc default'}; median of "
        f"{mem_repeats} fresh process(es); % = (increase - plain-forward increase) / expert weight bytes\n"
    )
    ebytes = next((r["expert_bytes"] for m in ("pass", "nopass") for r in mem[m]["runs"]), None)
    emb = ebytes / 2**20 if ebytes else None
    print(f"expert weights (all QuantExperts gate_up_proj + down_proj, fp32): {h.fmt_or_na(emb, '.1f')} MB\n")
    cols = "baseline RSS MB | peak increase MB | minus plain fwd MB | % of expert weights"
    print(h.table_head(f"| measurement | {cols} |"))
    plain = mem["plain"].get("increase_mb")
    adds: dict[str, float | None] = {}
    for mode, m in mem.items():
        if "error" in m:
            print(f"| {LABELS[mode]} | n/a (reason: {m['error']}) | | | |")
            continue
        before = statistics.median(r["before_mb"] for r in m["runs"])
        extra = m["increase_mb"] - plain if plain is not None and mode != "plain" else None
        adds[mode] = 100 * extra / emb if extra is not None and emb else None
        pct, extra_s = "-", "-"
        if mode != "plain":
            pct, extra_s = h.fmt_or_na(adds[mode], ".1f") + "%", h.fmt_or_na(extra, ".1f")
        print(f"| {LABELS[mode]} | {before:.0f} | {m['increase_mb']:.1f} | {extra_s} | {pct} |")
    if adds.get("pass") is not None:
        verdict = "met" if adds["pass"] < 10 else "NOT met"
        print(
            f"\ncalibration adds {adds['pass']:.1f}% of the expert weights with pass-through (target < 10%: "
            f"{verdict}), {h.fmt_or_na(adds.get('nopass'), '.1f')}% without"
        )
    return ebytes, adds


def main() -> None:
    parser = h.common(
        h.parser(__doc__), threads=2, repeats=(5, "timed QAT steps per path (after a warm-up)"),
        quick="2 timed steps, 1 memory run per mode", json="write the raw numbers here",
        reference="python of a virtualenv with nvidia-modelopt: times its FP8 QAT step; without it, skipped",
    )  # fmt: skip
    parser.add_argument("--mem-repeats", type=int, default=3, help="memory runs per mode (median kept)")
    parser.add_argument("--skip-memory", action="store_true", help="only the QAT step times")
    h.load_flags(parser, max_wait=600, retries=2, mmap_threshold="the memory children")
    h.hidden(parser, child=["step", "mem"], path=str)
    args = parser.parse_args()
    if args.child:
        _child_main(args)
        return

    repeats = 2 if args.quick else args.repeats
    mem_repeats = 1 if args.quick else args.mem_repeats
    print(
        "Qwen3-MoE (hidden 512, moe_intermediate 256, 64 experts, top-8, 2 layers), fp32, NVFP4_DEFAULT_CFG "
        "(and FP8_DEFAULT_CFG), "
        f"batch {BATCH}x{SEQ}; threads {args.threads}; {repeats} timed QAT steps after 1 warm-up; the "
        "grouped_mm paths and the unquantized one interleaved in one process; eager and each memory run in a "
        "fresh process", flush=True,
    )  # fmt: skip
    steps: dict[str, dict] = {}
    load_args = (args.max_other_load, args.retries, args.max_wait)
    for child, paths in STEP_CHILDREN.items():
        res = _run_child("step", child, args.threads, repeats, *load_args)
        for path in paths:
            if "error" in res:
                steps[path] = res
                print(f"  step {path}: failed: {res['error']}", flush=True)
                continue
            one = steps[path] = {**res["paths"][path], "loaded": res["loaded"]}
            one.update(h.time_stats(one["times"]), cpu_median_s=statistics.median(one["cpu_s"]))
            times = ", ".join(f"{t:.3f}" for t in one["times"])
            busy = res["other_cores_busy"]
            print(f"  step {path}: {times} s ({one['impl']}; {child}, others {busy:.2f})", flush=True)
    reference = None
    if args.reference_python:
        reference = _run_reference(args.reference_python, args.threads, repeats, load_args)
        if "error" in reference:
            print(f"  step reference: cannot run: {reference['error']}", flush=True)
        else:
            reference.update(
                h.time_stats(reference["times"]), cpu_median_s=statistics.median(reference["cpu_s"])
            )
            times = ", ".join(f"{t:.3f}" for t in reference["times"])
            ver = reference["versions"]
            print(
                f"  step reference: {times} s ({reference['impl']}, {reference['experts_type']}; modelopt "
                f"{ver.get('modelopt_moe_step')}, transformers {ver.get('transformers')}; "
                f"others {reference['other_cores_busy']:.2f})", flush=True,
            )  # fmt: skip
        steps["reference"] = reference
    else:
        print(f"  step reference: skipped ({h.no_reference_python()})", flush=True)
    mem: dict[str, dict] = {}
    mem_env = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}
    for mode in [] if args.skip_memory else MEM_MODES:  # peak memory does not depend on load: no retries
        mem[mode] = {"runs": []}
        for _ in range(mem_repeats):
            res = _run_child("mem", mode, args.threads, 0, float("inf"), 0, **mem_env)
            if "error" in res:
                print(f"  mem {mode}: failed: {res['error']}", flush=True)
                mem[mode].update(error=res["error"], traceback=res.get("traceback"))
                break
            print(f"  mem {mode}: +{res['increase_mb']:.1f} MB over {res['before_mb']:.0f} MB", flush=True)
            mem[mode]["runs"].append(res)
        if "error" not in mem[mode]:
            mem[mode]["increase_mb"] = statistics.median(r["increase_mb"] for r in mem[mode]["runs"])

    print("\n### QAT step time (forward + backward + AdamW step), seconds per step\n")
    cols = "median s | min s | vs unquantized (median / min) | CPU s, vs unquantized"
    print(h.table_head(f"| path | experts implementation | {cols} |"))
    base = steps["baseline"]
    for path, res in steps.items():
        if "error" in res:
            print(h.table_row(LABELS[path], "n/a", f"n/a (reason: {res['error']})", "", "", ""))
            continue
        vs = cpu_vs = "n/a"
        if "error" not in base:
            vs = f"{res['median_s'] / base['median_s']:.2f}x / {res['min_s'] / base['min_s']:.2f}x"
            cpu_vs = f"{res['cpu_median_s'] / base['cpu_median_s']:.2f}x"
        med = f"{res['median_s']:.3f}" + (" (loaded)" if res["loaded"] else "")
        cpu = f"{res['cpu_median_s']:.3f}, {cpu_vs}"
        print(f"| {LABELS[path]} | `{res['impl']}` | {med} | {res['min_s']:.3f} | {vs} | {cpu} |")
    print(
        f"\n(the first {len(INTERLEAVED)} rows: one process, steps interleaved; eager and the reference: "
        "each in its own process)"
    )
    if "error" not in base and "error" not in steps["grouped_mm"]:
        r = steps["grouped_mm"]["median_s"] / base["median_s"]
        verdict = "met" if r <= 1.3 else "NOT met"
        print(f"quantized grouped_mm step / unquantized: {r:.2f}x from medians (target <= 1.3x: {verdict})")
    nvfp4_speedup = speedup(steps["eager"], steps["grouped_mm"])
    print("\n" + speedup_line("NVFP4 speed-up, our forced eager / our grouped_mm", nvfp4_speedup, 10))
    ref_speedup = None
    if reference is not None:
        ref_speedup = speedup(reference, steps["fp8_grouped_mm"])
        print(speedup_line("FP8 speed-up, nvidia-modelopt (forced eager) / our grouped_mm", ref_speedup, 10))
        if "error" not in reference:
            print(
                f"(reference: {reference['weight_quantizers']} enabled weight quantizers, of which "
                f"{reference['expert_weight_quantizers']} per expert, and {reference['input_quantizers']} "
                f"input quantizers; quantized experts: {', '.join(reference['quantized_experts']) or 'none'})"
            )

    ebytes, adds = None, {}
    if not args.skip_memory:
        ebytes, adds = _print_memory(mem, args.mmap_threshold, mem_repeats)
    loaded = [p for p, r in steps.items() if r.get("loaded")]
    if loaded:
        print(f"\nwarning: still disturbed by other processes after retries: {', '.join(loaded)} (inflated)")
    h.print_failures([*steps.items(), *mem.items()])
    meta = {"threads": args.threads, "repeats": repeats, "mem_repeats": mem_repeats}
    meta.update(mmap_threshold=args.mmap_threshold, expert_bytes=ebytes, adds_pct=adds)
    ratios = {"speedup": nvfp4_speedup, "reference_fp8_speedup": ref_speedup}
    h.write_json(args.json, {**meta, "steps": steps, **ratios, "memory": mem})


if __name__ == "__main__":
    main()
