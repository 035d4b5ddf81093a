"""Unified export of transposed fused experts: Llama 4's text experts (stored ``(experts, in, out)``) are
written per expert as ``(out, in)`` linear maps and load back through our loader into the fused model, with
the fake-quantized weights and logits."""

import pytest
import torch

import modelopt_lite.quantization as mtq
from modelopt_lite.export import UnsupportedFormatError, export_hf_checkpoint, load_hf_checkpoint

from ._export_cases import BIT_EXACT, assert_within_ulp, hf_quant, tensors
from ._models import batches, tiny_llama4
from .test_moe import FAMILIES

EXPERTS = "model.layers.0.feed_forward.experts"


@pytest.mark.parametrize(("preset", "algo"), [("NVFP4_DEFAULT_CFG", "NVFP4"), ("FP8_DEFAULT_CFG", "FP8")])
def test_llama4_experts_export_per_expert_and_load_back(tmp_path, preset, algo):
    model = mtq.quantize(tiny_llama4(), getattr(mtq, preset), batches())
    export_hf_checkpoint(model, tmp_path)
    assert hf_quant(tmp_path)["quantization"]["quant_algo"] == algo
    on_disk = tensors(tmp_path)
    experts = model.model.layers[0].feed_forward.experts
    hidden, inter = 64, 32
    for e in range(experts.num_experts):
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):  # fmt: skip
            weight = on_disk[f"{EXPERTS}.{e}.{proj}.weight"]
            assert weight.shape == (shape if algo == "FP8" else (shape[0], shape[1] // 2)), (e, proj)
            assert f"{EXPERTS}.{e}.{proj}.input_scale" in on_disk
    assert not any(k.startswith(f"{EXPERTS}.gate_up_proj") for k in on_disk)
    assert "model.layers.0.feed_forward.shared_expert.down_proj.weight_scale" in on_disk

    loaded = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    fused = loaded.model.layers[0].feed_forward.experts
    with torch.no_grad():
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


def test_interleaved_gate_up_experts_are_refused_naming_the_layer(tmp_path):
    model = mtq.quantize(FAMILIES["gpt_oss"](), mtq.NVFP4_DEFAULT_CFG, batches())
    with pytest.raises(UnsupportedFormatError, match=r"model\.layers\.0\.mlp\.experts: .*interleaves"):
        export_hf_checkpoint(model, tmp_path)
