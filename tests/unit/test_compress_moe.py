"""mtq.compress of fused MoE experts (docs/compress.md "Fused MoE experts"): each projection's 3-D weight is
stored packed (every expert's codes and scales stacked), the forward dequantizes it on the fly and gives
the fake-quant model's outputs bit for bit on the ``grouped_mm`` and ``eager`` backends, for the stored
``(experts, out, in)`` layout (Qwen3-MoE) and the transposed one (GPT-OSS, Llama 4); save / restore,
export and trainers recognise compressed experts."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import modelopt_lite.quantization as mtq
from modelopt_lite.moe import QuantExperts
from modelopt_lite.nn.errors import UnsupportedFeatureError
from modelopt_lite.quantization.compress import CompressedExperts, compressed_layers
from modelopt_lite.quantization.compress.packers import UnsupportedFormatError, get_packer

from ._export_cases import FORMATS, quantized
from ._models import VOCAB, batches, tiny_gpt_oss, tiny_llama4, tiny_qwen3_moe
from ._training import CountingData, cpu_args

pytest.importorskip("torchao", reason="mtq.compress needs the torchao extra")

LOGGER = "modelopt_lite.quantization.compress"
BACKENDS = ("grouped_mm", "eager")


def _quantized(family: str, preset: str) -> torch.nn.Module:
    if family == "qwen3_moe":
        return quantized("qwen3_moe", preset)
    build = {"gpt_oss": tiny_gpt_oss, "llama4": tiny_llama4}[family]
    return mtq.quantize(build(), mtq.get_preset(preset), batches(n=1))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _experts(model: torch.nn.Module) -> dict[str, QuantExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}


def _expert_layers(model: torch.nn.Module) -> dict[str, str]:
    return {n: a for n, a in compressed_layers(model).items() if "experts" in n}


@pytest.fixture(scope="module")
def qwen_models() -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """preset -> (fake-quant tiny Qwen3-MoE, its compressed copy)."""
    out = {}
    for preset in FORMATS:
        model = quantized("qwen3_moe", preset)
        out[preset] = (model, mtq.compress(copy.deepcopy(model), int8_gemm=False))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", list(FORMATS))
def test_compressed_experts_equal_fake_quant(qwen_models, preset, backend):
    """Every format, both backends: the compressed model's logits are the fake-quant model's, bit for bit
    (W8A8 runs on the dequantize path here, int8_gemm=False)."""
    model, compressed = qwen_models[preset]
    assert len(_expert_layers(compressed)) == 4  # gate_up_proj and down_proj of both MoE layers
    model.set_experts_implementation(backend)
    compressed.set_experts_implementation(backend)
    for seed in (7, 8):
        ids = batches(n=1, seed=seed)[0]
        assert torch.equal(_logits(compressed, ids), _logits(model, ids))


@pytest.mark.parametrize("preset", list(FORMATS))
def test_expert_weights_are_stored_packed(qwen_models, preset):
    """No experts projection keeps a full-precision weight: no 3-D parameter is left, the codes have the
    format's dtype and bytes, and the packed tensors (codes and scales) are at most 0.35x (4-bit) / 0.6x
    (8-bit) of the bf16 weights (the tiny experts have 32 or 64 inputs: a per-row scale weighs more than on
    a real model)."""
    model, compressed = qwen_models[preset]
    algo = FORMATS[preset]
    packer = get_packer(algo)
    ratio = 0.35 if packer.weight_bits == 4 else 0.6
    for name, experts in _experts(compressed).items():
        assert isinstance(experts, CompressedExperts)
        params = dict(experts.named_parameters(recurse=False))
        ref = _experts(model)[name]
        for proj in experts._projections:
            assert proj not in params, f"{name}.{proj} is still a parameter"
            assert experts.quant_algos[proj] in (algo, "NVFP4")  # NVFP4_AWQ: a layer AWQ left unsmoothed
            codes = experts.get_buffer(proj)
            assert codes.dtype == packer.weight_dtype
            numel = getattr(ref, proj).numel()
            assert codes.numel() * codes.element_size() == numel * packer.weight_bits // 8
        packed = sum(t.numel() * t.element_size() for t in experts._packed().values())
        bf16 = sum(getattr(ref, proj).numel() * 2 for proj in experts._projections)
        assert packed <= ratio * bf16, (name, packed, bf16)


def test_gpt_oss_mxfp4_experts_compress_to_four_bits():
    """GPT-OSS's own format: MXFP4 expert weights (MXFP4_MLP_WEIGHT_ONLY_CFG) compress to E2M1 codes (4 bits)
    and E8M0 block scales, and the outputs equal the fake-quant model's bit for bit."""
    model = _quantized("gpt_oss", "MXFP4_MLP_WEIGHT_ONLY_CFG")
    compressed = mtq.compress(copy.deepcopy(model))
    experts = next(iter(_experts(compressed).values()))
    assert isinstance(experts, CompressedExperts)
    original = next(iter(_experts(model).values()))
    for proj in experts._projections:
        codes, scales = experts.get_buffer(proj), experts.get_buffer(f"{proj}_weight_scale")
        assert codes.dtype == torch.uint8
        assert scales.dtype == torch.uint8
        assert codes.numel() * 2 == getattr(original, proj).numel()  # two E2M1 codes per byte
        assert scales.numel() * 32 == getattr(original, proj).numel()  # one E8M0 byte per 32 weights
    ids = batches(n=1, seed=3)[0]
    for backend in BACKENDS:
        model.set_experts_implementation(backend)
        compressed.set_experts_implementation(backend)
        assert torch.equal(_logits(compressed, ids), _logits(model, ids))


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
@pytest.mark.parametrize("preset", ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"])
def test_transposed_experts(family, preset):
    """GPT-OSS (grouped_mm and eager, biases, interleaved gate / up) and Llama 4 (its own batched forward)
    store the experts ``(in, out)``: the packed codes are per expert ``(out, in)``, outputs bit-exact."""
    model = _quantized(family, preset)
    compressed = mtq.compress(copy.deepcopy(model))
    experts = next(iter(_experts(compressed).values()))
    assert isinstance(experts, CompressedExperts)
    assert experts.is_transposed
    stored = next(iter(_experts(model).values())).down_proj.shape  # (experts, in, out)
    codes = experts.get_buffer("down_proj")
    packed_out = codes.shape[1]
    assert stored[1] != stored[2]
    assert packed_out == stored[2]  # packed as (out, in), not as stored
    ids = batches(n=1, seed=3)[0]
    backends = BACKENDS if family == "gpt_oss" else (None,)
    for backend in backends:
        if backend is not None:
            model.set_experts_implementation(backend)
            compressed.set_experts_implementation(backend)
        assert torch.equal(_logits(compressed, ids), _logits(model, ids))


def test_no_fake_quant_warning_for_covered_experts(lib_caplog):
    """Compressed experts get INFO lines naming the format, no warning."""
    model = quantized("qwen3_moe", "NVFP4_DEFAULT_CFG")
    with lib_caplog.at_level(logging.INFO, logger=LOGGER):
        mtq.compress(model)
    assert not [r for r in lib_caplog.records if r.levelno >= logging.WARNING]
    infos = [r.getMessage() for r in lib_caplog.records if "fused MoE experts" in r.getMessage()]
    assert len(infos) == 1
    assert "4 fused MoE experts projection(s) in NVFP4" in infos[0]


def test_experts_mixing_formats_stay_fake_quantized_with_a_warning(lib_caplog):
    """A projection whose experts are in different formats cannot be stacked: it keeps its full-precision
    weight and a warning names it; the other projection is compressed; outputs unchanged."""
    model = quantized("qwen3_moe", "INT8_WEIGHT_ONLY_CFG")
    experts = model.model.layers[0].mlp.experts
    experts.down_proj_weight_quantizers[1].disable()  # expert 1's down_proj left in full precision
    ids = batches(n=1, seed=2)[0]
    ref = _logits(model, ids)
    with lib_caplog.at_level(logging.INFO, logger=LOGGER):
        mtq.compress(model)
    warnings = [r.getMessage() for r in lib_caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "model.layers.0.mlp.experts.down_proj (its experts mix formats" in warnings[0]
    assert "stay fake-quantized" in warnings[0]
    assert isinstance(experts.down_proj, torch.nn.Parameter)
    assert experts.quant_algos == {"gate_up_proj": "W8A16"}
    assert len(_expert_layers(model)) == 3
    assert torch.equal(_logits(model, ids), ref)


def test_unpackable_expert_shape_refused_before_any_change():
    """MXFP8 needs in_features divisible by 32: the experts projection is named, nothing is compressed."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        vocab_size=VOCAB, max_position_embeddings=64,
    )  # fmt: skip
    model = mtq.quantize(Qwen3MoeForCausalLM(cfg).eval(), mtq.MXFP8_DEFAULT_CFG, batches(n=1))
    with pytest.raises(UnsupportedFormatError, match=r"experts\.down_proj: MXFP8 needs in_features"):
        mtq.compress(model)
    assert not compressed_layers(model)


def test_dtype_cast_keeps_packed_experts(qwen_models):
    """model.to(bfloat16) leaves the codes and scales as they are; the dequantized weight follows."""
    compressed = copy.deepcopy(qwen_models["NVFP4_DEFAULT_CFG"][1])
    experts = compressed.model.layers[0].mlp.experts
    before = {n: b.clone() for n, b in experts._packed().items()}
    reference = experts.quantized_weight("gate_up_proj")
    compressed.to(torch.bfloat16)
    for name, buf in experts._packed().items():
        assert buf.dtype == before[name].dtype, name
        assert torch.equal(buf, before[name]), name
    weight = experts.quantized_weight("gate_up_proj")
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, reference.to(torch.bfloat16))


def test_compressed_experts_refuse_calibration_and_folding(qwen_models):
    experts = copy.deepcopy(qwen_models["FP8_DEFAULT_CFG"][1]).model.layers[0].mlp.experts
    with pytest.raises(UnsupportedFeatureError, match="experts are compressed"):
        list(experts.weight_quantizer_pairs())
    with pytest.raises(UnsupportedFeatureError, match="experts are compressed"):
        experts.fold_weight()


@pytest.mark.parametrize("preset", ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG", "INT4_AWQ_CFG"])
def test_mto_save_restore_compressed_experts(tmp_path, preset):
    """mto.save writes the stacked packed tensors; mto.restore onto a fresh model re-creates the compressed
    experts (no full-precision parameter) and gives the same outputs on both backends."""
    from safetensors import safe_open

    import modelopt_lite.opt as mto

    model = mtq.compress(quantized("qwen3_moe", preset))
    path = mto.save(model, tmp_path / "compressed.safetensors")
    name = "model.layers.0.mlp.experts"
    with safe_open(str(path), "pt") as f:
        stored = f.get_tensor(f"{name}.gate_up_proj")
    assert stored.dtype == get_packer(model.get_submodule(name).quant_algos["gate_up_proj"]).weight_dtype
    restored = mto.restore(tiny_qwen3_moe(seed=1), path)
    assert compressed_layers(restored) == compressed_layers(model)
    experts = restored.get_submodule(name)
    assert isinstance(experts, CompressedExperts)
    assert not dict(experts.named_parameters(recurse=False))
    ids = batches(n=1, seed=9)[0]
    for backend in BACKENDS:
        model.set_experts_implementation(backend)
        restored.set_experts_implementation(backend)
        assert torch.equal(_logits(restored, ids), _logits(model, ids))


def test_export_refuses_compressed_experts(tmp_path):
    from modelopt_lite.export import export_hf_checkpoint

    model = mtq.compress(quantized("qwen3_moe", "NVFP4_DEFAULT_CFG"), {"*experts*": True})
    assert set(compressed_layers(model)) == set(_expert_layers(model))  # only the experts
    with pytest.raises(UnsupportedFormatError, match=r"mlp\.experts: the layer is compressed"):
        export_hf_checkpoint(model, tmp_path / "out")


@pytest.mark.parametrize("trainer", ["QATTrainer", "QADTrainer"])
def test_trainers_refuse_compressed_experts(tmp_path, trainer):
    from modelopt_lite import training

    model = mtq.compress(quantized("qwen3_moe", "FP8_DEFAULT_CFG"), {"*experts*": True})
    kwargs = {"teacher_model": tiny_qwen3_moe()} if trainer == "QADTrainer" else {}
    with pytest.raises(ValueError, match=r"mlp\.experts\.gate_up_proj.*train before compressing"):
        getattr(training, trainer)(
            model=model, args=cpu_args(tmp_path), train_dataset=CountingData(), **kwargs
        )
