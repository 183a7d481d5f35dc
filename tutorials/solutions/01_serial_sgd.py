"""Solutions to the exercises of chapter 1 (tutorials/01_serial_sgd.py).

    python tutorials/solutions/01_serial_sgd.py

One process, float64, tiny arrays; every solution checks its result against finite differences, hsgd's own code
or a formula, and stops (non-zero exit) at the first check that fails.
"""
import os
import sys

from hsgd.model.config import ModelConfig   # hsgd before NumPy: it sets OpenBLAS's thread timeout first
from hsgd.model import layers, serial
from hsgd.model.gradcheck import fd_error   # chapter 1's checker: order 2, every coordinate
from hsgd.model.optim import SGD

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, rel_err, solve  # noqa: E402

threadpool_limits(1)
rng = np.random.default_rng(1)


# ------------------------------------------------------------------------------------------------------------ 1
def rmsnorm_forward(x, w, eps=1e-5):
    """y = x * r * w, r = 1 / sqrt(mean(x^2) + eps) over the last axis. x: (..., C), w: (C,)."""
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)     # (..., 1)
    xhat = x * r                                                      # (..., C)
    return xhat * w, (xhat, r, w)


def rmsnorm_backward(dy, cache, dw):
    """dw += sum over rows of dy * xhat; with g = dy * w, d xhat_j / d x_i = r (delta_ij - xhat_i xhat_j / C), so
    dx = r (g - xhat mean(g * xhat)): only the part of g along xhat is removed (there is no mean to remove)."""
    xhat, r, w = cache
    C = xhat.shape[-1]
    dw += (dy * xhat).reshape(-1, C).sum(axis=0)                      # (C,)
    g = dy * w                                                        # (..., C)
    return r * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))   # (..., C)


def exercise_1(check):
    """The backward of RMSNorm, by hand, against finite differences."""
    x, w = rng.standard_normal((2, 3, 6)), 1.0 + 0.1 * rng.standard_normal(6)
    y, cache = rmsnorm_forward(x, w)
    R = rng.standard_normal(y.shape)                                  # dL/dy of the probe L = sum(y * R)
    dw = np.zeros_like(w)
    dx = rmsnorm_backward(R, cache, dw)
    probe = lambda: float(np.sum(rmsnorm_forward(x, w)[0] * R))       # noqa: E731
    check("rmsnorm: dx, dw vs central differences", fd_error(probe, [x, w], [dx, dw]), 1e-6)
    row_sums = float(np.max(np.abs(dx.sum(axis=-1))))
    check.say(f"  largest |row sum of dx|: {row_sums:.2f} (LayerNorm's are 0: it also removes the mean)")
    check.holds("rmsnorm: the rows of dx do not sum to zero", row_sums > 1e-3)


# ------------------------------------------------------------------------------------------------------------ 2
def exercise_2(check):
    """Momentum SGD against plain SGD."""
    lr, mu, t = 0.1, 0.9, 7
    w0 = rng.standard_normal(5)
    gs = [rng.standard_normal(5) for _ in range(t)]                   # the gradients of steps 1 .. t
    params, opt = {"w": w0.copy()}, SGD(lr, momentum=mu)
    for g in gs:
        opt.step(params, {"w": g})
    unrolled = w0 - lr * sum(sum(mu ** (s - i) * gs[i] for i in range(s + 1)) for s in range(t))
    check(f"SGD(momentum={mu}) after {t} steps vs the unrolled sum", rel_err(params["w"], unrolled), 1e-13)

    lam = np.logspace(-2, 0, 20)                                      # curvatures 0.01 .. 1: condition number 100
    f = lambda w: 0.5 * float(np.sum(lam * w * w))                    # noqa: E731

    def steps_to(mu, lr=1.0, target=1e-8, cap=10_000):
        params, opt = {"w": np.ones_like(lam)}, SGD(lr, momentum=mu)
        f0 = f(params["w"])
        for step in range(1, cap + 1):
            opt.step(params, {"w": lam * params["w"]})               # the gradient of f
            if f(params["w"]) < target * f0:
                return step
        return cap

    plain, heavy = steps_to(0.0), steps_to(0.9)
    # plain SGD on f: every coordinate shrinks by (1 - lr lam_i) per step, so f_t = 1/2 sum lam_i (1 - lam_i)^(2t)
    f_t = lambda t: 0.5 * float(np.sum(lam * (1 - lam) ** (2 * t)))   # noqa: E731  (lr = 1, w0 = 1)
    predicted = next(t for t in range(1, 10_000) if f_t(t) < 1e-8 * f_t(0))
    check.say(f"  steps to f < 1e-8 f(w0): plain SGD {plain} (the closed form: {predicted}), momentum 0.9: {heavy}")
    check.equal("plain SGD: steps == the closed form's", plain, predicted)
    check.holds("momentum 0.9 needs fewer than a third of plain SGD's steps", heavy < plain / 3)


