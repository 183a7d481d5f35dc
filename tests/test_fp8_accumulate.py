"""hsgd.fp8.accumulate, the short tensor-core accumulator: chop_p is IEEE rounding where a named format has p bits, and
truncation is toward zero (a hand-worked product, to the bit); with 53 bits to nearest it is the sequential float64
sum and with 24 the sequential float32 loop, bit for bit; 14 bits truncated lose percents over K = 4096, as the
module docstring's estimate says, and promotion to float32 every 128 terms cuts that by about K / N_c or more."""
import math

import numpy as np
import pytest

from hsgd.fp8.accumulate import accumulation_error, chop, fp8_inputs, limited_matmul, unit
from hsgd.model.precision import FORMATS, gamma, round_to


def test_chop_to_nearest_is_the_named_formats_rounding():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(50_000) * 2.0 ** rng.integers(-5, 8, 50_000)).astype(np.float32)
    for fmt, p in (("float8_e4m3fn", 4), ("bfloat16", 8), ("float16", 11)):
        f = FORMATS[fmt]
        y = x[(np.abs(x) >= 2.0 ** f.emin) & (np.abs(x) < f.max)]   # fmt's normal range: chop has no exponent range
        ours = chop(y.astype(np.float64), p, "nearest")
        ref = round_to(y, fmt).astype(np.float64)
        print(f"chop to {p} bits vs round_to {fmt}: {int((ours != ref).sum())} of {y.size} differ")
        assert np.array_equal(ours, ref)


def test_truncation_rounds_toward_zero():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(20_000) * 2.0 ** rng.integers(-20, 20, 20_000)
    for p in (4, 14, 24):
        r = chop(x, p, "truncate")
        rel = np.abs(x - r) / np.abs(x)
        print(f"p = {p}: max relative cut {rel.max():.3e} (u = 2^(1-p) = {unit(p, 'truncate'):.3e})")
        assert (np.abs(r) <= np.abs(x)).all() and (np.sign(r) == np.sign(x)).all()
        assert rel.max() < unit(p, "truncate")
    # By hand, p = 4 (spacing 1/8 in [1, 2)), terms 1, 3/16, 3/16, 3/16 (exact sum 1.5625):
    #   truncate: 1 + 3/16 = 1.1875 -> 1.125;  + 3/16 = 1.3125 -> 1.25;  + 3/16 = 1.4375 -> 1.375
    #   nearest:  1.1875 = 9.5/8 -> 10/8 = 1.25 (tie, to even);  1.4375 -> 12/8 = 1.5;  1.6875 -> 14/8 = 1.75
    #   truncate, promoted every 2: block 1.125, block 3/8 (exact), float32 sum 1.5
    a = np.ones((1, 4))
    b = np.array([[1.0], [0.1875], [0.1875], [0.1875]])
    cases = [("truncate", None, 1.375), ("nearest", None, 1.75), ("truncate", 2, 1.5)]
    for mode, every, want in cases:
        got, neg = limited_matmul(a, b, 4, every, mode)[0, 0], limited_matmul(a, -b, 4, every, mode)[0, 0]
        print(f"{mode}, promote_every={every}: {got} and {neg} (by hand +-{want}, exact 1.5625)")
        assert got == want and neg == -want
    # terms all positive: every chop lowers the sum, so the product is below the exact one everywhere (above: negated)
    a, b = (np.abs(x) for x in fp8_inputs(8, 512, 8, seed=2))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    low, high = limited_matmul(a, b, 14, None), limited_matmul(a, -b, 14, None)
    print(f"positive terms: max (C - exact) / exact {((low - exact) / exact).max():.3e}, negated "
          f"{((high + exact) / exact).min():.3e}")
    assert (low < exact).all() and (high > -exact).all()


