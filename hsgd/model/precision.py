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

    format          p    emin   max              u = 2^-p
    float8_e4m3fn   4    -6     448              2^-4  = 6.3e-2     (no infinity: past max is NaN)
    float8_e5m2     3    -14    57344            2^-3  = 1.3e-1     (float16's exponent range, 3 significant bits)
    bfloat16        8    -126   3.3895e38        2^-8  = 3.9e-3     (float32's exponent range, 8 significant bits)
    float16         11   -14    65504            2^-11 = 4.9e-4
    float32         24   -126   3.4028e38        2^-24 = 6.0e-8
    float64         53   -1022  1.7977e308       2^-53 = 1.1e-16

The two 8-bit formats are the OCP's (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): E4M3 spends its one
infinity and the other codes of its top binade's last step on NaN, so a value that rounds past 448 becomes NaN
(Format.overflow "nan"; 464, halfway to the missing 480, rounds to even: 448); E5M2 is IEEE-like, past 57344 inf.
`saturate=True` clamps instead: a finite value past max, or an infinity, becomes +-max (the cast that scaled FP8
training uses after dividing by its scale).

The unit roundoff u bounds one rounding: round(x) = x (1 + d), |d| <= u (normal range). A sum of n terms computed
in any order, each addition rounded, is off by at most gamma_n sum |x_i| with gamma_n = n u / (1 - n u) (Higham
2002, "Accuracy and Stability of Numerical Algorithms", section 3.1, where gamma_n first appears for products and
sums); two layouts that add the same n terms in different orders therefore differ by at most 2 gamma_n sum |x_i|.
"""
from collections import namedtuple

import numpy as np

from hsgd.model.backend import array_module

Format = namedtuple("Format", "name p emin max overflow", defaults=("inf",))
FORMATS = {
    "float8_e4m3fn": Format("float8_e4m3fn", 4, -6, 448.0, "nan"),
    "float8_e5m2": Format("float8_e5m2", 3, -14, 57344.0),
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


def round_to(x, fmt, saturate=False):
    """round_formula(x, fmt, saturate), faster where the hardware's own conversions give the same bits
    (tests/test_precision.py and tests/test_fp8_formats.py check both against ml_dtypes and NumPy): a float32 array
    to bfloat16 by integer arithmetic on its bit pattern (add half a bfloat16 spacing, 0x7FFF, plus the last kept bit
    for ties to even, then clear the low 16 bits; a carry into the exponent is the rounding up to the next binade or
    to inf), to float16 by NumPy's (CuPy's) correctly rounded float32 -> float16 -> float32 casts, to the 8-bit
    formats by round_fp8_bits. NaN passes untouched."""
    xp = array_module(x)
    if x.dtype == xp.float32 and fmt.startswith("float8"):
        return round_fp8_bits(x, FORMATS[fmt], saturate)
    if saturate:
        return round_formula(x, fmt, saturate)
    if x.dtype == xp.float32 and fmt == "bfloat16":
        bits = x.view(xp.uint32)
        up = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) & xp.uint32(0xFFFF0000)
        return xp.where(xp.isnan(x), x, up.view(xp.float32))
    if x.dtype == xp.float32 and fmt == "float16":
        with np.errstate(over="ignore"):
            return xp.where(xp.isnan(x), x, x.astype(xp.float16).astype(xp.float32))
    return round_formula(x, fmt)


def round_formula(x, fmt, saturate=False):
    """x (a float32 or float64 array, NumPy or CuPy) rounded to the nearest number of `fmt`, ties to even (the
    module docstring's formula); the result in x's dtype. Past max (an infinity too): +-inf, or NaN for a format
    without infinities (float8_e4m3fn), or +-max with saturate. Signed zeros keep their sign, and a NaN is passed
    on untouched, bit for bit (the formats do not say what a NaN's other bits become)."""
    f = FORMATS[fmt]
    xp = array_module(x)
    with np.errstate(over="ignore", invalid="ignore"):          # NaN and inf pass; overflow is meant (NumPy)
        x64 = x.astype(xp.float64)
        _, k = xp.frexp(x64)                                  # x = m 2^k, 1/2 <= |m| < 1: floor(log2 |x|) = k - 1
        e = xp.maximum(k - 1, f.emin)                         # below 2^emin: the subnormals' fixed spacing
        q = xp.ldexp(xp.ones_like(x64), e - (f.p - 1))        # the spacing of fmt's numbers near x
        r = xp.rint(x64 / q) * q                              # to the nearest multiple of q, ties to even
        r = overflowed(r, x64, f, saturate, xp).astype(x.dtype)
    return xp.where(xp.isnan(x), x, r)


def overflowed(r, x, f, saturate, xp):
    """r where |r| <= max; past it (or not finite), what format f makes of it: +-max (saturate), NaN or +-inf."""
    past = ~(xp.abs(r) <= f.max)                              # (a NaN from an infinite input included)
    if saturate:
        big = xp.copysign(xp.asarray(f.max, dtype=r.dtype), x)
    else:
        big = xp.asarray(xp.nan, dtype=r.dtype) if f.overflow == "nan" else xp.copysign(xp.inf, x).astype(r.dtype)
    return xp.where(past, big, r)


def round_fp8_bits(x, f, saturate=False):
    """round_formula(x, f.name, saturate) for a float32 array, on its bit pattern where it can: in f's normal range
    add half of f's spacing in the low 23 - (p - 1) bits (plus the last kept bit: ties to even) and clear them (a
    carry into the exponent is the rounding up to the next binade); below 2^emin the fixed subnormal spacing q =
    2^(emin - p + 1), rint(x / q) q (exact in float32: q is a power of two); past max as overflowed says."""
    xp = array_module(x)
    drop = 23 - (f.p - 1)                                     # the float32 significand bits f has not
    bits = x.view(xp.uint32)
    keep = xp.uint32((0xFFFFFFFF >> drop) << drop)
    normal = ((bits + xp.uint32((1 << (drop - 1)) - 1) + ((bits >> drop) & xp.uint32(1))) & keep).view(xp.float32)
    q = xp.float32(2.0 ** (f.emin - f.p + 1))
    with np.errstate(over="ignore", invalid="ignore"):
        sub = xp.rint(x / q) * q                              # (rint keeps the sign of a zero)
        r = xp.where(xp.abs(x) < xp.float32(2.0 ** f.emin), sub, normal)
        r = overflowed(r, x, f, saturate, xp)
    return xp.where(xp.isnan(x), x, r)


# ------------------------------------------------------------------------------------------------ mixed precision

LOW = ("bfloat16", "float16")          # the compute formats that are emulated: float32 arrays holding their values

# Every place a low-precision run rounds, in one table (the calls are numerics.round(x, point) in hsgd.tp.model,
# and comm.payload_round in hsgd.tp.layers' collectives). What is not here is not rounded: LayerNorm's mean and
# variance, the softmax of attention and of the loss (their maxima, sums, exponentials), the weight gradients
# (accumulated in float32 from compute-format inputs, as Megatron-LM's gradient-accumulation fusion does), the
# gradient buffers, the optimizer's state and the master weights it updates: all float32.
POINTS = {
    "weights":   "the model's copy of the float32 master weights, made once per step (ZeRO-3: each layer's "
                 "gathered weights, rounded in place when they arrive)",
    "matmul":    "the output of every matrix product (the linears, q k v, gate and up, the LM head's logits; q and k "
                 "after their rotation), accumulated in float32 on compute-format inputs, as a tensor core does",
    "attention": "the core attention's output (its scores and softmax stay float32 inside, as in a fused kernel)",
    "layernorm": "LayerNorm's or RMSNorm's output (its statistics in float32)",
    "gelu":      "GELU's or SwiGLU's output",
    "residual":  "the residual stream after each addition, and the embedding's sum",
    "grad":      "every activation gradient an operation hands back in the backward pass",
    "payload":   "the partial sums a tensor-parallel collective adds (Allreduce, Reduce-Scatter): rounded before "
                 "they travel; the sum is rounded at the next point",
    "reduce":    "the gradient exchange over dp_comm: each rank's gradient and the average, in --reduce-dtype",
}


class Numerics:
    """How a run rounds. compute: float32 or float64 (nothing is rounded, no array is touched: the run is exactly
    as without this object) or bfloat16 / float16 (emulated: round_to at every point of POINTS); reduce: the
    format of the gradient exchange (float32: not rounded). counts: how often each point rounded (tests)."""

    def __init__(self, compute="float32", reduce="float32"):
        self.compute, self.reduce = compute, reduce
        self.rounds = compute in LOW
        self.counts = dict.fromkeys(POINTS, 0)

    def rounded(self, x, fmt, point):
        """x rounded to fmt (a copy) at `point` of POINTS: the one place a value is rounded (hsgd.check.oracle's
        rounding-error model puts a random perturbation of the same size here instead, one draw per point)."""
        return round_to(x, fmt)

    def round(self, x, point):
        """x rounded to the compute format at `point` (a copy), or x itself when nothing is rounded."""
        if not self.rounds:
            return x
        self.counts[point] += 1
        return self.rounded(x, self.compute, point)

    def round_(self, x, point):
        """The same, in place (x[...] = rounded x); returns x."""
        if self.rounds:
            self.counts[point] += 1
            x[...] = self.rounded(x, self.compute, point)
        return x

    def weights(self, params):
        """The model's copy of the master weights {name: array}: rounded copies, or params itself."""
        if not self.rounds:
            return params
        self.counts["weights"] += 1
        return {n: self.rounded(p, self.compute, "weights") for n, p in params.items()}

    def payload(self, x):
        """A tensor-parallel collective's partial sums, rounded in place before they travel (comm.payload_round)."""
        return self.round_(x, "payload")

    def reduced(self, x):
        """A gradient (or a part of one) rounded in place to the exchange's format; x itself for float32."""
        if self.reduce in LOW:
            self.counts["reduce"] += 1
            x[...] = self.rounded(x, self.reduce, "reduce")
        return x


EXACT = Numerics()                      # float32 and float64 runs: nothing rounded


def make_numerics(dtype, reduce_dtype="float32"):
    """The Numerics of a run: --dtype (bfloat16 and float16 emulated; float32 and float64: nothing rounded) and
    --reduce-dtype."""
    return Numerics(dtype if dtype in LOW else "float32", reduce_dtype)
