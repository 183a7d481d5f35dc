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
# # Chapter 9: pipeline parallelism
#
# Chapters 5 and 6 split every layer over a tensor-parallel group; the lecture's other way of splitting a model is
# by layers. Its section 3.1 (in translation):
#
# > pipeline parallelism: assign different layers of the model to different nodes, e.g. the first few layers to
# > node 1, the middle layers to node 2, the last layers to node 3. The data passes from node to node like on an
# > assembly line.
#
# Section 1 names the costs, "pipeline dependencies" between the nodes, "pipeline bubbles [that] easily leave the
# devices idle", a demanding load balance, and section 4.2 the remedies: "split the data into micro-batches that
# fill the stages of the pipeline, to reduce the idle time (the bubbles); balance the compute load and the
# communication of the partitions". This chapter runs p = 4 stages on 4 ranks (pp = 4, tp = dp = 1): the layers
# to stages, one micro-batch relayed by hand, the bubble of GPipe and 1F1B simulated, measured and in two
# measures, what the schedules hold, serial SGD bit for bit, load balance, and the bytes on `pp_comm`.
#
# Run it with four ranks (about 7 s on a quiet 2-core machine, up to 31 s when other jobs share the cores; on
# failure every rank raises, so it exits non-zero without hanging). Rank 0 draws three pictures into
# `$HSGD_FIGURES` (default `tutorials/figures/`) and alone prints:
#
# mpirun -n 4 python tutorials/09_pipeline_parallelism.py
#
# Legend: p = pp stages, s a stage (its `pp_rank`), m micro-batches per step (`micro_batches`), B global batch, b =
# B/m sequences per micro-batch, T sequence, C d_model, F d_ff, V vocabulary, L layers, $L_s$ the blocks of stage
# s, f and $b_c$ the time of one forward and one backward of a micro-batch on a stage, bytes per number 8
# (float64).

# %%
import itertools

import numpy as np

from hsgd.model.config import ModelConfig
from hsgd.model import serial
from hsgd.tp import model as tp_model
from hsgd.model.data import Corpus
from hsgd.errors import ConfigError
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.model.layers import embedding_forward
from hsgd.run.plots import draw_pipeline, pipeline_spans
from hsgd.pp.chunks import pp_formula, split_layers, stage_names
from hsgd.pp.schedules import build, simulate
from hsgd.pp.timelines import bubble_formula, bubble_fraction, peak_held
from hsgd.grid.trace import Tracer
from hsgd.run.report import fmt_bytes
from hsgd.accounting.traffic import step_formula

import pictures                          # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, rel_err, train_config   # tutorials/checks.py, shared by the chapters

PP = 4                                  # pipeline stages p
TOL = 1e-10                             # float64: parallel and serial differ by rounding, ~1e-16 relative
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, PP, tol=TOL, width=68)
grid = ProcessGrid(world, dp=1, pp=PP, tp=1)   # one pipeline of 4 stages; tp_comm and dp_comm have one rank each
pp_comm, s = grid.pp_comm, grid.pp_rank        # the pipeline's communicator (hsgd.grid.comm.Comm) and my stage

cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=16, n_heads=4, n_layers=8, d_ff=64)   # 8 blocks, 4 stages
SEED = 0
corpus = Corpus.load(None, cfg.seq_len) # the built-in corpus (the Python standard library's source), as hsgd.train
say(f"{PP} ranks = {PP} pipeline stages; model {cfg.n_params():,} parameters (L={cfg.n_layers} C={cfg.d_model} "
    f"NH={cfg.n_heads} F={cfg.d_ff} T={cfg.seq_len} V={cfg.vocab_size})")

# %% [markdown]
# ## 1. Layers to stages
#
# A GPT is a chain: embedding (`wte`, `wpe`), L blocks, final LayerNorm, LM head, loss. A pipeline cuts it into p
# **stages** of consecutive layers, one per rank (with tensor parallelism, per tensor-parallel group: chapter 10).
# Stage s holds the blocks `pp.chunks.split_layers(L, p)[s]`, as even as possible by default (the first L mod p
# stages get one more) or as `--pp-split 3,2,2,1` says (section 7); the embedding sits on the first stage, the
# final LayerNorm, head and loss on the last (`pp.chunks.stage_names`). A stage holds only its own parameters,
# gradients and optimizer state: that, not speed, is why pipelines exist.

# %%
split = split_layers(cfg.n_layers, PP)                 # [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
layers = split[s]                                      # my blocks
first, last = s == 0, s == PP - 1
names = stage_names(cfg, layers, first, last)          # my parameters
shapes = cfg.param_shapes()
n_mine = sum(int(np.prod(shapes[n])) for n in names)
extras = ", ".join(x for x, on in (("embedding wte, wpe", first), ("ln_f, lm_head, loss", last)) if on)
rows = pp_comm.allgather_obj((s, grid.rank, list(layers), n_mine, extras))
say("stage  world rank  blocks        parameters  and")
for st, r, blocks, n, ex in rows:
    say(f"{st:>5}  {r:>10}  {str(blocks):<12} {n:>11,}  {ex}")
held = pp_comm.allgather_obj(names)
check.equal("sum of the stages' parameter counts == n_params", sum(r[3] for r in rows), cfg.n_params())
check.equal("the stages' parameter names == the model's, each once", sorted(n for ns in held for n in ns),
            sorted(shapes))

