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
# # Chapter 15: FP8: 8-bit products, their scales, and the ranks a scale is agreed over
#
# Chapter 14 rounded to bfloat16 and float16, formats wide enough that a tensor is stored as it is. An 8-bit format is
# not: E4M3 spans «17.8» binades with 4 significant bits, E5M2 «31.8» with 3, and a Transformer's tensors (weights near
# 0.02, activations near 1, gradients of a mean over thousands of tokens near $10^{-6}$) sit in different places. FP8
# training (Micikevicius et al. 2022, "FP8 Formats for Deep Learning") therefore multiplies each operand of a matrix
# product by a **scale** that puts its largest magnitude near the top of the format, casts, and divides the scale out
# after the product. The scale is what a distributed run must get right: every rank that holds a piece of a tensor must
# cast with the *same* scale, so its amax must be reduced over exactly those ranks. FP8 is beyond the lecture, as
# chapter 14 is; section 3 stands on its sections 3.3 and 3.4, which say which ranks hold the pieces of one tensor and
# the copies of one shard. `hsgd.fp8` is the code taught.
#
# Run it with four ranks (measured on a 2-core machine: 3 s idle, 16 s under another job's 8 ranks). Rank 0 prints and
# draws two pictures into `$HSGD_FIGURES` (default `tutorials/figures/`); `mpirun -n 4 python -m hsgd.train --dp 2 --tp
# 2 --fp8 hybrid --fp8-recipe delayed --fp8-history 16 --fp8-check` trains with FP8 products (`--dtype float64` for the
# exact mode).
#
# mpirun -n 4 python tutorials/15_fp8.py
#
# Legend: B sequences in the global batch, T sequence length, C d_model, NH heads, F the MLP width, V vocabulary, L
# blocks; tp, cp, dp the layout's sizes, written dp x cp x tp where pp = 1, m micro-batches. A linear is Y = X W with X
# (N, K) (N = tokens), W (K, M), dY (N, M). FP8: p the significant bits of a format (leading bit included), emin its
# smallest normal exponent, fmax its largest value, u = 2^-p; amax the largest |value| of a tile; s = fmax / amax /
# 2^margin the scale, q(x) = round(x s, saturating) / s the value a product reads; b a block's side. Section 4: p the
# bits the partial sum keeps (14), N_c the terms between promotions to float32.

# %%
from hsgd.model.config import ModelConfig   # hsgd first, as appendix B explains (OpenBLAS's thread timeout)

import inspect
import math

import numpy as np

from hsgd.fp8.accumulate import accumulation_error, chop, fp8_inputs, limited_matmul, predicted
from hsgd.fp8.domains import Holders, ScaleMismatch, check_same
from hsgd.fp8.linear import Fp8Ops, key
from hsgd.fp8.recipes import FP8_FORMATS, make_recipe
from hsgd.fp8.reference import serial_fp8_sgd
from hsgd.fp8.scaling import BUGS, Fp8, make_fp8, past_max
from hsgd.grid.process_grid import ProcessGrid
from hsgd.model import layers, serial
from hsgd.model.data import Corpus
from hsgd.model.precision import FORMATS, round_to, unit_roundoff
from hsgd.step.trainer import HybridTrainer

import pictures                                  # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, ring_share, train_config   # tutorials/checks.py, shared by the chapters

P = 4
TOL = 1e-12                                      # the exact mode: FP8 values, float64 everything else
# one BLAS thread per rank; four ranks, else a clear exit; check(what, err, tol), check.holds(what, cond),
# check.equal(what, a, b), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, P, tol=TOL, width=84)

CFG = ModelConfig(vocab_size=256, seq_len=32, d_model=32, n_heads=4, n_layers=2, d_ff=64)
CORPUS = Corpus(np.random.default_rng(5).integers(0, 256, 4000, dtype=np.uint8).tobytes(), "random bytes",
                CFG.seq_len)
B = 8                                            # sequences per step
E4, E5 = "float8_e4m3fn", "float8_e5m2"


# %% [markdown]
# ## 1. The two formats and the values a tensor holds
#
# A format with p significant bits and smallest normal exponent emin holds the numbers $M\,2^{e-p+1}$, M an integer,
# $|M| < 2^p$, $e \ge$ emin; below $2^{\text{emin}}$ the spacing stays fixed (the subnormals), down to
# $2^{\text{emin}-p+1}$. The OCP standard's two 8-bit formats (`hsgd.model.precision.FORMATS`):
#
# - **E4M3** (`float8_e4m3fn`): p = 4, emin = -6, no infinity: of its top binade's codes only the all-ones one is
#   special (NaN), so its largest value is $1.75 \cdot 2^8 = 448$, and a value that rounds past it becomes NaN. Used for
#   the forward (X and W).
# - **E5M2** (`float8_e5m2`): float16's exponent range with p = 3, emin = -14, IEEE-like (inf and NaN), largest
#   $1.75 \cdot 2^{15} = 57344$. Used for gradients, whose range is wider: `FP8_FORMATS["hybrid"]` is E4M3 forward, E5M2
#   backward.
#
# The checks try the edges of each range with `round_to`.

# %%
say(f"{'format':>14} {'p':>2} {'emin':>5} {'fmax':>11} {'smallest normal':>16} {'smallest subnormal':>19} "
    f"{'binades':>8} {'u = 2^-p':>9}")
for name in (E4, E5, "bfloat16"):
    f = FORMATS[name]
    tiny = 2.0 ** (f.emin - f.p + 1)
    say(f"{name:>14} {f.p:>2} {f.emin:>5} {f.max:>11.6g} {2.0 ** f.emin:>16.3e} {tiny:>19.3e} "
        f"{math.log2(f.max / tiny):>8.1f} {unit_roundoff(name):>9.4f}")
check.equal("E4M3 max = 1.75 x 2^8 = 448, E5M2 max = 1.75 x 2^15 = 57344",
            (FORMATS[E4].max, FORMATS[E5].max), (1.75 * 2 ** 8, 1.75 * 2 ** 15))
check.equal("--fp8 hybrid: E4M3 for X and W, E5M2 for dY", FP8_FORMATS["hybrid"], {"x": E4, "w": E4, "dy": E5})


def shown(v):
    """A cast value as a comparable item: 'nan' for NaN (NaN != NaN), else the float."""
    return "nan" if v != v else float(v)


