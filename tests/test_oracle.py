"""hsgd.check.oracle's rounding-error model, one process: the perturbation is uniform on [-1, 1), a function of the
value (replicas stay replicas) and of the salt; a perturbed rounding is at most u away, relatively, and its rms is at
least a real rounding's; a value the format holds is left alone, and each rounding point draws its own error; how the
band is made of the model's draws."""
import numpy as np

from hsgd.check.oracle import Perturbed, differences, spread, uniform_of
from hsgd.check.verdict import Verdict
from hsgd.model.precision import Numerics, round_to, unit_roundoff


def test_the_perturbation_is_uniform_and_a_function_of_the_value():
    x = np.random.default_rng(0).standard_normal(200_000)
    e = uniform_of(x, salt=1)
    hist = np.histogram(e, bins=10, range=(-1, 1))[0] / len(e)
    print(f"mean {e.mean():.1e}, variance {e.var():.4f} (uniform: 1/3), bins {np.round(hist, 3)}")
    assert -1 <= e.min() and e.max() < 1 and abs(e.mean()) < 0.01 and abs(e.var() - 1 / 3) < 0.01
    assert np.all(np.abs(hist - 0.1) < 0.005)
    assert np.array_equal(e, uniform_of(x.copy(), salt=1))                      # the same values, the same e
    assert np.array_equal(uniform_of(np.array([x[5]] * 3), 1), [e[5]] * 3)
    assert abs(np.corrcoef(e, uniform_of(x, salt=2))[0, 1]) < 0.01                # another salt, another draw


def test_a_perturbed_rounding_is_as_large_as_a_real_one_can_be():
    for fmt in ("bfloat16", "float16"):                    # (inside each format's normal range: 1e-3 .. 1e3)
        rng = np.random.default_rng(1)
        x = rng.standard_normal(200_000) * 10.0 ** rng.integers(-3, 3, 200_000)
        x = x[np.abs(x) > 1e-4]
        u, model, real = unit_roundoff(fmt), Perturbed(fmt, salt=7), Numerics(fmt)
        mine = np.abs(model.round(x, "matmul") / x - 1)
        x32 = x.astype(np.float32)
        theirs = np.abs(real.round(x32, "matmul").astype(np.float64) / x32 - 1)
        assert np.array_equal(real.round(x32, "matmul"), round_to(x32, fmt))
        rms_mine, rms_theirs = np.sqrt(np.mean(mine ** 2)), np.sqrt(np.mean(theirs ** 2))
        print(f"{fmt}: u = {u:.1e}; model: max {mine.max() / u:.3f} u, rms {rms_mine / u:.3f} u (1/sqrt 3 = 0.577); "
              f"rounding: max {theirs.max() / u:.3f} u, rms {rms_theirs / u:.3f} u")
        assert mine.max() <= u * (1 + 1e-12) and theirs.max() <= u
        assert abs(rms_mine / u - 3 ** -0.5) < 0.01 and rms_theirs < rms_mine
        held = np.array([1.0, 0.5, -3.0, 2.0 ** -20, 0.0])                 # numbers of the format: left alone
        assert np.array_equal(model.round(held, "layernorm"), held)
        other = model.round(x, "layernorm")                                  # another point, another draw
        assert abs(np.corrcoef(other / x - 1, model.round(x, "matmul") / x - 1)[0, 1]) < 0.01


def test_the_band_is_lambda_times_the_models_rms_plus_the_float32_allowance():
    """The model's variance is the draws' spread (two draws: half their squared difference); m_L its rms over the
    seeds; between layouts the two in quadrature; a NaN observed (or a band that is not finite) is outside; with
    --loss-steps the median is held to the band."""
    ref = {"w": np.ones(4)}
    a, b = {"w": np.array([1.0, 1.0, 1.0, 1.006])}, {"w": np.ones(4)}
    assert np.isclose(spread([a, b], ref)["w"], differences(a, b, ref)["w"] ** 2 / 2)
    three = [a, b, {"w": np.array([1.0, 1.0, 1.0, 0.994])}]                       # deviations 6e-3, 0, -6e-3
    assert np.isclose(spread(three, ref)["w"], 3e-3 ** 2)               # d = 0.006 / ||ref|| = 3e-3, 0, 3e-3
    v = Verdict([(1, 1, 1, 1), (2, 1, 1, 4)], ["w"], "bfloat16", tokens=128)
    v.add((1, 1, 1, 1), {"w": 1e-3}, {"w": 0.0}, {"w": 3e-3 ** 2}, {"w": 0.0})
    v.add((1, 1, 1, 1), {"w": 2e-3}, {"w": 0.0}, {"w": 4e-3 ** 2}, {"w": 0.0})
    v.add((2, 1, 1, 4), {"w": 1e-3}, {"w": 2e-3}, {"w": 0.0}, {"w": 1e-16})
    v.add((2, 1, 1, 4), {"w": 2e-1}, {"w": 2e-3}, {"w": 0.0}, {"w": 1e-16})
    rms = np.sqrt((3e-3 ** 2 + 4e-3 ** 2) / 2)
    allowance = 4 * np.sqrt(128) * 2.0 ** -24
    assert np.isclose(v.band((1, 1, 1, 1), "w"), 4 * rms + allowance) and np.isclose(v.reorder32, allowance)
    assert np.isclose(v.band((2, 1, 1, 4), "w", base=True), 4 * rms + allowance)         # hypot(0, rms)
    bad, inexact = v.outside()
    assert [(r[0], r[1]) for r in bad] == [((2, 1, 1, 4), "w")] and inexact == []      # 2e-1 > 4 x 0
    nan = differences({"w": np.array([np.nan, 1.0])}, {"w": np.ones(2)}, {"w": np.ones(2)})
    v.add((1, 1, 1, 1), nan, {"w": 0.0}, {"w": 3e-3}, {"w": np.nan})
    assert nan["w"] == np.inf and ((1, 1, 1, 1), "w") in [(r[0], r[1]) for r in v.outside()[0]]
    assert v.outside()[1] == [(1, 1, 1, 1)]                                          # a NaN is not exact
    s = Verdict([(1, 1, 1, 1)], ["loss"], "bfloat16", tokens=128)
    for seen in (1e-3, 1e-3, 5.0):                                                   # one wild seed of three
        s.add((1, 1, 1, 1), {"loss": seen}, {"loss": 0.0}, {"loss": 2e-3 ** 2}, {"loss": 0.0})
    assert s.scalar and s.outside() == ([], [])
