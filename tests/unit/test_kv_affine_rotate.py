"""Affine (``bias``) and rotated (``rotate``) quantizers and the reference's KV presets that use them:
``FP8_AFFINE_KV_CFG``, ``NVFP4_AFFINE_KV_CFG``, ``NVFP4_KV_ROTATE_CFG`` (issue 15)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import modelopt_lite.export as mte
import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq
from modelopt_lite.export.layers import UnsupportedFormatError
from modelopt_lite.formats import hadamard_transform
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.quantization import tensor_quant

from ._expect import int_expect, nvfp4_expect
from ._models import batches, tiny_llama

AXES = {-2: None, -4: None}  # the reference's KV bias: per head and channel (reduced over batch, tokens)
FP8 = {"num_bits": (4, 3), "axis": None}
NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}

# nvidia-modelopt 0.47 on CPU: TensorQuantizer(QuantizerAttributeConfig(**cfg)) calibrated on _x1() then _x2()
# (load_calib_amax, load_calib_bias), then applied to _x1(). Its NVFP4 kernel needs CUDA (not compared here).
REFERENCE = {
    "fp8_mean": ({**FP8, "bias": {**AXES, "type": "static"}}, 3.0416667461395264),
    "fp8_maxmin": ({**FP8, "bias": {**AXES, "type": "static", "method": "max_min"}}, 2.75),
    "int8_dynamic": ({"num_bits": 8, "axis": None, "bias": {**AXES, "type": "dynamic"}}, 6.75),
}
REFERENCE_OUT = {
    "fp8_mean": [
        -2.85416651, 2.25744057, 1.46130955, 6.42261887, -0.247023776, -0.892857075, 3.95982122, 3.27232146,
        2.14285707, 1.49702382, 0.700892925, 5.77083302, -0.956845164, 4.00446415, 3.23735118, 2.53720236,
        1.48735118, 0.745535731, 5.57291651, 5.03571415, -1.82589269, 3.24404764, 2.50069761, 1.77678573,
        0.730654716, -0.023809433, 5.04613113, 4.25, -2.41964269, 2.47470236, 1.78720236, 6.85714245,
        -0.00260414183, -0.675595164, 4.28571415, 3.48958349, 2.51934528, 1.72321439, 1.01041675,
        6.01339245, -0.739583254, 4.33035707, 3.50892854, 2.75446439, 1.75892854, 0.962797642, 0.358631134,
        5.14434528
    ],
    "fp8_maxmin": [
        -2.80357146, 2.22321439, 1.49999988, 6.45535707, -0.25, -1.01785719, 3.95535707, 3.21428561,
        2.30357146, 1.48660719, 0.714285612, 5.76785707, -1.00000012, 3.97321439, 3.24553585, 2.5,
        1.45535719, 0.732142806, 5.75, 4.95535707, -1.78571439, 3.23660707, 2.50892854, 1.71428561,
        0.732142925, 0.0133928061, 5.03571415, 4.24553585, -2.41071439, 2.51785707, 1.79464281, 6.65178585,
        -0.00446426868, -0.723214388, 4.25, 3.50892854, 2.53571439, 1.76339281, 1.03571415, 6.03571415,
        -0.705357194, 4.26785707, 3.49107146, 2.79464293, 1.75000012, 1.02678561, 0.249999762, 5.25
    ],
    "int8_dynamic": [
        -2.75524926, 2.23818874, 1.4931103, 6.48818874, -0.257217824, -1.00393689, 3.9911418, 3.24606323,
        2.24081349, 1.49409437, 0.749015808, 5.74409437, -1.0068897, 3.98818874, 3.2398293, 2.49311018,
        1.49114168, 0.746063113, 5.73786068, 4.9911418, -1.75098419, 3.24409437, 2.49573493, 1.74901581,
        0.752624631, 0.0059055686, 5.00098419, 4.25590563, -2.48950124, 2.50393677, 1.75885832, 6.75393677,
        0.00853016973, -0.738188863, 4.25688982, 3.51181126, 2.50098419, 1.75590563, 1.00754595, 6.00098419,
        -0.741141677, 4.25393677, 3.50557733, 2.7588582, 1.7568897, 1.01181114, 0.263451338, 5.25688982
    ],
}  # fmt: skip


def _x1() -> torch.Tensor:
    a = torch.arange(48, dtype=torch.float32).reshape(2, 2, 3, 4)
    return ((a * 37) % 23 - 11) / 4 + (a % 4) * 1.5  # exact values, an offset per channel


def _x2() -> torch.Tensor:
    return _x1().flip(0) * 0.5 + 1


def _calibrated(cfg: dict, *xs: torch.Tensor) -> TensorQuantizer:
    q = TensorQuantizer(cfg)
    q.disable_quant()
    q.enable_calib()
    for x in xs:
        q(x)
    q.load_calib_amax()
    q.disable_calib()
    q.enable_quant()
    return q


@pytest.mark.parametrize("case", sorted(REFERENCE))
def test_affine_fake_quant_equals_the_reference(case):
    cfg, amax = REFERENCE[case]
    q = _calibrated(cfg, _x1(), _x2())
    assert q.amax.item() == amax
    torch.testing.assert_close(q(_x1()).flatten(), torch.tensor(REFERENCE_OUT[case]), rtol=0, atol=1e-6)


def test_functional_fake_quant_takes_a_bias_as_the_reference():
    q = _calibrated(REFERENCE["fp8_mean"][0], _x1(), _x2())
    x = _x1().requires_grad_()
    y = tensor_quant.scaled_e4m3(x, q.amax, q.bias_value, 4, 3)
    torch.testing.assert_close(y.flatten(), torch.tensor(REFERENCE_OUT["fp8_mean"]), rtol=0, atol=1e-6)
    y.sum().backward()  # clipped where the centred input is beyond the amax
    assert torch.equal(x.grad, ((_x1() - q.bias_value).abs() <= q.amax).float())
    bias = _x1().mean(dim=(0, 2), keepdim=True)
    y = tensor_quant.fake_tensor_quant(_x1(), torch.tensor(2.0), bias, 8, False, False)
    np.testing.assert_allclose(y.numpy(), int_expect((_x1() - bias).numpy(), 2.0) + bias.numpy(), atol=1e-6)
    x = _x1().repeat(1, 1, 1, 4)  # the dynamic block kernel quantizes the input itself, as the reference's
    plain = tensor_quant.dynamic_block_quant(x, 16, torch.tensor(7.0), None, (2, 1), (4, 3))
    assert torch.equal(tensor_quant.dynamic_block_quant(x, 16, torch.tensor(7.0), x, (2, 1), (4, 3)), plain)


def test_static_bias_is_the_running_mean_per_head_and_channel():
    x1, x2 = _x1(), _x2()
    q = _calibrated({**FP8, "bias": AXES}, x1, x2)
    m1, m2 = x1.mean(dim=(0, 2), keepdim=True), x2.mean(dim=(0, 2), keepdim=True)
    assert q.bias_value.shape == (1, 2, 1, 4)
    torch.testing.assert_close(q.bias_value, (m1 + m2) / 2)
    # the amax is calibrated on the input minus the bias known when it was seen
    assert q.amax.item() == max((x1 - m1).abs().max().item(), (x2 - (m1 + m2) / 2).abs().max().item())
    q.bias_value = torch.zeros(1, 2, 1, 4)  # a zero bias: plain FP8 with that amax
    assert torch.equal(q(x1), TensorQuantizer(FP8, amax=q.amax)(x1))
    q.reset_amax()  # as the reference's, also forgets the bias
    assert q.bias_value is None


def test_nvfp4_affine_quantizes_the_input_itself_with_the_amax_of_the_centred_input():
    # As the reference's dynamic block kernel: the bias is calibrated (and exported) and shifts the amax
    x1, x2 = _x1().repeat(1, 1, 1, 8), _x2().repeat(1, 1, 1, 8)  # 32 channels: two NVFP4 blocks
    q = _calibrated({**NVFP4, "bias": AXES}, x1, x2)
    m1 = x1.mean(dim=(0, 2), keepdim=True)
    m = (m1 + x2.mean(dim=(0, 2), keepdim=True)) / 2
    torch.testing.assert_close(q.bias_value, m)
    assert q.amax.item() == max((x1 - m1).abs().max().item(), (x2 - m).abs().max().item())
    expected = nvfp4_expect(x1.numpy(), global_amax=q.amax.item())
    np.testing.assert_array_equal(q(x1).numpy(), expected)


def test_static_bias_calibration_in_several_processes_raises(monkeypatch):
    monkeypatch.setattr("modelopt_lite.nn.quantizer.calibration.is_distributed", lambda: True)
    with pytest.raises(NotImplementedError, match="not merged across ranks"):
        _calibrated({**FP8, "bias": AXES}, _x1())


def test_bias_settings_are_validated():
    for bad, match in [
        ({"type": "static"}, "axes to reduce over"),
        ({-1: None, "method": "median"}, "method"),
        ({-1: None, "type": "sometimes"}, "type"),
        ({"enable": True}, "axes to reduce over"),
    ]:
        with pytest.raises(ValueError, match=match):
            TensorQuantizer({**FP8, "bias": bad})
    q = TensorQuantizer({**FP8, "bias": AXES}, amax=1.0)
    with pytest.raises(RuntimeError, match="no calibrated bias_value"):
        q(_x1())


def _hadamard(n: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix by its closed form: H[i, j] = (-1) ** popcount(i & j), normalized."""
    i = torch.arange(n)
    bits = torch.tensor([bin(v).count("1") for v in (i[:, None] & i[None, :]).flatten().tolist()])
    return ((-1.0) ** bits).reshape(n, n).double() / math.sqrt(n)