# %% [markdown]
# A split that cannot work is refused before anything runs, with an example of one that would:

# %%
for args in ((cfg.n_layers, PP, [3, 3, 3]), (cfg.n_layers, PP, [4, 4, 0, 0]), (2, PP, None)):
    try:
        split_layers(*args)
        refused = ""
    except ConfigError as e:
        refused = str(e)
    say(f"split_layers{args}: ConfigError: {refused}")
    check.holds(f"split_layers{args} refused", refused)

# %% [markdown]
# ## 2. What crosses between stages: one micro-batch by hand
#
# Stage s runs `tp_model.stage_forward(params, inp, targets, piece, setup)` on its blocks (`setup`, a
# `tp_model.TPSetup`, says how: tp communicator, scheme, what the blocks keep). Its input is the token ids on the
# first stage, else the **activation** $x^{(s)}$, (b, T, C), the residual stream after the previous stage; its
# output is $x^{(s+1)}$, or the loss on the last stage. `tp_model.stage_backward(dout, caches, grads, setup)` takes
# $\partial L / \partial x^{(s+1)}$ from stage s+1 ($dout = 1$ on the last), accumulates the stage's parameter
# gradients with `+=` and returns $\partial L/\partial x^{(s)}$ for stage s-1. By the chain rule a stage depends on
# the rest of the network only through that one (b, T, C) array. One micro-batch is two relay races on `pp_comm`:
#
#     forward:   stage 0 --x(1)--> stage 1 --x(2)--> stage 2 --x(3)--> stage 3 (loss)      Send / Recv, tag 0
#     backward:  stage 0 <-dx(1)-- stage 1 <-dx(2)-- stage 2 <-dx(3)-- stage 3 (dloss = 1)  Send / Recv, tag 1
#
# `Recv` blocks until its input exists. Every stage reads the same micro-batch (a function of seed and step); only
# the first uses the token ids, only the last the targets.

# %%
b = 2                                                   # sequences in the micro-batch
idx, targets = corpus.batch(SEED, 1, b)                 # (b, T) int64 each, on every stage
full = serial.init_params(cfg, seed=SEED, dtype="float64")     # the serial model, on every rank (a toy)
params = {n: full[n] for n in names}                    # my stage's parameters
grads = serial.zeros_like_params(params)                # my stage's gradients, accumulated with +=
act = (b, cfg.seq_len, cfg.d_model)                     # (b, T, C): every message has this shape
piece = tp_model.Piece(layers, first, last)             # my blocks, the embedding on stage 0, the head on the last
setup = tp_model.TPSetup(cfg, grid.tp_comm, "megatron")       # tp = 1 here: the whole width of every block

grid.stats.reset()
# forward: wait for stage s-1's activation, run my blocks, pass the result on
inp = idx if first else pp_comm.Recv(np.empty(act), source=s - 1, tag=0)          # (b, T) ids or (b, T, C)
out, caches = tp_model.stage_forward(params, inp, targets, piece, setup)
if not last:
    pp_comm.Send(np.ascontiguousarray(out), dest=s + 1, tag=0)                     # (b, T, C) activation out
# backward: the last stage starts from dloss = 1; the others wait for dL/d(my output) from stage s+1
dout = 1.0 if last else pp_comm.Recv(np.empty(act), source=s + 1, tag=1)          # (b, T, C) gradient in
dinp = tp_model.stage_backward(dout, caches, grads, setup)                        # += into grads; None on stage 0
if not first:
    pp_comm.Send(np.ascontiguousarray(dinp), dest=s - 1, tag=1)                    # (b, T, C) gradient out
by_hand = grid.stats.counts()

# %% [markdown]
# The serial reference: `serial.loss_and_grads` on the whole model, and the residual stream where my stage begins,
# from the serial layers. The loss, on the last stage only, is broadcast over `pp_comm`.

# %%
loss_ref, grads_ref = serial.loss_and_grads(full, idx, targets, cfg)
x_ref, _ = embedding_forward(idx, full["wte"], full["wpe"])                        # (b, T, C)
for i in range(layers.start):
    x_ref, _ = serial.block_forward(x_ref, full, f"h.{i}.", cfg)                   # after block i
loss = pp_comm.comm.bcast(float(out) if last else None, root=PP - 1)              # metadata: one float
check("by hand: activation received by my stage vs serial (stage 0: none)",
      0.0 if first else rel_err(inp, x_ref))
check("by hand: loss on the last stage vs serial loss", abs(loss - loss_ref) / loss_ref)
check("by hand: my stage's parameter gradients vs serial", max(rel_err(grads[n], grads_ref[n]) for n in names))
expect = pp_formula(b, cfg, 1, first, last, 8)          # Stage.run's Isend / Recv: the same messages
sent = sum(n for (c, op), (_, n) in by_hand.items() if c == "pp" and op == "Send")
check.equal("by hand: bytes sent on pp_comm == pp_formula(b, m=1)", sent, expect.get(("pp", "Isend"), (0, 0))[1])
say(f"every message is one (b, T, C) = {act} float64 array = {np.prod(act) * 8:,} bytes; stage 0 sends 1, "
    f"stages 1-2 send 2, stage 3 sends 1")

