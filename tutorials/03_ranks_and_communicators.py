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
# Chapter 2 ran every collective on `COMM_WORLD`. A training run needs each process to know which part of the
# model it holds, which data it reads and with whom it exchanges what. This chapter builds that map: ranks and
# communicators, `Split(color, key)`, the lecture's P = G x M workers as `hsgd.grid.process_grid.ProcessGrid` with
# its `tp_comm` and `dp_comm` and why the ranks are numbered as they are, collectives running side by side on
# sub-communicators and recorded under their names, sizes that do not fit, and the pipeline dimension.
#
# It needs 8 MPI processes (about 6 s on a quiet 2-core machine; it exits non-zero on every rank if a check fails).
# Rank 0 draws two pictures of the grid into `$HSGD_FIGURES` (default `tutorials/figures/`):
#
# mpirun -n 8 python tutorials/03_ranks_and_communicators.py
#
# Legend: P world size, dp = G (data-parallel replicas), tp = M (workers of one tensor-parallel group),
# pp pipeline stages; `dp_rank`, `tp_rank`, `pp_rank` a rank's coordinates in the grid.

# %%
import os

from hsgd.grid.process_grid import GridError, ProcessGrid   # hsgd before NumPy: it sets OpenBLAS's thread timeout first

import numpy as np
from mpi4py import MPI

import pictures                      # tutorials/pictures.py: the grid drawn with its communicators
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
# `mpirun -n 8 python script.py` starts 8 ordinary processes running the same file, sharing nothing and
# cooperating only by messages: SPMD (single program, multiple data).
#
# A **communicator** is a group of processes plus a private channel, so its messages never mix with another's;
# inside it each process has a **rank** 0 .. size-1. MPI starts with `COMM_WORLD`, all P processes; the rank in it,
# the "world rank", names a process in the rest of hsgd, which will also have ranks in the smaller communicators
# below.
#
# A collective completes only when every rank of *its communicator* has called it: only the members take part and
# wait, and a member that calls something else, or nothing, leaves the others waiting (chapter 2's
# `HSGD_CHECK_COLLECTIVES=1` turns the first case into an error). That is why each chapter's `check` is collective
# over `COMM_WORLD`: an `allgather` of the errors makes every rank see a failure and raise together. Every rank
# reports who it is, `gather`ed on rank 0:

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
# `comm.Split(color, key)` is collective over `comm`: ranks passing the same **color** land in one new communicator,
# numbered 0, 1, ... in the order of their **key** (ties by old rank), and each gets back its own. Below: evens and
# odds (color = rank % 2), with key = rank and key = -rank (reversed); a lowercase `allreduce` on each sums its
# members' world ranks, 0+2+4+6 = 12 and 1+3+5+7 = 16.

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
# The lecture's section 2 groups the P workers into **G model-parallel groups of M workers**, P = G x M: the M
# workers of a group split one copy of the model (tensor parallelism, every weight cut into M pieces, section 3.1),
# and the G groups are data-parallel replicas on different data. hsgd calls them `tp` = M and `dp` = G, adds `pp`
# for pipeline stages (section 6; here pp = 1), and writes every layout as P = dp x pp x tp.
#
# `ProcessGrid(world, dp=4, tp=2)` numbers the ranks **tp fastest, then pp, then dp**:
#
#     rank = (dp_rank * pp + pp_rank) * tp + tp_rank
#
# and builds one communicator per dimension with `Split`:
#
# * `tp_comm`: color (dp_rank, pp_rank), key tp_rank: the M ranks holding one copy of the model, where sections
#   3.2-3.3 communicate in every layer (the forward's All-Gather, the backward's Reduce-Scatter and All-Reduce).
# * `dp_comm`: color (pp_rank, tp_rank), key dp_rank: the G ranks at the same position in every group, holding the
#   **same parameter shard**: section 3.4's "cross-group communication set", which all-reduces that shard's gradient.
#
# **Why this order.** tp carries the most bytes, every layer, forward and backward, with the next layer waiting,
# so it must stay on a node's fastest links. `mpirun` gives each node a block of consecutive ranks, so with tp
# fastest a tensor-parallel group sits inside one node on NVLink: the lecture's hierarchical communication
# (section 4.1). dp outermost makes each replica a contiguous block (the lecture's G groups of M consecutive
# workers), and the dp All-Reduce, once per step and overlappable with the backward (chapter 8), is what crosses
# nodes. Megatron-LM orders the other two the other way round (section 6).
#
# The picture is drawn from hsgd's formula; the checks after it confirm that every rank's own coordinates and the
# members `Split` produced are the ones drawn.

