"""Floor 0, above ``data``: how a model is measured.

* ``heldout``: the one held-out protocol of every command (perplexity over fixed windows, KL to a reference,
  top-1 agreement, greedy continuations); its names are this package's (``evaluation.perplexity``, ...).

It imports only torch and the standard library at import time (scripts in other environments use it:
``benchmarks/``).
"""

from .heldout import (
    KL_MAX_BYTES,
    MAX_WINDOW,
    Comparison,
    StoredLogits,
    compare,
    default_window,
    describe,
    greedy_continuations,
    kl_per_token,
    perplexity,
    reference_logprobs,
    reference_within,
    store_logits,
    stored_logits_bytes,
)

__all__ = [
    "KL_MAX_BYTES",
    "MAX_WINDOW",
    "Comparison",
    "StoredLogits",
    "compare",
    "default_window",
    "describe",
    "greedy_continuations",
    "kl_per_token",
    "perplexity",
    "reference_logprobs",
    "reference_within",
    "store_logits",
    "stored_logits_bytes",
]
