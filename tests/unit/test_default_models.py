"""The bundled default models (modelopt_lite.models): corpus split, tokenizer, deterministic training with a
tiny budget, atomic cache writes, reuse, the API and command, and the PTQ command line's default; the
benchmark models (three-way split, their specs and kinds) and the default models' unchanged versions."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

from modelopt_lite.cli import default_model
from modelopt_lite.models import (
    BENCH_DENSE,
    BENCH_MOE,
    DENSE,
    MOE,
    build_default_model,
    cache_root,
    corpus,
    corpus_texts,
    default_model_path,
    specs,
    trainer,
)
from modelopt_lite.models import cache as cache_mod
from modelopt_lite.models.tokenizer import train_tokenizer

from ._export_cases import tensors


def tiny(spec: specs.DefaultModelSpec, **over) -> specs.DefaultModelSpec:
    """``spec`` with a budget of a few seconds: 32-wide, one layer, 4 steps, 40 documents per split."""
    model = {**spec.model_config, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    if spec.architecture == "qwen3_moe":
        model.update(head_dim=8, moe_intermediate_size=16, num_experts=4)
    budget = dict(steps=4, warmup_steps=1, vocab_size=300, seq_len=32, batch_size=2, max_documents=40)
    return dataclasses.replace(spec, model_config=model, **{**budget, **over})


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELOPT_LITE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def tiny_specs(monkeypatch):
    monkeypatch.setitem(specs.SPECS, "dense", tiny(DENSE))
    monkeypatch.setitem(specs.SPECS, "moe", tiny(MOE))
    monkeypatch.setitem(specs.SPECS, "bench-dense", tiny(BENCH_DENSE))
    monkeypatch.setitem(specs.SPECS, "bench-moe", tiny(BENCH_MOE))
    return specs.SPECS


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------- corpus


def test_split_disjoint_covering_and_stable():
    train, held, every = corpus_texts("train"), corpus_texts("heldout"), corpus_texts("all")
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(every)
    assert len(set(every)) == len(every)  # texts unique
    assert 0.05 < len(held) / len(every) < 0.15
    assert sum(map(len, every)) > 500_000  # about 1 MB of English on CPython 3.10+
    # pydoc topics and stdlib docstrings are both there
    names = [d.name for d in corpus.corpus_documents()]
    assert any(n.startswith("topics:") for n in names)
    assert "json.dumps" in names
    # the side of a document depends on its text only (SHA-256 rule), and a fresh read gives the same corpus
    for doc in corpus.corpus_documents()[:50]:
        h = int(hashlib.sha256(doc.text.encode()).hexdigest()[:8], 16)
        assert doc.heldout == (h < 0.10 * 2**32)
    digest = corpus.corpus_digest()
    corpus.corpus_documents.cache_clear()
    assert corpus_texts("heldout") == held
    assert corpus.corpus_digest() == digest
    with pytest.raises(ValueError, match="'heldout'"):
        corpus_texts("dev")  # type: ignore[arg-type]


def test_three_way_split_for_the_benchmark_models():
    train, held = corpus_texts("train"), corpus_texts("heldout")
    fit, val, test = corpus_texts("fit"), corpus_texts("validation"), corpus_texts("test")
    assert test == held  # nothing a default model trained on is in test
    assert not set(fit) & set(val)
    assert not (set(fit) | set(val)) & set(test)
    assert sorted(fit + val) == sorted(train)  # validation is carved out of the old train split
    assert [t for t in train if t in set(fit)] == fit  # corpus order kept
    assert 0.05 < len(val) / len(train) < 0.15
    assert min(len(fit), len(val)) > 100
    # the validation side depends on the text only: SHA-256 hex digits 8 to 15 (not the held-out slice)
    for doc in corpus.corpus_documents()[:200]:
        h = hashlib.sha256(doc.text.encode()).hexdigest()
        in_val = not doc.heldout and int(h[8:16], 16) < 0.10 * 2**32
        assert doc.validation == in_val
        assert doc.split == ("test" if doc.heldout else "validation" if in_val else "fit")
    assert corpus.SPLITS[:3] == ("train", "heldout", "all")


def test_corpus_ignores_libraries_patching_the_stdlib(monkeypatch):
    import json as json_module

    digest = corpus.corpus_digest()

    def patched(self):
        """A method some library added to a standard class after import; not CPython's documentation."""

    monkeypatch.setattr(json_module.JSONDecoder, "patched", patched, raising=False)
    corpus.corpus_documents.cache_clear()
    try:
        assert corpus.corpus_digest() == digest
        assert "json.JSONDecoder.patched" not in [d.name for d in corpus.corpus_documents()]
    finally:
        corpus.corpus_documents.cache_clear()


