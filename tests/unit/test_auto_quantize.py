"""mtq.auto_quantize: the exact solver, the scores (against direct measurements), groups, the result as an
ordinary quantized model (save / restore, summary, the config that reproduces it, export) and bad input."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq
from modelopt_lite.quantization.auto_quantize import solve_assignment

from ._models import batches, tiny_llama, tiny_qwen3_moe

FORMATS = ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"]


def _data(n: int = 3) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": b, "labels": b} for b in batches(n)]


def _forward(model, batch):
    return model(**batch)


def _loss(output, batch):
    return output.loss


def _logits(model, batch):
    return model(**batch).logits


def _search(model, bits=6.0, method="gradient", **kw):
    step = (
        {"forward_step": _forward, "loss_func": _loss} if method == "gradient" else {"forward_step": _logits}
    )
    return mtq.auto_quantize(
        model,
        {"effective_bits": bits},
        kw.pop("formats", FORMATS),
        kw.pop("data", None) or _data(),
        method=method,
        num_calib_steps=2,
        num_score_steps=2,
        **step,
        **kw,
    )


# ------------------------------------------------------------------------------------------------ solver
def _brute(costs, scores, budget):
    best = None
    for choice in itertools.product(*(range(len(r)) for r in costs)):
        if sum(c[j] for c, j in zip(costs, choice, strict=False)) <= budget + 1e-9:
            value = sum(s[j] for s, j in zip(scores, choice, strict=False))
            best = value if best is None else min(best, value)
    return best


def test_solver_is_exact_on_random_instances():
    rng = random.Random(0)
    for _ in range(100):
        groups = rng.randint(1, 6)
        costs = [
            sorted(rng.choice([1, 2, 3, 5, 8, 13]) * rng.randint(1, 4) for _ in range(3))
            for _ in range(groups)
        ]
        scores = [sorted((rng.random() for _ in range(3)), reverse=True) for _ in range(groups)]
        budget = rng.uniform(sum(r[0] for r in costs), sum(r[-1] for r in costs))
        choice, exact = solve_assignment(costs, scores, budget)
        assert exact
        assert sum(c[j] for c, j in zip(costs, choice, strict=False)) <= budget + 1e-9
        assert sum(s[j] for s, j in zip(scores, choice, strict=False)) == pytest.approx(
            _brute(costs, scores, budget)
        )


def test_solver_beats_greedy_where_greedy_fails():
    # upgrading A (cost 6) removes 7, B and C (cost 5 each) remove 5 each; budget 10 above the narrowest.
    # Greedy by score removed per bit takes A first (7/6 > 1) and then fits nothing: total 10. Optimal: B+C.
    costs, scores = [[0, 6], [0, 5], [0, 5]], [[7, 0], [5, 0], [5, 0]]
    choice, exact = solve_assignment(costs, scores, 10)
    assert exact
    assert choice == [0, 1, 1]
    assert solve_assignment(costs, scores, -1) is None


def test_solver_rounds_up_huge_costs_and_stays_feasible():
    costs = [[1_000_003 * 4.5, 1_000_003 * 8], [999_983 * 4.5, 999_983 * 8.0], [7 * 4.5, 7 * 8.0]]
    scores = [[3.0, 1.0], [2.0, 0.0], [5.0, 4.0]]
    budget = (1_000_003 + 999_983 + 7) * 6.25 + 0.3
    choice, exact = solve_assignment(costs, scores, budget)
    assert not exact
    assert sum(c[j] for c, j in zip(costs, choice, strict=False)) <= budget
    # optimal among the assignments whose costs, rounded up to budget / 2**18, fit
    slack = len(costs) * budget / 2**18
    assert sum(s[j] for s, j in zip(scores, choice, strict=False)) <= _brute(costs, scores, budget - slack)


# ------------------------------------------------------------------------------------------------ search
def test_dense_search_groups_budget_and_state():
    model = tiny_llama()
    weights = {n: p.data_ptr() for n, p in model.named_parameters()}
    model, state = _search(model)
    # the weights are the model's own (no copy per format), hooks and requires_grad flags put back
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == weights
    assert all(p.requires_grad for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())
    json.dumps(state)  # plain data
    stats, best = state["candidate_stats"], state["best"]
    assert best["is_satisfied"]
    assert best["exact"]
    assert best["constraints"]["effective_bits"] <= 6.0
    attn = "model.layers.0.self_attn"
    assert stats[f"{attn}.q_proj.quant_recipe"]["module_names"] == [f"{attn}.{p}_proj" for p in "qkv"]
    assert (
        stats["model.layers.0.mlp.gate_proj.quant_recipe"]["module_names"][1] == "model.layers.0.mlp.up_proj"
    )
    for stat in stats.values():
        assert stat["formats"] == [*FORMATS, "NONE"]
        assert stat["scores"][0] >= stat["scores"][1] >= stat["scores"][2] == 0
        assert stat["scores"][0] > 0
    # the chosen formats are in the model, shared within each group
    kinds = {"NVFP4_DEFAULT_CFG": "nvfp4", "FP8_DEFAULT_CFG": "fp8_e4m3", "NONE": "disabled"}
    for name, fmt in best["recipe"].items():
        for module in stats[name]["module_names"]:
            assert kinds[fmt] in model.get_submodule(module).weight_quantizer.extra_repr()
    # the search chose what the solver gives for the stored scores and costs
    names = list(stats)
    choice, _ = solve_assignment([stats[n]["costs"] for n in names], [stats[n]["scores"] for n in names],
                                 state["cost_denominator"] * 6.0 / 16)  # fmt: skip
    assert [stats[n]["formats"][j] for n, j in zip(names, choice, strict=False)] == list(
        best["recipe"].values()
    )
    assert len(set(best["recipe"].values())) > 1  # 6 bits between NVFP4 (4.5) and FP8 (8): a real mix


def test_moe_fused_experts_projections_are_searched_over_all_experts():
    model, state = _search(tiny_qwen3_moe(), bits=5.0, method="kl_div")
    stats = state["candidate_stats"]
    experts = model.model.layers[0].mlp.experts
    for proj in ("gate_up_proj", "down_proj"):
        stat = stats[f"model.layers.0.mlp.experts.{proj}.quant_recipe"]
        assert stat["costs"][-1] == getattr(experts, proj).numel()  # 16 bits / 16 per parameter
        fmt = state["best"]["recipe"][f"model.layers.0.mlp.experts.{proj}.quant_recipe"]
        reprs = {q.extra_repr().split(" amax")[0] for q in getattr(experts, f"{proj}_weight_quantizers")}
        assert len(reprs) == 1  # every expert in the same format
        assert getattr(experts, f"{proj}_input_quantizer").is_enabled == (fmt != "NONE")


def test_disabled_layers_stay_unquantized_and_count_16_bits():
    model, state = _search(tiny_llama(), bits=7.0, disabled_layers="*lm_head*")
    stat = state["candidate_stats"]["lm_head.quant_recipe"]
    assert stat["formats"] == ["NONE"]
    assert stat["disabled"]
    assert not model.lm_head.weight_quantizer.is_enabled
    total = state["cost_denominator"]
    assert total == sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear))
    spent = sum(
        s["costs"][s["formats"].index(state["best"]["recipe"][n])]
        for n, s in state["candidate_stats"].items()
    )
    assert state["best"]["constraints"]["effective_bits"] == pytest.approx(spent / total * 16)
    assert spent / total * 16 <= 7.0
    assert spent >= model.lm_head.weight.numel()  # lm_head at 16 bits is in the numerator


# ------------------------------------------------------------------------------------------------ scores
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _mlp_data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(2)]


def _only(state, group, fmt):
    """The search's own config with ``group`` in ``fmt`` and everything else unquantized."""
    entries = state["candidate_stats"][group]["quant_cfg"][fmt]
    return {"quant_cfg": [{"quantizer_name": "*", "enable": False}, *entries], "algorithm": "max"}


