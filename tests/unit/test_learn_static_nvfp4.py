"""Learnable static NVFP4 block scales (``learn_amax=True`` on ``NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG``'s
weights, the reference's tied LSQ): the forward is the static fake quant bit for bit, the gradients are the
LSQ formula written out here, the trainer trains them (also alone, ``trainable_params``), a resume is exact
and the export holds the learned scales (its reload computes the trained model)."""

import pytest
import torch

import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint, load_hf_checkpoint
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.quantization import iter_quantizers
from modelopt_lite.training import QATTrainer, QuantizationArguments
from modelopt_lite.training.qat_trainer import learnable_amax_parameters

from ._models import batches, tiny_llama
from ._training import CountingData, StopAt, cpu_args, step_losses
from .test_nvfp4_static import STATIC, _e2m1, expected_static

RECIPE = "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG"
LEARN = QuantizationArguments(recipe=RECIPE, calib_size=4, learn_amax=True, amax_lr_multiplier=0.5)


def _expected_grads(x, amax, global_amax, grad_out):
    """Tied LSQ on static NVFP4, from its definition: S = fp8(amax / 6 on the grid 448 / (global / 6)) per
    block, out = S * e2m1(x / S); straight-through E2M1 (gradient to x where |x / S| <= 6) and FP8 casts
    (dS / d amax = 1 / 6, none where amax / 6 saturates the grid); none for blocks whose S is zero."""
    rows, g = x.double().reshape(-1, 16), grad_out.double().reshape(-1, 16)
    grid = 448.0 / (global_amax.double() / 6.0)
    on_grid = amax.double().reshape(-1, 1) / 6.0 * grid
    s = on_grid.clamp(max=448.0).float().to(torch.float8_e4m3fn).double() / grid
    zero, saturated = s == 0, on_grid > 448.0
    v = rows / torch.where(zero, 1.0, s)
    inside = (v.abs() <= 6.0) & ~zero
    q = _e2m1(v.abs().float()).double() * v.sign()
    d = torch.where(inside, q - v, q) / 6.0
    d = torch.where(zero | saturated, 0.0, d)
    return (g * inside).reshape(x.shape), (d * g).sum(-1, keepdim=True).reshape(amax.shape)


def _quantizer():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 64, generator=g)
    w[2, 16:32] = 0.0  # an all-zero block
    q = TensorQuantizer({**STATIC, "learn_amax": True}).calibrate(w)
    with torch.no_grad():  # some blocks clip (amax below their max), some saturate (above the global amax)
        factors = torch.tensor([0.6, 1.0, 1.3, 0.9]).repeat(q.amax.numel() // 4).reshape(q.amax.shape)
        q.amax.mul_(factors)
        q.amax[9] = 1e-7  # a block scale that rounds to zero
    return w, q


def test_forward_is_the_static_fake_quant_and_gradients_are_the_lsq_formula():
    w, q = _quantizer()
    assert isinstance(q.amax, torch.nn.Parameter)
    x = w.clone().requires_grad_(True)
    out = q(x)
    expected = expected_static(w, q.amax.detach(), q.global_amax, 448.0)
    assert torch.equal(out, expected)
    plain = TensorQuantizer(STATIC)
    plain.amax, plain.global_amax = q.amax.detach(), q.global_amax
    assert torch.equal(out, plain(w))  # the same forward as the non-learned quantizer
    grad_out = torch.randn(w.shape, generator=torch.Generator().manual_seed(4))
    gx, ga = torch.autograd.grad(out, [x, q.amax], grad_out)
    ex, ea = _expected_grads(w, q.amax.detach(), q.global_amax, grad_out)
    assert torch.equal(gx, ex.float())
    torch.testing.assert_close(ga.double(), ea, rtol=1e-5, atol=1e-6)
    saturated = (q.amax.detach() > q.global_amax).reshape(-1)
    assert saturated.any()
    assert (ga.reshape(-1)[saturated] == 0).all()
    assert ga.reshape(-1)[9] == 0
    assert (ga.reshape(-1)[~saturated] != 0).sum() >= 0.8 * (~saturated).sum()
    assert not q.global_amax.requires_grad


def test_an_optimizer_step_on_the_block_amax_changes_the_fake_quant():
    w, q = _quantizer()
    before = q(w).detach().clone()
    opt = torch.optim.SGD([q.amax], lr=0.05)
    target = torch.randn(w.shape, generator=torch.Generator().manual_seed(5))
    ((q(w) - target) ** 2).sum().backward()
    opt.step()
    assert not torch.equal(q(w), before)


def test_learn_amax_reaches_the_static_nvfp4_weights_of_the_recipe():
    config = LEARN.quantize_config()
    model = mtq.quantize(tiny_llama(layers=1), config, batches(n=1))
    wq = model.model.layers[0].mlp.down_proj.weight_quantizer
    assert wq.spec.static_nvfp4
    assert isinstance(wq.amax, torch.nn.Parameter)
    assert model.model.layers[0].mlp.down_proj.input_quantizer.learnable_amax is None  # dynamic: nothing
    params = learnable_amax_parameters(model)
    assert len(params) == 7
    assert all(n.endswith("weight_quantizer._amax") for n in params)
    ids = batches(n=1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params.values())


def _trainer(tmp_path, quant_args, steps=4, resume=None, save_steps=100):
    args = cpu_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=save_steps, learning_rate=1e-3)
    trainer = QATTrainer(model=tiny_llama(layers=1), args=args, train_dataset=CountingData(n=32),
                         quant_args=quant_args, callbacks=[StopAt(steps)])  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _start(quant_args):
    return mtq.quantize(tiny_llama(layers=1), quant_args.quantize_config(), None)


