"""mtq.compress: real low-bit weights in memory (docs/compress.md). Every format round-trips (quantize ->
compress -> the same outputs as the fake-quant model), the weights are really stored packed, W8A8 runs
torchao's int8 GEMM, and bad input is refused."""

from __future__ import annotations

import copy
import itertools
import logging
import sys

import pytest
import torch

import modelopt_lite.quantization as mtq
from modelopt_lite.quantization.compress import W8A8_TOLERANCE, compressed_layers, fast_int8_gemm
from modelopt_lite.quantization.compress.packers import UnsupportedFormatError, get_packer

from ._export_cases import FORMATS, quantized
from ._models import batches, tiny_gpt2, tiny_llama
from ._training import CountingData, cpu_args

pytest.importorskip("torchao", reason="mtq.compress needs the torchao extra")

#: the export's formats and those only mtq.compress writes (MXFP4)
COMPRESS_FORMATS = {**FORMATS, "MXFP4_DEFAULT_CFG": "MXFP4"}
#: quant_algo -> the storage of the compressed layers' ``weight``: dtype, bits per element
STORAGE = {
    algo: (get_packer(algo).weight_dtype, get_packer(algo).weight_bits) for algo in COMPRESS_FORMATS.values()
}


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def compressed_models() -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """preset -> (fake-quant model, its compressed copy)."""
    out = {}
    for preset in COMPRESS_FORMATS:
        model = quantized("llama", preset)
        out[preset] = (model, mtq.compress(copy.deepcopy(model), int8_gemm=True))
    return out


@pytest.mark.parametrize("preset", list(COMPRESS_FORMATS))
def test_compressed_outputs_equal_fake_quant(compressed_models, preset):
    model, compressed = compressed_models[preset]
    ids = batches(n=1, seed=7)[0]
    ref, out = _logits(model, ids), _logits(compressed, ids)
    if COMPRESS_FORMATS[preset] == "W8A8_SQ_PER_CHANNEL":  # int8 GEMM, int32 accumulation: a stated tolerance
        rtol, atol = W8A8_TOLERANCE
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    else:  # dequantize on the fly: the fake quant's arithmetic, bit for bit
        assert torch.equal(out, ref)


@pytest.mark.parametrize("preset", list(COMPRESS_FORMATS))
def test_weights_are_stored_packed(compressed_models, preset):
    """No quantized layer keeps a full-precision weight: the storage dtype and bytes are the format's."""
    model, compressed = compressed_models[preset]
    layers = compressed_layers(compressed)
    assert len(layers) == 14  # every linear map of the two decoder layers (lm_head is not quantized)
    for name, algo in layers.items():
        module = compressed.get_submodule(name)
        dtype, bits = STORAGE[algo]
        full = model.get_submodule(name).weight
        assert "weight" not in dict(module.named_parameters(recurse=False)), name
        assert module.weight.dtype == dtype
        assert module.weight.numel() * module.weight.element_size() == full.numel() * bits // 8
        packed = sum(
            t.numel() * t.element_size() for n, t in module.named_buffers() if n.startswith("weight")
        )
        assert packed <= 1.5 * full.numel() * bits / 8  # the codes and, at these tiny sizes, the scales


def _profiled_ops(model: torch.nn.Module, ids: torch.Tensor) -> list[str]:
    """The op names one forward of ``model`` runs (after a warm-up forward, which compiles)."""
    from torch.profiler import profile

    _logits(model, ids)
    with profile() as prof:
        _logits(model, ids)
    return [e.name for e in prof.events()]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_w8a8_runs_torchao_int8_gemm(compiled):
    """W8A8 computes with torchao's Int8Tensor: torch._int_mm (int8 x int8 -> int32) runs once per layer
    (``int8_gemm=True``: by default only where it is fast, a CPU with AVX512-VNNI / AMX, or CUDA), under
    torch.compile on a CPU (the activation quantization fused: no separate round op) or eagerly."""
    from modelopt_lite.quantization.compress.linear import _COMPILED, CompressedLinear

    model = mtq.compress(quantized("llama", "INT8_SMOOTHQUANT_CFG"), int8_gemm=True)
    layers = [m for m in model.modules() if isinstance(m, CompressedLinear)]
    assert len(layers) == 14
    assert all(m.uses_kernel and m.compile_int8 for m in layers)
    for m in layers:
        m.compile_int8 = compiled
    ops = _profiled_ops(model, batches(n=1)[0])
    assert ops.count("aten::_int_mm") == 14
    assert ("torchao::quantize_affine" in ops) is not compiled
    assert ("aten::round" in ops) is not compiled
    if compiled:
        assert {(torch.float32, 3, tuple(m.weight.shape)) for m in layers} <= set(_COMPILED)


