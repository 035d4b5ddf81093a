"""Loading an export compressed keeps fused MoE experts packed (docs/compress.md "Load an export
compressed"): the per-expert tensors the export writes (``...experts.{i}.gate_proj`` / ``up_proj`` /
``down_proj``) are merged packed into the compressed experts of ``mtq.compress`` (same class, same tensors
bit for bit), no full-precision expert weight is built, and the logits equal the dequantized load's bit for
bit: Qwen3-MoE (``(experts, out, in)``), GPT-OSS (transposed, gate / up rows interleaved, biases) and
Llama 4 (transposed). Experts that cannot be merged packed load dequantized, named by one INFO line."""

from __future__ import annotations

import copy
import logging
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import modelopt_lite.quantization as mtq
from modelopt_lite.export import load_hf_checkpoint
from modelopt_lite.export.load.loader import ModeloptDequantize
from modelopt_lite.moe import QuantExperts
from modelopt_lite.quantization.compress import CompressedExperts, compressed_layers
from modelopt_lite.quantization.compress.packers import get_packer

from ._export_cases import FORMATS, export, quantized, tensors
from ._models import batches, tiny_gpt_oss, tiny_llama4, tiny_qwen3_moe

pytest.importorskip("torchao", reason="loading an export compressed needs the torchao extra")

LOGGER = "modelopt_lite.export.load.loader"
PRESETS = ("NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The fused experts modules (quantized or not)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts) or n.endswith(".experts")}


def _nbytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, object, torch.nn.Module, torch.nn.Module]]:
    """preset -> (fake-quant tiny Qwen3-MoE, export directory, dequantized load, compressed load)."""
    out = {}
    for preset in PRESETS:
        model = quantized("qwen3_moe", preset)
        directory = tmp_path_factory.mktemp(preset.lower())
        export(model, directory)
        dense = load_hf_checkpoint(directory, dtype=torch.float32)
        packed = load_hf_checkpoint(directory, dtype=torch.float32, compress=True)
        out[preset] = (model, directory, dense, packed)
    return out


@pytest.mark.parametrize("backend", ["grouped_mm", "eager"])
@pytest.mark.parametrize("preset", PRESETS)
def test_outputs_equal_the_dequantized_load(qwen, preset, backend):
    """Each projection's on-the-fly 3-D weight is the dequantized load's parameter bit for bit, and so are
    the logits on both experts backends."""
    _, _, dense, packed = qwen[preset]
    experts = {n: m for n, m in _experts(packed).items() if isinstance(m, CompressedExperts)}
    assert len(experts) == 2
    for name, module in experts.items():
        for proj in ("gate_up_proj", "down_proj"):
            ref = getattr(dense.get_submodule(name), proj)
            assert torch.equal(_bits(module.quantized_weight(proj)), _bits(ref)), (name, proj)
    dense.set_experts_implementation(backend)
    packed.set_experts_implementation(backend)
    ids = batches(n=1, seed=7)[0]
    assert torch.equal(_logits(packed, ids), _logits(dense, ids))


@pytest.mark.parametrize("preset", PRESETS)
def test_experts_are_stored_packed_as_mtq_compress_stores_them(qwen, preset):
    """No expert weight is left in full precision: the codes take the projection's name in the format's
    storage dtype and bytes, the model is smaller than the dequantized load by the experts' saving, and the
    class and every tensor are those of mtq.compress of the fake-quant model (bit for bit)."""
    model, directory, dense, packed = qwen[preset]
    algo = FORMATS[preset]
    packer = get_packer(algo)
    compressed = mtq.compress(copy.deepcopy(model), int8_gemm=False)
    assert compressed_layers(packed) == compressed_layers(compressed)
    on_disk = tensors(directory)
    saved = 0
    for name, module in _experts(packed).items():
        assert isinstance(module, CompressedExperts), name
        ref = compressed.get_submodule(name)
        assert type(module) is type(ref)
        params = dict(module.named_parameters(recurse=False))
        for proj in ("gate_up_proj", "down_proj"):
            assert proj not in params, f"{name}.{proj} is still a parameter"
            assert module.quant_algos[proj] == algo
            codes = module.get_buffer(proj)
            full = getattr(dense.get_submodule(name), proj)
            assert codes.dtype == packer.weight_dtype
            assert codes.numel() * codes.element_size() == full.numel() * packer.weight_bits // 8
            saved += full.numel() * 4 - codes.numel() * codes.element_size()
        # expert 1's down_proj codes are the checkpoint's own bytes
        assert torch.equal(
            _bits(module.get_buffer("down_proj")[1]), _bits(on_disk[f"{name}.1.down_proj.weight"])
        )
        assert module._packed().keys() == ref._packed().keys()
        for key, t in ref._packed().items():
            assert t.dtype == module._packed()[key].dtype, (name, key)
            assert torch.equal(_bits(t), _bits(module._packed()[key])), (name, key)
    assert _nbytes(dense) - _nbytes(packed) >= saved


def test_no_full_precision_expert_weight_is_built(qwen, monkeypatch):
    """The per-expert tensors go into the packed buffers as they are: the dequantizing op never runs on an
    experts projection (it does on the dequantized load)."""
    _, directory, _, _ = qwen["NVFP4_DEFAULT_CFG"]
    seen: list[str] = []
    convert = ModeloptDequantize.convert

    def spy(self, input_dict, full_layer_name=None, model=None, **kwargs):
        seen.append(str(full_layer_name))
        return convert(self, input_dict, full_layer_name=full_layer_name, model=model, **kwargs)

    monkeypatch.setattr(ModeloptDequantize, "convert", spy)
    load_hf_checkpoint(directory, dtype=torch.float32, compress=True)
    assert seen
    assert not [n for n in seen if "experts" in n]
    seen.clear()
    load_hf_checkpoint(directory, dtype=torch.float32)
    assert [n for n in seen if "experts" in n]


