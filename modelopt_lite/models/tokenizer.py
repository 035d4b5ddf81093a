"""Byte-level BPE tokenizer of the default models, trained with ``tokenizers`` (deterministic: the same
texts and vocabulary size give the same merges) and wrapped as a transformers ``PreTrainedTokenizerFast``.

Every string round-trips (``decode(encode(s)) == s``: byte-level, no normalisation). The tokenizer adds no
special tokens by itself; the trainer wraps each document as ``<|bos|> text <|eos|>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["BOS", "EOS", "PAD", "train_tokenizer"]

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
_MIN_VOCAB = 256 + 3  # the byte alphabet and the special tokens


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` tokens (ids 0, 1, 2 = pad, bos, eos) on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least {_MIN_VOCAB} tokens")
    if not texts:
        raise ValueError("train_tokenizer: no texts to train on")
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
    )