edges = [  # (what, format, x, saturate) -> what round_to gives, worked out by hand beside it
    ("448 stays", E4, 448.0, False, 448.0),
    ("464, halfway to the missing 480: ties to even, 448", E4, 464.0, False, 448.0),
    ("465: past 448 + half a step, NaN (no inf)", E4, 465.0, False, "nan"),
    ("inf: NaN", E4, np.inf, False, "nan"),
    ("1e6 saturated: 448", E4, 1e6, True, 448.0),
    ("2^-10, half the smallest subnormal: ties to even, 0", E4, 2.0 ** -10, False, 0.0),
    ("1.01 x 2^-10: the smallest subnormal 2^-9", E4, 1.01 * 2.0 ** -10, False, 2.0 ** -9),
    ("61440, halfway to 2^16: ties to even, inf", E5, 61440.0, False, float("inf")),
    ("61439: 57344", E5, 61439.0, False, 57344.0),
    ("2^-17, half the smallest subnormal: 0", E5, 2.0 ** -17, False, 0.0),
    ("inf saturated: 57344", E5, np.inf, True, 57344.0),
]
got = [shown(round_to(np.array([x]), fmt, saturate=sat)[0]) for _, fmt, x, sat, _ in edges]
for (what, fmt, x, sat, want), g in zip(edges, got):
    say(f"  {fmt:<14} {what:<56} -> {g}")
check.equal("round_to at the edges of both ranges == the values worked out by hand", got,
            [want for *_, want in edges])

# %% [markdown]
# Where do a model's values fall? One float64 forward and backward of the tiny model (L = 2, C = 32, NH = 4, F = 64, B =
# 8, T = 32), with an `Fp8` inside `Fp8Ops` whose `quantize`, which every operand of a block linear passes, keeps a copy
# and returns it uncast. Four operands: a weight, an activation (the MLP's input) and two output gradients dY, which
# carry the loss's 1/(B T) and shrink through the blocks. For each, the fraction of nonzero values a cast would flush to
# zero, leave subnormal or push past fmax, with s = 1 and with s = fmax/amax.

# %%
PICKED = {"h.0.mlp.fc.weight:w": ("weight W", E4), "h.0.mlp.in:x": ("activation X", E4),
          "h.0.mlp.fc:dy": ("gradient dY", E5), "h.0.attn.q:dy": ("gradient dY", E5)}


class Captured(Fp8):
    """An Fp8 that casts nothing: it keeps the first operand handed to it under each name, and returns it."""

    def __init__(self):
        super().__init__("hybrid", make_recipe("tensorwise"))
        self.seen = {}

    def quantize(self, x2, role, key, spread, holders, axis):
        self.seen.setdefault(key, x2.copy())
        return x2


def operands():
    params = serial.init_params(CFG, seed=0, dtype="float64")
    captured = Captured()
    ops = Fp8Ops(layers, captured)                       # the plain layers, the block linears through `captured`
    ops.bind(params)
    serial.loss_and_grads(params, *CORPUS.batch(0, 1, B), CFG, ops=ops)
    return {k: captured.seen[k] for k in PICKED}


def cast_stats(x, fmt, s):
    """Fractions of x's nonzero values that x s cast to fmt flushes to 0, leaves subnormal, overflows; and the
    relative error ||q(x) - x|| / ||x|| of q(x) = round(x s, saturating) / s."""
    f = FORMATS[fmt]
    y = x * s
    r = round_to(y, fmt, saturate=True)
    n = np.count_nonzero(x)
    return dict(under=np.count_nonzero((r == 0) & (x != 0)) / n,
                sub=np.count_nonzero((r != 0) & (np.abs(r) < 2.0 ** f.emin)) / n,
                over=np.count_nonzero(np.abs(y) > past_max(f)) / n,
                err=float(np.linalg.norm(r / s - x) / np.linalg.norm(x)))


seen = pictures.on_rank0(world, operands, share=True)    # rank 0 computes, every rank receives
stats = {}
say(f"\n{'operand':<21} {'cast to':<14} {'amax':>8} {'smallest':>9}   {'s':>9} {'underflow':>9} {'subnormal':>9} "
    f"{'overflow':>8} {'||q(x)-x||/||x||':>16}")
for k, (label, fmt) in PICKED.items():
    x = seen[k]
    amax = float(np.abs(x).max())
    for s in (1.0, FORMATS[fmt].max / amax):
        stats[(k, s == 1.0)] = st = cast_stats(x, fmt, s)
        say(f"{k:<21} {fmt:<14} {amax:>8.1e} {np.abs(x[x != 0]).min():>9.1e}   {s:>9.3g} {st['under']:>9.2%} "
            f"{st['sub']:>9.2%} {st['over']:>8.2%} {st['err']:>16.3f}")
scaled = [st for (k, unscaled), st in stats.items() if not unscaled]
check.equal("scaled by fmax/amax: no value overflows, none underflows (all four)",
            [(st["over"], st["under"]) for st in scaled], [(0.0, 0.0)] * len(scaled))
check("scaled: ||q(x) - x|| / ||x|| / u of the format, the worst of the four",
      max(stats[(k, False)]["err"] / unit_roundoff(fmt) for k, (_, fmt) in PICKED.items()), 1.0)
check.holds("unscaled: the attention q's gradient mostly underflows in E5M2 (over 90% flushed to 0)",
            stats[("h.0.attn.q:dy", True)]["under"] > 0.9)
check.holds("unscaled: half the weight's values are E4M3 subnormals (fewer than 4 significant bits)",
            stats[("h.0.mlp.fc.weight:w", True)]["sub"] > 0.4)


def draw_ranges():
    fig, axes = pictures.figure(10, 6.2, nrows=2, ncols=2, sharex=True)
    bins = np.arange(-34, 19, 0.5)                                         # log2 |value|, every panel alike
    for ax, (k, (label, fmt)) in zip(axes.flat, PICKED.items()):
        x = seen[k]
        v = np.log2(np.abs(x[x != 0]))
        shift = math.log2(FORMATS[fmt].max / np.abs(x).max())              # log2 s
        for name, color in ((E5, "C1"), (E4, "C2")):
            f = FORMATS[name]
            tag = "E4M3" if name == E4 else "E5M2"
            ax.axvspan(f.emin, math.log2(f.max), color=color, alpha=0.2, lw=0, label=f"{tag} normal")
            ax.axvspan(f.emin - f.p + 1, f.emin, color=color, alpha=0.08, lw=0, hatch="///",
                       label=f"{tag} subnormal")
        ax.hist(v, bins, color="0.35", alpha=0.8, label="as it is (s = 1)")
        ax.hist(v + shift, bins, histtype="step", color="C0", lw=1.5, label=f"times s = 2^{shift:.1f}")
        ax.set_title(f"{label} {k}: cast to {'E4M3' if fmt == E4 else 'E5M2'}", fontsize=9)
        ax.set_xlim(-34, 36)
        if ax in axes[1]:
            ax.set_xlabel("log2 |value|")
        ax.set_ylabel("values")
        ax.legend(fontsize=6, loc="upper right")
    return pictures.save(fig, "15_fp8_ranges")


