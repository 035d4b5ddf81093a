"""The exact solver of :func:`~modelopt_lite.quantization.auto_quantize`: one choice per group minimising the
summed score under a cost budget (a multiple-choice knapsack), by dynamic programming over integer costs;
and :func:`solve_state`, that solver applied to a search state's candidates at an effective-bits budget."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["solve_assignment", "solve_state"]

_MAX_CAPACITY = 1 << 18  # integer cost steps of the dynamic program (beyond: costs rounded up)


def solve_assignment(
    costs: Sequence[Sequence[float]], scores: Sequence[Sequence[float]], budget: float
) -> tuple[list[int], bool] | None:
    """One choice per group minimising the summed score with the summed cost at most ``budget``: a
    multiple-choice knapsack, solved by dynamic programming over integer costs. Costs are made integers
    exactly (their common denominator, then their greatest common divisor); when that needs more than 2**18
    steps they are rounded up to ``budget / 2**18`` (the answer then stays within the budget and is optimal
    among the assignments whose rounded cost fits). Returns ``(choices, exact)``, or ``None`` when nothing
    fits."""
    fractions = [[Fraction(c) for c in row] for row in costs]
    denominator = math.lcm(*(c.denominator for row in fractions for c in row))
    ints = [[int(c * denominator) for c in row] for row in fractions]
    capacity = math.floor(Fraction(budget) * denominator)  # every total cost is a multiple of 1 / denominator
    if capacity < 0:
        return None
    step = math.gcd(capacity, *(c for row in ints for c in row)) or 1
    exact = capacity // step <= _MAX_CAPACITY
    if exact:
        weights, capacity = [[c // step for c in row] for row in ints], capacity // step
    else:
        unit = Fraction(capacity, _MAX_CAPACITY)
        weights = [[math.ceil(c / unit) for c in row] for row in ints]
        capacity = _MAX_CAPACITY
    best = np.zeros(capacity + 1)  # best[c]: least score of the groups so far with cost <= c
    picks = np.zeros((len(weights), capacity + 1), dtype=np.int16)
    for g, (row, score_row) in enumerate(zip(weights, scores, strict=True)):
        new = np.full(capacity + 1, np.inf)
        for j, (w, s) in enumerate(zip(row, score_row, strict=True)):
            if w > capacity:
                continue
            candidate = np.full(capacity + 1, np.inf)
            candidate[w:] = best[: capacity + 1 - w] + float(s)
            better = candidate < new
            new[better] = candidate[better]
            picks[g, better] = j
        best = new
    if not np.isfinite(best[capacity]):
        return None
    choice, c = [0] * len(weights), capacity
    for g in range(len(weights) - 1, -1, -1):
        choice[g] = int(picks[g, c])
        c -= weights[g][choice[g]]
    return choice, exact


def solve_state(state: Mapping[str, Any], effective_bits: float) -> dict[str, Any]:
    """The search state's ``best`` entry for ``effective_bits``: each group's format (``recipe``), the bits
    and summed score reached, and whether the solve was exact. Raises with the reachable range when the
    budget is out of reach."""
    stats = state["candidate_stats"]
    total = state["cost_denominator"]
    names = list(stats)
    solved = solve_assignment(
        [stats[n]["costs"] for n in names], [stats[n]["scores"] for n in names], total * effective_bits / 16
    )
    if solved is None:
        low = sum(min(stats[n]["costs"]) for n in names) / total * 16
        raise ValueError(
            f"effective_bits={effective_bits} is out of reach: the reachable range is [{low:.4f}, 16.0]"
        )
    choice, exact = solved
    cost = sum(stats[n]["costs"][j] for n, j in zip(names, choice, strict=True))
    return {
        "recipe": {n: stats[n]["formats"][j] for n, j in zip(names, choice, strict=True)},
        "constraints": {"effective_bits": cost / total * 16},
        "score": sum(stats[n]["scores"][j] for n, j in zip(names, choice, strict=True)),
        "is_satisfied": True,
        "exact": exact,
    }
