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
# Chapter 2 ran every collective on all processes at once, on `COMM_WORLD`. A training run needs more structure:
# before any process trains anything, each has to know where it stands, which part of the model it holds, which
# data it reads, and with which other processes it exchanges what. This chapter builds that map. It covers
#
# 1. what an MPI rank and an MPI communicator are;
# 2. `Split(color, key)`, the one call that makes smaller communicators out of a big one;
# 3. the lecture's picture of P = G x M workers, as `hsgd.grid.process_grid.ProcessGrid`, with a communicator for the
#    M workers of one group (`tp_comm`) and one for the G workers that hold the same parameter shard
#    (`dp_comm`), and why hsgd numbers the ranks the way it does;
# 4. what is new about collectives on these sub-communicators (chapter 2 explains what each collective does):
#    several run side by side, each over its own members, and hsgd's byte accounting records each one under its
#    communicator's name;
# 5. what happens when the sizes do not fit the number of processes;
# 6. the third dimension, pipeline parallelism.
#
# The chapter needs 8 MPI processes. Run it as a script (about 6 s on a quiet 2-core machine; it exits non-zero
# on every rank if any check fails):
#
# mpirun -n 8 python tutorials/03_ranks_and_communicators.py
#
# (`mpiexec` is the same launcher under its standard name). Opened as a notebook
# (`jupytext --to ipynb tutorials/03_ranks_and_communicators.py`) it reads the same, but a notebook kernel is
# a single process, so the cells only run under `mpirun`. Rank 0 draws two pictures of the grid into
# `$HSGD_FIGURES` (default `tutorials/figures/`).
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
# A collective (chapter 2) completes only when every rank of *its communicator* has called it. On a smaller
# communicator that means: only its members take part, and only they wait for each other; a member that calls a
# different collective, or none, leaves the others waiting forever (chapter 2: with `HSGD_CHECK_COLLECTIVES=1`,
# `hsgd.grid.comm.Comm` turns the first case into an error that names every rank's call). That is why even the
# `check` of every chapter (`tutorials/checks.py`) is collective over `COMM_WORLD`: an `allgather` gives every
# rank every rank's error, so a failing check is found on every rank, and all of them raise together.
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
# `hsgd.grid.process_grid.ProcessGrid(world, dp=4, tp=2)` gives each world rank its coordinates, numbering the ranks
# **tp fastest, then pp, then dp**:
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
# **Why this order.** tp is innermost because it carries the most bytes, in every layer, forward and backward,
# and the next layer cannot start before its collective is done: it must stay on the node's fastest links. On a
# cluster `mpirun` normally gives each node a block of consecutive ranks (ranks 0-7 on the first node, 8-15 on
# the second, ...), so with tp fastest a tensor-parallel group is a block of consecutive ranks inside one node,
# on the links between its GPUs (NVLink): the lecture's hierarchical communication (section 4.1). hsgd then puts
# dp outermost, so that each data-parallel replica (one pipeline of tp groups) is a contiguous block of ranks:
# the lecture's G groups of M consecutive workers. With this order the dp All-Reduce is what crosses nodes, once
# per step and overlappable with the backward pass (chapter 8). Megatron-LM orders the other two the other way
# round (section 6).
#
# The picture below draws this grid. It is drawn from hsgd's formula, and the checks after it confirm that the
# coordinates every rank computed for itself, and the members of the communicators `Split` built, are exactly the
# ones drawn.

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
# The picture shows the 8 ranks as 4 replicas (columns) of one tensor-parallel group each: a blue bar joins the
# 2 ranks of each `tp_comm` (consecutive ranks), a red dashed line the 4 ranks of each `dp_comm` (the same
# tp_rank in every replica: ranks 0, 2, 4, 6 hold the first shard, 1, 3, 5, 7 the second).
#
# The `host` column is the same everywhere here because all ranks run on one machine. On a cluster with two
# GPUs per node, each tp_comm would sit on one host, and each dp_comm would span all four.
#
# `python -m hsgd.grid` prints the same table for any sizes, without writing any code:
#
#     mpirun -n 8 python -m hsgd.grid --tp 2          # dp defaults to P / (pp * tp) = 4