say(f"picture: {pictures.on_rank0(world, draw_ranges, share=True)}")

# %% [markdown]
# The picture shows each operand's histogram of $\log_2|x|$ as held (grey) and scaled (blue outline, moved right by
# $\log_2 s$), over the normal (solid) and subnormal (hatched) ranges of E4M3 (green) and E5M2 (orange). Unscaled, the
# weight falls half into E4M3's subnormals and the first block's q gradient lies below E5M2's smallest number; scaled,
# every top sits at fmax and the bulk in the normal range. A tensor's own spread, its histogram's width, is what no
# scale can fix.
#
# ## 2. Scaling recipes as objects
#
# A recipe (`hsgd.fp8.recipes`, `make_recipe(name)`) answers two questions: which elements share a scale (the **tile**),
# and whose amax sets it:
#
# | recipe | tile | amax from | in production |
# |---|---|---|---|
# | delayed | the tensor | the maximum of the last `history` steps' amaxes (not this one's) | TransformerEngine's `DelayedScaling` |
# | tensorwise | the tensor | this tensor, now ("current scaling") | `Float8CurrentScaling`; torchao's tensorwise |
# | rowwise | a row along the contraction axis K | this row, now | torchao's rowwise |
# | blockwise | 1 x b tiles of X and dY along K, b x b blocks of W | this tile, now | DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 3.3; `Float8BlockScaling` |
#
# A tile runs along the contraction axis, so its scale can be divided out of each dot product. The experiment: an
# activation X (64 tokens x K = 128) of N(0, 1) values in which tokens 0-3 are $10^4$ times larger (outlier tokens, as
# LLMs show), tokens 60-63 $10^3$ times smaller, and token 10 holds one outlier of $3 \cdot 10^5$. Each recipe casts it
# through `Fp8.quantize` (`Holders()`: no rank shares it). Printed: the relative error in norm, the worst token's, and
# the values whose error exceeds u (cast below the normal range).

# %%
SERIAL = Holders()                                   # one rank: no communicator splits anything
U4 = unit_roundoff(E4)


def cast(recipe, x, role="x", axis=1, fp8=None):
    """(q(x), the Fp8) for operand `role` of a linear, tiles along `axis` (1: K for X, as the forward casts it)."""
    fp8 = fp8 if fp8 is not None else Fp8("hybrid", recipe)
    return fp8.quantize(x, role, "demo:" + role, SERIAL.spread("h.0.mlp.fc.weight", role), SERIAL, axis), fp8


rng = np.random.default_rng(2)
X = rng.standard_normal((64, 128))                   # (N, K)
X[:4] *= 1e4                                         # outlier tokens
X[60:] *= 1e-3                                       # quiet tokens
X[10, 5] = 3e5                                       # one outlier value in token 10
recipes = {name: make_recipe(name, block=32) for name in ("tensorwise", "rowwise", "blockwise")}
bad, out = {}, {}
say(f"{'recipe':<18} {'||q(X)-X||/||X||':>17} {'worst token':>12} {'error above u':>15} {'zeros':>6}")
for name, recipe in recipes.items():
    Q, fp8 = cast(recipe, X)
    out[name] = Q
    bad[name] = np.argwhere(np.abs(Q - X) > U4 * np.abs(X))               # (n, 2): (token, column)
    rows = np.linalg.norm(Q - X, axis=1) / np.linalg.norm(X, axis=1)
    say(f"{recipe.describe():<18} {np.linalg.norm(Q - X) / np.linalg.norm(X):>17.2e} {rows.max():>12.2e} "
        f"{len(bad[name]):>15} {fp8.counts[('x', 'underflow')]:>6}")
check.holds("values with an error above u: blockwise <= rowwise <= tensorwise",
            len(bad["blockwise"]) <= len(bad["rowwise"]) <= len(bad["tensorwise"]))
check.holds("rowwise: every one of them is in token 10 (its row's scale is set by its outlier)",
            set(bad["rowwise"][:, 0].tolist()) == {10})
check.holds("blockwise (b = 32): ... all in token 10's first tile, columns 0-31",
            set(bad["blockwise"][:, 0].tolist()) == {10} and bad["blockwise"][:, 1].max() < 32)
check.holds("tensorwise: the quiet tokens flush to zero entirely (worst token error 1)",
            np.all(out["tensorwise"][60:] == 0))

# %% [markdown]
# One tensorwise scale serves the loudest value: every ordinary token drops into E4M3's subnormals and the quiet ones
# vanish. A scale per row isolates each token (only token 10 loses its small values to its own outlier), and a 1 x 32
# tile isolates the outlier's neighbourhood. Weights get b x b blocks: a 128 x 128 W ~ N(0, 0.02^2) with one 32 x 32
# block $10^4$ times smaller (a part that barely moved), tensorwise and blockwise.

# %%
W = rng.standard_normal((128, 128)) * 0.02           # (K, M)
W[32:64, 64:96] *= 1e-4
wbad = {}
for name in ("tensorwise", "blockwise"):
    Qw, fw = cast(recipes[name], W, role="w", axis=0)
    wbad[name] = int(np.count_nonzero(np.abs(Qw - W) > U4 * np.abs(W)))
    say(f"W, {recipes[name].describe():<16}: {wbad[name]:>4} values with an error above u, "
        f"{fw.counts[('w', 'underflow')]:>3} flushed to zero")
check.holds("W with a quiet block: blockwise casts every value within u, tensorwise does not",
            wbad["blockwise"] == 0 < wbad["tensorwise"])

# %% [markdown]
# **Delayed scaling** casts with a scale from the past: `quantize` records the amax of what it casts, `end_step` pushes
# it into the operand's history (reduced over the tensor's holders, section 3), and the next step's scale is fmax over
# the history's maximum. It is blind to the present: the first step casts with s = 1, as TransformerEngine starts, and a
# value above every recent one saturates. On X: step 1 with s = 1, then step 2, which for one tensor is the tensorwise
# cast exactly.

# %%
delayed = Fp8("hybrid", make_recipe("delayed", history=2))
Q1, _ = cast(delayed.recipe, X, fp8=delayed)
first = {k: delayed.counts[("x", k)] for k in ("overflow", "underflow")}
delayed.end_step()                                   # the step's amax into the history
Q2, _ = cast(delayed.recipe, X, fp8=delayed)
say(f"delayed, step 1 (s = 1): {first['overflow']} values saturated at 448, {first['underflow']} flushed to zero; "
    f"history after it: {delayed.histories['demo:x']}")
