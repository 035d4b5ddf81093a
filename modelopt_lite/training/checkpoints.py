"""Which checkpoint a run resumes from, and how a complete checkpoint is told from a half-written one.

``transformers.Trainer`` writes ``checkpoint-N`` in place, file by file (weights, optimizer, scheduler, RNG
states, ``trainer_state.json`` last); a process killed meanwhile leaves a folder that looks like a checkpoint,
and ``get_last_checkpoint`` returns the highest-numbered folder whatever it holds. Our trainers therefore
mark each checkpoint once ``Trainer`` has written all of it (``on_save``, after the write and the rotation of
old checkpoints): ``modelopt_lite_complete.json``, written atomically, naming the files and their sizes.

* A checkpoint is *complete* when its marker is there and every file it names has its size, or (one written
  by a plain ``Trainer``, with no marker and no quantizer state) when its ``trainer_state.json`` parses.
* ``resume_from_checkpoint=True`` (and the strings ``"true"`` / ``"last"``, as a command line gives them)
  resumes from the newest complete checkpoint of ``output_dir``; newer incomplete ones are removed (the run
  writes them again when it gets there), named in a WARNING. A folder given by path must be complete, else
  ``ValueError`` names what is missing and the newest complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput

from ..distributed import is_distributed, naming_lost_rank
from ..logging import get_logger
from ..opt.checkpoint import STATE_FILE

__all__ = ["COMPLETE_MARKER", "checkpoint_problem", "load_finished", "resolve_checkpoint", "trained_steps"]

logger = get_logger(__name__)

COMPLETE_MARKER = "modelopt_lite_complete.json"
_LAST = ("true", "last")
_NUMBERED = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def checkpoint_problem(folder: str | os.PathLike[str]) -> str | None:
    """What makes ``folder`` an incomplete checkpoint (``None``: it is complete)."""
    folder = Path(folder)
    marker = folder / COMPLETE_MARKER
    if marker.is_file():
        try:
            files = json.loads(marker.read_text())["files"]
        except (ValueError, KeyError, TypeError):
            return f"its {COMPLETE_MARKER} is unreadable"
        for name, size in files.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, {size} were written"
        return None
    if (folder / STATE_FILE).is_file():  # ours, killed before it was marked
        return f"it has no {COMPLETE_MARKER} (the process stopped while writing it)"
    try:
        json.loads((folder / TRAINER_STATE_NAME).read_text())["global_step"]
    except FileNotFoundError:
        return f"{TRAINER_STATE_NAME} is missing"
    except (ValueError, KeyError, TypeError):
        return f"{TRAINER_STATE_NAME} is unreadable"
    return None


def _numbered(output_dir: Path) -> list[Path]:
    found = (
        [p for p in output_dir.iterdir() if p.is_dir() and _NUMBERED.match(p.name)]
        if output_dir.is_dir()
        else []
    )
    return sorted(found, key=lambda p: int(_NUMBERED.match(p.name).group(1)))  # type: ignore[union-attr]


def resolve_checkpoint(value: str | bool | None, output_dir: str | os.PathLike[str]) -> str | None:
    """The checkpoint folder to resume from for ``resume_from_checkpoint=value`` (``None``: start afresh);
    see the module docstring. Raises ``ValueError`` naming what is wrong."""
    if value is None or value is False:
        return None
    if isinstance(value, str) and value.lower() in _LAST and not Path(value).is_dir():
        value = True
    if value is True:
        skipped: list[tuple[Path, str]] = []
        for folder in reversed(_numbered(Path(output_dir))):
            problem = checkpoint_problem(folder)
            if problem is None:
                if skipped:  # the run writes them again when it gets there: nothing is lost
                    for stale, _ in skipped:
                        shutil.rmtree(stale, ignore_errors=True)
                    logger.warning(
                        "resuming from %s; removed the newer incomplete checkpoint(s) %s",
                        folder.name,
                        "; ".join(f"{p.name} ({why})" for p, why in skipped),
                    )
                logger.info("resuming from the last complete checkpoint, %s", folder)
                return str(folder)
            skipped.append((folder, problem))
        detail = f" (incomplete: {'; '.join(f'{p.name} ({why})' for p, why in skipped)})" if skipped else ""
        raise ValueError(f"no complete checkpoint to resume from in {output_dir}{detail}")
    folder = Path(value)
    if not folder.is_dir():
        raise ValueError(f"resume_from_checkpoint={str(value)!r} is not a directory")
    problem = checkpoint_problem(folder)
    if problem is not None:
        complete = [p.name for p in _numbered(folder.parent) if checkpoint_problem(p) is None]
        hint = f"; the newest complete one is {complete[-1]}" if complete else ""
        raise ValueError(
            f"{folder} is an incomplete checkpoint: {problem}. Resume from a complete one (or pass "
            f"resume_from_checkpoint=True for the newest complete checkpoint){hint}"
        )
    return str(folder)


def trained_steps(checkpoint: str) -> int:
    """The optimizer steps a checkpoint was saved after (its ``trainer_state.json``)."""
    return int(json.loads((Path(checkpoint) / TRAINER_STATE_NAME).read_text())["global_step"])


def load_finished(trainer: Trainer, checkpoint: str) -> TrainOutput:
    """Resume from a checkpoint that already holds ``max_steps`` steps: load it, train nothing.
    (``Trainer.train`` would run one step more before it compares the step count with ``max_steps``.)
    Under FSDP the model is sharded first and the sharded checkpoint loaded into it, as ``Trainer.train``
    prepares a resumed run (model, optimizer and scheduler), so a run killed during its export after the
    last step resumes to the same sharded model."""
    prepare = getattr(trainer, "_prepare_for_training", None)  # (transformers' own step of train())
    if trainer.is_deepspeed_enabled or (trainer.is_fsdp_enabled and prepare is None):
        raise ValueError(
            f"{checkpoint} already holds max_steps={trainer.args.max_steps} steps; under "
            f"{'DeepSpeed' if trainer.is_deepspeed_enabled else 'FSDP with this transformers version'} load "
            "its model instead of resuming, or raise max_steps"
        )
    if trainer.is_fsdp_enabled:
        prepare(trainer.args.max_steps, trainer.get_train_dataloader(), checkpoint)
    else:
        trainer._load_from_checkpoint(checkpoint)  # what Trainer.train loads first (transformers' own loader)
    trainer.state = TrainerState.load_from_json(str(Path(checkpoint) / TRAINER_STATE_NAME))
    logger.info(
        "%s already holds max_steps=%d steps: the model is loaded from it, nothing is trained",
        checkpoint,
        trainer.args.max_steps,
    )
    losses = [e["train_loss"] for e in trainer.state.log_history if "train_loss" in e]
    return TrainOutput(trainer.state.global_step, losses[-1] if losses else float("nan"), {})


class CompleteCheckpointCallback(TrainerCallback):
    """After ``Trainer`` wrote a checkpoint: mark it complete (the main process, atomically, once every rank
    has written its part)."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if is_distributed():  # every rank writes files of its own (rng_state_<rank>.pth, shards): wait
            with naming_lost_rank(f"writing {PREFIX_CHECKPOINT_DIR}-{state.global_step}"):
                torch.distributed.barrier()
        if not args.should_save:
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():
            return
        files = {
            str(p.relative_to(folder)): p.stat().st_size
            for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != COMPLETE_MARKER
        }
        staging = folder / f".{COMPLETE_MARKER}.tmp"
        with open(staging, "w") as f:
            json.dump({"global_step": state.global_step, "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging, folder / COMPLETE_MARKER)
