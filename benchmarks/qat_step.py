"""What does a QAT (or QAD) step cost over a plain ``transformers.Trainer`` step, and the reference's?

Published in ``docs/benchmarks.md``, "QAT step time" and its sections (the commands with each table there),
and ``docs/real_qad.md`` (the step-time ratios at real width), for example:

    OMP_NUM_THREADS=2 python benchmarks/qat_step.py --reference-python PY
    python benchmarks/qat_step.py --interleaved --threads 1 --rounds 2 [--levers-off]
    python benchmarks/qat_step.py --interleaved --model smollm2-135m --threads 2 --steps 6 --warmup 2 --json F

(``--quick``: 2 timed steps after 1 warm-up, FP8 and NVFP4, a smoke run).

``--interleaved``: instead of a process per trainer, one process per allocator setting (and round) holds the
plain ``Trainer`` and a ``QATTrainer`` per preset, and their optimizer steps are taken in turn (plain, FP8,
NVFP4, INT4, plain, ...), so that other jobs on a shared machine slow every trainer alike; the ratios come
from the same process. Each step is the one ``Trainer.train()`` takes (``training_step``, clipping,
``optimizer.step()``, scheduler, ``zero_grad``, the ``on_step_end`` callbacks); the allocator setting is
applied to the whole process (``malloc_tuned()``) for ``on``. No reference column. Wall and CPU seconds.
``--levers-off`` adds, per preset, a second ``QATTrainer`` whose steps run with the native fake-quant
kernels and the shared outputs of identical inputs turned off (``set_native_fake_quant(False)``,
``TensorQuantizer.share_outputs = False`` around its steps): what the two levers buy, in the same process.
``--qad PRESET ...`` (interleaved only) adds two kinds of steppers: ``plain+teacher``, the plain ``Trainer``
step plus, inside the timed step, one ``torch.no_grad()`` forward of a frozen float copy of the model (the
teacher, full logits) on the same batch -- the cost QAD cannot avoid -- and per preset ``QAD PRESET``, a
``modelopt_lite.training.QADTrainer`` with that same teacher and ``DistillationArguments()`` as they come
(KL at temperature 1, no cross-entropy, chunks of 512 tokens), quantized and calibrated like the QAT ones.
The table then adds ``QAD PRESET / plain+teacher``.

``--model smollm2-135m`` (interleaved only): the real model (``modelopt_lite.models``, its float32
checkpoint; every stepper and the teacher a deep copy of it) instead of the config model; data: the first
``4 * (--warmup + --steps)`` consecutive 256-token windows of the corpus' ``fit`` split (real text, the
windows ``benchmarks/accuracy.py`` trains on, here in order; ``labels`` = ``input_ids``), batches of 4,
AdamW lr 3e-4. Its defaults: ``--configs NVFP4_DEFAULT_CFG FP8_DEFAULT_CFG``, ``--qad NVFP4_DEFAULT_CFG``,
``--malloc on`` (our trainers' default on CPU); the steppers in turn: plain, plain+teacher, QAT NVFP4, QAT
FP8, QAD NVFP4. Seven fp32 copies of the 135M model and five AdamW states are held at once: peak RSS
15.8 GB (measured with ``--steps 1 --warmup 1``).

Model: ``LlamaForCausalLM`` from a config (hidden 256, intermediate 688, 4 layers, 4 heads / 2 KV heads,
vocab 4096 or ``--vocab``), fp32, ``torch.manual_seed(0)``. Data: ``--warmup + --steps`` batches of 4x128
random ``input_ids`` (fixed generator; ``labels`` = ``input_ids``). ``TrainingArguments`` are the same for
every run: ``max_steps = warmup + steps``, batch 4, AdamW (Trainer's default) lr 1e-4 with the linear
schedule, ``use_cpu=True``, ``report_to=[]``, ``save_strategy="no"``, ``logging_steps=1``, seed 0.

Trainers, each ``train()`` in a fresh process:

* ``plain``: ``transformers.Trainer`` on the unquantized model (the baseline of every ratio);
* ``ours``: ``modelopt_lite.training.QATTrainer`` with ``QuantizationArguments(recipe=PRESET, calib_size=8,
  calib_batch_size=4, malloc_tuning=on|off)``: ``quantize_model()`` quantizes and max-calibrates on the first
  8 train samples (timed; ``train()`` would do it first, and skips it on a quantized model); its
  ``training_step`` collects garbage first, and the collector is frozen after the first optimizer step (the
  default ``manual_gc=True``);
* ``ref``: nvidia-modelopt's ``modelopt.torch.quantization.plugins.transformers_trainer.QATTrainer`` under
  ``--reference-python`` (default ``$MODELOPT_REFERENCE_PYTHON``) with its
  ``QuantizationArguments(calib_size=8)``. Its ``recipe`` argument takes only recipe YAML files
  (``general/ptq/...``, all with KV-cache quantizers that its Hugging Face plugin cannot add with
  transformers 5.24), so the same preset dict is
  assigned to ``trainer.quant_cfg`` after construction -- the attribute its ``_quantize_model`` reads. It
  quantizes and calibrates inside its first ``training_step`` (a warm-up step here) and its
  ``training_step`` runs a full ``gc.collect()`` before every step, never freezing (``ModelOptHFTrainer``'s
  own ``manual_gc`` collection is off by default). That interpreter has
  no transformers / accelerate: this interpreter's copies (and whichever of their dependencies it lacks,
  with their ``.dist-info``) are lent to it through a folder of symlinks on ``PYTHONPATH``, so both sides run
  the same transformers, accelerate and torch. A reference that cannot be imported or fails shows as
  ``n/a (reason: ...)`` with the exception message.

Allocator (``--malloc``, default ``both``): ``plain`` and ``ours`` run once with glibc's allocator as it
comes (``off``: ``QuantizationArguments(malloc_tuning="off")``; the plain ``Trainer`` untouched) and once
with the trainers' allocator setting (``on``: ``malloc_tuning="on"``, i.e. glibc's mmap / trim thresholds
raised for ``train()``; the plain ``Trainer``'s ``train()`` inside ``modelopt_lite.allocator.malloc_tuned()``,
the same policy -- what the setting buys any CPU training loop). The reference runs with glibc's defaults
only. A ``MALLOC_*_`` / ``GLIBC_TUNABLES`` allocator setting in the environment turns the ``on`` runs into
``off`` runs (the policy keeps the user's setting): the table says so. ``ours`` also times its calibration
(``QATTrainer.quantize_model()``, i.e. ``mtq.quantize`` with max calibration on the 8 samples), called before
``train()`` under the same setting. Every child also reports, per timed step, its minor page faults
(``getrusage``) and CPU seconds (``time.process_time``, all threads) -- less sensitive to a shared machine
than wall time -- and its peak RSS (``VmHWM``).

Presets: ``FP8_DEFAULT_CFG``, ``NVFP4_DEFAULT_CFG``, ``INT4_BLOCKWISE_WEIGHT_ONLY_CFG``. Timed: with a
``TrainerCallback`` added last, ``time.perf_counter()`` from ``on_step_begin`` to ``on_step_end`` of every
optimizer step, i.e. the gc call, forward, backward, gradient clipping, ``optimizer.step()``, scheduler and
``zero_grad`` -- not the data loading (fetched before ``on_step_begin``) nor logging (after
``on_step_end``). The first ``--warmup`` steps are not counted. Reported per trainer: the min and median of
the timed steps (pooled over ``--rounds`` rounds of processes, each round: plain, per preset ours and ref,
plain again) and their ratio to the plain Trainer of the same run. A ``gc.callbacks`` hook also sums the
time of the garbage collections inside the timed steps (the trainers' explicit ``gc.collect()`` and
Python's automatic ones).

Before each child the parent waits (``--max-wait``) until other processes keep at most ``--max-other-load``
cores busy (``/proc/stat``); a child during whose timed steps others kept more cores busy is rerun
(``--retries``) and, if disturbed every time, the least disturbed try is kept and flagged ``loaded``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence

import _harness as h

CONFIGS = ["FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"]
QUICK_CONFIGS = ["FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG"]
REF_TRAINER = "modelopt.torch.quantization.plugins.transformers_trainer"
BATCH, SEQ, VOCAB, CALIB_SAMPLES, LR = 4, 128, 4096, 8, 1e-4
REAL_SEQ, REAL_LR = 256, 3e-4  # --model (a real model): 4 x 256 tokens of the fit split, lr 3e-4
REAL_CONFIGS, REAL_QAD = ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"], ["NVFP4_DEFAULT_CFG"]
TEACHER, QAD = "plain+teacher", "QAD "  # --qad: the plain step plus a teacher forward; QADTrainer per preset
MODEL = dict(
    hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, max_position_embeddings=256,
)  # fmt: skip


# ----------------------------------------------------------------------------------------------- child


def _child(
    which: str, config: str, threads: int, warmup: int, steps: int, malloc: str = "off", vocab: int = VOCAB
) -> dict:
    import contextlib
    import copy
    import gc
    import resource
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback

    torch.set_num_threads(threads)
    model = h.tiny_model(**{**MODEL, "vocab_size": vocab})
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (BATCH * (warmup + steps), SEQ), generator=gen)
    data = [{"input_ids": row, "labels": row} for row in ids]

    class StepTimer(TrainerCallback):
        """Per-step wall time, and the time of the garbage collections (explicit or automatic) inside the
        timed steps, through ``gc.callbacks``."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.step, self.start, self.window, self.timing = 0, 0.0, None, False
            self.gc_start, self.gc_seconds, self.gc_runs = 0.0, 0.0, 0
            self.probe, self.malloc_state = (lambda: "off"), "off"  # the allocator policy's state
            self.faults, self.cpu, self.faults0, self.cpu0 = 0, 0.0, 0, 0.0

        def __call__(self, phase: str, info: dict) -> None:  # gc.callbacks hook
            if phase == "start":
                self.gc_start = time.perf_counter()
            elif self.timing:
                self.gc_seconds += time.perf_counter() - self.gc_start
                self.gc_runs += 1

        def on_step_begin(self, args, state, control, **kwargs):
            if self.step == warmup:  # first timed step: start the load window
                self.window = h.CpuMark.now()
                self.malloc_state = self.probe()
            self.timing = self.step >= warmup
            self.faults0, self.cpu0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.start
            cpu, faults = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            self.timing = False
            if self.step >= warmup:
                self.times.append(seconds)
                self.faults += faults - self.faults0
                self.cpu += cpu - self.cpu0
            self.step += 1

    timer = StepTimer()
    gc.callbacks.append(timer)
    with tempfile.TemporaryDirectory(prefix="qat_step_") as out:
        args = h.cpu_training_args(out, warmup + steps, BATCH, LR)
        if which == "plain":
            trainer = Trainer(model=model, args=args, train_dataset=data)
        elif which == "ours":
            from modelopt_lite.training import QATTrainer, QuantizationArguments

            quant = QuantizationArguments(
                recipe=config, calib_size=CALIB_SAMPLES, calib_batch_size=BATCH,
                malloc_tuning="on" if malloc == "on" else "off",
            )  # fmt: skip
            trainer = QATTrainer(model=model, args=args, train_dataset=data, quant_args=quant)
        else:
            import importlib

            import modelopt.torch.quantization as mtq

            plugin = importlib.import_module(REF_TRAINER)
            if not hasattr(mtq, config):
                return {"error": f"config {config} not present in the reference library"}
            quant_args = plugin.QuantizationArguments(calib_size=CALIB_SAMPLES)
            trainer = plugin.QATTrainer(model=model, args=args, train_dataset=data, quant_args=quant_args)
            trainer.quant_cfg = copy.deepcopy(getattr(mtq, config))  # what its _quantize_model reads
        tuned = malloc == "on"
        calib_s = float("nan")
        if which == "ours":
            from modelopt_lite.allocator import malloc_tuned

            with malloc_tuned() if tuned else contextlib.nullcontext():
                start = time.perf_counter()
                trainer.quantize_model()  # train() skips it now: the model carries quantizer state
                calib_s = time.perf_counter() - start
            timer.probe = lambda: trainer.malloc_policy.state
        trainer.add_callback(timer)
        start = time.perf_counter()
        if which == "plain" and tuned:
            from modelopt_lite.allocator import malloc_tuned

            with malloc_tuned() as policy:
                timer.probe = lambda: policy.state
                trainer.train()
        else:
            trainer.train()
        train_s = time.perf_counter() - start
        others = timer.window.since()[1] if timer.window is not None else float("nan")
    if len(timer.times) != steps:
        return {"error": f"timed {len(timer.times)} steps, expected {steps}"}
    quantizers = [m for m in model.modules() if any(c.__name__ == "TensorQuantizer" for c in type(m).__mro__)]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {
        "times": timer.times, "train_s": train_s, "other_cores_busy": others, "final_loss": losses[-1],
        "quantizers": len(quantizers), "enabled_quantizers": sum(bool(q.is_enabled) for q in quantizers),
        "torch": torch.__version__, "gc_s_per_step": timer.gc_seconds / steps,
        "gc_runs_per_step": timer.gc_runs / steps, "calib_s": calib_s, "malloc_state": timer.malloc_state,
        "minflt_per_step": timer.faults / steps, "cpu_s_per_step": timer.cpu / steps,
        "peak_rss_mb": h.status_mb("VmHWM"),
    }  # fmt: skip


