# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 14: floating point in distributed training: sums in another order, the band, loss scaling
#
# Every parallel layout adds partial results: the lecture's section 3.3 All-Reduces only the input-gradient partial
# sums of a tensor-parallel group, its section 3.4 a shard's gradients over the data-parallel groups. In exact
# arithmetic the order of those additions does not matter, and in float64, where every chapter so far checked against
# serial SGD, it barely does (1e-15). In bfloat16 or float16 it does: two correct layouts give different gradients,
# and "the TP run's loss differs from the one-device run" is a report every framework receives. Bug or rounding? The
# lecture treats addition as exact; floating point is beyond it, as chapters 11 to 13 go beyond it in their
# directions. This chapter is about what rounding does to a distributed sum and how to tell it from a bug; chapter
# 21's section 6 shows where a run on a GPU rounds.
#
# Run it with eight ranks (9 to 12 s measured on a 2-core machine shared with other jobs). Rank 0 prints and draws two
# pictures into `$HSGD_FIGURES` (default `tutorials/figures/`); `mpirun -n 8 python -m hsgd.verify --dtype bfloat16
# --layouts 1x1x1,2x1x4,1x2x4 --seeds 8 --plot oracle.png` runs the oracle of sections 3 to 5.
#
# mpirun -n 8 python tutorials/14_floating_point.py
#
# Legend: B sequences in the batch, T sequence length, N = B T tokens (the terms of a weight gradient's sum), C d_model,
# NH heads, F the MLP width, V vocabulary, L layers; dp, pp, tp the sizes of a layout, written dp x pp x tp; m
# micro-batches. Numbers: p the significand bits of a format, u = 2^-p its unit roundoff (bfloat16 2^-8, float16 2^-11,
# float32 2^-24), $\gamma_n = nu/(1 - nu)$ Higham's constant, S the loss scale; e a random number in [-1, 1); d(a, b)
# the oracle's relative difference of two gradients of one parameter (section 3).

# %%
from hsgd.model.config import ModelConfig   # hsgd first, as appendix B explains (OpenBLAS's thread timeout)

import io
import math
from dataclasses import replace

import numpy as np

from hsgd.model.data import Corpus
from hsgd.step.loss_scale import LossScaler
from hsgd.check.mutations import injected
from hsgd.check.oracle import Perturbed, differences, oracle, run_layout, uniform_of
from hsgd.check.verdict import name_of, plot_tolerance, report
from hsgd.model.precision import FORMATS, POINTS, Numerics, gamma, round_formula, round_to, unit_roundoff
from hsgd.step.settings import TrainConfig

import pictures                                  # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter         # tutorials/checks.py, shared by the chapters

P = 8
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, P, tol=1e-10, width=84)


# %% [markdown]
# ## 1. Why summing in another order changes the result
#
# A computed sum rounds after every addition: $\hat s_k = (\hat s_{k-1} + x_k)(1 + \delta_k)$, $|\delta_k| \le
# u$. Each term is multiplied by the $(1 + \delta)$ of every addition it passes through, so a sum of n terms in any
# order is off by at most $\gamma_{n-1} \sum |x_i|$ (Higham 2002, "Accuracy and Stability of Numerical Algorithms",
# chapter 4), and two orders differ by at most twice that. Pairwise summation passes each term through only
# $\lceil \log_2 n \rceil$ additions: bound $\gamma_{\lceil \log_2 n \rceil}$. A distributed sum is a third order: each
# of p ranks adds its share, then the All-Reduce adds the p partial sums ("split").
#
# The worst case needs every $\delta$ at $+u$. Higham and Mary 2019 ("A new approach to probabilistic rounding error
# analysis") treat the $\delta_k$ as independent, of mean zero, and show the error then stays below
# $\lambda \sqrt{n}\,u \sum|x_i|$ with a probability that tends to 1 quickly as $\lambda$ grows: $\sqrt{n}$ instead of
# n. In bfloat16 $\gamma_n$ reaches 1 at n = 128 and is infinite from n = 256, so past a few hundred terms the worst
# case says nothing, while $\sqrt{4096}\,u = 0.25$ still does.
#
# The experiment: K = 32 rows of n numbers uniform in [0, 1) (positive, so no cancellation hides an error), summed in
# the three orders in float32 and bfloat16, against `math.fsum`. A bfloat16 addition is a float32 addition, then
# `round_to`: two roundings, which give the correctly rounded sum because float32 has more than 2p + 2 bits (Figueroa
# 1995, "When is double rounding innocuous?"), as the first check confirms.

# %%
NS = (16, 64, 256, 1024, 4096)             # summands
FMTS = ("float32", "bfloat16")
K, PARTS = 32, 8                           # rows per job; "split": 8 parts (ranks), then their partial sums


def add(a, b, fmt):
    """a + b rounded to fmt: a float32 addition, then round_to for bfloat16."""
    s = a + b                                                       # float32
    return s if fmt == "float32" else round_to(s, fmt)


def sequential(X, fmt):
    """Row sums of X (K, n), left to right: s = (((x1 + x2) + x3) + ...)."""
    s = X[:, 0]
    for i in range(1, X.shape[1]):
        s = add(s, X[:, i], fmt)
    return s


