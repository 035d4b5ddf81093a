"""learn_amax: the amax of a static INT / FP8 quantizer as a trainable parameter (LSQ gradient, clipped
straight-through input gradient), through the trainers' param group, checkpoints and export."""

import pytest
import torch
from safetensors.torch import load_file

import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint
from modelopt_lite.formats import (
    E2M1_VALUES,
    fake_quant,
    fake_quant_learnable,
    minifloat_round,
    resolve_format,
)
from modelopt_lite.formats.rounding import E4M3
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.quantization import iter_quantizers
from modelopt_lite.training import QATTrainer, QuantizationArguments
from modelopt_lite.training.qat_trainer import learnable_amax_parameters

from ._models import batches, tiny_llama, tiny_qwen3_moe
from ._training import CountingData, StopAt, cpu_args, step_losses

assert len(E2M1_VALUES) == 8


def _lsq_expect(x: torch.Tensor, amax: torch.Tensor, kind: str, bits=8, block=None):
    """Independent LSQ formulation, differentiated by autograd: v = clamp(x * qmax / a, lo, hi),
    q = v + (round(v) - v).detach(), out = q * a / qmax.
    Returns (d loss / d x, d loss / d amax, g) for loss = sum(out * g)."""
    x = x.detach().clone().requires_grad_(True)
    a = amax.detach().clone().requires_grad_(True)
    if kind == "int":
        qmax, lo, hi = 2 ** (bits - 1) - 1, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1

        def rnd(v):
            return torch.round(v)
    else:
        qmax, lo, hi = 448.0, -448.0, 448.0

        def rnd(v):
            return minifloat_round(v, E4M3, signed=True)

    xb = x if block is None else x.reshape(-1, block)
    ab = a if block is None else a.reshape(-1, 1)
    v = torch.clamp(xb * qmax / ab, lo, hi)
    q = v + (rnd(v) - v).detach()
    out = (q * ab / qmax).reshape(x.shape)
    g = torch.linspace(-1, 1, x.numel()).reshape(x.shape)
    (out * g).sum().backward()
    return x.grad, a.grad, g


@pytest.mark.parametrize(
    ("spec_kwargs", "kind", "bits", "block", "amax_of"),
    [
        ({"num_bits": 8}, "int", 8, None, lambda x: x.abs().amax() * 0.6),
        ({"num_bits": 8, "axis": 0}, "int", 8, None, lambda x: x.abs().amax(dim=1, keepdim=True) * 0.7),
        ({"num_bits": 4, "block_sizes": {-1: 16}}, "int", 4, 16,
         lambda x: x.reshape(-1, 16).abs().amax(1, True) * 0.8),
        ({"num_bits": (4, 3)}, "fp8", None, None, lambda x: x.abs().amax() * 0.5),
        ({"num_bits": (4, 3), "axis": 0}, "fp8", None, None,
         lambda x: x.abs().amax(dim=1, keepdim=True) * 0.9),
    ],
)  # fmt: skip
def test_gradients_equal_an_independent_lsq_computation(spec_kwargs, kind, bits, block, amax_of):
    torch.manual_seed(0)
    spec = resolve_format(**spec_kwargs)
    x = torch.randn(8, 64)
    amax = amax_of(x)
    exp_gx, exp_ga, g = _lsq_expect(x, amax, kind, bits, block)
    xr, ar = x.clone().requires_grad_(True), amax.clone().requires_grad_(True)
    out = fake_quant_learnable(xr, spec, ar)
    assert torch.equal(out.detach(), fake_quant(x, spec, amax))  # the forward is the ordinary fake quant
    out.backward(g)
    assert ar.grad.shape == amax.shape
    assert (ar.grad != 0).all()
    torch.testing.assert_close(ar.grad, exp_ga, rtol=1e-4, atol=1e-5)
    # g inside the clipping range, 0 where clipped (the expectation's chain rule multiplies by
    # qmax / a * a / qmax, one ulp off 1)
    assert torch.equal(xr.grad == 0, exp_gx == 0)
    assert (xr.grad == 0).any()
    torch.testing.assert_close(xr.grad, exp_gx, rtol=1e-6, atol=0)


def test_int8_lower_edge_is_minus_128_steps():
    # INT8's grid reaches -128 / 127 * amax: an input between -amax and that edge is not clipped
    x = torch.tensor([-1.005, -1.2, 0.5, 1.2], requires_grad=True)
    amax = torch.tensor(1.0, requires_grad=True)
    fake_quant_learnable(x, resolve_format(8), amax).backward(torch.ones(4))
    assert torch.equal(x.grad, torch.tensor([1.0, 0.0, 1.0, 0.0]))