check.holds("delayed, step 1: values overflow and values underflow (no history: s = 1)",
            first["overflow"] > 0 and first["underflow"] > 0)
check.holds("delayed, step 2 == tensorwise, bit for bit (the history holds this tensor's amax)",
            np.array_equal(Q2, out["tensorwise"]))

# %% [markdown]
# The same in training: three steps of the serial FP8 model (float64, delayed scaling, history 2), each step's counts
# read from `fp8.last`. Step 1 casts the gradients with s = 1 into E5M2, where the small ones flush to zero; from step 2
# the history is there.

# %%
def delayed_run():
    tc = train_config(steps=3, batch_size=B, dp=1, fp8="hybrid", fp8_recipe="delayed", fp8_history=2)
    fp8 = make_fp8(tc.fp8_settings())
    params = serial.init_params(CFG, seed=tc.seed, dtype="float64")
    ops = Fp8Ops(layers, fp8)
    ops.bind(params)
    log = []

    def after_step():
        fp8.end_step()
        log.append(dict(fp8.last))                   # this step's counts, per (role, what)

    serial.sgd(CFG, tc, lambda s: CORPUS.batch(tc.seed, s, B), params, micro_sequences=B, ops=ops,
               after_step=after_step, sliced=True)
    return log


steps = pictures.on_rank0(world, delayed_run, share=True)
say(f"{'step':>4} " + "".join(f"{r + ' ' + w:>15}" for r in ("x", "w", "dy") for w in ("overflow", "underflow"))
    + f"{'dy values':>11}")
for i, c in enumerate(steps, 1):
    say(f"{i:>4} " + "".join(f"{c[(r, w)]:>15}" for r in ("x", "w", "dy") for w in ("overflow", "underflow"))
        + f"{c[('dy', 'values')]:>11}")
check.holds("delayed, step 1: over a quarter of the gradient values flushed to zero (s = 1)",
            steps[0][("dy", "underflow")] > steps[0][("dy", "values")] / 4)
check.holds("delayed, step 2: over 1000 times fewer (the scale from step 1's amax)",
            1000 * steps[1][("dy", "underflow")] < steps[0][("dy", "underflow")])

# %% [markdown]
# Step 2 trades the underflow for a few overflows (step 1's update changed the model). `--fp8-margin` (s divided by
# $2^{\text{margin}}$) and a longer history buy that off, for a binade at the bottom (exercise 3).
#
# ## 3. The amax and its domain
#
# hsgd declares, per operand of each linear, how it lies on the ranks (`Holders.spread`): **split** by tp along an axis
# (a column-parallel W along M, the row-parallel X along K), **gathered** from T-shards (the sequence scheme's inputs,
# cast before their All-Gather), a **copy** on every tp rank, and split along the tokens by cp. A tile's amax is reduced
# (MAX) over the communicators that split it (`reduce_over`), and every holder of a tile, copies included, must end with
# the same scale (`share`). The real `Holders` of two layouts, read from their trainers:

# %%
LINEARS = ("h.0.attn.q.weight", "h.0.attn.proj.weight", "h.0.mlp.fc.weight", "h.0.mlp.proj.weight")
USES = {"x": (1, 0), "w": (0, 1), "dy": (1, 0)}    # the contraction axes of each operand's two casts
WHOLE = {"tensorwise": make_recipe("tensorwise"), "rowwise": make_recipe("rowwise"),
         "blockwise": make_recipe("blockwise", block=8)}


def names(comms):
    return "+".join(c.name for c in comms) or "-"


def domain_table(h):
    """{operand: (tp spread, tp axis, cp, per-tensor over, rowwise over (first use), (second use), blockwise)}."""
    rows = {}
    for lin in LINEARS:
        for role, (a, b) in USES.items():
            sp = h.spread(lin, role)
            rows[key(lin, role)] = (sp.tp, sp.tp_axis, sp.cp, names(h.reduce_over(sp, WHOLE["tensorwise"], a)),
                                    names(h.reduce_over(sp, WHOLE["rowwise"], a)),
                                    names(h.reduce_over(sp, WHOLE["rowwise"], b)),
                                    names(h.reduce_over(sp, WHOLE["blockwise"], a)))
    return rows


def show_domains(title, rows):
    say(f"\n{title}\n{'operand':<24} {'tp':>8} {'axis':>4} {'cp':>5} {'per-tensor':>11} {'rowwise (1st)':>14} "
        f"{'rowwise (2nd)':>14} {'blockwise':>10}")
    for k, (tp, ax, cp, pt, r1, r2, bw) in rows.items():
        say(f"{k:<24} {str(tp):>8} {str(ax):>4} {str(cp):>5} {pt:>11} {r1:>14} {r2:>14} {bw:>10}")


# %% [markdown]
# "1st" and "2nd" are an operand's two casts: X along K (forward) and the tokens (wgrad), W along K (forward) and M
# (dgrad), dY along M (dgrad) and the tokens (wgrad).
#
# **The exact mode.** With `--fp8 hybrid --dtype float64` every operand of a block linear is an FP8 number times 1/s and
# the rest float64, so runs that cast alike agree to float64's rounding and a scale taken over the wrong ranks shows at
# FP8's size. The serial FP8 reference (as `tests/mpi/test_fp8.py` builds it) is `serial.sgd` through `Fp8Ops`, computed
# one replica's micro-batch at a time (`micro_sequences = B/(dp m)`: what a current scale is taken over), each replica's
# backward seeded as the layout seeds it (`replicas = dp cp`: exercise 1), `end_step` after every step. Four layouts of
# 4 ranks, a recipe each, three steps with `--fp8-check` (every scale compared over its tile's holders); parameters,
# losses and amax histories against the reference:

# %%
def serial_fp8(tc):
    """The serial FP8 reference of layout tc (hsgd.fp8.reference): (params, losses, histories) after tc.steps
    steps."""
    return serial_fp8_sgd(CFG, tc, lambda s: CORPUS.batch(tc.seed, s, tc.batch_size))


