"""``benchmarks/real_ptq.py --quick`` on a tiny Llama built in code (tied embeddings, as SmolLM2): our rows,
their export round trip and the report, without the peers (they need their own virtualenvs)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _real_ptq_peer as peer
import real_ptq
from _models import VOCAB, word_tokenizer


def _tiny_checkpoint(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                      tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    word_tokenizer().save_pretrained(path)


def test_measure_matches_the_evaluation_protocol(tmp_path: Path) -> None:
    """``measure`` against stored batches gives ``evaluation.compare``'s perplexity, KL and top-1."""
    from transformers import LlamaForCausalLM

    from modelopt_lite import evaluation

    _tiny_checkpoint(tmp_path / "m")
    base = LlamaForCausalLM.from_pretrained(tmp_path / "m").eval()
    other = LlamaForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn_like(p))
    windows = torch.randint(0, VOCAB, (5, 24), generator=torch.Generator().manual_seed(1))
    peer.write_reference(base, windows, tmp_path / "ref", batch_size=2)
    assert sorted(p.name for p in (tmp_path / "ref").iterdir()) == [f"b{i}.safetensors" for i in range(3)]
    got = peer.measure(other, windows, tmp_path / "ref", batch_size=2)
    want = evaluation.compare(base, other, windows, batch_size=2)
    assert got["ppl"] == pytest.approx(want.perplexity, rel=1e-5)
    assert got["kl"] == pytest.approx(want.kl, rel=1e-4)
    assert got["top1"] == pytest.approx(want.top1_agreement)
    assert got["tokens"] == want.tokens == 5 * 23
    assert peer.measure(base, windows, tmp_path / "ref", batch_size=2)["kl"] == pytest.approx(0.0, abs=1e-6)


