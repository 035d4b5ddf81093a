"""How much of the PTQ perplexity gap do QAT and QAD win back, on the benchmark models and SmolLM2?

Published in ``docs/accuracy.md`` (``docs/accuracy.json`` / ``.png``: the runs of its "Commands", then merged)
and ``docs/real_qad.md`` (SmolLM2-135M; the command with each table), for example:

    python benchmarks/accuracy.py --models bench-dense --threads 1 --steps 800 --seeds 1,2 --lr 1e-4 \\
        --qad-lr 3e-4 --ptq nvfp4 --rows "qat nvfp4,qad nvfp4" --json dense800.json
    python benchmarks/accuracy.py --merge dense.json moe.json dense800.json moe800.json dense1600a.json \\
        dense1600b.json --json docs/accuracy.json --png docs/accuracy.png

(``--quick``: 4 steps, 4 calibration / 4 evaluation windows, a smoke run).

Models: ``modelopt_lite.models`` benchmark models (``bench-dense`` = Llama, ``bench-moe`` = Qwen3-MoE with
fused experts), trained to near convergence on the ``fit`` split of the default corpus, fp32, loaded from
the user cache (``modelopt-lite-default-model --kind bench-dense`` builds one; this script never trains
them). ``dense`` / ``moe`` (the small default models) work too; their pretraining saw the validation split.

Data, three disjoint splits of the corpus by document (``models.corpus``), tokenized as the models were
trained (``bos text eos`` per document):

* ``fit``: calibration (the first ``--calib-size`` windows of 256 tokens, batches of 4, the same for every
  row) and QAT / QAD training (consecutive ``--seq-len`` windows, shuffled by the Trainer's seed);
* ``validation``: every setting (lr, steps, temperature, amax lr, ...) is chosen on it (``val`` columns);
* ``test``: the reported figures (``test`` columns, the table, the PNG); never read for a choice.

Perplexity: consecutive, non-overlapping windows of ``max_position_embeddings`` tokens (tail dropped),
every predicted token counted (``modelopt_lite.evaluation``). ``KL``: mean KL(unquantized || row)
per predicted token on the test windows, in 1e-3 nats.

Rows. PTQ (fake quant, calibrated on the same windows):

* ``nvfp4``: W4A4 NVFP4 (``NVFP4_DEFAULT_CFG``) with FP8 KV cache; ``nvfp4_awq`` the same with AWQ-lite;
* ``w4a16_nvfp4``: NVFP4 weights only, ``a_nvfp4``: NVFP4 activations (and FP8 KV) only: the two parts of
  the nvfp4 gap;
* ``nvfp4_rot``: nvfp4 after ``mtq.rotate_residual`` (residual-stream rotation folded into the weights);
* ``nvfp4_46``: ``NVFP4_FOUR_OVER_SIX_CFG`` (static weight block scales, each block's scale 4 or 6 x its
  maximum, whichever has the smaller error) with FP8 KV cache: the adaptive-block-scale lever;
* ``int4``: INT4 block-128 weight-only (max), ``int4_awq``: the same with AWQ (``INT4_AWQ_CFG``);
* ``nvfp4_nokv``: ``NVFP4_DEFAULT_CFG`` as it is (W4A4, KV cache unquantized), ``fp8``: ``FP8_DEFAULT_CFG``
  (W8A8 FP8, per-tensor amax): the formats of the side-by-side with the peers (``benchmarks/peers.py``);
  ``nvfp4_nokv_awq`` / ``_rot`` / ``_46``: that row with AWQ-lite / the rotation / adaptive block scales;
  ``nvfp4_nokv_mse``: ``NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG`` (static weight block scales from an MSE search
  over the FP8 scale grid, activations dynamic; issue 44); ``nvfp4_nokv_aq``: ``mtq.auto_quantize`` over
  NVFP4 W4A4, FP8 and unquantized per layer at :data:`AQ_BITS` weight bits per parameter of the decoder's
  linear layers (``lm_head``, unquantized, is left out of the budget; gradient score on the first
  :data:`AQ_SCORE_BATCHES` calibration batches).

Training (each from a copy of its PTQ row, so the trainer skips calibration and recovery compares against
exactly that row): ``qat X`` = ``QATTrainer`` (cross-entropy), ``qad X`` = ``QADTrainer`` with the
unquantized model as the frozen teacher (KL at ``--temperature``, plus ``--ce-weight`` x CE, 0 by default);
``+la`` rows make every static amax learnable (``learn_amax``, lr x ``--amax-lr-multiplier``; on
``nvfp4_nokv_mse``, the static weight block scales of ``NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG``), ``+la_only``
the same with only those amax training (``trainable_params``, weights frozen); ``+rkl`` / ``+jsd`` /
``+topk`` QAD rows distill with the reverse KL / generalized JSD (``--jsd-beta``) / top-k KL
(``--distill-top-k``) instead of the forward KL (``DistillationArguments.distill_loss``); ``ft`` = the
unquantized model fine-tuned with a plain ``Trainer`` and the same budget and lr (the control of QAT).
Budget: ``--steps`` optimizer steps of ``--batch-size`` x ``--seq-len`` tokens, AdamW (weight decay 0),
peak ``--lr`` (QAD rows: ``--qad-lr``), linear warm-up over 10%,
cosine to 0, gradient clipping 1.0. Seeds (``--seeds``) set the data order and the Trainer's initialisation:
the first seed runs every training row, the others only the ``--seeded-rows``. ``--budgets`` adds
``qat nvfp4`` / ``qad nvfp4`` / ``ft`` at each step count (first seed only): is recovery still rising?
``--qad-lrs`` adds every QAD row of ``--rows`` at each of these peak learning rates (first seed,
``--steps``; named ``<row> lr <value>``): the learning-rate probe of docs/training.md in one process, the
unquantized and PTQ rows measured once.

Recovery, per split (a row that starts from a lever's PTQ row, ``nvfp4_rot`` / ``nvfp4_awq`` / ``nvfp4_46``
/ ``int4_awq``, is measured against the gap of the plain format's PTQ row, ``nvfp4`` / ``int4``: ``gap_of``
in the JSON):

* QAD: ``(ppl_ptq - ppl_qad) / (ppl_ptq - ppl_unquantized)``: the share of the gap to the teacher closed;
* QAT: ``(ppl_ptq - ppl_qat) / (ppl_ptq - ppl_ft)``: the share of the gap to the unquantized model
  fine-tuned with the same budget, seed and lr (training alone also moves perplexity);
* ``KL rec``: ``1 - KL_trained / KL_ptq``.

Targets (issue 14, nvfp4 on both models, mean of the seeds): QAD >= 85%, QAT >= 70%.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h

PTQ_ROWS = (
    "nvfp4",
    "nvfp4_awq",
    "w4a16_nvfp4",
    "a_nvfp4",
    "nvfp4_rot",
    "nvfp4_46",
    "int4",
    "int4_awq",
    "nvfp4_nokv",
    "fp8",
)
# real-model lever starts (not in the default --ptq): AWQ-lite, the residual rotation, adaptive block scales,
# each on NVFP4 W4A4 with the KV cache unquantized
LEVER_PTQ_ROWS = ("nvfp4_nokv_awq", "nvfp4_nokv_rot", "nvfp4_nokv_46", "nvfp4_nokv_aq", "nvfp4_nokv_mse")
AQ_BITS = 5.0  # the nvfp4_nokv_aq row's auto_quantize budget (NVFP4 W4A4 alone is 4.5, FP8 alone 8)
AQ_SCORE_BATCHES = 4
# the +LOSS suffixes of QAD rows -> DistillationArguments.distill_loss
LOSS_ROWS = {"rkl": "reverse_kl", "jsd": "jsd", "topk": "top_k_kl"}
# training rows, "MODE PTQ-ROW [+LEVER]": QAT or QAD from that PTQ row (+la: learnable amax)
TRAIN_ROWS: dict[str, tuple[str, str, bool]] = {
    name: (name.split()[0], name.split()[1], name.endswith(("+la", "+la_only")))
    for name in (
        "qat nvfp4", "qad nvfp4", "qad w4a16_nvfp4", "qad a_nvfp4", "qad nvfp4_rot", "qad nvfp4_awq",
        "qat nvfp4_46", "qad nvfp4_46", "qat int4", "qad int4", "qad int4 +la", "qad int4_awq",
        # the formats of the side-by-side with the peers (benchmarks/peers.py)
        "qat nvfp4_nokv", "qad nvfp4_nokv", "qat fp8", "qad fp8",
        # real-model levers (issue 30): the tied embedding / lm_head frozen; better PTQ starts (learnable
        # amax: the int4 +la row; NVFP4 W4A4 has no static amax to learn)
        "qad nvfp4_nokv +frozen_emb", "qad nvfp4_nokv_awq", "qad nvfp4_nokv_rot",
        "qad nvfp4_nokv_46", "qad nvfp4_nokv_aq", "qad w4a16_nvfp4 +frozen_emb",
        # LoRA (issue 43): +loraR trains rank-R adapters deployed merged, +loraRs served, +qloraR served on
        # the base compressed to its real format (mtq.compress)
        *(f"{m} {f} +{kind}" for m in ("qad", "qat") for f in ("nvfp4_nokv", "int4")
          for kind in ("lora8", "lora32", "lora128", "lora32s", "qlora32")),
        # NVFP4 W4A4 levers (issue 44): static MSE / FP8-sweep weight block scales as they are, learned with
        # the weights (+la), learned alone with the weights frozen (+la_only, the reference's scale-only
        # QAD); the distillation divergences (+rkl reverse KL, +jsd with --jsd-beta, +topk with
        # --distill-top-k) on the plain and the static-scale start
        "qad nvfp4_nokv_mse", "qad nvfp4_nokv_mse +la", "qad nvfp4_nokv_mse +la_only",
        *(f"qad {f} +{loss}" for f in ("nvfp4_nokv", "nvfp4_nokv_mse") for loss in LOSS_ROWS),
    )
}  # fmt: skip
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def loss_of(row: str) -> str:
    """The ``DistillationArguments.distill_loss`` of a training row (``+rkl`` / ``+jsd`` / ``+topk``; else the
    default forward KL)."""
    suffix = row.rsplit("+", 1)[-1] if "+" in row else ""
    return LOSS_ROWS.get(suffix, "forward_kl")


def lora_of(row: str) -> tuple[int, str, bool] | None:
    """``(rank, deployment, compressed base)`` of a ``+lora`` / ``+qlora`` row, else None."""
    import re

    found = re.search(r"\+(q?)lora(\d+)(s?)$", row)
    if found is None:
        return None
    qlora, rank, served = found.groups()
    return int(rank), "served" if (served or qlora) else "merged", bool(qlora)


DEFAULT_TRAIN = (
    "qat nvfp4",
    "qad nvfp4",
    "qad w4a16_nvfp4",
    "qad a_nvfp4",
    "qad nvfp4_rot",
    "qad int4",
    "qad int4 +la",
    "qat int4",
)
# PTQ rows that apply a lever to a plain format -> that format (recovery is measured against its gap)
LEVER_OF = {
    "nvfp4_rot": "nvfp4",
    "nvfp4_awq": "nvfp4",
    "nvfp4_46": "nvfp4",
    "int4_awq": "int4",
    "nvfp4_nokv_awq": "nvfp4_nokv",
    "nvfp4_nokv_rot": "nvfp4_nokv",
    "nvfp4_nokv_46": "nvfp4_nokv",
    "nvfp4_nokv_aq": "nvfp4_nokv",
    "nvfp4_nokv_mse": "nvfp4_nokv",
}
TARGETS = {"qat nvfp4": 0.70, "qad nvfp4": 0.85}
REAL = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-1.5b")  # modelopt_lite.models.REAL_MODELS: compare()
MODELS = ("bench-dense", "bench-moe", "dense", "moe", *REAL)
# off-distribution text: continuations sampled from the unquantized model after these prompts (nothing like
# the corpus, CPython's documentation), so that distillation that only learns the corpus shows up
OFFDIST_PROMPTS = (
    "Once upon a time, in a small village by the sea,",
    "The best way to make a tomato soup is",
    "Dear Anna, thank you for your letter. Last week",
    "The football match last night was",
    "Photosynthesis is the process by which",
    "In 1850, the city of London",
    "My favourite holiday destination is",
    "The stock market fell sharply today because",
    "To grow healthy roses in your garden,",
    "The history of the Roman Empire begins",
    "Yesterday I went to the doctor and",
    "The new smartphone has a camera that",
    "A good night's sleep matters because",
    "The mountains in winter are",
    "She opened the door and saw",
    "The most important invention of the twentieth century",
)
GEN_PROMPTS = ("The capital of France is", "To open a file in Python,", "Once upon a time,")
CALIB_SEQ, CALIB_BATCH = 256, 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = h.common(h.parser(__doc__), threads=2, quick="4 steps, 4 calibration / 4 eval windows")
    p.add_argument("--models", default="bench-dense,bench-moe", help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of every training row")
    p.add_argument("--budgets", default="", help="extra step counts for qat / qad nvfp4 and ft (first seed)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training sample")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (QAT, QAD and the control)")
    p.add_argument(
        "--qad-lr", type=float, default=None, help="peak learning rate of the QAD rows (default --lr)"
    )
    p.add_argument(
        "--qad-lrs", default="", help="extra peak learning rates of the QAD rows (first seed, --steps)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="QAD softmax temperature")
    p.add_argument("--ce-weight", type=float, default=0.0, help="QAD cross-entropy weight (KL weight 1)")
    p.add_argument(
        "--distill-chunk-size",
        type=int,
        default=None,
        help="tokens per chunk of the QAD loss (default: the whole batch at once, the reference's "
        "arithmetic bit for bit; a number: the same objective, less memory, other rounding)",
    )
    p.add_argument(
        "--lora-lr",
        type=float,
        default=None,
        help="peak learning rate of the +lora rows (default: as QAD / QAT)",
    )
    p.add_argument("--amax-lr-multiplier", type=float, default=1.0, help="lr of learnable amax (+la rows)")
    p.add_argument(
        "--jsd-beta", type=float, default=0.5, help="beta of the +jsd rows (0 forward, 1 reverse KL)"
    )
    p.add_argument("--distill-top-k", type=int, default=50, help="teacher tokens compared by the +topk rows")
    p.add_argument("--seeds", default="0", help="comma-separated Trainer seeds (the first runs every row)")
    p.add_argument(
        "--seeded-rows",
        default="qat nvfp4,qad nvfp4",
        help="training rows that run on every seed (the others run on the first seed only)",
    )
    p.add_argument("--calib-size", type=int, default=32, help="calibration windows of 256 tokens")
    p.add_argument("--eval-windows", type=int, default=None, help="cap on validation / test windows")
    p.add_argument(
        "--eval-seq",
        type=int,
        default=None,
        help="tokens per evaluation window (default: max_position_embeddings; 512 for a real model)",
    )
    p.add_argument(
        "--train-windows", type=int, default=None, help="cap on distinct training windows (first N of fit)"
    )
    p.add_argument(
        "--offdist-tokens",
        type=int,
        default=128,
        help="real models: tokens sampled from the unquantized model after each of the off-distribution "
        "prompts (0: no off-distribution rows)",
    )
    p.add_argument(
        "--gen-tokens",
        type=int,
        default=24,
        help="real models: greedy tokens after each of GEN_PROMPTS per row",
    )
    p.add_argument(
        "--budget-rows",
        default="qat nvfp4,qad nvfp4",
        help="training rows run at each of --budgets (first seed)",
    )
    p.add_argument("--ptq", default=",".join(PTQ_ROWS), help="PTQ rows")
    p.add_argument("--rows", default=",".join(DEFAULT_TRAIN), help=f"training rows from {list(TRAIN_ROWS)}")
    p.add_argument("--no-control", dest="control", action="store_false", help="skip the ft control")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="measure nothing: combine the --json files of earlier runs (e.g. one per model, run side by "
        "side) into one table / --json / --png",
    )
    h.common(
        p, json="write the numbers here (every finished row also to F.partial at once, removed at the end)",
        png="write recovery bars and budget curves here (needs matplotlib)",
    )  # fmt: skip
    args = p.parse_args(argv)
    args.models, args.ptq, args.rows = h.csv(args.models), h.csv(args.ptq), h.csv(args.rows)
    args.seeded_rows, args.budget_rows = h.csv(args.seeded_rows), h.csv(args.budget_rows)
    try:
        args.seeds = [int(s) for s in h.csv(args.seeds)]
        args.budgets = [int(s) for s in h.csv(args.budgets)]
        args.qad_lrs = [float(s) for s in h.csv(args.qad_lrs)]
    except ValueError:
        p.error("--seeds and --budgets take comma-separated integers, --qad-lrs numbers")
    if any(not lr > 0 for lr in args.qad_lrs):
        p.error("--qad-lrs must be positive")
    for value, allowed, flag in (
        (args.models, MODELS, "--models"),
        (args.ptq, PTQ_ROWS + LEVER_PTQ_ROWS, "--ptq"),
        (args.rows, tuple(TRAIN_ROWS), "--rows"),
        (args.budget_rows, tuple(TRAIN_ROWS), "--budget-rows"),
    ):
        bad = [v for v in value if v not in allowed]
        if bad:
            p.error(f"{flag}: unknown {bad}; choose from {list(allowed)}")
    budget_rows = args.budget_rows if args.budgets else []
    missing = sorted({TRAIN_ROWS[r][1] for r in args.rows + budget_rows} - set(args.ptq))
    if missing:
        p.error(f"--rows start from the PTQ rows {missing}: add them to --ptq")
    if args.quick:
        args.steps, args.calib_size, args.eval_windows = 4, 4, args.eval_windows or 4
        args.budgets = [2] if args.budgets else []
    for flag in ("threads", "steps", "batch_size", "seq_len", "calib_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be a positive integer")
    for flag in ("lr", "temperature", "amax_lr_multiplier", "qad_lr", "lora_lr"):
        if getattr(args, flag) is not None and not getattr(args, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if args.ce_weight < 0:
        p.error("--ce-weight must be >= 0")
    if args.distill_chunk_size is not None and args.distill_chunk_size < 1:
        p.error("--distill-chunk-size must be >= 1")
    if not 0 <= args.jsd_beta <= 1 or args.distill_top_k < 2:
        p.error("--jsd-beta must lie in [0, 1] and --distill-top-k be >= 2")
    if not args.seeds or any(b < 1 for b in args.budgets):
        p.error("--seeds needs at least one seed; --budgets must be positive")
    return args


# ------------------------------------------------------------------------------------------- measuring


class TokenWindows:
    """Consecutive ``seq_len`` windows of a token stream as causal-LM samples."""

    def __init__(self, stream: Any, seq_len: int):
        count = stream.numel() // seq_len
        if count == 0:
            raise ValueError(f"{stream.numel()} tokens are fewer than one sample of seq_len={seq_len}")
        self.ids = stream[: count * seq_len].view(count, seq_len)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# the measuring functions are modelopt_lite.evaluation's (torch only), imported on use: the peer worker runs
# this module in another virtualenv with the repository root on PYTHONPATH


def _ppl(model: Any, windows: Any) -> float:
    """Perplexity by the one protocol (``modelopt_lite.evaluation.perplexity``)."""
    from modelopt_lite.evaluation import perplexity

    return perplexity(model, windows)


def _kl(base_logprobs: list[Any], model: Any, windows: Any, batch_size: int = 8) -> float:
    """Mean KL(unquantized || model) in nats per predicted token (``modelopt_lite.evaluation``)."""
    from modelopt_lite.evaluation import kl_per_token

    return kl_per_token(base_logprobs, model, windows, batch_size)


def base_logprobs(model: Any, windows: Any, batch_size: int = 8) -> list[Any]:
    """The unquantized model's next-token log-probabilities on ``windows``, per batch (for :func:`_kl`)."""
    from modelopt_lite.evaluation import reference_logprobs

    return reference_logprobs(model, windows, batch_size)


