"""Unified export of transposed fused experts: Llama 4's text experts and GPT-OSS's (stored
``(experts, in, out)``; GPT-OSS's with biases and gate / up rows interleaved) are written per expert as
``(out, in)`` linear maps and load back through our loader into the fused model, with the fake-quantized
weights and logits."""

import pytest
import torch

import modelopt_lite.quantization as mtq
from modelopt_lite.export import UnsupportedFormatError, export_hf_checkpoint, load_hf_checkpoint

from ._export_cases import BIT_EXACT, assert_within_ulp, hf_quant, tensors
from ._models import batches, tiny_llama4
from .test_moe import FAMILIES

#: family -> (tiny model, path of the first layer's experts)
FAMILIES_T = {
    "llama4": (tiny_llama4, "model.layers.0.feed_forward.experts"),
    "gpt_oss": (FAMILIES["gpt_oss"], "model.layers.0.mlp.experts"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES_T))
@pytest.mark.parametrize(("preset", "algo"), [("NVFP4_DEFAULT_CFG", "NVFP4"), ("FP8_DEFAULT_CFG", "FP8")])
def test_transposed_experts_export_per_expert_and_load_back(tmp_path, family, preset, algo):
    build, path = FAMILIES_T[family]
    model = mtq.quantize(build(), getattr(mtq, preset), batches())
    export_hf_checkpoint(model, tmp_path)
    assert hf_quant(tmp_path)["quantization"]["quant_algo"] == algo
    on_disk = tensors(tmp_path)
    experts = model.get_submodule(path)
    hidden, inter = 64, 32
    for e in range(experts.num_experts):
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):  # fmt: skip
            weight = on_disk[f"{path}.{e}.{proj}.weight"]
            assert weight.shape == (shape if algo == "FP8" else (shape[0], shape[1] // 2)), (e, proj)
            assert f"{path}.{e}.{proj}.input_scale" in on_disk
            assert (f"{path}.{e}.{proj}.bias" in on_disk) == (family == "gpt_oss")
    assert not any(k.startswith(f"{path}.gate_up_proj") for k in on_disk)
    if family == "llama4":
        assert "model.layers.0.feed_forward.shared_expert.down_proj.weight_scale" in on_disk

    loaded = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    fused = loaded.get_submodule(path)
    with torch.no_grad():
        if family == "gpt_oss":  # gate and up rows interleaved again
            assert torch.equal(fused.gate_up_proj_bias, experts.gate_up_proj_bias)
            assert torch.equal(fused.down_proj_bias, experts.down_proj_bias)
        for proj in ("gate_up_proj", "down_proj"):
            expected = experts.quantized_weight(proj)
            assert getattr(fused, proj).shape == expected.shape  # back in (experts, in, out)
            if algo in BIT_EXACT:
                assert torch.equal(getattr(fused, proj), expected), proj
            else:
                assert_within_ulp(getattr(fused, proj), expected)
        for name, q in mtq.iter_quantizers(model):  # the loaded model computes with dense activations
            if "weight_quantizer" not in name:
                q.disable()
        x = batches(n=1, seed=7)[0]
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


def test_interleaved_gate_up_in_a_row_scaled_format_is_refused_naming_the_layer(tmp_path):
    """Per-row scales (INT8 per channel) would need reordering with the rows: refused, not miswritten."""
    model = mtq.quantize(FAMILIES["gpt_oss"](), mtq.INT8_WEIGHT_ONLY_CFG, batches())
    with pytest.raises(
        UnsupportedFormatError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj\[0\]: .*interleaves"
    ):
        export_hf_checkpoint(model, tmp_path)
