"""The measurement of ``benchmarks/real_ptq.py`` and its peers' PTQ rows, run under the peer's interpreter.

    PEER_PYTHON benchmarks/_real_ptq_peer.py --peer {modelopt,torchao} --spec SPEC.json

``SPEC.json`` (written by ``real_ptq.py``): ``model_dir`` (a Hugging Face checkpoint folder), ``data`` (a
safetensors file: ``calib`` and ``test`` token windows), ``ref_dir`` (the unquantized model's next-token
log-probabilities on ``test``, one safetensors file per evaluation batch: :func:`write_reference`),
``eval_batch``, ``calib_batch``, ``threads`` and ``rows``: for ``modelopt`` ``{"name", "preset", "kv"}``
(preset names of ``modelopt.torch.quantization``; ``kv`` a KV-cache preset or null) and ``export_root`` (each
row is exported to ``export_root/<name>`` for its size, then removed; null: no export); for ``torchao``
``{"name", "config"}`` (a key of :data:`TORCHAO_CONFIGS`).

Imports torch, safetensors, transformers, the peer library and ``_harness`` (nothing of ``modelopt_lite``):
every library's model is measured by :func:`measure` here, on the same windows against the same stored
reference.
Each row is printed when done as one ``@@ROW <json>`` line (a row that raised carries its ``error``), so
that a parent that stops a slow worker keeps the rows it finished; the last line is ``@@RESULT`` with the
versions.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _harness as h

ROW_PREFIX = "@@ROW "


# ------------------------------------------------------------------------------------------ measurement


def _logprobs(model: Any, batch: Any) -> Any:
    return model(input_ids=batch).logits[:, :-1].float().log_softmax(-1)


def write_reference(model: Any, windows: Any, ref_dir: str | os.PathLike[str], batch_size: int) -> None:
    """The unquantized model's next-token log-probabilities on ``windows``, batch by batch, each batch in
    its own ``ref_dir/b{i}.safetensors`` (so that no process holds more than one batch of them)."""
    import torch
    from safetensors.torch import save_file

    Path(ref_dir).mkdir(parents=True, exist_ok=True)
    model.eval()
    with torch.no_grad():
        for i, batch in enumerate(windows.split(batch_size)):
            save_file(
                {"logprobs": _logprobs(model, batch).contiguous()}, str(Path(ref_dir) / f"b{i}.safetensors")
            )


def measure(model: Any, windows: Any, ref_dir: str | os.PathLike[str], batch_size: int) -> dict[str, float]:
    """One pass of ``model`` over ``windows`` (``(count, window)`` ids, batches of ``batch_size``: the batches
    of :func:`write_reference`, or the first windows of its first batch): perplexity by
    ``modelopt_lite.evaluation``'s protocol (a window's first token is context only), mean
    ``KL(unquantized || model)`` in nats per predicted token and top-1 agreement with the unquantized
    model's argmax. Holds one batch of each log-probability tensor, and works through it a window at a
    time."""
    import torch
    from safetensors.torch import load_file

    was_training = model.training
    model.eval()
    nll = kl = 0.0
    agree = count = 0
    batch_nll: list[float] = []
    batch_tokens: list[int] = []
    with torch.no_grad():
        for i, batch in enumerate(windows.split(batch_size)):
            before = nll
            lp = _logprobs(model, batch)
            ref = load_file(str(Path(ref_dir) / f"b{i}.safetensors"))["logprobs"][: len(batch)]
            if ref.shape != lp.shape:
                raise ValueError(
                    f"reference batch {i} has shape {tuple(ref.shape)}, the model {tuple(lp.shape)}"
                )
            targets = batch[:, 1:]
            for row in range(batch.shape[0]):
                r, q = ref[row], lp[row]
                nll -= float(q.gather(-1, targets[row, :, None]).sum())
                kl += float((r.exp() * (r - q)).sum())
                agree += int((r.argmax(-1) == q.argmax(-1)).sum())
            count += targets.numel()
            batch_nll.append(nll - before)
            batch_tokens.append(targets.numel())
            del lp, ref
    model.train(was_training)
    return {"ppl": math.exp(nll / count), "kl": kl / count, "top1": agree / count, "tokens": count,
            "batch_nll": batch_nll, "batch_tokens": batch_tokens}  # fmt: skip


def _digest(model: Any) -> list[tuple[str, float]]:
    """Every state-dict entry's name and sum: tells whether an in-place transform changed the model."""
    return [(k, float(v.double().sum())) for k, v in model.state_dict().items() if v.is_floating_point()]