def ptq_config(row: str) -> dict[str, Any]:
    import modelopt_lite.quantization as mtq
    from modelopt_lite.cli.ptq import build_config

    if row in ("nvfp4", "nvfp4_rot"):
        return build_config("nvfp4", "fp8")
    if row in ("nvfp4_nokv", "nvfp4_nokv_rot"):  # W4A4 as NVFP4_DEFAULT_CFG ships it (KV cache unquantized)
        return build_config("nvfp4")
    if row == "nvfp4_nokv_awq":
        return build_config("nvfp4_awq")
    if row == "nvfp4_nokv_46":
        return mtq.get_preset("NVFP4_FOUR_OVER_SIX_CFG")
    if row == "nvfp4_nokv_mse":  # static weight block scales: MSE over the FP8 scale grid (issue 44)
        return mtq.get_preset("NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG")
    if row == "nvfp4_awq":
        return build_config("nvfp4_awq", "fp8")
    if row == "nvfp4_46":
        return mtq.with_kv_cache(mtq.get_preset("NVFP4_FOUR_OVER_SIX_CFG"), "FP8_KV_CFG")
    if row == "w4a16_nvfp4":
        return build_config("w4a16_nvfp4")
    if row == "a_nvfp4":  # the activation (and KV) half of nvfp4: weights left in full precision
        cfg = build_config("nvfp4", "fp8")
        cfg["quant_cfg"] = [*cfg["quant_cfg"], {"quantizer_name": "*weight_quantizer", "enable": False}]
        return cfg
    presets = {"int4": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "int4_awq": "INT4_AWQ_CFG", "fp8": "FP8_DEFAULT_CFG"}
    return mtq.get_preset(presets[row])