#: suffix of the trainers ``--levers-off`` adds: the same preset, stepped with the native kernels and the
#: shared outputs off (the eager formulas, every quantizer its own fake quant)
LEVERS_OFF = " (native kernels, sharing off)"


def _levers(on: bool) -> None:
    from modelopt_lite.formats import set_native_fake_quant
    from modelopt_lite.nn import TensorQuantizer

    set_native_fake_quant(on)
    TensorQuantizer.share_outputs = on


def _interleaved(
    configs: list[str],
    threads: int,
    warmup: int,
    steps: int,
    malloc: str,
    vocab: int,
    levers_off: bool = False,
    qad: Sequence[str] = (),
    model_name: str | None = None,
) -> dict:
    """``--interleaved``: the plain ``Trainer`` and a ``QATTrainer`` per preset in one process, their
    optimizer steps taken in turn (plain, each preset, plain, ...), so that a shared machine's load drifts
    over every trainer alike. Each step is the one ``Trainer.train()`` takes: ``training_step`` (ours
    collects garbage first), gradient clipping, ``optimizer.step()``, the scheduler, ``zero_grad`` and the
    ``on_step_end`` callbacks (ours freezes the collector after its first step). With ``qad`` presets, also
    ``plain+teacher`` (the plain step plus one no-grad forward of a float teacher on the same batch) and a
    ``QADTrainer`` per preset (``QAD`` + preset; the same teacher, ``DistillationArguments()``). Returns per
    trainer the wall and CPU seconds (``time.thread_time``: this thread, the only one at ``threads == 1``;
    else ``process_time``) of each step after ``warmup``, and the loss of every step."""
    import contextlib
    import copy
    import tempfile

    import torch
    from transformers import Trainer

    from modelopt_lite.allocator import malloc_tuned
    from modelopt_lite.training import DistillationArguments, QADTrainer, QATTrainer, QuantizationArguments

    torch.set_num_threads(threads)
    seq, lr = SEQ, LR
    if model_name:  # a real model: its fp32 weights, the fit split's windows
        from modelopt_lite.data import token_stream, windows
        from modelopt_lite.models import corpus_texts, load_default_model

        base, tokenizer = load_default_model(model_name, train_if_missing=False)
        seq, lr, n = REAL_SEQ, REAL_LR, BATCH * (warmup + steps)
        ids = windows(token_stream(tokenizer, corpus_texts("fit")), seq, n, "the fit split")
        if len(ids) < n:
            raise ValueError(f"the fit split holds {len(ids)} windows of {seq} tokens, {n} needed")
        make = lambda: copy.deepcopy(base)  # noqa: E731
    else:
        make = lambda: h.tiny_model(**{**MODEL, "vocab_size": vocab})  # noqa: E731
        gen = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, vocab, (BATCH * (warmup + steps), seq), generator=gen)
    data = [{"input_ids": row, "labels": row} for row in ids]
    cpu_clock = time.thread_time if threads == 1 else time.process_time
    names = ["plain", *([TEACHER] if qad else []), *configs, *(QAD + c for c in qad)]
    names += [c + LEVERS_OFF for c in configs] if levers_off else []
    teacher = make().eval().requires_grad_(False) if qad else None  # the float model, shared, frozen
    res: dict = {n: {"times": [], "cpu": [], "loss": []} for n in names}
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(tempfile.TemporaryDirectory(prefix="qat_step_"))
        stack.enter_context(malloc_tuned(malloc == "on"))
        args = h.cpu_training_args(out, warmup + steps, BATCH, lr)
        trainers = {}
        for name in names:
            model = make()
            if name in ("plain", TEACHER):
                trainer = Trainer(model=model, args=args, train_dataset=data)
            else:
                quant = QuantizationArguments(
                    recipe=name.removesuffix(LEVERS_OFF).removeprefix(QAD),
                    calib_size=CALIB_SAMPLES,
                    calib_batch_size=BATCH,
                    malloc_tuning="off",
                )  # the allocator setting is the whole process's here
                common = dict(model=model, args=args, train_dataset=data, quant_args=quant)
                if name.startswith(QAD):
                    distill = DistillationArguments()  # KL at temperature 1, chunked
                    trainer = QADTrainer(**common, distill_args=distill, teacher_model=teacher)
                else:
                    trainer = QATTrainer(**common)
                trainer.quantize_model()
            trainer.create_optimizer_and_scheduler(num_training_steps=warmup + steps)
            trainer.current_gradient_accumulation_steps = 1  # what train() sets before its steps
            model.train()
            trainers[name] = trainer
        for step in range(warmup + steps):
            batch = trainers["plain"].data_collator(data[step * BATCH : (step + 1) * BATCH])
            for name, trainer in trainers.items():
                model, state = trainer.model, trainer.state
                _levers(not name.endswith(LEVERS_OFF))
                start, cpu0 = time.perf_counter(), cpu_clock()
                if name == TEACHER:  # the teacher's forward QAD cannot avoid, on the same batch
                    with torch.no_grad():
                        teacher(input_ids=batch["input_ids"])
                loss = trainer.training_step(model, dict(batch))
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                trainer.optimizer.step()
                trainer.lr_scheduler.step()
                model.zero_grad()
                state.global_step += 1
                trainer.callback_handler.on_step_end(args, state, trainer.control)
                wall, cpu = time.perf_counter() - start, cpu_clock() - cpu0
                res[name]["loss"].append(float(loss))
                if step >= warmup:
                    res[name]["times"].append(wall)
                    res[name]["cpu"].append(cpu)
        _levers(True)  # the defaults again
        for trainer in trainers.values():
            policy = getattr(trainer, "gc_policy", None)
            if policy is not None:
                policy.close()
    return {"results": res, "torch": torch.__version__}