class Shared:
    """What every row of a worker shares: the spec, the calibration batches and the evaluation windows. Each
    row reads its own float32 copy of the unquantized model from the checkpoint (``fresh_model``): one model
    in the process at a time (at 1.5B a kept copy plus a row's copy and AWQ's buffers outgrew 24 GB)."""

    def __init__(self, spec: dict[str, Any]):
        import torch
        from safetensors.torch import load_file

        torch.set_num_threads(spec["threads"])
        torch.manual_seed(spec.get("seed", 0))
        self.spec = spec
        data = load_file(spec["data"])
        self.calib = list(data["calib"].split(spec["calib_batch"]))
        self.test = data.get("test")  # none in a task-accuracy spec (_task_accuracy_peer.py)

    def fresh_model(self) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.spec["model_dir"], dtype=torch.float32).eval()

    def measure(self, model: Any) -> dict[str, float]:
        return measure(model, self.test, self.spec["ref_dir"], self.spec["eval_batch"])

    def forward_loop(self, model: Any) -> None:
        import torch

        with torch.no_grad():
            for batch in self.calib:
                model(input_ids=batch)


def guarded_row(row: dict[str, Any], work: Any) -> None:
    """``work(row)`` fills ``row``; an exception becomes ``row["error"]``; the row is emitted either way."""
    start = time.perf_counter()
    try:
        work(row)
    except Exception as err:  # a peer's failure is a result of this benchmark
        row["error"] = h.error_text(err, 400)
        row["traceback"] = traceback.format_exc()[-3000:]
        h.log(f"  {row['name']}: {row['error']}")
    row["seconds"] = time.perf_counter() - start
    h.emit_result(row, ROW_PREFIX)


# --------------------------------------------------------------------------------------------- modelopt


def modelopt_quantize(shared: Shared, spec_row: dict[str, Any], row: dict[str, Any]) -> Any:
    """A fresh model quantized by nvidia-modelopt with the row's preset (and KV preset, appended as its
    ``hf_ptq`` does with ``update_quant_cfg_with_kv_cache_quant``), calibrated on the shared batches;
    ``row["calib_s"]`` is set."""
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.quantization.utils import update_quant_cfg_with_kv_cache_quant

    cfg = copy.deepcopy(getattr(mtq, spec_row["preset"]))
    if spec_row.get("kv"):
        cfg = update_quant_cfg_with_kv_cache_quant(cfg, getattr(mtq, spec_row["kv"])["quant_cfg"])
    model = shared.fresh_model()
    start = time.perf_counter()
    with torch.no_grad():
        mtq.quantize(model, cfg, shared.forward_loop)
    row["calib_s"] = time.perf_counter() - start
    return model


def modelopt_as_shipped(model: Any) -> bool:
    """What nvidia-modelopt's ``export_hf_checkpoint`` does to the model in place before writing
    (``requantize_resmooth_fused_llm_layers``); whether that changed it."""
    import torch
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    before = _digest(model)
    with torch.no_grad():
        requantize_resmooth_fused_llm_layers(model)
    return _digest(model) != before


