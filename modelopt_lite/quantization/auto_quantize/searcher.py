"""``mtq.auto_quantize``: a format per layer group, chosen on data under an effective-bits budget.

The search follows the reference library's (``modelopt.torch.quantization.auto_quantize``):

1. **Groups.** Every quantized module with weights is a unit (a fused-experts module gives one unit per
   projection, over all its experts). Units that engines fuse share one format: ``q_proj`` / ``k_proj`` /
   ``v_proj`` of a layer, ``gate_proj`` / ``up_proj``, and the per-expert linears of one MoE block. Units
   matching ``disabled_layers`` stay unquantized and still count (at 16 bits) in the budget.
2. **Calibration.** For each candidate format, every unit gets that format's quantizers (its rules resolved
   on the unit's own quantizer names, as the reference does, so model-level patterns such as ``*lm_head*``
   do not apply) and the model is calibrated with the format's algorithm, as ``mtq.quantize``
   would. The calibrated quantizers of each format are kept aside; switching a unit between formats swaps
   its quantizer objects in place (no copy of the model, of its weights, per format).
3. **Scores**, per group and format, with every other group unquantized:

   * ``"gradient"``: the second-order (Fisher) estimate of the loss change, summed over the score batches
     and the group's outputs: ``sum((dL/dY * (Y_q - Y))**2)``, ``Y`` the output of the module where the
     group is measured (the layer itself; for a fused-experts projection, the experts module);
   * ``"kl_div"``: ``KL(p || p_q)`` summed over the tokens of the score batches, ``p`` the model's output
     distribution unquantized, ``p_q`` with only this group quantized.

   As in the reference, a wider format's score is capped by the narrower one's and "unquantized" scores 0.
4. **Solver.** The assignment minimising the summed score with ``sum(numel * bits) / sum(numel)`` at most
   the budget, a multiple-choice knapsack solved exactly by dynamic programming over integer costs
   (:func:`solve_assignment`). Bits per format are counted as the reference counts them: the format's
   ``effective_bits`` (NVFP4: 4.5), else ``num_bits`` (FP8 E4M3: 8, INT4: 4); unquantized is 16. The KV
   cache is not searched and not counted (quantize it afterwards, as the reference's ``hf_ptq`` does).

The result is an ordinary quantized model (its config is the one :func:`get_auto_quantize_config` returns;
``mto.save`` / ``restore`` and export treat it like any other), and a JSON-serialisable search state.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ...distributed import all_reduce_sum, check_same_on_all_ranks, is_distributed, is_sharded
from ...logging import get_logger
from ...nn import QuantModule, iter_quantizers
from ...nn.errors import UnsupportedFeatureError
from .. import model_quant
from ..calibration.calibrate import calibrate
from ..config import QuantizeConfig
from ..insertion import (
    Provenance,
    insert_quantizers,
    match_name,
    remove_quantizers,
    snapshot_implementations,
)
from .groups import GROUPING_RULES as GROUPING_RULES
from .groups import (
    NONE,
    _check_sharded_formats,
    _entries,
    _Format,
    _Group,
    _groups,
    _install,
    _make_quantizers,
    _resolve_formats,
    _units,
)
from .groups import SEARCHABLE_ALGORITHMS as SEARCHABLE_ALGORITHMS
from .groups import format_bits as format_bits
from .knapsack import solve_assignment, solve_state
from .scores import _activation_grads, _default_step, _gradient_scores, _kl_scores

__all__ = ["auto_quantize", "get_auto_quantize_config", "solve_assignment"]
# (GROUPING_RULES, SEARCHABLE_ALGORITHMS and format_bits: importable from here, as before the split)

logger = get_logger(__name__)

METHODS = ("gradient", "kl_div")


# ------------------------------------------------------------------------------------------------ checks
def _check_inputs(
    data_loader: Any,
    forward_step: Any,
    loss_func: Any,
    forward_backward_step: Any,
    method: str,
    constraints: Any,
) -> float:
    if method not in METHODS:
        raise ValueError(f"method={method!r}: use 'gradient' or 'kl_div'")
    if not isinstance(constraints, Mapping) or "effective_bits" not in constraints:
        raise ValueError("constraints must be a dict with 'effective_bits', e.g. {'effective_bits': 6.0}")
    extra = sorted(set(constraints) - {"effective_bits", "cost_model"})
    if extra or constraints.get("cost_model", "weight") != "weight":
        raise UnsupportedFeatureError(
            f"constraints {extra or ['cost_model']}: only 'effective_bits' (counted on the weights, "
            "cost_model 'weight') is supported"
        )
    bits = constraints["effective_bits"]
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not math.isfinite(bits):
        raise TypeError(f"constraints['effective_bits'] must be a number, got {bits!r}")
    if data_loader is None or (hasattr(data_loader, "__len__") and len(data_loader) == 0):
        raise ValueError(
            "auto_quantize needs data: pass data_loader (batches for calibration and scoring) and "
            "forward_step(model, batch)"
        )
    if iter(data_loader) is data_loader:
        raise TypeError(
            "data_loader is an iterator that can be read only once; auto_quantize reads it once per format "
            "and once for the scores: pass a list of batches or a DataLoader"
        )
    if not callable(forward_step):
        raise ValueError("auto_quantize needs forward_step(model, batch) (it returns the model output)")
    if method == "gradient" and loss_func is None and forward_backward_step is None:
        raise ValueError(
            "method='gradient' needs loss_func(output, batch) -> scalar loss or forward_backward_step(model, "
            "batch); without a loss, use method='kl_div' (forward_step returning the logits)"
        )
    return float(bits)


def _probe_loss(model: nn.Module, forward_step: Callable, loss_func: Callable, batch: Any) -> None:
    """One forward on the first batch: the loss must be a scalar with a gradient."""
    with _activation_grads(model):
        loss = loss_func(forward_step(model, batch), batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_func must return a scalar tensor (loss.backward() is called on it); got {shape}. Reduce "
            "it (e.g. .mean()), or use method='kl_div', which needs no loss"
        )
    if not loss.requires_grad:
        raise ValueError(
            "method='gradient': the loss has no gradient (forward_step under torch.no_grad / inference_mode, "
            "or a model without trainable floating-point parameters); use method='kl_div', which needs only "
            "forward passes"
        )


def _bits_range(groups: list[_Group]) -> tuple[float, float]:
    total = sum(g.numel for g in groups)
    low = sum(g.numel * g.formats[0].bits for g in groups) / total
    return low, 16.0


# ------------------------------------------------------------------------------------------------ search
def auto_quantize(
    model: nn.Module,
    constraints: dict[str, Any] | None = None,
    quantization_formats: list[dict[str, Any] | str | None] | None = None,
    data_loader: Iterable[Any] | None = None,
    forward_step: Callable[[nn.Module, Any], Any] | None = None,
    loss_func: Callable[[Any, Any], torch.Tensor] | None = None,
    forward_backward_step: Callable[[nn.Module, Any], Any] | None = None,
    disabled_layers: list[str] | str | None = None,
    num_calib_steps: int = 512,
    num_score_steps: int = 128,
    verbose: bool = False,
    method: str = "gradient",
    checkpoint: str | None = None,
    module_search_spaces: list[dict[str, Any]] | None = None,
    fixed_quantization_config: dict[str, Any] | str | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Quantize ``model`` (in place) with a format per layer group chosen under an effective-bits budget;
    returns ``(model, search_state)``. See the module docstring for the method.

    Args:
        model: an unquantized model.
        constraints: ``{"effective_bits": b}``: the weight bits per parameter of the searched layers
            (unquantized ones count 16); default 4.8 as in the reference.
        quantization_formats: candidates, by preset name, recipe name / path or config dict (calibrated with
            ``max``, ``mse`` or ``local_hessian``); "unquantized" is always a candidate (``None`` in the list
            is accepted and means it). Default ``["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"]``.
        data_loader: a re-iterable of batches (list, DataLoader): the first ``num_calib_steps`` calibrate
            each format, the first ``num_score_steps`` score them.
        forward_step: ``forward_step(model, batch)`` returns the model output (the logits for ``kl_div``).
        loss_func: ``loss_func(output, batch)`` returns the scalar loss (``gradient``).
        forward_backward_step: instead of ``loss_func``: runs forward and ``backward`` itself.
        disabled_layers: patterns (fnmatch) of layers kept unquantized, on module names (or quantizer names).
        num_calib_steps, num_score_steps: batches for calibration and for the scores.
        verbose: log the chosen format of every group (INFO); otherwise DEBUG.
        method: ``"gradient"`` (Fisher estimate of the loss change) or ``"kl_div"``.
        checkpoint, module_search_spaces, fixed_quantization_config: the reference's extensions; not
            supported here (they raise).

    Under ``torch.distributed`` call it on every rank before ``fully_shard``, each rank with its share of
    the batches: calibration merges across ranks and the scores are summed over them, so every rank picks
    the same formats. On an FSDP2-sharded model the same holds (formats calibrated with ``max`` only).

    The search state holds, per group (``candidate_stats``), its formats, scores, costs (``numel * bits /
    16``) and the config entries of each format, and the choice (``best``); it is plain JSON data.
    """
    for name, value in (
        ("checkpoint", checkpoint),
        ("module_search_spaces", module_search_spaces),
        ("fixed_quantization_config", fixed_quantization_config),
    ):
        if value is not None:
            raise UnsupportedFeatureError(f"auto_quantize({name}=...) is not supported; leave it None")
    effective_bits = _check_inputs(
        data_loader,
        forward_step,
        loss_func,
        forward_backward_step,
        method,
        constraints or {"effective_bits": 4.8},
    )
    formats = _resolve_formats(quantization_formats or ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"])
    if is_distributed() and is_sharded(model):
        _check_sharded_formats(formats)
    patterns = [disabled_layers] if isinstance(disabled_layers, str) else list(disabled_layers or [])
    if model_quant.quant_state(model) is not None or any(isinstance(m, QuantModule) for m in model.modules()):
        raise ValueError("auto_quantize needs an unquantized model (this one already has quantizers)")
    implementations = snapshot_implementations(model)
    try:
        insert_quantizers(model)
        for _, q in iter_quantizers(model):
            q.disable()
        groups = _groups(_units(model), formats, patterns)
        if not groups:
            raise ValueError(f"{type(model).__name__} has no quantizable layer with weights to search")
        if is_distributed():
            check_same_on_all_ranks(
                [[g.name for g in groups], [f.name for f in formats], effective_bits, method],
                "auto_quantize's layer groups, formats, budget and method",
            )
        low, high = _bits_range(groups)
        if not low - 1e-9 <= effective_bits <= high:
            raise ValueError(
                f"effective_bits={effective_bits} is out of reach: with these formats and disabled layers "
                f"the reachable range is [{low:.4f}, {high:.1f}] bits"
            )
        if method == "gradient" and loss_func is not None:
            _probe_loss(model, forward_step, loss_func, next(iter(data_loader)))
        state = _search(
            model, groups, formats, effective_bits, data_loader, forward_step, loss_func,
            forward_backward_step, method, num_calib_steps, num_score_steps, verbose, patterns,
        )  # fmt: skip
    except BaseException:
        remove_quantizers(model, implementations)
        raise
    for hook in model_quant._POST_QUANTIZE_HOOKS:
        hook(model)
    return model, state


def _search(
    model: nn.Module,
    groups: list[_Group],
    formats: list[_Format],
    effective_bits: float,
    data_loader: Iterable[Any],
    forward_step: Callable,
    loss_func: Callable | None,
    forward_backward_step: Callable | None,
    method: str,
    num_calib_steps: int,
    num_score_steps: int,
    verbose: bool,
    disabled_layers: list[str],
) -> dict[str, Any]:
    units = [u for g in groups for u in g.units]
    entries = {u.name: {f.name: _entries(u, f) for f in formats} for u in units}
    bank: dict[str, dict[str, dict[str, Any]]] = {u.name: {} for u in units}

    def forward_loop(m: nn.Module) -> None:
        for batch in itertools.islice(data_loader, num_calib_steps):
            forward_step(m, batch)

    for fmt in formats[:-1]:  # calibrate every unit in this format, as mtq.quantize would
        searched = [u for g in groups if not g.disabled for u in g.units]
        for unit in searched:
            _install(unit, _make_quantizers(unit, entries[unit.name][fmt.name]))
        logger.info("auto_quantize: calibrating %s (%s)", fmt.name, fmt.config.algorithm_name)
        calibrate(model, fmt.config.algorithm, forward_loop)
        for unit in searched:
            bank[unit.name][fmt.name] = {s: unit.module.get_submodule(s) for s in unit.slots}
    for unit in units:
        bank[unit.name][NONE] = _make_quantizers(unit, [])
        _install(unit, bank[unit.name][NONE])

    batches = list(itertools.islice(data_loader, num_score_steps))
    training = [(m, m.training) for m in model.modules()]
    model.eval()
    logger.info("auto_quantize: scoring %d group(s) x %d format(s) on %d batch(es) (%s)",
                sum(not g.disabled for g in groups), len(formats) - 1, len(batches), method)  # fmt: skip
    if method == "gradient":
        step = forward_backward_step or _default_step(forward_step, loss_func)
        raw = _gradient_scores(model, groups, bank, step, batches)
    else:
        raw = _kl_scores(model, groups, bank, forward_step, batches)
    for module, mode in training:
        module.training = mode
    if is_distributed():  # each rank scored its own batches: the scores add up over the ranks
        raw = all_reduce_sum(torch.from_numpy(raw)).numpy()

    stats: dict[str, dict[str, Any]] = {}
    for g, group in enumerate(groups):
        capped = []
        for k, fmt in enumerate(group.formats):
            score = 0.0 if fmt.config is None else float(raw[g, k])
            capped.append(min(score, capped[-1]) if capped else score)
        stats[group.name] = {
            "formats": [f.name for f in group.formats],
            "scores": capped,
            "costs": [group.numel * f.bits / 16 for f in group.formats],
            "module_names": [u.name for u in group.units],
            "disabled": group.disabled,
            "quant_cfg": {
                f.name: [e for u in group.units for e in entries[u.name][f.name]] for f in group.formats
            },
        }
    state: dict[str, Any] = {
        "method": method,
        "cost_model": "weight",
        "quantization_formats": {f.name: f.config.to_dict() for f in formats if f.config is not None},
        "disabled_layers": disabled_layers,
        "cost_denominator": sum(g.numel for g in groups),
        "candidate_stats": stats,
    }
    state["best"] = solve_state(state, effective_bits)
    chosen = state["best"]["recipe"]
    provenance = Provenance()
    config = get_auto_quantize_config(state)
    index = {e["quantizer_name"]: i for i, e in enumerate(config["quant_cfg"])}
    for group in groups:
        fmt, score = chosen[group.name], _chosen_score(stats[group.name], chosen[group.name])
        for unit in group.units:
            _install(unit, bank[unit.name][fmt])
            for slot in unit.slots:
                rule = f"{unit.module_name}.{match_name(slot)}"
                what = f"auto_quantize {fmt} (score {score:.3g}): {rule}"
                provenance.rules[f"{unit.module_name}.{slot}"] = [(index.get(rule, 0), what)]
    bank.clear()
    model_quant.set_quant_state(model, model_quant.QuantState(QuantizeConfig.from_dict(config), provenance))
    _log_choice(state, verbose)
    return state


def _chosen_score(stat: Mapping[str, Any], fmt: str) -> float:
    return stat["scores"][stat["formats"].index(fmt)]


def _log_choice(state: Mapping[str, Any], verbose: bool) -> None:
    best = state["best"]
    log = logger.info if verbose else logger.debug
    for name, fmt in best["recipe"].items():
        log("auto_quantize: %s -> %s", name.removesuffix(".quant_recipe"), fmt)
    counts: dict[str, int] = {}
    for fmt in best["recipe"].values():
        counts[fmt] = counts.get(fmt, 0) + 1
    logger.info(
        "auto_quantize: %.3f effective bits, score %.4g; groups per format: %s",
        best["constraints"]["effective_bits"],
        best["score"],
        ", ".join(f"{k} {v}" for k, v in counts.items()),
    )


def get_auto_quantize_config(
    search_state: Mapping[str, Any], constraints: Mapping[str, Any] | None = None, verbose: bool = False
) -> dict[str, Any]:
    """The config (list form) that ``mtq.quantize`` applies to reproduce the assignment of
    ``search_state``; with ``constraints`` (``{"effective_bits": b}``), the assignment solved again for that
    budget from the stored scores (no calibration, no scoring). Everything is disabled first, then each
    quantized layer gets its format's rules under its own name. The algorithm is the chosen formats' own
    when they share one, else ``max`` (logged)."""
    if not isinstance(search_state, Mapping) or "candidate_stats" not in search_state:
        raise TypeError("search_state must be the state returned by mtq.auto_quantize")
    best = search_state["best"]
    if constraints is not None:
        best = solve_state(search_state, float(constraints["effective_bits"]))
        _log_choice({**search_state, "best": best}, verbose)
    quant_cfg: list[dict[str, Any]] = [{"quantizer_name": "*", "enable": False}]
    for name, fmt in best["recipe"].items():
        quant_cfg += search_state["candidate_stats"][name]["quant_cfg"][fmt]
    formats = search_state["quantization_formats"]
    algorithms = {
        repr(formats[f]["algorithm"]): formats[f]["algorithm"] for f in best["recipe"].values() if f != NONE
    }
    algorithm = next(iter(algorithms.values())) if len(algorithms) == 1 else "max"
    if len(algorithms) > 1:
        logger.warning("auto_quantize: the chosen formats calibrate differently; the config uses 'max'")
    return {"quant_cfg": quant_cfg, "algorithm": algorithm}