def test_quick_run_on_a_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quick mode's rows (fp8, int4_awq) are measured, exported and reloaded: each dense-activation reload
    within 1e-3 of the weight-only fake-quant perplexity on the same (first) window, each reload with
    ``activations="fake"`` within 1e-3 of the full fake-quant one, the tied ``lm_head`` reported; JSON and
    markdown written."""
    monkeypatch.delenv("MODELOPT_REFERENCE_PYTHON", raising=False)
    monkeypatch.delenv("TORCHAO_PYTHON", raising=False)
    _tiny_checkpoint(tmp_path / "m")
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    argv = ["--model-dir", str(tmp_path / "m"), "--quick", "--json", str(out_json), "--md", str(out_md),
            "--roundtrip-windows", "1"]  # fmt: skip
    assert real_ptq.main(argv) == 0
    result = json.loads(out_json.read_text())
    assert math.isfinite(result["baseline"]["ppl"])
    assert result["baseline"]["kl"] == pytest.approx(0, abs=1e-6)
    rows = {r["name"]: r for r in result["ours"]}
    assert sorted(rows) == ["fp8", "int4_awq"]
    for row in rows.values():
        assert "error" not in row, row.get("error")
        assert row["kl"] > 0
        assert 0 < row["top1"] <= 1
        assert row["export_mb"] > 0
        assert abs(row["dequantized"]["rel_ppl_vs_fake"]) < real_ptq.ROUNDTRIP_GOAL
        for kind in ("dequantized_act", "compressed_act"):  # activations="fake" vs the full fake-quant model
            assert abs(row[kind]["rel_ppl_vs_fake"]) < real_ptq.ROUNDTRIP_GOAL, (row["name"], row[kind])
        head = row["lm_head"]
        assert head["tie_word_embeddings"] is True
        assert head["reloaded_tied"] is True
        assert head["lm_head_tensor_stored"] is False
    assert rows["fp8"]["weight_only_fake_ppl"]["disabled_quantizers"] > 0  # FP8 quantizes activations
    assert rows["int4_awq"]["weight_only_fake_ppl"]["disabled_quantizers"] == 0
    assert rows["int4_awq"]["weight_only_fake_ppl"]["windows"] == 1
    assert rows["int4_awq"]["quant_algo"] == "W4A16_AWQ"
    md = out_md.read_text()
    assert "| fp8 |" in md
    assert "Export round trip" in md
    assert "Export round trip with activations" in md
    assert "--quick" in md


def _run(ours: list[dict], torchao: list[dict], ppl: float = 30.0) -> dict:
    meta = {"model": "m", "calibration": "c", "evaluation": "e", "command": "x"}
    return {"meta": meta, "baseline": {"ppl": ppl}, "ours": ours, "peers": {"torchao": {"rows": torchao}}}


def test_report_merges_runs_on_the_same_windows() -> None:
    """``--report A B``: B's rows add to A's or replace them by name; runs on other windows are refused."""
    a = _run([{"name": "fp8", "ppl": 31.0}], [{"name": "int8_wo", "ppl": 30.5}, {"name": "x", "error": "E"}])
    b = _run([], [{"name": "x", "ppl": 32.0}, {"name": "y", "ppl": 33.0}])
    merged = real_ptq.merge([a, b])
    assert [r["name"] for r in merged["ours"]] == ["fp8"]
    assert {r["name"]: r.get("ppl") for r in merged["peers"]["torchao"]["rows"]} == {
        "int8_wo": 30.5, "x": 32.0, "y": 33.0
    }  # fmt: skip
    assert merged["comparison"][0]["name"] == "fp8"
    with pytest.raises(ValueError, match="differ"):
        real_ptq.merge([a, _run([], [], ppl=29.0)])


def test_report_writes_no_path_of_the_machine(tmp_path: Path) -> None:
    """``--report A B --json OUT``: a run written by an older version that kept a peer's log as an absolute
    path comes out with it written as ``<outside>/NAME``, as every recorded path."""
    more = {"machine": "2 CPU cores", "date": "d", "torch": "t", "transformers": "t"}
    a, b = _run([{"name": "fp8", "ppl": 31.0}], []), _run([{"name": "int8_sq", "ppl": 32.0}], [])
    for run in (a, b):
        run["meta"].update(more)
    a["peers"]["modelopt"] = {"rows": [], "log": "/work/elsewhere/run/modelopt.log"}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    out = tmp_path / "merged.json"
    assert (
        real_ptq.main(["--report", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json", str(out)])
        == 0
    )
    merged = json.loads(out.read_text())
    assert merged["peers"]["modelopt"]["log"] == "<outside>/modelopt.log"
    assert [r["name"] for r in merged["ours"]] == ["fp8", "int8_sq"]


def test_kv_cache_probe_finds_the_layer_whose_key_bias_fp8_rounds_away(tmp_path: Path) -> None:
    """``benchmarks/kv_cache_probe.py`` on a tiny Llama with q/k/v biases and one large k_proj bias in layer
    0 (as Qwen2.5's): that layer's K amax is the bias; leaving its K unquantized, or the affine KV preset,
    brings the KL back near V-only's, while K+V and K-only lose far more."""
    import kv_cache_probe
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                      attention_bias=True, rope_theta=1e6)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # the lowest-frequency RoPE channels of head 0: nearly constant over 32 tokens
        attn = model.model.layers[0].self_attn
        channels = [6, 7, 14, 15]
        attn.k_proj.bias[channels] = torch.tensor([-300.0, 290.0, 280, -310])
        attn.k_proj.weight[channels] *= 40  # their token-dependent part: a few units, below FP8's step there
        attn.q_proj.bias[channels] = 20.0  # and the queries read it
    model.save_pretrained(tmp_path / "m")
    gen = torch.Generator().manual_seed(1)
    calib = torch.randint(0, VOCAB, (4, 32), generator=gen)
    test = torch.randint(0, VOCAB, (2, 32), generator=gen)
    save_file({"calib": calib, "test": test}, str(tmp_path / "data.safetensors"))
    peer.write_reference(model, test, tmp_path / "reference_logprobs", 4)
    out = kv_cache_probe.main(["--model-dir", str(tmp_path / "m"), "--workdir", str(tmp_path),
                               "--json", str(tmp_path / "p.json")])  # fmt: skip
    assert json.loads((tmp_path / "p.json").read_text())["rows"] == out["rows"]
    layers = out["layers"]
    assert layers[0]["k_amax"] > 250 > 10 * layers[1]["k_amax"]
    assert layers[0]["k_proj_bias_max"] == pytest.approx(310)
    kl = {r["name"].split(" (")[0]: r["kl"] for r in out["rows"]}
    assert kl["K+V"] > 10 * kl["V only"]
    assert kl["K only"] > 10 * kl["V only"]
    assert kl["K+V, K of layer(s) 0 unquantized"] < 0.2 * kl["K+V"]
    assert kl["K+V affine"] < 0.2 * kl["K+V"]


