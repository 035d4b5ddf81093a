"""``benchmarks/accuracy.py``: each PTQ row builds the model its name promises."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from modelopt_lite.quantization import iter_quantizers

from ._models import batches, tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import accuracy


def test_rotation_rows_rotate_the_residual_stream() -> None:
    base = tiny_llama(seed=0)
    calib = batches(n=2)
    plain = accuracy.ptq_model("nvfp4_nokv", base, calib)
    ids = calib[0]
    with torch.no_grad():
        expected = plain(ids).logits
    for row in ("nvfp4_rot", "nvfp4_nokv_rot"):
        rotated = accuracy.ptq_model(row, base, calib)
        assert hasattr(rotated.config, "modelopt_lite_rotation"), row
        with torch.no_grad():
            assert not torch.equal(rotated(ids).logits, expected), row
    assert not hasattr(base.config, "modelopt_lite_rotation")  # the base model is left as it was


def test_learnable_amax_rows_refuse_a_model_without_static_amax() -> None:
    base, calib = tiny_llama(seed=0), batches(n=2)
    with pytest.raises(ValueError, match="no enabled quantizer of this model has a static amax"):
        accuracy.make_amax_learnable(accuracy.ptq_model("nvfp4_nokv", base, calib))
    int4 = accuracy.ptq_model("int4", base, calib)
    assert accuracy.make_amax_learnable(int4) > 0
    assert any(q.learn_amax for _, q in iter_quantizers(int4))


def test_the_auto_quantize_row_mixes_formats_within_its_budget(monkeypatch) -> None:
    """``nvfp4_nokv_aq`` is an auto_quantize search, not the plain NVFP4 row: some layers leave NVFP4 W4A4
    (FP8 or unquantized) and the rest stay NVFP4 (7 bits: the tiny model's layers cannot all take NVFP4, so
    its reachable range starts above the real model's 5)."""
    monkeypatch.setattr(accuracy, "AQ_BITS", 7.0)
    base, calib = tiny_llama(seed=0), batches(n=2)
    model = accuracy.ptq_model("nvfp4_nokv_aq", base, calib)
    weights = {n: q for n, q in iter_quantizers(model) if n.endswith("weight_quantizer")}
    weights = {n: q for n, q in weights.items() if "lm_head" not in n}
    nvfp4 = [n for n, q in weights.items() if q.is_enabled and q.spec.block_sizes]
    assert nvfp4, sorted(weights)
    assert len(nvfp4) < len(weights), sorted(weights)
    plain = accuracy.ptq_model("nvfp4_nokv", base, calib)
    ids = calib[0]
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, plain(ids).logits)


def test_the_budget_curve_takes_every_qat_and_qad_row_run_at_two_budgets() -> None:
    def row(name: str, method: str, steps: int | None, seed: int | None = 0, **rec: float) -> dict:
        return {"name": name, "method": method, "steps": steps, "seed": seed, **rec}

    rec = {"test_recovery": 0.5, "kl_recovery": 0.25, "offdist_recovery": 0.125}
    result = {
        "kind": "smollm2-135m",
        "rows": [
            row("unquantized", "baseline", None, None),
            row("qad nvfp4_nokv", "qad", 96, **{**rec, "test_recovery": 0.75}),
            row("qad nvfp4_nokv", "qad", 16, **rec),
            row("qad nvfp4_nokv", "qad", 16, seed=1, test_recovery=0.9),  # not the first seed
            row("qat nvfp4_nokv", "qat", 16, **rec),
            row("qat nvfp4_nokv", "qat", 48, **rec),
            row("qad nvfp4_nokv_46", "qad", 48, **rec),  # one budget: no curve
            row("ft", "ft", 16),
        ],
    }
    got = accuracy.curves(result)
    assert list(got) == ["qad nvfp4_nokv", "qat nvfp4_nokv"]
    assert got["qad nvfp4_nokv"] == {
        "test_recovery": [(16, 50.0), (96, 75.0)],
        "kl_recovery": [(16, 25.0), (96, 25.0)],
        "offdist_recovery": [(16, 12.5), (96, 12.5)],
    }
    # QAT's off-distribution share is against a control that leaves that text itself: not drawn
    assert set(got["qat nvfp4_nokv"]) == {"test_recovery", "kl_recovery"}


