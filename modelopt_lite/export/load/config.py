"""``ModeloptExportConfig``: the ``quantization_config`` of an exported checkpoint as transformers holds it
(the fields engines read, and the loading options ``dequantize`` / ``int8_gemm`` / ``activations`` of
:mod:`.loader`)."""

from __future__ import annotations

from typing import Any, Protocol

from transformers.utils.quantization_config import QuantizationConfigMixin

from ..hf_config import QUANT_METHOD

__all__ = ["ModeloptExportConfig"]


class ExportQuantizerView(Protocol):
    """What the loading operations read of the loader's ``ModeloptExportQuantizer`` (named by shape, so that
    :mod:`.dequantize` and :mod:`.packed` do not import the loader that imports them)."""

    quantization_config: ModeloptExportConfig
    _packed_experts: dict[str, tuple[tuple[str, ...], bool]]


class ModeloptExportConfig(QuantizationConfigMixin):
    """``config.json["quantization_config"]`` of an exported checkpoint (the fields engines read)."""

    def __init__(
        self,
        quant_algo: str | None = None,
        config_groups: dict[str, Any] | None = None,
        ignore: list[str] | None = None,
        kv_cache_quant_algo: str | None = None,
        group_size: int | None = None,
        quantized_layers: dict[str, Any] | None = None,
        producer: dict[str, Any] | None = None,
        dequantize: bool = True,
        int8_gemm: bool | None = False,
        activations: str = "dense",
        **kwargs: Any,
    ):
        """``dequantize=False`` keeps the linear layers' weights packed (see the module docstring);
        ``int8_gemm``: whether W8A8 layers kept packed run torchao's int8 GEMM (``None``: where fast);
        ``activations="fake"``: the layers' inputs (and the KV cache) fake-quantized from the stored scales
        (:mod:`.activations`), ``"dense"``: not."""
        self.quant_method = QUANT_METHOD  # type: ignore[assignment]
        self.quant_algo = quant_algo
        self.config_groups = config_groups or {}
        self.ignore = list(ignore or [])
        self.kv_cache_quant_algo = kv_cache_quant_algo
        self.group_size = group_size
        self.quantized_layers = quantized_layers
        self.producer = producer
        self.extra = {k: v for k, v in kwargs.items() if k != "quant_method"}
        self.dequantize = dequantize
        self.int8_gemm = int8_gemm
        self.activations = activations
        self.post_init()

    def post_init(self) -> None:
        if not isinstance(self.dequantize, bool) or self.int8_gemm not in (None, True, False):
            raise ValueError(
                "quantization_config (quant_method 'modelopt'): dequantize must be a bool and int8_gemm a "
                f"bool or None (got dequantize={self.dequantize!r}, int8_gemm={self.int8_gemm!r})"
            )
        if self.activations not in ("dense", "fake"):
            raise ValueError(
                "quantization_config (quant_method 'modelopt'): activations must be 'dense' (stored "
                "activation scales unused) or 'fake' (inputs and KV cache fake-quantized from them), got "
                f"{self.activations!r}"
            )
        if not isinstance(self.quant_algo, str):
            raise ValueError(
                f"quantization_config (quant_method 'modelopt') has no quant_algo (got {self.quant_algo!r}); "
                "the checkpoint was not written by a modelopt export"
            )

    def algorithms(self) -> set[str]:
        if self.quant_algo == "MIXED_PRECISION":
            return {entry["quant_algo"] for entry in (self.quantized_layers or {}).values()}
        return {self.quant_algo} if self.quant_algo else set()

    def layer_algo(self, layer: str) -> str | None:
        """The ``quant_algo`` of one layer (``None``: a MIXED_PRECISION checkpoint does not list it)."""
        if self.quant_algo == "MIXED_PRECISION":
            entry = (self.quantized_layers or {}).get(layer)
            return entry.get("quant_algo") if isinstance(entry, dict) else None
        return self.quant_algo

    def layer_group_size(self, layer: str) -> int | None:
        """The ``group_size`` of one layer (a MIXED_PRECISION layer's own, else the checkpoint's)."""
        if self.quant_algo == "MIXED_PRECISION":
            entry = (self.quantized_layers or {}).get(layer)
            return entry.get("group_size") if isinstance(entry, dict) else None
        return self.group_size
