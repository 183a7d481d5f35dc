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
# The lecture's algorithm, section 2 (in translation):
#
# > We divide the P workers into G model-parallel groups of M workers each (P = G x M); inside a group the workers
# > use model parallelism. The G groups are data-parallel replicas of each other [...]. After the backward pass,
# > the gradients of the *same parameter shard* are aggregated across the groups.
#
# G is hsgd's dp; the "model-parallel group" of M ranks may itself be split two ways (section 3.1): tensor
# parallelism inside each layer (chapters 5 and 6) and pipeline parallelism across layers (chapter 9). Tensor and
# pipeline parallelism make the model fit; data parallelism multiplies the throughput. A rank then has three
# coordinates. This chapter puts the pieces together on 8 ranks, mostly as dp = 2 replicas x pp = 2 stages x
# tp = 2 tensor-parallel ranks, with a 2-D dp = 4 x tp = 2 grid for the hybrid step by hand.
#
# Run it with eight ranks (about 10 s on a quiet 2-core machine; on failure every rank raises, so it exits non-zero
# without hanging):
#
# mpirun -n 8 python tutorials/10_3d_parallelism.py
#
# Rank 0 draws three pictures into `$HSGD_FIGURES` (default `tutorials/figures/`) and alone prints.
#
# Legend: P ranks, dp replicas, p = pp stages, tp ranks per stage, B global batch, b = B/dp sequences per replica,
# m micro-batches per replica and step, N = (B/(dp m)) T positions of a micro-batch, T sequence, C d_model, NH
# heads, F d_ff, V vocabulary, Vp = ceil(V/tp), L layers, $L_s$ the blocks of stage s, s bytes per number (8,
# float64).

# %%
import io
import math
import sys
from dataclasses import replace

import numpy as np

import hsgd.verify
from hsgd.model.config import ModelConfig
from hsgd.model import serial
from hsgd.tp import model as tp_model, shards as tp_shards
from hsgd.model.data import Corpus
from hsgd.dp.average import FlatBuffer, dp_average, dp_rows, params_digest
from hsgd.grid.process_grid import ProcessGrid, factorizations
from hsgd.step.trainer import HybridTrainer
from hsgd.accounting.activations import activation_bytes, activation_formula
from hsgd.pp.chunks import pp_formula, split_layers, stage_names
from hsgd.model.optim import clip_grads, global_grad_norm
from hsgd.train import train
from hsgd.run.report import fmt_bytes
from hsgd.accounting.traffic import step_formula
from hsgd.verify import verify

