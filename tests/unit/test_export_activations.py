"""``load_hf_checkpoint(dir, activations="fake")``: an export reloaded (dequantized and ``compress=True``)
with each quantized layer's input, and the KV cache, fake-quantized from the scales the checkpoint stores
computes what the exported fake-quant model computed; a wrong stored scale shows."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelopt_lite.export import load_hf_checkpoint
from modelopt_lite.nn import QuantLinear

from ._export_cases import FORMATS, export, quantized
from ._models import batches

#: formats that quantize activations (static scale stored, or dynamic), and a weight-only one
PRESETS = [
    "FP8_DEFAULT_CFG",
    "INT8_SMOOTHQUANT_CFG",
    "W4A8_AWQ_BETA_CFG",
    "NVFP4_DEFAULT_CFG",
    "NVFP4_AWQ_LITE_CFG",
    "MXFP8_DEFAULT_CFG",
    "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "INT4_AWQ_CFG",
]
#: the amax a reload recovers is ``(amax / max) * max`` in float32, within an ulp of the calibrated one, and
#: the dequantized INT / FP8 weights are within a few ulp of the fake-quantized ones (a folded
#: pre_quant_scale too): the logits of the tiny model differ by float rounding (at most 3e-7 measured; 0 for
#: NVFP4, NVFP4_AWQ, W4A8_AWQ, MXFP8), a dense-activation reload by 1.8e-2 or more
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """``(preset, kv) -> (fake-quant model after export, export directory)``, built once."""
    cache: dict = {}

    def get(preset: str, kv: str | None = None, model_name: str = "llama"):
        key = (preset, kv, model_name)
        if key not in cache:
            model = quantized(model_name, preset, kv)
            directory = tmp_path_factory.mktemp("act") / f"{model_name}-{preset}-{kv}"
            export(model, directory)
            cache[key] = (model, directory)
        return cache[key]

    return get


def _tampered(directory, tmp_path, suffix: str, factor: float = 2.0):
    """A copy of the export whose stored tensors ending in ``suffix`` are multiplied by ``factor``."""
    out = tmp_path / f"tampered{suffix}"
    out.mkdir()
    for f in directory.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            hit = [k for k in tensors if k.endswith(suffix)]
            assert hit, f"the export stores no {suffix}"
            save_file({k: v * factor if k in hit else v for k, v in tensors.items()}, str(out / f.name),
                      metadata={"format": "pt"})  # fmt: skip
        else:
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.mark.parametrize("compress", [False, True], ids=["dequantized", "compressed"])
@pytest.mark.parametrize("preset", PRESETS)
def test_reload_with_activations_computes_the_fake_quant_model(exports, preset, compress):
    """The logits equal the full fake-quant model's (within the ulp of the recovered amax); a reload with
    dense activations does not, for a format that quantizes activations."""
    if compress:
        pytest.importorskip("torchao", reason="compress=True needs the torchao extra")
    model, directory = exports(preset)
    ids = batches(n=1, seed=7)[0]
    expected = _logits(model, ids)
    loaded = load_hf_checkpoint(directory, torch.float32, compress=compress, activations="fake")
    torch.testing.assert_close(_logits(loaded, ids), expected, **TOLERANCE)
    weight_only = FORMATS[preset] == "W4A16_AWQ"
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and module.weight_quantizer.is_enabled:
            ours, theirs = loaded.get_submodule(name).input_quantizer, module.input_quantizer
            assert ours.is_enabled == theirs.is_enabled == (not weight_only), name
            assert ours.spec == theirs.spec, name
            if theirs.amax is not None:  # within one ulp of the calibrated amax
                torch.testing.assert_close(
                    ours.amax.reshape(()), theirs.amax.reshape(()), rtol=2**-23, atol=0
                )
    if not weight_only:
        dense = _logits(load_hf_checkpoint(directory, torch.float32, compress=compress), ids)
        assert (dense - expected).abs().max() > 100 * TOLERANCE["atol"]


@pytest.mark.parametrize(
    ("preset", "kv"),
    [
        ("FP8_DEFAULT_CFG", "FP8_KV_CFG"),
        ("NVFP4_DEFAULT_CFG", "NVFP4_KV_CFG"),
        ("NVFP4_DEFAULT_CFG", "NVFP4_AFFINE_KV_CFG"),
    ],
)
def test_kv_cache_from_k_scale_v_scale(exports, preset, kv, tmp_path):
    """With a quantized KV cache the reload fake-quantizes keys and values from ``k_scale`` / ``v_scale``:
    the logits equal the fake-quant model's, and a tampered ``k_scale`` changes them."""
    model, directory = exports(preset, kv)
    ids = batches(n=1, seed=7)[0]
    expected = _logits(model, ids)
    loaded = load_hf_checkpoint(directory, torch.float32, activations="fake")
    torch.testing.assert_close(_logits(loaded, ids), expected, **TOLERANCE)
    attn = loaded.model.layers[0].self_attn
    assert attn.k_bmm_quantizer.is_enabled
    assert attn.v_bmm_quantizer.is_enabled
    assert attn.k_bmm_quantizer.spec == model.model.layers[0].self_attn.k_bmm_quantizer.spec
    tampered = load_hf_checkpoint(_tampered(directory, tmp_path, ".k_scale", 0.25), torch.float32,
                                  activations="fake")  # fmt: skip
    assert (_logits(tampered, ids) - expected).abs().max() > 100 * TOLERANCE["atol"]


