"""``QADTrainer``: quantization-aware distillation. The quantized student learns the teacher's
distribution: ``loss = kd_loss_weight * T^2 * KL(teacher_T || student_T) + ce_loss_weight * CE`` over the
shifted tokens whose label is not ``-100`` (``DistillationArguments.distill_loss`` picks another divergence:
reverse KL, generalized JSD, top-k KL; :mod:`.distill_loss`).

Both models return their last hidden states and no logits (``logits_to_keep`` selects no position); the
loss runs the two LM heads (:func:`chunked_distillation_loss`). By default on the whole batch at once, the
arithmetic of nvidia-modelopt's ``QADTrainer`` bit for bit (the same loss and gradients to the last bit, so
the same training run); with ``DistillationArguments.distill_chunk_size`` chunk by chunk, so the
full-vocabulary fp32 logits of the whole batch are never held at once (the same loss up to float rounding).
Models whose ``forward`` has no ``logits_to_keep`` fall back to full logits (a WARNING says so).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ..distributed import shard_frozen
from ..logging import get_logger
from .arguments import DistillationArguments
from .distill_loss import chunked_distillation_loss
from .qat_trainer import QATTrainer

__all__ = ["QADTrainer"]

logger = get_logger(__name__)
_WARNED: set[tuple[type, str]] = set()


def _vocab(model: nn.Module) -> int | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return weight.shape[0] if isinstance(weight, torch.Tensor) else getattr(model.config, "vocab_size", None)


def _teacher_tokenizer(source: Any, teacher: nn.Module) -> tuple[Any, str] | None:
    """The teacher's tokenizer, read from its folder (the path given, else its config's ``_name_or_path``),
    and where it came from; None when there is none to read."""
    folder = source if isinstance(source, (str, Path)) else getattr(teacher.config, "_name_or_path", "")
    if not folder or not Path(folder).is_dir():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True), str(folder)
    except (OSError, ValueError, TypeError) as err:
        logger.debug("no tokenizer read from the teacher's folder %s (%s): not compared", folder, err)
        return None


def _check_same_tokenizer(student_tok: Any, found: tuple[Any, str] | None) -> None:
    """Refuse a teacher whose tokenizer maps any token to another id than the student's."""
    if student_tok is None or found is None or not hasattr(student_tok, "get_vocab"):
        return
    teacher_tok, where = found
    mine, theirs = student_tok.get_vocab(), teacher_tok.get_vocab()
    if mine == theirs:
        return
    diff = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: (kv[1], kv[0]))[0][0]
    raise ValueError(
        f"the teacher's tokenizer ({len(theirs)} tokens, from {where}) differs from the student's "
        f"({len(mine)} tokens; processing_class): token {diff!r} is id {theirs.get(diff)} for the teacher "
        f"and {mine.get(diff)} for the student. Distillation compares next-token distributions id by id and "
        "needs the same tokenizer"
    )


def _load_teacher(path: str, dtype: torch.dtype) -> nn.Module:
    if not Path(path).is_dir():
        raise ValueError(
            f"teacher_model={path!r} is not a directory; give the path of a saved model "
            "(save_pretrained) or pass the teacher as an nn.Module"
        )
    logger.info("loading the teacher from %s (%s, local files only)", path, dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)


