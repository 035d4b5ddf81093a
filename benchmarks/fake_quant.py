"""How fast is our fake quant per format on the CPU, against the memory floors and nvidia-modelopt?

Published in ``docs/benchmarks.md``, "Fake-quant throughput per format" (measured 2026-12-02):

    OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. <modelopt venv>/bin/python \\
        benchmarks/fake_quant.py --threads 1 2 --repeats 7

(with this interpreter instead, the nvidia-modelopt columns are left out; ``--quick`` smoke-runs it).

Shapes: a 4096x4096 fp32 weight and an 8x512x4096 fp32 activation, amax precomputed (calibrated), forward
only. For every format and thread count it prints the min and median of ``--repeats`` timed runs in
M elements/s of

- ``native``: our fake quant as it runs by default, the native one-pass kernels
  (``formats.kernels.native``; the rows say when a case is not covered and fell back), into a fresh output,
- ``native+buf``: the same into an output buffer kept between calls (``out=``, what a quantizer does in
  training), so no allocation and no page faults: compare it with ``copy_``,
- ``fused``: our fake quant with the compiled path on and the native kernels off
  (``set_fused_fake_quant(True, min_numel=0)``; its compile happens in the untimed warm-up call),
- ``eager``: our fake quant with both off (the reference formulas, run eagerly),
- the floors, measured right before each case on the same tensor: ``clone`` (one read, one write into a
  freshly allocated output, as fake quant does) and ``copy_`` (one read, one write into an existing buffer),

and each path as a fraction of both floors (medians). When ``modelopt`` (the reference library,
installed in a separate virtualenv and never a dependency of ours) imports, the same tensors go through its
``TensorQuantizer`` in the same process and the table adds the speed ratio (native / reference, from the
medians and from the mins) and whether the outputs are bit-identical (``torch.equal``).

On CPU the reference runs INT and FP8 fake quant only; its NVFP4 and MX fake quant need CUDA, so those
rows show ``n/a`` for it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import _harness as h
import torch

from modelopt_lite.formats import (
    fake_quant,
    fused_call_count,
    native_call_count,
    reduce_amax,
    resolve_format,
    set_fused_fake_quant,
    set_native_fake_quant,
)
from modelopt_lite.formats.functional import dispatch_fake_quant

PATHS = ("native", "native+buf", "fused", "eager", "clone", "copy")

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


def run(threads: list[int], repeats: int, scale: int, cases: list[str] | None = None) -> list[dict]:
    torch.manual_seed(0)
    tensors = {
        "weight": torch.randn(4096 // scale, 4096),
        "act": torch.randn(8 // min(scale, 8), 512 // scale, 4096) * 2,
    }
    rows = []
    for name, (which, attrs) in CASES.items():
        if cases and not any(c in name for c in cases):
            continue
        x = tensors[which]
        buf = torch.empty_like(x)
        spec = resolve_format(**attrs)
        amax = reduce_amax(x, spec) if spec.needs_amax else None
        ref_q = _reference_quantizer(attrs, amax)
        for n in threads:
            torch.set_num_threads(n)
            with torch.no_grad():
                clone_t, _, _ = h.time_calls(x.clone, repeats)
                copy_t, _, _ = h.time_calls(lambda x=x, b=buf: b.copy_(x), repeats)
                set_native_fake_quant(False)
                set_fused_fake_quant(False)
                eager_t, eager_out, _ = h.time_calls(lambda x=x, s=spec, a=amax: fake_quant(x, s, a), repeats)
                set_fused_fake_quant(True, min_numel=0)
                calls = fused_call_count()
                quantize = lambda x=x, s=spec, a=amax: fake_quant(x, s, a)  # noqa: E731
                fused_t, fused_out, compile_s = h.time_calls(quantize, repeats)
                fused_ran = fused_call_count() - calls == repeats + 1
                set_fused_fake_quant(False)
                set_native_fake_quant(True)
                calls = native_call_count()
                native_t, native_out, build_s = h.time_calls(quantize, repeats)
                into = lambda x=x, s=spec, a=amax, b=buf: dispatch_fake_quant(x, s, a, None, b)  # noqa: E731
                buf_t, buf_out, _ = h.time_calls(into, repeats)
                row = {
                    "case": name,
                    "shape": list(x.shape),
                    "threads": n,
                    "clone_s": clone_t,
                    "copy_s": copy_t,
                    "eager_s": eager_t,
                    "fused_s": fused_t,
                    "native_s": native_t,
                    "native+buf_s": buf_t,
                    "fused_first_call_s": compile_s,
                    "native_first_call_s": build_s,
                    "fused_ran": fused_ran,
                    "native_ran": native_call_count() - calls == 2 * (repeats + 1),
                    "fused_equals_eager": bool(torch.equal(fused_out, eager_out)),
                    "native_equals_eager": bool(
                        torch.equal(native_out, eager_out) and torch.equal(buf_out, eager_out)
                    ),
                }
                if ref_q is not None:
                    try:
                        ref_t, ref_out, _ = h.time_calls(lambda x=x, q=ref_q: q(x), repeats)
                        row["ref_s"] = ref_t
                        row["bit_identical"] = bool(torch.equal(native_out, ref_out))
                    except Exception as err:  # the reference's CUDA-only paths fail on CPU
                        row["ref_error"] = h.error_text(err, 100)
            rows.append(row)
            _print_row(row, x.numel())
    return rows


def _mels(numel: int, seconds: float) -> float:
    return numel / seconds / 1e6


def _print_row(row: dict, numel: int) -> None:
    med = {k: statistics.median(row[f"{k}_s"]) for k in PATHS}
    low = {k: min(row[f"{k}_s"]) for k in PATHS}

    def speed(k: str) -> str:
        return f"{_mels(numel, low[k]):6.0f}/{_mels(numel, med[k]):6.0f}"

    line = f"{row['case']:<22} t={row['threads']} min/med Melem/s:" + "".join(
        f" {k} {speed(k)}" for k in PATHS
    )
    line += f" | native/eager x{med['eager'] / med['native']:4.2f}"
    for floor in ("clone", "copy"):
        line += f" | of {floor}:" + "".join(f" {k} {med[floor] / med[k]:4.2f}" for k in PATHS[:4])
    line += (
        f" | first call: native {row['native_first_call_s']:5.2f}s fused {row['fused_first_call_s']:5.2f}s"
    )
    flags = (
        ("native_ran", " NATIVE PATH NOT TAKEN"),
        ("fused_ran", " FUSED PATH NOT TAKEN"),
        ("native_equals_eager", " NATIVE != EAGER"),
        ("fused_equals_eager", " FUSED != EAGER"),
    )
    line += "".join(text for key, text in flags if not row[key])
    line += reference_part(row, "ref", lambda ref: (
        f" | ref {_mels(numel, min(ref)):6.0f}/{_mels(numel, statistics.median(ref)):6.0f}"
        f" native/ref x{statistics.median(ref) / med['native']:5.2f} (med) x{min(ref) / low['native']:5.2f}"
        f" (min) eager/ref x{statistics.median(ref) / med['eager']:5.2f} (med)"
        f" | bit-identical: {row['bit_identical']}"
    ))  # fmt: skip
    print(line, flush=True)


def reference_part(row: dict, key: str, text: Callable[[list[float]], str]) -> str:
    """The reference library's part of a printed row: ``text`` of its timings ``row[key + "_s"]``, or why it
    has none (``row[key + "_error"]``), or nothing when it did not run."""
    if f"{key}_s" in row:
        return text(row[f"{key}_s"])
    return f" | {key} n/a ({row[key + '_error']})" if f"{key}_error" in row else ""


def main() -> None:
    parser = h.common(h.parser(__doc__), threads=([1, 2], "thread counts, each measured"), repeats=7)
    h.common(parser, quick="shapes 1/8 the size", json="write the raw timings here")
    parser.add_argument("--cases", nargs="+", help="only the cases whose name contains one of these")
    args = parser.parse_args()
    print(f"torch {torch.__version__}; repeats {args.repeats}; Melem/s = million elements per second")
    h.write_json(args.json, run(args.threads, args.repeats, 8 if args.quick else 1, args.cases))


if __name__ == "__main__":
    main()
