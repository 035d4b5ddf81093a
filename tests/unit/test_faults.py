"""Faults: a QAT run killed (SIGKILL) while writing a checkpoint or between steps resumes with
``resume_from_checkpoint=True`` from the last complete checkpoint to the uninterrupted run's weights, amax and
losses bit for bit; a half-written checkpoint is never resumed from; resuming a finished run trains no extra
step; ``"true"`` / ``"last"`` (as a command line passes them) mean the last complete checkpoint."""

import json
import os
import re
import subprocess
import sys
import time
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
        warnings = [r.getMessage() for r in lib_caplog.records if r.levelname == "WARNING"]
        assert any(f"removed the newer incomplete checkpoint(s) {skipped} (" in w for w in warnings)
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
    assert not plain.exists()  # (removed: the run writes it again)
    (good / "model.safetensors").write_bytes(b"x" * 4)  # truncated after it was marked
    assert "has 4 bytes, 10 were written" in checkpoint_problem(good)
    with pytest.raises(ValueError, match=r"incomplete: checkpoint-2 \(model.safetensors has 4"):
        resolve_checkpoint(True, tmp_path)


# ---------------------------------------------------------------- bad input, refused by name
def _quantized():
    import modelopt_lite.quantization as mtq

    from ._models import batches, tiny_llama

    model = tiny_llama()
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, batches(1))
    return model


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_a_damaged_state_file_is_refused_by_name(tmp_path, damage):
    import modelopt_lite.opt as mto

    from ._models import tiny_llama

    path = tmp_path / "q.safetensors"
    mto.save(_quantized(), path)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[100:120] = b"x" * 20  # inside the JSON header
    path.write_bytes(bytes(data))
    fresh = tiny_llama()
    with pytest.raises(
        ValueError, match=r"q.safetensors: cannot be read, the file is truncated or corrupted"
    ):
        mto.restore(fresh, path)
    assert not any(n.endswith("_quantizer") for n, _ in fresh.named_modules())  # nothing left half-restored


def test_empty_calibration_data_and_too_long_sequences_are_refused(tmp_path):
    import modelopt_lite.quantization as mtq
    from modelopt_lite import QATTrainer, QuantizationArguments

    from ._models import tiny_llama
    from ._training import cpu_args

    with pytest.raises(ValueError, match=r"calibration: forward_loop \(list\) yielded no batch"):
        mtq.quantize(tiny_llama(), mtq.INT8_DEFAULT_CFG, [])
    long = torch.randint(0, 128, (1, 65))
    with pytest.raises(ValueError, match="65 tokens is longer than the model's max_position_embeddings=64"):
        mtq.quantize(tiny_llama(positions=64), mtq.INT8_DEFAULT_CFG, [long])
    data = [{"input_ids": long[0], "labels": long[0]}] * 8
    t = QATTrainer(
        model=tiny_llama(positions=64),
        args=cpu_args(tmp_path, max_steps=1),
        train_dataset=data,
        quant_args=QuantizationArguments(recipe="INT8_WEIGHT_ONLY_CFG"),
    )
    with pytest.raises(ValueError, match="training data: a sequence of 65 tokens is longer"):
        t.train()
    t = QATTrainer(model=tiny_llama(), args=cpu_args(tmp_path, max_steps=1), train_dataset=[],
                   quant_args=QuantizationArguments(recipe="INT8_DEFAULT_CFG"))  # fmt: skip
    with pytest.raises(ValueError, match="train_dataset is empty"):
        t.train()


def test_a_full_disk_during_export_leaves_nothing_behind(tmp_path, monkeypatch):
    import errno

    import modelopt_lite.export.shards as shards
    from modelopt_lite.export import export_hf_checkpoint

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards, "save_file", full)
    with pytest.raises(OSError, match="No space left on device"):
        export_hf_checkpoint(_quantized(), tmp_path / "export")
    assert list(tmp_path.iterdir()) == []  # no export folder, no staging folder


