"""MoE experts that calibration routes no token to (docs/moe.md "Experts without calibration tokens").

One calibration token reaches two of the four experts of each layer (top-2), so two are left idle whatever
the weights. Fused experts (grouped_mm) share their input quantizers: the idle ones are named in a WARNING,
and quantize, export and reload work. Experts that are separate modules take the largest amax of the same
quantizer in the other experts of their layer. ``moe_experts_without_tokens="raise"`` makes both an error;
a module that never ran outside experts (or a whole layer of experts) stays one.
"""

import pytest
import torch

import modelopt_lite.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint, load_hf_checkpoint
from modelopt_lite.moe import QuantExperts, coverage_report

from ._export_cases import hf_quant, tensors
from ._models import batches, tiny_qwen3_moe, tiny_sequential_moe

ONE_TOKEN = [torch.tensor([[5]])]
STRICT = {"method": "max", "moe_experts_without_tokens": "raise"}
NVFP4_STRICT = {"quant_cfg": mtq.NVFP4_DEFAULT_CFG["quant_cfg"], "algorithm": STRICT}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def _fused(model) -> dict[str, QuantExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}


def test_fused_experts_without_tokens_warn_export_and_reload(tmp_path, lib_caplog):
    model = tiny_qwen3_moe()
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, ONE_TOKEN)
    assert model.config._experts_implementation == "grouped_mm"
    report = coverage_report(model)
    experts = _fused(model)
    assert len(experts) == 2
    warned = [m for m in _warnings(lib_caplog) if "received no calibration tokens" in m]
    assert len(warned) == 1
    for name, module in experts.items():
        idle = report[name]["experts_without_tokens"]
        assert len(idle) == 2, report[name]  # one token, top-2 of 4 experts
        assert f"{name} (fused): experts {idle} use the amax of the module's shared input" in warned[0]
        for e in idle:  # weights from the weights; inputs through the shared, calibrated quantizers
            q = module.gate_up_proj_weight_quantizers[e]
            assert torch.equal(q.amax, module.expert_weight("gate_up_proj", e).abs().amax())
        assert module.gate_up_proj_input_quantizer.amax > 0
        assert module.down_proj_input_quantizer.amax > 0

    export_hf_checkpoint(model, tmp_path)
    assert hf_quant(tmp_path)["quantization"]["quant_algo"] == "NVFP4"
    on_disk = tensors(tmp_path)
    for name, module in experts.items():
        shared = module.gate_up_proj_input_quantizer.amax / (6 * 448)
        for e in report[name]["experts_without_tokens"]:
            for proj in ("gate_proj", "up_proj"):
                torch.testing.assert_close(on_disk[f"{name}.{e}.{proj}.input_scale"], shared.reshape(()))
            assert on_disk[f"{name}.{e}.down_proj.weight"].dtype == torch.uint8

    loaded = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    for name, module in experts.items():
        for proj in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(loaded.get_submodule(name), proj), module.quantized_weight(proj))
    ids = batches(n=1, seed=7)[0]
    with torch.no_grad():
        dense = loaded(ids).logits
    assert torch.isfinite(dense).all()
    pytest.importorskip("torchao", reason="loading an export compressed needs the torchao extra")
    packed = load_hf_checkpoint(tmp_path, dtype=torch.float32, compress=True)
    with torch.no_grad():
        assert torch.equal(packed(ids).logits, dense)


def test_fused_strict_mode_raises_naming_the_idle_experts():
    model = tiny_qwen3_moe()
    with pytest.raises(RuntimeError, match=r"moe_experts_without_tokens='raise'") as err:
        mtq.quantize(model, NVFP4_STRICT, ONE_TOKEN)
    assert "model.layers.0.mlp.experts (fused): experts [" in str(err.value)
    assert "model.layers.1.mlp.experts (fused): experts [" in str(err.value)
    assert not list(mtq.iter_quantizers(model))  # a failed first quantize leaves the model as it was
    # with data that reaches every expert, the strict mode has nothing to say
    covered = tiny_qwen3_moe()
    mtq.quantize(covered, NVFP4_STRICT, batches(n=4))
    assert all(not r["experts_without_tokens"] for r in coverage_report(covered).values())


def test_strict_mode_applies_to_search_algorithms_and_the_pydantic_config():
    cfg = {"quant_cfg": mtq.NVFP4_DEFAULT_CFG["quant_cfg"], "algorithm": {**STRICT, "method": "mse"}}
    with pytest.raises(RuntimeError, match=r"2 MoE expert\(s\)|4 MoE expert\(s\)"):
        mtq.quantize(tiny_qwen3_moe(), cfg, ONE_TOKEN)
    pydantic = mtq.MaxCalibConfig(moe_experts_without_tokens="raise")
    with pytest.raises(RuntimeError, match="received no calibration tokens"):
        mtq.quantize(tiny_qwen3_moe(), {"quant_cfg": mtq.FP8_DEFAULT_CFG["quant_cfg"], "algorithm": pydantic},
                     ONE_TOKEN)  # fmt: skip