# ------------------------------------------------------------------------------------------------------------ 3
def exercise_3(check):
    """Gradient accumulation equals the big batch."""
    cfg = ModelConfig(vocab_size=11, seq_len=6, d_model=8, n_heads=2, n_layers=2, d_ff=16)
    params = serial.init_params(cfg, seed=0, dtype="float64")
    B = 8
    idx = rng.integers(0, cfg.vocab_size, (B, cfg.seq_len))           # (B, T)
    targets = rng.integers(0, cfg.vocab_size, (B, cfg.seq_len))       # (B, T)
    _, ref = serial.loss_and_grads(params, idx, targets, cfg)         # the big batch

    def accumulate(weights):
        grads = serial.zeros_like_params(params)                      # one dict; the layers add into it
        for (lo, hi), wgt in zip(((0, 3), (3, 8)), weights):
            logits, caches = serial.forward(params, idx[lo:hi], cfg)
            _, c_ce = layers.cross_entropy_forward(logits, targets[lo:hi])
            serial.backward(layers.cross_entropy_backward(wgt, c_ce), caches, grads, cfg)   # += wgt * grad L_m
        return grads

    by_size = accumulate((3 / B, 5 / B))
    equal = accumulate((0.5, 0.5))
    err = max(rel_err(by_size[n], ref[n]) for n in ref)
    naive = max(rel_err(equal[n], ref[n]) for n in ref)
    check.say(f"  weights b_m/B: max rel err {err:.1e}; weights 1/2: {naive:.1e}")
    check("micro-batches 3 + 5, weights b_m/B vs the batch of 8", err, 1e-12)
    check.holds("weights 1/2, unequal micro-batches: not the batch (> 1e-3)", naive > 1e-3)


# ------------------------------------------------------------------------------------------------------------ 4
def exercise_4(check):
    """The backward is as causal as the forward."""
    B, T, C, NH, t0 = 2, 6, 8, 2, 3
    q, k, v = (rng.standard_normal((B, T, C)) for _ in range(3))
    y, cache = layers.attention_forward(q, k, v, NH)
    dy = np.zeros_like(y)
    dy[:, t0] = rng.standard_normal((B, C))                           # the probe reads position t0 only
    dq, dk, dv = layers.attention_backward(dy, cache)
    future = float(max(np.abs(a[:, t0 + 1:]).max() for a in (dq, dk, dv)))
    other_q = float(np.abs(np.delete(dq, t0, axis=1)).max())
    past = float(min(np.abs(a[:, :t0 + 1]).max() for a in (dk, dv)))
    check.say(f"  positions after {t0}: max |dq, dk, dv| = {future:.0e}; dq elsewhere than {t0}: {other_q:.0e}; "
              f"dk, dv at positions <= {t0}: max |.| >= {past:.2f}")
    check.holds(f"dq, dk, dv after position {t0}: exactly zero", future == 0.0)
    check.holds(f"dq at positions other than {t0}: exactly zero", other_q == 0.0)
    check.holds(f"dk and dv at positions <= {t0} are not zero", past > 1e-3)


if __name__ == "__main__":
    solve(Checks(tol=1e-12, width=64), [exercise_1, exercise_2, exercise_3, exercise_4])