def pairwise(X, fmt):
    """Row sums of X (K, n), n a power of two: neighbours, then neighbouring pairs, ... (log2 n levels)."""
    while X.shape[1] > 1:
        X = add(X[:, 0::2], X[:, 1::2], fmt)
    return X[:, 0]


def split(X, fmt, p=PARTS):
    """Row sums of X (K, n) as p ranks would: each its n/p terms in order, then the p partial sums in order."""
    return sequential(np.stack([sequential(part, fmt) for part in np.split(X, p, axis=1)], axis=1), fmt)


ORDERS = {"sequential": sequential, "pairwise": pairwise, "split in 8": split}


def sum_job(fmt, n):
    """Relative errors |s_hat - s| / sum|x| (K,) of each order, and the largest relative difference between orders."""
    rng = np.random.default_rng(100 * n + len(fmt))
    X = rng.uniform(0, 1, (K, n)).astype(np.float32)                 # (K, n)
    X = X if fmt == "float32" else round_to(X, fmt)                  # the terms are numbers of the format
    exact = np.array([math.fsum(row) for row in X.astype(np.float64)])
    size = np.abs(X.astype(np.float64)).sum(axis=1)                  # sum |x_i|
    got = {o: f(X, fmt).astype(np.float64) for o, f in ORDERS.items()}
    errs = {o: np.abs(s - exact) / size for o, s in got.items()}
    diff = max(float(np.max(np.abs(got[a] - got[b]) / size)) for a in got for b in got if a < b)
    return (fmt, n), dict(errs=errs, diff=diff, seq_sum=got["sequential"])


jobs = [(fmt, n) for fmt in FMTS for n in NS]
mine = [sum_job(*job) for j, job in enumerate(jobs) if j % P == rank]
done = {k: v for part in world.allgather(mine) for k, v in part}
sums = {job: done[job] for job in jobs}                              # every rank: all ten jobs, in order

rng = np.random.default_rng(1)
a, b = (round_to((rng.choice([-1, 1], 100000) * 2.0 ** rng.uniform(-20, 20, 100000)).astype(np.float32),
                 "bfloat16") for _ in range(2))                      # (100000,) bfloat16 numbers, float32 arrays
once = round_formula(a.astype(np.float64) + b.astype(np.float64), "bfloat16")   # exact sum, rounded once
check.holds("bfloat16 a + b: float32 add then round_to == one correct rounding (1e5 pairs)",
            np.array_equal(add(a, b, "bfloat16").astype(np.float64), once))

say(f"\n{'format':>9} {'n':>5} {'gamma_(n-1)':>11} {'sqrt(n) u':>10}   "
    + "".join(f"{o + ' rms':>17}" for o in ORDERS) + f"{'max |a - b|':>13}")
for (fmt, n), r in sums.items():
    u = unit_roundoff(fmt)
    say(f"{fmt:>9} {n:>5} {gamma(n - 1, fmt):>11.2e} {math.sqrt(n) * u:>10.2e}   "
        + "".join(f"{np.sqrt(np.mean(e ** 2)):>17.2e}" for e in r["errs"].values()) + f"{r['diff']:>13.2e}")
say("(errors and differences relative to sum |x_i|; rms over K = 32 rows; max |a - b|: between any two orders)")

worst = {fmt: max(float(e.max()) / gamma(n - 1, fmt) for (f, n), r in sums.items() if f == fmt
                  for e in r["errs"].values() if gamma(n - 1, fmt) < 1) for fmt in FMTS}
for fmt in FMTS:
    check(f"{fmt}: every order's error / (gamma_(n-1) sum|x|), where gamma_(n-1) < 1", worst[fmt], 1.0)
    check(f"{fmt}: any two orders' difference / (2 gamma_(n-1) sum|x|), where gamma_(n-1) < 1",
          max(r["diff"] / (2 * gamma(n - 1, fmt)) for (f, n), r in sums.items() if f == fmt
              and gamma(n - 1, fmt) < 1), 1.0)
    check(f"{fmt}: pairwise error / (gamma_(log2 n) sum|x|), every n",
          max(float(r["errs"]["pairwise"].max()) / gamma(int(math.log2(n)), fmt)
              for (f, n), r in sums.items() if f == fmt), 1.0)
check.note(f"bfloat16: gamma_128 = {gamma(128, 'bfloat16'):g}, gamma_256 = {gamma(256, 'bfloat16'):g} (n u >= 1: "
           "the bound says nothing)", gamma(256, "bfloat16") == float("inf"))
random_ok = [(fmt, n) for fmt, n in jobs if fmt == "float32" or n <= 256]
scale = [float(np.sqrt(np.mean(sums[j]["errs"]["sequential"] ** 2))) / (math.sqrt(j[1]) * unit_roundoff(j[0]))
         for j in random_ok]
say(f"sequential rms error / (sqrt(n) u), float32 and bfloat16 up to n = 256: "
    f"{' '.join(f'{s:.2f}' for s in scale)}")
check("sequential sums: rms error / (sqrt(n) u) at most (float32, bfloat16 n <= 256)", max(scale), 1.0)
check.holds("sequential sums: rms error / (sqrt(n) u) at least 0.1 (the sqrt(n) growth is there)",
            min(scale) >= 0.1)