def test_w8a8_compiles_every_layer_shape():
    """Each W8A8 layer shape gets its own compiled function: with one shared function, dynamo would reach
    its recompile limit (8) after a few shapes and run the other layers eagerly."""
    widths = [16 + 8 * i for i in range(11)]
    model = torch.nn.Sequential(*(torch.nn.Linear(a, b, bias=False) for a, b in itertools.pairwise(widths)))
    data = [torch.randn(4, widths[0], generator=torch.Generator().manual_seed(0))]
    mtq.compress(mtq.quantize(model, mtq.get_preset("INT8_SMOOTHQUANT_CFG"), data), int8_gemm=True)
    with torch.no_grad():
        model(data[0])
        from torch.profiler import profile

        with profile() as prof:
            out = model(data[0])
    ops = [e.name for e in prof.events()]
    assert out.shape == (4, widths[-1])
    assert ops.count("aten::_int_mm") == 10
    assert "torchao::quantize_affine" not in ops  # no layer fell back to the eager torchao linear


def test_w8a8_compiled_equals_eager_and_falls_back(monkeypatch, lib_caplog):
    """The compiled int8 linear computes what the eager one computes (within W8A8_TOLERANCE of the fake
    quant either way); a compilation failure logs one warning and the layers run eagerly from then on."""
    from modelopt_lite.quantization.compress import linear as compressed

    model = mtq.compress(quantized("llama", "INT8_SMOOTHQUANT_CFG"), int8_gemm=True)
    ids = batches(n=2, seed=5)[0]
    with_compile = _logits(model, ids)
    for m in model.modules():
        if isinstance(m, compressed.CompressedLinear):
            m.compile_int8 = False
    torch.testing.assert_close(with_compile, _logits(model, ids), rtol=0, atol=1e-6)
    for m in model.modules():
        if isinstance(m, compressed.CompressedLinear):
            m.compile_int8 = True

    def broken(x, weight):
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

    monkeypatch.setattr(compressed, "_compiled_int8_linear", broken)
    monkeypatch.setitem(compressed._COMPILE, "failed", False)
    with lib_caplog.at_level(logging.WARNING):
        eager = _logits(model, ids)
        _logits(model, ids)
    torch.testing.assert_close(eager, with_compile, rtol=0, atol=1e-6)
    warnings = [r for r in lib_caplog.records if "torch.compile of the W8A8 int8 linear failed" in r.message]
    assert len(warnings) == 1
    assert "InvalidCxxCompiler" in warnings[0].message
    assert compressed._COMPILE["failed"]


def test_w8a8_int8_tensor_built_once_and_rebuilt_when_its_tensors_change(monkeypatch):
    """The torchao Int8Tensor of a W8A8 layer is built on the first forward and reused (rebuilding it per
    call cost as much as a small layer's GEMM); a changed amax (in place, as load_state_dict does, or a new
    tensor), a dtype cast or another input rank rebuild it, and the outputs follow."""
    from modelopt_lite.quantization.compress.linear import _INT8_WEIGHTS, CompressedLinear

    fake = quantized("llama", "INT8_SMOOTHQUANT_CFG")
    model = mtq.compress(copy.deepcopy(fake), int8_gemm=True)
    builds = []
    build = CompressedLinear._int8_weight

    def spy(self, dtype, ndim):
        builds.append((dtype, ndim))
        return build(self, dtype, ndim)

    monkeypatch.setattr(CompressedLinear, "_int8_weight", spy)
    ids = batches(n=1, seed=3)[0]
    first = _logits(model, ids)
    assert len(builds) == 14
    assert torch.equal(_logits(model, ids), first)
    assert len(builds) == 14  # reused: not one more build

    layer, fake_layer = model.model.layers[0].mlp.down_proj, fake.model.layers[0].mlp.down_proj
    x = torch.randn(2, 5, layer.in_features, generator=torch.Generator().manual_seed(0))
    rtol, atol = W8A8_TOLERANCE
    with torch.no_grad():
        for q in (layer.input_quantizer, fake_layer.input_quantizer):  # in place, as load_state_dict does
            q._amax.mul_(0.5)
        torch.testing.assert_close(layer(x), fake_layer(x), rtol=rtol, atol=atol)
        for q in (layer.input_quantizer, fake_layer.input_quantizer):  # a new tensor
            q.amax = q.amax * 3.0
        torch.testing.assert_close(layer(x), fake_layer(x), rtol=rtol, atol=atol)
        torch.testing.assert_close(layer(x[0]), fake_layer(x[0]), rtol=rtol, atol=atol)  # 2-D input
        before = layer(x)
        layer.register_buffer("weight_scale", layer.weight_scale * 2)  # another tensor (same version)
        assert torch.equal(layer(x), 2 * before)  # no bias: the output scales by 2 exactly
    assert builds[14:] == [(torch.float32, 3), (torch.float32, 3), (torch.float32, 2), (torch.float32, 3)]
    model.to(torch.bfloat16)
    assert layer not in _INT8_WEIGHTS  # a cast drops it: it would keep the replaced buffers alive
    assert _logits(model, ids).dtype == torch.bfloat16
    assert builds[-1] == (torch.bfloat16, 3)


