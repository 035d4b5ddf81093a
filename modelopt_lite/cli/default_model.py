"""``modelopt-lite-default-model``: build (or find) the default models in the cache and log where they are.

``modelopt-lite-default-model --kind all`` builds both (a few minutes each on CPU the first time);
``--kind moe --force`` trains the MoE model again and replaces the cached one. The benchmark models
(``--kind bench-dense``, ``bench-moe``, or ``bench`` for both; about 10 minutes each on one CPU thread) are
not part of ``all``. ``--kind smollm2-135m`` converts a real model from its package's GGUF file ahead of use
(see ``modelopt_lite.models.real``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from ..logging import get_logger
from ..models.cache import MARKER, cache_root, default_model_path
from ..models.real import REAL_MODELS
from ..models.specs import BENCH_KINDS, KINDS, spec_for

__all__ = ["main"]

logger = get_logger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="modelopt-lite-default-model",
        description="Train (first time) or find the bundled default models: a small Llama (dense) and a "
        "small Qwen3-MoE (moe) trained on CPython docs, and the longer-trained benchmark models "
        "(bench-dense, bench-moe). Cache: $MODELOPT_LITE_CACHE/default_models "
        f"(now {cache_root()}).",
    )
    p.add_argument(
        "--kind",
        choices=[*KINDS, *BENCH_KINDS, *REAL_MODELS, "all", "bench"],
        default="all",
        help="which model (default: all = the default models; bench = both benchmark models; a real model's "
        "name converts it)",
    )
    p.add_argument("--force", action="store_true", help="train again even when a cached model exists")
    args = p.parse_args(argv)
    groups = {"all": KINDS, "bench": BENCH_KINDS}
    for kind in groups.get(args.kind, (args.kind,)):
        path = default_model_path(kind, force=args.force)
        if kind in REAL_MODELS:
            logger.info("%s (%s): %s", kind, REAL_MODELS[kind].description, path)
            continue
        report = json.loads((path / MARKER).read_text())["report"]
        validation = report.get("validation_perplexity")
        logger.info(
            "%s (%s): %s | %.2fM parameters, %sheld-out perplexity %.2f vs unigram %.2f, trained in %.0f s",
            kind, spec_for(kind).name, path, report["parameters"] / 1e6,
            "" if validation is None else f"validation perplexity {validation:.2f}, ",
            report["heldout_perplexity"], report["unigram_perplexity"], report["train_seconds"],
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
