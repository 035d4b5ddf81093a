"""nvidia-modelopt's PTQ rows of ``benchmarks/task_accuracy.py``, run under its interpreter.

    REFERENCE_PYTHON benchmarks/_task_accuracy_peer.py --spec SPEC.json

``SPEC.json`` (written by ``task_accuracy.py``): ``model_dir`` (a Hugging Face checkpoint folder), ``data``
(a safetensors file with the ``calib`` windows), ``calib_batch``, ``threads``, ``seed``, ``rows``
(``{"name", "preset", "kv"}``: preset names of ``modelopt.torch.quantization``) and lm-eval's ``tasks``,
``limit``, ``num_fewshot``, ``eval_batch`` and ``include_path`` (the extracted task configs: the files our
rows run).

Each row is quantized by ``_real_ptq_peer.modelopt_quantize`` on the same calibration batches as ours, then
changed as its ``export_hf_checkpoint`` changes it (``modelopt_as_shipped``: the model it ships, as our rows
unify q/k/v and gate/up scales as our export does), then scored by lm-eval's ``simple_evaluate`` called as
``modelopt_lite.evaluation.evaluate_tasks`` calls it: ``HFLM`` around the model in memory (float32), the local
configs only, the same ``limit``, ``num_fewshot`` and batch size. Imports nothing of ``modelopt_lite``;
lm-eval must be installed beside nvidia-modelopt (``task_accuracy.py`` checks that first and names the
command).

Each row is printed as one ``@@ROW`` line when done (``results``: lm-eval's ``results`` and ``groups``;
``calib_s``, ``tasks_s``, ``shipped_changed``; or its ``error``); the last line is ``@@RESULT`` with the
versions.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import _harness as h
import _real_ptq_peer as peer


def task_rows(shared: peer.Shared) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    spec = shared.spec
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    for spec_row in spec["rows"]:
        row: dict[str, Any] = {"library": "modelopt", **spec_row}

        def work(row: dict[str, Any], spec_row: dict[str, Any] = spec_row) -> None:
            model = peer.modelopt_quantize(shared, spec_row, row)
            row["shipped_changed"] = peer.modelopt_as_shipped(model)
            start = time.perf_counter()
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=spec["eval_batch"])
            manager = TaskManager(include_path=spec["include_path"], include_defaults=False)
            out = simple_evaluate(model=lm, tasks=spec["tasks"], num_fewshot=spec.get("num_fewshot"),
                                  limit=spec["limit"], task_manager=manager)  # fmt: skip
            row["tasks_s"] = time.perf_counter() - start
            row["results"] = {"results": out["results"], "groups": out.get("groups", {})}
            row["peak_rss_mb"] = h.peak_rss_mb()
            h.log(f"  {row['name']}: {row['tasks_s']:.0f} s")

        peer.guarded_row(row, work)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True)
    a = p.parse_args(argv)
    return peer.worker_main(a.spec, "modelopt", ["modelopt", "lm_eval"], task_rows)


if __name__ == "__main__":
    sys.exit(main())