def test_a_full_disk_while_writing_a_checkpoint_is_never_resumed_from(
    tmp_path, monkeypatch, uninterrupted, lib_caplog
):
    import errno

    real_save = torch.save

    def filling(obj, f, *args, **kwargs):  # the disk fills up as checkpoint-4's optimizer state is written
        if str(f).endswith("checkpoint-4/optimizer.pt"):
            Path(f).write_bytes(b"\0" * 16)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", filling)
    with pytest.raises(OSError, match="No space left on device"):
        trainer(str(tmp_path)).train()
    monkeypatch.setattr(torch, "save", real_save)  # (space freed)
    assert "no modelopt_lite_complete.json" in checkpoint_problem(tmp_path / "checkpoint-4")
    resumed = trainer(str(tmp_path))
    resumed.train(resume_from_checkpoint=True)
    warnings = [r.getMessage() for r in lib_caplog.records if r.levelname == "WARNING"]
    assert any("removed the newer incomplete checkpoint(s) checkpoint-4 (" in w for w in warnings)
    _assert_same(resumed, uninterrupted)
    assert checkpoint_problem(tmp_path / "checkpoint-4") is None  # written again, whole


# ---------------------------------------------------------------- a lost rank
def _lost_rank_run(
    tmp_path: Path, phase: str, torchrun: bool, worker: str = "_dist_worker.py", scenario: str = "lost_rank"
) -> tuple[int, str, float]:
    """Rank 1 of two dies (SIGKILL) in ``phase``: (rank 0's or torchrun's exit code, its stderr, seconds from
    the death to the end). Without ``torchrun`` the two ranks are started directly, as a multi-node job's
    survivors are: no agent kills rank 0, which has to notice the loss itself (under torchrun the agent's
    SIGTERM may come first, and on a busy machine it did)."""
    import socket
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    worker = [str(Path(__file__).with_name(worker)), scenario, phase, str(tmp_path)]
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        cmd = [*launcher, *worker]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        code, stderr = proc.returncode, proc.stderr
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        world = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
        world["MASTER_PORT"] = str(port)
        ranks = [
            subprocess.Popen(
                [sys.executable, *worker],
                env={**env, **world, "RANK": str(r), "LOCAL_RANK": str(r)},
                stderr=subprocess.PIPE if r == 0 else subprocess.DEVNULL,  # (a pipe nobody reads can fill)
                stdout=subprocess.DEVNULL,
                text=True,
            )
            for r in range(2)
        ]
        try:
            stderr = ranks[0].communicate(timeout=120 if phase.startswith("hung_step") else 600)[1]
        finally:
            for proc in ranks:
                proc.kill()
        code = ranks[0].returncode
        ranks[1].wait(timeout=60)  # (dead already, or stopped: the SIGKILL above ends a stopped process too)
    ended = time.time()
    return code, stderr, ended - float((tmp_path / "died").read_text())


@pytest.mark.distributed
def test_a_lost_rank_stops_the_job_within_a_minute_and_torchrun_names_it(tmp_path):
    code, stderr, took = _lost_rank_run(tmp_path, "training", torchrun=True)
    assert code != 0
    assert took < 60, f"the job took {took:.1f} s to stop"
    assert "local_rank: 1" in stderr  # torchrun's summary names the lost rank
    assert "Signal 9 (SIGKILL)" in stderr


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("phase", "named"),
    [
        (
            "calibration",
            r"RankFailedError: calibration forward_loop: rank 0 lost contact with rank 1 \(pid \d+, exited\)",
        ),
        (
            "training_step",
            r"RankFailedError: training step 2: rank 0 lost contact with rank 1 \(pid \d+, exited\)",
        ),
        (
            "training",
            r"RankFailedError: training, after step 1 \(Trainer's own collectives\): rank 0 lost contact "
            r"with rank 1 \(pid \d+, exited\)",
        ),
    ],
)
def test_the_survivor_of_a_lost_rank_stops_within_a_minute_naming_the_phase(tmp_path, phase, named):
    code, stderr, took = _lost_rank_run(tmp_path, phase, torchrun=False)
    assert code != 0
    assert took < 60, f"the survivor took {took:.1f} s to stop"
    assert re.search(named, stderr), stderr[-3000:]  # (the trainer recorded each rank's process: it names it)


@pytest.mark.distributed
def test_a_rank_lost_in_a_sharded_export_stops_the_other_naming_it_and_leaves_nothing(tmp_path):
    """FSDP2-sharded NVFP4 Llama, rank 1 killed while packing its third layer: rank 0 (which writes) stops
    naming the export and the module, and neither the export folder nor its staging folder is left."""
    code, stderr, took = _lost_rank_run(tmp_path, "-", False, "_dist_export_worker.py", "lost_export")
    assert code != 0
    assert took < 60, f"the survivor took {took:.1f} s to stop"
    assert "RankFailedError: export: model.layers." in stderr, stderr[-3000:]
    assert "rank 0 lost contact with rank 1, which probably died" in stderr  # (no trainer: no record of pids)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["died"]


