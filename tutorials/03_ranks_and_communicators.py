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
# # Chapter 3: ranks, communicators and the process grid
#
# Chapter 1 ran on one process. From here on hsgd runs on P processes at once, and before any of them trains
# anything, each has to know where it stands: which part of the model it holds, which data it reads, and
# which other processes it exchanges what with. This chapter builds that map. It covers
#
# 1. what an MPI rank and an MPI communicator are;
# 2. `Split(color, key)`, the one call that makes smaller communicators out of a big one;
# 3. the lecture's picture of P = G x M workers, as `hsgd.grid.ProcessGrid`, with a communicator for the
#    M workers of one group (`tp_comm`) and one for the G workers that hold the same parameter shard
#    (`dp_comm`);
# 4. a first explicit collective on each communicator, checked against the sum NumPy computes from every
#    rank's input, and the byte accounting that hsgd keeps for every collective;
# 5. what happens when the sizes do not fit the number of processes;
# 6. the third dimension, pipeline parallelism.
#
# The chapter needs 8 MPI processes. Run it as a script (a few seconds; it exits non-zero on every rank if
# any check fails):
#
# mpirun -n 8 python tutorials/03_ranks_and_communicators.py
#
# (`mpiexec` is the same launcher under its standard name). Opened as a notebook
# (`jupytext --to ipynb tutorials/03_ranks_and_communicators.py`) it reads the same, but a notebook kernel is
# a single process, so the cells only run under `mpirun`.
#
# Legend: P world size, dp = G (data-parallel replicas), tp = M (workers of one tensor-parallel group),
# pp pipeline stages; `dp_rank`, `tp_rank`, `pp_rank` a rank's coordinates in the grid.

# %%
import os

import numpy as np
from mpi4py import MPI

from hsgd.grid import GridError, ProcessGrid

from checks import Checks            # tutorials/checks.py: the collective check every chapter uses

world = MPI.COMM_WORLD               # every process that mpirun started
rank = world.Get_rank()              # who am I: 0 .. P-1
P = world.Get_size()                 # how many of us
# check(what, err, tol), check.holds(what, cond), check.equal(what, a, b): on every rank, in the same order; rank 0
# prints the verdict (the worst err over the ranks), and every rank raises unless it holds on all of them
check = Checks(world, width=62, prefix="  check: ")
say = check.say                      # print once, from rank 0

if P != 8:                           # every rank sees the same P, so every rank stops here together
    raise RuntimeError(f"this chapter needs 8 ranks, got {P}: "
                       "mpirun -n 8 python tutorials/03_ranks_and_communicators.py")

# %% [markdown]
# ## 1. Ranks and communicators
#
# `mpirun -n 8 python script.py` starts 8 copies of the same program. They are ordinary operating-system
# processes: each has its own memory and runs every line of this file, and nothing is shared between them.
# They cooperate only by sending messages. This style is called SPMD (single program, multiple data): one
# program, whose behaviour depends on who runs it.
#
# A **communicator** is a group of processes that can talk to each other, plus a private channel, so that
# messages sent in one communicator never mix with those of another. Inside a communicator of `size`
# processes, each has a **rank** 0 .. size-1. MPI starts the program with one communicator, `COMM_WORLD`,
# which holds all P processes; a process's rank in it is the "world rank", the name we give a process in the
# rest of hsgd. The same process will also have other ranks in the smaller communicators built below.
#
# A **collective** (Allreduce, Allgather, Bcast, ...) is a call that every rank of a communicator makes
# together, and which completes only when all of them have made it. A rank that skips a collective, or
# calls a different one, leaves the others waiting forever. That is why even the `check` of every chapter
# (`tutorials/checks.py`) is collective: an `allgather` gives every rank every rank's error, so a failing
# check is found on every rank, and all of them raise together.
#
# Let every rank report who it is. `gather` collects one small Python object from every rank on rank 0.

