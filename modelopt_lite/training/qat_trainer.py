"""``QATTrainer``: a ``transformers.Trainer`` that quantizes and calibrates the model as a visible, logged
step before the training loop, saves the quantizer state with every checkpoint, restores it on resume, and
runs the garbage-collector policy around the steps.

Control flow of ``train()``:

1. with ``resume_from_checkpoint``: re-create the quantizers from the checkpoint's
   ``modelopt_lite_state.json`` (the recipe must be the same; the weights and amax load with the rest of
   the checkpoint); otherwise, unless the model already carries quantizer state, quantize with
   ``quant_args.recipe`` and calibrate on ``calib_dataset`` (or the first ``calib_size`` train samples);
2. ``Trainer.train`` runs the loop; ``training_step`` collects garbage first, a callback freezes the
   collector after the first optimizer step;
3. on exit (also on error) the collector is unfrozen if this trainer froze it.

With ``quant_args.malloc_tuning`` (``auto``: when training on the CPU), steps 1-2 run with glibc's mmap and
trim thresholds raised (:class:`~modelopt_lite.allocator.MallocPolicy`), set back on exit, also on error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers import Trainer, TrainingArguments

from ..allocator import MallocPolicy
from ..data import check_sequence_length
from ..distributed import all_ranks_succeed, is_sharded, naming_lost_rank, rank, unsharded_class, world_size
from ..distributed.comm import record_ranks, set_collective_timeout
from ..export.shards import ShardWriter
from ..logging import get_logger
from ..nn.lora import is_peft_model, lora_deploy
from ..opt.checkpoint import STATE_FILE, first_difference
from ..opt.hf import attached
from ..opt.state import modelopt_state, restore_from_modelopt_state
from ..quantization import auto_quantize, need_calibration, quant_state, quantize
from ..quantization.compress import compressed_layers
from ..quantization.config import plain
from ..quantization.config.presets import AUTO_QUANTIZE_DISABLED
from ..quantization.lora import warn_unquantized_adapters
from .adapters import load_frozen_base, save_frozen_base, with_adapters
from .arguments import QuantizationArguments
from .calib_data import calibration_samples, check_training_data
from .callbacks import _AmaxCheckCallback, _GCCallback
from .checkpoints import CompleteCheckpointCallback, load_finished, resolve_checkpoint, trained_steps
from .gc_policy import GCPolicy
from .trainable import choose_trainable, unify_learned_static_scales

__all__ = ["QATTrainer"]

logger = get_logger(__name__)
_SAVE_SHARD_BYTES = 2 * 2**30


def learnable_amax_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``{parameter name: Parameter}`` of the learnable amax (``learn_amax=True``) in ``model``."""
    return {n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] == "_amax"}