def _wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "the condition did not hold in time"
        time.sleep(0.02)


def test_a_lost_rank_is_named_by_its_process_state_else_by_elimination(monkeypatch):
    """The survivor names a rank of its host by the state of the process ``record_ranks`` saw (exited,
    stopped); without a record, the other rank of a 2-process job; of a larger one, "another rank"."""
    import signal
    import socket

    from modelopt_lite.distributed import comm

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert comm._state(child.pid) == "running"
        os.kill(child.pid, signal.SIGSTOP)
        _wait_for(lambda: comm._state(child.pid) == "stopped")  # (a signal arrives a moment later)
        monkeypatch.setattr(comm, "is_distributed", lambda: True)
        monkeypatch.setattr(comm.dist, "get_world_size", lambda: 2)
        monkeypatch.setattr(comm.dist, "get_rank", lambda: 0)
        monkeypatch.setattr(
            comm, "_RANKS", [(socket.gethostname(), os.getpid()), (socket.gethostname(), child.pid)]
        )
        assert comm._who(("stopped",), wait=0.0) == f"rank 1 (pid {child.pid}, stopped)"
        child.kill()  # (a zombie until waited for: exited all the same)
        _wait_for(lambda: comm._state(child.pid) == "exited")
        error = comm._lost("training step 3", RuntimeError("gloo/transport/tcp: Connection closed by peer"))
        assert f"training step 3: rank 0 lost contact with rank 1 (pid {child.pid}, exited): " in str(error)
        child.wait()
        assert comm._state(child.pid) == "exited"
        monkeypatch.setattr(comm, "_RANKS", [])  # (record_ranks never ran: by elimination)
        assert "lost contact with rank 1, which probably died" in str(comm._lost("export", RuntimeError("x")))
        monkeypatch.setattr(comm.dist, "get_world_size", lambda: 3)
        assert "lost contact with another rank, which" in str(comm._lost("export", RuntimeError("x")))
    finally:
        child.kill()
        child.wait()


def test_the_collective_timeout_is_set_or_its_absence_said(monkeypatch, caplog):
    import logging
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    from modelopt_lite.distributed import comm

    assert comm.set_collective_timeout(5) is False  # a single process: nothing to bound
    monkeypatch.setattr(comm, "is_distributed", lambda: True)
    seen = []
    monkeypatch.setattr(distributed_c10d, "_set_pg_timeout", seen.append)
    assert comm.set_collective_timeout(5) is True
    assert seen == [timedelta(seconds=5)]
    monkeypatch.delattr(distributed_c10d, "_set_pg_timeout")
    with caplog.at_level(logging.WARNING, logger="modelopt_lite"):
        assert comm.set_collective_timeout(5) is False
    assert "cannot change a process group's timeout" in caplog.text


@pytest.mark.distributed
def test_a_hung_rank_stops_the_other_after_ddp_timeout_naming_the_phase(tmp_path):
    """Rank 1 stops (SIGSTOP) in step 2's forward: alive, its connections open, so nothing fails at once. With
    ``use_cpu=True`` transformers does not hand ``ddp_timeout`` (8 s here) to the process group, whose
    default is 1800 s: the trainer applies it, and the survivor says it timed out."""
    code, stderr, took = _lost_rank_run(tmp_path, "hung_step", torchrun=False)
    assert code != 0
    assert 8 <= took < 40, f"the survivor took {took:.1f} s to stop"
    whole = (
        r"RankFailedError: training step 2: rank 0 waited the process group's whole timeout for rank 1 "
        r"\(pid \d+, stopped\)"
    )
    assert re.search(whole, stderr), stderr[-3000:]


def test_the_export_records_the_dtype_it_wrote_whatever_config_dtype_says(tmp_path):
    from modelopt_lite.export import export_hf_checkpoint

    model = _quantized()
    model.config.dtype = None  # (a model never saved in this process: a run resumed after its training)
    export_hf_checkpoint(model, tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dtype"] == "float32"


def test_an_export_removes_the_staging_a_killed_export_left(tmp_path):
    from modelopt_lite.export import export_hf_checkpoint

    dead = tmp_path / ".export.2147483646.x1y2.tmp"  # no such process
    live = tmp_path / f".export.{os.getppid()}.x1y2.tmp"  # a running process's export: left alone
    for d in (dead, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    export_hf_checkpoint(_quantized(), tmp_path / "export")
    assert not dead.exists()
    assert live.exists()
    assert (tmp_path / "export" / "hf_quant_config.json").is_file()