# %% [markdown]
# Every error is far below its worst case, and the sequential sum's rms error is a steady fraction of $\sqrt{n}\,u$: the
# roundings behave like independent random errors. Pairwise does better still, and "split in 8" sits between.
#
# Except in one place: the sequential bfloat16 sum of 1024 and 4096 terms is wrong by half and more. Between 128 and 256
# the bfloat16 numbers are the integers, so adding x in [0, 1) rounds to s or s + 1 and the sum still grows; from 256 on
# they are the even integers, and s + x is closer to s than to s + 2: the sum **stagnates** at 256. Every rounding now
# errs with the same sign, and the independence the probabilistic analysis assumes is gone (Connolly, Higham and Mary
# 2021, "Stochastic rounding and its probabilistic backward error analysis", show that stochastic rounding restores it:
# exercise 2). This is why hsgd accumulates matrix products and weight gradients in float32, All-Reduces them in float32
# unless `--reduce-dtype` says otherwise, and rounds to bfloat16 only at the points of `precision.POINTS`. (Megatron-LM
# reduces in float32 unless given `--grad-reduce-in-bf16`; DeepSpeed and FSDP2 reduce in the compute dtype by default:
# the cross-walk.)

# %%
stalled = [float(x) for n in (1024, 4096) for x in sums[("bfloat16", n)]["seq_sum"]]
check.equal("bfloat16 sequential sums of 1024 and 4096 terms in [0, 1): all exactly 256 (stagnation)",
            sorted(set(stalled)), [256.0])


def draw_sums():
    fig, axes = pictures.figure(10, 3.6, ncols=2)
    n = np.array(NS, dtype=float)
    for ax, fmt in zip(axes, FMTS):
        u = unit_roundoff(fmt)
        for (o, marker), color in zip((("sequential", "o"), ("pairwise", "s"), ("split in 8", "^")),
                                      ("C0", "C1", "C2")):
            rms = [float(np.sqrt(np.mean(sums[(fmt, k)]["errs"][o] ** 2))) for k in NS]
            ax.loglog(n, rms, marker=marker, color=color, label=f"{o} (rms of 32)")
        g = np.array([gamma(k - 1, fmt) for k in NS])
        ax.loglog(n[g < 1], g[g < 1], "k-", lw=1, label=r"worst case $\gamma_{n-1}$")
        ax.loglog(n, np.sqrt(n) * u, "k--", lw=1, label=r"$\sqrt{n}\,u$")
        ax.set_title(f"{fmt}: relative error of a sum of n numbers in [0, 1)", fontsize=9)
        ax.set_xlabel("n")
        ax.set_ylabel("|error| / sum |x|")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return pictures.save(fig, "14_sum_order")


say(f"picture: {pictures.on_rank0(world, draw_sums, share=True)}")

# %% [markdown]
# The picture shows, per format, the rms error of the three orders against n on log-log axes, under the worst-case bound
# $\gamma_{n-1}$ and the $\sqrt{n}\,u$ scale; the sequential bfloat16 points jump above both where the sum stagnates.
#
# ## 2. What each layout sums differently
#
# One bfloat16 step of a tiny model (T = 16, C = 32, NH = 4, L = 2, F = 64, B = 8) on seven layouts, each through
# `oracle.run_layout` (the training code path) with a `Numerics` whose `counts` say how often each point of
# `precision.POINTS` rounded. Each gradient is compared with serial's per parameter, in the oracle's measure $d(a, b) =
# \|a_P - b_P\| / \max(\|g_P\|, 10^{-3} \max_Q \|g_Q\|)$ (g: the float64 gradient).

# %%
cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
corpus = Corpus.load(None, cfg.seq_len)     # the built-in corpus (the Python standard library's source)
tc = TrainConfig(dtype="bfloat16", batch_size=8, micro_batches=2, tp=2, dp=4, seed=3)  # the oracle's, on 8 ranks
SEED = 3
LAYOUTS2 = {"1x1x1": ((1, 1, 1, 1), 1), "1x1x1, m = 2": ((1, 1, 1, 1), 2), "dp 2": ((2, 1, 1, 1), 1),
            "dp 8": ((8, 1, 1, 1), 1), "pp 2": ((1, 2, 1, 1), 1), "tp 2": ((1, 1, 1, 2), 1),
            "tp 4": ((1, 1, 1, 4), 1)}
NP = len(cfg.param_shapes())                 # 37 parameters
SHOWN = ("matmul", "attention", "layernorm", "gelu", "residual", "grad", "payload")

grads, counts = {}, {}
for label, (L, m) in LAYOUTS2.items():
    num = Numerics("bfloat16")
    g = run_layout(cfg, replace(tc, micro_batches=m), L, SEED, world, "bfloat16", num=num, corpus=corpus)
    counts[label] = {k: world.allreduce(v) for k, v in num.counts.items()}   # over the layout's ranks (others: 0)
    grads[label] = g                                                      # rank 0: {name: float64 array}
g64 = run_layout(cfg, tc, (1, 1, 1, 1), SEED, world, "float64", corpus=corpus)   # rank 0: the exact gradient


def compare():
    """Per layout: (parameters bit-identical to serial's, largest and median d against serial) on rank 0."""
    out = {}
    for label, g in grads.items():
        d = differences(g, grads["1x1x1"], g64)
        same = sum(np.array_equal(g[k], grads["1x1x1"][k]) for k in g)
        out[label] = (same, max(d.values()), float(np.median(list(d.values()))))
    return out