import pictures                          # tutorials/pictures.py: where the PNGs go
from checks import FLOOR, mpi_chapter, rel_err, train_config   # tutorials/checks.py, shared by the chapters

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
# `ProcessGrid(world, dp=2, pp=2, tp=2)` (chapter 3) numbers the ranks tp fastest, then pp, then dp,
#
# $$\text{rank} = (\text{dp\_rank} \cdot pp + \text{pp\_rank}) \cdot tp + \text{tp\_rank},$$
#
# and splits one communicator per dimension, each joining the ranks that agree on the *other two* coordinates:
#
# * **`tp_comm`** (same replica, same stage): the shards of one stage (chapters 5 and 6); they talk in every block,
#   forward and backward, on the critical path.
# * **`pp_comm`** (same replica, same tp_rank): the p stages of one pipeline, passing activations forward and
#   gradients back to their neighbours, once per micro-batch (chapter 9). The (N, C) activation is whole on every
#   rank of a tensor-parallel group after its All-Reduce, so each tp_rank has its own pipeline.
# * **`dp_comm`** (same stage, same tp_rank): the ranks that hold the **same shard of the same stage** in each
#   replica; they average its gradient once per step (chapter 4). This is the lecture's section 3.4: "all the
#   'first GPUs' of the tensor-parallel groups hold W_part1 [...] and All-Reduce the gradient of this shard".

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
# The picture: two replicas side by side, each a pp x tp block (stage 0 on top); `tp_comm` joins a row (blue),
# `pp_comm` a column (green arrows), `dp_comm` the same cell in every block (red dashes); the grey backgrounds are
# two nodes of 4 consecutive ranks. `grid.groups()` computes every communicator's members from the sizes alone;
# each rank checks that the communicators it holds have exactly those members.

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
# Who talks to whom, from `grid.groups()`: row a, column b names the communicator ranks a and b share ("." if none).
# Two ranks share one exactly when they differ in one coordinate, and then it is that coordinate's.

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
# **The order of the dimensions.** tp is innermost because it carries the most bytes, in every layer (section 3),
# and must stay on the node's fastest links. hsgd puts dp outermost, so that a replica is a contiguous block of
# ranks: the lecture's G groups of M consecutive workers. Megatron-LM puts pp outermost instead, since pp carries
# the least: its default order is "tp-cp-ep-dp-pp" (`initialize_model_parallel(order=...)`, `RankGenerator` in
# megatron/core/parallel_state.py; tp-dp-pp without context and expert parallelism). DeepSpeed's
# `PipeModelDataParallelTopology` (axes ["pipe", "data", "model"], row-major) is the same. On two nodes of 4
# consecutive ranks, hsgd's order sends the dp All-Reduce across nodes (once per step, overlappable, chapter 8),
# Megatron-LM's the pipeline's point-to-point messages; both keep tp inside the node:

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
# ## 2. One hybrid step by hand, on dp x tp
#
# First without the pipeline: `ProcessGrid(world, dp=4, tp=2)`, 4 groups of 2. Every rank of a group reads the
# group's rows of the batch (`dp_rows`), every rank of a `dp_comm` holds the same shard. `HybridTrainer.step`
# (hsgd/step/trainer.py) then runs the lecture's sections 3.2 to 3.5:
#
# 1. group g takes rows $[g\,b, (g+1)\,b)$ of the global batch;
# 2. the group runs the tensor-parallel forward and backward on them: each rank ends with **its shard of the
#    gradient of its group's slice**;
# 3. each `dp_comm` All-Reduces its shard's gradient and divides by dp. The loss is a mean over equal slices, and
#    slicing and averaging are both linear, so $\frac{1}{dp}\sum_g$ shard of $\nabla\text{loss}_g$ = **shard of
#    the serial gradient of the global batch**;
# 4. every rank updates its shard (elementwise: the shard of the serial update).
#
# By hand, with the pieces of hsgd, checked after steps 2 and 3 against serial gradients every rank computes:

# %%
DP2, TP2 = 4, 2                                                         # the 2-D grid: 4 groups of 2
grid2 = ProcessGrid(world, dp=DP2, tp=TP2)


def shard_err(local, full, tp_rank, tp, floor=FLOOR):
    """The largest rel_err of this rank's shards against the matching slices of full (serial) arrays."""
    return max(rel_err(local[n], tp_shards.shard(full[n], n, tp_rank, tp), floor) for n in local)


trainer2 = HybridTrainer(cfg, grid2, train_config(tp=TP2, dp=DP2, batch_size=B, seed=SEED))
idx, targets = corpus.batch(SEED, 1, B)                                 # (B, T): step 1's global batch
mine_rows = dp_rows(B, DP2, grid2.dp_rank)                              # my group's rows
p_digest, d_digest = params_digest(trainer2.params), params_digest({"idx": idx[mine_rows]})
same = {name: (len(set(comm.allgather_obj(p_digest))), len(set(comm.allgather_obj(d_digest))))
        for name, comm in (("dp", grid2.dp_comm), ("tp", grid2.tp_comm))}   # (distinct shards, distinct slices)
check.equal("dp_comm: (distinct shards, distinct data slices) == (1, dp)", same["dp"], (1, DP2))
check.equal("tp_comm: (distinct shards, distinct data slices) == (tp, 1)", same["tp"], (TP2, 1))

full = serial.init_params(cfg, seed=SEED, dtype="float64")              # the serial model, on every rank
local = tp_shards.shard_params(full, grid2.tp_rank, TP2)                # my shards of it (= trainer2.params)
_, grads_slice = serial.loss_and_grads(full, idx[mine_rows], targets[mine_rows], cfg)   # my slice's gradient
loss_ref, grads_ref = serial.loss_and_grads(full, idx, targets, cfg)    # ... and the global batch's
buf = FlatBuffer(local)                                                 # my gradient shards, one flat buffer
loss_g, _ = tp_model.loss_and_grads(local, idx[mine_rows], targets[mine_rows],
                                    tp_model.TPSetup(cfg, grid2.tp_comm), grads=buf.views)
