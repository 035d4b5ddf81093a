"""Do our exported checkpoints match nvidia-modelopt's, tensor by tensor, for the same model and calibration?

Published in ``docs/benchmarks.md``, "Export compatibility" (measured 2026-11-29, rechecked 2026-12-01/02):

    python benchmarks/export_compat.py --reference-python PY

Each side runs in its own subprocess (this file re-invoked with ``--child ours|ref``): ``LlamaForCausalLM``
from a config (hidden 128, intermediate 256, 2 layers, 4 heads / 2 KV heads, vocab 256, bf16, weights from
``torch.manual_seed(0)``), max calibration on 4 fixed batches of 2x32 tokens, then ``export_hf_checkpoint``
into a temporary directory. The reference runs under ``--reference-python`` (default
``$MODELOPT_REFERENCE_PYTHON``; without either, or when it cannot import nvidia-modelopt, the script stops
with an error saying so), borrowing this interpreter's transformers
through the symlink folder of ``benchmarks/calibrate.py`` when it has none. The parent compares the two
checkpoints: tensor names, dtypes, shapes and values (bytes), the calibrated amax each side used (as the
scales they wrote), and the keys of ``hf_quant_config.json`` and ``config.json["quantization_config"]``. A
side that fails is reported with its error instead of a comparison.

Differences found with nvidia-modelopt 0.47 (2026-11-29, and why): FP8 weight codes differ by one FP8 step in
a few percent of the elements because the reference divides the bf16 weight by a 0-dim float32 scale, which
PyTorch computes in bf16 (rounded twice); ours rounds once from float32, as its fake quantization does. NVFP4
exports are identical (``pack_e2m1`` writes a negative value that rounds to zero as 0x8, as the reference
does). Scales, names, dtypes and shapes are identical. ``MIXED_NVFP4_FP8`` (NVFP4 with layer 0's linears in
FP8, the layout ``mtq.auto_quantize`` exports; 2026-12-02): both write ``MIXED_PRECISION`` with identical
``quantized_layers``; ours also lists ``exclude_modules``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile

import _harness as h

CONFIGS = ["FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", "MIXED_NVFP4_FP8"]
#: a mixed-precision model, as ``mtq.auto_quantize`` leaves one: NVFP4 everywhere, layer 0's linears in FP8
MIXED = {"MIXED_NVFP4_FP8": ("NVFP4_DEFAULT_CFG", "*layers.0.*", {"num_bits": (4, 3), "axis": None})}


def _child(side: str, config: str, out: str) -> None:
    import torch

    if side == "ours":
        import modelopt_lite.quantization as mtq
        from modelopt_lite.export import export_hf_checkpoint
    else:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
    model = h.tiny_model(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip
    model = model.to(torch.bfloat16).eval()
    # nvidia-modelopt 0.47's export fails on a model built from a config (architectures None: "'NoneType'
    # object is not iterable" in is_multimodal_model); ours fills it in. Set it on both sides.
    model.config.architectures = ["LlamaForCausalLM"]
    data = h.random_batches(4, (2, 32), 256, seed=1)

    def loop(m):
        with torch.no_grad():
            for x in data:
                m(x)

    if config in MIXED:  # the same rules appended on both sides (both take the list form of quant_cfg)
        base, pattern, fp8 = MIXED[config]
        cfg = copy.deepcopy(getattr(mtq, base))
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [
            {"quantizer_name": f"{pattern}{q}", "cfg": dict(fp8)}
            for q in ("weight_quantizer", "input_quantizer")
        ]
    else:
        cfg = getattr(mtq, config)
    mtq.quantize(model, cfg, loop)
    if side == "ours":
        export_hf_checkpoint(model, out)
    else:
        export_hf_checkpoint(model, export_dir=out)
    h.emit_result({"ok": True})


def _run(python: str, side: str, config: str, out: str, extra_path: str | None) -> str | None:
    """None when the side exported, else its error."""
    cmd = [python, os.path.abspath(__file__), "--child", side, "--config", config, "--out", out]
    return h.run_child(cmd, h.child_env(2, extra_path), cwd=os.path.dirname(python) or None, limit=300).get(
        "error"
    )


def _tensors(directory: str) -> dict:
    import torch
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                for k in f.keys():
                    t = f.get_tensor(k)
                    if t.dtype == torch.float8_e4m3fn:  # compared as bytes; remembered for _explain
                        t = t.view(torch.uint8)
                        t.fp8 = True
                    out[k] = t
    return out


def _explain(a, b, fp8: bool) -> str:
    """What kind of difference: FP8 codes apart by how much, or E2M1 nibbles that differ only in the sign
    of zero."""
    import torch

    if fp8:
        va, vb = a.view(torch.float8_e4m3fn).float(), b.view(torch.float8_e4m3fn).float()
        ne = va != vb
        steps = (va[ne] - vb[ne]).abs() / va[ne].abs().clamp_min(2.0**-9)
        return f"(fp8 codes, largest relative difference {float(steps.max()):.3f})"
    na, nb = torch.stack((a & 15, a >> 4)), torch.stack((b & 15, b >> 4))
    ne = na != nb
    zero_sign = ne & ((na | nb) == 8) & ((na & nb) == 0)
    return f"(e2m1 nibbles: {int(zero_sign.sum())} of {int(ne.sum())} differ only as +0 / -0)"


def _keys(d, prefix=""):
    if not isinstance(d, dict):
        return set()
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        out |= _keys(v, f"{prefix}{k}.")
    return out


def _key_diff(a: dict, b: dict) -> dict:
    return {"only_ours": sorted(_keys(a) - _keys(b)), "only_ref": sorted(_keys(b) - _keys(a))}


def _compare(ours: str, ref: str) -> dict:
    import torch

    a, b = _tensors(ours), _tensors(ref)
    fp8_keys = {k for k, t in a.items() if getattr(t, "fp8", False)}
    common = sorted(set(a) & set(b))
    dtype_diff = [k for k in common if a[k].dtype != b[k].dtype]
    shape_diff = [k for k in common if k not in dtype_diff and a[k].shape != b[k].shape]
    value_diff = {}
    for k in common:
        if k in dtype_diff or k in shape_diff:
            continue
        ne = a[k] != b[k]
        if bool(ne.any()):
            value_diff[k] = f"{int(ne.sum())}/{ne.numel()} {_explain(a[k], b[k], fp8=k in fp8_keys)}"
    qa = json.load(open(os.path.join(ours, "hf_quant_config.json")))
    qb = json.load(open(os.path.join(ref, "hf_quant_config.json")))
    ca = json.load(open(os.path.join(ours, "config.json"))).get("quantization_config", {})
    cb = json.load(open(os.path.join(ref, "config.json"))).get("quantization_config", {})
    return {
        "tensors": [len(a), len(b)],
        "only_ours": sorted(set(a) - set(b)),
        "only_ref": sorted(set(b) - set(a)),
        "dtype_differs": dtype_diff,
        "shape_differs": shape_diff,
        "values_differ": value_diff,
        "values_equal": len(common) - len(dtype_diff) - len(shape_diff) - len(value_diff),
        "hf_quant_config_keys": _key_diff(qa, qb),
        "quantization_config_keys": _key_diff(ca, cb),
        "quant_algo": [qa["quantization"].get("quant_algo"), qb["quantization"].get("quant_algo")],
        "exclude_modules": [q["quantization"].get("exclude_modules") for q in (qa, qb)],
        # the per-layer formats of a MIXED_PRECISION checkpoint (None for one format)
        "quantized_layers_equal": qa["quantization"].get("quantized_layers")
        == qb["quantization"].get("quantized_layers"),
        "max_abs_diff_scales": {
            k: float((a[k].float() - b[k].float()).abs().max())
            for k in value_diff
            if a[k].dtype == torch.float32
        },
    }  # fmt: skip


def main() -> None:
    p = h.common(
        h.parser(__doc__), json="write the comparison here", reference="nvidia-modelopt's interpreter"
    )
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--keep", default=None, help="write the checkpoints under this directory and keep them")
    h.hidden(p, child=["ours", "ref"], config=str, out=str)
    args = p.parse_args()
    if args.child:
        _child(args.child, args.config, args.out)
        return
    usable, why = h.reference_usable(args.reference_python)
    if not usable:  # this benchmark only compares: nothing to do without the reference
        p.error(f"nvidia-modelopt is not usable: {why}")
    # the reference's export imports AutoTokenizer, which needs tokenizers (imported lazily by transformers)
    shim, borrowed, _ = h.borrow(args.reference_python, "import transformers, tokenizers")
    report: dict = {"reference": args.reference_python, "borrowed": borrowed, "configs": {}}
    for config in args.configs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            base = os.path.join(args.keep, config) if args.keep else tmp
            ours, ref = os.path.join(base, "ours"), os.path.join(base, "ref")
            errors = {
                "ours": _run(sys.executable, "ours", config, ours, None),
                "ref": _run(args.reference_python, "ref", config, ref, shim),
            }
            failed = {k: v for k, v in errors.items() if v}
            result = {"error": failed} if failed else _compare(ours, ref)
        report["configs"][config] = result
        print(f"== {config}")
        for key, value in result.items():
            print(f"  {key}: {value}")
    h.write_json(args.json, report, indent=2)


if __name__ == "__main__":
    main()
