"""Fused MoE experts: per-expert quantizers on grouped_mm and eager, across model families."""

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
)

import modelopt_lite.quantization as mtq
from modelopt_lite.moe import QuantExperts, coverage_report

from ._models import VOCAB, batches, tiny_llama4, tiny_qwen3_moe

COMMON = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
COMMON |= {"vocab_size": VOCAB, "max_position_embeddings": 64}


def _build(cls, cfg_cls, **kw):
    def make(seed=0, experts_implementation=None):
        torch.manual_seed(seed)
        extra = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
        return cls(cfg_cls(**COMMON, **kw, **extra)).eval()

    return make


FAMILIES = {
    "qwen3_moe": lambda seed=0, experts_implementation=None: _qwen3(seed, experts_implementation),
    "mixtral": _build(
        MixtralForCausalLM, MixtralConfig, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
    ),
    "olmoe": _build(
        OlmoeForCausalLM, OlmoeConfig, intermediate_size=32, num_experts=4, num_experts_per_tok=2
    ),
    "deepseek_v3": _build(
        DeepseekV3ForCausalLM,
        DeepseekV3Config,
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_shared_experts=1,
    ),
    "gpt_oss": _build(
        GptOssForCausalLM,
        GptOssConfig,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


def _qwen3(seed, experts_implementation):
    model = tiny_qwen3_moe(seed=seed)
    if experts_implementation is not None:
        model.set_experts_implementation(experts_implementation)
    return model


def _experts(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantExperts)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_expert_of_every_layer_is_quantized(family):
    model = FAMILIES[family]()
    original = {
        n: (m.gate_up_proj.detach().clone(), m.down_proj.detach().clone())
        for n, m in model.named_modules()
        if hasattr(m, "gate_up_proj")
    }
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, batches(n=4))
    experts = _experts(model)
    assert len(experts) == 2
    for name, module in experts:
        for proj in ("gate_up_proj", "down_proj"):
            quantizers = getattr(module, f"{proj}_weight_quantizers")
            assert len(quantizers) == module.num_experts
            for i, q in enumerate(quantizers):
                assert q.is_enabled, (name, i)
                assert torch.isfinite(q.amax).all(), (name, i)
                assert q.amax > 0, (name, i)
                assert torch.equal(q.amax, module.expert_weight(proj, i).abs().amax())
            w = module.quantized_weight(proj)
            assert w.shape == getattr(module, proj).shape
            for i in range(module.num_experts):
                assert not torch.equal(w[i], getattr(module, proj)[i]), f"{name}.{proj}[{i}] unchanged"
        assert torch.equal(module.gate_up_proj, original[name][0])
        assert module.gate_up_proj_input_quantizer.amax is not None
        assert module.down_proj_input_quantizer.amax is not None
    assert torch.isfinite(model(batches()[0]).logits).all()


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_disabled_quantizers_are_bit_identical(family, impl):
    reference = FAMILIES[family](experts_implementation=impl)
    model = FAMILIES[family](experts_implementation=impl)
    ids = batches()[0]
    expected = reference(ids).logits
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, batches())
    assert model.config._experts_implementation == impl
    enabled = [q for _, q in mtq.iter_quantizers(model) if q.is_enabled]
    assert not torch.equal(model(ids).logits, expected)
    for q in enabled:
        q.disable()
    assert torch.equal(model(ids).logits, expected)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_grouped_mm_and_eager_agree(family):
    runs = {}
    for impl in ("grouped_mm", "eager"):
        model = FAMILIES[family]()
        mtq.quantize(
            model,
            mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG | {"quant_cfg": mtq.NVFP4_DEFAULT_CFG["quant_cfg"]},
            batches(),
            experts_implementation=impl,
        )
        amax = {n: q.amax for n, q in mtq.iter_quantizers(model) if q.amax is not None}
        runs[impl] = (model(batches()[0]).logits, amax)
    assert runs["grouped_mm"][1].keys() == runs["eager"][1].keys()
    for name, amax in runs["grouped_mm"][1].items():
        if "weight_quantizer" in name:
            assert torch.equal(amax, runs["eager"][1][name]), name
        else:
            assert torch.allclose(amax, runs["eager"][1][name], rtol=1e-5), name
    assert torch.allclose(runs["grouped_mm"][0], runs["eager"][0], atol=1e-4)


def test_eager_choice_is_an_all_eager_run():
    """With experts_implementation='eager' nothing runs on grouped_mm: results equal a model that was
    eager from the start, byte for byte."""
    a = FAMILIES["qwen3_moe"]()
    b = FAMILIES["qwen3_moe"](experts_implementation="eager")
    mtq.quantize(a, mtq.NVFP4_DEFAULT_CFG, batches(), experts_implementation="eager")
    mtq.quantize(b, mtq.NVFP4_DEFAULT_CFG, batches())
    assert a.config._experts_implementation == b.config._experts_implementation == "eager"
    for (na, qa), (nb, qb) in zip(mtq.iter_quantizers(a), mtq.iter_quantizers(b), strict=True):
        assert na == nb
        assert (qa.amax is None and qb.amax is None) or torch.equal(qa.amax, qb.amax)
    ids = batches()[0]
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_qat_gradients_reach_every_expert_through_grouped_mm():
    model = FAMILIES["qwen3_moe"]()
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, batches())
    assert model.config._experts_implementation == "grouped_mm"
    model.train()
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).loss.backward()
    for _, module in _experts(model):
        for proj in ("gate_up_proj", "down_proj"):
            grad = getattr(module, proj).grad
            assert grad is not None
            routed = module.tokens_per_expert > 0
            assert (grad.flatten(1).abs().sum(1)[routed] > 0).all()


