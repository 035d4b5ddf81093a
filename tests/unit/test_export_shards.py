"""The streaming shard writer: tensors are saved as they come, one shard in memory at a time."""

import json

import pytest
import torch
from safetensors import safe_open

from modelopt_lite.export import export_hf_checkpoint
from modelopt_lite.export.shards import ShardWriter

from ._export_cases import quantized, tensors


def test_shards_fill_in_order_and_never_hold_more_than_the_limit(tmp_path):
    writer = ShardWriter(tmp_path, max_bytes=100)
    writer.add({"a": torch.zeros(10), "b": torch.zeros(10)})  # 40 + 40 bytes
    writer.add({"c": torch.zeros(10)})  # would make 120: starts the second shard
    writer.add({"big": torch.zeros(40)})  # 160 bytes: a shard of its own
    writer.add({"d": torch.ones(2, dtype=torch.float64)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"part-0000{i}.safetensors" for i in (1, 2, 3)]
    files = writer.close()
    names = [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    assert files == [*names, "model.safetensors.index.json"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "a": files[0], "b": files[0], "c": files[1], "big": files[2], "d": files[3]
    }  # fmt: skip
    assert index["metadata"]["total_size"] == 40 * 3 + 160 + 16
    assert writer.peak_bytes == 160  # the oversized tensor; otherwise at most the limit
    with safe_open(str(tmp_path / files[3]), "pt") as f:
        assert torch.equal(f.get_tensor("d"), torch.ones(2, dtype=torch.float64))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)  # no provisional name left


def test_one_shard_is_model_safetensors_and_a_key_is_written_once(tmp_path):
    writer = ShardWriter(tmp_path, max_bytes=10**6)
    writer.add({"a": torch.zeros(3)})
    with pytest.raises(RuntimeError, match="the tensor a was written twice"):
        writer.add({"a": torch.zeros(3)})
    assert writer.close() == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_streamed_export_matches_the_limit_and_is_independent_of_it(tmp_path):
    model = quantized("qwen3_moe", "NVFP4_DEFAULT_CFG", kv="FP8_KV_CFG")
    export_hf_checkpoint(model, tmp_path / "small", max_shard_size="16KB")
    export_hf_checkpoint(model, tmp_path / "one", max_shard_size="1GB")
    index = json.loads((tmp_path / "small" / "model.safetensors.index.json").read_text())
    for name in set(index["weight_map"].values()):
        with safe_open(str(tmp_path / "small" / name), "pt") as f:
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()]
        assert sum(sizes) <= 16_000 or len(sizes) == 1, (name, sizes)
    small, one = tensors(tmp_path / "small"), tensors(tmp_path / "one")
    assert small.keys() == one.keys()
    assert all(
        torch.equal(small[k].reshape(-1).view(torch.uint8), one[k].reshape(-1).view(torch.uint8))
        for k in small
    )
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
