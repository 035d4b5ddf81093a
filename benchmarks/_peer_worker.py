"""One peer library's QAT / QAD rows for ``benchmarks/peers.py``, run under the peer's own interpreter.

    PEER_PYTHON benchmarks/_peer_worker.py --peer {torchao,modelopt,...} --spec SPEC.json

``SPEC.json`` (written by ``peers.py``): ``model_dir`` (the benchmark model, a Hugging Face folder),
``data`` (a safetensors file: ``train`` / ``calib`` / ``validation`` / ``test`` token windows), ``formats``,
``steps``, ``batch_size``, ``lr``, ``seed``, ``temperature``, ``threads``, ``calib_batch``; for the
``modelopt_auto_quantize`` peer (``benchmarks/auto_quantize.py``) ``formats`` is ``["auto_quantize"]`` and
``auto_quantize`` holds the search settings. The ``modelopt_moe_step`` peer (``benchmarks/moe.py
--reference-python``) times the reference's quantized MoE QAT step instead: its spec holds ``model_dir``,
``data`` (a safetensors file: ``calib`` batches and the ``step`` input ids), ``preset``, ``lr``,
``repeats`` and ``threads``.

Imports torch, transformers, safetensors and the peer library. Of this repository it imports only the
measuring functions of ``benchmarks/accuracy.py`` (training windows, perplexity, KL, training arguments),
which use ``modelopt_lite.models.trainer.heldout_perplexity`` (torch only) from the repository root the
parent puts on ``PYTHONPATH``: nothing of ours is installed in the peer's virtualenv, and every model is
measured by the same functions as our rows. Prints progress to stderr and the result as one ``@@RESULT``
line (``_harness``): the rows, and per format the error a peer raised.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import _harness as h
import accuracy

# what each peer offers, by format: the name of its QAT / PTQ config
TORCHAO_FORMATS = ("nvfp4", "int4", "fp8")
MODELOPT_PRESETS = {
    "nvfp4": "NVFP4_DEFAULT_CFG",
    "int4": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
    "fp8": "FP8_DEFAULT_CFG",
}
INT4_GROUP = 128


class Run:
    """The model, data and budget every row shares, and the rows measured so far."""

    def __init__(self, spec: dict[str, Any]):
        h.pin_threads(spec["threads"])
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.spec = spec
        data = load_file(spec["data"])
        self.evals = {s: data[s] for s in ("validation", "test")}
        self.calib = list(data["calib"].split(spec["calib_batch"]))
        self.train_set = accuracy.TokenWindows(data["train"].reshape(-1), data["train"].shape[1])
        self.base = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
        self.base_lp = accuracy.base_logprobs(self.base, self.evals["test"])
        self.rows: list[dict[str, Any]] = []
        self.errors: dict[str, str] = {}
        self.add("unquantized", "baseline", "", self.base)

    def add(self, name: str, method: str, fmt: str, model: Any, **extra: Any) -> dict[str, Any]:
        row = {
            "name": name,
            "method": method,
            "format": fmt,
            "val_ppl": accuracy._ppl(model, self.evals["validation"]),
            "test_ppl": accuracy._ppl(model, self.evals["test"]),
            "kl": accuracy._kl(self.base_lp, model, self.evals["test"]),
            **extra,
        }
        self.rows.append(row)
        h.log(
            f"  {name:<24} val ppl {row['val_ppl']:8.3f}  test ppl {row['test_ppl']:8.3f}  "
            f"KL {1e3 * row['kl']:7.3f}e-3  {extra.get('train_seconds', '')}"
        )
        return row

    def training_args(self, output_dir: str) -> Any:
        s = self.spec
        ns = SimpleNamespace(batch_size=s["batch_size"], lr=s["lr"])
        return accuracy._training_args(ns, output_dir, s["steps"], s["seed"])  # type: ignore[arg-type]

    def train(self, make_trainer: Any) -> tuple[Any, dict[str, Any]]:
        """Build a trainer with ``make_trainer(training_args)``, train it, return the model and stats."""
        with tempfile.TemporaryDirectory(prefix="peer-bench-") as out:
            return accuracy.run_training(make_trainer(self.training_args(out)))

    def guarded(self, key: str, work: Any) -> None:
        """Run ``work()``; a peer error is recorded under ``key`` (first line, verbatim) and logged."""
        try:
            work()
        except Exception as err:  # a peer's failure is a result of this benchmark
            self.errors[key] = h.error_result(err, limit=400)["error"]
            h.log(f"  {key}: {self.errors[key]}")


# ---------------------------------------------------------------------------------------------- torchao


def _torchao_config(fmt: str) -> Any:
    if fmt == "nvfp4":
        from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig

        return NVFP4DynamicActivationNVFP4WeightConfig(use_triton_kernel=False)  # no triton on CPU
    if fmt == "int4":
        from torchao.quantization import Int4WeightOnlyConfig

        return Int4WeightOnlyConfig(group_size=INT4_GROUP)
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig

    return Float8DynamicActivationFloat8WeightConfig()


def _torchao_filter(fmt: str, skipped: list[str]) -> Any:
    """torchao's ``filter_fn``: every ``nn.Linear`` but ``lm_head`` (as modelopt's and our presets), and
    for INT4 only those whose input width is a multiple of the group (torchao's fake quantizer reshapes
    the weight into whole groups); the others are recorded in ``skipped``."""
    import torch

    def keep(module: Any, name: str) -> bool:
        if not isinstance(module, torch.nn.Linear) or name.endswith("lm_head"):
            return False
        if fmt == "int4" and module.in_features % INT4_GROUP:
            skipped.append(name)
            return False
        return True

    return keep


def torchao_rows(run: Run, fmt: str) -> None:
    """torchao QAT: ``quantize_(model, QATConfig(base, step="prepare"))`` (fake quantization, the "ptq"
    row), a plain ``transformers.Trainer`` (torchao has no trainer: QAT is a model transform, the loop is
    the user's; this one is the loop of our ``ft`` control), then ``step="convert"`` (the real quantized
    model, measured too where it runs on CPU). torchao has no QAD.

    FP8 trains almost nothing but the unquantized parameters, by torchao's doing, not this loop's (measured on
    bench-dense): ``_dequantize_affine_float8``'s ``.to(float32)`` casts the incoming gradient back to
    ``float8_e4m3fn`` in backward, and ``_RoundToFloat8``'s straight-through estimator passes that rounded
    gradient on, so ``grad * scale`` (scale = amax / 448) below e4m3's smallest step (2**-9) is zero: after
    3 AdamW steps 46 of the 724,992 entries of the quantized linears had changed (those reached through
    their per-tensor amax), against all of the unquantized ``lm_head``."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig
    from transformers import Trainer

    skipped: list[str] = []
    model = copy.deepcopy(run.base)
    quantize_(model, QATConfig(_torchao_config(fmt), step="prepare"), filter_fn=_torchao_filter(fmt, skipped))
    quantized = sum(
        type(m).__name__.startswith(("FakeQuantized", "NVFP4FakeQuantized")) for m in model.modules()
    )
    info = {"quantized_linears": quantized, "skipped": skipped}
    run.add(f"torchao ptq {fmt}", "ptq", fmt, model, **info)
    model.train()
    trained, stats = run.train(lambda args: Trainer(model=model, args=args, train_dataset=run.train_set))
    run.add(f"torchao qat {fmt}", "qat", fmt, trained, **stats, **info)

    def convert() -> None:
        quantize_(
            trained, QATConfig(_torchao_config(fmt), step="convert"), filter_fn=_torchao_filter(fmt, [])
        )
        run.add(f"torchao qat {fmt} converted", "converted", fmt, trained.eval())

    run.guarded(f"torchao convert {fmt}", convert)