def test_53_bits_to_nearest_is_the_sequential_float64_sum():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((5, 300)), rng.standard_normal((300, 7))
    s = np.zeros((5, 7))
    for k in range(300):
        s = s + a[:, k, None] * b[None, k, :]                 # the sequential sum, each product and addition in float64
    ours = limited_matmul(a, b, 53, None, "nearest")
    err = np.abs(ours - a @ b).max() / np.abs(a @ b).max()
    print(f"53 bits: {int((ours != s).sum())} entries differ from the sequential sum; vs a @ b max rel err {err:.2e}")
    assert ours.dtype == np.float64 and np.array_equal(ours, s)
    assert err < 1e-13


def test_24_bits_to_nearest_is_the_float32_loop():
    a, b = fp8_inputs(6, 1000, 5, seed=4)                     # float32 holding FP8 values: products exact in float32
    s = np.zeros((6, 5), np.float32)
    for k in range(1000):
        s = s + a[:, k, None] * b[None, k, :]                 # float32 products (exact) and additions (rounded)
    ours = limited_matmul(a, b, 24, None, "nearest")
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    err = (np.abs(ours - exact) / scale).max()
    print(f"24 bits: {int((ours != s).sum())} entries differ from the float32 loop; error {err:.2e} of sum |t_k|, "
          f"gamma_1000(float32) = {gamma(1000, 'float32'):.2e}")
    assert ours.dtype == np.float32 and np.array_equal(ours, s)
    assert err <= gamma(1000, "float32")


def test_14_bits_truncated_lose_percents_at_K_4096():
    # the estimate K u / (8 ln 2) = 9.0% (u = 2^-13) assumes many-bit terms; FP8 products lose a little less. Below a
    # quarter of it the accumulator would not be losing a spacing's half per chop; above K u / 2 = 25%, more than a
    # whole spacing (the sums grow like k: sum_k s_k ~ K S / 2).
    K, u = 4096, unit(14, "truncate")
    e = accumulation_error(K, 14, None, "truncate")
    print(f"K = {K}, 14 bits truncated, no promotion: max rel err {e['max_rel']:.3%} (rms {e['rms_rel']:.3%}), "
          f"estimate {e['predicted']:.3%}, ceiling K u / 2 = {K * u / 2:.1%}")
    assert e["predicted"] / 4 < e["max_rel"] < K * u / 2


def test_promotion_every_128_cuts_the_error():
    # promotion runs the short accumulator over N_c = 128 terms instead of K = 4096: K / N_c = 32 times less by the
    # estimate, more for FP8 products (they lose nothing early in a block); asked for: a quarter of K / N_c at least.
    K, Nc = 4096, 128
    plain, promoted = accumulation_error(K, 14, None), accumulation_error(K, 14, Nc)
    ratio = plain["max_rel"] / promoted["max_rel"]
    print(f"K = {K}, 14 bits truncated: max rel err {plain['max_rel']:.3e} without promotion, "
          f"{promoted['max_rel']:.3e} promoted every {Nc} ({ratio:.0f}x less; estimate {K // Nc}x)")
    assert ratio >= K / Nc / 4
    assert promoted["max_rel"] < promoted["predicted"]        # the estimate is an upper one for FP8 products


@pytest.mark.parametrize("mode", ["truncate", "nearest"])
def test_float32_terms_follow_the_estimate(mode):
    # on terms with many bits the module docstring's estimates hold: truncation's mean error, nearest's rms
    e = accumulation_error(4096, 14, None, mode, fmt=None)
    figure = e["mean_rel"] if mode == "truncate" else e["rms_rel"]
    print(f"float32 terms, 14 bits {mode}: {figure:.3e} measured, {e['predicted']:.3e} estimated "
          f"(ratio {figure / e['predicted']:.2f})")
    assert abs(math.log(figure / e["predicted"])) < math.log(1.5 if mode == "truncate" else 2)


def test_a_mode_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="truncate"):
        limited_matmul(np.ones((1, 2)), np.ones((2, 1)), mode="stochastic")
