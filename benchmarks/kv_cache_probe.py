"""Where does a KV-cache format lose on a real model: keys or values, which layer, and what helps?

Published in ``docs/model_families.md``, "The FP8 KV cache on Qwen2.5":

    python benchmarks/kv_cache_probe.py --model qwen2.5-coder-1.5b --workdir W --eval-windows 2

Reads the windows and the unquantized log-probabilities that ``benchmarks/real_ptq.py --workdir W`` stored
(``W/data.safetensors``, ``W/reference_logprobs``; the first ``--eval-windows`` of its test windows), loads
the model once in float32 and quantizes only its attention's K / V (``--kv``: a KV preset, FP8 per tensor by
default; weights and activations unquantized), calibrated with max on the stored calibration windows. Then
each row turns quantizers on or off and is measured as ``real_ptq.py`` measures (perplexity, KL(unquantized
|| row) per predicted token, top-1 agreement):

* ``K+V`` (the preset), ``K only``, ``V only``;
* ``K+V, layer 0's K unquantized`` (the layer with the largest K amax: ``--skip-layers``);
* ``K+V affine``: the preset's affine variant (``--affine``, a static bias per KV head and channel
  subtracted before quantizing), calibrated again.

It also prints, per layer, the calibrated K and V amax and the largest ``|k_proj bias|`` (models with one):
a key channel that the bias holds far from zero, nearly constant over tokens, is what one per-tensor FP8
scale rounds to a coarse grid (E4M3's top binade has a step of 32 / 448 of the amax).
"""

from __future__ import annotations

import time
from typing import Any

import _harness as h
import _probe
import _real_ptq_peer as peer

SLOTS = ("k_bmm_quantizer", "v_bmm_quantizer")


def _attention(model: Any) -> list[Any]:
    return [layer.self_attn for layer in model.model.layers]


def _set(model: Any, on: dict[str, bool], skip: tuple[int, ...] = ()) -> None:
    for i, attn in enumerate(_attention(model)):
        for slot in SLOTS:
            quantizer = getattr(attn, slot)
            enabled = on[slot] and not (slot == "k_bmm_quantizer" and i in skip)
            quantizer.enable() if enabled else quantizer.disable()


def _kv_only(model: Any, preset: str, calib: Any, batch: int) -> None:
    import torch

    import modelopt_lite.quantization as mtq

    cfg = mtq.with_kv_cache(
        {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}, preset
    )
    with torch.no_grad():
        mtq.quantize(model, cfg, list(calib.split(batch)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser(__doc__)
    _probe.add_flags(p, eval_windows=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--kv", default="FP8_KV_CFG", help="the KV preset")
    p.add_argument("--affine", default="FP8_AFFINE_KV_CFG", help="its affine variant ('' to skip the row)")
    p.add_argument("--skip-layers", default="0", help="layers whose K stays unquantized in that row")
    h.common(p, threads=1, json="write the rows and the per-layer amax here")
    args = p.parse_args(argv)
    h.pin_threads(args.threads)
    start = time.perf_counter()
    data, test, ref_dir, load = _probe.inputs(args)

    def row(name: str, model: Any) -> dict[str, Any]:
        m = peer.measure(model, test, ref_dir, args.batch_size)
        print(f"  {name:<34} ppl {m['ppl']:.4f}  KL {m['kl']:.4f}  top1 {m['top1']:.4f}", flush=True)
        return {"name": name, **{k: m[k] for k in ("ppl", "kl", "top1", "tokens")}}

    model = load()
    _kv_only(model, args.kv, data["calib"], args.batch_size)
    layers = []
    for i, attn in enumerate(_attention(model)):
        bias = getattr(attn.k_proj, "bias", None)
        layers.append({
            "layer": i,
            "k_amax": float(attn.k_bmm_quantizer.amax.max()),
            "v_amax": float(attn.v_bmm_quantizer.amax.max()),
            "k_proj_bias_max": None if bias is None else float(bias.detach().abs().max()),
        })  # fmt: skip
    print("| layer | K amax | V amax | max abs k_proj bias |\n|---|---|---|---|")
    for e in layers:
        bias = "—" if e["k_proj_bias_max"] is None else f"{e['k_proj_bias_max']:.1f}"
        print(f"| {e['layer']} | {e['k_amax']:.1f} | {e['v_amax']:.2f} | {bias} |")
    print(f"{args.model}, {args.kv} on K / V only, {args.eval_windows} test window(s):", flush=True)
    skip = tuple(int(s) for s in h.csv(args.skip_layers))
    rows = []
    for name, on, skipped in (
        ("K+V", {"k_bmm_quantizer": True, "v_bmm_quantizer": True}, ()),
        ("K only", {"k_bmm_quantizer": True, "v_bmm_quantizer": False}, ()),
        ("V only", {"k_bmm_quantizer": False, "v_bmm_quantizer": True}, ()),
        (f"K+V, K of layer(s) {args.skip_layers} unquantized", {s: True for s in SLOTS}, skip),
    ):
        _set(model, on, skipped)
        rows.append(row(name, model))
    del model
    if args.affine:
        model = load()
        _kv_only(model, args.affine, data["calib"], args.batch_size)
        rows.append(row(f"K+V affine ({args.affine})", model))
    meta = h.run_meta(__file__, argv, time.perf_counter() - start)
    out = {**meta, "model": args.model_dir or args.model, "kv": args.kv, "rows": rows, "layers": layers}
    h.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
