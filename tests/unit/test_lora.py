"""LoRA / QLoRA adapters (peft) on quantized models: the two deployments' arithmetic, either order of
wrapping and quantizing, gradients only to the adapters, exports that reload with the trained logits, the
trainers' lora_config with exact resume, and the bad-input list."""

import copy
import json
import sys

import pytest
import torch
from peft import LoraConfig, PeftModel
from torch import nn
from transformers import AutoModelForCausalLM

import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint
from modelopt_lite.nn import QuantLinear
from modelopt_lite.nn.lora import lora_deploy, lora_layers, set_lora_deploy
from modelopt_lite.training import QATTrainer, QuantizationArguments

from ._models import VOCAB, tiny_llama
from ._training import CountingData, StopAt, cpu_args, step_losses
from .test_export import activations_unquantized

IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def _config(**kw) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, **kw)


def _quantize(model, cfg=None):
    return mtq.quantize(model, cfg or mtq.NVFP4_DEFAULT_CFG, lambda m: m(input_ids=IDS))


def _nonzero_b(model, seed=1):
    """peft starts B at zero (the adapter adds nothing): give every adapter a visible delta."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            w = layer.lora_B["default"].weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.05)
    return model


def _lora_model(deploy="merged", cfg=None, order="quantize_first"):
    base = tiny_llama()
    torch.manual_seed(5)
    if order == "quantize_first":
        model = mtq.add_lora(_quantize(base, cfg), _config(), deploy=deploy)
    else:
        model = mtq.add_lora(base, _config(), deploy=deploy)
        _quantize(model, cfg)
    return _nonzero_b(model)


def _q_proj(model):
    return model.base_model.model.model.layers[0].self_attn.q_proj


@pytest.mark.parametrize("deploy", ["merged", "served"])
def test_either_order_gives_the_same_model_with_quantizers_on_the_base_only(deploy):
    a = _lora_model(deploy, order="quantize_first")
    b = _lora_model(deploy, order="adapters_first")
    for model in (a, b):
        layer = _q_proj(model)
        assert isinstance(layer.base_layer, QuantLinear)
        assert type(layer.lora_A["default"]) is nn.Linear
        assert type(layer.lora_B["default"]) is nn.Linear
        assert lora_deploy(model) == deploy
    amax = {n.replace(".base_layer", ""): q.amax for n, q in mtq.iter_quantizers(a) if q.amax is not None}
    amax_b = {n.replace(".base_layer", ""): q.amax for n, q in mtq.iter_quantizers(b) if q.amax is not None}
    assert amax.keys() == amax_b.keys()
    assert len(amax) > 10
    assert all(torch.equal(amax[k], amax_b[k]) for k in amax)
    assert torch.equal(a(input_ids=IDS).logits, b(input_ids=IDS).logits)


def _manual(layer, x, merged: bool):
    """The layer's function written out: merged Q_in(x) Q_w(W + sBA)^T + b; served Q_in(x) Q_w(W)^T + sBAx."""
    base = layer.base_layer
    a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    delta = (b @ a) * s
    if merged:
        return torch.nn.functional.linear(base.input_quantizer(x), base.weight_quantizer(base.weight + delta))
    out = torch.nn.functional.linear(base.input_quantizer(x), base.weight_quantizer(base.weight))
    return out + (x @ a.t() @ b.t()) * s


@pytest.mark.parametrize("deploy", ["merged", "served"])
def test_the_layer_computes_its_deployment(deploy):
    model = _lora_model(deploy)
    layer = _q_proj(model)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = layer(x)
        torch.testing.assert_close(got, _manual(layer, x, deploy == "merged"), rtol=1e-5, atol=1e-5)
        # the adapter is in the forward: without it the output differs
        other = _manual(layer, x, deploy != "merged")
        assert (got - other).abs().max() > 1e-3
        with model.disable_adapter():
            plain = layer(x)
        assert (got - plain).abs().max() > 1e-3


def test_only_adapters_and_learnable_amax_get_gradients():
    cfg = QuantizationArguments(recipe="INT8_DEFAULT_CFG", learn_amax=True).quantize_config()
    model = _lora_model("merged", cfg=cfg)
    model(input_ids=IDS).logits.square().mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert grads
    assert grads <= trainable
    assert {n for n in trainable if "lora_" not in n and not n.endswith("._amax")} == set()
    assert any(n.endswith("._amax") for n in grads), "learnable amax kept its gradient"
    assert any("lora_A" in n for n in grads)
    assert any("lora_B" in n for n in grads)
    assert all(p.grad is None for n, p in model.named_parameters() if n.endswith("base_layer.weight"))