def train_layout(tc, bugs=(), look=None):
    """tc.steps steps of HybridTrainer on tc's layout, with `bugs` (names of hsgd.fp8.scaling.BUGS) committed.
    Returns {"params": every parameter whole (None if a step raised), "losses", "histories", "error": None or
    "ScaleMismatch: ...", "seen": look(trainer) before the first step, "traffic": step 1's {(comm, op): (calls,
    payload bytes)}}."""
    grid = ProcessGrid(world, dp=tc.dp, pp=tc.pp, tp=tc.tp, cp=tc.cp)
    trainer = HybridTrainer(CFG, grid, tc)
    fp8 = trainer.stage.fp8
    if bugs:
        fp8.bugs = set(bugs)
    out = dict(params=None, losses=[], histories=None, error=None, traffic=None,
               seen=look(trainer) if look else None)
    try:
        for step in range(1, tc.steps + 1):
            before = grid.stats.counts()
            out["losses"].append(trainer.step(*CORPUS.batch(tc.seed, step, tc.batch_size), step).loss)
            if step == 1:
                out["traffic"] = grid.stats.since(before)
    except ScaleMismatch as e:                       # raised on every rank of the communicator (check_same)
        out["error"] = f"{type(e).__name__}: {e}"
    if out["error"] is None:
        trainer.finish()
        out["params"] = trainer.full_params()        # whole, on every rank
        out["histories"] = fp8.histories if fp8 is not None else {}
    trainer.free()
    grid.free()
    return out


def param_err(mine, ref):
    """max over parameters of max |p - ref| / max(max |ref|, 0.02) (the MPI tests' measure)."""
    return max(float(np.abs(mine[n] - ref[n]).max() / max(np.abs(ref[n]).max(), 0.02)) for n in ref)


def history_err(mine, ref):
    """The largest relative difference between two sets of amax histories (1.0 if the keys differ)."""
    if set(mine) != set(ref):
        return 1.0
    return max([abs(a - b) / b for k in ref for a, b in zip(mine[k], ref[k])], default=0.0)


def fp8_config(layout, steps=3, **kw):
    dp, cp, tp = layout
    return train_config(steps=steps, batch_size=B, dp=dp, pp=1, cp=cp, tp=tp, fp8="hybrid", **kw)


LAYOUTS = [  # ((dp, cp, tp), settings)
    ((2, 1, 2), dict(fp8_recipe="delayed", fp8_history=2)),
    ((1, 2, 2), dict(fp8_recipe="tensorwise", tp_scheme="sequence")),
    ((1, 1, 4), dict(fp8_recipe="rowwise", tp_scheme="sequence")),
    ((2, 2, 1), dict(fp8_recipe="blockwise", fp8_block=8)),     # tiles of 8: T/(2 cp) = 8 positions a run
]
tables, exact = {}, {}
for layout, kw in LAYOUTS:
    tc = fp8_config(layout, fp8_check=True, **kw)
    ref = pictures.on_rank0(world, lambda: serial_fp8(tc), share=True)
    run = train_layout(tc, look=lambda tr: domain_table(tr.stage.setup.products.holders))
    scheme = f" {tc.tp_scheme}" if tc.tp > 1 else ""                # (tp = 1: no scheme to name)
    name = f"{layout[0]}x{layout[1]}x{layout[2]}{scheme} {kw['fp8_recipe']}"
    tables[name] = run["seen"]
    if layout in ((2, 1, 2), (1, 2, 2)):
        show_domains(f"{name}: where each operand lies and what its amax is reduced over, on rank {rank}",
                     run["seen"])
    errs = (param_err(run["params"], ref[0]), max(abs(a - b) / b for a, b in zip(run["losses"], ref[1])),
            history_err(run["histories"], ref[2]))
    exact[name] = max(errs)
    say(f"  {name:<32}: params {errs[0]:.1e}, losses {errs[1]:.1e}, amax histories {errs[2]:.1e} "
        f"against the serial FP8 reference; every scale agreed (--fp8-check)")
for name, err in exact.items():
    check(f"exact mode, dp x cp x tp = {name}: params, losses, histories vs serial FP8", err)
megatron = tables["2x1x2 megatron delayed"]
check.equal("megatron's spreads == the domains docstring's table (q: X copy, W and dY split along M; proj: X "
            "split along K, W along K, dY copy)",
            {k: v[:2] for k, v in megatron.items() if ".attn." in k},
            {"h.0.attn.qkv:x": ("copy", None), "h.0.attn.q.weight:w": ("split", 1), "h.0.attn.q:dy": ("split", 1),
             "h.0.attn.proj:x": ("split", 1), "h.0.attn.proj.weight:w": ("split", 0),
             "h.0.attn.proj:dy": ("copy", None)})
check.holds("blockwise reduces no amax anywhere (a tile never leaves its rank)",
            all(v[6] == "-" for t in tables.values() for v in t.values()))

# %% [markdown]
# In the sequence scheme the inputs of q k v and fc are **gathered**: the All-Gather moves FP8 numbers, so the T-shards
# must share one scale, reduced over tp, and with cp over cp too. Blockwise needs no reduction: `check_blocks` refuses a
# layout whose pieces cut a tile (exercise 4).
#
# **What the agreement costs.** A current scale is reduced at each cast (one `Allreduce` MAX of a number, or of a vector
# of rows, per operand and use); delayed scaling reduces the whole step's amaxes at its end, one vector of 16 L numbers
# over tp and one over dp. Measured on dp 2 x tp 2 (megatron) as the Allreduce traffic of step 1 beyond a run without
# FP8, payload and what a ring moves per rank (2(p-1)/p of it):

# %%
plain_tc = train_config(steps=1, batch_size=B, dp=2, pp=1, cp=1, tp=2)
plain = train_layout(plain_tc)["traffic"]
extra = {}
for recipe in ("delayed", "tensorwise"):
    traffic = train_layout(fp8_config((2, 1, 2), steps=1, fp8_recipe=recipe))["traffic"]
    extra[recipe] = {k: (v[0] - plain.get(k, (0, 0))[0], v[1] - plain.get(k, (0, 0))[1])
                     for k, v in traffic.items() if v != plain.get(k)}
    for (comm, op), (calls, nbytes) in sorted(extra[recipe].items()):
        say(f"  {recipe:<10} {comm}_comm {op:<10}: {calls:>4} calls, payload {nbytes:>6} B, ring "
            f"{float(ring_share(op, 2) * nbytes):>7.0f} B per rank")
keys16 = 16 * CFG.n_layers
check.equal(f"delayed: one Allreduce of 16 L = {keys16} float64 amaxes over tp and one over dp, nothing else",
            extra["delayed"], {("tp", "Allreduce"): (1, 8 * keys16), ("dp", "Allreduce"): (1, 8 * keys16)})
check.holds("tensorwise: many Allreduces, all on tp (a current scale is its replica's own: never over dp)",
            set(extra["tensorwise"]) == {("tp", "Allreduce")} and extra["tensorwise"][("tp", "Allreduce")][0] > 1)

