"""``_harness.cpu_training_args(..., checkpointing=True)``, what ``lora_memory.py --gradient-checkpointing``
trains with, really checkpoints the blocks (transformers 5.25 resolves ``gradient_checkpointing`` when the
arguments are built, so setting it afterwards, as the benchmark once did, silently trained without it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import Trainer

from ._models import tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _harness as h  # a sibling module of the benchmark scripts


def _saved_bytes(tmp_path: Path, checkpointing: bool, trainer_kind: str) -> tuple[int, list[float]]:
    """Bytes saved for backward outside the checkpointed blocks in one training step, and the losses."""
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(0, 100, (4, 32))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = h.cpu_training_args(str(tmp_path / str(checkpointing)), 1, 4, 1e-4, checkpointing)
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    if trainer_kind == "qad":  # ours, with adapters: QAD-LoRA on NVFP4, the teacher the float model
        import copy

        from peft import LoraConfig

        from modelopt_lite.training import DistillationArguments, QADTrainer, QuantizationArguments

        trainer = QADTrainer(
            model=model, args=args, train_dataset=data, teacher_model=copy.deepcopy(model),
            quant_args=QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=4),
            distill_args=DistillationArguments(),
            lora_config=LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "down_proj"]),
        )  # fmt: skip
        trainer.quantize_model()
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train()
    return saved[0], [e["loss"] for e in trainer.state.log_history if "loss" in e]


@pytest.mark.parametrize("trainer_kind", ["transformers", "qad"])
def test_checkpointing_is_on_when_asked_and_computes_the_same(tmp_path, trainer_kind):
    off, loss_off = _saved_bytes(tmp_path, False, trainer_kind)
    on, loss_on = _saved_bytes(tmp_path, True, trainer_kind)
    assert on < off / 3  # the blocks' activations are recomputed in backward, not kept
    assert loss_on == loss_off
