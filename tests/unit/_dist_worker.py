"""Run by ``torchrun --nproc_per_node 2`` from test_distributed.py: one scenario per call, results written
per rank into the output directory (safetensors for tensors, JSON for outcomes)."""

import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard

from modelopt_lite.training.qat_trainer import learnable_amax_parameters

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import modelopt_lite.quantization as mtq
from modelopt_lite.distributed import weight_access
from tests.unit._models import tiny_llama, tiny_qwen3_moe

CONFIG = mtq.with_kv_cache(mtq.NVFP4_DEFAULT_CFG, "FP8_KV_CFG")
MODELS = {"llama": tiny_llama, "moe": tiny_qwen3_moe}


def batches(n: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 12), generator=g) for _ in range(n)]


def amax_of(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, q in mtq.iter_quantizers(model):
        stages = list(q) if isinstance(q, mtq.SequentialQuantizer) else [q]
        for i, s in enumerate(stages):
            if s.amax is not None:
                out[f"{name}.{i}"] = s.amax.detach().clone().contiguous()
    return out


def shard(model) -> None:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (DTensor.full_tensor) and every buffer."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone().contiguous()
    for name, b in model.named_buffers():
        out[name] = b.detach().clone().contiguous()
    return out


def calibrate_sharded(kind: str, out: Path, rank: int) -> None:
    model = MODELS[kind]()
    mtq.quantize(model, CONFIG, skip_calibration=True)  # quantizers before sharding
    shard(model)
    mtq.calibrate(model, "max", batches()[rank::2])  # this rank's half of the data
    save_file(amax_of(model), str(out / f"amax_{rank}.safetensors"))


def fold_sharded(kind: str, out: Path, rank: int) -> None:
    model = MODELS[kind]()
    mtq.quantize(model, CONFIG, skip_calibration=True)
    shard(model)
    mtq.calibrate(model, "max", batches()[rank::2])
    mtq.fold_weight(model)
    state = full_state(model)
    if rank == 0:
        save_file(state, str(out / "folded.safetensors"))


def _outcome(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


def bad_input(kind: str, out: Path, rank: int) -> None:
    model = MODELS[kind]()
    mtq.quantize(model, CONFIG, skip_calibration=True)
    shard(model)
    layer = model.model.layers[0].mlp
    outcomes = {}

    def outside():
        with weight_access(torch.nn.Linear(4, 4), root=model):
            pass

    def nested():
        with weight_access(layer, root=model), weight_access(layer.up_proj):
            pass

    def one_rank_raises():
        with weight_access(layer, root=model, timeout=30):
            if rank == 1:
                raise ValueError("rank 1 failed inside the window")

    outcomes["outside"] = _outcome(outside)
    outcomes["nested"] = _outcome(nested)
    outcomes["one_rank_raises"] = _outcome(one_rank_raises)
    outcomes["restored"] = type(layer.up_proj.weight).__name__  # the shard is back after the errors
    # calibration (forwards, windows) still works after the failed windows: nothing hangs or is half-restored
    mtq.calibrate(model, "max", batches(2)[rank::2])
    outcomes["calibrated_after"] = model.model.layers[0].mlp.up_proj.input_quantizer.amax is not None
    other = MODELS[kind]() if rank == 0 else tiny_llama(layers=3)
    mtq.quantize(other, CONFIG, skip_calibration=True)
    outcomes["mismatched_quantizers"] = _outcome(lambda: mtq.calibrate(other, "max", batches(2)))
    (out / f"outcomes_{rank}.json").write_text(json.dumps(outcomes))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def qat_ddp(kind: str, out: Path, rank: int) -> None:
    """QATTrainer under torchrun (accelerate: DDP on CPU) with FSDP requested through the environment."""
    from transformers import TrainerCallback

    from modelopt_lite.training import QATTrainer, QuantizationArguments
    from tests.unit._training import CountingData, cpu_args, step_losses

    records = _Records()
    logging.getLogger("modelopt_lite").addHandler(records)

    class Amax(TrainerCallback):  # amax as calibrated, before any training step
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            save_file(amax_of(model), str(out / f"amax_{rank}.safetensors"))

    trainer = QATTrainer(
        model=MODELS[kind](),
        args=cpu_args(out / "run", max_steps=3, per_device_train_batch_size=2),
        train_dataset=CountingData(),
        quant_args=QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=8),
        callbacks=[Amax()],
    )
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"trained_{rank}.safetensors")
    )
    result = {
        "warnings": records.messages,
        "losses": step_losses(trainer),
        "type": str(trainer.accelerator.distributed_type),
    }
    (out / f"qat_{rank}.json").write_text(json.dumps(result))