def test_the_learning_rate_probe_trains_each_qad_row_at_each_rate(monkeypatch) -> None:
    """``--qad-lrs``: the QAD rows at each extra peak rate, in one process (the probe of docs/training.md)."""
    args = accuracy.parse_args(["--rows", "qad nvfp4_nokv", "--ptq", "nvfp4_nokv", "--qad-lrs", "3e-5,1e-3"])
    assert args.qad_lrs == [3e-5, 1e-3]
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--qad-lrs", "0"])
    seen: list[float] = []
    monkeypatch.setattr(accuracy, "run_training", lambda t: seen.append(t.args.learning_rate) or (None, {}))
    base = tiny_llama(seed=0)
    student = accuracy.ptq_model("nvfp4_nokv", base, batches(n=2))
    for lr in (None, *args.qad_lrs):
        accuracy._train("qad", student, base, batches(n=2), None, args, 2, 0, lr=lr)
    assert seen == [args.lr, 3e-5, 1e-3]


def test_lora_rows_name_their_rank_deployment_and_base() -> None:
    assert accuracy.lora_of("qad nvfp4_nokv +lora32") == (32, "merged", False)
    assert accuracy.lora_of("qad nvfp4_nokv +lora32s") == (32, "served", False)
    assert accuracy.lora_of("qad int4 +qlora32") == (32, "served", True)
    assert accuracy.lora_of("qad int4 +la") is None
    for rank in (8, 32, 128):
        assert accuracy.TRAIN_ROWS[f"qad nvfp4_nokv +lora{rank}"] == ("qad", "nvfp4_nokv", False)


def test_a_qlora_row_trains_adapters_on_the_compressed_base(monkeypatch) -> None:
    pytest.importorskip("torchao")
    seen = {}
    monkeypatch.setattr(accuracy, "run_training", lambda trainer: seen.setdefault("trainer", trainer))
    student = accuracy.ptq_model("int4", tiny_llama(), batches(n=1))
    args = accuracy.parse_args(["--models", "smollm2-135m", "--ptq", "int4", "--rows", "qad int4 +qlora32"])
    accuracy._train("qad", student, tiny_llama(), [], None, args, 2, 0, lora=(32, "served", True))
    model = seen["trainer"].model
    from modelopt_lite.nn.lora import lora_deploy
    from modelopt_lite.quantization.compress import compressed_layers

    assert lora_deploy(model) == "served"
    assert compressed_layers(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, p in model.named_parameters() if "lora_" in n
    }


def test_issue_44_rows_set_the_loss_and_the_learned_static_scales(monkeypatch) -> None:
    """``+rkl`` / ``+jsd`` / ``+topk`` reach DistillationArguments.distill_loss; ``nvfp4_nokv_mse`` is the
    static MSE-scale preset, whose ``+la`` rows learn its weight block scales, ``+la_only`` nothing else."""
    rows = ["qad nvfp4_nokv +rkl", "qad nvfp4_nokv_mse +jsd", "qad nvfp4_nokv_mse +la_only"]
    args = accuracy.parse_args(["--models", "smollm2-135m", "--ptq", "nvfp4_nokv,nvfp4_nokv_mse",
                                "--rows", ",".join(rows), "--jsd-beta", "0.3"])  # fmt: skip
    assert accuracy.TRAIN_ROWS["qad nvfp4_nokv_mse +la"] == ("qad", "nvfp4_nokv_mse", True)
    assert accuracy.TRAIN_ROWS["qad nvfp4_nokv_mse +la_only"] == ("qad", "nvfp4_nokv_mse", True)
    assert accuracy.loss_of("qad nvfp4_nokv") == "forward_kl"
    seen: list = []
    monkeypatch.setattr(accuracy, "run_training", lambda t: seen.append(t) or (None, {}))
    base, calib = tiny_llama(seed=0), batches(n=2)
    student = accuracy.ptq_model("nvfp4_nokv_mse", base, calib)
    assert student.model.layers[0].mlp.down_proj.weight_quantizer.spec.static_nvfp4
    for row in rows:
        accuracy._train("qad", copy.deepcopy(student), base, [], None, args, 2, 0,
                        learn_amax=row.endswith("+la_only"), row=row)  # fmt: skip
    assert [t.distill_args.distill_loss for t in seen] == ["reverse_kl", "jsd", "forward_kl"]
    assert seen[1].distill_args.jsd_beta == 0.3
    scale_only = seen[2]
    scale_only.model.train()
    from modelopt_lite.training.trainable import choose_trainable

    choose_trainable(scale_only.model, scale_only.quant_args)  # what its train() does first
    trainable = {n for n, p in scale_only.model.named_parameters() if p.requires_grad}
    assert trainable
    assert all(n.endswith("weight_quantizer._amax") for n in trainable)