def test_w8a8_int8_gemm_choice():
    """By default W8A8 runs the int8 GEMM where torch._int_mm is fast; int8_gemm=False dequantizes on the
    fly, bit-exact."""
    model = quantized("llama", "INT8_SMOOTHQUANT_CFG")
    auto = mtq.compress(copy.deepcopy(model))
    fast = fast_int8_gemm(torch.device("cpu"))
    assert {m.uses_kernel for m in auto.modules() if hasattr(m, "quant_algo")} == {fast}
    exact = mtq.compress(copy.deepcopy(model), int8_gemm=False)
    ids = batches(n=1, seed=4)[0]
    assert torch.equal(_logits(exact, ids), _logits(model, ids))


def test_conv1d_w8a8_falls_back_to_dequantize_and_one_info_line_per_format(lib_caplog):
    """GPT-2's Conv1D has no kernel path: W8A8 dequantizes on the fly there (bit-exact), with one INFO line
    for the format; a model with two formats gets two lines."""
    model = mtq.quantize(tiny_gpt2(), mtq.INT8_SMOOTHQUANT_CFG, batches(n=1))
    ref = _logits(model, batches(n=1, seed=3)[0])
    with lib_caplog.at_level(logging.INFO, logger="modelopt_lite.quantization.compress"):
        mtq.compress(model, int8_gemm=True)
    lines = [r.getMessage() for r in lib_caplog.records if "dequantize on the fly" in r.getMessage()]
    assert len(lines) == 1
    assert "W8A8_SQ_PER_CHANNEL" in lines[0]
    assert torch.equal(_logits(model, batches(n=1, seed=3)[0]), ref)

    lib_caplog.clear()
    two = quantized("llama", "NVFP4_AWQ_LITE_CFG")  # AWQ leaves some layers plain NVFP4
    with lib_caplog.at_level(logging.INFO, logger="modelopt_lite.quantization.compress"):
        mtq.compress(two)
    lines = [r.getMessage() for r in lib_caplog.records if "dequantize on the fly" in r.getMessage()]
    assert sorted(line.split()[2] for line in lines) == sorted(set(compressed_layers(two).values()))


def test_missing_torchao_names_the_extra(monkeypatch):
    model = quantized("llama", "INT8_WEIGHT_ONLY_CFG")
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'modelopt_lite\[torchao\]'"):
        mtq.compress(model)
    assert not compressed_layers(model)


def test_compress_before_calibration_names_the_quantizers():
    model = quantized("llama", "FP8_DEFAULT_CFG")
    model.model.layers[1].mlp.down_proj.input_quantizer.amax = None
    with pytest.raises(RuntimeError, match=r"layers\.1\.mlp\.down_proj\.input_quantizer \(no amax\)"):
        mtq.compress(model)
    assert not compressed_layers(model)  # nothing changed


def test_bad_input_refused():
    with pytest.raises(ValueError, match="no quantized linear layer"):
        mtq.compress(tiny_llama())
    with pytest.raises(ValueError, match=r"expected None, a CompressConfig or \{layer pattern: bool\}"):
        mtq.compress(quantized("llama", "FP8_DEFAULT_CFG"), config=mtq.FP8_DEFAULT_CFG)
    model = mtq.compress(quantized("llama", "FP8_DEFAULT_CFG"))
    with pytest.raises(mtq.UnsupportedFeatureError, match=r"before mtq\.compress"):
        mtq.fold_weight(model)
    with pytest.raises(mtq.UnsupportedFeatureError, match=r"calibrate \(mtq\.quantize, mtq\.calibrate\)"):
        mtq.calibrate(model, "max", batches(n=1))


def test_config_selects_layers_as_the_reference():
    model = quantized("llama", "INT8_SMOOTHQUANT_CFG")
    mtq.compress(model, {"*mlp*": False, "default": True, "*layers.1.mlp.up_proj": True})
    names = set(compressed_layers(model))
    assert len(names) == 9  # 8 attention projections and up_proj of layer 1
    assert "model.layers.1.mlp.up_proj" in names
    assert not any("mlp" in n for n in names - {"model.layers.1.mlp.up_proj"})
    model = mtq.compress(quantized("llama", "INT8_SMOOTHQUANT_CFG"), mtq.CompressConfig(quant_gemm=False))
    assert len(compressed_layers(model)) == 14
    assert not any(getattr(m, "uses_kernel", False) for m in model.modules())


