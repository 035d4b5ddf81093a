"""Independently written expectations: numpy, element by element, from the format definitions.

Nothing here imports modelopt_lite. Minifloat values are found by decoding every bit pattern of the format
and picking the nearest one (ties to the even code), not by the arithmetic the library uses.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def minifloat_table(exp_bits: int, man_bits: int, max_value: float) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative finite values of an (exp, man) format up to max_value, and their codes."""
    bias = 2 ** (exp_bits - 1) - 1
    vals, codes = [], []
    for code in range(2 ** (exp_bits + man_bits)):
        e, m = code >> man_bits, code & (2**man_bits - 1)
        if e == 0:
            v = (m / 2**man_bits) * 2.0 ** (1 - bias)
        else:
            v = (1 + m / 2**man_bits) * 2.0 ** (e - bias)
        if v <= max_value:
            vals.append(v)
            codes.append(code)
    return np.array(vals, dtype=np.float64), np.array(codes)


def round_to_table(a: np.ndarray, vals: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Nearest table value to each non-negative a (saturating), ties to the even code."""
    a = np.asarray(a, dtype=np.float64)
    out = np.empty_like(a)
    for i, v in np.ndenumerate(a):
        if v >= vals[-1]:
            out[i] = vals[-1]
            continue
        d = np.abs(vals - v)
        best = np.flatnonzero(d == d.min())
        if len(best) > 1:
            best = [b for b in best if codes[b] % 2 == 0]
        out[i] = vals[best[0]]
    return out.astype(F32)


E4M3 = minifloat_table(4, 3, 448.0)
E5M2 = minifloat_table(5, 2, 57344.0)
E3M2 = minifloat_table(3, 2, 28.0)
E2M3 = minifloat_table(2, 3, 7.5)
E2M1 = minifloat_table(2, 1, 6.0)
TABLES = {(4, 3): E4M3, (5, 2): E5M2, (3, 2): E3M2, (2, 3): E2M3, (2, 1): E2M1}
EMAX = {(4, 3): 8, (5, 2): 15, (3, 2): 4, (2, 3): 2, (2, 1): 2, 8: 0}


def signed_round(x: np.ndarray, table) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    return (np.sign(x) * round_to_table(np.abs(x), *table)).astype(F32)


def int_expect(x, amax, num_bits=8, unsigned=False, narrow=False):
    x = np.asarray(x, dtype=F32)
    amax = np.asarray(amax, dtype=F32)
    maxb = 2**num_bits - 1 if unsigned else 2 ** (num_bits - 1) - 1
    minb = 0 if unsigned else (-maxb if narrow else -maxb - 1)
    safe = np.where(amax <= 2.0**-24, F32(1), amax).astype(F32)
    scale = (F32(maxb) / safe).astype(F32)  # IEEE float32 division
    q = np.clip(np.rint((x * scale).astype(F32)), minb, maxb).astype(F32)
    out = (q / scale).astype(F32)
    return np.where(amax <= 2.0**-24, F32(0), out).astype(F32)


def fp8_expect(x, amax, num_bits=(4, 3)):
    x = np.asarray(x, dtype=F32)
    amax = np.asarray(amax, dtype=F32)
    maxv = F32(448.0 if num_bits == (4, 3) else 57344.0)
    amax = np.where(amax <= 2.0**-24, F32(1), amax).astype(F32)
    scale = ((F32(1) / amax).astype(F32) * maxv).astype(F32)  # reciprocal, then multiply
    y = np.clip((x * scale).astype(F32), -maxv, maxv)
    y = signed_round(y, TABLES[tuple(num_bits)])
    return (y * (F32(1) / scale).astype(F32)).astype(F32)


def blocks_last_axis(x: np.ndarray, block: int) -> tuple[np.ndarray, int]:
    """(num_blocks, block) view with zero padding of the last axis; returns the padded width."""
    x = np.asarray(x, dtype=F32)
    cols = x.shape[-1]
    padded = -(-cols // block) * block
    xp = np.zeros((*x.shape[:-1], padded), dtype=F32)
    xp[..., :cols] = x
    return xp.reshape(-1, block), padded


def unblock(b: np.ndarray, shape: tuple, padded: int) -> np.ndarray:
    return b.reshape(*shape[:-1], padded)[..., : shape[-1]]


def nvfp4_expect(x, global_amax=None):
    x = np.asarray(x, dtype=F32)
    b, padded = blocks_last_axis(x, 16)
    gamax = F32(np.abs(x).max() if global_amax is None else global_amax)
    if gamax <= 2.0**-24:
        return np.zeros_like(x)
    s2 = F32(gamax / F32(2688.0))
    out = np.empty_like(b)
    for r in range(b.shape[0]):
        bam = F32(np.abs(b[r]).max())
        s = F32(bam / F32(s2 * F32(6.0)))
        if s == 0:
            s = F32(1.0)
        s = F32(min(max(s, 2.0**-9), 448.0))
        s = round_to_table(np.array([s]), *E4M3)[0]
        denom = F32(s * s2)
        q = signed_round((np.abs(b[r]) / denom).astype(F32) * np.sign(b[r]), E2M1)
        out[r] = (q * denom).astype(F32)
    return unblock(out, x.shape, padded)


def mx_expect(x, num_bits, block=32):
    x = np.asarray(x, dtype=F32)
    b, padded = blocks_last_axis(x, block)
    out = np.empty_like(b)
    for r in range(b.shape[0]):
        amax = float(np.abs(b[r]).max())
        e = -127 if amax == 0 else int(np.floor(np.log2(amax))) - EMAX[num_bits]
        e = min(max(e, -127), 127)
        scale = 2.0**e
        v = b[r].astype(np.float64) / scale
        if num_bits == 8:
            q = np.clip(np.rint(v * 64), -127, 127) / 64
        else:
            q = signed_round(v.astype(F32), TABLES[num_bits]).astype(np.float64)
        out[r] = (q * scale).astype(F32)
    return unblock(out, x.shape, padded)
