"""Argument dataclasses of the QAT / QAD trainers; ``transformers.HfArgumentParser`` parses them next to
``TrainingArguments`` (command line or YAML). Values are validated when the dataclass is built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..formats import learnable_amax_error
from ..nn.lora import require_peft
from ..quantization import QuantizeConfig, resolve_config
from ..quantization.config import ALGORITHMS, QuantRule
from .distill_loss import check_loss_options

__all__ = ["DistillationArguments", "QuantizationArguments"]

_EXPERTS = ("eager", "grouped_mm")
_MALLOC_TUNING = ("auto", "on", "off")
_LORA_DEPLOY = ("auto", "merged", "served")


@dataclass
class QuantizationArguments:
    recipe: str = field(
        default="general/qat/nvfp4",
        metadata={"help": "Packaged recipe name (general/qat/nvfp4, ...), a preset name (NVFP4_DEFAULT_CFG) "
                  "or a path to a recipe YAML file; with auto_quantize_bits, a comma list of them: the "
                  "candidate formats."},
    )  # fmt: skip
    auto_quantize_bits: float | None = field(
        default=None,
        metadata={"help": "Search a format per layer group among recipe's comma-separated candidates (and "
                  "unquantized) under this effective-bits budget (mtq.auto_quantize, as modelopt-lite-ptq "
                  "--auto_quantize_bits B --qformat a,b), on the calibration data, then train."},
    )  # fmt: skip
    auto_quantize_method: str = field(
        default="gradient", metadata={"help": "Score of the auto_quantize search: gradient or kl_div."}
    )
    auto_quantize_score_size: int = field(
        default=128, metadata={"help": "Calibration samples that score the auto_quantize candidates."}
    )
    calib_algorithm: str | None = field(
        default=None,
        metadata={"help": f"Calibration algorithm instead of the recipe's ({', '.join(ALGORITHMS)}), so that "
                  "training starts from that PTQ model; default: the recipe's own."},
    )  # fmt: skip
    learn_amax: bool = field(
        default=False,
        metadata={"help": "Train the amax of every static INT / FP8 quantizer of the recipe (per tensor, "
                  "channel or block) and the per-block amax (FP8 block scales) of static NVFP4 weights "
                  "(NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG) with the model, starting from the calibrated value "
                  "(LSQ gradient; NVFP4's global amax stays fixed, as in the reference's LSQ)."},
    )  # fmt: skip
    trainable_params: list[str] | None = field(
        default=None,
        metadata={"help": "fnmatch patterns of the parameter names that train; every other parameter is "
                  "frozen (nvidia-modelopt's trainable_params). Scale-only training of learn_amax: "
                  "['*weight_quantizer._amax']. Mutually exclusive with frozen_params."},
    )  # fmt: skip
    frozen_params: list[str] | None = field(
        default=None,
        metadata={"help": "fnmatch patterns of the parameter names that are frozen (nvidia-modelopt's "
                  "frozen_params); mutually exclusive with trainable_params."},
    )  # fmt: skip
    amax_lr_multiplier: float = field(
        default=1.0,
        metadata={"help": "Learning rate of learnable amax parameters relative to learning_rate (they get "
                  "their own optimizer param group, without weight decay)."},
    )  # fmt: skip
    lora: bool = field(
        default=False,
        metadata={"help": "Train LoRA adapters (peft) on the frozen quantized model instead of its weights "
                  "(a lora_config passed to the trainer wins over the lora_* fields)."},
    )  # fmt: skip
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (the adapter is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the adapter input (served only)."})
    lora_target_modules: str = field(
        default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        metadata={"help": "Comma-separated module names that get an adapter (peft's target_modules)."},
    )
    lora_deploy: str = field(
        default="auto",
        metadata={"help": "merged: the weight quantizer sees W + s B A and the export merges the adapter; "
                  "served: the adapter runs beside the quantized base and is exported as a peft adapter; "
                  "auto: served on a compressed base (QLoRA), merged otherwise."},
    )  # fmt: skip
    calib_size: int = field(default=512, metadata={"help": "Number of calibration samples."})
    calib_batch_size: int = field(default=1, metadata={"help": "Batch size of the calibration passes."})
    calib_dataset: str | None = field(
        default=None,
        metadata={"help": "Calibration data: a local .txt / .md / .json / .jsonl / .csv / .parquet file, a "
                  "directory written by datasets' save_to_disk or a cached dataset name "
                  "(modelopt_lite.data), "
                  "tokenized by the trainer's tokenizer; default: the first train samples."},
    )  # fmt: skip
    calib_text_field: str = field(
        default="text", metadata={"help": "The field of calib_dataset's records that holds the text."}
    )
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
    malloc_tuning: str = field(
        default="auto",
        metadata={"help": "During train(), raise glibc's mmap / trim thresholds (mallopt) so that large "
                  "temporaries are reused from the heap instead of page-faulted in again every step; "
                  "restored when train() returns. auto: on when training on the CPU; on; off. A no-op "
                  "without glibc and when MALLOC_*_ / GLIBC_TUNABLES set the allocator."},
    )  # fmt: skip
    malloc_mmap_threshold_mb: int = field(
        default=1024,
        metadata={"help": "With malloc_tuning: blocks up to this many MiB come from the heap (the trim "
                  "threshold is twice this, at most 2 GiB)."},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.calib_algorithm is not None and self.calib_algorithm not in ALGORITHMS:
            raise ValueError(
                f"calib_algorithm={self.calib_algorithm!r} is unknown (known: {', '.join(ALGORITHMS)})"
            )
        if not isinstance(self.learn_amax, bool):
            raise ValueError(f"learn_amax={self.learn_amax!r} must be True or False")
        multiplier = self.amax_lr_multiplier
        if (
            isinstance(multiplier, bool)
            or not isinstance(multiplier, (int, float))
            or not (math.isfinite(multiplier) and multiplier > 0)
        ):
            raise ValueError(f"amax_lr_multiplier={multiplier!r} must be a positive number")
        for name in ("trainable_params", "frozen_params"):
            patterns = getattr(self, name)
            if patterns is not None and (
                isinstance(patterns, str)
                or not patterns
                or not all(isinstance(p, str) and p for p in patterns)
            ):
                raise ValueError(
                    f"{name}={patterns!r} must be a non-empty list of parameter-name patterns, e.g. "
                    "['*weight_quantizer._amax']"
                )
        if self.trainable_params is not None and self.frozen_params is not None:
            raise ValueError("trainable_params and frozen_params are mutually exclusive: set one of them")
        if (self.trainable_params is not None or self.frozen_params is not None) and self.lora:
            raise ValueError(
                "trainable_params / frozen_params and lora=True both choose what trains: with LoRA only the "
                "adapters train; unset one of them"
            )
        candidates = self.quantize_configs()  # unknown recipe names raise, listing presets and recipes
        if len(candidates) > 1 and self.auto_quantize_bits is None:
            raise ValueError(
                f"recipe={self.recipe!r} names {len(candidates)} formats: set auto_quantize_bits to search "
                "among them, or name one recipe"
            )
        if self.auto_quantize_method not in ("gradient", "kl_div"):
            raise ValueError(f"auto_quantize_method={self.auto_quantize_method!r} must be gradient or kl_div")
        for name in ("calib_size", "calib_batch_size", "calib_seq_len", "auto_quantize_score_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if (
            self.calib_dataset is not None
            and Path(self.calib_dataset).suffix
            and not Path(self.calib_dataset).exists()
        ):
            raise ValueError(f"calib_dataset={self.calib_dataset!r}: no such file")
        if self.experts_implementation not in (None, *_EXPERTS):
            raise ValueError(f"experts_implementation={self.experts_implementation!r} (allowed: {_EXPERTS})")
        if self.gc_refreeze_every is not None and self.gc_refreeze_every < 1:
            raise ValueError(f"gc_refreeze_every={self.gc_refreeze_every!r} must be >= 1 or unset")
        if self.lora_deploy not in _LORA_DEPLOY:
            raise ValueError(f"lora_deploy={self.lora_deploy!r} (allowed: {', '.join(_LORA_DEPLOY)})")
        if self.lora:
            require_peft()
            if self.lora_r < 1 or not self.lora_target_modules.strip():
                raise ValueError(
                    f"lora_r={self.lora_r!r} must be >= 1 and lora_target_modules non-empty "
                    f"(got {self.lora_target_modules!r})"
                )
            if not 0 <= self.lora_dropout < 1:
                raise ValueError(f"lora_dropout={self.lora_dropout!r} must be in [0, 1)")
        if self.malloc_tuning not in _MALLOC_TUNING:
            raise ValueError(f"malloc_tuning={self.malloc_tuning!r} (allowed: {', '.join(_MALLOC_TUNING)})")
        mb = self.malloc_mmap_threshold_mb
        if isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= 2047:
            raise ValueError(
                f"malloc_mmap_threshold_mb={mb!r} must be an integer from 1 to 2047 (mallopt's limit)"
            )

    def lora_config(self) -> Any:
        """The ``peft.LoraConfig`` of the ``lora_*`` fields (causal LM), or None without ``lora``."""
        if not self.lora:
            return None
        from peft import LoraConfig, TaskType  # the peft extra; checked in __post_init__

        targets = [t.strip() for t in self.lora_target_modules.split(",") if t.strip()]
        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=targets,
            task_type=TaskType.CAUSAL_LM,
        )

    def quantize_configs(self) -> list[QuantizeConfig]:
        """:meth:`quantize_config` of each comma-separated name of ``recipe`` (several are the candidates of
        ``auto_quantize_bits``)."""
        return [self.quantize_config(name.strip()) for name in self.recipe.split(",")]

    def quantize_config(self, recipe: str | None = None) -> QuantizeConfig:
        """The config the trainers quantize with: the recipe (or ``recipe``; the first candidate under
        ``auto_quantize_bits``), with ``calib_algorithm`` replacing its algorithm and, with ``learn_amax``,
        ``learn_amax: True`` added to every rule that sets a static INT / FP8 or static NVFP4 quantizer
        (rules of dynamic NVFP4 / MX / dynamic quantizers are kept as written)."""
        config = resolve_config(recipe or self.recipe.split(",")[0].strip())
        if self.calib_algorithm is not None and self.calib_algorithm != config.algorithm_name:
            config = QuantizeConfig(config.quant_cfg, self.calib_algorithm)
        if self.learn_amax:
            config = QuantizeConfig(tuple(_learnable(r) for r in config.quant_cfg), config.algorithm)
        return config


@dataclass
class DistillationArguments:
    teacher_model: str | None = field(
        default=None, metadata={"help": "Path of the teacher model (loaded offline); or pass an nn.Module."}
    )
    temperature: float = field(default=1.0, metadata={"help": "Softmax temperature of the KL term."})
    kd_loss_weight: float = field(
        default=1.0, metadata={"help": "Weight of the distillation term (T^2 * distill_loss)."}
    )
    ce_loss_weight: float = field(
        default=0.0, metadata={"help": "Weight of the cross-entropy on the labels."}
    )
    distill_loss: str = field(
        default="forward_kl",
        metadata={"help": "The divergence of the distillation term, each times T^2, with p the teacher's "
                  "and q the student's softmax(logits / T): forward_kl (default, KL(p || q), the "
                  "reference's); reverse_kl (KL(q || p)); jsd (generalized Jensen-Shannon with jsd_beta, "
                  "as TRL's GKD / Liger's JSD: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + "
                  "(1 - beta) q); top_k_kl (KL on the teacher's distill_top_k most likely tokens, both "
                  "renormalized)."},
    )  # fmt: skip
    jsd_beta: float = field(
        default=0.5,
        metadata={"help": "beta of distill_loss=jsd in [0, 1]: 0 is the forward KL, 1 the reverse KL, 0.5 "
                  "the symmetric JSD (nvidia-modelopt's liger_jsd_beta)."},
    )  # fmt: skip
    distill_top_k: int = field(
        default=50,
        metadata={"help": "Tokens (the teacher's most likely at each position) that distill_loss=top_k_kl "
                  "compares; >= 2."},
    )  # fmt: skip
    distill_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "None (default): the distillation loss on the whole batch at once, nvidia-modelopt's "
            "arithmetic bit for bit. A number of tokens: the loss chunk by chunk, holding one chunk's "
            "full-vocabulary logits instead of the batch's (less memory; the same loss up to float "
            "rounding, which parts a training run from the reference's)."
        },
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
        if self.distill_chunk_size is not None and self.distill_chunk_size < 1:
            raise ValueError(f"distill_chunk_size={self.distill_chunk_size!r} must be None or >= 1")
        check_loss_options(self.distill_loss, self.jsd_beta, self.distill_top_k)


def _learnable(rule: QuantRule) -> QuantRule:
    """``rule`` with ``learn_amax: True`` in each stage whose format has a static amax to learn."""
    stages = rule.attributes()
    if stages is None or not any(learnable_amax_error(a.spec()) is None for a in stages):
        return rule
    cfgs = rule.cfg if isinstance(rule.cfg, tuple) else (rule.cfg,)
    new: list[dict[str, Any]] = [
        {**c, "learn_amax": True} if learnable_amax_error(a.spec()) is None else dict(c)
        for c, a in zip(cfgs, stages, strict=True)
    ]
    cfg: Any = tuple(new) if isinstance(rule.cfg, tuple) else new[0]
    return QuantRule(rule.quantizer_name, cfg, rule.enable, rule.parent_class)
