"""Calibration algorithms (SmoothQuant, AWQ, GPTQ, MSE): each lowers the error it targets compared with max
calibration, keeps the function where it only rescales, and runs on fused MoE experts per expert."""

import copy

import pytest
import torch
from torch import nn

import modelopt_lite.quantization as mtq
from modelopt_lite.quantization.algorithms.gptq import gptq_quantize_weight
from modelopt_lite.quantization.calibration.targets import blocks, linear_targets

from ._models import batches, tiny_llama, tiny_qwen3_moe

NVFP4 = mtq.NVFP4_DEFAULT_CFG["quant_cfg"][1]["cfg"]
INT4_BLOCK = {"num_bits": 4, "block_sizes": {-1: 32}}


def _inputs(n=512, dim=64, outliers=(), correlated=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    if correlated:
        basis = torch.randn(dim, dim, generator=g) * torch.logspace(0, -2, dim).unsqueeze(1)
        x = x @ basis
    for c in outliers:
        x[:, c] *= 40.0
    return x


def _layer(seed=0, dim=64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, dim, bias=False)).eval()


def _error(model, reference, x):
    with torch.no_grad():
        y = reference(x)
        return float((model(x) - y).pow(2).sum() / y.pow(2).sum())


def _run(cfg_weight, cfg_input, algorithm, x, seed=0):
    reference = _layer(seed)
    model = copy.deepcopy(reference)
    rules = [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": cfg_weight},
    ]
    if cfg_input is not None:
        rules.append({"quantizer_name": "*input_quantizer", "cfg": cfg_input})
    calib = list(x.split(128))
    mtq.quantize(model, {"quant_cfg": rules, "algorithm": algorithm}, calib)
    return model, reference


def test_smoothquant_moves_activation_outliers_into_the_weights():
    x = _inputs(outliers=(3, 17))
    errors = {}
    for algo in ("max", "smoothquant"):
        model, reference = _run({"num_bits": 8, "axis": 0}, {"num_bits": 8}, algo, x)
        errors[algo] = _error(model, reference, x)
    assert errors["smoothquant"] < 0.5 * errors["max"], errors
    q = model[0].input_quantizer
    assert q.pre_quant_scale.shape == (64,)
    assert q.pre_quant_scale[3] < q.pre_quant_scale[0]  # outlier channels are scaled down
    for _, quantizer in mtq.iter_quantizers(model):
        quantizer.disable()  # pre_quant_scale stays: smoothing alone keeps the function
    assert torch.allclose(model(x), reference(x), rtol=1e-4, atol=1e-4)


def test_awq_lite_keeps_no_smoothing_when_that_is_best():
    x = _inputs()  # no outliers, weights without structure: smoothing should not pay on the sample
    model, reference = _run(INT4_BLOCK, None, "awq_lite", x)
    base, _ = _run(INT4_BLOCK, None, "max", x)
    assert _error(model, reference, x) <= _error(base, reference, x)


def test_smoothquant_shares_one_scale_across_layers_reading_the_same_input():
    model = tiny_llama()
    mtq.quantize(model, mtq.INT8_SMOOTHQUANT_CFG, batches())
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    scales = [attn.q_proj, attn.k_proj, attn.v_proj]
    assert all(torch.equal(m.input_quantizer.pre_quant_scale, attn.q_proj.input_quantizer.pre_quant_scale)
               for m in scales)  # fmt: skip
    assert torch.equal(
        mlp.gate_proj.input_quantizer.pre_quant_scale, mlp.up_proj.input_quantizer.pre_quant_scale
    )
    assert not torch.equal(
        attn.o_proj.input_quantizer.pre_quant_scale, attn.q_proj.input_quantizer.pre_quant_scale
    )


@pytest.mark.parametrize("algorithm", ["awq_lite", "awq_clip", "awq_full", "gptq", "mse"])
def test_weight_algorithms_beat_max_on_int4_blocks(algorithm):
    x = _inputs(outliers=(5, 40), correlated=True)
    base, reference = _run(INT4_BLOCK, None, "max", x)
    model, _ = _run(INT4_BLOCK, None, algorithm, x)
    assert _error(model, reference, x) < _error(base, reference, x)


@pytest.mark.parametrize("algorithm", ["awq_lite", "gptq"])
def test_weight_algorithms_beat_max_on_nvfp4(algorithm):
    x = _inputs(outliers=(5, 40), correlated=True)
    base, reference = _run(NVFP4, None, "max", x)
    model, _ = _run(NVFP4, None, algorithm, x)
    assert _error(model, reference, x) < _error(base, reference, x)