def ptq_model(row: str, base: Any, calib_batches: Any) -> Any:
    """A quantized copy of ``base`` for PTQ ``row``: the ``*_rot`` rows rotate the residual stream first;
    the ``*_aq`` row chooses a format per layer with ``mtq.auto_quantize``."""
    import torch

    import modelopt_lite.quantization as mtq

    model = copy.deepcopy(base)
    if row == "nvfp4_nokv_aq":
        loader = [{"input_ids": ids, "labels": ids} for ids in calib_batches]
        model, _ = mtq.auto_quantize(
            model,
            constraints={"effective_bits": h.aq_budget(model)(AQ_BITS)},
            quantization_formats=["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG", None],
            data_loader=loader,
            forward_step=lambda m, batch: m(**batch),
            loss_func=lambda out, batch: out.loss,
            num_calib_steps=len(loader),
            num_score_steps=min(AQ_SCORE_BATCHES, len(loader)),
            disabled_layers=["*lm_head*"],
        )
        return model
    if row.endswith("_rot"):
        mtq.rotate_residual(model)
    with torch.no_grad():
        mtq.quantize(model, ptq_config(row), calib_batches)
    return model


def make_amax_learnable(student: Any) -> int:
    """Make every static amax of the already quantized ``student`` learnable in place (the ``+la`` rows);
    returns how many. Refuses a model with none (NVFP4 / MX block scales and dynamic scales have no amax to
    learn), whose ``+la`` row would silently repeat the row without it."""
    from modelopt_lite.formats import learnable_amax_error
    from modelopt_lite.quantization import iter_quantizers

    count = 0
    for _, q in iter_quantizers(student):
        if q.is_enabled and q.amax is not None and learnable_amax_error(q.spec) is None:
            q.learn_amax = True
            count += 1
    if count == 0:
        raise ValueError(
            "a +la row, but no enabled quantizer of this model has a static amax to learn (NVFP4 / MX block "
            "scales and dynamic scales have none): the row would repeat the row without +la"
        )
    from modelopt_lite.training.trainable import unify_learned_static_scales

    unify_learned_static_scales(student)  # as QATTrainer does before learning static NVFP4 block scales
    return count


