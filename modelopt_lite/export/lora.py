"""Export of a quantized model carrying peft LoRA adapters, in the deployment they were trained for
(:mod:`modelopt_lite.nn.lora`):

* ``merged``: each adapter is merged into its base weight (``W + s B A``, peft's merge) and the model is
  exported as any quantized model: one checkpoint, the function that was trained;
* ``served``: ``export_dir/base_model`` holds the quantized base checkpoint (adapters left out) and
  ``export_dir`` itself the adapter as peft writes it (``adapter_config.json``,
  ``adapter_model.safetensors``): ``vllm serve export_dir/base_model --enable-lora --lora-modules
  name=export_dir``, or ``PeftModel.from_pretrained(base, export_dir)``.

The model is left as it was: the LoRA layers are swapped for their base layers only while the checkpoint is
written (merged: the targeted base weights are copied first and put back after, which costs their size in
memory).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..logging import get_logger
from ..nn.lora import lora_deploy, lora_layers

__all__ = ["BASE_MODEL_DIR", "export_with_adapters"]

logger = get_logger(__name__)
#: the served deployment's base checkpoint, inside the export directory (the reference's layout)
BASE_MODEL_DIR = "base_model"


@contextlib.contextmanager
def _without_lora_layers(model: nn.Module) -> Iterator[nn.Module]:
    """The peft model's underlying transformers model with every LoRA layer replaced by its base layer
    (so module names and tensors are the plain model's), put back on exit."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    inner = model.get_base_model()  # type: ignore[operator]
    try:
        for name, layer in list(lora_layers(inner)):
            parent_name, _, child = name.rpartition(".")
            parent = inner.get_submodule(parent_name) if parent_name else inner
            setattr(parent, child, layer.get_base_layer())
            swapped.append((parent, child, layer))
        yield inner
    finally:
        for parent, child, layer in swapped:
            setattr(parent, child, layer)


@contextlib.contextmanager
def _adapters_merged(model: nn.Module) -> Iterator[None]:
    """Every active adapter merged into its base weight (peft's ``merge``), the weights restored exactly
    on exit."""
    saved: list[tuple[nn.Module, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for _, layer in lora_layers(model):
                base = layer.get_base_layer()
                saved.append((layer, base.weight.detach().clone()))
                layer.merge()
        yield
    finally:
        with torch.no_grad():
            for layer, weight in saved:
                layer.get_base_layer().weight.copy_(weight)
                layer.merged_adapters.clear()


def export_with_adapters(
    model: nn.Module,
    export_dir: Path,
    write: Callable[..., Any],
    overwrite: bool,
    **kwargs: Any,
) -> Any:
    """Export a ``peft.PeftModel`` whose base is quantized (see the module docstring); ``write`` is the
    quantized-model export (``export_hf_checkpoint`` of a model without adapters), called with
    ``kwargs``. Returns its result."""
    deploy = lora_deploy(model)
    if deploy is None:
        raise ValueError(
            "the peft model has no LoRA linear layer this export knows (peft.tuners.lora.Linear); "
            "merge other adapter kinds yourself (merge_and_unload) before export_hf_checkpoint"
        )
    names = [n for n, _ in lora_layers(model)]
    if deploy == "merged":
        with _adapters_merged(model), _without_lora_layers(model) as plain:
            result = write(plain, export_dir=export_dir, overwrite=overwrite, **kwargs)
        logger.info(
            "export: %d LoRA adapter(s) merged into their quantized weights (%s, ...)", len(names), names[0]
        )
        return result
    if export_dir.exists() and not overwrite:
        raise FileExistsError(f"{export_dir} exists: pass overwrite=True or choose another directory")
    if export_dir.exists():
        shutil.rmtree(export_dir)
    with _without_lora_layers(model) as plain:
        result = write(plain, export_dir=export_dir / BASE_MODEL_DIR, overwrite=False, **kwargs)
    model.save_pretrained(export_dir)  # type: ignore[operator]  (peft: the adapter files only)
    logger.info(
        "export: quantized base in %s, %d LoRA adapter layer(s) in float beside it (%s): serve with "
        "--enable-lora --lora-modules NAME=%s",
        export_dir / BASE_MODEL_DIR, len(names), export_dir, export_dir,
    )  # fmt: skip
    return result