# %%
def members(grid):
    """{dim: the world ranks of my dim_comm, in the order of their rank there}. Collective: an allgather of
    world ranks on each communicator."""
    return {dim: getattr(grid, f"{dim}_comm").allgather_obj(rank) for dim in ("tp", "pp", "dp")}


def predicted(grid):
    """{dim: the group of grid.groups()[dim] that holds me}, computed without communicating."""
    return {dim: next(g for g in groups if rank in g) for dim, groups in grid.groups().items()}


grid = ProcessGrid(world, dp=4, tp=2)
table = grid.layout_table()                                      # collective: every rank's coordinates and host
say(f"P = {P} ranks = G {grid.dp} groups (dp) x M {grid.tp} workers (tp)\n")
say(table)
for dim, groups in grid.groups().items():
    say(f"{dim}_comm groups: {groups}")
if rank == 0:
    say("picture:", pictures.grid(4, 1, 2, "03_grid_dp4_tp2"))
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

check.equal("rank == (dp_rank*pp + pp_rank)*tp + tp_rank",
            rank, ProcessGrid.rank_of(grid.dp_rank, grid.pp_rank, grid.tp_rank, grid.pp, grid.tp))
check.equal("my rank in tp_comm is tp_rank, in dp_comm dp_rank",
            (grid.tp_comm.rank, grid.dp_comm.rank), (grid.tp_rank, grid.dp_rank))
check.equal("communicator members == grid.groups()", members(grid), predicted(grid))

# %% [markdown]
# The picture: 4 replicas (columns) of one tensor-parallel group each; a blue bar joins each `tp_comm`'s 2
# consecutive ranks, a red dashed line each `dp_comm`'s 4 ranks (ranks 0, 2, 4, 6 hold the first shard, 1, 3, 5, 7
# the second). The `host` column is the same here (one machine); with two GPUs per node each tp_comm would sit on
# one host and each dp_comm span four. `python -m hsgd.grid` prints this table for any sizes:
#
#     mpirun -n 8 python -m hsgd.grid --tp 2          # dp defaults to P / (pp * tp) = 4

# %% [markdown]
# ## 4. Collectives on the sub-communicators
#
# What is new is only *where* the collectives run: on `grid.tp_comm` and `grid.dp_comm`, `hsgd.grid.comm.Comm`
# objects (chapter 2). Every rank makes a vector x_r of N numbers from its own seed; `grid.tp_comm.Allreduce(a)`
# sums over my tensor-parallel pair (the shape of section 3.3's All-Reduce of dL/dX), `grid.dp_comm.Allreduce(b)`
# over the 4 ranks holding my shard (section 3.4). The four tp_comms, and the two dp_comms, run at the same time,
# each over its own members. Serial reference: every rank rebuilds all 8 inputs from their seeds and NumPy sums
# its groups' rows, equal to rounding (MPI may add in another order).
#
# This is *not* the lecture's "two-dimensional mesh All-Reduce" (end of section 3.4), which syncs one shard's
# gradient *within one dp_comm* by viewing its G ranks as a mesh (n per node times k nodes) and reducing along one
# dimension, then the other, then gathering back. hsgd's hierarchical all-reduce (chapter 8) is such an algorithm;
# exercise 4 builds its two communicators with `Split`.

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

say(f"rank 0: x         = {np.array2string(x, precision=3)}")
say(f"rank 0: tp sum    = {np.array2string(a, precision=3)}   (ranks {my_tp})")
say(f"rank 0: dp sum    = {np.array2string(b, precision=3)}   (ranks {my_dp})")
check("max |tp_comm Allreduce - NumPy sum over the group|", float(np.max(np.abs(a - X[my_tp].sum(axis=0)))),
      1e-12)
check("max |dp_comm Allreduce - NumPy sum over the shard|", float(np.max(np.abs(b - X[my_dp].sum(axis=0)))),
      1e-12)

# %% [markdown]
# Every `Comm` call adds to a `CommStats` shared by the grid's communicators, under (communicator name, operation):
# calls, payload bytes, seconds. The **payload** is the logical tensor, N float64 = 40 bytes per Allreduce on any
# communicator; what a rank sends grows with the communicator's size n, $2(n-1)/n$ times the payload for a ring
# All-Reduce (chapter 2), which is why the course quotes both columns. Rank 0's table:

# %%
say(grid.stats.format())
say(f"\n{'communicator':<13}{'ranks n':>8}{'calls':>7}{'payload':>10}{'ring bytes sent per rank':>27}")
for name, comm in (("tp", grid.tp_comm), ("dp", grid.dp_comm)):
    calls, payload = grid.stats.counts()[(name, "Allreduce")]
    say(f"{name:<13}{comm.size:>8}{calls:>7}{payload:>10}{2 * (comm.size - 1) / comm.size * payload:>27.0f}")
