"""``modelopt_lite.evaluation``: the one held-out protocol (perplexity over fixed windows, KL to a reference),
and the three commands that report it (``hf_ptq.py``, ``examples/llm_qat/main.py``, the models / benchmarks
path) printing the same baseline perplexity for the same model and split."""

from __future__ import annotations

import copy
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from modelopt_lite import evaluation
from modelopt_lite.cli.ptq import main as ptq_main
from modelopt_lite.data import heldout_split, load_texts, token_stream, windows
from modelopt_lite.models.trainer import heldout_perplexity

from ._models import tiny_llama, word_tokenizer
from .test_llm_qat_main import _main as llm_qat_main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import accuracy


def test_perplexity_is_the_mean_nll_of_every_token_after_a_windows_first():
    model = tiny_llama()
    ws = torch.randint(0, 128, (5, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = model(input_ids=ws).logits[:, :-1].log_softmax(-1)
    nll = -logp.gather(-1, ws[:, 1:, None]).mean()
    model.train()
    for batch_size in (1, 2, 16):
        assert evaluation.perplexity(model, ws, batch_size) == pytest.approx(math.exp(float(nll)), rel=1e-5)
    assert model.training  # mode restored
    assert evaluation.describe(ws) == (
        "5 windows of 12 tokens (stride 12, tail dropped; documents as bos text eos; a window's first token "
        "is context only: 55 predicted tokens)"
    )
    assert evaluation.default_window(model.config) == 64
    model.config.max_position_embeddings = 4096
    assert evaluation.default_window(model.config) == evaluation.MAX_WINDOW


def test_kl_to_a_reference_per_predicted_token():
    ref_model = tiny_llama()
    model = copy.deepcopy(ref_model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ws = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(1))
    ref = evaluation.reference_logprobs(ref_model, ws, batch_size=2)
    assert evaluation.kl_per_token(ref, ref_model, ws, batch_size=2) == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        p = ref_model(input_ids=ws).logits[:, :-1].log_softmax(-1)
        q = model(input_ids=ws).logits[:, :-1].log_softmax(-1)
    expected = float((p.exp() * (p - q)).sum(-1).mean())
    assert evaluation.kl_per_token(ref, model, ws, batch_size=2) == pytest.approx(expected, rel=1e-5)
    assert evaluation.reference_within(ref_model, ws, max_bytes=3 * 9 * 128 * 4) is not None
    assert evaluation.reference_within(ref_model, ws, max_bytes=3 * 9 * 128 * 4 - 1) is None


@pytest.mark.parametrize(("batch_size", "chunk_tokens"), [(2, 5), (3, 1024)])
def test_compare_matches_whole_evaluation_formulas(batch_size, chunk_tokens):
    """compare() runs both models batch by batch and the log-probabilities in chunks of tokens; its figures
    equal the ones written over the whole evaluation at once, however it is cut."""
    ref_model = tiny_llama()
    model = copy.deepcopy(ref_model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.003 * torch.randn_like(p, generator=torch.Generator().manual_seed(2)))
    model.train()
    ws = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        p = ref_model(input_ids=ws).logits[:, :-1].log_softmax(-1)
        q = model.eval()(input_ids=ws).logits[:, :-1].log_softmax(-1)
    model.train()
    target = ws[:, 1:, None]
    got = evaluation.compare(ref_model, model, ws, batch_size=batch_size, chunk_tokens=chunk_tokens)
    assert got.tokens == 27
    assert got.kl == pytest.approx(float((p.exp() * (p - q)).sum(-1).mean()), rel=1e-5)
    assert got.reference_perplexity == pytest.approx(math.exp(-float(p.gather(2, target).mean())), rel=1e-6)
    assert got.perplexity == pytest.approx(math.exp(-float(q.gather(2, target).mean())), rel=1e-6)
    assert got.perplexity == pytest.approx(evaluation.perplexity(model, ws), rel=1e-5)
    assert got.top1_agreement == pytest.approx(float((p.argmax(-1) == q.argmax(-1)).float().mean()))
    assert 0.0 < got.top1_agreement < 1.0  # the perturbation changes some predictions, not all
    assert model.training
    assert not ref_model.training
    same = evaluation.compare(ref_model, ref_model, ws)
    assert same.kl == pytest.approx(0.0, abs=1e-6)
    assert same.top1_agreement == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stored_reference_gives_the_kept_copys_figures_bit_for_bit(tmp_path, dtype):
    """The PTQ command line keeps the unquantized model's logits in a file instead of a copy of the model:
    compare() against them equals compare() against the model itself, to every bit, in float32 and bf16."""
    ref_model = tiny_llama().to(dtype)
    model = copy.deepcopy(ref_model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p, generator=torch.Generator().manual_seed(2)))
    ws = torch.randint(0, 128, (5, 10), generator=torch.Generator().manual_seed(1))
    for batch_size in (
        1,
        3,
    ):  # the logits of the batch size the comparison runs (batching moves the last bit)
        stored = evaluation.store_logits(ref_model, ws, tmp_path / "ref.bin", batch_size)
        assert (tmp_path / "ref.bin").stat().st_size == evaluation.stored_logits_bytes(ws, 128, dtype)
        assert stored.dtype == dtype
        assert evaluation.compare(stored, model, ws, batch_size) == evaluation.compare(
            ref_model, model, ws, batch_size
        )
    with pytest.raises(ValueError, match=r"stored reference has 5 windows of 10 tokens.*4 of 10"):
        evaluation.compare(stored, model, ws[:4])


def test_the_ptq_command_keeps_no_copy_of_the_model(checkpoint, monkeypatch, lib_caplog):
    """hf_ptq's comparison works from the stored reference: a deepcopy of a model fails the run, and the
    figures are a kept copy's (the unquantized perplexity equals the float model's)."""
    import modelopt_lite.cli.ptq as ptq

    deepcopy = copy.deepcopy

    def no_copy(obj, *a, **k):
        if isinstance(obj, torch.nn.Module):
            raise AssertionError("the PTQ command copied the model")
        return deepcopy(obj, *a, **k)

    monkeypatch.setattr(copy, "deepcopy", no_copy)
    args = ["--pyt_ckpt_path", str(checkpoint / "model"), "--dataset", str(checkpoint / "data.jsonl"),
            "--qformat", "int8", "--calib_size", "2", "--calib_seq", "16", "--eval_size", "3",
            "--eval_seq", "16", "--gen_tokens", "2", "--prompt", "w3 w6"]  # fmt: skip
    with lib_caplog.at_level("INFO"):
        assert ptq.main(args) == 0
    assert "no copy of the model is kept" in lib_caplog.text
    assert re.search(r"greedy continuation of 'w3 w6'\n  unquantized: .*\n  quantized: ", lib_caplog.text)
    before = float(re.search(r"perplexity: ([\d.]+) before", lib_caplog.text).group(1))
    texts = load_texts([str(checkpoint / "data.jsonl")])
    _, held = heldout_split(texts, 10.0, "--dataset")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint / "model")
    ws = windows(token_stream(tok, held), 16, 3)
    float_model = AutoModelForCausalLM.from_pretrained(checkpoint / "model")
    assert before == pytest.approx(evaluation.perplexity(float_model, ws), abs=1e-3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluation")
    tiny_llama().save_pretrained(root / "model")
    word_tokenizer().save_pretrained(root / "model")
    docs = [" ".join(f"w{(s * 11 + 3 * i) % 120}" for i in range(30 + s % 17)) for s in range(60)]
    (root / "data.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return root


def test_the_three_commands_print_the_same_baseline_perplexity(checkpoint, tmp_path, lib_caplog):
    """Same model, same data, same held-out split (the last 10% of the documents): hf_ptq.py's "before",
    main.py's ``ppl_baseline`` and the models / benchmarks functions agree, and state the same protocol."""
    lib_caplog.set_level("INFO", logger="modelopt_lite")
    model_dir, data = str(checkpoint / "model"), str(checkpoint / "data.jsonl")
    ptq_args = ["--pyt_ckpt_path", model_dir, "--dataset", data, "--qformat", "fp8", "--calib_size", "2",
                "--calib_seq", "16", "--batch_size", "2"]  # fmt: skip
    assert ptq_main(ptq_args) == 0
    ptq_ppl = float(re.search(r"held-out perplexity: ([\d.]+) before", lib_caplog.text).group(1))
    ptq_protocol = re.search(r"held-out evaluation: (.*)", lib_caplog.text).group(1)

    results = llm_qat_main().main(
        ["--model_name_or_path", model_dir, "--dataset", data, "--seq_len", "16", "--output_dir",
         str(tmp_path / "qat"), "--max_steps", "1", "--per_device_train_batch_size", "2", "--use_cpu", "true",
         "--report_to", "none", "--calib_size", "2", "--save_strategy", "no", "--recipe", "FP8_DEFAULT_CFG"]
    )  # fmt: skip

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    _, held = heldout_split(load_texts(data), 10)
    stream = token_stream(tokenizer, held)
    window = evaluation.default_window(model.config)
    models_ppl = heldout_perplexity(model, stream, window)
    bench_ppl = accuracy._ppl(model, windows(stream, window))

    printed = {f"{x:.3f}" for x in (ptq_ppl, results["ppl_baseline"], models_ppl, bench_ppl)}
    assert len(printed) == 1, (ptq_ppl, results["ppl_baseline"], models_ppl, bench_ppl)
    assert results["ppl_baseline"] == pytest.approx(models_ppl, rel=1e-6)
    assert bench_ppl == models_ppl
    assert ptq_protocol == results["eval_protocol"] == evaluation.describe(windows(stream, window))
    assert "held-out KL(unquantized || quantized)" in lib_caplog.text
    assert results["kl_ptq"] > 0


def test_the_ptq_command_runs_lean_on_memory(checkpoint, tmp_path, monkeypatch):
    """hf_ptq maps large temporaries instead of keeping them in glibc's heap (the policy is applied for the
    run), and its export writes shards of --max_shard_size (one shard is held in memory)."""
    import modelopt_lite.cli.ptq as ptq

    seen = []
    real = ptq.malloc_tuned

    def recording(**kwargs):
        seen.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(ptq, "malloc_tuned", recording)
    out = tmp_path / "out"
    args = ["--pyt_ckpt_path", str(checkpoint / "model"), "--dataset", str(checkpoint / "data.jsonl"),
            "--qformat", "fp8", "--calib_size", "2", "--calib_seq", "16", "--eval_size", "0",
            "--gen_tokens", "0", "--export_path", str(out), "--max_shard_size", "20KB"]  # fmt: skip
    assert ptq.main(args) == 0
    assert seen == [{"mmap_threshold": 4 << 20}]
    assert len(list(out.glob("*.safetensors"))) > 1