# %% [markdown]
# Bytes are nothing here; calls are the cost. Current scaling puts a small collective in front of many products, on the
# critical path; delayed scaling pays one per step and communicator, off it (TransformerEngine and torchao batch theirs
# likewise).
#
# **Three bugs, reproduced.** `hsgd.fp8.scaling.BUGS` holds amax reductions real runs got wrong, switched on by
# `trainer.stage.fp8.bugs = {name}`:

# %%
for name in ("amax-local-shard", "amax-dp-only", "amax-no-sp-reduce"):
    say(f"  {name:<18} {BUGS[name]}")

# %% [markdown]
# Each on dp 2 x tp 2: a tp shard's weight amax taken locally with tensorwise scaling (torchtitan issue #3109); the
# history reduced over dp but not tp with delayed scaling (Megatron-LM PR #442: a 40B model diverged at tp 8); the
# sequence scheme's gathered inputs cast on their own T-shard's amax (TransformerEngine PR #74). First one step in the
# exact mode against the serial FP8 reference, then two steps with `--fp8-check`.

# %%
BUG_CASES = [
    ("amax-local-shard", dict(fp8_recipe="tensorwise"), "h.0.attn.q.weight:w"),
    ("amax-dp-only", dict(fp8_recipe="delayed", fp8_history=2), "h.0.attn.q.weight:w"),
    ("amax-no-sp-reduce", dict(fp8_recipe="tensorwise", tp_scheme="sequence"), "h.0.attn.qkv:x"),
]
tp_group = rank // 2                                  # dp 2 x tp 2: ranks (0, 1) and (2, 3) are the tp groups
for bug, kw, operand in BUG_CASES:
    tc = fp8_config((2, 1, 2), steps=1, **kw)
    ref = pictures.on_rank0(world, lambda: serial_fp8(tc), share=True)
    run = train_layout(tc, bugs=[bug])
    p_err, h_err = param_err(run["params"], ref[0]), history_err(run["histories"], ref[2])
    caught = train_layout(fp8_config((2, 1, 2), steps=2, fp8_check=True, **kw), bugs=[bug])["error"]
    said = world.allgather((tp_group, caught))
    say(f"\n{bug}: after one step, params {p_err:.1e} and amax histories {h_err:.1e} from serial FP8\n"
        f"  --fp8-check, rank 0: {caught}")
    check.holds(f"{bug}: one step differs from serial FP8 by FP8-sized amounts (params or histories > 1e-6)",
                max(p_err, h_err) > 1e-6)
    check.holds(f"{bug}: --fp8-check stops every rank with ScaleMismatch naming {operand}",
                all(e is not None and e.startswith("ScaleMismatch") and f"hold {operand} " in e for _, e in said))
    check.holds(f"{bug}: ... the same message on both ranks of each tp group",
                all(e == e2 for g, e in said for g2, e2 in said if g == g2))

# %% [markdown]
# The first and third bugs change a scale in step 1, so the parameters move by FP8-sized amounts at once. The second
# leaves step 1 alone (delayed scaling's first step casts with s = 1 everywhere) but writes different amaxes into the
# two tp ranks' histories, which step 2 casts with: the histories show it after one step, and `--fp8-check` names it in
# step 2.
#
# Every rank raises alike: `check_same` reduces each scale with MIN and MAX over the tile's holders, so all reach the
# same verdict at the same call. Its body:

# %%
say("\n" + inspect.getsource(check_same).split('"""')[-1].strip("\n"))

# %% [markdown]
# **When an FP8 tensor travels.** The first bug alone only chooses a finer tile; it does harm once the *codes* cross
# ranks and the scale does not. ZeRO-3 gathers each layer's weights before its forward and backward; with
# `--fp8-allgather` (`hsgd.dp.fp8_gather`, as torchao's FP8 All-Gather for FSDP2) each rank casts its chunk first and
# sends one byte a value (`hsgd.fp8.codes`), so every weight's amax must be reduced over the shard ranks (and tp) before
# the cast. On dp 4 with `--zero 3`, tensorwise, in the exact mode: the run against the serial FP8 reference, step 1's
# All-Gather bytes with and without it, then the local-shard bug on the same layout:

# %%
sent_tc = fp8_config((4, 1, 1), fp8_recipe="tensorwise", zero=3, fp8_allgather=True, fp8_check=True)
ref = pictures.on_rank0(world, lambda: serial_fp8(sent_tc), share=True)
sent = train_layout(sent_tc)
as_is = train_layout(fp8_config((4, 1, 1), steps=1, fp8_recipe="tensorwise", zero=3))
gathered = {name: run["traffic"][("dp", "Allgather")][1] for name, run in (("float64", as_is), ("FP8", sent))}
sent_err = max(param_err(sent["params"], ref[0]), max(abs(a - b) / b for a, b in zip(sent["losses"], ref[1])))
say(f"  dp 4, --zero 3 --fp8-allgather: params and losses {sent_err:.1e} from the serial FP8 reference; step 1's "
    f"All-Gathers {gathered['FP8']} B against {gathered['float64']} B sending float64 "
    f"({gathered['FP8'] / gathered['float64']:.2f}; the embedding and the head go as they are)")
check("exact mode, dp 4 --zero 3 --fp8-allgather: params, losses vs serial FP8", sent_err)
check.holds("sending FP8 codes moves fewer bytes than float64 values", gathered["FP8"] < gathered["float64"])
local_tc = fp8_config((4, 1, 1), steps=1, fp8_recipe="tensorwise", zero=3, fp8_allgather=True)
ref = pictures.on_rank0(world, lambda: serial_fp8(local_tc), share=True)
local_err = param_err(train_layout(local_tc, bugs=["amax-local-shard"])["params"], ref[0])
caught = train_layout(fp8_config((4, 1, 1), steps=1, fp8_recipe="tensorwise", zero=3, fp8_allgather=True,
                                 fp8_check=True), bugs=["amax-local-shard"])["error"]
say(f"  amax-local-shard with the weights sent in FP8: params {local_err:.1e} from serial FP8 after one step\n"
    f"  --fp8-check, rank 0: {caught}")
check.holds("amax-local-shard, sent in FP8: one step off by far more than a cast's error (> 1e-2)",
            local_err > 1e-2)
check.holds("amax-local-shard, sent in FP8: --fp8-check stops it with ScaleMismatch",
            all(e is not None and e.startswith("ScaleMismatch") for e in world.allgather(caught)))

# %% [markdown]
# A chunk cast with scale $s_r$ and read with $s$ arrives $s_r / s$ times too large. In float32 the tolerance oracle
# flags the bug and passes the correct run (`tests/mpi/test_oracle.py`). The oracle also checks a resume: `python -m
# hsgd.verify --dtype fp8 --fp8-recipe delayed --resume-after 2` compares the third step's gradients after a checkpoint,
# and a resume that loses the amax histories (`stale-history`) casts with s = 1 there and is flagged.

