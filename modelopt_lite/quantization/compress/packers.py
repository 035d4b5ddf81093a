"""Real quantized tensors per format (docs/export.md "Tensors per format"): the packer registry. The export
writes these tensors; ``mtq.compress`` keeps them in memory. Which format a layer's quantizers amount to
(:func:`detect_format`) is in :mod:`.real_format` (re-exported here).

A packer turns one weight ``(out, in)`` and its calibrated weight quantizer into the tensors written under
the layer's name (``weight``, ``weight_scale``, ``weight_scale_2``), and back (:meth:`Packer.dequantize`,
used by the loader and by compressed layers). Codes are computed with the arithmetic of
:mod:`modelopt_lite.formats`, so the stored codes are the ones the fake quantization rounds to.
Dequantization is bit-exact for NVFP4 and MXFP8 (the tensors hold the factors the fake quantization
multiplies by); for FP8 and the integer formats they hold ``amax / max_bound`` (what engines multiply by)
while the fake quantization multiplies by ``reciprocal(448 / amax)`` (FP8) or divides by
``max_bound / amax`` (INT), so a dequantized value can differ from the fake-quantized one by one float32
ulp.

Packers register with :func:`register_packer` at definition time, under one or more ``quant_algo`` names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from ...formats import (
    BlockLayout,
    nvfp4_block_scales,
    nvfp4_global_scale,
    nvfp4_static_scales,
    pack_e2m1,
    unpack_e2m1,
)
from ...formats.fp8 import fp8_scales
from ...formats.integer import int_bounds, int_scale_keep
from ...formats.mx import mx_scale_exponent
from ...formats.rounding import E4M3, TINY_AMAX, minifloat_round, true_div
from ...nn import SequentialQuantizer, TensorQuantizer
from ...nn.quant_module import Quantizer
from .real_format import (  # re-exported: imported from here before the split
    COMPRESS_ONLY,
    SUPPORTED,
    UnsupportedFormatError,
    detect_format,
    linear_format,
)

__all__ = [
    "COMPRESS_ONLY",
    "PACKERS",
    "SUPPORTED",
    "Packer",
    "UnsupportedFormatError",
    "detect_format",
    "get_packer",
    "linear_format",
    "register_packer",
    "scale_of_amax",
]

Tensors = dict[str, torch.Tensor]
PACKERS: dict[str, Packer] = {}


def register_packer(*quant_algos: str) -> Callable[[type[Packer]], type[Packer]]:
    """Class decorator: one instance of the packer serves every ``quant_algo`` named."""

    def add(cls: type[Packer]) -> type[Packer]:
        for algo in quant_algos:
            if algo in PACKERS:
                raise ValueError(f"quant_algo {algo!r} already has the packer {type(PACKERS[algo]).__name__}")
            PACKERS[algo] = cls()
        return cls

    return add


def get_packer(quant_algo: str) -> Packer:
    if quant_algo not in PACKERS:
        raise ValueError(f"no export packer for quant_algo {quant_algo!r} (supported: {sorted(PACKERS)})")
    return PACKERS[quant_algo]


#: FormatSpec.kind -> the bound a static activation amax is divided by in a checkpoint (``input_scale = amax /
#: bound``); the export writes it, the reload with activations reads it back
INPUT_SCALE_BOUND = {"fp8": 448.0, "int": 127.0, "nvfp4": 6.0 * 448.0}


def scale_of_amax(amax: torch.Tensor, max_bound: float) -> torch.Tensor:
    """``amax / max_bound`` as a true float32 division (amax <= 2**-24 taken as 1, as FP8 does)."""
    amax = amax.detach().float()
    return true_div(torch.where(amax <= TINY_AMAX, torch.ones_like(amax), amax), max_bound)


def _stage(q: Quantizer, i: int) -> TensorQuantizer:
    return q[i] if isinstance(q, SequentialQuantizer) else q


def _amax(q: TensorQuantizer) -> torch.Tensor:
    if q.amax is None:
        raise RuntimeError(f"{q.name}: no amax to export; calibrate the model before exporting it")
    return q.amax.detach().float()


class Packer:
    """Base of every packer; subclasses set the class attributes and implement :meth:`pack` and
    :meth:`dequantize`."""

    #: dtype of the stored ``weight``
    weight_dtype: ClassVar[torch.dtype]

    def pack(self, weight: torch.Tensor, quantizer: Quantizer) -> Tensors:
        """``weight`` is ``(out, in)`` as the weight quantizer sees it."""
        raise NotImplementedError

    def dequantize(self, tensors: Tensors, group_size: int | None = None) -> torch.Tensor:
        """The float32 ``(out, in)`` weight from the stored tensors; ``group_size``: the block of a format
        whose last block may be partial (INT4), which the tensors' shapes alone do not tell."""
        raise NotImplementedError

    #: bits per weight element of the stored ``weight`` (its exact size) and of weight plus weight scales
    #: at the nominal group size (the size check of post-export verification allows for smaller layers)
    weight_bits: ClassVar[int]
    nominal_bits: ClassVar[float]

    def group_size(self, quantizer: Quantizer) -> int | None:
        return None

    def check_shape(self, shape: torch.Size | tuple[int, ...]) -> None:
        """Raise ``ValueError`` when a weight ``(out, in)`` of this shape cannot be packed."""

    #: whether :meth:`dequantize` returns the fake-quantized weight bit for bit (otherwise within one ulp)
    exact_dequantize: ClassVar[bool] = False