def _training_args(
    args: argparse.Namespace, output_dir: str, steps: int, seed: int, lr: float | None = None
) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr if lr is None else lr,
        lr_scheduler_type="cosine",
        warmup_steps=round(0.1 * steps),
        weight_decay=0.0,
        max_grad_norm=1.0,
        seed=seed,
        data_seed=seed,
        use_cpu=True,
        save_strategy="no",
        report_to="none",
        logging_steps=max(1, steps // 10),
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def _train(
    mode: str,
    student: Any,
    teacher: Any,
    train_set: TokenWindows,
    tokenizer: Any,
    args: Any,
    steps: int,
    seed: int,
    learn_amax: bool = False,
    freeze_embeddings: bool = False,
    lr: float | None = None,
    lora: tuple[int, str, bool] | None = None,
    row: str = "",
) -> tuple[Any, dict[str, Any]]:
    from transformers import Trainer

    from modelopt_lite.training import DistillationArguments, QADTrainer, QATTrainer, QuantizationArguments

    if learn_amax:
        make_amax_learnable(student)
    if freeze_embeddings:  # the tied embedding / lm_head keeps its weights (a fifth of SmolLM2-135M's)
        student.get_input_embeddings().weight.requires_grad_(False)
        student.get_output_embeddings().weight.requires_grad_(False)
    lora_args: dict[str, Any] = {}
    if lora is not None:  # adapters on the PTQ model (quantize, then wrap); QLoRA compresses the base first
        from peft import LoraConfig

        import modelopt_lite.quantization as mtq

        rank, _, compressed = lora
        if compressed:
            mtq.compress(student)
        lora_args["lora_config"] = LoraConfig(
            r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
        )
        lr = lr or args.lora_lr
    with tempfile.TemporaryDirectory(prefix="accuracy-bench-") as out:
        common = dict(
            model=student,
            args=_training_args(args, out, steps, seed, lr or (args.qad_lr if mode == "qad" else None)),
            train_dataset=train_set,
            processing_class=tokenizer,
            **lora_args,
        )
        # the student already carries its PTQ quantizers: the trainers skip quantization and calibration
        quant = QuantizationArguments(
            recipe="NVFP4_DEFAULT_CFG",
            amax_lr_multiplier=args.amax_lr_multiplier,
            lora_deploy=lora[1] if lora else "auto",
            # +la_only: the scales alone train (the reference's scale-only QAD)
            trainable_params=["*weight_quantizer._amax"] if row.endswith("+la_only") else None,
        )
        if mode == "ft":
            trainer: Any = Trainer(**{k: v for k, v in common.items() if k != "lora_config"})
        elif mode == "qat":
            trainer = QATTrainer(**common, quant_args=quant)
        else:
            distill = DistillationArguments(
                temperature=args.temperature,
                kd_loss_weight=1.0,
                ce_loss_weight=args.ce_weight,
                distill_chunk_size=args.distill_chunk_size,
                distill_loss=loss_of(row),
                jsd_beta=args.jsd_beta,
                distill_top_k=args.distill_top_k,
            )
            trainer = QADTrainer(**common, quant_args=quant, distill_args=distill, teacher_model=teacher)
        return run_training(trainer)


def run_training(trainer: Any) -> tuple[Any, dict[str, Any]]:
    """Train; the trained model (unwrapped, eval mode) and the run's time, steps, first / last loss and
    every logged loss."""
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    return model, {
        "train_seconds": round(seconds, 1),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "steps": trainer.state.global_step,
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        # every logged loss and gradient norm (logging_steps), to compare two runs step by step
        "train_losses": losses,
        "train_grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
    }


def _share(start: float, end: float, goal: float) -> float | None:
    """``(start - end) / (start - goal)``; None when there is no gap (``start <= goal``)."""
    return None if start - goal <= 0 else (start - end) / (start - goal)


def load_data(
    kind: str, args: argparse.Namespace
) -> tuple[Any, Any, dict[str, Any], list[Any], TokenWindows]:
    """The unquantized model (fp32, eval mode), its tokenizer and the data of every row: the
    ``validation`` / ``test`` windows (and, for a real model, ``offdist``), the calibration batches and the
    training windows (the first ``--train-windows`` of the fit split when given)."""
    from modelopt_lite.models import corpus_texts, load_default_model
    from modelopt_lite.models.trainer import token_stream

    base, tokenizer = load_default_model(kind, train_if_missing=False)
    base = base.float().eval()
    eval_seq = args.eval_seq or (512 if kind in REAL else base.config.max_position_embeddings)
    stream = {s: token_stream(tokenizer, corpus_texts(s)) for s in ("fit", "validation", "test")}
    evals = {s: TokenWindows(stream[s], eval_seq).ids[: args.eval_windows] for s in ("validation", "test")}
    if kind in REAL and args.offdist_tokens:
        evals["offdist"] = offdist_windows(base, tokenizer, args.offdist_tokens)
    calib_batches = list(TokenWindows(stream["fit"], CALIB_SEQ).ids[: args.calib_size].split(CALIB_BATCH))
    train_set = TokenWindows(stream["fit"], args.seq_len)
    if args.train_windows is not None:
        if args.train_windows > len(train_set):
            raise SystemExit(f"--train-windows {args.train_windows}: the fit split holds {len(train_set)}")
        train_set.ids = train_set.ids[: args.train_windows]
    return base, tokenizer, evals, calib_batches, train_set


def offdist_windows(model: Any, tokenizer: Any, new_tokens: int, seed: int = 0) -> Any:
    """One window per :data:`OFFDIST_PROMPTS` prompt: ``bos prompt`` and ``new_tokens`` tokens sampled from
    ``model`` (temperature 1, no top-k / top-p, end of text suppressed), cut to the shortest prompt's length
    so that the windows stack."""
    import torch

    torch.manual_seed(seed)
    rows = []
    for prompt in OFFDIST_PROMPTS:
        ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer(prompt, add_special_tokens=False).input_ids]])
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
        rows.append(out[0])
    length = min(len(r) for r in rows)
    return torch.stack([r[:length] for r in rows])