class QADTrainer(QATTrainer):
    """``QATTrainer`` with a frozen teacher. Extra keyword arguments: ``distill_args``
    (:class:`DistillationArguments`) and ``teacher_model`` (an ``nn.Module``; default:
    ``distill_args.teacher_model`` loaded from its path)."""

    def __init__(
        self,
        *args: Any,
        distill_args: DistillationArguments | None = None,
        teacher_model: nn.Module | str | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.distill_args = distill_args or DistillationArguments()
        teacher = teacher_model if teacher_model is not None else self.distill_args.teacher_model
        if teacher is None:
            raise ValueError(
                "QADTrainer needs a teacher: DistillationArguments(teacher_model=PATH) or teacher_model=..."
            )
        student = self.accelerator.unwrap_model(self.model)
        dtype = next(student.parameters()).dtype
        source = teacher
        teacher = _load_teacher(teacher, dtype) if isinstance(teacher, (str, Path)) else teacher
        if not isinstance(teacher, nn.Module):
            raise TypeError(f"teacher_model must be a path or an nn.Module, got {type(teacher).__name__}")
        vocab_t, vocab_s = _vocab(teacher), _vocab(student)
        if vocab_t != vocab_s:
            raise ValueError(
                f"the teacher's vocabulary ({vocab_t}) differs from the student's ({vocab_s}): distillation "
                "compares their next-token distributions and needs the same tokenizer"
            )
        _check_same_tokenizer(self.processing_class, _teacher_tokenizer(source, teacher))
        self.teacher = teacher.to(device=self.args.device, dtype=dtype).eval().requires_grad_(False)
        if self.is_fsdp_enabled and getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2:
            blocks = getattr(self.teacher, "_no_split_modules", None) or []
            shard_frozen(self.teacher, blocks)
            logger.info("teacher sharded with FSDP2 (blocks: %s)", ", ".join(blocks))

    @staticmethod
    def _last_hidden(
        model: nn.Module, inputs: dict[str, Any], full_logits: bool = False
    ) -> tuple[torch.Tensor, nn.Module | None]:
        """The last hidden state and the LM head, or (full logits, None) when ``full_logits`` or the model
        has no ``logits_to_keep``."""
        inner = getattr(model, "module", model)
        if not full_logits and "logits_to_keep" in inspect.signature(inner.forward).parameters:
            device = inputs["input_ids"].device
            nothing = torch.empty(0, dtype=torch.long, device=device)
            out = model(**inputs, output_hidden_states=True, logits_to_keep=nothing)
            return out.hidden_states[-1], inner.get_output_embeddings()
        reason = "under FSDP" if full_logits else "its forward has no logits_to_keep"
        if (type(inner), reason) not in _WARNED:
            _WARNED.add((type(inner), reason))
            logger.warning(
                "%s: distilling on full logits (%s): the student's full-vocabulary logits are materialised",
                type(inner).__name__,
                reason,
            )
        return model(**inputs).logits, None

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        inputs = dict(inputs)
        labels = inputs.pop("labels", None)
        if labels is None:  # plain language modelling: predict the input, skip padding
            labels = inputs["input_ids"].clone()
            if "attention_mask" in inputs:
                labels[inputs["attention_mask"] == 0] = -100
        # Under FSDP the student's LM head must run inside the sharded forward: its parameters are the root
        # group's, freed after the root's backward (running it outside crashed backward on FSDP2 / CPU).
        student_hidden, student_head = self._last_hidden(model, inputs, full_logits=self.is_fsdp_enabled)
        with torch.no_grad():
            teacher_hidden, teacher_head = self._last_hidden(self.teacher, inputs)
        # Like Trainer.compute_loss: with ``num_items_in_batch`` (the shifted-label count of the whole
        # accumulated batch, on every process) the loss is a token-weighted share that Trainer does not
        # divide by the accumulation steps again; without it, a per-batch mean that Trainer divides.
        scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        args = self.distill_args
        identity = nn.Identity()
        loss = chunked_distillation_loss(
            student_hidden, teacher_hidden, labels, student_head or identity, teacher_head or identity,
            temperature=args.temperature, kd_weight=args.kd_loss_weight, ce_weight=args.ce_loss_weight,
            chunk_size=args.distill_chunk_size, num_items=num_items_in_batch if scaled else None,
            loss=args.distill_loss, beta=args.jsd_beta, top_k=args.distill_top_k,
        )  # fmt: skip
        if scaled and self.args.average_tokens_across_devices:
            loss = loss * self.accelerator.num_processes
        if not return_outputs:
            return loss
        logits = student_head(student_hidden) if student_head is not None else student_hidden
        return loss, {"loss": loss, "logits": logits}
