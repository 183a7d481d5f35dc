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
# # Chapter 12: pipeline schedules as data: interleaved 1F1B, zero bubble, the V and DualPipe
#
# Chapter 9 ran GPipe and 1F1B and found the same idle time in both, $(p-1)/(m+p-1)$ of the step. The lecture's section
# 1 lists this idle time among the challenges of pipeline parallelism ("pipeline bubbles easily leave the devices idle",
# in translation), and its section 4.2 answers with micro-batches that fill the stages, which help only with a larger
# batch or smaller micro-batches. This chapter continues those sections with later remedies that change the schedule
# instead:
#
# * **interleaved 1F1B** (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
#   Megatron-LM"): every stage holds v smaller chunks of the model, so the pipeline fills and drains in chunk-sized
#   steps; the bubble shrinks to $(p-1)/(vm+p-1)$, for v times the messages;
# * **zero bubble** (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): the backward is split into B, the input
#   gradient the previous stage waits for, and W, the weight gradients nobody waits for; the W's fill the waits. ZB-H1
#   holds no more micro-batches than 1F1B's first stage and, for equal F, B and W, leaves a third of 1F1B's idle time;
# * **two chunks per stage**: ZB-V (the same paper) places them in a V, down the stages and back up; DualPipe
#   (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report") holds the model twice, feeds micro-batches from both ends and
#   runs a forward and a backward as one overlapped pair; DualPipeV is its V-shaped half.
#
# In hsgd a schedule is data (`hsgd/pp/schedules.py`): per stage, the list of actions it runs in one step, which can be
# printed, checked for deadlocks, simulated, and handed to `hsgd.pp.stage.Stage` to run on the real grid.
#
# Run it with eight ranks (7 s measured on a 2-core machine with nothing else running, 8 to 14 s with other work beside
# it; on failure every rank raises). Rank 0 prints and draws six pictures into `$HSGD_FIGURES` (default
# `tutorials/figures/`); the schedule lab, `python -m hsgd.schedule`, prints and measures one schedule at a time:
#
# mpirun -n 8 python tutorials/12_pipeline_schedules.py
#
# Legend: P ranks, p = pp stages, s a stage, m micro-batches per replica and step, j a micro-batch, v chunks per stage
# (virtual stages), c a chunk, k = cp + s the piece of the model that chunk c of stage s holds (in the loop placement;
# section 7 has the others). Actions: F (forward), B (backward: the input gradient, plus the weight gradients unless the
# list has a W for the same micro-batch and chunk, then it is "split"), W (the weight gradients), F&B (an overlapped
# pair, `schedules.Pair`); in formulas, their times per chunk (a fused backward takes B + W; in DeepSeek-V3's Table 2, B
# is that whole backward). A "pair" held is a (micro-batch, chunk) whose activations a stage holds. The model: L layers,
# C d_model, NH heads, $d_{ff}$ the MLP width, T sequence, V vocabulary, B = 16 sequences the global batch (in the
# code), b sequences per micro-batch, N = bT positions, float64.

# %%
from hsgd.model.config import ModelConfig   # hsgd first, as appendix B explains (OpenBLAS's thread timeout)
from hsgd.model import serial
from hsgd.tp import model as tp_model, shards as tp_shards

from fractions import Fraction

import numpy as np

from hsgd.model.data import Corpus
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.accounting.activations import activation_bytes
from hsgd.model.ops import linear_backward, linear_forward, linear_input_grad, linear_weight_grad
from hsgd.run.plots import COLORS, draw_pipeline
from hsgd.pp.chunks import chunk_layers, pp_formula, stage_chunks, stage_names
from hsgd.run.report import fmt_bytes
from hsgd.schedule import keep_bytes
from hsgd.pp.schedules import KIND_NAMES, Action, Pair, ScheduleError, build, placement_of, simulate
from hsgd.pp.timelines import (FORMULA, PEAK_FORMULA, TABLE2, bubble_formula, bubble_fraction, grid, held_bytes,
                               idle_per_stage, most_idle, peak_formula, peak_held, stage_idle, table2)
from hsgd.pp.schedules import check as check_schedule
from hsgd.pp.placement import placement
from hsgd.schedule import Plan
from hsgd.grid.trace import Tracer
from hsgd.run.plots import pipeline_spans
from hsgd.tp.wgrad import WeightGrads

import pictures                                  # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, rel_err, train_config  # tutorials/checks.py, shared by the chapters

P = 8
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, P, tol=1e-10, width=76)


cfg = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=4, n_layers=16, d_ff=32)  # 16 blocks: 8 x 2 chunks
SEED, B, M, STEPS = 0, 16, 8, 2         # global batch, micro-batches per replica, steps per run
KINDS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))   # (schedule, v): the chapter's four
corpus = Corpus.load(None, cfg.seq_len) # the built-in corpus (the Python standard library's source), as hsgd.train
say(f"{P} ranks; model {cfg.n_params():,} parameters (L={cfg.n_layers} C={cfg.d_model} NH={cfg.n_heads} "
    f"d_ff={cfg.d_ff} T={cfg.seq_len} V={cfg.vocab_size}); B={B}, m={M} micro-batches per replica, float64")

# %% [markdown]
# ## 1. A schedule as data
#
# `schedules.build(kind, m, p, v)` returns, per stage, a list of `Action(kind, mb, chunk)`, printed F3 (micro-batch 3
# through chunk 0), B3, W3, or F3.1 for chunk 1. With v chunks the L blocks are cut into pv pieces, chunk c of stage s
# being piece k = cp + s: a micro-batch goes through stages 0 .. p-1, then back to stage 0 for chunk 1, and so on. An
# action waits for one other action, and for the one before it in its stage's list:
#
#     F(k, j)  waits for F(k-1, j), the activation, from stage (s-1) mod p     (piece 0: the tokens, nothing)
#     B(k, j)  waits for B(k+1, j), the gradient, from stage (s+1) mod p       (the last piece: its own F(k, j))
#     W(k, j)  waits for B(k, j) on the same stage
#
# The four schedules for p = 4, m = 4:
#
# * **GPipe**: all forwards, then all backwards;
# * **1F1B**: $p-s-1$ warm-up forwards, then one forward and one backward in turn (chapter 9);
# * **interleaved** (v = 2): Megatron-LM's order, after $2(p-s-1) + (v-1)p$ warm-up forwards ($p-s-1$ for v = 1, which
#   is 1F1B). Forwards go through the chunks in groups of p micro-batches, backwards likewise with the chunks reversed;
#   hence m must be a multiple of p, in hsgd as in Megatron-LM;
# * **ZB-H1**: 1F1B with every B split from its W; hsgd places each W by simulating the stages with the given costs:
#   where its stage would otherwise wait, or where one more forward would hold more than p micro-batches; the rest at
#   the end.

# %%
def lists(kind, m, p, v=1):
    """Every stage's actions as text, one line per stage."""
    return [f"  stage {s}: " + " ".join(str(a) for a in acts) for s, acts in enumerate(build(kind, m, p, v))]


for kind, v in KINDS:
    say(f"{kind}" + (f", v = {v}" if v > 1 else "") + ", m = 4, p = 4:")
    for line in lists(kind, 4, 4, v):
        say(line)
counts = {kind: [len(acts) for acts in build(kind, 4, 4, v)] for kind, v in KINDS}
check.note("actions per stage: 2m (GPipe, 1F1B), 2vm (interleaved), 3m (ZB-H1), as the lists are written",
           counts == {"gpipe": [8] * 4, "1f1b": [8] * 4, "interleaved": [16] * 4, "zb-h1": [12] * 4})

# %% [markdown]
# `schedules.check(actions, m, v)` walks those dependencies without running anything, every stage as far as it can. It
# refuses a list that misses or repeats an action, or whose stages would all end up waiting for one another, naming the
# first action that cannot run. Sends in hsgd do not block and receives wait (chapter 9), so a list the check runs to
# its end cannot deadlock on MPI either; `Stage` checks its list before its first message. Three hand-written lists for
# p = 2, m = 2 (`parse`): stage 0 runs 1F1B without its warm-up while stage 1 runs GPipe (stage 0 waits for B0, which
# stage 1 runs after F1, which stage 0 runs after B0); a forward run twice; a W before its B.

# %%
def parse(text):
    """'F0 F1 B0 B1 | F0 B0 F1 B1' -> [[Action] per stage] ('F3.1': micro-batch 3, chunk 1)."""
    out = []
    for row in text.split("|"):
        out.append([Action(t[0], int(t[1:].partition(".")[0]), int(t[1:].partition(".")[2] or 0))
                    for t in row.split()])
    return out


def refusal(actions, m, v=1, pl=None):
    """schedules.check's message for a list it refuses ("" if it accepts it); pl: the placement (default the loop,
    section 7 has the others)."""
    try:
        check_schedule(actions, m, v, pl)
        return ""
    except ScheduleError as e:
        return str(e)


for text, names in (("F0 B0 F1 B1 | F0 F1 B0 B1", ("deadlocks", "B0", "F1")),
                    ("F0 F0 B0 B1 | F0 B0 F1 B1", ("twice", "F0")),
                    ("F0 W0 F1 B0 B1 | F0 B0 F1 B1", ("W0", "before its B0"))):
    why = refusal(parse(text), 2)
    say(f"{text}\n  ScheduleError: {why}")
    check.holds(f"refused, naming {' and '.join(names)}", why and all(n in why for n in names))
check.holds("1F1B written by hand (F0 F1 B0 B1 | F0 B0 F1 B1) == build('1f1b', 2, 2), accepted",
            parse("F0 F1 B0 B1 | F0 B0 F1 B1") == build("1f1b", 2, 2) and not refusal(build("1f1b", 2, 2), 2))

# %% [markdown]
# ## 2. Each schedule drawn
#
# `schedules.simulate(actions, m, v, costs)` is the same walk with times: an action starts when its stage is free and
# what it waits for has ended, and takes F, B or W (a fused backward B + W). With F = B = W = 1 for a stage's whole
# share of the model, an interleaved chunk's actions cost 1/v. The four schedules for p = 4, m = 8, on one time axis:

