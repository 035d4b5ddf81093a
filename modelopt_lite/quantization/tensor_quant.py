"""The reference's functional fake-quant functions (``mtq.tensor_quant``), on :mod:`modelopt_lite.formats`.

* :func:`fake_tensor_quant` ``(inputs, amax, bias=None, num_bits=8, unsigned=False, narrow_range=True, ...)``:
  integer fake quant with ``amax`` broadcast against ``inputs``; the backward passes the gradient where
  ``|x| <= amax`` (everywhere with ``pass_through_bwd=True``).
* :func:`scaled_e4m3` ``(inputs, amax, bias=None, E=4, M=3, ...)``: FP8 fake quant (``amax=None``: no
  scaling), same backward.
* :func:`dynamic_block_quant` ``(inputs, block_size, amax, bias, num_bits, scale_bits, ...)``: NVFP4 / MX
  blocks with scales taken from each block (``amax``: NVFP4's global amax).
* :func:`int_cast_ste`, :func:`fp4_cast_ste`: rounding to the integer / E2M1 grid with a clipped
  straight-through backward; :func:`fake_quant_impl`, :func:`scaled_e4m3_impl`, :func:`fp8_eager`: the
  forward computations without autograd.

The ONNX-only arguments (``trt_high_precision_dtype``, ``block_size`` / ``axis`` of ``fake_tensor_quant``,
``onnx_quantizer_type``) are accepted and change nothing. A ``bias`` (affine quantization, broadcast against
``inputs``) is subtracted before the integer / FP8 fake quant and added back after; as in the reference,
:func:`dynamic_block_quant` quantizes the input itself. :func:`static_blockwise_fp4_fake_quant` is static
NVFP4 (a calibrated amax per block, four-over-six with ``fp8_max_for_normalization=256``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..formats import e2m1_round, fake_quant, fp8_fake_quant, int_bounds, int_fake_quant, resolve_format
from ..nn.errors import UnsupportedFeatureError
from .config_models import QuantizerAttributeConfig

__all__ = [
    "E4M3_MAX",
    "QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL",
    "QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW",
    "QUANT_DESC_8BIT_PER_TENSOR",
    "QUANT_DESC_UNSIGNED_8BIT_PER_TENSOR",
    "DynamicBlockQuantizationFunction",
    "FP4CastSTEFunction",
    "FakeTensorQuantFunction",
    "IntCastSTEFunction",
    "QuantizerAttributeConfig",
    "ScaledE4M3Function",
    "StaticBlockwiseFP4FakeQuantFunction",
    "dynamic_block_quant",
    "fake_quant_impl",
    "fake_tensor_quant",
    "fp4_cast_ste",
    "fp8_eager",
    "int_cast_ste",
    "mx_format_map",
    "scaled_e4m3",
    "scaled_e4m3_impl",
    "static_blockwise_fp4_fake_quant",
]

E4M3_MAX = 448.0
QUANT_DESC_8BIT_PER_TENSOR = QuantizerAttributeConfig(num_bits=8)
QUANT_DESC_UNSIGNED_8BIT_PER_TENSOR = QuantizerAttributeConfig(num_bits=8, unsigned=True)
QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW = QuantizerAttributeConfig(num_bits=8, axis=0)
QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
#: ``num_bits`` -> format name, as in the reference.
mx_format_map: dict[Any, str] = {
    (4, 3): "E4M3", (5, 2): "E5M2", (3, 2): "E3M2", (2, 3): "E2M3", 8: "INT8", (8, 0): "E8M0", (2, 1): "E2M1",
    (1, 2): "E1M2", (0, 3): "E0M3", (3, 0): "E3M0",
}  # fmt: skip


class _ClippedSTE(torch.autograd.Function):
    """``forward(x) = fn(x)``; ``backward`` passes the gradient where ``|x| <= bound`` (everywhere when
    ``bound`` is ``None``). No gradient for the amax."""

    @staticmethod
    def forward(ctx, x, fn, bound):  # type: ignore[override]
        ctx.clip = bound is not None
        if ctx.clip:
            ctx.save_for_backward(x, torch.as_tensor(bound, dtype=torch.float32, device=x.device))
        return fn(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if not ctx.clip:
            return grad, None, None
        x, bound = ctx.saved_tensors
        return grad * (x.abs() <= bound.to(x.dtype)), None, None


def _ste(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], bound: Any) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _ClippedSTE.apply(x, fn, bound)
    return fn(x)


def _affine(
    inputs: torch.Tensor, bias: torch.Tensor | None, quantize: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``quantize(inputs - bias) + bias`` (a clipped backward sees the centred input); no bias: as it is."""
    if bias is None:
        return quantize(inputs)
    bias = torch.as_tensor(bias, dtype=inputs.dtype, device=inputs.device)
    return quantize(inputs - bias) + bias


