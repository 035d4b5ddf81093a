"""Floor 3: the ``mtq`` facade. ``import modelopt_lite.quantization as mtq``::

    model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)
    mtq.print_quant_summary(model)

Presets are plain dicts under the reference library's names; recipes are YAML files loaded by name.
"""

from ..nn import QUANT_MODULES, QuantModule, SequentialQuantizer, TensorQuantizer, iter_quantizers
from . import awq, gptq, mse, smoothquant  # noqa: F401  (algorithms register at definition time)
from .calibrate import calibrate, check_calibrated, register_algorithm, run_forward_loop
from .config import QuantizeConfig, QuantRule, quantizer_attributes
from .insertion import insert_quantizers
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
from .presets import KV_PRESETS, PRESETS, get_preset, with_kv_cache
from .recipes import Recipe, list_recipes, load_recipe
from .rotation import rotate_residual

register = QUANT_MODULES.register
unregister = QUANT_MODULES.unregister

FP8_DEFAULT_CFG = PRESETS["FP8_DEFAULT_CFG"]
FP8_PER_CHANNEL_PER_TOKEN_CFG = PRESETS["FP8_PER_CHANNEL_PER_TOKEN_CFG"]
INT8_DEFAULT_CFG = PRESETS["INT8_DEFAULT_CFG"]
INT8_SMOOTHQUANT_CFG = PRESETS["INT8_SMOOTHQUANT_CFG"]
INT8_WEIGHT_ONLY_CFG = PRESETS["INT8_WEIGHT_ONLY_CFG"]
INT4_BLOCKWISE_WEIGHT_ONLY_CFG = PRESETS["INT4_BLOCKWISE_WEIGHT_ONLY_CFG"]
INT4_AWQ_CFG = PRESETS["INT4_AWQ_CFG"]
W4A8_AWQ_BETA_CFG = PRESETS["W4A8_AWQ_BETA_CFG"]
NVFP4_DEFAULT_CFG = PRESETS["NVFP4_DEFAULT_CFG"]
NVFP4_AWQ_LITE_CFG = PRESETS["NVFP4_AWQ_LITE_CFG"]
W4A16_NVFP4_CFG = PRESETS["W4A16_NVFP4_CFG"]
MXFP8_DEFAULT_CFG = PRESETS["MXFP8_DEFAULT_CFG"]
MXFP6_DEFAULT_CFG = PRESETS["MXFP6_DEFAULT_CFG"]
MXFP4_DEFAULT_CFG = PRESETS["MXFP4_DEFAULT_CFG"]
MXINT8_DEFAULT_CFG = PRESETS["MXINT8_DEFAULT_CFG"]
FP8_KV_CFG = KV_PRESETS["FP8_KV_CFG"]
NVFP4_KV_CFG = KV_PRESETS["NVFP4_KV_CFG"]

__all__ = [
    "FP8_DEFAULT_CFG",
    "FP8_KV_CFG",
    "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "INT4_AWQ_CFG",
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
    "INT8_DEFAULT_CFG",
    "INT8_SMOOTHQUANT_CFG",
    "INT8_WEIGHT_ONLY_CFG",
    "KV_PRESETS",
    "MXFP4_DEFAULT_CFG",
    "MXFP6_DEFAULT_CFG",
    "MXFP8_DEFAULT_CFG",
    "MXINT8_DEFAULT_CFG",
    "NVFP4_AWQ_LITE_CFG",
    "NVFP4_DEFAULT_CFG",
    "NVFP4_KV_CFG",
    "PRESETS",
    "QUANT_MODULES",
    "W4A8_AWQ_BETA_CFG",
    "W4A16_NVFP4_CFG",
    "QuantModule",
    "QuantRule",
    "QuantizeConfig",
    "Recipe",
    "SequentialQuantizer",
    "TensorQuantizer",
    "calibrate",
    "check_calibrated",
    "disable_quantizer",
    "enable_quantizer",
    "explain",
    "fold_weight",
    "get_preset",
    "insert_quantizers",
    "iter_quantizers",
    "list_recipes",
    "load_recipe",
    "need_calibration",
    "print_quant_summary",
    "quant_state",
    "quantize",
    "quantizer_attributes",
    "register",
    "register_algorithm",
    "resolve_config",
    "rotate_residual",
    "run_forward_loop",
    "set_quantizer_by_cfg",
    "unregister",
    "with_kv_cache",
]