# %% [markdown]
# `Stage.run` (hsgd/pp/stage.py), which training uses, differs in two ways that matter with several micro-batches
# in flight: **tags** (micro-batch j's activation from stage s travels with tag 2(sm + j), its gradient with
# 2(sm + j) + 1, so every `Recv` names its message) and **non-blocking sends** (`Isend`, completed at the end of
# the step). With a blocking `Send`, 1F1B could deadlock: stage s sends micro-batch j+1's activation forward while
# stage s+1 sends micro-batch j's gradient back, and a large `Send` returns only once the receiver posts its
# `Recv` (small messages go out eagerly, so the bug would hide in a toy). With `Isend`, and no cycle in the
# schedules' dependencies, some stage can always progress.
#
# ## 3. Micro-batches and the bubble
#
# With one micro-batch, while stage 0 computes the others wait. So the batch is cut into m micro-batches of
# b = B/m sequences whose gradients accumulate (chapter 4's `micro_batches`: the gradient is serial's whatever m
# is), and each stage runs a list of actions, "F j" and "B j", in the order of a **schedule** (`build(kind, m, p)[s]`,
# hsgd.pp.schedules), a list of `Action(kind, micro-batch, chunk)` (the chunk is 0 until chapter 12):
#
# * **GPipe** (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
#   Parallelism"): all m forwards, then all m backwards;
# * **1F1B**, the steady state of PipeDream (Narayanan et al. 2019, "PipeDream: Generalized Pipeline Parallelism
#   for DNN Training") in the synchronous form PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient
#   Pipeline-Parallel DNN Training") that Megatron-LM runs: $\min(p-s-1, m)$ warm-up forwards, then one forward and
#   one backward in turn, then the remaining backwards.
#
# Both run the backwards in the order B0, B1, ..., so they add the same gradients in the same order.
#
# **The bubble.** Let every forward take f and every backward $b_c$ (`simulate` starts each action once its stage
# is free and its input has arrived). The first micro-batch reaches the last stage after $(p-1)f$, which then
# works $m(f + b_c)$, and the last gradient needs $(p-1)b_c$ to reach stage 0: the step takes
# $(m + p - 1)(f + b_c)$, each stage computes $m(f + b_c)$, and the idle fraction is
#
# $$\text{bubble} = \frac{p - 1}{m + p - 1},$$
#
# for both schedules, whatever f and $b_c$: $(p-1)/p$ at m = 1, about a half at m = p, a third at 2p.
#
# **Two measures of the same idle time.** hsgd's (`bubble_formula`, `bubble_fraction` of a timeline) divides by
# the whole step. Narayanan et al. (2021), "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", divide the idle time $t_{pb} = (p-1)(f + b_c)$ by the computation $t_{id} = m(f + b_c)$:
#
# $$\frac{t_{pb}}{t_{id}} = \frac{p-1}{m},$$
#
# $\beta/(1-\beta)$ for hsgd's $\beta$: equal for large m, above 1 at m = 1 (a stage idles p - 1 times as long as
# it works). Say which you quote. The table gives both, and the picture draws the timelines (f = 1, $b_c$ = 2: a
# backward computes two matrix products for every one of the forward); the blank space is the fill and the drain.

# %%
def bubbles(timeline):
    """(hsgd's bubble, Megatron-LM's) of a timeline [[(action, start, end)] per stage]: the idle time over
    p x the step's span (bubble_fraction), and the same idle time over the busy time, beta / (1 - beta)."""
    beta = bubble_fraction(timeline)
    return beta, beta / (1.0 - beta)


say(f"{'':<12} {'step':>4} {'(m+p-1)(f+b_c)':>15}   {'bubble':>6} {'(p-1)/(m+p-1)':>13}   {'idle/busy':>9} "
    f"{'(p-1)/m':>7}")
simulated = {}
for m in (1, PP, 2 * PP):
    for kind in ("gpipe", "1f1b"):
        t = simulate(build(kind, m, PP), m, costs=(1.0, 2.0, 0.0))        # [[(action, start, end)] per stage]
        span = max(e for stage in t for _, _, e in stage)
        ours, megatron = bubbles(t)
        closed = bubble_formula(kind, m, PP)                     # (p-1)/(m+p-1), both schedules
        say(f"{kind:<5} m = {m:<2}  {span:>4.0f} {(m + PP - 1) * 3:>15}   {ours:>6.3f} {closed:>13.3f}   "
            f"{megatron:>9.3f} {(PP - 1) / m:>7.3f}")
        check(f"{kind} m={m}: simulated bubble - (p-1)/(m+p-1)", abs(ours - closed), 1e-12)
        check(f"{kind} m={m}: simulated idle/busy - (p-1)/m", abs(megatron - (PP - 1) / m), 1e-12)
        simulated[kind, m] = t