# %% [markdown]
# ## 4. Collectives on the sub-communicators
#
# Chapter 2 explained what Allreduce, Allgather and Reduce-Scatter compute and what they cost. What is new here is
# only *where* they run. hsgd's parallel code calls them on `grid.tp_comm` and `grid.dp_comm`, which are
# `hsgd.grid.comm.Comm` objects: the same uppercase buffer methods as mpi4py, on contiguous NumPy arrays, in place,
# plus one line of accounting per call.
#
# Every rank r makes a vector x_r of N numbers from its own seed. Then `grid.tp_comm.Allreduce(a)` sums over the
# 2 ranks of my tensor-parallel group (the shape of section 3.3's All-Reduce of the partial dL/dX), and
# `grid.dp_comm.Allreduce(b)` over the 4 ranks that hold my shard (section 3.4: G gradients of one shard, one per
# replica). The four tp_comms, and the two dp_comms, run their collectives at the same time, each over its own
# members. The check against serial: every rank rebuilds all 8 inputs from their seeds (no communication at
# all), and NumPy sums the rows that belong to its groups. Floating-point addition is not associative and MPI may
# add in a different order than `np.sum`, so the two agree to rounding, not always to the last bit.
#
# One thing this is *not*: an Allreduce over tp_comm followed by one over dp_comm sums every rank's vector once,
# but nothing in training needs that sum. The lecture's "two-dimensional mesh All-Reduce" (end of section 3.4)
# is an algorithm for the per-shard gradient sync *within one dp_comm*: its G ranks are viewed as a 2-D mesh
# (say n ranks per node times k nodes), the gradient is reduced along one dimension of the mesh, then along the
# other, then gathered back. hsgd's hierarchical all-reduce (chapter 8, section 3) is such a 2-D algorithm, and
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
# Every call through a `Comm` adds one line to a `CommStats` that all communicators of the grid share, under
# (communicator name, operation): the number of calls, the payload bytes and the seconds spent. The **payload** is
# the size of the logical tensor of the call, here N float64 = 40 bytes per Allreduce, whatever the
# communicator's size. What a rank actually sends depends on the size n of the communicator and on MPI's
# algorithm: a ring All-Reduce sends $2(n-1)/n$ times the payload from each rank (chapter 2). Wherever the course
# compares communication it gives both columns, because the same payload costs more on a bigger communicator.
# These counts are what later chapters compare with their communication formulas. The table is per process; this
# is rank 0's.

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
# into pp stages of consecutive layers. `pp_comm` joins the stages of one pipeline (same dp_rank, same tp_rank):
# they pass one activation forward and one gradient backward per micro-batch, to their neighbours only. By bytes
# that is the **least** traffic of the three: tensor parallelism moves activations in every layer, data
# parallelism the whole gradient of the stage every step, the pipeline one (B/m, T, C) activation per micro-batch
# and neighbour. `dp_comm` now joins the ranks that hold the same shard of the same stage.
#
# hsgd's order puts pp between tp and dp (tp fastest, then pp, then dp): a replica stays one contiguous block of
# ranks, and what crosses nodes is the dp All-Reduce. Megatron-LM orders by bytes instead: its default order is
# `"tp-cp-ep-dp-pp"` (tp fastest, then context, expert and data parallelism, pipeline slowest; see `RankGenerator`
# and `initialize_model_parallel(order=...)` in megatron/core/parallel_state.py), and DeepSpeed's
# `PipeModelDataParallelTopology` has the same order (axes `pipe, data, model`, the last varying fastest). There
# the pipeline's point-to-point sends cross nodes, and the data-parallel All-Reduce stays inside. Both keep tp
# inside the node; which of the other two should cross depends on the network and on how well each overlaps
# (exercise 1 builds Megatron's order with `Split`).
#
# With 8 ranks as dp = 2, pp = 2, tp = 2, and nodes of 4 ranks (consecutive ranks, as `mpirun` would place them):

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
# The picture shows the two replicas (columns), each a pipeline of two stages (rows, green arrows from stage 0 to
# stage 1), each stage a tensor-parallel pair (blue), and the grey backgrounds the two nodes of 4 ranks: every
# tp_comm and every pp_comm is inside a node, every dp_comm (red dashed) joins the two nodes.
#
# ## Check against serial
#
# What this chapter established, on all 8 ranks and with every verdict reached collectively:
#
# * `Split(color, key)` groups ranks by color and numbers them by key, as predicted;
# * `ProcessGrid` places ranks tp fastest, `rank = (dp_rank * pp + pp_rank) * tp + tp_rank`, and the members of
#   every `tp_comm`, `pp_comm` and `dp_comm` it splits off are exactly the groups `grid.groups()` computes
#   without communicating (for dp=4 tp=2 and for dp=2 pp=2 tp=2); with nodes of 4 consecutive ranks only dp_comm
#   crosses nodes;
# * an Allreduce over `tp_comm` and over `dp_comm` equals the sum NumPy computes on one rank from everyone's input
#   (the serial reference), to rounding; and the byte accounting records exactly those calls;
# * sizes whose product is not 8 raise the same `GridError` on every rank, before any communication.
#
# Chapter 4 puts `dp_comm` to work: data-parallel SGD, one All-Reduce of the gradients per step.

# %%
_, worst = check.worst()                             # the numerical checks: the Allreduces against NumPy
say(f"chapter 3: all {len(check.passed)} checks passed on {P} ranks; largest numerical difference from NumPy "
    f"{worst:.1e}")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# Every framework builds the same grid; they differ in the order of the dimensions and in how the groups are
