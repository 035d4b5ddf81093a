"""``benchmarks/faults.py --modes ddp,fsdp2``: a 2-process QAT run (``torchrun --standalone
--nproc_per_node 2``, gloo, one thread per rank) where rank 1 SIGKILLs itself at a random moment of the
training phase, or (``--phases calibration`` / ``checkpoint`` / ``export``) during calibration, while a
checkpoint is written or during the export.

Workload: the tiny Llama of the single-process modes, INT4 block-wise weights with learnable amax
(``QATTrainer``), 6 steps of 2 x 16 tokens per rank, a checkpoint every 2 steps. ``ddp``: what accelerate
builds under torchrun on CPU (DDP). ``fsdp2``: the same trainer with FSDP2 put back after the accelerator is
built (accelerate turns FSDP into DDP on CPU: ``_harness.fsdp2_on_cpu``, the shim the tests use too),
sharded checkpoints. At the end each job writes the final weights and amax, gathered whole on rank 0
(``full_tensor`` of every DTensor under FSDP2), to ``final.safetensors``, then exports the model with
``export_hf_checkpoint`` as ``examples/llm_qat/main.py`` does (FSDP2: every rank, one module gathered at a
time, rank 0 writes; DDP: rank 0 alone, rank 1 waits at the barrier after it).

Per setting, an uninterrupted job gives the reference and the length of its training phase (rank 1's
``on_train_begin`` to the end of its last step, checkpoint writing included), of each checkpoint's writing
(from the step's end to ``on_save``), of its calibration (from calling ``train`` to ``on_train_begin``: the
quantizers inserted and calibrated, amax merged across ranks) and of its export (to the barrier after it).
Each trial: rank 1 arms a timer on entering the phase aimed at (``on_train_begin``; the end of the step that
saves the checkpoint; calling ``train``; the export) that writes ``time.time()`` to ``died`` and then sends
itself SIGKILL, after a delay drawn uniformly from that phase's length (or that checkpoint's); the
launcher measures the time from that moment until the whole torchrun
job has exited, and keeps the survivor's error (``error_0.json``, written by rank 0 as its exception leaves
``train``: none when the launcher's SIGTERM came first). The whole job is then launched again, with
``resume_from_checkpoint=True`` when a complete checkpoint exists (else from the start, as a user would),
and its final tensors and export files compared with the reference's bit for bit (SHA-256).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _harness as h
from _faults_files import digest, leftovers

STEPS, SAVE_EVERY, BATCH = 6, 2, 2
SETTINGS = ("ddp", "fsdp2")
PHASES = ("calibration", "training", "checkpoint", "export")


def worker(out: Path, setting: str, resume: bool, kill: str | None) -> None:
    """One rank of the job (under torchrun); ``kill``: ``PHASE:DELAY``, or ``checkpoint:DELAY:STEP`` (rank 1
    dies that long after entering the phase, or after the step that saves ``checkpoint-STEP`` ended)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from transformers import TrainerCallback

    from modelopt_lite import QATTrainer, QuantizationArguments
    from modelopt_lite.distributed import is_sharded, naming_lost_rank
    from modelopt_lite.export import export_hf_checkpoint
    from modelopt_lite.training.checkpoints import checkpoint_problem

    rank = int(os.environ["RANK"])
    target, delay, at_step = ([*kill.split(":"), ""])[:3] if kill else (None, None, "")

    def mark(phase: str) -> None:
        with open(out / f"phases_{rank}.jsonl", "a") as f:
            f.write(json.dumps({"phase": phase, "t": time.time()}) + "\n")

    def die() -> None:
        (out / "died").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def arm(phase: str, step: int = 0) -> None:
        if rank == 1 and phase == target and (phase != "checkpoint" or step == int(at_step)):
            threading.Timer(float(delay), die).start()

    class Marks(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            mark("training")
            arm("training")

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == STEPS:
                mark("end")
            elif state.global_step % SAVE_EVERY == 0:
                mark("checkpoint")
                arm("checkpoint", state.global_step)

        def on_save(self, args, state, control, **kwargs):
            if state.global_step < STEPS:
                mark("training")

    trainer_class = QATTrainer if setting == "ddp" else h.fsdp2_on_cpu(QATTrainer)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (64, 16), generator=g)
    args = h.cpu_training_args(str(out / "run"), STEPS, BATCH, 1e-3)
    args.save_strategy, args.save_steps = "steps", SAVE_EVERY
    model = h.tiny_model(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip
    quant = QuantizationArguments(recipe="INT4_BLOCKWISE_WEIGHT_ONLY_CFG", calib_size=8, learn_amax=True)
    data = [{"input_ids": r, "labels": r} for r in ids]
    trainer = trainer_class(model=model, args=args, train_dataset=data, quant_args=quant, callbacks=[Marks()])
    run = Path(args.output_dir)
    complete = resume and any(checkpoint_problem(p) is None for p in run.glob("checkpoint-*"))
    try:
        mark("calibration" if not complete else "restore")
        arm("calibration")  # (a resumed job marks "restore": no timer)
        trainer.train(resume_from_checkpoint=True if complete else None)
        state = {}
        for name, p in trainer.accelerator.unwrap_model(trainer.model).state_dict().items():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # (FSDP2: every rank takes part)
            state[name] = full.detach().clone().contiguous()
        if rank == 0:
            save_file(state, str(out / "final.tmp"))
            os.replace(out / "final.tmp", out / "final.safetensors")
        mark("export")
        arm("export")
        model = trainer.accelerator.unwrap_model(trainer.model)
        if is_sharded(model) or rank == 0:  # (as examples/llm_qat/main.py: DDP replicas export once)
            export_hf_checkpoint(model, out / "export", overwrite=True)
        with naming_lost_rank("after the export"):
            dist.barrier()
        mark("done")
    except BaseException as err:
        text = f"{type(err).__module__}.{type(err).__qualname__}: {err}"
        staged = out / f"error_{rank}.json.tmp"  # (torchrun's SIGTERM may come while this is written)
        staged.write_text(json.dumps({"t": time.time(), "error": text}))
        os.replace(staged, out / f"error_{rank}.json")
        raise
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (gloo sometimes aborts in torch's static destructors after a finished FSDP2 run)


def _launch(out: Path, setting: str, resume: bool = False, kill: str | None = None) -> dict:
    """The torchrun job; ``rc``, ``stderr`` and the moment it exited."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           h.REPO_ROOT + "/benchmarks/faults.py", "--dist-child", str(out), "--mode", setting]  # fmt: skip
    cmd += ["--resume"] * resume + (["--kill", kill] if kill else [])  # fmt: skip
    path = os.pathsep.join(filter(None, [h.REPO_ROOT, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    return {"rc": proc.returncode, "stderr": proc.stderr, "exited": time.time()}


def _marks(out: Path, rank: int) -> list[dict]:
    path = out / f"phases_{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def _leftovers(out: Path) -> list[str]:
    """Temporary and staging files, and checkpoints that are not complete, in a finished run's output."""
    from modelopt_lite.training.checkpoints import checkpoint_problem

    incomplete = [p.name for p in (out / "run").glob("checkpoint-*") if checkpoint_problem(p) is not None]
    return leftovers(out) + incomplete


def _survivor_error(out: Path, stderr: str) -> str | None:
    path = out / "error_0.json"
    if path.is_file():
        return h.portable_text(json.loads(path.read_text())["error"])
    (out / "error_0.json.tmp").unlink(missing_ok=True)  # (cut short by the launcher's SIGTERM)
    lines = [line for line in stderr.splitlines() if line.startswith("[rank0]:") and "Error" in line]
    return h.portable_text(lines[-1].removeprefix("[rank0]:").strip()) if lines else None


def measure(
    setting: str,
    kills: int,
    work: Path,
    rng: random.Random,
    progress: Any = None,
    phases: tuple[str, ...] = ("training",),
) -> dict:
    """The mode's rows (one per phase aimed at) and trials (``progress(result)`` after each trial: what is
    measured so far)."""
    ref = work / f"{setting}_reference"
    job = _launch(ref, setting)
    if job["rc"] != 0:
        raise RuntimeError(
            f"{setting}: the uninterrupted job failed (rc {job['rc']}): {job['stderr'][-3000:]}"
        )
    marks = _marks(ref, 1)
    at: dict[str, float] = {}
    for m in marks:  # each phase's first mark (training's is on_train_begin; it is marked again after saves)
        at.setdefault(m["phase"], m["t"])
    length = at["end"] - at["training"]
    lengths = {"calibration": at["training"] - at["calibration"], "training": length,
               "export": at["done"] - at["export"]}  # fmt: skip
    writing = [b["t"] - a["t"] for a, b in itertools.pairwise(marks) if a["phase"] == "checkpoint"]
    saves = [(SAVE_EVERY * (n + 1), seconds) for n, seconds in enumerate(writing)]  # (checkpoint-2, -4)
    reference = digest(ref)
    if not any(k.endswith("_amax") for k in reference) or not any(k.startswith("export/") for k in reference):
        raise RuntimeError(f"{setting}: the reference job wrote no final tensors with amax, or no export")
    h.log(f"{setting}: reference job: calibration {lengths['calibration']:.2f} s, training phase "
          f"{length:.1f} s, checkpoints {', '.join(f'{s:.2f}' for _, s in saves)} s, export "
          f"{lengths['export']:.2f} s, {len(reference)} tensors and files")  # fmt: skip
    rows = {p: {"kills": 0, "exact": 0, "failed_or_partial": 0, "not_killed": 0} for p in phases}
    trials: list[dict] = []
    exits: list[float] = []
    result = {"rows": rows, "trials": trials, "training_seconds": round(length, 2),
              "calibration_seconds": round(lengths["calibration"], 3),
              "export_seconds": round(lengths["export"], 3),
              "checkpoint_seconds": {f"checkpoint-{n}": round(s, 3) for n, s in saves}}  # fmt: skip
    for phase, i in ((p, i) for p in phases for i in range(kills)):
        out = work / (f"{setting}_{i}" if phase == "training" else f"{setting}_{phase}_{i}")
        row = rows[phase]
        if phase != "checkpoint":
            delay = rng.uniform(0, lengths[phase])
            kill = f"{phase}:{delay:.4f}"
        else:
            step, seconds = saves[rng.randrange(len(saves))]
            delay = rng.uniform(0, seconds)
            kill = f"checkpoint:{delay:.4f}:{step}"
        job = _launch(out, setting, kill=kill)
        if not (out / "died").is_file():
            row["not_killed"] += 1
            continue
        died = float((out / "died").read_text())
        row["kills"] += 1
        seconds = job["exited"] - died
        exits.append(seconds)
        before = [m["phase"] for m in _marks(out, 1) if m["t"] <= died]
        survivor = _survivor_error(out, job["stderr"])
        summary = "local_rank: 1" in job["stderr"] and "exitcode  : -9" in job["stderr"]
        launcher_term = "exitcode  : -15" in job["stderr"]  # (rank 0 ended by torchrun's SIGTERM)
        resumed = _launch(out, setting, resume=True)
        exact = resumed["rc"] == 0 and digest(out) == reference
        left = _leftovers(out)
        bad = resumed["rc"] != 0 or bool(left)
        row["exact"] += exact
        row["failed_or_partial"] += bad
        failed = {"resume_stderr": h.portable_text(resumed["stderr"][-3000:])} if resumed["rc"] else {}
        trials.append({
            "target": phase, "delay_s": round(delay, 3), "died_in": before[-1] if before else "startup",
            "rc": job["rc"],
            "death_to_exit_s": round(seconds, 3), "survivor_error": survivor, "summary_names_rank_1": summary,
            "survivor_terminated_by_launcher": launcher_term, "resume_rc": resumed["rc"], "exact": exact,
            "leftovers": left, **failed,
        })  # fmt: skip
        h.log(f"{setting} {phase} #{i}: rank 1 died in {trials[-1]['died_in']} after {delay:.2f} s; "
              f"job exited {seconds:.2f} s later; survivor: {(survivor or 'no error (terminated)')[:120]}; "
              f"resumed exact={exact}")  # fmt: skip
        stats = {"min": min(exits), "median": statistics.median(exits), "max": max(exits)}
        result["death_to_exit_s"] = {k: round(v, 3) for k, v in stats.items()}
        if progress is not None:
            progress(result)
    return result
