"""Solutions to the exercises of chapter 14 (tutorials/14_floating_point.py).

    mpirun -n 2 python tutorials/solutions/14_floating_point.py

Exercises 1 to 3 are arithmetic on one process that every rank does (cheap), checked collectively; exercise 4 trains
a float16 HybridTrainer on dp 2 and lets its loss scaler find an S that does not overflow.
"""
# mpirun -n 2 python tutorials/solutions/14_floating_point.py
import math
import os
import sys

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, solve  # noqa: E402

from hsgd.model.config import ModelConfig  # noqa: E402
from hsgd.model.data import Corpus  # noqa: E402
from hsgd.grid.process_grid import ProcessGrid  # noqa: E402
from hsgd.step.trainer import HybridTrainer  # noqa: E402
from hsgd.check.oracle import Perturbed  # noqa: E402
from hsgd.model.precision import FORMATS, Numerics, round_to, unit_roundoff  # noqa: E402
from hsgd.step.settings import TrainConfig  # noqa: E402

threadpool_limits(1)                    # the ranks share the cores, tiny matrices: one BLAS thread each
world = MPI.COMM_WORLD
U = unit_roundoff("bfloat16")
K, N = 32, 4096                         # rows, terms: section 1's largest case


def terms(n=N, seed=4096):
    """K rows of n bfloat16 numbers in [0, 1) (float32 arrays) and their exact sums (math.fsum)."""
    X = round_to(np.random.default_rng(seed).uniform(0, 1, (K, n)).astype(np.float32), "bfloat16")   # (K, n)
    return X, np.array([math.fsum(row) for row in X.astype(np.float64)])


def R(x):
    """x (float32) rounded to bfloat16: every operation of a bfloat16 sum is a float32 one followed by this."""
    return round_to(x, "bfloat16")


# ---------------------------------------------------------------------------------------------------- exercise 1

def exercise_1(check):
    """Kahan summation in bfloat16."""
    X, exact = terms()
    s, c = np.zeros(K, np.float32), np.zeros(K, np.float32)             # the sum and the lost low part
    plain = np.zeros(K, np.float32)
    for i in range(N):
        y = R(X[:, i] - c)                                              # the term, corrected by what was lost
        t = R(s + y)
        c = R(R(t - s) - y)                                             # (t - s) - y: what the addition lost
        s = t
        plain = R(plain + X[:, i])
    err_k = np.abs(s.astype(np.float64) - exact) / exact                # sum |x| = sum x: the terms are >= 0
    err_p = np.abs(plain.astype(np.float64) - exact) / exact
    check.say(f"  n = {N}: Kahan's largest relative error {err_k.max():.1e} = {err_k.max() / U:.2f} u; plain "
              f"{err_p.max():.2f} (bound 2u + n u^2 = {2 * U + N * U * U:.1e})")
    check("Kahan in bfloat16: largest error / ((2u + n u^2) sum|x|)", float(err_k.max()) / (2 * U + N * U * U), 1.0)
    check("Kahan in bfloat16: largest error / (2u sum|x|) (the first-order bound)", float(err_k.max()) / (2 * U), 1.0)
    check.equal("... while the plain bfloat16 sum stagnates at 256 in every row", sorted(set(plain.tolist())),
                [256.0])


# ---------------------------------------------------------------------------------------------------- exercise 2

def round_stochastic(x, fmt, rng):
    """x (float64) to one of its two neighbours in fmt, the upper with probability (x - down) / (up - down)."""
    f = FORMATS[fmt]
    _, k = np.frexp(x)
    q = np.ldexp(np.ones_like(x), np.maximum(k - 1, f.emin) - (f.p - 1))   # the spacing near x
    down = np.floor(x / q) * q
    return np.where(rng.random(x.shape) < (x - down) / q, down + q, down)


def exercise_2(check):
    """Stochastic rounding."""
    rng = np.random.default_rng(11)
    x = 1 + 0.3 * 2.0 ** -7                                             # 30% of the way from 1 to 1 + 2^-7
    draws = round_stochastic(np.full(200000, x), "bfloat16", rng)
    se = 2.0 ** -7 * math.sqrt(0.3 * 0.7 / len(draws))                 # the standard error of the mean
    nearest = float(round_to(np.array([x]), "bfloat16")[0])
    check.say(f"  x = 1 + 0.3 * 2^-7: mean of {len(draws)} stochastic roundings - x = {draws.mean() - x:+.1e} "
              f"(standard error {se:.1e}); round to nearest - x = {nearest - x:+.1e}")
    check.equal("stochastic rounding gives only the two neighbours of x", sorted(set(draws.tolist())),
                [1.0, 1 + 2.0 ** -7])
    check("stochastic rounding: |mean - x| / its standard error", abs(float(draws.mean()) - x) / se, 4.0)
    check.holds("round to nearest: off by 0.3 of a spacing, over 100 standard errors", abs(nearest - x) > 100 * se)
    X, exact = terms()
    s = np.zeros(K)
    for i in range(N):
        s = round_stochastic(s + X[:, i].astype(np.float64), "bfloat16", rng)   # the exact sum, rounded at random
    err = np.abs(s - exact) / exact
    scale = math.sqrt(N) * U
    check.say(f"  the sequential sum of {N} terms with stochastic rounding: rms error {np.sqrt(np.mean(err ** 2)):.1e}"
              f", largest {err.max():.1e}; sqrt(n) u = {scale:.2f}; round to nearest: 0.88 (stagnation)")
    check("stochastic rounding, n = 4096: largest error / (sqrt(n) u sum|x|)", float(err.max()) / scale, 2.0)