def _main_interleaved(args, configs: list[str], mallocs: list[str]) -> None:
    """Run ``--rounds`` interleaved processes per allocator setting and print median (min) per trainer and
    its ratio to the plain ``Trainer`` of the same processes (wall and CPU)."""
    env = h.child_env(args.threads, h.REPO_ROOT, keep_pythonpath=False, TRANSFORMERS_VERBOSITY="error")
    pooled: dict[str, dict[str, dict[str, list[float]]]] = {}
    for _ in range(args.rounds):
        for malloc in mallocs:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "interleaved", "--configs", *configs]
            cmd += ["--threads", str(args.threads), "--warmup", str(args.warmup), "--steps", str(args.steps)]
            cmd += ["--malloc", malloc, "--vocab", str(args.vocab)] + (
                ["--levers-off"] if args.levers_off else []
            )
            cmd += ["--qad", *args.qad] if args.qad is not None else []  # [] too: no QAD stepper
            cmd += ["--model", args.model] if args.model else []
            res = h.run_child(cmd, env, timeout=7200 if args.model else 1800)
            if "error" in res:
                print(f"interleaved malloc {malloc} failed: {res['error']}")
                continue
            for name, r in res["results"].items():
                slot = pooled.setdefault(malloc, {}).setdefault(name, {"times": [], "cpu": []})
                slot["times"] += r["times"]
                slot["cpu"] += r["cpu"]
    n = args.steps * args.rounds
    if args.model:
        what = f"{args.model}, fp32, batch {BATCH}x{REAL_SEQ} of the fit split, lr {REAL_LR}"
        print(f"\n{what}; threads {args.threads}; {args.warmup} warm-up step(s)")
    print(
        f"\n### Interleaved in one process per setting: median (min) of {n} steps; ratios to the plain "
        "`Trainer` of the same processes (medians (mins))\n"
    )
    print(h.table_head("| trainer | allocator | wall s / step | / plain | CPU s / step | / plain |"))
    for malloc, rows in pooled.items():
        base = {k: h.time_stats(rows["plain"][k]) for k in ("times", "cpu")}
        for name, r in rows.items():
            cells = []
            for k in ("times", "cpu"):
                m = h.time_stats(r[k])
                cells += [h.fmt_median_min(m), h.fmt_ratio(m, base[k])]
            label = {"plain": "plain `Trainer`", TEACHER: "plain `Trainer` + teacher forward"}.get(name)
            print(f"| {label or f'ours {name}'} | {malloc} | " + " | ".join(cells) + " |")
    for malloc, rows in pooled.items():  # what QAD costs beyond the teacher forward it cannot avoid
        if TEACHER in rows:
            base = {k: h.time_stats(rows[TEACHER][k]) for k in ("times", "cpu")}
            for name in (n for n in rows if n.startswith(QAD)):
                wall, cpu = (h.fmt_ratio(h.time_stats(rows[name][k]), base[k]) for k in ("times", "cpu"))
                print(f"\n{name} / plain+teacher ({malloc}): wall {wall}, CPU {cpu} (medians (mins))")
    meta = {"interleaved": True, "threads": args.threads, "model": args.model or "config Llama"}
    h.write_json(args.json, {**meta, "results": pooled})