check("step 2: my shard of my group's gradient vs serial, on the slice",
      shard_err(buf.views, grads_slice, grid2.tp_rank, TP2))
say(f"  (the same shard against the global batch's gradient, before averaging: "
    f"{shard_err(buf.views, grads_ref, grid2.tp_rank, TP2):.2f}: one group's slice is not the batch)")
dp_average(buf, grid2.dp_comm)                                          # Allreduce over dp_comm, / dp
check("step 3: my shard after dp_average vs serial, global batch",
      shard_err(buf.views, grads_ref, grid2.tp_rank, TP2))
loss_avg = grid2.dp_comm.comm.allreduce(loss_g) / DP2                   # metadata: one float
check("loss: mean over the groups vs serial loss of the global batch", abs(loss_avg - loss_ref) / loss_ref)
trainer2.gradients(idx, targets)                                        # steps 1-3 as training runs them
check("HybridTrainer.gradients vs the steps by hand: max |difference|",
      max(float(np.max(np.abs(trainer2.grads[n] - buf.views[n]))) for n in local))

# %% [markdown]
# **The global gradient norm, for clipping**, $g \leftarrow g \cdot \min(1, c/\lVert g\rVert)$. No rank holds
# the whole gradient: a split parameter's squares are spread over the tp ranks, a replicated one's are on all of
# them. `optim.global_grad_norm` adds each kind once,
#
# $$\lVert g\rVert^2 = \sum_{\text{split } p} \ \sum_{i=1}^{tp} \lVert g_{p,i} \rVert^2
# \;+\; \sum_{\text{replicated } p} \lVert g_p \rVert^2 ,$$
#
# the first sum with one All-Reduce of a float over `tp_comm` (and `pp_comm` on the 3-D grid), the second locally.
# After `dp_average` every replica holds the same gradient, so nothing crosses `dp_comm`.

# %%
norm = global_grad_norm(trainer2.grads, trainer2.norm_weight, grid2.tp_comm)
serial_norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads_ref.values()))
squares = sum(float(np.sum(g * g)) for g in trainer2.grads.values())   # all my squares
everything = math.sqrt(grid2.tp_comm.comm.allreduce(squares))            # wrong: replicated ones tp times
say(f"serial norm {serial_norm:.12f}; global_grad_norm {norm:.12f}; wrong: my shards only "
    f"{math.sqrt(squares):.12f}, everything summed over tp_comm {everything:.12f}")
norms = world.allgather(norm)
check("global_grad_norm vs serial norm", abs(norm - serial_norm) / serial_norm, 1e-12)
check("global_grad_norm: spread over all 8 ranks", (max(norms) - min(norms)) / serial_norm, 1e-15)
factor = clip_grads(trainer2.grads, norm, 0.5 * norm)                   # clip to half the norm
check("clipped to half the norm: my shards vs serial clipped gradient",
      shard_err(trainer2.grads, {n: g * factor for n, g in grads_ref.items()}, grid2.tp_rank, TP2))
trainer2.free()
grid2.free()

