"""What ``--qformat`` / ``--kv_cache_qformat`` of the PTQ command line (:mod:`.ptq`) mean: the format names,
the quantize config they build, and the candidates of ``--auto_quantize_bits``."""

from __future__ import annotations

import copy
from typing import Any

from .. import quantization as mtq
from ..quantization.auto_quantize import SEARCHABLE_ALGORITHMS
from ..quantization.config.presets import STANDARD_EXCLUSIONS

__all__ = ["KV_FORMATS", "NOT_EXPORTABLE", "QFORMATS", "auto_quantize_formats", "build_config"]

QFORMATS = {
    "fp8": "FP8_DEFAULT_CFG",
    "fp8_pc_pt": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "int8": "INT8_DEFAULT_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int8_wo": "INT8_WEIGHT_ONLY_CFG",
    "int4_awq": "INT4_AWQ_CFG",
    "w4a8_awq": "W4A8_AWQ_BETA_CFG",
    "nvfp4": "NVFP4_DEFAULT_CFG",
    "nvfp4_awq": "NVFP4_AWQ_LITE_CFG",
    "w4a16_nvfp4": "W4A16_NVFP4_CFG",
    "mxfp8": "MXFP8_DEFAULT_CFG",
    "mxfp4": "MXFP4_DEFAULT_CFG",
}
NOT_EXPORTABLE = {"mxfp4"}  # no deployable tensor layout in the export (yet)
#: ``--kv_cache_qformat`` names (the reference's ``hf_ptq`` choices) -> KV preset. ``*_affine``: a static
#: bias per KV head and channel is subtracted before quantizing (keys with a large, nearly constant offset,
#: as Qwen2's k_proj bias gives, keep their token-dependent part); ``nvfp4_rotate``: keys Hadamard-rotated.
KV_FORMATS = {
    "none": None,
    "fp8": "FP8_KV_CFG",
    "fp8_affine": "FP8_AFFINE_KV_CFG",
    "nvfp4": "NVFP4_KV_CFG",
    "nvfp4_affine": "NVFP4_AFFINE_KV_CFG",
    "nvfp4_rotate": "NVFP4_KV_ROTATE_CFG",
}


def _algorithm_name(cfg: dict[str, Any]) -> str:
    algo = cfg.get("algorithm")
    return "max" if algo is None else algo if isinstance(algo, str) else algo["method"]


def build_config(qformat: str, kv_cache_qformat: str = "none") -> dict[str, Any]:
    """The quantize config for ``--qformat`` (one name or ``attention,mlp``) and ``--kv_cache_qformat``."""
    names = [q.strip() for q in qformat.split(",")]
    unknown = [q for q in names if q not in QFORMATS]
    if unknown or not 1 <= len(names) <= 2:
        raise ValueError(
            f"--qformat {qformat!r}: expected one format or two separated by a comma (attention,mlp) from "
            f"{sorted(QFORMATS)}"
        )
    if kv_cache_qformat not in KV_FORMATS:
        raise ValueError(f"--kv_cache_qformat {kv_cache_qformat!r}: choose one of {sorted(KV_FORMATS)}")
    cfg = mtq.get_preset(QFORMATS[names[0]])
    if len(names) == 2:
        mlp = mtq.get_preset(QFORMATS[names[1]])
        algos = {_algorithm_name(cfg), _algorithm_name(mlp)}
        if len(algos - {"max"}) > 1:
            raise ValueError(
                f"--qformat {qformat!r}: {names[0]} calibrates with {_algorithm_name(cfg)} and {names[1]} "
                f"with {_algorithm_name(mlp)}; a mixed recipe needs one algorithm (or plain max on one side)"
            )
        rules = [copy.deepcopy(r) for r in mlp["quant_cfg"] if r.get("quantizer_name") in
                 ("*weight_quantizer", "*input_quantizer")]  # fmt: skip
        for rule in rules:
            rule["quantizer_name"] = "*mlp*" + rule["quantizer_name"].lstrip("*")
        cfg["quant_cfg"] += rules + copy.deepcopy(list(STANDARD_EXCLUSIONS))
        cfg["algorithm"] = cfg["algorithm"] if _algorithm_name(cfg) != "max" else mlp["algorithm"] or "max"
    if KV_FORMATS[kv_cache_qformat] is not None:
        cfg = mtq.with_kv_cache(cfg, KV_FORMATS[kv_cache_qformat])
    return cfg


def auto_quantize_formats(qformat: str) -> list[str]:
    """The candidate presets of ``--qformat a,b,...`` for ``--auto_quantize_bits``."""
    names = [q.strip() for q in qformat.split(",")]
    unknown = [q for q in names if q not in QFORMATS]
    if unknown:
        raise ValueError(
            f"--qformat {qformat!r}: with --auto_quantize_bits, a comma list of candidates from "
            f"{sorted(QFORMATS)}"
        )
    for name in names:
        algorithm = _algorithm_name(mtq.get_preset(QFORMATS[name]))
        if algorithm not in SEARCHABLE_ALGORITHMS:
            raise ValueError(
                f"--qformat {name}: calibrates with {algorithm}, which changes the weights; the search "
                f"takes formats calibrated with {' / '.join(SEARCHABLE_ALGORITHMS)}"
            )
    return [QFORMATS[q] for q in names]
