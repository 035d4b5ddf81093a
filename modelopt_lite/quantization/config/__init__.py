"""The quantization config: the typed config (:mod:`.rules`: :class:`QuantizeConfig`, :class:`QuantRule`;
:mod:`.algorithm_specs`: the algorithm names), the reference's pydantic models under its names
(:mod:`.config_models`), the presets (:mod:`.presets`) and the packaged YAML recipes (:mod:`.recipes`; the
reference's recipe names that are not shipped: :mod:`.reference_recipes`).

The bottom of :mod:`modelopt_lite.quantization`: it imports only :mod:`modelopt_lite.nn` (quantizer
attributes) and the floors below, never another part of ``quantization``. As the reference's
``modelopt.torch.quantization.config`` it also names the pydantic classes, every preset and the list helpers.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config_models import *  # noqa: F403  (the reference's pydantic config classes, as in its config module)
from .config_models import __all__ as _CONFIG_MODELS
from .presets import (
    AUTO_QUANTIZE_DISABLED,
    EXTRA_PRESETS,
    KV_PRESETS,
    PRESETS,
    STANDARD_EXCLUSIONS,
    get_preset,
    preset_names,
    with_kv_cache,
)
from .recipes import Recipe, list_recipes, load_recipe
from .rules import (
    ALGORITHMS,
    EXPERTS_WITHOUT_TOKENS,
    EXPERTS_WITHOUT_TOKENS_CHOICES,
    LAYERWISE_UNSUPPORTED,
    UNSUPPORTED_ALGORITHMS,
    QuantizeConfig,
    QuantRule,
    UnsupportedFeatureError,
    algorithm_step,
    experts_without_tokens,
    plain,
    quantizer_attributes,
    validating,
)

__all__ = [
    *_CONFIG_MODELS,
    "ALGORITHMS",
    "AUTO_QUANTIZE_DISABLED",
    "EXPERTS_WITHOUT_TOKENS",
    "EXPERTS_WITHOUT_TOKENS_CHOICES",
    "EXTRA_PRESETS",
    "KV_PRESETS",
    "LAYERWISE_UNSUPPORTED",
    "PRESETS",
    "STANDARD_EXCLUSIONS",
    "UNSUPPORTED_ALGORITHMS",
    "QuantRule",
    "QuantizeConfig",
    "Recipe",
    "UnsupportedFeatureError",
    "algorithm_step",
    "experts_without_tokens",
    "get_preset",
    "list_recipes",
    "load_recipe",
    "plain",
    "preset_names",
    "quantizer_attributes",
    "validating",
    "with_kv_cache",
]

#: Names of the reference's config module that live above this package, in the ``mtq`` facade.
_FACADE_NAMES = frozenset({"find_quant_cfg_entry_by_path", "normalize_quant_cfg_list", "need_calibration"})
_PRESET_CONSTANTS = {**PRESETS, **EXTRA_PRESETS, **KV_PRESETS}


def __getattr__(name: str) -> Any:
    """Every preset under its constant name (``NVFP4_DEFAULT_CFG``), and the reference config module's list
    helpers from :mod:`modelopt_lite.quantization` (imported on first use: it builds on this package)."""
    if name in _PRESET_CONSTANTS:
        return _PRESET_CONSTANTS[name]
    if name in _FACADE_NAMES:
        return getattr(importlib.import_module(__name__.rpartition(".")[0]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