def qat_fsdp2(kind: str, out: Path, rank: int) -> None:
    """QATTrainer on FSDP2 through accelerate. accelerate turns FSDP into DDP on CPU; the shim
    ``benchmarks/_harness.fsdp2_on_cpu`` puts FSDP2 back after the accelerator is built (``kind``:
    ``STEPS``, ``STEPS:resume``, ``STEPS:qad``, ``STEPS:save``, ``STEPS:la`` or, with learnable amax
    checkpointed at step 3, ``STEPS:la_save`` / ``STEPS:la_resume``, on DDP with ``:ddp`` after them)."""
    from _harness import fsdp2_on_cpu  # (benchmarks/: the FSDP2-on-CPU shim the benchmarks use too)
    from transformers import TrainerCallback

    from modelopt_lite.training import QADTrainer, QATTrainer, QuantizationArguments
    from tests.unit._training import CountingData, cpu_args, step_losses

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= stop

    FSDP2OnCPU, QADFSDP2OnCPU = fsdp2_on_cpu(QATTrainer), fsdp2_on_cpu(QADTrainer)

    stop, _, mode = kind.partition(":")
    stop = int(stop)
    mode, _, backend = mode.partition(":")  # ``STEPS:la_save:ddp``: the same job on accelerate's DDP
    args = cpu_args(out, max_steps=6, per_device_train_batch_size=2, save_strategy="steps", save_steps=3)
    quant = QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=8)
    if mode == "la":  # learnable amax: INT8 weights per channel, inputs per tensor (1-element parameters)
        quant = learn_amax_args()
        args = cpu_args(out, max_steps=6, per_device_train_batch_size=2, optim="sgd", save_strategy="no")
    if mode in ("la_save", "la_resume"):  # learnable amax, checkpointed at step 3 (AdamW, the default)
        quant = learn_amax_args()
    common = dict(
        model=tiny_llama(), args=args, train_dataset=CountingData(), quant_args=quant, callbacks=[StopAt()]
    )
    if mode == "qad":
        trainer = QADFSDP2OnCPU(**common, teacher_model=tiny_llama(seed=1))
        teacher_weight = trainer.teacher.model.layers[0].mlp.up_proj.weight
        trainer.train()
        result = {"losses": step_losses(trainer), "teacher": type(teacher_weight).__name__}
        (out / f"qad_{rank}.json").write_text(json.dumps(result))
        return
    if mode == "save":
        trainer = FSDP2OnCPU(**common)
        trainer.train()
        trainer.save_model(str(out / "final"))
        state = full_state(trainer.model)
        if rank == 0:
            save_file(state, str(out / "gathered.safetensors"))
        return
    if mode in ("la_save", "la_resume"):
        trainer = (QATTrainer if backend == "ddp" else FSDP2OnCPU)(**common)
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-3") if mode == "la_resume" else None)
        state = full_state(trainer.model)  # weights and learnable amax (parameters), gathered whole
        if rank == 0:
            save_file(state, str(out / f"{mode}_{stop}.safetensors"))
        # the amax the amax check reads: the parameters the model and the optimizer hold
        live = {id(p) for p in learnable_amax_parameters(trainer.model).values()}
        optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
        checked = {id(p) for p in trainer._amax_params.values()}
        result = {
            "losses": step_losses(trainer),
            "sharded": type(trainer.model.model.embed_tokens.weight).__name__,
            "checked": "the model's and the optimizer's" if checked == live <= optimized else "others",
        }
        (out / f"{mode}_{stop}_{rank}.json").write_text(json.dumps(result))
        return
    resume = mode == "resume"
    trainer = FSDP2OnCPU(**common)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-3") if resume else None)
    weight = trainer.model.model.layers[0].mlp.up_proj.weight
    result = {
        "losses": step_losses(trainer),
        "sharded": type(weight).__name__,
        "amax": amax_of(trainer.model),
    }
    if mode == "la":  # the learnable amax gathered whole, and how they were held
        params = learnable_amax_parameters(trainer.model)
        result["amax"] = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in params.items()
        }
        result["amax_types"] = sorted({type(p).__name__ for p in params.values()})
    result["amax"] = {k: v.tolist() for k, v in result["amax"].items()}
    suffix = "_resumed" if resume else "_la" if mode == "la" else ""
    (out / f"fsdp2_{stop}{suffix}_{rank}.json").write_text(json.dumps(result))


