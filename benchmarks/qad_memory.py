"""How much peak memory does chunking the distillation loss save in a QAD step, against unchunked and QAT?

Published in ``docs/benchmarks.md``, "QAD memory: chunked distillation loss" (measured 2026-11-29):

    OMP_NUM_THREADS=2 python benchmarks/qad_memory.py

(``--quick``: 1 measured step, 1 process per mode, a smoke run).

``--model smollm2-135m``: the real model instead (``modelopt_lite.models``; vocabulary 49152, tied
embedding), the same data shape and modes; its children get 20 minutes each instead of 5.

Model: ``LlamaForCausalLM`` from a config (hidden 256, intermediate 688, 2 layers, 4 heads / 2 KV heads,
vocab 32768, untied ``lm_head``), fp32, ``torch.manual_seed(0)``; the teacher is an unquantized deep copy of
it taken before quantization. Data: random ``input_ids`` 4x512 (fixed generator), ``labels`` =
``input_ids``. ``TrainingArguments``: batch 4, AdamW lr 1e-4, ``use_cpu=True``, ``report_to=[]``,
``save_strategy="no"``, seed 0, ``max_steps = 1 + --steps``. Recipe ``--recipe`` (default
``NVFP4_DEFAULT_CFG``; ``lm_head`` stays unquantized), calibrated on the first 4 train samples.

Modes, each ``train()`` in a fresh process:

* ``chunked``: ``QADTrainer`` with ``DistillationArguments(distill_chunk_size=--chunk)`` (default 256 tokens:
  the 4x511 predicted positions in 8 chunks; each chunk's fp32 logits are 256x32768x4 B = 32 MiB per model);
* ``unchunked``: the same with ``distill_chunk_size=None`` (the default since the loss follows the
  reference's arithmetic), the whole batch at once, so the step holds the full fp32 logits of both models
  (2044x32768x4 B = 255.5 MiB each, plus their log-softmaxes and, in backward, their gradients);
* ``QAT (no teacher)``: a plain ``QATTrainer`` step, the model's own cross-entropy on its full logits.

Measured with a ``TrainerCallback``: the first optimizer step is a warm-up (it creates the AdamW state and
the one-time buffers). At ``on_step_begin`` of the second step the callback runs ``gc.collect()`` and
glibc's ``malloc_trim(0)``, resets the peak-RSS mark by writing ``5`` to ``/proc/self/clear_refs`` and takes
the baseline = VmRSS (model, teacher, quantizers, optimizer state); after the last step, the peak increase =
VmHWM - baseline, i.e. the working memory of ``--steps`` training steps (forward, loss, backward, optimizer
step). When the kernel refuses the reset the baseline is VmHWM so far, which includes the warm-up step, and
the increase reads ~0 (the table says which method ran). Children run with ``MALLOC_MMAP_THRESHOLD_=131072``
(``--mmap-threshold``) so that freed MB-sized temporaries leave the heap and VmHWM follows the live memory
(see ``benchmarks/moe.py``). Step time: ``time.perf_counter()`` from ``on_step_begin`` to ``on_step_end`` of
the measured steps (min and median over all steps of all repeats).

Reported: per mode the median over ``--repeats`` processes of the peak increase in MB, and the ratios
chunked / unchunked and chunked / QAT. Before each child the parent waits (``--max-wait``) for other
processes to keep at most ``--max-other-load`` cores busy; a child disturbed during its measured steps is
flagged ``loaded`` (peak memory does not depend on load, so it is not rerun).
"""

from __future__ import annotations

import json
import os
import sys
import time

import _harness as h

BATCH, SEQ, VOCAB, CALIB_SAMPLES = 4, 512, 32768, 4
MODEL = dict(
    hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=False,
)  # fmt: skip
MODES = ["chunked", "unchunked", "qat"]
LABELS = {"chunked": "QAD, chunked KL", "unchunked": "QAD, unchunked KL", "qat": "QAT (no teacher)"}


# ----------------------------------------------------------------------------------------------- child


