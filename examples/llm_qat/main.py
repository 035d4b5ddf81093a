"""QAT / QAD of a causal LM with modelopt_lite, offline, on CPU or GPU, one process or many.

    python examples/llm_qat/main.py --config examples/llm_qat/configs/qat_nvfp4.yaml
    accelerate launch --config_file examples/llm_qat/accelerate_config/ddp.yaml --num_processes 2 \\
        examples/llm_qat/main.py --config examples/llm_qat/configs/qad_nvfp4.yaml --max_steps 20

Arguments: ``ModelArguments`` and ``DataArguments`` below, ``transformers.TrainingArguments``,
``QuantizationArguments`` and ``DistillationArguments``; ``--config file.yaml`` holds any of them and the
command line overrides it. Without ``--model_name_or_path`` the bundled default model (``--default_model
dense|moe``) is used, trained on first use; without ``--dataset``, its corpus (CPython's documentation).
``--teacher_model same`` distils from the unquantized starting model (QAD); no teacher means QAT.
``--lora true`` (``--lora_r``, ``--lora_alpha``, ``--lora_target_modules``, ``--lora_deploy merged|served``)
trains peft LoRA adapters on the frozen quantized model instead of its weights; a served adapter is exported
as ``export/base_model`` plus the adapter in ``export``.
``--dataset`` is any source ``modelopt_lite.data`` reads (local .txt / .md / .json / .jsonl / .csv / .parquet,
a ``save_to_disk`` directory); its last ``--heldout_percent`` of documents are held out for evaluation.

The run: held-out perplexity of the model as given, quantize + calibrate (PTQ), perplexity again, train,
perplexity after, export a deployable checkpoint to ``<output_dir>/export`` and read it back. Perplexity and
KL to the model as given follow ``modelopt_lite.evaluation``'s protocol (``eval_protocol`` in the results).
``--tasks piqa,arc_easy --tasks_limit 200`` ends with lm-eval task accuracy of the trained model (offline,
the local tasks of docs/tasks.md; ``tasks`` in the results), checked before anything loads.
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, TrainingArguments

from modelopt_lite import evaluation
from modelopt_lite.data import TokenWindows, heldout_split, load_texts, token_stream
from modelopt_lite.distributed import is_sharded
from modelopt_lite.export import export_hf_checkpoint
from modelopt_lite.export.lora import BASE_MODEL_DIR
from modelopt_lite.logging import get_logger
from modelopt_lite.nn.lora import lora_deploy
from modelopt_lite.training import DistillationArguments, QADTrainer, QATTrainer, QuantizationArguments

logger = get_logger("modelopt_lite.examples.llm_qat")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A local model directory; default: the bundled default model."}
    )
    default_model: str = field(
        default="dense",
        metadata={
            "help": "Model by name: bundled dense or moe, or a real one (smollm2-135m; docs/models.md)."
        },
    )
    dtype: str = field(default="float32", metadata={"help": "Weights dtype: float32 or bfloat16."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code (off)."})


@dataclass
class DataArguments:
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "A local .txt / .md / .json / .jsonl / .csv / .parquet file or a directory written by "
            "datasets' save_to_disk (modelopt_lite.data); default: the default model's corpus (train split "
            "for training, held-out split for evaluation)."
        },
    )
    text_field: str = field(default="text", metadata={"help": "The field of the records holding the text."})
    seq_len: int = field(default=128, metadata={"help": "Tokens per training sample."})
    train_samples: int | None = field(default=None, metadata={"help": "Cap on training samples."})
    eval_samples: int | None = field(
        default=None, metadata={"help": "Cap on held-out windows for perplexity and KL (default: all)."}
    )
    eval_seq_len: int | None = field(
        default=None,
        metadata={"help": "Tokens per held-out window; default: the model's max_position_embeddings, at most "
                  f"{evaluation.MAX_WINDOW}."},
    )  # fmt: skip
    heldout_percent: float = field(
        default=10.0, metadata={"help": "With --dataset: the share of the file kept for evaluation."}
    )
    tasks: str | None = field(
        default=None,
        metadata={"help": "Last: lm-eval task accuracy of the trained model on these local tasks, e.g. "
                  "piqa,arc_easy (the lm_eval extra and the extracted tasks: modelopt-lite-eval, "
                  "docs/tasks.md); batches of --per_device_eval_batch_size."},
    )  # fmt: skip
    tasks_limit: int | None = field(default=None, metadata={"help": "With --tasks: N documents per task."})


DATACLASSES = (ModelArguments, DataArguments, TrainingArguments, QuantizationArguments, DistillationArguments)


def parse(argv: list[str]) -> tuple[Any, ...]:
    """The five argument dataclasses from ``--config file.yaml`` (optional) and the command line. Without a
    GPU, ``--use_cpu true`` is implied (so that ``accelerate launch`` runs DDP over CPU processes)."""
    parser = HfArgumentParser(DATACLASSES)
    config_args: list[str] = []
    if not torch.cuda.is_available() and "--use_cpu" not in argv:
        argv = ["--use_cpu", "true", *argv]
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise SystemExit("--config needs a YAML file")
        path = Path(argv[i + 1])
        if not path.is_file():
            raise SystemExit(f"--config {path}: no such file")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise SystemExit(f"--config {path}: expected a mapping of argument names to values")
        known = {f.name for cls in DATACLASSES for f in fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise SystemExit(f"--config {path}: unknown key(s) {unknown}; see --help for the arguments")
        for key, value in values.items():
            if isinstance(value, (list, dict)):
                value = json.dumps(value)
            config_args += [f"--{key}", str(value)]
        argv = argv[:i] + argv[i + 2 :]
    return parser.parse_args_into_dataclasses(args=config_args + argv)


def check_tasks(data: DataArguments) -> None:
    """Before any model loads: ``--tasks`` names local tasks and lm-eval is installed, or the fix is named."""
    if data.tasks_limit is not None and (not data.tasks or data.tasks_limit < 1):
        raise SystemExit("--tasks_limit: a positive number of documents, with --tasks")
    if data.tasks:
        try:
            evaluation.check_tasks(data.tasks)
        except (ValueError, FileNotFoundError, ImportError) as err:
            raise SystemExit(f"--tasks: {err}") from None


def split_texts(data: DataArguments, default_model: str | None) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts). The corpus for a real model: its ``fit`` split for training and its
    ``test`` split for evaluation (the ``validation`` split between them is left for choosing settings)."""
    if data.dataset is None:
        from modelopt_lite.models import REAL_MODELS, corpus_texts

        if default_model in REAL_MODELS:
            return corpus_texts("fit"), corpus_texts("test")
        return corpus_texts("train"), corpus_texts("heldout")
    try:
        texts = load_texts(data.dataset, text_field=data.text_field)
        return heldout_split(texts, data.heldout_percent, f"--dataset {data.dataset}")
    except ValueError as err:
        raise SystemExit(f"--dataset: {err}") from None