if rank == 0:
    fig, axes = pictures.figure(10, 6.6, nrows=3, ncols=2, sharex=True)
    for row, m in enumerate((1, PP, 2 * PP)):
        for col, kind in enumerate(("gpipe", "1f1b")):
            ours, megatron = bubbles(simulated[kind, m])
            draw_pipeline(axes[row, col], simulated[kind, m], xlabel="time (units of f; b_c = 2f)" if row == 2 else "",
                          title=f"{'GPipe' if kind == 'gpipe' else '1F1B'}, m = {m}, p = {PP}: bubble {ours:.2f} of "
                                f"the step, idle/busy {megatron:.2f}", legend=col == 1)
    path = pictures.save(fig, "09_schedules_equal_cost")
    say(f"picture: {path}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# The picture: each schedule's step in the equal-cost model, one row per stage, one bar per action. Equally fast,
# not equally large: at m = 8 GPipe's stage 0 runs F0 ... F7 before its first backward, holding all 8 micro-batches'
# activations; 1F1B's stage 0 runs 3 warm-up forwards, then alternates (F3 B0 F4 B1 ...), freeing one micro-batch
# per new one.
#
# ## 4. Two schedules, run for real: what they hold
#
# `peak_held(actions)` (hsgd.pp.timelines) counts the most micro-batches forwarded and not yet backwarded: m for
# GPipe, $\min(p - s, m)$ for 1F1B. Each holds its caches, per block a few (b, T, C) and (b, T, F) arrays and the
# (b, NH, T, T) attention probabilities, so GPipe's activation memory grows with m, the very thing that shrinks
# the bubble, while 1F1B's is bounded by p. `HybridTrainer` with `pp=4` runs its stage's schedule through
# `Stage.run`, which counts what it holds (`trainer.stage.peak_held`) and records each action's start and end
# (`trainer.stage.timeline`): three steps, B = 16, m = 8, once per schedule.

# %%
def config(**kw):
    """The float64 run every comparison shares (`train_config`: SGD with momentum, validated as hsgd.train does)."""
    return train_config(**{**dict(dp=1, pp=PP, tp=1, steps=3, batch_size=16, micro_batches=2 * PP, seed=SEED), **kw})


def run(tc):
    """tc.steps steps of HybridTrainer on the chapter's grid. Returns (trainer, losses, bytes of step 2 as
    {(comm, op): (calls, bytes)})."""
    trainer = HybridTrainer(cfg, grid, tc)
    losses, per_step = [], None
    for step in range(1, tc.steps + 1):
        before = grid.stats.counts()
        losses.append(trainer.step(*corpus.batch(tc.seed, step, tc.batch_size), step).loss)
        if step == 2:
            per_step = grid.stats.since(before)
    return trainer, losses, per_step


M = 2 * PP
runs = {kind: run(config(schedule=kind)) for kind in ("gpipe", "1f1b")}
say(f"1F1B, m = {M}, p = {PP}: the actions of every stage, build('1f1b', m, p)[s]:")
for st in range(PP):
    say(f"  stage {st}: " + " ".join(str(a) for a in build("1f1b", M, PP)[st]))   # Action: F3, B3
check.equal("trainer.stage.actions == build(kind, m, p)[my stage], both",
            [runs[k][0].stage.actions for k in runs], [build(k, M, PP)[s] for k in runs])
say("stage   micro-batches held: GPipe measured / schedule   1F1B measured / schedule   min(p-s, m)")
mine = [(runs[k][0].stage.peak_held, peak_held(runs[k][0].stage.actions)) for k in ("gpipe", "1f1b")]
for st, ((g_meas, g_sched), (f_meas, f_sched)) in enumerate(pp_comm.allgather_obj(mine)):
    say(f"{st:>5}   {g_meas:>27} / {g_sched:<8} {f_meas:>16} / {f_sched:<8} {min(PP - st, M):>12}")
check.equal("micro-batches held == peak_held(schedule), both schedules",
            [held for held, _ in mine], [promised for _, promised in mine])
check.equal("micro-batches held (GPipe, 1F1B) == (m, min(p - s, m))", (mine[0][0], mine[1][0]), (M, min(PP - s, M)))

# %% [markdown]
# ## 5. The schedules as they ran
#
# `hsgd.grid.trace.Tracer` records a span for every forward and backward, opened once the input has been received,
# so the gaps are time spent in `Recv`, the bubble. `hsgd.run.plots.pipeline_spans` turns a trace into the same
# [(action, start, end)] per stage as `simulate`, and `draw_pipeline` draws either; on one machine the ranks share
# one clock, so adding each rank's origin (`tracer.t0`) back aligns them. The timings use a wider model (C = 64,
# T = 32, F = 256, 8 blocks), so that a forward is arithmetic, not fixed cost per call: for each m, two steps of m
# micro-batches of 2 sequences, the second traced.

# %%
wide = ModelConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=8, d_ff=256)
wide_corpus = Corpus.load(None, wide.seq_len)


def traced(kind, m):
    """The second of two steps of `kind` with m micro-batches of 2 sequences on the wide model, as hsgd.grid.trace
    recorded it: [[("F j" or "B j", start, end)] per stage], in seconds on the ranks' common clock."""
    tc = config(schedule=kind, micro_batches=m, batch_size=2 * m, steps=2)
    tracer = Tracer(rank, world)                            # a Barrier, then this rank's time origin
    trainer = HybridTrainer(wide, grid, tc, tracer)
    for step in (1, 2):
        tracer.clear()                                      # keep only the last step's spans
        trainer.step(*wide_corpus.batch(tc.seed, step, tc.batch_size), step)
    trainer.free()
    events = [e for mine in world.allgather(tracer.chrome_events()) for e in mine]   # every rank's spans
    origins = world.allgather(tracer.t0)                    # world rank r is stage r here (dp = tp = 1)
    return [[(name, origins[r] + a, origins[r] + b) for name, a, b in stage]
            for r, stage in enumerate(pipeline_spans(events, range(PP)))]


