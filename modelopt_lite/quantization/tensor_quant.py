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

As in the reference, these functional names are the ``apply`` of ``torch.autograd.Function`` classes
(``fake_tensor_quant = FakeTensorQuantFunction.apply``, ...), which take keyword arguments and defaults as
a function does and, stored as a class attribute, do not bind ``self``.

The ONNX-only arguments (``trt_high_precision_dtype``, ``block_size`` / ``axis`` of ``fake_tensor_quant``,
``onnx_quantizer_type``) are accepted and change nothing. A ``bias`` (affine quantization, broadcast against
``inputs``) is subtracted before the integer / FP8 fake quant and added back after; as in the reference,
:func:`dynamic_block_quant` quantizes the input itself. :func:`static_blockwise_fp4_fake_quant` is static
NVFP4 (a calibrated amax per block, four-over-six with ``fp8_max_for_normalization=256``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..formats import e2m1_round, fake_quant, fp8_fake_quant, int_bounds, int_fake_quant, resolve_format
from ..nn.errors import UnsupportedFeatureError
from .config.config_models import QuantizerAttributeConfig

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


def _clip_mask(grad: torch.Tensor, x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """The straight-through gradient zeroed where ``|x| > bound`` (``bound`` broadcast against ``x``)."""
    return torch.where(x.abs() <= bound.to(x.dtype), grad, grad.new_zeros(()))


def _save_clip(ctx: Any, x: torch.Tensor, amax: Any, clip: bool) -> None:
    """Keep what a clipped backward needs (the centred input and ``amax``), or nothing."""
    ctx.clip = clip and amax is not None
    if ctx.clip:
        ctx.save_for_backward(x, torch.as_tensor(amax, dtype=torch.float32, device=x.device))


def _clipped_grad(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    if not ctx.clip:
        return grad
    x, bound = ctx.saved_tensors
    return _clip_mask(grad, x, bound)


def _centred(inputs: torch.Tensor, bias: Any) -> torch.Tensor:
    return (
        inputs if bias is None else inputs - torch.as_tensor(bias, dtype=inputs.dtype, device=inputs.device)
    )


def _uncentred(outputs: torch.Tensor, bias: Any) -> torch.Tensor:
    return (
        outputs
        if bias is None
        else outputs + torch.as_tensor(bias, dtype=outputs.dtype, device=outputs.device)
    )


def fake_quant_impl(
    inputs: torch.Tensor,
    amax: torch.Tensor,
    num_bits: int = 8,
    unsigned: bool = False,
    narrow_range: bool = True,
) -> torch.Tensor:
    """Integer fake quant of ``inputs`` scaled by ``amax`` (broadcast), no autograd wrapper."""
    return int_fake_quant(inputs, torch.as_tensor(amax), num_bits, unsigned, narrow_range)


def scaled_e4m3_impl(inputs: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """E4M3 fake quant: scale so that ``amax`` maps to 448 (no scaling when ``amax`` is ``None``)."""
    return fp8_fake_quant(inputs, torch.as_tensor(E4M3_MAX if amax is None else amax), (4, 3))


def fp8_eager(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """E4M3 fake quant of ``x`` scaled by ``amax``."""
    return scaled_e4m3_impl(x, amax)


class FakeTensorQuantFunction(torch.autograd.Function):
    """Integer fake quant (:func:`fake_tensor_quant`): ``forward(inputs, amax, bias=None, num_bits=8,
    unsigned=False, narrow_range=True, trt_high_precision_dtype=None, pass_through_bwd=False,
    block_size=None, axis=None)``; the backward passes the gradient where ``|inputs - bias| <= amax``
    (everywhere with ``pass_through_bwd=True``); no gradient for the other arguments."""

    @staticmethod
    def forward(  # type: ignore[override]
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
        x = _centred(inputs, bias)
        return _uncentred(fake_quant_impl(x, torch.as_tensor(amax), num_bits, unsigned, narrow_range), bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, amax, bias, *_, pass_through_bwd = inputs[:8]
        _save_clip(ctx, _centred(x.detach(), bias), amax, not pass_through_bwd)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return (_clipped_grad(ctx, grad),) + (None,) * 9


class ScaledE4M3Function(torch.autograd.Function):
    """FP8 fake quant (:func:`scaled_e4m3`): ``forward(inputs, amax=None, bias=None, E=4, M=3,
    trt_high_precision_dtype=None, pass_through_bwd=False)`` (``E, M`` = 4, 3 or 5, 2; ``amax=None``: E4M3
    without scaling); the backward passes the gradient where ``|inputs - bias| <= amax`` (everywhere with
    ``pass_through_bwd=True`` or without an amax)."""

    @staticmethod
    def forward(  # type: ignore[override]
        inputs: torch.Tensor,
        amax: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        E: int = 4,  # (the reference's argument names)
        M: int = 3,
        trt_high_precision_dtype: str | None = None,
        pass_through_bwd: bool = False,
    ) -> torch.Tensor:
        x = _centred(inputs, bias)
        if (E, M) == (4, 3) and amax is None:
            return _uncentred(scaled_e4m3_impl(x), bias)
        if amax is None:
            raise ValueError(f"scaled_e4m3: E={E}, M={M} needs an amax")
        return _uncentred(fp8_fake_quant(x, torch.as_tensor(amax), (E, M)), bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, amax, bias, *_ = inputs
        _save_clip(ctx, _centred(x.detach(), bias), amax, not inputs[6])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return (_clipped_grad(ctx, grad),) + (None,) * 6


class DynamicBlockQuantizationFunction(torch.autograd.Function):
    """Dynamic block fake quant along the last dimension (:func:`dynamic_block_quant`): ``forward(inputs,
    block_size, amax, bias, num_bits, scale_bits, trt_high_precision_dtype=None,
    onnx_quantizer_type="dynamic", pass_through_bwd=True)``. NVFP4: ``num_bits=(2, 1), scale_bits=(4, 3)``
    with ``amax`` the global amax; MX: ``scale_bits=(8, 0)``. ``bias`` is not applied (the reference's kernel
    takes it and quantizes the input itself). Straight-through backward (clipped at ``amax`` with
    ``pass_through_bwd=False``)."""

    @staticmethod
    def forward(  # type: ignore[override]
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
        spec = resolve_format(
            num_bits, None, {-1: block_size, "type": "dynamic", "scale_bits": scale_bits}, False, False
        )
        return fake_quant(inputs, spec, None if amax is None else torch.as_tensor(amax))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _save_clip(ctx, inputs[0].detach(), inputs[2], not inputs[8])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return (_clipped_grad(ctx, grad),) + (None,) * 8


class IntCastSTEFunction(torch.autograd.Function):
    """``clamp(round(x))`` to the integer grid, no scaling (:func:`int_cast_ste`): ``forward(x, num_bits,
    unsigned=False, narrow_range=True)``; the gradient passes inside the grid's range."""

    @staticmethod
    def forward(  # type: ignore[override]
        x: torch.Tensor, num_bits: int, unsigned: bool = False, narrow_range: bool = True
    ) -> torch.Tensor:
        low, high = int_bounds(num_bits, unsigned, narrow_range)
        return x.round().clamp(low, high)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, num_bits, unsigned, narrow_range = inputs
        ctx.bounds = int_bounds(num_bits, unsigned, narrow_range)
        ctx.save_for_backward(x.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        low, high = ctx.bounds
        return torch.where((x >= low) & (x <= high), grad, grad.new_zeros(())), None, None, None


class FP4CastSTEFunction(torch.autograd.Function):
    """Round to the E2M1 grid, no scaling (:func:`fp4_cast_ste`): ``forward(x, out_dtype=None)``; the
    gradient passes where ``|x| <= 6``."""

    @staticmethod
    def forward(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:  # type: ignore[override]
        out = e2m1_round(x.float()).to(x.dtype)
        return out if out_dtype is None else out.to(out_dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0].detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return _clip_mask(grad, x, torch.tensor(6.0)), None


def _static_fp4_blocks(x: torch.Tensor, amax: torch.Tensor) -> int:
    """The block length of static NVFP4 with one ``amax`` per block along the last dimension of ``x``."""
    block = x.numel() // max(amax.numel(), 1)
    if block == 0 or block * amax.numel() != x.numel() or x.shape[-1] % block:
        raise ValueError(
            f"x {tuple(x.shape)} does not split into {amax.numel()} blocks along its last dimension"
        )
    return block


class StaticBlockwiseFP4FakeQuantFunction(torch.autograd.Function):
    """Static NVFP4 (:func:`static_blockwise_fp4_fake_quant`): ``forward(x, amax, global_amax=None,
    quantize_block_scales=True, fp8_max_for_normalization=448, out_dtype=None, pass_through_bwd=False)``.
    ``amax`` holds one calibrated amax per block of ``x.numel() // amax.numel()`` elements along the last
    dimension, ``global_amax`` the per-tensor amax (``None``: the largest block amax);
    ``fp8_max_for_normalization`` 448, or 256 for four-over-six. The backward passes the gradient where
    ``|x|`` is within its block amax (everywhere with ``pass_through_bwd=True``)."""

    @staticmethod
    def forward(  # type: ignore[override]
        x: torch.Tensor,
        amax: torch.Tensor,
        global_amax: torch.Tensor | None = None,
        quantize_block_scales: bool = True,
        fp8_max_for_normalization: float = 448.0,
        out_dtype: torch.dtype | None = None,
        pass_through_bwd: bool = False,
    ) -> torch.Tensor:
        if not quantize_block_scales:
            raise UnsupportedFeatureError(
                "static_blockwise_fp4_fake_quant(quantize_block_scales=False) (unquantized block scales) is "
                "not implemented; use the FP8 block scales (quantize_block_scales=True)"
            )
        if fp8_max_for_normalization not in (448.0, 256.0):
            raise ValueError(f"fp8_max_for_normalization={fp8_max_for_normalization!r} (allowed: 448, 256)")
        amax = torch.as_tensor(amax)
        blocks = {
            -1: _static_fp4_blocks(x, amax),
            "type": "static",
            "scale_bits": (4, 3),
            "four_over_six": fp8_max_for_normalization == 256,
        }
        spec = resolve_format((2, 1), None, blocks)
        global_amax = None if global_amax is None else torch.as_tensor(global_amax)
        out = fake_quant(x, spec, amax.reshape(-1, 1), False, global_amax)
        return out if out_dtype is None else out.to(out_dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, amax, *_ = inputs
        ctx.clip = not inputs[6]
        if ctx.clip:
            amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
            ctx.shape = x.shape
            ctx.save_for_backward(x.detach().reshape(amax.numel(), -1), amax.reshape(-1, 1))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if ctx.clip:
            x, bound = ctx.saved_tensors
            grad = _clip_mask(grad.reshape(x.shape), x, bound).reshape(ctx.shape)
        return (grad,) + (None,) * 6


# As in the reference, the functional names are the ``apply`` of these ``torch.autograd.Function`` classes:
# bound methods, so that one stored as a class attribute does not bind ``self`` (``func =
# tensor_quant.fake_tensor_quant`` in a class body, called as ``self.func(x, amax)``). Keyword arguments and
# the defaults above work as in a plain function.
fake_tensor_quant = FakeTensorQuantFunction.apply
scaled_e4m3 = ScaledE4M3Function.apply
dynamic_block_quant = DynamicBlockQuantizationFunction.apply
int_cast_ste = IntCastSTEFunction.apply
fp4_cast_ste = FP4CastSTEFunction.apply
static_blockwise_fp4_fake_quant = StaticBlockwiseFP4FakeQuantFunction.apply