def measure(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    base, tokenizer, evals, calib_batches, train_set = load_data(kind, args)
    eval_seq = base.config.max_position_embeddings
    from modelopt_lite.evaluation import compare, greedy_continuations

    real = kind in REAL
    base_lp = None if real else base_logprobs(base, evals["test"])
    print(
        f"\n## {kind}: {sum(p.numel() for p in base.parameters()) / 1e6:.2f}M parameters; validation "
        f"{tuple(evals['validation'].shape)}, test {tuple(evals['test'].shape)} windows; calibration "
        f"{args.calib_size} x {CALIB_SEQ}; training {len(train_set)} windows of {args.seq_len}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []

    def add(name: str, method: str, model: Any, **extra: Any) -> dict[str, Any]:
        if base_lp is None:  # a real model: both models batch by batch (evaluation.compare)
            row = {"name": name, "method": method}
            for split, key in (("validation", "val"), ("test", "test"), ("offdist", "offdist")):
                if split in evals:
                    c = compare(base, model, evals[split])
                    row[f"{key}_ppl"], row[f"{key}_kl"], row[f"{key}_top1"] = (
                        c.perplexity,
                        c.kl,
                        c.top1_agreement,
                    )
            row["kl"] = row["test_kl"]
            if args.gen_tokens:
                row["generations"] = greedy_continuations(
                    model, tokenizer, list(GEN_PROMPTS), args.gen_tokens
                )
            row.update(extra)
        else:
            row = {
                "name": name,
                "method": method,
                "val_ppl": _ppl(model, evals["validation"]),
                "test_ppl": _ppl(model, evals["test"]),
                "kl": _kl(base_lp, model, evals["test"]),
                **extra,
            }
        rows.append(row)
        if args.json:  # every finished row is on disk at once: a stopped run loses only the row in progress
            h.write_json(f"{args.json}.partial", {"model": kind, "rows": rows})
        print(
            f"  {name:<18} seed {extra.get('seed', '-')!s:>2} steps {extra.get('steps', '-')!s:>4}   val ppl "
            f"{row['val_ppl']:8.3f}   test ppl {row['test_ppl']:8.3f}   KL {1e3 * row['kl']:7.3f}e-3"
            + (f"   top-1 {row['test_top1']:.3f}" if "test_top1" in row else "")
            + (
                f"   off-dist ppl {row['offdist_ppl']:.3f} KL {row['offdist_kl']:.3f}"
                if "offdist_ppl" in row
                else ""
            ),
            flush=True,
        )
        return row

    baseline = add("unquantized", "baseline", base)
    teacher = copy.deepcopy(base)  # QADTrainer freezes its teacher: keep `base` trainable for the control
    ptq: dict[str, tuple[Any, dict[str, Any]]] = {}
    for name in args.ptq:
        start = time.perf_counter()
        model = ptq_model(name, base, calib_batches)
        row = add(f"ptq {name}", "ptq", model, calib_seconds=round(time.perf_counter() - start, 1))
        ptq[name] = (model, row)

    def trained(
        name: str,
        steps: int,
        seed: int,
        controls: dict[tuple[int, int], dict[str, Any]],
        lr: float | None = None,
    ) -> None:
        mode, start_row, learn = TRAIN_ROWS[name]
        model0 = ptq[start_row][0]
        # a lever row (rotation, AWQ start) is measured against the gap of the plain format's PTQ row, so
        # that what the lever buys before training counts too
        ptq_row = ptq[LEVER_OF.get(start_row, start_row) if LEVER_OF.get(start_row) in ptq else start_row][1]
        frozen = name.endswith("+frozen_emb")
        model, stats = _train(
            mode, copy.deepcopy(model0), teacher, train_set, tokenizer, args, steps, seed, learn, frozen, lr,
            lora_of(name), name,
        )  # fmt: skip
        row = add(
            name if lr is None else f"{name} lr {lr:g}",
            mode,
            model,
            seed=seed,
            starts_from=f"ptq {start_row}",
            gap_of=ptq_row["name"],
            **({} if lr is None else {"lr": lr}),
            **stats,
        )
        goal = controls.get((steps, seed)) if mode == "qat" else baseline
        for split in ("val", "test", "offdist"):
            if f"{split}_ppl" not in row:
                continue
            row[f"{split}_recovery"] = (
                None
                if goal is None
                else _share(ptq_row[f"{split}_ppl"], row[f"{split}_ppl"], goal[f"{split}_ppl"])
            )
        row["recovery_goal"] = "ft (same budget, seed, lr)" if mode == "qat" else "unquantized"
        row["kl_recovery"] = 1 - row["kl"] / ptq_row["kl"] if ptq_row["kl"] > 0 else None
        if "offdist_kl" in row:
            row["offdist_kl_recovery"] = 1 - row["offdist_kl"] / ptq_row["offdist_kl"]
        if "test_top1" in row:  # the share of the top-1 agreement lost by PTQ that training won back
            lost = 1 - ptq_row["test_top1"]
            row["top1_recovery"] = (row["test_top1"] - ptq_row["test_top1"]) / lost if lost > 0 else None
        rec = "n/a" if row["test_recovery"] is None else f"{100 * row['test_recovery']:.1f}%"
        print(f"    test recovery {rec}; {stats['train_seconds']:.0f} s")

    controls: dict[tuple[int, int], dict[str, Any]] = {}
    for i, seed in enumerate(args.seeds):
        names = [r for r in args.rows if i == 0 or r in args.seeded_rows]
        if args.control and any(TRAIN_ROWS[r][0] == "qat" for r in names):
            model, stats = _train(
                "ft", copy.deepcopy(base), None, train_set, tokenizer, args, args.steps, seed
            )
            controls[(args.steps, seed)] = add("ft", "ft", model, seed=seed, **stats)
        for name in names:
            trained(name, args.steps, seed, controls)
    for steps in args.budgets:  # recovery against budget, first seed
        if steps == args.steps:
            continue
        seed = args.seeds[0]
        if any(TRAIN_ROWS[r][0] == "qat" for r in args.budget_rows):
            model, stats = _train("ft", copy.deepcopy(base), None, train_set, tokenizer, args, steps, seed)
            controls[(steps, seed)] = add("ft", "ft", model, seed=seed, **stats)
        for name in args.budget_rows:
            trained(name, steps, seed, controls)
    for lr in args.qad_lrs:  # the learning-rate probe, first seed
        for name in (r for r in args.rows if TRAIN_ROWS[r][0] == "qad"):
            trained(name, args.steps, args.seeds[0], controls, lr)
    return {
        "kind": kind,
        "eval_seq": eval_seq,
        "windows": {s: int(w.shape[0]) for s, w in evals.items()},
        "calib_windows": args.calib_size,
        "train_windows": len(train_set),
        "seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------- output


def merge_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The models of several ``--json`` runs; runs of the same model are combined (e.g. more seeds at another
    ``--steps``): a later run adds its trained rows, and its unquantized / PTQ rows must equal the first's."""
    by_kind: dict[str, dict[str, Any]] = {}
    for run in runs:
        for model in run["models"]:
            base = by_kind.setdefault(model["kind"], model)
            if base is model:
                continue
            known = {(r["name"], r.get("seed"), r.get("steps")): r for r in base["rows"]}
            for row in model["rows"]:
                first = known.get((row["name"], row.get("seed"), row.get("steps")))
                if first is None:
                    base["rows"].append(row)
                elif row["method"] in ("baseline", "ptq") and first["test_ppl"] != row["test_ppl"]:
                    raise SystemExit(
                        f"--merge: {model['kind']} {row['name']} differs between runs "
                        f"({first['test_ppl']} vs {row['test_ppl']}): not the same model or data"
                    )
    return list(by_kind.values())


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per (row, steps): means over seeds, with the min and max of the recovery."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for r in result["rows"]:
        groups.setdefault((r["name"], r.get("steps")), []).append(r)
    out = []
    for (name, steps), rs in groups.items():
        line: dict[str, Any] = {"name": name, "steps": steps, "seeds": len(rs), "method": rs[0]["method"]}
        for key in (
            "val_ppl", "test_ppl", "kl", "val_recovery", "test_recovery", "kl_recovery", "test_top1",
            "top1_recovery", "offdist_ppl", "offdist_kl", "offdist_recovery", "offdist_kl_recovery",
            "train_seconds",
        ):  # fmt: skip
            values = [r[key] for r in rs if r.get(key) is not None]
            if values:
                line[key] = statistics.fmean(values)
                if key.endswith("recovery") and len(values) > 1:
                    line[key + "_range"] = [min(values), max(values)]
        if name in TARGETS and line.get("test_recovery") is not None:
            line["target"] = TARGETS[name]
            line["target_met"] = line["test_recovery"] >= TARGETS[name]
        out.append(line)
    return out


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def markdown(results: list[dict[str, Any]], steps: int) -> str:
    lines = [
        "| model | row | steps | seeds | test ppl | test recovery (min - max) | val recovery | KL (1e-3) "
        "| KL rec | target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for res in results:
        for s in res["summary"]:
            if s["steps"] not in (None, steps):
                continue
            rng = s.get("test_recovery_range")
            rec = _pct(s.get("test_recovery")) + (f" ({_pct(rng[0])} - {_pct(rng[1])})" if rng else "")
            target = ""
            if "target" in s:
                target = f">= {100 * s['target']:.0f}%: {'met' if s['target_met'] else '**missed**'}"
            lines.append(
                f"| {res['kind']} | {s['name']} | {s['steps'] or ''} | {s['seeds']} | {s['test_ppl']:.3f} | "
                f"{rec} | {_pct(s.get('val_recovery'))} | {1e3 * s['kl']:.3f} | {_pct(s.get('kl_recovery'))} "
                f"| {target} |"
            )
    return "\n".join(lines)


CURVE_COLORS = ("#5aa469", "#f0a94a", "#4a7bd0", "#c0504d", "#8064a2")
# the budget curve's measures: (row key, line style, label)
CURVE_MEASURES = (
    ("test_recovery", "-", "ppl gap"),
    ("kl_recovery", "--", "KL"),
    ("offdist_recovery", ":", "off-dist ppl gap"),
)
# the goals of QAD on a real model (NVFP4 W4A4): perplexity gap, KL, perplexity gap off the training text
REAL_GOALS = {"test_recovery": 0.90, "kl_recovery": 0.60, "offdist_recovery": 0.75}


def curves(result: dict[str, Any]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """The first seed's recovery (%) against steps of every QAT / QAD row run at two budgets or more:
    ``{row: {measure: [(steps, %), ...]}}`` over :data:`CURVE_MEASURES`. QAT's perplexity gap is to its
    fine-tuned control; its off-distribution gap is left out (the control itself moves away from that text,
    so the share means nothing); KL recovery is ``1 - KL_trained / KL_ptq``."""
    first = min((r["seed"] for r in result["rows"] if r.get("seed") is not None), default=None)
    trained = [r for r in result["rows"] if r.get("seed") == first and r["method"] in ("qat", "qad")]
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for name in dict.fromkeys(r["name"] for r in trained):
        mine = [r for r in trained if r["name"] == name]
        if len({r["steps"] for r in mine}) < 2:  # a curve needs two budgets
            continue
        keys = [
            k for k, _, _ in CURVE_MEASURES if not (k == "offdist_recovery" and mine[0]["method"] == "qat")
        ]
        points = {k: sorted((r["steps"], 100 * r[k]) for r in mine if r.get(k) is not None) for k in keys}
        out[name] = {k: pts for k, pts in points.items() if pts}
    return out


def plot(results: list[dict[str, Any]], path: str, steps: int) -> None:
    """Per model: the mean test recovery of every row at ``steps`` (bars, min-max over seeds), and
    :func:`curves` (with the QAD goals of a real model as grey lines)."""
    fig, axes = h.pyplot().subplots(len(results), 2, figsize=(14, 4.2 * len(results)), squeeze=False)
    for (ax, curve), res in zip(axes, results, strict=True):
        lines = [s for s in res["summary"] if s["steps"] == steps and s.get("test_recovery") is not None]
        ax.bar(
            range(len(lines)),
            [100 * s["test_recovery"] for s in lines],
            color=["#f0a94a" if s["method"] == "qat" else "#5aa469" for s in lines],
        )
        for i, s in enumerate(lines):
            if "test_recovery_range" in s:
                lo, hi = s["test_recovery_range"]
                ax.plot([i, i], [100 * lo, 100 * hi], color="black", linewidth=1)
        for name, target in TARGETS.items():
            if any(s["name"] == name for s in lines):
                ax.axhline(100 * target, color="#999999", linestyle="--", linewidth=0.7)
                ax.annotate(f"{name} target", (len(lines) - 0.5, 100 * target), fontsize=7, ha="right")
        ax.set_xticks(range(len(lines)), [s["name"] for s in lines], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("test recovery of the PTQ gap (%)")
        ax.set_title(
            f"{res['kind']}: recovery after {steps} steps (bars: mean, lines: min-max over seeds)", fontsize=9
        )
        styles = {k: (style, what) for k, style, what in CURVE_MEASURES}
        budgets: set[int] = set()
        for i, (name, measures) in enumerate(curves(res).items()):
            color = CURVE_COLORS[i % len(CURVE_COLORS)]
            for key, pts in measures.items():
                budgets.update(s for s, _ in pts)
                style, what = styles[key]
                curve.plot(*zip(*pts, strict=True), marker="o", linestyle=style, color=color,
                           label=f"{name}: {what}")  # fmt: skip
        if res["kind"] in REAL and budgets:
            for key, goal in REAL_GOALS.items():
                curve.axhline(100 * goal, color="#999999", linestyle=styles[key][0], linewidth=0.7)
                curve.annotate(
                    f"QAD goal: {styles[key][1]}", (min(budgets), 100 * goal), fontsize=7, va="bottom"
                )
        curve.set_xscale("log", base=2)
        if budgets:
            curve.set_xticks(sorted(budgets), [str(b) for b in sorted(budgets)])
        curve.set_xlabel("optimizer steps")
        curve.set_ylabel("test recovery (%)")
        curve.set_title(f"{res['kind']}: recovery against budget (first seed)", fontsize=9)
        curve.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    h.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    h.pin_threads(args.threads)
    start = time.perf_counter()
    budget = (
        f"{args.steps} steps x {args.batch_size} x {args.seq_len} tokens, lr {args.lr:g}"
        + (f" (QAD {args.qad_lr:g})" if args.qad_lr is not None else "")
        + " (warm-up 10%, "
        f"cosine), AdamW, QAD T={args.temperature:g}"
        + (f" CE weight {args.ce_weight:g}" if args.ce_weight else "")
        + (f" loss chunk {args.distill_chunk_size}" if args.distill_chunk_size is not None else "")
        + f", seeds {args.seeds}"
    )
    print(f"threads {args.threads}; every training row: {budget}" + (" [--quick]" if args.quick else ""))
    if args.merge:
        runs = [json.loads(Path(f).read_text()) for f in args.merge]
        results = merge_runs(runs)
        args.steps = runs[0]["meta"].get("steps", args.steps)  # the table shows the first run's budget
        budget = " | ".join(dict.fromkeys(run["meta"]["budget"] for run in runs))
    else:
        results = [measure(kind, args) for kind in args.models]
    for res in results:
        res["summary"] = summarize(res)
    table = markdown(results, args.steps)
    wall = time.perf_counter() - start
    print(f"\n{table}\n\n{budget}. Total wall time {wall / 60:.1f} min.")
    if args.json:
        meta = {**h.run_meta(__file__, argv, wall), "threads": args.threads, "budget": budget}
        meta.update(steps=args.steps, merged=[run["meta"] for run in runs] if args.merge else None)
        meta.update(amax_lr_multiplier=args.amax_lr_multiplier, targets=TARGETS)
        h.write_json(args.json, {"meta": meta, "models": results})
        Path(f"{args.json}.partial").unlink(missing_ok=True)
        print(f"wrote {args.json}")
    if args.png:
        plot(results, args.png, args.steps)
        print(f"wrote {args.png}")
    missed = [
        f"{res['kind']} {s['name']}"
        for res in results
        for s in res["summary"]
        if s.get("target_met") is False and s["steps"] == args.steps
    ]
    if missed:
        print(f"targets missed: {', '.join(missed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