SWEEP = (1, 2, 4, 8, 16)
timed = {(kind, m): traced(kind, m) for m in SWEEP for kind in ("gpipe", "1f1b")}
check.holds("the traced actions of every stage, in time order == build(kind, m, p)",
            all([n for n, _, _ in t[st]] == [str(a) for a in build(kind, m, PP)[st]]
                for (kind, m), t in timed.items() for st in range(PP)))
if rank == 0:
    fig, axes = pictures.figure(10, 4.6, nrows=2)
    for ax, kind in zip(axes, ("gpipe", "1f1b")):
        ours, megatron = bubbles(timed[kind, M])
        closed = bubble_formula(kind, M, PP)
        draw_pipeline(ax, timed[kind, M], unit=1e-3, xlabel="milliseconds",
                      title=f"{'GPipe' if kind == 'gpipe' else '1F1B'}, m = {M}, p = {PP}, measured: bubble {ours:.2f} "
                            f"of the step (equal-cost model {closed:.2f}), idle/busy {megatron:.2f} "
                            f"(model {(PP - 1) / M:.2f})")
    path = pictures.save(fig, "09_schedules_measured")
    say(f"picture: {path}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# The picture is the traced step of each schedule at m = 8: the order is the schedule's, the lengths are not the
# model's. The table gives every traced step's bubble in both measures next to the formulas, and in the last column
# the part due to unequal stages alone: a step lasts at least as long as its busiest stage computes, so
# $1 - \overline{w}/\max_s w_s$ would idle even without fill or drain ($w_s$ the time stage s computed, 1F1B).

# %%
def busy(timeline):
    """Seconds each stage spent in its actions."""
    return [sum(e - a for _, a, e in stage) for stage in timeline]


say(f"{'m':>3}  {'(p-1)/(m+p-1)':>13}  {'GPipe':>6} {'1F1B':>6}   {'(p-1)/m':>7}  {'GPipe':>6} {'1F1B':>6}   "
    f"{'1 - mean/max busy':>17}")
for m in SWEEP:
    (g, g_meg), (f, f_meg) = bubbles(timed["gpipe", m]), bubbles(timed["1f1b", m])
    w = busy(timed["1f1b", m])
    say(f"{m:>3}  {bubble_formula('gpipe', m, PP):>13.3f}  {g:>6.3f} {f:>6.3f}   {(PP - 1) / m:>7.3f}  {g_meg:>6.3f} "
        f"{f_meg:>6.3f}   {1 - np.mean(w) / max(w):>17.3f}")
if rank == 0:
    fig, (left, right) = pictures.figure(10, 3.6, ncols=2)
    ms = np.arange(1, SWEEP[-1] + 1)
    for ax, formula, label, which in ((left, (PP - 1) / (ms + PP - 1), "(p-1)/(m+p-1)", 0),
                                      (right, (PP - 1) / ms, "(p-1)/m", 1)):
        ax.plot(ms, formula, color="black", lw=1, label=f"equal-cost model {label}")
        for kind, marker in (("gpipe", "o"), ("1f1b", "s")):
            ax.plot(SWEEP, [bubbles(timed[kind, m])[which] for m in SWEEP], marker, ls="none",
                    label=f"measured, {'GPipe' if kind == 'gpipe' else '1F1B'}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(SWEEP, [str(m) for m in SWEEP])
        ax.set_xlabel(f"micro-batches m (p = {PP})")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    left.set_ylabel("idle / (p x step time)")
    left.set_title("hsgd's bubble: a fraction of the step", fontsize=9)
    right.set_ylabel("idle / busy")
    right.set_title("Megatron-LM's bubble: against the ideal compute time", fontsize=9)
    path = pictures.save(fig, "09_bubble_vs_micro_batches")
    say(f"picture: {path}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# The second picture: the measured bubble against m, in hsgd's measure (left) and Megatron-LM's (right), the
# formulas as lines. It falls with m and stays above the formula by a noisy amount (printed, not checked): the
# stages are unequal (the last computes the LM head and the loss, section 7), every action has a fixed cost outside
# the spans, and four ranks share two cores, where a rank waiting in `Recv` polls and takes CPU from those
# computing. The first two shrink with a larger, balanced model, the third with a core per rank.
#
# ## 6. Both schedules are serial SGD
#
# Pipelining changes when a micro-batch is computed, never what: every stage accumulates the gradients of
# $\frac1m \text{loss}_j$ for j = 0, ..., m-1 in that order under both schedules, so GPipe and 1F1B agree **bit for
# bit**, and both end with serial SGD's parameters (`serial.sgd`) up to rounding, relative to each parameter's
# largest entry but at least 0.02 (chapter 4: the attention k-biases only receive rounding noise).

# %%
tc = config()
ref, ref_losses = serial.sgd(cfg, tc, lambda step: corpus.batch(tc.seed, step, tc.batch_size))
gpipe, onefb = runs["gpipe"][0], runs["1f1b"][0]
say(f"serial SGD losses: {' '.join(f'{x:.6f}' for x in ref_losses)}")
for kind in ("gpipe", "1f1b"):
    say(f"{kind:<5} losses:      {' '.join(f'{x:.6f}' for x in runs[kind][1])}")
check.holds("GPipe vs 1F1B after 3 steps: parameters bit-identical",
            all(np.array_equal(gpipe.params[n], onefb.params[n]) for n in names))
for kind in ("gpipe", "1f1b"):
    check(f"{kind}, 3 steps: losses vs serial SGD", max(abs(a - b) / b for a, b in zip(runs[kind][1], ref_losses)),
          1e-9)
    check(f"{kind}, 3 steps: my stage's parameters vs serial SGD",
          max(rel_err(p, ref[n], floor=0.02) for n, p in runs[kind][0].params.items()), 1e-9)

# %% [markdown]
# ## 7. Load balance
#
# A pipeline runs at the pace of its slowest stage. The blocks are alike, the ends are not: the first stage also
# looks up the embedding (no matmul), the last computes the LM head, a (C, V) matmul per position, and the loss.
# In matmul FLOPs (`ModelConfig.step_flops`: 6 per multiply-add) a block costs $6(4C^2 + 2CF) + 12TC$ per position
# and the head $6CV$. `--pp-split` (`TrainConfig.pp_split`) moves blocks off the last stage; the best split below
# minimizes the slowest stage over every way of cutting L blocks into p non-empty stages (35 for this toy, 165 for
# GPT-2's 12 layers).

# %%
def block_and_head(cfg):
    """Matmul FLOPs of one training step on one sequence: (one block, the LM head), from ModelConfig.step_flops."""
    head = 6 * cfg.seq_len * cfg.d_model * cfg.vocab_size                   # step_flops' LM head term
    return (cfg.step_flops(1) - head) / cfg.n_layers, head


def stage_costs(cfg, split):
    """Each stage's cost in blocks: its blocks, plus the LM head on the last stage."""
    block, head = block_and_head(cfg)
    return [n + (head / block) * (i == len(split) - 1) for i, n in enumerate(split)]


def best_split(cfg, p):
    """The blocks per stage that minimize the slowest stage (every split of L into p parts of at least 1)."""
    cuts = itertools.combinations(range(1, cfg.n_layers), p - 1)         # where the p-1 stage boundaries go
    splits = [[hi - lo for lo, hi in zip((0,) + c, c + (cfg.n_layers,))] for c in cuts]
    return min(splits, key=lambda sp: max(stage_costs(cfg, sp)))


gpt2 = ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072)
for name, mc in (("this toy", cfg), ("GPT-2 small", gpt2)):
    block, head = block_and_head(mc)
    even = [len(r) for r in split_layers(mc.n_layers, PP)]
    say(f"{name}: a block costs {block / 1e6:,.2f} MFLOP per sequence and step, the LM head {head / block:.2f} "
        f"blocks; stage costs in blocks, p = {PP}:")
    for label, sp in (("even", even), ("best", best_split(mc, PP))):
        costs = stage_costs(mc, sp)
        say(f"  {label} split {','.join(map(str, sp)):<9} " + "  ".join(f"{c:5.2f}" for c in costs)
            + f"   slowest {max(costs):5.2f}, ideal {sum(costs) / PP:5.2f}")

# %% [markdown]
# For the toy the head weighs about one block and the best split gains a few percent; for GPT-2's shape
# (V = 50257) it weighs more than four blocks, and the best split shortens every step by about a quarter. (Real
# systems also weigh memory: under 1F1B the first stage holds the most micro-batches.) An uneven split is still
# serial SGD: a run of the toy's best split, and each stage's compute time in its last step next to the even
# split's (printed, not checked):

# %%
best = best_split(cfg, PP)                                               # [1, 3, 3, 1] for this toy
pp_split = ",".join(map(str, best))                                      # what --pp-split takes
uneven, _, _ = run(config(pp_split=pp_split))
busy = pp_comm.allgather_obj((list(uneven.stage.layers), sum(e - a for _, a, e in uneven.stage.timeline),
                              sum(e - a for _, a, e in onefb.stage.timeline)))
say(f"stage  blocks ({pp_split})  busy ms: {pp_split}   even 2,2,2,2   FLOP model {pp_split} / even (blocks)")
model_best, model_even = stage_costs(cfg, best), stage_costs(cfg, [2, 2, 2, 2])
for st, (blocks, t_best, t_even) in enumerate(busy):
    say(f"{st:>5}  {str(blocks):<16}  {1e3 * t_best:>15.1f}  {1e3 * t_even:>13.1f}   "
        f"{model_best[st]:>12.2f} / {model_even[st]:.2f}")
check(f"pp_split {pp_split}, 3 steps: my stage's parameters vs serial SGD",
      max(rel_err(p, ref[n], floor=0.02) for n, p in uneven.params.items()), 1e-9)

# %% [markdown]
# ## 8. What the pipeline sends
#
# Per micro-batch, stage s sends its output activation to stage s+1 (unless last) and its input gradient to stage
# s-1 (unless first), and receives as many: `pp.chunks.pp_formula` gives m `Isend`s and m `Recv`s of
# $\frac{B}{m} T C s$ bytes per neighbour, $B T C s$ in all, **whatever m is**: more, smaller messages, not more
# bytes. `accounting.traffic.step_formula` adds the (here one-rank) tp and dp terms. Step 2 of the 1F1B run:

# %%
formula = step_formula(cfg, config(schedule="1f1b"), onefb)
measured = runs["1f1b"][2]
for st, (meas, form) in enumerate(pp_comm.allgather_obj((measured, formula))):
    say(f"stage {st}: measured (calls, bytes) vs step_formula")
    for key in sorted(set(meas) | set(form)):
        say(f"  {key[0]:<3} {key[1]:<10} {str(meas.get(key, (0, 0))):<16} {form.get(key, (0, 0))}"
            + ("   (a one-rank communicator: nothing moves)" if key[0] != "pp" else ""))
check.equal("1F1B step 2: every stage's bytes == step_formula (tp, pp, dp)", measured, formula)
check.equal("GPipe step 2: every stage's bytes == step_formula",
            runs["gpipe"][2], step_formula(cfg, config(schedule="gpipe"), gpipe))

# %% [markdown]
# The other way to use the same four ranks for one copy of the model is a tensor-parallel group of 4 (chapters 5
# and 6), which All-Reduces (N, C) activations in every block, $((4L + 2)C + 3) N s$ bytes per rank and step
# (N = B T), against the pipeline's $2 B T C s$ from a middle stage. Those are payloads; a ring All-Reduce over p
# ranks sends $2(p-1)/p$ of its payload from every rank, a point-to-point message once (chapter 2). Both columns:

# %%
B = config().batch_size
pp_bytes = max(sum(n for (c, op), (_, n) in form.items() if c == "pp" and op == "Isend")
               for form in pp_comm.allgather_obj(formula))
tp_bytes = sum(n for _, n in tp_model.comm_formula(cfg, B, 8).values())
ring = 2 * (PP - 1) / PP                                 # bytes a ring All-Reduce sends per rank, per payload byte
say(f"per rank and step, B = {B}, float64          {'payload':>10}  {'sent per rank':>13}")
say(f"pipeline of {PP} stages, Isend (middle stage)  {fmt_bytes(pp_bytes):>10}  {fmt_bytes(pp_bytes):>13}   (1 x)")
say(f"tensor-parallel group of {PP}, Allreduce      {fmt_bytes(tp_bytes):>10}  {fmt_bytes(ring * tp_bytes):>13}   "
    f"(2(p-1)/p = {ring:.2f} x)")
say(f"tensor parallel / pipeline                  {tp_bytes / pp_bytes:>10.1f}  {ring * tp_bytes / pp_bytes:>13.1f}")
check.equal("pp bytes sent by a middle stage == 2 B T C s", pp_bytes, 2 * B * cfg.seq_len * cfg.d_model * 8)

# %% [markdown]
# That is the lecture's trade. Tensor parallelism has no bubble but talks in every layer, many times the
# pipeline's bytes, and needs the fast links inside a node. A pipeline talks little and only to neighbours, so its
# stages can sit on different nodes, but pays with the bubble, activation memory (GPipe m micro-batches, 1F1B up
# to p) and its slowest stage. Chapter 10 combines all three dimensions.
#
# ## Check against serial
#
# On 4 ranks, collectively: every parameter lives on exactly one stage; one micro-batch relayed by hand gives each
# stage serial's activation, loss and gradients; the equal-cost bubble is $(p-1)/(m+p-1)$ of the step and
# $(p-1)/m$ of the compute for m = 1, p, 2p; real stages hold exactly what their schedules promise and run their
# actions in order; GPipe and 1F1B end three steps bit-identical and at serial SGD's parameters, as does an uneven
# `--pp-split`; and every stage's bytes are `step_formula`'s.

# %%
worst, err = check.worst([w for w in check.errors if "serial" in w])
say(f"\nchapter 9: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error against serial "
    f"{err:.1e} ({worst})")
grid.free()

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `pp.chunks.split_layers(L, p, split)`, `--pp-split` (`TrainConfig.pp_split`) | even split by default; `num_layers_in_first_pipeline_stage`, `num_layers_in_last_pipeline_stage`, `account_for_loss_in_pipeline_split`, `pipeline_model_parallel_layout` (`TransformerConfig`, megatron/core/transformer/transformer_config.py) | `PipelineModule(layers=..., partition_method="parameters")`, also `"uniform"` and `"type:..."` (deepspeed/runtime/pipe/module.py) | `pipeline(...)` with `SplitPoint` / `pipe_split()` (torch/distributed/pipelining/_IR.py), or one `PipelineStage` per hand-cut module | blocks per stage, given by hand; the cost model that chooses them is in this chapter (section 7), not in the library |
# | `build("gpipe", m, p)[s]` (hsgd.pp.schedules) | none (Megatron-LM runs 1F1B) | none (its `TrainSchedule` is 1F1B-like) | `ScheduleGPipe` (torch/distributed/pipelining/schedules.py) | kept to show what 1F1B saves in memory |
# | `build("1f1b", m, p)[s]`, run by `Stage.run` (hsgd/pp/stage.py) | `forward_backward_pipelining_without_interleaving` (megatron/core/pipeline_parallel/schedules.py; warm-up `total_stages - current_stage - 1` forwards), chosen by `get_forward_backward_func` | `TrainSchedule` (deepspeed/runtime/pipe/schedule.py), run by `PipelineEngine.train_batch` (deepspeed/runtime/pipe/engine.py) | `Schedule1F1B` (torch/distributed/pipelining/schedules.py) | a schedule is a plain list of `Action`s (F3, B3) that one loop executes, so it can be printed, simulated and compared with the trace |
# | `schedules.build("interleaved", m, p, v)`: chapter 12 | `forward_backward_pipelining_with_interleaving` (virtual stages: v model chunks per rank) | none | `ScheduleInterleaved1F1B` | left to chapter 12: interleaving divides the bubble by about v and multiplies the messages by v (Narayanan et al. 2021) |
# | `Stage.receive`, `Stage.forward` / `backward`: `Isend` / `Recv` on `pp_comm`, tags 2(sm + j) and 2(sm + j) + 1 | `P2PCommunicator.send_forward`, `recv_forward`, `send_forward_recv_backward`, ... (megatron/core/pipeline_parallel/p2p_communication.py), batched with `torch.distributed.batch_isend_irecv` | `send`, `recv` (deepspeed/runtime/pipe/p2p.py) | `PipelineStage` (torch/distributed/pipelining/stage.py) builds `dist.P2POp` lists (`get_fwd_send_ops`, ...) | MPI tags name each message, so no two messages of a step can be confused, whatever the order the schedule posts them in |
# | `peak_held(actions)` (hsgd.pp.timelines), measured as `Stage.peak_held`: GPipe m, 1F1B $\min(p-s, m)$ | `max_outstanding_backprops = num_warmup_microbatches + 1` in `forward_backward_pipelining_without_interleaving`: at most p - s micro-batches await their backward | `TrainSchedule.num_pipe_buffers()`: $\max(2, \min(p - s, m))$ buffers | none | counted and checked in real steps, not only promised |
# | `bubble_formula` $(p-1)/(m+p-1)$, `bubble_fraction` of a timeline (hsgd.pp.timelines) (idle over the whole step) | the paper's bubble time fraction $(p-1)/m$ (idle over ideal compute; Narayanan et al. 2021) | none | none | hsgd's denominator is the step, so the fraction stays below 1; section 3 prints both |
#
# ## Exercises
#
# ### Exercise 1: the bubble from a table of time slots
# With a forward taking one time slot and a backward two, build the table of a step by hand: for every stage a row
# of slots, each slot idle or holding "F j" or "B j". Place the actions of `build(kind, m, p)[s]` in order,
# each at the first slot where its stage is free and its input exists (F on stage s after F of the same
# micro-batch on stage s-1; B on stage s after B on stage s+1, or on the last stage after its own F). Count the idle
# slots: check that idle / (p x slots) is $(p-1)/(m+p-1)$ and idle / busy is $(p-1)/m$ for both schedules, p from 2
# to 6 and m from 1 to 2p, and that every action ends in the slot where `simulate` ends it.
# (solution: `tutorials/solutions/09_pipeline_parallelism.py`, `exercise_1`)
#
# ### Exercise 2: what GPipe and 1F1B hold
# Write stage s's 1F1B schedule yourself (warm-up forwards, one forward and one backward in turn, the remaining
# backwards) and check it against `build` for every p up to 6, m up to 12 and s. From a schedule, count the
# micro-batches held after each action and check the peak against m (GPipe) and $\min(p-s, m)$ (1F1B). Then turn it
# into bytes on the chapter's 4 ranks: cache one micro-batch's forward on your stage (`tp_model.stage_forward`),
# measure it with `hsgd.accounting.activations.activation_bytes`, and print each stage's peak activation memory under
# both schedules at m = 8; check your peak against `Stage.peak_held` after a real step of each schedule.
# (solution: `tutorials/solutions/09_pipeline_parallelism.py`, `exercise_2`)
#
# ### Exercise 3: an unbalanced split
# Extend the equal-cost simulation to a forward cost $f_s$ and a backward cost $b_s$ per stage, and check that a
# GPipe step then takes $\sum_s f_s + (m-1)\max_s f_s + \sum_s b_s + (m-1)\max_s b_s$ (each phase is a flow of
# identical jobs through the stages), which for equal costs is section 3's $(m+p-1)(f+b_c)$. With the stage costs of
# section 7's FLOP model, predict how much longer a step of the split 5,1,1,1 takes than the even one. Then run both
# on 4 ranks (`pp_split="5,1,1,1"`): check that each stage holds `split_layers(8, 4, [5, 1, 1, 1])[s]` and that both
# splits end with the same parameters; print the measured step times next to your prediction.
# (solution: `tutorials/solutions/09_pipeline_parallelism.py`, `exercise_3`)
#
# ### Exercise 4: the bytes between the stages
# Write by hand the (calls, bytes) that stage s sends and receives on `pp_comm` in one step of m micro-batches of
# $B/m$ sequences, and check them against `CommStats` after a real step on 4 ranks for m = 1, 2, 4, 8: the bytes do
# not depend on m, only the number of messages does. Put the busiest stage's bytes per step next to a tensor-parallel
# group of 4 on the same batch (`tp_model.comm_formula`), as payload and as bytes a ring sends per rank.
# (solution: `tutorials/solutions/09_pipeline_parallelism.py`, `exercise_4`)
