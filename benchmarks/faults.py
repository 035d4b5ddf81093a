"""Killed at a random moment, does a QAT / QAD run resume to the uninterrupted run's result, and is anything
left half-written?

Published in ``docs/training.md``, "Killed at any moment" (the table and its command):

    python benchmarks/faults.py --kills 20 --json faults.json

(``--quick``: 2 kills per phase and mode, a smoke run). Not run by default, each described in its module:

    python benchmarks/faults.py --modes convert --kills 20     # _faults_convert.py: SmolLM2-135M converted
    python benchmarks/faults.py --modes ddp,fsdp2 --kills 20   # _faults_dist.py: torchrun, rank 1 dies
    python benchmarks/faults.py --modes ddp --phases checkpoint # ... while a checkpoint is written
    python benchmarks/faults.py --modes ddp,fsdp2 --phases calibration,export  # ... or in those phases
    python benchmarks/faults.py --model smollm2-135m --modes qat --phases training   # a real model

Workload (one child process per run, ``--threads`` each): a tiny Llama built from a config (hidden 64, 2
layers, vocabulary 128, seed 0), INT4 block-wise weights with learnable amax (``QATTrainer``) or NVFP4 W4A4
distilled from the unquantized model (``QADTrainer``, ``--modes``), 6 steps of 4 x 16 tokens, a checkpoint
every 2 steps, then ``export_hf_checkpoint`` (``--model smollm2-135m``: the real model instead, on the
same token ids). The child marks each phase it enters in a file (calibration,
training, checkpoint: from the end of a saving step until ``on_save``, export, done) and writes its final
weights and quantizer tensors (``final.safetensors``) once the export is written.

Per mode: one uninterrupted run gives the reference (final tensors, the export's files by SHA-256) and each
phase's duration. Then, ``--kills`` times per phase, a child arms a timer on entering the phase that sends
it SIGKILL after a delay drawn uniformly from that phase's duration in the reference run (the n-th of the
three checkpoints drawn at random); the moment is counted in the phase the child had marked last when it
died (a delay that outlasted its phase lands in the next). The run is then resumed as a user would:
``train(resume_from_checkpoint=True)`` when a complete checkpoint exists, else from the start, to the end
and its export. Counted per phase: kills, resumes equal to the reference bit for bit (every tensor of the
model and the export's files), and runs that failed or left something half-written (a resume that raised,
an export folder without its files, a staging folder left behind).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import _faults_convert
import _faults_dist
import _harness as h
from _faults_files import digest, leftovers

PHASES = ("calibration", "training", "checkpoint", "export")
MODES = ("qat", "qad")
MORE_MODES = ("convert", "ddp", "fsdp2")  # (benchmarks/_faults_convert.py, _faults_dist.py; not by default)
STEPS, SAVE_EVERY = 6, 2


def _child(out: Path, mode: str, resume: bool, kill: str | None, model_name: str = "tiny") -> None:
    """One run (see the module docstring); ``kill`` = ``PHASE:DELAY[:CHECKPOINT]``; ``model_name`` a real
    model's name (``smollm2-135m``) instead of the tiny Llama."""
    import torch
    from safetensors.torch import save_file
    from transformers import TrainerCallback

    from modelopt_lite import DistillationArguments, QADTrainer, QATTrainer, QuantizationArguments
    from modelopt_lite.export import export_hf_checkpoint
    from modelopt_lite.training.checkpoints import resolve_checkpoint

    target, delay, nth = ([*kill.split(":"), ""])[:3] if kill else (None, "0", "")
    marks = out / "phases.jsonl"

    def mark(phase: str) -> None:
        with open(marks, "a") as f:
            f.write(json.dumps({"phase": phase, "t": time.time()}) + "\n")
        if phase == target and (target != "checkpoint" or nth == "" or state_step[0] == int(nth)):
            threading.Timer(float(delay), lambda: os.kill(os.getpid(), signal.SIGKILL)).start()

    state_step = [0]

    class Marks(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            mark("training")

        def on_step_end(self, args, state, control, **kwargs):
            state_step[0] = state.global_step
            if state.global_step % SAVE_EVERY == 0:
                mark("checkpoint")

        def on_save(self, args, state, control, **kwargs):
            mark("training")

    def model():
        if model_name != "tiny":  # (the token ids below are < 128: any real vocabulary takes them)
            from modelopt_lite.models import load_default_model

            return load_default_model(model_name)[0].train()
        return h.tiny_model(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (64, 16), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = h.cpu_training_args(str(out / "run"), STEPS, 4, 1e-3)
    args.save_strategy, args.save_steps = "steps", SAVE_EVERY
    if mode == "qat":
        quant = QuantizationArguments(recipe="INT4_BLOCKWISE_WEIGHT_ONLY_CFG", calib_size=8, learn_amax=True)
        trainer = QATTrainer(
            model=model(), args=args, train_dataset=data, quant_args=quant, callbacks=[Marks()]
        )
    else:
        quant = QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=8)
        trainer = QADTrainer(
            model=model(), args=args, train_dataset=data, quant_args=quant, callbacks=[Marks()],
            distill_args=DistillationArguments(), teacher_model=model(),
        )  # fmt: skip
    checkpoint = None
    if resume:
        try:
            checkpoint = resolve_checkpoint(True, args.output_dir)
        except ValueError:  # killed before its first complete checkpoint: start again
            checkpoint = None
    mark("calibration" if checkpoint is None else "restore")
    trainer.train(resume_from_checkpoint=checkpoint)
    mark("export")
    export_hf_checkpoint(trainer.model, out / "export", overwrite=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in trainer.model.state_dict().items()}
    save_file(tensors, str(out / "final.tmp"))
    os.replace(out / "final.tmp", out / "final.safetensors")
    mark("done")


def _spawn(
    out: Path, mode: str, threads: int, resume: bool = False, kill: str | None = None, model: str = "tiny"
) -> int:
    cmd = [sys.executable, __file__, "--child", str(out), "--mode", mode, "--threads", str(threads)]
    cmd += ["--model", model]
    cmd += ["--resume"] * resume + (["--kill", kill] if kill else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, timeout=900).returncode


def _marks(out: Path) -> list[dict]:
    path = out / "phases.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def measure_mode(
    mode: str,
    kills: int,
    threads: int,
    work: Path,
    rng: random.Random,
    phases: tuple[str, ...] = PHASES,
    model: str = "tiny",
) -> dict:
    ref = work / f"{mode}_reference"
    if _spawn(ref, mode, threads, model=model) != 0:
        raise RuntimeError(f"{mode}: the uninterrupted run failed")
    marks = _marks(ref)
    times = {}
    for a, b in itertools.pairwise(marks):
        times.setdefault(a["phase"], []).append(b["t"] - a["t"])
    reference = digest(ref)
    rows = {p: {"kills": 0, "exact": 0, "failed_or_partial": 0, "not_killed": 0} for p in (*PHASES, "other")}
    trials = []
    for phase in phases:
        for i in range(kills):
            out = work / f"{mode}_{phase}_{i}"
            durations = times[phase]
            nth = rng.randrange(len(durations))
            delay = rng.uniform(0, durations[nth])
            step = f":{SAVE_EVERY * (nth + 1)}" if phase == "checkpoint" else ""
            code = _spawn(out, mode, threads, kill=f"{phase}:{delay:.4f}{step}", model=model)
            marks_left = _marks(out)
            died_in = marks_left[-1]["phase"] if marks_left else "other"
            row = rows[died_in if died_in in rows else "other"]
            if code != -signal.SIGKILL:
                row["not_killed"] += 1
                continue
            row["kills"] += 1
            resumed = _spawn(out, mode, threads, resume=True, model=model)
            exact = resumed == 0 and digest(out) == reference
            bad = (
                resumed != 0
                or not (out / "export" / "hf_quant_config.json").is_file()
                or bool(leftovers(out))
            )
            row["exact"] += exact
            row["failed_or_partial"] += bad
            trials.append({
                "target": phase, "died_in": died_in, "delay_s": round(delay, 4), "resume_rc": resumed,
                "exact": exact, "leftovers": leftovers(out),
            })  # fmt: skip
            h.log(f"{mode} {phase} #{i}: died in {died_in} after {delay:.3f} s; resumed exact={exact}")
            if model != "tiny" and exact and not bad:  # a real model's checkpoints: 1.6 GB each (SmolLM2)
                shutil.rmtree(out)
    return {
        "rows": rows,
        "trials": trials,
        "phase_seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    p = h.common(h.parser(__doc__), threads=1, seed=0, quick="2 kills per phase and mode", json="the numbers")
    p.add_argument("--kills", type=int, default=20, help="kills per phase and mode")
    p.add_argument("--modes", default=",".join(MODES), help=f"from {[*MODES, *MORE_MODES]}")
    p.add_argument("--gguf", default="smollm2-135m", help="convert: the real model (a name or a .gguf file)")
    p.add_argument("--phases", help=f"where to kill (default {','.join(PHASES)}; ddp / fsdp2: training)")
    p.add_argument("--model", default="tiny", help="qat / qad: the tiny Llama, or a real model's name")
    p.add_argument("--workdir", help="keep the runs here (default: a temporary folder)")
    p.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--dist-child", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="qat", help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kill", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dist_child:  # one rank of a torchrun job
        h.pin_threads(args.threads)
        _faults_dist.worker(Path(args.dist_child), args.mode, args.resume, args.kill)
        return {}
    if args.child:
        h.pin_threads(args.threads)
        Path(args.child).mkdir(parents=True, exist_ok=True)
        if args.mode == "convert":
            _faults_convert.child(Path(args.child), args.gguf, args.kill)
            return {}
        _child(Path(args.child), args.mode, args.resume, args.kill, args.model)
        return {}
    import tempfile

    kills = 2 if args.quick else args.kills
    work = Path(args.workdir or tempfile.mkdtemp(prefix="faults_"))
    rng = random.Random(args.seed)
    start = time.time()
    phases = tuple(h.csv(args.phases or ",".join(PHASES)))
    if set(phases) - set(PHASES):
        p.error(f"--phases from {list(PHASES)}")
    modes = h.csv(args.modes)
    if set(modes) - {*MODES, *MORE_MODES}:
        p.error(f"--modes from {[*MODES, *MORE_MODES]}")
    result: dict[str, dict] = {}

    def progress(partial: dict) -> None:  # what is measured so far (a run stopped early keeps it)
        meta = h.run_meta(__file__, argv, time.time() - start)
        h.write_json(args.json, {**meta, "partial": True, "kills_per_phase": kills,
                                 "modes": {**result, mode: partial}})  # fmt: skip

    for mode in modes:
        if mode == "convert":
            result[mode] = _faults_convert.measure(args.gguf, kills, args.threads, work, rng, progress)
        elif mode in _faults_dist.SETTINGS:
            aimed = tuple(x for x in phases if x in _faults_dist.PHASES) if args.phases else ("training",)
            if not aimed:
                p.error(f"--modes {mode}: --phases from {list(_faults_dist.PHASES)}")
            result[mode] = _faults_dist.measure(mode, kills, work, rng, progress, aimed)
        else:
            result[mode] = measure_mode(mode, kills, args.threads, work, rng, phases, args.model)
    print(
        h.table_head(
            "| mode | phase | kills | resumed bit-exact | failed or half-written | not killed (ended first) |"
        )
    )
    for mode, res in result.items():
        for phase, r in res["rows"].items():
            if r["kills"] or r["not_killed"]:
                print(
                    h.table_row(mode, phase, r["kills"], r["exact"], r["failed_or_partial"], r["not_killed"])
                )
    for mode, res in result.items():
        if "death_to_exit_s" in res:
            print(f"{mode}: rank 1's death to the job's exit, min / median / max: {res['death_to_exit_s']} s")
    out = {**h.run_meta(__file__, argv, time.time() - start), "kills_per_phase": kills, "modes": result}
    h.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