def test_the_amax_of_a_quantizer_trains_and_moves():
    torch.manual_seed(0)
    q = TensorQuantizer("layer.weight_quantizer", num_bits=4, axis=0, learn_amax=True)
    w = torch.randn(16, 32)
    q.calibrate(w)
    assert [n for n, _ in q.named_parameters()] == ["_amax"]
    start = q.amax.detach().clone()
    opt = torch.optim.Adam(q.parameters(), lr=1e-2)
    for _ in range(30):  # LSQ on the weight alone: minimise the quantization error by moving the scale
        opt.zero_grad()
        loss = ((q(w) - w) ** 2).sum()
        loss.backward()
        opt.step()
    assert q.amax.grad is not None
    assert not torch.allclose(q.amax.detach(), start)
    err = lambda a: ((fake_quant(w, q.spec, a) - w) ** 2).sum()  # noqa: E731
    assert err(q.amax.detach()) < 0.95 * err(start)  # max calibration is not MSE-optimal for INT4


def test_learn_amax_refused_where_nothing_is_learnable_naming_the_quantizer():
    nvfp4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
    with pytest.raises(
        ValueError, match=r"model.layers.0.mlp.down_proj.input_quantizer: learn_amax=True: nvfp4"
    ):
        TensorQuantizer("model.layers.0.mlp.down_proj.input_quantizer", **nvfp4, learn_amax=True)
    with pytest.raises(ValueError, match=r"q: learn_amax=True: .*dynamic"):
        TensorQuantizer("q", num_bits=(4, 3), block_sizes={-1: None, "type": "dynamic"}, learn_amax=True)
    with pytest.raises(ValueError, match="mxfp4"):
        TensorQuantizer("q", num_bits=(2, 1), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)},
                        learn_amax=True)  # fmt: skip


def test_toggling_learn_amax_keeps_the_value_and_dtype_moves_keep_float32():
    q = TensorQuantizer("q", num_bits=8)
    q.amax = 2.5
    q.learn_amax = True
    assert isinstance(q.learnable_amax, torch.nn.Parameter)
    assert q.learnable_amax.shape == (1,)  # FSDP2 shards no scalar parameter
    assert q.amax.shape == ()
    assert q.amax.item() == 2.5
    q.to(torch.bfloat16)
    assert q.amax.dtype == torch.float32
    assert isinstance(q.learnable_amax, torch.nn.Parameter)
    restored = TensorQuantizer("q", num_bits=8, learn_amax=True)
    restored.allocate_buffers(q.buffer_shapes())
    restored.load_state_dict(q.state_dict())
    assert restored.amax.shape == ()
    assert restored.amax.item() == 2.5
    q.learn_amax = False
    assert not isinstance(q.amax, torch.nn.Parameter)
    assert q.amax.item() == 2.5
    assert list(q.parameters()) == []


REFERENCE_LEARN_AMAX = {  # written for the reference library: INT8 weights per channel, inputs per tensor
    "quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0, "learn_amax": True}},
        {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8, "axis": None, "learn_amax": True}},
        {"quantizer_name": "*lm_head*", "enable": False},
    ],
    "algorithm": "max",
}


def test_a_reference_config_with_learn_amax_trains_every_amax():
    model = tiny_llama()
    mtq.quantize(model, REFERENCE_LEARN_AMAX, batches())
    params = learnable_amax_parameters(model)
    enabled = [n for n, q in iter_quantizers(model) if q.is_enabled]
    assert len(params) == len(enabled) == 2 * 14
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params.values())


def _trainer(tmp_path, quant_args, steps=6, resume=None, save_steps=100, model=None):
    """``steps`` of a 6-step schedule (a shorter run stops early, so that the learning rates agree)."""
    args = cpu_args(tmp_path, max_steps=max(steps, 6), save_strategy="steps", save_steps=save_steps,
                    weight_decay=0.1)  # fmt: skip
    trainer = QATTrainer(model=model or tiny_llama(), args=args, train_dataset=CountingData(n=64),
                         quant_args=quant_args, callbacks=[StopAt(steps)])  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return trainer


INT4_LEARN = QuantizationArguments(
    recipe="INT4_BLOCKWISE_WEIGHT_ONLY_CFG", calib_size=8, learn_amax=True, amax_lr_multiplier=10.0
)


def test_trainer_puts_amax_in_its_own_group_and_trains_it(tmp_path):
    trainer = _trainer(tmp_path, INT4_LEARN)
    params = learnable_amax_parameters(trainer.model)
    assert len(params) == 14
    groups = [
        g for g in trainer.optimizer.param_groups if any(p is params[n] for n in params for p in g["params"])
    ]
    assert len(groups) == 1
    assert groups[0]["weight_decay"] == 0.0
    assert {id(p) for p in groups[0]["params"]} == {id(p) for p in params.values()}
    assert groups[0]["initial_lr"] == pytest.approx(1e-3 * 10.0)
    assert not any(n in trainer.get_decay_parameter_names(trainer.model) for n in params)
    # every learned amax moved away from its calibrated start (the same recipe on the untrained model)
    start = mtq.quantize(tiny_llama(), INT4_LEARN.quantize_config())
    starts = {n: q.amax for n, q in iter_quantizers(start) if q.amax is not None}
    learned = {n: q.amax.detach() for n, q in iter_quantizers(trainer.model) if q.amax is not None}
    assert starts.keys() == learned.keys()
    assert len(learned) == 14
    assert all(not torch.allclose(starts[n], learned[n]) for n in learned)