def test_merge_keeps_the_quantizer_and_the_trained_function():
    model = _lora_model("merged")
    expected = model(input_ids=IDS).logits
    merged = mtq.merge_lora(model)
    assert not isinstance(merged, PeftModel)
    q_proj = merged.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QuantLinear)
    assert q_proj.weight_quantizer.is_enabled
    assert torch.equal(merged(input_ids=IDS).logits, expected)


def test_a_served_adapter_does_not_merge():
    with pytest.raises(ValueError, match=r"trained served.*would change the model"):
        mtq.merge_lora(_lora_model("served"))


def test_switching_the_deployment_changes_the_function():
    model = _lora_model("served")
    served = model(input_ids=IDS).logits
    set_lora_deploy(model, "merged")
    merged = model(input_ids=IDS).logits
    assert (served - merged).abs().max() > 1e-4
    set_lora_deploy(model, "served")
    assert torch.equal(model(input_ids=IDS).logits, served)


def test_merged_export_reloads_with_the_trained_logits(tmp_path):
    model = _lora_model("merged")
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    export_hf_checkpoint(model, export_dir=tmp_path / "out")
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters()), "weights restored"
    assert isinstance(model, PeftModel)
    assert not any(layer.merged for _, layer in lora_layers(model))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert not (tmp_path / "out" / "adapter_config.json").exists()
    with torch.no_grad(), activations_unquantized(model):
        torch.testing.assert_close(loaded(IDS).logits, model(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)


def test_served_export_is_a_quantized_base_and_a_peft_adapter(tmp_path):
    model = _lora_model("served")
    export_hf_checkpoint(model, export_dir=tmp_path / "out")
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(TARGETS)
    base_cfg = json.loads((tmp_path / "out" / "base_model" / "hf_quant_config.json").read_text())
    assert base_cfg["quantization"]["quant_algo"] == "NVFP4"
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "base_model", dtype=torch.float32)
    assert not any("lora" in k for k in base.state_dict())
    loaded = PeftModel.from_pretrained(base, tmp_path / "out")
    with torch.no_grad(), activations_unquantized(model):
        torch.testing.assert_close(loaded(IDS).logits, model(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)
        with loaded.disable_adapter():
            assert (loaded(IDS).logits - model(input_ids=IDS).logits).abs().max() > 1e-3


def test_qlora_on_a_compressed_base_equals_lora_on_the_fake_quant_base():
    pytest.importorskip("torchao")
    fake = _quantize(tiny_llama(), mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    compressed = mtq.compress(copy.deepcopy(fake))
    torch.manual_seed(5)
    lora_fake = _nonzero_b(mtq.add_lora(fake, _config(), deploy="served"))
    torch.manual_seed(5)
    qlora = _nonzero_b(mtq.add_lora(compressed, _config()))  # auto: served on a compressed base
    assert lora_deploy(qlora) == "served"
    torch.testing.assert_close(
        qlora(input_ids=IDS).logits, lora_fake(input_ids=IDS).logits, rtol=0, atol=1e-5
    )
    qlora(input_ids=IDS).logits.square().mean().backward()
    assert {n for n, p in qlora.named_parameters() if p.grad is not None} == {
        n for n, p in qlora.named_parameters() if "lora_" in n
    }
    with pytest.raises(ValueError, match="compressed"):
        mtq.merge_lora(qlora)
    with pytest.raises(ValueError, match=r"compressed.*deploy='served'"):
        mtq.add_lora(
            mtq.compress(_quantize(tiny_llama(), mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)), _config(), "merged"
        )


# ------------------------------------------------------------------------------------------ trainers


def _train(tmp_path, steps=4, resume=None, save_steps=100, **quant):
    args = cpu_args(tmp_path, max_steps=8, save_strategy="steps", save_steps=save_steps)
    quant_args = QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=8, **quant)
    trainer = QATTrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=CountingData(n=64),
        quant_args=quant_args,
        lora_config=None if quant.get("lora") else _config(),
        callbacks=[StopAt(steps)],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_trainer_with_lora_config_trains_only_the_adapters(tmp_path):
    reference = tiny_llama().state_dict()
    trainer = _train(tmp_path)
    model = trainer.model
    assert isinstance(model, PeftModel)
    assert lora_deploy(model) == "merged"
    assert isinstance(_q_proj(model).base_layer, QuantLinear)
    for name, value in model.get_base_model().state_dict().items():
        plain = name.replace(".base_layer", "")
        if plain in reference:
            assert torch.equal(value, reference[plain]), f"{name} changed"
    assert any(layer.lora_B["default"].weight.abs().sum() > 0 for _, layer in lora_layers(model))


def test_trainer_lora_flags_build_the_config(tmp_path):
    trainer = _train(tmp_path, lora=True, lora_r=2, lora_target_modules="o_proj", lora_deploy="served")
    layers = dict(lora_layers(trainer.model))
    assert layers
    assert all(name.endswith("o_proj") for name in layers)
    assert lora_deploy(trainer.model) == "served"
    assert next(iter(layers.values())).r["default"] == 2


def test_qlora_trains_adapters_on_a_compressed_model_in_the_trainer(tmp_path):
    pytest.importorskip("torchao")
    ids = CountingData(n=8).ids
    model = mtq.compress(_quantize(tiny_llama(), mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG))
    packed = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = QATTrainer(
        model=model, args=cpu_args(tmp_path), train_dataset=CountingData(), lora_config=_config()
    )
    trainer.train()
    assert lora_deploy(trainer.model) == "served"
    state = {k.replace(".base_layer", ""): v for k, v in trainer.model.get_base_model().state_dict().items()}
    assert all(torch.equal(state[k], v) for k, v in packed.items()), "the compressed base is untouched"
    assert any(layer.lora_B["default"].weight.abs().sum() > 0 for _, layer in lora_layers(trainer.model))
    assert trainer.model(input_ids=ids).logits.isfinite().all()
    plain = mtq.compress(_quantize(tiny_llama(), mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG))
    with pytest.raises(ValueError, match="QLoRA: lora_config"):
        QATTrainer(model=plain, args=cpu_args(tmp_path), train_dataset=CountingData())


def test_lora_resume_is_exact(tmp_path):
    full = _train(tmp_path / "full", steps=8)
    _train(tmp_path / "split", steps=4, save_steps=4)
    resumed = _train(
        tmp_path / "split", steps=8, save_steps=4, resume=str(tmp_path / "split" / "checkpoint-4")
    )
    assert step_losses(resumed)[-4:] == step_losses(full)[-4:]
    state, state_r = full.model.state_dict(), resumed.model.state_dict()
    assert state.keys() == state_r.keys()
    assert all(torch.equal(state[k], state_r[k]) for k in state)


# ------------------------------------------------------------------------------------------ bad input


def test_bad_input_is_refused_with_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="not found"):
        mtq.add_lora(_quantize(tiny_llama()), LoraConfig(r=4, target_modules=["no_such_layer"]))
    with pytest.raises(ValueError, match=r"lora_dropout=0.1.*deploy='served'"):
        mtq.add_lora(tiny_llama(), LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.1), "merged")
    with pytest.raises(NotImplementedError, match="fused MoE expert parameters"):
        mtq.add_lora(
            tiny_llama(), LoraConfig(r=4, target_modules=[], target_parameters=["mlp.experts.down_proj"])
        )
    with pytest.raises(TypeError, match=r"peft.LoraConfig"):
        mtq.add_lora(tiny_llama(), {"r": 4})
    with pytest.raises(ValueError, match="no peft LoRA linear layer"):
        set_lora_deploy(tiny_llama(), "merged")
    with pytest.raises(ValueError, match="lora_deploy='both'"):
        QuantizationArguments(lora_deploy="both")
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"modelopt_lite\[peft\]"):
        mtq.add_lora(tiny_llama(), _config())


