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
# # Chapter 8: communication optimizations
#
# Chapter 10 trained the lecture's hybrid: dp groups of tp tensor-parallel workers, one All-Reduce of every gradient
# shard over `dp_comm` after the backward pass. The lecture then lists what makes that exchange cheaper or hides
# it, and what it costs when it is not synchronous. Section 3.4 (in translation):
#
# > this communication pattern can be optimized as: a Reduce-Scatter over the data-parallel dimension (summing and
# > scattering the gradient), then an All-Gather over the model-parallel dimension (synchronizing the parameters),
# > or a more efficient two-dimensional mesh All-Reduce algorithm.
#
# Section 4.1: hierarchical communication (NVLink inside a server, InfiniBand between servers); overlap: start the
# All-Reduce of each shard as soon as its gradient is ready. Section 1: the challenges of data parallelism include
# stragglers; section 4.4: asynchronous updates add noise.
#
# On one point hsgd departs from section 3.4, on purpose: the dimension of the All-Gather. After the Reduce-Scatter
# over `dp_comm`, each of the dp ranks that hold the same shard has the summed gradient of 1/dp of that shard, and
# updates just that part. The parameters that must then travel are those parts, to the other dp ranks of the
# *same* shard: so hsgd's All-Gather runs over the **data-parallel** dimension too (`dp_comm`). An All-Gather over
# the model-parallel dimension (`tp_comm`) would give every tp rank the other tp ranks' shards, which its next step
# does not use: a tensor-parallel rank computes with its own shard only. Section 2 below is this Reduce-Scatter /
# All-Gather pair (ZeRO stages 1 and 2), and section 3 is the lecture's two-dimensional mesh All-Reduce: the dp
# ranks of one `dp_comm` laid out as nodes x ranks per node, reduced along one dimension of the mesh, then the
# other, then gathered back.
#
# `HybridTrainer` (hsgd/step/trainer.py) has each optimization as a `TrainConfig` option. All but the last change *how*
# the gradients travel, never *what* the update is; staleness changes the algorithm, exactly. This chapter takes
# them one at a time, measures the bytes, and checks the result against the plain path and against serial SGD:
#
# 1. **overlap** (`dp_overlap`): one non-blocking All-Reduce per layer, started by the backward pass;
# 2. **Reduce-Scatter + sharded optimizer + All-Gather** (`zero=1`, `zero=2`): the same bytes, 1/dp of the
#    optimizer state (and with `zero=2`, reduce-scattered layer by layer during the backward pass, of the gradient);
# 3. **hierarchical all-reduce** (`hierarchical`, `ranks_per_node`): inside the node, across nodes, inside again;
# 4. **stragglers** (`straggler`) and **staleness** (`dp_staleness=1`): what synchronous SGD pays for the slowest
#    rank, and the exact (and inexact) price of not waiting.
#
# Run it with eight ranks (about 10 s on a 2-core machine; on failure every rank raises, so it exits non-zero
# without hanging). Rank 0 draws four pictures into `$HSGD_FIGURES` (default `tutorials/figures/`):
#
# mpirun -n 8 python tutorials/08_communication_optimizations.py
#
# The notebook form (`jupytext --to ipynb tutorials/08_communication_optimizations.py`) is for reading: the code
# needs eight MPI ranks. Only rank 0 prints.
#
# Legend: P ranks, dp replicas (groups), tp ranks per group, B global batch, b = B/dp, T sequence,
# C d_model, NH heads, F d_ff, V vocabulary, L layers, s bytes per number, $\Phi$ the bytes of a rank's gradient
# buffer, n ranks per node, k nodes, $\eta_s$ the learning rate of step s, $w_s$ the parameters after step s.

# %%
from hsgd.model.config import ModelConfig   # hsgd before NumPy: it sets OpenBLAS's thread timeout (hsgd.model.threads)
from hsgd.model import serial
from hsgd.tp import model as tp_model, shards as tp_shards

import io
import math

import numpy as np

from hsgd.model.data import Corpus
from hsgd.dp.average import params_digest
from hsgd.grid.process_grid import ProcessGrid
from hsgd.dp.hierarchical import cross_node_bytes, hier_formula
from hsgd.step.trainer import HybridTrainer
from hsgd.run.plots import COLORS as PHASE_COLORS
from hsgd.grid.trace import Tracer, overlap_seconds
from hsgd.train import train

import pictures                                      # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, rel_err, ring_share, train_config

P, DP, TP = 8, 4, 2                     # the default layout: 4 groups of 2, as in chapter 10
TOL = 1e-12                             # float64: two ways of summing the same numbers differ by ~1e-16 relative
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, P, tol=TOL, width=70)
grid = ProcessGrid(world, dp=DP, tp=TP)

cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=8, n_layers=2, d_ff=128)   # NH, T split 1..8 ways
SEED, B, STEPS = 0, 8, 4
corpus = Corpus.load(None, cfg.seq_len) # the built-in corpus (the Python standard library's source), as hsgd.train
say(f"{P} ranks; model {cfg.n_params():,} parameters (L={cfg.n_layers} C={cfg.d_model} NH={cfg.n_heads} "
    f"F={cfg.d_ff} T={cfg.seq_len} V={cfg.vocab_size}); B={B}")

# %% [markdown]
# Four helpers serve every section: `config` is the float64 run all comparisons share (SGD with momentum, a
# warm-up, a cosine schedule; `train_config` of `tutorials/checks.py` with this chapter's layout); `run` trains it
# for a few steps on a grid and records the bytes of step 2; `serial_sgd` is the reference, `serial.sgd` on one
# process with the whole batch of every step (every rank computes it; the toy is cheap), optionally with the
# gradient applied one step late (section 4); `param_err` compares a rank's shards with the matching slices of
# serial parameters, relative to each parameter's largest entry but at least to 0.02, the scale of the
# initialization (chapter 4 says why: the attention k-biases only ever receive rounding noise).

# %%
def config(**kw):
    return train_config(**{**dict(tp=TP, dp=DP, steps=STEPS, batch_size=B, warmup=2, seed=SEED), **kw})


def run(tc, g=None, tracer=None):
    """tc.steps steps of HybridTrainer on grid g (default: the chapter's grid). Returns (trainer, infos, bytes of
    step 2 as {(comm, op): (calls, bytes)}, DP replicas bit-identical after every step)."""
    g = g or grid
    trainer = HybridTrainer(cfg, g, tc, tracer)
    infos, per_step, identical = [], None, True
    for step in range(1, tc.steps + 1):
        before = g.stats.counts()
        infos.append(trainer.step(*corpus.batch(tc.seed, step, tc.batch_size), step))
        if step == 2:
            per_step = g.stats.since(before)
        identical &= len(set(g.dp_comm.allgather_obj(params_digest(trainer.params)))) == 1
    return trainer, infos, per_step, identical


