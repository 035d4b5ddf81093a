"""mtq.compress: weight memory per format and the CPU speed of the W8A8 compressed forward.

    OMP_NUM_THREADS=2 python benchmarks/compress.py [--repeats 5] [--tokens 64 256] [--json out.json]

Needs the torchao extra. Two models: the default dense model's architecture (``modelopt_lite.models.DENSE``,
untrained weights: memory and speed do not depend on their values) and a stack of two 4096 x 4096 linear
layers. Calibration uses random token ids / activations.

* Memory: for each format, the bytes of the quantized linear layers' weights after ``mtq.compress`` (codes
  and scales) against the same weights in bf16, and the whole compressed model (its other layers cast to
  bf16; parameters and buffers, quantizer amax included) against the whole model in bf16.
* Speed (``--threads``, default 2 threads): forward time of the W8A8 (INT8_SMOOTHQUANT_CFG) compressed model,
  on torchao's int8 GEMM (``int8_gemm=True``) and dequantizing on the fly (``int8_gemm=False``), against the
  fp32 and bf16 models and the fake-quant W8A8 model, at each ``--tokens`` count (one batch of
  ``tokens / 64`` sequences of 64), as median and min of ``--repeats`` runs after a warm-up. Timings on a
  shared machine are noisy: compare the minimums.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections.abc import Callable

import _harness as h
import torch
from torch import nn

import modelopt_lite.quantization as mtq
from modelopt_lite.models import DENSE
from modelopt_lite.quantization.compress import compressed_layers, fast_int8_gemm
from modelopt_lite.quantization.packers import UnsupportedFormatError

#: preset -> how it is calibrated here (AWQ's search replaced by max: the stored format is the same)
FORMATS = {
    "INT8_SMOOTHQUANT_CFG": "smoothquant",
    "INT8_WEIGHT_ONLY_CFG": "max",
    "FP8_DEFAULT_CFG": "max",
    "INT4_AWQ_CFG": "max",
    "NVFP4_DEFAULT_CFG": "max",
    "MXFP8_DEFAULT_CFG": "max",
}


def dense_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**DENSE.model_config, vocab_size=DENSE.vocab_size, max_position_embeddings=256)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().eval()


class LinearStack(nn.Sequential):
    def __init__(self, width: int = 4096, depth: int = 2):
        torch.manual_seed(0)
        super().__init__(*(nn.Linear(width, width, bias=False) for _ in range(depth)))


def dense_batches(tokens: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, DENSE.vocab_size, (max(1, tokens // 64), 64), generator=g)]


def stack_batches(tokens: int) -> list[torch.Tensor]:
    return [torch.randn(tokens, 4096, generator=torch.Generator().manual_seed(0))]


def quantize(model: nn.Module, preset: str, batches: list[torch.Tensor]) -> nn.Module:
    cfg = mtq.get_preset(preset)
    cfg["algorithm"] = FORMATS[preset]
    return mtq.quantize(model, cfg, batches)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory(make: Callable[[], nn.Module], batches: list[torch.Tensor]) -> dict[str, dict[str, float]]:
    rows = {}
    reference = make()
    total_bf16 = nbytes([*reference.parameters(), *reference.buffers()]) / 2  # fp32 -> bf16
    for preset in FORMATS:
        try:
            model = mtq.compress(quantize(make(), preset, batches))
        except UnsupportedFormatError as err:  # e.g. MXFP8 on in_features not divisible by 32
            rows[preset] = {"error": str(err)}
            continue
        layers = compressed_layers(model)
        packed = nbytes(t for n in layers for k, t in model.get_submodule(n).named_buffers(recurse=False)
                        if k.startswith("weight"))  # fmt: skip
        full = nbytes(reference.get_submodule(n).weight for n in layers) / 2
        model.to(torch.bfloat16)  # the layers left in full precision (embeddings, lm_head, norms) as bf16
        total = nbytes([*model.parameters(), *model.buffers()])
        rows[preset] = {
            "layers": len(layers),
            "linear_mb": packed / 2**20,
            "linear_bf16_mb": full / 2**20,
            "linear_ratio": packed / full,
            "model_ratio": total / total_bf16,
        }
    return rows


def _time(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    with torch.no_grad():
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return h.time_stats(times)


def speed(make, batches_of, tokens: list[int], repeats: int) -> dict[str, dict[str, dict[str, float]]]:
    out = {}
    fp32 = make()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    fake = quantize(copy.deepcopy(fp32), "INT8_SMOOTHQUANT_CFG", batches_of(64))
    models = {
        "fp32": fp32,
        "bf16": bf16,
        "fake-quant W8A8": fake,
        "compressed W8A8 int8 GEMM": mtq.compress(copy.deepcopy(fake), int8_gemm=True),
        "compressed W8A8 dequantize": mtq.compress(copy.deepcopy(fake), int8_gemm=False),
    }
    for n in tokens:
        x = batches_of(n)[0]
        out[str(n)] = {}
        for name, model in models.items():
            xin = x.to(torch.bfloat16) if name == "bf16" and x.is_floating_point() else x
            out[str(n)][name] = _time(lambda model=model, xin=xin: model(xin), repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}), torch "
          f"{torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, fast int8 GEMM: "
          f"{fast_int8_gemm(torch.device('cpu'))}; timings on a shared machine are noisy")  # fmt: skip
    models = {
        "dense (default model architecture)": (dense_model, dense_batches),
        "4096x4096 linear x2": (LinearStack, stack_batches),
    }
    result: dict[str, dict] = {}
    for name, (make, batches_of) in models.items():
        mem = memory(make, batches_of(64))
        print(f"\n{name}: weight memory after mtq.compress")
        print(
            f"{'format':<24}{'layers':>7}{'linears MiB':>13}{'bf16 MiB':>10}{'x bf16':>8}{'model x bf16':>14}"
        )
        for preset, r in mem.items():
            if "error" in r:
                print(f"{preset:<24} n/a: {r['error'][:80]}")
                continue
            print(f"{preset:<24}{r['layers']:>7}{r['linear_mb']:>13.2f}{r['linear_bf16_mb']:>10.2f}"
                  f"{r['linear_ratio']:>8.3f}{r['model_ratio']:>14.3f}")  # fmt: skip
        spd = speed(make, batches_of, args.tokens, args.repeats)
        print(f"\n{name}: forward seconds, median (min) of {args.repeats}")
        for tokens, row in spd.items():
            fp32_min = row["fp32"]["min_s"]
            print(f"{tokens:>5} tokens:")
            for k, v in row.items():
                print(f"    {k:<28}{h.fmt_median_min(v, '.4f'):>20}  {fp32_min / v['min_s']:.2f}x fp32 (min)")
        result[name] = {"memory": mem, "speed": spd}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