# %% [markdown]
# ## 3. What each communicator carries in one step
#
# On the 3-D grid, `HybridTrainer.step` cuts replica g's rows into m micro-batches, runs each stage's schedule
# (1F1B by default) of tensor-parallel `stage_forward` / `stage_backward` (chapter 9), averages each shard's
# gradient over `dp_comm` and updates it. `CommStats` records every collective's calls and **payload** (the
# logical tensor); per rank and step (`accounting.traffic.step_formula`):
#
# * **tp_comm, per micro-batch, times m**: $4L_s$ All-Reduces of (N, C) for the stage's blocks (in each block the
#   forward's attention and MLP projections, $g$, and the backward's input gradients of q, k, v and of fc, $f$),
#   plus the vocab-parallel embedding's on the first stage and, on the last, the LM head's input gradient (N, C)
#   and the cross-entropy's MAX and SUM (3N numbers): $m\,(4L_s + [\text{first}] + 3[\text{last}])$ calls and
#   $m\,\big(4L_s C + [\text{first}]\,C + [\text{last}]\,(C + 3)\big) N s$ bytes, growing with the activations;
# * **pp_comm, per micro-batch**: an (N, C) activation forward and its gradient back to each neighbour,
#   $m([\text{not first}] + [\text{not last}])$ `Isend`s and as many `Recv`s of $N C s$ bytes;
# * **dp_comm, once per step**: one All-Reduce of the rank's gradient buffer: its stage's split parameters' 1/tp
#   share (vocabulary padded to tp Vp) and the replicated ones whole, growing with the parameters.
#
# Two steps (m = 2 micro-batches of 2 sequences), the second measured on every rank and compared with
# `step_formula` and with the expressions above written out by hand:

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
# The first stage's `dp_comm` payload includes `wte`'s vocabulary rows, the last stage's the LM head's columns.
#
# ## 4. All ten layouts of 8 ranks
#
# The closed forms give the traffic of any layout 8 = dp x pp x tp (`grid.factorizations(8)`) without running it,
# here at B = 16 and m = 2, each column the busiest stage's ("-": a one-rank communicator). Each cell is the
# **payload**, then what a ring **sends from each rank** (chapter 2): $2(n-1)/n$ of the payload for an
# All-Reduce over n ranks, all of it for a point-to-point message. A ratio of payloads is not a ratio of bytes on
# the wire. The bytes do not depend on m (m times the calls, 1/m of the positions each), so the formulas at m = 1
# must give the payloads measured at m = 2.

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
drawn = {}                                                             # layout -> {comm: (payload, sent)}
say(f"{'dp x pp x tp':>12} {'seq/mb':>6} {'params/rank':>11} {'tp calls':>8} {'tp_comm':>21} {'pp_comm':>9} "
    f"{'dp_comm':>21} {'all three':>21}")
for dp, pp, tp in factorizations(P):
    rows = layout_rows(cfg, dp, pp, tp, BIG, M_MB)                     # [(parameters, formula)] per stage
    stages = [f for _, f in rows]
    size = {"tp": tp, "pp": pp, "dp": dp}
    most = {c: max(sent(f, c) for f in stages) for c in size}          # (calls, payload) of the busiest stage
    wire = {c: max(sent(f, c, size[c])[1] for f in stages) for c in size}
    show = {c: cell(most[c][1], wire[c]) if size[c] > 1 else "-" for c in size}
    drawn[dp, pp, tp] = {c: (most[c][1], wire[c]) if size[c] > 1 else (0, 0) for c in size}
    total = max(sum(sent(f, c)[1] for c in size if size[c] > 1) for f in stages)
    total_wire = max(sum(sent(f, c, size[c])[1] for c in size if size[c] > 1) for f in stages)
    say(f"{f'{dp} x {pp} x {tp}':>12} {BIG // dp // M_MB:>6} {max(n for n, _ in rows):>11,} "
        f"{most['tp'][0] if tp > 1 else '-':>8} {show['tp']:>21} {fmt_bytes(most['pp'][1]) if pp > 1 else '-':>9} "
        f"{show['dp']:>21} {cell(total, total_wire):>21}")
mine_from_table = layout_rows(cfg, DP, PP, TP, B, M_MB)[grid.pp_rank][1]
check.equal("2 x 2 x 2 at B = 8: the table's formulas for my stage == measured", mine_from_table, measured)
check.equal("the table's parameters per rank for my stage == the trainer's",
            layout_rows(cfg, DP, PP, TP, B, M_MB)[grid.pp_rank][0], n_local)
payloads = lambda f: {c: sum(n for (cc, _), (_, n) in f.items() if cc == c) for c in ("tp", "pp", "dp")}
check.equal("measured payloads at m = 2 == the formulas at m = 1", payloads(measured),
            payloads(layout_rows(cfg, DP, PP, TP, B, 1)[grid.pp_rank][1]))