cmp = world.bcast(compare() if rank == 0 else None)
floor32 = 2 * gamma(tc.batch_size * cfg.seq_len, "float32")      # two orders of an N-term float32 sum
say(f"\n{'layout':<14}" + "".join(f"{p:>10}" for p in SHOWN) + f"{'weights':>9}{'identical':>11}{'max d':>10}"
    f"{'median d':>10}")
for label, c in counts.items():
    same, mx, med = cmp[label]
    say(f"{label:<14}" + "".join(f"{c[p]:>10}" for p in SHOWN) + f"{c['weights']:>9}{f'{same}/{NP}':>11}"
        f"{mx:>10.1e}{med:>10.1e}")
say(f"(rounding calls over the layout's ranks; identical: parameters whose gradient is bit-identical to 1x1x1's; "
    f"2 gamma_N(u_float32) = {floor32:.1e} for N = {tc.batch_size * cfg.seq_len})")

base = counts["1x1x1"]
act = [p for p in SHOWN if p != "payload"]                             # the points every layout has
check.equal("payload roundings only where tp > 1", sorted(k for k, c in counts.items() if c["payload"]),
            ["tp 2", "tp 4"])
check.equal("m = 2: every activation point rounds twice as often (each micro-batch once)",
            {p: counts["1x1x1, m = 2"][p] for p in act}, {p: 2 * base[p] for p in act})
for label, k in (("dp 2", 2), ("dp 8", 8), ("tp 2", 2), ("tp 4", 4)):
    check.equal(f"{label}: each of its {k} ranks rounds at every activation point as serial does (on its part)",
                {p: counts[label][p] for p in act}, {p: k * base[p] for p in act})
check.equal("pp 2: the two stages together round exactly where serial does", {p: counts["pp 2"][p] for p in act},
            {p: base[p] for p in act})