def _child(mode: str, recipe: str, chunk: int, threads: int, steps: int, name: str | None = None) -> dict:
    import copy
    import gc
    import tempfile

    import torch
    from transformers import TrainerCallback

    from modelopt_lite.training import DistillationArguments, QADTrainer, QATTrainer, QuantizationArguments

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if name:
        from modelopt_lite.models import load_default_model

        model = load_default_model(name)[0].float()
    else:
        model = h.tiny_model(seed=None, **MODEL)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (BATCH * (1 + steps), SEQ), generator=gen)
    data = [{"input_ids": row, "labels": row} for row in ids]

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.step, self.start, self.times = 0, 0.0, []
            self.method, self.before, self.window = "", 0.0, None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.step == 1:  # after the warm-up step: baseline
                gc.collect()
                h.malloc_trim()
                self.method, self.before = h.reset_peak_rss("VmHWM after warm-up step")
                self.window = h.CpuMark.now()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.start
            if self.step >= 1:
                self.times.append(seconds)
            self.step += 1

    probe = Probe()
    with tempfile.TemporaryDirectory(prefix="qad_memory_") as out:
        args = h.cpu_training_args(out, 1 + steps, BATCH, 1e-4)
        quant_args = QuantizationArguments(recipe=recipe, calib_size=CALIB_SAMPLES, calib_batch_size=BATCH)
        common = dict(model=model, args=args, train_dataset=data, quant_args=quant_args)
        size = chunk if mode == "chunked" else None
        if mode == "qat":
            trainer = QATTrainer(**common)
        else:
            teacher = copy.deepcopy(model)
            distill_args = DistillationArguments(distill_chunk_size=size)
            trainer = QADTrainer(**common, distill_args=distill_args, teacher_model=teacher)
        trainer.add_callback(probe)
        trainer.train()
    peak = h.status_mb("VmHWM")  # read before anything else allocates
    others = probe.window.since()[1] if probe.window is not None else float("nan")
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {
        "method": probe.method or "no measured step", "before_mb": probe.before, "peak_mb": peak,
        "increase_mb": peak - probe.before, "times": probe.times, "other_cores_busy": others,
        "final_loss": losses[-1], "chunk": size,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- parent


def _run_child(mode: str, args) -> dict:
    malloc = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}
    env = h.child_env(args.threads, h.REPO_ROOT, TRANSFORMERS_VERBOSITY="error", **malloc)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--recipe", args.recipe]
    cmd += ["--chunk", str(args.chunk), "--threads", str(args.threads), "--steps", str(args.steps)]
    cmd += ["--model", args.model] if args.model else []
    # peak memory does not depend on load: a disturbed child is flagged, not rerun
    limit = 1200 if args.model else 300
    return h.run_child_when_quiet(
        cmd, env, max_other=args.max_other_load, max_wait=args.max_wait, limit=limit
    )