# --------------------------------------------------------------------------------------------- modelopt


def _modelopt_counts(model: Any) -> dict[str, Any]:
    """Enabled weight / input quantizers, and the modules whose weights are quantized (fused MoE experts
    carry one weight quantizer per expert: ``experts.gate_up_proj_weight_quantizers.3``)."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    names = [n for n, m in model.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled]
    weight = re.compile(r"[._]weight_quantizers?(\.\d+)?$")
    weights = [n for n in names if weight.search(n)]
    return {
        "weight_quantizers": len(weights),
        "input_quantizers": sum(bool(re.search(r"[._]input_quantizer$", n)) for n in names),
        "quantized_modules": sorted({weight.sub("", n) for n in weights}),
    }


def modelopt_rows(run: Run, fmt: str) -> None:
    """nvidia-modelopt: ``mtq.quantize`` with the preset, calibrated on the shared calibration batches (the
    "ptq" row), then ``QATTrainer`` (cross-entropy) and ``QADTrainer`` (KL to the unquantized teacher at
    ``temperature``, no CE), each from a copy of the PTQ model (the trainers see it is quantized and skip
    their own calibration, as ours do)."""
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.quantization.plugins.transformers_trainer import QADTrainer, QATTrainer

    model = copy.deepcopy(run.base)

    def forward_loop(m: Any) -> None:
        for batch in run.calib:
            m(input_ids=batch)

    with torch.no_grad():
        mtq.quantize(model, copy.deepcopy(getattr(mtq, MODELOPT_PRESETS[fmt])), forward_loop)
    counts = _modelopt_counts(model)
    run.add(f"modelopt ptq {fmt}", "ptq", fmt, model, **counts)
    common = {"train_dataset": run.train_set}
    qat, stats = run.train(lambda args: QATTrainer(model=copy.deepcopy(model), args=args, **common))
    run.add(f"modelopt qat {fmt}", "qat", fmt, qat, **stats)
    teacher = copy.deepcopy(run.base)
    distill = {"teacher_model": teacher, "temperature": run.spec["temperature"]}
    qad, stats = run.train(
        lambda args: QADTrainer(model=copy.deepcopy(model), args=args, distill_args=distill, **common)
    )
    run.add(f"modelopt qad {fmt}", "qad", fmt, qad, **stats)


def modelopt_auto_quantize_rows(run: Run, _fmt: str) -> None:
    """nvidia-modelopt's ``mtq.auto_quantize`` for ``benchmarks/auto_quantize.py --reference-python``, with
    the spec's ``auto_quantize`` settings (``formats``, ``method``, ``search_bits``, ``budgets``,
    ``score_steps``, ``disabled_layers``, ``repeats``): ``repeats`` searches on the calibration batches
    (``input_ids`` and ``labels``, the loss the model's own), each timed; then per budget the assignment
    solved again from the search state (``get_auto_quantize_config``) and quantized on a fresh copy of the
    model with ``mtq.quantize`` on the same batches, as our rows are."""
    import modelopt.torch.quantization as mtq
    import torch

    aq = run.spec["auto_quantize"]
    data = [{"input_ids": b, "labels": b} for b in run.calib]
    gradient = aq["method"] == "gradient"
    times = []
    for _ in range(aq["repeats"]):  # a fresh copy each time; the last search's state is kept
        start = time.perf_counter()
        _, state = mtq.auto_quantize(
            copy.deepcopy(run.base), {"effective_bits": aq["search_bits"]}, list(aq["formats"]), data,
            (lambda m, b: m(**b)) if gradient else (lambda m, b: m(input_ids=b["input_ids"]).logits),
            (lambda out, b: out.loss) if gradient else None,
            num_calib_steps=len(data), num_score_steps=aq["score_steps"], method=aq["method"],
            disabled_layers=aq["disabled_layers"] or None,
        )  # fmt: skip
        times.append(time.perf_counter() - start)
    run.rows.append({"name": f"modelopt search {aq['method']}", "times": times})

    def forward_loop(m: Any) -> None:
        with torch.no_grad():
            for batch in run.calib:
                m(input_ids=batch)

    for bits in aq["budgets"]:
        config = mtq.get_auto_quantize_config(state, {"effective_bits": bits})
        model = mtq.quantize(copy.deepcopy(run.base), config, forward_loop)
        run.add(f"modelopt {aq['method']}", "auto_quantize", "", model, bits=bits)


def modelopt_moe_step(spec: dict[str, Any]) -> dict[str, Any]:
    """nvidia-modelopt's quantized QAT step for ``benchmarks/moe.py --reference-python``: the spec's
    ``model_dir`` (our benchmark Qwen3-MoE, saved with ``save_pretrained``) loaded in fp32, ``mtq.quantize``
    with the spec's ``preset`` (``FP8_DEFAULT_CFG``: its fake quant runs on CPU) calibrated on the ``calib``
    batches of the ``data`` safetensors file (the reference forces fused experts to transformers' ``eager``
    implementation and quantizes per expert), ``train()``, AdamW(lr ``lr``), then one warm-up and ``repeats``
    timed steps of ``loss = model(ids, labels=ids).loss; loss.backward(); opt.step(); opt.zero_grad()`` on
    ``data["step"]``: wall-clock and CPU seconds per step, the load of other processes (as our children)."""
    import modelopt.torch.quantization as mtq
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    data = load_file(spec["data"])
    calib, ids = list(data["calib"].unbind(0)), data["step"]
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()

    def forward_loop(m: Any) -> None:
        for batch in calib:
            m(input_ids=batch)

    with torch.no_grad():
        mtq.quantize(model, copy.deepcopy(getattr(mtq, spec["preset"])), forward_loop)
    counts = _modelopt_counts(model)
    per_expert = re.compile(r"\.experts\.\w+_weight_quantizers\.\d+$")  # one per expert and projection
    names = [n for n, m in model.named_modules() if per_expert.search(n) and getattr(m, "is_enabled", False)]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    times: list[float] = []
    cpu_s: list[float] = []
    loads: list[float] = []
    loss = None
    for i in range(spec["repeats"] + 1):
        seconds, others, cpu, loss = h.timed_train_step(model, opt, ids)
        if i:  # step 0 is the warm-up
            times.append(seconds)
            cpu_s.append(cpu)
            loads.append(others)
        h.log(f"  reference step {i}: {seconds:.3f} s")
    return {
        "times": times,
        "cpu_s": cpu_s,
        "other_cores_busy": statistics.median(loads) if loads else 0.0,
        "impl": getattr(model.config, "_experts_implementation", None),
        "experts_type": type(model.model.layers[0].mlp.experts).__name__,
        "loss": loss,
        "weight_quantizers": counts["weight_quantizers"],
        "input_quantizers": counts["input_quantizers"],
        "expert_weight_quantizers": len(names),
        "quantized_experts": sorted({n[: n.index(".experts.") + len(".experts")] for n in names}),
    }


PEERS = {
    "torchao": torchao_rows,
    "modelopt": modelopt_rows,
    "modelopt_auto_quantize": modelopt_auto_quantize_rows,
}
#: peers measuring something else than rows on the shared data: ``work(spec)`` returns their result
STANDALONE = {"modelopt_moe_step": modelopt_moe_step}


def versions(peer: str) -> dict[str, str]:
    import torch
    import transformers

    lib = __import__("torchao" if peer == "torchao" else "modelopt")
    return {"torch": torch.__version__, "transformers": transformers.__version__, peer: lib.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", choices=sorted([*PEERS, *STANDALONE]), required=True)
    p.add_argument("--spec", required=True)
    a = p.parse_args(argv)

    def work() -> dict[str, Any]:
        with open(a.spec) as f:
            spec = json.load(f)
        if a.peer in STANDALONE:
            return {"peer": a.peer, "versions": versions(a.peer), **STANDALONE[a.peer](spec)}
        run = Run(spec)
        for fmt in spec["formats"]:
            h.log(f"{a.peer} {fmt}")
            run.guarded(f"{a.peer} {fmt}", lambda fmt=fmt: PEERS[a.peer](run, fmt))
        return {"peer": a.peer, "versions": versions(a.peer), "rows": run.rows, "errors": run.errors}

    h.run_and_emit(work, limit=400)
    return 0


if __name__ == "__main__":
    sys.exit(main())