# ---------------------------------------------------------------------------------------------- parent

_PROBE = f"import accelerate, transformers, {REF_TRAINER}; from transformers import TrainingArguments"


def _run_child(which: str, config: str, malloc: str, python: str, extra_path: str | None, args) -> dict:
    """Run one ``train()`` in a fresh process after waiting for a quiet machine; rerun while other
    processes kept > ``--max-other-load`` cores busy during its timed steps (if every try was disturbed, the
    least disturbed one is kept, flagged ``loaded``)."""
    env = h.child_env(
        args.threads, extra_path, keep_pythonpath=False, TRANSFORMERS_VERBOSITY="error",
        TOKENIZERS_PARALLELISM="false",
    )  # fmt: skip
    cmd = [python, os.path.abspath(__file__), "--child", which, "--config", config]
    cmd += ["--threads", str(args.threads), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    cmd += ["--malloc", malloc, "--vocab", str(args.vocab)]

    def show(res: dict) -> None:
        times = ", ".join(f"{t:.3f}" for t in res["times"])
        print(
            f"  {which:<5} {config} malloc {malloc}: {times} s/step; train() {res['train_s']:.1f} s, loss "
            f"{res['final_loss']:.3f}, {res['enabled_quantizers']}/{res['quantizers']} quantizers on, gc "
            f"{res['gc_s_per_step']:.3f} s/step; calib {res['calib_s']:.2f} s; peak RSS "
            f"{res['peak_rss_mb']:.0f} MB; allocator {res['malloc_state']}; others "
            f"{res['other_cores_busy']:.2f} cores", flush=True,
        )  # fmt: skip

    def disturbed(res: dict, retrying: bool) -> None:
        note = ", retrying" if retrying else "; keeping the least disturbed (flagged loaded)"
        print(f"  {which} {config} malloc {malloc}: disturbed{note}", flush=True)

    return h.run_child_when_quiet(
        cmd, env, max_other=args.max_other_load, max_wait=args.max_wait, retries=args.retries,
        # a neutral working directory: the reference interpreter must not pick up this checkout by accident
        cwd=os.path.dirname(python) or None, limit=300, keep_least_disturbed=True, on_result=show,
        on_disturbed=disturbed,
    )  # fmt: skip


def _pool(runs: list[dict]) -> dict:
    """Merge the rounds of one (trainer, preset): the first error wins, else the pooled step times."""
    for res in runs:
        if "error" in res:
            return {"error": res["error"], "traceback": res.get("traceback", "")}
    return {
        "runs": runs, **h.time_stats(t for res in runs for t in res["times"]),
        "loaded_runs": sum(r["loaded"] for r in runs),
        "enabled_quantizers": runs[0]["enabled_quantizers"], "quantizers": runs[0]["quantizers"],
        "final_loss": statistics.median(r["final_loss"] for r in runs),
        "gc_s_per_step": statistics.median(r["gc_s_per_step"] for r in runs),
        "gc_runs_per_step": statistics.median(r["gc_runs_per_step"] for r in runs),
        "calib": h.time_stats(r["calib_s"] for r in runs),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "malloc_states": sorted({r["malloc_state"] for r in runs}),
        "minflt_per_step": statistics.median(r["minflt_per_step"] for r in runs),
        "cpu_s_per_step": statistics.median(r["cpu_s_per_step"] for r in runs),
    }  # fmt: skip


def _details(m: dict | None) -> str:
    if m is None or "error" in m:
        return "n/a"
    gc = f"gc {m['gc_s_per_step']:.3f} s/step ({m['gc_runs_per_step']:.1f} runs)"
    return f"{m['enabled_quantizers']}/{m['quantizers']} quantizers, loss {m['final_loss']:.3f}, {gc}"


def _cell(m: dict | None, plain: dict) -> tuple[str, str]:
    """(``median (min)`` seconds, ratio to plain ``median (min)``) table cells."""
    if m is None or "error" in m:
        return h.fmt_cell(m), "" if m is None else "n/a"
    ratio = "n/a" if "error" in plain else h.fmt_ratio(m, plain)
    return h.fmt_cell(m) + (" (loaded)" if m["loaded_runs"] else ""), ratio


def main() -> None:
    parser = h.common(
        h.parser(__doc__), threads=2, quick="2 timed steps after 1 warm-up, FP8 and NVFP4",
        json="write the raw numbers here", reference="interpreter with nvidia-modelopt (else no ref column)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per process")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--rounds", type=int, default=1, help="fresh processes per trainer and preset")
    parser.add_argument("--configs", nargs="+", help=f"subset of {CONFIGS}")
    h.load_flags(parser, max_wait=120, retries=1)
    parser.add_argument("--no-reference", action="store_true", help="skip nvidia-modelopt")
    parser.add_argument(
        "--malloc", choices=["both", "on", "off"],
        help="glibc allocator setting of plain / ours: off (glibc as it comes), on (the trainers' "
        "malloc_tuning), both (default; on with --model)",
    )  # fmt: skip
    parser.add_argument(
        "--model", help="with --interleaved: a real model by name (smollm2-135m) instead of the config model"
    )
    parser.add_argument(
        "--qad", nargs="*",
        help=f"with --interleaved: presets of QADTrainer steppers, adding the plain step + teacher forward "
        f"(default with --model: {REAL_QAD})",
    )  # fmt: skip
    parser.add_argument(
        "--vocab", type=int, default=VOCAB,
        help="vocabulary size (32000: logits and embedding gradients above glibc's 32 MiB mmap ceiling)",
    )  # fmt: skip
    parser.add_argument(
        "--interleaved", action="store_true",
        help="one process per allocator setting: plain and every preset's steps taken in turn (ratios from "
        "the same process; no reference)",
    )  # fmt: skip
    parser.add_argument(
        "--levers-off", action="store_true",
        help="with --interleaved: also each preset with the native kernels and shared outputs off",
    )  # fmt: skip
    h.hidden(parser, child=["plain", "ours", "ref", "interleaved"], config=str)
    args = parser.parse_args()
    args.config = args.config or "none"
    if (args.model or args.qad is not None) and not args.interleaved and args.child != "interleaved":
        parser.error("--model and --qad need --interleaved")
    if args.model:
        args.malloc = args.malloc or "on"
        args.qad = REAL_QAD if args.qad is None else args.qad
        args.configs = args.configs or REAL_CONFIGS
    args.malloc = args.malloc or "both"
    if args.child == "interleaved":
        a = args
        configs = a.configs or CONFIGS
        run = lambda: _interleaved(  # noqa: E731
            configs, a.threads, a.warmup, a.steps, a.malloc, a.vocab, a.levers_off, a.qad or (), a.model
        )
        h.run_and_emit(run, 300)
        return
    if args.child:
        a = args
        run = lambda: _child(a.child, a.config, a.threads, a.warmup, a.steps, a.malloc, a.vocab)  # noqa: E731
        h.run_and_emit(run, 300)
        return
    if args.quick:
        args.steps, args.warmup = 2, 1
    configs = args.configs or (QUICK_CONFIGS if args.quick else CONFIGS)
    if args.interleaved:
        _main_interleaved(args, configs, ["off", "on"] if args.malloc == "both" else [args.malloc])
        return

    print(
        f"tiny Llama (hidden 256, 4 layers, vocab {args.vocab}), fp32, batch {BATCH}x{SEQ}; threads "
        f"{args.threads}; {args.steps} timed steps after {args.warmup} warm-up step(s), {args.rounds} "
        "round(s); each train() in a fresh process", flush=True,
    )  # fmt: skip
    ref_python, ref_path, ref_note = args.reference_python, None, "skipped (--no-reference)"
    if not args.no_reference and h.reference_usable(ref_python)[0]:
        ref_path, borrowed, err = h.borrow(ref_python, _PROBE)  # transformers, accelerate and its trainer
        ref_note = f"`import {REF_TRAINER}` (with transformers, accelerate) failed: {err}" if err else ""
        if borrowed and not err:
            print(f"note: {ref_python} borrows {', '.join(borrowed)} from {sys.executable}", flush=True)
    elif not args.no_reference:
        ref_note = h.reference_usable(ref_python)[1]
    ref_ok = not ref_note
    if not ref_ok:
        print(f"note: reference: {ref_note}", flush=True)

    mallocs = ["off", "on"] if args.malloc == "both" else [args.malloc]
    user_env = [n for n in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_",
                            "MALLOC_TOP_PAD_", "GLIBC_TUNABLES") if os.environ.get(n)]  # fmt: skip
    if user_env:
        print(f"note: {', '.join(user_env)} set: the 'on' runs keep that setting (policy off)", flush=True)
    runs: dict[tuple[str, str, str], list[dict]] = {}
    for _ in range(args.rounds):
        jobs = [("plain", "none", m, sys.executable, h.REPO_ROOT) for m in mallocs]
        for config in configs:
            jobs += [("ours", config, m, sys.executable, h.REPO_ROOT) for m in mallocs]
            if ref_ok:
                jobs.append(("ref", config, "off", ref_python, ref_path))
        jobs += jobs[: len(mallocs)]  # the baselines again at the end: drift hits them like the others
        for which, config, malloc, python, extra_path in jobs:
            res = _run_child(which, config, malloc, python, extra_path, args)
            runs.setdefault((which, config, malloc), []).append(res)
    pooled = {key: _pool(value) for key, value in runs.items()}
    ref_missing = {"error": ref_note} if not ref_ok else None

    n = args.steps * args.rounds
    print(
        f"\n### Training step time, seconds per optimizer step: median (min) of {n} steps; ratios from "
        "medians (mins); each trainer against the plain `transformers.Trainer` under the same allocator "
        "setting\n"
    )
    head = "| trainer, recipe |"
    for m in mallocs:
        label = "glibc as it comes" if m == "off" else "malloc_tuning on"
        head += f" s/step, {label} | / plain ({m}) |"
    print(h.table_head(head + (" on / off |" if len(mallocs) == 2 else "")))

    def row(label: str, which: str, config: str) -> None:
        line = f"| {label} |"
        cells = {}
        for m in mallocs:
            cells[m] = pooled.get((which, config, m), ref_missing if which == "ref" and m == "off" else None)
            plain = pooled["plain", "none", m]
            cell, ratio = _cell(cells[m], plain) if cells[m] is not None else ("", "")
            line += f" {cell} | {ratio} |"
        if len(mallocs) == 2:
            on, off = cells["on"], cells["off"]
            ok = on is not None and off is not None and "error" not in on and "error" not in off
            line += f" {h.fmt_ratio(on, off)} |" if ok else " |"
        print(line)

    row("plain `Trainer`", "plain", "none")
    for config in configs:
        row(f"ours {config}", "ours", config)
        if not args.no_reference:
            row(f"reference {config}", "ref", config)

    print("\nCalibration (`QATTrainer.quantize_model()`, max on 8 samples), seconds: median (min)")
    for config in configs:
        parts = []
        for m in mallocs:
            res = pooled.get(("ours", config, m))
            parts.append(
                f"{m} " + ("n/a" if res is None or "error" in res else h.fmt_median_min(res["calib"], ".2f"))
            )
        print(f"  {config}: {'; '.join(parts)}")
    print(
        "\nper timed step (medians over processes): minor page faults, CPU seconds of the process (all its "
        "threads); peak RSS of the child (VmHWM, MB, max over rounds); allocator policy state in train():"
    )
    for (side, config, m), res in pooled.items():
        if "error" not in res:
            states = ", ".join(res["malloc_states"])
            print(
                f"  {side} {config} {m}: {res['minflt_per_step']:.0f} faults, "
                f"{res['cpu_s_per_step']:.3f} CPU s; {res['peak_rss_mb']:.0f} MB; allocator {states}"
            )
    print("\nquantizers enabled, final loss, garbage collection inside the timed steps (s/step, runs/step):")
    for (side, config, m), res in pooled.items():
        print(f"  {side} {config} {m}: {_details(res)}")
    loaded = [" ".join(k) for k, m in pooled.items() if m.get("loaded_runs")]
    if loaded:
        print(f"\nwarning: still disturbed by other processes after retries: {', '.join(loaded)} (inflated)")
    torches = {r["torch"] for rs in runs.values() for r in rs if "torch" in r}
    if len(torches) > 1:
        print(f"\nwarning: the children ran different torch versions: {sorted(torches)}")
    for key, m in pooled.items():
        if "error" in m:
            tb = (m.get("traceback") or "").strip().splitlines()
            print(f"\n{' '.join(key)} failed: {m['error']}" + ("\n  " + "\n  ".join(tb[-5:]) if tb else ""))
    meta = dict(threads=args.threads, steps=args.steps, warmup=args.warmup, rounds=args.rounds)
    meta.update(reference_python=ref_python, reference_note=ref_note, configs=configs, mallocs=mallocs)
    h.write_json(args.json, {**meta, "results": {"/".join(key): m for key, m in pooled.items()}})


if __name__ == "__main__":
    main()
