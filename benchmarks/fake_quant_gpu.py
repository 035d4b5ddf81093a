"""What share of a GPU's memory bandwidth do our fake-quant kernels reach, against nvidia-modelopt?

Named in ``docs/benchmarks.md``, "Fake-quant throughput per format" (not run on a GPU yet):

    python benchmarks/fake_quant_gpu.py --peak-gbs 4800        # the data-sheet bandwidth (H200: 4800 GB/s)
    python benchmarks/fake_quant_gpu.py --device cpu --quick   # a smoke run of this script on a CPU

For every case (same tensors and quantizer attributes as ``fake_quant.py``: a 4096x4096 weight, an
8x512x4096 activation, fp32 and bf16, amax calibrated beforehand) it times, with CUDA events after a warm-up:

* ``kernel``: ``modelopt_lite.formats.fake_quant`` (the Triton kernel where one covers the case);
* ``reference``: ``fake_quant_reference`` (our eager PyTorch formula, the kernels' oracle);
* ``copy_``: a copy of the tensor into an existing buffer: the bandwidth floor measured in the same run;
* ``modelopt``: the reference library's ``TensorQuantizer`` on the same tensor (when importable).

Bandwidth is counted as one read and one write of the tensor (``2 * numel * element size`` bytes per call;
the amax is negligible); each row prints GB/s, the share of the measured ``copy_`` bandwidth and, with
``--peak-gbs`` (the data-sheet figure, e.g. 4800 for an H200), the share of the peak. Each output is checked
bit for bit against ``fake_quant_reference`` (``kernel == reference``) and against the reference library.

Goal from the project's speed issue: the kernels at >= 0.35 (INT8) / 0.25 (NVFP4) of the memory bandwidth.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import _harness as h
import torch
from fake_quant import CASES, _reference_quantizer, reference_part  # sibling benchmark: the same cases

from modelopt_lite.formats import fake_quant, reduce_amax, resolve_format
from modelopt_lite.formats.functional import fake_quant_reference


def _timer(
    device: torch.device,
) -> Callable[[Callable[[], torch.Tensor], int], tuple[list[float], torch.Tensor]]:
    """``time(fn, repeats) -> (seconds per call, last output)``: CUDA events on a GPU, else perf_counter."""

    def time_cuda(fn, repeats):
        out = fn()  # warm-up (compiles the Triton kernel)
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return times, out

    def time_cpu(fn, repeats):
        return h.time_calls(fn, repeats)[:2]

    return time_cuda if device.type == "cuda" else time_cpu


def run(device: torch.device, repeats: int, scale: int, dtypes: list[torch.dtype], peak_gbs: float | None):
    timed = _timer(device)
    torch.manual_seed(0)
    rows = []
    for dtype in dtypes:
        tensors = {
            "weight": torch.randn(4096 // scale, 4096).to(device, dtype),
            "act": (torch.randn(8 // min(scale, 8), 512 // scale, 4096) * 2).to(device, dtype),
        }
        for name, (which, attrs) in CASES.items():
            x = tensors[which]
            buf = torch.empty_like(x)
            spec = resolve_format(**attrs)
            amax = reduce_amax(x, spec) if spec.needs_amax else None
            with torch.no_grad():
                copy_t, _ = timed(lambda x=x, b=buf: b.copy_(x), repeats)
                ref_t, ref_out = timed(lambda x=x, s=spec, a=amax: fake_quant_reference(x, s, a), repeats)
                kern_t, kern_out = timed(lambda x=x, s=spec, a=amax: fake_quant(x, s, a), repeats)
                row = {
                    "case": name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": list(x.shape),
                    "bytes": 2 * x.numel() * x.element_size(),
                    "copy_s": copy_t,
                    "reference_s": ref_t,
                    "kernel_s": kern_t,
                    "kernel_equals_reference": bool(torch.equal(kern_out, ref_out)),
                }
                q = _reference_quantizer(attrs, amax)
                if q is not None:
                    try:
                        q = q.to(device)
                        mo_t, mo_out = timed(lambda x=x, q=q: q(x), repeats)
                        row["modelopt_s"] = mo_t
                        row["bit_identical_to_modelopt"] = bool(torch.equal(kern_out, mo_out))
                    except Exception as err:  # a path the reference does not have on this device
                        row["modelopt_error"] = h.error_text(err, 100)
            rows.append(row)
            _print_row(row, peak_gbs)
    return rows


def _print_row(row: dict, peak_gbs: float | None) -> None:
    med = {k: statistics.median(row[f"{k}_s"]) for k in ("copy", "reference", "kernel")}
    gbs = {k: row["bytes"] / v / 1e9 for k, v in med.items()}
    line = (
        f"{row['case']:<22} {row['dtype']:<8} GB/s (median): kernel {gbs['kernel']:7.1f} reference "
        f"{gbs['reference']:7.1f} copy_ {gbs['copy']:7.1f}"
        f" | kernel of copy_ {gbs['kernel'] / gbs['copy']:4.2f}"
        f" | kernel / reference x{med['reference'] / med['kernel']:5.2f} (min x"
        f"{min(row['reference_s']) / min(row['kernel_s']):5.2f})"
    )
    if peak_gbs:
        line += f" | kernel of peak {gbs['kernel'] / peak_gbs:4.2f}"
    if not row["kernel_equals_reference"]:
        line += " | KERNEL != REFERENCE"
    line += reference_part(row, "modelopt", lambda t: (
        f" | modelopt {row['bytes'] / statistics.median(t) / 1e9:7.1f} GB/s, kernel / modelopt "
        f"x{statistics.median(t) / med['kernel']:5.2f} | bit-identical: {row['bit_identical_to_modelopt']}"
    ))  # fmt: skip
    print(line, flush=True)


def main() -> None:
    parser = h.common(h.parser(__doc__), repeats=50, quick="shapes 1/8 the size, 3 repeats")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run of the script)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--peak-gbs", type=float, help="the device's data-sheet memory bandwidth, GB/s")
    args = h.common(parser, json="write the raw timings here").parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run this on a GPU machine, or pass --device cpu for a smoke run")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}; {where}; repeats {args.repeats}; 1 GB = 1e9 bytes")
    dtypes = [getattr(torch, d) for d in args.dtypes]
    rows = run(device, 3 if args.quick else args.repeats, 8 if args.quick else 1, dtypes, args.peak_gbs)
    h.write_json(args.json, {"device": where, "peak_gbs": args.peak_gbs, "rows": rows})
    if not all(r["kernel_equals_reference"] for r in rows):
        raise SystemExit("a kernel differs from the reference formula (rows marked KERNEL != REFERENCE)")


if __name__ == "__main__":
    main()