def serial_sgd(tc, delayed=False):
    """serial.sgd on the global batch of every step, with tc's optimizer, schedule and clipping; delayed=True
    applies the gradient of step s at step s+1 and nothing at step 1. Returns (params, losses)."""
    return serial.sgd(cfg, tc, lambda step: corpus.batch(tc.seed, step, tc.batch_size), delayed=delayed)


def param_err(params, ref, g=None, scheme="megatron"):
    """Largest rel_err of this rank's shards against the matching slices of serial parameters (floor 0.02)."""
    g = g or grid
    return max(rel_err(p, tp_shards.shard(ref[n], n, g.tp_rank, g.tp, scheme), floor=0.02) for n, p in params.items())


def max_diff(a, b):
    """The largest rel_err between two {name: array} dicts of the same shards (floor 0.02, as param_err)."""
    return max(rel_err(a[n], b[n], floor=0.02) for n in b)


ref_params, _ = serial_sgd(config())
plain, _, plain_bytes, _ = run(config())          # chapter 10's path: one Allreduce after the backward
check(f"plain DP, {STEPS} steps: every rank's shards vs serial SGD", param_err(plain.params, ref_params), 1e-10)

# %% [markdown]
# ## 1. Overlap: one bucket per layer, started by the backward pass
#
# The backward pass finishes the gradients from the top of the network down: the LM head and the final LayerNorm
# first, then block L-1, ..., block 0, the embeddings last (`tp_model.backward_order`). Once a block's backward is
# done, nothing will touch its gradients again in this step, so their All-Reduce can start *now*, while the
# layers below are still computing. Chapter 10 waited until the very end.
#
# To make each layer's gradients one message, the exchange lays out the flat buffers in backward order (the
# groups of `Stage.groups()`, in `AllreduceExchange.__init__`): every group is a contiguous slice, a **bucket**
# (`trainer.exchange.buckets`, group -> slice of the buffer). The stage's last backward action passes
# `on_ready(group)` to `tp_model.stage_backward`, which calls it when a group is final, and with
# `dp_overlap=True` that is `OverlappedExchange.on_ready`, which starts a non-blocking `Iallreduce` of the bucket
# and returns at once. After the backward pass, `finish()` waits for all of them and divides by dp. The arithmetic
# is the same sum over the same dp ranks, element by element, so the result is the same up to the order of the
# additions; the bytes are the same too, in both columns (the payloads of the buckets add up to the buffer, and a
# ring sends $2\frac{dp-1}{dp}$ of each), in one call per bucket instead of one call in all.

# %%
overlap, _, overlap_bytes, same_replicas = run(config(dp_overlap=True))
itemsize = overlap.pbuf.flat.itemsize
say(f"trainer.exchange.buckets on rank 0 (backward order), {len(overlap.exchange.buckets)} Iallreduces per step:")
for group, span in overlap.exchange.buckets.items():
    say(f"  {group:<10} buffer [{span.start:>6}, {span.stop:>6})  {(span.stop - span.start) * itemsize:>7,} bytes")
say(f"step 2, dp_comm, measured (calls, payload): plain {plain_bytes[('dp', 'Allreduce')]} Allreduce, "
    f"overlapped {overlap_bytes[('dp', 'Iallreduce')]} Iallreduce; a ring sends "
    f"{float(ring_share('Allreduce', DP) * overlap_bytes[('dp', 'Iallreduce')][1]):,.0f} bytes per rank for either")
check.equal("overlap: step 2's bytes == tp comm_formula + trainer.exchange.sizes.formula()",
            overlap_bytes, {**tp_model.comm_formula(cfg, B // DP, itemsize), **overlap.exchange.sizes.formula()})
check.equal("overlap: dp bytes per step == plain's (one Allreduce)",
            overlap_bytes[("dp", "Iallreduce")][1], plain_bytes[("dp", "Allreduce")][1])
check(f"overlap vs plain DP after {STEPS} steps: parameters", max_diff(overlap.params, plain.params))
check(f"overlap, {STEPS} steps: every rank's shards vs serial SGD", param_err(overlap.params, ref_params), 1e-10)
check.holds("overlap: DP replicas bit-identical after every step", same_replicas)

# %% [markdown]
# **Seeing it.** `hsgd.grid.trace.Tracer` records every rank's compute-track phases (forward, backward, dp sync,
# optimizer) and every collective; a non-blocking call is one span on an "async" track from its start to the end
# of its `Wait`. One more step of each trainer, traced. `overlap_seconds(events, rank)` adds up, request by request,
# the time an `Iallreduce` was in flight during a span of the compute track. That track also holds "dp sync", the
# phase in which the rank *waits* for those very requests, so we hand it the events without that phase: what is
# left is time in flight while the rank ran its forward, backward or optimizer code. It must be positive on every
# rank for the overlapped trainer, and it is 0 for the blocking one, which has no non-blocking calls.
# `StepInfo.dp_seconds` is the exposed part, the time a rank waited in the dp exchange after its backward pass.
# The picture below draws the traced step of both trainers, every rank on three lines: its compute phases, its
# blocking collectives (tp blue, dp red), and its non-blocking ones (translucent red, from start to `Wait`).

# %%
def traced_step(trainer, tracer, step):
    """One more step of trainer with tracer on; returns (this rank's Chrome events, StepInfo)."""
    grid.tp_comm.tracer = grid.dp_comm.tracer = tracer
    tracer.enabled = True
    info = trainer.step(*corpus.batch(SEED, step, B), step)
    tracer.enabled = False
    grid.tp_comm.tracer = grid.dp_comm.tracer = None
    return tracer.chrome_events(), info


def draw_timelines(timelines):
    """Rank 0: one panel per trainer; per rank a line of compute phases, of blocking collectives (coloured by
    communicator) and of non-blocking ones; milliseconds from the first event of the panel's step."""
    fig, axes = pictures.figure(7.5, 6.0, nrows=len(timelines), sharex=True)
    for ax, (name, (events, _)) in zip(axes, timelines.items()):
        spans = [e for r in events for e in r if e.get("ph") == "X" and not e["name"].startswith("step ")]
        t0 = min(e["ts"] for e in spans)
        for e in spans:
            y = 3 * (P - 1 - e["pid"]) + (2 - e["tid"])              # compute on top, then comm, then async
            color = (PHASE_COLORS.get(e["name"], "0.6") if e["tid"] == 0
                     else pictures.COLORS.get(e["args"].get("comm"), "0.4"))
            ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 20.0) / 1e3)], (y + 0.1, 0.8), color=color,
                           alpha=0.4 if e["tid"] == 2 else 1.0, edgecolor="black" if e["tid"] == 2 else "none",
                           linewidth=0.3)
        ax.set_yticks([3 * (P - 1 - r) + 1.5 for r in range(P)], [f"rank {r}" for r in range(P)], fontsize=7)
        ax.set_ylim(0, 3 * P)
        ax.tick_params(labelsize=7)
        ax.set_title(f"dp {DP} x tp {TP}, {name} gradient exchange: one traced step (per rank: compute, "
                     "blocking, non-blocking)", fontsize=8)
    axes[-1].set_xlabel("milliseconds", fontsize=7)
    handles = [axes[0].broken_barh([], (0, 0), color=PHASE_COLORS[n], label=n)
               for n in ("forward", "backward", "dp sync", "optimizer")]
    handles += [axes[0].broken_barh([], (0, 0), color=pictures.COLORS["tp"], label="tp_comm collective"),
                axes[0].broken_barh([], (0, 0), color=pictures.COLORS["dp"], label="dp_comm collective"),
                axes[0].broken_barh([], (0, 0), color=pictures.COLORS["dp"], alpha=0.4, edgecolor="black",
                                    label="dp Iallreduce, start to Wait")]
    axes[-1].legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, fontsize=7,
                    frameon=False)
    return pictures.save(fig, "08_timeline_blocking_vs_overlapped")


