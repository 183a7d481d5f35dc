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
# # Chapter 10: 3-D parallelism, dp x pp x tp
#
# The lecture ends with what an implementation has to get right. Its summary (in translation):
#
# > the keys to implementing the algorithm are: define clearly how the nodes are grouped along the two parallel
# > dimensions; design efficient forward and backward computation and communication inside a group (model
# > parallelism); design an efficient gradient synchronization across groups (data parallelism), usually an
# > All-Reduce per parameter shard; and use hierarchical communication, overlap of computation and communication,
# > and pipelining to raise the throughput.
#
# Its "model-parallel group" may itself be split two ways (section 3.1): tensor parallelism inside each layer
# (chapters 5 and 6) and pipeline parallelism across layers (chapter 9). With both, and the data parallelism of
# chapters 4 and 10 on top, a rank has three coordinates, and hsgd's grid is the product of all three dimensions.
# This chapter puts the pieces together on 8 ranks as dp = 2 replicas x pp = 2 stages x tp = 2 tensor-parallel
# ranks:
#
# 1. the 3-D grid: where each rank sits, what it holds, and which ranks talk to which, drawn from `grid.groups()`;
#    the order in which hsgd numbers the ranks, Megatron-LM's, and which traffic each puts between nodes;
# 2. what each of the three communicators carries in one step, measured on every rank and compared with the closed
#    forms of `accounting.traffic.step_formula`, term by term;
# 3. a table of the bytes per rank and step for all 10 ways of writing 8 = dp x pp x tp, from the formulas, as
#    payload and as bytes a ring sends;
# 4. the memory per rank of the same 10 layouts: parameters, gradients, optimizer state and activations, the
#    formulas checked against this layout's measurement and drawn;
# 5. `hsgd.verify` on the 2 x 2 x 2 layout;
# 6. a few steps of `hsgd.train.train` on it, ending with the parameters of serial SGD;
# 7. the command lines that run the same things.
#
# Run it with eight ranks (about 7 s on a quiet 2-core machine, 14 s when other jobs share the cores; on failure every
# rank raises, so it exits non-zero without hanging):
#
# mpirun -n 8 python tutorials/10_3d_parallelism.py
#
# Rank 0 draws two pictures into `$HSGD_FIGURES` (default `tutorials/figures/`). The notebook form
# (`jupytext --to ipynb tutorials/10_3d_parallelism.py`) is for reading: the code needs eight MPI ranks. Only rank 0
# prints.
#
# Legend: P ranks, dp replicas, p = pp stages, tp ranks per stage, B global batch, m micro-batches per replica and
# step, N = (B/(dp m)) T positions of a micro-batch, T sequence, C d_model, NH heads, F d_ff, V vocabulary, Vp =
# ceil(V/tp), L layers, $L_s$ the blocks of stage s, s bytes per number (8, float64).

# %%
import io
import math
import sys

import numpy as np

import hsgd.verify
from hsgd.model.config import ModelConfig
from hsgd.model import serial
from hsgd.tp import model as tp_model, shards as tp_shards
from hsgd.model.data import Corpus
from hsgd.dp.average import params_digest
from hsgd.grid.process_grid import ProcessGrid, factorizations
from hsgd.step.trainer import HybridTrainer
from hsgd.accounting.activations import activation_bytes, activation_formula
from hsgd.pp.chunks import pp_formula, split_layers, stage_names
from hsgd.train import train
from hsgd.run.report import fmt_bytes
from hsgd.accounting.traffic import step_formula
from hsgd.verify import verify

import pictures                          # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, rel_err, train_config   # tutorials/checks.py, shared by the chapters

P, DP, PP, TP = 8, 2, 2, 2              # 8 = 2 replicas x 2 stages x 2 tensor-parallel ranks
TOL = 1e-10                             # float64: parallel and serial differ by rounding, ~1e-16 relative
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, P, tol=TOL, width=68)
grid = ProcessGrid(world, dp=DP, pp=PP, tp=TP)

cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=8, n_layers=8, d_ff=64)   # splits 1..8 ways
SEED, B, M_MB, S = 0, 8, 2, 8           # global batch, micro-batches per replica, bytes per float64
corpus = Corpus.load(None, cfg.seq_len) # the built-in corpus (the Python standard library's source), as hsgd.train
say(f"{P} ranks = dp {DP} x pp {PP} x tp {TP}; model {cfg.n_params():,} parameters (L={cfg.n_layers} C={cfg.d_model} "
    f"NH={cfg.n_heads} F={cfg.d_ff} T={cfg.seq_len} V={cfg.vocab_size})")


def config(**kw):
    """The float64 run the chapter's comparisons share (`train_config`: validated, as hsgd.train does)."""
    return train_config(**{**dict(dp=DP, pp=PP, tp=TP, steps=2, batch_size=B, micro_batches=M_MB, clip=1.0,
                                  seed=SEED), **kw})

