"""The reference library's public names and signatures resolve here (issue 15).

The name lists are copied from the reference's source (release 0.47: ``quantization/config.py``,
``model_quant.py``, ``conversion.py``, ``tensor_quant.py``, ``nn/__init__.py``, ``opt/conversion.py``,
``export/unified_export_hf.py``) so that CI needs no reference install. Names for features this library
leaves out must exist and raise ``NotImplementedError`` naming what to use, never ``AttributeError``.
"""

import inspect

import pytest
import torch
from torch import nn

import modelopt_lite.export as mte
import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq
import modelopt_lite.quantization.nn as qnn
from modelopt_lite.quantization import tensor_quant

# The reference's 38 ``*_CFG`` presets and its one ``*_CONFIG`` (copied names).
REFERENCE_PRESETS = [
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", "FP8_AFFINE_KV_CFG", "FP8_DEFAULT_CFG", "FP8_KV_CFG",
    "FP8_PER_CHANNEL_PER_TOKEN_CFG", "INT4_AWQ_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "INT8_DEFAULT_CFG",
    "INT8_SMOOTHQUANT_CFG", "INT8_WEIGHT_ONLY_CFG", "MAMBA_MOE_FP8_AGGRESSIVE_CFG",
    "MAMBA_MOE_FP8_CONSERVATIVE_CFG", "MAMBA_MOE_NVFP4_AGGRESSIVE_CFG", "MAMBA_MOE_NVFP4_CONSERVATIVE_CFG",
    "MXFP4_DEFAULT_CFG", "MXFP4_MLP_WEIGHT_ONLY_CFG", "MXFP6_DEFAULT_CFG", "MXFP8_DEFAULT_CFG",
    "MXINT8_DEFAULT_CFG", "NVFP4_AFFINE_KV_CFG", "NVFP4_AWQ_CLIP_CFG", "NVFP4_AWQ_FULL_CFG",
    "NVFP4_AWQ_LITE_CFG", "NVFP4_DEFAULT_CFG", "NVFP4_EXPERTS_ONLY_CFG", "NVFP4_FOUR_OVER_SIX_CFG",
    "NVFP4_KV_CFG", "NVFP4_KV_ROTATE_CFG", "NVFP4_MLP_ONLY_CFG", "NVFP4_MLP_WEIGHT_ONLY_CFG",
    "NVFP4_OMLP_ONLY_CFG", "NVFP4_SVDQUANT_DEFAULT_CFG", "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG",
    "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG", "W4A16_NVFP4_CFG", "W4A8_AWQ_BETA_CFG", "W4A8_MXFP4_FP8_CFG",
    "W4A8_NVFP4_FP8_CFG", "NVFP4_FP8_MHA_CONFIG",
]  # fmt: skip

