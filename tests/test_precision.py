"""hsgd.model.precision and hsgd.step.loss_scale, one process: rounding to bfloat16 and float16 equals ml_dtypes' and
NumPy's casts bit for bit (every float32 bit pattern class: normals of every exponent, subnormals, ties, overflow, inf,
NaN, signed zeros; float64 inputs rounded once); the unit roundoff bounds every rounding; GradScaler's rules."""
import numpy as np
import pytest

from hsgd.step.loss_scale import LossScaler
from hsgd.model.precision import FORMATS, gamma, round_formula, round_to, unit_roundoff

ml_dtypes = pytest.importorskip("ml_dtypes")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")    # the reference casts of NaN and of overflow


def sample_inputs():
    """float32 test tensors: every bit pattern class, many exponents, and exact ties of bfloat16 and float16."""
    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)   # any float32
    scaled = (rng.standard_normal(100_000) * 10.0 ** rng.integers(-45, 39, 100_000)).astype(np.float32)
    # ties: a bfloat16 number plus half its spacing (the 16 low bits 0x8000), with an even and an odd last bit
    bf_ties = ((rng.integers(0, 2 ** 16, 20_000, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000).view(np.float32)
    h = rng.integers(0, 2 ** 16, 20_000, dtype=np.uint64).astype(np.uint16).view(np.float16)
    h = h[np.isfinite(h)].astype(np.float32)
    f16_ties = (h.view(np.uint32) | np.uint32(1 << 12)).view(np.float32)     # half a float16 spacing above h
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 3.3895e38, 3.39e38,
                        2.0 ** -126, 2.0 ** -133, 2.0 ** -134, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25], np.float32)
    return np.concatenate([patterns, scaled, bf_ties, f16_ties, special, -special])


def bits(a, dtype):
    return a.astype(dtype).view(np.uint16)


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
def test_rounding_equals_the_reference_casts_bit_for_bit(fmt):
    ref_dtype = ml_dtypes.bfloat16 if fmt == "bfloat16" else np.float16
    x = sample_inputs()
    ours = round_to(x, fmt)
    plain = round_formula(x, fmt)                                         # the formula the fast path must equal
    assert ours.dtype == np.float32 and np.array_equal(ours.view(np.uint32), plain.view(np.uint32))
    same = bits(ours, ref_dtype) == bits(x, ref_dtype)         # our value is the one the reference cast makes
    exact = np.isnan(ours) | (ours.astype(ref_dtype).astype(np.float32) == ours)   # and it is a fmt number
    print(f"{fmt}: {x.size} float32 inputs, {int(same.sum())} equal to the reference cast bit for bit, "
          f"{int((~exact).sum())} results not representable")
    assert same.all() and exact.all(), x[~same][:10]
    rng = np.random.default_rng(1)
    x64 = rng.standard_normal(100_000) * 10.0 ** rng.integers(-40, 39, 100_000)
    x64 = np.concatenate([x64, [1 + 2.0 ** -8 + 2.0 ** -30, 1 + 2.0 ** -11 + 2.0 ** -40]])   # ties only in float32
    same64 = bits(round_to(x64, fmt), ref_dtype) == bits(x64, ref_dtype)
    twice = bits(x64.astype(np.float32), ref_dtype) != bits(x64, ref_dtype)
    print(f"{fmt}: float64 inputs rounded once, equal to the reference {int(same64.sum())}/{x64.size}; rounding "
          f"through float32 first would differ on {int(twice.sum())}")
    assert same64.all() and twice.sum() >= 1


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "float32"])
def test_one_rounding_is_within_the_unit_roundoff(fmt):
    f, u = FORMATS[fmt], unit_roundoff(fmt)
    x = np.random.default_rng(3).standard_normal(100_000) * 10.0 ** np.random.default_rng(4).integers(-3, 4, 100_000)
    x = x[(np.abs(x) >= 2.0 ** f.emin) & (np.abs(x) <= f.max)]                # the normal range
    rel = np.abs(round_to(x, fmt) - x) / np.abs(x)
    print(f"{fmt}: largest relative rounding error {rel.max():.3e}, u = 2^-{f.p} = {u:.3e}")
    assert rel.max() <= u and rel.max() > 0.9 * u                         # the bound holds and is reached


