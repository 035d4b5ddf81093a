"""Pydantic models under the reference library's names: ``QuantizerAttributeConfig``, ``QuantizerCfgEntry``
and the calibration configs (``MaxCalibConfig``, ``AWQLiteCalibConfig``, ...).

They validate with ``extra="forbid"``, so a bad config raises ``pydantic.ValidationError`` (a ``ValueError``)
as in the reference. The checks themselves are ours: each model's validator calls the function the plain-dict
path uses (:func:`~.rules.quantizer_attributes`, :class:`~.rules.QuantRule`, the algorithm name check), so
both paths accept and reject the same things with the same messages. A feature we do not implement raises
:class:`~.rules.UnsupportedFeatureError` (a ``NotImplementedError`` that pydantic reports as a
``ValidationError``) naming what to use.

Every model is also a read-only mapping, like the reference's: ``cfg["num_bits"]`` reads any field, and
iterating (``dict(cfg)``) yields the fields that were given (plus ``method`` for calibration configs),
which is what :func:`mtq.quantize` and the calibration algorithms receive::

    mtq.quantize(model, {"quant_cfg": [...], "algorithm": mtq.AWQLiteCalibConfig(alpha_step=0.2)}, loop)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ...nn import QuantizerAttributes
from .rules import (
    ALGORITHMS,
    QuantizeConfig,
    QuantRule,
    experts_without_tokens,
    is_empty_cfg,
    quantizer_attributes,
)

__all__ = [
    "AWQClipCalibConfig",
    "AWQFullCalibConfig",
    "AWQLiteCalibConfig",
    "CompressConfig",
    "GPTQCalibConfig",
    "LSQConfig",
    "LayerwiseConfig",
    "LocalHessianCalibConfig",
    "MaxCalibConfig",
    "MseCalibConfig",
    "NVFP4ActHeadroomCalibConfig",
    "QuantizeAlgorithmConfig",
    "QuantizerAttributeConfig",
    "QuantizerCfgEntry",
    "RotateConfig",
    "SVDQuantConfig",
    "SmoothQuantCalibConfig",
]

_Fraction = Annotated[float | None, Field(gt=0.0, le=1.0)]
_Positive = Annotated[float | None, Field(gt=0.0)]


class _MappingModel(BaseModel, Mapping):  # type: ignore[misc]
    """A pydantic model that reads like a mapping of the fields that were given."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        # (extra="forbid" would reject these too, but without naming the allowed fields)
        unknown = sorted(set(data) - set(cls.model_fields)) if isinstance(data, Mapping) else []
        if unknown:
            raise ValueError(
                f"{cls.__name__}: unknown field(s) {unknown} (allowed: {sorted(cls.model_fields)})"
            )
        return data

    def _given(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)

    def __getitem__(self, key: str) -> Any:
        if key not in type(self).model_fields:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]
        return iter(self._given())

    def __len__(self) -> int:
        return len(self._given())

    def __contains__(self, key: object) -> bool:
        return key in self._given()


