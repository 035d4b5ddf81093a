"""Faults: a QAT run killed (SIGKILL) while writing a checkpoint or between steps resumes with
``resume_from_checkpoint=True`` from the last complete checkpoint to the uninterrupted run's weights, amax and
losses bit for bit; a half-written checkpoint is never resumed from; resuming a finished run trains no extra
step; ``"true"`` / ``"last"`` (as a command line passes them) mean the last complete checkpoint."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modelopt_lite.training.checkpoints import COMPLETE_MARKER, checkpoint_problem, resolve_checkpoint

from ._fault_worker import trainer
from ._training import step_losses

WORKER = Path(__file__).with_name("_fault_worker.py")


def _run_killed(out: Path, moment: str) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), moment], env=env, capture_output=True, timeout=600
    )
    return proc.returncode


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    t = trainer(str(tmp_path_factory.mktemp("full")))
    t.train()
    return {k: v.clone() for k, v in t.model.state_dict().items()}, step_losses(t)


def _assert_same(resumed, uninterrupted) -> None:
    state, losses = uninterrupted
    now = resumed.model.state_dict()
    assert now.keys() == state.keys()
    assert any(k.endswith("weight_quantizer._amax") for k in now)  # (learned amax: compared too)
    assert all(torch.equal(now[k], state[k]) for k in state)
    assert step_losses(resumed) == losses[-len(step_losses(resumed)) :]


@pytest.mark.parametrize(
    ("moment", "resumes_from", "skipped"),
    [
        ("write:checkpoint-4/optimizer.pt", "checkpoint-2", "checkpoint-4"),
        ("write:checkpoint-4/rng_state.pth", "checkpoint-2", "checkpoint-4"),
        ("step:5", "checkpoint-4", None),
    ],
)
def test_a_killed_run_resumes_from_the_last_complete_checkpoint_exactly(
    tmp_path, uninterrupted, lib_caplog, moment, resumes_from, skipped
):
    assert _run_killed(tmp_path, moment) == -9  # SIGKILL
    if skipped:
        assert checkpoint_problem(tmp_path / skipped) is not None
        with pytest.raises(
            ValueError, match=rf"incomplete checkpoint.*newest complete one is {resumes_from}"
        ):
            resolve_checkpoint(str(tmp_path / skipped), tmp_path)
    resumed = trainer(str(tmp_path))
    resumed.train(resume_from_checkpoint=True)
    assert any(
        f"resuming from the last complete checkpoint, {tmp_path / resumes_from}" in r.getMessage()
        for r in lib_caplog.records
    )
    if skipped:
        assert any(f"{skipped} (" in r.getMessage() for r in lib_caplog.records if r.levelname == "WARNING")
    _assert_same(resumed, uninterrupted)
    assert checkpoint_problem(tmp_path / "checkpoint-6") is None


def test_resuming_a_finished_run_loads_it_and_trains_no_extra_step(tmp_path, uninterrupted):
    assert _run_killed(tmp_path, "none") == 0  # (a run killed after training, e.g. during its export)
    resumed = trainer(str(tmp_path))
    out = resumed.train(resume_from_checkpoint="last")
    assert out.global_step == 6
    assert not (tmp_path / "checkpoint-7").exists()
    state, _ = uninterrupted
    now = resumed.model.state_dict()
    assert all(torch.equal(now[k], state[k]) for k in state)


def test_resume_values_and_what_counts_as_complete(tmp_path):
    with pytest.raises(ValueError, match="no complete checkpoint to resume from"):
        resolve_checkpoint(True, tmp_path)
    assert resolve_checkpoint(None, tmp_path) is None
    assert resolve_checkpoint(False, tmp_path) is None
    with pytest.raises(ValueError, match="is not a directory"):
        resolve_checkpoint(str(tmp_path / "nowhere"), tmp_path)
    good = tmp_path / "checkpoint-2"
    good.mkdir()
    (good / "model.safetensors").write_bytes(b"x" * 10)
    (good / COMPLETE_MARKER).write_text(json.dumps({"global_step": 2, "files": {"model.safetensors": 10}}))
    plain = tmp_path / "checkpoint-3"  # written by a plain Trainer: no marker, no quantizer state
    plain.mkdir()
    (plain / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    assert resolve_checkpoint("true", tmp_path) == str(plain)
    (plain / "trainer_state.json").write_text('{"global_st')  # cut short
    assert resolve_checkpoint("LAST", tmp_path) == str(good)
    (good / "model.safetensors").write_bytes(b"x" * 4)  # truncated after it was marked
    assert "has 4 bytes, 10 were written" in checkpoint_problem(good)
    with pytest.raises(
        ValueError, match=r"incomplete: checkpoint-3 .*checkpoint-2 \(model.safetensors has 4"
    ):
        resolve_checkpoint(True, tmp_path)