def fake_quant_impl(
    inputs: torch.Tensor,
    amax: torch.Tensor,
    num_bits: int = 8,
    unsigned: bool = False,
    narrow_range: bool = True,
) -> torch.Tensor:
    """Integer fake quant of ``inputs`` scaled by ``amax`` (broadcast), no autograd wrapper."""
    return int_fake_quant(inputs, torch.as_tensor(amax), num_bits, unsigned, narrow_range)


def fake_tensor_quant(
    inputs: torch.Tensor,
    amax: torch.Tensor,
    bias: torch.Tensor | None = None,
    num_bits: int = 8,
    unsigned: bool = False,
    narrow_range: bool = True,
    trt_high_precision_dtype: str | None = None,
    pass_through_bwd: bool = False,
    block_size: int | None = None,
    axis: int | None = None,
) -> torch.Tensor:
    """Integer fake quant with a straight-through backward (clipped at ``amax`` unless
    ``pass_through_bwd``)."""
    amax = torch.as_tensor(amax)
    return _affine(
        inputs,
        bias,
        lambda c: _ste(
            c,
            lambda x: fake_quant_impl(x, amax, num_bits, unsigned, narrow_range),
            None if pass_through_bwd else amax,
        ),
    )


def scaled_e4m3_impl(inputs: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """E4M3 fake quant: scale so that ``amax`` maps to 448 (no scaling when ``amax`` is ``None``)."""
    return fp8_fake_quant(inputs, torch.as_tensor(E4M3_MAX if amax is None else amax), (4, 3))


def fp8_eager(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """E4M3 fake quant of ``x`` scaled by ``amax``."""
    return scaled_e4m3_impl(x, amax)


def scaled_e4m3(
    inputs: torch.Tensor,
    amax: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    E: int = 4,  # (the reference's argument names)
    M: int = 3,
    trt_high_precision_dtype: str | None = None,
    pass_through_bwd: bool = False,
) -> torch.Tensor:
    """FP8 (``E``, ``M`` = 4, 3 or 5, 2) fake quant with a straight-through backward (clipped at ``amax``
    unless ``pass_through_bwd`` or no ``amax``)."""
    bits = (E, M)
    if bits == (4, 3) and amax is None:
        return _affine(inputs, bias, lambda c: _ste(c, scaled_e4m3_impl, None))
    scale = torch.as_tensor(amax) if amax is not None else None
    if scale is None:
        raise ValueError(f"scaled_e4m3: E={E}, M={M} needs an amax")
    bound = None if pass_through_bwd else scale
    return _affine(inputs, bias, lambda c: _ste(c, lambda x: fp8_fake_quant(x, scale, bits), bound))


def dynamic_block_quant(
    inputs: torch.Tensor,
    block_size: int,
    amax: torch.Tensor | None,
    bias: torch.Tensor | None,
    num_bits: Any,
    scale_bits: Any,
    trt_high_precision_dtype: str | None = None,
    onnx_quantizer_type: str = "dynamic",
    pass_through_bwd: bool = True,
) -> torch.Tensor:
    """Dynamic block fake quant along the last dimension (NVFP4: ``num_bits=(2, 1), scale_bits=(4, 3)``
    with ``amax`` the global amax; MX: ``scale_bits=(8, 0)``); straight-through backward. ``bias`` is not
    applied (the reference's kernel takes it and quantizes the input itself)."""
    spec = resolve_format(
        num_bits, None, {-1: block_size, "type": "dynamic", "scale_bits": scale_bits}, False, False
    )
    return fake_quant(inputs, spec, None if amax is None else torch.as_tensor(amax))


def int_cast_ste(
    x: torch.Tensor, num_bits: int, unsigned: bool = False, narrow_range: bool = True
) -> torch.Tensor:
    """``clamp(round(x))`` to the integer grid (no scaling); the gradient passes inside the grid's range."""
    low, high = int_bounds(num_bits, unsigned, narrow_range)
    out = x.detach().round().clamp(low, high)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return out
    return out + (x - x.detach()) * ((x >= low) & (x <= high)).to(x.dtype)


def fp4_cast_ste(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Round to the E2M1 grid (no scaling); the gradient passes where ``|x| <= 6``."""
    out = _ste(x, lambda v: e2m1_round(v.float()).to(v.dtype), 6.0)
    return out if out_dtype is None else out.to(out_dtype)


def static_blockwise_fp4_fake_quant(
    x: torch.Tensor,
    amax: torch.Tensor,
    global_amax: torch.Tensor | None = None,
    quantize_block_scales: bool = True,
    fp8_max_for_normalization: float = 448.0,
    out_dtype: torch.dtype | None = None,
    pass_through_bwd: bool = False,
) -> torch.Tensor:
    """Static NVFP4: ``amax`` holds one calibrated amax per block of ``x.numel() // amax.numel()`` elements
    along the last dimension, ``global_amax`` the per-tensor amax (``None``: the largest block amax);
    ``fp8_max_for_normalization`` 448, or 256 for four-over-six. The backward passes the gradient where
    ``|x|`` is within its block amax (everywhere with ``pass_through_bwd=True``)."""
    if not quantize_block_scales:
        raise UnsupportedFeatureError(
            "static_blockwise_fp4_fake_quant(quantize_block_scales=False) (unquantized block scales) is not "
            "implemented; use the FP8 block scales (quantize_block_scales=True)"
        )
    if fp8_max_for_normalization not in (448.0, 256.0):
        raise ValueError(f"fp8_max_for_normalization={fp8_max_for_normalization!r} (allowed: 448, 256)")
    amax = torch.as_tensor(amax)
    block = x.numel() // max(amax.numel(), 1)
    if block == 0 or block * amax.numel() != x.numel() or x.shape[-1] % block:
        raise ValueError(
            f"x {tuple(x.shape)} does not split into {amax.numel()} blocks along its last dimension"
        )
    blocks = {
        -1: block,
        "type": "static",
        "scale_bits": (4, 3),
        "four_over_six": fp8_max_for_normalization == 256,
    }
    spec = resolve_format((2, 1), None, blocks)
    global_amax = None if global_amax is None else torch.as_tensor(global_amax)
    out = fake_quant(x, spec, amax.reshape(-1, 1), not pass_through_bwd, global_amax)
    return out if out_dtype is None else out.to(out_dtype)


def _autograd_name(name: str, fn: Callable[..., torch.Tensor]) -> type:
    """The reference's ``torch.autograd.Function`` name for ``fn``: ``<name>.apply(...)`` is ``fn(...)``."""
    return type(
        name, (), {"apply": staticmethod(fn), "__doc__": f"``{name}.apply`` is :func:`{fn.__name__}`."}
    )


FakeTensorQuantFunction = _autograd_name("FakeTensorQuantFunction", fake_tensor_quant)
ScaledE4M3Function = _autograd_name("ScaledE4M3Function", scaled_e4m3)
DynamicBlockQuantizationFunction = _autograd_name("DynamicBlockQuantizationFunction", dynamic_block_quant)
IntCastSTEFunction = _autograd_name("IntCastSTEFunction", int_cast_ste)
FP4CastSTEFunction = _autograd_name("FP4CastSTEFunction", fp4_cast_ste)
StaticBlockwiseFP4FakeQuantFunction = _autograd_name(
    "StaticBlockwiseFP4FakeQuantFunction", static_blockwise_fp4_fake_quant
)