@pytest.mark.parametrize(("cfg", "strict"), [(INT4_BLOCK, True), (NVFP4, False)])
def test_mse_lowers_the_weight_quantization_error(cfg, strict):
    x = _inputs()
    errors = {}
    for algo in ("max", "mse"):
        model, _ = _run(cfg, None, algo, x)
        w = model[0].weight.detach()
        errors[algo] = float((model[0].weight_quantizer(w) - w).pow(2).sum())
    assert errors["mse"] < errors["max"] if strict else errors["mse"] <= errors["max"]


def test_gptq_weights_are_reproduced_exactly_by_fake_quant():
    x = _inputs(correlated=True)
    model, _ = _run(INT4_BLOCK, None, "gptq", x)
    layer = model[0]
    assert torch.equal(layer.weight_quantizer(layer.weight), layer.weight)


def test_gptq_damps_a_singular_hessian_and_zeroes_dead_channels():
    x = _inputs(n=8)  # rank 8 < 64: singular X^T X
    x[:, 7] = 0.0  # a dead input channel
    q = mtq.TensorQuantizer("w", num_bits=4, block_sizes={-1: 32})
    w = torch.randn(16, 64)
    out, scales = gptq_quantize_weight(q, w, 2 * x.t() @ x / 8)
    assert torch.isfinite(out).all()
    assert (out[:, 7] == 0).all()
    assert len(scales) == 2
    act, _ = gptq_quantize_weight(q, w, 2 * x.t() @ x / 8, act_order=True)
    assert torch.isfinite(act).all()


def test_gptq_rejects_formats_it_cannot_handle():
    model = tiny_llama()
    cfg = mtq.get_preset("MXFP4_DEFAULT_CFG") | {"algorithm": "gptq"}
    with pytest.raises(ValueError, match="gptq supports"):
        mtq.quantize(model, cfg, batches())
    assert mtq.quant_state(model) is None


def test_algorithm_options_are_validated():
    x = list(_inputs().split(128))
    for algorithm, match in [({"method": "gptq", "blocksize": 64}, "unknown option"),
                             ({"method": "awq_lite", "alpha_step": 0}, "alpha_step"),
                             ({"method": "smoothquant", "alpha": 2}, "alpha"),
                             ({"method": "mse", "fp8_sweep": True}, "unknown option")]:  # fmt: skip
        cfg = {"quant_cfg": [{"quantizer_name": "*", "cfg": {"num_bits": 8}}], "algorithm": algorithm}
        with pytest.raises((ValueError, NotImplementedError), match=match):
            mtq.quantize(_layer(), cfg, x)


def test_blocks_group_targets_per_transformer_layer():
    model = tiny_llama(layers=3)
    mtq.quantize(model, mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    groups = blocks(linear_targets(model))
    assert [len(g) for g in groups] == [7, 7, 7, 1]  # three layers, then lm_head on its own


@pytest.mark.parametrize("algorithm", ["gptq", "awq_lite", "awq_clip", "mse"])
def test_algorithms_run_per_expert_on_fused_moe(algorithm, lib_caplog):
    model = tiny_qwen3_moe()
    experts = [layer.mlp.experts for layer in model.model.layers]
    before = [e.gate_up_proj.detach().clone() for e in experts]
    hidden = torch.randn(64, 64)
    hidden[:, 5] *= 40.0  # an outlier channel, which AWQ smooths
    route = torch.tensor([[0, 1]]).repeat(64, 1)  # experts 2 and 3 get no token

    def loop(m):
        for e in experts:
            e(hidden, route, torch.full((64, 2), 0.5))

    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*experts*weight_quantizer", "cfg": INT4_BLOCK},
        ],
        "algorithm": algorithm,
    }
    mtq.quantize(model, cfg, loop)
    for e, old in zip(experts, before, strict=True):
        for i in range(e.num_experts):
            q = e.gate_up_proj_weight_quantizers[i]
            assert torch.isfinite(q.amax).all()
            assert (q.amax > 0).all()
        changed = [not torch.equal(e.gate_up_proj[i], old[i]) for i in range(e.num_experts)]
        if algorithm == "gptq":  # the routed experts get GPTQ weights, the idle ones keep theirs
            assert changed == [True, True, False, False]
        if algorithm == "awq_lite":
            assert e.gate_up_proj_input_quantizer.pre_quant_scale.shape == (64,)
        if algorithm == "awq_clip":  # idle experts keep their max amax
            assert torch.equal(
                e.gate_up_proj_weight_quantizers[3].amax,
                mtq.TensorQuantizer(**INT4_BLOCK).calibrate(e.expert_weight("gate_up_proj", 3)).amax,
            )
    if algorithm in ("gptq", "awq_clip"):
        assert any("received no calibration tokens" in r.getMessage() and "8 expert weight" in r.getMessage()
                   for r in lib_caplog.records)  # fmt: skip


