"""Loading an exported checkpoint back into transformers, dequantized to a floating dtype.

``import modelopt_lite.export`` registers ``quant_method: "modelopt"`` with transformers' public registration
API (``register_quantization_config`` / ``register_quantizer``), so ``AutoModelForCausalLM.from_pretrained
(export_dir)`` works. By default the quantizer dequantizes: each layer's stored tensors (``weight``, its
scales, an unfolded ``pre_quant_scale``) become one dense weight in the loading op that transformers runs
before its own conversions (so per-expert tensors are dequantized before they are merged into fused experts).
``input_scale`` / ``k_scale`` / ``v_scale`` (and an affine KV cache's ``k_bias`` / ``v_bias``) are dropped:
the loaded model computes with dense activations, unless ``activations="fake"`` in the quantization config
(:func:`load_hf_checkpoint` ``activations="fake"``): then every quantized layer's input and the KV cache are
fake-quantized as the format prescribes, from those stored scales, with either load (:mod:`.activations`;
a ``pre_quant_scale`` is then not folded into the weight but applied by the input quantizer).

With ``dequantize=False`` in the quantization config (transformers' name for this loading option;
:func:`load_hf_checkpoint` ``compress=True`` sets it) the linear layers keep the stored tensors packed: each
becomes the compressed layer of ``mtq.compress`` (:func:`~modelopt_lite.quantization.compress.packed_linear`),
which dequantizes its weight on the fly in each forward and computes what the dequantized load computes
(bit for bit, a ``pre_quant_scale`` aside: it scales the input instead of the weight's columns). With
``int8_gemm=True`` (``None``: where it is fast) W8A8 layers run torchao's int8 GEMM instead, quantizing
activations with the stored ``input_scale`` as an engine does (outputs then differ from the dequantized load
by that activation quantization). Fused MoE experts written per expert (``...experts.{i}.gate_proj`` /
``up_proj`` / ``down_proj``) become the compressed experts of ``mtq.compress``
(:func:`~modelopt_lite.quantization.compress.packed_experts`): each projection's per-expert tensors are
merged as the model fuses them (gate and up rows concatenated, or interleaved for GPT-OSS; every expert
stays packed ``(out, in)``), never materialising the full-precision 3-D weight, and the forward gives the
dequantized load's outputs bit for bit. A projection whose experts cannot be merged packed (an unfolded
``pre_quant_scale``, formats or block sizes that differ between experts, gate and up halves with different
per-tensor scales) loads dequantized: one INFO line per format names every quantized weight that loads in
full precision.

:func:`load_hf_checkpoint` adds the checks of ``hf_quant_config.json`` (missing or malformed: a clear error).

This module holds the transformers quantizer, its registration and :func:`load_hf_checkpoint`; the
quantization config is in :mod:`.config`, the dequantized load in :mod:`.dequantize`, the compressed
load (``dequantize=False``) in :mod:`.packed`, the activation quantization in :mod:`.activations`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.core_model_loading import (
    Concatenate,
    ConversionOps,
    Interleave,
    MergeModulelist,
    Transpose,
    WeightConverter,
)
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer

from ...logging import get_logger
from ...quantization.compress import (
    KERNELS,
    CompressedExperts,
    CompressedLinear,
    compressed_layers,
    fast_int8_gemm,
    require_torchao,
    use_int8_gemm,
)
from ...quantization.compress.packers import PACKERS
from ..hf_config import QUANT_METHOD, validate_hf_quant_config
from .activations import ACTIVATIONS, plan_activations, quantize_activations
from .config import ModeloptExportConfig
from .dequantize import _COMPANIONS, ModeloptDequantize, dequantize_layer
from .packed import ModeloptKeepPacked, ModeloptKeepPackedExperts, PackedLoading

__all__ = ["ModeloptExportConfig", "ModeloptExportQuantizer", "dequantize_layer", "load_hf_checkpoint"]
# (ModeloptDequantize, ModeloptKeepPacked and ModeloptKeepPackedExperts: importable from here, as before)

logger = get_logger(__name__)


def _fused_experts_conversions(experts: str, interleaved: bool, bias: bool) -> list[WeightConverter]:
    """Per-expert ``gate_proj`` / ``up_proj`` / ``down_proj`` maps, written ``(out, in)`` as every other
    linear map, merged into fused experts stored transposed, ``(experts, in, out)``: Llama 4 (``gate_up_proj``
    = [gate; up]) and GPT-OSS (gate and up rows interleaved, with biases). transformers has no such
    conversion for either."""

    def gate_up() -> list[ConversionOps]:
        ops: list[ConversionOps] = [MergeModulelist(dim=0), Concatenate(dim=1)]
        return [*ops, Interleave(dim=1, inverse=True)] if interleaved else ops

    halves = [f"{experts}.*.gate_proj.", f"{experts}.*.up_proj."]
    down = f"{experts}.*.down_proj."
    out = [
        WeightConverter(
            [h + "weight" for h in halves], f"{experts}.gate_up_proj", [*gate_up(), Transpose(1, 2)]
        ),
        WeightConverter(down + "weight", f"{experts}.down_proj", [MergeModulelist(dim=0), Transpose(1, 2)]),
    ]
    if bias:
        out.append(WeightConverter([h + "bias" for h in halves], f"{experts}.gate_up_proj_bias", gate_up()))
        out.append(WeightConverter(down + "bias", f"{experts}.down_proj_bias", [MergeModulelist(dim=0)]))
    return out


#: fused experts classes written per expert -> (their path under the decoder layer, interleaved, biases)
_FUSED_TRANSPOSED = {
    Llama4TextExperts: ("feed_forward.experts", False, False),
    GptOssExperts: ("mlp.experts", True, True),
}


class ModeloptExportQuantizer(PackedLoading, HfQuantizer):
    """Loads an exported checkpoint: dequantized (the default), or with the linear layers' weights kept
    packed (``dequantize=False``, see the module docstring)."""

    requires_calibration = True  # only pre-quantized checkpoints
    quantization_config: ModeloptExportConfig
    serialized_names: ClassVar[dict[str, list[str]]] = {"weight": ["weight", *_COMPANIONS]}

    def __init__(self, quantization_config: ModeloptExportConfig, **kwargs: Any):
        super().__init__(quantization_config, **kwargs)
        self._stored: dict[str, str] = {}  # layers stored quantized in the checkpoint -> quant_algo
        self._covered: set[str] = set()  # per-expert layers kept packed in compressed experts
        #: compressed experts projection (``<experts>.<proj>``) -> (checkpoint halves, interleaved rows)
        self._packed_experts: dict[str, tuple[tuple[str, ...], bool]] = {}
        self._activations: dict[str, Any] | None = None  # activations="fake": plan_activations' plan

    def get_load_operations(self) -> dict:
        return {"dequantize": ModeloptDequantize, "deserialize": ModeloptKeepPacked}

    def update_weight_conversions(self, weight_conversions: list, model: nn.Module) -> list:
        """The model's conversions, plus the merge of per-expert Llama 4 / GPT-OSS experts (dequantized
        first; with ``dequantize=False`` kept packed where the experts were prepared packed)."""
        present = {type(m) for m in model.modules()}
        for cls in _FUSED_TRANSPOSED:
            # before weight loading a fused experts module may already be its compressed class
            if any(issubclass(p, cls) for p in present):
                experts, interleaved, bias = _FUSED_TRANSPOSED[cls]
                weight_conversions = [
                    *weight_conversions,
                    *_fused_experts_conversions(experts, interleaved, bias),
                ]
        converters = super().update_weight_conversions(weight_conversions, model)
        if self.quantization_config.dequantize:
            return converters
        out = []
        for c in converters:
            ops = getattr(c, "operations", None) or []
            if len(ops) > 1 and type(ops[0]) is ModeloptDequantize:  # a merge of per-expert weights
                c = c.copy(
                    c._original_source_patterns,
                    c._original_target_patterns,
                    operations=[ModeloptKeepPackedExperts(self, list(ops))],
                )
            out.append(c)
        return out

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        unknown = self.quantization_config.algorithms() - set(PACKERS)
        if unknown:
            raise ValueError(
                f"the checkpoint's quant_algo {sorted(unknown)} cannot be dequantized by modelopt_lite "
                f"(supported: {sorted(PACKERS)})"
            )
        files = kwargs.get("checkpoint_files") or []
        if not self.quantization_config.dequantize:
            require_torchao()
            self._prepare_packed(model, files)
        if self.quantization_config.activations == "fake":
            self._activations = plan_activations(model, self.quantization_config, files)

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        if not self.quantization_config.dequantize:
            self._report_packed(model)
        if self._activations is not None:
            quantize_activations(model, self._activations)
        return model

    def _report_packed(self, model: nn.Module) -> None:
        """``dequantize=False``: refuse experts left unloaded; one INFO line per format and kind of layer."""
        int8_gemm = self.quantization_config.int8_gemm
        for name, module in model.named_modules():
            if isinstance(module, CompressedExperts):
                unloaded = [n for n, b in module._packed().items() if b.is_meta]
                if unloaded:
                    raise ValueError(
                        f"{name}: the checkpoint's per-expert tensors did not load into the packed experts "
                        f"({', '.join(unloaded)} still empty); load with dequantize=True"
                    )
        layers = compressed_layers(model)
        linear = {n for n, m in model.named_modules() if isinstance(m, CompressedLinear)}
        kernel = {n: use_int8_gemm(model.get_submodule(n), int8_gemm) for n in linear if layers[n] in KERNELS}
        for algo in sorted(set(layers.values())):
            on_kernel = sum(1 for n, a in layers.items() if a == algo and kernel.get(n))
            if on_kernel:
                logger.info(
                    "from_pretrained(dequantize=False): %d %s layer(s) keep packed weights and run %s "
                    "(activations quantized with the stored input_scale)",
                    on_kernel,
                    algo,
                    KERNELS[algo],
                )
            rest = sum(1 for n, a in layers.items() if a == algo and not kernel.get(n) and n in linear)
            if rest:
                why = ""
                if algo in KERNELS:
                    why = (
                        "; torch._int_mm is slow on a CPU without AVX512-VNNI / AMX, int8_gemm=True forces it"
                        if int8_gemm is None and not fast_int8_gemm(next(iter(model.buffers())).device)
                        else "; int8_gemm=True runs the int8 GEMM on quantized activations"
                    )
                acts = (
                    "inputs fake-quantized from the stored scales, activations='fake'"
                    if self.quantization_config.activations == "fake"
                    else f"dense activations, as the dequantized load{why}"
                )
                logger.info(
                    "from_pretrained(dequantize=False): %d %s layer(s) keep packed weights and dequantize "
                    "them on the fly (%s)",
                    rest,
                    algo,
                    acts,
                )
            experts = sum(1 for n, a in layers.items() if a == algo and n not in linear)
            if experts:
                logger.info(
                    "from_pretrained(dequantize=False): %d fused MoE experts projection(s) in %s keep packed "
                    "weights and dequantize them on the fly (all experts of a projection per forward, as the "
                    "dequantized load)",
                    experts,
                    algo,
                )
        by_algo: dict[str, list[str]] = {}
        for name, algo in sorted(self._stored.items()):
            if name not in layers and name not in self._covered:
                by_algo.setdefault(algo, []).append(name)
        for algo, names in sorted(by_algo.items()):
            logger.info(
                "from_pretrained(dequantize=False): %d %s weight(s) load dequantized to full precision (not "
                "a plain linear layer of the model, nor fused MoE experts stored packed in one format with "
                "the gate and up halves sharing their per-tensor scales, without pre_quant_scale): %s",
                len(names),
                algo,
                ", ".join(names[:4]) + (" ..." if len(names) > 4 else ""),
            )

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return self.quantization_config.dequantize  # packed weights: train before compressing


def _register() -> None:
    """Definition-time registration under ``modelopt`` unless another library holds the name."""
    owner = AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD)
    if owner is None and QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(ModeloptExportConfig)
        register_quantizer(QUANT_METHOD)(ModeloptExportQuantizer)
    elif owner is not ModeloptExportQuantizer:
        logger.warning(
            "transformers already has a quantizer for quant_method %r (%s): from_pretrained on exported "
            "checkpoints uses it instead of modelopt_lite's dequantizing loader",
            QUANT_METHOD,
            getattr(owner, "__name__", owner),
        )


_register()


def read_hf_quant_config(export_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``hf_quant_config.json`` of ``export_dir``, validated (missing or malformed: a clear error)."""
    path = Path(export_dir) / "hf_quant_config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: {export_dir} is not a modelopt export (export_hf_checkpoint writes it "
            "next to config.json)"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno}); re-export the model"
        ) from None
    return validate_hf_quant_config(data, str(path))


