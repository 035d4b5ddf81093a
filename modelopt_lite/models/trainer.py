"""Train one default model from its spec with a plain torch loop (deterministic for a seed and thread count).

``train(spec)`` returns the model, its tokenizer and a report (parameter count, seconds, held-out perplexity
and the unigram baseline on the same tokens); it writes nothing (``cache.build_default_model`` does).
A benchmark spec (``train_split="fit"``) trains its tokenizer and model on the ``"fit"`` split only and also
reports the ``"validation"`` perplexity; its ``heldout_perplexity`` is the ``"test"`` (= ``"heldout"``) one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from .. import evaluation
from ..data import token_stream, windows
from ..logging import get_logger
from .corpus import corpus_texts
from .specs import DefaultModelSpec
from .tokenizer import train_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = ["TrainResult", "build_model", "heldout_perplexity", "token_stream", "train", "unigram_perplexity"]

logger = get_logger(__name__)


@dataclass
class TrainResult:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast
    report: dict[str, Any]


def build_model(spec: DefaultModelSpec, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """The untrained model of ``spec`` (float32), initialised from ``spec.seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=len(tokenizer), max_position_embeddings=spec.seq_len, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    if spec.architecture == "llama":
        config: Any = LlamaConfig(**{**spec.model_config, **common})
        model_cls: Any = LlamaForCausalLM
    else:
        config = Qwen3MoeConfig(
            **{**spec.model_config, **common, "router_aux_loss_coef": spec.router_aux_loss_coef}
        )
        model_cls = Qwen3MoeForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return model_cls(config).float()


def heldout_perplexity(
    model: PreTrainedModel, stream: torch.Tensor, seq_len: int, batch_size: int = 16
) -> float:
    """Perplexity on consecutive, non-overlapping ``seq_len`` windows of ``stream`` (the tail is dropped):
    ``modelopt_lite.evaluation.perplexity``, the one held-out protocol."""
    return evaluation.perplexity(model, windows(stream, seq_len), batch_size)


def unigram_perplexity(
    train_stream: torch.Tensor, eval_stream: torch.Tensor, vocab_size: int, seq_len: int
) -> float:
    """Perplexity of the add-one unigram model of ``train_stream`` on the tokens ``heldout_perplexity``
    predicts (each window's tokens after its first): the baseline a language model has to beat."""
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    log_p = counts.log() - counts.sum().log()
    targets = windows(eval_stream, seq_len)[:, 1:].reshape(-1)
    return math.exp(float(-log_p[targets].mean()))


def _lr_lambda(spec: DefaultModelSpec) -> Any:
    def factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * cosine

    return factor


def _texts(split: str, spec: DefaultModelSpec) -> list[str]:
    texts = corpus_texts(split)  # type: ignore[arg-type]
    return texts if spec.max_documents is None else texts[: spec.max_documents]


def train(spec: DefaultModelSpec, *, progress: bool = True) -> TrainResult:
    """Tokenizer, model and training loop for ``spec``; one spec and thread count give the same weights."""
    start = time.perf_counter()
    train_texts, heldout_texts = _texts(spec.train_split, spec), _texts("heldout", spec)
    tokenizer = train_tokenizer(train_texts, spec.vocab_size)
    train_ids, heldout_ids = token_stream(tokenizer, train_texts), token_stream(tokenizer, heldout_texts)
    validation_ids = (
        token_stream(tokenizer, _texts("validation", spec)) if spec.train_split == "fit" else None
    )
    if train_ids.numel() <= spec.seq_len:
        raise ValueError(
            f"{spec.name}: {train_ids.numel()} training tokens, need more than seq_len={spec.seq_len}; "
            "raise max_documents"
        )
    model = build_model(spec, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "training default model %s: %.2fM parameters, %d train / %d held-out tokens, %d steps of %dx%d, "
        "%d threads",
        spec.name, n_params / 1e6, train_ids.numel(), heldout_ids.numel(), spec.steps, spec.batch_size,
        spec.seq_len, torch.get_num_threads(),
    )  # fmt: skip
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr, betas=(0.9, 0.95),
    )  # fmt: skip
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(spec))
    generator = torch.Generator().manual_seed(spec.seed)
    extra = {"output_router_logits": True} if spec.architecture == "qwen3_moe" else {}
    offsets = torch.arange(spec.seq_len)
    model.train()
    losses: list[float] = []
    bar = tqdm(range(spec.steps), desc=f"training {spec.name}", disable=not progress, leave=False)
    for _ in bar:
        high = train_ids.numel() - spec.seq_len + 1
        starts = torch.randint(0, high, (spec.batch_size, 1), generator=generator)
        batch = train_ids[starts + offsets]
        loss = model(input_ids=batch, labels=batch, **extra).loss
        if not torch.isfinite(loss):
            raise RuntimeError(f"{spec.name}: training loss became {float(loss)}; lower the spec's lr")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    train_s = time.perf_counter() - start
    model.eval()
    ppl = heldout_perplexity(model, heldout_ids, spec.seq_len)
    baseline = unigram_perplexity(train_ids, heldout_ids, len(tokenizer), spec.seq_len)
    last = losses[-min(20, len(losses)) :]
    report: dict[str, Any] = {
        "parameters": n_params,
        "train_tokens": train_ids.numel(),
        "heldout_tokens": heldout_ids.numel(),
        "train_seconds": round(train_s, 1),
        "threads": torch.get_num_threads(),
        "final_train_loss": round(sum(last) / len(last), 4),
        "heldout_perplexity": round(ppl, 3),
        "unigram_perplexity": round(baseline, 3),
    }
    if validation_ids is not None:
        report["train_split"] = spec.train_split
        report["validation_tokens"] = validation_ids.numel()
        report["validation_perplexity"] = round(heldout_perplexity(model, validation_ids, spec.seq_len), 3)
        report["test_perplexity"] = report["heldout_perplexity"]
    logger.info(
        "trained %s in %.0f s: held-out perplexity %.2f (unigram baseline %.2f)",
        spec.name, train_s, ppl, baseline,
    )  # fmt: skip
    return TrainResult(model, tokenizer, report)
