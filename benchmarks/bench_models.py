"""Are the benchmark models trained near convergence, and how much does NVFP4 PTQ cost them?

Published in ``docs/accuracy.md``, "The benchmark models" (issue 14; ``bench-dense`` = Llama, ``bench-moe`` =
Qwen3-MoE with 8 experts, top-2, from ``modelopt_lite.models``):

    OMP_NUM_THREADS=2 MODELOPT_LITE_CACHE=... python benchmarks/bench_models.py --json out.json

(``--kinds bench-dense --ft-steps 0 --calib-size 4`` makes a short run).

Models: loaded from the cache with ``default_model_path(kind, train_if_missing=--build)``; with ``--build``
a missing model is trained first (its build seconds are the ``train_seconds`` of its report either way:
tokenizer, training and its own evaluation, on the threads it was built with). ``--checkpoint KIND=DIR``
measures another directory instead, with the spec of ``KIND`` (for its split).

Data (the default corpus, tokenized with the model's own tokenizer, ``bos text eos`` per document):

* ``val ppl`` / ``test ppl``: ``models.trainer.heldout_perplexity`` on every consecutive window of the
  model's ``seq_len`` (256) tokens of the ``"validation"`` / ``"test"`` split (for the default models
  ``dense`` / ``moe``, whose training split ``"train"`` contains the validation documents, ``val ppl`` is
  not a held-out figure);
* calibration: the first ``--calib-size`` (32) windows of 256 tokens of the model's training split
  (``"fit"`` for the benchmark models), batches of 4;
* PTQ: ``mtq.quantize(model, build_config("nvfp4"), calibration)`` (``NVFP4_DEFAULT_CFG``: W4A4, block 16,
  max calibration), and the same with an FP8 KV cache (``build_config("nvfp4", kv_cache_qformat="fp8")``);
  ``gap = ppl_ptq / ppl - 1`` on validation (and on test);
* fine-tune: ``--ft-steps`` (200) more AdamW steps (betas 0.9 / 0.95, weight decay 0, gradient clipping
  1.0, seed 0) on batches of ``--ft-batch`` (4) random windows of ``--ft-seq`` (128) tokens of the training
  split, lr cosine from ``--ft-lr`` to 0 (default 1e-4: the lr of ``benchmarks/accuracy.py``'s rows and of
  its fine-tuning control, so this is the gain that control would show); ``ft gain`` = the relative
  validation perplexity improvement (below 0.5%: the model is near convergence; negative: more training
  makes it worse).

Threads: ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` are set to ``--threads`` before torch is imported.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from typing import Any

import _harness as h

CALIB_SEQ, CALIB_BATCH = 256, 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = h.common(h.parser(__doc__), threads=2, json="write the results here")
    p.add_argument("--kinds", default="bench-dense,bench-moe", help="comma-separated model kinds")
    p.add_argument("--build", action="store_true", help="train a model missing from the cache")
    p.add_argument("--calib-size", type=int, default=32, help="calibration windows of 256 tokens")
    p.add_argument("--ft-steps", type=int, default=200, help="fine-tuning steps (0: skip)")
    p.add_argument("--ft-batch", type=int, default=4)
    p.add_argument("--ft-seq", type=int, default=128)
    p.add_argument("--ft-lr", type=float, default=1e-4, help="the accuracy study's lr (its ft control)")
    p.add_argument("--checkpoint", action="append", default=[], metavar="KIND=DIR",
                   help="measure DIR instead of the cached model of KIND")  # fmt: skip
    args = p.parse_args(argv)
    args.kinds = h.csv(args.kinds)
    args.checkpoint = dict(c.split("=", 1) for c in args.checkpoint)
    return args


def splits_of(spec: Any) -> tuple[str, str, str]:
    """(training, validation, test) split names of a spec."""
    return (spec.train_split, "validation", "test")


def fine_tune_gain(model: Any, train_ids: Any, val_ids: Any, seq_len: int, *, steps: int, lr: float,
                   batch: int = 4, seq: int = 128, seed: int = 0) -> tuple[float, float]:  # fmt: skip
    """(validation perplexity after ``steps`` more AdamW steps on a copy of ``model``, relative gain)."""
    import torch

    from modelopt_lite.models.trainer import heldout_perplexity

    before = heldout_perplexity(model, val_ids, seq_len)
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))
    )
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq)
    extra = {"output_router_logits": True} if model.config.model_type == "qwen3_moe" else {}
    for _ in range(steps):
        starts = torch.randint(0, train_ids.numel() - seq + 1, (batch, 1), generator=generator)
        ids = train_ids[starts + offsets]
        loss = model(input_ids=ids, labels=ids, **extra).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    after = heldout_perplexity(model.eval(), val_ids, seq_len)
    return after, (before - after) / before


def measure(model: Any, tokenizer: Any, spec: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Everything of one row but the build: perplexities, PTQ gaps, fine-tune gain."""
    import torch

    import modelopt_lite.quantization as mtq
    from modelopt_lite.cli.ptq import build_config
    from modelopt_lite.models import corpus_texts
    from modelopt_lite.models.trainer import heldout_perplexity, token_stream

    train_split, val_split, test_split = splits_of(spec)
    seq_len = spec.seq_len
    train_ids = token_stream(tokenizer, corpus_texts(train_split))
    val_ids = token_stream(tokenizer, corpus_texts(val_split))
    test_ids = token_stream(tokenizer, corpus_texts(test_split))
    calib = train_ids[: (train_ids.numel() // CALIB_SEQ) * CALIB_SEQ].view(-1, CALIB_SEQ)[: args.calib_size]
    calib_batches = list(calib.split(CALIB_BATCH))
    row: dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters())}
    row["val_ppl"] = heldout_perplexity(model, val_ids, seq_len)
    row["test_ppl"] = heldout_perplexity(model, test_ids, seq_len)
    for name, cfg in (("nvfp4", build_config("nvfp4")), ("nvfp4_kvfp8", build_config("nvfp4", "fp8"))):
        quantized = copy.deepcopy(model)
        with torch.no_grad():
            mtq.quantize(quantized, cfg, calib_batches)
        val = heldout_perplexity(quantized, val_ids, seq_len)
        test = heldout_perplexity(quantized, test_ids, seq_len)
        row[f"{name}_val_ppl"], row[f"{name}_test_ppl"] = val, test
        row[f"{name}_val_gap"], row[f"{name}_test_gap"] = val / row["val_ppl"] - 1, test / row["test_ppl"] - 1
        del quantized
    if args.ft_steps:
        lr = args.ft_lr
        after, gain = fine_tune_gain(model, train_ids, val_ids, seq_len, steps=args.ft_steps, lr=lr,
                                     batch=args.ft_batch, seq=args.ft_seq)  # fmt: skip
        row.update(ft_lr=lr, ft_val_ppl=after, ft_gain=gain)
    return row


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| kind | params | build s | val ppl | test ppl | nvfp4 val ppl | nvfp4 val gap | nvfp4 test gap "
            "| +fp8 kv val gap | ft lr | ft val gain |")  # fmt: skip
    lines = [h.table_head(head)]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['parameters'] / 1e6:.2f}M | {r.get('build_seconds', '-')} "
            f"| {r['val_ppl']:.2f} | {r['test_ppl']:.2f} | {r['nvfp4_val_ppl']:.2f} "
            f"| {_pct(r['nvfp4_val_gap'])} | {_pct(r['nvfp4_test_gap'])} | {_pct(r['nvfp4_kvfp8_val_gap'])} "
            f"| {r.get('ft_lr', 0):.1e} | {_pct(r.get('ft_gain'))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    h.pin_threads(args.threads, seed=None)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modelopt_lite.models import default_model_path
    from modelopt_lite.models.cache import MARKER
    from modelopt_lite.models.specs import spec_for

    rows = []
    for kind in args.kinds:
        spec = spec_for(kind)
        path = args.checkpoint.get(kind) or str(default_model_path(kind, train_if_missing=args.build))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        marker = os.path.join(path, MARKER)
        report = json.load(open(marker))["report"] if os.path.isfile(marker) else {}
        start = time.perf_counter()
        row = {"kind": kind, "path": path, "build_seconds": report.get("train_seconds"),
               **measure(model, tokenizer, spec, args)}  # fmt: skip
        row["measure_seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(table(rows))
    h.write_json(args.json, rows, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
