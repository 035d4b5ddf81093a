"""mtq.quantize on tiny Llama, Qwen3 and GPT-2 models built in code."""

import pytest
import torch
from torch import nn

import modelopt_lite.quantization as mtq
from modelopt_lite.nn import QuantModule, SequentialQuantizer, TensorQuantizer

from ._models import BUILDERS, batches, tiny_gpt2, tiny_llama, tiny_qwen3_moe

PRESETS = sorted(mtq.PRESETS)


def _config(name):
    cfg = mtq.get_preset(name)
    algo = cfg.get("algorithm")
    algo = algo["method"] if isinstance(algo, dict) else algo
    return cfg, algo


def _enabled(model):
    return {n: q for n, q in mtq.iter_quantizers(model) if q.is_enabled}


@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_quantizes_calibrates_and_trains(arch, preset):
    model = BUILDERS[arch]()
    data = batches()
    cfg, _ = _config(preset)
    mtq.quantize(model, cfg, data)
    enabled = _enabled(model)
    weights = [n for n in enabled if n.endswith("weight_quantizer")]
    assert weights, "no weight quantizer enabled"
    assert not any("lm_head" in n for n in enabled)
    assert not any("bmm" in n for n in enabled)
    n_linear = sum(isinstance(m, QuantModule) and hasattr(m, "weight_quantizer") for m in model.modules())
    assert len(weights) == n_linear - 1  # every linear but lm_head
    inputs_on = "*input_quantizer" in str([r for r in cfg["quant_cfg"] if "cfg" in r])
    assert any(n.endswith("input_quantizer") for n in enabled) == inputs_on
    summary = mtq.print_quant_summary(model)
    assert f"{len(enabled)} enabled" in summary
    model.train()
    ids = data[0]
    out = model(ids, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads
    assert all(torch.isfinite(g).all() for g in grads)
    quantized = next(
        m for m in model.modules() if isinstance(m, QuantModule) and hasattr(m, "weight_quantizer")
    )
    assert quantized.weight.grad is not None
    assert quantized.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_disabled_quantizers_give_bit_identical_outputs(arch):
    reference = BUILDERS[arch]()
    model = BUILDERS[arch]()
    ids = batches()[0]
    expected = reference(ids).logits
    mtq.quantize(model, mtq.with_kv_cache(mtq.NVFP4_DEFAULT_CFG, "FP8_KV_CFG"), batches())
    assert not torch.equal(model(ids).logits, expected)
    for name, _ in mtq.iter_quantizers(model):
        mtq.disable_quantizer(model, name)
    assert torch.equal(model(ids).logits, expected)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_kv_cache_quantizers_run_inside_attention(attn):
    model = tiny_llama(attn=attn)
    ids = batches()[0]
    base = model(ids).logits
    mtq.quantize(
        model,
        mtq.with_kv_cache({"quant_cfg": [{"quantizer_name": "*", "enable": False}]}, "FP8_KV_CFG"),
        batches(),
    )
    assert model.config._attn_implementation == f"modelopt_lite_{attn}"
    attn_mod = model.model.layers[0].self_attn
    assert attn_mod.k_bmm_quantizer.amax.numel() == 1
    assert attn_mod.v_bmm_quantizer.amax > 0
    quantized = model(ids).logits
    assert not torch.equal(quantized, base)
    assert (quantized - base).abs().max() < 0.05
    model.set_attn_implementation(attn)  # switching away would skip the KV quantizers: refuse loudly
    with pytest.raises(RuntimeError, match="bypass"):
        model(ids)


def test_kv_quantization_matches_between_sdpa_and_eager():
    outs = []
    for attn in ("sdpa", "eager"):
        model = tiny_llama(attn=attn)
        mtq.quantize(model, mtq.with_kv_cache(mtq.FP8_DEFAULT_CFG, "FP8_KV_CFG"), batches())
        outs.append((model(batches()[0]).logits, model.model.layers[1].self_attn.k_bmm_quantizer.amax))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-4)
    assert torch.allclose(outs[0][1], outs[1][1], rtol=1e-5)


def test_kv_configs_work_on_qwen3_moe_attention():
    model = tiny_qwen3_moe()
    mtq.quantize(model, mtq.with_kv_cache(mtq.FP8_DEFAULT_CFG, "NVFP4_KV_CFG"), batches())
    assert model.model.layers[0].self_attn.v_bmm_quantizer.spec.name == "nvfp4"
    assert torch.isfinite(model(batches()[0]).logits).all()


