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
# Chapter 4's data parallelism ends the step with one All-Reduce of every gradient shard over `dp_comm` (chapter 10
# combines it with tp and pp). The lecture lists what makes that exchange cheaper or hides it. Section 3.4 (in
# translation):
#
# > this communication pattern can be optimized as: a Reduce-Scatter over the data-parallel dimension (summing and
# > scattering the gradient), then an All-Gather over the model-parallel dimension (synchronizing the parameters),
# > or a more efficient two-dimensional mesh All-Reduce algorithm.
#
# Section 4.1 adds hierarchical communication and overlap; sections 1 and 4.4, stragglers and asynchrony.
#
# hsgd departs from section 3.4 on one point, on purpose: after the Reduce-Scatter over `dp_comm`, each dp rank
# updates 1/dp of *its own* shard, and those parts must reach the other dp ranks of the same shard, so the
# All-Gather runs over `dp_comm` too. One over `tp_comm` would bring a rank the other tp ranks' shards, which it
# never computes with.
#
# Each optimization is a `TrainConfig` option of `HybridTrainer`, measured and checked against the plain path and
# serial SGD. All but staleness change *how* the gradients travel, never the update.
#
# Run it with eight ranks (about 10 s on a 2-core machine; on failure every rank raises, so it exits non-zero
# without hanging). Rank 0 draws four pictures into `$HSGD_FIGURES` (default `tutorials/figures/`) and alone prints:
#
# mpirun -n 8 python tutorials/08_communication_optimizations.py
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
# Shared helpers: `config` (the float64 run every comparison uses: SGD with momentum, warm-up, cosine), `run` (a
# few steps on a grid, with the bytes of step 2), `serial_sgd` (the reference, optionally with the gradient applied
# one step late, section 4), and `param_err` (a rank's shards against serial, relative to each parameter's largest
# entry but at least 0.02: the attention k-biases only ever receive rounding noise, chapter 4).

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
# The backward pass finishes the gradients from the top down: LM head and final LayerNorm, block L-1, ..., block 0,
# embeddings (`tp_model.backward_order`). Once a block is done its gradients are final, so their All-Reduce can
# start while the layers below still compute. The exchange lays the flat buffer out in that order, so that each
# layer is a contiguous slice, a **bucket** (`trainer.exchange.buckets`). With `dp_overlap=True`,
# `tp_model.stage_backward` calls `OverlappedExchange.on_ready(group)` when a group is final, which starts a
# non-blocking `Iallreduce` of its bucket; `finish()` waits for all and divides by dp. Same sum, same bytes in both
# columns, one call per bucket instead of one in all.

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
# **Seeing it.** `hsgd.grid.trace.Tracer` records every rank's compute phases and collectives; a non-blocking call
# is one span from its start to the end of its `Wait`. `overlap_seconds` adds up the time an `Iallreduce` was in
# flight during compute spans; we drop the "dp sync" phase (the rank *waiting* for those requests), so what remains
# is time in flight while the rank ran forward, backward or optimizer code: positive on every rank when
# overlapped, 0 when blocking. `StepInfo.dp_seconds` is the exposed wait. The picture: one traced step of each
# trainer, per rank compute phases, blocking collectives (tp blue, dp red), non-blocking ones (start to `Wait`).

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
# "In flight" means started and not completed, not that bytes moved in the background: MPICH has no progress
# thread by default (a request advances only inside other MPI calls), and 8 ranks on 2 cores have no idle core, so
# the overlapped exchange is not faster here. On a GPU cluster NCCL runs on its own stream and the network card moves
# the data, so the same schedule hides the exchange, except the last bucket, the embeddings, ready only when the
# backward ends (and with `micro_batches > 1` only the last micro-batch overlaps: earlier gradients are not final).
# Exercise 2 sizes the buckets with a latency-bandwidth model.
#
# ## 2. Reduce-Scatter, a sharded optimizer, All-Gather (ZeRO stages 1 and 2)
#
# A bandwidth-optimal All-Reduce of $\Phi$ bytes over dp ranks (a ring, or recursive halving then doubling: Thakur,
# Rabenseifner and Gropp 2005, "Optimization of Collective Communication Operations in MPICH") is a
# **Reduce-Scatter** (each rank ends with the sum of one $1/dp$ chunk, sending $\frac{dp-1}{dp}\Phi$) followed by
# an **All-Gather** (another $\frac{dp-1}{dp}\Phi$). Plain DP then runs the same update on every replica, with the
# whole optimizer state (AdamW: twice the parameters' memory). Section 3.4 splits the halves, both over `dp_comm`:
#
# $$g_r = \tfrac{1}{dp}\,\text{Reduce-Scatter}(g)_r, \qquad w_r \leftarrow \text{AdamW}(w_r, g_r), \qquad
# w = \text{All-Gather}(w_0, \dots, w_{dp-1}):$$
#
# rank r updates and keeps optimizer state only for its chunk, and the updated *parameters* travel. The same bytes,
# $1/dp$ of the optimizer's memory and work: ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
# Toward Training Trillion Parameter Models"; hsgd/dp/zero1.py, one flat buffer padded to a multiple of dp).
# Stage 2 also drops the full gradient (hsgd/dp/zero2.py): each layer's gradient is a bucket of its own, padded to
# dp chunks, reduce-scattered (`Ireduce_scatter_block`) as soon as the layer is done and freed during the next
# layer's backward. Clipping adds the chunks' squares over dp in `health.global_norm`. The check: four steps of
# AdamW with weight decay and clipping active, plain vs ZeRO-1 vs ZeRO-2.

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
# The bytes of step 2 on `dp_comm`, rank 0 (payload: a Reduce-Scatter's full input, an All-Gather's full output),
# and what a ring sends per rank:

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
# What it buys, from `trainer.memory()` (bytes kept between steps):

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
# ZeRO-1 keeps the full gradient buffer *and* its chunk, more gradient bytes than plain DP between steps, and one
# full gradient at its peak. ZeRO-2 keeps $1/dp$, and at its peak two layers' buckets (one filling, one in flight).
# Its parameters stay whole on every rank, and the optimizer updates a separate copy of its chunks (the whole plus
# $1/dp$ above). Sharding the parameters as well is ZeRO stage 3: exercise 1 builds it by hand; `--zero 3` and
# chapter 11 measure every byte of all four stages.
#
# **The same ideas as a PyTorch API: FSDP2.** `torch.distributed.fsdp.fully_shard(module, mesh=...,
# reshard_after_forward=..., mp_policy=MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...))`, applied layer by
# layer and then to the root, turns each layer's parameters into dim-0 shards that are All-Gathered before its
# forward and backward, with its gradients reduce-scattered after the backward:
#
# * `reshard_after_forward=True` frees the gathered parameters after the forward and gathers them again for the
#   backward: ZeRO-3, hsgd's `--zero 3`;
# * `False` keeps them until the end of the backward, no re-gather: ZeRO-2's traffic, like `--zero 2` (which
#   keeps them whole between steps as well, where FSDP2 reshards after the backward);
# * an int r (a divisor of the shard group, say the node size) reshards to groups of r ranks after the forward,
#   so the backward's All-Gather stays inside them; hsgd has no such mode;
# * a 1-D `mesh` shards over all its ranks; a 2-D `DeviceMesh` (`init_device_mesh`) is HSDP, placement
#   (Replicate(), Shard(0)): shard along dim 1, inside a node, replicate along dim 0, hsgd's
#   `--zero 2 --hierarchical` or `--zero 3 --hierarchical` (hybrid sharding, section 3);
# * `param_dtype` is the dtype of the gathered parameters and the compute, `reduce_dtype` that of the gradient
#   reduction; it defaults to None, and then, if `param_dtype` is set, the reduction runs in `param_dtype` (the
#   docstring of `MixedPrecisionPolicy`). hsgd's `--reduce-dtype` defaults to float32.
#
# The picture follows one step through the flat buffer of rank 0's `dp_comm` (world ranks on the left), to scale:
# its buckets (head, blocks, embedding), its $dp$ chunks, the padding that makes them equal, and who holds what
# after each collective.

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
# Ranks of one node talk over fast links (NVLink, shared memory), nodes over a slower network. The lecture's
# "two-dimensional mesh All-Reduce" lays the ranks of one `dp_comm` out as k nodes x n ranks and sums along one
# dimension, then the other, then gathers back (`hier.hierarchical_allreduce`; `node_split` builds the two
# communicators with `Split(color, key)`):
#
# 1. `dp-node` **Reduce-Scatter**: rank j of a node gets chunk j of its node's sum, $\Phi/n$ bytes;
# 2. `dp-cross` **All-Reduce** of that chunk over the k ranks with node-local rank j; only this leaves the node;
# 3. `dp-node` **All-Gather**: every rank of the node gets all n chunks.
#
# Both dimensions are data-parallel: every rank of the mesh holds the same shard. One machine here, so
# `ranks_per_node` *declares* the nodes; with tp = 1, dp = 8 and `ranks_per_node=4`, 2 "nodes" of 4:

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
# The picture is this run's mesh: nodes grey, `dp-node` communicators solid (steps 1 and 3), `dp-cross` dashed
# (step 2), with each step's bytes. What matters is what crosses a node boundary; `cross_node_bytes` counts it
# for rings with consecutive placement:
#
# * **flat ring over P = kn ranks**: in each node exactly one rank's neighbour is on the next node, so **one link
#   carries $2\frac{P-1}{P}\Phi$** and the node's other n - 1 links carry nothing;
# * **hierarchical**: every rank sends its chunk's ring All-Reduce over the k nodes, $2\frac{k-1}{k}\frac{\Phi}{n}$,
#   on its own link: **n links in parallel, each with about $1/n$ of the load**.
#
# Per node no more leaves ($2\frac{k-1}{k}\Phi$ against $2\frac{P-1}{P}\Phi$), but over n network cards instead of
# one (the per-link load falls by $n\,\frac{(P-1)/P}{(k-1)/k} \ge n$), in $2(k-1)$ ring steps instead of $2(P-1)$.
#
# This is the picture of one ring per node, not of what NCCL does. NCCL splits a collective over several channels
# at once, each a ring over its own share of the NVLinks and network cards (`NCCL_MIN_NCHANNELS`,
# `NCCL_MAX_NCHANNELS`), so even its flat All-Reduce uses all of a node's NICs, and it picks tree or NVLink SHARP
# (NVLS) algorithms where they are faster (`NCCL_ALGO`). The flat ring's busiest link bounds a single ring's time,
# not NCCL's; chapter 2 explains NCCL's algorithms. For this gradient buffer on P = 8, payload ($\Phi$ flat against
# $\Phi/n$, padded, for `dp-cross`) and ring bytes:

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
# Exercise 3 derives these columns for other layouts.
#
# ## 4. Stragglers and staleness
#
# **A straggler.** No rank can finish the dp exchange before the last has joined it. `straggler="5:100"` makes
# rank 5 sleep 100 ms after every backward pass; three steps with and without it (timings printed, not checked).
# The *result* must be bit for bit that of the run without a straggler.

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
# Every rank's step grows. Rank 5's `dp_comm` partners (ranks 1, 3, 7) wait in the dp exchange (the bracketed
# numbers); the others in the next collective that depends on it, directly or through its tp partner, rank 4. One
# slow worker sets the pace of all P. (With a core per rank the step grows by the whole delay; here the others get
# rank 5's share of the two cores while it sleeps.)
#
# **Staleness.** The asynchronous answer is not to wait. With `dp_staleness=1` step s starts the `Iallreduce` of
# its gradient and applies the average that step s-1 started; nothing is applied at step 1. With plain SGD
# ($\mu$ = 0) that is delayed SGD,
#
# $$w_s = w_{s-1} - \eta_s\, \bar g_{s-1}(w_{s-2}) \quad (s \ge 2), \qquad w_1 = w_0,$$
#
# $\bar g_{s}(w)$ the gradient of step s's global batch at $w$: exact arithmetic, which a serial program with one
# pending gradient (`serial_sgd(tc, delayed=True)`) reproduces.

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
# Exact, but a different algorithm: each update uses a gradient one step old, which matters more the larger the
# steps (and with momentum, which already carries old gradients): the noise of the lecture's section 4.4. Four
# short float32 trainings, synchronous and stale at two learning rates with momentum 0.9, run side by side on two
# ranks each (`world.Split`: dp = 2, tp = 1), only their losses kept. The picture draws the four loss curves (log
# scale; stale dashed, one colour per learning rate):

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
# One run of each, on one seed. The stale runs start a step behind and then follow a direction one step out of
# date; with momentum the delay feeds back into itself, and a learning rate that synchronous SGD takes in its
# stride can make the stale run climb: an exchange that never blocks, paid in convergence. Exercise 4 writes the
# stale exchange by hand.
#
# ## Check against serial
#
# On 8 ranks, collectively: overlap, ZeRO 1 and 2 and the hierarchical all-reduce end with the plain path's and
# serial SGD's parameters, replicas bit-identical, and a straggler changes no bit; overlapped requests are in flight
# during the backward on every rank; every mode's bytes are its formula, with 1/dp of the optimizer state for
# ZeRO; staleness 1 is exactly delayed serial SGD.

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
# | `dp_overlap=True`: `OverlappedExchange` (hsgd/dp/exchange.py), one `Iallreduce` per layer's bucket, started by `on_ready(group)` from `tp_model.stage_backward` | `DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=...)` (megatron/core/distributed/distributed_data_parallel_config.py); a backward hook per parameter calls its bucket group's `register_grad_ready`; `no_sync()` until the last micro-batch | without ZeRO, `allreduce_gradients` after the backward in buffers of `MEMORY_OPT_ALLREDUCE_SIZE` elements (deepspeed/runtime/engine.py); with ZeRO 1 or 2, `"overlap_comm"` and `"reduce_bucket_size"` (deepspeed/runtime/zero/config.py) | `DistributedDataParallel(..., bucket_cap_mb=25)` (torch/nn/parallel/distributed.py): buckets in reverse parameter order; `no_sync()` | a bucket is a layer (`tp_model.backward_order`), not a size cap; without a progress thread the overlap is a schedule here, not a speed-up |
# | `zero=1`: `Zero1Exchange` (hsgd/dp/zero1.py), Reduce-Scatter of the padded flat buffer, AdamW on the owned chunk, All-Gather; `zero=2`: `Zero2Exchange` (hsgd/dp/zero2.py), the same layer by layer | `use_distributed_optimizer=True` with `DistributedOptimizer` (megatron/core/optimizer/distrib_optimizer.py): reduce-scatter, the optimizer on the shard, parameter all-gather (`overlap_param_gather`); Megatron-FSDP's `data_parallel_sharding_strategy="optim_grads_params"` shards the parameters too | `"zero_optimization": {"stage": 1}`, `2` (deepspeed/runtime/zero/stage_1_and_2.py) or `3` (stage3.py) | `ZeroRedundancyOptimizer` (torch/distributed/optim/zero_redundancy_optimizer.py): optimizer state sharded by whole parameters; FSDP1's `ShardingStrategy.SHARD_GRAD_OP` and `FULL_SHARD` | ZeRO-1 cuts one flat buffer into dp equal chunks through parameters, after the whole backward; ZeRO-2 and 3 cut each layer's bucket, during the backward; stage 3 by hand is exercise 1 |
# | `--zero 3`; `--zero 2`; `--zero 3 --hierarchical --ranks-per-node n`; `--dtype bfloat16 --reduce-dtype float32` | `TorchFullyShardedDataParallelConfig(reshard_after_forward=...)` passes FSDP2's setting through | none | FSDP2: `fully_shard(module, mesh=..., reshard_after_forward=..., mp_policy=MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...))` (torch/distributed/fsdp/_fully_shard), True, False or an int; a 2-D mesh from `init_device_mesh` is HSDP, (Replicate(), Shard(0)) | `reshard_after_forward=False` is ZeRO-2's traffic but reshards after the backward, where hsgd's `--zero 2` keeps the parameters whole; no int mode; `reduce_dtype=None` reduces in `param_dtype`, hsgd's default is float32 |
# | `hierarchical=True`, `ranks_per_node`: `HierarchicalExchange`, `hierarchical_allreduce` (hsgd/dp/hierarchical.py): node Reduce-Scatter, cross-node All-Reduce of one chunk, node All-Gather | `num_distributed_optimizer_instances` > 1: reduce-scatter inside an instance, all-reduce of the shard across instances (param_and_grad_buffer.py) | ZeRO++'s `"zero_quantized_gradients"` (two hops, `all_to_all_quant_reduce` in deepspeed/runtime/comm/coalesced_collectives.py), `"zero_hpz_partition_size"` | FSDP1's `ShardingStrategy.HYBRID_SHARD`, FSDP2's 2-D mesh | a plain all-reduce, so it combines with any optimizer; nodes declared with `ranks_per_node` on one machine |
# | `cross_node_bytes` (hsgd/dp/hierarchical.py): one ring per node, the flat ring's busiest link | NCCL underneath | NCCL underneath | NCCL: several channels at once (`NCCL_MIN_NCHANNELS`, `NCCL_MAX_NCHANNELS`), ring, tree or NVLS (`NCCL_ALGO`) chosen per call | a single ring, so the count is exact and checkable; NCCL's channels and algorithms are chapter 2's |
# | `dp_staleness=1`: `StaleExchange` (hsgd/dp/exchange.py), the `Iallreduce` of step s applied at step s+1 | none | none | none; the nearest is local SGD, `PostLocalSGDOptimizer` (torch/distributed/optim/post_localSGD_optimizer.py), averaging parameters every few steps | exact delayed SGD, checked against `serial.sgd(..., delayed=True)`, to put a number on what not waiting costs |
# | `straggler="5:100"`: one rank sleeps before every exchange | none | none | none | the result must not change by a bit |
#
# ## Exercises
#
# ### Exercise 1: ZeRO-3 by hand
# Shard the parameters over `dp_comm` too (tp = 1, dp = 4): flatten each group (embedding, each block, the head),
# pad it to a multiple of dp and keep your chunk. In the forward, All-Gather a group just before its layer and drop
# it after, keeping only the activations between groups; in the backward, All-Gather it again, recompute its
# forward, run its backward, Reduce-Scatter its gradient and update your chunk with SGD (the embedding needs no
# second gather). Check two steps against serial SGD, and a step's bytes against `CommStats`: All-Gather payload
# $2\Phi - \Phi_{emb}$, Reduce-Scatter $\Phi$ (padded), so a ring sends $\frac{dp-1}{dp}(3\Phi - \Phi_{emb})$ per
# rank, up to 1.5 times an All-Reduce's.
# (solution: `tutorials/solutions/08_communication_optimizations.py`, `exercise_1`)
#
# ### Exercise 2: the bucket size that lets overlap hide the exchange
# The backward produces $\Phi$ bytes of gradient steadily over $T_b$ seconds, in n equal buckets; one bucket's ring
# All-Reduce over p ranks takes $t(S) = 2(p-1)\alpha + 2\frac{p-1}{p}\frac{S}{\beta}$, one bucket at a time. The
# exchange keeps up when $t(S) \le S\,T_b/\Phi$. Solve for the smallest bucket $S^*$, predict the exposed time (end
# of backward to end of the last All-Reduce) as a function of n, and check with a small event simulation that the
# best n is where your formula says, for p = 8, $\alpha$ = 5 us, $\beta$ = 25 GB/s, $\Phi$ = 500 MB,
# $T_b$ = 100 ms.
# (solution: `tutorials/solutions/08_communication_optimizations.py`, `exercise_2`)
#
# ### Exercise 3: the bytes that leave a node
# For dp = n x k, write the bytes that cross node boundaries per step, the flat ring's busiest link and a
# hierarchical rank's link, in payload and ring bytes. Check them against `cross_node_bytes` for every layout of 4,
# 8, 16 and 64 ranks, and against a measured `hierarchical_allreduce` on 4 ranks as 2 nodes x 2.
# (solution: `tutorials/solutions/08_communication_optimizations.py`, `exercise_3`)
#
# ### Exercise 4: staleness 1 by hand
# On 4 ranks (tp = 1, dp = 4), at step s start an `Iallreduce` of your slice's gradient, then wait for the one
# started at step s-1 and apply it (nothing at step 1). Check five steps against delayed SGD in a few lines of
# serial code, and against `HybridTrainer` with `dp_staleness=1`.
# (solution: `tutorials/solutions/08_communication_optimizations.py`, `exercise_4`)