def draw_bytes(drawn):
    """Rank 0: per layout, the busiest stage's payload and ring bytes per rank, stacked by communicator."""
    fig, ax = pictures.figure(9, 3.6)
    xs = np.arange(len(drawn))
    for off, col, hatch in ((-0.2, 0, ""), (0.2, 1, "//")):                    # payload, then sent by a ring
        bottom = np.zeros(len(drawn))
        for c in ("tp", "pp", "dp"):
            kib = np.array([cells[c][col] for cells in drawn.values()]) / 1024
            ax.bar(xs + off, kib, 0.38, bottom=bottom, color=pictures.COLORS[c], hatch=hatch,
                   label=f"{c}_comm" if col == 0 else None)
            bottom += kib
    ax.set_xticks(xs, [f"{dp}x{pp}x{tp}" for dp, pp, tp in drawn], fontsize=7)
    ax.set_xlabel("layout dp x pp x tp (8 ranks); left bar payload, right bar (hatched) sent by a ring")
    ax.set_ylabel("KiB per rank and step")
    ax.set_title(f"Traffic per rank: B = {BIG}, m = {M_MB}, float64, the busiest stage", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.08)
    return pictures.save(fig, "10_bytes_per_step")


path = pictures.on_rank0(world, lambda: draw_bytes(drawn))
say(f"picture: {path}")

# %% [markdown]
# The picture stacks the table's columns per layout, payload beside ring bytes. One dimension at a time, at a fixed
# P and global batch:
#
# * **tp** divides the parameters (not the LayerNorms, `wpe` and the row-parallel biases) and adds All-Reduces of
#   activations in every block, a payload $\propto (B/dp)\,T\,C\,L_s$ on the critical path: keep it in a node.
# * **pp** divides the parameters and the tp traffic by the stages and adds only $2\,(B/dp)\,T\,C\,s$ per middle
#   stage, the least of the three, at the price of the bubble $(p-1)/(m+p-1)$ (chapter 9; 7/9 at m = 2, p = 8).
# * **dp** divides nothing but the batch: one All-Reduce of the stage shard's gradient per step, overlappable with
#   the backward pass (chapter 8).
#
# Which layout moves the least depends on the ratio of activations to parameters. Among the 2-D layouts (pp = 1),
# for a model whose parameters outweigh its batch (the toy below: 2 layers, F = 128, B = 8) a mixed layout moves
# the least; for GPT-2 small's shape at B = 32 sequences of 1024 the activations dominate and pure dp would, if
# the model fitted. Hence the recipe (the lecture's section 2, placed as in its section 4.1): tp x pp just large
# enough that a replica fits, tp inside a node, the remaining ranks to dp.

# %%
def least_2d(cfg, batch, s, tps):
    """Among the layouts (P/tp) x 1 x tp: (the least payload summed over tp and dp, the fewest ring bytes)."""
    totals = {}
    for tp in tps:
        f, size = layout_rows(cfg, P // tp, 1, tp, batch, 1, s)[0][1], {"tp": tp, "dp": P // tp}
        totals[tp] = [sum(sent(f, c, size[c] if col else None)[1] for c in size if size[c] > 1)
                      for col in (0, 1)]
        say(f"  {P // tp} x 1 x {tp}: payload {fmt_bytes(totals[tp][0])}, sent by a ring {fmt_bytes(totals[tp][1])}")
    return tuple(f"{P // t} x 1 x {t}" for t in (min(tps, key=lambda t: totals[t][col]) for col in (0, 1)))


toy = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=8, n_layers=2, d_ff=128)
say("toy (L=2, F=128), B = 8, float64:")
toy_best = least_2d(toy, 8, 8, (1, 2, 4, 8))
gpt2 = ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072)
say(f"GPT-2 small's shape ({gpt2.n_params() / 1e6:.0f} M parameters), B = 32, float32 (tp = 8 does not divide 12):")
gpt2_best = least_2d(gpt2, 32, 4, (1, 2, 4))
say(f"least (payload, ring bytes): toy {toy_best}, GPT-2 {gpt2_best}")
check.holds("the toy: a mixed layout moves the least, in both columns", set(toy_best) <= {"4 x 1 x 2", "2 x 1 x 4"})
check.holds("GPT-2's shape: pure DP moves the least, in both columns", set(gpt2_best) == {"8 x 1 x 1"})

