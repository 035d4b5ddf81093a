"""Where does an AWQ (or SmoothQuant) row lose on a real model: the weights or the inputs, clipping, the
shared search?

Published in ``docs/model_families.md``, "W4A8 AWQ on eight windows":

    python benchmarks/awq_probe.py --model qwen2.5-coder-1.5b --workdir W --eval-windows 8
    python benchmarks/awq_probe.py --model qwen2.5-coder-1.5b --workdir W --eval-windows 8 --per-layer
    python benchmarks/awq_probe.py --model qwen2.5-coder-1.5b --workdir W --eval-windows 8 --group-scale mean

Reads the windows and the unquantized log-probabilities that ``benchmarks/real_ptq.py --workdir W`` stored
(``W/data.safetensors``, ``W/reference_logprobs``; its first ``--eval-windows`` test windows, batches of 4 as
stored), loads the model in float32 and quantizes it with ``--qformat`` (``w4a8_awq``: INT4 weights with AWQ
scales, FP8 per-tensor inputs) on the stored calibration windows, as ``real_ptq.py`` does (then the export's
shared q/k/v and gate/up input amax). Each window is then measured on its own (summed negative
log-likelihood, KL(unquantized || row) per predicted token):

* ``as is``: the row of ``real_ptq.py``, with the share of input elements beyond their quantizer's amax
  (clipped by the FP8 scale) and the three layers with the largest ``max |x| / amax``;
* ``inputs off``: the FP8 input quantizers disabled, the AWQ scales kept (the weights' share of the loss);
* ``inputs widened``: each input amax raised to the largest input the evaluated windows give it (no
  clipping; a diagnostic that looks at the evaluated text, never a calibration);
* ``--per-layer``: instead, the AWQ search run on each layer alone (q, k, v, gate and up each with its own
  scale, as the reference's ``awq_lite`` searches; not deployable with fused q/k/v), measured as is;
* ``--group-scale mean``: the rows above with ``awq_lite``'s ``group_scale="mean"`` (each layer searched
  alone, the group given the mean of their ``pre_quant_scale``: deployable);
* ``--group-loss output`` / ``regret``: with that ``awq_lite`` ``group_loss`` (how the joint search weighs
  a group's layers);
* ``--qformat int8_sq`` (SmoothQuant: INT8 weights per channel, INT8 per-tensor inputs) with ``--alpha A``:
  the smoothing strength (``s_j = max|X_j|^A / max|W_:j|^(1 - A)``; the preset's is 1.0); the rows above
  then split its loss between the INT8 weights and the INT8 inputs.

``--split validation`` measures on windows of the corpus' validation split instead (made, with their
unquantized log-probabilities, in ``--workdir`` on first use): choose between levers there, report on the
test windows. Every run also prints, for the layers with a bias, the share of their output that the inputs
make on the calibration windows (``||x W^T||^2 / ||x W^T + b||^2``; JSON ``bias_share``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import _harness as h
import _probe


def _per_window(model: Any, test: Any, ref_dir: Path, name: str, track: dict | None = None) -> list[dict]:
    import torch
    from safetensors.torch import load_file

    rows = []
    with torch.no_grad():
        for b, batch in enumerate(test.split(4)):
            ref = load_file(str(ref_dir / f"b{b}.safetensors"))["logprobs"]
            for r in range(batch.shape[0]):
                if track is not None:
                    track.clear()
                lp = model(input_ids=batch[r : r + 1]).logits[0, :-1].float().log_softmax(-1)
                targets, want = batch[r, 1:], ref[r]
                row: dict[str, Any] = {
                    "window": 4 * b + r,
                    "nll": -float(lp.gather(-1, targets[:, None]).sum()),
                    "kl": float((want.exp() * (want - lp)).sum()) / targets.numel(),
                }
                if track:
                    row["clipped_fraction"] = sum(s[0] for s in track.values()) / sum(
                        s[1] for s in track.values()
                    )
                    worst = sorted(track.items(), key=lambda kv: -kv[1][2])[:3]
                    row["largest_over_amax"] = [[n, round(s[2], 2)] for n, s in worst]
                rows.append(row)
                print(
                    f"  {name:<16} window {row['window']}: nll {row['nll']:.2f}  KL {row['kl']:.4f}",
                    flush=True,
                )
    return rows


def _inputs(model: Any) -> dict[str, Any]:
    from modelopt_lite.nn.quant_linear import QuantLinear

    return {
        n: m.input_quantizer
        for n, m in model.named_modules()
        if isinstance(m, QuantLinear) and m.input_quantizer is not None and m.input_quantizer.amax is not None
    }


def _watch(quantizers: dict[str, Any], seen: dict, peaks: bool = False) -> list[Any]:
    """Hooks on each input quantizer: ``seen[name]`` = [elements over amax, elements, max |x| / amax] of
    the input as it is quantized (after the AWQ scale), or with ``peaks`` the largest ``|x|``."""

    def hook(name: str) -> Any:
        def f(quantizer: Any, args: Any) -> None:
            x = quantizer._transform(args[0]).detach().abs()
            if peaks:
                seen[name] = max(seen.get(name, 0.0), float(x.max()))
                return
            amax = float(quantizer.amax.max())
            s = seen.setdefault(name, [0, 0, 0.0])
            s[0], s[1], s[2] = (
                s[0] + int((x > amax).sum()),
                s[1] + x.numel(),
                max(s[2], float(x.max()) / amax),
            )

        return f

    return [q.register_forward_pre_hook(hook(n)) for n, q in quantizers.items()]


def _bias_share(model: Any, calib: Any) -> dict[str, float]:
    """For each linear layer with a bias, ``||x W^T||^2 / ||x W^T + b||^2`` on the calibration windows
    (float model): how much of its output the inputs make (tiny where a bias dominates, as in Qwen2's
    k_proj); ``awq_lite``'s ``group_loss="relative"`` divides each layer's error by the numerator, its
    default ``"output"`` by the denominator."""
    import torch

    sums: dict[str, list[float]] = {}

    def hook(name: str) -> Any:
        def f(module: Any, args: Any, out: Any) -> None:
            xw = args[0].reshape(-1, args[0].shape[-1]).float() @ module.weight.float().t()
            s = sums.setdefault(name, [0.0, 0.0])
            s[0] += float(xw.pow(2).sum())
            s[1] += float((xw + module.bias.float()).pow(2).sum())

        return f

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    hooks = [m.register_forward_hook(hook(n)) for n, m in linears if m.bias is not None]
    with torch.no_grad():
        for batch in calib.split(4):
            model(input_ids=batch)
    for hk in hooks:
        hk.remove()
    return {n: s[0] / max(s[1], 1e-30) for n, s in sums.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = h.parser(__doc__)
    _probe.add_flags(p, eval_windows=8)
    p.add_argument(
        "--qformat", default="w4a8_awq", help="an AWQ --qformat of the PTQ command line, or int8_sq"
    )
    p.add_argument("--per-layer", action="store_true", help="search each layer alone (see above)")
    p.add_argument("--group-scale", default="joint", help="awq_lite's group_scale: joint or mean")
    p.add_argument("--group-loss", help="awq_lite's group_loss: output (its default), relative, regret")
    p.add_argument("--alpha", type=float, help="smoothquant's alpha (int8_sq only; the preset's: 1.0)")
    p.add_argument("--as-is-only", action="store_true", help="only the 'as is' row")
    h.common(p, threads=2, json="write the rows here")
    args = p.parse_args(argv)
    h.pin_threads(args.threads)
    start = time.perf_counter()
    import torch

    import modelopt_lite.quantization as mtq
    import modelopt_lite.quantization.algorithms.awq as awq
    from modelopt_lite.cli.ptq import build_config
    from modelopt_lite.export.layers import unify_shared_scales

    cfg = build_config(args.qformat, "none")
    algorithm = cfg["algorithm"]
    method = algorithm if isinstance(algorithm, str) else algorithm["method"]
    if method == "smoothquant":
        if args.per_layer or args.group_loss or args.group_scale != "joint":
            raise SystemExit(
                "--per-layer, --group-scale and --group-loss are AWQ options; int8_sq takes --alpha"
            )
        options = {} if args.alpha is None else {"alpha": args.alpha}
        group_loss = None
    elif args.alpha is not None:
        raise SystemExit(
            f"--alpha is smoothquant's (--qformat int8_sq); {args.qformat} calibrates with {method}"
        )
    else:
        group_loss = args.group_loss or awq.GROUP_LOSSES[0]  # as real_ptq.py's row: the library's default
        options = {"group_scale": args.group_scale, "group_loss": group_loss}
    data, test, ref_dir, load = _probe.inputs(args)
    model = load()
    share = _bias_share(model, data["calib"])
    for name, r in sorted(share.items(), key=lambda kv: kv[1])[:5]:
        print(f"bias share: {name}: ||xW||^2 / ||xW + b||^2 = {r:.4f}", flush=True)
    grouping = awq.groups
    if args.per_layer:  # (a benchmark-local switch of the search's grouping; the library has no such option)
        awq.groups = lambda targets, stats: [[t] for t in targets]
    clock = time.perf_counter()
    try:
        with torch.no_grad():
            cfg["algorithm"] = {
                "method": method,
                **({} if isinstance(algorithm, str) else algorithm),
                **options,
            }
            mtq.quantize(model, cfg, list(data["calib"].split(4)))
    finally:
        awq.groups = grouping
    calib_s = time.perf_counter() - clock
    if not args.per_layer:
        unify_shared_scales(model)
    quantizers, seen = _inputs(model), {}
    rows: dict[str, list[dict]] = {}
    if args.per_layer:
        rows["per layer"] = _per_window(model, test, ref_dir, "per layer")
    else:
        hooks = _watch(quantizers, seen)
        rows["as is"] = _per_window(model, test, ref_dir, "as is", seen)
        for hook in hooks:
            hook.remove()
    if not args.per_layer and not args.as_is_only:
        for q in quantizers.values():
            q.disable()
        rows["inputs off"] = _per_window(model, test, ref_dir, "inputs off")
        peaks: dict[str, float] = {}
        hooks = _watch(quantizers, peaks, peaks=True)
        with torch.no_grad():
            for batch in test.split(4):
                model(input_ids=batch)
        for hook in hooks:
            hook.remove()
        for name, q in quantizers.items():
            q.enable()
            q.amax = torch.maximum(q.amax, torch.full_like(q.amax, peaks[name]))
        rows["inputs widened"] = _per_window(model, test, ref_dir, "inputs widened")
    summary = {}
    for name, windows in rows.items():
        nll, kl = sum(w["nll"] for w in windows), sum(w["kl"] for w in windows) / len(windows)
        summary[name] = {"nll": nll, "kl": kl}
        print(f"{name:<16} summed nll {nll:.2f}  KL {kl:.4f}")
    meta = h.run_meta(__file__, argv, time.perf_counter() - start)
    out = {**meta, "model": args.model_dir or args.model, "qformat": args.qformat,
           "group_scale": args.group_scale, "group_loss": group_loss, "alpha": options.get("alpha"),
           "split": args.split,
           "bias_share": {n: round(r, 6) for n, r in share.items()},
           "calib_s": round(calib_s, 1), "summary": summary,
           "windows": rows}  # fmt: skip
    h.write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
