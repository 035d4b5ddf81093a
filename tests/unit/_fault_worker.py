"""Run as a script by test_faults.py: a short QAT run of the tiny Llama that kills itself with SIGKILL at a
chosen moment (the Nth ``torch.save`` / safetensors write of a checkpoint file, or an optimizer step), or
runs to the end; the test then resumes it in its own process and compares with an uninterrupted run."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import safetensors.torch
import torch
from transformers import TrainerCallback

from modelopt_lite import QATTrainer, QuantizationArguments
from tests.unit._models import tiny_llama
from tests.unit._training import CountingData, cpu_args

RECIPE = QuantizationArguments(recipe="INT4_BLOCKWISE_WEIGHT_ONLY_CFG", calib_size=8, learn_amax=True)


def trainer(out: str, steps: int = 6, save_steps: int = 2, **kwargs) -> QATTrainer:
    args = cpu_args(out, max_steps=steps, save_strategy="steps", save_steps=save_steps, weight_decay=0.1)
    return QATTrainer(
        model=tiny_llama(), args=args, train_dataset=CountingData(n=64), quant_args=RECIPE, **kwargs
    )


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _KillAtStep(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            _die()


def _kill_on_write(target: str) -> None:
    """SIGKILL when the checkpoint file ``target`` (``checkpoint-4/optimizer.pt``) starts being written."""
    real_save, real_sf = torch.save, safetensors.torch.save_file

    def check(path) -> None:
        if str(path).endswith(target):
            Path(path).write_bytes(b"\0" * 16)  # a file cut short
            _die()

    def save(obj, f, *a, **k):
        if isinstance(f, (str, os.PathLike)):
            check(f)
        return real_save(obj, f, *a, **k)

    def save_file(tensors, filename, *a, **k):
        check(filename)
        return real_sf(tensors, filename, *a, **k)

    torch.save, safetensors.torch.save_file = save, save_file


if __name__ == "__main__":
    out, moment = sys.argv[1], sys.argv[2]  # moment: "write:<checkpoint-N/file>", "step:<N>" or "none"
    callbacks = []
    if moment.startswith("write:"):
        _kill_on_write(moment.removeprefix("write:"))
    elif moment.startswith("step:"):
        callbacks.append(_KillAtStep(int(moment.removeprefix("step:"))))
    trainer(out, callbacks=callbacks).train()