def learn_amax_args():
    from modelopt_lite.training import QuantizationArguments

    return QuantizationArguments(
        recipe="INT8_DEFAULT_CFG", calib_size=8, learn_amax=True, amax_lr_multiplier=5.0
    )


def qat_not_distributed(kind: str, out: Path, rank: int) -> None:
    """A GPU-style launch on a machine without GPUs (use_cpu=False): the Trainer stays single-process on
    every rank; QATTrainer must refuse instead of letting each process train its own copy."""
    from modelopt_lite.training import QATTrainer, QuantizationArguments
    from tests.unit._training import CountingData, cpu_args

    args = cpu_args(out / "run", use_cpu=False)
    quant = QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=8)
    outcome = _outcome(
        lambda: QATTrainer(model=MODELS[kind](), args=args, train_dataset=CountingData(), quant_args=quant)
    )
    (out / f"launch_{rank}.json").write_text(json.dumps({"world_size": args.world_size, "outcome": outcome}))


AQ_FORMATS = ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"]


def aq_batches() -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": x, "labels": x} for x in batches()]


def auto_quantize_search(model, method: str, data) -> dict:
    """One ``mtq.auto_quantize`` search at 6 bits; the search state (JSON data)."""
    _, state = mtq.auto_quantize(
        model, {"effective_bits": 6.0}, AQ_FORMATS, data,
        (lambda m, b: m(**b)) if method == "gradient" else (lambda m, b: m(input_ids=b["input_ids"]).logits),
        (lambda out, b: out.loss) if method == "gradient" else None,
        num_calib_steps=len(data), num_score_steps=len(data), method=method,
    )  # fmt: skip
    return state


def auto_quantize_ranks(kind: str, out: Path, rank: int) -> None:
    """The search on every rank, each on its half of the data: the model replicated (as before
    fully_shard) and FSDP2-sharded (then a forward of the searched model); a format calibrated with a
    search algorithm is refused on the sharded model."""
    states = {
        m: auto_quantize_search(MODELS[kind](), m, aq_batches()[rank::2]) for m in ("gradient", "kl_div")
    }
    for method in ("gradient", "kl_div"):
        sharded = MODELS[kind]()
        shard(sharded)
        states[f"sharded {method}"] = auto_quantize_search(sharded, method, aq_batches()[rank::2])
        logits = sharded(input_ids=aq_batches()[0]["input_ids"]).logits.detach()
        save_file({"logits": logits.contiguous()}, str(out / f"aq_logits_{method}_{rank}.safetensors"))
    sharded = MODELS[kind]()
    shard(sharded)
    mse = {**mtq.FP8_DEFAULT_CFG, "algorithm": "mse"}
    states["sharded mse"] = _outcome(
        lambda: mtq.auto_quantize(
            sharded,
            {"effective_bits": 6.0},
            ["NVFP4_DEFAULT_CFG", mse],
            aq_batches()[rank::2],
            lambda m, b: m(input_ids=b["input_ids"]).logits,
            method="kl_div",
        )
    )
    states["sharded mse left quantizers"] = any("quantizer" in n for n, _ in sharded.named_modules())
    (out / f"auto_quantize_{rank}.json").write_text(json.dumps(states))


