"""Loading an export compressed: ``from_pretrained`` of a ``quant_method: "modelopt"`` checkpoint with
``dequantize=False`` (``load_hf_checkpoint(compress=True)``) keeps the linear layers' weights packed, as the
compressed layers of ``mtq.compress``, and computes what the dequantized load computes (docs/compress.md)."""

from __future__ import annotations

import copy
import json
import logging
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import modelopt_lite.quantization as mtq
from modelopt_lite.export import load_hf_checkpoint
from modelopt_lite.export.load.loader import ModeloptExportConfig
from modelopt_lite.quantization.compress import W8A8_TOLERANCE, CompressedLinear, compressed_layers
from modelopt_lite.quantization.compress.packers import get_packer

from ._export_cases import FORMATS, assert_within_ulp, export, quantized, tensors
from ._models import batches, tiny_llama
from ._training import CountingData, cpu_args

pytest.importorskip("torchao", reason="loading an export compressed needs the torchao extra")

LOGGER = "modelopt_lite.export.load.loader"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (float8 NaN patterns and signed zeros compare as stored)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, object]]:
    """preset -> (the fake-quant model after export, its export directory)."""
    out = {}
    for preset in FORMATS:
        model = quantized("llama", preset)
        directory = tmp_path_factory.mktemp(preset.lower())
        export(model, directory)
        out[preset] = (model, directory)
    return out


@pytest.fixture(scope="module")
def loads(exports) -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """preset -> (dequantized load, compressed load), both float32."""
    return {
        preset: (
            load_hf_checkpoint(directory, dtype=torch.float32),
            load_hf_checkpoint(directory, dtype=torch.float32, compress=True),
        )
        for preset, (_, directory) in exports.items()
    }


@pytest.mark.parametrize("preset", list(FORMATS))
def test_compressed_load_computes_the_dequantized_load(loads, preset):
    """Every layer's on-the-fly weight is the dequantized load's weight bit for bit (an unfolded
    pre_quant_scale, which the compressed layer applies to its input, multiplied in); the logits are equal
    bit for bit without such a scale, and within float rounding with one."""
    dense, packed = loads[preset]
    layers = compressed_layers(packed)
    assert set(layers.values()) == {FORMATS[preset]}
    scaled = 0
    for name in layers:
        module = packed.get_submodule(name)
        weight = module.quantized_weight()
        pqs = module.input_quantizer.pre_quant_scale
        if pqs is not None:
            scaled += 1
            weight = weight * pqs.reshape(1, -1)
        assert torch.equal(weight, dense.get_submodule(name).weight), name
    ids = batches(n=1, seed=7)[0]
    if scaled:
        torch.testing.assert_close(_logits(packed, ids), _logits(dense, ids), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(_logits(packed, ids), _logits(dense, ids))


@pytest.mark.parametrize("preset", list(FORMATS))
def test_compressed_load_keeps_the_stored_tensors_packed(exports, loads, preset):
    """No quantized layer is left in full precision: each holds the checkpoint's own tensors (dtype, bytes,
    values), no ``weight`` parameter; the model is smaller than the dequantized load."""
    _, directory = exports[preset]
    dense, packed = loads[preset]
    on_disk = tensors(directory)
    algo = FORMATS[preset]
    layers = compressed_layers(packed)
    assert len(layers) == 14  # every linear map of the two decoder layers (lm_head is not quantized)
    packer = get_packer(algo)
    for name in layers:
        module = packed.get_submodule(name)
        assert isinstance(module, CompressedLinear)
        assert "weight" not in dict(module.named_parameters(recurse=False)), name
        assert module.weight.dtype == packer.weight_dtype
        full = dense.get_submodule(name).weight
        assert module.weight.numel() * module.weight.element_size() == full.numel() * packer.weight_bits // 8
        for key, t in module._packed().items():
            assert t.dtype == on_disk[f"{name}.{key}"].dtype
            assert torch.equal(_bits(t), _bits(on_disk[f"{name}.{key}"])), (name, key)

    def nbytes(model: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])

    linear_dense = sum(dense.get_submodule(n).weight.numel() * 4 for n in layers)
    assert nbytes(dense) - nbytes(packed) >= linear_dense * (1 - 1.5 * packer.weight_bits / 32)


def test_compressed_load_is_the_layer_of_mtq_compress(exports, loads):
    """The same class and buffers as ``mtq.compress`` of the exported model (codes bit for bit)."""
    model, _ = exports["NVFP4_DEFAULT_CFG"]
    _, packed = loads["NVFP4_DEFAULT_CFG"]
    compressed = mtq.compress(copy.deepcopy(model))
    assert compressed_layers(compressed) == compressed_layers(packed)
    for name in compressed_layers(packed):
        a, b = compressed.get_submodule(name), packed.get_submodule(name)
        assert type(a) is type(b)
        assert a._packed().keys() == b._packed().keys()
        for key, t in a._packed().items():
            assert torch.equal(_bits(t), _bits(b._packed()[key])), (name, key)