def test_deepcopy_and_dtype_cast_keep_codes_and_scales():
    model = mtq.compress(quantized("llama", "NVFP4_DEFAULT_CFG"))
    ids = batches(n=1)[0]
    assert torch.equal(_logits(copy.deepcopy(model), ids), _logits(model, ids))
    layer = model.model.layers[0].mlp.up_proj
    before = {n: b.clone() for n, b in layer.named_buffers(recurse=False)}
    model.to(torch.bfloat16)
    for name, buf in layer.named_buffers(recurse=False):
        assert torch.equal(buf, before[name]), name
    assert _logits(model, batches(n=1)[0]).dtype == torch.bfloat16
    assert layer.quantized_weight().dtype == torch.bfloat16


@pytest.mark.parametrize("trainer", ["QATTrainer", "QADTrainer"])
def test_trainers_refuse_a_compressed_model(tmp_path, trainer):
    from modelopt_lite import training

    model = mtq.compress(quantized("llama", "INT8_WEIGHT_ONLY_CFG"))
    kwargs = {"teacher_model": tiny_llama()} if trainer == "QADTrainer" else {}
    with pytest.raises(ValueError, match="train before compressing"):
        getattr(training, trainer)(
            model=model, args=cpu_args(tmp_path), train_dataset=CountingData(), **kwargs
        )


@pytest.mark.parametrize(
    "preset", ["INT8_SMOOTHQUANT_CFG", "NVFP4_DEFAULT_CFG", "INT4_AWQ_CFG", "MXFP4_DEFAULT_CFG"]
)
def test_mto_save_restore_keeps_weights_packed(tmp_path, preset):
    """mto.save writes the packed tensors (safetensors, no pickle); mto.restore onto a fresh model re-creates
    the compressed layers and gives the same outputs."""
    from safetensors import safe_open

    import modelopt_lite.opt as mto

    model = mtq.compress(quantized("llama", preset))
    path = mto.save(model, tmp_path / "compressed.safetensors")
    name = "model.layers.0.mlp.down_proj"
    with safe_open(str(path), "pt") as f:
        assert f.get_tensor(f"{name}.weight").dtype == model.get_submodule(name).weight.dtype
    restored = mto.restore(tiny_llama(seed=1), path)
    assert compressed_layers(restored) == compressed_layers(model)
    assert "weight" not in dict(restored.get_submodule(name).named_parameters(recurse=False))
    ids = batches(n=1, seed=9)[0]
    assert torch.equal(_logits(restored, ids), _logits(model, ids))


def test_unpackable_shape_refused_before_any_change():
    """A layer the format cannot pack (MXFP8 needs in_features divisible by 32) is named before any layer
    is compressed."""
    model = tiny_llama()
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(120, 64, bias=False)
    model.model.layers[1].mlp.up_proj = torch.nn.Linear(64, 120, bias=False)
    model.model.layers[1].mlp.gate_proj = torch.nn.Linear(64, 120, bias=False)
    model = mtq.quantize(model, mtq.MXFP8_DEFAULT_CFG, batches(n=1))
    with pytest.raises(UnsupportedFormatError, match=r"layers\.1\.mlp\.down_proj: MXFP8 needs in_features"):
        mtq.compress(model)
    assert not compressed_layers(model)


def test_export_of_a_compressed_model_refused(tmp_path):
    from modelopt_lite.export import export_hf_checkpoint

    model = mtq.compress(quantized("llama", "FP8_DEFAULT_CFG"))
    with pytest.raises(UnsupportedFormatError, match="export the model before compressing it"):
        export_hf_checkpoint(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_int4_partial_last_block_round_trips():
    """INT4 block-128 over 176 inputs: the second block of each row is partial; the compressed layer keeps
    the quantizer's block (group_size), so it dequantizes each code with its own block's scale."""
    cfg = mtq.get_preset("INT4_AWQ_CFG")
    cfg["algorithm"] = "max"
    model = mtq.quantize(tiny_llama(hidden=88), cfg, batches(n=1))
    compressed = mtq.compress(copy.deepcopy(model))
    down = compressed.get_submodule("model.layers.0.mlp.down_proj")
    assert down.weight_scale.shape == (88, 2)
    assert down.group_size == 128
    ids = batches(n=1, seed=5)[0]
    assert torch.equal(_logits(compressed, ids), _logits(model, ids))
