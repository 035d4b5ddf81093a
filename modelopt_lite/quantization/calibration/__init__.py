"""Calibration, the machinery every algorithm builds on: the algorithm registry and ``calibrate``
(:mod:`.calibrate`), max calibration (:mod:`.max_calib`), the forward loop, the linear maps algorithms work on
(:mod:`.targets`), the layer-by-layer driver (:mod:`.layerwise`), MoE experts that got no tokens
(:mod:`.idle_experts`) and the search helpers (:mod:`.search`). Imports only ``quantization.config`` and the
floors below ``quantization``.
"""

from .calibrate import ForwardLoop, calibrate, check_calibrated, register_algorithm, run_forward_loop
from .max_calib import max_calibrate  # (registers "max", which calibrate() always has)

__all__ = [
    "ForwardLoop",
    "calibrate",
    "check_calibrated",
    "max_calibrate",
    "register_algorithm",
    "run_forward_loop",
]
