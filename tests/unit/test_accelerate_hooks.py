"""Quantizers run when accelerate's hooks replace ``forward`` on the instance (``device_map`` dispatch,
CPU / disk offload), whether the hooks were added before or after quantization; mtq.quantize, training,
fold and export on a model with a decoder layer offloaded to disk."""

from __future__ import annotations

import pytest
import torch
from accelerate import cpu_offload
from accelerate.hooks import remove_hook_from_module
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.quantization.insertion import remove_quantizers
from modelopt_lite.training import QATTrainer, QuantizationArguments

from ._models import batches, tiny_llama
from ._training import CountingData, cpu_args, step_losses

CFG = "FP8_DEFAULT_CFG"
DATA = batches(n=2, batch=2, seq=8)
# layer 1 lives on disk (its parameters are on the meta device outside its forward)
DEVICE_MAP = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "lm_head": "cpu",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama().save_pretrained(path)
    return path


def _offloaded(saved, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        saved, device_map=DEVICE_MAP, offload_folder=str(tmp_path / "offload"), dtype=torch.float32
    ).eval()
    q_proj = model.model.layers[1].self_attn.q_proj
    assert q_proj.weight.is_meta
    assert "forward" in q_proj.__dict__
    return model


def _plain(saved):
    return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()


def _loop(model):
    for x in DATA:
        model(x)


def _quantizers_that_ran(model, inputs) -> tuple[set[str], set[str]]:
    """(names of the enabled quantizers, names of those that ran during one forward)."""
    enabled = {q.name for _, q in mtq.iter_quantizers(model) if q.is_enabled}
    ran: set[str] = set()
    handles = [
        m.register_forward_hook(lambda mod, *_: ran.add(mod.name))
        for m in model.modules()
        if isinstance(m, TensorQuantizer)
    ]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for h in handles:
            h.remove()
    return enabled, ran


def _amax(model) -> dict[str, torch.Tensor]:
    return {n: q.amax for n, q in mtq.iter_quantizers(model) if q.is_enabled}


def test_device_map_with_disk_offload_quantize_calibrate_train_export(saved, tmp_path):
    plain = mtq.quantize(_plain(saved), CFG, _loop)
    model = mtq.quantize(_offloaded(saved, tmp_path), CFG, _loop)

    enabled, ran = _quantizers_that_ran(model, DATA[0])
    assert len(enabled) == 28
    assert ran >= enabled, f"bypassed: {sorted(enabled - ran)}"
    got, want = _amax(model), _amax(plain)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    with torch.no_grad():
        assert torch.equal(model(DATA[1]).logits, plain(DATA[1]).logits)

    # QAT steps on both, updating the parameters that live on the CPU (accelerate reloads the disk layer's
    # weights from its offload folder in every forward, so they cannot train); the disk layer's quantizers
    # run in every step and the two models stay identical
    names = {n for n, p in model.named_parameters() if not p.is_meta}
    assert len(names) < len(dict(model.named_parameters()))
    losses = _train(model, names)
    assert losses == _train(plain, names)
    assert losses[-1] < losses[0]
    enabled, ran = _quantizers_that_ran(model, DATA[0])
    assert ran >= enabled

    # the export reads the disk layer's weights through its hook: the same tensors as the plain model's
    ours = load_file(export_hf_checkpoint(model, tmp_path / "ours").export_dir / "model.safetensors")
    ref = load_file(export_hf_checkpoint(plain, tmp_path / "ref").export_dir / "model.safetensors")
    assert ours.keys() == ref.keys()
    assert "model.layers.1.mlp.down_proj.weight_scale" in ours
    for key in ref:
        assert torch.equal(ours[key].float(), ref[key].float()), key


def _train(model, names: set[str], steps: int = 4) -> list[float]:
    params = [p for n, p in model.named_parameters() if n in names]
    opt = torch.optim.SGD(params, lr=0.1)
    model.train()
    losses = []
    for step in range(steps):
        x = DATA[step % len(DATA)]
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    return losses


