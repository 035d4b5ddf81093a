"""Fake-quant throughput per format, side by side with nvidia-modelopt when it is importable.

    OMP_NUM_THREADS=2 python benchmarks/fake_quant.py [--threads 1 2] [--repeats 7] [--json out.json]

Shapes: a 4096x4096 fp32 weight and an 8x512x4096 fp32 activation, amax precomputed (calibrated), forward
only. For every format and thread count it prints the min and median of ``--repeats`` timed runs in
M elements/s. When ``modelopt`` (the reference library, installed in a separate virtualenv and never a
dependency of ours) imports, the same tensors go through its ``TensorQuantizer`` in the same process and
the table adds the speed ratio (ours / reference, from the medians and from the mins) and whether the
outputs are bit-identical (``torch.equal``). To run both in one process, put this checkout on the
reference venv's path:

    PYTHONPATH=. /path/to/modelopt-venv/bin/python benchmarks/fake_quant.py

On CPU the reference runs INT and FP8 fake quant only; its NVFP4 and MX fake quant need CUDA, so those
rows show ``n/a`` for it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from modelopt_lite.formats import fake_quant, reduce_amax, resolve_format

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
MXFP8 = {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}
MXFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}
#: name -> (tensor, quantizer attributes); weights quantize per channel / block, activations per tensor
CASES = {
    "int8 per-channel (W)": ("weight", {"num_bits": 8, "axis": 0}),
    "int4 block-128 (W)": ("weight", {"num_bits": 4, "block_sizes": {-1: 128}}),
    "fp8 per-tensor (W)": ("weight", {"num_bits": (4, 3)}),
    "nvfp4 (W)": ("weight", NVFP4),
    "mxfp8 (W)": ("weight", MXFP8),
    "mxfp4 (W)": ("weight", MXFP4),
    "int8 per-tensor (A)": ("act", {"num_bits": 8}),
    "fp8 per-tensor (A)": ("act", {"num_bits": (4, 3)}),
    "nvfp4 (A)": ("act", NVFP4),
}


def _time(fn: Callable[[], torch.Tensor], repeats: int) -> tuple[list[float], torch.Tensor]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out


def _reference_quantizer(attrs: dict, amax: torch.Tensor | None):
    """The reference library's TensorQuantizer for the same attributes, or None if not importable."""
    try:
        from modelopt.torch.quantization.config import QuantizerAttributeConfig
        from modelopt.torch.quantization.nn import TensorQuantizer
    except ImportError:
        return None
    q = TensorQuantizer(QuantizerAttributeConfig(**attrs))
    if amax is not None:
        q.amax = amax
    return q.eval()


def run(threads: list[int], repeats: int, scale: int) -> list[dict]:
    torch.manual_seed(0)
    tensors = {
        "weight": torch.randn(4096 // scale, 4096),
        "act": torch.randn(8 // min(scale, 8), 512 // scale, 4096) * 2,
    }
    rows = []
    for name, (which, attrs) in CASES.items():
        x = tensors[which]
        spec = resolve_format(**attrs)
        amax = reduce_amax(x, spec) if spec.needs_amax else None
        ref_q = _reference_quantizer(attrs, amax)
        for n in threads:
            torch.set_num_threads(n)
            with torch.no_grad():
                ours_t, ours_out = _time(lambda x=x, s=spec, a=amax: fake_quant(x, s, a), repeats)
                row = {"case": name, "shape": list(x.shape), "threads": n, "ours_s": ours_t}
                if ref_q is not None:
                    try:
                        ref_t, ref_out = _time(lambda x=x, q=ref_q: q(x), repeats)
                        row["ref_s"] = ref_t
                        row["bit_identical"] = bool(torch.equal(ours_out, ref_out))
                    except Exception as err:  # the reference's CUDA-only paths fail on CPU
                        row["ref_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
            rows.append(row)
            _print_row(row, x.numel())
    return rows


def _mels(numel: int, seconds: float) -> float:
    return numel / seconds / 1e6


def _print_row(row: dict, numel: int) -> None:
    ours = row["ours_s"]
    line = (
        f"{row['case']:<22} t={row['threads']}  ours min {_mels(numel, min(ours)):7.1f} "
        f"med {_mels(numel, statistics.median(ours)):7.1f} Melem/s"
    )
    if "ref_s" in row:
        ref = row["ref_s"]
        ratio_med = statistics.median(ref) / statistics.median(ours)
        ratio_min = min(ref) / min(ours)
        line += (
            f" | ref min {_mels(numel, min(ref)):7.1f} med {_mels(numel, statistics.median(ref)):7.1f}"
            f" | x{ratio_med:5.2f} (med) x{ratio_min:5.2f} (min) | bit-identical: {row['bit_identical']}"
        )
    elif "ref_error" in row:
        line += f" | ref n/a ({row['ref_error']})"
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="fake-quant throughput per format")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="shapes 1/8 the size (smoke test)")
    parser.add_argument("--json", help="write the raw timings here")
    args = parser.parse_args()
    print(f"torch {torch.__version__}; repeats {args.repeats}; Melem/s = million elements per second")
    rows = run(args.threads, args.repeats, 8 if args.quick else 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
