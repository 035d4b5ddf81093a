"""A cached copy of a converted real model's checkpoint in another floating dtype, written tensor by tensor.

transformers loads a float32 checkpoint into a bfloat16 model by reading every float32 tensor first: the
peak resident memory is both models' bytes (10.86 GB for Qwen2.5-Coder-1.5B: 7.1 GB of float32 weights and
3.6 GB of bfloat16), where a checkpoint stored in the run's dtype maps its file and holds one copy (its
bytes). ``cast_checkpoint`` writes that copy once, beside the float32 checkpoint in the cache
(``<name>-<digest>-bfloat16/``), reading one float32 tensor at a time (each through its own ``safe_open``,
so no mapping of the whole file stays resident) and converting it with ``Tensor.to`` (round to nearest
even, what ``from_pretrained(..., dtype=...)`` computes): the model loaded from it equals, bit for bit, the
float32 checkpoint loaded with ``dtype=``. Written into a staging directory and renamed into place when
complete, as the conversion is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .._staging import build_once
from ..logging import get_logger

__all__ = ["CAST_DTYPES", "cast_checkpoint"]

logger = get_logger(__name__)
CAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MARKER = "cast.json"


def cast_checkpoint(source: Path, dtype: str) -> Path:
    """``source`` (a checkpoint directory of float safetensors) in ``dtype`` (``"bfloat16"`` or
    ``"float16"``): the cached copy ``<source>-<dtype>``, written on first use."""
    if dtype not in CAST_DTYPES:
        raise ValueError(f"cast_checkpoint: dtype {dtype!r}: choose one of {sorted(CAST_DTYPES)}")
    source = Path(source)
    target = source.parent / f"{source.name}-{dtype}"
    if not build_once(target, lambda t: (t / MARKER).is_file(), lambda s: _write_cast(source, s, dtype)):
        return target
    logger.info("%s in %s written to %s", source.name, dtype, target)
    return target


def _write_cast(source: Path, staging: Path, dtype: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = sorted(source.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"cast_checkpoint: {source} has no .safetensors file")
    logger.info("writing %s in %s, once (%d shard(s))", source.name, dtype, len(shards))
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            names, metadata = list(handle.keys()), handle.metadata()
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            with safe_open(str(shard), framework="pt") as handle:  # mapped for this tensor only
                tensor = handle.get_tensor(name)
            tensors[name] = tensor.to(CAST_DTYPES[dtype]) if tensor.is_floating_point() else tensor
            del tensor
        save_file(tensors, str(staging / shard.name), metadata=metadata)
        del tensors
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy2(path, staging / path.name)
    config = json.loads((staging / "config.json").read_text())
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    index = staging / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("metadata", {})["total_size"] = sum(
            f.stat().st_size for f in staging.glob("*.safetensors")
        )
        index.write_text(json.dumps(data, indent=2) + "\n")
    (staging / MARKER).write_text(json.dumps({"source": source.name, "dtype": dtype}) + "\n")