def test_conv1d_quantizes_like_a_linear_with_the_transposed_weight():
    model = tiny_gpt2()
    mtq.quantize(model, mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    conv = model.transformer.h[0].attn.c_attn
    w = conv.weight.detach()  # (in, out)
    lin = nn.Linear(w.shape[0], w.shape[1])
    lin.weight.data = w.t().contiguous()
    expected = TensorQuantizer(num_bits=4, block_sizes={-1: 128}).calibrate(lin.weight)(lin.weight)
    assert torch.equal(conv.quantized_weight(), expected.t())
    assert conv.weight_quantizer.amax.shape[0] == w.shape[1] * ((w.shape[0] + 127) // 128)


def test_w4a8_weight_quantizer_is_sequential():
    model = tiny_llama()
    cfg = mtq.get_preset("W4A8_AWQ_BETA_CFG") | {"algorithm": "max"}
    mtq.quantize(model, cfg, batches())
    wq = model.model.layers[0].mlp.up_proj.weight_quantizer
    assert isinstance(wq, SequentialQuantizer)
    assert [q.spec.name for q in wq] == ["int4", "fp8_e4m3"]
    w = model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(wq(w), wq[1](wq[0](w)))
    assert torch.equal(wq[1].amax, wq[0](w).abs().amax())


def test_sequential_stage_is_calibrated_on_the_previous_stage_output():
    attrs = [
        mtq.quantizer_attributes(mtq.MXFP4_DEFAULT_CFG["quant_cfg"][1]["cfg"]),
        mtq.quantizer_attributes({"num_bits": 8}),
    ]
    seq = SequentialQuantizer("w", attrs)
    w = torch.randn(64, 64)
    seq.calibrate(w)
    first = seq[0](w)
    assert not torch.equal(first.abs().amax(), w.abs().amax())
    assert torch.equal(seq[1].amax, first.abs().amax())


def test_explain_and_unmatched_rule_warning(lib_caplog):
    model = tiny_llama()
    cfg = mtq.get_preset("FP8_DEFAULT_CFG")
    cfg["quant_cfg"].append({"quantizer_name": "*no_such_layer*", "enable": False})
    mtq.quantize(model, cfg, batches())
    warnings = [r.getMessage() for r in lib_caplog.records if r.levelname == "WARNING"]
    assert any("*no_such_layer*" in w for w in warnings)
    assert not any("vision_tower" in w for w in warnings)  # standard exclusions may match nothing
    text = mtq.explain(model, "lm_head.weight_quantizer")
    assert "#0 '*': enable=False" in text
    assert "#1 '*weight_quantizer'" in text
    assert "'*lm_head*'" in text


def test_weights_calibrate_from_weights_not_from_data():
    a, b = tiny_llama(), tiny_llama()
    mtq.quantize(a, mtq.FP8_DEFAULT_CFG, batches(seed=1))
    mtq.quantize(b, mtq.FP8_DEFAULT_CFG, batches(seed=2))
    qa, qb = a.model.layers[0].mlp.down_proj, b.model.layers[0].mlp.down_proj
    assert torch.equal(qa.weight_quantizer.amax, qb.weight_quantizer.amax)
    assert torch.equal(qa.weight_quantizer.amax, qa.weight.abs().amax())
    assert not torch.equal(qa.input_quantizer.amax, qb.input_quantizer.amax)


def test_forward_loop_may_be_a_dataloader_of_dicts():
    model = tiny_llama()
    data = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)} for ids in batches()]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, loader)
    mtq.check_calibrated(model)