class QATTrainer(Trainer):
    """``Trainer`` for quantization-aware training. Extra keyword arguments:

    * ``quant_args``: :class:`QuantizationArguments` (recipe, calibration size, gc policy, ...);
    * ``calib_dataset``: a dataset of tokenized samples for calibration (default: ``quant_args.calib_dataset``
      read and tokenized with ``processing_class``, else the first ``calib_size`` train samples);
    * ``lora_config``: a ``peft.LoraConfig`` (default: ``quant_args.lora_config()``, from ``--lora``): the
      model is wrapped with the adapters (:func:`mtq.add_lora`, deployed as ``quant_args.lora_deploy``)
      before it is quantized, and only the adapters train. A model already wrapped by ``get_peft_model``
      trains its adapters as it is.
    """

    def __init__(
        self,
        *args: Any,
        quant_args: QuantizationArguments | None = None,
        calib_dataset: Any = None,
        lora_config: Any = None,
        **kwargs: Any,
    ):
        quant_args = quant_args or QuantizationArguments()
        lora_config = lora_config if lora_config is not None else quant_args.lora_config()
        if lora_config is not None:
            args, kwargs = with_adapters(args, kwargs, lora_config, quant_args.lora_deploy)
        super().__init__(*args, **kwargs)
        self.quant_args = quant_args
        self.calib_dataset = calib_dataset
        self.gc_policy = GCPolicy(self.quant_args.manual_gc, self.quant_args.gc_refreeze_every)
        self.add_callback(_GCCallback(self.gc_policy))
        self.add_callback(CompleteCheckpointCallback())
        on = {"on": True, "auto": self.args.device.type == "cpu"}.get(self.quant_args.malloc_tuning, False)
        self.malloc_policy = MallocPolicy(on, self.quant_args.malloc_mmap_threshold_mb * 2**20)
        self._amax_params: dict[str, torch.nn.Parameter] = {}
        self._quantized_by_me = False
        self.add_callback(_AmaxCheckCallback(self))
        self._check_launch()

    def _check_launch(self) -> None:
        compressed = compressed_layers(self.model) if self.model is not None else {}
        if compressed and lora_deploy(self.model) == "served":
            logger.info(
                "QLoRA: %d compressed layer(s) stay frozen in their real formats; the adapters train",
                len(compressed),
            )
        elif compressed:
            name, algo = next(iter(compressed.items()))
            raise ValueError(
                f"the model is compressed ({len(compressed)} layer(s) hold real {algo} weights, e.g. "
                f"{name}): train before compressing (QAT / QAD on the fake-quantized model, then "
                "mtq.compress), or train LoRA adapters on the frozen compressed weights (QLoRA: "
                "lora_config=...)"
            )
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and self.args.world_size == 1:
            raise RuntimeError(
                f"{launched} processes were launched (WORLD_SIZE={launched}) but the Trainer is not "
                "distributed: every process would train its own copy of the model. Without GPUs, pass "
                "TrainingArguments(use_cpu=True) (--use_cpu true) or launch with `accelerate launch --cpu`"
            )
        self._warn_if_fsdp_was_dropped()
        record_ranks()  # (so that the survivor of a lost rank names it)
        asked = self.args.ddp_timeout  # (transformers hands it to the process group only without use_cpu)
        if self.args.use_cpu and asked != TrainingArguments.ddp_timeout and set_collective_timeout(asked):
            logger.info("collectives wait at most ddp_timeout=%s s for another rank", asked)

    def _warn_if_fsdp_was_dropped(self) -> None:
        requested = bool(self.args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        running = self.accelerator.distributed_type
        if requested and running != DistributedType.FSDP:
            logger.warning(
                "FSDP was requested (TrainingArguments.fsdp or the accelerate config) but accelerate "
                "runs %s: every rank holds the whole model and optimizer state (on CPU, accelerate "
                "replaces FSDP by DDP)",
                getattr(running, "value", running),
            )

    # -- calibration ---------------------------------------------------------------------------------------
    def _calibration_source(self) -> Any:
        if self.calib_dataset is not None:
            return self.calib_dataset
        if self.quant_args.calib_dataset is not None:
            quant = self.quant_args
            return calibration_samples(
                quant.calib_dataset, self.processing_class, quant.calib_seq_len, quant.calib_text_field
            )
        if self.train_dataset is None:
            raise ValueError(
                "QATTrainer needs calibration data: pass train_dataset (its first calib_size samples are "
                "used), calib_dataset=..., or QuantizationArguments(calib_dataset=PATH)"
            )
        return self.train_dataset

    def _calibration_batches(self) -> list[dict[str, torch.Tensor]]:
        source = self._calibration_source()
        size = self.quant_args.calib_size
        if len(source) < size:
            logger.warning(
                "calib_size=%d is larger than the calibration data (%d samples): using all of them",
                size,
                len(source),
            )
        samples = [source[i] for i in range(min(size, len(source)))]
        bs = self.quant_args.calib_batch_size
        batches = []
        for start in range(0, len(samples), bs):
            batch = self.data_collator(samples[start : start + bs])
            batches.append({k: v.to(self.args.device) for k, v in batch.items() if k != "labels"})
        if world_size() > 1 and self.quant_args.quantize_config().algorithm_name == "max":
            # each rank calibrates on its share; the statistics are merged across ranks (max)
            return batches[rank() :: world_size()]
        return batches  # search algorithms see all the data on every rank

    def quantize_model(self) -> None:
        """Insert quantizers and calibrate (skipped when the model already carries quantizer state)."""
        model = self.model
        if quant_state(model) is not None:
            if self._quantized_by_me:
                logger.info(
                    "model quantized and calibrated by quantize_model() earlier: training starts from it"
                )
            else:
                logger.info(
                    "the model given to the trainer already carries quantizer state (mtq.quantize, "
                    "mto.restore or from_pretrained of a quantized checkpoint): used as it is, no calibration"
                )
            return
        if self.quant_args.auto_quantize_bits is not None:
            self._auto_quantize()
            return
        config = self.quant_args.quantize_config()
        batches = self._calibration_batches() if need_calibration(config) else None
        samples = sum(len(next(iter(b.values()))) for b in batches or [])
        logger.info(
            "quantizing with %s and calibrating on %d sample(s) (algorithm %s%s)",
            self.quant_args.recipe, samples, config.algorithm_name,
            ", learnable amax" if self.quant_args.learn_amax else "",
        )  # fmt: skip
        quantize(model, config, batches, self.quant_args.experts_implementation)
        self._quantized_by_me = True
        warn_unquantized_adapters(model)
        if self.quant_args.learn_amax:
            unify_learned_static_scales(model)

    def _auto_quantize(self) -> None:
        """``mtq.auto_quantize`` among the recipe's candidates under ``auto_quantize_bits``, calibrated and
        scored on the calibration batches (the loss is the model's own on ``labels = input_ids``)."""
        quant = self.quant_args
        if quant.experts_implementation and hasattr(self.model, "set_experts_implementation"):
            self.model.set_experts_implementation(quant.experts_implementation)
        data = [{**b, "labels": _labels(b)} for b in self._calibration_batches()]
        gradient = quant.auto_quantize_method == "gradient"
        logger.info(
            "auto_quantize: %s under %g effective bits (%s), %d calibration batch(es)",
            quant.recipe, quant.auto_quantize_bits, quant.auto_quantize_method, len(data),
        )  # fmt: skip
        auto_quantize(
            self.model,
            {"effective_bits": quant.auto_quantize_bits},
            list(quant.quantize_configs()),
            data,
            (lambda m, b: m(**b)) if gradient else (lambda m, b: m(input_ids=b["input_ids"]).logits),
            (lambda output, b: output.loss) if gradient else None,
            num_calib_steps=len(data),
            num_score_steps=min(len(data), max(quant.auto_quantize_score_size // quant.calib_batch_size, 1)),
            disabled_layers=AUTO_QUANTIZE_DISABLED,
            method=quant.auto_quantize_method,
        )
        self._quantized_by_me = True

    # -- optimizer ---------------------------------------------------------------------------------------
    def get_decay_parameter_names(self, model: torch.nn.Module) -> list[str]:
        """As ``Trainer``'s, without the learnable amax (never weight-decayed)."""
        amax = set(learnable_amax_parameters(model))
        return [n for n in super().get_decay_parameter_names(model) if n not in amax]

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """``Trainer``'s optimizer, with the learnable amax moved into a param group of their own: learning
        rate ``learning_rate * quant_args.amax_lr_multiplier``, no weight decay (the scheduler scales it)."""
        had_optimizer = self.optimizer is not None
        optimizer = super().create_optimizer(model)
        amax = learnable_amax_parameters(self.model if model is None else model)
        self._amax_params = {n: p for n, p in amax.items() if p.requires_grad}
        if self.quant_args.learn_amax and not amax and not had_optimizer:
            logger.warning(
                "learn_amax=True but the model has no learnable amax (recipe %s: dynamic NVFP4 / MX block "
                "scales and dynamic scales have none): the scales stay as calibrated; for learned NVFP4 "
                "block scales use a static NVFP4 weight recipe (NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG)",
                self.quant_args.recipe,
            )
        if had_optimizer or not self._amax_params:
            return optimizer
        ids = {id(p) for p in self._amax_params.values()}
        found = 0
        for group in optimizer.param_groups:
            kept = [p for p in group["params"] if id(p) not in ids]
            found += len(group["params"]) - len(kept)
            group["params"] = kept
        if found != len(ids):
            raise RuntimeError(
                f"the optimizer ({type(optimizer).__name__}) holds {found} of the {len(ids)} learnable amax "
                "parameters in its param groups; build the optimizer yourself (Trainer(optimizers=...)) "
                "with them in a group of their own"
            )
        optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
        lr = self.args.learning_rate * self.quant_args.amax_lr_multiplier
        optimizer.add_param_group({"params": list(self._amax_params.values()), "lr": lr, "weight_decay": 0.0})
        logger.info(
            "%d learnable amax parameter(s) in their own param group: lr %.3g (%.3g x learning_rate)",
            len(ids), lr, self.quant_args.amax_lr_multiplier,
        )  # fmt: skip
        return optimizer

    # -- checkpoints -------------------------------------------------------------------------------------
    def _expected_config(self) -> dict[str, Any]:
        state = quant_state(self.model)
        config = state.config if state is not None else self.quant_args.quantize_config()
        return plain(config.to_dict(), str_keys=True)

    def _restore_from_checkpoint(self, checkpoint: str) -> None:
        path = Path(checkpoint) / STATE_FILE
        if not path.is_file():
            raise ValueError(
                f"{checkpoint} holds no {STATE_FILE}: it was not written by a QATTrainer (resume with the "
                "trainer that made it, or start from the model without resume_from_checkpoint)"
            )
        saved = json.loads(path.read_text())
        difference = first_difference(saved["modelopt_state"]["quant_config"], self._expected_config())
        if difference:
            raise ValueError(
                f"{checkpoint} was made with recipe {saved.get('recipe')!r}, this run uses "
                f"{self.quant_args.recipe!r}; the quantization configs differ at {difference}. Resume with "
                "the checkpoint's recipe, or start a new run"
            )
        if quant_state(self.model) is None:
            restore_from_modelopt_state(self.model, saved["modelopt_state"])
            logger.info(
                "restored %d quantizers from %s (weights and amax load with the checkpoint)",
                len(saved["modelopt_state"]["quantizers"]),
                checkpoint,
            )
        if is_peft_model(self.model):
            load_frozen_base(self.model, Path(checkpoint))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save as ``Trainer`` does (also every checkpoint), with ``config.json`` carrying the quantizer state
        (``quant_method: "modelopt_lite"``: ``from_pretrained`` restores it after
        ``mto.enable_huggingface_checkpointing()``) and the state as JSON beside the weights (``mto.restore``
        reads the directory)."""
        model = self.accelerator.unwrap_model(self.model)
        if quant_state(model) is None:
            super().save_model(output_dir, _internal_call)
            return
        if is_sharded(model) and not _internal_call:
            self._save_gathered(model, Path(output_dir or self.args.output_dir))
            return
        with attached(model):
            super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            output = Path(output_dir or self.args.output_dir)
            output.mkdir(parents=True, exist_ok=True)  # FSDP's sharded save writes the model elsewhere
            state = {"recipe": self.quant_args.recipe, "modelopt_state": modelopt_state(model)}
            (output / STATE_FILE).write_text(json.dumps(state, indent=1))
            if is_peft_model(model):  # peft saved the adapters only
                save_frozen_base(model, output)

    def _save_gathered(self, model: torch.nn.Module, output: Path) -> None:
        """``save_model`` of an FSDP2-sharded model: a ``from_pretrained`` directory written by rank 0 from
        full tensors gathered one at a time (every rank takes part in each gather), streamed into safetensors
        shards of at most ``_SAVE_SHARD_BYTES``, so no rank ever holds the whole model."""
        writes = self.args.should_save
        with all_ranks_succeed("save_model of the sharded model"):
            if writes:
                output.mkdir(parents=True, exist_ok=True)
            shards = ShardWriter(output, _SAVE_SHARD_BYTES) if writes else None
            seen: set[int] = set()
            for key, value in model.state_dict(keep_vars=True).items():
                if id(value) in seen:  # a tied weight (lm_head = embeddings) is saved once
                    continue
                seen.add(id(value))
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                if shards is not None:
                    shards.add({key: full.detach()})
            if shards is not None:
                shards.close()
                if not getattr(model.config, "architectures", None):  # as save_pretrained would set it
                    model.config.architectures = [unsharded_class(model).__name__]
                with attached(model):
                    model.config.save_pretrained(output)
                state = {"recipe": self.quant_args.recipe, "modelopt_state": modelopt_state(model)}
                (output / STATE_FILE).write_text(json.dumps(state, indent=1))
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output)
        logger.info("saved the sharded model to %s (gathered one tensor at a time)", output)

    # -- the loop ----------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        self.malloc_policy.apply()
        try:
            return self._train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.malloc_policy.close()

    def _train(self, resume_from_checkpoint: str | bool | None, *args: Any, **kwargs: Any):
        check_training_data(self.args, self.train_dataset)
        # True / "true" / "last": the newest complete checkpoint; a half-written one is never resumed from
        resume_from_checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if resume_from_checkpoint:
            self._restore_from_checkpoint(resume_from_checkpoint)
            if 0 < self.args.max_steps <= trained_steps(resume_from_checkpoint):
                return load_finished(self, resume_from_checkpoint)
        else:
            self.quantize_model()
        choose_trainable(self.accelerator.unwrap_model(self.model), self.quant_args)
        after = lambda: f"training, after step {self.state.global_step} (Trainer's own collectives)"  # noqa: E731
        try:  # (outside our steps: Trainer's own collectives, e.g. the loss gathered for logging)
            with naming_lost_rank(after):
                return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.gc_policy.close()

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any):
        check_sequence_length(self.model, inputs.get("input_ids"), "training data")
        self.gc_policy.before_step()
        # a rank that died mid-step fails DDP's / FSDP's collectives here: say so, with the step
        with naming_lost_rank(f"training step {self.state.global_step + 1}"):
            return super().training_step(model, inputs, *args, **kwargs)

    def prediction_step(self, *args: Any, **kwargs: Any):
        self.gc_policy.evaluation_step()
        return super().prediction_step(*args, **kwargs)


def _labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``input_ids`` as labels, padding (``attention_mask == 0``) ignored."""
    mask = batch.get("attention_mask")
    ids = batch["input_ids"]
    return ids if mask is None else ids.masked_fill(mask == 0, -100)