# made. MPI's `Split` lets each rank say which group it belongs to, in one collective call; PyTorch's
# `torch.distributed.new_group(ranks)` must be called by every rank for every group, with the list of members, and
# each rank keeps the group it is in.
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `ProcessGrid(world, dp, pp, tp)`: rank = (dp_rank * pp + pp_rank) * tp + tp_rank | `initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size, ..., order="tp-cp-ep-dp-pp")` with `RankGenerator` (megatron/core/parallel_state.py): tp fastest, pp slowest | `PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`: axes `["pipe", "data", "model"]`, row-major, so model (tp) fastest and pipe slowest (deepspeed/runtime/pipe/topology.py) | `init_device_mesh("cuda", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))` (torch/distributed/device_mesh.py): a row-major mesh, the last dimension fastest | dp outermost, so a replica is a contiguous block of ranks (the lecture's G groups of M workers); Megatron-LM and DeepSpeed put pp outermost, and PyTorch's mesh follows the order its caller writes |
# | `grid.tp_comm` (Split: color (dp_rank, pp_rank), key tp_rank) | `get_tensor_model_parallel_group()` | `PipelineParallelGrid.get_slice_parallel_group()` (the `model` axis) | `mesh.get_group("tp")` or `mesh["tp"]` | the communicator is passed as an argument, never looked up in a global |
# | `grid.dp_comm` | `get_data_parallel_group()` | `PipelineParallelGrid.get_data_parallel_group()` | `mesh.get_group("dp")` | as above |
# | `grid.pp_comm` | `get_pipeline_model_parallel_group()` | `PipelineParallelGrid.get_pipe_parallel_group()` | `mesh.get_group("pp")` | as above |
# | `comm.Split(color, key)` | `create_group(ranks)`, a wrapper of `torch.distributed.new_group`, called for every group by every rank | `dist.new_group(ranks=...)` for every group of `get_axis_comm_lists` | `torch.distributed.new_group(ranks)`; `torch.distributed.split_group` splits an existing group | one collective call, each rank naming only its own group |
# | `grid.groups()`: who is with whom, without communicating | `RankGenerator.get_ranks("dp")` (`generate_masked_orthogonal_rank_groups`) | `ProcessTopology.get_axis_comm_lists("data")` | the mesh tensor `DeviceMesh.mesh` | - |
# | `CommStats`: calls and payload bytes per (communicator, operation) | none | `CommsLogger` (deepspeed/utils/comms_logging.py): message size per op, and a "busbw" that multiplies by 2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter: the two columns of section 4 | `CommDebugMode` (torch.distributed.tensor.debug) counts the collectives, not their bytes | exact counts, compared with formulas by the tests |
#
# ## Exercises
#
# ### Exercise 1: Megatron-LM's rank order, built with Split
# Megatron-LM's default order `"tp-cp-ep-dp-pp"` (cp = ep = 1 here) numbers the ranks
# rank = (pp_rank * dp + dp_rank) * tp + tp_rank. For dp = pp = tp = 2 on the 8 ranks, compute each rank's
# coordinates in that order, build its tp, pp and dp communicators with `world.Split(color, key)`, and check their
# members against the groups you predict without communicating. Compare with hsgd's grid: which communicators
# have the same members, and, with nodes of 4 consecutive ranks, which one crosses nodes in each order?
# (solution: `tutorials/solutions/03_ranks_and_communicators.py`, `exercise_1`)
#
# ### Exercise 2: the ranks of one node, with Split_type
# `world.Split_type(MPI.COMM_TYPE_SHARED)` groups the ranks that share memory, that is, one node. Build it, and
# check that its members are exactly the world ranks whose `MPI.Get_processor_name()` equals yours (gather the
# names), and that your rank in it (the "local rank" that picks a GPU in chapter 21, `hsgd.train.local_ranks`) is
# your position among them. Then pretend the machine has nodes of 4 ranks (color = rank // 4) and check which
# ranks of your dp_comm of the dp=4 tp=2 grid are on your "node".
# (solution: `tutorials/solutions/03_ranks_and_communicators.py`, `exercise_2`)
#
# ### Exercise 3: the grid of 12 ranks
# Write `groups(dp, pp, tp)`, the members of every tp, pp and dp communicator computed from hsgd's formula alone.
# For 12 ranks, list every factorization dp x pp x tp = 12 (`hsgd.grid.process_grid.factorizations`) and check for each
# that every rank is in exactly one group of each dimension and that every tp group is a block of consecutive ranks.
# Then, on the 8 ranks you have, check your function against `ProcessGrid(world, dp, pp, tp).groups()` and against
# the members of the communicators it builds, for every factorization of 8.
# (solution: `tutorials/solutions/03_ranks_and_communicators.py`, `exercise_3`)
#
# ### Exercise 4: the lecture's 2-D mesh all-reduce on one dp_comm
# In the dp=8 grid (tp = 1), view the 8 ranks of dp_comm as a mesh of 2 "nodes" x 4 ranks (consecutive ranks per
# node). Build the two directions with `Split` on dp_comm (the ranks of one node; the ranks with the same position
# in every node), and sum a gradient vector in three steps: Reduce-Scatter inside the node, All-Reduce across the
# nodes on the chunk, All-Gather inside the node. Check the result against one flat `dp_comm.Allreduce` and
# against `hsgd.dp.hierarchical.hierarchical_allreduce`, and print the payload and ring bytes of each step next to the
# flat All-Reduce's.
# (solution: `tutorials/solutions/03_ranks_and_communicators.py`, `exercise_4`)
