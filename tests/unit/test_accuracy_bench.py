"""``benchmarks/accuracy.py``: each PTQ row builds the model its name promises."""

from __future__ import annotations

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
