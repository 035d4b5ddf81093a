"""What users already do with Trainer keeps working with QATTrainer / QADTrainer: gradient accumulation,
bf16 autocast, report_to (tensorboard, wandb offline), load_best_model_at_end, torch.compile."""

import pytest
import torch

from modelopt_lite.opt.checkpoint import load_state
from modelopt_lite.quantization import iter_quantizers
from modelopt_lite.training import DistillationArguments, QADTrainer, QATTrainer, QuantizationArguments

from ._models import tiny_llama
from ._training import CountingData, cpu_args, step_losses

NVFP4 = QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=8)


class _Masked(CountingData):
    """Labels masked over a sample-dependent prefix, so micro-batches hold different token counts."""

    def __getitem__(self, i):
        item = dict(super().__getitem__(i))
        labels = item["labels"].clone()
        labels[: (i * 5) % 13] = -100
        item["labels"] = labels
        return item


def _qad(tmp_path, **overrides):
    args = cpu_args(tmp_path, max_steps=3, **overrides)
    trainer = QADTrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=_Masked(n=24),
        quant_args=NVFP4,
        teacher_model=tiny_llama(seed=1),
        distill_args=DistillationArguments(ce_loss_weight=0.5, distill_chunk_size=9),
    )
    trainer.train()
    return trainer


def test_qad_gradient_accumulation_equals_the_large_batch(tmp_path):
    large = _qad(tmp_path / "large", per_device_train_batch_size=4)
    accumulated = _qad(tmp_path / "acc", per_device_train_batch_size=2, gradient_accumulation_steps=2)
    assert step_losses(accumulated) == pytest.approx(step_losses(large), rel=1e-5)
    w_large, w_acc = large.model.state_dict(), accumulated.model.state_dict()
    # 1e-5 = 1% of one Adam step (lr 1e-3): summing two half-batch gradients rounds differently from one
    # large batch, and Adam's normalisation turns that into up to ~3e-6 on near-zero gradients (seen with
    # transformers 5.24); a wrongly weighted accumulation moves weights by a whole step.
    assert all(torch.allclose(w_large[k], w_acc[k], atol=1e-5) for k in w_large)


def test_bf16_autocast_keeps_amax_in_float32(tmp_path):
    trainer = QATTrainer(
        model=tiny_llama(), args=cpu_args(tmp_path, bf16=True), train_dataset=CountingData(), quant_args=NVFP4
    )
    trainer.train()
    assert all(torch.isfinite(torch.tensor(step_losses(trainer))))
    amaxes = [q.amax for _, q in iter_quantizers(trainer.model) if getattr(q, "amax", None) is not None]
    assert amaxes
    assert all(a.dtype == torch.float32 for a in amaxes)


def test_report_to_tensorboard_and_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    args = cpu_args(tmp_path, max_steps=2, report_to=["tensorboard", "wandb"])
    QATTrainer(model=tiny_llama(), args=args, train_dataset=CountingData(), quant_args=NVFP4).train()
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_qad_load_best_model_at_end(tmp_path):
    args = cpu_args(
        tmp_path,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
    )
    trainer = QADTrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=CountingData(),
        quant_args=NVFP4,
        eval_dataset=CountingData(n=8, seed=3),
        teacher_model=tiny_llama(seed=1),
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None
    assert [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    # the weights and amax in memory are the best checkpoint's
    saved = load_state(best)
    assert set(saved["quantizers"]) == {n for n, _ in iter_quantizers(trainer.model)}
    from safetensors.torch import load_file

    on_disk = load_file(f"{best}/model.safetensors")
    current = trainer.model.state_dict()
    assert all(torch.equal(on_disk[k], current[k]) for k in on_disk)


@pytest.mark.slow
def test_torch_compile_matches_eager(tmp_path):
    def run(**compile_args):
        args = cpu_args(tmp_path, max_steps=2, **compile_args)
        trainer = QATTrainer(model=tiny_llama(), args=args, train_dataset=CountingData(), quant_args=NVFP4)
        trainer.train()
        return step_losses(trainer)

    compiled = run(torch_compile=True, torch_compile_backend="aot_eager")
    assert compiled == pytest.approx(run(), rel=1e-4)