# %%
me = (rank, P, os.getpid(), MPI.Get_processor_name())
everyone = world.gather(me, root=0)                  # on rank 0: [me of rank 0, me of rank 1, ...]; else None
say(f"{'world rank':>10} {'size':>5} {'pid':>8}  host")
for r, size, pid, host in everyone or []:
    say(f"{r:>10} {size:>5} {pid:>8}  {host}")
check.holds("COMM_WORLD ranks are 0..P-1, each once",
            everyone is None or sorted(e[0] for e in everyone) == list(range(P)))

# %% [markdown]
# ## 2. `Split(color, key)`: smaller communicators
#
# `comm.Split(color, key)` is collective over `comm`. Every rank passes two integers; ranks that pass the
# same **color** end up together in a new communicator, and inside it they are numbered 0, 1, ... in the
# order of their **key** (ties broken by the old rank). Each rank gets back only the communicator it belongs
# to.
#
# A direct mpi4py example: split the 8 ranks into the even ones and the odd ones (color = rank % 2). With
# key = rank, new ranks follow world ranks; with key = -rank the order is reversed. A lowercase `allreduce`
# on the new communicator then sums the world ranks of its members only: 0+2+4+6 = 12 for the evens,
# 1+3+5+7 = 16 for the odds.

# %%
color = rank % 2                                     # 0: the even ranks, 1: the odd ranks
parity = world.Split(color=color, key=rank)          # new ranks in world-rank order
backwards = world.Split(color=color, key=-rank)      # the same members, numbered from the other end
row = (rank, color, parity.Get_rank(), parity.Get_size(), backwards.Get_rank(),
       parity.allreduce(rank, op=MPI.SUM))           # the sum of the world ranks of my new communicator only
rows = world.gather(row, root=0)
say(f"{'world rank':>10} {'color':>6} {'new rank (key=rank)':>20} {'new size':>9} {'new rank (key=-rank)':>21}"
    f" {'sum of members':>15}")
for r, c, nr, ns, br, s in rows or []:
    say(f"{r:>10} {c:>6} {nr:>20} {ns:>9} {br:>21} {s:>15}")