# %% [markdown]
# ## 4. Limited accumulation
#
# An FP8 tensor core multiplies exactly but adds into a short accumulator. The DeepSeek-V3 report (section 3.3.2)
# measured that its GPUs' FP8 GEMMs keep about 14 bits of the running sum, for a largest relative error near 2% at K =
# 4096, and promoted the partial sums to float32 every $N_c = 128$ terms. Fasi, Higham, Mikaitis and Pranesh 2021
# ("Numerical behavior of NVIDIA tensor cores") found that tensor cores align the addends by **truncation**, toward
# zero. `limited_matmul` is that accumulator as a recurrence, $s_k = \mathrm{chop}_{p}(s_{k-1} + a_{ik}
# b_{kj})$ with p = 14, promoted every $N_c$ terms into a float32 sum or never; `accumulation_error` runs it on FP8
# inputs (entries 1 + N(0, 1) scaled to 448: positive sums, where truncation's bias shows) against the float64 product
# over 16 x 16 entries. First a check: with 53 bits, to nearest and never promoted, it is the sequential float64 sum,
# bit for bit.

# %%
a, b = fp8_inputs(4, 256, 4)                         # (4, 256), (256, 4) float32 E4M3 values
a64, b64 = a.astype(np.float64), b.astype(np.float64)
s = np.zeros((4, 4))
for k in range(256):
    s = s + a64[:, k, None] * b64[None, k, :]        # the sequential sum, term by term
check.holds("limited_matmul(53 bits, nearest, no promotion) == the sequential float64 sum, bit for bit",
            np.array_equal(limited_matmul(a64, b64, acc_bits=53, promote_every=None, mode="nearest"), s))


def fused(K, group=4, bits=14, seed=0):
    """{"max_rel", "mean_rel"} of a 14-bit truncated accumulator that adds `group` exact products at a time (the
    same inputs as accumulation_error): one chop per group instead of per term."""
    a, b = fp8_inputs(16, K, 16, seed=seed)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = a64 @ b64                                                        # (16, 16)
    s = np.zeros_like(exact)
    for k in range(0, K, group):
        s = chop(s + a64[:, k:k + group] @ b64[k:k + group], bits)          # `group` products, then one chop
    rel = np.abs(s - exact) / np.abs(exact)
    return {"max_rel": float(rel.max()), "mean_rel": float(rel.mean())}


KS = (128, 256, 512, 1024, 2048, 4096)
JOBS = ([("truncate", K, 128) for K in KS] + [("truncate", K, None) for K in KS]
        + [("nearest", 4096, None), ("fused 4", 4096, None)])


def job(mode, K, every):
    if mode == "fused 4":
        return fused(K)
    return accumulation_error(K=K, acc_bits=14, promote_every=every, mode=mode)


mine = [(j, job(*j)) for i, j in enumerate(JOBS) if i % P == rank]           # the jobs spread over the ranks
acc = {j: r for part in world.allgather(mine) for j, r in part}
say(f"{'accumulator (14 bits)':<34} {'K':>5} {'max rel':>9} {'mean rel':>9} {'estimate':>9}")
for j in [("truncate", 4096, 128), ("truncate", 4096, None), ("nearest", 4096, None), ("fused 4", 4096, None)]:
    mode, K, every = j
    r = acc[j]
    what = f"{mode}, " + (f"promoted every {every}" if every else "never promoted")
    say(f"{what:<34} {K:>5} {r['max_rel']:>9.3%} {r['mean_rel']:>9.3%} "
        + (f"{r['predicted']:>9.3%}" if "predicted" in r else f"{'':>9}"))
never, promoted = acc[("truncate", 4096, None)], acc[("truncate", 4096, 128)]
check.holds("truncated, never promoted, K = 4096: largest relative error over twice the report's 2%",
            never["max_rel"] > 2 * 0.02)
check("... its mean within 30% of the module's estimate K u / (8 ln 2)",
      abs(never["mean_rel"] / never["predicted"] - 1), 0.3)
check.holds("promotion every 128 terms: over 30 times smaller at K = 4096", 30 * promoted["max_rel"]
            < never["max_rel"])
check.holds("rounding to nearest instead of truncation, never promoted: over 10 times smaller in the mean",
            10 * acc[("nearest", 4096, None)]["mean_rel"] < never["mean_rel"])
check.holds("four products per chop: between 2 and 8 times smaller than one (the chops are 4 times fewer)",
            2 < never["max_rel"] / acc[("fused 4", 4096, None)]["max_rel"] < 8)
check.holds("... and within a factor 2 of the report's 2%", 0.01 < acc[("fused 4", 4096, None)]["max_rel"] < 0.04)

# %% [markdown]
# This model, one term per truncation, loses several times more (the second row, checked at above twice the report's
# figure), near the docstring's mean, $K u / (8 \ln 2)$ with $u = 2^{1-p}$. Four exact products per chop (the last row)
# bring it to the report's size: a plausible reading of the hardware, not a measurement of any GPU. What the model does
# show: truncation's errors all point one way and grow like K, rounding to nearest lets them cancel, and promotion caps
# the short accumulator's run at $N_c$ terms, which cuts the error by more than $K / N_c$ (while the partial sum is
# small, an 8-bit product loses nothing to the chop).

# %%
def draw_accumulation():
    fig, ax = pictures.figure(6.4, 3.8)
    k = np.array(KS, dtype=float)
    for every, color, label in ((None, "C3", "never promoted"), (128, "C0", "promoted every 128")):
        ax.loglog(k, [acc[("truncate", K, every)]["max_rel"] for K in KS], "o-", color=color,
                  label=f"14 bits truncated, {label}: max")
        ax.loglog(k, [acc[("truncate", K, every)]["mean_rel"] for K in KS], "s:", color=color, ms=4,
                  label="... mean")
        ax.loglog(k, [predicted(K, 14, every, "truncate") for K in KS], "--", color=color, lw=1,
                  label="... the docstring's estimate")
    ax.loglog([4096], [acc[("fused 4", 4096, None)]["max_rel"]], "D", color="C2",
              label="4 products per chop, never promoted: max")
    ax.loglog([4096], [0.02], "*", color="k", ms=11, label="the DeepSeek-V3 report: nearly 2% (its test)")
    ax.set_xticks(k, [str(K) for K in KS])
    ax.set_xticks([], minor=True)
    ax.set_xlabel("K (terms of each dot product)")
    ax.set_ylabel("relative error vs float64")
    ax.set_title("FP8 products into a 14-bit accumulator", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6.5)
    return pictures.save(fig, "15_fp8_accumulation")


