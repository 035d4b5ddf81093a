"""The PTQ command line (``modelopt-lite-ptq`` / ``examples/llm_ptq/hf_ptq.py``) on a tiny saved model."""

from __future__ import annotations

import json

import pytest

from modelopt_lite.cli.ptq import QFORMATS, build_config, main

from ._export_cases import tensors
from ._models import tiny_qwen3_moe


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("ptq")
    raw = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="w0").save_pretrained(root / "model")
    tiny_qwen3_moe().save_pretrained(root / "model")
    words = [f"w{(i * 7) % 128}" for i in range(16 * 6)]  # 6 paragraphs (documents) of 16 words
    (root / "data.txt").write_text("\n\n".join(" ".join(words[i : i + 16]) for i in range(0, 96, 16)))
    return root


def _args(root, *extra):
    return ["--pyt_ckpt_path", str(root / "model"), "--dataset", str(root / "data.txt"), "--calib_seq", "16",
            "--eval_seq", "16", "--calib_size", "4", "--eval_size", "1", "--batch_size", "2",
            *extra]  # fmt: skip


def test_nvfp4_moe_eager_exports_every_expert_quantized(checkpoint, tmp_path, lib_caplog):
    lib_caplog.set_level("INFO", logger="modelopt_lite")
    out = tmp_path / "out"
    args = ["--qformat", "nvfp4", "--experts_implementation", "eager", "--export_path", str(out)]
    assert main(_args(checkpoint, *args)) == 0
    t = tensors(out)
    experts = [k for k in t if ".mlp.experts." in k and k.endswith(".weight")]
    assert len(experts) == 2 * 4 * 3
    assert all(t[k].dtype.is_floating_point is False for k in experts)
    assert (out / "tokenizer.json").is_file()
    assert "held-out perplexity" in lib_caplog.text
    assert f"checkpoint: {out}" in lib_caplog.text


def test_bad_input(checkpoint, tmp_path, lib_caplog, capsys):
    with pytest.raises(SystemExit):
        main(_args(checkpoint, "--qformat", "int3"))
    assert "'nvfp4_awq'" in capsys.readouterr().err  # the error lists the choices
    assert main(_args(checkpoint, "--qformat", "fp8", "--calib_size", "400")) == 2
    assert "the dataset has 80 tokens (5 samples)" in lib_caplog.text  # the last document is held out
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(SystemExit):
        main(_args(checkpoint, "--export_path", str(tmp_path / "full")))
    assert "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(_args(checkpoint, "--qformat", "mxfp4", "--export_path", str(tmp_path / "mx")))
    with pytest.raises(ValueError, match="one algorithm"):
        build_config("int8_sq,int4_awq")


def test_mixed_recipe_attention_and_mlp(checkpoint, tmp_path):
    assert set(QFORMATS) >= {"fp8", "nvfp4", "w4a8_awq", "mxfp8"}
    out = tmp_path / "out"
    args = ["--qformat", "fp8,nvfp4", "--eval_size", "0", "--export_path", str(out)]
    assert main(_args(checkpoint, *args)) == 0
    q = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION"
    layers = q["quantized_layers"]
    assert layers["model.layers.0.self_attn.q_proj"]["quant_algo"] == "FP8"
    assert layers["model.layers.0.mlp.experts.3.down_proj"]["quant_algo"] == "NVFP4"


def test_the_figures_are_the_exported_models(checkpoint, tmp_path, lib_caplog):
    """The command evaluates the model it exports: q/k/v and gate/up share their NVFP4 weight global amax
    before the evaluation (as the export writes them), so the dequantized reload of a weight-only export
    has the perplexity the command printed, with or without --export_path."""
    import re

    import torch
    from transformers import AutoTokenizer

    from modelopt_lite import evaluation
    from modelopt_lite.cli.ptq import _samples, parse_args
    from modelopt_lite.export import load_hf_checkpoint

    lib_caplog.set_level("INFO", logger="modelopt_lite")
    out = tmp_path / "out"
    args = _args(
        checkpoint, "--qformat", "w4a16_nvfp4", "--experts_implementation", "eager", "--gen_tokens", "0"
    )
    assert main([*args, "--export_path", str(out)]) == 0
    assert main(args) == 0
    printed = re.findall(r"perplexity: [\d.]+ before, ([\d.]+) after", lib_caplog.text)
    assert len(printed) == 2
    assert printed[0] == printed[1]
    _, held = _samples(parse_args(args), AutoTokenizer.from_pretrained(checkpoint / "model"), 16, 16)
    reloaded = load_hf_checkpoint(out, dtype=torch.float32)
    assert f"{evaluation.perplexity(reloaded, held):.3f}" == printed[0]