# %% [markdown]
# ## 1. The grid, and who talks to whom
#
# `ProcessGrid(world, dp=2, pp=2, tp=2)` (chapter 3) numbers the ranks tp fastest, then pp, then dp:
#
# $$\text{rank} = (\text{dp\_rank} \cdot pp + \text{pp\_rank}) \cdot tp + \text{tp\_rank},$$
#
# and splits one communicator per dimension off the world, each joining the ranks that agree on the *other two*
# coordinates:
#
# * **`tp_comm`**: same replica, same stage. The tp ranks that hold one stage's parameters between them (the
#   shards of chapters 5 and 6: MLP columns, heads, vocabulary rows). They talk in every block, forward and backward.
# * **`pp_comm`**: same replica, same tp_rank. The p stages of one pipeline, each rank holding the same shard
#   position of a different stage; they pass activations forward and their gradients back, once per micro-batch,
#   to their neighbours only (chapter 9). Every tp_rank has its own pipeline: the (N, C) activation is whole on
#   every rank of a tensor-parallel group after its All-Reduce, so each rank sends its copy to the rank with the
#   same tp_rank in the next stage.
# * **`dp_comm`**: same stage, same tp_rank. The dp ranks that hold the **same shard of the same stage** in each
#   replica; they average its gradient once per step (chapters 4 and 10).
#
# Every rank contributes its row to the table:

# %%
layers = split_layers(cfg.n_layers, PP)[grid.pp_rank]                  # my stage's blocks
first, last = grid.pp_rank == 0, grid.pp_rank == PP - 1
tc = config()
trainer = HybridTrainer(cfg, grid, tc)                                 # my stage's shards (float64)
nh, Fp, Vp = cfg.n_heads // TP, cfg.d_ff // TP, math.ceil(cfg.vocab_size / TP)
holds = (f"blocks {layers.start}-{layers.stop - 1}: heads {grid.tp_rank * nh}-{(grid.tp_rank + 1) * nh - 1}, "
         f"MLP columns {grid.tp_rank * Fp}-{(grid.tp_rank + 1) * Fp - 1}"
         + (f", wte rows {grid.tp_rank * Vp}-{(grid.tp_rank + 1) * Vp - 1}" if first else "")
         + (f", lm_head columns {grid.tp_rank * Vp}-{(grid.tp_rank + 1) * Vp - 1}" if last else ""))
n_local = sum(p.size for p in trainer.params.values())
rows = world.allgather((rank, grid.dp_rank, grid.pp_rank, grid.tp_rank, n_local, holds))
say(" rank  dp  pp  tp  parameters  holds")
for r, d, p, t, n, h in rows:
    say(f"{r:>5} {d:>3} {p:>3} {t:>3} {n:>11,}  {h}")
check.equal("rank == (dp_rank * pp + pp_rank) * tp + tp_rank",
            rank, ProcessGrid.rank_of(grid.dp_rank, grid.pp_rank, grid.tp_rank, PP, TP))

# %% [markdown]
# The same 8 ranks drawn as two replicas side by side, each a pp x tp block (stage 0 on top): `tp_comm` joins the
# boxes of a row (blue), `pp_comm` a column (green arrows, the direction of the activations), `dp_comm` the same cell
# in every block (red dashes). `grid.groups()` computes the members of every communicator from the sizes alone,
# without communicating; each rank checks that the three communicators it actually holds have exactly those
# members. The grey backgrounds are two nodes of 4 ranks, as a launcher that fills each node with consecutive ranks
# would place them on a cluster.