# %% [markdown]
# ## 5. Memory per rank
#
# What each layout buys is memory. A rank holds its stage's parameters (about 1/tp of them,
# `tp_shards.shard_numel`), as many gradients, the optimizer's state (SGD with momentum: one velocity per
# parameter; AdamW two), and the activations cached for the backward: per micro-batch on stage s, $L_s$ blocks of
# `activation_formula` (split terms already divided by tp), the embedding's ids and masks on the first stage, the
# final LayerNorm, LM-head input and softmax on the last; times the micro-batches in flight, $\min(p - s, m)$
# under 1F1B (chapter 9). The 2 x 2 x 2 trainer checks all four: `trainer.memory()` and `activation_bytes` of a
# real `stage_forward`.

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
# Parameters, gradients and optimizer state shrink with pp x tp, never with dp (chapter 8's ZeRO shards them over
# dp). Activations go the other way: each rank taken from dp gives a replica more sequences per micro-batch; tp
# leaves the LayerNorm outputs and the split products' inputs whole (chapter 6's sequence parallelism splits
# them); and under 1F1B the first stage keeps $\min(p, m)$ micro-batches of $L/p$ blocks, as much as the whole
# model for one micro-batch once m reaches p (here m = 2).
#
# ## 6. `hsgd.verify`
#
# One step of `HybridTrainer.gradients` against `hsgd.model.serial` on the same batch, the largest error of any
# rank's shard of each parameter, exit code 0 within $10^{-10}$. On 2 x 2 x 2 with 1F1B, with the lecture's
# All-Gather scheme and GPipe, and on 2 x 1 x 4 with All-Gather and two micro-batches:

# %%
for extra in (dict(), dict(tp_scheme="gather", schedule="gpipe"),
              dict(dp=2, pp=1, tp=4, tp_scheme="gather", micro_batches=2)):
    report = io.StringIO()
    ok, _ = verify(cfg, config(**extra), world, out=report)
    lines = report.getvalue().splitlines()                             # rank 0's report; empty elsewhere
    say("\n".join(lines[:5] + ["    ..."] + lines[-3:]) + "\n")
    check.holds(f"hsgd.verify {extra or 'dp=2 pp=2 tp=2'}: PASS", ok)

# %% [markdown]
# ## 7. Training, and the check against serial SGD
#
# `hsgd.train.train(cfg, tc, world)` is the loop of `mpirun -n 8 python -m hsgd.train --tp 2 --pp 2 --dp 2`:
# here twelve float64 steps of SGD with momentum, warm-up, cosine schedule and clipping at 1.0, m = 2, 1F1B. It
# prints the bytes per step against `step_formula`, the last step's measured schedule (noisy, chapter 9) and the
# micro-batches each stage held:

# %%
tc = config(steps=12, warmup=2, log_interval=6, eval_batches=2)
run = train(cfg, tc, world, out=sys.stdout)           # rank 0 prints; every rank returns its summary
losses = run["losses"]
say(f"\ntraining loss: first step {losses[0]:.3f}, mean of the last 3 {np.mean(losses[-3:]):.3f}")
check.holds("training loss fell by at least 1.0", np.mean(losses[-3:]) < losses[0] - 1.0)
check.holds("validation loss fell", run["val_after"] < run["val_before"])

# %% [markdown]
# The reference is `serial.sgd`: one process, the whole batch of every step, the same optimizer, schedule and
# clipping (the serial norm). Rank 0 runs it, and once more without clipping to show that clipping was active;
# every rank compares its shards with the matching slices, relative to each parameter's largest entry but at least
# to 0.02 (the attention k-biases only ever receive rounding noise).

# %%
def serial_reference(tc):
    """serial.sgd with tc, and how far serial SGD without clipping ends from it: (params, losses, distance)."""
    batch = lambda step: corpus.batch(tc.seed, step, tc.batch_size)          # the global batch of every step
    ref, ref_losses = serial.sgd(cfg, tc, batch)
    unclipped, _ = serial.sgd(cfg, replace(tc, clip=0.0), batch)
    return ref, ref_losses, max(rel_err(unclipped[n], ref[n], floor=0.02) for n in ref)