def test_gradient_score_is_the_fisher_estimate():
    data = _mlp_data()
    mse = lambda out, batch: F.mse_loss(out, batch[1], reduction="sum")  # noqa: E731
    _model, state = mtq.auto_quantize(
        _mlp(), {"effective_bits": 6.0}, FORMATS, data, lambda m, b: m(b[0]), mse,
        num_calib_steps=2, num_score_steps=2,
    )  # fmt: skip
    stat = state["candidate_stats"]["2.quant_recipe"]
    for k, fmt in enumerate(FORMATS):
        reference, quantized = (
            _mlp(),
            mtq.quantize(_mlp(), _only(state, "2.quant_recipe", fmt), [b[0] for b in data]),
        )
        expected = 0.0
        for x, y in data:
            hidden = reference[1](reference[0](x)).detach()
            out = reference[2](hidden)
            (grad,) = torch.autograd.grad(F.mse_loss(out, y, reduction="sum"), out)
            with torch.no_grad():
                expected += float((grad * (quantized[2](hidden) - out)).square().sum())
        assert stat["scores"][k] == pytest.approx(
            min(expected, *stat["scores"][:k]) if k else expected, rel=1e-4
        )


def test_kl_div_score_is_the_kl_of_the_model_with_only_that_group_quantized():
    data = _data(2)
    _, state = _search(tiny_llama(), method="kl_div", data=data)
    group = "model.layers.1.mlp.down_proj.quant_recipe"
    reference = tiny_llama()
    quantized = mtq.quantize(tiny_llama(), _only(state, group, "NVFP4_DEFAULT_CFG"), data)
    expected = 0.0
    with torch.no_grad():
        for batch in data:
            p = F.log_softmax(_logits(reference, batch).float(), -1)
            q = F.log_softmax(_logits(quantized, batch).float(), -1)
            expected += float((p.exp() * (p - q)).sum())
    assert state["candidate_stats"][group]["scores"][0] == pytest.approx(expected, rel=1e-3)