def test_gamma_bounds_a_sum_in_any_order():
    """A sum of n float16 numbers, accumulated in float16 (every addition rounded), in two orders: each within
    gamma_(n-1) sum |x| of the exact sum, so within 2 gamma_(n-1) sum |x| of each other."""
    rng = np.random.default_rng(5)
    n = 200
    worst = 0.0
    for _ in range(20):
        x = round_to(rng.standard_normal(n), "float16")
        exact = float(np.sum(x.astype(np.float64)))
        for order in (np.arange(n), rng.permutation(n)):
            s = 0.0
            for v in x[order]:
                s = float(round_to(np.array([s + v]), "float16")[0])
            worst = max(worst, abs(s - exact) / float(np.abs(x).sum()))
    bound = gamma(n - 1, "float16")
    print(f"float16 sums of {n}: largest error {worst:.2e} of sum |x|, gamma_{n - 1} = {bound:.2e}")
    assert 0 < worst <= bound
    assert gamma(300, "bfloat16") == float("inf") and gamma(1, "float64") == pytest.approx(2.0 ** -53)


def test_loss_scaler_follows_gradscalers_rules():
    s = LossScaler()
    assert s.scale == 2.0 ** 16
    assert [s.update(True) for _ in range(3)] == [False] * 3 and s.scale == 2.0 ** 13 and s.skipped == 3
    for _ in range(1999):
        assert s.update(False)
    assert s.scale == 2.0 ** 13 and s.good_steps == 1999
    s.update(False)                                                     # the 2000th good step in a row: grow
    assert s.scale == 2.0 ** 14 and s.good_steps == 0
    for _ in range(1500):
        s.update(False)
    s.update(True)                                                      # an inf resets the count
    assert s.scale == 2.0 ** 13 and s.good_steps == 0
    t = LossScaler(init_scale=8.0, growth_interval=2)
    t.load(s.state())
    assert t.state() == s.state() == {"scale": 2.0 ** 13, "good_steps": 0, "skipped": 4}
    with pytest.raises(ValueError):
        LossScaler(backoff_factor=1.5)


# ------------------------------------------------------------------------------------------------ mixed precision

def one_process_trainer(dtype, loss_scale="dynamic", batch=1024, **kw):
    """A HybridTrainer of a small model on this process alone (COMM_SELF), float16 activations gradients small
    enough to underflow at batch 1024 x 16 positions."""
    from hsgd.model.config import ModelConfig
    from mpi4py import MPI

    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer
    from hsgd.step.settings import TrainConfig
    cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=2, n_layers=2, d_ff=64)
    tc = TrainConfig(dtype=dtype, loss_scale=loss_scale, steps=10, batch_size=batch, lr=0.05, warmup=0, threads=1,
                     **kw)
    return HybridTrainer(cfg, ProcessGrid(MPI.COMM_SELF, dp=1, tp=1), tc)


def batch(n, seed=0):
    from hsgd.model.data import Corpus
    corpus = Corpus(np.random.default_rng(seed).integers(0, 256, 200_000, dtype=np.uint8).tobytes(), "random", 16)
    return corpus.batch(0, 1, n)


def test_float32_and_float64_round_nothing():
    from hsgd.model.precision import EXACT, Numerics
    x = np.arange(5.0)
    params = {"w": x}
    for num in (EXACT, Numerics("float64"), Numerics("float32")):
        assert num.round(x, "matmul") is x and num.weights(params) is params and num.reduced(x) is x
        assert num.round_(x, "grad") is x and not num.rounds and not any(num.counts.values())
    tr = one_process_trainer("float32", batch=8)
    tr.step(*batch(8), 1)
    assert not tr.scaler.dynamic and not any(tr.num.counts.values()) and tr.stage.loss_scale == 1.0
    tr.grid.free()


class CountingZeros:
    """Wraps a trainer's Numerics: counts the activation-gradient entries that the "grad" rounding flushes to zero."""

    def __init__(self, num):
        self.num, self.flushed, self.seen = num, 0, 0

    def __getattr__(self, name):
        return getattr(self.num, name)

    def round(self, x, point):
        y = self.num.round(x, point)
        if point == "grad":
            self.flushed += int((y == 0).sum() - (x == 0).sum())
            self.seen += x.size
        return y


def test_float16_underflows_without_loss_scaling_and_not_with_it():
    """One step's gradient on a batch of 512 x 16 positions: the float16 activation gradients of the mean loss are
    ~1/(N V) small; without loss scaling some flush to zero and the first block's gradient is far off the
    float32 one; with the loss scaled by 2^16 they stay in range and the gradient is within float16's rounding."""
    idx, targets = batch(512)
    grads, flushed = {}, {}
    for dtype, scaling in (("float32", "none"), ("float16", "none"), ("float16", "dynamic")):
        tr = one_process_trainer(dtype, scaling)
        tr.use_numerics(CountingZeros(tr.num))                        # (tr.num is the stage's)
        tr.gradients(idx, targets)
        grads[dtype, scaling] = {n: g / tr.stage.loss_scale for n, g in tr.grads.items()}
        flushed[dtype, scaling] = tr.num.flushed / max(tr.num.seen, 1)
        tr.grid.free()
    ref = grads["float32", "none"]
    floor = 1e-3 * max(float(np.abs(g).max()) for g in ref.values())      # (the k bias's gradient is ~0)
    err = {k: max(float(np.abs(g[n] - ref[n]).max() / max(np.abs(ref[n]).max(), floor)) for n in ref)
           for k, g in grads.items()}
    print(f"float16, no loss scaling: max rel gradient error {err['float16', 'none']:.2e}, activation-gradient "
          f"entries flushed to zero {100 * flushed['float16', 'none']:.1f}%; loss scale 2^16: "
          f"{err['float16', 'dynamic']:.2e}, {100 * flushed['float16', 'dynamic']:.1f}%")
    assert err["float16", "none"] > 0.1 and flushed["float16", "none"] > 0.01
    assert err["float16", "dynamic"] < 0.01 and flushed["float16", "dynamic"] < 1e-4


