"""``QATTrainer``: a ``transformers.Trainer`` that quantizes and calibrates the model as a visible, logged
step before the training loop, and runs the garbage-collector policy around the steps.

Work in progress toward the full trainer (checkpointed quantizer state with exact resume, QAD, FSDP2): this
first step covers calibration before the loop and the gc policy.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ..logging import get_logger
from ..quantization import quant_state, quantize
from .arguments import QuantizationArguments
from .gc_policy import GCPolicy

__all__ = ["QATTrainer"]

logger = get_logger(__name__)


class _GCCallback(TrainerCallback):
    """Freeze after the first optimizer step (``on_step_end`` runs after ``optimizer.step()``)."""

    def __init__(self, policy: GCPolicy):
        self.policy = policy

    def on_step_end(self, args, state, control, **kwargs):
        self.policy.after_optimizer_step()


class QATTrainer(Trainer):
    def __init__(self, *args: Any, quant_args: QuantizationArguments | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.quant_args = quant_args or QuantizationArguments()
        self.gc_policy = GCPolicy(self.quant_args.manual_gc, self.quant_args.gc_refreeze_every)
        self.add_callback(_GCCallback(self.gc_policy))

    def _calibration_batches(self) -> list[dict[str, torch.Tensor]]:
        if self.train_dataset is None:
            raise ValueError("QATTrainer needs a train_dataset (calibration uses its first samples)")
        size = self.quant_args.calib_size
        if len(self.train_dataset) < size:
            logger.warning("calib_size=%d is larger than the dataset (%d samples): using all of them", size,
                           len(self.train_dataset))  # fmt: skip
        samples = [self.train_dataset[i] for i in range(min(size, len(self.train_dataset)))]
        bs = self.quant_args.calib_batch_size
        batches = []
        for start in range(0, len(samples), bs):
            batch = self.data_collator(samples[start : start + bs])
            batches.append({k: v for k, v in batch.items() if k != "labels"})
        return batches

    def quantize_model(self) -> None:
        """Insert quantizers and calibrate (skipped when the model already carries quantizer state)."""
        model = self.model
        if quant_state(model) is not None:
            logger.info("model already quantized (restored quantizer state): skipping calibration")
            return
        logger.info("quantizing with %s and calibrating on %d sample(s)", self.quant_args.recipe,
                    self.quant_args.calib_size)  # fmt: skip
        quantize(
            model, self.quant_args.recipe, self._calibration_batches(), self.quant_args.experts_implementation
        )

    def train(self, *args: Any, **kwargs: Any):
        self.quantize_model()
        try:
            return super().train(*args, **kwargs)
        finally:
            self.gc_policy.close()

    def training_step(self, *args: Any, **kwargs: Any):
        self.gc_policy.before_step()
        return super().training_step(*args, **kwargs)
