"""The trainers' allocator setting (QuantizationArguments.malloc_tuning): applied for the whole of train()
(calibration and loop), set back when train() returns, also after an error inside training; off: nothing."""

import logging

import pytest
from transformers import TrainerCallback

from modelopt_lite import allocator
from modelopt_lite.allocator import (
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    USER_ENV_VARS,
    dynamic_threshold_ceiling,
)
from modelopt_lite.training import DistillationArguments, QADTrainer, QATTrainer, QuantizationArguments

from ._models import tiny_llama
from ._training import CountingData, cpu_args
from .test_allocator import FakeGlibc

CEILING = dict(zip((M_MMAP_THRESHOLD, M_TRIM_THRESHOLD), dynamic_threshold_ceiling(), strict=True))


@pytest.fixture
def libc(monkeypatch):
    """A fake glibc in place of this process's (the trainers' policy loads it in apply())."""
    for name in (*USER_ENV_VARS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    fake = FakeGlibc()
    monkeypatch.setattr(allocator, "_load_glibc", lambda: fake)
    return fake


class _Observe(TrainerCallback):
    """The fake allocator's state at each step, optionally raising at step ``raise_at``."""

    def __init__(self, libc, raise_at=None):
        self.libc, self.raise_at, self.seen = libc, raise_at, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen.append(dict(self.libc.values))
        if state.global_step == self.raise_at:
            raise RuntimeError("boom")


def _qat(tmp_path, libc, raise_at=None, **quant):
    observe = _Observe(libc, raise_at)
    trainer = QATTrainer(
        model=tiny_llama(), args=cpu_args(tmp_path, max_steps=2), train_dataset=CountingData(),
        quant_args=QuantizationArguments(recipe="FP8_DEFAULT_CFG", calib_size=4, **quant),
        callbacks=[observe],
    )  # fmt: skip
    return trainer, observe


def test_applied_during_train_and_restored_after(tmp_path, libc):
    trainer, observe = _qat(tmp_path, libc, malloc_mmap_threshold_mb=64)
    assert libc.calls == []  # nothing at construction
    trainer.train()
    during = {M_MMAP_THRESHOLD: 64 * 2**20, M_TRIM_THRESHOLD: 128 * 2**20}
    assert observe.seen == [during, during]
    assert libc.values == CEILING
    assert libc.trims == 1
    assert trainer.malloc_policy.state == "off"


def test_restored_after_an_error_inside_training(tmp_path, libc):
    trainer, observe = _qat(tmp_path, libc, raise_at=1)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert observe.seen[-1][M_MMAP_THRESHOLD] == 2**30
    assert libc.values == CEILING
    assert libc.trims == 1


def test_off_does_nothing(tmp_path, libc):
    trainer, observe = _qat(tmp_path, libc, malloc_tuning="off")
    trainer.train()
    assert libc.calls == []
    assert libc.trims == 0
    assert observe.seen == [{}, {}]


def test_auto_is_on_for_cpu_training_and_on_is_on(tmp_path, libc):
    for tuning in ("auto", "on"):
        trainer, _ = _qat(tmp_path, libc, malloc_tuning=tuning)
        assert trainer.malloc_policy.enabled


def test_without_mallopt_train_logs_one_info_line(tmp_path, monkeypatch, lib_caplog):
    for name in (*USER_ENV_VARS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "_load_glibc", lambda: None)
    lib_caplog.set_level(logging.INFO, logger="modelopt_lite")
    trainer, _ = _qat(tmp_path, FakeGlibc())
    trainer.train()
    lines = [r for r in lib_caplog.records if r.name == "modelopt_lite.allocator"]
    assert [r.levelno for r in lines] == [logging.INFO]
    assert trainer.malloc_policy.state == "unsupported"


def test_qad_trainer_restores_after_an_error(tmp_path, libc):
    observe = _Observe(libc, raise_at=1)
    trainer = QADTrainer(
        model=tiny_llama(), args=cpu_args(tmp_path, max_steps=2), train_dataset=CountingData(),
        quant_args=QuantizationArguments(recipe="FP8_DEFAULT_CFG", calib_size=4),
        distill_args=DistillationArguments(), teacher_model=tiny_llama(seed=1), callbacks=[observe],
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert observe.seen[-1][M_MMAP_THRESHOLD] == 2**30
    assert libc.values == CEILING
    assert libc.trims == 1


@pytest.mark.parametrize(
    "bad", [{"malloc_tuning": "yes"}, {"malloc_mmap_threshold_mb": 0}, {"malloc_mmap_threshold_mb": 2048}]
)
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        QuantizationArguments(**bad)
