"""Shared pieces of the trainer tests: a learnable token dataset and TrainingArguments for CPU runs."""

import torch
from transformers import TrainerCallback, TrainingArguments

from ._models import VOCAB


class CountingData(torch.utils.data.Dataset):
    """Sequences ``s, s+k, s+2k, ...`` (mod VOCAB) with a per-sample stride: easy to learn, not constant."""

    def __init__(self, n: int = 32, seq: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (n, 1), generator=g)
        strides = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (starts + strides * torch.arange(seq)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def cpu_args(tmp_path, **overrides) -> TrainingArguments:
    kwargs = dict(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def step_losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


class StopAt(TrainerCallback):
    """Stop after ``step`` optimizer steps (a shorter run on the same schedule as a longer one)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
