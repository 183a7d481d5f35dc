"""The 8-bit formats of hsgd.model.precision (Step 22's first piece): rounding to float8_e4m3fn and float8_e5m2, by
the readable formula (round_formula) and the fast path on float32's bit pattern (round_to, round_fp8_bits), equal bit
for bit to ml_dtypes' casts on every one of the 256 codes of each format and on float32 inputs of every class
(normal, subnormal in the 8-bit format and in float32, the exact ties between neighbours and one float32 step either
side of them, the overflow thresholds, zeros, infinities, NaN); float64 inputs rounded once; saturating as stated;
one rounding within the unit roundoff."""
import numpy as np
import pytest

from hsgd.model.precision import FORMATS, round_formula, round_to, unit_roundoff

ml_dtypes = pytest.importorskip("ml_dtypes")

TYPES = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def codes(fmt):
    """The 256 codes of fmt as float32 values (NaN codes included)."""
    return np.arange(256, dtype=np.uint8).view(TYPES[fmt]).astype(np.float32)


def inputs(fmt):
    """float32 inputs of every class for fmt: its codes, the midpoints of neighbouring codes (exact ties) and one
    float32 step either side, float32's own subnormals, a random spread over every binade, the specials."""
    c = np.unique(codes(fmt)[np.isfinite(codes(fmt))])
    mids = ((c[1:].astype(np.float64) + c[:-1]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    top = FORMATS[fmt].max
    edges = np.array([top, top * 1.0625, top * 1.125, top * 1.2, 2 * top, 1e30, np.finfo(np.float32).max],
                     np.float32)
    rng = np.random.default_rng(0)
    spread = (rng.standard_normal(20_000) * 2.0 ** rng.integers(-30, 20, 20_000)).astype(np.float32)
    tiny = np.array([1e-45, 1e-40, 2.0 ** -126, 0.0, -0.0], np.float32)
    special = np.array([np.inf, -np.inf, np.nan], np.float32)
    x = np.concatenate([c, mids, near, edges, spread, tiny, special])
    return np.concatenate([x, -x])


def same_bits(a, b, t):
    """a and b (float32 arrays) cast to t are the same codes, a NaN counted equal to any NaN."""
    na, nb = np.isnan(a), np.isnan(b)
    return (na == nb) & (na | (a.astype(t).view(np.uint8) == b.astype(t).view(np.uint8)))


@pytest.mark.parametrize("fmt", list(TYPES))
def test_every_code_is_its_own_rounding(fmt):
    c = codes(fmt)
    for name, fn in (("fast path", round_to), ("formula", round_formula)):
        r = fn(c, fmt)
        ok = (np.isnan(c) & np.isnan(r)) | (r == c)
        print(f"{fmt} {name}: {int(ok.sum())}/256 codes unchanged ({int(np.isnan(c).sum())} NaN codes stay NaN)")
        assert ok.all(), c[~ok]


@pytest.mark.parametrize("fmt", list(TYPES))
def test_rounding_equals_ml_dtypes_bit_for_bit(fmt):
    t, x = TYPES[fmt], inputs(fmt)
    ref = x.astype(t).astype(np.float32)
    fast, plain = round_to(x, fmt), round_formula(x, fmt)
    same_fast, same_plain = same_bits(fast, ref, t), same_bits(plain, ref, t)
    exact = np.isnan(fast) | (fast.astype(t).astype(np.float32) == fast)             # a number of the format
    twin = np.array_equal(np.where(np.isnan(fast), 0, fast).view(np.uint32),
                          np.where(np.isnan(plain), 0, plain).view(np.uint32)) and \
        np.array_equal(np.isnan(fast), np.isnan(plain))
    print(f"{fmt}: {x.size} float32 inputs; fast path equal to ml_dtypes on {int(same_fast.sum())}, the formula on "
          f"{int(same_plain.sum())}; fast path == formula bit for bit: {twin}; not representable: "
          f"{int((~exact).sum())}")
    assert same_fast.all() and same_plain.all() and exact.all() and twin, x[~(same_fast & same_plain)][:10]


@pytest.mark.parametrize("fmt", list(TYPES))
def test_float64_inputs_are_rounded_once(fmt):
    """A float64 value is rounded to the format directly (through float32 first would round twice)."""
    t = TYPES[fmt]
    mids = ((np.unique(codes(fmt)[np.isfinite(codes(fmt))])[1:].astype(np.float64)
             + np.unique(codes(fmt)[np.isfinite(codes(fmt))])[:-1]) / 2)
    x = np.concatenate([mids + mids * 2.0 ** -40, mids - mids * 2.0 ** -40, np.random.default_rng(1).standard_normal(
        20_000) * 2.0 ** np.random.default_rng(2).integers(-20, 17, 20_000)])
    ours = round_to(x, fmt)
    ref = x.astype(t).astype(np.float64)
    same = np.where(np.isnan(ref), np.isnan(ours), ours == ref)
    twice = ~np.where(np.isnan(ref), True, x.astype(np.float32).astype(t).astype(np.float64) == ref)
    print(f"{fmt}: {x.size} float64 inputs, equal to ml_dtypes' direct cast on {int(same.sum())}; through float32 "
          f"first would differ on {int(twice.sum())}")
    assert same.all() and twice.sum() >= 1


@pytest.mark.parametrize("fmt", list(TYPES))
def test_saturating_clamps_past_max(fmt):
    """saturate=True: a value past max, or an infinity, becomes +-max (ml_dtypes' cast of the clipped value); a NaN
    stays NaN; within range nothing changes."""
    t, x, top = TYPES[fmt], inputs(fmt), FORMATS[fmt].max
    ref = np.clip(x, -top, top).astype(t).astype(np.float32)
    for name, fn in (("fast path", round_to), ("formula", round_formula)):
        sat = fn(x, fmt, saturate=True)
        ok = same_bits(sat, ref, t)
        print(f"{fmt} saturating, {name}: {int(ok.sum())}/{x.size} equal to the clipped cast; largest |value| "
              f"{np.nanmax(np.abs(sat)):g}")
        assert ok.all() and np.nanmax(np.abs(sat)) == top


@pytest.mark.parametrize("fmt", list(TYPES))
def test_one_rounding_is_within_the_unit_roundoff(fmt):
    f, u = FORMATS[fmt], unit_roundoff(fmt)
    x = np.random.default_rng(3).uniform(1, 2, 100_000) * 2.0 ** np.random.default_rng(4).integers(f.emin, 8, 100_000)
    x = x[np.abs(x) <= f.max]
    rel = np.abs(round_to(x.astype(np.float32), fmt) - x.astype(np.float32)) / np.abs(x.astype(np.float32))
    print(f"{fmt}: largest relative rounding error {rel.max():.4f}, u = 2^-{f.p} = {u:.4f} (at 1 + u/2 of a binade "
          f"it is u/(1 + u) = {u / (1 + u):.4f})")
    assert rel.max() <= u and rel.max() > 0.95 * u / (1 + u)
