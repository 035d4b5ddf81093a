"""Bad input to the export and the loader, post-export verification, sharding and the atomic write."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import modelopt_lite.quantization as mtq
from modelopt_lite.export import (
    ExportVerificationError,
    UnsupportedFormatError,
    export_hf_checkpoint,
    load_hf_checkpoint,
    parse_size,
    verify_export,
)

from ._export_cases import quantized, tensors
from ._models import batches, tiny_llama


@pytest.fixture(scope="module")
def nvfp4_llama():
    return quantized("llama", "NVFP4_DEFAULT_CFG")


def test_unquantized_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"not quantized .*mtq\.quantize"):
        export_hf_checkpoint(tiny_llama(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_model_with_every_quantizer_disabled_is_refused(tmp_path):
    model = quantized("llama", "FP8_DEFAULT_CFG")
    mtq.disable_quantizer(model, "*")
    with pytest.raises(ValueError, match="no enabled weight quantizer"):
        export_hf_checkpoint(model, tmp_path / "out")


def test_non_empty_directory_needs_overwrite(tmp_path, nvfp4_llama):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf_checkpoint(nvfp4_llama, target)
    assert (target / "old.txt").read_text() == "keep me"
    export_hf_checkpoint(nvfp4_llama, target, overwrite=True)
    assert not (target / "old.txt").exists()
    assert (target / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directory left


def test_empty_existing_directory_is_used(tmp_path, nvfp4_llama):
    (tmp_path / "out").mkdir()
    export_hf_checkpoint(nvfp4_llama, tmp_path / "out")
    assert (tmp_path / "out" / "hf_quant_config.json").is_file()


def test_unsupported_weight_format_names_layer_and_format(tmp_path):
    model = quantized("llama", "MXFP6_DEFAULT_CFG")
    with pytest.raises(
        UnsupportedFormatError, match=r"model\.layers\.0\.self_attn\.q_proj: no real format.*mxfp6"
    ):
        export_hf_checkpoint(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_compress_only_format_refused_by_the_export(tmp_path):
    # MXFP4 linears compress (mtq.compress) but have no unified checkpoint layout: refused, naming the layer
    model = quantized("llama", "MXFP4_DEFAULT_CFG")
    with pytest.raises(
        UnsupportedFormatError, match=r"model\.layers\.0\.self_attn\.q_proj: MXFP4 has no unified"
    ):
        export_hf_checkpoint(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_unsupported_kv_cache_format_names_attention(tmp_path):
    int8_kv = {"quant_cfg": [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": 8, "axis": None}}]}
    model = quantized("llama", "FP8_DEFAULT_CFG", int8_kv)
    with pytest.raises(UnsupportedFormatError, match=r"model\.layers\.0\.self_attn: KV cache .*int8"):
        export_hf_checkpoint(model, tmp_path / "out")


class _FailingTokenizer:
    def save_pretrained(self, directory):
        (directory / "tokenizer.json").write_text("{}")
        raise OSError("disk full")


def test_failed_export_leaves_nothing_behind(tmp_path, nvfp4_llama):
    with pytest.raises(OSError, match="disk full"):
        export_hf_checkpoint(nvfp4_llama, tmp_path / "out", tokenizer=_FailingTokenizer())
    assert list(tmp_path.iterdir()) == []
    previous = tmp_path / "prev"
    previous.mkdir()
    (previous / "config.json").write_text("{}")
    with pytest.raises(OSError, match="disk full"):
        export_hf_checkpoint(nvfp4_llama, previous, tokenizer=_FailingTokenizer(), overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["prev"]
    assert (previous / "config.json").read_text() == "{}"  # the old checkpoint is intact


class _Tokenizer:
    def save_pretrained(self, directory):
        (directory / "tokenizer_config.json").write_text("{}")


def test_tokenizer_and_dtype(tmp_path, nvfp4_llama):
    result = export_hf_checkpoint(nvfp4_llama, tmp_path / "out", dtype=torch.bfloat16, tokenizer=_Tokenizer())
    assert "tokenizer_config.json" in result.files
    t = tensors(tmp_path / "out")
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert t["model.norm.weight"].dtype == torch.bfloat16
    assert t["model.layers.0.mlp.up_proj.weight"].dtype == torch.uint8
    assert t["model.layers.0.mlp.up_proj.weight_scale_2"].dtype == torch.float32
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(TypeError, match=r"floating torch\.dtype"):
        export_hf_checkpoint(nvfp4_llama, tmp_path / "other", dtype=torch.int8)


def test_sharded_checkpoint_with_index_loads(tmp_path, nvfp4_llama):
    export_hf_checkpoint(nvfp4_llama, tmp_path / "out", max_shard_size="20KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    assert all((tmp_path / "out" / s).is_file() for s in shards)
    stored = tensors(tmp_path / "out")
    assert set(index["weight_map"]) == set(stored)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    single = tmp_path / "single"
    export_hf_checkpoint(nvfp4_llama, single)
    x = batches(n=1, seed=3)[0]
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)(x).logits
        b = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)(x).logits
    assert torch.equal(a, b)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError, match="'5 parsecs'"):
        parse_size("5 parsecs")


# ----------------------------------------------------------------------------- post-export verification


def test_zero_scale_fails_the_export(tmp_path):
    model = quantized("llama", "INT8_DEFAULT_CFG")
    q = model.model.layers[1].self_attn.v_proj.weight_quantizer
    amax = q.amax.clone()
    amax[3] = 0.0
    q.amax = amax
    with pytest.raises(ExportVerificationError, match=r"layers\.1\.self_attn\.v_proj\.weight_scale: .*zero"):
        export_hf_checkpoint(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    export_hf_checkpoint(model, tmp_path / "out", verify=False)  # the escape hatch


def _rewrite(directory, **changes):
    t = tensors(directory)
    t.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del t[key]
    save_file(t, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_verification_names_the_broken_layers(tmp_path, nvfp4_llama):
    d = tmp_path / "out"
    export_hf_checkpoint(nvfp4_llama, d)
    assert verify_export(nvfp4_llama, d)["NVFP4"] > 0
    dense = nvfp4_llama.model.layers[0].self_attn.q_proj.weight.detach().to(torch.bfloat16)
    _rewrite(
        d,
        **{
            "model.layers.0.self_attn.q_proj.weight": dense,  # stored in high precision
            "model.layers.1.mlp.up_proj.weight_scale_2": torch.tensor(float("nan")),
            "model.layers.1.self_attn.o_proj.input_scale": None,  # dropped
        },
    )
    with pytest.raises(ExportVerificationError) as info:
        verify_export(nvfp4_llama, d)
    message = str(info.value)
    assert "model.layers.0.self_attn.q_proj: stored as BF16" in message
    assert "model.layers.1.mlp.up_proj.weight_scale_2: NaN" in message
    assert "model.layers.1.self_attn.o_proj.input_scale: missing" in message


def test_verification_catches_a_quantizer_left_out(tmp_path):
    model = quantized("llama", "FP8_DEFAULT_CFG")
    d = tmp_path / "out"
    export_hf_checkpoint(model, d)
    model.lm_head.weight_quantizer.enable()  # asked for after the export: not in the checkpoint
    with pytest.raises(ExportVerificationError, match="lm_head: its weight quantizer is enabled"):
        verify_export(model, d)


# ----------------------------------------------------------------------------- loader


def test_loader_needs_a_valid_hf_quant_config(tmp_path, nvfp4_llama):
    d = tmp_path / "out"
    export_hf_checkpoint(nvfp4_llama, d)
    model = load_hf_checkpoint(d, dtype=torch.float32)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    path = d / "hf_quant_config.json"
    good = path.read_text()
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"hf_quant_config\.json is not valid JSON"):
        load_hf_checkpoint(d)
    path.write_text(json.dumps({"producer": {}, "quantization": {"exclude_modules": []}}))
    with pytest.raises(ValueError, match="quant_algo is missing"):
        load_hf_checkpoint(d)
    path.unlink()
    with pytest.raises(FileNotFoundError, match=r"hf_quant_config\.json is missing"):
        load_hf_checkpoint(d)
    path.write_text(good)
    config = json.loads((d / "config.json").read_text())
    del config["quantization_config"]["quant_algo"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_algo"):
        AutoModelForCausalLM.from_pretrained(d)


def test_export_gets_ordinary_permissions(tmp_path):
    """mkdtemp makes 0700 and safetensors 0600: the published checkpoint follows the umask like any file."""
    import os
    import stat

    import torch

    import modelopt_lite.quantization as mtq
    from modelopt_lite.export import export_hf_checkpoint

    from ._models import tiny_llama

    model = tiny_llama()
    mtq.quantize(model, "FP8_DEFAULT_CFG", [torch.randint(0, 128, (2, 8))])
    old = os.umask(0o022)
    try:
        export_hf_checkpoint(model, tmp_path / "out", max_shard_size="100KB")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "out").iterdir()} == {0o644}