check.equal("tp: payload roundings per rank == 4L + 2, whatever tp", (counts["tp 2"]["payload"] // 2,
                                                                    counts["tp 4"]["payload"] // 4),
            (4 * cfg.n_layers + 2, 4 * cfg.n_layers + 2))
check.equal(f"pp 2: all {NP} gradients bit-identical to serial's", cmp["pp 2"][0], NP)
for label in ("1x1x1, m = 2", "dp 2", "dp 8"):
    check(f"{label}: largest d from serial, within float32 reordering 2 gamma_N(u_float32)", cmp[label][1], floor32)
    check.holds(f"{label}: ... and not bit-identical (the float32 sums run in another order)", cmp[label][0] < NP)
for label in ("tp 2", "tp 4"):
    check.holds(f"{label}: median d from serial > 20 x 2 gamma_N(u_float32): bfloat16-sized, not reordering",
                cmp[label][2] > 20 * floor32)

tc6 = replace(tc, batch_size=6, micro_batches=1)                      # B = 6: on dp 3, 2 rows per replica
six = [run_layout(cfg, tc6, L, SEED, world, dtype, corpus=corpus) for L, dtype in
       (((1, 1, 1, 1), "bfloat16"), ((3, 1, 1, 1), "bfloat16"), ((1, 1, 1, 1), "float64"))]
d6 = world.bcast(float(np.median(list(differences(six[1], six[0], six[2]).values()))) if rank == 0 else None)
say(f"B = 6, dp 3 against serial: median d {d6:.1e} (dp 2 and dp 8 with B = 8: {cmp['dp 2'][2]:.1e}, "
    f"{cmp['dp 8'][2]:.1e})")
check.holds("dp 3 with B = 6 (scalings by 1/3): median d from serial > 20 x 2 gamma_N(u_float32)",
            d6 > 20 * floor32)

# %% [markdown]
# Three kinds of layout, by what they change in the arithmetic:
#
# * **pp** only moves layers: each stage computes serial's rows with serial's weights and sends bfloat16 activations,
#   which travel exactly. Every rounding happens where serial's does, on the same values: bit-identical gradients.
# * **dp and micro-batches** split the rows. Each row's forward and backward are serial's, rounding for rounding, as
#   long as a matrix product's row does not depend on the rows multiplied with it (true of the BLAS here, not promised
#   by every GPU kernel). Only the weight gradient's float32 sum over the N tokens runs in another order (the
#   micro-batches' `+=`, the All-Reduce), so they differ from serial within $2\gamma_N(u_{32})$. This needs B/dp and B/m
#   to be powers of two, so that the loss's 1/m and 1/(rows) factors are exact: B = 6 on dp 3 differs by bfloat16-sized
#   amounts (checked above).
# * **tp** adds roundings: a row-parallel linear's tp partial sums are each rounded to bfloat16 before they travel
#   (`payload`: 4L + 2 per rank and step), and their sum again at the next point. Serial never does those, so the
#   activations and every gradient from them differ by bfloat16-sized amounts.
#
# How large may tp's differences be? That is the band.
#
# ## 3. The band
#
# `hsgd.check.oracle` answers with a model of the rounding error, after Higham and Mary: run the layout in float64, and
# wherever the bfloat16 run would round, multiply by $(1 + u e)$ instead, e in [-1, 1). `Perturbed` is that `Numerics`;
# `uniform_of(x, salt)` draws e from a hash of the value's bits and a salt, so that replicas of a value stay replicas.
# Is e uniform, and is one perturbation as large as a real rounding?

# %%
x = np.random.default_rng(5).standard_normal(200000)                    # (200000,) float64
e = uniform_of(x, 7)
hist = np.histogram(e, bins=20, range=(-1, 1))[0] / len(e)             # 20 bins of width 0.1
say(f"uniform_of: mean {e.mean():+.4f}, variance {e.var():.4f} (uniform: 1/3 = 0.3333), bins {hist.min():.4f} .. "
    f"{hist.max():.4f} (uniform: 0.05)")
check.holds("uniform_of: in [-1, 1), a function of the value (same x, same salt: same e)",
            e.min() >= -1 and e.max() < 1 and np.array_equal(e, uniform_of(x.copy(), 7)))
check.holds("uniform_of: another salt gives other e (correlation below 0.01)",
            abs(float(np.corrcoef(e, uniform_of(x, 8))[0, 1])) < 0.01)
check("uniform_of: |mean| (uniform: 0; 200000 draws, sd 0.0013)", abs(float(e.mean())), 0.01)
check("uniform_of: |variance - 1/3|", abs(float(e.var()) - 1 / 3), 0.01)
check("uniform_of: largest |bin share - 0.05| over 20 bins", float(np.abs(hist - 0.05).max()), 0.005)

u16 = unit_roundoff("bfloat16")
xs = (np.random.default_rng(6).choice([-1, 1], 200000) * 2.0 ** np.random.default_rng(7).uniform(-30, 30, 200000))
real = (round_to(xs, "bfloat16") - xs) / xs                            # a real rounding's relative error
model = (Perturbed("bfloat16").rounded(xs, "bfloat16", "matmul") - xs) / xs     # the model's: u e
benford = math.sqrt(3 / (8 * math.log(2)))                             # see below
say(f"relative error of one bfloat16 rounding of log-uniform x: max |d| / u = {np.abs(real).max() / u16:.4f}, "
    f"rms / (u/sqrt 3) = {np.sqrt(np.mean(real ** 2)) / (u16 / math.sqrt(3)):.4f}; the model's "
    f"{np.sqrt(np.mean(model ** 2)) / (u16 / math.sqrt(3)):.4f}")
check("a real bfloat16 rounding: max |relative error| / u", float(np.abs(real).max()) / u16, 1.0 + 1e-12)
check("... its rms / (u/sqrt 3) against sqrt(3 / (8 ln 2)) = 0.736 (derived below)",
      abs(float(np.sqrt(np.mean(real ** 2))) / (u16 / math.sqrt(3)) - benford), 0.01)
check("the model's rms / (u/sqrt 3) against 1", abs(float(np.sqrt(np.mean(model ** 2))) / (u16 / math.sqrt(3)) - 1),
      0.01)

# %% [markdown]
# A rounding's absolute error is uniform in half a spacing, $\pm 2^{e-p}$ for x in $[2^e, 2^{e+1})$, so its relative
# error is largest at the bottom of the binade. For values spread evenly in $\log x$ (density $1/(x \ln 2)$, as products
# of many factors tend to be) the mean of $1/x^2$ over $[1, 2)$ is $3/(8 \ln 2)$, and the rms relative error is
# $\sqrt{3/(8 \ln 2)}$ = «0.736» of $u/\sqrt{3}$, the rms of the model's $u e$: the model **overestimates** a typical
# rounding, on purpose.
#
# For each seed and layout L the oracle runs the float64 serial reference g, L in bfloat16 ($g_L$), L in float64
# ($g_L^{64}$: any difference from g beyond 1e-10 is a bug, not rounding), and L under the model twice ($g_L^a$,
# $g_L^b$). The model's rms $m_L = \sqrt{\mathrm{mean}_s\, d(g_L^a, g_L^b)^2 / 2}$ (two draws differ by $\sqrt 2$ times
# one draw's error; what they share, such as a bug only the narrow formats take, cancels and cannot widen the band) sets
# the band $\lambda m_L + \lambda \sqrt{N} u_{32}$ against float64, and $\lambda \sqrt{m_L^2 + m_B^2} + \lambda \sqrt{N}
# u_{32}$ between L and the first layout B, with $\lambda$ = 4; the second term allows for the float32 sums the model
# does not perturb. On 8 ranks, three layouts, two seeds, two micro-batches:

# %%
LAYOUTS3 = [(1, 1, 1, 1), (4, 1, 1, 2), (2, 2, 1, 2)]
verdict = oracle(cfg, tc, LAYOUTS3, 2, world, corpus)        # collective; the Verdict on rank 0, None elsewhere
out = io.StringIO()
ok = report(verdict, tc, cfg, P, out) if rank == 0 else None
say(out.getvalue())
facts = world.bcast((ok, max(verdict.exact.values()), max(max(r[3] / r[4], r[6] / r[7]) for r in verdict.rows()),
                     min(r[4] for r in verdict.rows())) if rank == 0 else None)
check.holds(f"the oracle: every layout of {', '.join(map(name_of, LAYOUTS3))} inside its band (report: PASS)",
            facts[0])
check("the oracle: every layout's float64 run against the float64 reference", facts[1], 1e-12)
check("the oracle: largest observed difference / its band", facts[2], 1.0)
check.holds(f"the oracle: every band above float32's worst-case reordering 2 gamma_N(u_float32) = {floor32:.1e}",
            facts[3] > floor32)
say("picture: " + pictures.on_rank0(world, lambda: pictures.save(plot_tolerance(verdict), "14_oracle_band"),
                                    share=True))

# %% [markdown]
# The picture (`verdict.plot_tolerance`) shows, per layout, every parameter's observed differences (a dot per seed,
# against float64 and against 1x1x1) under its band (the step line), on a log scale: the largest observed over its band
# is printed above each layout (at most «0.27»). The band is wide because it must hold on every seed of every correct
# layout, yet narrow enough to catch section 5's bugs, of order 1.
#
# ## 4. Loss scaling step by step
#
# float16 has bfloat16's problem the other way round: 3 more significant bits, but its normal numbers end at $2^{-14}$ =
# 6.1e-5 and its subnormals at $2^{-24}$ = 6.0e-8. A gradient flowing back gets small: the loss's gradient is 1/N per
# token, and every layer multiplies it by weights of size ~0.02. `Flushes` is a `Numerics` that also counts, at every
# rounding point, the nonzero values that became 0 (underflow) or subnormal. One float16 step on 4x1x2, without a loss
# scale and with $S = 2^{16}$ (`--loss-scale dynamic`, `LossScaler`'s first S):

# %%
class Flushes(Numerics):
    """Numerics that also counts, per point, the nonzero values a rounding turned into 0 or into a subnormal."""

    def __init__(self, compute):
        super().__init__(compute)
        self.zeros, self.subnormal = dict.fromkeys(POINTS, 0), dict.fromkeys(POINTS, 0)

    def rounded(self, x, fmt, point):                      # Numerics' one place a value is rounded
        r = round_to(x, fmt)
        self.zeros[point] += int(np.count_nonzero((x != 0) & (r == 0)))
        self.subnormal[point] += int(np.count_nonzero((r != 0) & (np.abs(r) < 2.0 ** FORMATS[fmt].emin)))
        return r


flushed = {}
for scaling in ("none", "dynamic"):
    num = Flushes("float16")
    g16 = run_layout(cfg, replace(tc, dtype="float16", loss_scale=scaling), (4, 1, 1, 2), SEED, world, "float16",
                     num=num, corpus=corpus)
    worst_d = world.bcast(max(differences(g16, g64, g64).values()) if rank == 0 else None)
    flushed[scaling] = ({p: world.allreduce(v) for p, v in num.zeros.items()},
                        {p: world.allreduce(v) for p, v in num.subnormal.items()}, worst_d)
for scaling, (zeros, sub, worst_d) in flushed.items():
    say(f"float16, loss scale {scaling:<8}: flushed to 0 {sum(zeros.values()):>5} (grad {zeros['grad']}), "
        f"subnormal {sum(sub.values()):>6} (grad {sub['grad']}); largest d from float64 {worst_d:.1e}")
check.holds("float16 without a scale: activation gradients flushed to zero", flushed["none"][0]["grad"] > 0)
check.equal("float16 with S = 2^16: none flushed", sum(flushed["dynamic"][0].values()), 0)
check.holds("... and over 10x fewer subnormals", 10 * sum(flushed["dynamic"][1].values())
            < sum(flushed["none"][1].values()))
check.holds("the worst parameter's gradient is closer to float64 with the scale than without",
            flushed["dynamic"][2] < flushed["none"][2])

# %% [markdown]
# The scale multiplies dloss, so every activation gradient, by S; the weight gradients are accumulated in float32 and
# divided by S after the All-Reduce (`HybridTrainer.update`). Too large an S overflows a gradient to inf (above 65504).
# `LossScaler` keeps the rules of Micikevicius et al. 2018 ("Mixed Precision Training") with `torch.amp.GradScaler`'s
# growth: on an inf or NaN anywhere (agreed by every rank), skip the update and halve S; after `growth_interval` good
# steps in a row, double it. With growth_interval = 3 and a sequence of found_inf flags, each step's state worked out by
# hand:

# %%
flags = [False, False, False, False, True, False, True, True, False, False, False]
by_hand = [  # (S, good steps in a row, skipped so far, update applied) after each step
    (65536, 1, 0, True), (65536, 2, 0, True), (131072, 0, 0, True),      # the third good step: S x 2
    (131072, 1, 0, True), (65536, 0, 1, False),                          # an inf: S / 2, skipped, count reset
    (65536, 1, 1, True), (32768, 0, 2, False), (16384, 0, 3, False),     # two infs in a row: S / 4
    (16384, 1, 3, True), (16384, 2, 3, True), (32768, 0, 3, True)]       # three good ones: S x 2
scaler = LossScaler(growth_interval=3)
walked = []
for step, found_inf in enumerate(flags, 1):
    applied = scaler.update(found_inf)
    walked.append((scaler.scale, scaler.good_steps, scaler.skipped, applied))
    say(f"step {step:>2}: found_inf {str(found_inf):<5} -> S = {scaler.scale:>8g}, good steps {scaler.good_steps}, "
        f"skipped {scaler.skipped}, update {'applied' if applied else 'skipped'}")
check.equal("LossScaler over 11 steps == the rules worked out by hand", walked, by_hand)
default = LossScaler()
check.equal("LossScaler's defaults == GradScaler's (init 2^16, growth 2, backoff 0.5, interval 2000)",
            (default.scale, default.growth_factor, default.backoff_factor, default.growth_interval),
            (65536.0, 2.0, 0.5, 2000))

# %% [markdown]
# The oracle's model never underflows: with the scale the float16 run is inside its band, without it the attention's k
# biases fall outside. Their exact gradient is zero (a softmax ignores a shift shared by a row of scores), so a run
# computes there a sum of the backward's smallest values, the first to underflow. The oracle cannot tell underflow from
# a bug, but it tells that something beyond rounding happened. One layout, one seed each:

# %%
f16 = {}
for scaling in ("dynamic", "none"):
    tc16 = replace(tc, dtype="float16", loss_scale=scaling)
    v = oracle(cfg, tc16, [(4, 1, 1, 2)], 1, world, corpus)
    out = io.StringIO()
    ok16 = report(v, tc16, cfg, P, out) if rank == 0 else None
    say(f"loss scale {scaling}: " + " | ".join(line for line in out.getvalue().splitlines()
                                                 if line.startswith(("largest", "PASS", "FAIL"))))
    f16[scaling] = world.bcast((ok16, sorted({r[1] for r in v.outside()[0]})) if rank == 0 else None)
check.holds("float16 with S = 2^16: inside the band (report: PASS)", f16["dynamic"][0])
check.holds("float16 without a scale: outside the band (report: FAIL) ...", not f16["none"][0])
check.holds("... only at the attention's q or k parameters",
            f16["none"][1] and all(".attn.q." in k or ".attn.k." in k for k in f16["none"][1]))

# %% [markdown]
# ## 5. Reading a "TP loss differs from one device" report
#
# `hsgd.check.mutations.injected(bug)` switches on one of two known mistakes for the length of a `with` block:
# `missing-tp-scale` makes one parameter's gradient tp times too large (a replicated parameter's whole gradients summed
# over the tp ranks: here `ln_f.weight`), and `dropped-micro-batch` starts the last micro-batch's backward from a zero
# dloss. From the loss curve both look like rounding. The oracle on 1x1x1 and one parallel layout, one seed each:

# %%
bugs = {}
for bug, layouts, kw in (("missing-tp-scale", [(1, 1, 1, 1), (4, 1, 1, 2)], {}),
                         ("dropped-micro-batch", [(1, 1, 1, 1), (2, 2, 1, 2)], dict(micro_batches=2))):
    tcb = replace(tc, **kw)
    with injected(bug, "ln_f.weight"):
        v = oracle(cfg, tcb, layouts, 1, world, corpus)
    out = io.StringIO()
    okb = report(v, tcb, cfg, P, out) if rank == 0 else None
    lines = out.getvalue().splitlines()
    say(f"\n{bug}:\n" + "\n".join(line for line in lines if line.startswith(("layout", "largest", "FAIL", "PASS"))
                                  or line.startswith("ln_f.weight")))
    if rank == 0:
        bad, inexact = v.outside()
        bugs[bug] = (okb, sorted({(name_of(r[0]), r[1]) for r in bad}), [name_of(L) for L in inexact],
                     {name_of(r[0]): r[3] / r[4] for r in v.rows() if r[1] == "ln_f.weight"})
    bugs[bug] = world.bcast(bugs.get(bug))
tp_bug, mb_bug = bugs["missing-tp-scale"], bugs["dropped-micro-batch"]
check.holds("missing-tp-scale: the report says FAIL", not tp_bug[0])
check.equal("missing-tp-scale: flagged exactly ln_f.weight on 4x1x2; 4x1x2 not exact in float64",
            (tp_bug[1], tp_bug[2]), ([("4x1x2", "ln_f.weight")], ["4x1x2"]))
check.holds("missing-tp-scale: ln_f.weight on 4x1x2 more than 10x outside its band; on 1x1x1 inside",
            tp_bug[3]["4x1x2"] > 10 and tp_bug[3]["1x1x1"] < 1)
check.holds("dropped-micro-batch: the report says FAIL, both layouts (m = 2) not exact in float64",
            not mb_bug[0] and mb_bug[2] == ["1x1x1", "2x2x2"])
check.holds("dropped-micro-batch: more than half the parameters flagged on each layout",
            all(sum(L == name for L, _ in mb_bug[1]) > NP / 2 for name in ("1x1x1", "2x2x2")))
check.note("the correct code on the same layouts: inside the band (section 3's check)", facts[0])

# %% [markdown]
# How to use the oracle on such a report, in this order:
#
# 1. **The float64 line first.** Every layout of hsgd reproduces serial SGD in float64 to ~1e-15; a layout that does not
#    has a bug, whatever the format: both bugs above fail here, by orders of magnitude.
# 2. **Then the band.** Exact in float64 means every bfloat16 difference is rounding; the oracle says whether of the
#    size the model predicts. Inside: nothing to find by comparing one step. Outside: one parameter far outside
#    (missing-tp-scale, a factor tp) points at its own code path; all of them a little outside at something global (a
#    loss scale, a dropped micro-batch, underflow).
# 3. **Both columns.** Against float64: distance from the truth; against the base layout: what the report compares.
# 4. **Seeds.** One seed inside proves little; a difference outside on several seeds is a finding.
# 5. **What it cannot see.** A bug smaller than the rounding (a wrong scale of $1 + 10^{-3}$ in bfloat16) is inside the
#    band; only the float64 line catches it. And a step is not a training run: `--loss-steps K` asks the same of the
#    loss after K steps.
#
# ## Check against serial
#
# Every verdict above is collective over 8 ranks; the float64 runs are serial SGD's to rounding, and every bfloat16 and
# float16 difference was held to a bound derived above.

# %%
what, err = check.worst(["the oracle: every layout's float64 run against the float64 reference"])
say(f"\nchapter 14: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error against serial "
    f"(float64) {err:.1e} ({what})")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `--dtype bfloat16`: `precision.Numerics`, `round_to` at every point of `POINTS`, float32 master weights and gradients | `--bf16` (`Float16OptimizerWithFloat16Params`: float32 main params) | `"bf16": {"enabled": true}` | `torch.autocast(device_type, dtype=torch.bfloat16)`; FSDP `MixedPrecision(param_dtype=torch.bfloat16)` | emulated on float32 arrays, every rounding point named and counted; no kernel rounds differently from its neighbour |
# | `--reduce-dtype`: the gradient exchange's format (`Numerics.reduced`); float32 by default | `--accumulate-allreduce-grads-in-fp32` (gradients accumulated and All-Reduced in float32; set by `--bf16` unless `--grad-reduce-in-bf16`) | `"communication_data_type"` (unset: the compute dtype, bfloat16 under `"bf16"`) | FSDP `MixedPrecision(reduce_dtype=...)`; FSDP2 `MixedPrecisionPolicy(reduce_dtype=...)` (None: the compute dtype) | the default is the safe one: float32, whatever --dtype |
# | `--dtype float16 --loss-scale dynamic`: `LossScaler` (S = 2^16, x 0.5 on inf, x 2 after 2000 good steps) | `--fp16`, `--loss-scale` (fixed), `--initial-loss-scale`, `--loss-scale-window`, `--hysteresis`, `--min-loss-scale` (`DynamicGradScaler`) | `"fp16": {"enabled", "loss_scale": 0 (dynamic), "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"}` | `torch.amp.GradScaler(init_scale, growth_factor, backoff_factor, growth_interval)` | GradScaler's rules: no hysteresis (halve at the first inf); S below 1 ends the run (`MIN_SCALE`, chapter 19) |
# | `hsgd.check.oracle`, `python -m hsgd.verify --dtype bfloat16 --layouts ...`: a band per parameter from a rounding-error model | none | none | none (`torch.testing.assert_close` has fixed per-dtype tolerances, e.g. rtol 1.6e-2 for bfloat16) | the tolerance is predicted per layout and parameter, not fixed per dtype |
# | `hsgd.check.mutations.injected(bug)`: bugs on purpose, to show the checks catch them | none | none | none | a teaching device, never imported by hsgd itself |
#
# ## Exercises
#
# ### Exercise 1: Kahan summation in bfloat16
# Write compensated (Kahan) summation with every operation rounded to bfloat16 (`round_to` after each float32 add
# and subtract), sum section 1's 4096 numbers, and check that its error stays below $2u + n u^2$ of $\sum|x_i|$
# (its classical bound) while the plain sum stagnates at 256.
# (solution: `tutorials/solutions/14_floating_point.py`, `exercise_1`)
#
# ### Exercise 2: stochastic rounding
# Round x to bfloat16 up with probability (x - down) / (up - down), else down. Check that the mean of many
# stochastic roundings of one x is x (within a few standard errors, where round-to-nearest is off by a fixed
# amount), and that section 1's sequential sum no longer stagnates: its error at n = 4096 is of the $\sqrt{n}\,u$
# scale.
# (solution: `tutorials/solutions/14_floating_point.py`, `exercise_2`)
#
# ### Exercise 3: the band of one linear layer, by hand
# For $dW = X^\top dY$ with X (N, C) and dY (N, F) rounded to bfloat16 before a float32 product, derive the model's
# rms error of dW relative to its norm, $u \sqrt{2/3}\, \sqrt{\sum_{ij} \sum_n X_{ni}^2 dY_{nj}^2} / \|dW\|$. Check
# it against `Perturbed` (many salts) within 10%, and that real rounding's rms error is below it, near 0.74 of it.
# (solution: `tutorials/solutions/14_floating_point.py`, `exercise_3`)
#
# ### Exercise 4: a float16 overflow found by the scaler
# Train a float16 `HybridTrainer` on dp 2 whose scaler starts at $S = 2^{36}$, far too large. Check that each step
# skips the update on both ranks (master weights bit-identical) and halves S, and that the first update comes at the
# largest power of two S with $S \max|g| < 65520$ (g: the activation gradients the backward hands to a rounding,
# recorded by a `Numerics` of your own; 65520 is where float16 rounds to inf), equal on both replicas.
# (solution: `tutorials/solutions/14_floating_point.py`, `exercise_4`)