MTQ_FUNCTIONS = {  # name -> the reference's parameter names
    "quantize": ["model", "config", "forward_loop"],
    "calibrate": ["model", "algorithm", "forward_loop"],
    "set_quantizer_attributes_full": ["quant_model", "wildcard_or_filter_func", "attributes", "parent_class"],
    "set_quantizer_attributes_partial": [
        "quant_model", "wildcard_or_filter_func", "partial_attributes", "parent_class",
    ],
    "set_quantizer_attribute": ["quant_model", "wildcard_or_filter_func", "attribute", "parent_class"],
    "set_quantizer_by_cfg_context": ["quant_model", "quant_cfg"],
    "preserve_quantizer_attributes_context": ["quant_model"],
    "postprocess_amax": ["model", "key", "post_process_fn"],
    "compute_quantization_mse": ["model", "forward_loop", "wildcards"],
    "temporarily_fold_weights": ["model", "snapshot_device"],
    "compress": ["model", "config"],
    "auto_quantize": [
        "model", "constraints", "quantization_formats", "data_loader", "forward_step", "loss_func",
        "forward_backward_step", "disabled_layers", "num_calib_steps", "num_score_steps", "verbose", "method",
        "checkpoint", "module_search_spaces", "fixed_quantization_config",
    ],
    "get_auto_quantize_config": ["search_state", "constraints", "verbose"],
    "need_calibration": ["config"],
    "update_quant_cfg_with_kv_cache_quant": ["quant_cfg", "kv_cache_quant_cfg"],
    "find_quant_cfg_entry_by_path": ["quant_cfg_list", "quantizer_name"],
    "normalize_quant_cfg_list": ["v"],
    "replace_quant_module": ["model", "version", "registry"],
}  # fmt: skip
MTQ_OTHER_NAMES = """
    disable_quantizer enable_quantizer fold_weight print_quant_summary register unregister
    set_quantizer_by_cfg QuantModuleRegistry register_quant_backend register_attention_for_kv_quant
    QuantizeConfig QuantizerAttributeConfig QuantizerCfgEntry QuantizeAlgorithmConfig MaxCalibConfig
    MseCalibConfig LocalHessianCalibConfig SmoothQuantCalibConfig AWQLiteCalibConfig AWQClipCalibConfig
    AWQFullCalibConfig SVDQuantConfig GPTQCalibConfig NVFP4ActHeadroomCalibConfig LSQConfig
    LayerwiseConfig RotateConfig CompressConfig
""".split()
MTO_FUNCTIONS = {
    "load_modelopt_state": ["modelopt_state_path", "kwargs"],
    "restore_from_modelopt_state": ["model", "modelopt_state", "modelopt_state_path"],
    "modelopt_state": ["model"],
}
MTO_OTHER_NAMES = [
    "save",
    "restore",
    "enable_huggingface_checkpointing",
    "apply_mode",
    "ModeloptStateManager",
]
TENSOR_QUANT_NAMES = """
    FakeTensorQuantFunction ScaledE4M3Function DynamicBlockQuantizationFunction IntCastSTEFunction
    FP4CastSTEFunction StaticBlockwiseFP4FakeQuantFunction
    fake_tensor_quant scaled_e4m3 dynamic_block_quant static_blockwise_fp4_fake_quant fp4_cast_ste
    int_cast_ste fake_quant_impl scaled_e4m3_impl fp8_eager E4M3_MAX mx_format_map
    QuantizerAttributeConfig QUANT_DESC_8BIT_PER_TENSOR QUANT_DESC_UNSIGNED_8BIT_PER_TENSOR
    QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL
    QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL
    QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL
    QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL
    QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL
""".split()
QNN_NAMES = """
    TensorQuantizer SequentialQuantizer QuantLinear Linear QuantModule QuantModuleRegistry AnyQuantizer
    QUANT_DESC_8BIT_PER_TENSOR register_quant_backend unregister_quant_backend
    is_registered_quant_backend QuantConv1d QuantConv2d QuantConv3d QuantConvTranspose1d
    QuantConvTranspose2d QuantConvTranspose3d Conv1d Conv2d Conv3d ConvTranspose1d ConvTranspose2d
    ConvTranspose3d QuantMaxPool1d QuantMaxPool2d QuantMaxPool3d QuantAvgPool1d QuantAvgPool2d
    QuantAvgPool3d QuantAdaptiveAvgPool1d QuantAdaptiveAvgPool2d QuantAdaptiveAvgPool3d MaxPool1d
    MaxPool2d MaxPool3d AvgPool1d AvgPool2d AvgPool3d AdaptiveAvgPool1d AdaptiveAvgPool2d
    AdaptiveAvgPool3d QuantInstanceNorm1d QuantInstanceNorm2d QuantInstanceNorm3d QuantEmbedding
    QuantInputBase QuantLinearConvBase QuantRNNBase QuantRNNFullBase RNNLayerForward VFRNNForward
    RealQuantLinear SVDQuantLinear GroupedQuantizer NVFP4StaticQuantizer StaticBlockScaleQuantizer
    HardDisabledTensorQuantizer TensorQuantizerCache
""".split()
CALIB_NAMES = [
    "MaxCalibrator",
    "HistogramCalibrator",
    "MseCalibrator",
    "NVFP4MSECalibrator",
    "BiasCalibrator",
    "NVFP4ActHeadroomCalibrator",
]
EXPORT_NAMES = [
    "export_hf_checkpoint", "export_tensorrt_llm_checkpoint", "torch_to_tensorrt_llm_checkpoint",
    "export_mcore_gpt_to_hf", "export_mcore_gpt_to_hf_vllm_fq", "import_mcore_gpt_from_hf",
    "export_hf_vllm_fq_checkpoint", "export_speculative_decoding", "convert_to_transformer_engine",
    "convert_hf_quant_config_format", "has_quant_opt",
]  # fmt: skip


def _params(fn):
    return list(inspect.signature(fn).parameters)


def test_every_reference_preset_resolves_by_attribute_and_by_name():
    assert len(REFERENCE_PRESETS) == 39
    for name in REFERENCE_PRESETS:
        preset = getattr(mtq, name)
        assert isinstance(preset, dict)
        assert "quant_cfg" in preset
        assert mtq.get_preset(name) == preset  # a deep copy, equal
        assert name in mtq.preset_names()


