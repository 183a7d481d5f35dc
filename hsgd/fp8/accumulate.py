"""FP8 matrix products with a short accumulator, emulated: what a tensor core's partial sums lose, and what promoting
them to float32 every N_c terms buys back.

    python -c "from hsgd.fp8.accumulate import accumulation_error as e; print(e()); print(e(promote_every=None))"

The DeepSeek-V3 report (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 3.3.2, "Increasing accumulation
precision") measured that the FP8 GEMMs of NVIDIA H800 tensor cores keep only about 14 bits of their running sum,
for a largest relative error near 2% at K = 4096 in its test, and fixed it by copying the partial sums into float32
registers on the CUDA cores every N_c = 128 terms. Fasi, Higham, Mikaitis and Pranesh 2021 ("Numerical behavior of
NVIDIA tensor cores") found that tensor cores align the addends' significands by truncation: the bits shifted out
are dropped, a rounding toward zero, not to nearest. This module is that accumulator as a formula:

    C[i, j] = sum_k A[i, k] B[k, j],   K terms t_k = A[i, k] B[k, j], each exact in float64 (an FP8 product has at
                                       most 8 significant bits)
    s_0 = 0;   s_k = chop_p(s_{k-1} + t_k)        the partial sum, p = acc_bits significant bits (leading bit in)
    every N_c terms:  c = fl32(c + s);  s = 0     promotion: added into the float32 accumulator c, restart
    C[i, j] = fl32(c + s)                          (no promotion: C[i, j] = s, in A's dtype)

chop_p keeps p significant bits: x = M 2^(e - p), 2^(p-1) <= |M| < 2^p, with M an integer cut toward zero ("truncate")
or rounded to the nearest, ties to even ("nearest"). The accumulator has no exponent range (no overflow, no
subnormals): only its significand is short. (hsgd.model.precision.round_formula does the nearest rounding for the
named formats, each with its exponent range; here p is a parameter and truncation is a second mode, so chop_p is a
three-line frexp / ldexp of its own.)

One chop's relative error is below u = 2^(1 - p) toward zero (truncation) or 2^-p (nearest), so Higham's bound for
a sum (hsgd.model.precision.gamma, with this u) holds: |C - sum t_k| <= gamma_K sum |t_k| after K chops, about K u.
Typical errors, on terms of one sign whose sum S grows like s_k ~ k S / K: within a binade the spacing of s is
2^(1-p) 2^e with 2^e / s averaging 1 / (2 ln 2), and its square 3 / (8 ln 2). Truncation loses half a spacing on
average at every chop, always the same way, so the losses add up; rounding to nearest errs by a uniform amount in
+-half a spacing, variance spacing^2 / 12, and the errors cancel like a random walk:

    truncate:  |C - S| / S  ~  (u / (4 ln 2)) (1 / K) sum_k k                ~  K u / (8 ln 2)
    nearest:   |C - S| / S  ~  u sqrt((1 / (8 ln 2)) (1 / K^2) sum_k k^2)    ~  u sqrt(K / (24 ln 2))   (rms)

9.0% and 0.096% at K = 4096, p = 14. Promotion caps the run of the short accumulator at N_c terms. Each block's
error is the formula with K -> N_c, as a fraction of the block's sum S N_c / K; the K / N_c blocks' errors add
(truncation) or cancel (nearest); the float32 additions, to nearest, add about 2^-24 sqrt((K / N_c) / (24 ln 2)):

    truncate:  |C - S| / S  ~  N_c u / (8 ln 2)                  (0.28% for N_c = 128: K / N_c = 32 times less)
    nearest:   |C - S| / S  ~  N_c u / sqrt(24 ln 2 K)           (0.003%, rms)

These estimates take the chopped bits as uniform over a spacing of s, true for terms with many significant bits
(float32 inputs: measured/estimated 0.90 truncating, 0.87 to nearest, tests/test_fp8_accumulate.py). An FP8
product has at most 8, so it loses nothing while the spacing of s is below its last bit (s under about 2^(p-8)
|t_k|) and less than half a spacing a while after: a block of 128 spends much of its run there, and promoted FP8
products come out about 4 times below the estimate (the sums of 4096, mostly past it, somewhat below: a mean of
7.5% against 9.0%; benchmarks/bench_fp8_accumulate.py prints the figures).

How the hardware adds (several products at once, aligned to the largest exponent among them, then into the
accumulator) cuts the number of chops, and so the error, by the number of products fused per addition; this module
adds one term at a time. (Chapter 15 fuses four exact products per chop and measures 2.4% at K = 4096, p = 14,
near DeepSeek's figure: a guess at the cause, not a measurement of any hardware.)

What it leaves out: the FP8 scaling factors (per-tensor or per-tile, applied after the product) and the exponent
range of the accumulator. The sum s_{k-1} + t_k is formed in float64 before the chop: exact while the two exponents
differ by less than 53 - p bits (always, for FP8 products of similar scales).
"""
import math

import numpy as np

from hsgd.model.backend import array_module
from hsgd.model.precision import FORMATS, round_to

MODES = ("truncate", "nearest")


def chop(x, p, mode="truncate"):
    """x (a float64 array) with p significant bits kept: toward zero ("truncate") or to nearest, ties to even."""
    xp = array_module(x)
    m, e = xp.frexp(x)                                        # x = m 2^e, 1/2 <= |m| < 1 (m = 0 for x = 0)
    M = xp.ldexp(m, p)                                        # 2^(p-1) <= |M| < 2^p: the significand, p bits
    M = xp.trunc(M) if mode == "truncate" else xp.rint(M)     # cut toward zero, or to the nearest (ties to even)
    return xp.ldexp(M, e - p)


