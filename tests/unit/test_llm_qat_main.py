"""examples/llm_qat/main.py end to end on a tiny model and a local text file: QAT and QAD, the YAML config
with command-line overrides, export read back, resume, and the bad-input list."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from ._models import tiny_llama, word_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples/llm_qat/configs").glob("*.yaml"))


def _main():
    spec = importlib.util.spec_from_file_location("llm_qat_main", ROOT / "examples/llm_qat/main.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["llm_qat_main"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm_qat")
    tokenizer = word_tokenizer()
    model = tiny_llama()
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    paragraphs = [" ".join(f"w{(s + 3 * i) % 125}" for i in range(40)) for s in range(60)]
    (root / "data.txt").write_text("\n\n".join(paragraphs))
    return root


def _args(setup, out, *extra):
    return [
        "--model_name_or_path",
        str(setup / "model"),
        "--dataset",
        str(setup / "data.txt"),
        "--seq_len",
        "16",
        "--output_dir",
        str(out),
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "4",
        "--use_cpu",
        "true",
        "--report_to",
        "none",
        "--calib_size",
        "8",
        "--eval_samples",
        "8",
        "--save_strategy",
        "no",
        *extra,
    ]


def test_qat_from_a_yaml_config_with_overrides_exports_and_reads_back(setup, tmp_path):
    config = tmp_path / "qat.yaml"
    config.write_text("recipe: FP8_DEFAULT_CFG\nmax_steps: 50\nlearning_rate: 0.001\n")
    results = _main().main(["--config", str(config), *_args(setup, tmp_path / "run")])  # max_steps 3 wins
    assert results["mode"] == "qat"
    assert results["recipe"] == "FP8_DEFAULT_CFG"
    assert results["tokens_trained"] == 3 * 4 * 16
    for key in ("ppl_baseline", "ppl_ptq", "ppl_after", "ppl_exported_weights"):
        assert 1 < results[key] < 1e4, (key, results)
    assert (tmp_path / "run" / "export" / "hf_quant_config.json").is_file()
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == results


def test_qad_distils_from_the_unquantized_model_and_resumes(setup, tmp_path):
    main = _main()
    extra = (
        "--recipe",
        "NVFP4_DEFAULT_CFG",
        "--teacher_model",
        "same",
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
    )
    first = main.main(_args(setup, tmp_path, *extra))
    assert first["mode"] == "qad"
    resumed = main.main(
        _args(
            setup,
            tmp_path,
            *extra,
            "--max_steps",
            "4",
            "--resume_from_checkpoint",
            "true",  # the last complete checkpoint, checkpoint-2
        )
    )
    assert resumed["tokens_trained"] == 4 * 4 * 16
    assert (tmp_path / "checkpoint-4" / "modelopt_lite_complete.json").is_file()


def test_bad_input(setup, tmp_path):
    main = _main()
    config = tmp_path / "bad.yaml"
    config.write_text("recipe: FP8_DEFAULT_CFG\nlearning_rat: 0.1\n")
    with pytest.raises(SystemExit, match=r"unknown key\(s\) \['learning_rat'\]"):
        main.main(["--config", str(config), *_args(setup, tmp_path)])
    with pytest.raises(SystemExit, match="no such file"):
        main.main([*_args(setup, tmp_path), "--dataset", str(tmp_path / "missing.txt")])
    with pytest.raises(ValueError, match="is not a directory"):
        main.main([*_args(setup, tmp_path), "--teacher_model", str(tmp_path / "no_teacher")])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(config):
    """Each YAML in examples/llm_qat/configs names only known arguments and its numbers arrive as written (a
    typo or a wrong key stops main.py with SystemExit before any model loads)."""
    main = _main()
    args = main.parse(["--config", str(config)])
    values = {k: v for a in args for k, v in vars(a).items()}
    for key, value in yaml.safe_load(config.read_text()).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert values[key] == value, (config.name, key, values[key], value)


def test_the_gemma_recipe_distils_in_chunks_at_its_probed_rate():
    """configs/gemma3_qad_nvfp4.yaml: the rate its 16-step probe picked (3e-5) and the chunked loss that
    keeps a vocabulary of 262144 within memory."""
    args = _main().parse(["--config", str(ROOT / "examples/llm_qat/configs/gemma3_qad_nvfp4.yaml")])
    values = {k: v for a in args for k, v in vars(a).items()}
    assert values["learning_rate"] == 3e-5
    assert values["distill_chunk_size"] == 512
    assert values["default_model"] == "gemma3-270m"


@pytest.mark.parametrize("deploy", ["merged", "served"])
def test_qad_with_lora_flags_exports_the_deployment_and_reads_it_back(setup, tmp_path, deploy):
    extra = ("--recipe", "NVFP4_DEFAULT_CFG", "--teacher_model", "same", "--lora", "true", "--lora_r", "4")
    results = _main().main(_args(setup, tmp_path, *extra, "--lora_deploy", deploy))
    assert results["lora"]["deploy"] == deploy
    assert 0 < results["lora"]["trainable_parameters"] < 20_000  # the adapters, not the model's weights
    assert results["kl_after"] != results["kl_ptq"], results  # the adapters trained
    served = (tmp_path / "export" / "adapter_config.json").is_file()
    assert served == (deploy == "served")
    assert (tmp_path / "export" / ("base_model" if served else "") / "hf_quant_config.json").is_file()
    # the reload is scored like the trained model (weights quantized, activations dense: close to "after")
    assert abs(results["ppl_exported_weights"] - results["ppl_after"]) < 0.2 * results["ppl_after"]