check.equal("stats: 1 Allreduce of N float64 on each of tp, dp", grid.stats.counts(),
            {("dp", "Allreduce"): (1, N * 8), ("tp", "Allreduce"): (1, N * 8)})
grid.free()

# %% [markdown]
# ## 5. Sizes that do not fit
#
# dp x pp x tp must equal the number of ranks. `ProcessGrid` checks it first, from numbers every rank knows, so
# every rank raises the same `GridError` before any communication (none is left in a `Split`), saying what would
# work. `GridError` is a `UsageError`: the entry points print `hsgd: error: ...` once and exit with code 2 (e.g.
# `mpirun -n 8 python -m hsgd.grid --dp 3 --tp 2`).

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
# into pp stages of consecutive layers. `pp_comm` joins the stages of one pipeline (same dp_rank and tp_rank),
# which pass one activation forward and one gradient back per micro-batch, to neighbours only: the **least**
# traffic of the three (tp moves activations every layer, dp the stage's whole gradient every step). `dp_comm` now
# joins the ranks holding the same shard of the same stage.
#
# hsgd puts pp between tp and dp, so a replica stays contiguous and the dp All-Reduce crosses nodes. Megatron-LM
# orders by bytes instead: default `"tp-cp-ep-dp-pp"` (tp fastest, pp slowest; `RankGenerator` and
# `initialize_model_parallel(order=...)` in megatron/core/parallel_state.py), as does DeepSpeed's
# `PipeModelDataParallelTopology` (axes `pipe, data, model`, the last fastest): there the pipeline's sends cross
# nodes and the dp All-Reduce stays inside. Both keep tp inside the node; which other one should cross depends on
# the network and on overlap (exercise 1 builds Megatron's order). Here dp = 2, pp = 2, tp = 2, nodes of 4
# consecutive ranks:

# %%
grid3 = ProcessGrid(world, dp=2, pp=2, tp=2)
say(grid3.layout_table())
for dim, groups in grid3.groups().items():
    say(f"{dim}_comm groups: {groups}")
hosts = [f"node {r // 4}" for r in range(P)]                     # 4 consecutive ranks per node
if rank == 0:
    say("picture:", pictures.grid(2, 2, 2, "03_grid_dp2_pp2_tp2", hosts=hosts))
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws
crossing = [dim for dim, groups in grid3.groups().items()            # a group with ranks on two nodes
            if any(len({hosts[r] for r in g}) > 1 for g in groups)]
say(f"with 4 ranks per node: {', '.join(d + '_comm' for d in crossing)} crosses nodes; "
    f"{', '.join(d + '_comm' for d in ('tp', 'pp', 'dp') if d not in crossing)} stay inside one")
check.equal("dp=2 pp=2 tp=2: rank == (dp_rank*pp+pp_rank)*tp + tp_rank",
            rank, ProcessGrid.rank_of(grid3.dp_rank, grid3.pp_rank, grid3.tp_rank, 2, 2))
check.equal("dp=2 pp=2 tp=2: communicator members == grid.groups()", members(grid3), predicted(grid3))
check.equal("4 ranks per node: the communicators that cross nodes", crossing, ["dp"])
grid3.free()

# %% [markdown]
# The picture: two replicas (columns), each a pipeline of two stages (rows, green arrows), each stage a
# tensor-parallel pair (blue), on two nodes of 4 ranks (grey): every tp_comm and pp_comm inside a node, every
# dp_comm (red dashed) across both.
#
# ## Check against serial
#
# On all 8 ranks, every verdict collective:
#
# * `Split(color, key)` groups by color and numbers by key, as predicted;
# * `ProcessGrid` places ranks tp fastest, and every `tp_comm`, `pp_comm` and `dp_comm` has exactly the members
#   `grid.groups()` computes without communicating (dp=4 tp=2 and dp=2 pp=2 tp=2); with nodes of 4 consecutive
#   ranks only dp_comm crosses nodes;
# * Allreduce over `tp_comm` and `dp_comm` equals NumPy's sum from everyone's input, to rounding, and the accounting
#   records exactly those calls;
# * sizes whose product is not 8 raise the same `GridError` on every rank, before any communication.
#
# Chapter 4 puts `dp_comm` to work: data-parallel SGD.

# %%
_, worst = check.worst()                             # the numerical checks: the Allreduces against NumPy
say(f"chapter 3: all {len(check.passed)} checks passed on {P} ranks; largest numerical difference from NumPy "
    f"{worst:.1e}")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# Every framework builds this grid; they differ in the order of the dimensions and in how groups are made: with