def _fp8_codes(weight: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    scale, _ = fp8_scales(amax, E4M3, weight.device)
    return torch.mul(weight.float(), scale).clamp_(-E4M3.max_value, E4M3.max_value).to(torch.float8_e4m3fn)


@register_packer("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
class FP8Packer(Packer):
    """``weight`` float8_e4m3fn ``(out, in)``; ``weight_scale`` = amax / 448, a scalar (per tensor) or
    ``(out,)`` (per channel)."""

    weight_dtype = torch.float8_e4m3fn
    weight_bits = 8
    nominal_bits = 8.0

    def pack(self, weight: torch.Tensor, quantizer: Quantizer) -> Tensors:
        amax = _amax(_stage(quantizer, 0))
        scale = scale_of_amax(amax, E4M3.max_value)
        scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1)
        return {"weight": _fp8_codes(weight, amax), "weight_scale": scale}

    def dequantize(self, tensors: Tensors, group_size: int | None = None) -> torch.Tensor:
        scale = tensors["weight_scale"].float()
        return tensors["weight"].float() * (scale.reshape(-1, 1) if scale.ndim else scale)


def _int_codes(weight: torch.Tensor, amax: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``clamp(round(w * max_bound / amax))`` as int8, per channel (``amax`` broadcasts) or per block."""
    lo, hi = int_bounds(num_bits)
    scale, keep = int_scale_keep(amax, hi, weight.device)
    codes = torch.mul(weight.float(), scale).round_().clamp_(lo, hi)
    return (codes if keep is None else codes.mul_(keep)).to(torch.int8)


@register_packer("W8A8_SQ_PER_CHANNEL", "W8A16")
class Int8Packer(Packer):
    """``weight`` int8 ``(out, in)``; ``weight_scale`` f32 ``(out,)`` = amax / 127."""

    weight_dtype = torch.int8
    weight_bits = 8
    nominal_bits = 8.25

    def pack(self, weight: torch.Tensor, quantizer: Quantizer) -> Tensors:
        amax = _amax(_stage(quantizer, 0)).reshape(-1, 1)
        return {"weight": _int_codes(weight, amax, 8), "weight_scale": true_div(amax.reshape(-1), 127.0)}

    def dequantize(self, tensors: Tensors, group_size: int | None = None) -> torch.Tensor:
        return tensors["weight"].float() * tensors["weight_scale"].float().reshape(-1, 1)


def _pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """Two output rows per byte, the even row in the low nibble: ``(out / 2, in)`` uint8."""
    return ((codes[0::2] & 0x0F) | ((codes[1::2] & 0x0F) << 4)).to(torch.uint8)


def _unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=1).to(torch.int16)  # (out/2, 2, in)
    nibbles = torch.where(nibbles >= 8, nibbles - 16, nibbles)
    return nibbles.reshape(-1, packed.shape[-1]).float()


@register_packer("W4A16_AWQ")
class Int4BlockPacker(Packer):
    """``weight`` uint8 ``(out / 2, in)``; ``weight_scale`` f32 ``(out, in / block)`` = block_amax / 7."""

    weight_dtype = torch.uint8
    weight_bits = 4
    nominal_bits = 4.25

    def _block(self, quantizer: Quantizer) -> int:
        return int(_stage(quantizer, 0).spec.block_axes[0][1])

    def group_size(self, quantizer: Quantizer) -> int | None:
        return self._block(quantizer)

    def check_shape(self, shape: torch.Size | tuple[int, ...]) -> None:
        if shape[0] % 2:
            raise ValueError(f"INT4 packs two output rows per byte; {shape[0]} rows is odd")

    def pack(self, weight: torch.Tensor, quantizer: Quantizer) -> Tensors:
        self.check_shape(weight.shape)
        q = _stage(quantizer, 0)
        block = self._block(quantizer)
        layout = BlockLayout.build(weight.shape, {-1: block})
        amax = _amax(q).reshape(-1, 1)
        codes = layout.merge(_int_codes(layout.split(weight.float()), amax, 4))
        per_row = -(-weight.shape[-1] // block)
        return {"weight": _pack_int4_rows(codes), "weight_scale": true_div(amax, 7.0).reshape(-1, per_row)}

    def dequantize(self, tensors: Tensors, group_size: int | None = None) -> torch.Tensor:
        codes = _unpack_int4_rows(tensors["weight"])
        scale = tensors["weight_scale"].float()
        in_f, blocks = codes.shape[-1], scale.shape[-1]
        # without group_size, the blocks are taken as full but the last one (ceil(in / blocks)): right
        # unless the last block is partial, e.g. 176 inputs in blocks of 128 (two scales, 88 inferred)
        block = group_size or -(-in_f // blocks)
        if -(-in_f // block) != blocks:
            raise ValueError(f"INT4 weight_scale {tuple(scale.shape)}: {in_f} inputs in blocks of {block} "
                             f"make {-(-in_f // block)} blocks per row, not {blocks}")  # fmt: skip
        return codes * scale.repeat_interleave(block, dim=-1)[:, :in_f]


@register_packer("W4A8_AWQ")
class W4A8Packer(Int4BlockPacker):
    """As W4A16_AWQ, plus ``weight_scale_2`` = amax / 448 of the FP8 stage."""

    def pack(self, weight: torch.Tensor, quantizer: Quantizer) -> Tensors:
        out = super().pack(weight, quantizer)
        out["weight_scale_2"] = scale_of_amax(_amax(_stage(quantizer, 1)), E4M3.max_value)
        return out

    def dequantize(self, tensors: Tensors, group_size: int | None = None) -> torch.Tensor:
        w = super().dequantize(tensors, group_size)
        amax = tensors["weight_scale_2"].float() * E4M3.max_value
        scale, inv = fp8_scales(amax, E4M3, w.device)
        return minifloat_round(w.mul_(scale).clamp_(-448.0, 448.0), E4M3, signed=True).mul_(inv)


class _FixedBlockPacker(Packer):
    """Formats with a fixed block along the input dimension (no padding in the export)."""

    block: ClassVar[int]
    name: ClassVar[str]

    def group_size(self, quantizer: Quantizer) -> int | None:
        return self.block

    def check_shape(self, shape: torch.Size | tuple[int, ...]) -> None:
        if shape[-1] % self.block:
            raise ValueError(f"{self.name} needs in_features divisible by {self.block}, got {shape[-1]}")

    def _blocks(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` as float32 ``(num_blocks, block)`` rows."""
        self.check_shape(weight.shape)
        return weight.float().reshape(-1, self.block)


@register_packer("NVFP4", "NVFP4_AWQ", "W4A16_NVFP4")
class NVFP4Packer(_FixedBlockPacker):
    """``weight`` uint8 ``(out, in / 2)`` (E2M1 codes, even element low); ``weight_scale`` float8_e4m3fn
    ``(out, in / 16)``; ``weight_scale_2`` f32 scalar = amax / 2688. Static NVFP4 (calibrated block amax,
    four-over-six) writes the reference's static scales (``formats.nvfp4_static_scales``)."""

    weight_dtype = torch.uint8
    weight_bits = 4
    nominal_bits = 4.5
    block = 16
    name = "NVFP4"
    exact_dequantize = True

    def pack(self, weight: torch.Tensor, quantizer: Quantizer) -> Tensors:
        out_f, in_f = weight.shape
        blocks = self._blocks(weight)
        q = _stage(quantizer, 0)
        if q.spec.static_nvfp4:
            global_amax = q.global_amax if q.global_amax is not None else _amax(q).amax()
            block_scale, s2 = nvfp4_static_scales(_amax(q).reshape(-1, 1), global_amax, q.spec.nvfp4_fp8_max)
        else:
            s2 = nvfp4_global_scale(_amax(q))
            block_scale = nvfp4_block_scales(blocks.abs().amax(-1, keepdim=True), s2)
        scaled = blocks / (block_scale * s2)  # the fake quantization's |x| / (fp8(s) * s2), signed
        return {
            "weight": pack_e2m1(scaled.reshape(out_f, in_f)),
            "weight_scale": block_scale.reshape(out_f, -1).to(torch.float8_e4m3fn),
            "weight_scale_2": s2.reshape(()),
        }

    def dequantize(self, tensors: Tensors, group_size: int | None = None) -> torch.Tensor:
        values = unpack_e2m1(tensors["weight"])
        step = tensors["weight_scale"].float().reshape(-1, 1) * tensors["weight_scale_2"].float()
        return (values.reshape(-1, self.block) * step).reshape(values.shape)


class _MXPacker(_FixedBlockPacker):
    """MX formats: ``weight_scale`` uint8 ``(out, in / 32)``, the E8M0 exponent byte (``exponent + 127``) of
    each block's power-of-two scale; the codes are the block divided by that scale (exact), rounded."""

    block = 32
    exact_dequantize = True
    element: ClassVar[tuple[int, int]]

    def _encode(self, scaled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def pack(self, weight: torch.Tensor, quantizer: Quantizer) -> Tensors:
        out_f, _ = weight.shape
        blocks = self._blocks(weight)
        exp = mx_scale_exponent(blocks.abs().amax(-1, keepdim=True), self.element)
        scaled = blocks / torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)  # exact
        return {
            "weight": self._encode(scaled).reshape(out_f, -1),
            "weight_scale": (exp + 127).to(torch.uint8).reshape(out_f, -1),
        }

    def dequantize(self, tensors: Tensors, group_size: int | None = None) -> torch.Tensor:
        values = self._decode(tensors["weight"])
        exp = tensors["weight_scale"].to(torch.int32) - 127
        scale = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)
        return (values.reshape(-1, self.block) * scale.reshape(-1, 1)).reshape(values.shape)


@register_packer("MXFP8")
class MXFP8Packer(_MXPacker):
    """``weight`` float8_e4m3fn ``(out, in)``; ``weight_scale`` the E8M0 bytes (``_MXPacker``)."""

    weight_dtype = torch.float8_e4m3fn
    weight_bits = 8
    nominal_bits = 8.25
    name = "MXFP8"
    element = (4, 3)

    def _encode(self, scaled: torch.Tensor) -> torch.Tensor:
        return minifloat_round(scaled.abs(), E4M3).copysign_(scaled).to(torch.float8_e4m3fn)

    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.float()


@register_packer("MXFP4")
class MXFP4Packer(_MXPacker):
    """``weight`` uint8 ``(out, in / 2)`` (E2M1 codes, even element low, as NVFP4); ``weight_scale`` the E8M0
    bytes (``_MXPacker``). ``mtq.compress`` only: the unified export has no MXFP4 layout here
    (:data:`COMPRESS_ONLY`; GPT-OSS experts: ``export_gpt_oss_mxfp4``)."""

    weight_dtype = torch.uint8
    weight_bits = 4
    nominal_bits = 4.25
    name = "MXFP4"
    element = (2, 1)

    def _encode(self, scaled: torch.Tensor) -> torch.Tensor:
        return pack_e2m1(scaled)

    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        return unpack_e2m1(codes)