def test_groups_come_from_identical_inputs_not_memory_addresses():
    from modelopt_lite.quantization.calibration.calibrate import run_forward_loop
    from modelopt_lite.quantization.calibration.max_calib import calibration_mode
    from modelopt_lite.quantization.calibration.targets import capture, groups

    model = tiny_llama()
    mtq.quantize(model, mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    block = blocks(linear_targets(model))[0]
    with calibration_mode(model), capture(block) as stats:
        run_forward_loop(model, batches())
    names = sorted(sorted(t.name.rsplit(".", 1)[-1] for t in g) for g in groups(block, stats))
    assert names == [["down_proj"], ["gate_proj", "up_proj"], ["k_proj", "q_proj", "v_proj"], ["o_proj"]]


@pytest.mark.parametrize("cfg", [{"num_bits": 4}, {"num_bits": (4, 3)}, {"num_bits": 8, "axis": 0}, NVFP4])
def test_gptq_weights_are_kept_by_fake_quant_in_every_granularity(cfg):
    model, _ = _run(cfg, None, "gptq", _inputs(correlated=True))
    layer = model[0]
    assert torch.equal(layer.weight_quantizer(layer.weight), layer.weight)


def test_awq_full_clips_on_the_smoothed_inputs(monkeypatch):
    from modelopt_lite.quantization.algorithms import awq

    seen = []
    original = awq._clip_target
    monkeypatch.setattr(awq, "_clip_target", lambda t, x, r: (seen.append((t, x)), original(t, x, r))[1])
    x = _inputs(outliers=(5, 40))
    _run(INT4_BLOCK, None, "awq_full", x)
    ((target, sample),) = seen
    scale = target.input_quantizer.pre_quant_scale
    assert scale is not None
    assert torch.allclose(sample, x[: sample.shape[0]] * scale)


def test_awq_lite_group_loss_sums_each_layers_relative_error():
    """A shared scale is judged by each layer's relative output error, so that a layer with large outputs
    (e.g. v_proj) does not decide the scale of its whole group alone."""
    from modelopt_lite.quantization.algorithms import awq

    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(64, 32, bias=False), "b": nn.Linear(64, 32, bias=False)})
    with torch.no_grad():
        model["b"].weight.mul_(100.0)  # outputs 100x larger than a's
    rules = [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": INT4_BLOCK},
    ]
    mtq.quantize(model, {"quant_cfg": rules, "algorithm": "max"})
    group = linear_targets(model)
    x = _inputs(n=256, outliers=(3,))
    s = torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5
    expected = 0.0
    for t in group:
        w = t.weight().detach()
        wq = mtq.TensorQuantizer(**INT4_BLOCK).calibrate(w * s)(w * s)
        y = x @ w.t()
        expected += float(((x / s) @ wq.t() - y).pow(2).sum() / y.pow(2).sum())
    got = awq._group_loss(group, {t.name: x for t in group}, s)
    assert got == pytest.approx(expected, rel=1e-4)


def _biased_group(bias_scale: float = 50.0):
    """Two layers reading one input, ``a`` with a bias far larger than its ``x W^T`` (as Qwen2's k_proj)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(64, 32), "b": nn.Linear(64, 32, bias=False)})
    with torch.no_grad():
        model["a"].bias.normal_().mul_(bias_scale)
    rules = [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": INT4_BLOCK},
    ]
    mtq.quantize(model, {"quant_cfg": rules, "algorithm": "max"})
    return model, linear_targets(model)


def test_awq_group_loss_output_divides_each_error_by_the_layers_whole_output():
    """``group_loss="output"``: a layer's error over ``||x W^T + b||^2`` (its bias included), so a layer
    whose bias dominates its output weighs less; without a bias it is the default's relative error."""
    from modelopt_lite.quantization.algorithms import awq

    _, group = _biased_group()
    x = _inputs(n=256, outliers=(3,))
    samples = {t.name: x for t in group}
    s = torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5
    expected = {"relative": 0.0, "output": 0.0}
    for t in group:
        w, b = t.weight().detach(), t.module.bias
        wq = mtq.TensorQuantizer(**INT4_BLOCK).calibrate(w * s)(w * s)
        err = float(((x / s) @ wq.t() - x @ w.t()).pow(2).sum())
        expected["relative"] += err / float((x @ w.t()).pow(2).sum())
        full = x @ w.t() + (b.detach() if b is not None else 0.0)
        expected["output"] += err / float(full.pow(2).sum())
    for loss, want in expected.items():
        got = awq._group_loss(group, samples, s, awq._group_reference(group, samples, loss))
        assert got == pytest.approx(want, rel=1e-4), loss
    default = awq._group_loss(group, samples, s, awq._group_reference(group, samples))
    assert default == pytest.approx(expected["output"], rel=1e-4)  # the default since 2026-12-07
    assert expected["output"] < 0.5 * expected["relative"]  # the bias made a's term small
    unbiased = [t for t in group if t.module.bias is None]
    assert (
        awq._group_reference(unbiased, samples, "output")["b"][1]
        == awq._group_reference(unbiased, samples, "relative")["b"][1]
    )