def main() -> None:
    parser = h.common(
        h.parser(__doc__), threads=2, repeats=(2, "fresh processes per mode (median kept)"),
        quick="1 measured step, 1 process per mode", json="write the raw numbers here",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=2, help="measured optimizer steps after 1 warm-up")
    parser.add_argument("--chunk", type=int, default=256, help="distill_chunk_size of the chunked mode")
    parser.add_argument("--recipe", default="NVFP4_DEFAULT_CFG", help="QuantizationArguments.recipe")
    h.load_flags(parser, max_wait=60, mmap_threshold="the children")
    parser.add_argument("--model", help="a real model by name (smollm2-135m) instead of the config model")
    h.hidden(parser, child=MODES)
    args = parser.parse_args()
    if args.child:
        run = lambda: _child(args.child, args.recipe, args.chunk, args.threads, args.steps, args.model)  # noqa: E731
        h.run_and_emit(run, 1200 if args.model else 300)
        return
    if args.quick:
        args.steps, args.repeats = 1, 1

    vocab = VOCAB
    if args.model:
        from modelopt_lite.models import default_model_path

        vocab = json.loads((default_model_path(args.model) / "config.json").read_text())["vocab_size"]
    logits_mb = BATCH * (SEQ - 1) * vocab * 4 / 2**20
    what = (
        f"{args.model} (vocab {vocab}, tied embedding)"
        if args.model
        else f"Llama (hidden 256, 2 layers, vocab {VOCAB})"
    )
    print(
        f"{what}, fp32, {args.recipe}, batch {BATCH}x{SEQ}; threads "
        f"{args.threads}; {args.steps} measured step(s) after 1 warm-up; {args.repeats} fresh process(es) "
        f"per mode; one full fp32 logits tensor = {logits_mb:.1f} MB", flush=True,
    )  # fmt: skip

    def line(mode: str, res: dict) -> str:
        times = ", ".join(f"{t:.2f}" for t in res["times"])
        return (
            f"  {mode:<9}: +{res['increase_mb']:.1f} MB over {res['before_mb']:.0f} MB; {times} s/step; "
            f"loss {res['final_loss']:.3f}; others {res['other_cores_busy']:.2f} cores"
        )

    results = h.run_modes(MODES, args.repeats, lambda mode: _run_child(mode, args), line)
    h.pool(
        results,
        lambda r: r["times"],
        increase_mb=lambda r: r["increase_mb"],
        before_mb=lambda r: r["before_mb"],
    )

    method = next((r["method"] for m in results.values() for r in m.get("runs", [])), "n/a")
    print(
        f"\n### Peak RSS increase of {args.steps} QAD / QAT training step(s) after a warm-up step "
        f"(median of {args.repeats} process(es)), and seconds per step: median (min)\n"
    )
    print(
        f"baseline = VmRSS after the warm-up step, gc and malloc_trim (method: {method}); "
        f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'glibc default'}\n"
    )
    cols = "baseline RSS MB | peak increase MB | vs unchunked | s/step | vs unchunked"
    print(h.table_head(f"| mode | chunk size | {cols} |"))
    ref = results["unchunked"]
    for mode, m in results.items():
        if "error" in m:
            print(h.table_row(LABELS[mode], "", f"n/a (reason: {m['error']})", "", "", "", ""))
            continue
        chunk = "-" if mode == "qat" else str(m["runs"][0]["chunk"] or "all")
        mem_ratio = time_ratio = "n/a"
        if "error" not in ref:
            mem_ratio = f"{m['increase_mb'] / ref['increase_mb']:.2f}x" if ref["increase_mb"] > 0 else "n/a"
            time_ratio = f"{m['median_s'] / ref['median_s']:.2f}x"
        flag = " (loaded)" if m["loaded_runs"] else ""
        print(
            f"| {LABELS[mode]} | {chunk} | {m['before_mb']:.0f} | {m['increase_mb']:.1f} | {mem_ratio} "
            f"| {h.fmt_median_min(m, '.2f')}{flag} | {time_ratio} |"
        )
    ratios = {}
    c, u, q = (results[k] for k in MODES)
    if "error" not in c and "error" not in u and u["increase_mb"] > 0:
        ratios["chunked/unchunked"] = c["increase_mb"] / u["increase_mb"]
        saved = u["increase_mb"] - c["increase_mb"]
        print(
            f"\nchunked / unchunked peak increase: {ratios['chunked/unchunked']:.2f} ({c['increase_mb']:.0f} "
            f"MB vs {u['increase_mb']:.0f} MB: {saved:.0f} MB saved = {saved / logits_mb:.1f} full logits)"
        )
    if "error" not in c and "error" not in q and q["increase_mb"] > 0:
        ratios["chunked/qat"] = c["increase_mb"] / q["increase_mb"]
        print(f"chunked QAD / plain QAT peak increase: {ratios['chunked/qat']:.2f}")
    loaded = [mode for mode, m in results.items() if m.get("loaded_runs")]
    if loaded:
        print(f"\nwarning: step times disturbed by other processes: {', '.join(loaded)} (memory is not)")
    h.print_failures(results.items())
    meta = dict(threads=args.threads, steps=args.steps, repeats=args.repeats, chunk=args.chunk)
    meta.update(recipe=args.recipe, mmap_threshold=args.mmap_threshold, logits_mb=logits_mb)
    meta.update(model=args.model or "config Llama, hidden 256, 2 layers, vocab 32768")
    h.write_json(args.json, {**meta, "ratios": ratios, "results": results})


if __name__ == "__main__":
    main()