def test_switching_experts_implementation_afterwards_raises():
    model = FAMILIES["qwen3_moe"]()
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, batches())
    model.set_experts_implementation("batched_mm")
    with pytest.raises(RuntimeError, match="bypass the expert quantizers"):
        model(batches()[0])


def test_coverage_report_and_experts_without_tokens(lib_caplog):
    model = FAMILIES["qwen3_moe"]()
    nvfp4 = mtq.NVFP4_DEFAULT_CFG["quant_cfg"][1]["cfg"]
    cfg = {
        "quant_cfg": [{"quantizer_name": "*", "enable": False}, {"quantizer_name": "*experts*", "cfg": nvfp4}]
    }
    hidden = torch.randn(16, 64)
    route = torch.tensor([[0, 1]]).repeat(16, 1)  # experts 2 and 3 get no token

    def loop(m):
        for layer in m.model.layers:
            layer.mlp.experts(hidden, route, torch.full((16, 2), 0.5))

    mtq.quantize(model, cfg, loop)
    report = coverage_report(model)
    assert report["model.layers.0.mlp.experts"]["experts_without_tokens"] == [2, 3]
    assert report["model.layers.1.mlp.experts"]["tokens_per_expert"] == [16, 16, 0, 0]
    assert any("received no calibration tokens" in r.getMessage() for r in lib_caplog.records)
    experts = model.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj_weight_quantizers[3].amax, experts.gate_up_proj[3].abs().amax())
    assert experts.gate_up_proj_input_quantizer.amax == hidden.abs().amax()


def test_empty_batch_and_unmatched_expert_patterns(lib_caplog):
    model = FAMILIES["qwen3_moe"]()
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, batches())
    experts = model.model.layers[0].mlp.experts
    empty = torch.zeros(0, 64)
    assert experts(empty, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)).shape == (0, 64)
    other = FAMILIES["qwen3_moe"]()
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*self_attn*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
        ]
    }
    mtq.quantize(other, cfg)
    assert any(
        "fused experts" in r.getMessage() and "layers.0.mlp.experts" in r.getMessage()
        for r in lib_caplog.records
        if r.levelname == "WARNING"
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_input_observer_sees_each_experts_rows_on_both_paths(family):
    seen = {}
    for impl in ("grouped_mm", "eager"):
        model = FAMILIES[family]()
        mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, batches(), experts_implementation=impl)
        experts = model.model.layers[1].mlp.experts
        rows: dict = {}
        experts.input_observer = lambda proj, e, x, rows=rows: rows.setdefault((proj, e), []).append(
            x.detach()
        )
        experts.reset_coverage()
        model(batches()[0])
        seen[impl] = {k: torch.cat(v) for k, v in rows.items()}
        for e, count in enumerate(experts.tokens_per_expert.tolist()):
            for proj in ("gate_up_proj", "down_proj"):
                assert seen[impl].get((proj, e), torch.zeros(0, 1)).shape[0] == count, (impl, proj, e)
    assert seen["grouped_mm"].keys() == seen["eager"].keys()
    for key, x in seen["grouped_mm"].items():
        y = seen["eager"][key]
        assert x.shape == y.shape, key
        # the same rows, possibly in another order within the expert
        assert torch.allclose(x.sum(1).sort().values, y.sum(1).sort().values, atol=1e-4), key


def test_llama4_text_experts_have_an_explicit_wrapper(lib_caplog):
    from modelopt_lite.moe import QuantLlama4TextExperts

    model, reference = tiny_llama4(), tiny_llama4()
    ids = batches()[0]
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, batches())
    experts = model.model.layers[0].feed_forward.experts
    assert isinstance(experts, QuantLlama4TextExperts)
    for i, q in enumerate(experts.down_proj_weight_quantizers):
        assert torch.equal(q.amax, experts.down_proj[i].abs().amax())
    assert not any("Llama4Router" in r.getMessage() for r in lib_caplog.records)  # excluded anyway
    on = [q for _, q in mtq.iter_quantizers(model) if q.is_enabled]
    assert not torch.equal(model(ids).logits, reference(ids).logits)
    for q in on:
        q.disable()
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_expert_classes_without_a_wrapper_are_an_error():
    class Experts3D(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 8, 8))
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(torch.einsum("eij,bj->bi", self.w, x))

    with pytest.raises(ValueError, match=r"no wrapper.*Experts3D"):
        mtq.quantize(Experts3D(), mtq.INT8_WEIGHT_ONLY_CFG)


def test_expert_classes_with_2d_weights_are_caught_too():
    class DbrxLikeExpertGLU(torch.nn.Module):  # experts stored as (experts * inter, hidden) matrices
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(4 * 8, 8))

        def forward(self, x):
            return x @ self.w1.t()

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), DbrxLikeExpertGLU())
    with pytest.raises(ValueError, match=r"no wrapper.*DbrxLikeExpertGLU"):
        mtq.quantize(model, mtq.INT8_WEIGHT_ONLY_CFG)