half = P // 2
check.equal("Split: (new rank, new size, rank for key=-rank, member sum)", row[2:],
            (rank // 2, half, half - 1 - rank // 2, sum(range(color, P, 2))))
parity.Free()                                        # communicators are MPI resources: free what you split
backwards.Free()

# %% [markdown]
# ## 3. The process grid: P = G x M
#
# Section 2 of the lecture groups the P workers into **G model-parallel groups of M workers each**, P = G x M.
# Inside a group the M workers split one copy of the model between them (tensor parallelism: every weight matrix
# cut into M pieces, section 3.1); the G groups are data-parallel replicas of each other, each working on
# different data. hsgd calls these sizes `tp` = M and `dp` = G, and adds a third one, `pp`, for pipeline stages
# (section 6; here pp = 1). G and M are the lecture's names; from here on hsgd writes every layout as
# P = dp x pp x tp.
#
# `hsgd.grid.ProcessGrid(world, dp=4, tp=2)` gives each world rank its coordinates, with tp varying fastest:
#
#     rank = (dp_rank * pp + pp_rank) * tp + tp_rank
#
# and builds one communicator per dimension with `Split`, exactly as in section 2:
#
# * `tp_comm`: color = which group I am in (dp_rank, pp_rank), key = tp_rank. The M ranks of one group,
#   which together hold one copy of the model. Sections 3.2-3.3 of the lecture communicate here, in every
#   layer: the All-Gather of the forward pass, its Reduce-Scatter and the All-Reduce of dL/dX in the backward.
# * `dp_comm`: color = my position inside the group (pp_rank, tp_rank), key = dp_rank. The G ranks, one per
#   group, that sit at the same position and therefore hold the **same parameter shard**. This is section 3.4's
#   "cross-group communication set": the "first GPU" of every tensor-parallel group holds W_part1, and
#   these G ranks, and only they, all-reduce the gradient of W_part1.
#
# Why tp fastest? On a cluster, `mpirun` normally gives each node a block of consecutive ranks (ranks 0-7 on
# the first node, 8-15 on the second, ...). With tp fastest, a tensor-parallel group is a block of
# consecutive ranks and so sits inside one node, on the fast links between its GPUs (NVLink), while `dp_comm`
# crosses nodes. That is the lecture's hierarchical communication (section 4.1). The tensor-parallel
# traffic comes in every layer, forward and backward, and the next layer cannot start before it is done, so it
# gets the fast links; the data-parallel gradient sync comes once per step and can overlap the backward pass.
#
# The picture below is drawn from the coordinates each rank computed for itself (gathered from all 8 ranks),
# not typed in by hand.

# %%
def grid_picture(grid):
    """Where every world rank sits, one row per (dp, pp) group, one column per tp_rank. Collective."""
    coords = grid.base.allgather((grid.dp_rank, grid.pp_rank, grid.tp_rank, grid.rank))
    at = {(d, p, t): r for d, p, t, r in coords}                  # (dp_rank, pp_rank, tp_rank) -> world rank
    w, lw = 11, 16 if grid.pp == 1 else 28                       # width of a column, of the row labels
    lines = [" " * lw + "".join(f"{f'tp_rank {t}':^{w}}" for t in range(grid.tp))]
    for d in range(grid.dp):
        for p in range(grid.pp):
            label = f"replica dp {d}" + (f", stage pp {p}" if grid.pp > 1 else "")
            members = [at[d, p, t] for t in range(grid.tp)]
            lines.append(f"{label + ':':<{lw}}" + "".join(f"{r:^{w}}" for r in members) + f"  <- tp_comm {members}")
    if grid.pp == 1:                                             # then each dp_comm is one column
        lines.append(" " * lw + "".join(f"{'^':^{w}}" for _ in range(grid.tp)))
    for p in range(grid.pp):
        for t in range(grid.tp):
            where = f"tp_rank {t}" + (f" of stage pp {p}" if grid.pp > 1 else "")
            members = [at[d, p, t] for d in range(grid.dp)]
            lines.append(f"  dp_comm {members}: the {where} of every replica (the same shard)")
    return "\n".join(line.rstrip() for line in lines)


def members(grid):
    """{dim: the world ranks of my dim_comm, in the order of their rank there}. Collective: an allgather of
    world ranks on each communicator."""
    return {dim: getattr(grid, f"{dim}_comm").allgather_obj(rank) for dim in ("tp", "pp", "dp")}


def predicted(grid):
    """{dim: the group of grid.groups()[dim] that holds me}, computed without communicating."""
    return {dim: next(g for g in groups if rank in g) for dim, groups in grid.groups().items()}


grid = ProcessGrid(world, dp=4, tp=2)
picture = grid_picture(grid)
table = grid.layout_table()                                      # collective, like the picture
say(f"P = {P} ranks = G {grid.dp} groups (dp) x M {grid.tp} workers (tp)\n")
say(picture)
say()
say(table)
for dim, groups in grid.groups().items():
    say(f"{dim}_comm groups: {groups}")

check.equal("rank == (dp_rank*pp + pp_rank)*tp + tp_rank",
            rank, ProcessGrid.rank_of(grid.dp_rank, grid.pp_rank, grid.tp_rank, grid.pp, grid.tp))
check.equal("my rank in tp_comm is tp_rank, in dp_comm dp_rank",
            (grid.tp_comm.rank, grid.dp_comm.rank), (grid.tp_rank, grid.dp_rank))
check.equal("communicator members == grid.groups()", members(grid), predicted(grid))

# %% [markdown]
# The `host` column is the same everywhere here because all ranks run on one machine. On a cluster with two
# GPUs per node, each tp_comm row of the picture would sit on one host, and each dp_comm column would span
# all four.
#
# `python -m hsgd.grid` prints the same table for any sizes, without writing any code:
#
#     mpirun -n 8 python -m hsgd.grid --tp 2          # dp defaults to P / (pp * tp) = 4

# %% [markdown]
# ## 4. A first collective on each communicator
#
# hsgd never calls mpi4py's collectives directly in its parallel code. It goes through the thin wrappers in
# `hsgd.comm.Comm` (what `grid.tp_comm` and `grid.dp_comm` are): the same uppercase buffer methods, on
# contiguous NumPy arrays, in place, plus one line of accounting per call. Uppercase methods send the array's
# memory as it is; the lowercase ones used above pickle Python objects, fine for a few numbers of metadata
# and too slow for tensors.
#
# Every rank r makes a vector x_r of N numbers from its own seed. Then
#
# * `grid.tp_comm.Allreduce(a)`: every rank of a group gets the sum over its group, $\sum_{t} x_{(d, t)}$.
#   This is the shape of section 3.3's All-Reduce of the partial dL/dX within a group.
# * `grid.dp_comm.Allreduce(b)`: every rank gets the sum over the ranks that hold the same shard,
#   $\sum_{d} x_{(d, t)}$. This is section 3.4: G gradients of one shard, one per replica, summed.
# * both in a row: summing within each group and then across groups adds up every rank's vector once, so each
#   rank ends with the sum over the whole world, $\sum_r x_r$. This two-step all-reduce is the "2-D mesh"
#   idea the lecture mentions at the end of section 3.4.
#
# The check against serial: every rank rebuilds all 8 inputs from their seeds (no communication at all),
# and NumPy sums the rows that belong to its groups. Floating-point addition is not associative and MPI may
# add in a different order than `np.sum`, so the two agree to rounding (about 1e-16 here), not always to the
# last bit.

# %%
N = 5


def x_of(r):
    """The input vector of world rank r: from r's own seed, so that anyone can rebuild it."""
    return np.random.default_rng(r).standard_normal(N)          # (N,)


x = x_of(rank)                                                   # (N,) this rank's input
X = np.stack([x_of(r) for r in range(P)])                        # (P, N) the serial view: everyone's input
my_tp = next(g for g in grid.groups()["tp"] if rank in g)        # world ranks of my tp_comm
my_dp = next(g for g in grid.groups()["dp"] if rank in g)        # world ranks of my dp_comm

a = x.copy()
grid.tp_comm.Allreduce(a)          # a <- sum of x over my tensor-parallel group (M = 2 vectors)
b = x.copy()
grid.dp_comm.Allreduce(b)          # b <- sum of x over the replicas of my shard (G = 4 vectors)
c = x.copy()
grid.tp_comm.Allreduce(c)          # c <- sum over my group ...
grid.dp_comm.Allreduce(c)          # ... then over the groups: every rank's x, once

say(f"rank 0: x         = {np.array2string(x, precision=3)}")
say(f"rank 0: tp sum    = {np.array2string(a, precision=3)}   (ranks {my_tp})")
say(f"rank 0: dp sum    = {np.array2string(b, precision=3)}   (ranks {my_dp})")
say(f"rank 0: tp, dp    = {np.array2string(c, precision=3)}   (all {P} ranks)")
check("max |tp_comm Allreduce - NumPy sum over the group|", float(np.max(np.abs(a - X[my_tp].sum(axis=0)))),
      1e-12)
check("max |dp_comm Allreduce - NumPy sum over the shard|", float(np.max(np.abs(b - X[my_dp].sum(axis=0)))),
      1e-12)
check("max |tp then dp Allreduce - NumPy sum over all ranks|", float(np.max(np.abs(c - X.sum(axis=0)))), 1e-12)

# %% [markdown]
# Every call through a `Comm` adds one line to a `CommStats` that all communicators of the grid share, under
# (communicator name, operation): the number of calls, the payload bytes and the seconds spent. The payload
# is the size of the logical tensor of the call, here N float64 = 40 bytes per Allreduce; how many bytes
# actually cross the wires depends on MPI's algorithm (a ring all-reduce sends about 2 (n-1)/n times the
# payload from each rank). These counts are what later chapters compare with their communication formulas.
# The table is per process; this is rank 0's.

# %%
say(grid.stats.format())
expected = {("dp", "Allreduce"): (2, 2 * N * 8), ("tp", "Allreduce"): (2, 2 * N * 8)}
check.equal("stats: 2 Allreduces of N float64 on each of tp, dp", grid.stats.counts(), expected)
grid.free()

# %% [markdown]
# ## 5. Sizes that do not fit
#
# dp x pp x tp must equal the number of ranks. `ProcessGrid` checks that first, from numbers every rank
# already knows (its arguments and the size of the base communicator), so when the sizes are wrong every rank
# raises the same `GridError` before any communication, and no rank is left waiting in a `Split` the others
# never reach. The message says what would work. (`GridError` is a `UsageError`: the entry points print it
# once as `hsgd: error: ...` and exit with code 2, e.g. `mpirun -n 8 python -m hsgd.grid --dp 3 --tp 2`.)

# %%
for sizes in (dict(dp=3, tp=2), dict(dp=8, tp=0)):
    args = ", ".join(f"{k}={v}" for k, v in sizes.items())
    try:
        ProcessGrid(world, **sizes)
        message = ""
    except GridError as e:
        message = str(e)
    messages = world.allgather(message)                           # what each rank saw
    say(f"ProcessGrid(world, {args}) -> GridError: {messages[0]}")
    check.holds(f"{args}: every rank raised the same GridError", all(m and m == messages[0] for m in messages))

# %% [markdown]
# ## 6. The third dimension: pipeline stages
#
# Pipeline parallelism (the lecture's section 3.1: "assign different layers to different nodes") cuts the model
# into pp stages of consecutive layers. hsgd places pp between tp and dp: within one replica, the stages
# come one after another, each stage being a tensor-parallel group. `pp_comm` joins the stages of one
# pipeline (same dp_rank, same tp_rank): they pass activations forward and gradients backward, to their
# neighbours only, once per micro-batch. That is less traffic than tensor parallelism (every layer) but more
# than data parallelism (once per step), hence the middle place. `dp_comm` now joins the ranks that hold the
# same shard of the same stage.
#
# With 8 ranks as dp = 2, pp = 2, tp = 2:

# %%
grid3 = ProcessGrid(world, dp=2, pp=2, tp=2)
picture3 = grid_picture(grid3)
say(picture3)
for dim, groups in grid3.groups().items():
    say(f"{dim}_comm groups: {groups}")
check.equal("dp=2 pp=2 tp=2: rank == (dp_rank*pp+pp_rank)*tp + tp_rank",
            rank, ProcessGrid.rank_of(grid3.dp_rank, grid3.pp_rank, grid3.tp_rank, 2, 2))
check.equal("dp=2 pp=2 tp=2: communicator members == grid.groups()", members(grid3), predicted(grid3))
grid3.free()

# %% [markdown]
# ## Check against serial
#
# What this chapter established, on all 8 ranks and with every verdict reached collectively:
#
# * `Split(color, key)` groups ranks by color and numbers them by key, as predicted;
# * `ProcessGrid` places ranks tp fastest, `rank = (dp_rank * pp + pp_rank) * tp + tp_rank`, and the members of
#   every `tp_comm`, `pp_comm` and `dp_comm` it splits off are exactly the groups `grid.groups()` computes
#   without communicating (for dp=4 tp=2 and for dp=2 pp=2 tp=2);
# * an Allreduce over `tp_comm`, over `dp_comm`, and over both in a row equals the sum NumPy computes on one
#   rank from everyone's input (the serial reference), to rounding; and the byte accounting records exactly
#   those calls;
# * sizes whose product is not 8 raise the same `GridError` on every rank, before any communication.
#
# Chapter 5 puts `tp_comm` to work: linear layers whose weight matrices are split across the group.

# %%
_, worst = check.worst()                             # the numerical checks: the Allreduces against NumPy
say(f"chapter 3: all {len(check.passed)} checks passed on {P} ranks; largest numerical difference from NumPy "
    f"{worst:.1e}")