@pytest.mark.parametrize("value", ["maybe", True, None])
def test_the_option_takes_warn_or_raise_only(value):
    model = tiny_qwen3_moe()
    algorithm = {**STRICT, "moe_experts_without_tokens": value}
    cfg = {"quant_cfg": mtq.FP8_DEFAULT_CFG["quant_cfg"], "algorithm": algorithm}
    with pytest.raises(ValueError, match=r"moe_experts_without_tokens=.*allowed: \['warn', 'raise'\]"):
        mtq.quantize(model, cfg, ONE_TOKEN)
    assert not list(mtq.iter_quantizers(model))
    with pytest.raises(ValueError, match=r"allowed: \['warn', 'raise'\]"):
        mtq.MaxCalibConfig(moe_experts_without_tokens=value)


def test_sequential_experts_take_the_largest_amax_of_their_layer(lib_caplog):
    model = tiny_sequential_moe()
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, ONE_TOKEN)
    report = coverage_report(model)
    warned = [m for m in _warnings(lib_caplog) if "received no calibration tokens" in m]
    assert len(warned) == 1
    assert "4 MoE expert(s)" in warned[0]
    for i, layer in enumerate(model.layers):
        moe = layer.mlp
        routed, idle = sorted(moe.routed), sorted(set(range(4)) - moe.routed)
        assert len(routed) == len(idle) == 2
        container = f"layers.{i}.mlp.experts"
        assert report[container]["experts_without_tokens"] == idle
        for proj in ("gate_proj", "up_proj", "down_proj"):
            amax = {e: moe.experts[e].get_submodule(proj).input_quantizer.amax for e in range(4)}
            if proj == "down_proj":  # (gate / up read the same token in both) the routed keep their own
                assert amax[routed[0]] != amax[routed[1]]
            for e in idle:
                assert torch.equal(amax[e], torch.maximum(amax[routed[0]], amax[routed[1]])), (i, proj, e)
                name = f"{container}.{e}.{proj}.input_quantizer"
                assert report[container]["amax_from_other_experts"][name] == [
                    f"{container}.{r}.{proj}.input_quantizer" for r in routed
                ]
            text = f"{container}.[{', '.join(map(str, idle))}].{proj}.input_quantizer took the largest amax"
            assert f"{text} of experts [{', '.join(map(str, routed))}]" in warned[0]
    assert torch.isfinite(model(batches(n=1)[0])).all()
    # calibrated again on data that reaches every expert: nothing filled, nothing reported
    mtq.calibrate(model, "max", batches(n=4))
    assert not any("amax_from_other_experts" in r for r in coverage_report(model).values())


def test_sequential_strict_mode_raises():
    model = tiny_sequential_moe()
    cfg = {"quant_cfg": mtq.FP8_DEFAULT_CFG["quant_cfg"], "algorithm": STRICT}
    name = r"layers\.0\.mlp\.experts\.\[\d, \d\]\.gate_proj\.input_quantizer"
    with pytest.raises(RuntimeError, match=name):
        mtq.quantize(model, cfg, ONE_TOKEN)


def test_modules_that_never_ran_stay_an_error_even_inside_experts():
    """Layer 1 never runs: its dense projection and its experts (no expert of the layer saw data) raise."""
    model = tiny_sequential_moe()

    def first_layer_only(m):
        m.layers[0](m.embed(ONE_TOKEN[0]))

    with pytest.raises(RuntimeError, match=r"received no data during calibration: layers\.1\.proj") as err:
        mtq.quantize(model, mtq.FP8_DEFAULT_CFG, first_layer_only)
    assert "layers.1.mlp.experts.0.gate_proj.input_quantizer" in str(err.value)
    assert "layers.0." not in str(err.value)


def test_experts_smoothed_with_their_own_scales_cannot_stand_in():
    """W4A8 AWQ gives each routed expert a pre_quant_scale of its own; an idle expert has none, so the
    others' amax (of their scaled inputs) does not fit it: an error naming why, not a silent fill."""
    why = r"(?s)experts\.\d\.gate_proj\.input_quantizer.*pre_quant_scale of their own"
    with pytest.raises(RuntimeError, match=why):
        mtq.quantize(tiny_sequential_moe(), mtq.W4A8_AWQ_BETA_CFG, ONE_TOKEN)
