"""OCP Microscaling formats (MX v1.0): MXFP8, MXFP6, MXFP4, MXINT8, docs/numerics.md "MX formats".

Blocks of 32 along the last axis share a power-of-two scale stored as E8M0. The scale exponent is
``floor(log2(block_amax)) - emax_elem`` clamped to the E8M0 range [-127, 127]; elements are ``x / 2**exp``
rounded to nearest (ties to even) in the element format and saturated at its largest value. MXINT8 elements
are 8-bit integers with an implicit scale of 2**-6, clamped symmetrically to [-127/64, 127/64] (the
OCP encoding allows -2; like the OCP reference emulation we keep the grid symmetric, so q(-x) = -q(x)).
"""

from __future__ import annotations

import torch

from ._blocks import BlockLayout
from ._chunks import map_rows
from .rounding import MINIFLOATS, MinifloatSpec, minifloat_round

__all__ = ["MX_BLOCK", "MX_ELEMENTS", "mx_fake_quant", "mx_scale_exponent"]

MX_BLOCK = 32
#: element formats by ``num_bits``: (exp, man) tuples for the float elements, 8 for MXINT8
MX_ELEMENTS: dict[object, MinifloatSpec | None] = {
    (4, 3): MINIFLOATS[(4, 3)],
    (5, 2): MINIFLOATS[(5, 2)],
    (3, 2): MINIFLOATS[(3, 2)],
    (2, 3): MINIFLOATS[(2, 3)],
    (2, 1): MINIFLOATS[(2, 1)],
    8: None,
}
_E8M0_MIN, _E8M0_MAX = -127, 127
_MXINT8_FRAC_BITS = 6


def _element(num_bits: object) -> MinifloatSpec | None:
    key = tuple(num_bits) if isinstance(num_bits, (list, tuple)) else num_bits
    if key not in MX_ELEMENTS:
        raise ValueError(
            f"num_bits={num_bits!r} is not an MX element format (allowed: (4, 3), (5, 2) MXFP8; "
            "(3, 2), (2, 3) MXFP6; (2, 1) MXFP4; 8 MXINT8)"
        )
    return MX_ELEMENTS[key]


def mx_scale_exponent(block_amax: torch.Tensor, num_bits: object) -> torch.Tensor:
    """Shared E8M0 exponent per block: ``floor(log2(amax)) - emax_elem`` in [-127, 127] (int32)."""
    spec = _element(num_bits)
    emax = 0 if spec is None else spec.emax
    _, exp = torch.frexp(block_amax.float())  # amax = m * 2**exp, m in [0.5, 1)
    exp = exp.to(torch.int32) - 1 - emax
    exp = torch.where(block_amax > 0, exp, torch.full_like(exp, _E8M0_MIN))
    return exp.clamp_(_E8M0_MIN, _E8M0_MAX)


def mx_fake_quant(x: torch.Tensor, num_bits: object, block_size: int = MX_BLOCK) -> torch.Tensor:
    """MX fake quantization of ``x`` along its last axis (block 32 by default)."""
    if block_size <= 0:
        raise ValueError(f"block_sizes[-1]={block_size} must be a positive block length (MX: 32)")
    spec = _element(num_bits)
    layout = BlockLayout.build(x.shape, {-1: block_size})

    def quantize_rows(rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        v = out.copy_(rows)
        exp = mx_scale_exponent(v.abs().amax(dim=-1, keepdim=True), num_bits)
        scale = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)
        v.div_(scale)  # exact: a power-of-two scale
        if spec is None:
            q = v.mul_(2.0**_MXINT8_FRAC_BITS).round_().clamp_(-127, 127).div_(2.0**_MXINT8_FRAC_BITS)
        else:
            q = v.copy_(minifloat_round(v.abs(), spec).copysign_(v))
        return q.mul_(scale)

    return layout.merge(map_rows(quantize_rows, layout.split(x))).to(x.dtype)