timelines = {}
for name, tc in (("blocking", config()), ("overlapped", config(dp_overlap=True))):
    tracer = Tracer(rank, world, enabled=False)
    trainer = HybridTrainer(cfg, grid, tc, tracer)
    for step in range(1, STEPS + 1):                                  # untraced steps first: warm caches
        trainer.step(*corpus.batch(SEED, step, B), step)
    events, info = traced_step(trainer, tracer, STEPS + 1)
    ov = overlap_seconds([e for e in events if e["name"] != "dp sync"], rank)   # in flight while computing
    timelines[name] = (world.gather(events), world.gather((ov, info.dp_seconds)))
    if name == "overlapped":
        check.holds("overlapped: an Iallreduce in flight while computing", ov > 0)
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "Iallreduce"]
        backward = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "backward"][-1]
    else:
        check.holds("blocking: no Iallreduce in flight", ov == 0.0)

if rank == 0:
    for name, (events, rows) in timelines.items():
        say(f"{name:<10}: in flight while computing (ms, ranks 0..7) "
            + " ".join(f"{1e3 * ov:5.2f}" for ov, _ in rows)
            + "; exposed dp wait (ms) " + " ".join(f"{1e3 * dp:5.2f}" for _, dp in rows))
    say("rank 0's Iallreduces, start and end relative to the end of its backward pass (ms): "
        + ", ".join(f"[{(s - backward[1]) / 1e3:+.2f}, {(e - backward[1]) / 1e3:+.2f}]" for s, e in spans))
path = pictures.on_rank0(world, lambda: draw_timelines(timelines))
say(f"picture: {path}")

# %% [markdown]
# Be careful what "in flight" means here. `overlap_seconds > 0` says that the request had been *started* and not
# yet *completed* while the rank computed; it does not say that the bytes moved in the background. MPICH (the
# library of this venv) has no progress thread by default: a non-blocking collective advances only inside other MPI
# calls of the same process, here the tensor-parallel All-Reduces of the layers below and finally the `Wait`. And 8
# ranks on a machine with 2 cores have no idle core to move bytes anyway, so compare the exposed waits above
# without expecting a gain: here the overlapped exchange is not systematically faster. On a GPU cluster the
# collective library (NCCL) runs on its own stream and the network card moves the data, so the same schedule really
# hides the exchange behind the backward pass; the one bucket that cannot hide is the last, the embeddings, which
# is ready only when the backward pass ends. (That is also why `micro_batches > 1` overlaps only the last
# micro-batch: the earlier ones' gradients are not final.) Exercise 2 works out, with a latency-bandwidth model,
# how large the buckets must be for the exchange to keep up with the backward pass.
#
# ## 2. Reduce-Scatter, a sharded optimizer, All-Gather (ZeRO stages 1 and 2)
#
# An All-Reduce of a buffer of $\Phi$ bytes over dp ranks is, in the bandwidth-optimal algorithms (a ring, or
# recursive halving then doubling: Thakur, Rabenseifner and Gropp 2005), a **Reduce-Scatter** (each rank ends with
# the sum of one $1/dp$ chunk, sending $\frac{dp-1}{dp}\Phi$) followed by an **All-Gather** (every rank gets every
# chunk, another $\frac{dp-1}{dp}\Phi$). Plain DP does both halves on the gradients, and then every replica runs
# the same optimizer update on the whole buffer, with the whole optimizer state (AdamW: two moments per parameter,
# twice the parameters' memory). The lecture's section 3.4 splits the two halves apart, both over `dp_comm` (the
# introduction says why the All-Gather is over the data-parallel dimension here):
#
# $$g_r = \tfrac{1}{dp}\,\text{Reduce-Scatter}(g)_r, \qquad w_r \leftarrow \text{AdamW}(w_r, g_r), \qquad
# w = \text{All-Gather}(w_0, \dots, w_{dp-1}):$$
#
# rank r updates only its chunk $w_r$ and keeps optimizer state only for it, then the updated *parameters* travel
# in the All-Gather. The same bytes as an All-Reduce, $1/dp$ of the optimizer's memory and work: ZeRO stage 1
# (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"). Stage 2 also
# drops the full gradient, keeping only $g_r$: in hsgd (`dp/zero2.py`) each layer's gradient is a bucket of its own,
# padded to dp chunks, alive only during that layer's backward; its Reduce-Scatter (non-blocking,
# `Ireduce_scatter_block`) starts as soon as the layer is done and completes during the next layer's backward,
# and the bucket is freed. Stage 1's flat buffer is padded once, to a multiple of dp (`dp/zero1.py`), stage 2's
# every layer's bucket. Clipping needs the global norm of the gradient, which is now spread over
# the chunks: `health.step_numbers` and `health.global_norm` add the chunks' squares over dp (and the split
# parameters' over tp).
#
# The check: four steps of AdamW with weight decay and clipping active at every step, plain vs ZeRO-1 vs ZeRO-2.