# `Split` each rank names its own group in one call, while `torch.distributed.new_group(ranks)` is called by every
# rank for every group.
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `ProcessGrid(world, dp, pp, tp)`: rank = (dp_rank * pp + pp_rank) * tp + tp_rank | `initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size, ..., order="tp-cp-ep-dp-pp")` with `RankGenerator` (megatron/core/parallel_state.py): tp fastest, pp slowest | `PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`: axes `["pipe", "data", "model"]`, row-major, so model (tp) fastest and pipe slowest (deepspeed/runtime/pipe/topology.py) | `init_device_mesh("cuda", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))` (torch/distributed/device_mesh.py): a row-major mesh, the last dimension fastest | dp outermost: a replica is a contiguous block (the lecture's G groups of M workers) |
# | `grid.tp_comm` (Split: color (dp_rank, pp_rank), key tp_rank) | `get_tensor_model_parallel_group()` | `PipelineParallelGrid.get_slice_parallel_group()` (the `model` axis) | `mesh.get_group("tp")` or `mesh["tp"]` | the communicator is passed as an argument, never looked up in a global |
# | `grid.dp_comm` | `get_data_parallel_group()` | `PipelineParallelGrid.get_data_parallel_group()` | `mesh.get_group("dp")` | as above |
# | `grid.pp_comm` | `get_pipeline_model_parallel_group()` | `PipelineParallelGrid.get_pipe_parallel_group()` | `mesh.get_group("pp")` | as above |
# | `comm.Split(color, key)` | `create_group(ranks)`, a wrapper of `torch.distributed.new_group`, called for every group by every rank | `dist.new_group(ranks=...)` for every group of `get_axis_comm_lists` | `torch.distributed.new_group(ranks)`; `torch.distributed.split_group` splits an existing group | one collective call, each rank naming only its own group |
# | `grid.groups()`: who is with whom, without communicating | `RankGenerator.get_ranks("dp")` (`generate_masked_orthogonal_rank_groups`) | `ProcessTopology.get_axis_comm_lists("data")` | the mesh tensor `DeviceMesh.mesh` | - |
# | `CommStats`: calls and payload bytes per (communicator, operation) | none | `CommsLogger` (deepspeed/utils/comms_logging.py): message size per op, and a "busbw" with 2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter | `CommDebugMode` (torch.distributed.tensor.debug) counts the collectives, not their bytes | exact counts, compared with formulas by the tests |
#
# ## Exercises
#
# ### Exercise 1: Megatron-LM's rank order, built with Split
# Megatron-LM's `"tp-cp-ep-dp-pp"` (cp = ep = 1) numbers rank = (pp_rank * dp + dp_rank) * tp + tp_rank. For
# dp = pp = tp = 2, build each rank's tp, pp and dp communicators in that order with `world.Split(color, key)` and
# check their members against your prediction. Which communicators match hsgd's, and, with nodes of 4 consecutive
# ranks, which one crosses nodes in each order?
# (solution: `tutorials/solutions/03_ranks_and_communicators.py`, `exercise_1`)
#
# ### Exercise 2: the ranks of one node, with Split_type
# `world.Split_type(MPI.COMM_TYPE_SHARED)` groups the ranks of one node. Check that its members are the world
# ranks with your `MPI.Get_processor_name()` (gather the names), and that your rank in it (the "local rank" that
# picks a GPU, chapter 21, `hsgd.train.local_ranks`) is your position among them. Then, pretending nodes of 4
# ranks (color = rank // 4), check which ranks of your dp_comm (dp=4 tp=2) share your "node".
# (solution: `tutorials/solutions/03_ranks_and_communicators.py`, `exercise_2`)
#
# ### Exercise 3: the grid of 12 ranks
# Write `groups(dp, pp, tp)`, every communicator's members from hsgd's formula alone. For every factorization
# dp x pp x tp = 12 (`hsgd.grid.process_grid.factorizations`) check that every rank is in one group per dimension
# and every tp group is consecutive ranks. On the 8 ranks, check it against `ProcessGrid(world, dp, pp,
# tp).groups()` and the communicators' members, for every factorization of 8.
# (solution: `tutorials/solutions/03_ranks_and_communicators.py`, `exercise_3`)
#
# ### Exercise 4: the lecture's 2-D mesh all-reduce on one dp_comm
# In the dp=8 grid, view dp_comm as 2 "nodes" x 4 consecutive ranks. Build both directions with `Split` on dp_comm
# (one node; the same position in every node) and sum a gradient in three steps: Reduce-Scatter in the node,
# All-Reduce of the chunk across nodes, All-Gather in the node. Check it against a flat `dp_comm.Allreduce` and
# `hsgd.dp.hierarchical.hierarchical_allreduce`, and print each step's payload and ring bytes next to the flat one's.
# (solution: `tutorials/solutions/03_ranks_and_communicators.py`, `exercise_4`)