@pytest.mark.parametrize(
    ("family", "preset"),
    [("gpt_oss", "NVFP4_DEFAULT_CFG"), ("gpt_oss", "FP8_DEFAULT_CFG"), ("llama4", "NVFP4_DEFAULT_CFG")],
)
def test_transposed_experts(tmp_path, family, preset):
    """GPT-OSS (gate / up rows interleaved, biases; grouped_mm and eager) and Llama 4 store the experts
    ``(in, out)``: the merged codes are per expert ``(out, in)``, in the model's row order, as mtq.compress
    packs them; the logits equal the dequantized load's bit for bit."""
    model = mtq.quantize({"gpt_oss": tiny_gpt_oss, "llama4": tiny_llama4}[family](), mtq.get_preset(preset),
                         batches(n=1))  # fmt: skip
    export(model, tmp_path)
    dense = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    packed = load_hf_checkpoint(tmp_path, dtype=torch.float32, compress=True)
    compressed = mtq.compress(copy.deepcopy(model), int8_gemm=False)
    experts = {n: m for n, m in _experts(packed).items() if "shared" not in n}
    assert experts
    for name, module in experts.items():
        assert isinstance(module, CompressedExperts), name
        assert module.is_transposed
        stored = dense.get_submodule(name).down_proj.shape  # (experts, in, out)
        assert module.get_buffer("down_proj").shape[1] == stored[2] != stored[1]
        ref = compressed.get_submodule(name)
        for key, t in ref._packed().items():
            assert torch.equal(_bits(t), _bits(module._packed()[key])), (name, key)
    ids = batches(n=1, seed=3)[0]
    for backend in ("grouped_mm", "eager") if family == "gpt_oss" else (None,):
        if backend is not None:
            dense.set_experts_implementation(backend)
            packed.set_experts_implementation(backend)
        assert torch.equal(_logits(packed, ids), _logits(dense, ids))


def _rewrite(directory, key: str, value: torch.Tensor) -> None:
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            if key not in f.keys():
                continue
            data = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata()
        data[key] = value
        save_file(data, str(path), metadata=metadata)
        return
    raise KeyError(key)


def test_gate_and_up_with_different_scales_stay_dequantized(qwen, tmp_path, lib_caplog):
    """Gate and up halves quantized with different per-tensor scales cannot share one packed projection (as
    mtq.compress packs it): that projection loads dequantized, one INFO line names its weights; the others
    stay packed; the logits equal the dequantized load's."""
    _, directory, _, _ = qwen["NVFP4_DEFAULT_CFG"]
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    key = "model.layers.0.mlp.experts.1.up_proj.weight_scale_2"
    _rewrite(tmp_path, key, tensors(tmp_path)[key] * 2)
    dense = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    with lib_caplog.at_level(logging.INFO, logger=LOGGER):
        packed = load_hf_checkpoint(tmp_path, dtype=torch.float32, compress=True)
    lines = [r.getMessage() for r in lib_caplog.records if "to full precision" in r.getMessage()]
    assert len(lines) == 1
    assert "8 NVFP4 weight(s)" in lines[0]  # the 4 experts' gate_proj and up_proj of layer 0
    assert "model.layers.0.mlp.experts.0.gate_proj" in lines[0]
    layer0 = packed.get_submodule("model.layers.0.mlp.experts")
    assert isinstance(layer0, CompressedExperts)
    assert set(layer0.quant_algos) == {"down_proj"}
    assert layer0.gate_up_proj.dtype == torch.float32
    assert set(packed.get_submodule("model.layers.1.mlp.experts").quant_algos) == {
        "gate_up_proj",
        "down_proj",
    }
    ids = batches(n=1, seed=2)[0]
    assert torch.equal(_logits(packed, ids), _logits(dense, ids))


def test_experts_with_pre_quant_scale_stay_dequantized(tmp_path, lib_caplog):
    """SmoothQuant's per-expert pre_quant_scale is folded into each expert's columns by the dequantized load:
    those experts load dequantized with one INFO line, every other layer packed."""
    cfg = mtq.get_preset("INT8_SMOOTHQUANT_CFG")
    model = mtq.quantize(tiny_qwen3_moe(), cfg, batches(n=1))
    export(model, tmp_path)
    assert "model.layers.0.mlp.experts.0.gate_proj.pre_quant_scale" in tensors(tmp_path)
    dense = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    with lib_caplog.at_level(logging.INFO, logger=LOGGER):
        packed = load_hf_checkpoint(tmp_path, dtype=torch.float32, compress=True)
    lines = [r.getMessage() for r in lib_caplog.records if "to full precision" in r.getMessage()]
    assert len(lines) == 1
    assert "24 W8A8_SQ_PER_CHANNEL weight(s)" in lines[0]
    assert not any(isinstance(m, CompressedExperts) for m in packed.modules())
    assert len(compressed_layers(packed)) == 8  # q, k, v, o of the two layers
    ids = batches(n=1, seed=2)[0]
    # the linear layers apply their pre_quant_scale to the input (the dequantized load: to the weight)
    torch.testing.assert_close(_logits(packed, ids), _logits(dense, ids), rtol=1e-5, atol=1e-5)