# ---------------------------------------------------------------------------------------------------- exercise 3

def exercise_3(check):
    """The band of one linear layer, by hand."""
    rng = np.random.default_rng(3)
    Nr, C, F = 64, 16, 24
    X, dY = rng.standard_normal((Nr, C)), rng.standard_normal((Nr, F))     # (N, C), (N, F) float64
    dW = X.T @ dY                                                          # (C, F) exact (to 1e-16)
    # dW_model - dW = u sum_n X_ni dY_nj (e1 + e2) + O(u^2); e1, e2 independent, variance 1/3 each
    by_hand = U * math.sqrt(2 / 3) * math.sqrt(float(((X ** 2).T @ dY ** 2).sum())) / np.linalg.norm(dW)
    d = []
    for salt in range(200):
        pert = Perturbed("bfloat16", salt=salt)
        Xm, dYm = pert.rounded(X, "bfloat16", "matmul"), pert.rounded(dY, "bfloat16", "grad")
        d.append(np.linalg.norm(Xm.T @ dYm - dW) / np.linalg.norm(dW))
    model = math.sqrt(np.mean(np.square(d)))
    real_W = (round_to(X.astype(np.float32), "bfloat16").T @ round_to(dY.astype(np.float32), "bfloat16"))
    real = np.linalg.norm(real_W.astype(np.float64) - dW) / np.linalg.norm(dW)     # float32 accumulation
    check.say(f"  dW = X^T dY, N = {Nr}: by hand {by_hand:.3e}, the model's rms over 200 salts {model:.3e}, real "
              f"bfloat16 rounding {real:.3e} ({real / by_hand:.2f} of the hand formula)")
    check("the model's rms against the hand formula, relative", abs(model / by_hand - 1), 0.1)
    check.holds("real rounding below the model's rms, and above half of it", 0.5 * by_hand < real < by_hand)


# ---------------------------------------------------------------------------------------------------- exercise 4

class Largest(Numerics):
    """Numerics that records the largest |value| / S the backward pass hands to a "grad" rounding (S: scale)."""

    def __init__(self, compute):
        super().__init__(compute)
        self.scale, self.largest = 1.0, 0.0

    def round(self, x, point):
        if point == "grad":
            self.largest = max(self.largest, float(np.abs(x).max()) / self.scale)
        return super().round(x, point)


def exercise_4(check):
    """A float16 overflow found by the scaler."""
    cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
    corpus = Corpus.load(None, cfg.seq_len)
    tc = TrainConfig(dtype="float16", batch_size=8, dp=2, steps=40, lr=0.05, momentum=0.9, warmup=1, seed=2)
    grid = ProcessGrid(world, dp=2, pp=1, tp=1)
    trainer = HybridTrainer(cfg, grid, tc)
    num = Largest("float16")
    trainer.use_numerics(num)
    trainer.scaler.scale = 2.0 ** 36                                     # far too large: everything overflows
    idx, targets = corpus.batch(tc.seed, 1, tc.batch_size)
    history, unchanged = [], True
    for step in range(1, tc.steps + 1):
        before = trainer.exchange.master.copy()
        num.scale, num.largest = trainer.scaler.scale, 0.0              # this step's
        with np.errstate(over="ignore", invalid="ignore"):              # inf - inf and inf * 0 on the way: NaN
            info = trainer.step(idx, targets, step)
        applied = not math.isnan(info.lr)
        history.append((info.loss_scale, applied))
        if applied:
            break
        unchanged &= np.array_equal(before, trainer.exchange.master)
    skipped = [s for s, a in history if not a]
    found = history[-1][0]
    overflow = 65520.0                                                  # float16 rounds |x| >= max + half a step up
    predicted = 2.0 ** math.floor(math.log2(overflow / num.largest))     # the largest power of two that fits
    check.say(f"  {len(skipped)} skipped steps, S from 2^{math.log2(skipped[0]):g} halving to 2^"
              f"{math.log2(skipped[-1]):g}; the first update at S = 2^{math.log2(found):g}; largest |activation "
              f"gradient| / S {num.largest:.2e}: S max|g| < {overflow:g} from S = 2^{math.log2(predicted):g}")
    check.holds("an update was applied within 40 steps", history[-1][1])
    check.equal("S halved at every skip: 2^36, 2^35, ...", skipped, [2.0 ** (36 - i) for i in range(len(skipped))])
    check.holds("every skipped step left the master weights bit-identical", unchanged)
    check.equal("the first S that works == the largest power of two with S max|g| < 65520", found, predicted)
    losses, weights = world.allgather(info.loss), world.allgather(trainer.exchange.master)
    check.holds("both replicas: the same loss and bit-identical weights after the update",
                len(set(losses)) == 1 and all(np.array_equal(w, weights[0]) for w in weights))
    grid.free()


check = Checks(world, tol=1e-10, width=84)
solve(check, [exercise_1, exercise_2, exercise_3, exercise_4])
