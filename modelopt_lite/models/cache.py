"""Where the default models live, and building one there atomically.

Directory: ``$MODELOPT_LITE_CACHE/default_models/<name>-<version>/`` (``$MODELOPT_LITE_CACHE`` defaults to
``$XDG_CACHE_HOME/modelopt_lite``, else ``~/.cache/modelopt_lite``). A model is trained into a hidden
temporary directory beside it and renamed into place only when complete (``default_model.json`` is written
last), so an interrupted or failed training never leaves a half model; a complete directory is reused.
Builders of one model take turns (a lock file beside it): the second reuses the first one's model, and a
staging directory left by a killed builder is removed by the next one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._cache import cache_base
from .._staging import builder_lock, move_into_place
from .._version import __version__
from ..logging import get_logger
from .specs import SPECS, DefaultModelSpec, spec_for

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = [
    "MARKER",
    "build_default_model",
    "builder_lock",
    "cache_root",
    "default_model_path",
    "load_default_model",
    "move_into_place",
]

logger = get_logger(__name__)
MARKER = "default_model.json"


def cache_root() -> Path:
    """``$MODELOPT_LITE_CACHE/default_models`` (see the module docstring for the fallbacks)."""
    return cache_base() / "default_models"


def _complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / "config.json").is_file()


def build_default_model(spec: DefaultModelSpec, *, force: bool = False, progress: bool = True) -> Path:
    """The directory of ``spec``'s model: reused when complete, else trained and written atomically
    (``force``: train again and replace it)."""
    from .trainer import train

    target = cache_root() / spec.dirname
    if _complete(target) and not force:
        logger.info("default model %s: reusing %s", spec.name, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with builder_lock(target) as exclusive:
        if _complete(target) and not force:  # another process built it while this one waited
            logger.info("default model %s: reusing %s (built by another process)", spec.name, target)
            return target
        if exclusive:  # no other builder runs: any staging directory left is a killed process's
            for stale in target.parent.glob(f".{spec.dirname}.partial-*"):
                logger.info("removing %s, left by an interrupted build", stale)
                shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{spec.dirname}.partial-", dir=target.parent))
        try:
            result = train(spec, progress=progress)
            result.model.save_pretrained(staging)
            result.tokenizer.save_pretrained(staging)
            info = {"name": spec.name, "version": spec.version, "modelopt_lite": __version__,
                    "torch": torch.__version__, "spec": spec.to_json(), "report": result.report}  # fmt: skip
            (staging / MARKER).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
            if _complete(target) and not force:  # another process finished first: keep its (identical) model
                shutil.rmtree(staging)
            else:
                move_into_place(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    logger.info("default model %s written to %s", spec.name, target)
    return target


def default_model_path(kind: str = "dense", train_if_missing: bool = True, *, force: bool = False) -> Path:
    """Directory of the default ``"dense"`` (Llama) or ``"moe"`` (Qwen3-MoE) model, or of the benchmark
    model ``"bench-dense"`` / ``"bench-moe"`` (trained longer, on the ``"fit"`` split only), a Hugging Face
    checkpoint with its tokenizer. Trained on first use (a few minutes on CPU; about 15 for a benchmark
    model) unless ``train_if_missing=False``.

    A real model's name (``"smollm2-135m"``, see ``real``) gives its converted checkpoint: converted from
    the package's GGUF file on first use (about half a minute, whatever ``train_if_missing`` says)."""
    from .real import REAL_MODELS, real_model_path

    if kind in REAL_MODELS:
        return real_model_path(kind, force=force)
    if kind not in SPECS:
        raise ValueError(f"model {kind!r}: choose one of {[*SPECS, *REAL_MODELS]} (default and real models)")
    spec = spec_for(kind)
    target = cache_root() / spec.dirname
    if not _complete(target) and not train_if_missing and not force:
        raise FileNotFoundError(
            f"the default {kind} model is not built yet ({target}); run `modelopt-lite-default-model --kind "
            f"{kind}` or call default_model_path({kind!r}, train_if_missing=True)"
        )
    return build_default_model(spec, force=force)


def load_default_model(
    kind: str = "dense", dtype: torch.dtype = torch.float32, train_if_missing: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """``(model, tokenizer)`` of the default model, the model in eval mode and ``dtype`` (a real model's
    name: ``real.load_real_model``, which reads a bfloat16 / float16 model from its cached copy in that
    dtype instead of every float32 tensor first)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .real import REAL_MODELS, load_real_model

    if kind in REAL_MODELS:
        return load_real_model(kind, dtype)
    path = default_model_path(kind, train_if_missing=train_if_missing)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(path)