@pytest.mark.parametrize("compress", [False, True], ids=["dequantized", "compressed"])
@pytest.mark.parametrize("preset", ["NVFP4_AWQ_LITE_CFG", "FP8_DEFAULT_CFG"])
def test_fused_experts(exports, preset, compress):
    """Qwen3-MoE: the fused experts get one input quantizer per projection from their experts' (shared)
    ``input_scale`` and ``pre_quant_scale``; the logits equal the fake-quant model's."""
    if compress:
        pytest.importorskip("torchao", reason="compress=True needs the torchao extra")
    from modelopt_lite.moe import QuantExperts

    model, directory = exports(preset, model_name="qwen3_moe")
    ids = batches(n=1, seed=7)[0]
    expected = _logits(model, ids)
    loaded = load_hf_checkpoint(directory, torch.float32, compress=compress, activations="fake")
    torch.testing.assert_close(_logits(loaded, ids), expected, **TOLERANCE)
    experts = [(n, m) for n, m in loaded.named_modules() if isinstance(m, QuantExperts)]
    assert experts
    for name, module in experts:
        for proj in module._projections:
            ours = getattr(module, f"{proj}_input_quantizer")
            theirs = getattr(model.get_submodule(name), f"{proj}_input_quantizer")
            assert ours.is_enabled, f"{name}.{proj}"
            assert ours.spec == theirs.spec
    dense = _logits(load_hf_checkpoint(directory, torch.float32, compress=compress), ids)
    assert (dense - expected).abs().max() > 100 * TOLERANCE["atol"]


@pytest.mark.parametrize("preset", ["FP8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG", "NVFP4_DEFAULT_CFG"])
def test_a_wrong_input_scale_shows(exports, preset, tmp_path):
    """The reload uses the stored ``input_scale``: the same checkpoint with every ``input_scale`` scaled no
    longer computes the fake-quant model (so a wrong scale in an export would be caught)."""
    model, directory = exports(preset)
    ids = batches(n=1, seed=7)[0]
    expected = _logits(model, ids)
    tampered = _tampered(directory, tmp_path, ".input_scale", 0.5)
    got = _logits(load_hf_checkpoint(tampered, torch.float32, activations="fake"), ids)
    assert (got - expected).abs().max() > 100 * TOLERANCE["atol"]


def test_missing_input_scale_is_an_error(exports, tmp_path):
    """A static activation format without its ``input_scale`` cannot be rebuilt: the error names the layer."""
    _, directory = exports("FP8_DEFAULT_CFG")
    out = tmp_path / "no-input-scale"
    out.mkdir()
    for f in directory.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            kept = {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.down_proj.input_scale"}
            save_file(kept, str(out / f.name), metadata={"format": "pt"})
        else:
            (out / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj.*no input_scale"):
        load_hf_checkpoint(out, torch.float32, activations="fake")
    load_hf_checkpoint(out, torch.float32)  # dense activations need no input_scale


def test_format_without_a_known_activation_quantization_is_an_error(exports, tmp_path):
    """A quant_algo whose activation quantization the loader does not know raises, naming it."""
    from modelopt_lite.export.load import activations as load_activations

    with pytest.raises(ValueError, match=r"MXFP4.*activations='dense'"):
        load_activations.input_cfg("MXFP4")
    _, directory = exports("FP8_DEFAULT_CFG")
    with pytest.raises(ValueError, match="activations"):
        load_hf_checkpoint(directory, torch.float32, activations="int8")
    config = json.loads((directory / "config.json").read_text())
    assert "activations" not in config["quantization_config"]  # a loading option, not a checkpoint fact