# ------------------------------------------------------------------------------------------------ result
def test_result_round_trips_and_its_config_reproduces_it(tmp_path):
    data = _data()
    model, state = _search(tiny_llama(), data=data)
    summary = mtq.print_quant_summary(model)
    assert "auto_quantize NVFP4_DEFAULT_CFG (score" in summary
    assert "auto_quantize FP8_DEFAULT_CFG" in summary
    ids = data[0]["input_ids"]
    with torch.no_grad():
        expected = model(ids).logits
    mto.save(model, tmp_path / "aq.safetensors")
    restored = mto.restore(tiny_llama(), tmp_path / "aq.safetensors")
    config = mtq.get_auto_quantize_config(state)
    again = mtq.quantize(tiny_llama(), config, lambda m: [m(**b) for b in data[:2]])
    with torch.no_grad():
        assert torch.equal(restored(ids).logits, expected)
        assert torch.equal(again(ids).logits, expected)
    assert mtq.print_quant_summary(restored) == summary
    for (name, q), (_, r) in zip(mtq.iter_quantizers(model), mtq.iter_quantizers(again), strict=False):
        assert q.extra_repr() == r.extra_repr(), name
    # solved again for another budget from the stored scores, without the model
    narrow = mtq.get_auto_quantize_config(state, {"effective_bits": 4.5})
    assert all(e["cfg"]["num_bits"] == (2, 1) for e in narrow["quant_cfg"][1:])


def test_mixed_model_exports_as_mixed_precision(tmp_path):
    from modelopt_lite.export import export_hf_checkpoint

    model, state = _search(tiny_llama(), disabled_layers=["*lm_head*"])
    export_hf_checkpoint(model, tmp_path / "out")
    quant = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "MIXED_PRECISION"
    algos = {name: entry["quant_algo"] for name, entry in quant["quantized_layers"].items()}
    chosen = {"NVFP4_DEFAULT_CFG": "NVFP4", "FP8_DEFAULT_CFG": "FP8"}
    for group, fmt in state["best"]["recipe"].items():
        if fmt != "NONE":
            assert algos[group.removesuffix(".quant_recipe")] == chosen[fmt]


# ------------------------------------------------------------------------------------------------ bad input
def _refused(model, match, **kw):
    with pytest.raises((ValueError, TypeError), match=match):
        _search(model, **kw)
    assert not any(True for _ in mtq.iter_quantizers(model))
    assert mtq.quant_state(model) is None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"bits": 4.0}, r"reachable range is \[4\.5000, 16\.0\]"),
        ({"bits": 16.5}, r"reachable range is \[4\.5000, 16\.0\]"),
        ({"bits": 5.5, "disabled_layers": ["*lm_head*"]}, r"reachable range is \[5\.6500, 16\.0\]"),
        ({"formats": ["NVFP5_CFG"]}, r"unknown preset or recipe 'NVFP5_CFG'; presets: \[.*NVFP4_DEFAULT_CFG"),
        ({"formats": ["NVFP4_AWQ_LITE_CFG"]}, r"changes the weights"),
    ],
)
def test_bad_budget_and_formats_are_refused_before_any_work(kw, match):
    bits = kw.pop("bits", 6.0)
    _refused(tiny_llama(), match, bits=bits, **kw)


def test_no_data_is_refused():
    for data, match in (([], "needs data"), (iter(_data()), "read only once")):
        model = tiny_llama()
        with pytest.raises((ValueError, TypeError), match=match):
            mtq.auto_quantize(model, {"effective_bits": 6.0}, FORMATS, data, _forward, _loss)
        assert mtq.quant_state(model) is None
    with pytest.raises(ValueError, match="needs data"):
        mtq.auto_quantize(tiny_llama(), {"effective_bits": 6.0}, FORMATS, None, _forward, _loss)