# %%
adamw = dict(optimizer="adamw", lr=0.01, weight_decay=0.1, clip=0.5)
zero_ref, _ = serial_sgd(config(**adamw))
zero_runs = {z: run(config(zero=z, **adamw)) for z in (0, 1, 2)}
base = zero_runs[0][0]
for z in (1, 2):
    tr, infos, nbytes, same = zero_runs[z]
    check(f"ZeRO-{z} vs plain DP, AdamW + decay + clipping, {STEPS} steps", max_diff(tr.params, base.params))
    check(f"ZeRO-{z}, {STEPS} steps: every rank's shards vs serial AdamW", param_err(tr.params, zero_ref), 1e-10)
    check.equal(f"ZeRO-{z}: bytes of step 2 == tp comm_formula + the exchange's formula",
                nbytes, {**tp_model.comm_formula(cfg, B // DP, itemsize), **tr.exchange.sizes.formula()})
    check.holds(f"ZeRO-{z}: DP replicas bit-identical after every step", same)
check.holds("clipping active at every step (norm > 0.5)", all(i.grad_norm > 0.5 for i in zero_runs[1][1]))

# %% [markdown]
# The bytes of step 2 on `dp_comm`, rank 0, as `CommStats` records them (the payload of the logical tensor: the
# full input of a Reduce-Scatter, the full output of an All-Gather), and what a ring sends per rank:

# %%
phi = base.exchange.buf.flat.nbytes                               # plain DP: the gradient buffer, unpadded
phi_pad = zero_runs[1][0].pbuf.flat.nbytes                         # ZeRO-1: padded to a multiple of dp
phi_pad2 = zero_runs[2][0].exchange.sizes.size * itemsize                # ZeRO-2: every layer's bucket padded
n_groups = len(zero_runs[2][0].exchange.groups)                     # the layers: one bucket each
reduce_op = {1: "Reduce_scatter_block", 2: "Ireduce_scatter_block"}
ring = (DP - 1) / DP
say(f"{'':<8}{'operation':<22}{'calls':>6}{'payload':>10}{'ring, sent per rank':>22}")
say(f"{'plain':<8}{'Allreduce':<22}{zero_runs[0][2][('dp', 'Allreduce')][0]:>6}"
    f"{zero_runs[0][2][('dp', 'Allreduce')][1]:>10,}{2 * ring * phi:>22,.0f}")
for z in (1, 2):
    nb = zero_runs[z][2]
    for op in (reduce_op[z], "Allgather"):
        say(f"{f'ZeRO-{z}':<8}{op:<22}{nb[('dp', op)][0]:>6}{nb[('dp', op)][1]:>10,}{ring * nb[('dp', op)][1]:>22,.0f}")
say(f"padding: ZeRO-1 {(phi_pad - phi) // itemsize} elements, so that the buffer splits into {DP} chunks of "
    f"{phi_pad // itemsize // DP:,}; ZeRO-2 {(phi_pad2 - phi) // itemsize} over its {n_groups} layers")
for z, pad, calls in ((1, phi_pad, 1), (2, phi_pad2, n_groups)):
    nb = zero_runs[z][2]
    check.equal(f"ZeRO-{z}: (Reduce-Scatter, Allgather) (calls, payloads) == ({calls}, padded Phi) each",
                (nb[("dp", reduce_op[z])], nb[("dp", "Allgather")]), ((calls, pad), (calls, pad)))
check.holds("padding < dp elements (ZeRO-1), < dp per layer (ZeRO-2)",
            0 <= phi_pad - phi < DP * itemsize and 0 <= phi_pad2 - phi < n_groups * DP * itemsize)

# %% [markdown]
# What it buys, measured with `trainer.memory()` after the last step (bytes this rank keeps between steps):

# %%
mems = {z: zero_runs[z][0].memory() for z in (0, 1, 2)}
say(f"{'':<8}{'parameters':>12}{'gradients':>12}{'AdamW state':>13}")
for z, m in mems.items():
    say(f"{'plain' if z == 0 else f'ZeRO-{z}':<8}{m['params']:>12,}{m['grads']:>12,}{m['optimizer']:>13,}")
say(f"optimizer state: plain / ZeRO-1 = {mems[0]['optimizer'] / mems[1]['optimizer']:.3f} (dp = {DP}); "
    f"ZeRO-2 keeps {mems[2]['grads'] / mems[0]['grads']:.3f} of the gradient bytes between steps")
check.equal("AdamW state: (plain, ZeRO-1 x dp, ZeRO-2 x dp) == (2 Phi, 2 padded Phi, same)",
            (mems[0]["optimizer"], mems[1]["optimizer"] * DP, mems[2]["optimizer"] * DP),
            (2 * phi, 2 * phi_pad, 2 * phi_pad2))
check.equal("ZeRO-2: gradient bytes kept == one chunk", mems[2]["grads"], phi_pad2 // DP)
check.equal("ZeRO-1: gradient bytes kept == full buffer + chunk", mems[1]["grads"], phi_pad + phi_pad // DP)

# %% [markdown]
# ZeRO-1 keeps the full gradient buffer *and* its chunk: between steps it holds more gradient bytes than plain DP,
# the price of a sharded optimizer that still accumulates full gradients, and its peak holds one full gradient
# during the backward pass. ZeRO-2 keeps $1/dp$, and at its peak two layers' buckets (the one being filled and the
# one whose Reduce-Scatter is in flight). Its parameters stay whole on every rank, and the optimizer updates a
# separate copy of its chunks (its "parameters" above: the whole plus $1/dp$). Sharding the parameters as well is
# ZeRO stage 3: exercise 1 builds it by hand, and `--zero 3` and chapter 11 measure every byte of all four stages.
#
# The picture follows one step through the flat buffer of the ranks of rank 0's `dp_comm` (world ranks listed on
# the left), drawn to scale from this run's buffer: its buckets (head, blocks, embedding), its $dp$ chunks, the
# padding that makes them equal, and who holds what after each collective.

# %%
def draw_zero_chunks(tr1, dp_members):
    """Rank 0: the flat buffer of the ranks of one dp_comm through the four stages of a ZeRO step, to scale."""
    n_flat, n_used, chunk = phi_pad // itemsize, phi // itemsize, phi_pad // itemsize // DP
    buckets = {grp: tr1.pbuf.span(names) for grp, names in tr1.exchange.groups.items()}   # group -> slice
    owner_colors = [f"C{r}" for r in range(DP)]
    stages = [("after the backward pass: every dp rank holds the full gradient of its rows "
               f"({phi_pad:,} bytes)", "all", 0.35),
              (f"Reduce-Scatter over dp_comm: dp rank r keeps the sum of chunk r ({phi_pad // DP:,} bytes)",
               "own", 1.0),
              (f"AdamW on chunk r only: state {2 * phi_pad // DP:,} B per rank (plain DP {2 * phi:,}); ZeRO-1 also "
               "keeps the full gradient", "own", 1.0),
              (f"All-Gather over dp_comm: every rank gets every updated chunk ({phi_pad:,} bytes of parameters)",
               "all", 1.0)]
    fig, axes = pictures.figure(8.0, 6.2, nrows=len(stages), sharex=True)
    for ax, (title, held, alpha) in zip(axes, stages):
        for d in range(DP):
            y = DP - 1 - d
            ax.barh(y, n_flat, left=0, height=0.7, color="white", edgecolor="0.6", linewidth=0.5)
            for j in range(DP):                                  # chunk j belongs to dp rank j
                if held == "all" or j == d:
                    ax.barh(y, chunk, left=j * chunk, height=0.7, color=owner_colors[j], alpha=alpha,
                            edgecolor="black", linewidth=0.4)
            if n_flat > n_used:
                ax.barh(y, n_flat - n_used, left=n_used, height=0.7, color="white", hatch="////",
                        edgecolor="0.3", linewidth=0.4)
            if held == "own" and "AdamW" in title:
                ax.text((d + 0.5) * chunk, y, "m, v", ha="center", va="center", fontsize=6.5, color="white")
        for grp, sl in buckets.items():                          # bucket boundaries, labelled on top
            ax.axvline(sl.start, color="0.2", lw=0.6, ls=":")
            ax.text((sl.start + sl.stop) / 2, DP - 0.45, grp, ha="center", va="bottom", fontsize=6, color="0.25")
        ax.set_yticks(range(DP), [f"dp {d} (rank {dp_members[d]})" for d in reversed(range(DP))], fontsize=6.5)
        ax.set_ylim(-0.5, DP + 0.1)
        ax.set_title(title, fontsize=7.5)
        ax.tick_params(labelsize=6.5)
    axes[-1].set_xlabel(f"element of the flat buffer ({n_used:,} parameters + {n_flat - n_used} padding = {DP} "
                        f"chunks of {chunk:,}; dotted lines: bucket boundaries)", fontsize=7)
    return pictures.save(fig, "08_zero_chunks")


dp_members = grid.dp_comm.allgather_obj(rank)                    # world ranks of my dp_comm, in dp order
path = pictures.on_rank0(world, lambda: draw_zero_chunks(zero_runs[1][0], dp_members))
say(f"picture: {path}")

# %% [markdown]
# ## 3. Hierarchical all-reduce: the lecture's two-dimensional mesh
#
# On a cluster, the ranks of one node talk over fast links (NVLink, shared memory), nodes over a slower network.
# The lecture's "two-dimensional mesh All-Reduce" (section 3.4) is about this same per-shard sync: lay the dp ranks
# of one `dp_comm` out as a k x n mesh, k nodes of n ranks, and sum along one dimension of the mesh, then along the
# other, then gather back along the first (`hier.hierarchical_allreduce`; `node_split` builds the two
# communicators with `Split(color, key)`):
#
# 1. `dp-node` **Reduce-Scatter**: rank j of a node gets chunk j of its node's sum, $\Phi/n$ bytes;
# 2. `dp-cross` **All-Reduce** of that chunk over the k ranks that share the node-local rank j: the global sum of
#    chunk j. Only this step leaves the node;
# 3. `dp-node` **All-Gather**: every rank of the node gets all n chunks.
#
# Both dimensions of this mesh are data-parallel: every rank in it holds the same shard. (An All-Reduce over
# `tp_comm` followed by one over `dp_comm` would be something else: it would add up *different* shards.)
#
# There is one machine here, so `ranks_per_node` *declares* the nodes: consecutive ranks of `dp_comm`. With tp = 1
# and dp = 8, `ranks_per_node=4` makes 2 "nodes" of 4:

# %%
grid8 = ProcessGrid(world, dp=P, tp=1)
flat8, _, _, _ = run(config(tp=1, dp=P), grid8)
hier, _, hier_bytes, same_replicas = run(config(tp=1, dp=P, hierarchical=True, ranks_per_node=4), grid8)
members = {c.name: c.comm.allgather(rank) for c in (hier.exchange.node_comm, hier.exchange.cross_comm)}
say(f"rank {rank}: dp-node {members['dp-node']}, dp-cross {members['dp-cross']}")
n, k = hier.exchange.sizes.ranks_per_node, hier.exchange.sizes.n_nodes
phi8 = hier.exchange.buf.flat.nbytes
formula = hier_formula(phi8, n, k, itemsize)
ring_sent = {("dp-node", "Reduce_scatter_block"): (n - 1) / n, ("dp-cross", "Allreduce"): 2 * (k - 1) / k,
             ("dp-node", "Allgather"): (n - 1) / n}                # a ring's bytes per rank / payload
say(f"step 2 on rank 0, {k} nodes x {n} ranks, gradient buffer {phi8:,} bytes (calls, payload), and a ring's bytes:")
for key in sorted(formula):
    say(f"  {key[0]:<9} {key[1]:<22} measured {str(hier_bytes.get(key)):<14} hier_formula {str(formula[key]):<14}"
        f" ring, sent per rank {ring_sent[key] * hier_bytes[key][1]:>9,.0f}")
check.equal("hierarchical: dp-node / dp-cross bytes == hier_formula",
            {key: v for key, v in hier_bytes.items() if key[0].startswith("dp")}, formula)
check(f"hierarchical vs flat Allreduce after {STEPS} steps: parameters", max_diff(hier.params, flat8.params))
check(f"hierarchical, {STEPS} steps: every rank's parameters vs serial SGD", param_err(hier.params, ref_params, grid8),
      1e-10)
check.holds("hierarchical: DP replicas bit-identical after every step", same_replicas)


def draw_mesh(n, k, hier_bytes):
    """Rank 0: the dp ranks as k nodes x n ranks, the two communicators of the mesh and the bytes of each step."""
    from matplotlib.patches import Rectangle
    fig, ax = pictures.figure(6.4, 3.0)
    for node in range(k):                                           # nodes: grey bands
        ax.add_patch(Rectangle((-0.45, k - 1 - node - 0.4), n - 0.1, 0.8, color="0.9", zorder=0))
        ax.text(-0.6, k - 1 - node, f"node {node}", ha="right", va="center", fontsize=7)
    for node in range(k):
        ax.plot([0, n - 1], [k - 1 - node] * 2, color=pictures.COLORS["dp"], lw=5, alpha=0.35, zorder=1)
        for j in range(n):
            ax.text(j, k - 1 - node, f"rank {node * n + j}", ha="center", va="center", fontsize=7, zorder=3,
                    bbox=dict(boxstyle="round", fc="white", ec="black", lw=0.6))
    for j in range(n):
        ax.plot([j, j], [0, k - 1], color=pictures.COLORS["dp"], lw=1.2, ls="--", zorder=2)
    node_rs, cross, node_ag = (hier_bytes[("dp-node", "Reduce_scatter_block")][1],
                               hier_bytes[("dp-cross", "Allreduce")][1], hier_bytes[("dp-node", "Allgather")][1])
    ax.set_title(f"dp = {P} as {k} nodes x {n} ranks (the 2-D mesh), step 2 measured on rank 0:\n"
                 f"1. dp-node (solid, inside a node) Reduce-Scatter: payload {node_rs:,} B, ring sends "
                 f"{node_rs * (n - 1) / n:,.0f}\n"
                 f"2. dp-cross (dashed, across nodes) All-Reduce of one chunk: payload {cross:,} B, ring sends "
                 f"{cross * 2 * (k - 1) / k:,.0f}: all that leaves the node\n"
                 f"3. dp-node All-Gather: payload {node_ag:,} B, ring sends {node_ag * (n - 1) / n:,.0f}",
                 fontsize=7, loc="left")
    ax.set_xlim(-1.5, n - 0.4)
    ax.set_ylim(-0.6, k - 0.4)
    ax.axis("off")
    return pictures.save(fig, "08_hierarchical_mesh")


path = pictures.on_rank0(world, lambda: draw_mesh(n, k, hier_bytes))
say(f"picture: {path}")

# %% [markdown]
# The picture is the mesh of this run: the grey bands are the nodes, the solid lines inside them the `dp-node`
# communicators (steps 1 and 3), the dashed lines the `dp-cross` ones (step 2), with the bytes each step moved.
# The node steps move the whole buffer, as much as the flat All-Reduce, but over the fast links. What matters is
# what crosses a node boundary, and on which link. `cross_node_bytes` counts it for ring algorithms with
# consecutive placement:
#
# * **flat ring over all P = kn ranks**: every rank sends $2\frac{P-1}{P}\Phi$ to its ring neighbour; in each node
#   exactly one rank's neighbour is on the next node, so **one link carries $2\frac{P-1}{P}\Phi$**, about
#   twice the whole buffer, and the other n - 1 links of the node carry nothing;
# * **hierarchical**: only step 2 leaves the node, and every rank sends its own chunk's ring All-Reduce over the k
#   nodes, $2\frac{k-1}{k}\frac{\Phi}{n}$, on its own link: **n links in parallel, each with about $1/n$ of the
#   load**. A ring of k ranks sends $2\frac{k-1}{k}$ times its payload per rank: 1 with k = 2 (the whole chunk), 1.5
#   with k = 4, approaching 2 for many nodes.
#
# Per node, no more leaves than before ($2\frac{k-1}{k}\Phi$ against $2\frac{P-1}{P}\Phi$); the main gain is that
# it is spread over n network cards instead of one (the per-link load falls by
# $n\,\frac{(P-1)/P}{(k-1)/k} \ge n$), and that the slow network sees $2(k-1)$ ring steps instead of $2(P-1)$.
# In payloads (what `CommStats` records) the comparison is $\Phi$ for the flat All-Reduce against $\Phi/n$ (padded)
# for `dp-cross`. For this gradient buffer on P = 8 ranks, both columns:

# %%
say(f"{'nodes x ranks':>14} | {'flat: payload':>13} {'ring, one link':>15} | {'dp-cross payload':>16} "
    f"{'ring, each link':>16} | {'ratio: payload':>14} {'ring':>6}")
for n_, k_ in ((1, 8), (2, 4), (4, 2), (8, 1)):
    x = cross_node_bytes(phi8, n_, k_, itemsize)
    flat_payload = phi8 if k_ > 1 else 0                             # one node: nothing crosses
    cross_payload = hier_formula(phi8, n_, k_, itemsize)[("dp-cross", "Allreduce")][1] if k_ > 1 else 0
    ratios = (f"{flat_payload / cross_payload:.2f}", f"{x['flat_ring'] / x['hier']:.2f}") if k_ > 1 else ("-", "-")
    say(f"{f'{k_} x {n_}':>14} | {flat_payload:>13,} {x['flat_ring']:>15,.0f} | {cross_payload:>16,} "
        f"{x['hier']:>16,.0f} | {ratios[0]:>14} {ratios[1]:>6}")
x = cross_node_bytes(phi8, n, k, itemsize)
cross = 2 * (k - 1) / k * hier_bytes[("dp-cross", "Allreduce")][1]     # what a ring sends of the measured payload
check(f"{k} x {n}: hierarchical bytes leaving the node vs 2 (k-1)/k x dp-cross payload", abs(x["hier"] - cross) / cross)
check.holds(f"{k} x {n}: per-link load falls at least n-fold", x["flat_ring"] >= n * x["hier"])
hier.free()

# %% [markdown]
# (With one rank per node the hierarchy is the flat ring; with one node nothing leaves it.) Exercise 3 derives
# these columns for other layouts and checks them against `cross_node_bytes`.
#
# ## 4. Stragglers and staleness
#
# **A straggler.** Synchronous SGD waits: no rank can finish the dp exchange before the last one has joined it.
# `TrainConfig(straggler="5:100")` makes rank 5 sleep 100 ms in every step, after its backward pass. Three steps
# with and without it (timings on a shared machine are noisy: printed, not checked). The *result* cannot depend on
# when a rank arrives: the parameters must be bit for bit those of the run without a straggler.

# %%
DELAY_MS = 100
runs = {}
for name, extra in (("no straggler", {}), (f"rank 5 +{DELAY_MS} ms", dict(straggler=f"5:{DELAY_MS}"))):
    tr, infos, _, _ = run(config(steps=3, **extra))
    runs[name] = (tr, world.gather([(i.seconds, i.dp_seconds) for i in infos]))
say("mean step time (ms) of steps 2-3, ranks 0..7 (in brackets: of which waiting in the dp exchange)")
if rank == 0:
    means = {}
    for name, (_, rows) in runs.items():
        means[name] = np.mean([t for r in rows for t, _ in r[1:]])
        say(f"  {name:<16}" + " ".join(f"{1e3 * np.mean([t for t, _ in r[1:]]):4.0f} "
                                       f"({1e3 * np.mean([d for _, d in r[1:]]):3.0f})" for r in rows))
    slow, fast = means[f"rank 5 +{DELAY_MS} ms"], means["no straggler"]
    say(f"  mean over the ranks: {1e3 * fast:.0f} ms -> {1e3 * slow:.0f} ms, {1e3 * (slow - fast):+.0f} ms for "
        f"one rank's {DELAY_MS} ms")
a, b_ = (tr.params for tr, _ in runs.values())
check.holds("straggler: every array bit-identical to the run without one", all(np.array_equal(a[n], b_[n]) for n in a))

# %% [markdown]
# Every rank's step grows, not only rank 5's. Rank 5's `dp_comm` partners (ranks 1, 3, 7) wait for it in the dp
# exchange, the bracketed numbers; the other ranks wait in the next collective that depends on it, directly or
# through its tensor-parallel partner, rank 4 (the gradient norm's reduction over `tp_comm`, the loss average): not
# counted as dp time, but the same wait. One slow worker sets the pace of all P. (On hardware where every rank has
# its own core the step grows by the whole delay. Here eight ranks share two cores, and while rank 5 sleeps the
# others get its share of them, so the growth measured above can be smaller.)
#
# **Staleness.** The asynchronous answer is not to wait. With `dp_staleness=1` step s starts the All-Reduce of its
# gradient (an `Iallreduce`) and, instead of waiting for it, applies the average that step s-1 started, which has
# had a whole step to arrive. Nothing is applied at step 1. With plain SGD ($\mu$ = 0) that is delayed SGD:
#
# $$w_s = w_{s-1} - \eta_s\, \bar g_{s-1}(w_{s-2}) \quad (s \ge 2), \qquad w_1 = w_0,$$
#
# where $\bar g_{s}(w)$ is the gradient of step s's global batch at $w$. It is still exact, deterministic
# arithmetic: a serial program that keeps one pending gradient (`serial.sgd(cfg, tc, batch, delayed=True)`, through
# `serial_sgd(tc, delayed=True)` above) computes the same parameters.

# %%
stale_tc = config(dp_staleness=1, momentum=0.0, steps=5)
stale, stale_infos, stale_bytes, same_replicas = run(stale_tc)
stale.finish()                                                  # the last exchange completes, is not applied
delayed_ref, _ = serial_sgd(stale_tc, delayed=True)
sync_ref, _ = serial_sgd(config(momentum=0.0, steps=5))
say(f"staleness 1, step 2's dp exchange: {stale_bytes[('dp', 'Iallreduce')]} (calls, payload) Iallreduce; "
    f"gradient norm applied at step 1: {stale_infos[0].grad_norm}")
check("staleness 1, 5 steps: every rank's shards vs delayed serial SGD", param_err(stale.params, delayed_ref), 1e-10)
check.equal("staleness 1: bytes of step 2 == tp comm_formula + the exchange's formula",
            stale_bytes, {**tp_model.comm_formula(cfg, B // DP, itemsize), **stale.exchange.sizes.formula()})
check.holds("staleness 1: nothing applied at step 1 (its norm is nan)", math.isnan(stale_infos[0].grad_norm))
check.holds("staleness 1: DP replicas bit-identical after every step", same_replicas)
say(f"  (the same shards against synchronous serial SGD: {param_err(stale.params, sync_ref):.1e}: a different "
    "algorithm)")

# %% [markdown]
# Exact, but not the same algorithm: each update uses a gradient computed at parameters one step old. With a
# small learning rate that hardly matters; the larger the steps (and with momentum, which already carries old
# gradients), the more the stale direction disagrees with the current one: the noise the lecture's section 4.4
# attributes to asynchronous updates. Short float32 trainings with `hsgd.train.train`, synchronous and stale, the
# same data and schedule, SGD with momentum 0.9 at two learning rates. The four runs are independent, so they run
# side by side, each on two of the eight ranks (`world.Split`: dp = 2, tp = 1; the layout changes how the gradient
# is computed, not its value); their printed output is discarded, only the losses are kept, and `np.errstate`
# silences NumPy's overflow warnings, should a run blow up. The picture draws the four loss curves, step by step
# (log scale; the stale runs dashed, one colour per learning rate):

# %%
CURVE_STEPS = 40
curve_runs = [(lr, name, extra) for lr in (0.05, 0.1)
              for name, extra in (("synchronous", {}), ("staleness 1", dict(dp_staleness=1)))]
pair = world.Split(color=rank // 2, key=rank)                     # ranks 2i, 2i+1 train run i
lr, name, extra = curve_runs[rank // 2]
tc = train_config(tp=1, dp=2, steps=CURVE_STEPS, batch_size=B, lr=lr, warmup=5, dtype="float32", seed=SEED,
                  eval_batches=2, log_interval=CURVE_STEPS, threads=1, **extra)
with np.errstate(all="ignore"):
    losses = train(cfg, tc, pair, out=io.StringIO())["losses"]
pair.Free()
curves = {f"lr {lr}, {name}": c for lr, name, c in world.allgather((lr, name, losses))[::2]}   # one per pair
say("mean training loss over 10 steps")
say(f"{'steps':<26}" + "".join(f"{f'{s}-{s + 9}':>10}" for s in range(1, CURVE_STEPS + 1, 10)))
for name, losses in curves.items():
    say(f"{name:<26}" + "".join(f"{np.mean(losses[s:s + 10]):>10.3f}" for s in range(0, CURVE_STEPS, 10)))


def draw_curves(curves):
    """Rank 0: the training loss of every run, synchronous solid, stale dashed, one colour per learning rate."""
    fig, ax = pictures.figure(6.4, 3.4)
    for i, (name, losses) in enumerate(curves.items()):
        ax.plot(range(1, len(losses) + 1), losses, lw=1.0, color=f"C{i // 2}", ls="--" if "stale" in name else "-",
                label=name)
    ax.set(xlabel="step", ylabel="training loss (global batch)", yscale="log")
    ax.set_title(f"synchronous vs staleness 1, SGD with momentum 0.9, float32, {CURVE_STEPS} steps", fontsize=8)
    ax.legend(fontsize=7, frameon=False)
    ax.grid(alpha=0.3)
    return pictures.save(fig, "08_losses_sync_vs_stale")


path = pictures.on_rank0(world, lambda: draw_curves(curves))
say(f"picture: {path}")
check.holds("the synchronous runs' losses are finite",
            all(np.all(np.isfinite(c)) for n, c in curves.items() if "sync" in n))

# %% [markdown]
# Read the rows and the curves as one run of each, on one seed (float32 on this machine; other hardware may round
# differently). The stale runs start a step behind, since nothing is applied at step 1, and then follow a
# direction one step out of date; with momentum the delay feeds back into itself, and the learning rate that
# synchronous SGD takes in its stride can make the stale run climb instead of descend. Staleness buys a step whose
# exchange never blocks (on hardware that progresses it in the background, section 1) and pays in convergence,
# more the larger the steps. The lecture's answer is the synchronous algorithm of the rest of this tutorial, which
# keeps serial SGD's guarantees. Exercise 4 writes the stale exchange by hand.
#
# ## Check against serial
#
# On 8 ranks, every verdict reached collectively: overlapped buckets, ZeRO 1 and 2 (with AdamW, weight decay and
# clipping) and the hierarchical all-reduce end a few steps with the parameters of the plain path and of serial SGD,
# the DP replicas bit-identical, and a straggler changes no bit; the overlapped requests are in flight while the
# backward pass computes, on every rank; every mode's bytes are exactly its formula, ZeRO's Reduce-Scatter and
# All-Gather being the two halves of the All-Reduce they replace, with 1/dp of the optimizer state; and
# staleness 1 is exactly delayed serial SGD.

# %%
grid8.free()
worst, err = check.worst()
say(f"\nchapter 8: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error {err:.1e} "
    f"({worst})")
grid.free()

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `dp_overlap=True`: `OverlappedExchange` (hsgd/dp/exchange.py), one `Iallreduce` per layer's bucket, started by `on_ready(group)` from `tp_model.stage_backward` | `DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=...)` (megatron/core/distributed/distributed_data_parallel_config.py; `bucket_size` counts parameters, default max(40M, 1M x dp)); a backward hook per parameter calls its bucket group's `register_grad_ready` (distributed_data_parallel.py); `no_sync()` holds the exchange back until the last micro-batch | without ZeRO, `allreduce_gradients` runs after the backward pass in buffers of `MEMORY_OPT_ALLREDUCE_SIZE` elements (deepspeed/runtime/engine.py), not overlapped; with ZeRO 1 or 2, `"overlap_comm"` and `"reduce_bucket_size"` under `"zero_optimization"` (deepspeed/runtime/zero/config.py) | `torch.nn.parallel.DistributedDataParallel(..., bucket_cap_mb=25)` (torch/nn/parallel/distributed.py): buckets in reverse parameter order, each all-reduced when its last gradient arrives; `no_sync()` | a bucket is a layer (`tp_model.backward_order`), not a size cap, so the buckets can be read off the model; MPICH has no progress thread, so the overlap is a schedule here, not a speed-up (section 1) |
# | `zero=1`: `Zero1Exchange` (hsgd/dp/zero1.py): Reduce-Scatter of the padded flat buffer over `dp_comm`, AdamW on the owned chunk, All-Gather of the updated chunks; `zero=2`: `Zero2Exchange` (hsgd/dp/zero2.py, hsgd/dp/sharded.py), the same layer by layer | `use_distributed_optimizer=True` (`DistributedDataParallelConfig`) with `DistributedOptimizer` (megatron/core/optimizer/distrib_optimizer.py): reduce-scatter of the gradient buffer, the optimizer on the shard, all-gather of the parameters (`start_param_sync` in param_and_grad_buffer.py, overlapped with the next forward by `overlap_param_gather`): stage 1 with a Reduce-Scatter, like hsgd's ZeRO-1; parameters sharded too with Megatron-FSDP, `data_parallel_sharding_strategy="optim_grads_params"` | `"zero_optimization": {"stage": 1}` or `2` (`DeepSpeedZeroOptimizer`, deepspeed/runtime/zero/stage_1_and_2.py), `3` (`DeepSpeedZeroOptimizer_Stage3`, stage3.py) | `ZeroRedundancyOptimizer` (torch/distributed/optim/zero_redundancy_optimizer.py): the optimizer state sharded by whole parameters, the gradients still all-reduced by DDP, the updated parameters broadcast by their owner; FSDP's `ShardingStrategy.SHARD_GRAD_OP` (gradients and optimizer state sharded, like stage 2) and `FULL_SHARD` (parameters too, stage 3) in torch/distributed/fsdp/api.py; FSDP2's `fully_shard(..., reshard_after_forward=...)` | ZeRO-1: one flat buffer cut into dp equal chunks (padding included, chunk boundaries cut through parameters), exchanged after the whole backward pass; ZeRO-2 and 3 (hsgd/dp/zero2.py, zero3.py): each layer's bucket cut into dp chunks, reduce-scattered during the backward pass; stage 3 by hand is exercise 1, `--zero 3` is chapter 11 |
# | `hierarchical=True`, `ranks_per_node`: `HierarchicalExchange`, `hierarchical_allreduce` (hsgd/dp/hierarchical.py): node Reduce-Scatter, cross-node All-Reduce of one chunk, node All-Gather | with the distributed optimizer, `num_distributed_optimizer_instances` > 1: reduce-scatter inside an instance (`intra_distributed_optimizer_instance_group`), all-reduce of the shard across instances (`inter_distributed_optimizer_instance_group`), in param_and_grad_buffer.py | no hierarchical all-reduce setting; ZeRO++'s `"zero_quantized_gradients"` reduces gradients in two hops, inside the node then across nodes (`all_to_all_quant_reduce`, deepspeed/runtime/comm/coalesced_collectives.py), and `"zero_hpz_partition_size"` keeps a second copy of the parameter shards inside each node | FSDP's `ShardingStrategy.HYBRID_SHARD`: FULL_SHARD inside a node, replicas across nodes (a reduce-scatter in the node, an all-reduce across); under all three, NCCL chooses ring or tree per call (`NCCL_ALGO`), and its tree is itself two-level, chains inside the nodes and trees across them | a plain all-reduce (every rank ends with the whole sum), so it combines with any optimizer; the nodes are declared with `ranks_per_node` on one machine, so the mesh can be shown and measured |
# | `dp_staleness=1`: `StaleExchange` (hsgd/dp/exchange.py), the `Iallreduce` started at step s applied at step s+1 | none | none | none for one-step-late gradients; the nearest relaxation is local SGD: `PostLocalSGDOptimizer` (torch/distributed/optim/post_localSGD_optimizer.py) with `PostLocalSGDState` / `post_localSGD_hook` (torch/distributed/algorithms/ddp_comm_hooks/post_localSGD_hook.py), which averages the parameters every few steps instead of the gradients every step | kept as an experiment: exact delayed SGD, checked against `serial.sgd(..., delayed=True)`, to put a number on what not waiting costs |
# | `straggler="5:100"`: one rank sleeps before every exchange | none | none | none | an experiment on purpose: the result must not change by a bit |
#
# ## Exercises
#
# ### Exercise 1: ZeRO-3 by hand
# Shard the parameters over `dp_comm` too (tp = 1, dp = 4): flatten each group of parameters (embedding, each
# block, the head), pad it to a multiple of dp and keep only your chunk. For the forward pass, All-Gather a
# group's parameters just before its layer runs and drop them after; keep only the activations between groups. In
# the backward pass, All-Gather each group again, recompute its forward from the saved input, run its backward,
# Reduce-Scatter its gradient and update your chunk with SGD (the embedding's backward needs only the token ids:
# no second gather). Check two steps against serial SGD, and the bytes of a step against `CommStats`: All-Gather
# payload $2\Phi - \Phi_{emb}$, Reduce-Scatter $\Phi$ ($\Phi$ the padded parameter bytes), so a ring sends
# $\frac{dp-1}{dp}(3\Phi - \Phi_{emb})$ per rank, up to 1.5 times an All-Reduce's $2\frac{dp-1}{dp}\Phi$: the
# price of holding $1/dp$ of the parameters.
# (solution: `tutorials/solutions/08_communication_optimizations.py`, `exercise_1`)
#
# ### Exercise 2: the bucket size that lets overlap hide the exchange
# Model one rank's step: the backward pass produces $\Phi$ bytes of gradient at a steady rate over $T_b$ seconds,
# in n equal buckets, and one bucket's ring All-Reduce over p ranks takes $t(S) = 2(p-1)\alpha +
# 2\frac{p-1}{p}\frac{S}{\beta}$ (latency $\alpha$, bandwidth $\beta$); buckets go out one at a time, in order. The
# exchange keeps up when each bucket is done before the next is ready, $t(S) \le S\,T_b/\Phi$. Solve for the
# smallest bucket $S^*$, and predict the exposed time (from the end of the backward pass to the end of the last
# All-Reduce) as a function of n. Check with a small event simulation that the best n is where your formula says,
# for p = 8, $\alpha$ = 5 us, $\beta$ = 25 GB/s, $\Phi$ = 500 MB, $T_b$ = 100 ms.
# (solution: `tutorials/solutions/08_communication_optimizations.py`, `exercise_2`)
#
# ### Exercise 3: the bytes that leave a node
# For dp = n x k (n ranks per node, k nodes), write the bytes that cross node boundaries per step: the flat ring's
# busiest link and a hierarchical rank's link, in payload and in ring bytes. Check them against
# `hsgd.dp.hierarchical.cross_node_bytes` for every layout of 4, 8, 16 and 64 ranks, and against a measured
# `hierarchical_allreduce` on 4 ranks as 2 nodes x 2.
# (solution: `tutorials/solutions/08_communication_optimizations.py`, `exercise_3`)
#
# ### Exercise 4: staleness 1 by hand
# Write the stale exchange yourself on 4 ranks (tp = 1, dp = 4): at step s start an `Iallreduce` of your slice's
# gradient, then wait for the one started at step s-1 and apply it (nothing at step 1). Check five steps against
# delayed SGD written in a few lines of serial code (one pending gradient), and against `HybridTrainer` with
# `dp_staleness=1`.
# (solution: `tutorials/solutions/08_communication_optimizations.py`, `exercise_4`)