def modelopt_rows(shared: Shared) -> None:
    """nvidia-modelopt: each row quantized by :func:`modelopt_quantize` and measured fake-quantized; then
    measured again after :func:`modelopt_as_shipped` (q/k/v and gate/up get one averaged AWQ / SmoothQuant
    ``pre_quant_scale``, folded into the norm, and one input amax / NVFP4 global amax) where that changed
    the model: the model it ships, activation quantization included; then exported (``export_root``) for
    its size, or its error."""
    import torch
    from modelopt.torch.export import export_hf_checkpoint

    for spec_row in shared.spec["rows"]:
        row: dict[str, Any] = {"library": "modelopt", **spec_row}

        def work(row: dict[str, Any], spec_row: dict[str, Any] = spec_row) -> None:
            model = modelopt_quantize(shared, spec_row, row)
            row.update(shared.measure(model))
            h.log(f"  {row['name']:<22} ppl {row['ppl']:.4f}  KL {row['kl']:.4e}  top1 {row['top1']:.4f}")
            try:  # what its export does to the model first, in place: the model it ships
                if not modelopt_as_shipped(model):
                    row["exported"] = {"same_as_fake_quant": True, "ppl": row["ppl"], "kl": row["kl"],
                                       "top1": row["top1"]}  # fmt: skip
                else:
                    row["exported"] = shared.measure(model)
                    h.log(f"  {row['name']:<22} as exported: ppl {row['exported']['ppl']:.4f}")
            except Exception as err:  # recorded; the fake-quant row stands
                row["exported"] = {"error": h.error_text(err, 400)}
            root = shared.spec.get("export_root")
            if root:
                out = Path(root) / row["name"]
                try:
                    with torch.no_grad():
                        export_hf_checkpoint(model, export_dir=str(out))
                    row["export_mb"] = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6
                except Exception as err:  # recorded; the fake-quant row stands
                    row["export_error"] = h.error_text(err, 400)
                    h.log(f"  {row['name']} export: {row['export_error']}")
                shutil.rmtree(out, ignore_errors=True)
            del model

        guarded_row(row, work)


# ---------------------------------------------------------------------------------------------- torchao


def _torchao_config(name: str) -> Any:
    import torch
    import torchao.quantization as q

    if name == "int8_wo":
        return q.Int8WeightOnlyConfig()
    if name == "int8_dyn":
        return q.Int8DynamicActivationInt8WeightConfig()
    if name == "int4_wo_g128":
        return q.Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
    if name in ("intx4_wo_g128", "intx4_wo_g64"):  # torchao needs whole groups: 576 = 4.5 x 128 = 9 x 64
        from torchao.quantization.granularity import PerGroup

        return q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(int(name[10:])))
    if name == "fp8_wo":
        return q.Float8WeightOnlyConfig()
    if name == "fp8_dyn":
        return q.Float8DynamicActivationFloat8WeightConfig()
    if name == "fp8_dyn_row":
        from torchao.quantization.granularity import PerRow

        return q.Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    import torchao.prototype.mx_formats as mx

    if name in ("mxfp8", "mxfp4"):
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        dt = torch.float8_e4m3fn if name == "mxfp8" else torch.float4_e2m1fn_x2
        return mx.MXDynamicActivationMXWeightConfig(
            activation_dtype=dt, weight_dtype=dt, kernel_preference=KernelPreference.EMULATED
        )
    if name == "nvfp4":
        return mx.NVFP4DynamicActivationNVFP4WeightConfig(use_triton_kernel=False)
    if name == "nvfp4_wo":
        return mx.NVFP4WeightOnlyConfig()
    raise ValueError(f"unknown torchao row {name!r}; known: {list(TORCHAO_CONFIGS)}")


#: torchao rows: name -> what it is (the config is built by :func:`_torchao_config`)
TORCHAO_CONFIGS = {
    "int8_wo": "Int8WeightOnlyConfig()",
    "int8_dyn": "Int8DynamicActivationInt8WeightConfig() (per-row weights, per-token dynamic activations)",
    "int4_wo_g128": "Int4WeightOnlyConfig(group_size=128, int4_packing_format='tile_packed_to_4d'), bf16",
    "intx4_wo_g128": "IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(128))",
    "intx4_wo_g64": "IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(64))",
    "fp8_wo": "Float8WeightOnlyConfig()",
    "fp8_dyn": "Float8DynamicActivationFloat8WeightConfig() (per-tensor)",
    "fp8_dyn_row": "Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())",
    "mxfp8": "MXDynamicActivationMXWeightConfig(e4m3, kernel_preference=EMULATED), bf16 model",
    "mxfp4": "MXDynamicActivationMXWeightConfig(e2m1, kernel_preference=EMULATED), bf16 model",
    "nvfp4": "NVFP4DynamicActivationNVFP4WeightConfig(use_triton_kernel=False)",
    "nvfp4_wo": "NVFP4WeightOnlyConfig()",
}
#: rows whose torchao kernels take bfloat16 only: the model is cast to bfloat16 first
TORCHAO_BF16 = ("int4_wo_g128", "mxfp8", "mxfp4")