def test_w8a8_int8_gemm_on_request(exports, loads):
    """int8_gemm=True: W8A8 layers run torchao's int8 GEMM (torch._int_mm) on activations quantized with the
    stored input_scale, which is the exported fake-quant model's arithmetic (its stated tolerance); the
    default keeps dense activations (the dequantized load's function)."""
    model, directory = exports["INT8_SMOOTHQUANT_CFG"]
    packed = load_hf_checkpoint(directory, dtype=torch.float32, compress=True, int8_gemm=True)
    layers = compressed_layers(packed)
    assert all(packed.get_submodule(n).uses_kernel for n in layers)
    assert not any(loads["INT8_SMOOTHQUANT_CFG"][1].get_submodule(n).uses_kernel for n in layers)
    ids = batches(n=1, seed=7)[0]
    out = _logits(packed, ids)  # (compiles the int8 linear on a CPU; the next forward runs it)
    with torch.profiler.profile() as prof:
        assert torch.equal(_logits(packed, ids), out)
    assert [e.name for e in prof.events()].count("aten::_int_mm") == len(layers)
    rtol, atol = W8A8_TOLERANCE
    torch.testing.assert_close(out, _logits(model, ids), rtol=rtol, atol=atol)


def test_one_info_line_per_format(exports, lib_caplog):
    _, directory = exports["INT4_AWQ_CFG"]
    with lib_caplog.at_level(logging.INFO, logger=LOGGER):
        load_hf_checkpoint(directory, dtype=torch.float32, compress=True)
    lines = [r.getMessage() for r in lib_caplog.records if "keep packed weights" in r.getMessage()]
    assert len(lines) == 1
    assert "14 W4A16_AWQ layer(s)" in lines[0]
    assert not [r for r in lib_caplog.records if "load dequantized to full precision" in r.getMessage()]


def test_from_pretrained_with_the_config_option(exports):
    """The option is the quantization config's ``dequantize`` (transformers' name), set on the model config
    that ``from_pretrained`` reads."""
    _, directory = exports["FP8_DEFAULT_CFG"]
    config = AutoConfig.from_pretrained(directory)
    config.quantization_config = {**config.quantization_config, "dequantize": False}
    model = AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=torch.float32)
    assert set(compressed_layers(model).values()) == {"FP8"}
    assert model.config.quantization_config.dequantize is False
    dense = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert not compressed_layers(dense)


def test_stored_tensors_that_match_no_format_refused(exports, tmp_path):
    """A checkpoint whose declared format does not match its tensors is refused before loading, naming the
    tensors (never a silent full-precision load)."""
    _, directory = exports["NVFP4_DEFAULT_CFG"]
    for f in directory.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    for name, key in (("config.json", "quantization_config"), ("hf_quant_config.json", "quantization")):
        data = json.loads((tmp_path / name).read_text())
        data[key]["quant_algo"] = "MXFP8"
        (tmp_path / name).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"matches none of the checkpoint's formats \['MXFP8'\]"):
        load_hf_checkpoint(tmp_path, dtype=torch.float32, compress=True)


def test_missing_torchao_names_the_extra(exports, monkeypatch):
    _, directory = exports["FP8_DEFAULT_CFG"]
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'modelopt_lite\[torchao\]'"):
        load_hf_checkpoint(directory, dtype=torch.float32, compress=True)
    assert not compressed_layers(load_hf_checkpoint(directory, dtype=torch.float32))  # dense needs none


def test_bad_options_refused(exports):
    _, directory = exports["FP8_DEFAULT_CFG"]
    with pytest.raises(ValueError, match="int8_gemm applies to compress=True only"):
        load_hf_checkpoint(directory, int8_gemm=True)
    with pytest.raises(ValueError, match="dequantize must be a bool"):
        ModeloptExportConfig(quant_algo="FP8", dequantize="no")


def test_trainer_refuses_a_compressed_load(exports, tmp_path):
    """The quantizer tells transformers the packed model is not trainable (the dequantized load is)."""
    from modelopt_lite import training

    _, directory = exports["INT8_WEIGHT_ONLY_CFG"]
    model = load_hf_checkpoint(directory, dtype=torch.float32, compress=True)
    assert not model.hf_quantizer.is_trainable
    assert load_hf_checkpoint(directory, dtype=torch.float32).is_quantized is False
    with pytest.raises(ValueError, match="fine-tuning"):
        training.QATTrainer(model=model, args=cpu_args(tmp_path), train_dataset=CountingData())


def test_int4_partial_last_block(tmp_path):
    """INT4 block-128 over 176 inputs (down_proj of a hidden-88 Llama): two scales per row, the second block
    partial. The block is the checkpoint's group_size (the shapes alone would say 88): the dequantized load
    gives the fake-quantized weights (within the stored scales' ulp) and the compressed load equals it."""
    cfg = mtq.get_preset("INT4_AWQ_CFG")
    cfg["algorithm"] = "max"
    model = mtq.quantize(tiny_llama(hidden=88), cfg, batches(n=1))
    export(model, tmp_path)
    name = "model.layers.0.mlp.down_proj"
    assert tensors(tmp_path)[f"{name}.weight_scale"].shape == (88, 2)
    dense = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    packed = load_hf_checkpoint(tmp_path, dtype=torch.float32, compress=True)
    fake = model.get_submodule(name)
    assert_within_ulp(dense.get_submodule(name).weight, fake.weight_quantizer(fake.weight))
    assert packed.get_submodule(name).group_size == 128
    ids = batches(n=1, seed=5)[0]
    assert torch.equal(_logits(packed, ids), _logits(dense, ids))


def test_without_safetensors_files_refused(exports):
    """The packed layers are sized from the safetensors headers: without them the load is refused rather
    than falling back to full precision."""
    from modelopt_lite.export.load.loader import ModeloptExportQuantizer

    _, directory = exports["FP8_DEFAULT_CFG"]
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    config = ModeloptExportConfig(quant_algo="FP8", dequantize=False)
    with pytest.raises(ValueError, match="no safetensors checkpoint file"):
        ModeloptExportQuantizer(config)._process_model_before_weight_loading(model, checkpoint_files=[])
    assert not compressed_layers(model)