# -------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_special_tokens(tmp_path):
    from transformers import AutoTokenizer

    tok = train_tokenizer(corpus_texts("train")[:200], vocab_size=400)
    assert len(tok) == 400
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    samples = ["def f(x):\n    return x  # tabs\tand  spaces", "naïve café — 東京 🙂", "", " lead and trail "]
    for s in samples:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == s
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(samples[1])["input_ids"] == tok(samples[1])["input_ids"]
    assert again.eos_token == "<|eos|>"
    assert again.pad_token == "<|pad|>"
    with pytest.raises(ValueError, match="at least 259"):
        train_tokenizer(["abc"], vocab_size=100)


# ------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("base", [DENSE, MOE], ids=["dense", "moe"])
def test_training_is_deterministic(base):
    spec = tiny(base)
    a = trainer.train(spec, progress=False)
    torch.manual_seed(123)  # the caller's random state does not matter
    b = trainer.train(spec, progress=False)
    sa, sb = _state(a.model), _state(b.model)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.tokenizer.backend_tokenizer.to_str() == b.tokenizer.backend_tokenizer.to_str()
    other = trainer.train(dataclasses.replace(spec, seed=1), progress=False)
    assert not all(torch.equal(sa[k], v) for k, v in _state(other.model).items())
    assert a.report == {**b.report, "train_seconds": a.report["train_seconds"]}


def test_a_small_budget_beats_the_unigram_baseline():
    spec = tiny(DENSE, steps=60, warmup_steps=5, batch_size=8, max_documents=300, lr=1e-2)
    report = trainer.train(spec, progress=False).report
    assert report["heldout_perplexity"] < 0.8 * report["unigram_perplexity"]


# the versions of the default models before the benchmark models existed (corpus digest 1aa9d39292a8a695 is
# CPython 3.11's corpus); the spec JSON digests hold on every CPython
_DEFAULT_VERSIONS = {"1aa9d39292a8a695": {"dense": "5033eb597b", "moe": "5e81c7ebc4"}}
_DEFAULT_SPEC_DIGESTS = {"dense": "a7f441329bfc40f1", "moe": "b1b341a1d6adc221"}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_default_model_versions_are_unchanged(kind):
    spec = specs.spec_for(kind)
    payload = json.dumps(spec.to_json(), sort_keys=True)
    assert hashlib.sha256(payload.encode()).hexdigest()[:16] == _DEFAULT_SPEC_DIGESTS[kind]
    assert "train_split" not in spec.to_json()
    assert specs.FORMAT == 1
    known = _DEFAULT_VERSIONS.get(corpus.corpus_digest())
    if known is not None:
        assert spec.version == known[kind]
    assert spec.train_split == "train"
    assert dataclasses.replace(spec, train_split="fit").version != spec.version


def test_benchmark_specs_and_kinds():
    assert specs.KINDS == ("dense", "moe")  # `--kind all` and the PTQ command's default models
    assert specs.BENCH_KINDS == ("bench-dense", "bench-moe")
    assert specs.spec_for("bench-dense") is BENCH_DENSE
    assert specs.spec_for("bench-moe") is BENCH_MOE
    assert BENCH_DENSE.architecture == "llama"
    assert BENCH_MOE.architecture == "qwen3_moe"
    assert BENCH_MOE.model_config["num_experts"] == 8
    assert BENCH_MOE.model_config["num_experts_per_tok"] == 2
    for spec in (BENCH_DENSE, BENCH_MOE):
        assert spec.train_split == "fit"
        assert spec.to_json()["train_split"] == "fit"
    assert len({s.dirname for s in specs.SPECS.values()}) == 4
    assert BENCH_DENSE.dirname.startswith("llama-bench-")
    assert BENCH_MOE.dirname.startswith("qwen3-moe-bench-")
    with pytest.raises(ValueError, match="'bench-moe'"):
        specs.spec_for("bench")
    with pytest.raises(ValueError, match="train_split"):
        dataclasses.replace(DENSE, train_split="heldout")


def test_a_benchmark_model_trains_on_fit_and_reports_validation(monkeypatch):
    asked: list[str] = []

    def recording(split):
        asked.append(split)
        return corpus_texts(split)

    monkeypatch.setattr(trainer, "corpus_texts", recording)
    report = trainer.train(tiny(BENCH_DENSE), progress=False).report
    assert asked == ["fit", "heldout", "validation"]
    assert report["train_split"] == "fit"
    assert report["test_perplexity"] == report["heldout_perplexity"]
    assert report["validation_perplexity"] > 1
    assert report["validation_tokens"] > 0
    asked.clear()
    default = trainer.train(tiny(DENSE), progress=False).report
    assert asked == ["train", "heldout"]
    assert "validation_perplexity" not in default
    assert "train_split" not in default


