"""The 256 codes of an 8-bit format: what travels when an FP8 tensor is sent (hsgd.dp.fp8_gather), one byte a value.

A code is a sign bit, e exponent bits and m = p - 1 significand bits (E4M3: e = 4, m = 3, bias 7; E5M2: e = 5, m = 2,
bias 15; bias = 1 - emin, hsgd.model.precision.FORMATS):

    exponent field E = 0        (-1)^sign  M / 2^m  2^emin          the subnormals, and zero
    0 < E < top                 (-1)^sign (1 + M / 2^m) 2^(E - bias)
    E = top (all ones)          E5M2 (IEEE-like): M = 0 infinity, else NaN
                                E4M3fn: a number like the others, but M all ones is NaN (its only NaN, no infinity)

Positive codes 0x00, 0x01, ... hold increasing values (the exponent field sits above the significand), so the code
of a value the format holds is its place in the sorted table of positive values, plus 0x80 for the sign: encode
is one binary search, decode one table look-up, on NumPy or CuPy arrays alike.
"""
import numpy as np

from hsgd.model.backend import array_module
from hsgd.model.precision import FORMATS

TABLES = {}


def code_values(fmt):
    """(256,) float64: the value of each code of format `fmt` (by the formula of the module docstring)."""
    if fmt not in TABLES:
        f = FORMATS[fmt]
        m, bias = f.p - 1, 1 - f.emin
        e_bits = 7 - m
        top = 2 ** e_bits - 1
        out = np.empty(256)
        for code in range(256):
            sign, E, M = code >> 7, (code >> m) & top, code & (2 ** m - 1)
            if E == 0:
                v = M / 2 ** m * 2.0 ** f.emin
            elif E == top and f.overflow == "inf":
                v = np.inf if M == 0 else np.nan
            elif E == top and M == 2 ** m - 1:
                v = np.nan
            else:
                v = (1 + M / 2 ** m) * 2.0 ** (E - bias)
            out[code] = -v if sign else v
        TABLES[fmt] = out
    return TABLES[fmt]


def encode(q, fmt):
    """The codes (uint8, q's shape) of q, an array of values format `fmt` holds (finite, as a saturating cast leaves
    them; the sign of a zero kept)."""
    xp = array_module(q)
    positive = xp.asarray(code_values(fmt)[:128])                  # codes 0x00..0x7F, increasing (NaN last)
    finite = positive[:int(np.isfinite(code_values(fmt)[:128]).sum())]
    code = xp.searchsorted(finite, xp.abs(q).astype(xp.float64)).astype(xp.uint8)
    return code | (xp.signbit(q).astype(xp.uint8) << xp.uint8(7))


def decode(codes, fmt, dtype):
    """The values (dtype) of codes (uint8) of format `fmt`."""
    xp = array_module(codes)
    return xp.asarray(code_values(fmt))[codes.astype(xp.int64)].astype(dtype)