def test_an_unknown_preset_still_fails_with_the_list():
    with pytest.raises(ValueError, match="NVFP4_FOUR_OVER_SIX_CFG") as err:
        mtq.get_preset("NVFP5_DEFAULT_CFG")
    assert "W4A8_NVFP4_FP8_CFG" in str(err.value)
    with pytest.raises(ValueError, match="MAMBA_MOE_FP8_AGGRESSIVE_CFG"):
        mtq.resolve_config("NVFP5_DEFAULT_CFG")


@pytest.mark.parametrize("name", sorted(MTQ_FUNCTIONS))
def test_mtq_functions_take_the_reference_parameters(name):
    assert _params(getattr(mtq, name))[: len(MTQ_FUNCTIONS[name])] == MTQ_FUNCTIONS[name]


def test_other_mtq_mto_tensor_quant_nn_and_export_names_exist():
    missing = [n for n in MTQ_OTHER_NAMES if not hasattr(mtq, n)]
    missing += [f"mto.{n}" for n in [*MTO_FUNCTIONS, *MTO_OTHER_NAMES] if not hasattr(mto, n)]
    missing += [f"tensor_quant.{n}" for n in TENSOR_QUANT_NAMES if not hasattr(tensor_quant, n)]
    missing += [f"mtq.nn.{n}" for n in QNN_NAMES if not hasattr(qnn, n)]
    missing += [f"export.{n}" for n in EXPORT_NAMES if not hasattr(mte, n)]
    missing += [f"calib.{n}" for n in CALIB_NAMES if not hasattr(mtq.calib, n)]
    assert not missing
    assert mtq.nn is qnn
    assert mtq.tensor_quant is tensor_quant
    for name, params in MTO_FUNCTIONS.items():
        assert _params(getattr(mto, name)) == params


REFUSED = [
    (lambda: mtq.register_quant_backend("mine", lambda x, q: x), "built-in"),
    (lambda: qnn.unregister_quant_backend("mine"), "not implemented"),
    (lambda: qnn.QuantConv2d(3, 3, 3), "LLM linear"),
    (lambda: qnn.QuantEmbedding(10, 4), "high precision"),
    (lambda: mtq.calib.MseCalibrator(8), "'mse' calibration algorithm"),
    (lambda: qnn.SVDQuantLinear(4, 4), "NVFP4_SVDQUANT_DEFAULT_CFG"),
    (lambda: qnn.RealQuantLinear(4, 4), "export_hf_checkpoint"),
    (lambda: mto.apply_mode(nn.Linear(2, 2), "fastnas"), "mtq.quantize"),
    (lambda: mto.ModeloptStateManager(), "mto.modelopt_state"),
    (lambda: mto.load_modelopt_state("modelopt_state.pth"), "mto.save"),
    (lambda: mte.export_tensorrt_llm_checkpoint(nn.Linear(2, 2), "llama"), "export_hf_checkpoint"),
    (lambda: mte.export_mcore_gpt_to_hf(nn.Linear(2, 2), "x"), "transformers model"),
    (
        lambda: tensor_quant.static_blockwise_fp4_fake_quant(torch.ones(16), torch.ones(1), None, False),
        "quantize_block_scales=True",
    ),
]


@pytest.mark.parametrize(("call", "alternative"), REFUSED, ids=range(len(REFUSED)))
def test_refused_features_raise_not_implemented_naming_the_alternative(call, alternative):
    with pytest.raises(NotImplementedError, match=r"not (supported|implemented|read|part of)") as err:
        call()
    assert alternative in str(err.value)


def test_unsupported_algorithms_and_attributes_are_not_implemented_and_value_errors():
    for algorithm in ("nvfp4_act_headroom", "lsq"):
        with pytest.raises(NotImplementedError, match=algorithm):
            mtq.QuantizeConfig.from_dict({"quant_cfg": [], "algorithm": {"method": algorithm}})
    with pytest.raises(ValueError, match="backend='x' is not supported"):  # also a ValueError, as before
        mtq.quantizer_attributes({"num_bits": 8, "backend": "x"})


def test_register_attention_for_kv_quant_accepts_interface_attention_and_refuses_others():
    from transformers.models.llama.modeling_llama import LlamaAttention

    assert mtq.register_attention_for_kv_quant(LlamaAttention) is True

    class OwnAttention(nn.Module):
        def forward(self, q, k, v):
            return (q @ k.transpose(-1, -2)).softmax(-1) @ v

    with pytest.raises(NotImplementedError, match="k_bmm_quantizer"):
        mtq.register_attention_for_kv_quant(OwnAttention)
