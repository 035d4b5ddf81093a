"""The recipe names Model-Optimizer (release 0.47) ships that this library does not, each with the reason and
what to use instead: :func:`~.recipes.load_recipe` of such a name raises
:class:`~modelopt_lite.nn.errors.UnsupportedFeatureError` saying so. Every other recipe name of that release
is shipped under the same name (``mtq.list_recipes()``), with the same rules."""

from __future__ import annotations

__all__ = ["REFERENCE_ONLY_RECIPES"]

_AUTO_QUANTIZE = (
    "an auto_quantize recipe (a per-layer format search under a bit budget) is not a quantization config; "
    "call mtq.auto_quantize(model, constraints={'effective_bits': ...}, quantization_formats=[...], "
    "data_loader=..., forward_step=..., loss_func=...) with the formats and budget of its name"
)
_SPECULATIVE = (
    "speculative-decoding draft-head training (EAGLE / DFlash) is not part of this library, which "
    "quantizes, calibrates, trains (QAT / QAD) and exports quantized models; use Model-Optimizer itself "
    "to train draft heads"
)
_LAYERWISE = (
    "layer-by-layer calibration (layerwise={{'enable': True}}) is not implemented; {instead} has the same "
    "rules calibrated on the whole model"
)
_LSQ = (
    "LSQ calibration (algorithm 'lsq') is not implemented; use general/qad/nvfp4_default-kv_fp8 with "
    "learn_amax=True in the quantizer attributes (LSQ gradients) and the QAD trainer"
)
_BUILDING_BLOCK = (
    "a building block that the reference's recipes import, not a recipe (the reference's load_recipe does "
    "not load it either); load {instead}"
)

#: reference recipe name -> why it is not shipped and what to use instead
REFERENCE_ONLY_RECIPES: dict[str, str] = {
    **dict.fromkeys(
        [
            "general/auto_quantize/nvfp4_fp8_at_5p4bits",
            "general/auto_quantize/nvfp4_fp8_kl_div_at_5p4bits",
            "general/auto_quantize/nvfp4_mse_fp8_at_6p0bits",
            "general/auto_quantize/w4a16_nvfp4_fp8_at_6p0bits-active_moe",
            "general/auto_quantize/w4a8_awq_beta_fp8_at_6p0bits",
            "huggingface/qwen3_6_moe/auto_quantize/w4a16_nvfp4_fp8_at_6p0bits-active_moe",
            "huggingface/qwen3_6_moe/auto_quantize/w4a16_nvfp4_fp8_module_spaces_at_6p0bits-active_moe",
            "models/meta-models/Muse-Glimmer-30B/auto_quantize/w4a16_nvfp4_4o6_mixed",
        ],
        _AUTO_QUANTIZE,
    ),
    **dict.fromkeys(
        [
            "general/speculative_decoding/dflash",
            "general/speculative_decoding/domino",
            "general/speculative_decoding/dspark",
            "general/speculative_decoding/eagle3",
            "models/nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16/speculative_decoding/dspark_warmstart",
        ],
        _SPECULATIVE,
    ),
    "general/distillation/dmd2_qwen_image": (
        "diffusion-model distillation (DMD2) is not part of this library; for language models use "
        "QADTrainer (distillation during quantization-aware training)"
    ),
    "general/ptq/nvfp4_act_headroom-kv_fp8_cast": (
        "NVFP4 activation headroom calibration (algorithm 'nvfp4_act_headroom') is not implemented; "
        "general/ptq/nvfp4_default-kv_fp8_cast has the same formats with max calibration"
    ),
    "general/ptq/nvfp4_default-kv_none-gptq": (
        "layer-by-layer GPTQ (layerwise={'enable': True}) is not implemented; quantize with "
        "{**mtq.NVFP4_DEFAULT_CFG, 'algorithm': 'gptq'} for whole-model GPTQ on the same formats (one "
        "transformer block of Hessians at a time), or load general/ptq/int4_gptq"
    ),
    "general/ptq/nvfp4_experts_only-kv_fp8_layerwise": _LAYERWISE.format(
        instead="general/ptq/nvfp4_experts_only-kv_fp8"
    ),
    "general/ptq/nvfp4_experts_only-kv_fp8_layerwise_offload": _LAYERWISE.format(
        instead="general/ptq/nvfp4_experts_only-kv_fp8"
    ),
    "huggingface/minimax_m3_vl/ptq/mxfp8_nvfp4_experts": (
        "layer-by-layer calibration (layerwise={'enable': True}) is not implemented; "
        "huggingface/minimax_m3_vl/ptq/nvfp4_experts_only quantizes the same experts, calibrated on the "
        "whole model"
    ),
    "general/qad/nvfp4_dual_lsq-mse_init-fp8_kv": _LSQ,
    "general/qad/nvfp4_lsq-mse_init-fp8_kv": _LSQ,
    "huggingface/vit/ptq/fp8": (
        "a vision-transformer recipe: the reference also quantizes the patch-embedding convolution and "
        "embedding layers, and quantized Conv / Embedding modules are left out of this library; "
        "general/ptq/fp8_default-kv_fp8 quantizes the linear layers in FP8"
    ),
    "huggingface/diffusion_gemma/ptq/disabled_quantizers": _BUILDING_BLOCK.format(
        instead="huggingface/diffusion_gemma/ptq/nvfp4_experts_only"
    ),
    "huggingface/nemotron_vl/ptq/disabled_quantizers": _BUILDING_BLOCK.format(
        instead="huggingface/nemotron_vl/ptq/nvfp4-kv_fp8_cast"
    ),
    "huggingface/qwen3_5/ptq/w4a16_nvfp4-fp8_attn-kv_fp8_cast.quant_cfg": _BUILDING_BLOCK.format(
        instead="huggingface/qwen3_5/ptq/w4a16_nvfp4-fp8_attn-kv_fp8_cast"
    ),
    "huggingface/qwen3_5/ptq/w4a16_nvfp4_mse-fp8_attn-kv_fp8_cast.quant_cfg": _BUILDING_BLOCK.format(
        instead="huggingface/qwen3_5/ptq/w4a16_nvfp4_mse-fp8_attn-kv_fp8_cast"
    ),
}