def test_an_overflow_skips_the_update_and_halves_the_scale():
    """A loss scale far too large: every rank skips the update and halves S, step after step, until the gradients
    fit float16; the first update then applies the unscaled gradient."""
    tr = one_process_trainer("float16", batch=8)
    tr.scaler.scale = 2.0 ** 40                         # dloss = 2^40 / m: the activation gradients overflow float16
    before = tr.exchange.master.copy()
    infos, untouched = [], True
    while not infos or np.isnan(infos[-1].lr):
        infos.append(tr.step(*batch(8), len(infos) + 1))
        untouched &= bool(np.isnan(infos[-1].lr) <= np.array_equal(tr.exchange.master, before))
        assert len(infos) < 40
    skips = len(infos) - 1
    print(f"S = 2^40: {skips} updates skipped, S halved each time; the first applied with S = "
          f"2^{np.log2(infos[-1].loss_scale):g}")
    assert skips >= 1 and untouched                      # a skipped step leaves every parameter as it was
    assert [i.loss_scale for i in infos] == [2.0 ** (40 - k) for k in range(len(infos))]
    assert infos[-1].scale_skips == skips and not np.array_equal(tr.exchange.master, before)
    tr.grid.free()


def test_a_stale_gradient_is_unscaled_by_the_scale_it_was_made_with():
    """float16 with --dp-staleness 1: the update of step s applies step s-1's gradient, made with step s-1's S; the
    scaler may have changed S since (here: grown, growth interval 2), so it is unscaled by the S it carries, not the
    current one."""
    tr = one_process_trainer("float16", batch=8, dp_staleness=1, momentum=0.0)
    tr.scaler.scale, tr.scaler.growth_interval = 2.0 ** 10, 2
    found = None
    for step in range(1, 8):
        loss = tr.gradients(*batch(8, seed=step))
        made_with, made_now = tr.scaler.made_with(tr.exchange.lag), tr.stage.loss_scale
        g = None if tr.exchange.grads() is None else tr.exchange.grads().copy()    # the average it applies, scaled
        before = tr.exchange.master.copy()
        info = tr.update(loss, step)
        if g is not None and made_with != made_now:
            found = (step, made_with, made_now, g, info.lr, before)
            break
    assert found is not None
    step, made_with, made_now, g, lr, before = found
    right = before - lr * (g / made_with)                       # plain SGD (momentum 0), no clipping
    err = float(np.abs(tr.exchange.master - right).max() / np.abs(right - before).max())
    print(f"step {step}: the applied gradient was made with S = 2^{np.log2(made_with):g}, the step's S is "
          f"2^{np.log2(made_now):g}; update vs g / S_made {err:.1e}")
    assert made_now == 2 * made_with and err < 1e-5
    wrong = before - lr * (g / made_now)
    assert not np.allclose(tr.exchange.master, wrong, rtol=0, atol=0.1 * float(np.abs(right - before).max()))
    tr.grid.free()


def test_with_staleness_an_overflow_is_one_back_off():
    """float16, S = 2^40 at first, the same batch every step: with --dp-staleness 1 the scaler judges each step's
    own gradient (made with the current S), not the late one it applies, so S comes down to where it does without
    staleness, one halving per overflow, and the first update is applied one step later."""
    idx, targets = batch(8)
    first = {}
    for stale in (0, 1):
        tr = one_process_trainer("float16", batch=8, dp_staleness=stale)
        tr.scaler.scale = 2.0 ** 40
        for step in range(1, 40):
            info = tr.step(idx, targets, step)
            if not np.isnan(info.lr) and (not stale or step > 1):
                first[stale] = (step, tr.scaler.scale, tr.scaler.skipped)
                break
        tr.grid.free()
    print(f"first update applied (step, S after, back-offs): without staleness {first[0]}, with {first[1]}")
    assert first[1] == (first[0][0] + 1, first[0][1], first[0][2])
