"""``mtq.add_lora`` / ``mtq.merge_lora``: peft LoRA adapters on a quantized (or to-be-quantized) model, in
the deployment they will be served in (:mod:`modelopt_lite.nn.lora` describes both).

Either order works and gives the same model: ``mtq.quantize`` then ``mtq.add_lora`` (or ``get_peft_model``),
or the adapters first and ``mtq.quantize`` after (the adapters' own layers are never quantized). QLoRA is
``mtq.compress`` before ``add_lora(..., deploy="served")``: the frozen base keeps its real low-bit weights.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..logging import get_logger
from ..nn import QuantLinear
from ..nn.errors import UnsupportedFeatureError
from ..nn.lora import DEPLOYMENTS, is_peft_model, lora_deploy, lora_layers, require_peft, set_lora_deploy
from .compress import compressed_layers

__all__ = [
    "add_lora",
    "merge_lora",
    "set_lora_deploy",
    "unquantized_adapter_layers",
    "warn_unquantized_adapters",
]

logger = get_logger(__name__)


def _check_config(lora_config: Any, deploy: str) -> None:
    peft = require_peft()
    if not isinstance(lora_config, peft.LoraConfig):
        raise TypeError(f"lora_config: expected a peft.LoraConfig, got {type(lora_config).__name__}")
    if getattr(lora_config, "target_parameters", None):
        raise UnsupportedFeatureError(
            f"target_parameters={lora_config.target_parameters!r}: adapters on fused MoE expert parameters "
            "would bypass the quantized experts' forward; target the linear layers (target_modules)"
        )
    if deploy not in (*DEPLOYMENTS, "auto"):
        raise ValueError(f"deploy={deploy!r}: choose one of auto, {', '.join(DEPLOYMENTS)}")
    if deploy == "merged":
        unmergeable = {
            "lora_dropout": lora_config.lora_dropout,
            "use_dora": lora_config.use_dora,
            "lora_bias": getattr(lora_config, "lora_bias", False),
        }
        bad = {k: v for k, v in unmergeable.items() if v}
        if bad:
            raise ValueError(
                f"deploy='merged' trains the adapter inside the weight quantizer (Q(W + s B A)), which has "
                "no "
                f"form for {', '.join(f'{k}={v!r}' for k, v in bad.items())}: set them to 0 / False, or "
                "use deploy='served'"
            )


def unquantized_adapter_layers(model: nn.Module) -> list[str]:
    """LoRA layers whose base layer has no enabled weight quantizer (the recipe leaves it in high
    precision, e.g. ``lm_head``): their adapter trains like plain LoRA there."""
    return [
        name
        for name, layer in lora_layers(model)
        if not isinstance(base := layer.get_base_layer(), QuantLinear) or not base.weight_quantizer.is_enabled
    ]


def add_lora(
    model: nn.Module, lora_config: Any, deploy: str = "auto", adapter_name: str = "default"
) -> nn.Module:
    """Wrap ``model`` with peft LoRA adapters (``get_peft_model``; on a ``PeftModel``, ``add_adapter``) and
    return the ``PeftModel``. ``deploy``: ``"merged"`` (the adapter is trained inside the weight quantizer
    and merged at export), ``"served"`` (it runs beside the quantized base and is exported as a peft adapter)
    or ``"auto"`` (served on a compressed base, merged otherwise). Only the adapters (and learnable amax
    that were trainable) keep ``requires_grad``. A target that matches no module raises peft's
    ``ValueError``; adapters on layers the recipe leaves unquantized are named in a WARNING."""
    _check_config(lora_config, deploy)
    peft = require_peft()
    compressed = compressed_layers(model)
    if deploy == "auto":
        deploy = "served" if compressed else "merged"
    if deploy == "merged" and compressed:
        raise ValueError(
            f"{len(compressed)} layer(s) are compressed (e.g. {next(iter(compressed))}): their real low-bit "
            "weights cannot take a merged adapter; use deploy='served' (QLoRA), or add the adapter before "
            "mtq.compress"
        )
    learnable = [p for n, p in model.named_parameters() if n.endswith("._amax") and p.requires_grad]
    if is_peft_model(model):
        model.add_adapter(adapter_name, lora_config)  # type: ignore[operator]
        model.set_adapter(adapter_name)  # type: ignore[operator]
    else:
        model = peft.get_peft_model(model, lora_config, adapter_name=adapter_name)
    for p in learnable:  # get_peft_model froze every non-adapter parameter
        p.requires_grad_(True)
    names = set_lora_deploy(model, deploy)  # type: ignore[arg-type]
    logger.info("LoRA adapter %r on %d layer(s), deployed %s", adapter_name, len(names), deploy)
    warn_unquantized_adapters(model)
    return model


def warn_unquantized_adapters(model: nn.Module) -> None:
    """WARNING naming the LoRA layers whose base the quantization leaves unquantized (on a model that has
    quantizers: before ``mtq.quantize`` every base is unquantized and nothing is said)."""
    if not any(isinstance(m, QuantLinear) for m in model.modules()):
        return
    plain = unquantized_adapter_layers(model)
    if plain:
        logger.warning(
            "%d LoRA layer(s) sit on a layer the quantization config leaves unquantized, so their adapter "
            "trains as plain LoRA there: %s", len(plain), ", ".join(plain[:6]),
        )  # fmt: skip


def merge_lora(model: nn.Module) -> nn.Module:
    """Merge the adapters of a model trained with ``deploy="merged"`` into its base weights and return the
    quantized model without peft (``merge_and_unload``): it computes exactly what the adapter model computed.
    A served adapter has no exact merged form (``Q(W) + s B A`` is not ``Q(W + s B A)``), so this raises for
    it: export it with ``export_hf_checkpoint`` (base checkpoint + adapter folder)."""
    if not is_peft_model(model):
        raise TypeError(f"merge_lora: expected a peft.PeftModel, got {type(model).__name__}")
    deploy = lora_deploy(model)
    if deploy != "merged":
        where = "a compressed base" if compressed_layers(model) else "its quantized base"
        raise ValueError(
            f"the adapters were trained served (beside the quantized weight): merging them into {where} "
            "would change the model. Export base + adapter with export_hf_checkpoint, or train with "
            "deploy='merged'"
        )
    return model.merge_and_unload()  # type: ignore[operator]
