"""Which PTQ calibration algorithms beat max calibration, on a small byte-level Llama trained on real text?

Published in ``docs/benchmarks.md``, "Calibration algorithms":

    OMP_NUM_THREADS=2 python benchmarks/algorithms.py --reference-python PY

(``--quick``: 100 training steps and fewer rows, a smoke run; ``--configs``, ``--no-memory`` cut it).

Data: CPython's own English documentation, available offline (docstrings of a fixed list of stdlib modules,
then ``pydoc_data.topics``), as UTF-8 bytes (vocab 256); the last 10% is held out. Model: ``LlamaForCausalLM``
(hidden 128, intermediate 384, 4 layers, 4 heads / 2 KV heads), seed 0, trained with AdamW for
``--train-steps`` steps of 16 random 128-byte windows; the weights are cached under
``~/.cache/modelopt_lite/bench/`` (keyed by a hash of the settings and the data).

Per (preset, algorithm): ``mtq.quantize`` on 16 calibration batches of 4x128 train windows, then the held-out
loss (32 windows of 128) and the relative layer output error ``||y_q - y||^2 / ||y||^2`` of every linear
layer but ``lm_head``, each quantized layer called on the inputs it saw in the unquantized model (4 held-out
windows), averaged over layers. "better than max?" means both are lower than the same preset's max row.
Each side runs in its own subprocess; the reference (nvidia-modelopt under ``--reference-python``, borrowing
this interpreter's transformers like ``benchmarks/calibrate.py``) gets the same weights and data tensors.
"reduction" is ``1 - mse / mse(max)`` of the same preset and side: the share of max calibration's layer
output error that the algorithm removes.

Reference interpreter: ``--reference-python`` (default ``$MODELOPT_REFERENCE_PYTHON``); without either, the
reference columns are skipped.
``--make-reference-venv DIR`` creates (or reuses) a virtual environment there, installs
``torch==<this interpreter's torch version>`` first, then ``nvidia-modelopt==0.47.0`` with
``transformers==<this interpreter's version>`` and ``requests`` (modelopt imports both without declaring
them), and runs the reference with ``DIR/bin/python``; pip's output goes to ``DIR/install.log``. Torch comes
first so that pip keeps that build rather than picking another for modelopt's loose torch pin; where PyPI
serves CUDA builds of torch, a CPU build needs ``PIP_INDEX_URL`` / ``PIP_EXTRA_INDEX_URL`` set to a CPU
wheel index before the command.

GPTQ memory: in fresh processes, the peak-RSS increase (VmHWM, reset through ``/proc/self/clear_refs``)
during ``mtq.quantize`` with INT4_AWQ_CFG and algorithm gptq vs max on random-init Llamas of 2 and 8 layers.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import _harness as h

ROWS = [
    ("INT8_SMOOTHQUANT_CFG", ["max", "smoothquant"]),
    ("INT4_AWQ_CFG", ["max", "awq_lite", "awq_clip", "awq_full", "gptq", "mse"]),
    ("NVFP4_DEFAULT_CFG", ["max", "awq_lite", "gptq", "mse"]),
    ("NVFP4_AWQ_LITE_CFG", ["max", "awq_lite", "awq_clip", "awq_full"]),
    ("W4A8_AWQ_BETA_CFG", ["max", "awq_lite"]),
]
QUICK_ROWS = [("INT8_SMOOTHQUANT_CFG", ["max", "smoothquant"]), ("INT4_AWQ_CFG", ["max", "awq_lite", "gptq"])]
MODEL = dict(
    vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
)  # fmt: skip
MODULES = (
    "os re json collections itertools functools pathlib typing argparse logging subprocess threading asyncio "
    "inspect unittest dataclasses contextlib string textwrap datetime decimal statistics random heapq bisect "
    "csv sqlite3 email urllib shutil tempfile pickle copy zipfile tarfile hashlib struct queue traceback "
    "warnings weakref abc numbers io codecs difflib doctest timeit"
).split()
SEQ, CALIB_BATCHES, CALIB_BS, EVAL_WINDOWS, LAYER_WINDOWS = 128, 16, 4, 32, 4
REFERENCE_MODELOPT = "nvidia-modelopt==0.47.0"
CACHE = os.path.expanduser("~/.cache/modelopt_lite/bench")


# ------------------------------------------------------------------------------------------- data, model


def corpus_bytes() -> bytes:
    import importlib
    import inspect
    from pydoc_data.topics import topics

    docs = []
    for name in MODULES:
        try:
            docs.append(inspect.getdoc(importlib.import_module(name)) or "")
        except ImportError:
            continue
    docs += [topics[k] for k in sorted(topics)]
    return "\n\n".join(d for d in docs if d).encode("utf-8")


def windows(tokens, n: int, seed: int, seq: int = SEQ):
    import torch

    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq, (n,), generator=gen)
    return torch.stack([tokens[s : s + seq] for s in starts.tolist()])


def heldout_loss(model, eval_ids) -> float:
    import torch

    with torch.no_grad():
        losses = [model(input_ids=b, labels=b).loss.item() for b in eval_ids.split(8)]
    return sum(losses) / len(losses)


def train_or_load(args) -> tuple[str, dict]:
    import torch
    from safetensors.torch import load_file, save_file

    tokens = torch.tensor(list(corpus_bytes()), dtype=torch.long)
    cut = int(0.9 * len(tokens))
    train, held = tokens[:cut], tokens[cut:]
    settings = dict(model=MODEL, steps=args.train_steps, batch=args.train_batch, seq=SEQ, lr=3e-3, wd=0.01,
                    schedule="warmup10-cosine", seed=0, clip=1.0,
                    data=hashlib.sha256(bytes(tokens.to(torch.uint8).tolist())).hexdigest()[:16])  # fmt: skip
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(CACHE, f"llama_bytes_{key}.safetensors")
    data = {
        "calib": windows(train, CALIB_BATCHES * CALIB_BS, 1).view(CALIB_BATCHES, CALIB_BS, SEQ),
        "eval": windows(held, EVAL_WINDOWS, 2),
        "layer": windows(held, LAYER_WINDOWS, 3),
    }
    info = {"path": path, "train_bytes": len(train), "held_bytes": len(held), "cached": os.path.exists(path)}
    model = h.tiny_model(**MODEL)
    if info["cached"]:
        model.load_state_dict(load_file(path))
    else:
        torch.set_num_threads(args.threads)
        opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=settings["wd"])
        steps = args.train_steps
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        )
        gen, recent, start = torch.Generator().manual_seed(0), [], time.perf_counter()
        model.train()
        for step in range(steps):
            starts = torch.randint(0, len(train) - SEQ, (args.train_batch,), generator=gen).tolist()
            batch = torch.stack([train[s : s + SEQ] for s in starts])
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings["clip"])
            opt.step()
            sched.step()
            recent = [*recent, loss.item()][-20:]
            if (step + 1) % 50 == 0:
                print(f"  step {step + 1}/{steps}: train loss {loss.item():.3f}", file=sys.stderr, flush=True)
        info["train_s"], info["train_loss_last20"] = time.perf_counter() - start, sum(recent) / len(recent)
        os.makedirs(CACHE, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    info["heldout_loss"] = heldout_loss(model.eval(), data["eval"])
    return path, {**info, **{k: v for k, v in data.items()}}


# ----------------------------------------------------------------------------------------------- children


def _set_algorithm(cfg: dict, algorithm: str) -> dict:
    current = cfg.get("algorithm")
    method = current.get("method") if isinstance(current, dict) else current
    if method != algorithm:  # keep the preset's own options (e.g. alpha_step) when it already runs it
        cfg["algorithm"] = algorithm
    return cfg


def _timed(fn, *args) -> dict:
    """Wall seconds of ``fn(*args)``; cores other processes kept busy meanwhile (they inflate it)."""
    start = h.CpuMark.now()
    fn(*args)
    seconds, others = start.since()
    return {"seconds": seconds} if math.isnan(others) else {"seconds": seconds, "other_cores": others}


def _eval_child(side: str, data_path: str, rows: list, threads: int) -> None:
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(threads)
    data = torch.load(data_path)
    state = load_file(data["path"])
    if side == "ours":
        import modelopt_lite.quantization as mtq
        from modelopt_lite.logging import set_verbosity

        set_verbosity("WARNING")
    else:
        import modelopt.torch.quantization as mtq

    def fresh():
        model = h.tiny_model(seed=None, **MODEL)
        model.load_state_dict(state)
        return model.eval()

    captured: dict = {}

    def keep(name):
        return lambda mod, inp, out: captured.__setitem__(
            name, (inp[0].detach().clone(), out.detach().clone())
        )

    model = fresh()
    hooks = [m.register_forward_hook(keep(n)) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and "lm_head" not in n]  # fmt: skip
    with torch.no_grad():
        model(data["layer"])
    for hook in hooks:
        hook.remove()
    h.emit_result({"row": None, "loss": heldout_loss(model, data["eval"])})

    def loop(m):
        with torch.no_grad():
            for b in data["calib"]:
                m(b)

    # untimed warm-up: lazy imports and first-call costs of the library would land on the first row
    try:
        warm = _set_algorithm(copy.deepcopy(getattr(mtq, rows[0][0])), "max")
        with torch.no_grad():
            mtq.quantize(fresh(), warm, lambda m: m(data["calib"][0]))
    except Exception:  # the row itself reports the error
        pass
    for config, algorithm in rows:
        out = {"row": [config, algorithm]}
        try:
            if not hasattr(mtq, config):
                raise KeyError(f"preset {config} not in this library")
            cfg = _set_algorithm(copy.deepcopy(getattr(mtq, config)), algorithm)
            model = fresh()
            out.update(_timed(mtq.quantize, model, cfg, loop))
            errs = []
            with torch.no_grad():
                for name, (x, y) in captured.items():
                    yq = model.get_submodule(name)(x)
                    errs.append(((yq.float() - y).pow(2).sum() / y.pow(2).sum()).item())
                out["mse"] = sum(errs) / len(errs)
                out["loss"] = heldout_loss(model, data["eval"])
        except Exception as err:
            out.update(h.error_result(err, 160))
        h.emit_result(out)


def _mem_child(layers: int, algorithm: str, threads: int) -> None:
    import torch

    import modelopt_lite.quantization as mtq
    from modelopt_lite.logging import set_verbosity

    set_verbosity("WARNING")
    torch.set_num_threads(threads)
    model = h.tiny_model(
        **dict(MODEL, hidden_size=256, intermediate_size=768, num_hidden_layers=layers)
    ).eval()
    batches = h.random_batches(8, (4, SEQ), 256, seed=7)
    with torch.no_grad():
        model(batches[0])  # warm-up: kernels, thread pools
    how, base = h.reset_peak_rss("peak after warm-up")
    timed = _timed(mtq.quantize, model, _set_algorithm(mtq.get_preset("INT4_AWQ_CFG"), algorithm), batches)
    res = {**timed, "increase_mb": h.status_mb("VmHWM") - base, "baseline": how,
           "model_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
           "block_mb": sum(m.weight.numel() * m.weight.element_size() for m in model.model.layers[0].modules()
                           if isinstance(m, torch.nn.Linear)) / 2**20}  # fmt: skip
    h.emit_result(res)


def _run_child(python: str, argv: list[str], threads: int, extra_path: str | None, **env_extra) -> list[dict]:
    env = h.child_env(threads, extra_path, **env_extra)
    cmd = [python, os.path.abspath(__file__), *argv, "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.path.dirname(python) or None)
    out = h.parse_results(proc.stdout)  # one result per row; a crash adds the row "crash"
    if proc.returncode:
        out.append({"row": "crash", **h.crash_error(proc)})
    return out


# ------------------------------------------------------------------------------------------------ parent


def make_reference_venv(path: str) -> str:
    """Create (or reuse) a venv at ``path`` with this interpreter's torch version, then the reference;
    return its interpreter. pip's output goes to ``path/install.log``."""
    import torch
    import transformers

    torch_pin, more = f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}"
    log = os.path.join(os.path.abspath(path), "install.log")
    return h.make_venv(path, [torch_pin], [REFERENCE_MODELOPT, more, "requests"], log=log)