def test_spec_version_names_the_recipe():
    assert tiny(DENSE).dirname != tiny(DENSE, steps=5).dirname
    assert tiny(DENSE).dirname == tiny(DENSE).dirname
    assert DENSE.dirname.startswith("llama-dense-")
    assert MOE.dirname.startswith("qwen3-moe-")
    with pytest.raises(ValueError, match="warmup_steps"):
        tiny(DENSE, warmup_steps=10)
    with pytest.raises(ValueError, match="'llama'"):
        dataclasses.replace(DENSE, architecture="gpt2")


# ----------------------------------------------------------------------------------------------- cache


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    assert cache_root() == tmp_path / "cache" / "default_models"
    monkeypatch.delenv("MODELOPT_LITE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "modelopt_lite" / "default_models"


def _entries() -> list[str]:
    """What the cache holds, without the builders' lock files."""
    return sorted(p.name for p in cache_root().iterdir() if not p.name.endswith(".lock"))


def _interrupt_after(monkeypatch, steps: int, exc: BaseException) -> None:
    """Raise ``exc`` in the middle of the training loop, after ``steps`` optimizer steps."""
    real, calls = torch.nn.utils.clip_grad_norm_, []

    def clip(*args, **kwargs):
        calls.append(1)
        if len(calls) > steps:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), RuntimeError("disk full")], ids=["ctrl-c", "error"])
def test_interrupted_training_leaves_nothing(monkeypatch, exc):
    _interrupt_after(monkeypatch, 2, exc)
    with pytest.raises(type(exc)):
        build_default_model(tiny(DENSE), progress=False)
    assert _entries() == []  # no model, no partial directory


def test_failed_save_leaves_nothing(monkeypatch):
    from transformers import PreTrainedTokenizerFast

    def broken(self, *args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", broken)  # after the weights are written
    with pytest.raises(OSError, match="no space"):
        build_default_model(tiny(DENSE), progress=False)
    assert _entries() == []


def test_reused_from_cache_without_training(monkeypatch, lib_caplog):
    lib_caplog.set_level("INFO", logger="modelopt_lite")
    spec = tiny(DENSE)
    path = build_default_model(spec, progress=False)
    assert path == cache_root() / spec.dirname
    info = json.loads((path / cache_mod.MARKER).read_text())
    assert info["version"] == spec.version
    assert info["spec"]["steps"] == 4
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("retrained a cached model")

    monkeypatch.setattr(trainer, "train", no_training)
    assert build_default_model(spec, progress=False) == path
    assert weights.stat().st_mtime_ns == mtime
    assert f"reusing {path}" in lib_caplog.text
    with pytest.raises(AssertionError, match="retrained"):
        build_default_model(spec, force=True, progress=False)  # force trains again
    assert weights.stat().st_mtime_ns == mtime  # and the failed retraining kept the old model
    assert _entries() == [spec.dirname]


def test_a_killed_builders_staging_directory_is_removed_by_the_next_build(lib_caplog):
    lib_caplog.set_level("INFO", logger="modelopt_lite")
    spec = tiny(DENSE)
    stale = cache_root() / f".{spec.dirname}.partial-dead1234"  # what SIGKILL in the middle leaves
    (stale / "sub").mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    other = cache_root() / ".another-model-0123456789.partial-x"  # another model's build: not touched
    other.mkdir()
    path = build_default_model(spec, progress=False)
    assert not stale.exists()
    assert other.exists()
    assert f"removing {stale}" in lib_caplog.text
    assert _entries() == sorted([spec.dirname, other.name])
    assert cache_mod._complete(path)


def test_a_second_builder_waits_for_the_first_and_reuses_its_model(monkeypatch, lib_caplog):
    import fcntl
    import threading

    lib_caplog.set_level("INFO", logger="modelopt_lite")
    spec = tiny(DENSE)
    built = build_default_model(spec, progress=False)  # a complete model to hand over
    target = cache_root() / spec.dirname
    parked = cache_root() / "parked"
    built.rename(parked)

    def no_training(*args, **kwargs):
        raise AssertionError("trained while another builder held the lock")

    monkeypatch.setattr(trainer, "train", no_training)
    result: dict[str, object] = {}
    with open(cache_root() / f".{spec.dirname}.lock", "a+b") as lock:  # the first builder, mid-training
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(
            target=lambda: result.update(path=build_default_model(spec, progress=False))
        )
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive()  # waits instead of training the same model a second time
        assert not any(p.name.startswith(f".{spec.dirname}.partial-") for p in cache_root().iterdir())
        parked.rename(target)  # the first builder finishes
        fcntl.flock(lock, fcntl.LOCK_UN)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert result["path"] == target
    assert "another process is building it; waiting" in lib_caplog.text
    assert "(built by another process)" in lib_caplog.text


def test_force_replaces_the_cached_model():
    spec = tiny(DENSE)
    path = build_default_model(spec, progress=False)
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert build_default_model(spec, force=True, progress=False) == path
    assert (path / "model.safetensors").stat().st_mtime_ns != before
    assert _entries() == [spec.dirname]


def test_default_model_path_and_load(tiny_specs):
    with pytest.raises(FileNotFoundError, match="modelopt-lite-default-model --kind moe"):
        default_model_path("moe", train_if_missing=False)
    with pytest.raises(ValueError, match="'dense'"):
        default_model_path("sparse")
    path = default_model_path("moe")
    assert default_model_path("moe", train_if_missing=False) == path
    from modelopt_lite.models import load_default_model

    model, tok = load_default_model("moe", dtype=torch.bfloat16)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not model.training
    assert model.dtype == torch.bfloat16
    assert model.config.num_experts == 4
    ids = tok("import json", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))