def lora_ddp(kind: str, out: Path, rank: int) -> None:
    """QATTrainer with LoRA adapters (merged) under torchrun (accelerate: DDP on CPU)."""
    from peft import LoraConfig

    from modelopt_lite.training import QATTrainer, QuantizationArguments
    from tests.unit._training import CountingData, cpu_args, step_losses

    trainer = QATTrainer(
        model=MODELS[kind](),
        args=cpu_args(out / "run", max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2),
        train_dataset=CountingData(),
        quant_args=QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=8),
        lora_config=LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"]),
    )
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(out / f"lora_{rank}.safetensors")
    )
    result = {"losses": step_losses(trainer), "type": str(trainer.accelerator.distributed_type)}
    (out / f"lora_{rank}.json").write_text(json.dumps(result))


def lost_rank(kind: str, out: Path, rank: int) -> None:
    """QATTrainer under torchrun where rank 1 dies (SIGKILL, after writing the time to ``died``) in the
    phase ``kind``: ``calibration`` (its first calibration forward), ``training`` (after step 1) or
    ``training_step`` (in the forward of step 2, so that the survivor fails in DDP's collectives); with
    ``hung_step[:SECONDS]`` it stops there instead (SIGSTOP), ``ddp_timeout`` SECONDS (8)."""
    import signal
    import time

    from transformers import TrainerCallback

    from modelopt_lite.training import QATTrainer, QuantizationArguments
    from tests.unit._training import CountingData, cpu_args

    hang = kind.startswith("hung_step")  # rank 1 stops (SIGSTOP: alive, never answering) in step 2's forward
    timeout = int(kind.partition(":")[2] or 8) if hang else 60  # ``hung_step:SECONDS`` (default 8)
    if hang:
        kind = "training_step"

    def die() -> None:
        (out / "died").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP if hang else signal.SIGKILL)

    armed = [kind == "calibration"]

    class DieAfterStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if rank == 1 and state.global_step == 1:
                if kind == "training":
                    die()
                armed[0] = True  # training_step: in the next forward

    model = tiny_llama()
    if kind in ("calibration", "training_step") and rank == 1:
        model.register_forward_pre_hook(lambda *_: die() if armed[0] else None)
    trainer = QATTrainer(
        model=model,
        args=cpu_args(out / "run", max_steps=3, per_device_train_batch_size=2, ddp_timeout=timeout),
        train_dataset=CountingData(),
        quant_args=QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=8),
        callbacks=[DieAfterStep()] if kind.startswith("training") else [],
    )
    trainer.train()


SCENARIOS = {
    "lost_rank": lost_rank,
    "lora_ddp": lora_ddp,
    "auto_quantize": auto_quantize_ranks,
    "qat_not_distributed": qat_not_distributed,
    "calibrate": calibrate_sharded,
    "fold": fold_sharded,
    "bad_input": bad_input,
    "qat_ddp": qat_ddp,
    "qat_fsdp2": qat_fsdp2,
}


def main(scenarios=SCENARIOS) -> None:
    """``<worker> SCENARIO KIND OUT_DIR`` under torchrun (other workers pass their own scenarios)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    scenario, kind, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if not scenario.startswith(("qat_", "lost_rank")):  # for these the Trainer's accelerate state sets it up
        dist.init_process_group("gloo")
    try:
        scenarios[scenario](kind, out, int(os.environ["RANK"]))
        if dist.is_initialized():
            dist.barrier()  # both ranks done before teardown (a rank leaving first made gloo abort at exit)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Success: leave without the interpreter's teardown. Under FSDP2 on gloo (a CPU-only test setup) a rank
    # sometimes aborted in torch's C++ static destructors after everything had finished and been written
    # ("terminate called without an active exception"), even after barrier + destroy_process_group.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
