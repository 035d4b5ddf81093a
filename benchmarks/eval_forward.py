"""How much slower is a fake-quant evaluation forward than the unquantized one, at the model's dtype, with the
native kernels reading and writing bfloat16 directly and with the float32 copy they used before?

Published in ``docs/model_families.md``, "Qwen2.5-1.5B: memory and time" (2026-12-07):

    OMP_NUM_THREADS=2 python benchmarks/eval_forward.py --model qwen2.5-coder-1.5b --dtype bfloat16 \\
        --qformats nvfp4,fp8 --repeats 5

Model: the real model ``--model`` in ``--dtype``, eval mode, one batch of ``--batch`` x ``--seq`` random
token ids (seed 0), ``logits_to_keep=1`` (the forward without the vocabulary projection of every position,
which is not quantized). Per format (``NVFP4_DEFAULT_CFG``, ``FP8_DEFAULT_CFG``): quantized in place,
calibrated on one slice of the batch (the activations' amax matter here only for their cost), the weights'
fake quant folded once (``mtq.fold_weight``, as ``hf_ptq.py`` evaluates), then ``--repeats`` forwards of
each, interleaved: ``unquantized`` (before quantizing), ``bf16 io`` (the default: a bfloat16 tensor goes
through the native kernel as bfloat16) and ``float32 copy`` (the kernels' earlier path: copied to float32,
computed, cast back; forced here by clearing the kernels' checked bfloat16 cast, a switch of this
benchmark only). Min and median seconds and their ratios to the unquantized forward (goal: at most 1.3x).
``--quick``: a tiny Llama built in code instead of the real model.
"""

from __future__ import annotations

import time

import _harness as h


def main(argv: list[str] | None = None) -> dict:
    p = h.common(h.parser(__doc__), threads=2, repeats=5, quick="a tiny Llama, 2 repeats", json="the numbers")
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="a real model of modelopt_lite.models")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--qformats", default="nvfp4,fp8", help="comma-separated: nvfp4, fp8")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    args = p.parse_args(argv)
    h.pin_threads(args.threads)
    import torch

    import modelopt_lite.quantization as mtq
    from modelopt_lite.formats.kernels import native
    from modelopt_lite.models import load_real_model

    dtype = getattr(torch, args.dtype)
    start, rows = time.time(), {}
    for qformat in h.csv(args.qformats):
        if args.quick:
            model = h.tiny_model(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                 max_position_embeddings=64)  # fmt: skip
            model = model.to(dtype).eval()
        else:
            model, _ = load_real_model(args.model, dtype=dtype)
        vocab = model.config.vocab_size
        shape = (2, 32) if args.quick else (args.batch, args.seq)
        ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0))

        def forward(model=model, ids=ids) -> None:
            with torch.inference_mode():
                model(ids, logits_to_keep=1)

        repeats = 2 if args.quick else args.repeats
        base = h.time_interleaved({"unquantized": forward}, repeats)["unquantized"]
        config = getattr(mtq, f"{qformat.upper()}_DEFAULT_CFG")
        mtq.quantize(model, config, lambda m, ids=ids: m(ids[:1, :128]))
        mtq.fold_weight(model)
        checked = native._state["nan16"]  # (set once the kernels load: the first fake quant above)

        def copied(forward=forward, checked=checked) -> None:
            native._state["nan16"] = None  # the float32 copy, as before the bfloat16 path
            try:
                forward()
            finally:
                native._state["nan16"] = checked

        times = h.time_interleaved({"bf16 io": forward, "float32 copy": copied}, repeats)
        stats = {"unquantized": h.time_stats(base), **{k: h.time_stats(v) for k, v in times.items()}}
        rows[qformat] = {
            "seconds": stats,
            "bf16_io_available": checked is not None,
            "ratio_to_unquantized": {k: h.ratio(v, stats["unquantized"]) for k, v in stats.items()},
        }
        del model
    print(h.table_head("| format | path | min s | median s | vs unquantized (min / median) |"))
    for qformat, row in rows.items():
        for path, s in row["seconds"].items():
            r = row["ratio_to_unquantized"][path]
            print(h.table_row(qformat, path, f"{s['min_s']:.2f}", f"{s['median_s']:.2f}",
                              f"{r['min']:.2f}x / {r['median']:.2f}x"))  # fmt: skip
    out = {**h.run_meta(__file__, argv, time.time() - start), "dtype": args.dtype, "rows": rows}
    h.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