def test_command(tiny_specs, lib_caplog, capsys):
    lib_caplog.set_level("INFO", logger="modelopt_lite")
    assert default_model.main(["--kind", "dense"]) == 0
    assert str(cache_root() / tiny_specs["dense"].dirname) in lib_caplog.text
    assert "held-out perplexity" in lib_caplog.text
    with pytest.raises(SystemExit) as exit_:
        default_model.main(["--help"])
    assert exit_.value.code == 0
    assert "--force" in capsys.readouterr().out


def test_benchmark_kinds_build_load_and_command(tiny_specs, lib_caplog):
    from modelopt_lite.models import load_default_model

    lib_caplog.set_level("INFO", logger="modelopt_lite")
    with pytest.raises(FileNotFoundError, match="--kind bench-moe"):
        default_model_path("bench-moe", train_if_missing=False)
    assert default_model.main(["--kind", "bench"]) == 0
    for kind in ("bench-dense", "bench-moe"):
        path = default_model_path(kind, train_if_missing=False)
        assert path == cache_root() / tiny_specs[kind].dirname
        info = json.loads((path / cache_mod.MARKER).read_text())
        assert info["spec"]["train_split"] == "fit"
        assert info["report"]["validation_perplexity"] > 1
        assert str(path) in lib_caplog.text
    assert "validation perplexity" in lib_caplog.text
    assert not (cache_root() / tiny_specs["dense"].dirname).exists()  # `bench` builds only the bench models
    model, _ = load_default_model("bench-moe", train_if_missing=False)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"


# ----------------------------------------------------------------------------------- PTQ command default


def test_ptq_defaults_to_the_moe_model_and_corpus(tiny_specs, tmp_path, lib_caplog):
    from modelopt_lite.cli.ptq import main

    lib_caplog.set_level("INFO", logger="modelopt_lite")
    out = tmp_path / "out"
    args = ["--qformat", "nvfp4", "--experts_implementation", "eager", "--export_path", str(out)]
    assert main([*args, "--calib_size", "8", "--eval_size", "2"]) == 0
    assert f"no --pyt_ckpt_path: the bundled default moe model {cache_root()}" in lib_caplog.text
    t = tensors(out)
    experts = [k for k in t if ".mlp.experts." in k and k.endswith(".weight")]
    assert len(experts) == 1 * 4 * 3
    assert all(not t[k].dtype.is_floating_point for k in experts)
    assert "held-out perplexity" in lib_caplog.text


def test_ptq_default_model_flag(tiny_specs, tmp_path, lib_caplog, capsys):
    from modelopt_lite.cli.ptq import main

    lib_caplog.set_level("INFO", logger="modelopt_lite")
    args = ["--default_model", "dense", "--qformat", "fp8", "--calib_size", "2", "--eval_size", "1"]
    assert main(args) == 0
    assert "bundled default dense model" in lib_caplog.text
    with pytest.raises(SystemExit):
        main(["--default_model", "dense", "--pyt_ckpt_path", str(tmp_path)])
    assert "only one of them" in capsys.readouterr().err


def test_ptq_default_corpus_too_small(tiny_specs, lib_caplog):
    from modelopt_lite.cli.ptq import main

    assert main(["--default_model", "dense", "--eval_size", "100000"]) == 2
    assert "--eval_size = 100000 samples of 32 tokens, but the default corpus' held-out split has" in (
        lib_caplog.text
    )
