"""What each default model is: architecture, sizes and the training budget, as frozen, JSON-able specs.

A spec's ``version`` hashes everything that changes the weights (the spec, the corpus digest and
``FORMAT``), so a new recipe or another CPython's corpus gets its own cache directory, never a stale model.
Tests and experiments use ``dataclasses.replace(DENSE, steps=4, ...)`` for a small budget.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from .corpus import corpus_digest

__all__ = ["DENSE", "FORMAT", "KINDS", "MOE", "SPECS", "DefaultModelSpec", "spec_for"]

Kind = Literal["dense", "moe"]
KINDS: tuple[str, ...] = ("dense", "moe")
FORMAT = 1  # bump when the training code changes what a spec produces
_ARCHITECTURES = ("llama", "qwen3_moe")


@dataclass(frozen=True)
class DefaultModelSpec:
    """A default model: ``model_config`` goes to ``LlamaConfig`` / ``Qwen3MoeConfig`` (vocabulary size,
    special token ids and ``max_position_embeddings = seq_len`` are added); the rest is the training recipe:
    AdamW (betas 0.9 / 0.95, weight decay on matrices only), linear warm-up then cosine decay to
    ``min_lr_ratio * lr``, ``steps`` batches of ``batch_size`` random windows of ``seq_len`` training tokens,
    gradient clipping, seed. ``max_documents`` keeps only the first documents of each split (tests)."""

    name: str
    architecture: str
    model_config: dict[str, Any] = field(default_factory=dict)
    vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 500
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 25
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    router_aux_loss_coef: float = 0.01
    seed: int = 0
    max_documents: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in _ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r}: choose one of {list(_ARCHITECTURES)}")
        for name in ("vocab_size", "seq_len", "batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"DefaultModelSpec.{name}={getattr(self, name)}: must be a positive integer")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps}: must be between 0 and steps={self.steps}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def version(self) -> str:
        """10 hex digits over the spec, the corpus digest and ``FORMAT``."""
        payload = json.dumps({"format": FORMAT, "corpus": corpus_digest(), "spec": self.to_json()},
                             sort_keys=True)  # fmt: skip
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:10]

    @property
    def dirname(self) -> str:
        return f"{self.name}-{self.version}"


DENSE = DefaultModelSpec(
    name="llama-dense",
    architecture="llama",
    model_config=dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    steps=500,
)
MOE = DefaultModelSpec(
    name="qwen3-moe",
    architecture="qwen3_moe",
    model_config=dict(
        hidden_size=192,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    steps=600,
)
SPECS: dict[str, DefaultModelSpec] = {"dense": DENSE, "moe": MOE}


def spec_for(kind: str) -> DefaultModelSpec:
    if kind not in SPECS:
        raise ValueError(f"default model kind {kind!r}: choose one of {list(KINDS)}")
    return SPECS[kind]
