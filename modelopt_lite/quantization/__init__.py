"""Floor 3: the ``mtq`` facade. ``import modelopt_lite.quantization as mtq``::

    model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)
    mtq.print_quant_summary(model)

Presets are plain dicts under the reference library's names; recipes are YAML files loaded by name. The
reference's other public names are here too (:mod:`.compat`, :mod:`.config.config_models`, ``mtq.nn``,
``mtq.tensor_quant``); those for features this library leaves out raise :class:`UnsupportedFeatureError`
(a ``NotImplementedError``) naming what to use.

Every name users import is here; the code lives in subpackages, top to bottom (``docs/architecture.md``):
:mod:`.auto_quantize`, then :mod:`.model_quant` (the entry points), then :mod:`.algorithms` and
:mod:`.compress`, then :mod:`.calibration` and :mod:`.insertion`, with :mod:`.config` at the bottom.
"""

from ..nn import QUANT_MODULES, QuantModule, SequentialQuantizer, TensorQuantizer, iter_quantizers

# the algorithms register at import; calib, nn and tensor_quant are the reference's mtq.* modules
from . import algorithms, calib, model_calib, nn, tensor_quant  # noqa: F401
from .auto_quantize import auto_quantize, get_auto_quantize_config
from .calibration import calibrate, check_calibrated, register_algorithm, run_forward_loop
from .compat import (
    compute_quantization_mse,
    find_quant_cfg_entry_by_path,
    normalize_quant_cfg_list,
    postprocess_amax,
    preserve_quantizer_attributes_context,
    replace_quant_module,
    set_quantizer_attribute,
    set_quantizer_attributes_full,
    set_quantizer_attributes_partial,
    set_quantizer_by_cfg_context,
    temporarily_fold_weights,
    update_quant_cfg_with_kv_cache_quant,
)
from .compress import compress, is_compressed
from .config import (
    EXTRA_PRESETS,
    KV_PRESETS,
    PRESETS,
    QuantizeConfig,
    QuantRule,
    Recipe,
    UnsupportedFeatureError,
    config_models,
    get_preset,
    list_recipes,
    load_recipe,
    preset_names,
    quantizer_attributes,
    with_kv_cache,
)
from .config.config_models import *  # noqa: F403  (the reference's pydantic config classes)
from .insertion import insert_quantizers
from .lora import add_lora, merge_lora, set_lora_deploy
from .model_quant import (
    disable_quantizer,
    enable_quantizer,
    explain,
    fold_weight,
    need_calibration,
    print_quant_summary,
    quant_state,
    quantize,
    resolve_config,
    set_quantizer_by_cfg,
)
from .rotation import rotate_residual
from .unsupported import (
    register_attention_for_kv_quant,
    register_quant_backend,
)

register = QUANT_MODULES.register
unregister = QUANT_MODULES.unregister
QuantModuleRegistry = QUANT_MODULES  # the reference's name for the registry object

# Every preset as a module constant under the reference's name (mtq.NVFP4_DEFAULT_CFG, mtq.FP8_KV_CFG, ...).
_PRESET_CONSTANTS = {**PRESETS, **EXTRA_PRESETS, **KV_PRESETS}
globals().update(_PRESET_CONSTANTS)

__all__ = [
    *sorted(_PRESET_CONSTANTS),
    *config_models.__all__,
    "EXTRA_PRESETS",
    "KV_PRESETS",
    "PRESETS",
    "QUANT_MODULES",
    "QuantModule",
    "QuantModuleRegistry",
    "QuantRule",
    "QuantizeConfig",
    "Recipe",
    "SequentialQuantizer",
    "TensorQuantizer",
    "UnsupportedFeatureError",
    "auto_quantize",
    "calib",
    "calibrate",
    "check_calibrated",
    "add_lora",
    "compress",
    "merge_lora",
    "set_lora_deploy",
    "compute_quantization_mse",
    "disable_quantizer",
    "enable_quantizer",
    "explain",
    "find_quant_cfg_entry_by_path",
    "fold_weight",
    "get_auto_quantize_config",
    "get_preset",
    "insert_quantizers",
    "is_compressed",
    "iter_quantizers",
    "list_recipes",
    "load_recipe",
    "need_calibration",
    "nn",
    "normalize_quant_cfg_list",
    "postprocess_amax",
    "preserve_quantizer_attributes_context",
    "preset_names",
    "print_quant_summary",
    "quant_state",
    "quantize",
    "quantizer_attributes",
    "register",
    "register_algorithm",
    "register_attention_for_kv_quant",
    "register_quant_backend",
    "replace_quant_module",
    "resolve_config",
    "rotate_residual",
    "run_forward_loop",
    "set_quantizer_attribute",
    "set_quantizer_attributes_full",
    "set_quantizer_attributes_partial",
    "set_quantizer_by_cfg",
    "set_quantizer_by_cfg_context",
    "temporarily_fold_weights",
    "tensor_quant",
    "unregister",
    "update_quant_cfg_with_kv_cache_quant",
    "with_kv_cache",
]