def _as_value_error(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run one of our checks; a ``TypeError`` becomes a ``ValueError`` so that pydantic reports it."""
    try:
        return fn(*args, **kwargs)
    except TypeError as err:
        raise ValueError(str(err)) from None


class QuantizerAttributeConfig(_MappingModel):
    """One quantizer's attributes, in the reference's vocabulary (our own names ``backward``,
    ``calibrator_options`` also accepted). :meth:`attributes` gives the validated
    :class:`~modelopt_lite.nn.QuantizerAttributes`."""

    enable: bool = True
    num_bits: Any = 8
    effective_bits: float | None = None
    axis: Any = None
    fake_quant: bool = True
    unsigned: bool = False
    narrow_range: bool = False
    learn_amax: bool = False
    type: Literal["static", "dynamic"] = "static"
    block_sizes: dict[Any, Any] | None = None
    bias: Any = None
    trt_high_precision_dtype: Literal["Float", "Half", "BFloat16"] = "Float"
    calibrator: Any = "max"  # a name, or a calibrator class with its arguments (checked by attributes())
    calibrator_options: dict[str, Any] = Field(default_factory=dict)
    rotate: Any = False
    pass_through_bwd: bool = True
    backward: Literal["pass_through", "clipped"] | None = None
    backend: str | None = None
    backend_extra_args: dict[str, Any] | None = None
    use_constant_amax: bool = False
    constant_amax: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _backward_names(cls, data: Any) -> Any:
        # our ``backward`` and the reference's ``pass_through_bwd`` say the same thing: keep them in agreement
        # so that ``QuantizerAttributeConfig(**cfg.model_dump())`` gives ``cfg`` back
        if isinstance(data, Mapping) and data.get("backward") in ("pass_through", "clipped"):
            if "pass_through_bwd" not in data:
                data = {**data, "pass_through_bwd": data["backward"] == "pass_through"}
        return data

    @model_validator(mode="after")
    def _check(self) -> QuantizerAttributeConfig:
        _as_value_error(self.attributes)
        return self

    def attributes(self) -> QuantizerAttributes:
        """The validated attributes (what ``TensorQuantizer.set_attributes`` takes)."""
        return quantizer_attributes(dict(self), self.enable, "QuantizerAttributeConfig")


class QuantizerCfgEntry(_MappingModel):
    """One ``quant_cfg`` rule: ``quantizer_name`` (a wildcard), optional ``parent_class``, ``cfg`` (attributes
    or a list of them for a sequential quantizer) and ``enable``.

    As in the reference, ``cfg`` is held as a :class:`QuantizerAttributeConfig` (a list of them for a
    sequential quantizer) and ``enable`` is always filled: the rule's own value, else the one its ``cfg``
    gives, else ``True``; the entry reads as a mapping of all four fields. An entry needs ``cfg``,
    ``enable`` or both; an empty ``cfg`` means none with ``enable=False`` and is refused otherwise (it
    would quantize with every default)."""

    quantizer_name: str
    parent_class: str | None = None
    cfg: QuantizerAttributeConfig | list[QuantizerAttributeConfig] | None = None
    enable: bool = True

    @model_validator(mode="before")
    @classmethod
    def _fill(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or isinstance(data, QuantizerCfgEntry):
            return data
        data = dict(data)
        name = data.get("quantizer_name")
        if "cfg" not in data and "enable" not in data:
            raise ValueError(
                f"quant_cfg entry {name!r}: must specify 'cfg', 'enable', or both (an entry with only "
                "quantizer_name does nothing; enable=True keeps the quantizer's attributes)"
            )
        cfg = data.get("cfg")
        if cfg is not None and is_empty_cfg(cfg):
            if data.get("enable") is not False:
                raise ValueError(
                    f"quant_cfg entry {name!r}: cfg is empty; it must specify at least one quantizer "
                    "attribute, or drop cfg and set enable (True keeps the quantizer's attributes, False "
                    "disables it)"
                )
            data["cfg"] = None
        elif data.get("enable") is None:
            data["enable"] = cfg.get("enable", True) if isinstance(cfg, Mapping) else True
        return data

    @model_validator(mode="after")
    def _check(self) -> QuantizerCfgEntry:
        _as_value_error(self.rule)
        return self

    def _given(self) -> dict[str, Any]:
        # an entry reads as complete, like the reference's: every field, set or not
        return self.model_dump()

    def rule(self) -> QuantRule:
        """The same rule as our :class:`~.rules.QuantRule`."""
        cfg = self.cfg
        if isinstance(cfg, (list, tuple)):
            cfg = tuple(dict(c) if isinstance(c, Mapping) else c for c in cfg)
        elif isinstance(cfg, Mapping):
            cfg = dict(cfg)
        return QuantRule(self.quantizer_name, cfg, self.enable, self.parent_class)


class LayerwiseConfig(_MappingModel):
    """The reference's layer-by-layer calibration switch. Any value builds (so configs that mention it can
    be read and written); calibrating with ``enable=True`` raises :class:`UnsupportedFeatureError` before
    the model is touched (:func:`~.rules.algorithm_step`)."""

    enable: bool = False
    get_qdq_activations_from_prev_layer: bool = False
    checkpoint_dir: str | None = None
    save_every: Annotated[int, Field(ge=1)] = 1
    calib_mutates_weights: bool = True


class RotateConfig(_MappingModel):
    """A quantizer's ``rotate`` setting: a normalized Hadamard transform of its input along the last
    dimension (in blocks of ``block_size``; ``rotate_back`` also rotates the output back)."""

    enable: bool = False
    mode: Literal["rotate", "rotate_back"] = "rotate"
    rotate_fp32: bool = False
    block_size: int | None = None


class CompressConfig(_MappingModel):
    """Arguments of the reference's ``mtq.compress`` (real low-bit weights); see :func:`mtq.compress`."""

    compress: dict[str, bool] = Field(default_factory=lambda: {"*": True})
    quant_gemm: bool = True


