"""QATTrainer: calibration before the loop, gc policy, checkpointed quantizer state with exact resume,
save_model that mto / from_pretrained restore, QAT that learns, and the bad-input list."""

import gc
import json
import weakref

import pytest
import torch
from transformers import LlamaForCausalLM, TrainerCallback

import modelopt_lite.opt as mto
from modelopt_lite.nn import QuantModule
from modelopt_lite.opt.checkpoint import STATE_FILE
from modelopt_lite.quantization import iter_quantizers, quant_state
from modelopt_lite.training import QATTrainer, QuantizationArguments
from modelopt_lite.training.calib_data import check_training_data

from ._models import tiny_llama
from ._training import CountingData, StopAt, cpu_args, step_losses

NVFP4 = QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=8)


class _FreezeCounts(TrainerCallback):
    def __init__(self):
        self.counts = []

    def on_step_end(self, args, state, control, **kwargs):
        self.counts.append(gc.get_freeze_count())


class _RaiseAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError("boom")


def _state(model):
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    return tensors, {n: q.extra_repr() for n, q in iter_quantizers(model)}


def test_quantizes_before_the_loop_and_manages_the_gc(tmp_path, lib_caplog):
    model = tiny_llama()
    counts = _FreezeCounts()
    trainer = QATTrainer(
        model=model,
        args=cpu_args(tmp_path),
        train_dataset=CountingData(),
        quant_args=NVFP4,
        callbacks=[counts],
    )
    result = trainer.train()
    assert quant_state(model) is not None
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantModule)
    assert model.model.layers[0].mlp.up_proj.input_quantizer.amax is not None
    assert any("calibrating on 8 sample" in r.getMessage() for r in lib_caplog.records)
    assert counts.counts[0] == 0  # recorded before the GC callback froze after the first optimizer step
    assert all(c > 0 for c in counts.counts[1:])  # frozen from step 2 on
    assert gc.get_freeze_count() == 0  # unfrozen when train() returns
    assert torch.isfinite(torch.tensor(result.training_loss))


def test_a_model_in_a_reference_cycle_is_freed_after_train(tmp_path):
    model = tiny_llama()
    model.cycle = [model]  # only the cyclic collector can free it
    alive = weakref.ref(model)
    trainer = QATTrainer(model=model, args=cpu_args(tmp_path), train_dataset=CountingData(), quant_args=NVFP4)
    trainer.train()
    del model, trainer
    gc.collect()
    assert alive() is None


def test_a_step_that_raises_restores_the_gc(tmp_path):
    trainer = QATTrainer(
        model=tiny_llama(),
        args=cpu_args(tmp_path),
        train_dataset=CountingData(),
        quant_args=NVFP4,
        callbacks=[_RaiseAt(2)],
    )
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert trainer.gc_policy.optimizer_steps == 2  # it had frozen
    assert gc.get_freeze_count() == 0


def test_gc_policy_can_be_switched_off(tmp_path):
    counts = _FreezeCounts()
    quant = QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=8, manual_gc=False)
    trainer = QATTrainer(
        model=tiny_llama(),
        args=cpu_args(tmp_path),
        train_dataset=CountingData(),
        quant_args=quant,
        callbacks=[counts],
    )
    trainer.train()
    assert counts.counts == [0, 0, 0, 0]


def _run(tmp_path, steps, resume=None, save_steps=5):
    args = cpu_args(tmp_path, max_steps=10, save_strategy="steps", save_steps=save_steps)
    trainer = QATTrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=CountingData(n=64),
        quant_args=NVFP4,
        callbacks=[StopAt(steps)],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_resume_is_exact(tmp_path):
    full = _run(tmp_path / "full", 10, save_steps=100)
    first = _run(tmp_path / "split", 5)
    assert (tmp_path / "split" / "checkpoint-5" / STATE_FILE).is_file()
    resumed = _run(tmp_path / "split", 10, resume=str(tmp_path / "split" / "checkpoint-5"))
    assert len(step_losses(full)) == 10
    assert step_losses(first) + step_losses(resumed)[-5:] == step_losses(full)
    weights, quantizers = _state(full.model)
    weights_r, quantizers_r = _state(resumed.model)
    assert quantizers == quantizers_r
    assert weights.keys() == weights_r.keys()
    assert all(torch.equal(weights[k], weights_r[k]) for k in weights)
    assert any(k.endswith("input_quantizer._amax") for k in weights)  # amax took part in the comparison


def test_resume_with_another_recipe_names_the_difference(tmp_path):
    _run(tmp_path, 5)
    args = cpu_args(tmp_path, max_steps=10)
    trainer = QATTrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=CountingData(),
        quant_args=QuantizationArguments(recipe="FP8_DEFAULT_CFG", calib_size=8),
    )
    with pytest.raises(ValueError, match=r"NVFP4_DEFAULT_CFG.*FP8_DEFAULT_CFG.*differ at .*quant_cfg"):
        trainer.train(resume_from_checkpoint=True)
    assert quant_state(trainer.model) is None


