"""GPT-OSS experts (transposed, biases, clamped SwiGLU): MXFP4 QAT with the reference's recipe, exported in
the layout GPT-OSS ships and read back by transformers' own MXFP4 loader."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, Mxfp4Config

import modelopt_lite.quantization as mtq
from modelopt_lite.export import UnsupportedFormatError
from modelopt_lite.export.mxfp4 import export_gpt_oss_mxfp4

from ._models import VOCAB, batches
from .test_moe import COMMON, FAMILIES

RECIPE = "MXFP4_MLP_WEIGHT_ONLY_CFG"  # the reference's recipe for GPT-OSS QAT


def _qat(model, steps=6):
    model.train()
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model.eval(), losses


def test_mxfp4_qat_then_transformers_loads_the_gpt_oss_layout(tmp_path):
    model = mtq.quantize(FAMILIES["gpt_oss"](), mtq.get_preset(RECIPE), batches())
    experts = model.model.layers[0].mlp.experts
    before = experts.gate_up_proj.detach().clone()
    model, losses = _qat(model)
    assert losses[-1] < losses[0] - 0.05, losses
    assert not torch.equal(experts.gate_up_proj, before)  # the experts were trained

    export_gpt_oss_mxfp4(model, tmp_path)
    qcfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "mxfp4"
    assert "model.layers.0.mlp.router" in qcfg["modules_to_not_convert"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    prefix = "model.layers.0.mlp.experts"
    assert stored[f"{prefix}.gate_up_proj_blocks"].dtype == torch.uint8
    assert stored[f"{prefix}.gate_up_proj_blocks"].shape == (4, 64, 64 // 32, 16)  # (experts, out, in/32, 16)
    assert stored[f"{prefix}.gate_up_proj_scales"].shape == (4, 64, 2)
    assert stored[f"{prefix}.down_proj_blocks"].shape == (4, 64, 32 // 32, 16)
    assert f"{prefix}.gate_up_proj" not in stored
    assert f"{prefix}.down_proj_bias" in stored

    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    assert type(loaded.model.layers[0].mlp.experts).__name__ == "GptOssExperts"  # transformers' own class
    with torch.no_grad():
        for layer, theirs in zip(model.model.layers, loaded.model.layers, strict=True):
            for proj in ("gate_up_proj", "down_proj"):
                ours = layer.mlp.experts.quantized_weight(proj)
                assert torch.equal(getattr(theirs.mlp.experts, proj), ours), proj  # bit-exact
        x = batches(n=1, seed=7)[0]
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


def test_mxfp4_export_refuses_a_shape_off_the_32_block(tmp_path):
    torch.manual_seed(0)
    layers = {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"], "head_dim": 16}
    cfg = GptOssConfig(**COMMON, **layers, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    model = mtq.quantize(GptOssForCausalLM(cfg).eval(), mtq.get_preset(RECIPE), batches())
    with pytest.raises(
        UnsupportedFormatError, match=r"model\.layers\.0\.mlp\.experts\.down_proj: input size 48"
    ):
        export_gpt_oss_mxfp4(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_mxfp4_export_refuses_other_quantizers(tmp_path):
    model = mtq.quantize(FAMILIES["gpt_oss"](), mtq.MXFP4_DEFAULT_CFG, batches())
    with pytest.raises(UnsupportedFormatError, match="only the experts' weights"):
        export_gpt_oss_mxfp4(model, tmp_path / "out")
