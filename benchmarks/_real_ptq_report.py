"""Tables and figure of ``benchmarks/real_ptq.py`` (standard library; matplotlib for the figure)."""

from __future__ import annotations

import textwrap
from functools import partial
from typing import Any

import _harness as h

GOAL = 0.005  # ours within 0.5% perplexity of the reference (its exported model where it has one)
ROUNDTRIP_GOAL = 1e-3


_f = partial(h.fmt_or_na, na="—")


def _ppl_cell(m: dict[str, Any]) -> str:
    """A row's (or reload's) perplexity cell: ``error`` where it failed."""
    return "error" if m.get("error") else _f(m.get("ppl"), ".4f")


def _by_name(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in rows}


def _ppl(row: dict[str, Any] | None, key: str | None = None) -> float | None:
    if row is None:
        return None
    part = row.get(key) if key else row
    return part.get("ppl") if isinstance(part, dict) else None


def comparison(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per row name: ours, the reference fake-quantized and exported, and ours against the reference's
    exported model where it has one (else its fake-quant model)."""
    ref = _by_name(result["peers"].get("modelopt", {}).get("rows", []))
    out = []
    for row in result["ours"]:
        r = ref.get(row["name"])
        target = _ppl(r, "exported") or _ppl(r)
        ours = _ppl(row)
        delta = ours / target - 1 if ours and target else None
        out.append(
            {
                "name": row["name"],
                "ours": ours,
                "reference_fake": _ppl(r),
                "reference_exported": _ppl(r, "exported"),
                "vs_reference": delta,
                "within_goal": None if delta is None else delta <= GOAL,
            }
        )
    return out


def _errors(result: dict[str, Any]) -> list[str]:
    lines = []
    for lib, rows in [("ours", result["ours"])] + [
        (k, v.get("rows", [])) for k, v in result["peers"].items()
    ]:
        for r in rows:
            for key in ("error", "export_error"):
                if r.get(key):
                    lines.append(f"{lib} {r['name']} ({key.replace('_', ' ')}): {r[key]}")
            for key in ("dequantized", "compressed", "dequantized_act", "compressed_act", "exported"):
                if isinstance(r.get(key), dict) and r[key].get("error"):
                    lines.append(f"{lib} {r['name']} ({key} reload): {r[key]['error']}")
    for k, v in result["peers"].items():
        if v.get("error"):
            lines.append(f"{k} worker: {v['error']}")
    return lines


def _activations_roundtrip(result: dict[str, Any]) -> list[str]:
    """The table of the exports reloaded with ``activations="fake"`` against the full fake-quant model."""
    rows = [r for r in result["ours"] if "dequantized_act" in r or "compressed_act" in r]
    if not rows:
        return []
    n = rows[0].get("full_fake_ppl", {}).get("windows", "—")
    lines = [
        "",
        "Export round trip with activations (ours): test perplexity of the export reloaded with each layer's "
        "input (and the KV cache) fake-quantized from the stored scales (`load_hf_checkpoint(dir, "
        'activations="fake")`, dequantized and `compress=True`), relative to the full fake-quant model, '
        f"on the first {n} test windows (goal < {ROUNDTRIP_GOAL:g}); last column: the fake-quant model "
        "itself with its static activation amax replaced by the one the reload recovers (stored scale * "
        "max, within an ulp), and how many changed.",
        "",
        h.table_head(
            "| row | quant_algo | KV cache | full fake ppl | dequantized + act. ppl | rel. diff "
            "| compressed + act. ppl | rel. diff | fake, recovered amax: rel. diff (amax changed) |"
        ),
    ]
    for row in rows:
        d, c = row.get("dequantized_act") or {}, row.get("compressed_act") or {}
        rec = row.get("fake_recovered_amax_ppl") or {}
        lines.append(
            f"| {row['name']} | {row.get('quant_algo', '—')} | {row.get('kv_cache_quant_algo') or '—'} | "
            f"{_f((row.get('full_fake_ppl') or {}).get('ppl'), '.4f')} | {_ppl_cell(d)} | "
            f"{_f(d.get('rel_ppl_vs_fake'), '.1e')} | {_ppl_cell(c)} | "
            f"{_f(c.get('rel_ppl_vs_fake'), '.1e')} | "
            f"{_f(rec.get('rel_ppl_vs_fake'), '.1e')} ({rec.get('changed_amax', '—')}) |"
        )
    return lines


def markdown(result: dict[str, Any]) -> str:
    meta, base = result["meta"], result["baseline"]
    ref = _by_name(result["peers"].get("modelopt", {}).get("rows", []))
    versions = {k: v.get("versions", {}) for k, v in result["peers"].items()}
    lines = [
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}; {meta['date']}; torch {meta['torch']}, "
        f"transformers {meta['transformers']}"
        + "".join(f"; {k} {v.get(k, '?')}" for k, v in versions.items())
        + "  ",
        f"Model: {meta['model']}. Calibration: {meta['calibration']}. Evaluation: {meta['evaluation']}.  ",
        f"Unquantized test perplexity: **{base['ppl']:.4f}**.",
        "",
        h.table_head(
            "| row | ours ppl | ref ppl (fake quant) | ref ppl (exported) | ours vs ref | ours KL | ref KL "
            "| ours top-1 | ref top-1 | ours MB | ref MB | ours calib s | ref calib s |"
        ),
    ]
    comp = _by_name(result.get("comparison") or comparison(result))
    rt = next(
        (r["weight_only_fake_ppl"]["windows"] for r in result["ours"] if "weight_only_fake_ppl" in r), "—"
    )
    for row in result["ours"]:
        r = ref.get(row["name"], {})
        c = comp[row["name"]]
        vs = "—" if c["vs_reference"] is None else f"{100 * c['vs_reference']:+.2f}%"
        lines.append(
            f"| {row['name']} | {_ppl_cell(row)} | {_ppl_cell(r)} | {_ppl_cell(r.get('exported') or {})} "
            f"| {vs} | {_f(row.get('kl'), '.4f')} | "
            f"{_f(r.get('kl'), '.4f')} | {_f(row.get('top1'), '.4f')} | {_f(r.get('top1'), '.4f')} | "
            f"{_f(row.get('export_mb'), '.0f')} | {_f(r.get('export_mb'), '.0f')} | "
            f"{_f(row.get('calib_s'), '.0f')} | {_f(r.get('calib_s'), '.0f')} |"
        )
    if any("dequantized" in r or "export_error" in r for r in result["ours"]):
        lines += [
            "",
            "Export round trip (ours): test perplexity of the export reloaded dequantized "
            "(`AutoModelForCausalLM.from_pretrained`) and packed (`load_hf_checkpoint(dir, compress=True)`), "
            "relative to the fake-quant model with only its weight quantizers enabled (a reload computes "
            f"with dense activations), on the first {rt} test windows (goal < {ROUNDTRIP_GOAL:g}); how the "
            "tied `lm_head` was written. KV-cache rows are not reloaded (their weights are their base "
            "row's).",
            "",
            h.table_head(
                "| row | quant_algo | weight-only fake ppl | dequantized ppl | rel. diff | compressed ppl "
                "| rel. diff | lm_head |"
            ),
        ]
        for row in result["ours"]:
            if row.get("kv") not in (None, "none") or (
                "dequantized" not in row and "export_error" not in row
            ):
                continue
            d, c = row.get("dequantized") or {}, row.get("compressed") or {}
            head = row.get("lm_head") or {}
            head_s = (
                f"tied={head.get('tie_word_embeddings')}, stored={head.get('lm_head_tensor_stored')}, "
                f"excluded={head.get('lm_head_in_exclude_modules')}, "
                f"reloaded tied={head.get('reloaded_tied')}"
                if head else row.get("export_error", "—")
            )  # fmt: skip
            lines.append(
                f"| {row['name']} | {row.get('quant_algo', '—')} | "
                f"{_f((row.get('weight_only_fake_ppl') or {}).get('ppl'), '.4f')} | {_ppl_cell(d)} | "
                f"{_f(d.get('rel_ppl_vs_fake'), '.1e')} | {_ppl_cell(c)} | "
                + f"{_f(c.get('rel_ppl_vs_fake'), '.1e')} | {head_s} |"
            )
    lines += _activations_roundtrip(result)
    tao = result["peers"].get("torchao", {}).get("rows", [])
    if tao:
        lines += ["", "torchao `quantize_` (every linear but `lm_head`):", ""]
        lines += [h.table_head("| row | config | ppl | KL | top-1 | quantize s |")]
        for r in tao:
            lines.append(f"| {r['name']} | `{r.get('desc')}` | {_ppl_cell(r)} | {_f(r.get('kl'), '.4f')} | "
                         f"{_f(r.get('top1'), '.4f')} | {_f(r.get('calib_s'), '.1f')} |")  # fmt: skip
    errs = _errors(result)
    if errs:
        lines += ["", "Errors:", ""] + [f"- {e}" for e in errs]
    return "\n".join(lines)


def table(result: dict[str, Any]) -> str:
    return markdown(result)


def plot(result: dict[str, Any], path: str) -> None:
    base = result["baseline"]["ppl"]
    ref = _by_name(result["peers"].get("modelopt", {}).get("rows", []))
    names = [r["name"] for r in result["ours"]]
    series = {
        "ours": [_ppl(r) for r in result["ours"]],
        "reference (fake quant)": [_ppl(ref.get(n)) for n in names],
        "reference (exported)": [_ppl(ref.get(n), "exported") for n in names],
    }
    tao = result["peers"].get("torchao", {}).get("rows", [])
    fig, axes = h.pyplot().subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [3, 1]})
    ax = axes[0]
    width = 0.27
    for i, (label, vals) in enumerate(series.items()):
        xs = [j + (i - 1) * width for j in range(len(names))]
        ys = [100 * (v / base - 1) if v else 0.0 for v in vals]
        ax.bar(xs, ys, width, label=label)
    for j, n in enumerate(names):
        if ref.get(n, {}).get("error"):
            ax.text(j + 0.05, 0.05, "ref: error", rotation=90, fontsize=7, va="bottom", ha="center")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    ax.set_ylabel("test perplexity increase over unquantized (%)")
    ax.set_yscale("symlog", linthresh=1)
    ax.legend()
    ax.set_title(f"PTQ on {result['meta']['model']} (unquantized ppl {base:.3f})")
    ax = axes[1]
    ok = [r for r in tao if r.get("ppl")]
    ax.bar(range(len(ok)), [100 * (r["ppl"] / base - 1) for r in ok], color="tab:green")
    ax.set_xticks(range(len(ok)), [r["name"] for r in ok], rotation=45, ha="right")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_title("torchao quantize_ (CPU)")
    fig.suptitle(textwrap.fill(result["meta"]["command"], 230), fontsize=6)
    h.save_figure(fig, path)