def test_an_adapter_on_an_unquantized_layer_is_named(lib_caplog):
    model = _quantize(tiny_llama())
    mtq.add_lora(model, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert any("lm_head" in r.getMessage() and "unquantized" in r.getMessage() for r in lib_caplog.records)


def _saved_bytes_and_grads(model):
    """Bytes autograd keeps from forward to backward, and the adapters' gradients after backward."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=IDS).logits.square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return sum(saved), grads


@pytest.mark.parametrize("compressed", [False, True])
def test_a_frozen_base_recomputes_its_quantized_weight_in_backward(monkeypatch, compressed):
    if compressed:
        pytest.importorskip("torchao")
    model = _quantize(tiny_llama(), mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    if compressed:
        mtq.compress(model)
    model = _nonzero_b(mtq.add_lora(model, _config(), deploy="served"))
    weights = sum(
        m.quantized_weight().numel() * 4
        for m in model.modules()
        if isinstance(m, QuantLinear) and m.weight_quantizer.is_enabled
    )
    on_bytes, on_grads = _saved_bytes_and_grads(model)
    monkeypatch.setattr(QuantLinear, "_weight_is_frozen", lambda self: False)
    off_bytes, off_grads = _saved_bytes_and_grads(model)
    assert on_grads.keys() == off_grads.keys()
    assert on_grads
    assert all(torch.equal(on_grads[k], off_grads[k]) for k in on_grads), "the same gradients, bit for bit"
    assert off_bytes - on_bytes >= weights, (off_bytes, on_bytes, weights)