def test_hadamard_transform_is_the_normalized_sylvester_matrix_in_blocks():
    torch.manual_seed(0)
    for n in (2, 16, 64):
        x = torch.randn(3, 5, n, dtype=torch.float64)
        torch.testing.assert_close(hadamard_transform(x), x @ _hadamard(n))
        torch.testing.assert_close(hadamard_transform(hadamard_transform(x)), x)  # its own inverse
    x = torch.randn(4, 48, dtype=torch.float64)  # not a power of two: blocks of its largest one, 16
    blocks = x.reshape(4, 3, 16) @ _hadamard(16)
    torch.testing.assert_close(hadamard_transform(x), blocks.reshape(4, 48))
    torch.testing.assert_close(hadamard_transform(x, 8), (x.reshape(4, 6, 8) @ _hadamard(8)).reshape(4, 48))
    with pytest.raises(ValueError, match="no power-of-two divisor"):
        hadamard_transform(torch.ones(2, 15))
    with pytest.raises(ValueError, match="power of two dividing"):
        hadamard_transform(torch.ones(2, 48), 32)
    with pytest.raises(ValueError, match="block_size=12 must be a power of two"):
        TensorQuantizer({"num_bits": 8, "rotate": {"enable": True, "block_size": 12}})
    with pytest.raises(ValueError, match="mode='back'"):
        TensorQuantizer({"num_bits": 8, "rotate": {"enable": True, "mode": "back"}})
    with pytest.raises(ValueError, match="k_bmm_quantizer: Hadamard rotation"):
        TensorQuantizer("k_bmm_quantizer", rotate=True, enable=False)(torch.ones(2, 15))


