"""How much collection time per QAT step does ``GCPolicy``'s ``gc.freeze()`` save on a million objects?

Published in ``docs/benchmarks.md``, "Garbage collection per step" (measured 2026-11-29):

    python benchmarks/gc_step.py

(``--quick``: 200 layers, 4 repeats, a smoke run).

Model: ``LlamaForCausalLM`` from a config with many tiny layers (hidden 32, intermediate 64, ``--layers``
layers, 2 heads / 1 KV head, head_dim 16, vocab 256), fp32, ``torch.manual_seed(0)``, quantized with
``mtq.quantize(model, "NVFP4_DEFAULT_CFG", calib_batches)`` (1 batch of ``input_ids`` 1x16), then
``train()`` and AdamW(lr 1e-4) with one warm-up step, so model, quantizers and optimizer state are all alive.
The layer count sizes the object graph: the imports alone (torch, transformers' Llama, which pulls in
triton, and this library) hold ~0.36M tracked objects and each layer adds ~700 (~205 model, ~460 quantizers,
~35 optimizer state), so the default of 910 layers gives ~1M ``len(gc.get_objects())``. The counts are
printed stage by stage.

Training step: ``loss = model(ids, labels=ids).loss; loss.backward(); opt.step(); opt.zero_grad()`` on
random ``input_ids`` 1x16 (fixed generator); the loss tensor dies with the step, as in a training loop. Two
policies, in alternating blocks (``--rounds``) so that drift and load from other processes hit both alike:

* ``no freeze``: a fresh ``GCPolicy()``; before each step ``policy.before_step()`` (a full ``gc.collect()``);
  ``after_optimizer_step()`` is never called, so nothing is frozen;
* ``freeze``: a fresh ``GCPolicy()`` used as the trainer does: ``before_step()``, step,
  ``after_optimizer_step()`` -- the first call freezes everything alive. That block's first collection
  (before the freeze) is not counted; ``policy.close()`` unfreezes at the end of the block.

Timed: only the ``policy.before_step()`` call (``time.perf_counter`` around it), ``--repeats`` collections
per policy over all rounds; never the training steps (their median time is printed for scale). Reported:
min and median per policy and their ratio (target: >= 50x less collection time per step with the freeze).
A ``gc.callbacks`` hook also counts what each collection found unreachable and the automatic collections
Python ran inside the steps. Python 3.11's ``gc.get_objects()`` leaves out frozen objects, so the count is
taken before any freeze. The cores other processes kept busy are reported per policy (``/proc/stat``); the
mins are the numbers to trust on a busy machine.

Threads: torch runs with ``--threads`` (default 1; ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` are set from it
before torch loads, whatever the environment said). ``gc.collect()`` is single-threaded either way, and the
steps only make the garbage: at this size a step is a long run of tiny ops (~7 ms of CPU per layer, ~6.5 s
at 910 layers) that a second thread does not speed up, while two threads pinned to a 2-core machine that
other processes also use made steps up to ~10x slower here (~35 s per step), far over the ~3 minute budget.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import time

import _harness as h

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 64, 2, 1, 16, 256
BATCH, SEQ, CALIB_BATCHES, TRAIN_BATCHES = 1, 16, 1, 4
CONFIG = "NVFP4_DEFAULT_CFG"


class _GCWatch:
    """``gc.callbacks`` hook: per policy, the collections run inside ``before_step`` (``in_policy``) and
    the automatic ones Python ran elsewhere (during the steps), with their time and what they found."""

    def __init__(self) -> None:
        self.arm: str | None = None
        self.in_policy = False
        self.start = 0.0
        self.stats: dict[str, dict] = {}

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.start = time.perf_counter()
            return
        if self.arm is None:
            return
        seconds = time.perf_counter() - self.start
        s = self.stats.setdefault(self.arm, {"policy_unreachable": [], "auto": {}})
        if self.in_policy:
            s["policy_unreachable"].append(info["collected"] + info["uncollectable"])
        else:
            empty = {"count": 0, "seconds": 0.0, "unreachable": 0}
            gen = s["auto"].setdefault(str(info["generation"]), empty)
            gen["count"] += 1
            gen["seconds"] += seconds
            gen["unreachable"] += info["collected"] + info["uncollectable"]


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def _build(layers: int, counts: dict):
    import torch
    from transformers import LlamaForCausalLM  # noqa: F401  (counted with the imports)

    import modelopt_lite.quantization as mtq

    counts["imports"] = _tracked()
    model = h.tiny_model(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB,
        max_position_embeddings=2 * SEQ,
    ).eval()  # fmt: skip
    counts["model"] = _tracked()
    batches = h.random_batches(CALIB_BATCHES + TRAIN_BATCHES, (BATCH, SEQ), VOCAB)
    mtq.quantize(model, CONFIG, batches[:CALIB_BATCHES])  # runs under no_grad
    mtq.check_calibrated(model)
    counts["quantized"] = _tracked()
    quantizers = sum(1 for m in model.modules() if type(m).__name__.endswith("TensorQuantizer"))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, batches[CALIB_BATCHES:], quantizers


def _train_step(model, opt, ids, step_times: list[float] | None = None) -> float:
    seconds, _, _, loss = h.timed_train_step(model, opt, ids)  # the loss tensor (and its graph) died there
    if step_times is not None:
        step_times.append(seconds)
    return loss


def main() -> None:
    wall = time.perf_counter()
    parser = h.common(
        h.parser(__doc__), threads=(1, "torch threads (see the module docstring)"),
        repeats=(6, "timed collections per policy (all rounds)"), quick="200 layers, 4 repeats",
        json="write the raw numbers here",
    )  # fmt: skip
    parser.add_argument("--layers", type=int, default=910, help="Llama layers (~700 tracked objects each)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating no-freeze / freeze blocks")
    h.load_flags(parser, max_other=None)  # None: cores - threads
    args = parser.parse_args()
    layers, repeats = (200, 4) if args.quick else (args.layers, args.repeats)
    rounds = max(1, min(args.rounds, repeats))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    max_other = args.max_other_load if args.max_other_load is not None else max(0.25, cores - args.threads)
    h.pin_threads(args.threads, seed=None)  # the environment before torch loads

    from modelopt_lite.training import GCPolicy

    counts: dict[str, int] = {}
    model, opt, batches, quantizers = _build(layers, counts)
    _train_step(model, opt, batches[0])  # warm-up: creates the AdamW state
    counts["optimizer"] = _tracked()
    tracked = counts["optimizer"]
    per_layer = (tracked - counts["imports"]) / layers
    print(
        f"tiny Llama (hidden {HIDDEN}, {layers} layers), {CONFIG} ({quantizers} quantizer modules), AdamW, "
        f"batch {BATCH}x{SEQ}; threads {args.threads}; Python {sys.version.split()[0]}; {repeats} timed "
        f"collections per policy in {rounds} round(s)",
        flush=True,
    )
    print(
        f"tracked objects (len(gc.get_objects())): {counts['imports']:,} after imports, "
        f"+{counts['model'] - counts['imports']:,} model, +{counts['quantized'] - counts['model']:,} "
        f"quantizers, +{tracked - counts['quantized']:,} optimizer state = {tracked:,} "
        f"({per_layer:.0f} per layer)",
        flush=True,
    )

    watch = _GCWatch()
    gc.callbacks.append(watch)
    times: dict[str, list[float]] = {"nofreeze": [], "freeze": []}
    loads: dict[str, list[float]] = {"nofreeze": [], "freeze": []}
    step_times: dict[str, list[float]] = {"nofreeze": [], "freeze": []}
    first_unfrozen, freeze_calls, frozen, not_frozen, losses = [], [], [], [], []
    step = 0

    def timed_before_step(policy) -> float:
        watch.in_policy = True
        start = time.perf_counter()
        policy.before_step()
        seconds = time.perf_counter() - start
        watch.in_policy = False
        return seconds

    def next_batch():
        nonlocal step
        step += 1
        return batches[step % len(batches)]

    try:
        for r in range(rounds):
            n = repeats // rounds + (r < repeats % rounds)
            for arm in ("nofreeze", "freeze"):
                watch.arm = arm
                policy = GCPolicy()
                start = h.CpuMark.now()
                if arm == "freeze":  # first step of a run: collect (nothing frozen yet), step, freeze
                    first_unfrozen.append(timed_before_step(policy))
                    losses.append(_train_step(model, opt, next_batch()))
                    t = time.perf_counter()
                    policy.after_optimizer_step()
                    freeze_calls.append(time.perf_counter() - t)
                    frozen.append(gc.get_freeze_count())
                    del watch.stats[arm]["policy_unreachable"][-1]  # the pre-freeze collection
                for _ in range(n):
                    times[arm].append(timed_before_step(policy))
                    losses.append(_train_step(model, opt, next_batch(), step_times[arm]))
                    if arm == "freeze":
                        policy.after_optimizer_step()
                if arm == "freeze":
                    not_frozen.append(len(gc.get_objects()))  # excludes the frozen generation
                policy.close()
                others = start.since()[1]
                if not math.isnan(others):
                    loads[arm].append(others)
                last = ", ".join(f"{1e3 * t:.3f}" for t in times[arm][-n:])
                print(f"  round {r + 1} {arm:<8}: collect ms {last}", file=sys.stderr, flush=True)
    finally:
        watch.arm = None
        gc.callbacks.remove(watch)
        if gc.get_freeze_count():
            gc.unfreeze()

    res = {arm: {"times_s": t, **h.time_stats(t)} for arm, t in times.items()}
    for arm, r in res.items():
        r["other_cores_busy"] = max(loads[arm]) if loads[arm] else None
        r["loaded"] = bool(loads[arm]) and max(loads[arm]) > max_other
        r["step_times_s"] = step_times[arm]
        r.update(watch.stats.get(arm, {}))
    nf, fr = res["nofreeze"], res["freeze"]
    ratio = h.ratio(nf, fr)

    def others(r: dict) -> str:
        return "n/a" if r["other_cores_busy"] is None else f"{r['other_cores_busy']:.2f}"

    def auto(r: dict) -> str:
        a = r.get("auto", {})
        return ", ".join(f"gen{g}: {v['count']}" for g, v in sorted(a.items())) or "none"

    print(f"\n### gc.collect() before each training step ({CONFIG} Llama, {layers} layers), ms per step\n")
    print(h.table_head(
        "| policy | objects the collection walks | collections | median ms | min ms | no-freeze / this "
        "(median) | unreachable found per collection | automatic collections in the steps | others busy |"
    ))  # fmt: skip
    rows = [
        ("no freeze: `before_step()` only", f"{tracked:,}", nf),
        (
            "freeze: `before_step()` + `after_optimizer_step()`",
            f"{statistics.median(not_frozen):,.0f} ({statistics.median(frozen):,.0f} frozen)",
            fr,
        ),
    ]
    for label, walked, r in rows:
        unreach = statistics.median(r["policy_unreachable"]) if r.get("policy_unreachable") else 0
        print(
            f"| {label} | {walked} | {len(r['times_s'])} | {1e3 * r['median_s']:.3f} "
            f"| {1e3 * r['min_s']:.3f} | {nf['median_s'] / r['median_s']:.1f}x | {unreach:.0f} | {auto(r)} "
            f"| {others(r)}{' (loaded)' if r['loaded'] else ''} |"
        )
    verdict = "met" if ratio["median"] >= 50 else "NOT met"
    print(
        f"\ntracked objects: {tracked:,}; collection time per step {ratio['median']:.0f}x less with the "
        f"freeze from medians, {ratio['min']:.0f}x from mins (target >= 50x: {verdict}); the freeze itself "
        f"(first after_optimizer_step) took {1e3 * statistics.median(freeze_calls):.3f} ms, the collection "
        f"before it {1e3 * statistics.median(first_unfrozen):.1f} ms"
    )
    step_s = statistics.median(step_times["nofreeze"] + step_times["freeze"])
    share_nf, share_fr = 100 * nf["median_s"] / step_s, 100 * fr["median_s"] / step_s
    print(
        f"a training step took {step_s:.2f} s (median, not in the timings above): the collection before it "
        f"adds {share_nf:.1f}% without the freeze, {share_fr:.3f}% with it"
    )
    if nf["loaded"] or fr["loaded"]:
        print("\nwarning: other processes kept cores busy during a block (flagged loaded); compare the mins")
    print(f"\ntotal run {time.perf_counter() - wall:.0f} s", flush=True)
    meta = {"layers": layers, "threads": args.threads, "repeats": repeats, "rounds": rounds}
    meta.update(max_other_load=max_other, batch=[BATCH, SEQ])
    meta.update(config=CONFIG, quantizers=quantizers, python=sys.version.split()[0])
    meta.update(tracked_objects=tracked, counts=counts, objects_per_layer=per_layer)
    extra = {"freeze_call_s": freeze_calls, "first_collect_before_freeze_s": first_unfrozen}
    extra.update(frozen_objects=frozen, not_frozen_objects=not_frozen, losses=losses)
    h.write_json(args.json, {**meta, "ratio": ratio, "nofreeze": nf, "freeze": fr, **extra})


if __name__ == "__main__":
    main()