def torchao_rows(shared: Shared) -> None:
    """torchao PTQ: ``quantize_(model, config, filter_fn=every nn.Linear but lm_head)`` (no calibration: its
    weight scales come from the weights, activation scales per token at run time); measured as quantized.
    The rows of :data:`TORCHAO_BF16` quantize a bfloat16 copy (their kernels take nothing else): their
    figures include the bfloat16 rounding of the rest of the model."""
    import torch
    from torchao.quantization import quantize_

    def keep(module: Any, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")

    for spec_row in shared.spec["rows"]:
        row: dict[str, Any] = {
            "library": "torchao",
            **spec_row,
            "desc": TORCHAO_CONFIGS.get(spec_row["config"]),
        }

        def work(row: dict[str, Any], spec_row: dict[str, Any] = spec_row) -> None:
            model = shared.fresh_model()
            if spec_row["config"] in TORCHAO_BF16:
                model = model.to(torch.bfloat16)
            start = time.perf_counter()
            quantize_(model, _torchao_config(spec_row["config"]), filter_fn=keep)
            row["calib_s"] = time.perf_counter() - start
            row["quantized_linears"] = sum(
                type(m.weight).__name__ != "Parameter"
                for m in model.modules()
                if isinstance(m, torch.nn.Linear)
            )
            row.update(shared.measure(model))
            h.log(f"  {row['name']:<22} ppl {row['ppl']:.4f}  KL {row['kl']:.4e}  top1 {row['top1']:.4f}")

        guarded_row(row, work)


# ------------------------------------------------------------------------------------- the parent's side


def run_worker(script: str, python: str, spec: dict[str, Any], work: Path, name: str, *, threads: int,
               timeout: float | None, args: Sequence[str] = ()) -> dict:  # fmt: skip
    """Run ``python script --spec work/<name>_spec.json *args`` (a worker of this protocol; its stderr in
    ``work/<name>.log``): its ``@@ROW`` rows (kept when it is stopped after ``timeout`` s) and result."""
    spec_path = work / f"{name}_spec.json"
    spec_path.write_text(json.dumps(spec))
    env = h.child_env(threads, str(Path(__file__).parent), keep_pythonpath=False)
    cmd = [python, script, *args, "--spec", str(spec_path)]
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            stdout, _ = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
            timed_out = True
    rows, results = h.parse_results(stdout, ROW_PREFIX), h.parse_results(stdout)
    result = results[-1] if results else {"error": f"worker exited {proc.returncode} without a result"}
    if timed_out:
        result["error"] = f"stopped after {timeout:.0f} s"
    for r in rows:
        r.pop("traceback", None)
    return {**result, "rows": rows, "log": h.portable_arg(str(work / f"{name}.log"))}


PEERS = {"modelopt": modelopt_rows, "torchao": torchao_rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", choices=sorted(PEERS), required=True)
    p.add_argument("--spec", required=True)
    a = p.parse_args(argv)
    return worker_main(a.spec, a.peer, [a.peer], PEERS[a.peer])


def worker_main(spec_path: str, peer: str, libs: Sequence[str], rows: Callable[[Shared], None]) -> int:
    """A worker's body: read the spec, record the versions of torch, transformers and ``libs`` (modules),
    run ``rows(Shared(spec))``; the last line is ``@@RESULT`` (with the error, if one was raised)."""
    result: dict[str, Any] = {"peer": peer}
    try:
        with open(spec_path) as f:
            spec = json.load(f)
        result["versions"] = {name: __import__(name).__version__ for name in ["torch", "transformers", *libs]}
        rows(Shared(spec))
        result["peak_rss_mb"] = h.peak_rss_mb()
    except Exception as err:
        result["error"] = h.error_text(err, 400)
        result["traceback"] = traceback.format_exc()[-3000:]
    h.emit_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