def test_a_disabled_quantizer_still_rotates_and_rotate_back_undoes_it():
    x = torch.randn(2, 16)
    q = TensorQuantizer({"num_bits": 8, "rotate": True, "enable": False})
    torch.testing.assert_close(q(x), (x.double() @ _hadamard(16)).float())
    back = TensorQuantizer(
        {"num_bits": 8, "rotate": {"enable": True, "mode": "rotate_back"}, "enable": False}
    )
    torch.testing.assert_close(back(x), x)
    on = TensorQuantizer({"num_bits": 8, "rotate": {"enable": True, "mode": "rotate_back"}}, amax=2.0)
    plain = TensorQuantizer({"num_bits": 8}, amax=2.0)
    torch.testing.assert_close(on(x), hadamard_transform(plain(hadamard_transform(x))))


def _rotation_cfg(q_rotate: bool) -> dict:
    return {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*q_bmm_quantizer", "cfg": {"rotate": q_rotate}, "enable": False},
            {"quantizer_name": "*k_bmm_quantizer", "cfg": {"rotate": True}, "enable": False},
        ],
        "algorithm": "max",
    }


def test_rotating_the_query_and_the_keys_leaves_attention_unchanged():
    data = batches()
    plain = tiny_llama()
    both = mtq.quantize(tiny_llama(), _rotation_cfg(True), data)
    keys_only = mtq.quantize(tiny_llama(), _rotation_cfg(False), data)
    with torch.no_grad():
        ref, out_both, out_keys = plain(data[0]).logits, both(data[0]).logits, keys_only(data[0]).logits
    torch.testing.assert_close(out_both, ref, rtol=0, atol=1e-5)
    assert (out_keys - ref).abs().max() > 1e-3  # the rotation happens: rotating only the keys changes it
    keys_only.set_attn_implementation("sdpa")  # an implementation that would skip the rotation: refused
    with pytest.raises(RuntimeError, match="would bypass them"):
        keys_only(data[0])
    keys_only.set_attn_implementation("modelopt_lite_sdpa")
    # a rule that only disables (as the reference's {"enable": False}) also stops the rotation
    mtq.set_quantizer_by_cfg(keys_only, [{"quantizer_name": "*", "enable": False}])
    mtq.set_quantizer_attributes_partial(both, "*", {"enable": False})
    mtq.disable_quantizer(rotated := mtq.quantize(tiny_llama(), _rotation_cfg(False), data), "*")
    with torch.no_grad():
        torch.testing.assert_close(keys_only(data[0]).logits, ref, rtol=0, atol=0)
        torch.testing.assert_close(both(data[0]).logits, ref, rtol=0, atol=0)
        torch.testing.assert_close(rotated(data[0]).logits, ref, rtol=0, atol=0)