ref, ref_losses, clip_effect = world.bcast(pictures.on_rank0(world, lambda: serial_reference(tc)), root=0)
param_errs = {n: rel_err(p, tp_shards.shard(ref[n], n, grid.tp_rank, TP), floor=0.02) for n, p in run["params"].items()}
replicas = len(set(grid.dp_comm.allgather_obj(params_digest(run["params"]))))
held = set(n for names in world.allgather(sorted(run["params"])) for n in names)
say(f"serial SGD losses: {' '.join(f'{x:.6f}' for x in ref_losses)}")
say(f"3-D grid losses:   {' '.join(f'{x:.6f}' for x in losses)}")
say(f"serial SGD without clipping ends {clip_effect:.1e} away (rel) from serial SGD with it")
check.holds("clipping was active: serial SGD without it ends > 1e-3 away", clip_effect > 1e-3)
check(f"{tc.steps} steps: losses vs serial SGD", max(abs(a - b) / b for a, b in zip(losses, ref_losses)), 1e-9)
check(f"{tc.steps} steps: every rank's shards of its stage vs serial SGD", max(param_errs.values()), 1e-9)
check.equal("distinct digests of the DP replicas of every shard", replicas, 1)
check.equal("parameters held by some rank == the model's", held, set(cfg.param_shapes()))

# %% [markdown]
# ## 8. The command lines
#
# Training (`--help` lists the rest: `--pp-split`, `--schedule gpipe`, `--micro-batches`, `--tp-scheme gather`,
# `--plot DIR` for the per-rank timeline), the layout table and groups, and the check against serial (dp
# defaults to the ranks left over):
#
#     mpirun -n 8 python -m hsgd.train --tp 2 --pp 2 --dp 2
#     mpirun -n 8 python -m hsgd.grid --tp 2 --pp 2
#     mpirun -n 8 python -m hsgd.verify --tp 2 --pp 2
#
# The last through its own `main`, as `python -m` runs it; its return value is the exit code:

# %%
code = hsgd.verify.main(["--tp", "2", "--pp", "2"])
check.equal("mpirun -n 8 python -m hsgd.verify --tp 2 --pp 2: exit code", code, 0)