def test_the_trainer_learns_the_block_scales_and_fused_siblings_share_the_global_amax(tmp_path):
    trainer = _trainer(tmp_path, LEARN)
    layer = trainer.model.model.layers[0]
    amax = {id(p) for p in learnable_amax_parameters(trainer.model).values()}
    groups = [g for g in trainer.optimizer.param_groups if amax & {id(p) for p in g["params"]}]
    assert len(groups) == 1
    assert {id(p) for p in groups[0]["params"]} == amax
    assert len(amax) == 7
    assert groups[0]["initial_lr"] == pytest.approx(5e-4)
    ref = QATTrainer(model=tiny_llama(layers=1), args=cpu_args(tmp_path / "r"),
                     train_dataset=CountingData(n=32), quant_args=LEARN)  # fmt: skip
    ref.quantize_model()  # the calibrated start of the same run
    start = dict(iter_quantizers(ref.model))
    for name, q in iter_quantizers(trainer.model):
        if q.learnable_amax is not None:
            assert not torch.equal(q.amax.detach(), start[name].amax.detach()), name
            assert torch.equal(q.global_amax, start[name].global_amax)  # not learned
    attn = layer.self_attn
    assert attn.q_proj.weight_quantizer.global_amax == attn.k_proj.weight_quantizer.global_amax
    assert attn.q_proj.weight_quantizer.global_amax == attn.v_proj.weight_quantizer.global_amax


def test_scale_only_training_keeps_the_weights(tmp_path):
    quant = QuantizationArguments(recipe=RECIPE, calib_size=4, learn_amax=True, amax_lr_multiplier=0.5,
                                  trainable_params=["*weight_quantizer._amax"])  # fmt: skip
    trainer = _trainer(tmp_path, quant)
    start = tiny_llama(layers=1).state_dict()
    trained = trainer.model.state_dict()
    assert all(torch.equal(trained[k], v) for k, v in start.items())  # every weight as it was
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == 7
    amax = [v for k, v in trained.items() if k.endswith("weight_quantizer._amax")]
    assert len(amax) == 7
    assert step_losses(trainer)[-1] != step_losses(trainer)[0]


def test_trainable_params_errors(tmp_path):
    with pytest.raises(ValueError, match="mutually exclusive"):
        QuantizationArguments(recipe=RECIPE, trainable_params=["*_amax"], frozen_params=["*embed*"])
    with pytest.raises(ValueError, match="non-empty list of parameter-name patterns"):
        QuantizationArguments(recipe=RECIPE, trainable_params=[])
    quant = QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=4, trainable_params=["*_amax"])
    with pytest.raises(ValueError, match=r"pattern\(s\) \['\*_amax'\] match no parameter"):
        _trainer(tmp_path, quant)


def test_resume_is_exact(tmp_path):
    full = _trainer(tmp_path / "full", LEARN, steps=4)
    _trainer(tmp_path / "split", LEARN, steps=2, save_steps=2)
    resumed = _trainer(tmp_path / "split", LEARN, steps=4, resume=str(tmp_path / "split" / "checkpoint-2"))
    assert step_losses(resumed)[-2:] == step_losses(full)[-2:]
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert sum(k.endswith("weight_quantizer._amax") for k in a) == 7
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert isinstance(resumed.model.model.layers[0].mlp.up_proj.weight_quantizer.amax, torch.nn.Parameter)


def test_export_holds_the_learned_scales_and_reloads_to_the_trained_model(tmp_path):
    model = _trainer(tmp_path / "run", LEARN).model.eval()
    ids = batches(n=1)[0]
    with torch.no_grad():
        trained = model(input_ids=ids).logits
        weights = {n: m.weight_quantizer(m.weight).detach().clone() for n, m in model.named_modules()
                   if hasattr(m, "weight_quantizer") and m.weight_quantizer.is_enabled}  # fmt: skip
    export_hf_checkpoint(model, export_dir=tmp_path / "export", dtype=torch.float32)
    with torch.no_grad():  # the export changed nothing in the trained model (siblings already unified)
        assert torch.equal(model(input_ids=ids).logits, trained)
    reloaded = load_hf_checkpoint(tmp_path / "export", dtype=torch.float32, activations="fake").eval()
    state = reloaded.state_dict()
    for name, w in weights.items():  # the dequantized weights are the trained fake-quant weights
        torch.testing.assert_close(state[f"{name}.weight"], w, rtol=2.0**-21, atol=0.0)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)