def test_resume_from_a_checkpoint_without_state_is_refused(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()  # a plain Trainer's checkpoint: complete, no quantizer state
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    trainer = QATTrainer(
        model=tiny_llama(), args=cpu_args(tmp_path), train_dataset=CountingData(), quant_args=NVFP4
    )
    with pytest.raises(ValueError, match=f"holds no {STATE_FILE}"):
        trainer.train(resume_from_checkpoint=True)


def test_save_model_is_restorable_by_mto_and_from_pretrained(tmp_path):
    trainer = QATTrainer(
        model=tiny_llama(), args=cpu_args(tmp_path), train_dataset=CountingData(), quant_args=NVFP4
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    saved = json.loads((tmp_path / "final" / STATE_FILE).read_text())
    assert saved["recipe"] == "NVFP4_DEFAULT_CFG"
    assert "quantization_config" not in trainer.model.config.to_dict()  # attached only while saving
    model = trainer.model.eval()
    ids = CountingData().ids[:2]
    expected = model(ids).logits

    restored = mto.restore(tiny_llama(seed=1), tmp_path / "final")
    assert torch.equal(restored(ids).logits, expected)
    mto.enable_huggingface_checkpointing()
    try:
        loaded = LlamaForCausalLM.from_pretrained(tmp_path / "final").eval()
    finally:
        mto.disable_huggingface_checkpointing()
    assert quant_state(loaded) is not None or any(isinstance(m, QuantModule) for m in loaded.modules())
    assert torch.equal(loaded(ids).logits, expected)


@pytest.mark.slow
def test_qat_lowers_the_training_loss(tmp_path):
    args = cpu_args(tmp_path, max_steps=40, learning_rate=3e-3, lr_scheduler_type="constant")
    trainer = QATTrainer(model=tiny_llama(), args=args, train_dataset=CountingData(n=64), quant_args=NVFP4)
    trainer.train()
    losses = step_losses(trainer)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


def test_calibration_from_a_text_file(tmp_path, lib_caplog):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="w0")
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{i % 128}" for i in range(200)))
    quant = QuantizationArguments(
        recipe="FP8_DEFAULT_CFG", calib_size=100, calib_dataset=str(text), calib_seq_len=32
    )
    trainer = QATTrainer(
        model=tiny_llama(),
        args=cpu_args(tmp_path, max_steps=1),
        train_dataset=CountingData(),
        quant_args=quant,
        processing_class=tokenizer,
    )
    trainer.train()
    assert any("larger than the calibration data (6 samples)" in r.getMessage() for r in lib_caplog.records)
    assert any("calibrating on 6 sample" in r.getMessage() for r in lib_caplog.records)


def test_calib_size_larger_than_the_train_data_warns(tmp_path, lib_caplog):
    quant = QuantizationArguments(recipe="FP8_DEFAULT_CFG", calib_size=1000)
    trainer = QATTrainer(
        model=tiny_llama(),
        args=cpu_args(tmp_path, max_steps=1),
        train_dataset=CountingData(n=12),
        quant_args=quant,
    )
    trainer.train()
    warnings = [
        r for r in lib_caplog.records if r.levelname == "WARNING" and "calib_size=1000" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert "12 samples" in warnings[0].getMessage()


def test_unknown_recipe_is_refused():
    with pytest.raises(ValueError, match="unknown preset or recipe"):
        QuantizationArguments(recipe="general/qat/nvfp5")


def test_a_restored_model_is_not_calibrated_again(tmp_path, lib_caplog):
    source = QATTrainer(
        model=tiny_llama(),
        args=cpu_args(tmp_path, max_steps=1),
        train_dataset=CountingData(),
        quant_args=NVFP4,
    )
    source.train()
    source.save_model(str(tmp_path / "saved"))
    model = mto.restore(tiny_llama(seed=1), tmp_path / "saved")
    amax = model.model.layers[0].mlp.up_proj.input_quantizer.amax.clone()
    lib_caplog.clear()
    trainer = QATTrainer(
        model=model,
        args=cpu_args(tmp_path, max_steps=1),
        train_dataset=CountingData(seed=9),
        quant_args=NVFP4,
    )
    trainer.train()
    assert any("already carries quantizer state" in r.getMessage() for r in lib_caplog.records)
    assert torch.equal(model.model.layers[0].mlp.up_proj.input_quantizer.amax, amax)


def test_qat_on_fused_moe_experts(tmp_path):
    from ._models import tiny_qwen3_moe

    quant = QuantizationArguments(
        recipe="NVFP4_DEFAULT_CFG", calib_size=8, experts_implementation="grouped_mm"
    )
    model = tiny_qwen3_moe()
    experts = model.model.layers[0].mlp.experts
    before = experts.gate_up_proj.detach().clone()
    trainer = QATTrainer(model=model, args=cpu_args(tmp_path), train_dataset=CountingData(), quant_args=quant)
    trainer.train()
    assert model.config._experts_implementation == "grouped_mm"
    assert experts.gate_up_proj_weight_quantizers[0].amax is not None
    assert not torch.equal(experts.gate_up_proj, before)  # the experts were trained


def test_quantize_model_before_train_is_named_as_such(tmp_path, lib_caplog):
    trainer = QATTrainer(
        model=tiny_llama(),
        args=cpu_args(tmp_path, max_steps=1),
        train_dataset=CountingData(),
        quant_args=NVFP4,
    )
    trainer.quantize_model()
    lib_caplog.clear()
    trainer.train()
    messages = [r.getMessage() for r in lib_caplog.records]
    assert any("by quantize_model() earlier" in m for m in messages)
    assert not any("carries quantizer state" in m or "restored" in m for m in messages)


def test_a_budget_the_data_cannot_fill_warns_with_the_numbers(tmp_path, lib_caplog):
    data = CountingData()
    args = cpu_args(tmp_path, max_steps=len(data))  # len(data) steps of per_device_train_batch_size samples
    check_training_data(args, data)
    warnings = [r.getMessage() for r in lib_caplog.records if r.levelname == "WARNING"]
    per_step = args.per_device_train_batch_size
    assert len(warnings) == 1
    assert f"needs {len(data) * per_step} samples" in warnings[0]
    assert f"holds {len(data)}" in warnings[0]
    lib_caplog.clear()
    args = cpu_args(tmp_path, max_steps=len(data) // per_step)
    check_training_data(args, data)
    assert not [r for r in lib_caplog.records if r.levelname == "WARNING"]
