"""``benchmarks/qat_step.py --interleaved`` (issue 19): the plain ``Trainer`` and a ``QATTrainer`` take their
optimizer steps in turn in one process; each trainer gets its own timed steps and really trains (its loss
moves, and the quantized model's differs from the plain one's)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import qat_step  # the benchmark script


def test_interleaved_steps_every_trainer_in_turn():
    out = qat_step._interleaved(["FP8_DEFAULT_CFG"], threads=1, warmup=1, steps=2, malloc="off", vocab=128)
    res = out["results"]
    assert list(res) == ["plain", "FP8_DEFAULT_CFG"]
    for r in res.values():
        assert len(r["times"]) == 2  # the warm-up step is not timed
        assert len(r["cpu"]) == 2
        assert all(t > 0 for t in r["times"])
        assert len(r["loss"]) == 3
        assert all(math.isfinite(v) for v in r["loss"])
        assert r["loss"][0] != r["loss"][-1]  # the optimizer stepped
    # same seed, data and steps: only the fake quantization tells the two apart
    assert res["plain"]["loss"][0] != res["FP8_DEFAULT_CFG"]["loss"][0]


def test_levers_off_trains_the_same_bits_with_the_eager_formulas():
    """``--levers-off``: the same preset with the native kernels and shared outputs off takes the same steps
    (its losses equal the default trainer's bit for bit), and the levers are on again afterwards."""
    from modelopt_lite.formats import native_fake_quant_enabled
    from modelopt_lite.nn import TensorQuantizer

    out = qat_step._interleaved(
        ["NVFP4_DEFAULT_CFG"], threads=1, warmup=1, steps=2, malloc="off", vocab=128, levers_off=True
    )
    res = out["results"]
    off = "NVFP4_DEFAULT_CFG" + qat_step.LEVERS_OFF
    assert list(res) == ["plain", "NVFP4_DEFAULT_CFG", off]
    assert res[off]["loss"] == res["NVFP4_DEFAULT_CFG"]["loss"]
    assert native_fake_quant_enabled()
    assert TensorQuantizer.share_outputs


def test_qad_steppers_add_the_teacher_forward_and_distill_from_it():
    """``--qad`` (issue 30): ``plain+teacher`` takes the plain step plus one no-grad forward of the frozen
    float teacher (its losses equal the plain trainer's bit for bit: the teacher changes nothing in the
    student), and ``QAD <preset>`` is a ``QADTrainer`` distilling from that same teacher."""
    import torch
    from transformers import LlamaForCausalLM

    teacher_forwards = []

    def count(module, args, output):
        if isinstance(module, LlamaForCausalLM) and not any(p.requires_grad for p in module.parameters()):
            teacher_forwards.append(torch.is_grad_enabled())

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        out = qat_step._interleaved(
            ["FP8_DEFAULT_CFG"],
            threads=1,
            warmup=1,
            steps=2,
            malloc="off",
            vocab=128,
            qad=["FP8_DEFAULT_CFG"],
        )
    finally:
        handle.remove()
    res = out["results"]
    qad = qat_step.QAD + "FP8_DEFAULT_CFG"
    assert list(res) == ["plain", qat_step.TEACHER, "FP8_DEFAULT_CFG", qad]
    for r in res.values():
        assert len(r["times"]) == 2
        assert len(r["cpu"]) == 2
        assert all(math.isfinite(v) for v in r["loss"])
    assert res[qat_step.TEACHER]["loss"] == res["plain"]["loss"]
    # one teacher forward per step for plain+teacher and one for QAD, all without autograd
    assert teacher_forwards == [False] * (2 * 3)
    # QAD's loss is the KL to the teacher (small: the student starts as the teacher, fake quantized), not
    # the cross-entropy on the labels that QAT minimises
    assert 0 < res[qad]["loss"][0] < 0.1 * res["FP8_DEFAULT_CFG"]["loss"][0]
    assert res[qad]["loss"][0] != res[qad]["loss"][-1]