# %%
groups = grid.groups()                  # {"tp": [[0, 1], [2, 3], ...], "pp": [[0, 2], ...], "dp": [[0, 4], ...]}
at = {(d, p, t): ProcessGrid.rank_of(d, p, t, PP, TP) for d in range(DP) for p in range(PP) for t in range(TP)}
PER_NODE = 4                            # ranks per node, for the placement below
node = [r // PER_NODE for r in range(P)]   # world rank -> node, consecutive ranks per node
if rank == 0:
    path = pictures.grid(DP, PP, TP, "10_grid_dp2_pp2_tp2", hosts=[f"node {n}" for n in node])
    say(f"picture: {path}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws
for dim in ("tp", "pp", "dp"):
    say(f"{dim}_comm groups: {groups[dim]}")
members = {dim: getattr(grid, f"{dim}_comm").allgather_obj(rank) for dim in ("tp", "pp", "dp")}
check.holds("my tp_comm, pp_comm, dp_comm members are groups of grid.groups()",
            all(members[dim] in groups[dim] for dim in members))

# %% [markdown]
# Who talks to whom, as an 8 x 8 table generated from `grid.groups()`: the entry in row a, column b names the
# communicator ranks a and b share, "." if none. Two ranks share a communicator exactly when they differ in one
# coordinate, and then it is that coordinate's; ranks that differ in two or three never exchange anything
# directly. Each rank has one partner per dimension here (every communicator has two members), three in all out of
# seven.

# %%
via = {}                                # (rank a, rank b) -> the communicator they share
for dim in ("tp", "pp", "dp"):
    for group in groups[dim]:
        for a in group:
            for b in group:
                if a != b:
                    via.setdefault((a, b), []).append(dim)
say("       " + "".join(f"{b:>4}" for b in range(P)))
for a in range(P):
    say(f"rank {a} " + "".join(f"{'-' if a == b else '/'.join(via.get((a, b), ['.'])):>4}" for b in range(P)))
coords = {r: (d, p, t) for (d, p, t), r in at.items()}
predicted = {}                          # (rank a, rank b) -> the one coordinate they differ in, if only one
for a in range(P):
    for b in range(P):
        differ = [dim for dim, x, y in zip(("dp", "pp", "tp"), coords[a], coords[b]) if x != y]
        if len(differ) == 1:
            predicted[a, b] = differ
check.equal("shared communicators == the one coordinate two ranks differ in", via, predicted)

# %% [markdown]
# **The order of the dimensions.** hsgd numbers ranks tp fastest, then pp, then dp. tp is innermost because it
# carries the most bytes, in every layer (section 2), and must stay on the node's fastest links. dp is outermost so
# that each data-parallel replica, one pipeline of tensor-parallel groups, is a contiguous block of ranks: the
# lecture's G groups of M consecutive workers. By bytes, though, pp carries the least, one activation per
# micro-batch between neighbours, and that is why Megatron-LM puts pp outermost: its default order is
# "tp-cp-ep-dp-pp" (`initialize_model_parallel(order=...)` and `RankGenerator` in megatron/core/parallel_state.py:
# tp fastest, then context, expert and data parallelism, pipeline slowest; with no context or expert parallelism,
# tp-dp-pp). DeepSpeed's `PipeModelDataParallelTopology` has the same order: axes ["pipe", "data", "model"],
# laid out row-major, so "model" (tp) varies fastest and "pipe" slowest.
#
# On a cluster the choice decides which traffic crosses nodes. Below, both orders place the same 8 ranks on two
# nodes of 4 consecutive ranks, and each communicator's groups are checked: with hsgd's order the dp All-Reduce
# crosses nodes (once per step, and it can overlap the backward pass, chapter 8); with Megatron-LM's the pipeline's
# point-to-point messages do. Both keep tp inside the node.

# %%
def rank_in(order, sizes, coord):
    """The rank of coordinates {dim: index} when the dimensions vary in `order`, fastest first (Megatron-LM's
    notation: "tp-dp-pp" is tp fastest, pp slowest)."""
    r, stride = 0, 1
    for dim in order.split("-"):
        r, stride = r + coord[dim] * stride, stride * sizes[dim]
    return r


def groups_in(order, sizes):
    """{dim: [[ranks of one group], ...]}: the ranks that differ only in dim, as `grid.groups()` but in any order."""
    out = {}
    for dim in ("tp", "pp", "dp"):
        rest = [d for d in ("dp", "pp", "tp") if d != dim]
        out[dim] = sorted([rank_in(order, sizes, {dim: i, rest[0]: a, rest[1]: b}) for i in range(sizes[dim])]
                          for a in range(sizes[rest[0]]) for b in range(sizes[rest[1]]))
    return out


sizes = {"dp": DP, "pp": PP, "tp": TP}
check.holds("rank_in('tp-pp-dp') == ProcessGrid.rank_of, every (d, p, t)",
            all(rank_in("tp-pp-dp", sizes, {"dp": d, "pp": p, "tp": t}) == r for (d, p, t), r in at.items()))
say(f"{'order':<26} {'communicator':<8} {'groups':<34} placement on nodes of {PER_NODE}")
crossing = {}
for label, order in (("hsgd (tp, pp, dp)", "tp-pp-dp"), ("Megatron-LM (tp, dp, pp)", "tp-dp-pp")):
    for dim, gs in groups_in(order, sizes).items():
        across = sum(len({node[r] for r in g}) > 1 for g in gs)          # groups that span two nodes
        crossing[label, dim] = across
        say(f"{label:<26} {dim + '_comm':<12} {str(gs):<34} "
            f"{f'{across} of {len(gs)} groups across nodes' if across else 'inside a node'}")
check.equal("hsgd's order: the groups == grid.groups()", groups_in("tp-pp-dp", sizes), groups)
check.equal("groups across nodes: hsgd dp only, Megatron-LM pp only, tp never",
            {k: v for k, v in crossing.items() if v}, {("hsgd (tp, pp, dp)", "dp"): PP * TP,     # every dp group
                                                       ("Megatron-LM (tp, dp, pp)", "pp"): DP * TP})  # every pp group

# %% [markdown]
# ## 2. What each communicator carries in one step
#
# One training step on the 3-D grid, in the order `HybridTrainer.step` runs it:
#
# 1. replica g takes rows $[gB/dp, (g+1)B/dp)$ of the global batch and cuts them into m micro-batches of
#    $B/(dp\,m)$ sequences (every rank of the replica reads the same rows);
# 2. each stage runs its schedule (1F1B by default) of m forwards and m backwards; each forward and backward is the
#    tensor-parallel `stage_forward` / `stage_backward` of chapter 9 on its tensor-parallel group;
# 3. each rank averages its stage shard's gradient over `dp_comm`;
# 4. each rank updates its shard. (The global gradient norm for clipping adds the squares over `tp_comm` and
#    `pp_comm`: every stage holds different parameters.)
#
# So the three communicators carry, per rank and step (`accounting.traffic.step_formula`, from
# `tp_model.comm_formula(..., stage=(L_s, first, last))`, `pp.chunks.pp_formula` and
# `trainer.exchange.sizes.formula()`):
#
# * **tp_comm, per micro-batch, times m**: Megatron's All-Reduces of (N, C) activations, $4L_s$ of them for the
#   stage's $L_s$ blocks (2 forward, 2 backward per block), plus the embedding's on the first stage and, on the
#   last, the LM head's input gradient (N, C) and the cross-entropy's MAX and SUM (3N numbers):
#   $m\,(4L_s + [\text{first}] + 3[\text{last}])$ calls and
#   $m\,\big(4L_s C + [\text{first}]\,C + [\text{last}]\,(C + 3)\big) N s$ bytes;
# * **pp_comm, per micro-batch**: one (N, C) activation to the next stage and one gradient back from it, one
#   gradient to the previous stage and one activation from it: $m([\text{not first}] + [\text{not last}])$
#   `Isend`s and as many `Recv`s, of $N C s$ bytes each;
# * **dp_comm, once per step**: one All-Reduce of the rank's whole gradient buffer: its stage's parameters, the
#   split ones' 1/tp share (vocabulary padded to tp Vp), the replicated ones whole.
#
# Two training steps on the grid (m = 2 micro-batches of 2 sequences), the second one measured on every rank; every
# rank compares its own measurement with `step_formula` and with the expressions above written out by hand:

# %%
def by_hand(cfg, tp, m, n_blocks, first, last, names, positions, s=S):
    """The three closed forms above for one rank, {(comm, op): (calls, bytes)}; positions = N of a micro-batch."""
    C, N = cfg.d_model, positions
    out = {("tp", "Allreduce"): (m * (4 * n_blocks + first + 3 * last),
                                 m * (4 * n_blocks * C + first * C + last * (C + 3)) * N * s),
           ("dp", "Allreduce"): (1, tp_shards.shard_numel(cfg, tp, names) * s)}
    sends = m * ((not first) + (not last))
    if sends:
        out[("pp", "Isend")] = out[("pp", "Recv")] = (sends, sends * N * C * s)
    return out


for step in (1, 2):                                                    # the trainer of section 1
    before = grid.stats.counts()
    trainer.step(*corpus.batch(tc.seed, step, tc.batch_size), step)
measured = grid.stats.since(before)                                    # step 2's (calls, bytes)
formula = step_formula(cfg, tc, trainer)
N = tc.batch_size // DP // tc.micro_batches * cfg.seq_len
st = trainer.stage                                                     # my stage: its blocks, first / last
mine = by_hand(cfg, TP, tc.micro_batches, len(st.layers), st.first, st.last,
               stage_names(cfg, st.layers, st.first, st.last), N)
reports = world.allgather((grid.pp_rank, measured, formula) if grid.dp_rank == 0 and grid.tp_rank == 0 else None)
for stage, meas, form in [r for r in reports if r]:
    say(f"stage {stage} (blocks {list(split_layers(cfg.n_layers, PP)[stage])}), step 2 on each of its ranks: "
        "measured (calls, bytes) | step_formula")
    for key in sorted(set(meas) | set(form)):
        say(f"  {key[0]:<3} {key[1]:<10} {str(meas.get(key, (0, 0))):<16} | {form.get(key, (0, 0))}")
check.equal("every rank: step 2's calls and bytes == step_formula", measured, formula)
check.equal("every rank: step_formula == the closed forms written out by hand", formula, mine)

# %% [markdown]
# Read the numbers against each other. Each rank's `tp_comm` carries several hundred kilobytes in dozens of calls,
# all on the critical path of its blocks; `pp_comm` a few small messages per micro-batch; `dp_comm` one call of
# the stage shard's gradient. The first stage's `dp_comm` payload includes `wte`'s vocabulary rows, the last
# stage's the LM head's columns, and the last stage's `tp_comm` the cross-entropy's.
#
# ## 3. All ten layouts of 8 ranks
#
# The closed forms give the traffic of any layout without running it. For this model, a global batch of 16 and
# m = 2 micro-batches per replica (a plain gradient accumulation of 2 when pp = 1), the bytes per rank and step of
# every factorization 8 = dp x pp x tp (`grid.factorizations(8)`), each column the largest over the stages ("-": a
# one-rank communicator, nothing moves). The 2 x 2 x 2 row, at a batch of 8, is checked against the measurement
# above.
#
# Each cell has two numbers. The first is the **payload**, the logical tensors of the calls, which is what
# `CommStats` records and `step_formula` predicts. The second is what a ring actually **sends from each rank**
# (chapter 2): an All-Reduce over n ranks sends $2(n-1)/n$ of its payload (exactly the payload for n = 2, 1.75
# times it for n = 8), a point-to-point message goes once, so `pp_comm` has one number. Compare rows and columns
# by the second number: a ratio of payloads is not a ratio of bytes on the wire.

# %%
def layout_rows(cfg, dp, pp, tp, batch, m, s=S):
    """Per stage of the layout dp x pp x tp: (parameters per rank, {(comm, op): (calls, bytes)}) from the formulas."""
    out = []
    for st, blocks in enumerate(split_layers(cfg.n_layers, pp)):
        first, last = st == 0, st == pp - 1
        per_mb = batch // dp // m                                             # sequences per micro-batch
        f = {k: (c * m, n * m) for k, (c, n) in tp_model.comm_formula(
            cfg, per_mb, s, stage=(len(blocks), first, last)).items()}
        if pp > 1:
            f.update(pp_formula(per_mb, cfg, m, first, last, s))
        numel = tp_shards.shard_numel(cfg, tp, stage_names(cfg, blocks, first, last))
        f[("dp", "Allreduce")] = (1, numel * s)
        out.append((numel, f))
    return out


def sent(f, comm, size=None):
    """(calls, bytes) a rank puts on one communicator, from a formula dict (pp: its sends, not its receives). With
    the communicator's size: the bytes a ring sends per rank instead of the payload (All-Reduce: 2(n-1)/n of it)."""
    ops = [(op, c, n) for (cm, op), (c, n) in f.items() if cm == comm and op != "Recv"]
    ring = (lambda op: 2 * (size - 1) / size if op == "Allreduce" else 1) if size else (lambda op: 1)
    return sum(c for _, c, _ in ops), sum(n * ring(op) for op, _, n in ops)


def cell(payload, wire):
    return f"{fmt_bytes(payload)} / {fmt_bytes(wire)}"


BIG = 16
say(f"B = {BIG}, m = {M_MB}, float64, per rank and step (the largest over the stages); payload / sent by a ring:")
say(f"{'dp x pp x tp':>12} {'seq/mb':>6} {'params/rank':>11} {'tp calls':>8} {'tp_comm':>21} {'pp_comm':>9} "
    f"{'dp_comm':>21} {'all three':>21}")
for dp, pp, tp in factorizations(P):
    rows = layout_rows(cfg, dp, pp, tp, BIG, M_MB)                     # [(parameters, formula)] per stage
    stages = [f for _, f in rows]
    size = {"tp": tp, "pp": pp, "dp": dp}
    most = {c: max(sent(f, c) for f in stages) for c in size}          # (calls, payload) of the busiest stage
    wire = {c: max(sent(f, c, size[c])[1] for f in stages) for c in size}
    show = {c: cell(most[c][1], wire[c]) if size[c] > 1 else "-" for c in size}
    total = max(sum(sent(f, c)[1] for c in size if size[c] > 1) for f in stages)
    total_wire = max(sum(sent(f, c, size[c])[1] for c in size if size[c] > 1) for f in stages)
    say(f"{f'{dp} x {pp} x {tp}':>12} {BIG // dp // M_MB:>6} {max(n for n, _ in rows):>11,} "
        f"{most['tp'][0] if tp > 1 else '-':>8} {show['tp']:>21} {fmt_bytes(most['pp'][1]) if pp > 1 else '-':>9} "
        f"{show['dp']:>21} {cell(total, total_wire):>21}")
mine_from_table = layout_rows(cfg, DP, PP, TP, B, M_MB)[grid.pp_rank][1]
check.equal("2 x 2 x 2 at B = 8: the table's formulas for my stage == measured", mine_from_table, measured)
check.equal("the table's parameters per rank for my stage == the trainer's",
            layout_rows(cfg, DP, PP, TP, B, M_MB)[grid.pp_rank][0], n_local)

# %% [markdown]
# How to read it, one dimension at a time, at a fixed P = 8 and global batch:
#
# * **tp** divides the parameters per rank (almost: LayerNorms, `wpe` and the row-parallel biases stay whole) and
#   adds All-Reduces of activations in every block. Its payload is proportional to the positions a replica
#   processes times the blocks of a stage, $B/dp \cdot T \cdot C \cdot L_s$: fewer replicas or fewer stages make it
#   larger, and a larger tp_comm sends more of it per rank (the second number). It is the traffic to keep inside a
#   node.
# * **pp** divides the parameters and the tensor-parallel traffic by the number of stages (each stage has $L/p$
#   blocks) and adds only $2\,(B/dp)\,T\,C\,s$ of point-to-point messages per middle stage, the smallest of the
#   three, at the price of the bubble $(p-1)/(m+p-1)$ (chapter 9): with m = 2 and p = 8 that is 7/9 of the time
#   idle, which is why real pipelines use m of several p.
# * **dp** divides nothing but the batch: each rank All-Reduces the whole gradient of its shard of its stage,
#   $\approx$ (parameters)/(pp tp), once per step, where it can overlap the backward pass (chapter 8).
#
# Hence the usual recipe, the lecture's section 2 with the placement of its section 4.1: choose tp x pp just large
# enough that one replica of the model fits, with tp inside a node, where the bandwidth is, then give the remaining
# ranks to dp. Which of the other two then crosses between nodes is the rank order's choice (section 1): in hsgd's
# order a replica of pp x tp consecutive ranks fills as few nodes as it needs, and the dp All-Reduce crosses between
# nodes, once per step and overlappable; in Megatron-LM's order the pipeline's point-to-point messages cross
# instead, the smallest payload. Only when one replica needs more ranks than a node has do hsgd's pipelines cross
# nodes too.
#
# ## 4. Memory per rank
#
# What each layout buys is memory. A rank holds, between and during steps:
#
# * its stage's parameters, $(\text{stage parameters})/tp$ give or take the replicated ones (`tp_shards.shard_numel`);
# * as many gradients (the buffer the backward pass accumulates into and `dp_comm` averages);
# * the optimizer's state: SGD with momentum keeps one velocity per parameter (AdamW would keep two);
# * the activations the forward passes cache for their backward passes: per micro-batch of b sequences on stage s,
#   $L_s$ blocks of `hsgd.accounting.activations.activation_formula` (which already divides the split terms by tp), plus
#   the token ids and masks of the embedding on the first stage and the final LayerNorm, the LM head's input and the
#   loss's softmax on the last; times the micro-batches in flight, $\min(p - s, m)$ under 1F1B (chapter 9).
#
# The 2 x 2 x 2 trainer above checks all four against measurement: `trainer.memory()` for the first three, and
# `hsgd.accounting.activations.activation_bytes` of the caches of one micro-batch's `stage_forward` on every rank for
# the last.

# %%
def micro_batch_activations(cfg, tp, b, n_blocks, first, last, s=S):
    """Bytes one micro-batch of b sequences keeps cached on one rank of a stage: the blocks (activation_formula),
    the embedding's token ids (int64) and ownership mask (bool) on the first stage, and on the last the final
    LayerNorm and LM-head input N(2C + 1), the softmax N Vp, and the loss's ids, mask and row numbers, 17N bytes."""
    N, C, Vp = b * cfg.seq_len, cfg.d_model, math.ceil(cfg.vocab_size / tp)
    return (n_blocks * activation_formula(cfg, b, s, tp, "megatron")["block"] + first * 9 * N
            + last * (N * (2 * C + 1) * s + N * Vp * s + 17 * N))


def rank_memory(cfg, dp, pp, tp, batch, m, st, s=S):
    """{part: bytes} one rank of stage st holds in the layout dp x pp x tp (SGD with momentum, 1F1B)."""
    blocks = split_layers(cfg.n_layers, pp)[st]
    first, last = st == 0, st == pp - 1
    numel = tp_shards.shard_numel(cfg, tp, stage_names(cfg, blocks, first, last))
    held = min(pp - st, m)                                                 # micro-batches in flight, 1F1B
    return {"parameters": numel * s, "gradients": numel * s, "optimizer state": numel * s,
            "activations": held * micro_batch_activations(cfg, tp, batch // dp // m, len(blocks), first, last, s)}


b_mb = B // DP // M_MB                                                     # sequences per micro-batch
idx, targets = corpus.batch(SEED, 1, b_mb)
inp = idx if first else np.random.default_rng(grid.pp_rank).standard_normal((b_mb, cfg.seq_len, cfg.d_model))
_, caches = tp_model.stage_forward(trainer.params, inp, targets, tp_model.Piece(layers, first, last),
                                   tp_model.TPSetup(cfg, grid.tp_comm, "megatron"))
predicted = rank_memory(cfg, DP, PP, TP, B, M_MB, grid.pp_rank)
mem = trainer.memory()                                                     # {"params", "grads", "optimizer"}
check.equal("trainer.memory() == formulas (parameters, gradients, optimizer)",
            (mem["params"], mem["grads"], mem["optimizer"]),
            (predicted["parameters"], predicted["gradients"], predicted["optimizer state"]))
check.equal("one micro-batch's cached bytes (activation_bytes) == the formula",
            activation_bytes(caches, trainer.params), micro_batch_activations(cfg, TP, b_mb, len(layers), first, last))
check.equal("micro-batches held in the last step == min(p - s, m)", trainer.stage.peak_held,
            min(PP - grid.pp_rank, M_MB))

PARTS = ("parameters", "gradients", "optimizer state", "activations")
table = {}                                                                 # layout -> the busiest stage's parts
for dp, pp, tp in factorizations(P):
    table[dp, pp, tp] = max((rank_memory(cfg, dp, pp, tp, BIG, M_MB, st) for st in range(pp)),
                            key=lambda parts: sum(parts.values()))
say(f"B = {BIG}, m = {M_MB}, float64, SGD with momentum, 1F1B; the busiest stage's rank:")
say(f"{'dp x pp x tp':>12} " + " ".join(f"{part:>15}" for part in PARTS) + f" {'total':>10}")
for (dp, pp, tp), parts in table.items():
    say(f"{f'{dp} x {pp} x {tp}':>12} " + " ".join(f"{fmt_bytes(parts[x]):>15}" for x in PARTS)
        + f" {fmt_bytes(sum(parts.values())):>10}")
if rank == 0:
    fig, ax = pictures.figure(9, 3.8)
    labels = [f"{dp}x{pp}x{tp}" for dp, pp, tp in table]
    bottom = np.zeros(len(table))
    for part, color in zip(PARTS, ("#4C72B0", "#55A868", "#8172B2", "#DD8452")):
        kib = np.array([parts[part] for parts in table.values()]) / 1024
        ax.bar(labels, kib, bottom=bottom, color=color, label=part)
        bottom += kib
    ax.set_xlabel("layout dp x pp x tp (8 ranks)")
    ax.set_ylabel("KiB per rank (the busiest stage)")
    ax.set_title(f"Memory per rank: B = {BIG}, m = {M_MB}, float64, SGD with momentum, 1F1B", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    path = pictures.save(fig, "10_memory_per_rank")
    say(f"picture: {path}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# The picture stacks the four parts for each of the ten layouts, for the rank of the stage that holds the most.
#
# Parameters, gradients and optimizer state shrink with pp x tp and not at all with dp: every replica holds all of
# them (chapter 8's ZeRO shards the optimizer state and the gradients over dp to change that). Activations go the
# other way down the table. At a fixed 8 ranks, every rank given to tp or pp is taken from dp, and each replica then
# processes more sequences per micro-batch. tp divides only part of a block's cache: Megatron's scheme keeps the
# LayerNorm outputs and the inputs of the split matrix products whole on every rank (chapter 6's sequence
# parallelism splits those too). And pp hardly divides it under 1F1B: the first stage keeps $\min(p, m)$
# micro-batches of $L/p$ blocks each, so with m at least p it holds as much as the whole model would for one
# micro-batch, whatever p is (here m = 2, so the deep pipelines keep only 2 of their p).
#
# ## 5. `hsgd.verify` on the 3-D grid
#
# `hsgd.verify` runs one step of `HybridTrainer.gradients` and of `hsgd.model.serial` on the same batch and prints,
# per parameter, the largest error of any rank's shard of the gradient, with the stage that holds it; exit code 0
# when all are within the float64 tolerance ($10^{-10}$). Called as a function, on 2 x 2 x 2 with 1F1B, and with
# the lecture's All-Gather scheme and GPipe; the first lines and the last of each report:

# %%
for extra in (dict(), dict(tp_scheme="gather", schedule="gpipe")):
    report = io.StringIO()
    ok, _ = verify(cfg, config(**extra), world, out=report)
    lines = report.getvalue().splitlines()                             # rank 0's report; empty elsewhere
    say("\n".join(lines[:5] + ["    ..."] + lines[-3:]) + "\n")
    check.holds(f"hsgd.verify dp=2 pp=2 tp=2 {extra}: PASS", ok)

# %% [markdown]
# ## 6. Training on the 3-D grid, and the check against serial SGD
#
# `hsgd.train.train(cfg, tc, world)` is the loop of `mpirun -n 8 python -m hsgd.train --tp 2 --pp 2 --dp 2`: here
# six float64 steps of SGD with momentum, a warm-up, a cosine schedule and clipping at 1.0, m = 2 micro-batches,
# 1F1B. Besides the progress lines, it prints the bytes per step of every stage against `step_formula`, the last
# step's measured pipeline schedule (noisy on a shared machine, see chapter 9) and the micro-batches each stage
# held. Its output, from rank 0:

# %%
tc = config(steps=6, warmup=2, log_interval=3)
run = train(cfg, tc, world, out=sys.stdout)           # rank 0 prints; every rank returns its summary

# %% [markdown]
# The reference is serial mini-batch SGD on one process, the whole batch of every step, with the same optimizer,
# schedule and clipping (the serial norm): `serial.sgd`. Rank 0 runs it and broadcasts the result; every rank
# compares its shards of its stage with the matching slices. As in chapter 4 the error is relative to each
# parameter's largest entry, but at least to 0.02: the attention k-biases only ever receive rounding noise. Both
# replicas of every shard must also be bit-identical, and every parameter must be held by some rank.

# %%
reference = None
if rank == 0:                                         # the same global batches, on one process
    reference = serial.sgd(cfg, tc, lambda step: corpus.batch(tc.seed, step, tc.batch_size))
pictures.wait_asleep(world)                           # the others sleep meanwhile (not spin inside the bcast)
ref, ref_losses = world.bcast(reference, root=0)      # a small model: a pickled broadcast is fine

losses = run["losses"]
param_errs = {n: rel_err(p, tp_shards.shard(ref[n], n, grid.tp_rank, TP), floor=0.02) for n, p in run["params"].items()}
replicas = len(set(grid.dp_comm.allgather_obj(params_digest(run["params"]))))
held = set(n for names in world.allgather(sorted(run["params"])) for n in names)
say(f"\nserial SGD losses: {' '.join(f'{x:.6f}' for x in ref_losses)}")
say(f"3-D grid losses:   {' '.join(f'{x:.6f}' for x in losses)}")
check(f"{tc.steps} steps: losses vs serial SGD", max(abs(a - b) / b for a, b in zip(losses, ref_losses)), 1e-9)
check(f"{tc.steps} steps: every rank's shards of its stage vs serial SGD", max(param_errs.values()), 1e-9)
check.equal("distinct digests of the DP replicas of every shard", replicas, 1)
check.equal("parameters held by some rank == the model's", held, set(cfg.param_shapes()))

# %% [markdown]
# ## 7. The command lines
#
# Everything above, from a shell. Training (the default model and 1000 steps; `--help` lists the rest, among them
# `--pp-split`, `--schedule gpipe`, `--micro-batches`, `--tp-scheme gather`, `--plot DIR` for the per-rank
# timeline as a PNG):
#
#     mpirun -n 8 python -m hsgd.train --tp 2 --pp 2 --dp 2
#     mpirun -n 8 python -m hsgd.train --tp 2 --pp 2 --dp 2 --micro-batches 4 --schedule gpipe --steps 100
#
# the layout table and the groups of section 1:
#
#     mpirun -n 8 python -m hsgd.grid --tp 2 --pp 2
#
# and the check against serial of section 5 (dp defaults to the ranks left over, 8 / (2 x 2) = 2):
#
#     mpirun -n 8 python -m hsgd.verify --tp 2 --pp 2
#
# The last is cheap, so here it is, through its own `main` with exactly those arguments, as `python -m` runs it; its
# return value is the exit code:

# %%
code = hsgd.verify.main(["--tp", "2", "--pp", "2"])
check.equal("mpirun -n 8 python -m hsgd.verify --tp 2 --pp 2: exit code", code, 0)

# %% [markdown]
# ## Check against serial
#
# On 8 ranks as dp 2 x pp 2 x tp 2, every verdict reached collectively: each rank sits at
# $(\text{dp\_rank} \cdot pp + \text{pp\_rank}) \cdot tp + \text{tp\_rank}$, its three communicators have the
# members `grid.groups()` predicts, and two ranks share a communicator exactly when they differ in one coordinate;
# on two nodes of 4, hsgd's order sends only the dp groups across nodes and Megatron-LM's only the pp groups; every
# rank's bytes and calls on `tp_comm`, `pp_comm` and `dp_comm` in a step are exactly `step_formula`'s and the closed
# forms written out, which the table of all ten layouts uses; the memory formulas of that table give exactly the
# trainer's parameters, gradients and optimizer state, the cached bytes of a real forward and the micro-batches
# held; `hsgd.verify` passes, from Python and with the command line's arguments; and six steps of 3-D parallel SGD
# with momentum and clipping end with serial SGD's parameters, the replicas of every shard bit-identical.

# %%
worst, err = check.worst([w for w in check.errors if "serial" in w])
say(f"\nchapter 10: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error against serial "
    f"{err:.1e} ({worst})")
grid.free()

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `ProcessGrid(world, dp, pp, tp)` (hsgd/grid/process_grid.py): rank = (dp_rank pp + pp_rank) tp + tp_rank, order tp-pp-dp | `initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size, ..., order="tp-cp-ep-dp-pp")`, ranks from `RankGenerator` (megatron/core/parallel_state.py): tp-dp-pp without cp and ep | `PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`, axes ["pipe", "data", "model"], row-major (deepspeed/runtime/pipe/topology.py): tp-dp-pp | `init_device_mesh("cuda", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))` (torch/distributed/device_mesh.py), row-major: the order is the caller's | dp outermost, so that a replica is a contiguous block of ranks (the lecture's G groups of M consecutive workers); the others put pp outermost, so that the pipeline's small messages cross nodes instead of the dp All-Reduce |
# | `grid.groups()`; `tp_comm`, `pp_comm`, `dp_comm` from `Split(color, key)` | `RankGenerator.get_ranks("tp")` etc.; `get_tensor_model_parallel_group()`, `get_pipeline_model_parallel_group()`, `get_data_parallel_group()` | `PipelineParallelGrid(topology=...)`: `get_slice_parallel_group()` (tp), `get_pipe_parallel_group()`, `get_data_parallel_group()` | `mesh["tp"]`, `mesh["pp"]`, `mesh["dp"]` (sub-meshes), `mesh.get_group("tp")` | three MPI communicators passed as arguments, no global state |
# | `accounting.traffic.step_formula`, the layout table of section 3 | none (the paper derives each dimension's traffic) | none | none | every term checked against `CommStats`, byte for byte |
# | `HybridTrainer.memory()`, `hsgd.accounting.activations.activation_formula`, section 4's `rank_memory` | `report_theoretical_memory`, `compute_weight_and_optimizer_memory`, `compute_activation_memory` (megatron/training/theoretical_memory_usage.py; the first stage holds `min(num_microbatches, pipeline_model_parallel_size)` micro-batches) | `estimate_zero2_model_states_mem_needs_all_live` (deepspeed/runtime/zero/stage_1_and_2.py) | none | the formulas count hsgd's own caches exactly, and are checked against `activation_bytes` of a real forward |
# | `hsgd.verify` (every rank's gradient shards against serial) | none | none | none | a parallel step is trusted only once it matches serial |
#
# ## Exercises
#
# ### Exercise 1: 16 ranks on 2 nodes of 8
# For every layout of 16 = dp x pp x tp that this model allows, from the formulas of sections 3 and 4 (B = 64,
# m = 4), compute the memory per rank of the busiest stage and the bytes per rank and step (payload and sent by a
# ring); then place the ranks in hsgd's order on two nodes of 8 consecutive ranks and find which communicators have
# groups that span both nodes. Check the rules: tp stays inside a node exactly when tp divides 8, and pp crosses
# nodes exactly when one replica (pp x tp ranks) is larger than a node; otherwise dp is what crosses. Among the
# layouts whose memory fits a budget (the 2 x 2 x 4 layout's, say) and whose tp stays inside a node, choose the one
# that sends the fewest bytes between nodes per rank (count, as an upper bound, all a rank sends on a communicator
# whose groups span both nodes).
# (solution: `tutorials/solutions/10_3d_parallelism.py`, `exercise_1`)
#
# ### Exercise 2: the bytes of another layout
# On the 8 ranks, build `ProcessGrid(world, dp=1, pp=4, tp=2)` and `ProcessGrid(world, dp=4, pp=2, tp=1)`. For each,
# write by hand what one rank sends on each communicator in one step (the closed forms of section 2) as payload and
# as bytes a ring sends, run a step of `HybridTrainer`, and check your payloads against `CommStats`.
# (solution: `tutorials/solutions/10_3d_parallelism.py`, `exercise_2`)
#
# ### Exercise 3: Megatron-LM's numbering
# Write the rank of (d, p, t) in Megatron-LM's default order (tp-cp-ep-dp-pp, with cp = ep = 1) and its inverse;
# check that it is a bijection of the 8 ranks and reproduce the example in the docstring of Megatron-LM's
# `generate_masked_orthogonal_rank_groups` (order tp-pp-dp, sizes 2-2-2: dp groups [0, 4], [1, 5], [2, 6], [3, 7]).
# Then run hsgd in Megatron-LM's layout: renumber the world with `world.Split(0, key=...)` so that `ProcessGrid`
# gives every rank its Megatron-LM coordinates, check that the members of its three communicators (in world ranks)
# are Megatron-LM's groups, that on two nodes of 4 the pp groups now cross nodes and the dp groups do not, and that
# a training step gives the same loss as in hsgd's layout.
# (solution: `tutorials/solutions/10_3d_parallelism.py`, `exercise_3`)