# %% [markdown]
# ## Check against serial
#
# On 8 ranks, every verdict reached collectively: the ranks sit where the numbering formula says, their
# communicators have the members `grid.groups()` predicts, and on two nodes of 4 hsgd's order sends only dp
# across nodes, Megatron-LM's only pp; on dp 4 x tp 2, the dp replicas hold the same shard of different rows, a
# group's gradient is the shard of its slice's serial gradient, after `dp_average` the shard of the global batch's,
# and the global norm and clipping are serial's; every rank's bytes on the three communicators are `step_formula`'s
# and the closed forms', independent of m; the memory formulas match the trainer and a real forward; `hsgd.verify`
# passes on three layouts and from the command line; and twelve clipped steps of 3-D SGD end with serial SGD's
# parameters, the replicas bit-identical.

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
# | `HybridTrainer.step` (hsgd/step/trainer.py): the group's rows, the tp forward and backward, `dp_average(buf, grid.dp_comm)` of one `FlatBuffer`, clipping, the update | `train_step` (megatron/training/training.py): `forward_backward_func`, then `finalize_model_grads` (megatron/core/distributed/finalize_model_grads.py) calls each chunk's `finish_grad_sync` on `DistributedDataParallel`'s contiguous buffers, then `optimizer.step()` | `DeepSpeedEngine` (deepspeed/runtime/engine.py): `engine.backward(loss)` reduces the gradients (`allreduce_gradients`), `engine.step()` clips and updates | `loss.backward()`, `optimizer.step()` on a module made tensor-parallel by `parallelize_module(model, mesh["tp"], plan)` and data-parallel by `fully_shard(model, mesh=mesh["dp"])` or `DistributedDataParallel` | one function per step of the lecture, no autograd hooks, one buffer and one call after the backward (buckets and overlap: chapter 8) |
# | `optim.global_grad_norm(grads, norm_weight, tp_comm)`: split parameters' squares summed over `tp_comm`, replicated ones counted once | `get_grad_norm_fp32` (megatron/core/optimizer/clip_grads.py) over the gradients passing `param_is_not_shared` and `param_is_not_tensor_parallel_duplicate` | `clip_grad_norm_(parameters, max_norm, mpu=...)` (deepspeed/runtime/utils.py) counts a replicated parameter only on model-parallel rank 0 | `torch.nn.utils.clip_grad_norm_`; with DTensor gradients the sharded norms are reduced over their mesh | 0/1 masks keep the two sums apart, so every tp rank gets the same norm to the last bit |
# | `accounting.traffic.step_formula` and `CommStats`, the layout table of section 4 | none (profilers) | the `"comms_logger"` setting (deepspeed/comm/config.py): each collective's size and time | `CommDebugMode` (torch.distributed.tensor.debug): counts DTensor collectives, without bytes | every term checked against `CommStats`, byte for byte |
# | `HybridTrainer.memory()`, `activation_formula`, section 5's `rank_memory` | `report_theoretical_memory`, `compute_weight_and_optimizer_memory`, `compute_activation_memory` (megatron/training/theoretical_memory_usage.py; the first stage holds `min(num_microbatches, pipeline_model_parallel_size)` micro-batches) | `estimate_zero2_model_states_mem_needs_all_live` (deepspeed/runtime/zero/stage_1_and_2.py) | none | the formulas count hsgd's own caches exactly, checked against `activation_bytes` of a real forward |
# | `hsgd.verify` (every rank's gradient shards against serial) | none | none | none | a parallel step is trusted only once it matches serial |
#
# ## Exercises
#
# ### Exercise 1: 16 ranks on 2 nodes of 8
# For every layout of 16 = dp x pp x tp that this model allows, from the formulas of sections 3 to 5 (B = 64,
# m = 4), compute the busiest stage's memory per rank and bytes per rank and step (payload and sent by a ring);
# place the ranks in hsgd's order on two nodes of 8 consecutive ranks and find which communicators span both.
# Check the rules: tp stays inside a node exactly when tp divides 8, pp crosses exactly when a replica (pp x tp
# ranks) is larger than a node, otherwise dp crosses. Among the layouts that fit a memory budget (the 2 x 2 x 4
# layout's) with tp inside a node, choose the one that sends the fewest bytes between nodes per rank (as an upper
# bound, all a rank sends on a communicator whose groups span both nodes).
# (solution: `tutorials/solutions/10_3d_parallelism.py`, `exercise_1`)
#
# ### Exercise 2: the bytes of another layout
# On the 8 ranks, build `ProcessGrid(world, dp=1, pp=4, tp=2)` and `ProcessGrid(world, dp=4, pp=2, tp=1)`. For
# each, write what one rank sends on each communicator in one step (section 3's closed forms), as payload and as
# bytes a ring sends, run a step of `HybridTrainer`, and check your payloads against `CommStats`.
# (solution: `tutorials/solutions/10_3d_parallelism.py`, `exercise_2`)
#
# ### Exercise 3: Megatron-LM's numbering
# Write the rank of (d, p, t) in Megatron-LM's default order (tp-cp-ep-dp-pp, cp = ep = 1) and its inverse; check
# that it is a bijection of the 8 ranks and reproduce the example in the docstring of Megatron-LM's
# `generate_masked_orthogonal_rank_groups` (order tp-pp-dp, sizes 2-2-2: dp groups [0, 4], [1, 5], [2, 6], [3, 7]).
# Then renumber the world with `world.Split(0, key=...)` so that `ProcessGrid` gives every rank its Megatron-LM
# coordinates; check that its communicators' members (in world ranks) are Megatron-LM's groups, that on two nodes
# of 4 the pp groups cross nodes and the dp groups do not, and that a training step gives the same loss as in
# hsgd's layout.
# (solution: `tutorials/solutions/10_3d_parallelism.py`, `exercise_3`)
#
# ### Exercise 4: the global gradient norm in one All-Reduce over the world
# On dp 4 x tp 2, after one `HybridTrainer.gradients`, compute $\lVert g\rVert$ from `trainer.grads` with a single
# All-Reduce of one float over all 8 ranks, weighting each rank's squares so that every element counts once (a
# split parameter's shard is on dp ranks, a replicated parameter on dp x tp). Check it against the serial norm and
# `global_grad_norm`.
# (solution: `tutorials/solutions/10_3d_parallelism.py`, `exercise_4`)
#
# ### Exercise 5: unequal slices
# Split B = 10 sequences over dp = 4 groups (tp = 2) as 3, 3, 2, 2 rows. Each group's `tp_model.loss_and_grads`
# returns the gradient of the mean loss over *its* rows. Find the weights of the average over `dp_comm` that give
# the serial gradient of the global batch, do it with one All-Reduce, check against serial, and show that the
# plain $1/dp$ average is off.
# (solution: `tutorials/solutions/10_3d_parallelism.py`, `exercise_5`)
