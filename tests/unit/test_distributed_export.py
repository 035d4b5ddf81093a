"""Multi-process (gloo, 2 ranks, torchrun) export of FSDP2-sharded models: the checkpoint equals the one
exported from a single process byte for byte, every rank returns the same result, a failure on one rank
fails all of them, and the peak memory of the export per rank stays near one layer plus one output shard.

Select with ``-m distributed``; each test runs
``torchrun --nproc_per_node 2 tests/unit/_dist_export_worker.py``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint, read_checkpoint

from ._dist_export_worker import CONFIGS, MEMORY_SHARD_SIZE, SHARD_SIZE
from ._dist_worker import MODELS, batches

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("_dist_export_worker.py")


def _torchrun(scenario: str, kind: str, out: Path, **env_vars: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env_vars}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*cmd, str(WORKER), scenario, kind, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        raise AssertionError(
            f"torchrun {scenario} {kind} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )


@pytest.mark.parametrize("kind", ["llama-nvfp4", "moe-nvfp4", "llama-fp8", "moe-fp8", "llama-awq"])
def test_sharded_export_equals_single_process_export_byte_for_byte(tmp_path, kind):
    _torchrun("export", kind, tmp_path)
    model_kind, fmt = kind.split("-")
    model = mtq.quantize(MODELS[model_kind](), CONFIGS[fmt], batches())  # all the batches in one process
    expected = export_hf_checkpoint(model, tmp_path / "single", max_shard_size=SHARD_SIZE)
    sharded = tmp_path / "export"
    files = sorted(p.name for p in sharded.iterdir())
    assert files == expected.files
    assert "model.safetensors.index.json" in files  # streamed into several shards
    if model_kind == "moe":
        assert any(".mlp.experts.3.down_proj" in name for name in expected.quantized_layers)
    if fmt == "awq":  # the norms absorbed pre_quant_scale (gathered through windows on the sharded side)
        assert expected.hf_quant_config["quantization"]["quant_algo"] == "NVFP4_AWQ"
        assert not any(k.endswith("q_proj.pre_quant_scale") for k in read_checkpoint(tmp_path / "single"))
    different = [f for f in files if (sharded / f).read_bytes() != (tmp_path / "single" / f).read_bytes()]
    assert not different, different
    for rank in (0, 1):  # every rank returns the same result, and its shards are back after the export
        result = json.loads((tmp_path / f"result_{rank}.json").read_text())
        assert result["files"] == expected.files
        assert result["quantized_layers"] == expected.quantized_layers
        assert result["hf_quant_config"] == expected.hf_quant_config
        assert result["total_bytes"] == expected.total_bytes
        assert result["ratios"] == expected.ratios
        assert result["after"] == "DTensor"
    # exporting again into the now non-empty directory: rank 0 refuses, rank 1 learns it instead of hanging
    again = [json.loads((tmp_path / f"result_{r}.json").read_text())["again"] for r in (0, 1)]
    assert again[0].startswith("FileExistsError: export_dir"), again
    assert again[1].startswith("RankFailedError: export_hf_checkpoint: preparing the directory: rank(s) [0]")
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # nothing half-written


def test_peak_memory_per_rank_is_one_layer_plus_one_shard(tmp_path):
    """The export of an 8-layer Llama (hidden 512, fp32: about 9 MiB a layer, 72 MiB in all) raises each
    rank's peak resident memory by less than one layer plus one output shard plus allocator slack, far
    below what gathering the whole model would take."""
    _torchrun("memory", "8", tmp_path, MALLOC_MMAP_THRESHOLD_="131072")
    slack_mb = 8.0
    for rank in (0, 1):
        m = json.loads((tmp_path / f"memory_{rank}.json").read_text())
        shard_mb = MEMORY_SHARD_SIZE / 2**20 if rank == 0 else 0.0  # only rank 0 collects output shards
        bound = m["layer_mb"] + shard_mb + slack_mb
        print(
            f"rank {rank}: export raised peak RSS by {m['rise_mb']:.1f} MiB (bound {bound:.1f}: layer "
            f"{m['layer_mb']:.1f} + output shard {shard_mb:.1f} + slack {slack_mb}); model "
            f"{m['model_mb']:.1f} MiB, this rank's shard {m['local_mb']:.1f} MiB, peak reset: {m['reset']}"
        )
        assert m["model_mb"] > 6 * m["layer_mb"]  # the bound separates one layer from the whole model
        assert m["rise_mb"] < bound, m