def _probe_workdir(tmp_path: Path) -> tuple[list[str], Any, Any, Any]:
    """A tiny Llama saved with a word tokenizer and a ``real_ptq.py``-like workdir (calibration and test
    windows, the test windows' unquantized log-probabilities): the probe's common flags, the float model,
    the calibration and the test windows."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)  # fmt: skip
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "m")
    word_tokenizer().save_pretrained(tmp_path / "m")  # (for --split validation's windows)
    model = LlamaForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    calib = torch.randint(0, VOCAB, (4, 64), generator=gen)
    test = torch.randint(0, VOCAB, (6, 64), generator=gen)
    save_file({"calib": calib, "test": test}, str(tmp_path / "data.safetensors"))
    peer.write_reference(model, test, tmp_path / "reference_logprobs", 4)
    common = ["--model-dir", str(tmp_path / "m"), "--workdir", str(tmp_path), "--eval-windows", "6"]
    return common, model, calib, test


def test_awq_probe_splits_the_rows_loss_into_weights_and_inputs_per_window(tmp_path: Path) -> None:
    """``benchmarks/awq_probe.py`` on a tiny Llama: its windows sum to what ``real_ptq.py`` measures for
    the same row, the FP8 inputs add to the weights' loss, and ``--per-layer`` changes the search."""
    import awq_probe
    from safetensors.torch import load_file

    import modelopt_lite.quantization as mtq
    from modelopt_lite.cli.ptq import build_config
    from modelopt_lite.export.layers import unify_shared_scales

    common, model, calib, test = _probe_workdir(tmp_path)
    out = awq_probe.main([*common, "--threads", "1", "--json", str(tmp_path / "p.json")])
    with torch.no_grad():
        mtq.quantize(model, build_config("w4a8_awq", "none"), list(calib.split(4)))
    unify_shared_scales(model)
    row = peer.measure(model, test, tmp_path / "reference_logprobs", 4)
    assert [w["window"] for w in out["windows"]["as is"]] == list(range(6))
    assert out["summary"]["as is"]["nll"] == pytest.approx(sum(row["batch_nll"]), rel=1e-5)
    assert out["summary"]["as is"]["kl"] == pytest.approx(row["kl"], rel=1e-4)
    assert out["summary"]["inputs off"]["kl"] < out["summary"]["as is"]["kl"]
    assert all(0 <= w["clipped_fraction"] < 1 for w in out["windows"]["as is"])
    import modelopt_lite.quantization.algorithms.awq as awq

    grouping = awq.groups
    per_layer = awq_probe.main([*common, "--threads", "1", "--per-layer"])
    assert awq.groups is grouping  # (the switch is undone)
    assert per_layer["summary"]["per layer"]["nll"] != pytest.approx(out["summary"]["as is"]["nll"], rel=1e-6)
    # --split validation: windows of the corpus' validation split, made and referenced once per workdir
    val = awq_probe.main([*common, "--threads", "1", "--split", "validation", "--as-is-only"])
    (stored,) = tmp_path.glob("validation_6x64.safetensors")
    windows = load_file(str(stored))["validation"]
    assert windows.shape == (6, 64)
    assert not torch.equal(windows, test)
    row = peer.measure(model, windows, tmp_path / "validation_6x64_logprobs", 4)  # the same quantized model
    assert val["split"] == "validation"
    assert val["summary"]["as is"]["nll"] == pytest.approx(sum(row["batch_nll"]), rel=1e-5)
    made = stored.stat().st_mtime_ns
    regret = awq_probe.main([*common, "--threads", "1", "--split", "validation", "--as-is-only",
                             "--group-loss", "regret"])  # fmt: skip
    assert stored.stat().st_mtime_ns == made  # reused
    assert regret["group_loss"] == "regret"
    with pytest.raises(ValueError, match="group_loss"):  # handed to awq_lite as it is
        awq_probe.main(
            [*common, "--threads", "1", "--split", "validation", "--as-is-only", "--group-loss", "l1"]
        )


