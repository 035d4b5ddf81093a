"""Collectives the quantization code needs, all no-ops in a single process.

* :func:`all_ranks_succeed`: a block that every rank enters; on exit all ranks agree whether one of them
  raised, so a failure on one rank becomes an error on every rank instead of a hang at the next collective;
* :func:`naming_lost_rank`: a collective that fails inside the block because a peer went away (its process
  died) raises :class:`RankFailedError` naming the phase instead of the backend's bare transport error;
* :func:`set_collective_timeout`: bound how long a collective waits for a rank that hung;
* :func:`record_ranks`: learn each rank's host and process id, so that the survivor of a lost rank names it
  (``rank 1 (pid 4242, exited)``);
* :func:`check_same_on_all_ranks`: refuse to go on when ranks disagree (e.g. on the set of quantizers);
* :func:`all_reduce_max`: element-wise max of named tensors across ranks, where a rank may lack some of
  them (an expert that saw no tokens there);
* :func:`all_reduce_sum`: element-wise sum of one tensor across ranks (statistics each rank gathered on its
  own data);
* :func:`broadcast_tensors`: rank 0's values everywhere;
* :func:`broadcast_json`: rank 0's JSON-serialisable value everywhere (no pickle).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..logging import get_logger

__all__ = [
    "RankFailedError",
    "all_ranks_succeed",
    "all_reduce_max",
    "all_reduce_sum",
    "broadcast_json",
    "broadcast_tensors",
    "check_same_on_all_ranks",
    "is_distributed",
    "naming_lost_rank",
    "rank",
    "record_ranks",
    "set_collective_timeout",
    "world_size",
]

logger = get_logger(__name__)


class RankFailedError(RuntimeError):
    """Another rank raised inside a block all ranks had to finish together."""


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def _device() -> torch.device:
    backend = dist.get_backend()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def all_ranks_succeed(what: str, timeout: float | None = None) -> Iterator[None]:
    """Run the block on every rank; on exit, all ranks learn whether any rank raised. The rank that raised
    re-raises its own error; the others raise :class:`RankFailedError` naming it. With ``timeout`` (seconds;
    gloo only), a rank that never arrives (crashed, stuck) is reported by a monitored barrier instead of
    blocking until the process-group timeout."""
    if not is_distributed():
        yield
        return
    failed = torch.zeros(world_size(), dtype=torch.int32, device=_device())
    try:
        yield
    except BaseException:
        failed[rank()] = 1
        _agree(failed, what, timeout)
        raise
    _agree(failed, what, timeout)
    if failed.any():
        ranks = failed.nonzero().flatten().tolist()
        raise RankFailedError(f"{what}: rank(s) {ranks} raised (see their logs); rank {rank()} stops too")


def _agree(failed: torch.Tensor, what: str, timeout: float | None) -> None:
    if timeout is not None and dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        except RuntimeError as err:
            raise RankFailedError(f"{what}: not every rank arrived within {timeout:g} s: {err}") from err
    try:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    except RuntimeError as err:  # (gloo: a peer's process ended, its connection closed)
        raise _lost(what, err) from err


def _lost(what: str, err: BaseException) -> RankFailedError:
    if _timed_out(err):
        who = _who(("stopped",), wait=0.0) or _the_other_rank()
        return RankFailedError(
            f"{what}: rank {rank()} waited the process group's whole timeout for {who}, which hung or is far "
            f"behind (a stopped or swapping process, a stuck node; set the bound with "
            f"TrainingArguments(ddp_timeout=SECONDS)): {err}"
        )
    who = _who(("exited",), wait=1.0)
    if who:
        return RankFailedError(f"{what}: rank {rank()} lost contact with {who}: {err}")
    return RankFailedError(
        f"{what}: rank {rank()} lost contact with {_the_other_rank()}, which probably died (the launcher's "
        f"summary names it): {err}"
    )


_RANKS: list[tuple[str, int]] = []  # every rank's (host, process id), once record_ranks ran


def record_ranks() -> None:
    """Learn every rank's host and process id (one collective: call it on every rank, as the trainers do
    when they are built), so that a rank which loses another names it: ``rank 1 (pid 4242, exited)``, or
    ``(pid 4242, stopped)`` for one that hung. Only ranks on this rank's host can be looked at; without the
    record a 2-process job names the other rank, a larger one says "another rank". No-op in one process."""
    if not is_distributed():
        return
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, [socket.gethostname(), os.getpid()])
    _RANKS[:] = [(str(host), int(pid)) for host, pid in gathered]


def _state(pid: int) -> str:
    """``exited``, ``stopped`` or ``running``: a process of this host, from ``/proc`` where there is one."""
    if not Path("/proc/self/stat").is_file():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "exited"
        except PermissionError:
            pass
        return "running"
    try:
        code = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "exited"
    return {"Z": "exited", "X": "exited", "T": "stopped", "t": "stopped"}.get(code, "running")


def _who(states: tuple[str, ...], wait: float) -> str:
    """The other ranks on this host whose process is in one of ``states`` (looking again for up to ``wait``
    seconds: a killed process closes its connections a moment before it is marked exited); "" if none."""
    if len(_RANKS) != world_size():
        return ""
    host, me, deadline = socket.gethostname(), rank(), time.monotonic() + wait
    while True:
        found = [
            f"rank {r} (pid {pid}, {state})"
            for r, (where, pid) in enumerate(_RANKS)
            if r != me and where == host and (state := _state(pid)) in states
        ]
        if found or time.monotonic() >= deadline:
            return " and ".join(found)
        time.sleep(0.05)


def _the_other_rank() -> str:
    return f"rank {1 - rank()}" if world_size() == 2 else "another rank"


def set_collective_timeout(seconds: float) -> bool:
    """Bound every later collective of the default process group to ``seconds`` (gloo and NCCL); False
    (nothing changed) in a single process or where this torch has no way to change it. For groups created
    without the timeout a user asked for: transformers passes ``TrainingArguments.ddp_timeout`` to the
    process group only when ``use_cpu`` is off."""
    from torch.distributed import distributed_c10d

    if not is_distributed():
        return False
    setter = getattr(distributed_c10d, "_set_pg_timeout", None)  # (torch >= 2.3)
    if setter is None:
        logger.warning(
            "this torch cannot change a process group's timeout (no distributed_c10d._set_pg_timeout): "
            "collectives keep the group's own; pass timeout= to torch.distributed.init_process_group "
            "before the Trainer is built"
        )
        return False
    setter(timedelta(seconds=seconds))
    return True


def _timed_out(err: BaseException) -> bool:
    """gloo's errors when the process group's timeout passed: ``.../gloo/transport/tcp/unbound_buffer.cc:78]
    Timed out waiting 8000ms for recv operation to complete``, or in DDP's backward ``Application timeout
    caused pair closure`` (no path)."""
    return "Timed out waiting" in str(err) or "Application timeout caused pair closure" in str(err)


def _peer_lost(err: BaseException) -> bool:
    """Whether ``err`` is a collective's failure: torch's ``DistBackendError`` (NCCL), or the transport error
    gloo raises as a plain ``RuntimeError`` when a peer's connection closes (``.../gloo/transport/...:
    Connection reset by peer``)."""
    return isinstance(err, dist.DistBackendError) or (
        isinstance(err, RuntimeError) and ("/gloo/transport/" in str(err) or _timed_out(err))
    )


@contextmanager
def naming_lost_rank(what: str | Callable[[], str]) -> Iterator[None]:
    """Run the block; a collective inside it that fails because another rank went away (a process killed,
    out of memory) raises :class:`RankFailedError` naming ``what`` (``"training step 5"``, or a function
    that says it when the failure comes) and this rank, chained to the backend's error. Other errors pass
    unchanged; nothing happens in a single process."""
    try:
        yield
    except RankFailedError:
        raise  # (named already, by a block inside this one)
    except RuntimeError as err:
        if not (is_distributed() and _peer_lost(err)):
            raise
        raise _lost(what() if callable(what) else what, err) from err


def check_same_on_all_ranks(value: Any, what: str) -> None:
    """Raise on every rank when ``value`` (JSON-serialisable) differs between ranks; the message names the
    first differing rank and, for lists / dicts, up to five entries that differ."""
    if not is_distributed():
        return
    gathered: list[Any] = [None] * world_size()
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
    dist.all_gather_object(gathered, digest)
    if len(set(gathered)) == 1:
        return
    values: list[Any] = [None] * world_size()
    dist.all_gather_object(values, value)
    other = next(r for r, d in enumerate(gathered) if d != gathered[0])
    detail = ""
    if isinstance(value, (list, dict)):
        a, b = set(values[0]), set(values[other])
        detail = f": only on rank 0: {sorted(a - b)[:5]}, only on rank {other}: {sorted(b - a)[:5]}"
    raise ValueError(f"{what} differ between ranks 0 and {other}{detail}")


def all_reduce_max(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """Element-wise max across ranks of each named tensor. The names must be the same on every rank; a rank
    holding ``None`` for a name contributes nothing (values are amax, >= 0). A name that is ``None`` on every
    rank stays ``None``."""
    if not is_distributed():
        return tensors
    names = sorted(tensors)
    check_same_on_all_ranks(names, "tensor names to reduce")
    shapes: list[Any] = [None] * world_size()
    local = {n: list(t.shape) if t is not None else None for n, t in tensors.items()}
    dist.all_gather_object(shapes, local)
    out: dict[str, torch.Tensor | None] = {}
    device = _device()
    home = next((t.device for t in tensors.values() if t is not None), torch.device("cpu"))
    for name in names:
        known = [s[name] for s in shapes if s[name] is not None]
        if not known:
            out[name] = None
            continue
        if any(k != known[0] for k in known):
            raise ValueError(f"{name}: amax shapes differ between ranks: {known}")
        t = tensors[name]
        buf = (t.detach().float() if t is not None else torch.zeros(known[0])).to(device).clone()
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        out[name] = buf.to(
            device=t.device if t is not None else home, dtype=t.dtype if t is not None else buf.dtype
        )
    return out


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise sum across ranks of ``tensor`` (same shape and dtype on every rank), as a new tensor on
    ``tensor``'s device; ``tensor`` itself in a single process."""
    if not is_distributed():
        return tensor
    check_same_on_all_ranks(
        [list(tensor.shape), str(tensor.dtype)], "the shape and dtype of the tensor to sum"
    )
    buf = tensor.detach().to(_device()).clone()
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf.to(tensor.device)


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Overwrite every rank's ``tensors`` (in place; same order and shapes everywhere) with rank ``src``'s."""
    if not is_distributed():
        return
    device = _device()
    for t in tensors:
        buf = t.detach().to(device).clone()
        dist.broadcast(buf, src=src)
        with torch.no_grad():
            t.copy_(buf.to(t.device))


def broadcast_json(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` (JSON-serialisable; what the other ranks pass is ignored) on every rank."""
    if not is_distributed():
        return value
    device = _device()
    data = json.dumps(value).encode() if rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if rank() == src:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=src)
    return json.loads(buf.cpu().numpy().tobytes().decode())