def test_fold_weight_keeps_outputs():
    model = tiny_llama()
    mtq.quantize(model, mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    ids = batches()[0]
    before = model(ids).logits
    mtq.fold_weight(model)
    assert not model.model.layers[0].mlp.up_proj.weight_quantizer.is_enabled
    assert torch.equal(model(ids).logits, before)


def test_user_registered_wrapper_and_overridden_forward_warning(lib_caplog):
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.weight

    class QuantScale(QuantModule):
        def _setup(self):
            self.input_quantizer = TensorQuantizer()

        def forward(self, x):
            return super().forward(self.input_quantizer(x))

    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    mtq.register(Scale, QuantScale)
    try:
        model = nn.Sequential(Scale(), MyLinear(4, 4))
        mtq.quantize(
            model,
            {"quant_cfg": [{"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8}}]},
            [torch.randn(2, 4)],
        )
        assert model[0].input_quantizer.amax is not None
        assert any("MyLinear" in r.getMessage() for r in lib_caplog.records if r.levelname == "WARNING")
        with pytest.raises(ValueError, match="already has the wrapper"):
            mtq.register(Scale, QuantScale)
    finally:
        mtq.unregister(Scale)


# ----------------------------------------------------------------------------- bad input
def test_nothing_to_quantize():
    with pytest.raises(ValueError, match="no module that modelopt_lite can quantize"):
        mtq.quantize(nn.Sequential(nn.Embedding(4, 4), nn.ReLU()), mtq.INT8_DEFAULT_CFG)


def test_quantizing_twice_with_another_config_raises():
    model = tiny_llama()
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, batches())
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, batches())  # same config: calibrates again
    with pytest.raises(ValueError, match="already quantized with a different config"):
        mtq.quantize(model, mtq.FP8_DEFAULT_CFG, batches())


def test_failed_quantize_leaves_the_model_as_it_was():
    model, reference = tiny_llama(), tiny_llama()
    model.train()
    ids = batches()[0]

    def broken(m):
        m(ids)
        raise KeyError("data ran out")

    with pytest.raises(KeyError, match="data ran out"):
        mtq.quantize(model, mtq.with_kv_cache(mtq.INT8_DEFAULT_CFG, "FP8_KV_CFG"), broken)
    assert not any(isinstance(m, QuantModule) for m in model.modules())
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
    assert model.config._attn_implementation == "sdpa"
    assert mtq.quant_state(model) is None
    assert model.training  # the caller's mode is kept
    model.eval()
    assert torch.equal(model(ids).logits, reference(ids).logits)
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, [ids])  # any config works on the retry
    mtq.check_calibrated(model)


def test_calibration_restores_training_mode_and_quantizer_modes():
    model = tiny_llama()
    model.train()
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, batches())
    assert model.training
    assert all(m.training for m in model.modules())
    for _, q in mtq.iter_quantizers(model):
        assert q._quant_enabled
        assert not q._calib_enabled


def test_bad_algorithms_fail_before_touching_the_model():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"unknown calibration algorithm 'magic' \(available: \['awq_clip'"):
        mtq.calibrate(model, "magic", batches())
    with pytest.raises(ValueError, match="needs a 'method'"):
        mtq.calibrate(model, {"mthod": "max"}, batches())
    with pytest.raises(ValueError, match="'awq_lite' needs calibration data"):
        mtq.quantize(model, mtq.INT4_AWQ_CFG)  # no forward_loop: rolled back
    assert not any(isinstance(m, QuantModule) for m in model.modules())
    with pytest.raises(ValueError, match="smoothquant needs layers whose input and weight quantizers"):
        mtq.quantize(model, mtq.get_preset("INT8_WEIGHT_ONLY_CFG") | {"algorithm": "smoothquant"}, batches())
    assert mtq.quant_state(model) is None


def test_sequential_input_quantizer_is_refused_by_search_algorithms_and_rolled_back():
    # (max calibrates a sequential input quantizer: tests/unit/test_reference_round3_quantizer.py)
    model = tiny_llama()
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
            {"quantizer_name": "*input_quantizer", "cfg": [{"num_bits": 8}, {"num_bits": (4, 3)}]},
        ],
        "algorithm": "smoothquant",
    }
    with pytest.raises(NotImplementedError, match=r"smoothquant.*sequential.*input_quantizer"):
        mtq.quantize(model, cfg, batches())
    assert mtq.quant_state(model) is None


def test_enable_only_rules_toggle_without_touching_attributes():
    model = tiny_llama()
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 4, "block_sizes": {-1: 32}}},
            {"quantizer_name": "*weight_quantizer", "enable": False},
            {"quantizer_name": "*mlp*weight_quantizer", "enable": True},
        ]
    }
    mtq.quantize(model, cfg)
    up = model.model.layers[0].mlp.up_proj.weight_quantizer
    assert up.is_enabled
    assert up.spec.name == "int4"
    assert up.amax.shape == (128 * 64 // 32, 1)
    q = model.model.layers[0].self_attn.q_proj.weight_quantizer
    assert not q.is_enabled
    assert q.num_bits == 4


def test_a_cfg_rule_replaces_every_attribute():
    model = tiny_llama()
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 4, "axis": 0, "narrow_range": True}},
            {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8}},
        ]
    }
    mtq.quantize(model, cfg)
    q = model.model.layers[0].mlp.up_proj.weight_quantizer
    assert (q.num_bits, q.axis, q.narrow_range) == (8, None, False)
    assert q.amax.numel() == 1