class QuantizeAlgorithmConfig(_MappingModel):
    """Base of the calibration configs: ``method`` names the algorithm. Iterating yields ``method`` and the
    options that were given, which is the ``{"method": ..., **options}`` dict :func:`mtq.calibrate` takes.
    ``moe_experts_without_tokens`` (ours, every algorithm): ``"warn"`` (default) or ``"raise"``, what
    calibration does with MoE experts that receive no tokens (see ``docs/moe.md``)."""

    method: Any = None
    moe_calib_experts_ratio: _Fraction = None
    layerwise: LayerwiseConfig | None = None
    moe_experts_without_tokens: Literal["warn", "raise"] = "warn"

    @field_validator("moe_experts_without_tokens", mode="before")
    @classmethod
    def _check_experts_without_tokens(cls, value: Any) -> Any:
        return experts_without_tokens(value)

    def _given(self) -> dict[str, Any]:
        return {"method": self.method, **super()._given()}

    @model_validator(mode="after")
    def _check_method(self) -> QuantizeAlgorithmConfig:
        if self.method is not None and self.method not in ALGORITHMS:
            raise ValueError(f"algorithm={self.method!r} is unknown (allowed: {list(ALGORITHMS)} or None)")
        return self

    def config(self, quant_cfg: Any) -> QuantizeConfig:
        """Our :class:`~.rules.QuantizeConfig` of ``quant_cfg`` calibrated with this algorithm (unsupported
        algorithms raise here, naming what to use)."""
        return QuantizeConfig.from_dict({"quant_cfg": quant_cfg, "algorithm": dict(self)})


class MaxCalibConfig(QuantizeAlgorithmConfig):
    """Max calibration: amax = the largest magnitude seen."""

    method: Literal["max"] = "max"
    distributed_sync: bool | None = True
    shared_states: dict[str, dict[str, list[str]]] | None = None
    sync_expert_weight_amax: bool = False
    skip_forward_without_activation_calib: bool = False


class MseCalibConfig(QuantizeAlgorithmConfig):
    """Max calibration, then a grid search of each weight amax that minimises the quantization MSE. The grid's
    defaults are this library's (0.5 to 1.0 in steps of 0.05); the reference's are 0.25 to 4.0 by 0.1."""

    method: Literal["mse"] = "mse"
    step_size: _Positive = 0.05
    start_multiplier: _Positive = 0.5
    stop_multiplier: _Positive = 1.0
    fp8_scale_sweep: bool | None = False
    distributed_sync: bool | None = True
    shared_states: dict[str, dict[str, list[str]]] | None = None


