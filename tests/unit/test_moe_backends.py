"""Quantized fused experts keep transformers' backend names (``eager``, ``grouped_mm``) and apply their
quantizers on whichever the config names: before or after quantizing, after a switch, after a reload."""

import logging

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq
from modelopt_lite.moe import QuantExperts

from ._models import batches, tiny_qwen3_moe

IDS = batches()[0]


def _quantized(impl=None, seed=0):
    model = tiny_qwen3_moe(seed=seed)
    if impl is not None:
        model.set_experts_implementation(impl)
    return mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, batches())


def _calls(model):
    return sum(m.forward_calls for m in model.modules() if isinstance(m, QuantExperts))


def _logits(model):
    """Logits of IDS, checking that the forward went through every quantized experts module."""
    before = _calls(model)
    with torch.no_grad():
        out = model(IDS).logits
    assert _calls(model) == before + 2  # two MoE layers
    return out


@pytest.fixture(scope="module")
def unquantized_logits():
    with torch.no_grad():
        return tiny_qwen3_moe()(IDS).logits


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_each_standard_name_is_kept_and_quantizes(impl, unquantized_logits):
    model = _quantized(impl)
    assert model.config._experts_implementation == impl
    assert all(
        m.config._experts_implementation == impl for m in model.modules() if isinstance(m, QuantExperts)
    )
    quantized = _logits(model)
    assert not torch.allclose(quantized, unquantized_logits, atol=1e-3)
    for _, q in mtq.iter_quantizers(model):
        q.disable()
    assert torch.equal(_logits(model), unquantized_logits)


@pytest.mark.parametrize("first", ["grouped_mm", "eager"])
def test_switching_backends_after_quantizing_both_ways(first, unquantized_logits):
    other = "eager" if first == "grouped_mm" else "grouped_mm"
    model = _quantized(first)
    reference = _logits(model)
    model.set_experts_implementation(other)
    assert model.config._experts_implementation == other
    switched = _logits(model)
    assert torch.allclose(switched, reference, atol=1e-4, rtol=0)  # within float rounding
    assert not torch.allclose(switched, unquantized_logits, atol=1e-3)  # the quantizers ran
    model.set_experts_implementation(first)
    assert torch.equal(_logits(model), reference)


def test_amax_calibrated_on_either_backend_agree():
    a, b = _quantized("grouped_mm"), _quantized("eager")
    for (name, qa), (_, qb) in zip(mtq.iter_quantizers(a), mtq.iter_quantizers(b), strict=True):
        if qa.amax is not None:
            assert torch.allclose(qa.amax, qb.amax, rtol=1e-5), name


@pytest.mark.parametrize("load_as", ["eager", "grouped_mm"])
def test_from_pretrained_with_experts_implementation_then_restore(tmp_path, load_as):
    model = _quantized()  # quantized on grouped_mm
    expected = _logits(model)
    tiny_qwen3_moe(seed=5).save_pretrained(tmp_path / "base")  # other weights: the checkpoint brings them
    mto.save(model, tmp_path / "quantized.safetensors")
    fresh = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "base", experts_implementation=load_as).eval()
    mto.restore(fresh, tmp_path / "quantized.safetensors")
    assert fresh.config._experts_implementation == load_as
    got = _logits(fresh)
    if load_as == "grouped_mm":
        assert torch.equal(got, expected)
    else:
        assert torch.allclose(got, expected, atol=1e-4, rtol=0)


def test_huggingface_checkpoint_loads_on_the_backend_asked_for(tmp_path):
    mto.enable_huggingface_checkpointing()
    try:
        model = _quantized()
        expected = _logits(model)
        model.save_pretrained(tmp_path)
        fresh = Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation="eager").eval()
    finally:
        mto.disable_huggingface_checkpointing()
    assert fresh.config._experts_implementation == "eager"
    assert torch.allclose(_logits(fresh), expected, atol=1e-4, rtol=0)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_batched_mm_moves_to_grouped_mm_with_one_warning(lib_caplog):
    model = tiny_qwen3_moe()
    model.set_experts_implementation("batched_mm")
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, batches())
    assert model.config._experts_implementation == "grouped_mm"
    moved = [m for m in _warnings(lib_caplog) if "batched_mm" in m]
    assert len(moved) == 1, _warnings(lib_caplog)
    assert "'grouped_mm'" in moved[0]
    _logits(model)


def test_restore_onto_a_batched_mm_model_moves_it_with_a_warning(tmp_path, lib_caplog):
    mto.save(_quantized(), tmp_path / "q.safetensors")
    fresh = tiny_qwen3_moe(seed=5)
    fresh.set_experts_implementation("batched_mm")
    mto.restore(fresh, tmp_path / "q.safetensors")
    assert fresh.config._experts_implementation == "grouped_mm"
    assert sum("batched_mm" in m for m in _warnings(lib_caplog)) == 1


def test_a_bypassing_backend_chosen_afterwards_raises():
    model = _quantized()
    model.set_experts_implementation("batched_mm")
    with pytest.raises(
        RuntimeError, match=r"'batched_mm'.*bypass the expert quantizers.*'grouped_mm', 'eager'"
    ):
        model(IDS)


@pytest.mark.parametrize(("legacy", "standard"), [("modelopt_lite_grouped_mm", "grouped_mm"),
                                                  ("modelopt_lite_eager", "eager")])  # fmt: skip
def test_old_private_names_mean_the_standard_backends(legacy, standard):
    """Models quantized by earlier development versions carry the private names in their config."""
    model = _quantized(standard)
    expected = _logits(model)
    model.config._experts_implementation = legacy  # as an earlier version left it
    assert torch.equal(_logits(model), expected)
    other = tiny_qwen3_moe()
    mtq.quantize(other, mtq.NVFP4_DEFAULT_CFG, batches(), experts_implementation=legacy)
    assert other.config._experts_implementation == standard


def test_experts_with_a_forward_we_cannot_intercept_are_disabled_with_an_error(lib_caplog):
    model = tiny_qwen3_moe()
    experts = model.model.layers[0].mlp.experts
    original = experts.forward
    experts.forward = lambda *a, **k: original(*a, **k)  # set before quantizing, e.g. by a kernel library
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, batches())
    errors = [r.getMessage() for r in lib_caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert "model.layers.0.mlp.experts (Qwen3MoeExperts)" in errors[0]
    assert "disabled gate_up_proj_input_quantizer, gate_up_proj_weight_quantizer x4," in errors[0]
    assert len(_warnings(lib_caplog)) == 0
    assert not any(q.is_enabled for _, q in mtq.iter_quantizers(experts))
    assert all(q.is_enabled for _, q in mtq.iter_quantizers(model.model.layers[1].mlp.experts))
    assert any(q.is_enabled for n, q in mtq.iter_quantizers(model) if "self_attn" in n)  # the rest quantized