def reload_export(export_dir: Path) -> torch.nn.Module:
    """The exported checkpoint read back: with ``transformers``, plus ``peft`` for a served adapter
    (the quantized base in ``export_dir/base_model``, the adapter beside it)."""
    if (export_dir / "adapter_config.json").is_file():
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(export_dir / BASE_MODEL_DIR, dtype=torch.float32)
        return PeftModel.from_pretrained(base, export_dir)
    return AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    model_args, data, training, quant, distill = parse(sys.argv[1:] if argv is None else argv)
    check_tasks(data)
    named = model_args.default_model if model_args.model_name_or_path is None else None
    if model_args.model_name_or_path is None:
        from modelopt_lite.models import default_model_path

        with training.main_process_first(desc="building the default model"):  # trained once, then cached
            model_args.model_name_or_path = str(default_model_path(model_args.default_model))
    path = model_args.model_name_or_path
    if not Path(path).is_dir():
        raise SystemExit(f"--model_name_or_path {path}: not a directory")
    dtype = getattr(torch, model_args.dtype)
    load = dict(dtype=dtype, trust_remote_code=model_args.trust_remote_code, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, **load)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    train_texts, eval_texts = split_texts(data, named)
    train_set = TokenWindows(token_stream(tokenizer, train_texts), data.seq_len, data.train_samples)
    eval_seq = data.eval_seq_len or evaluation.default_window(model.config)
    held_out = TokenWindows(token_stream(tokenizer, eval_texts), eval_seq, data.eval_samples).ids
    batch = training.per_device_eval_batch_size
    results: dict[str, Any] = {"model": path, "recipe": quant.recipe, "train_samples": len(train_set)}
    results["eval_protocol"] = evaluation.describe(held_out)
    # the model as given, kept unquantized for KL(model as given || model) and top-1 agreement, compared
    # batch by batch (nothing of a whole evaluation is stored); QAD's teacher is that model already
    teacher = distill.teacher_model
    reference = None if teacher == "same" else copy.deepcopy(model)

    def measure(key: str, measured: Any) -> None:
        c = evaluation.compare(reference, measured, held_out, batch)
        results["ppl_baseline"] = c.reference_perplexity
        results[f"ppl_{key}"], results[f"kl_{key}"], results[f"top1_{key}"] = (
            c.perplexity,
            c.kl,
            c.top1_agreement,
        )
        logger.info(
            "%s: perplexity %.3f (model as given %.3f), KL %.4f nats/token, top-1 agreement %.3f",
            key, c.perplexity, c.reference_perplexity, c.kl, c.top1_agreement,
        )  # fmt: skip

    if teacher == "same":
        distill.teacher_model = path
    common = dict(
        model=model, args=training, train_dataset=train_set, quant_args=quant, processing_class=tokenizer
    )
    trainer = QADTrainer(**common, distill_args=distill) if teacher else QATTrainer(**common)
    results["mode"] = "qad" if teacher else "qat"
    if (deploy := lora_deploy(trainer.model)) is not None:
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        results["lora"] = {"deploy": deploy, "r": quant.lora_r, "trainable_parameters": trainable}
    if reference is None:
        reference = trainer.teacher
    trainer.quantize_model()  # PTQ first, to report what training recovers
    measure("ptq", model)
    trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    measure("after", trainer.model)
    results["tokens_trained"] = (
        trainer.state.global_step
        * training.per_device_train_batch_size
        * (training.gradient_accumulation_steps * training.world_size * data.seq_len)
    )
    trainer.save_model()
    model = trainer.accelerator.unwrap_model(trainer.model)
    export_dir = Path(training.output_dir) / "export"
    # A sharded (FSDP2) model is exported by every rank (one module gathered at a time, rank 0 writes);
    # replicas (one process, DDP) by the main process alone.
    if is_sharded(model) or trainer.is_world_process_zero():
        exported = export_hf_checkpoint(model, export_dir, tokenizer=tokenizer, overwrite=True)
    if trainer.is_world_process_zero():
        reloaded = reload_export(export_dir)
        results["export_dir"] = str(export_dir)
        results["export_mb"] = round(exported.total_bytes / 1e6, 3)
        measure("exported_weights", reloaded)
        if data.tasks:  # the trained model in memory; a sharded one through its export read back
            scored, what = (reloaded, "export read back") if is_sharded(model) else (model, "trained model")
            found = evaluation.evaluate_tasks(scored, data.tasks, tokenizer=tokenizer, limit=data.tasks_limit,
                                              batch_size=batch)  # fmt: skip
            results["tasks"] = {
                "model": what,
                "limit": data.tasks_limit,
                "scores": evaluation.task_scores(found),
            }
        logger.info("results: %s", json.dumps(results, indent=1))
        (Path(training.output_dir) / "results.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # all ranks finish before gloo tears down (else: abort at exit)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
