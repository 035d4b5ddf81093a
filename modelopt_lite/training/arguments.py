"""Argument dataclasses of the QAT / QAD trainers; ``transformers.HfArgumentParser`` parses them next to
``TrainingArguments`` (command line or YAML). Values are validated when the dataclass is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..quantization import resolve_config

__all__ = ["DistillationArguments", "QuantizationArguments"]

_EXPERTS = ("eager", "grouped_mm")


@dataclass
class QuantizationArguments:
    recipe: str = field(
        default="general/qat/nvfp4",
        metadata={"help": "Packaged recipe name (general/qat/nvfp4, ...), a preset name (NVFP4_DEFAULT_CFG) "
                  "or a path to a recipe YAML file."},
    )  # fmt: skip
    calib_size: int = field(default=512, metadata={"help": "Number of calibration samples."})
    calib_batch_size: int = field(default=1, metadata={"help": "Batch size of the calibration passes."})
    calib_dataset: str | None = field(
        default=None,
        metadata={"help": "Calibration data: a local .txt, .json or .jsonl file (records with a 'text' "
                  "field), tokenized by the trainer's tokenizer; default: the first train samples."},
    )  # fmt: skip
    calib_seq_len: int = field(default=512, metadata={"help": "Tokens per sample read from calib_dataset."})
    experts_implementation: str | None = field(
        default=None,
        metadata={"help": "How fused MoE experts run: eager or grouped_mm (default: the model's)."},
    )
    manual_gc: bool = field(
        default=True, metadata={"help": "Collect before each step and freeze the GC after the first step."}
    )
    gc_refreeze_every: int | None = field(
        default=None, metadata={"help": "Unfreeze, collect and freeze again every N optimizer steps."}
    )

    def __post_init__(self) -> None:
        resolve_config(self.recipe)  # unknown names raise, listing presets and recipes
        for name in ("calib_size", "calib_batch_size", "calib_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.calib_dataset is not None and not Path(self.calib_dataset).is_file():
            raise ValueError(f"calib_dataset={self.calib_dataset!r} is not a file")
        if self.experts_implementation not in (None, *_EXPERTS):
            raise ValueError(f"experts_implementation={self.experts_implementation!r} (allowed: {_EXPERTS})")
        if self.gc_refreeze_every is not None and self.gc_refreeze_every < 1:
            raise ValueError(f"gc_refreeze_every={self.gc_refreeze_every!r} must be >= 1 or unset")


@dataclass
class DistillationArguments:
    teacher_model: str | None = field(
        default=None, metadata={"help": "Path of the teacher model (loaded offline); or pass an nn.Module."}
    )
    temperature: float = field(default=1.0, metadata={"help": "Softmax temperature of the KL term."})
    kd_loss_weight: float = field(default=1.0, metadata={"help": "Weight of T^2 * KL(teacher || student)."})
    ce_loss_weight: float = field(
        default=0.0, metadata={"help": "Weight of the cross-entropy on the labels."}
    )
    distill_chunk_size: int = field(
        default=512, metadata={"help": "Tokens per chunk of the distillation loss."}
    )

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r} must be > 0")
        if (
            self.kd_loss_weight < 0
            or self.ce_loss_weight < 0
            or self.kd_loss_weight + self.ce_loss_weight == 0
        ):
            raise ValueError("kd_loss_weight and ce_loss_weight must be >= 0 and not both 0")
        if self.distill_chunk_size < 1:
            raise ValueError(f"distill_chunk_size={self.distill_chunk_size!r} must be >= 1")