class LocalHessianCalibConfig(MseCalibConfig):
    """Max calibration, then the weight amax search of ``mse`` with each block's error weighted by the local
    Hessian ``X_b^T X_b`` of the layer's inputs
    (:mod:`~modelopt_lite.quantization.algorithms.local_hessian`). The defaults are the reference's."""

    method: Literal["local_hessian"] = "local_hessian"  # type: ignore[assignment]
    step_size: _Positive = 0.1
    start_multiplier: _Positive = 0.25
    stop_multiplier: _Positive = 4.0
    fp8_scale_sweep: bool | None = True
    block_size: Annotated[int | None, Field(gt=0)] = 16
    debug: bool | None = False


class SmoothQuantCalibConfig(QuantizeAlgorithmConfig):
    """SmoothQuant: migrate activation outliers into the weights with strength ``alpha``."""

    method: Literal["smoothquant"] = "smoothquant"
    alpha: Annotated[float | None, Field(ge=0.0, le=1.0)] = 1.0


class AWQLiteCalibConfig(QuantizeAlgorithmConfig):
    """AWQ-lite: search a per-channel pre-quantization scale with exponent grid step ``alpha_step``."""

    method: Literal["awq_lite"] = "awq_lite"
    alpha_step: _Fraction = 0.1
    group_scale: Literal["joint", "mean"] | None = "joint"
    group_loss: Literal["relative", "output", "regret"] | None = "output"
    debug: bool | None = False


class AWQClipCalibConfig(QuantizeAlgorithmConfig):
    """AWQ-clip: search each weight block's amax ratio on calibration inputs."""

    method: Literal["awq_clip"] = "awq_clip"
    max_co_batch_size: int | None = 1024
    max_tokens_per_batch: int | None = 64
    min_clip_ratio: Annotated[float | None, Field(gt=0.0, lt=1.0)] = 0.5
    shrink_step: _Fraction = 0.05
    debug: bool | None = False


class AWQFullCalibConfig(AWQClipCalibConfig):
    """AWQ-lite, then AWQ-clip."""

    method: Literal["awq_full"] = "awq_full"  # type: ignore[assignment]
    alpha_step: _Fraction = 0.1
    group_scale: Literal["joint", "mean"] | None = "joint"
    group_loss: Literal["relative", "output", "regret"] | None = "output"


class SVDQuantConfig(QuantizeAlgorithmConfig):
    """SVDQuant: AWQ-lite smoothing, then each linear layer keeps the top-``lowrank`` SVD components of its
    weight in a high-precision branch and quantizes the rest
    (:mod:`~modelopt_lite.quantization.algorithms.svdquant`); layers matching ``skip_layers`` are only
    max-calibrated."""

    method: Literal["svdquant"] = "svdquant"
    lowrank: int | None = 32
    skip_layers: list[str] | None = None


class GPTQCalibConfig(QuantizeAlgorithmConfig):
    """GPTQ: quantize weights column by column, compensating the error with the inputs' Hessian."""

    method: Literal["gptq"] = "gptq"
    perc_damp: _Fraction = 0.01
    block_size: int | None = 128
    fused: bool = False


class NVFP4ActHeadroomCalibConfig(QuantizeAlgorithmConfig):
    """The reference's NVFP4 activation headroom calibration; not implemented (quantizing with it raises)."""

    method: Literal["nvfp4_act_headroom"] = "nvfp4_act_headroom"
    anchor_percentile: Annotated[float, Field(gt=0.0, le=100.0)] = 1.0
    upper_percentile: Annotated[float, Field(gt=0.0, le=100.0)] = 99.99
    rho: Annotated[float, Field(gt=0.0, lt=28672.0)] = 16384.0
    weight_scale_algorithm: Any = None


class LSQConfig(QuantizeAlgorithmConfig):
    """The reference's LSQ calibration mode; here: ``learn_amax=True`` quantizer attributes with the QAT
    trainer (quantizing with this config raises, saying so)."""

    method: Literal["lsq"] = "lsq"
    learnable_amax: Any = ("post",)
    tied_amax: bool = False
    quantize_pre_scale: bool = True
    scale_algorithm: Any = None
