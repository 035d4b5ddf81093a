"""Peak memory and step time of QAD with LoRA adapters and QLoRA, against full-weight QAD and a plain LoRA
fine-tune of the float model, on a real model (issue 43; docs/lora.md "Memory and step time"):

    OMP_NUM_THREADS=2 python benchmarks/lora_memory.py --model smollm2-135m --json lora_memory.json

(``--quick``: 1 measured step, 1 process per mode, a smoke run).

Every mode is one fresh process. It loads the model (fp32, or ``--dtype bfloat16``), builds random
``input_ids`` (batch ``--batch`` x ``--seq``, fixed generator, ``labels = input_ids``), quantizes it with
``--recipe`` calibrated on the first batch (``mtq.quantize``, before the trainer; the trainers then skip
calibration) and trains ``1 + --steps`` optimizer steps (AdamW, lr 1e-4, no saving):

* ``full``: ``QADTrainer`` on every weight; the teacher an unquantized copy of the model;
* ``lora``: the same with ``lora_config`` (rank ``--rank``, alpha = rank, the seven projections of each
  block, deployed merged): the base frozen and fake-quantized;
* ``qlora``: ``mtq.compress`` after quantizing (the base held in its real low-bit format), then the same
  adapters, served;
* ``lora_float``: ``transformers.Trainer`` on ``peft.get_peft_model`` of the float model (no quantization,
  no teacher; the model's own cross-entropy): the plain LoRA fine-tune;
* ``full_float``: ``transformers.Trainer`` on every weight of the float model (the plain fine-tune).

The QAD modes compute the loss in chunks of 512 tokens (``distill_chunk_size``), so the full-vocabulary
logits of the batch never exist at once in any mode but the plain fine-tunes'. ``--gradient-checkpointing``
turns on ``TrainingArguments(gradient_checkpointing=True)`` in every mode (activations recomputed in
backward).

The weights are copied out of the checkpoint's memory mapping after loading: a tensor that ``from_pretrained``
reads from a safetensors file shares the file's mapping, whose pages, once touched (by calibration), stay
resident until the last tensor of the file is freed, so after ``mtq.compress`` the fp32 pages would still
count (the kernel can drop them, but ``VmRSS`` counts them).

Measured: ``VmRSS`` after setup (the model, its copy or teacher, quantizers; after ``gc`` and
``malloc_trim``), then the peak-RSS mark is reset and the **peak RSS of the training run** (``VmHWM`` at the
end: resident model and teacher + optimizer state + the steps' working memory) is read after the last step;
the first step is a warm-up, the step time is ``on_step_begin`` -> ``on_step_end`` of the other steps (min and
median over all runs). Ratios are against ``full`` and ``lora_float`` of the same run. Children run with
``MALLOC_MMAP_THRESHOLD_=131072`` so that freed temporaries leave the heap.
"""

from __future__ import annotations

import os
import sys
import time

import _harness as h

MODES = ["full", "lora", "qlora", "lora_float", "full_float"]
LABELS = {
    "full": "full-weight QAD",
    "lora": "QAD-LoRA (fake-quant base, merged)",
    "qlora": "QLoRA QAD (compressed base, served)",
    "lora_float": "LoRA fine-tune, float model",
    "full_float": "full fine-tune, float model",
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _child(mode: str, args) -> dict:
    import copy
    import gc
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback

    import modelopt_lite.quantization as mtq
    from modelopt_lite.models import load_default_model
    from modelopt_lite.training import DistillationArguments, QADTrainer, QuantizationArguments

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_default_model(args.model, getattr(torch, args.dtype))[0]
    with torch.no_grad():  # own copies: tensors read from the file's mapping keep the whole file resident
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()
    gc.collect()
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, model.config.vocab_size, (args.batch * (1 + args.steps), args.seq), generator=gen)
    data = [{"input_ids": row, "labels": row} for row in ids]
    lora_config = None
    if mode != "full" and mode != "full_float":
        from peft import LoraConfig

        lora_config = LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=0.0, target_modules=TARGETS)
    teacher = None
    if mode in ("full", "lora", "qlora"):
        teacher = copy.deepcopy(model).eval()
        with torch.no_grad():
            mtq.quantize(model, mtq.get_preset(args.recipe), [ids[: args.batch]])
        if mode == "qlora":
            mtq.compress(model)

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.step, self.start, self.times = 0, 0.0, []
            self.method, self.before, self.window = "", 0.0, None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.step == 1:
                self.window = h.CpuMark.now()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.step >= 1:
                self.times.append(time.perf_counter() - self.start)
            self.step += 1

    probe = Probe()
    with tempfile.TemporaryDirectory(prefix="lora_memory_") as out:
        # --gradient-checkpointing: every mode recomputes its blocks' activations in backward
        train_args = h.cpu_training_args(out, 1 + args.steps, args.batch, 1e-4, args.gradient_checkpointing)
        common = dict(args=train_args, train_dataset=data, callbacks=[probe])
        if teacher is None:
            if lora_config is not None:
                from peft import get_peft_model

                model = get_peft_model(model, lora_config)
            trainer: object = Trainer(model=model, **common)
        else:
            quant = QuantizationArguments(
                recipe=args.recipe, lora_deploy="served" if mode == "qlora" else "merged"
            )
            distill = DistillationArguments(distill_chunk_size=512)
            trainer = QADTrainer(
                model=model, quant_args=quant, distill_args=distill, teacher_model=teacher,
                lora_config=lora_config, **common,
            )  # fmt: skip
        gc.collect()
        h.malloc_trim()
        setup_mb = h.status_mb("VmRSS")
        method, _ = h.reset_peak_rss("VmHWM including setup")
        trainer.train()  # type: ignore[attr-defined]
    peak = h.status_mb("VmHWM")
    others = probe.window.since()[1] if probe.window is not None else float("nan")
    trained = trainer.model  # type: ignore[attr-defined]
    return {
        "method": method, "setup_mb": setup_mb, "peak_mb": peak, "times": probe.times,
        "other_cores_busy": others,
        "trainable": sum(p.numel() for p in trained.parameters() if p.requires_grad),
        "final_loss": [e["loss"] for e in trainer.state.log_history if "loss" in e][-1],  # type: ignore[attr-defined]
    }  # fmt: skip


