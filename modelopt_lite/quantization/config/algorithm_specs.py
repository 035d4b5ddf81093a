"""The calibration algorithm part of a config: the algorithm names a config may give (and those of the
reference that this library leaves out, with what to use instead), the options every algorithm takes, and
how one algorithm spec (a name, ``{"method": ..., **options}`` or ``None``) reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...nn.errors import UnsupportedFeatureError

__all__ = [
    "ALGORITHMS",
    "EXPERTS_WITHOUT_TOKENS",
    "EXPERTS_WITHOUT_TOKENS_CHOICES",
    "LAYERWISE_UNSUPPORTED",
    "UNSUPPORTED_ALGORITHMS",
    "algorithm_step",
    "experts_without_tokens",
]

#: The reference's calibration algorithms that this library does not implement, with what to use instead.
UNSUPPORTED_ALGORITHMS = {
    "nvfp4_act_headroom": "NVFP4 activation headroom calibration is not implemented; use 'max'",
    "lsq": "use learn_amax=True in the quantizer attributes (LSQ gradients) with the QAT trainer",
}
#: Calibration algorithms a config may name (``None`` means: no calibration); the last ones are names of the
#: reference that raise :class:`UnsupportedFeatureError` naming the alternative.
ALGORITHMS = (
    "max",
    "smoothquant",
    "awq_lite",
    "awq_clip",
    "awq_full",
    "gptq",
    "mse",
    "local_hessian",
    "svdquant",
    *UNSUPPORTED_ALGORITHMS,
)
#: The option every calibration algorithm takes (``{"method": ..., "moe_experts_without_tokens": ...}``) that
#: says what happens to MoE experts that receive no calibration tokens: ``"warn"`` (the default) gives their
#: activation quantizers the amax of the other experts of their layer and names them in a WARNING;
#: ``"raise"`` makes that an error.
EXPERTS_WITHOUT_TOKENS = "moe_experts_without_tokens"
EXPERTS_WITHOUT_TOKENS_CHOICES = ("warn", "raise")


def experts_without_tokens(value: Any) -> str:
    """``value`` if it is one of :data:`EXPERTS_WITHOUT_TOKENS_CHOICES`; else ``ValueError`` naming them."""
    if not isinstance(value, str) or value not in EXPERTS_WITHOUT_TOKENS_CHOICES:
        raise ValueError(
            f"{EXPERTS_WITHOUT_TOKENS}={value!r} (allowed: {list(EXPERTS_WITHOUT_TOKENS_CHOICES)}: 'warn' "
            "gives the activation quantizers of MoE experts that received no calibration tokens the amax of "
            "the other experts of their layer, with a WARNING; 'raise' makes that an error)"
        )
    return value


#: What a config asking for the reference's layer-by-layer calibration (``layerwise={"enable": True}``) hears.
LAYERWISE_UNSUPPORTED = (
    "layerwise calibration (one decoder layer at a time, layerwise={'enable': True}) is not implemented; "
    "drop 'layerwise' to calibrate the whole model (our search algorithms already process one transformer "
    "block at a time)"
)


def _without_layerwise(name: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` less the reference's ``layerwise`` switch: off is dropped, on raises."""
    layerwise = options.pop("layerwise", None)
    enabled = layerwise.get("enable", False) if isinstance(layerwise, Mapping) else layerwise
    if enabled:
        raise UnsupportedFeatureError(f"algorithm={name!r}: {LAYERWISE_UNSUPPORTED}")
    return options


def algorithm_step(algorithm: Any) -> tuple[str | None, dict[str, Any]]:
    """``(name, options)`` of one algorithm spec (a name, ``{"method": ..., **options}`` or ``None``); a spec
    of another type raises ``TypeError``, a dict without ``"method"`` ``ValueError``. The reference's
    ``layerwise`` option is dropped when off and raises :class:`UnsupportedFeatureError` when on."""
    if isinstance(algorithm, Mapping):
        if "method" not in algorithm:
            raise ValueError(
                f"algorithm={dict(algorithm)!r} needs a 'method' key (one of {list(ALGORITHMS)})"
            )
        options = {k: v for k, v in algorithm.items() if k != "method"}
        return algorithm["method"], _without_layerwise(algorithm["method"], options)
    if algorithm is not None and not isinstance(algorithm, str):
        raise TypeError(
            f"algorithm must be a name, a dict with 'method', None, or a list of these; got {algorithm!r}"
        )
    return algorithm, {}
