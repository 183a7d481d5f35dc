"""Floating-point formats, emulated: rounding to bfloat16 or float16 on arrays of wider floats, and what a rounding
costs (the unit roundoff, Higham's gamma_n).

A format with a p-bit significand (the leading bit included), smallest normal exponent emin and largest finite
value `max` represents x exactly when x = M 2^(e - p + 1) with M an integer, |M| < 2^p and e = max(floor(log2 |x|),
emin). Rounding x to it, to nearest with ties to even (IEEE 754's default, what bfloat16 and float16 hardware and
the ml_dtypes package do):

    e = max(floor(log2 |x|), emin);   q = 2^(e - p + 1)   (the spacing of the format's numbers near x)
    round(x) = rint(x / q) q           (rint: to the nearest integer, ties to even)
    |round(x)| > max  ->  +-inf        (x at or past max + q/2 rounds up past max: overflow)

Below 2^emin the spacing stays 2^(emin - p + 1): the subnormal numbers, down to zero. Every step is exact in
float64 for float32 or float64 inputs (x / q and M q only move the exponent), so `round_to` gives the correctly
rounded value, returned in the input's dtype (every bfloat16 and float16 number is a float32). A float64 input
is rounded once, directly: float64 -> float32 -> bfloat16 would round twice and can differ in the last bit.

    format     p    emin   max              u = 2^-p
    bfloat16   8    -126   3.3895e38        2^-8  = 3.9e-3     (float32's exponent range, 8 significant bits)
    float16    11   -14    65504            2^-11 = 4.9e-4
    float32    24   -126   3.4028e38        2^-24 = 6.0e-8
    float64    53   -1022  1.7977e308       2^-53 = 1.1e-16

The unit roundoff u bounds one rounding: round(x) = x (1 + d), |d| <= u (normal range). A sum of n terms computed
in any order, each addition rounded, is off by at most gamma_n sum |x_i| with gamma_n = n u / (1 - n u) (Higham
2002, "Accuracy and Stability of Numerical Algorithms", section 3.1, where gamma_n first appears for products and
sums); two layouts that add the same n terms in different orders therefore differ by at most 2 gamma_n sum |x_i|.
"""
from collections import namedtuple

import numpy as np

from .backend import array_module

Format = namedtuple("Format", "name p emin max")
FORMATS = {
    "bfloat16": Format("bfloat16", 8, -126, float((2 - 2.0 ** -7) * 2.0 ** 127)),
    "float16": Format("float16", 11, -14, 65504.0),
    "float32": Format("float32", 24, -126, float(np.finfo(np.float32).max)),
    "float64": Format("float64", 53, -1022, float(np.finfo(np.float64).max)),
}


def unit_roundoff(fmt):
    """u = 2^-p: the largest relative error of one rounding to `fmt` in its normal range."""
    return 2.0 ** -FORMATS[fmt].p


def gamma(n, fmt):
    """Higham's gamma_n = n u / (1 - n u) for `fmt`: the relative error bound of n operations in a row (a sum of
    n + 1 terms, a dot product of length n); inf once n u >= 1, where the bound says nothing."""
    nu = n * unit_roundoff(fmt)
    return nu / (1 - nu) if nu < 1 else float("inf")


def round_to(x, fmt):
    """x (a float32 or float64 array, NumPy or CuPy) rounded to the nearest number of `fmt`, ties to even (the
    module docstring's formula); the result in x's dtype. +-inf stays, overflow goes to +-inf, signed zeros keep
    their sign, and a NaN is passed on untouched, bit for bit (the formats do not say what a NaN's other bits
    become)."""
    f = FORMATS[fmt]
    xp = array_module(x)
    with np.errstate(over="ignore", invalid="ignore"):          # NaN and inf pass; overflow is meant (NumPy)
        x64 = x.astype(xp.float64)
        _, k = xp.frexp(x64)                                  # x = m 2^k, 1/2 <= |m| < 1: floor(log2 |x|) = k - 1
        e = xp.maximum(k - 1, f.emin)                         # below 2^emin: the subnormals' fixed spacing
        q = xp.ldexp(xp.ones_like(x64), e - (f.p - 1))        # the spacing of fmt's numbers near x
        r = xp.rint(x64 / q) * q                              # to the nearest multiple of q, ties to even
        r = xp.where(xp.abs(r) > f.max, xp.copysign(xp.inf, x64), r).astype(x.dtype)
    return xp.where(xp.isnan(x), x, r)