def test_awq_group_loss_regret_weighs_each_layer_by_its_own_best_error():
    """``group_loss="regret"``: the joint search minimises the sum over layers of each layer's error divided
    by the smallest error that layer reaches searched alone on the same grid."""
    from modelopt_lite.quantization.algorithms import awq

    _, group = _biased_group(bias_scale=0.0)
    x = _inputs(n=256, outliers=(3, 17))
    samples = {t.name: x for t in group}
    act = x.abs().mean(0)
    wmag = awq._weight_magnitude(group, 32)
    candidates = [torch.ones_like(act)]
    for a, b in awq._exponents(0.25):
        c = act.clamp_min(1e-8).pow(a) / wmag.clamp_min(1e-8).pow(b)
        candidates.append((c / (c.max() * c.min()).sqrt()).clamp(1e-4, 1e4))
    alone = {}
    for t in group:  # each layer's own best over the same candidates (its own weight magnitude)
        wm = awq._weight_magnitude([t], 32)
        own = [torch.ones_like(act)]
        for a, b in awq._exponents(0.25):
            c = act.clamp_min(1e-8).pow(a) / wm.clamp_min(1e-8).pow(b)
            own.append((c / (c.max() * c.min()).sqrt()).clamp(1e-4, 1e4))
        alone[t.name] = min(awq._group_loss([t], samples, c) for c in own)
    want = min(sum(awq._group_loss([t], samples, c) / alone[t.name] for t in group) for c in candidates)
    _, _, got = awq._search(group, samples, act, 0.25, "regret")
    assert got == pytest.approx(want, rel=1e-4)
    _, _, relative = awq._search(group, samples, act, 0.25, "relative")
    assert relative != pytest.approx(got, rel=1e-3)


def test_awq_group_loss_is_validated_and_reaches_the_config_models():
    from modelopt_lite.quantization.config.config_models import AWQLiteCalibConfig

    with pytest.raises(ValueError, match="group_loss"):
        _awq_model(group_loss="l1")
    assert AWQLiteCalibConfig(group_loss="regret").group_loss == "regret"
    with pytest.raises(ValueError, match="group_loss"):
        AWQLiteCalibConfig(group_loss="l1")


def _awq_model(group_scale: str | None = None, per_layer: bool = False, monkeypatch=None, **options):
    import modelopt_lite.quantization.algorithms.awq as awq

    if per_layer:
        monkeypatch.setattr(awq, "groups", lambda targets, stats: [[t] for t in targets])
    cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
    cfg["algorithm"] = {"method": "awq_lite", "alpha_step": 0.1}
    if group_scale is not None:
        cfg["algorithm"]["group_scale"] = group_scale
    cfg["algorithm"].update(options)
    model = tiny_llama(layers=1, hidden=128)
    mtq.quantize(model, cfg, batches())
    return model.model.layers[0]


def test_awq_group_scale_mean_gives_a_group_the_mean_of_its_layers_own_scales(monkeypatch):
    """``group_scale="mean"``: q/k/v (and gate/up) each searched alone, then one scale for the group whose
    ``pre_quant_scale`` is the mean of theirs (the reference's export); ``"joint"`` searches it once."""
    alone = _awq_model(per_layer=True, monkeypatch=monkeypatch).self_attn
    monkeypatch.undo()
    mean = _awq_model("mean").self_attn
    joint = _awq_model().self_attn
    own = [getattr(alone, p).input_quantizer.pre_quant_scale for p in ("q_proj", "k_proj", "v_proj")]
    assert not torch.equal(own[0], own[1]) or not torch.equal(own[1], own[2])  # each layer its own scale
    shared = mean.q_proj.input_quantizer.pre_quant_scale
    for p in ("k_proj", "v_proj"):
        assert torch.equal(getattr(mean, p).input_quantizer.pre_quant_scale, shared)  # deployable: one scale
    assert torch.allclose(shared, torch.stack(own).mean(0), rtol=1e-5)
    searched_once = joint.q_proj.input_quantizer.pre_quant_scale  # (None: the joint search kept s = 1)
    assert searched_once is None or not torch.allclose(searched_once, shared, rtol=1e-3)


def test_awq_group_scale_is_validated():
    with pytest.raises(ValueError, match="group_scale"):
        _awq_model("median")