def _kv_quantized(model_preset: str, kv_preset: str, model=None):
    cfg = mtq.update_quant_cfg_with_kv_cache_quant(
        getattr(mtq, model_preset), getattr(mtq, kv_preset)["quant_cfg"]
    )
    return mtq.quantize(model if model is not None else tiny_llama(), cfg, batches())


def test_nvfp4_rotate_preset_quantizes_the_rotated_keys(tmp_path):
    model = _kv_quantized("NVFP4_DEFAULT_CFG", "NVFP4_KV_ROTATE_CFG")
    mto.save(model, tmp_path / "q.pth")  # the rotation is part of the saved quantizer state
    with torch.no_grad():
        restored = mto.restore(tiny_llama(), tmp_path / "q.pth")
        assert torch.equal(restored(batches()[0]).logits, model(batches()[0]).logits)
    attn = model.model.layers[0].self_attn
    seen = {}

    def keep(slot):
        return lambda mod, args, out: seen.setdefault(slot, (args[0], out)) and None

    hooks = [getattr(attn, f"{s}_bmm_quantizer").register_forward_hook(keep(s)) for s in "qkv"]
    with torch.no_grad():
        model(batches()[0])
    for h in hooks:
        h.remove()
    h16 = _hadamard(16)  # head_dim 16
    query, rotated_query = seen["q"]
    torch.testing.assert_close(rotated_query, (query.double() @ h16).float())  # disabled, still rotated
    keys, quantized_keys = seen["k"]
    k_amax = attn.k_bmm_quantizer.amax.item()
    expected = nvfp4_expect((keys.double() @ h16).float().numpy(), global_amax=k_amax)
    np.testing.assert_allclose(quantized_keys.numpy(), expected, rtol=0, atol=1e-6)
    values, quantized_values = seen["v"]  # values are not rotated
    np.testing.assert_array_equal(
        quantized_values.numpy(), nvfp4_expect(values.numpy(), attn.v_bmm_quantizer.amax.item())
    )