def test_gradient_method_without_gradients_names_kl_div():
    def no_grad_forward(model, batch):
        with torch.no_grad():
            return model(**batch)

    model = tiny_llama()
    cases = [
        ({"loss_func": lambda out, b: F.cross_entropy(out.logits.mT, b["labels"], reduction="none")},
         "must return a scalar tensor.*kl_div"),
        ({"forward_step": no_grad_forward, "loss_func": _loss}, "has no gradient.*kl_div"),
        ({"forward_step": _forward}, "needs loss_func.*kl_div"),
    ]  # fmt: skip
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            mtq.auto_quantize(
                model, {"effective_bits": 6.0}, FORMATS, _data(), **{"forward_step": _forward, **kw}
            )
        assert mtq.quant_state(model) is None
    with pytest.raises(RuntimeError, match=r"no gradient reached.*kl_div"):
        mtq.auto_quantize(model, {"effective_bits": 6.0}, FORMATS, _data(), _forward,
                          forward_backward_step=lambda m, b: no_grad_forward(m, b))  # fmt: skip


def test_unsupported_reference_options_raise():
    with pytest.raises(mtq.UnsupportedFeatureError, match="checkpoint"):
        mtq.auto_quantize(
            tiny_llama(), {"effective_bits": 6.0}, FORMATS, _data(), _forward, _loss, checkpoint="x"
        )
    with pytest.raises(TypeError, match="search_state"):
        mtq.get_auto_quantize_config({})


# ------------------------------------------------------------------------------------------------ CLI
def test_ptq_cli_searches_the_qformat_candidates_and_exports(tmp_path, lib_caplog):
    from modelopt_lite.cli.ptq import main

    from ._models import word_tokenizer

    word_tokenizer().save_pretrained(tmp_path / "model")
    tiny_llama().save_pretrained(tmp_path / "model")
    (tmp_path / "data.txt").write_text(
        "\n\n".join(" ".join(f"w{(i * 7 + j) % 120}" for j in range(16)) for i in range(8))
    )
    args = ["--pyt_ckpt_path", str(tmp_path / "model"), "--dataset", str(tmp_path / "data.txt"),
            "--calib_seq", "16", "--eval_seq", "16", "--calib_size", "4", "--eval_size", "1",
            "--batch_size", "2", "--qformat", "nvfp4,fp8", "--auto_quantize_bits", "6.0",
            "--kv_cache_qformat", "fp8"]  # fmt: skip
    lib_caplog.set_level("INFO", logger="modelopt_lite")
    assert main([*args, "--export_path", str(tmp_path / "out")]) == 0
    assert "auto_quantize: 5." in lib_caplog.text
    quant = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "MIXED_PRECISION"
    assert {e["quant_algo"] for e in quant["quantized_layers"].values()} == {"NVFP4", "FP8"}
    assert quant["kv_cache_quant_algo"] == "FP8"
    assert main([*args[:-4], "--auto_quantize_bits", "3.0"]) == 2
    assert "reachable range" in lib_caplog.text
    with pytest.raises(SystemExit):
        main([*args[:-5], "nvfp4_awq,fp8", "--auto_quantize_bits", "6.0"])


# ------------------------------------------------------------------------------------------------ trainer
def test_qat_trainer_with_auto_quantize_bits_trains_a_mixed_precision_model(tmp_path):
    from modelopt_lite.training import QATTrainer, QuantizationArguments

    from ._training import CountingData, cpu_args

    with pytest.raises(ValueError, match="set auto_quantize_bits"):
        QuantizationArguments(recipe="NVFP4_DEFAULT_CFG,FP8_DEFAULT_CFG")
    quant = QuantizationArguments(
        recipe="NVFP4_DEFAULT_CFG,FP8_DEFAULT_CFG", auto_quantize_bits=6.0, calib_size=4, calib_batch_size=2
    )
    trainer = QATTrainer(
        model=tiny_llama(),
        args=cpu_args(tmp_path, max_steps=1),
        train_dataset=CountingData(),
        quant_args=quant,
    )
    trainer.train()
    weights = {
        name: q.num_bits
        for name, q in trainer.model.named_modules()
        if name.endswith("weight_quantizer") and isinstance(q, mtq.TensorQuantizer) and q.is_enabled
    }
    assert set(weights.values()) == {(2, 1), (4, 3)}, weights  # NVFP4 and FP8 layers: a mixed model
    assert mtq.quant_state(trainer.model) is not None  # an ordinary quantized model (save, export)
