"""``mtq.auto_quantize``: a format per layer group under an effective-bits budget. The layer groups and their
quantizers per format (:mod:`.groups`), the scores (:mod:`.scores`), the exact solver (:mod:`.knapsack`) and
the entry point (:mod:`.searcher`). Sits above the ``mtq`` entry points (``model_quant``) and may import them,
``calibration``, ``insertion`` and ``config``; nothing in ``quantization`` but the facade imports it.
"""

from .groups import GROUPING_RULES, SEARCHABLE_ALGORITHMS, format_bits
from .knapsack import solve_assignment, solve_state
from .searcher import METHODS, auto_quantize, get_auto_quantize_config

__all__ = [
    "GROUPING_RULES",
    "METHODS",
    "SEARCHABLE_ALGORITHMS",
    "auto_quantize",
    "format_bits",
    "get_auto_quantize_config",
    "solve_assignment",
    "solve_state",
]