@pytest.mark.parametrize(
    ("model_preset", "kv_preset"),
    [
        ("FP8_DEFAULT_CFG", "FP8_AFFINE_KV_CFG"),
        ("NVFP4_DEFAULT_CFG", "NVFP4_AFFINE_KV_CFG"),
        ("NVFP4_DEFAULT_CFG", "NVFP4_KV_ROTATE_CFG"),
    ],
)
def test_kv_presets_quantize_a_model_as_the_reference_readme_merges_them(model_preset, kv_preset):
    model = _kv_quantized(model_preset, kv_preset)
    without_kv = mtq.quantize(tiny_llama(), getattr(mtq, model_preset), batches())
    for layer in model.model.layers:
        attn = layer.self_attn
        k, v, q = attn.k_bmm_quantizer, attn.v_bmm_quantizer, attn.q_bmm_quantizer
        assert k.is_enabled
        assert v.is_enabled
        assert not q.is_enabled
        assert k.amax is not None
        assert v.amax is not None
        if "AFFINE" in kv_preset:
            assert k.bias_value.shape == v.bias_value.shape == (1, 2, 1, 16)  # (1, KV heads, 1, head_dim)
        else:
            assert k.attributes.rotation()
            assert q.attributes.rotation()
            assert not v.attributes.rotation()
    with torch.no_grad():
        out, ref = model(batches()[0]).logits, without_kv(batches()[0]).logits
    assert torch.isfinite(out).all()
    assert not torch.equal(out, ref)
    assert mtq.with_kv_cache(
        getattr(mtq, model_preset), kv_preset
    ) == mtq.update_quant_cfg_with_kv_cache_quant(
        getattr(mtq, model_preset), getattr(mtq, kv_preset)["quant_cfg"]
    )


def test_affine_kv_state_restores_and_exports_k_bias_as_the_reference(tmp_path):
    model = _kv_quantized("FP8_DEFAULT_CFG", "FP8_AFFINE_KV_CFG")
    mto.save(model, tmp_path / "q.pth")
    fresh = mto.restore(tiny_llama(), tmp_path / "q.pth")
    attn, fresh_attn = model.model.layers[1].self_attn, fresh.model.layers[1].self_attn
    assert torch.equal(fresh_attn.k_bmm_quantizer.bias_value, attn.k_bmm_quantizer.bias_value)
    assert fresh_attn.v_bmm_quantizer.attributes.bias == {**AXES, "type": "static"}
    with torch.no_grad():
        assert torch.equal(fresh(batches()[0]).logits, model(batches()[0]).logits)
    mte.export_hf_checkpoint(model, export_dir=tmp_path / "hf")
    t = load_file(tmp_path / "hf" / "model.safetensors")
    for x in "kv":
        bias = getattr(attn, f"{x}_bmm_quantizer").bias_value
        assert torch.equal(t[f"model.layers.1.self_attn.{x}_proj.{x}_bias"], bias)  # (1, heads, 1, head_dim)
        assert f"model.layers.1.self_attn.{x}_proj.{x}_scale" in t
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert not any("k_bias" in n for n, _ in loaded.named_parameters())


def test_export_refuses_what_the_checkpoint_cannot_record(tmp_path):
    # (NVFP4 KV caches, affine or rotated: tests/unit/test_export_kv_nvfp4.py)
    rotated = mtq.update_quant_cfg_with_kv_cache_quant(
        mtq.FP8_DEFAULT_CFG, [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {**FP8, "rotate": True}}]
    )
    with pytest.raises(UnsupportedFormatError, match="Hadamard rotation"):
        mte.export_hf_checkpoint(mtq.quantize(tiny_llama(), rotated, batches()), export_dir=tmp_path)


@pytest.mark.parametrize(
    ("name", "affine", "rotate"),
    [("fp8_affine", True, False), ("nvfp4_affine", True, False), ("nvfp4_rotate", False, True)],
)
def test_the_ptq_command_line_takes_the_references_kv_cache_names(tmp_path, name, affine, rotate):
    """--kv_cache_qformat fp8_affine / nvfp4_affine / nvfp4_rotate, as the reference's hf_ptq names them: a
    model quantized with the built config has a static bias on its K / V quantizers (or rotated keys)."""
    from modelopt_lite.cli.ptq import build_config, parse_args

    argv = ["--pyt_ckpt_path", str(tmp_path), "--qformat", "fp8", "--kv_cache_qformat", name]
    assert parse_args([*argv, "--export_path", str(tmp_path / "out")]).kv_cache_qformat == name
    model = tiny_llama()
    mtq.quantize(model, build_config("fp8", name), batches())
    attn = model.model.layers[0].self_attn
    for slot in ("k_bmm_quantizer", "v_bmm_quantizer"):
        q = getattr(attn, slot)
        assert q.is_enabled
        assert (q.bias_value is not None) == affine, slot
    assert (attn.k_bmm_quantizer.attributes.rotation() is not None) == rotate
    assert not attn.q_bmm_quantizer.is_enabled