# %%
P4 = 4
sims = {kind: simulate(build(kind, M, P4, v), M, v, (1 / v,) * 3) for kind, v in KINDS}


def title(kind, v):
    return {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": f"interleaved 1F1B, v = {v}", "zb-h1": "ZB-H1"}[kind]


def span(t):
    """A timeline's step: its last end less its first start."""
    return max(e for r in t for _, _, e in r) - min(s for r in t for _, s, _ in r)


def draw_equal_cost():
    fig, axes = pictures.figure(10, 7.2, nrows=4, sharex=True)
    for ax, (kind, v) in zip(axes, KINDS):
        t = sims[kind]
        draw_pipeline(ax, t, xlabel="time (F = B = W = 1 for a stage's share of the model)" if kind == "zb-h1" else "",
                      title=f"{title(kind, v)}, m = {M}, p = {P4}: step {max(e for r in t for _, _, e in r):g}, "
                            f"bubble {bubble_fraction(t):.3f} = {FORMULA[kind]}")
    axes[0].set_xlim(0, max(e for t in sims.values() for r in t for _, _, e in r))   # shared: the longest step
    return pictures.save(fig, "12_schedules_equal_cost")


path = pictures.on_rank0(world, draw_equal_cost, share=True)
say(f"picture: {path}")
for kind, v in KINDS:
    t = sims[kind]
    say(f"{title(kind, v):<24} step {max(e for r in t for _, _, e in r):>5g}   bubble {bubble_fraction(t):.4f}   "
        f"idle per stage {idle_per_stage(t):g}")
say(f"GPipe and 1F1B: {span(sims['1f1b']):g} time units each, {idle_per_stage(sims['1f1b']):g} of them idle "
    f"per stage")
say("1F1B and ZB-H1 as grids of time slots (timelines.grid; '.' idle, a fused B fills two slots):")
say(grid(sims["1f1b"]))
say(grid(sims["zb-h1"]))

# %% [markdown]
# The picture shows the four simulated steps, one row per stage. GPipe and 1F1B take the same «33 time units», of which
# «9» are idle on every stage while the pipeline fills and drains. Interleaving fills and drains in half-size steps.
# ZB-H1 moves W's into the waits: in the grid, stage 0 runs each W right after its B, where it would wait for its next
# backward, while stage 3, never kept waiting once the pipeline is full, postpones its W's until it holds p pairs (W0
# after B3) and runs the last ones in the drain.
#
# ## 3. The closed forms against the simulation
#
# With equal costs the bubble, idle time over p times the step, has a closed form per schedule
# (`timelines.bubble_formula`, text in `timelines.FORMULA`):
#
# * GPipe and 1F1B: $(p-1)/(m+p-1)$ (chapter 9);
# * interleaved: $(p-1)/(vm+p-1)$. A stage still computes for $m(F+B+W)$, but the fill and drain are made of chunk
#   actions of 1/v the cost, so the idle time per stage is $(p-1)(F+B+W)/v$. Narayanan et al. divide by the compute
#   alone and write $\frac{1}{v}\cdot\frac{p-1}{m}$; hsgd divides by the whole step, as in chapter 9;
# * ZB-H1: idle time per stage $(p-1)(F+B-W)$ against 1F1B's $(p-1)(F+B+W)$: the W's fill $2(p-1)W$ of it, and for F = B
#   = W a third is left. It needs m >= p (enough W's to fill the waits) and W <= min(F, B).
#
# The simulation knows none of these formulas; it only follows the dependencies. Rank 0 simulates every case while the
# others sleep (`pictures.on_rank0`):

# %%
def closed_forms():
    """The largest |simulated - closed form| per schedule, over p = 2, 4, 8 (interleaved v = 2, 4) and m = p..4p,
    and the ZB-H1 idle time and peaks for p = 2..8, m = p, 2p, 3p, equal costs and (F, B, W) = (1, 2, 1)."""
    worst = {kind: 0.0 for kind, _ in KINDS}
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            for kind, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (2, 4)), ("zb-h1", (1,))):
                for v in vs:
                    t = simulate(build(kind, m, p, v), m, v)
                    worst[kind] = max(worst[kind], abs(bubble_fraction(t) - bubble_formula(kind, m, p, v)))
    zb = []
    for costs in ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0)):
        f, b, w = costs
        for p in range(2, 9):
            for m in (p, 2 * p, 3 * p):
                zb_t = simulate(build("zb-h1", m, p, costs=costs), m, 1, costs)
                one_t = simulate(build("1f1b", m, p), m, 1, costs)
                zb.append((costs, p, m, idle_per_stage(zb_t), (p - 1) * (f + b - w), idle_per_stage(one_t),
                           (p - 1) * (f + b + w), max(peak_held(a) for a in build("zb-h1", m, p, costs=costs)),
                           max(peak_held(a) for a in build("1f1b", m, p))))
    return worst, zb


worst, zb = pictures.on_rank0(world, closed_forms, share=True)
for kind, v in KINDS:
    check(f"{kind}: simulated bubble - {FORMULA[kind]}, every case", worst[kind], 1e-12)
check("ZB-H1: simulated idle per stage - (p-1)(F+B-W), p = 2..8, two costs", max(abs(r[3] - r[4]) for r in zb), 1e-12)
check("1F1B: simulated idle per stage - (p-1)(F+B+W), the same cases", max(abs(r[5] - r[6]) for r in zb), 1e-12)
ratio = max(r[3] / r[5] for r in zb if r[0] == (1.0, 1.0, 1.0))
say(f"F = B = W: ZB-H1's idle time / 1F1B's = {ratio:.6f} at most, over p = 2..8 and m = p, 2p, 3p")
check.holds("F = B = W: ZB-H1's idle time <= 40% of 1F1B's (it is a third)", ratio <= 0.4)
check.equal("ZB-H1 and 1F1B hold the same peak pairs, max over the stages (= p)",
            [r[7] for r in zb], [r[8] for r in zb])

# %% [markdown]
# What the two schedules pay is memory. 1F1B's stage s holds at most $p-s$ micro-batches (chapter 9). ZB-H1 holds p
# pairs on every stage, since a pair whose W is postponed still holds what the W reads (section 4): more than 1F1B on
# the later stages, never more than 1F1B's stage 0. Interleaving's stage s holds up to $\min(2(p-s-1) + (v-1)p + 1, vm)$
# pairs of 1/v of a stage, so its stage 0 holds $p + (p-1)/v$ micro-batches' worth where 1F1B holds p.
# `timelines.peak_formula` has the four closed forms (`PEAK_FORMULA`), checked against `peak_held` of the lists, stage
# by stage:

# %%
cases = [(kind, p, m, v) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)
         for kind, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (1, 2, 3, 4)), ("zb-h1", (1,)))
         for v in vs]
for kind, _ in KINDS:
    say(f"  {kind:<12} peak pairs of stage s: {PEAK_FORMULA[kind]}")
check.equal("peak pairs of every stage == peak_formula, p = 2, 4, 8, m = p..4p, v = 1..4",
            [[peak_held(a) for a in build(kind, m, p, v)] for kind, p, m, v in cases],
            [[peak_formula(kind, m, p, s, v) for s in range(p)] for kind, p, m, v in cases])
say(f"p = 4, m = 8: peak pairs per stage  1F1B {[peak_held(a) for a in build('1f1b', 8, 4)]}   "
    f"interleaved v = 2 {[peak_held(a) for a in build('interleaved', 8, 4, 2)]}   "
    f"ZB-H1 {[peak_held(a) for a in build('zb-h1', 8, 4)]}")
worth = {(p, v): Fraction(peak_held(build("interleaved", 4 * p, p, v)[0]), v) for p in (2, 4, 8) for v in (2, 3, 4)}
pairs0 = peak_held(build("interleaved", M, P4, 2)[0])                 # m = 8, p = 4, v = 2: stage 0's peak
say(f"interleaved, m = {M}, p = {P4}, v = 2, stage 0: {pairs0} pairs of half a stage = {pairs0 / 2:g} micro-batches' "
    f"worth; p + (p-1)/v = {P4 + (P4 - 1) / 2:g}; 1F1B's stage 0 holds {peak_held(build('1f1b', M, P4)[0])}")
check.equal("interleaved, stage 0: peak pairs / v == p + (p-1)/v, p = 2, 4, 8, v = 2..4, m = 4p", worth,
            {(p, v): p + Fraction(p - 1, v) for p, v in worth})

# %% [markdown]
# ## 4. The W pass
#
# A linear layer $Y = XW + b$ has two gradients with different customers (`hsgd.model.ops`, the functions every model in
# hsgd runs):
#
# * `linear_input_grad(dY, cache)`: $dX = dY\,W^T$, which the previous stage waits for: this is B;
# * `linear_weight_grad(dY, cache, dW, db)`: $dW \mathrel{+}= X^T dY$, $db \mathrel{+}= \sum_n dY_n$, needed only by the
#   optimizer step: this is W.
#
# `linear_backward` is the two in turn. A split B hands every weight-gradient product, the function with its X and dY,
# to a `WeightGrads()` (`hsgd.tp.wgrad`) for the W. The rest of a backward (LayerNorms, embedding, the biases tensor
# parallelism replicates) stays in B; it is O(NC), small next to the products. First the two halves against NumPy:

# %%
rng = np.random.default_rng(14)
x, w_, bias = rng.standard_normal((2, 8, 16)), rng.standard_normal((16, 32)), rng.standard_normal(32)
dy = rng.standard_normal((2, 8, 32))                                  # (b, T, Cout): dL/dY
_, cache = linear_forward(x, w_, bias)
dw_fused, db_fused = np.zeros_like(w_), np.zeros_like(bias)
dx_fused = linear_backward(dy, cache, dw_fused, db_fused)             # both halves at once
dx_b = linear_input_grad(dy, cache)                                   # B
dw_w, db_w = np.zeros_like(w_), np.zeros_like(bias)
linear_weight_grad(dy, cache, dw_w, db_w)                             # W, later
x2, dy2 = x.reshape(-1, 16), dy.reshape(-1, 32)                       # (N, Cin), (N, Cout)
check("dX = dY W^T, dW = X^T dY, db = sum dY against NumPy",
      max(rel_err(dx_b, dy @ w_.T), rel_err(dw_w, x2.T @ dy2), rel_err(db_w, dy2.sum(0))), 1e-12)