def _run_child(mode: str, args) -> dict:
    malloc = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}
    env = h.child_env(args.threads, h.REPO_ROOT, TRANSFORMERS_VERBOSITY="error", **malloc)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, *args.passthrough]
    return h.run_child_when_quiet(cmd, env, max_other=args.max_other_load, max_wait=args.max_wait, limit=3600)


def main() -> None:
    parser = h.common(
        h.parser(__doc__), threads=2, repeats=(1, "fresh processes per mode (median kept)"),
        quick="1 measured step, 1 process per mode", json="write the raw numbers here",
    )  # fmt: skip
    parser.add_argument("--model", default="smollm2-135m", help="a real model by name")
    parser.add_argument("--recipe", default="NVFP4_DEFAULT_CFG", help="the quantization preset")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="measured optimizer steps after 1 warm-up")
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="TrainingArguments(gradient_checkpointing=True)"
    )
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated from {MODES}")
    h.load_flags(parser, max_wait=60, mmap_threshold="the children")
    h.hidden(parser, child=MODES)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 1, 1
    if args.child:
        h.run_and_emit(lambda: _child(args.child, args), 3600)
        return
    modes = h.csv(args.modes)
    if any(m not in MODES for m in modes):
        parser.error(f"--modes: choose from {MODES}")
    args.passthrough = [
        "--model", args.model, "--recipe", args.recipe, "--dtype", args.dtype, "--rank", str(args.rank),
        "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
        "--threads", str(args.threads),
        *(["--gradient-checkpointing"] if args.gradient_checkpointing else []),
    ]  # fmt: skip
    print(
        f"{args.model} {args.dtype}, {args.recipe}, LoRA rank {args.rank}, batch {args.batch}x{args.seq}; "
        f"threads {args.threads}; {args.steps} measured step(s) after 1 warm-up; {args.repeats} process(es) "
        "per mode", flush=True,
    )  # fmt: skip

    def line(mode: str, res: dict) -> str:
        times = ", ".join(f"{t:.2f}" for t in res["times"])
        return (
            f"  {mode:<10}: setup {res['setup_mb']:.0f} MB, peak {res['peak_mb']:.0f} MB; {times} s/step; "
            f"{res['trainable']:,} trainable; others {res['other_cores_busy']:.2f} cores"
        )

    results = h.run_modes(modes, args.repeats, lambda mode: _run_child(mode, args), line)
    h.pool(results, lambda r: r["times"], peak_mb=lambda r: r["peak_mb"], setup_mb=lambda r: r["setup_mb"])
    vs = "vs full QAD | vs LoRA float"
    print(f"\n| mode | trainable | setup RSS MB | peak RSS MB | {vs} | s/step | {vs} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios: dict[str, dict[str, float]] = {}
    for mode, m in results.items():
        if "error" in m:
            print(f"| {LABELS[mode]} | n/a ({m['error']}) | | | | | | | |")
            continue
        row: dict[str, float] = {}
        cells = []
        for key, ref in (("full", "full"), ("lora_float", "lora_float")):
            r = results.get(ref)
            ok = r is not None and "error" not in r
            row[f"peak_vs_{key}"] = m["peak_mb"] / r["peak_mb"] if ok else float("nan")
            row[f"step_vs_{key}"] = m["median_s"] / r["median_s"] if ok else float("nan")
        ratios[mode] = row
        cells = [f"{row['peak_vs_full']:.2f}x", f"{row['peak_vs_lora_float']:.2f}x"]
        steps = [f"{row['step_vs_full']:.2f}x", f"{row['step_vs_lora_float']:.2f}x"]
        flag = " (loaded)" if m["loaded_runs"] else ""
        print(
            f"| {LABELS[mode]} | {m['runs'][0]['trainable']:,} | {m['setup_mb']:.0f} | {m['peak_mb']:.0f} | "
            f"{' | '.join(cells)} | {h.fmt_median_min(m, '.2f')}{flag} | {' | '.join(steps)} |"
        )
    h.print_failures(results.items())
    keys = ("model", "recipe", "dtype", "rank", "batch", "seq", "steps", "threads", "gradient_checkpointing")
    meta = {k: getattr(args, k) for k in keys}
    h.write_json(
        args.json, {**meta, "mmap_threshold": args.mmap_threshold, "ratios": ratios, "results": results}
    )


if __name__ == "__main__":
    main()