def test_explain_numbers_rules_as_written():
    model = tiny_llama()
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "default": {"enable": False}}}
    mtq.quantize(model, cfg)
    text = mtq.explain(model, "model.layers.0.mlp.up_proj.weight_quantizer")
    assert "#1 'default'" in text
    assert "#0 '*weight_quantizer'" in text
    mtq.set_quantizer_by_cfg(model, [{"quantizer_name": "*up_proj.weight_quantizer", "enable": False}])
    assert "#2 '*up_proj.weight_quantizer': enable=False" in mtq.explain(
        model, "*layers.0.mlp.up_proj.weight*"
    )
    mtq.quantize(model, cfg)  # the original config still counts as the same config


def test_zero_and_missing_amax_are_reported():
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.zero_()
    with pytest.raises(RuntimeError, match=r"layers\.0\.mlp\.up_proj\.weight_quantizer \(amax is zero"):
        mtq.quantize(model, mtq.INT8_WEIGHT_ONLY_CFG)
    cfg = mtq.get_preset("INT8_WEIGHT_ONLY_CFG") | {"algorithm": None}
    with pytest.raises(RuntimeError, match="algorithm is None"):
        mtq.quantize(tiny_llama(), cfg)


def test_nan_activations_name_the_quantizer():
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.input_quantizer: .*NaN"):
        mtq.quantize(model, mtq.INT8_DEFAULT_CFG, batches())


def test_activation_quantizers_need_data_and_must_receive_it():
    with pytest.raises(ValueError, match="need calibration data"):
        mtq.quantize(tiny_llama(), mtq.FP8_DEFAULT_CFG)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8}},
        ]
    }
    with pytest.raises(RuntimeError, match=r"received no data.*1\.input_quantizer"):
        mtq.quantize(model, cfg, lambda m: m[0](torch.randn(2, 4)))


def test_uncalibrated_quantizer_is_reported_by_name():
    model = tiny_llama()
    mtq.quantize(model, mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    model.model.layers[0].mlp.up_proj.weight_quantizer.amax = None
    with pytest.raises(RuntimeError, match=r"layers\.0\.mlp\.up_proj\.weight_quantizer \(no amax\)"):
        mtq.check_calibrated(model)


def test_casting_the_model_keeps_amax_in_float32():
    model = tiny_llama()
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, batches())
    q = model.model.layers[0].mlp.up_proj.input_quantizer
    amax = q.amax.clone()
    model.to(torch.bfloat16)
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert q.amax.dtype == torch.float32
    assert torch.equal(q.amax, amax)
    assert model(batches()[0]).logits.dtype == torch.bfloat16


def _head_widths(model, calibrate):
    seen = []
    handle = model.lm_head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    calibrate(model)
    handle.remove()
    return seen


def test_calibration_skips_the_unquantized_output_layer_on_all_but_the_last_position():
    """An iterable forward_loop on a causal LM whose lm_head is not quantized (the presets exclude it)
    computes the logits of the last position only, with every calibrated amax as with full logits; a
    quantized lm_head still sees every position."""
    data = batches(2, seq=16)
    cfg = mtq.get_preset("NVFP4_DEFAULT_CFG")
    fast, full = tiny_llama(), tiny_llama()
    assert _head_widths(fast, lambda m: mtq.quantize(m, cfg, data)) == [1, 1]
    assert _head_widths(full, lambda m: mtq.quantize(m, cfg, lambda mm: [mm(b) for b in data])) == [16, 16]
    amax = {n: q.amax for n, q in mtq.iter_quantizers(full) if q.amax is not None}
    assert amax
    assert all(torch.equal(q.amax, amax[n]) for n, q in mtq.iter_quantizers(fast) if n in amax)
    with_head = {**cfg, "quant_cfg": [*cfg["quant_cfg"], {"quantizer_name": "*lm_head*", "enable": True}]}
    assert _head_widths(tiny_llama(), lambda m: mtq.quantize(m, with_head, data)) == [16, 16]