def load_hf_checkpoint(
    export_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.bfloat16,
    *,
    compress: bool = False,
    int8_gemm: bool | None = False,
    activations: str = "dense",
    **kwargs: Any,
) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(export_dir, dtype=dtype)`` after checking
    ``hf_quant_config.json`` against ``config.json``. Weights are dequantized to ``dtype``; with
    ``compress=True`` the linear layers keep them packed, as ``mtq.compress`` does (the quantization config's
    ``dequantize=False``; needs the torchao extra), and ``int8_gemm`` chooses whether W8A8 layers run
    torchao's int8 GEMM on activations quantized with the stored ``input_scale`` (``None``: where it is
    fast; ``False``, the default: dense activations, what the dequantized load computes).

    ``activations="fake"`` (with either load) gives every quantized linear layer back the activation fake
    quantization of its format, from the checkpoint's ``input_scale`` (FP8 and W4A8_AWQ ``amax = input_scale
    * 448``, W8A8 ``* 127``, NVFP4's global amax ``* 6 * 448`` with dynamic 16-element blocks; MXFP8 and FP8
    per token need no stored scale), a ``pre_quant_scale`` not folded into a norm on its input, and the KV
    cache its fake quantization from ``k_scale`` / ``v_scale``: the model computes what the exported
    fake-quant model computed, up to the ulp an amax may lose through ``amax / max * max``. A format whose
    activation quantization the checkpoint does not determine raises, naming it. ``"dense"`` (the default):
    the stored activation scales are not used (see :mod:`.activations`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = read_hf_quant_config(export_dir)
    config_path = Path(export_dir) / "config.json"
    qcfg = json.loads(config_path.read_text()).get("quantization_config") or {}
    if qcfg.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"{config_path}: quantization_config.quant_method is {qcfg.get('quant_method')!r}, "
                         f"expected {QUANT_METHOD!r}")  # fmt: skip
    if qcfg.get("quant_algo") != hf_cfg["quantization"]["quant_algo"]:
        raise ValueError(
            f"{export_dir}: config.json says quant_algo {qcfg.get('quant_algo')!r} but hf_quant_config.json "
            f"says {hf_cfg['quantization']['quant_algo']!r}"
        )
    if activations not in ACTIVATIONS:
        raise ValueError(f"load_hf_checkpoint: activations={activations!r} (allowed: {list(ACTIVATIONS)})")
    if not compress and int8_gemm is not False:
        raise ValueError("load_hf_checkpoint: int8_gemm applies to compress=True only")
    options: dict[str, Any] = {"activations": activations} if activations != "dense" else {}
    if compress:
        require_torchao()
        options.update(dequantize=False, int8_gemm=int8_gemm)
    if options:
        if "config" in kwargs:
            raise ValueError(
                f"load_hf_checkpoint({', '.join(f'{k}={v!r}' for k, v in options.items())}) sets the model "
                "config's quantization_config; do not pass config="
            )
        config = AutoConfig.from_pretrained(export_dir)
        config.quantization_config = {**qcfg, **options}
        kwargs["config"] = config
    return AutoModelForCausalLM.from_pretrained(export_dir, dtype=dtype, **kwargs)
