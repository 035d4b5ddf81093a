"""What does ``mtq.compress`` save in weight memory per format, and what do its forward, load and output cost?

Published in ``docs/compress.md`` ("Peak memory of the load", "W8A8 forward on an AVX512-VNNI CPU", "Held-out
perplexity and greedy generation") and ``docs/benchmarks.md`` ("mtq.compress: memory and W8A8 speed"):

    OMP_NUM_THREADS=1 python benchmarks/compress.py --sections load --load-repeats 3 --threads 1
    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2 taskset -c 0,1 python benchmarks/compress.py --sections speed \\
        --repeats 7
    OMP_NUM_THREADS=2 python benchmarks/compress.py --sections quality --windows 16 --new-tokens 32 \\
        --repeats 5

(``--sections memory``, or ``--repeats 1 --tokens 64``, make a short run).

Needs the torchao extra. Two models: the default dense model's architecture (``modelopt_lite.models.DENSE``,
untrained weights: memory and speed do not depend on their values) and a stack of two 4096 x 4096 linear
layers. Calibration uses random token ids / activations.

* Memory: for each format, the bytes of the quantized linear layers' weights after ``mtq.compress`` (codes
  and scales) against the same weights in bf16, and the whole compressed model (its other layers cast to
  bf16; parameters and buffers, quantizer amax included) against the whole model in bf16.
* Speed (``--threads``, default 2 threads): forward time of the W8A8 (INT8_SMOOTHQUANT_CFG) compressed model,
  on torchao's int8 GEMM (``int8_gemm=True``; also cast to bf16, its unquantized layers then in bf16) and
  dequantizing on the fly (``int8_gemm=False``), against the fp32 and bf16 models and the fake-quant W8A8
  model, at each ``--tokens`` count (one batch of ``tokens / 64`` sequences of 64), as median and min of
  ``--repeats`` rounds after two warm-up calls; the models are interleaved (one call of each per round), and
  the speed-ups are ratios within the run. Timings on a shared machine are noisy: pin the threads
  (``taskset``) and compare the ratios.
* Loading an export (``--sections load``): an NVFP4 export of a Llama built in code whose linear weights
  dominate (``--load-hidden``, ``--load-layers``; vocabulary 1024), loaded with ``load_hf_checkpoint`` in bf16
  dequantized and compressed (``compress=True``), each in a fresh process (``--load-repeats`` of each,
  alternating): the peak RSS (``VmHWM``) of the process, and the peak minus the RSS before the load (after
  the imports), as median and min.
* Quality and generation (``--sections quality``): the default dense model (``modelopt_lite.models``,
  trained on first use), per format: held-out perplexity (``modelopt_lite.evaluation`` protocol, the first
  ``--windows`` windows of the held-out split) of the fake-quant and the compressed model, and tokens/s of
  greedy generation (``--new-tokens`` tokens after a 16-token prompt, batch 1, median and min of
  ``--repeats``) of the fp32, fake-quant and compressed models. MXFP8 leaves ``down_proj`` unquantized
  there (688 inputs, not a multiple of its 32-element blocks).
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import _harness as h
import torch
from torch import nn

import modelopt_lite.quantization as mtq
from modelopt_lite.models import DENSE
from modelopt_lite.quantization.compress import compressed_layers, fast_int8_gemm
from modelopt_lite.quantization.compress.packers import UnsupportedFormatError

#: preset -> how it is calibrated here (AWQ's search replaced by max: the stored format is the same)
FORMATS = {
    "INT8_SMOOTHQUANT_CFG": "smoothquant",
    "INT8_WEIGHT_ONLY_CFG": "max",
    "FP8_DEFAULT_CFG": "max",
    "INT4_AWQ_CFG": "max",
    "NVFP4_DEFAULT_CFG": "max",
    "MXFP8_DEFAULT_CFG": "max",
    "MXFP4_DEFAULT_CFG": "max",
}


def dense_model() -> nn.Module:
    return h.tiny_model(**DENSE.model_config, vocab_size=DENSE.vocab_size, max_position_embeddings=256).eval()


class LinearStack(nn.Sequential):
    def __init__(self, width: int = 4096, depth: int = 2):
        torch.manual_seed(0)
        super().__init__(*(nn.Linear(width, width, bias=False) for _ in range(depth)))


def dense_batches(tokens: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, DENSE.vocab_size, (max(1, tokens // 64), 64), generator=g)]


def stack_batches(tokens: int) -> list[torch.Tensor]:
    return [torch.randn(tokens, 4096, generator=torch.Generator().manual_seed(0))]


def quantize(
    model: nn.Module, preset: str, batches: list[torch.Tensor], exclude: tuple[str, ...] = ()
) -> nn.Module:
    """``exclude``: layer name patterns left unquantized (e.g. a width the format cannot pack)."""
    cfg = mtq.get_preset(preset)
    cfg["algorithm"] = FORMATS[preset]
    cfg["quant_cfg"] = [*cfg["quant_cfg"], *({"quantizer_name": f"{p}*", "enable": False} for p in exclude)]
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


def _time_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict[str, float]]:
    """Median and min of ``repeats`` timings of each function, interleaved (one call of each per round, after
    two warm-up calls of each): a burst of load on a shared machine hits every model, not one of them."""
    with torch.no_grad():
        times = h.time_interleaved(fns, repeats, warmup=2)
    return {name: h.time_stats(t) for name, t in times.items()}


def speed(make, batches_of, tokens: list[int], repeats: int) -> dict[str, dict[str, dict[str, float]]]:
    out = {}
    fp32 = make()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    fake = quantize(copy.deepcopy(fp32), "INT8_SMOOTHQUANT_CFG", batches_of(64))
    int8 = mtq.compress(copy.deepcopy(fake), int8_gemm=True)
    models = {
        "fp32": fp32,
        "bf16": bf16,
        "fake-quant W8A8": fake,
        "compressed W8A8 int8 GEMM": int8,
        "compressed W8A8 dequantize": mtq.compress(copy.deepcopy(fake), int8_gemm=False),
        # the layers left unquantized (lm_head, attention, norms) in bf16, as in the bf16 model
        "compressed W8A8 int8 GEMM, bf16": copy.deepcopy(int8).to(torch.bfloat16),
    }
    for n in tokens:
        x = batches_of(n)[0]
        fns = {}
        for name, model in models.items():
            bf = name.endswith("bf16")
            xin = x.to(torch.bfloat16) if bf and x.is_floating_point() else x
            fns[name] = lambda model=model, xin=xin: model(xin)
        out[str(n)] = _time_interleaved(fns, repeats)
    return out


# ------------------------------------------------------------------------------ loading an export: peak RSS


def load_model(hidden: int, layers: int) -> nn.Module:
    """A Llama whose linear weights dominate (vocabulary 1024), float32, untrained."""
    return h.tiny_model(
        vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, max_position_embeddings=256,
        tie_word_embeddings=False,
    ).eval()  # fmt: skip


def child_load(directory: str, mode: str) -> dict[str, float]:
    """In a fresh process: load the export dequantized or compressed (bf16) and report the peak RSS."""
    import torchao  # noqa: F401  (both modes import the same modules before the baseline)

    from modelopt_lite.export import load_hf_checkpoint

    before = h.status_mb("VmRSS")
    start = time.perf_counter()
    model = load_hf_checkpoint(directory, dtype=torch.bfloat16, compress=mode == "compressed")
    seconds = time.perf_counter() - start
    peak, after = h.status_mb("VmHWM"), h.status_mb("VmRSS")
    with torch.no_grad():  # reads every weight: packed tensors the loader left memory-mapped count from here
        model(torch.zeros(1, 16, dtype=torch.long))
    return {
        "peak_mb": peak,
        "before_mb": before,
        "load_peak_mb": peak - before,
        "rss_after_mb": after,
        "forward_peak_mb": h.status_mb("VmHWM"),
        "forward_rss_mb": h.status_mb("VmRSS"),
        "model_mb": nbytes([*model.parameters(), *model.buffers()]) / 2**20,
        "compressed_layers": len(compressed_layers(model)),
        "load_s": seconds,
    }


def load_rss(hidden: int, layers: int, repeats: int, threads: int) -> dict[str, object]:
    from modelopt_lite.export import export_hf_checkpoint

    model = load_model(hidden, layers)
    ids = torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(0))
    cfg = mtq.get_preset("NVFP4_DEFAULT_CFG")
    cfg["algorithm"] = "max"
    mtq.quantize(model, cfg, [ids])
    linear_bf16 = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, nn.Linear)) / 2**20
    with tempfile.TemporaryDirectory(prefix="compress_load_") as directory:
        export_hf_checkpoint(model, directory, dtype=torch.bfloat16)
        disk = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)) / 2**20
        del model
        env = h.child_env(threads, h.REPO_ROOT)
        runs: dict[str, list[dict]] = {"dequantized": [], "compressed": []}
        for _ in range(repeats):
            for mode in runs:
                cmd = [sys.executable, os.path.abspath(__file__), "--child-load", directory, "--mode", mode]
                res = h.run_child(cmd, env)
                if "error" in res:
                    raise RuntimeError(f"{mode} load: {res['error']}\n{res.get('traceback', '')}")
                runs[mode].append(res)
    out: dict[str, object] = {
        "hidden": hidden,
        "layers": layers,
        "linear_bf16_mb": linear_bf16,
        "disk_mb": disk,
    }
    for mode, rows in runs.items():
        keys = ("peak_mb", "load_peak_mb", "rss_after_mb", "forward_peak_mb", "forward_rss_mb", "model_mb")
        out[mode] = {
            key: {"median": statistics.median(r[key] for r in rows), "min": min(r[key] for r in rows)}
            for key in (*keys, "load_s")
        } | {"compressed_layers": rows[0]["compressed_layers"]}
    return out


def print_load(r: dict) -> None:
    print(f"\nloading an NVFP4 export (Llama hidden {r['hidden']}, {r['layers']} layers; linear weights "
          f"{r['linear_bf16_mb']:.0f} MiB in bf16, checkpoint {r['disk_mb']:.0f} MiB), fresh processes, "
          "MiB, median (min):")  # fmt: skip
    print(f"{'load':<14}{'peak RSS':>14}{'peak - before':>15}{'RSS after':>14}{'+ forward: peak':>17}"
          f"{'RSS':>13}{'tensors':>9}")  # fmt: skip

    def cell(m: dict, k: str) -> str:
        return f"{m[k]['median']:.0f} ({m[k]['min']:.0f})"

    for mode in ("dequantized", "compressed"):
        m = r[mode]
        print(f"{mode:<14}{cell(m, 'peak_mb'):>14}{cell(m, 'load_peak_mb'):>15}{cell(m, 'rss_after_mb'):>14}"
              f"{cell(m, 'forward_peak_mb'):>17}{cell(m, 'forward_rss_mb'):>13}"
              f"{m['model_mb']['median']:>9.0f}")  # fmt: skip
    d, c = r["dequantized"], r["compressed"]
    print(f"compressed / dequantized: peak RSS {c['peak_mb']['min'] / d['peak_mb']['min']:.3f}x (min), "
          f"{c['peak_mb']['median'] / d['peak_mb']['median']:.3f}x (median); load's own peak "
          f"{c['load_peak_mb']['min'] / d['load_peak_mb']['min']:.3f}x (min), "
          f"{c['load_peak_mb']['median'] / d['load_peak_mb']['median']:.3f}x (median); peak RSS after a "
          f"forward {c['forward_peak_mb']['min'] / d['forward_peak_mb']['min']:.3f}x (min), "
          f"{c['forward_peak_mb']['median'] / d['forward_peak_mb']['median']:.3f}x (median)")  # fmt: skip


# ------------------------------------------------------------------- quality and greedy generation speed


def _generate_stats(model: nn.Module, prompt: torch.Tensor, new_tokens: int, repeats: int):
    def run() -> torch.Tensor:
        return model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )

    with torch.no_grad():
        times, tokens, _ = h.time_calls(run, repeats)  # greedy: every call the same tokens
    n = prompt.shape[0] * new_tokens
    return {"tokens_per_s": {"median": n / statistics.median(times), "max": n / min(times)}, "tokens": tokens}


def quality(repeats: int, new_tokens: int, n_windows: int) -> dict[str, dict]:
    from modelopt_lite.data import token_stream, windows
    from modelopt_lite.evaluation import default_window, describe, perplexity
    from modelopt_lite.models import corpus_texts, load_default_model

    fp32, tokenizer = load_default_model("dense")
    seq = default_window(fp32.config)
    heldout = windows(token_stream(tokenizer, corpus_texts("heldout")), seq)[:n_windows]
    calib = list(windows(token_stream(tokenizer, corpus_texts("train")), seq)[:4].split(2))
    prompt = heldout[:1, :16]
    print(f"\nheld-out protocol: {describe(heldout)}")
    base = _generate_stats(fp32, prompt, new_tokens, repeats)
    out: dict[str, dict] = {"fp32": {"ppl": perplexity(fp32, heldout), "gen": base["tokens_per_s"]}}
    for preset in FORMATS:
        # MX formats pack blocks of 32 inputs: down_proj's 688 inputs stay unquantized there
        exclude = ("*down_proj",) if preset.startswith("MX") else ()
        fake = quantize(copy.deepcopy(fp32), preset, calib, exclude)
        compressed = mtq.compress(copy.deepcopy(fake))
        kernel = any(getattr(m, "uses_kernel", False) for m in compressed.modules())
        g_fake = _generate_stats(fake, prompt, new_tokens, repeats)
        g_comp = _generate_stats(compressed, prompt, new_tokens, repeats)
        out[preset] = {
            "format": sorted(set(compressed_layers(compressed).values())),
            "layers": len(compressed_layers(compressed)),
            "excluded": list(exclude),
            "int8_gemm": kernel,
            "ppl_fake": perplexity(fake, heldout),
            "ppl_compressed": perplexity(compressed, heldout),
            "gen_fake": g_fake["tokens_per_s"],
            "gen_compressed": g_comp["tokens_per_s"],
            "same_tokens": bool(torch.equal(g_fake["tokens"], g_comp["tokens"])),
        }
    return out


def print_quality(q: dict, new_tokens: int) -> None:
    fp32 = q["fp32"]
    print(f"default dense model: held-out perplexity, greedy generation ({new_tokens} new tokens, batch 1) "
          f"tokens/s median (best); fp32: ppl {fp32['ppl']:.4f}, {fp32['gen']['median']:.1f} "
          f"({fp32['gen']['max']:.1f}) tokens/s")  # fmt: skip
    print(f"{'format':<22}{'ppl fake-quant':>16}{'ppl compressed':>16}{'rel. diff':>11}"
          f"{'gen fake tok/s':>18}{'gen compr. tok/s':>18}{'x fake':>8}{'x fp32':>8}"
          "  same tokens")  # fmt: skip
    for preset, r in q.items():
        if preset == "fp32":
            continue
        rel = r["ppl_compressed"] / r["ppl_fake"] - 1
        gf, gc = r["gen_fake"], r["gen_compressed"]
        name = "/".join(r["format"]) + (" (int8 GEMM)" if r["int8_gemm"] else "")
        print(f"{name:<22}{r['ppl_fake']:>16.4f}{r['ppl_compressed']:>16.4f}{rel:>11.1e}"
              f"{gf['median']:>10.1f} ({gf['max']:>5.1f}){gc['median']:>10.1f} ({gc['max']:>5.1f})"
              f"{gc['median'] / gf['median']:>8.2f}{gc['median'] / fp32['gen']['median']:>8.2f}  "
              f"{r['same_tokens']}")  # fmt: skip


def main() -> None:
    parser = h.common(h.parser(__doc__, full=True), threads=2, repeats=5, json="write the raw numbers here")
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    parser.add_argument(
        "--sections", nargs="+", choices=["memory", "speed", "load", "quality"],
        default=["memory", "speed", "load", "quality"],
    )  # fmt: skip
    parser.add_argument("--load-hidden", type=int, default=2048)
    parser.add_argument("--load-layers", type=int, default=6)
    parser.add_argument("--load-repeats", type=int, default=3)
    parser.add_argument("--windows", type=int, default=16, help="held-out windows for the perplexity")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy generation length")
    h.hidden(parser, child_load=str, mode=str)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child_load:
        h.run_and_emit(lambda: child_load(args.child_load, args.mode))
        return
    print(f"threads {args.threads} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}), torch "
          f"{torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, fast int8 GEMM: "
          f"{fast_int8_gemm(torch.device('cpu'))}; timings on a shared machine are noisy")  # fmt: skip
    models = {
        "dense (default model architecture)": (dense_model, dense_batches),
        "4096x4096 linear x2": (LinearStack, stack_batches),
    }
    result: dict[str, dict] = {}
    for name, (make, batches_of) in models.items():
        if "memory" not in args.sections and "speed" not in args.sections:
            break
        result[name] = {}
        if "memory" in args.sections:
            mem = memory(make, batches_of(64))
            print(f"\n{name}: weight memory after mtq.compress")
            print(f"{'format':<24}{'layers':>7}{'linears MiB':>13}{'bf16 MiB':>10}{'x bf16':>8}"
                  f"{'model x bf16':>14}")  # fmt: skip
            for preset, r in mem.items():
                if "error" in r:
                    print(f"{preset:<24} n/a: {r['error'][:80]}")
                    continue
                print(f"{preset:<24}{r['layers']:>7}{r['linear_mb']:>13.2f}{r['linear_bf16_mb']:>10.2f}"
                      f"{r['linear_ratio']:>8.3f}{r['model_ratio']:>14.3f}")  # fmt: skip
            result[name]["memory"] = mem
        if "speed" in args.sections:
            spd = speed(make, batches_of, args.tokens, args.repeats)
            print(f"\n{name}: forward seconds, median (min) of {args.repeats}")
            for tokens, row in spd.items():
                fp32, bf16 = row["fp32"], row["bf16"]
                print(f"{tokens:>5} tokens:  {'seconds':>20}  speed-up over fp32, over bf16: median (min)")
                for k, v in row.items():
                    ratios = "  ".join(
                        f"{b['median_s'] / v['median_s']:.2f}x ({b['min_s'] / v['min_s']:.2f}x)"
                        for b in (fp32, bf16)
                    )
                    print(f"    {k:<34}{h.fmt_median_min(v, '.4f'):>20}  {ratios}")
            result[name]["speed"] = spd
    if "load" in args.sections:
        result["load"] = load_rss(args.load_hidden, args.load_layers, args.load_repeats, args.threads)
        print_load(result["load"])
    if "quality" in args.sections:
        result["quality"] = quality(args.repeats, args.new_tokens, args.windows)
        print_quality(result["quality"], args.new_tokens)
    h.write_json(args.json, result)


if __name__ == "__main__":
    main()