def test_fold_weight_writes_back_to_the_offloaded_copy(saved, tmp_path):
    model = mtq.quantize(_offloaded(saved, tmp_path), CFG, _loop)
    plain = mtq.quantize(_plain(saved), CFG, _loop)
    mtq.fold_weight(model)
    mtq.fold_weight(plain)
    with torch.no_grad():
        assert torch.equal(model(DATA[1]).logits, plain(DATA[1]).logits)
    assert not model.model.layers[1].mlp.down_proj.weight_quantizer.is_enabled


def test_hooks_added_after_quantization_and_removal(saved):
    model = mtq.quantize(_plain(saved), CFG, _loop)
    with torch.no_grad():
        want = model(DATA[1]).logits
    cpu_offload(model, execution_device="cpu")  # every module's tensors offloaded, hooks on every module
    enabled, ran = _quantizers_that_ran(model, DATA[0])
    assert ran >= enabled
    with torch.no_grad():
        assert torch.equal(model(DATA[1]).logits, want)
    remove_hook_from_module(model, recurse=True)
    remove_quantizers(model)
    attn = model.model.layers[0].self_attn
    assert type(attn) is LlamaAttention
    assert "forward" not in attn.__dict__


def test_revert_rebinds_a_hooked_forward_to_the_original_class(saved, tmp_path):
    model = mtq.quantize(_offloaded(saved, tmp_path), CFG, _loop)
    remove_quantizers(model)
    q_proj = model.model.layers[1].self_attn.q_proj
    assert type(q_proj) is nn.Linear
    assert q_proj._old_forward.__func__ is nn.Linear.forward
    with torch.no_grad():
        assert torch.equal(model(DATA[1]).logits, _plain(saved)(DATA[1]).logits)


def test_calibration_error_names_a_forward_replaced_after_quantizers_were_inserted():
    # (a forward replaced before mtq.quantize runs between the quantizers: test_reference_round3.py)
    model = tiny_llama()

    def loop(m):
        down = m.model.layers[0].mlp.down_proj
        down.forward = lambda x: x @ down.weight.t()  # set on the quantized layer: skips its quantizers
        _loop(m)

    with pytest.raises(RuntimeError, match=r"(?s)received no data.*down_proj: forward replaced"):
        mtq.quantize(model, CFG, loop)


def test_qat_trainer_on_a_model_with_a_disk_layer(saved, tmp_path):
    model = _offloaded(saved, tmp_path)
    trainer = QATTrainer(
        model=model,
        args=cpu_args(tmp_path / "out"),
        train_dataset=CountingData(),
        quant_args=QuantizationArguments(recipe=CFG, calib_size=8),
    )
    trainer.train()
    assert len(step_losses(trainer)) == 4
    assert model.model.layers[1].mlp.down_proj.input_quantizer.amax is not None
    enabled, ran = _quantizers_that_ran(model, DATA[0])
    assert ran >= enabled


@pytest.mark.parametrize("cfg", ["INT4_AWQ_CFG", "INT8_SMOOTHQUANT_CFG"])
def test_search_algorithms_refuse_offloaded_weights_and_leave_the_model_as_it_was(saved, tmp_path, cfg):
    model = _offloaded(saved, tmp_path)
    with pytest.raises(NotImplementedError, match="load the model without offloading"):
        mtq.quantize(model, cfg, _loop)
    assert not any(True for _ in mtq.iter_quantizers(model))


def test_mse_calibrates_offloaded_weights_like_the_plain_model(saved, tmp_path):
    cfg = {**mtq.get_preset("INT8_DEFAULT_CFG"), "algorithm": "mse"}
    model = mtq.quantize(_offloaded(saved, tmp_path), cfg, _loop)
    plain = mtq.quantize(_plain(saved), cfg, _loop)
    with torch.no_grad():
        assert torch.equal(model(DATA[1]).logits, plain(DATA[1]).logits)