def test_resume_with_learnable_amax_is_exact(tmp_path):
    full = _trainer(tmp_path / "full", INT4_LEARN, steps=6)
    first = _trainer(tmp_path / "split", INT4_LEARN, steps=3, save_steps=3)
    assert step_losses(first) == step_losses(full)[:3]
    resumed = _trainer(
        tmp_path / "split", INT4_LEARN, steps=6, resume=str(tmp_path / "split" / "checkpoint-3")
    )
    assert step_losses(resumed)[-3:] == step_losses(full)[-3:]
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert any(k.endswith("weight_quantizer._amax") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert isinstance(resumed.model.model.layers[0].mlp.down_proj.weight_quantizer.amax, torch.nn.Parameter)


def test_amax_that_goes_non_positive_stops_training_naming_it(tmp_path):
    args = QuantizationArguments(recipe="INT4_BLOCKWISE_WEIGHT_ONLY_CFG", calib_size=8, learn_amax=True,
                                 amax_lr_multiplier=1e6)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"learnable amax .*_amax went to .* lower QuantizationArguments"):
        _trainer(tmp_path, args, steps=4)


def test_export_equals_export_of_the_same_amax_set_by_calibration(tmp_path):
    quant = QuantizationArguments(
        recipe="FP8_DEFAULT_CFG", calib_size=8, learn_amax=True, amax_lr_multiplier=2.0
    )
    trainer = _trainer(tmp_path / "run", quant, steps=4)
    learned = trainer.model
    plain = tiny_llama()
    plain.load_state_dict(
        {k: v for k, v in learned.state_dict().items() if "quantizer" not in k}, strict=False
    )
    mtq.quantize(plain, "FP8_DEFAULT_CFG", batches())
    for (name, q), (name2, q2) in zip(iter_quantizers(learned), iter_quantizers(plain), strict=True):
        assert name == name2
        if q.amax is not None:
            assert q.learnable_amax is not None
            assert q2.learnable_amax is None
            q2.amax = q.amax.detach()
    export_hf_checkpoint(learned, export_dir=tmp_path / "a", dtype=torch.float32)
    export_hf_checkpoint(plain, export_dir=tmp_path / "b", dtype=torch.float32)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    start = tiny_llama()
    mtq.quantize(start, "FP8_DEFAULT_CFG", batches())
    q0 = start.model.layers[0].self_attn.q_proj.input_quantizer.amax
    assert not torch.equal(q0, learned.model.layers[0].self_attn.q_proj.input_quantizer.amax.detach())


def test_learnable_amax_on_fused_moe_experts(tmp_path):
    model = tiny_qwen3_moe()
    quant = QuantizationArguments(recipe="INT4_BLOCKWISE_WEIGHT_ONLY_CFG", calib_size=8, learn_amax=True,
                                  experts_implementation="grouped_mm", amax_lr_multiplier=10.0)  # fmt: skip
    experts = model.model.layers[0].mlp.experts
    trainer = _trainer(tmp_path, quant, steps=3, model=model)
    params = learnable_amax_parameters(trainer.model)
    expert_params = [n for n in params if ".experts." in n]
    assert len(expert_params) == 2 * 2 * 4  # layers x (gate_up, down) x experts
    assert isinstance(experts.down_proj_weight_quantizers[3].amax, torch.nn.Parameter)


def test_quantization_arguments_bad_input():
    with pytest.raises(
        ValueError, match=r"calib_algorithm='awq' is unknown \(known: max, smoothquant, awq_lite"
    ):
        QuantizationArguments(calib_algorithm="awq")
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match=r"amax_lr_multiplier=.* must be a positive number"):
            QuantizationArguments(amax_lr_multiplier=bad)


def test_calib_algorithm_replaces_the_recipes(tmp_path):
    args = QuantizationArguments(recipe="INT4_BLOCKWISE_WEIGHT_ONLY_CFG", calib_algorithm="mse", calib_size=8)
    assert args.quantize_config().algorithm_name == "mse"
    assert (
        QuantizationArguments(recipe="INT4_BLOCKWISE_WEIGHT_ONLY_CFG").quantize_config().algorithm_name
        == "max"
    )
    trainer = _trainer(tmp_path, args, steps=1)
    assert mtq.quant_state(trainer.model).config.algorithm_name == "mse"
