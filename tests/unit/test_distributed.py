"""Multi-process (gloo, 2 ranks, torchrun) quantization on FSDP2-sharded models: calibration equal to a
single process on all the data, folding through the weight-access window, and the bad-input list.

Select with ``-m distributed``; each test runs ``torchrun --nproc_per_node 2 tests/unit/_dist_worker.py``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import modelopt_lite.quantization as mtq
from modelopt_lite.opt.checkpoint import STATE_FILE

from ._dist_worker import (
    CONFIG,
    MODELS,
    amax_of,
    aq_batches,
    auto_quantize_search,
    batches,
    full_state,
    learn_amax_args,
)
from ._models import tiny_llama

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("_dist_worker.py")


def _torchrun(scenario: str, kind: str, out: Path, **env_vars: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env_vars}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(WORKER),
        scenario,
        kind,
        str(out),
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise AssertionError(
            f"torchrun {scenario} {kind} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )


def _single_process(kind: str) -> torch.nn.Module:
    model = MODELS[kind]()
    mtq.quantize(model, CONFIG, batches())
    return model


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_sharded_calibration_equals_one_process_on_every_rank(tmp_path, kind):
    _torchrun("calibrate", kind, tmp_path)
    expected = amax_of(_single_process(kind))
    assert any("k_bmm" in n for n in expected)
    assert any("experts" in n for n in expected) == (kind == "moe")
    for rank in (0, 1):
        got = load_file(str(tmp_path / f"amax_{rank}.safetensors"))
        assert got.keys() == expected.keys()
        different = [n for n in expected if not torch.equal(got[n], expected[n])]
        assert not different, f"rank {rank}: {different[:5]}"


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_fold_through_the_window_equals_folding_the_unsharded_model(tmp_path, kind):
    _torchrun("fold", kind, tmp_path)
    model = _single_process(kind)
    mtq.fold_weight(model)
    expected = full_state(model)
    got = load_file(str(tmp_path / "folded.safetensors"))
    assert got.keys() == expected.keys()
    different = [n for n in expected if not torch.equal(got[n], expected[n])]
    assert not different, different[:5]
    # folding changed the weights (the comparison is not between two unfolded copies)
    name = "model.layers.0.self_attn.o_proj.weight"
    assert not torch.equal(got[name], MODELS[kind]().state_dict()[name])


def test_auto_quantize_on_two_ranks_sums_the_scores_and_equals_one_process_on_all_the_data(tmp_path):
    # each rank scores its half of the batches, on the replicated model (before fully_shard) and on the
    # FSDP2-sharded one; summed over the ranks the scores are one process's on all the batches
    # (calibration: max over the ranks), and every rank picks the same formats
    _torchrun("auto_quantize", "llama", tmp_path)
    ranks = [json.loads((tmp_path / f"auto_quantize_{r}.json").read_text()) for r in (0, 1)]
    for method in ("gradient", "kl_div"):
        model = MODELS["llama"]()
        expected = auto_quantize_search(model, method, aq_batches())
        for got in (r[key] for r in ranks for key in (method, f"sharded {method}")):
            assert got["best"]["recipe"] == expected["best"]["recipe"]
            assert got["candidate_stats"].keys() == expected["candidate_stats"].keys()
            for name, stat in expected["candidate_stats"].items():
                assert got["candidate_stats"][name]["scores"] == pytest.approx(stat["scores"], rel=1e-4), name
        assert ranks[0][method] == ranks[1][method]
        assert ranks[0][f"sharded {method}"] == ranks[1][f"sharded {method}"]
        assert any(s > 0 for stat in expected["candidate_stats"].values() for s in stat["scores"])
        # the sharded model, searched, computes what the searched whole model computes
        logits = model(input_ids=aq_batches()[0]["input_ids"]).logits.detach()
        for r in (0, 1):
            got = load_file(str(tmp_path / f"aq_logits_{method}_{r}.safetensors"))["logits"]
            torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-6)
    for r in ranks:
        assert r["sharded mse"].startswith(
            "UnsupportedFeatureError: auto_quantize on an FSDP2-sharded model"
        ), r
        assert "CUSTOM_1 (mse) need whole weights" in r["sharded mse"], r
        assert not r["sharded mse left quantizers"]


def test_bad_input_fails_on_every_rank_without_hanging(tmp_path):
    _torchrun("bad_input", "llama", tmp_path)
    outcomes = [json.loads((tmp_path / f"outcomes_{r}.json").read_text()) for r in (0, 1)]
    for o in outcomes:
        assert o["outside"].startswith("ValueError: weight_access: the Linear given is not a submodule"), o
        assert o["nested"].startswith(
            "RuntimeError: weight_access: a window on a LlamaMLP is already open"
        ), o
        assert o["restored"] == "DTensor"
        assert o["calibrated_after"]
        assert "differ between ranks 0 and 1" in o["mismatched_quantizers"], o
        assert "only on rank 1: ['model.layers.2." in o["mismatched_quantizers"], o
    assert outcomes[1]["one_rank_raises"] == "ValueError: rank 1 failed inside the window"
    assert outcomes[0]["one_rank_raises"].startswith(
        "RankFailedError: weight-access window on LlamaMLP: rank(s) [1]"
    )


def test_qat_trainer_under_ddp_calibrates_on_shares_and_warns_about_dropped_fsdp(tmp_path):
    _torchrun("qat_ddp", "llama", tmp_path, ACCELERATE_USE_FSDP="true")
    from ._training import CountingData

    data = CountingData()
    model = MODELS["llama"]()
    mtq.quantize(model, "NVFP4_DEFAULT_CFG", [{"input_ids": data[i]["input_ids"][None]} for i in range(8)])
    expected = amax_of(model)
    results = [json.loads((tmp_path / f"qat_{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(results):
        got = load_file(str(tmp_path / f"amax_{rank}.safetensors"))
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[n], expected[n]) for n in expected), rank
        assert "MULTI_CPU" in result["type"]
        assert any("FSDP was requested" in w and "MULTI_CPU" in w for w in result["warnings"]), result
        assert len(result["losses"]) == 3
    # DDP kept the replicas identical through training
    trained = [load_file(str(tmp_path / f"trained_{r}.safetensors")) for r in (0, 1)]
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    assert not torch.equal(
        trained[0]["model.layers.0.mlp.up_proj.weight"], model.model.layers[0].mlp.up_proj.weight
    )


def test_lora_adapters_train_under_ddp_with_identical_replicas(tmp_path):
    _torchrun("lora_ddp", "llama", tmp_path)
    fresh = MODELS["llama"]().state_dict()
    results = [json.loads((tmp_path / f"lora_{r}.json").read_text()) for r in (0, 1)]
    assert all("MULTI_CPU" in r["type"] and len(r["losses"]) == 3 for r in results), results
    trained = [load_file(str(tmp_path / f"lora_{r}.safetensors")) for r in (0, 1)]
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0]), "replicas differ"
    lora_b = [k for k in trained[0] if "lora_B" in k]
    assert lora_b
    assert all(trained[0][k].abs().sum() > 0 for k in lora_b), "the adapters trained"
    for key, value in trained[0].items():  # the base weights are frozen
        plain = key.replace("base_model.model.", "", 1).replace(".base_layer", "")
        if plain in fresh:
            assert torch.equal(value, fresh[plain]), key


@pytest.mark.slow
def test_qat_under_fsdp2_resumes_exactly(tmp_path):
    _torchrun("qat_fsdp2", "6", tmp_path / "full")
    _torchrun("qat_fsdp2", "3", tmp_path / "split")
    _torchrun("qat_fsdp2", "6:resume", tmp_path / "split")
    for rank in (0, 1):
        full = json.loads((tmp_path / "full" / f"fsdp2_6_{rank}.json").read_text())
        first = json.loads((tmp_path / "split" / f"fsdp2_3_{rank}.json").read_text())
        resumed = json.loads((tmp_path / "split" / f"fsdp2_6_resumed_{rank}.json").read_text())
        assert full["sharded"] == "DTensor"  # the shim kept FSDP2: weights are shards
        assert len(full["losses"]) == 6
        assert first["losses"] == full["losses"][:3]
        assert resumed["losses"][-3:] == full["losses"][3:]
        assert resumed["amax"] == full["amax"]


def test_learnable_amax_under_fsdp2_matches_one_process(tmp_path):
    from modelopt_lite.training import QATTrainer
    from modelopt_lite.training.qat_trainer import learnable_amax_parameters

    from ._training import CountingData, StopAt, cpu_args

    _torchrun("qat_fsdp2", "3:la", tmp_path)
    ranks = [json.loads((tmp_path / f"fsdp2_3_la_{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["sharded"] == "DTensor"
    assert ranks[0]["amax_types"] == ["DTensor"]  # sharded like every parameter, gathered in forward
    assert ranks[0]["amax"] == ranks[1]["amax"]
    # one process, the same global batches (2 ranks x 2 = 4) and steps; SGD (Adam's normalisation would
    # magnify rounding differences of near-zero gradients into whole steps)
    args = cpu_args(tmp_path / "one", max_steps=6, per_device_train_batch_size=4, optim="sgd")
    one = QATTrainer(
        model=tiny_llama(), args=args, train_dataset=CountingData(), quant_args=learn_amax_args()
    )
    one.add_callback(StopAt(3))
    start = {n: p.detach().clone() for n, p in _calibrated(learn_amax_args()).items()}
    one.train()
    single = {n: p.detach() for n, p in learnable_amax_parameters(one.model).items()}
    assert single.keys() == ranks[0]["amax"].keys()
    assert len(single) == 2 * 7 * 2
    for name, value in single.items():
        torch.testing.assert_close(torch.tensor(ranks[0]["amax"][name]), value, rtol=1e-4, atol=1e-6)
    moved = [n for n in single if not torch.equal(torch.tensor(ranks[0]["amax"][n]), start[n])]
    assert len(moved) >= len(single) // 2  # and they were trained (some gradients are below one ulp)


@pytest.mark.parametrize("backend", ["fsdp2", pytest.param("ddp", marks=pytest.mark.slow)])
def test_learnable_amax_resumes_exactly(tmp_path, backend):
    # 6 steps uninterrupted = 3 steps, checkpointed, resumed to 6: losses, weights and learnable amax bit
    # for bit, and the quantizer state the last checkpoints record (issue 45, FSDP2: the resumed run stopped
    # at its first step, its amax check reading the zero placeholders fully_shard had left behind; a
    # per-tensor amax loaded from a sharded checkpoint was recorded as (1,) instead of a scalar)
    suffix = "" if backend == "fsdp2" else f":{backend}"
    _torchrun("qat_fsdp2", f"6:la_save{suffix}", tmp_path / "full")
    _torchrun("qat_fsdp2", f"3:la_save{suffix}", tmp_path / "split")
    _torchrun("qat_fsdp2", f"6:la_resume{suffix}", tmp_path / "split")
    for rank in (0, 1):
        full = json.loads((tmp_path / "full" / f"la_save_6_{rank}.json").read_text())
        first = json.loads((tmp_path / "split" / f"la_save_3_{rank}.json").read_text())
        resumed = json.loads((tmp_path / "split" / f"la_resume_6_{rank}.json").read_text())
        assert full["sharded"] == ("DTensor" if backend == "fsdp2" else "Parameter")
        assert full["checked"] == resumed["checked"] == "the model's and the optimizer's"
        assert len(full["losses"]) == 6
        assert first["losses"] == full["losses"][:3]
        assert resumed["losses"][-3:] == full["losses"][3:]
    full = load_file(str(tmp_path / "full" / "la_save_6.safetensors"))
    resumed = load_file(str(tmp_path / "split" / "la_resume_6.safetensors"))
    assert full.keys() == resumed.keys()
    assert sum(k.endswith("._amax") for k in full) == 2 * 7 * 2
    assert [k for k in full if not torch.equal(full[k], resumed[k])] == []
    start = _calibrated(learn_amax_args())
    assert any(not torch.equal(full[n], p.detach()) for n, p in start.items())  # the amax trained
    state = [json.loads((tmp_path / d / "checkpoint-6" / STATE_FILE).read_text()) for d in ("full", "split")]
    assert state[0] == state[1]


def _calibrated(quant):
    """The learnable amax of the model the trainers start from (calibrated, not trained)."""
    from modelopt_lite.quantization import quantize
    from modelopt_lite.training.qat_trainer import learnable_amax_parameters

    from ._training import CountingData

    data = CountingData()
    model = quantize(tiny_llama(), quant.quantize_config(), [data.ids[i : i + 1] for i in range(8)])
    return learnable_amax_parameters(model)


def test_qad_under_fsdp2_shards_the_teacher(tmp_path):
    _torchrun("qat_fsdp2", "3:qad", tmp_path)
    results = [json.loads((tmp_path / f"qad_{r}.json").read_text()) for r in (0, 1)]
    for result in results:
        assert result["teacher"] == "DTensor"
        assert len(result["losses"]) == 3
        assert all(0 < loss < 100 for loss in result["losses"])
    assert results[0]["losses"] == results[1]["losses"]  # logged losses are averaged over the ranks


def test_save_model_of_an_fsdp2_model_is_restorable_in_one_process(tmp_path):
    import modelopt_lite.opt as mto

    _torchrun("qat_fsdp2", "2:save", tmp_path)
    final = tmp_path / "final"
    assert (final / STATE_FILE).is_file()
    assert (
        json.loads((final / "config.json").read_text())["quantization_config"]["quant_method"]
        == "modelopt_lite"
    )
    gathered = load_file(str(tmp_path / "gathered.safetensors"))
    restored = mto.restore(MODELS["llama"](seed=7), final)
    state = full_state(restored)
    assert state.keys() == gathered.keys()
    assert all(torch.equal(state[k], gathered[k]) for k in state)


def test_processes_launched_without_a_distributed_trainer_are_refused(tmp_path):
    _torchrun("qat_not_distributed", "llama", tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"launch_{rank}.json").read_text())
        assert result["world_size"] == 1  # what the Trainer would have done: train alone on each rank
        assert result["outcome"].startswith(
            "RuntimeError: 2 processes were launched (WORLD_SIZE=2) but the Trainer is not distributed"
        ), result
