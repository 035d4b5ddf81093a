"""Run by ``torchrun --nproc_per_node 2`` from test_distributed_export.py: export from an FSDP2-sharded model
(quantizers inserted before sharding, each rank calibrating on its half of the batches), results per rank
as JSON in the output directory.

Scenarios (``<scenario> <kind> <outdir>``):

* ``export <model>-<format>``: ``export_hf_checkpoint`` into ``<outdir>/export`` on every rank; then again
  into the same (now non-empty) directory, which must fail on every rank without hanging;
* ``lost_export -``: rank 1 dies in the middle of the export (the survivor must name the export);
* ``memory <layers>``: peak resident memory of the export of an NVFP4 + FP8-KV Llama (hidden 512, 8 layers by
  default): the rise of VmHWM over VmRSS just before the export (the peak mark reset through
  ``/proc/self/clear_refs``). Run with ``MALLOC_MMAP_THRESHOLD_=131072`` so freed tensors leave the heap.
"""

import gc
import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint
from tests.unit._dist_worker import CONFIG, MODELS, batches, shard
from tests.unit._dist_worker import main as run_worker
from tests.unit._models import tiny_llama

#: awq: NVFP4 AWQ-lite (coarse search), so that the export folds pre_quant_scale into sharded norms (through
#: windows); search algorithms run before fully_shard (calibrate refuses them on a sharded model), on all data
AWQ = {**mtq.NVFP4_AWQ_LITE_CFG, "algorithm": {"method": "awq_lite", "alpha_step": 0.5}}
CONFIGS = {"nvfp4": CONFIG, "fp8": mtq.FP8_DEFAULT_CFG, "awq": AWQ}
SHARD_SIZE = "40KB"  # several output shards even for the tiny models
MEMORY_HIDDEN = 512
MEMORY_SHARD_SIZE = 4 * 2**20


def quantize_and_shard(model, config, rank: int):
    if config is AWQ:
        mtq.quantize(model, config, batches())
        shard(model)
        return model
    mtq.quantize(model, config, skip_calibration=True)  # quantizers before sharding
    shard(model)
    mtq.calibrate(model, "max", batches()[rank::2])  # this rank's half of the data
    return model


def _outcome(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError, OSError) as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


def export_sharded(kind: str, out: Path, rank: int) -> None:
    model_kind, fmt = kind.split("-")
    model = quantize_and_shard(MODELS[model_kind](), CONFIGS[fmt], rank)
    result = export_hf_checkpoint(model, out / "export", max_shard_size=SHARD_SIZE)
    again = _outcome(lambda: export_hf_checkpoint(model, out / "export", max_shard_size=SHARD_SIZE))
    outcome = {
        "files": result.files,
        "quantized_layers": result.quantized_layers,
        "total_bytes": result.total_bytes,
        "hf_quant_config": result.hf_quant_config,
        "ratios": result.ratios,
        "after": type(model.model.layers[0].self_attn.q_proj.weight).__name__,  # shards put back
        "again": again,
    }
    (out / f"result_{rank}.json").write_text(json.dumps(outcome))


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def memory(kind: str, out: Path, rank: int) -> None:
    layers = int(kind)
    model = quantize_and_shard(tiny_llama(layers=layers, hidden=MEMORY_HIDDEN), CONFIG, rank)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())  # full shape
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # root: gathered
    local_bytes = sum(p.numel() * p.element_size() for p in local)
    gc.collect()
    dist.barrier()
    reset = _reset_peak()
    before = _status_mb("VmRSS") if reset else _status_mb("VmHWM")
    export_hf_checkpoint(model, out / "export", max_shard_size=MEMORY_SHARD_SIZE)
    peak = _status_mb("VmHWM")
    result = {
        "reset": reset,
        "rise_mb": peak - before,
        "before_mb": before,
        "peak_mb": peak,
        "layer_mb": layer_bytes / 2**20,
        "model_mb": model_bytes / 2**20,
        "local_mb": local_bytes / 2**20,
        "shard_limit_mb": MEMORY_SHARD_SIZE / 2**20,
    }
    (out / f"memory_{rank}.json").write_text(json.dumps(result))


def lost_export(kind: str, out: Path, rank: int) -> None:
    """Rank 1 SIGKILLs itself (after writing the time to ``died``) in the export of an FSDP2-sharded NVFP4
    Llama, while it packs its third layer; rank 0's error is the test's to read."""
    import os
    import signal
    import time

    from modelopt_lite.export import writer

    model = quantize_and_shard(MODELS["llama"](), CONFIGS["nvfp4"], rank)
    if rank == 1:  # (test code: a hook into the export's per-layer step, to die at a known moment)
        real, calls = writer._layer_tensors, []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                (out / "died").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        writer._layer_tensors = dying
    export_hf_checkpoint(model, out / "export", max_shard_size=SHARD_SIZE)


SCENARIOS = {"export": export_sharded, "memory": memory, "lost_export": lost_export}


if __name__ == "__main__":
    run_worker(SCENARIOS)