check.holds("linear_backward == linear_input_grad, then linear_weight_grad: bit for bit",
            np.array_equal(dx_fused, dx_b) and np.array_equal(dw_fused, dw_w) and np.array_equal(db_fused, db_w))

# %% [markdown]
# Now a whole stage: every rank takes its stage of the 4-stage pipeline (4 blocks; stage 0 also the embedding, stage 3
# the head), runs one micro-batch of b = 1 forward, then backward fused (`tp_model.stage_backward`) and split
# (`wg=WeightGrads()`, then `wg.run(grads, group)` per group). What the B kept, and its bytes per stage against
# `hsgd.schedule.keep_bytes`: the forward's cache, and what the W reads, $N \cdot 8 \cdot (4C + 4C + 2d_{ff})$ per block
# (X and dY of q/k/v, attn.proj, fc and mlp.proj, tp = 1) and $N \cdot 8 \cdot (C + V)$ for the head:

# %%
g4 = ProcessGrid(world, dp=P // P4, pp=P4, tp=1)     # ranks 0-3 replica 0, stages 0-3; ranks 4-7 replica 1
s4 = g4.pp_rank
layers4 = chunk_layers(cfg.n_layers, P4)[s4]
first4, last4 = s4 == 0, s4 == P4 - 1
full = serial.init_params(cfg, seed=SEED, dtype="float64")
params = {n: full[n] for n in stage_names(cfg, layers4, first4, last4)}
idx, targets = corpus.batch(SEED, 1, 1)                                # one sequence: (1, T) each
inp = idx if first4 else np.random.default_rng(s4).standard_normal((1, cfg.seq_len, cfg.d_model))
dout = 1.0 if last4 else np.random.default_rng(10 + s4).standard_normal((1, cfg.seq_len, cfg.d_model))


def backward(split):
    """A fresh forward of the micro-batch, then its backward, fused or split into B and W. Returns (dL/d(input),
    the gradients, the forward's cache bytes, the bytes the B kept for the W, the kept products)."""
    setup = tp_model.TPSetup(cfg, g4.tp_comm, "megatron")
    _, caches = tp_model.stage_forward(params, inp, targets, tp_model.Piece(layers4, first4, last4), setup)
    cache_bytes = activation_bytes(caches, params)
    grads = serial.zeros_like_params(params)
    wg = WeightGrads() if split else None
    dx = tp_model.stage_backward(dout, caches, grads, setup, wg=wg)
    if not split:
        return dx, grads, cache_bytes, 0, []
    del caches                                         # the B is done: only the kept products are left
    kept, later = activation_bytes([e[2] for e in wg.later], params), list(wg.later)
    for group in wg.groups():                          # the W, group by group in backward order
        wg.run(grads, group)
    return dx, grads, cache_bytes, kept, later


dx_f, grads_f, cache_bytes, _, _ = backward(split=False)
dx_s, grads_s, _, kept_bytes, later = backward(split=True)
if rank == 0:
    say(f"stage 0 kept {len(later)} products for its W; those of block {layers4[0]}:")
    for group, fn, args, names in later[-4:][::-1]:     # the backward meets a stage's first block last
        shapes = ", ".join(str(a.shape) for a in (args[0], args[1][0]))
        say(f"  {group:<5} {fn.__name__:<19} dY, X = {shapes:<22} -> {', '.join(names)}")
want = keep_bytes(cfg, 1, 8, 1, "megatron", "none", (len(layers4), first4, last4))
say("stage  cache of F (measured, formula)   kept from B to W (measured, formula)")
for st, row in enumerate(g4.pp_comm.allgather_obj((cache_bytes, want[0], kept_bytes, want[1]))):
    say(f"{st:>5}  {row[0]:>14,} {row[1]:>14,}   {row[2]:>16,} {row[3]:>16,}")
check.equal("one micro-batch: cache and kept bytes == keep_bytes, every stage", (cache_bytes, kept_bytes), want)
check.holds("split B then W == fused backward: dL/d(input) and every gradient bit-identical",
            (dx_f is None and dx_s is None or np.array_equal(dx_f, dx_s))
            and all(np.array_equal(grads_f[n], grads_s[n]) for n in params))

# %% [markdown]
# Bit-identical, not only close: the W calls the same functions on the same arrays as the fused backward, whose weight
# products feed nothing else (dX comes from W and dY, never from dW). A step's gradient sums the micro-batches, and
# floating-point addition is not associative, so every schedule here adds a chunk's micro-batches in the order 0 .. m-1
# (ZB-H1 runs its W's in the order of its B's). The split costs memory while it waits: the B frees the forward's cache
# but keeps X and dY of every linear.
#
# ## 5. Every schedule on the real grid
#
# Two layouts of the 8 ranks, a 4-stage pipeline replicated twice (dp 2 x pp 4, b = 1) and one 8-stage pipeline (pp 8, b
# = 2), each train 2 steps of SGD with momentum with each of the four schedules (interleaved v = 2). The last step is
# measured: every stage's timeline (`stage.timeline`), pairs held (`stage.peak_held`), activation bytes at the peak
# (`stage.peak_bytes`) and bytes on `pp_comm` (`grid.stats`). The predictions: the list itself, action for action;
# `peak_held` of it; `timelines.held_bytes`, which walks the list with `keep_bytes`' two amounts per chunk (an F adds
# the cache; a fused B frees it; a split B frees it and keeps what its W reads, which the W frees); and
# `pp.chunks.pp_formula`, $m(2v - [s = 0] - [s = p-1])$ messages each way of $b\,T C \cdot 8$ bytes.

# %%
def config(pp, kind, v=1):
    """The float64 run every schedule shares (`train_config`: SGD with momentum, validated as hsgd.train does)."""
    return train_config(dp=P // pp, pp=pp, tp=1, steps=STEPS, batch_size=B, micro_batches=M, schedule=kind,
                        virtual_stages=v, seed=SEED)


def predict(g, kind, v):
    """My stage's (actions, peak pairs, peak activation bytes, pp_comm calls and bytes) as the formulas say."""
    p, s, b = g.pp, g.pp_rank, B // g.dp // M
    actions = build(kind, M, p, v)[s]
    pieces = chunk_layers(cfg.n_layers, p, v)
    amounts = [keep_bytes(cfg, b, 8, 1, "megatron", "none", (len(pieces[c * p + s]), c * p + s == 0,
                                                              c * p + s == p * v - 1)) for c in range(v)]
    peak_bytes = held_bytes(actions, [a for a, _ in amounts], [k for _, k in amounts])
    return actions, peak_held(actions), peak_bytes, pp_formula(b, cfg, M, s == 0, s == p - 1, 8, "megatron", 1, v)


def run(g, kind, v, predicted=None, tracer=None):
    """STEPS steps of `kind` on grid g, the last one measured (and traced, given a tracer: section 7); every stage's
    measures of replica 0 on every rank. predicted: my stage's prediction (default `predict`'s)."""
    tc = config(g.pp, kind, v)
    trainer = HybridTrainer(cfg, g, tc, tracer)
    for step in range(1, tc.steps + 1):
        trainer.stage.measure_bytes = step == tc.steps
        if tracer is not None:
            tracer.clear()                                                  # keep only the last step's spans
        before = g.stats.counts()
        trainer.step(*corpus.batch(SEED, step, B), step)
    st = trainer.stage
    sent = {key: n for key, n in g.stats.since(before).items() if key[0] == "pp"}   # this step on pp_comm
    ran = [a for a, _, _ in st.timeline]                                   # what my stage ran, in order
    mine = (ran, st.peak_held, st.peak_bytes, sent)
    stages = sorted((r for r in world.allgather((g.dp_rank, g.pp_rank, st.timeline, st.peak_held, st.peak_bytes,
                                                  sent, trainer.memory()["params"])) if r[0] == 0),
                    key=lambda r: r[1])                                     # replica 0, by stage
    out = dict(mine=mine, predicted=predict(g, kind, v) if predicted is None else predicted,
               params=dict(trainer.params), full=trainer.full_params(),
               timeline=[r[2] for r in stages], held=[r[3] for r in stages], bytes=[r[4] for r in stages],
               sent=[r[5].get(("pp", "Isend"), (0, 0)) for r in stages], param_bytes=[r[6] for r in stages])
    trainer.finish()
    trainer.free()
    return out


g8 = ProcessGrid(world, dp=1, pp=8, tp=1)
results = {(g.pp, kind): run(g, kind, v) for g in (g4, g8) for kind, v in KINDS}
ref = pictures.on_rank0(world, lambda: serial.sgd(cfg, config(4, "1f1b"), lambda step: corpus.batch(SEED, step, B))[0],
                        share=True)
say(f"8 runs of {STEPS} steps; serial SGD on one process as the reference")

# %% [markdown]
# Every run computed serial SGD's step, the four schedules with the same bits. Then, per layout, every stage's
# measurements next to their predictions (replica 0 printed; the checks cover every rank):

# %%
def shard_err(r, g):
    """The largest rel_err of my parameters against serial SGD's (floor 0.02 as in chapter 4; tp = 1: the whole
    tensor, `tp_shards.shard` in general)."""
    return max(rel_err(p, tp_shards.shard(ref[n], n, g.tp_rank, g.tp, "megatron"), floor=0.02)
               for n, p in r["params"].items())


for g in (g4, g8):
    pp = g.pp
    runs = [results[pp, kind] for kind, _ in KINDS]
    predicted = [g.pp_comm.allgather_obj(r["predicted"][1:3]) for r in runs]   # every stage's (pairs, bytes)
    for r, pred in zip(runs, predicted):
        r["predicted stages"] = pred                                             # for section 6
    say(f"\npp {pp} (dp {g.dp} x pp {pp}, b = {B // g.dp // M}), per stage: pairs held and activation KiB at the "
        f"peak, measured/predicted, and messages sent")
    say(("stage" + "".join(f"  {title(kind, v):<24}" for kind, v in KINDS)).rstrip())
    for st in range(pp):
        cells = [f"{r['held'][st]:>2}/{pred[st][0]:<2} {r['bytes'][st] / 1024:5.1f}/{pred[st][1] / 1024:<5.1f} "
                 f"{r['sent'][st][0]:>2}" for r, pred in zip(runs, predicted)]
        say((f"{st:>5}" + "".join(f"  {c:<24}" for c in cells)).rstrip())
    check.equal(f"pp {pp}: what my stage ran (its timeline) == schedules.build(kind, m, p, v)[s], all four",
                [r["mine"][0] for r in runs], [r["predicted"][0] for r in runs])
    check.equal(f"pp {pp}: pairs held == peak_held(actions), all four", [r["mine"][1] for r in runs],
                [r["predicted"][1] for r in runs])
    check.equal(f"pp {pp}: activation bytes at the peak == held_bytes, all four", [r["mine"][2] for r in runs],
                [r["predicted"][2] for r in runs])
    check.equal(f"pp {pp}: pp_comm calls and bytes of the step == pp_formula, all four",
                [r["mine"][3] for r in runs], [r["predicted"][3] for r in runs])
    check(f"pp {pp}: my parameters vs serial SGD, the worst of the four schedules",
          max(shard_err(r, g) for r in runs))
    diff = max(float(np.abs(r["full"][n] - runs[0]["full"][n]).max()) for r in runs for n in runs[0]["full"])
    say(f"pp {pp}: largest difference between the four schedules' parameters: {diff}")
    check.holds(f"pp {pp}: the four schedules' parameters bit-identical",
                all(np.array_equal(r["full"][n], runs[0]["full"][n]) for r in runs for n in runs[0]["full"]))

# %% [markdown]
# Interleaving holds «11 pairs of half a stage» on stage 0 of pp 4, more bytes than 1F1B's 4 whole ones. On pp 8 with m
# = p its warm-up, $2(p-1) + (v-1)p$ = 22 forwards, exceeds the 16 a stage runs, so its first stages run every forward
# before any backward, like GPipe: interleaving pays off when m is several times p.
#
# A measured step at this size is mostly noise: on eight ranks sharing two cores an action that loses its core looks
# many times longer than its neighbours. What stays put is the typical duration of each kind of action, so the picture
# replays the list that ran at each run's median F, B and W (replica 0, every stage):

# %%
def durations(kind):
    """{"F": [...], "B": [...], "W": [...]}: seconds of every action of the measured step, replica 0's stages."""
    took = {}
    for stage in results[4, kind]["timeline"]:
        for a, t0, t1 in stage:
            took.setdefault(a.kind, []).append(t1 - t0)
    return took


took = {kind: durations(kind) for kind in ("1f1b", "zb-h1")}
med = {kind: {k: float(np.median(d)) for k, d in t.items()} for kind, t in took.items()}
replay_costs = {"1f1b": (med["1f1b"]["F"], med["1f1b"]["B"], 0.0),          # 1F1B's B: the fused one (B + W)
                "zb-h1": (med["zb-h1"]["F"], med["zb-h1"]["B"], med["zb-h1"]["W"])}
replay = {kind: simulate(build(kind, M, P4), M, 1, c) for kind, c in replay_costs.items()}
for kind, (f, b, w) in replay_costs.items():
    t_meas, kinds = results[4, kind]["timeline"], sorted(took[kind], key="FBW".find)
    say(f"{title(kind, 1):<6} median ms per action: " + ", ".join(f"{k} {1e3 * med[kind][k]:.2f}" for k in kinds)
        + f"; replayed step {1e3 * span(replay[kind]):.1f} ms, bubble {bubble_fraction(replay[kind]):.2f}; measured "
        f"step {1e3 * span(t_meas):.1f} ms, bubble {bubble_fraction(t_meas):.2f}; longest / shortest action: "
        + ", ".join(f"{k} {max(took[kind][k]) / min(took[kind][k]):.0f}x" for k in kinds))
say("(timings of this machine: printed, never checked)")


def gantt(ax, timeline):
    """A replayed timeline (seconds) in milliseconds, one bar collection per stage and kind of action, in
    draw_pipeline's colours, stage 0 on top; no labels (section 2's picture numbers the same lists)."""
    p = len(timeline)
    for s, row in enumerate(timeline):
        for kind in "FBW":
            bars = [(1e3 * a0, 1e3 * (a1 - a0)) for a, a0, a1 in row if a.kind == kind]
            ax.broken_barh(bars, (p - 1 - s + 0.1, 0.8), facecolor=COLORS[KIND_NAMES[kind]], edgecolor="white",
                           linewidth=0.6)
    ax.set_yticks([p - 1 - s + 0.5 for s in range(p)])
    ax.set_yticklabels([f"stage {s}" for s in range(p)], fontsize=7)
    ax.tick_params(axis="x", labelsize=7)


def draw_measured():
    from matplotlib.patches import Patch                                      # (rank 0 only: it draws)
    fig, axes = pictures.figure(10, 4.4, nrows=2, sharex=True)
    for ax, kind in zip(axes, ("1f1b", "zb-h1")):
        gantt(ax, replay[kind])
        ax.set_ylim(0, 4.7)                                                  # (a row of room for the key)
        ax.set_title(f"{title(kind, 1)}, m = {M}, p = 4, the list replayed at its measured median F, B, W: step "
                     f"{1e3 * span(replay[kind]):.1f} ms, bubble {bubble_fraction(replay[kind]):.2f} (as measured: "
                     f"step {1e3 * span(results[4, kind]['timeline']):.1f} ms, bubble "
                     f"{bubble_fraction(results[4, kind]['timeline']):.2f})", fontsize=8)
    ax.set_xlim(0, 1e3 * max(span(t) for t in replay.values()))              # one time axis for both lists
    ax.set_xlabel("milliseconds", fontsize=7)
    ax.legend(handles=[Patch(color=COLORS[KIND_NAMES[k]], label=f"{KIND_NAMES[k]} {k}") for k in "FBW"],
              loc="upper left", fontsize=6, ncol=3, frameon=False, borderaxespad=0.1)
    return pictures.save(fig, "12_1f1b_vs_zb_h1_measured")


path = pictures.on_rank0(world, draw_measured, share=True)
say(f"picture: {path}")

# %% [markdown]
# The picture shows 1F1B and ZB-H1 at this machine's ratio of costs rather than at F = B = W; the measured timeline,
# whose spread (printed) is the machine's, not the schedule's, is not drawn. ZB-H1's W's fill $2(p-1)W$ of a stage's
# idle time (section 3), so the shorter a W is next to F and B, the less it gains over 1F1B.
#
# ## 6. The trade-off
#
# Per layout and schedule: the bubble three ways (closed form for equal costs, simulated, measured in step 2), the pairs
# and activation bytes held at the peak (most over the stages, predicted and measured), and what stage 1, a middle
# stage, sends on `pp_comm` per step (point-to-point: payload and bytes sent are the same number).

# %%
table = []
for g in (g4, g8):
    for kind, v in KINDS:
        r = results[g.pp, kind]
        t_sim = simulate(build(kind, M, g.pp, v), M, v)
        calls, nbytes = r["sent"][1]                                   # stage 1, a middle stage
        pred = r["predicted stages"]
        table.append((g.pp, title(kind, v), bubble_formula(kind, M, g.pp, v), bubble_fraction(t_sim),
                      bubble_fraction(r["timeline"]), max(h for h, _ in pred), max(r["held"]),
                      max(b for _, b in pred), max(r["bytes"]), calls, nbytes))
say(f"{'':<27} {'bubble':^32}   {'pairs held':^11}   {'activation bytes':^21}   {'pp_comm, stage 1':^26}".rstrip())
say(f"{'p':>2}  {'schedule':<23} {'formula':>9} {'simulated':>10} {'measured':>10}   {'pred':>5} {'meas':>5}   "
    f"{'predicted':>10} {'measured':>10}   {'messages':>8} {'payload':>8} {'sent':>8}")
for p, name, closed, sim, meas, pairs_p, pairs, act_p, act, calls, nbytes in table:
    say(f"{p:>2}  {name:<23} {closed:>9.4f} {sim:>10.4f} {meas:>10.2f}   {pairs_p:>5} {pairs:>5}   "
        f"{fmt_bytes(act_p):>10} {fmt_bytes(act):>10}   {calls:>8} {fmt_bytes(nbytes):>8} {fmt_bytes(nbytes):>8}")
check("every layout and schedule: simulated bubble - closed form", max(abs(r[2] - r[3]) for r in table), 1e-12)


def draw_tradeoff():
    fig, ax = pictures.figure(7, 4)
    for p, marker in ((4, "o"), (8, "s")):
        rows = [r for r in table if r[0] == p]
        ax.plot([r[2] for r in rows], [r[8] / 1024 for r in rows], marker, ls="none", label=f"pp {p}, m = {M}")
        for r in rows:
            ax.annotate(f"{r[1].split(',')[0]} ({r[9]} msgs)", (r[2], r[8] / 1024), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("bubble, equal costs (closed form)")
    ax.set_ylabel("activation KiB at the peak (max over stages)")
    ax.set_title("the trade-off: bubble against memory (and messages sent by a middle stage)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return pictures.save(fig, "12_bubble_vs_memory")


path = pictures.on_rank0(world, draw_tradeoff, share=True)
say(f"picture: {path}")

# %% [markdown]
# The picture places every schedule by its equal-cost bubble and the activation bytes of its fullest stage, with the
# messages a middle stage sends. GPipe and 1F1B have the same bubble and messages; 1F1B holds $\min(p-s, m)$
# micro-batches instead of m. Interleaving with v = 2 cuts the bubble (on pp 4 from «0.2727» to «0.1579») for twice the
# messages of the same size («32.0 KiB» per step from a middle stage of pp 4) and more activations on the first stages.
# ZB-H1 cuts it further («0.1111» on pp 4) without an extra message, holding 1F1B's peak in pairs, though not here in
# bytes (its fullest stage is the last, with the head's arrays; V = 256 is large next to C = 16). Every schedule trains
# serial SGD, all four to the same bit; the measured column shows only that on eight ranks sharing two cores the costs
# are neither equal nor constant (the lab, `python -m hsgd.schedule --costs F,B,W`, tries others).

# %% [markdown]
# ## 7. Two chunks per stage: the V and DualPipe
#
# Three later schedules give every stage two chunks, so that the pipeline fills and drains in fewer steps and a stage
# can run one micro-batch's forward beside another's backward (`hsgd.pp.placement`, `hsgd.pp.vshape`, `hsgd.pp.dual`):
#
# * **ZB-V** (Qi et al. 2024, section 6): 2p pieces in a **V**, chunk 0 of stage s piece s, chunk 1 piece 2p-1-s. Stage
#   p-1 hands the activation to itself at the turn (a copy, no message), and stage 0 holds the embedding and the loss.
#   Its list is ZB-H1's idea on the V;
# * **DualPipeV** (the V-shaped half of DualPipe, in DeepSeek's repository deepseek-ai/DualPipe): the same V with
#   DeepSeek's steps (`vshape.dual_steps`), whose steady state runs **pairs** F&B, one micro-batch's forward through one
#   chunk with another's backward through the other (`schedules.Pair`, printed F7&B3.1), so that on a GPU one half's
#   communication hides behind the other's computation. hsgd runs a pair's F, then its B; the simulation gives a pair
#   its own cost F&B, from max(F, B+W) to F+B+W;
# * **DualPipe** (DeepSeek-AI 2024, section 3.2.1): p pieces, the model held **twice**. Micro-batches 0 .. m/2-1 go down
#   (piece k on stage k), m/2 .. m-1 come up (piece k on stage p-1-k). Stage s and its twin p-1-s hold pieces s and
#   p-1-s and add their gradients after the backward (`dual.DualStage`, one message each way); stage s runs DualPipeV's
#   steps for position min(s, p-1-s) in a V of p/2 stages.
#
# First the placements of `placement(shape, p, 2)` for p = 4: each stage's pieces, the hand-offs a stage makes to
# itself, and what a backward waits for (`pl.after(s, c)`). Told the pieces are in a loop, section 1's static check
# refuses ZB-V's list.

# %%
pl_loop, pl_v, pl_dual = (placement(shape, P4, 2) for shape in ("loop", "v", "dual"))
for name, pl in (("loop (interleaved)", pl_loop), ("V (zb-v, dualpipev)", pl_v), ("dual (dualpipe)", pl_dual)):
    say(f"{name:<20} (chunk 0, chunk 1) pieces: " + "  ".join(f"s{s} {tuple(pl.piece(s, c) for c in (0, 1))}"
                                                            for s in range(P4))
        + f"   local hand-offs {[pl.local_handoffs(s) for s in range(P4)]}")
path_v = [pl_v.stage(k) for k in range(pl_v.K)]                  # the stage of each piece, along the path
down = [pl_dual.holder(k)[0] for k in range(pl_dual.K)]           # micro-batches 0 .. m/2-1: chunk 0
up = [next(s for s in range(P4) if pl_dual.piece(s, 1) == k) for k in range(pl_dual.K)]   # m/2 .. m-1: chunk 1
say(f"V: a micro-batch visits stages {path_v}; the backward of piece {P4 - 1} (stage {P4 - 1}, chunk 0) waits for "
    f"(stage, chunk) {pl_v.after(P4 - 1, 0)}")
say(f"dual: micro-batches 0..m/2-1 visit stages {down}, m/2..m-1 visit {up}")
check.equal("V: stages 0..p-1, then p-1..0 along the path; one hand-off to itself, on p-1",
            (path_v, [pl_v.local_handoffs(s) for s in range(P4)]),
            (list(range(P4)) + list(range(P4 - 1, -1, -1)), [0] * (P4 - 1) + [1]))
check.holds("V: pieces 0 and 2p-1 on stage 0; B of piece p-1 waits on its own stage",
            pl_v.stage(0) == pl_v.stage(pl_v.K - 1) == 0 and pl_v.after(P4 - 1, 0) == (P4 - 1, 1))
held_by = [sorted(pl_dual.piece(s, c) for c in (0, 1)) for s in range(P4)]
check.holds("dual: stages s and p-1-s hold pieces s and p-1-s; every piece on two",
            all(held_by[s] == held_by[P4 - 1 - s] == sorted((s, P4 - 1 - s)) for s in range(P4))
            and all(sum(k in h for h in held_by) == 2 for k in range(pl_dual.K)))
why = refusal(build("zb-v", M, P4, 2), M, 2)                      # (checked with the loop placement, the default)
say(f"ZB-V's list, checked as if its pieces were in a loop:\n  ScheduleError: {why}")
check.holds("ZB-V's list refused on the loop placement, accepted on the V",
            bool(why) and "deadlocks" in why and not refusal(build("zb-v", M, P4, 2), M, 2, pl_v))


def draw_placements():
    fig, (ax_v, ax_d) = pictures.figure(10, 3.4, ncols=2)
    ks = range(pl_v.K)
    ax_v.plot(ks, [pl_loop.stage(k) for k in ks], "o--", color="0.65",
              label="loop (interleaved): piece p back on stage 0")
    ax_v.plot(ks, path_v, "o-", color="C0", label="V: down the stages and back up")
    for k in ks:
        ax_v.annotate(f"{k}.{pl_v.holder(k)[1]}", (k, path_v[k]), xytext=(7, 5), textcoords="offset points",
                      fontsize=6, color="C0")
    ax_v.annotate("a hand-off to itself,\nno message", ((2 * P4 - 1) / 2, P4 - 1), xytext=(0, 30),
                  textcoords="offset points", ha="center", fontsize=7, arrowprops=dict(arrowstyle="->", lw=0.8))
    ax_v.set_xticks(list(ks))
    ax_v.set_xlim(-0.5, pl_v.K - 0.2)
    ax_v.set_xlabel("piece k of the model, along a micro-batch's path (labels: k.chunk)", fontsize=7)
    ax_v.set_title(f"the V (zb-v, dualpipev), p = {P4}: stage s holds pieces s and 2p-1-s", fontsize=8)
    ax_v.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.42, 1.0))
    kd = range(pl_dual.K)
    ax_d.plot(kd, down, "o-", color="C0", label="micro-batches 0 .. m/2-1 (chunk 0), down")
    ax_d.plot(kd, up, "s-", color="C3", label="micro-batches m/2 .. m-1 (chunk 1), up")
    for s in range(P4 // 2):                                       # twins s and p-1-s
        x = P4 - 0.6 + 0.25 * s
        ax_d.annotate("", (x, P4 - 1 - s), (x, s), arrowprops=dict(arrowstyle="<->", color="0.5"))
    ax_d.text(P4 - 0.1, (P4 - 1) / 2, "twins s, p-1-s:\nthe same pieces,\ngradients summed", fontsize=6.5,
              va="center")
    ax_d.set_xlim(-0.4, P4 + 1.2)
    ax_d.set_xticks(list(kd))
    ax_d.set_xlabel("piece k of the model", fontsize=7)
    ax_d.set_title(f"dual (dualpipe), p = {P4}: two copies, micro-batches from both ends", fontsize=8)
    ax_d.legend(fontsize=6, loc="lower left")
    for ax in (ax_v, ax_d):
        ax.set_ylim(P4 - 0.4, -0.6)                                 # stage 0 on top
        ax.set_yticks(range(P4))
        ax.set_yticklabels([f"stage {s}" for s in range(P4)], fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(alpha=0.3)
    return pictures.save(fig, "12_v_and_dual_placement")


path = pictures.on_rank0(world, draw_placements, share=True)
say(f"picture: {path}")

# %% [markdown]
# The picture shows the stage of each piece along a micro-batch's path: the V turns on stage p-1 where the loop jumps
# back to stage 0, and DualPipe's two copies cross, every stage holding its twin's pieces.
#
# Next the three schedules for p = 4, m = 8 (DualPipe needs m >= 2p), with a stage's share costing F = B = W = 1 as in
# section 2: a V chunk is half a share, a DualPipe piece a whole one (each sees half the micro-batches). A pair costs
# F&B = `FB` shares, less than F+B+W: an overlap assumed for the picture, which Table 2 below varies.

# %%
FB = 2.5                                                  # F&B of a stage's share, against F+B+W = 3 apart
SHARE = {"zb-v": 0.5, "dualpipev": 0.5, "dualpipe": 1.0}  # a chunk's part of a stage's share of the model
TITLES = {"zb-v": "ZB-V", "dualpipev": "DualPipeV", "dualpipe": "DualPipe"}


def simulate2(kind, m, p, costs):
    """The timeline of `kind`'s list (two chunks per stage) on its own placement."""
    return simulate(build(kind, m, p, 2), m, 2, costs, placement_of(kind, p, 2))


v_sims = {kind: simulate2(kind, M, P4, (x, x, x, FB * x)) for kind, x in SHARE.items()}
say(f"p = {P4}, m = {M}, a share F = B = W = 1, F&B = {FB}: step, bubble, idle of the least busy stage (most_idle), "
    f"longest idle inside a stage's own span (stage_idle), peak pairs per stage")
say(f"  {'1F1B (section 2)':<18} step {span(sims['1f1b']):>5g}   bubble {bubble_fraction(sims['1f1b']):.4f}   "
    f"most_idle {most_idle(sims['1f1b']):>4g}   stage_idle {stage_idle(sims['1f1b']):>4g}   "
    f"pairs {[peak_held(a) for a in build('1f1b', M, P4)]}")
for kind, t in v_sims.items():
    say(f"  {TITLES[kind]:<18} step {span(t):>5g}   bubble {bubble_fraction(t):.4f}   most_idle {most_idle(t):>4g}   "
        f"stage_idle {stage_idle(t):>4g}   pairs {[peak_held(a) for a in build(kind, M, P4, 2)]}")
say("DualPipe's lists (F3&B5.1: a pair, the forward of micro-batch 3 through chunk 0 with the backward of 5 "
    "through chunk 1):")
for line in lists("dualpipe", M, P4, 2):
    say(line)
check.holds("a stage's busy time = m(F+B+W) less (F+B+W - F&B) x chunk share per pair",
            all(abs(sum(e - s for _, s, e in r) - (M * 3 - sum(isinstance(a, Pair) for a, _, _ in r)
                                                   * SHARE[kind] * (3 - FB))) < 1e-12
                for kind, t in v_sims.items() for r in t))


def draw_v_schedules():
    fig, axes = pictures.figure(10, 5.6, nrows=3, sharex=True)
    for ax, (kind, t) in zip(axes, v_sims.items()):
        t2 = table2(kind, M, P4, (SHARE[kind],) * 3 + (FB * SHARE[kind],))
        draw_pipeline(ax, t, xlabel="time (F = B = W = 1 for a stage's share)" if kind == "dualpipe" else "",
                      title=f"{TITLES[kind]}, m = {M}, p = {P4}: step {span(t):g}, most_idle {most_idle(t):g}"
                            + (f" = Table 2's {TABLE2[kind]}" if t2 is not None else "")
                            + f", stage_idle {stage_idle(t):g}")
    axes[0].set_xlim(0, max(span(t) for t in v_sims.values()))
    return pictures.save(fig, "12_v_and_dual_simulated")


path = pictures.on_rank0(world, draw_v_schedules, share=True)
say(f"picture: {path}")

# %% [markdown]
# The picture shows the three simulated steps, a pair drawn as its forward over its backward: ZB-V's stages never wait
# once started, DualPipeV runs F&B pairs in its steady state, and DualPipe starts from both ends at once.
#
# ### DeepSeek-V3's Table 2
#
# DeepSeek-AI (2024) give in their Table 2 the bubble of 1F1B $(PP-1)(F+B)$, of ZB1P (ZB-H1) $(PP-1)(F+B-2W)$ and of
# DualPipe $(PP/2-1)(F\&B+B-3W)$; parameters 1x, 1x, 2x; activations PP, PP, PP+1 micro-batches of a chunk. Their F, B,
# W and F&B are per chunk, their B a whole backward (B + W here), and their bubble is `timelines.most_idle`: the step's
# span less the busy time of the least busy stage (`timelines.table2` has the closed forms). For p = 4 and 8, m = 2p,
# and four sets of costs with F = B (the input half), W <= F and max(F, B+W) <= F&B <= F+B+W, from a pair that hides
# nothing to one that hides all its F:

# %%
T2_COSTS = ((1.0, 1.0, 1.0, 3.0), (1.0, 1.0, 1.0, 2.0), (1.0, 1.0, 0.5, 2.0), (2.0, 2.0, 1.0, 4.5))   # F,B,W,F&B
T2_KINDS = ("1f1b", "zb-h1", "dualpipe")


def table2_rows():
    """Per (p, costs): the simulated most_idle and Table 2's closed form of 1F1B, ZB1P and DualPipe; and per p the
    peak pairs, the most over the stages."""
    rows, peaks = [], {}
    for p in (4, 8):
        m = 2 * p
        for costs in T2_COSTS:
            acts = {"1f1b": build("1f1b", m, p), "zb-h1": build("zb-h1", m, p, costs=costs[:3]),
                    "dualpipe": build("dualpipe", m, p, 2)}
            v = {"1f1b": 1, "zb-h1": 1, "dualpipe": 2}
            sim = {k: simulate(a, m, v[k], costs, placement_of(k, p, v[k])) for k, a in acts.items()}
            rows.append((p, costs, [(most_idle(sim[k]), table2(k, m, p, costs)) for k in T2_KINDS]))
            peaks[p] = [max(peak_held(a) for a in acts[k]) for k in T2_KINDS]
    return rows, peaks


t2_rows, t2_peaks = pictures.on_rank0(world, table2_rows, share=True)
say(f"{'':<27} {'1F1B':^17} {'ZB1P (zb-h1)':^17} {'DualPipe':^17}   (B: a whole backward, B+W in hsgd)")
say(f"{'p':>2} {'F':>4} {'B':>4} {'W':>4} {'F&B':>4}   " + "   ".join(f"{'sim':>6} {'Table 2':>8}" for _ in T2_KINDS))
for p, (f, b, w, fb), cells in t2_rows:
    say(f"{p:>2} {f:>4g} {b + w:>4g} {w:>4g} {fb:>4g}   " + "   ".join(f"{s:>6g} {c:>8g}" for s, c in cells))
check("Table 2: simulated most_idle - closed form, 1F1B, ZB1P, DualPipe",
      max(abs(s - c) for _, _, cells in t2_rows for s, c in cells), 1e-12)
for p, peak in t2_peaks.items():
    say(f"p = {p}: peak (micro-batch, chunk) pairs, the most over the stages: 1F1B {peak[0]}, ZB1P {peak[1]}, "
        f"DualPipe {peak[2]}")
check.equal("Table 2: peak pairs of 1F1B, ZB1P, DualPipe == (PP, PP, PP+1), p = 4, 8",
            t2_peaks, {p: [p, p, p + 1] for p in t2_peaks})

# %% [markdown]
# Every row agrees with the closed forms; the parameters' 1x, 1x, 2x are measured below on the trained stages.
#
# The zero-bubble paper's claim for ZB-V is in another measure: with F = B = W no stage waits between its first action
# and its last (`timelines.stage_idle`; the paper's "bubble rate" is built on a stage's own span), for 1F1B's
# activations (2p pairs of half a stage, against p whole ones). What remains is the V's fill: stage s starts s F after
# stage 0, so the step is $(p-1)F$ longer than any stage's span, which `most_idle` counts and the paper's measure does
# not. For p = 2, 4, 8 and m = 2p-1, 2p, 4p:

# %%
def zbv_claim():
    out = []
    for p in (2, 4, 8):
        for m in (2 * p - 1, 2 * p, 4 * p):
            acts = build("zb-v", m, p, 2)
            t = simulate(acts, m, 2, (1.0, 1.0, 1.0), placement_of("zb-v", p, 2))
            out.append((p, m, stage_idle(t), most_idle(t), max(peak_held(a) for a in acts),
                        max(peak_held(a) for a in build("1f1b", m, p)), [r[0][1] for r in t]))
    return out


zbv = pictures.on_rank0(world, zbv_claim, share=True)
say("  p   m   stage_idle   most_idle (p-1)F   peak pairs ZB-V (half a stage)   1F1B (a whole stage)")
for p, m, own, least, pairs, one, _ in zbv:
    say(f"{p:>3} {m:>3} {own:>12g} {least:>11g} {p - 1:>6}   {pairs:>30}   {one:>20}")
check("ZB-V, F = B = W: idle inside every stage's own span (stage_idle)",
      max(r[2] for r in zbv), 1e-12)
check("ZB-V, F = B = W: most_idle - (p-1)F, the V's fill", max(abs(r[3] - (r[0] - 1)) for r in zbv), 1e-12)
check.equal("ZB-V: stage s starts s F after stage 0", [r[6] for r in zbv], [list(range(r[0])) for r in zbv])
check.holds("ZB-V holds 1F1B's activations: peak pairs 2p of half a stage = 2 x 1F1B's p", all(r[4] == 2 * r[5]
                                                                                              for r in zbv))

# %% [markdown]
# ### The three on the real grid
#
# Training on the 4-stage pipeline (dp 2 x pp 4, m = 8 = 2p), as in section 5: ZB-V and DualPipeV (8 pieces of 2 blocks,
# two per stage) and DualPipe (4 pieces of 4 blocks, each on two stages). The predictions come from the lab's `Plan`
# (`hsgd.schedule`: the list, its `peak_held` and `held_bytes` on the schedule's placement) and `pp_formula`: the V's
# turn sends nothing, and a DualPipe stage sends half its micro-batches each way plus its whole gradient to its twin.
# `held_bytes` looks at a pair after its F and after its B (the stage measures at the same moments), and on the V's last
# stage counts the activation, later the gradient, it hands to itself. DualPipe's run is traced
# (`hsgd.grid.trace.Tracer`, as in chapter 9): a pair is one span.

# %%
def predict_two(g, kind):
    """My stage's (actions, peak pairs, peak activation bytes, pp_comm calls and bytes) and its parameter bytes,
    for a schedule of two chunks per stage."""
    p, s, b = g.pp, g.pp_rank, B // g.dp // M
    plan = Plan(cfg, config(p, kind, 2), (1.0, 1.0, 1.0))          # the list, its pairs and bytes, every stage
    pl = plan.placement
    chunks = stage_chunks(cfg.n_layers, p, s, 2, None, pl)         # [(piece, layers, first, last)] of my 2 chunks
    shapes = cfg.param_shapes()
    param_bytes = 8 * sum(int(np.prod(shapes[n])) for _, layers, first, last in chunks
                          for n in stage_names(cfg, layers, first, last))
    if pl.shape == "dual":                       # half the micro-batches each way, and the gradients to the twin
        sent = pp_formula(b, cfg, M, s == 0, s == p - 1, 8, "megatron", 1, 1, twin=param_bytes)
    else:                                        # pieces 0 and 2p-1 both on stage 0, the turn on stage p-1
        sent = pp_formula(b, cfg, M, s == pl.stage(0), s == pl.stage(pl.K - 1), 8, "megatron", 1, 2, 1,
                          pl.local_handoffs(s))
    return (plan.actions[s], plan.held[s], plan.bytes[s], sent), param_bytes


two, tracer = {}, Tracer(rank, world)             # a Barrier, then this rank's time origin (for DualPipe's run)
for kind in SHARE:
    pred, pbytes = predict_two(g4, kind)
    two[kind] = run(g4, kind, 2, pred, tracer if kind == "dualpipe" else None)
    two[kind]["param bytes predicted"] = pbytes
base = results[4, "1f1b"]["full"]
diff = {kind: max(float(np.abs(r["full"][n] - base[n]).max()) for n in base) for kind, r in two.items()}
for kind, r in two.items():
    say(f"{TITLES[kind]:<10} largest |difference| from 1F1B's parameters after {STEPS} steps: {diff[kind]:.1e}")
check.equal("V and dual: what my stage ran (its timeline) == the Plan's list", [r["mine"][0] for r in two.values()],
            [r["predicted"][0] for r in two.values()])
check.equal("V and dual: pairs held == the Plan's (peak_held)",
            [r["mine"][1] for r in two.values()], [r["predicted"][1] for r in two.values()])
check.equal("V and dual: activation bytes at the peak == held_bytes (the Plan's)",
            [r["mine"][2] for r in two.values()], [r["predicted"][2] for r in two.values()])
check.equal("V and dual: pp_comm calls and bytes == pp_formula (the turn, the twin)",
            [r["mine"][3] for r in two.values()], [r["predicted"][3] for r in two.values()])
act = g4.pp_comm.allgather_obj([(r["mine"][2], r["predicted"][2]) for r in two.values()])
say("activation bytes at the peak on replica 0: measured / held_bytes")
for st, row in enumerate(act):
    say(f"  stage {st}: " + "   ".join(f"{TITLES[k]} {m:,} / {w:,}" for k, (m, w) in zip(two, row)))
check(f"pp 4: my parameters vs serial SGD, the worst of {', '.join(TITLES.values())}",
      max(shard_err(r, g4) for r in two.values()))
check.holds("ZB-V and DualPipeV: parameters bit-identical to 1F1B's",
            all(np.array_equal(two[k]["full"][n], base[n]) for k in ("zb-v", "dualpipev") for n in base))
check("DualPipe: |parameters - 1F1B's| (the twin sum regroups: rounding)",
      diff["dualpipe"], 1e-15)

# %% [markdown]
# Measured bytes equal `held_bytes` on every stage. ZB-V and DualPipeV end with 1F1B's bits: every chunk adds its
# micro-batches' gradients in the order 0 .. m-1 (section 4). DualPipe's differ by rounding (printed above): each copy
# adds its own half of the micro-batches and the twin sum adds the halves, a different grouping of the same terms. Next
# what each copy costs in parameters, `trainer.memory()["params"]` on every stage of replica 0, against the stage's
# pieces:

# %%
param_rows = {"1F1B": results[4, "1f1b"]["param_bytes"], "ZB-H1": results[4, "zb-h1"]["param_bytes"],
              **{TITLES[k]: r["param_bytes"] for k, r in two.items()}}
one_copy = sum(param_rows["1F1B"])
for name, per_stage in param_rows.items():
    say(f"  {name:<10} parameter bytes per stage {[fmt_bytes(x) for x in per_stage]}   pipeline "
        f"{fmt_bytes(sum(per_stage))} = {sum(per_stage) / one_copy:g} x 1F1B's")
mine_pbytes = g4.pp_comm.allgather_obj([(r["param_bytes"][g4.pp_rank], r["param bytes predicted"])
                                        for r in two.values()])
check.holds("V and dual: a stage's parameter bytes == 8 x its pieces' parameters",
            all(meas == pred for row in mine_pbytes for meas, pred in row))
check.equal("Table 2: pipeline parameters 1x (1F1B, ZB-H1, ZB-V, DualPipeV), 2x DualPipe",
            [sum(x) for x in param_rows.values()], [one_copy] * 4 + [2 * one_copy])
check.equal("1F1B's pipeline holds the model once: 8 x its parameters", one_copy, 8 * cfg.n_params())

# %% [markdown]
# DualPipe's step from the trace: `hsgd.run.plots.pipeline_spans` turns the stages' spans into a timeline, checked
# against the list.

# %%
events = [e for mine in world.allgather(tracer.chrome_events()) for e in mine]     # every rank's spans
origins = world.allgather(tracer.t0)                  # world ranks 0..3 are replica 0's stages 0..3
traced = [[(name, origins[r] + a, origins[r] + b) for name, a, b in stage]
          for r, stage in enumerate(pipeline_spans(events, range(P4)))]
check.equal("DualPipe traced: each stage's spans in time order == its list",
            [[n for n, _, _ in stage] for stage in traced],
            [[str(a) for a in acts] for acts in build("dualpipe", M, P4, 2)])
dp_lists, took2 = build("dualpipe", M, P4, 2), {}
for stage, acts in zip(traced, dp_lists):               # the spans are the list's actions, in order (checked above)
    split = {(a.mb, a.chunk) for a in acts if a.kind == "W"}
    for (_, t0, t1), a in zip(stage, acts):
        took2.setdefault("B+W" if a.kind == "B" and (a.mb, a.chunk) not in split else a.kind, []).append(t1 - t0)
med2 = {k: float(np.median(took2[k])) for k in ("F", "B", "W", "B+W", "F&B")}
dp_costs = (med2["F"], med2["B"], med2["W"], med2["F&B"])          # a fused B costs B + W in the replay
dp_replay = simulate2("dualpipe", M, P4, dp_costs)
apart = simulate2("dualpipe", M, P4, dp_costs[:3])                                # F&B = its F and its B apart
hidden = simulate2("dualpipe", M, P4, dp_costs[:3] + (max(dp_costs[0], dp_costs[1] + dp_costs[2]),))
say("DualPipe's traced step, median ms per action: " + ", ".join(f"{k} {1e3 * x:.2f}" for k, x in med2.items()))
say(f"replayed at those medians: step {1e3 * span(dp_replay):.1f} ms; a pair as its two halves apart "
    f"{1e3 * span(apart):.1f} ms; a pair as its longer half (full overlap) {1e3 * span(hidden):.1f} ms; "
    f"as measured {1e3 * span(traced):.1f} ms (timings of this machine: printed, never checked)")


def draw_dualpipe_measured():
    fig, ax = pictures.figure(10, 2.6)
    draw_pipeline(ax, dp_replay, unit=1e-3, xlabel="milliseconds",
                  title=f"DualPipe, m = {M}, p = {P4}, its list replayed at the traced medians (ms): "
                        + ", ".join(f"{k} {1e3 * x:.2f}" for k, x in med2.items() if k != "B+W")
                        + f"; step {1e3 * span(dp_replay):.1f} ms (a pair as its halves apart: "
                          f"{1e3 * span(apart):.1f} ms)")
    return pictures.save(fig, "12_dualpipe_measured")


path = pictures.on_rank0(world, draw_dualpipe_measured, share=True)
say(f"picture: {path}")

# %% [markdown]
# The picture shows DualPipe's list replayed at the traced medians of a lone F, a split B, a W and a pair (a fused B
# costing B + W), since the traced durations spread as in section 5. hsgd computes a pair's halves one after the other
# on one core, so a pair costs about its F plus its B (compare the medians printed), and the replay comes out near the
# step with every pair run as its halves apart; the third printed step, each pair costing only its longer half, is what
# an overlap would give, which needs a device that computes while its messages travel.
#
# ### Section 6's trade-off, with the new schedules
#
# On pp 4 with m = 8, the columns of section 6 plus the parameter bytes of the fullest stage and of the pipeline
# (DualPipe's messages include the gradient to its twin):

# %%
rows = []
for name, r, kind, v in (("1F1B", results[4, "1f1b"], "1f1b", 1), ("ZB-H1", results[4, "zb-h1"], "zb-h1", 1),
                         *((TITLES[k], two[k], k, 2) for k in SHARE)):
    pred = r["predicted stages"] if v == 1 else g4.pp_comm.allgather_obj(r["predicted"][1:3])
    t_sim = simulate(build(kind, M, P4, v), M, v, (1.0, 1.0, 1.0), placement_of(kind, P4, v))
    rows.append((name, bubble_formula(kind, M, P4, v), bubble_fraction(t_sim), bubble_fraction(r["timeline"]),
                 max(h for h, _ in pred), max(r["held"]), max(b for _, b in pred), max(r["bytes"]),
                 max(r["param_bytes"]), sum(r["param_bytes"]), *r["sent"][1]))
say(f"{'':<10} {'bubble':^29}   {'pairs held':^11}   {'activation bytes':^21}   {'parameters':^19}   "
    f"{'pp_comm, stage 1':^26}")
say(f"{'schedule':<10} {'formula':>8} {'simulated':>10} {'measured':>9}   {'pred':>5} {'meas':>5}   "
    f"{'predicted':>10} {'measured':>10}   {'stage':>9} {'pipeline':>9}   {'messages':>8} {'payload':>8} {'sent':>8}")
for name, closed, sim, meas, pp_, pm, ap, am, pst, ppl, calls, nbytes in rows:
    say(f"{name:<10} {closed:>8.4f} {sim:>10.4f} {meas:>9.2f}   {pp_:>5} {pm:>5}   {fmt_bytes(ap):>10} "
        f"{fmt_bytes(am):>10}   {fmt_bytes(pst):>9} {fmt_bytes(ppl):>9}   {calls:>8} {fmt_bytes(nbytes):>8} "
        f"{fmt_bytes(nbytes):>8}")
check("pp 4, the five schedules: simulated bubble - closed form", max(abs(r[1] - r[2]) for r in rows), 1e-12)
twin_bytes = two["dualpipe"]["param_bytes"][1]                     # stage 1's gradient, to stage p-2
say(f"DualPipe's stage 1 sends {fmt_bytes(rows[-1][-1] - twin_bytes)} of activations and their gradients and "
    f"{fmt_bytes(twin_bytes)} of parameter gradients to its twin per step")
check.holds("equal costs: ZB-V's bubble the least of the five, DualPipeV's == ZB-H1's",
            min(rows, key=lambda r: r[1])[0] == "ZB-V" and abs(rows[3][1] - rows[1][1]) < 1e-12)

# %% [markdown]
# ZB-V has the smallest bubble of the five for equal costs, holding the activations of 1F1B's stage 0 on every stage (2p
# pairs of half a stage) and, on a middle stage, sending twice 1F1B's messages, as interleaving does; its end stages
# send fewer, the turn being a copy. DualPipeV runs the same V with DeepSeek's steps: with pairs that overlap nothing
# its bubble is ZB-H1's, and every unit an F&B saves below F+B+W takes p-1 off its idle time, $(p-1)(F\&B+B-3W)$ in
# `TABLE2` (Table 2's DualPipe of 2p stages folded in two; exercise 5 finds it in the simulator). DualPipe fills and
# drains from both ends, p/2 stages deep, and sends 1F1B's messages plus one; its price, as Table 2 says, is twice the
# parameters (with their gradients and optimizer state), one more pair held, and the twins' gradient sum, which in this
# toy model is most of the bytes a stage sends.

# %% [markdown]
# ## Check against serial
#
# Every verdict above is collective, over 8 ranks. What they establish: the static check refuses bad lists by name; the
# simulator reproduces every closed form, `peak_formula` and DeepSeek-V3's Table 2; the split backward is the fused one
# bit for bit; and every schedule, on pp 4 and pp 8, runs its list, holds the predicted pairs and bytes, sends
# `pp_formula`'s messages and ends with serial SGD's parameters (1F1B's bits, DualPipe to rounding).

# %%
worst_what, err = check.worst([w for w in check.errors if "serial" in w])
say(f"\nchapter 12: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error against serial "
    f"{err:.1e} ({worst_what})")
g4.free()
g8.free()

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | a schedule is data: `schedules.build(kind, m, p, v)`, per stage a list of `Action(kind, mb, chunk)` (F, B, W), run by `Stage.run` (hsgd/pp/stage.py) | none: each schedule is a function whose loops run the steps (`forward_backward_no_pipelining`, `forward_backward_pipelining_without_interleaving`, `forward_backward_pipelining_with_interleaving`, megatron/core/pipeline_parallel/schedules.py), picked by `get_forward_backward_func` | `PipeSchedule.steps()` yields each step's list of `PipeInstruction`s (`ForwardPass`, `BackwardPass`, `SendActivation`, `RecvGrad`, ...); `TrainSchedule` is 1F1B (deepspeed/runtime/pipe/schedule.py) | `pipeline_order`: per rank a list of `_Action(stage_index, computation_type, microbatch_index)`, `_ComputationType` F, I (input gradient), W (weight gradient), B (full backward) (torch/distributed/pipelining/schedules.py) | the messages are not in the list: they follow from the dependencies, sent when an action ends and received when the next one starts |
# | `schedules.check` / `simulate`: `ScheduleError` naming the first action that cannot run | none | none | `_simulate_comms_compute` dry-runs a `pipeline_order` and flags deadlocks | checked by every `Stage` before its first message, and simulated with chosen costs for the pictures and the lab |
# | `build("interleaved", m, p, v)`, `--schedule interleaved --virtual-stages v` (`pp.chunks.chunk_layers`: chunk c of stage s is piece cp + s) | `forward_backward_pipelining_with_interleaving` with `virtual_pipeline_model_parallel_size` (`ModelParallelConfig`, `parallel_state.initialize_model_parallel`): v model chunks per rank, warm-up $2(p-s-1) + (v-1)p$ | none | `ScheduleInterleaved1F1B` | the same order, written out as a list; m must be a multiple of p |
# | `build("zb-h1", m, p, costs=(F, B, W))`, `--schedule zb-h1`; the W's products kept by `wgrad.WeightGrads` | none upstream (Qi et al. built theirs on a fork); `delay_wgrad_compute` defers weight-gradient GEMMs to overlap expert-parallel communication, not to fill a pipeline | none | `ScheduleInterleavedZeroBubble` (zero bubble over several stages per rank), `ScheduleZBVZeroBubble` (the V-shaped placement), with I and W actions | H1 with one chunk per stage (ZB-V: the next row); the W's are placed by simulating with given costs, so the list changes when the costs do |
# | `timelines.bubble_formula`, `FORMULA`; `idle_per_stage`, `bubble_fraction` | the paper's $\frac{1}{v}\cdot\frac{p-1}{m}$ (idle over compute) | none | none | idle over the whole step, so the fraction stays below 1 (chapter 9) |
# | `build("zb-v", m, p)`, `--schedule zb-v`, on `placement("v", p, 2)`: chunk 0 of stage s is piece s, chunk 1 piece 2p-1-s | none | none | `ScheduleZBVZeroBubble` (torch.distributed.pipelining), its stages placed by `generate_rank_to_stage_mapping(..., style="v")`; torchtitan: `pipeline_parallel_schedule = "ZBVZeroBubble"` | the paper's pattern written out as a list (`vshape.zb_v`), checked and simulated on its placement; the turn on stage p-1 is a copy, not a message |
# | `build("dualpipev", m, p)`, `--schedule dualpipev`; the overlapped pair `schedules.Pair` (F&B) | none | none | `ScheduleDualPipeV`, its pairs `OVERLAP_F_B` actions; torchtitan: `pipeline_parallel_schedule = "DualPipeV"`. DeepSeek's own: the `DualPipeV` class (deepseek-ai/DualPipe, dualpipe/dualpipev.py), its postponed weight gradients in `WeightGradStore` | DeepSeek's steps as data (`vshape.dual_steps`); hsgd runs a pair's F, then its B, so it hides nothing on a CPU: the simulation's F&B says what an overlap would give |
# | `build("dualpipe", m, p)`, `--schedule dualpipe`: `placement("dual", p, 2)`, two copies; `dual.DualStage` sums the twins' gradients | none (no V or bidirectional schedule; `combined_1f1b_schedule_for_interleaved_pipelining`, megatron/core/pipeline_parallel/combined_1f1b.py, overlaps one micro-batch's forward with another's backward inside interleaved 1F1B when `overlap_moe_expert_parallel_comm` is set) | none | none (only the V-shaped half, `ScheduleDualPipeV`) | DeepSeek's `DualPipe` class (dualpipe/dualpipe.py, two modules per rank, `overlapped_forward_backward` on the module) leaves the twins' gradient sum to its caller; hsgd's stage sums them itself, one message each way, so the copies stay equal bit for bit |
# | `timelines.most_idle` and `table2` (DeepSeek-V3's Table 2), `stage_idle` (the zero-bubble papers' measure) | none | none | none | both measures from one simulated timeline, so a paper's claim is checked in its own measure |
#
# ## Exercises
#
# ### Exercise 1: Megatron-LM's interleaved order by hand
# Write stage s's interleaved list from its description: the i-th forward is micro-batch $\lfloor i/(pv) \rfloor p +
# (i \bmod p)$ through chunk $\lfloor i/p \rfloor \bmod v$, the i-th backward the same micro-batch through chunk
# $v - 1 - (\lfloor i/p \rfloor \bmod v)$; $\min(2(p-s-1) + (v-1)p, vm)$ warm-up forwards ($p-s-1$ for v = 1), then F
# and B in turn, then the remaining backwards. Check it against `schedules.build("interleaved", m, p, v)` for p = 2 to
# 6, v = 1 to 4, m = p, 2p, 3p, that `schedules.check` accepts every list, and that a chunk's backwards come in the
# order 0 .. m-1 on every stage. Then use the warm-up $2(p-s-1)$ for v = 1 too (Megatron-LM never does): check with
# `schedules.simulate` that the bubble does not change, and count what it costs in pairs held.
# (solution: `tutorials/solutions/12_pipeline_schedules.py`, `exercise_1`)
#
# ### Exercise 2: ZB-H1 by hand
# From section 2's grid: stage s runs 1F1B's F's and B's, and the W of micro-batch j right after the B of j + s, the
# last s W's at the end. Check that list against `schedules.build("zb-h1", m, p)` for p = 2 to 8, m = p to 3p, and
# with `schedules.simulate` that it idles $(p-1)(F+B-W)$ per stage and holds at most p pairs. With costs (F, B, W)
# = (1, 1, 1/2): is your list still `build`'s, and do both idle times still follow the formula?
# (solution: `tutorials/solutions/12_pipeline_schedules.py`, `exercise_2`)
#
# ### Exercise 3: every schedule of a small pipeline
# For p = 2, m = 2, list the 6 orders of F0, F1, B0, B1 with each forward before its backward, and the 36 pairs of
# orders. Write your own deadlock test (run each stage as far as it can, repeat until nothing moves) and check that it
# accepts exactly what `schedules.check` accepts. How many are there, which hold the fewest pairs, which have the
# smallest simulated step? The same for p = 3 (216 triples).
# (solution: `tutorials/solutions/12_pipeline_schedules.py`, `exercise_3`)
#
# ### Exercise 4: what interleaving sends
# On the 4-stage pipeline (dp 2 x pp 4) and the 16-block model, train one step interleaved with v = 1, 2, 4 and read
# `pp_comm`'s calls and bytes from `grid.stats`. Check them against $m(2v - [s = 0] - [s = p-1])$ messages each way of
# $b\,T C \cdot 8$ bytes and `pp.chunks.pp_formula`, check that the three runs end bit-identical, and print each
# stage's bytes per step next to 1F1B's.
# (solution: `tutorials/solutions/12_pipeline_schedules.py`, `exercise_4`)
#
# ### Exercise 5: the V's turn, and DualPipe's Table 2 from the simulator
# Write the V's dependencies yourself (piece k on stage k for k < p, on 2p-1-k after; F waits for F of piece k-1, B
# for B of piece k+1 or, on the last piece, its own F; W for its B; an F&B pair for both halves' inputs) and a walker
# returning the first action of the lowest stage that cannot run. Check it accepts ZB-V's and DualPipeV's lists for
# p = 2 to 6, m = 2p, 3p; then move stage 3's B0 (piece 3) before its B0.1 (piece 4) in ZB-V's list for p = 4, m = 8
# and check that your walker stops where `schedules.check` does with `placement("v", 4, 2)`. Second, without Table 2:
# simulate DualPipe for p = 6, m = 12 and 24 with costs where F = B, W <= F and max(F, B+W) <= F&B <= F+B+W, fit its
# `most_idle` linearly in F&B, DeepSeek's B (B + W) and W by least squares, and check the coefficients are
# $(p/2-1)(1, 1, -3) = (2, 2, -6)$ with no constant; then the same for DualPipeV on p = 3, whose Table 2 idle
# $(p-1)(F\&B+B-3W)$ has the same coefficients.
# (solution: `tutorials/solutions/12_pipeline_schedules.py`, `exercise_5`)