def limited_matmul(a, b, acc_bits=14, promote_every=128, mode="truncate"):
    """a (N, K) @ b (K, M) as an emulated FP8 tensor core computes it (the module docstring's recurrence): the K
    products added one k at a time into a partial sum of acc_bits significant bits (chopped by `mode` after every
    addition), promoted into a float32 accumulator every `promote_every` terms (None or 0: never; then the partial
    sum is the result). Returns (N, M) in a's dtype: float32 inputs get a float32 result; float64 inputs without
    promotion get the partial sum itself (acc_bits = 53, "nearest": the sequential float64 sum)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    if not 1 <= acc_bits <= 53:
        raise ValueError(f"acc_bits={acc_bits}: a float64 holds 1 to 53 significant bits")
    xp = array_module(a)
    N, K = a.shape
    M = b.shape[1]
    a64, b64 = a.astype(xp.float64), b.astype(xp.float64)
    s = xp.zeros((N, M), xp.float64)                          # (N, M) the partial sum, acc_bits bits
    c = xp.zeros((N, M), xp.float32)                          # (N, M) the float32 accumulator (CUDA-core registers)
    for k in range(K):
        t = a64[:, k, None] * b64[None, k, :]                 # (N, M) the k-th products (exact for float32 inputs)
        s = chop(s + t, acc_bits, mode)                       # s_k = chop_p(s_{k-1} + t_k)
        if promote_every and (k + 1) % promote_every == 0:
            c = (c + s).astype(xp.float32)                    # c = fl32(c + s): promoted
            s = xp.zeros_like(s)                              # and the partial sum restarts
    if not promote_every:
        return s.astype(a.dtype)
    return (c + s).astype(xp.float32).astype(a.dtype)         # the last, short block (if K is not a multiple of N_c)


def unit(acc_bits, mode):
    """The bound on one chop's relative error: u = 2^(1 - p) for truncation, 2^-p to nearest."""
    return 2.0 ** (1 - acc_bits) if mode == "truncate" else 2.0 ** -acc_bits


def predicted(K, acc_bits=14, promote_every=128, mode="truncate"):
    """The typical relative error on terms of one sign (the module docstring's estimates): truncation's mean,
    n u / (8 ln 2), or nearest's rms, u sqrt(n / (24 ln 2)) sqrt(n / K), for runs of n = min(K, N_c) terms (n = K
    without promotion), plus the promotions' float32 rounding, 2^-24 sqrt((K / n) / (24 ln 2))."""
    u, n = unit(acc_bits, mode), min(K, promote_every or K)
    f32 = 2.0 ** -24 * math.sqrt(K / n / (24 * math.log(2))) if n < K else 0.0
    if mode == "truncate":
        return n * u / (8 * math.log(2)) + f32
    return u * math.sqrt(n / (24 * math.log(2))) * math.sqrt(n / K) + f32


def fp8_inputs(N, K, M, mean=1.0, seed=0, fmt="float8_e4m3fn"):
    """a (N, K) and b (K, M) float32 as a FP8 GEMM gets them: entries mean + N(0, 1), scaled per tensor so the largest
    is the format's max (448 for e4m3), rounded to `fmt` (saturating; fmt None: left in float32, the check of the
    estimates on terms with many bits). A positive mean makes the sums grow like k, the case where truncation's
    bias shows, as in DeepSeek's test (which does not state its distribution)."""
    rng = np.random.default_rng(seed)
    out = []
    for shape in ((N, K), (K, M)):
        x = (mean + rng.standard_normal(shape)).astype(np.float32)
        if fmt is not None:
            x *= np.float32(FORMATS[fmt].max / np.abs(x).max())   # per-tensor scale: the largest entry at fmt's max
            x = round_to(x, fmt, saturate=True)
        out.append(x)
    return out


def accumulation_error(K=4096, acc_bits=14, promote_every=128, mode="truncate", seed=0, n=16, m=16, mean=1.0,
                       fmt="float8_e4m3fn"):
    """The error of limited_matmul on fp8_inputs(n, K, m, mean, seed, fmt) against the float64 product, over its n m
    entries: {"max_rel", "mean_rel", "rms_rel": of |C - C64| / |C64|; "max_abs_rel": max |C - C64| / (|a| |b|), the
    quantity gamma_K bounds (read this one for mean = 0, where entries of C64 near zero make the relative error
    meaningless); "predicted": the module docstring's estimate, truncation's mean or nearest's rms}."""
    a, b = fp8_inputs(n, K, m, mean, seed, fmt)
    exact = a.astype(np.float64) @ b.astype(np.float64)      # (n, m) float64: off by ~1e-16, nothing next to these
    err = np.abs(limited_matmul(a, b, acc_bits, promote_every, mode).astype(np.float64) - exact)   # (n, m)
    rel = err / np.abs(exact)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)                             # (n, m)
    return {"max_rel": float(rel.max()), "mean_rel": float(rel.mean()), "rms_rel": float(np.sqrt(np.mean(rel ** 2))),
            "max_abs_rel": float((err / scale).max()), "predicted": predicted(K, acc_bits, promote_every, mode)}