say(f"picture: {pictures.on_rank0(world, draw_accumulation, share=True)}")

# %% [markdown]
# The picture shows an FP8 dot product's relative error against K: growing like K without promotion (red), flat when
# promoted every 128 terms (blue); the green diamond is four products per chop, the black star the report's figure.
#
# ## Check against serial
#
# Every verdict above is collective over 4 ranks; in the exact mode four layouts equal the serial FP8 reference to
# 1e-12, and each reproduced bug moves a run by FP8-sized amounts and is named by `--fp8-check` on every rank.

# %%
what, err = check.worst([w for w in check.errors if w.startswith("exact mode")])
say(f"\nchapter 15: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error against serial "
    f"(the exact FP8 mode) {err:.1e} ({what})")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# Megatron-LM runs FP8 through TransformerEngine; DeepSpeed has no FP8 training setting of its own (its
# maintainers point to TransformerEngine's layers); PyTorch's column is torchao's `torchao.float8`.
#
# | hsgd | Megatron-LM (TransformerEngine) | DeepSpeed | PyTorch (torchao) | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `--fp8 hybrid` or `e4m3` (`FP8_FORMATS`: E4M3 forward, E5M2 gradients) | `--fp8-format hybrid` or `e4m3` (TE `Format.HYBRID`, `Format.E4M3`) | none | dtypes `torch.float8_e4m3fn`, `torch.float8_e5m2`; `Float8LinearRecipeName.ROWWISE` uses E4M3 for all three operands | the casts are emulated on float64 or float32 arrays (`round_to`), so the exact mode can compare a layout with serial to 1e-12 |
# | `--fp8-recipe delayed --fp8-history H --fp8-margin M` (`Delayed`) | `--fp8-recipe delayed --fp8-amax-history-len --fp8-amax-compute-algo --fp8-margin` (TE `DelayedScaling(margin, amax_history_len, amax_compute_algo)`) | none | none among `Float8LinearRecipeName`'s recipes | the history's maximum only (no `most_recent`, no callable); a history of 16 steps by default (TE's `DelayedScaling`: 1024) |
# | `--fp8-recipe tensorwise`, `rowwise` (`Tensorwise`, `Rowwise`) | `--fp8-recipe tensorwise` (TE `Float8CurrentScaling`) | none | `Float8LinearConfig.from_recipe_name("tensorwise")` or `"rowwise"`, `convert_to_float8_training` | scales are fmax/amax exactly, never rounded to a power of two (torchao's rowwise recipe floors them) |
# | `--fp8-recipe blockwise --fp8-block b` (`Blockwise`; `check_blocks` refuses a tile cut by a shard) | `--fp8-recipe blockwise` (TE `Float8BlockScaling`) | none | none known in `torchao.float8` | b is a setting (128 by default), so a tiny model can run it |
# | `Holders.reduce_over` per operand; `--fp8-check` (`check_same`, `ScaleMismatch`) | one amax group, `parallel_state.get_amax_reduction_group`, handed to TE's `fp8_autocast(fp8_group=...)` | none | the amax of a DTensor reduced over the mesh dimensions it is sharded on; `precompute_float8_dynamic_scale_for_fsdp` | the domain is declared per operand and checked: a scale that differs between holders stops the run |
# | `--zero 3 --fp8-allgather` (`hsgd.dp.fp8_gather`: each chunk cast with the scale agreed over the shards, sent as codes) | `--fp8-param-gather` (the parameters kept in FP8 and all-gathered so) | none | `Float8LinearConfig(enable_fsdp_float8_all_gather=True)` with FSDP2, `precompute_float8_dynamic_scale_for_fsdp` | tensorwise and delayed only; the master chunk stays in the run's type, cast at every gather |
# | `--fp8-accumulate BITS:NC` (`limited_matmul`, `accumulation_error`) | TE's GEMM `use_split_accumulator` | none | `torch._scaled_mm(use_fast_accum=...)`; `Float8GemmConfig(use_fast_accum=...)` | a formula for a short truncated accumulator, not a measurement of a GPU |
#
# ## Exercises
#
# ### Exercise 1: what a power of two does to a cast, and why the reference takes `replicas`
# A replica of dp = 2 differentiates the mean over its half of the batch, so its gradients are twice serial's until
# the average over dp_comm. Check that a current-scaled cast is blind to that, $q(2^k x) = 2^k q(x)$ bit for bit for
# k from -8 to 8, while a cast with s = 1 (delayed scaling's first step) flushes a different number of values for
# different k. Then run the serial FP8 reference of dp 2 with `replicas=2` and `replicas=1`: equal to 1e-12 with
# tensorwise scaling, different after one step with delayed scaling.
# (solution: `tutorials/solutions/15_fp8.py`, `exercise_1`)
#
# ### Exercise 2: count the numbers of E4M3 and E5M2
# Decode all 256 codes of each format from its bit layout (bias 7 or 15, subnormals at exponent 0; E4M3's NaN is
# S.1111.111 only, E5M2's top exponent is inf and NaN). Check that E4M3 has 253 distinct finite values and E5M2
# 247, that their largest are 448 and 57344, and that `round_to` leaves each unchanged and sends every midpoint
# between neighbours to the even one.
# (solution: `tutorials/solutions/15_fp8.py`, `exercise_2`)
#
# ### Exercise 3: the margin against a growing tensor
# Under delayed scaling (history 4), cast a tensor that grows by a factor g every step, for 6 steps. Check that with
# g = 1.3 and margin 0 every step after the first overflows, that margin 1 removes every overflow and g = 2.5 needs
# margin 2; derive the rule (the largest value lands at $448\, g / 2^{\text{margin}}$, which must stay below 464)
# and check the margin's cost at the bottom (no fewer underflows).
# (solution: `tutorials/solutions/15_fp8.py`, `exercise_3`)
#
# ### Exercise 4: a tile that straddles a shard
# Blockwise scaling reduces no amax, so a tile must never be cut between ranks. Check that `check_blocks` refuses
# b = 32 at tp = 2 for C = 32 and b = 16 at cp = 2 for T = 32 (a rank's runs of positions are T/(2 cp) = 8 long)
# with a `ConfigError` naming the dimension, accepts b = 16 at tp = 2 and b = 8 at cp = 2, and that
# `check_fp8_layout`, which `HybridTrainer` calls before any communication, refuses such settings.
# (solution: `tutorials/solutions/15_fp8.py`, `exercise_4`)