def test_awq_probe_measures_smoothquant_at_the_alpha_asked(tmp_path: Path) -> None:
    """``awq_probe.py --qformat int8_sq --alpha A``: the row is SmoothQuant at that alpha (what
    ``mtq.quantize`` gives with it, not the preset's 1.0), split into the INT8 weights' and the inputs'
    share; AWQ's options are refused for it, and ``--alpha`` for an AWQ row."""
    import awq_probe

    import modelopt_lite.quantization as mtq
    from modelopt_lite.cli.ptq import build_config
    from modelopt_lite.export.layers import unify_shared_scales

    common, model, calib, test = _probe_workdir(tmp_path)
    argv = [*common, "--threads", "1", "--qformat", "int8_sq"]
    half = awq_probe.main([*argv, "--alpha", "0.5"])
    with torch.no_grad():
        cfg = build_config("int8_sq", "none")
        mtq.quantize(
            model, {**cfg, "algorithm": {"method": "smoothquant", "alpha": 0.5}}, list(calib.split(4))
        )
    unify_shared_scales(model)
    row = peer.measure(model, test, tmp_path / "reference_logprobs", 4)
    assert half["alpha"] == 0.5
    assert half["group_loss"] is None
    assert half["summary"]["as is"]["nll"] == pytest.approx(sum(row["batch_nll"]), rel=1e-5)
    assert half["summary"]["inputs off"]["kl"] < half["summary"]["as is"]["kl"]
    preset = awq_probe.main([*argv, "--as-is-only"])
    assert preset["alpha"] is None
    assert preset["summary"]["as is"]["nll"] != pytest.approx(half["summary"]["as is"]["nll"], rel=1e-6)
    with pytest.raises(SystemExit, match="AWQ options"):
        awq_probe.main([*argv, "--group-loss", "regret"])
    with pytest.raises(SystemExit, match="--alpha is smoothquant's"):
        awq_probe.main([*common, "--threads", "1", "--alpha", "0.5"])


def test_awq_probe_bias_share_is_the_inputs_part_of_each_biased_layers_output() -> None:
    """``awq_probe._bias_share``: ``||x W^T||^2 / ||x W^T + b||^2`` per biased linear, small where the bias
    dominates (a large k_proj bias, as Qwen2.5's), absent for layers without a bias."""
    import awq_probe
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, attention_bias=True)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.bias.fill_(100.0)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    seen = {}
    attn.q_proj.register_forward_hook(lambda m, a, o: seen.setdefault("x", a[0].detach()))
    share = awq_probe._bias_share(model, ids)
    assert set(share) == {f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    x = seen["x"].reshape(-1, 64)
    xw = x @ attn.q_proj.weight.detach().t()
    want = float(xw.pow(2).sum() / (xw + attn.q_proj.bias.detach()).pow(2).sum())
    assert share["model.layers.0.self_attn.q_proj"] == pytest.approx(want, rel=1e-5)
    assert share["model.layers.0.self_attn.k_proj"] < 0.01 < share["model.layers.0.self_attn.q_proj"]