def _secs(r: dict) -> str:
    if "error" in r or "seconds" not in r:
        return "n/a"
    return f"{r['seconds']:.2f}" + ("*" if r.get("other_cores", 0) > 0.25 else "")


def _better(res: dict | None, base: dict | None) -> str:
    if res is None or base is None or "error" in res or "error" in base:
        return "n/a"
    if res is base:
        return "-"
    worse = [k for k in ("mse", "loss") if res[k] >= base[k]]
    return "yes" if not worse else "no (" + ", ".join(f"{k} higher" for k in worse) + ")"


def _reduction(res: dict, base: dict | None) -> str:
    """``1 - mse / mse(max)`` as a percentage: the share of max calibration's layer error removed."""
    if base is None or "error" in base or "error" in res or "mse" not in res or res is base:
        return "-" if res is base else "n/a"
    return f"{100 * (1 - res['mse'] / base['mse']):+.1f}%"


def main() -> None:
    parser = h.common(h.parser(__doc__), threads=2, quick="100 training steps, fewer rows")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--train-batch", type=int, default=16)
    parser.add_argument("--no-memory", action="store_true", help="skip the GPTQ memory table")
    h.common(parser, json="write the raw numbers here")
    parser.add_argument("--configs", help="comma-separated presets: only their rows (default: all)")
    ref_arg = parser.add_mutually_exclusive_group()
    h.common(ref_arg, reference="interpreter with nvidia-modelopt installed (else no reference columns)")
    ref_arg.add_argument(
        "--make-reference-venv", metavar="DIR", help=f"create / reuse a venv in DIR with {REFERENCE_MODELOPT}"
    )
    h.hidden(parser, child=["ours", "ref", "mem"], data=str, rows=str, layers=int, algorithm=str)
    args = parser.parse_args()
    if args.child == "mem":
        return _mem_child(args.layers, args.algorithm, args.threads)
    if args.child:
        return _eval_child(args.child, args.data, json.loads(args.rows), args.threads)

    import torch

    if args.quick:
        args.train_steps = min(args.train_steps, 100)
    table = QUICK_ROWS if args.quick else ROWS
    if args.configs:
        wanted = args.configs.split(",")
        unknown = sorted(set(wanted) - {c for c, _ in table})
        if unknown:
            parser.error(f"--configs: {unknown} not among {[c for c, _ in table]}")
        table = [row for row in table if row[0] in wanted]
    if args.make_reference_venv:
        args.reference_python = make_reference_venv(args.make_reference_venv)
    rows = [[c, a] for c, algs in table for a in algs]
    path, info = train_or_load(args)
    how = "loaded from cache" if info["cached"] else f"trained in {info['train_s']:.0f} s"
    print(f"tiny byte-level Llama {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}: {how} "
          f"({args.train_steps} steps of {args.train_batch}x{SEQ}; {info['train_bytes']} train / "
          f"{info['held_bytes']} held-out bytes) -> {path}")  # fmt: skip
    if "train_loss_last20" in info:
        print(f"final train loss (mean of last 20 steps) {info['train_loss_last20']:.3f}")
    print(f"held-out loss unquantized {info['heldout_loss']:.3f} nats/byte (uniform: ln 256 = 5.545)")
    print(f"calibration: {CALIB_BATCHES} batches of {CALIB_BS}x{SEQ}; eval: {EVAL_WINDOWS} windows; "
          f"layer error: {LAYER_WINDOWS} windows; threads {args.threads}", flush=True)  # fmt: skip

    sides = {"ours": (sys.executable, h.REPO_ROOT)}
    ref_ok, ref_note = h.reference_usable(args.reference_python)
    if ref_ok:
        shim, borrowed, _ = h.borrow(args.reference_python)
        sides["ref"] = (args.reference_python, shim)
        if borrowed:
            print(f"note: reference borrows {', '.join(borrowed)} from {sys.executable}")
    else:
        print(f"note: reference columns skipped ({ref_note})")
    tmp = tempfile.mkdtemp(prefix="algorithms_bench_")
    data_path = os.path.join(tmp, "data.pt")
    torch.save({"path": path, **{k: info[k] for k in ("calib", "eval", "layer")}}, data_path)
    results: dict[str, dict] = {}
    for side, (python, extra) in sides.items():
        print(f"running {side} ({len(rows)} rows) ...", file=sys.stderr, flush=True)
        out = _run_child(python, ["--child", side, "--data", data_path, "--rows", json.dumps(rows)],
                         args.threads, extra)  # fmt: skip
        results[side] = {
            (tuple(r["row"]) if isinstance(r["row"], list) else r["row"] or "base"): r for r in out
        }
    os.remove(data_path)
    os.rmdir(tmp)

    ours = results["ours"]
    base = ours.get("base", {}).get("loss")
    print("\n## ours (modelopt_lite)\n")
    print(f"unquantized held-out loss: {h.fmt_or_na(base, '.4f')}\n")
    print("| config | algorithm | rel. layer MSE (mean) | reduction | held-out loss | Δ loss vs unquantized "
          "| calib s | better than max? |\n|" + "---|" * 8)  # fmt: skip
    for c, a in rows:
        r = ours.get((c, a), {"error": "missing (child crashed)"})
        ok = "error" not in r
        delta = r["loss"] - base if ok and base is not None else None
        cells = (f"{r['mse']:.3e} | {_reduction(r, ours.get((c, 'max')))} | {r['loss']:.4f} "
                 f"| {h.fmt_or_na(delta, '+.4f')} | {_secs(r)}" if ok
                 else f"n/a ({r['error']}) | n/a | n/a | n/a | n/a")  # fmt: skip
        print(f"| {c} | {a} | {cells} | {_better(r, ours.get((c, 'max')))} |")
    print("\ncalib s: wall time of mtq.quantize (insertion + calibration) after an untimed warm-up; * = other"
          " processes kept > 0.25 cores busy meanwhile (time inflated)")  # fmt: skip

    if "ref" in results:
        ref = results["ref"]
        print("\n## side by side with nvidia-modelopt (same weights, data and configs)\n")
        rb = ref.get("base", {}).get("loss")
        print(f"unquantized held-out loss: ours {h.fmt_or_na(base, '.4f')}, ref {h.fmt_or_na(rb, '.4f')}\n")
        print("| config | algorithm | ours loss | ref loss | ours layer MSE | ref layer MSE | ours reduction "
              "| ref reduction | ours s | ref s | ref better than max? |\n|" + "---|" * 11)  # fmt: skip
        for c, a in rows:
            o, r = ours.get((c, a), {}), ref.get((c, a), {"error": "missing (child crashed)"})

            def cell(d, k, spec):
                return h.fmt_or_na(d.get(k), spec) if "error" not in d else "n/a"

            rl = cell(r, "loss", ".4f") if "error" not in r else f"n/a ({r['error']})"
            print(f"| {c} | {a} | {cell(o, 'loss', '.4f')} | {rl} | {cell(o, 'mse', '.3e')} "
                  f"| {cell(r, 'mse', '.3e')} | {_reduction(o, ours.get((c, 'max')))} "
                  f"| {_reduction(r, ref.get((c, 'max')))} | {_secs(o)} | {_secs(r)} "
                  f"| {_better(r, ref.get((c, 'max')))} |")  # fmt: skip

    mem = {}
    if not args.no_memory:
        print("\n## GPTQ peak host memory (INT4_AWQ_CFG, random-init hidden 256 / intermediate 768, "
              "8 batches 4x128, fresh process each)\n")  # fmt: skip
        print("| layers | glibc malloc | model weights MB | one block's linear weights MB | peak RSS "
              "increase gptq MB | max MB | gptq - max MB | gptq s |\n|" + "---|" * 8)  # fmt: skip
        # default glibc raises its mmap threshold after large frees, so freed per-block buffers may stay in
        # the heap (fragmentation); a fixed threshold returns them to the OS and shows what is really kept
        for malloc, env in (("default", {}), ("MMAP_THRESHOLD 64K", {"MALLOC_MMAP_THRESHOLD_": "65536"})):
            for layers in (2, 8):
                for alg in ("gptq", "max"):
                    argv = ["--child", "mem", "--layers", str(layers), "--algorithm", alg]
                    res = _run_child(sys.executable, argv, args.threads, h.REPO_ROOT, **env)
                    ok = res and "error" not in res[0]
                    mem[f"{malloc}/{layers}/{alg}"] = res[0] if ok else {"error": str(res)[:300]}
                g, m = mem[f"{malloc}/{layers}/gptq"], mem[f"{malloc}/{layers}/max"]
                if "error" in g or "error" in m:
                    print(f"| {layers} | {malloc} | n/a ({(g.get('error') or m.get('error'))[:150]}) |")
                    continue
                gi, mi = g["increase_mb"], m["increase_mb"]
                print(f"| {layers} | {malloc} | {g['model_mb']:.1f} | {g['block_mb']:.2f} | {gi:.1f} "
                      f"| {mi:.1f} | {gi - mi:+.1f} | {_secs(g)} |")  # fmt: skip
        print(f"\n(baseline: {next((v['baseline'] for v in mem.values() if 'baseline' in v), 'n/a')})")

    for side, res in results.items():
        for key, r in res.items():
            if "traceback" in r and (side == "ours" or key == "crash"):
                print(f"\n{side} failed on {key}:\n{r['traceback']}")
    if args.json:
        info = {k: v for k, v in info.items() if not hasattr(v, "shape")}
        dump = {s: [dict(r, row=list(k) if isinstance(k, tuple) else k) for k, r in res.items()]
                for s, res in results.items()}  # fmt: skip
        h.write_json(
            args.json, {"training": info, "results": dump, "memory": mem, "reference_note": ref_note}
        )


if __name__ == "__main__":
    main()
