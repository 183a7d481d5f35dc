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
# # Chapter 2: collectives, the vocabulary of every parallel step
#
# Every later chapter splits chapter 1's training over P processes, and whatever the split, the processes cooperate
# through a handful of **collectives**: the All-Reduce of the gradients (the lecture's section 1), the All-Gather
# and its adjoint Reduce-Scatter (sections 3.2-3.4). This chapter learns them on 4 processes and small arrays:
# point to point and deadlock; each collective against NumPy; hsgd's `Comm` wrapper and the payload it records;
# the ring All-Reduce by hand and why 2(p-1)/p is optimal; the alpha-beta model fitted on this machine, and how
# NCCL departs from it; debugging a mismatched collective and a failing rank; the all-to-all of expert parallelism.
#
# Run it with four ranks (about 11 s on a 2-core machine; on failure every rank raises, so it exits non-zero
# without hanging). Rank 0 prints, and draws four pictures into `$HSGD_FIGURES` (default `tutorials/figures/`):
#
# mpirun -n 4 python tutorials/02_collectives.py
#
# Legend: p (or P) the number of ranks of a communicator, r a rank, $x_r$ rank r's input, n the payload in bytes
# (the size of the logical tensor of a call), m the number of elements of a block, $\alpha$ the latency of a
# message (seconds), $\beta$ the time per byte (1/$\beta$ is a bandwidth), $\gamma$ the time per byte of a
# reduction's arithmetic.

# %%
from hsgd.grid.comm import CollectiveMismatch, Comm, CommStats   # hsgd before NumPy: it sets OpenBLAS's thread timeout

import hashlib
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

import pictures                      # tutorials/pictures.py: where the PNGs go
from checks import Checks            # tutorials/checks.py: the collective check every chapter uses

threadpool_limits(1)                 # four ranks share two cores: one BLAS thread each
world = MPI.COMM_WORLD               # every process mpirun started; this chapter needs no other communicator
rank = world.Get_rank()              # who am I: 0 .. P-1
P = world.Get_size()                 # how many of us
if P != 4:                           # every rank sees the same P, so every rank stops here together
    raise SystemExit(f"run this chapter on 4 ranks: mpirun -n 4 python {__file__}" if rank == 0 else 1)
EPS = np.finfo(np.float64).eps       # 2.2e-16: the spacing of float64 numbers near 1
# check(what, err, tol), check.holds(what, cond), check.equal(what, a, b): on every rank, in the same order; rank 0
# prints the verdict (the worst err over the ranks), and every rank raises unless it holds on all of them
check = Checks(world, tol=1e-12, width=68, prefix="  check: ")
say = check.say                      # print once, from rank 0
EXACT = []                           # the checks against NumPy, for the closing line


def politely_wait(req):
    """Wait for a non-blocking MPI request while sleeping, instead of spinning inside MPI.

    MPICH waits by polling: a rank blocked in Barrier or Bcast keeps its core busy. With four ranks on two cores,
    ranks that only wait would slow down the ranks that work (and the times they measure), so they sleep 2 ms
    between tests of an Ibarrier instead."""
    while not req.Test():
        time.sleep(0.002)


def digest(a):
    """SHA-256 of an array's bytes: equal digests mean bit-identical arrays."""
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


# %% [markdown]
# ## 1. Point to point: `Send`, `Recv`, `Sendrecv`
#
# An MPI program is P copies of the same script that share no memory; each knows its `rank` and `P`. Rank a calls
# `Send(buf, dest=b)`, rank b `Recv(buf, source=a)`, and b's buffer receives a copy of a's.
#
# mpi4py spells every call twice. The **uppercase** ones (`Send`, `Allreduce`, ...) hand a contiguous NumPy buffer
# to MPI as it is, no copy; the receiver must have allocated it. The **lowercase** ones (`send`, `allreduce`, ...)
# pickle any Python object: fine for metadata, far too slow for tensors. Below, rank 0 sends rank 1 an array of a
# length rank 1 does not know: the shape and dtype lowercase, then the numbers uppercase.
#
# A **ring shift** (rank r sends to r+1, receives from r-1; pipeline stages do this, chapter 9) shows the trap.
# `Send` may block until the receiver starts receiving (MPI does so for large messages, and buffers small ones), so
# if every rank sends first, all wait forever, and only once the messages grow. Two cures: order the calls by
# parity (even ranks send first), or `Sendrecv`, which does both at once. The ring All-Reduce of section 4 is made
# of `Sendrecv`s.

# %%
def x_of(r):
    """Rank r's input in sections 1 and 2: four small integers, 10(r+1) + i, distinct over all ranks (so a picture
    can tell whose number a cell holds) and exact in float64 (so the sums below are exact too)."""
    return 10.0 * (r + 1) + np.arange(P)                          # (P,) e.g. rank 1: [20. 21. 22. 23.]


x = x_of(rank)                                                    # (P,) my input
X = np.stack([x_of(r) for r in range(P)])                         # (P, P) the serial view: every rank's input
right, left = (rank + 1) % P, (rank - 1) % P                      # my neighbours on the ring
shown = {}                                                        # collective -> (before, after) on this rank

got = np.empty_like(x)                                            # (P,) preallocated receive buffer
if rank % 2 == 0:                                                 # even: send, then receive
    world.Send(x, dest=right)
    world.Recv(got, source=left)
else:                                                             # odd: receive, then send
    world.Recv(got, source=left)
    world.Send(x, dest=right)
shown["Send/Recv: r -> r+1"] = (x.copy(), got.copy())
check("ring shift with Send/Recv (by parity): max |got - x_{r-1}|", float(np.max(np.abs(got - X[left]))))

got2 = np.empty_like(x)
world.Sendrecv(x, dest=right, recvbuf=got2, source=left)          # both directions in one call
check("ring shift with Sendrecv: max |got - x_{r-1}|", float(np.max(np.abs(got2 - X[left]))))

if rank == 0:                                                     # metadata first (pickled), then the numbers
    msg = np.linspace(0.0, 1.0, 7)                                # (7,) rank 1 does not know the length
    world.send((msg.shape, msg.dtype.str), dest=1, tag=1)
    world.Send(msg, dest=1, tag=2)
elif rank == 1:
    shape, dtype = world.recv(source=0, tag=1)                    # small: lowercase is fine
    msg = np.empty(shape, dtype=dtype)                            # allocate from the metadata
    world.Recv(msg, source=0, tag=2)                              # the numbers: uppercase, into that buffer
check("metadata with send/recv, then the array with Send/Recv",
      float(np.max(np.abs(msg - np.linspace(0.0, 1.0, 7)))) if rank == 1 else 0.0)
say(f"rank 0 received {np.array2string(got, precision=0)} from rank {(0 - 1) % P}")

# %% [markdown]
# ## 2. The collectives, one at a time
#
# A **collective** is a call that every rank of a communicator makes at the same point of the program, and that
# completes only when all have made it. Rank r holds $x_r = [10(r+1), ..., 10(r+1)+3]$; each result is checked
# against NumPy on `X`, every rank's input rebuilt locally (the serial view). Small integers make every sum exact.
#
# | call (mpi4py, uppercase) | after the call | what hsgd uses it for |
# |---|---|---|
# | `Bcast(buf, root)` | every rank holds the root's buf | the same data everywhere (a seed, metadata) |
# | `Reduce(x, out, op, root)` | the root holds $\sum_r x_r$ | nothing: hsgd wants sums on every rank |
# | `Allreduce(x, out)` | every rank holds $\sum_r x_r$ | the data-parallel gradient sum (chapter 4) |
# | `Allgather(part, out)` | every rank holds every rank's part | the lecture's All-Gather of $Y_{part}$ (ch. 5) |
# | `Reduce_scatter_block(full, out)` | rank r holds block r of $\sum_s full_s$ | the All-Gather's adjoint (ch. 5, 8) |
# | `Alltoall(send, recv)` | rank r holds block r of every rank | the dispatch of tokens to experts (section 7) |
#
# Two relations used below: All-Reduce = Reduce-Scatter then All-Gather, and Reduce-Scatter is the adjoint of
# All-Gather (chapter 5's backward). Alltoall transposes the blocks: block j of rank i becomes block i of rank j.

# %%
ROOT = 0

buf = x.copy() if rank == ROOT else np.full(P, np.nan)            # (P,) only the root's buffer holds data
before = buf.copy()
world.Bcast(buf, root=ROOT)                                       # every rank: buf <- the root's buf
shown["Bcast (root 0)"] = (before, buf.copy())
EXACT.append("Bcast: max |buf - x_root|")
check(EXACT[-1], float(np.max(np.abs(buf - X[ROOT]))))

total = np.empty(P) if rank == ROOT else None                     # only the root receives
world.Reduce(x, total, op=MPI.SUM, root=ROOT)                     # the root: total <- sum_r x_r
shown["Reduce (root 0)"] = (x.copy(), total.copy() if rank == ROOT else None)
EXACT.append("Reduce: on the root, max |total - sum_r x_r|")
check(EXACT[-1], float(np.max(np.abs(total - X.sum(axis=0)))) if rank == ROOT else 0.0)

summed = np.empty(P)
world.Allreduce(x, summed, op=MPI.SUM)                            # every rank: summed <- sum_r x_r
shown["Allreduce"] = (x.copy(), summed.copy())
EXACT.append("Allreduce: max |summed - sum_r x_r|")
check(EXACT[-1], float(np.max(np.abs(summed - X.sum(axis=0)))))

part = x[rank:rank + 1].copy()                                    # (1,) my block: element `rank` of my input
gathered = np.empty((P, 1))                                       # (P, 1) row s <- rank s's block
world.Allgather(part, gathered)
shown["Allgather"] = (part.copy(), gathered.ravel().copy())
EXACT.append("Allgather: max |gathered[s] - x_s[s]|")
check(EXACT[-1], float(np.max(np.abs(gathered.ravel() - np.diag(X)))))

mine = np.empty(1)                                                # (1,) block `rank` of the sum
world.Reduce_scatter_block(x, mine, op=MPI.SUM)                   # x is (P,): P blocks of one element
shown["Reduce_scatter_block"] = (x.copy(), mine.copy())
EXACT.append("Reduce_scatter_block: max |mine - (sum_r x_r)[rank]|")
check(EXACT[-1], float(np.max(np.abs(mine - X.sum(axis=0)[rank]))))

swapped = np.empty(P)
world.Alltoall(x, swapped)                                        # swapped[s] <- x_s[rank]: block `rank` of all
shown["Alltoall"] = (x.copy(), swapped.copy())
EXACT.append("Alltoall: max |swapped[s] - x_s[rank]| (a transpose)")
check(EXACT[-1], float(np.max(np.abs(swapped - X[:, rank]))))

# %% [markdown]
# The picture: each collective's buffers on the four ranks, before (left) and after (right). Colour says whose
# number a cell holds; grey is a sum over all ranks; an empty cell holds no data.

# %%
everyone = world.gather(shown, root=0)                            # small arrays, for the picture: lowercase
RANK_COLOURS = ["#8ecae6", "#ffb703", "#90be6d", "#f4978e"]       # rank 0..3: whose number a cell holds
SUM_COLOUR = "0.75"                                               # a sum over all ranks


def draw_buffers(ax, rows, x0, owner):
    """One rank per row (rank 0 on top), one cell per element from x = x0, coloured by `owner` (value -> rank)."""
    from matplotlib.patches import Rectangle
    for r, row in enumerate(rows):
        y = P - 1 - r
        if row is None:                                           # this rank receives nothing in this call
            ax.text(x0 + 0.1, y + 0.5, "(no result)", va="center", fontsize=7, color="0.4")
            continue
        for i, v in enumerate(row):
            if np.isnan(v):
                face, label = "white", ""                         # no data yet
            else:
                face, label = RANK_COLOURS[owner[v]] if v in owner else SUM_COLOUR, f"{v:.0f}"
            ax.add_patch(Rectangle((x0 + i, y + 0.08), 0.92, 0.84, fc=face, ec="black", lw=0.6))
            ax.text(x0 + i + 0.46, y + 0.5, label, ha="center", va="center", fontsize=7)


if rank == 0:
    from matplotlib.patches import Rectangle
    owner = {float(v): r for r in range(P) for v in X[r]}         # every input value is unique
    fig, axes = pictures.figure(11, 9.5, nrows=4, ncols=2)
    for ax, name in zip(axes.ravel(), shown):
        draw_buffers(ax, [everyone[r][name][0] for r in range(P)], 0.0, owner)    # before
        ax.annotate("", (5.3, P / 2), (4.3, P / 2), arrowprops=dict(arrowstyle="->", lw=1.5))
        draw_buffers(ax, [everyone[r][name][1] for r in range(P)], 5.6, owner)    # after
        for r in range(P):
            ax.text(-0.15, P - 1 - r + 0.5, f"rank {r}", ha="right", va="center", fontsize=7)
        ax.text(2.0, P + 0.15, "before", ha="center", fontsize=8)
        ax.text(7.6, P + 0.15, "after", ha="center", fontsize=8)
        ax.set_title(name, fontsize=9)
    key = axes.ravel()[-1]                                        # the eighth panel: the colour key
    for r in range(P):
        key.add_patch(Rectangle((0.5, P - 1 - r + 0.1), 0.9, 0.8, fc=RANK_COLOURS[r], ec="black", lw=0.6))
        key.text(1.6, P - 1 - r + 0.5, f"a number of rank {r}'s input", va="center", fontsize=8)
    key.add_patch(Rectangle((5.6, P - 1 + 0.1), 0.9, 0.8, fc=SUM_COLOUR, ec="black", lw=0.6))
    key.text(6.7, P - 1 + 0.5, "a sum over all ranks", va="center", fontsize=8)
    key.add_patch(Rectangle((5.6, P - 2 + 0.1), 0.9, 0.8, fc="white", ec="black", lw=0.6))
    key.text(6.7, P - 2 + 0.5, "no data", va="center", fontsize=8)
    key.set_title("key", fontsize=9)
    for ax in axes.ravel():
        ax.set_xlim(-1.3, 9.8)
        ax.set_ylim(-0.1, P + 0.6)
        ax.axis("off")
    say(f"picture: {pictures.save(fig, '02_collectives_before_after')}")

# %% [markdown]
# ## 3. `hsgd.grid.comm.Comm`: the same calls, recorded
#
# hsgd's parallel code calls collectives only through `hsgd.grid.comm.Comm`, a thin wrapper that makes the same
# uppercase calls and adds a `CommStats` record per call (shared by all communicators of a run), the buffer rules
# stated once (contiguous; GPU arrays staged through host memory without a CUDA-aware MPI, chapter 21), and an
# optional check of the call sequence (section 6):
#
# | `hsgd.grid.comm.Comm` | mpi4py call it makes | payload recorded (bytes) |
# |---|---|---|
# | `Allreduce(x)`, `Iallreduce(x)` | `Allreduce(MPI.IN_PLACE, x)`, `Iallreduce` | x: the buffer |
# | `Allgather(part, out)` | `Allgather(part, out)` | out: the gathered tensor, (size, *part.shape) |
# | `Reduce_scatter_block(full, out)` | `Reduce_scatter_block(full, out)` | full: the whole input, (size, *out.shape) |
# | `Alltoall(send, recv)`, `Alltoallv(send, send_counts, recv, recv_counts)` | the same (counts in rows) | send: the rows this rank sends, its own block included (section 7) |
# | `Bcast(x, root)` | `Bcast(x, root)` | x |
# | `Send`, `Recv`, `Isend`, `Irecv` | the same | the message |
# | `allgather_obj(obj)` | `allgather(obj)` (lowercase, pickled) | (not recorded: metadata) |
#
# No step of hsgd needs `Reduce` or `Sendrecv`, so neither is wrapped. The payload is the *logical tensor's* size,
# not the bytes an algorithm moves (section 4 derives those); later chapters compare it with their formulas, so
# the check below asks that the records say exactly what was called.

# %%
stats = CommStats()                                               # calls, payload bytes, seconds per (comm, op)
comm = Comm(world, "world", stats)                                # the name keys the accounting
N = 6                                                             # elements per vector
v = np.random.default_rng(rank).standard_normal(N)                # (N,) float64, this rank's vector
V = np.stack([np.random.default_rng(r).standard_normal(N) for r in range(P)])   # (P, N) everyone's, rebuilt

a = v.copy()
comm.Allreduce(a)                                                 # in place: a <- sum over ranks
full = np.stack([v * (s + 1) for s in range(P)])                  # (P, N): block s is (s+1) * v
block = np.empty(N)
comm.Reduce_scatter_block(full, block)                            # block <- (sum_r full_r)[rank]
out = np.empty((P, N))
comm.Allgather(block, out)                                        # out[s] <- block of rank s
root_v = v.copy()
comm.Bcast(root_v, root=2)                                        # root_v <- rank 2's v
shifted = np.empty(N)
if rank % 2 == 0:                                                 # the ring shift of section 1, through Comm
    comm.Send(v, right)
    comm.Recv(shifted, left)
else:
    comm.Recv(shifted, left)
    comm.Send(v, right)

ref_sum = V.sum(axis=0)                                           # (N,) what NumPy says
scale = float(np.abs(V).sum(axis=0).max())                        # for a relative error of sums of 4 numbers
EXACT.append("Comm.Allreduce: max |a - sum_r v_r| / max sum_r |v_r|")
check(EXACT[-1], float(np.max(np.abs(a - ref_sum))) / scale)
EXACT.append("Comm.Reduce_scatter_block + Allgather: vs (s+1) * sum_r v_r")
check(EXACT[-1], float(np.max(np.abs(out - np.outer(np.arange(1, P + 1), ref_sum)))) / (P * scale))
EXACT.append("Comm.Bcast and Comm.Send/Recv: vs v_2 and v_{r-1}")
check(EXACT[-1], float(max(np.max(np.abs(root_v - V[2])), np.max(np.abs(shifted - V[left])))))
say(f"\nrank 0's CommStats:\n{stats.format()}")
check.equal("CommStats: one call each, payload = the logical tensor's bytes", stats.counts(),
            {("world", "Allreduce"): (1, N * 8), ("world", "Reduce_scatter_block"): (1, P * N * 8),
             ("world", "Allgather"): (1, P * N * 8), ("world", "Bcast"): (1, N * 8),
             ("world", "Send"): (1, N * 8), ("world", "Recv"): (1, N * 8)})

# %% [markdown]
# ## 4. The ring All-Reduce, by hand
#
# Summing at rank 0 and sending back makes rank 0's link carry (p-1)n bytes each way while the others idle. The
# **ring** keeps every link equally busy: cut each vector into p chunks of n/p bytes, rank r sending to r+1.
#
# * **Reduce-Scatter, p-1 steps.** At step s rank r sends its partial sum of chunk (r-s) mod p to the right and
#   adds the chunk (r-s-1) mod p arriving from the left; after p-1 steps it holds chunk (r+1) mod p summed over all.
# * **All-Gather, p-1 steps.** At step s rank r passes the complete chunk (r+1-s) mod p on and overwrites chunk
#   (r-s) mod p with the one arriving.
#
# Each step is one `Sendrecv` of n/p bytes, so each rank sends **2(p-1)/p x n bytes** (and receives as many),
# whatever p is: the ring of Patarasuk and Yuan (2009, "Bandwidth optimal all-reduce algorithms for clusters of
# workstations"), and the Reduce-Scatter-then-All-Gather that Thakur, Rabenseifner and Gropp (2005, "Optimization
# of collective communication operations in MPICH") use for long messages.

# %%
def ring_allreduce(comm, x, trace=None):
    """In place: x <- the sum of x over the ranks of comm (an mpi4py communicator), by the ring: p-1 Sendrecv
    steps of Reduce-Scatter, then p-1 of All-Gather. x: (n,) with n divisible by p; chunk c = x[c*m:(c+1)*m],
    m = n/p. Returns the bytes this rank sent. With `trace` (a list), x is appended after every step."""
    p, r = comm.Get_size(), comm.Get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    chunks = x.reshape(p, -1)                                     # (p, m) a view of x: chunk c is row c
    incoming = np.empty_like(chunks[0])                           # (m,) the chunk arriving from the left
    sent = 0
    for s in range(p - 1):                                        # Reduce-Scatter
        out_c, in_c = (r - s) % p, (r - s - 1) % p
        comm.Sendrecv(chunks[out_c], dest=right, recvbuf=incoming, source=left)
        chunks[in_c] += incoming                                  # one more rank's contribution to chunk in_c
        sent += chunks[out_c].nbytes
        if trace is not None:
            trace.append(x.copy())
    for s in range(p - 1):                                        # All-Gather: chunk (r+1) % p is complete here
        out_c, in_c = (r + 1 - s) % p, (r - s) % p
        comm.Sendrecv(chunks[out_c], dest=right, recvbuf=chunks[in_c], source=left)   # overwrite: it is complete
        sent += chunks[out_c].nbytes
        if trace is not None:
            trace.append(x.copy())
    return sent


M = 1000                                                          # elements per chunk
g = np.random.default_rng(100 + rank).standard_normal(P * M)      # (P*M,) float64, this rank's "gradient"
G = np.stack([np.random.default_rng(100 + r).standard_normal(P * M) for r in range(P)])   # (P, P*M) everyone's

ring = g.copy()
sent = ring_allreduce(world, ring)                                # by hand
mpi = np.empty_like(g)
world.Allreduce(g, mpi)                                           # MPI's own algorithm
rs = np.empty(M)
world.Reduce_scatter_block(g, rs)                                 # the two phases as MPI's own collectives
two_phase = np.empty((P, M))
world.Allgather(rs, two_phase)

bound = (P - 1) * EPS                                             # see the text below
mass = np.abs(G).sum(axis=0)                                      # (P*M,) sum_r |g_r|, elementwise
EXACT.append("ring vs MPI Allreduce: max |ring - mpi| / sum_r |g_r|")
check(EXACT[-1], float(np.max(np.abs(ring - mpi) / mass)), bound)
EXACT.append("ring vs NumPy's sum: max |ring - sum_r g_r| / sum_r |g_r|")
check(EXACT[-1], float(np.max(np.abs(ring - G.sum(axis=0)) / mass)), bound)
EXACT.append("Reduce_scatter_block then Allgather vs Allreduce (same scale)")
check(EXACT[-1], float(np.max(np.abs(two_phase.ravel() - mpi) / mass)), bound)
same_ring, same_mpi = world.allgather(digest(ring)), world.allgather(digest(mpi))
check.holds("ring: every rank holds the same bits", len(set(same_ring)) == 1)
check.holds("MPI Allreduce: every rank holds the same bits (here)", len(set(same_mpi)) == 1)
check.equal("ring: bytes sent per rank == 2(p-1)/p x payload", sent, 2 * (P - 1) * g.nbytes // P)
say(f"payload {g.nbytes:,} B; the ring sent {sent:,} B from each rank = 2(p-1)/p x payload, p = {P}")

# %% [markdown]
# **The tolerance.** Floating-point addition is not associative, so the ring, MPI and `np.sum` may differ in the
# last bits. Any order of summing p numbers errs by at most $(p-1)\,u \sum_r |x_r|$ (first order, $u = \epsilon/2$),
# so two orders differ by at most $(p-1)\,\epsilon \sum_r |x_r|$ elementwise, the bound checked above (a relative
# error |ring - ref|/|ref| would be the wrong yardstick where the numbers nearly cancel). The ring gives every rank
# the same bits by construction (each chunk is summed once, then copied); MPI's did too here, as the digests show,
# and chapter 4 relies on it to keep replicas identical.
#
# **Why 2(p-1)/p is the least.** After a Reduce-Scatter each rank's values of the p-1 chunks it does not own must
# have left it, in some form: (p-1)/p x n bytes sent. After an All-Gather each rank holds p chunks and had one:
# (p-1)/p x n received. An All-Reduce does both, and Patarasuk and Yuan (2009) prove the 2(p-1)/p x n bound, which
# the ring meets: about 2n bytes per rank however large p grows. The picture shows the ring's steps on inputs that
# record who contributed: rank r's chunks hold $2^r$, so every partial sum is a bit mask of its ranks.

# %%
trace = []
ring_allreduce(world, 2.0 ** rank * np.ones(P), trace)            # (P,) one element per chunk; 2^r: a bit mask
traces = world.gather([np.ones(P) * 2.0 ** rank] + trace, root=0) # per rank: the start and the 2(p-1) steps
if rank == 0:
    from matplotlib import cm
    from matplotlib.patches import Rectangle
    steps = len(traces[0])                                        # 1 + 2(p-1) = 7
    fig, axes = pictures.figure(12, 5.6, nrows=2, ncols=4)
    titles = (["start: rank r holds its own chunks"]
              + [f"reduce-scatter step {s + 1}" for s in range(P - 1)]
              + [f"all-gather step {s + 1}" for s in range(P - 1)])
    for k, ax in enumerate(list(axes[0]) + list(axes[1])[:steps - P]):
        for r in range(P):
            for c in range(P):
                mask = int(traces[r][k][c])                       # which ranks' values chunk c of rank r holds
                members = [q for q in range(P) if mask >> q & 1]
                changed = k > 0 and traces[r][k][c] != traces[r][k - 1][c]   # received at this step
                ax.add_patch(Rectangle((c, P - 1 - r), 0.92, 0.9, fc=cm.Blues(0.15 + 0.2 * len(members)),
                                       ec="red" if changed else "black", lw=2.2 if changed else 0.6))
                label = "all" if len(members) == P else "+".join(map(str, members))
                ax.text(c + 0.46, P - 1 - r + 0.45, label, ha="center", va="center", fontsize=7.5,
                        color="white" if len(members) >= 3 else "black")
            ax.text(-0.1, P - 1 - r + 0.45, f"rank {r}", ha="right", va="center", fontsize=7)
        for c in range(P):
            ax.text(c + 0.46, P + 0.05, f"chunk {c}", ha="center", fontsize=6.5)
        ax.set_title(titles[k], fontsize=8.5)
        ax.set_xlim(-1.2, P)
        ax.set_ylim(-0.1, P + 0.4)
        ax.axis("off")
    key = axes[1][-1]
    key.text(0, 0.75, "cell: the ranks whose values the chunk holds\n(darker: more ranks; all: complete)\n"
                      "red border: received at this step\n\nreduce-scatter: received chunks are added;\n"
                      "all-gather: received chunks overwrite", fontsize=8, va="top", transform=key.transAxes)
    key.axis("off")
    say(f"picture: {pictures.save(fig, '02_ring_allreduce_steps')}")
final = trace[-1]
check.equal("ring on bit masks: every chunk ends with all ranks (2^p - 1)", final.tolist(), [2.0 ** P - 1] * P)

# %% [markdown]
# Both columns for every collective: the **payload** (`CommStats`) and the **bytes each rank sends** in the
# bandwidth-optimal algorithm (ring or pairwise exchange). Exercises 1 and 4 measure the All-Gather and Alltoall rows.

# %%
n_ex = g.nbytes                                                   # the payload of section 4, as an example
rows = [("Send/Recv", "the message", 1.0, "the sender sends it once"),
        ("Bcast", "the buffer", 1.0, "each non-root rank must receive all of it"),
        ("Reduce", "one rank's buffer", 1.0, "each non-root rank's data must leave it"),
        ("Allreduce", "the buffer", 2 * (P - 1) / P, "reduce-scatter + all-gather"),
        ("Allgather", "the gathered tensor", (P - 1) / P, "each rank lacks p-1 of p blocks"),
        ("Reduce_scatter_block", "the full input", (P - 1) / P, "p-1 of p blocks leave each rank"),
        ("Alltoall", "the send buffer", (P - 1) / P, "every block but one's own leaves")]
say(f"{'collective':<22}{'payload (CommStats)':<22}{'payload n':>11}{'sent per rank':>15}{'= factor':>10}  why")
for name, what, factor, why in rows:
    say(f"{name:<22}{what:<22}{n_ex:>11,}{int(factor * n_ex):>15,}{factor:>10.3f}  {why}")
say(f"(p = {P}; the factors 2(p-1)/p and (p-1)/p tend to 2 and 1 as p grows)")

# %% [markdown]
# ## 5. The alpha-beta cost model, measured
#
# Hockney's model (Hockney 1994, "The communication challenge for MPP: Intel Paragon and Meiko CS-2") prices a
# message of n bytes as
#
# $$T(n) = \alpha + \beta\, n,$$
#
# $\alpha$ the **latency** (the time of an empty message), $1/\beta$ the **bandwidth**; the two terms are equal at
# $n_{1/2} = \alpha/\beta$. A collective is a sum of messages, so it has the same form with other constants: the
# ring All-Reduce costs $2(p-1)\alpha + 2\frac{p-1}{p} n \beta + \frac{p-1}{p} n \gamma$ (Thakur, Rabenseifner
# and Gropp 2005 give one such formula per MPICH algorithm). The fit below is made honest by:
#
# * **Two ranks measure, two sleep.** Four busy ranks would take turns on the 2 cores (and MPICH's waiting ranks
#   spin), so ranks 0 and 1 time the calls on a communicator of their own (`Split`, chapter 3) while ranks 2 and 3
#   sleep in `politely_wait`. Everything below is for p = 2.
# * **Interleaved calls, medians.** Each call is timed alone after a `Barrier`, all (collective, size) pairs in one
#   random order per round, 40 rounds (small messages 8 times a round); the median ignores the calls another
#   program disturbed.
# * **Sizes where the line holds.** Only messages of at most 1 KiB (latency) and of 2 MiB and more (bandwidth) are
#   fitted. In between MPICH switches protocol (eager copies vs a handshake) and algorithm (its `MPIR_CVAR_*`
#   thresholds), and caches help; those sizes are drawn, not fitted.
# * **Relative least squares**, $\sum_i ((\alpha + \beta n_i)/t_i - 1)^2$, still linear in $(\alpha, \beta)$,
#   weighs a 10% miss at 16 B and at 4 MiB alike.
#
# The check: on the fitted sizes the line reproduces every median within 30%; a collective that misses is measured
# again, twice at most.

# %%
KiB, MiB = 1 << 10, 1 << 20
SIZES = [16, 64, 256, KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 2 * MiB, 3 * MiB, 4 * MiB]  # bytes
FITTED = [n for n in SIZES if n <= KiB or n >= 2 * MiB]           # where the line holds
OPS = ["Sendrecv", "Bcast", "Allreduce", "Allgather", "Reduce_scatter_block", "Alltoall"]
ROUNDS = 40


def repeats(n):
    """Timed calls per round of a message of n bytes: the short fitted ones many times (they are cheap, and each is
    either undisturbed or delayed by a whole time slice of another program, so their medians need many samples),
    the fitted large ones twice, the middle sizes once (they are only drawn, not checked)."""
    return 8 if n <= KiB else 2 if n in FITTED else 1


TOLERANCE = 0.30                                                  # the fit vs the medians, on FITTED


def timed_call(pair, op, n):
    """A function making one call of `op` on the 2-rank communicator `pair` with payload n bytes (float64)."""
    m = n // 8
    a, b, half = np.ones(m), np.zeros(m), np.zeros(m // 2)        # (m,), (m,), (m/2,)
    other = 1 - pair.Get_rank()
    calls = {"Sendrecv": lambda: pair.Sendrecv(a, dest=other, recvbuf=b, source=other),   # n each way
             "Bcast": lambda: pair.Bcast(a, root=0),
             "Allreduce": lambda: pair.Allreduce(a, b),
             "Allgather": lambda: pair.Allgather(half, b),                    # gathered: n
             "Reduce_scatter_block": lambda: pair.Reduce_scatter_block(a, half),   # full input: n
             "Alltoall": lambda: pair.Alltoall(a, b)}
    return calls[op]


def measure(pair, ops=OPS):
    """{(op, n): median seconds} on the 2-rank communicator pair. A round makes repeats(n) calls of every (op, n),
    each timed on its own after a Barrier, all in one random order (the same on both ranks); ROUNDS rounds. The
    result is the median of each (op, n)'s samples, the larger of the two ranks' medians."""
    calls = {(op, n): timed_call(pair, op, n) for op in ops for n in SIZES}
    for f in calls.values():                                      # warm up: first-touch allocations, connections
        f()
    schedule = [key for key in calls for _ in range(repeats(key[1]))]   # one entry per timed call of a round
    samples = {key: [] for key in calls}
    order = np.random.default_rng(0)                              # same seed on both ranks: same order
    for _ in range(ROUNDS):
        for i in order.permutation(len(schedule)):
            key = schedule[i]
            pair.Barrier()                                        # start together (not timed)
            t0 = time.perf_counter()
            calls[key]()
            samples[key].append(time.perf_counter() - t0)
    medians = {key: float(np.median(s)) for key, s in samples.items()}
    both = pair.allgather(medians)                                # small: lowercase
    return {key: max(d[key] for d in both) for key in medians}


def matmul_times(C, tokens, reps=5):
    """{N: median seconds of one linear layer's forward and backward matmuls on N tokens}, W: (C, 4C) float64."""
    rng = np.random.default_rng(0)
    W = rng.standard_normal((C, 4 * C))                           # (C, 4C) the layer's weight
    out = {}
    for N in tokens:
        Xa, dY = rng.standard_normal((N, C)), rng.standard_normal((N, 4 * C))   # (N, C), (N, 4C)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            Y = Xa @ W                                            # (N, 4C) forward
            dX = dY @ W.T                                         # (N, C)  backward, input gradient
            dW = Xa.T @ dY                                        # (C, 4C) backward, weight gradient
            times.append(time.perf_counter() - t0)
        out[N] = float(np.median(times))
        del Y, dX, dW
    return out


def measured(ops=OPS):
    """measure(pair, ops) on ranks 0 and 1, ranks 2 and 3 asleep meanwhile; the medians on every rank."""
    out = measure(pair, ops) if pair != MPI.COMM_NULL else None
    politely_wait(world.Ibarrier())
    return world.bcast(out, root=0)


t_measure = time.perf_counter()
pair = world.Split(color=0 if rank < 2 else MPI.UNDEFINED, key=rank)   # ranks 0, 1; COMM_NULL on 2, 3
medians = measured()
C_LAYER, TOKENS = 256, [32, 128, 512]                             # a layer C x 4C, tokens per rank
mm = matmul_times(C_LAYER, TOKENS) if rank == 0 else None         # one core, the others asleep
politely_wait(world.Ibarrier())
mm = world.bcast(mm, root=0)
t_measure = time.perf_counter() - t_measure


def fit(op):
    """(alpha, beta) minimizing sum over FITTED of ((alpha + beta n)/t - 1)^2: linear least squares."""
    n = np.array(FITTED, dtype=float)
    t = np.array([medians[op, s] for s in FITTED])
    A = np.stack([1.0 / t, n / t], axis=1)                        # (len(FITTED), 2): row i times (a, b) = fit/t
    (alpha, beta), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


fits = {op: fit(op) for op in OPS}                                # every rank fits the same medians


def deviation(op, sizes):
    """[fit / measured median - 1] of op at each size: how far the line is from the measurements."""
    alpha, beta = fits[op]
    return [(alpha + beta * n) / medians[op, n] - 1.0 for n in sizes]


# Another program on the machine can spoil a whole measurement (on a shared machine, or in a test run): the
# collectives whose line misses the medians by more than TOLERANCE are measured again, twice at most.
for _ in range(2):
    missed = [op for op in OPS if max(abs(d) for d in deviation(op, FITTED)) >= TOLERANCE]
    if not missed:
        break
    say(f"measured again, the line missed by more than {TOLERANCE:.0%} (a busy machine?): {', '.join(missed)}")
    medians.update(measured(missed))
    fits.update({op: fit(op) for op in missed})
if pair != MPI.COMM_NULL:
    pair.Free()


MIDDLE = [n for n in SIZES if n not in FITTED]
calls_made = ROUNDS * len(OPS) * sum(repeats(n) for n in SIZES)
say(f"timed {calls_made:,} calls ({len(OPS)} collectives x {len(SIZES)} sizes, {ROUNDS} rounds) on 2 ranks, and the "
    f"matmuls on one, in {t_measure:.1f} s")
say(f"\n{'p = 2':<22}{'alpha (us)':>11}{'1/beta (GB/s)':>15}{'worst |fit/t - 1|':>19}{'middle, not fitted':>20}")
for op in OPS:
    alpha, beta = fits[op]
    worst = max(abs(d) for d in deviation(op, FITTED))
    mid = max(deviation(op, MIDDLE), key=abs)
    say(f"{op:<22}{alpha * 1e6:>11.2f}{1e-9 / beta:>15.2f}{worst:>18.0%} {mid:>+19.0%}")
say("\nmeasured medians (us):")
say(f"{'size':>9}" + "".join(f"{op[:12]:>13}" for op in OPS))
for n in SIZES:
    mark = " " if n in FITTED else "*"
    say(f"{n:>8,}{mark}" + "".join(f"{medians[op, n] * 1e6:>13.1f}" for op in OPS))
say("(* not fitted)")
for op in OPS:
    check(f"alpha-beta fit of {op}: worst |fit/measured - 1|", max(abs(d) for d in deviation(op, FITTED)),
          TOLERANCE)

# %% [markdown]
# The picture: the medians (filled: fitted; hollow: not) and the fitted lines, log-log; right, each median's
# distance from its line, with the 30% band.

# %%
if rank == 0:
    fig, (ax, dev) = pictures.figure(12, 4.6, ncols=2)
    colours = ["#000000", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    grid_n = np.logspace(np.log10(SIZES[0]), np.log10(SIZES[-1]), 200)
    for op, col in zip(OPS, colours):
        alpha, beta = fits[op]
        ax.plot(grid_n, (alpha + beta * grid_n) * 1e6, color=col, lw=1.2,
                label=f"{op}: {alpha * 1e6:.1f} us + n / {1e-9 / beta:.1f} GB/s")
        for sizes, face in ((FITTED, col), (MIDDLE, "white")):
            ax.plot(sizes, [medians[op, n] * 1e6 for n in sizes], "o", ms=4.5, mfc=face, mec=col)
            dev.plot(sizes, [100 * d for d in deviation(op, sizes)], "o", ms=4.5, mfc=face, mec=col)
        dev.plot(SIZES, [100 * d for d in deviation(op, SIZES)], color=col, lw=0.6, alpha=0.5)
    for a in (ax, dev):
        a.set_xscale("log")
        a.axvspan(KiB * 1.5, 1.5 * MiB, color="0.93", zorder=0)
        a.set_xlabel("payload n (bytes)")
        a.grid(alpha=0.3, which="both")
    ax.set_yscale("log")
    ax.set_ylabel("time per call (us), median")
    ax.set_title("alpha-beta fits on 2 ranks of this machine (grey band: measured, not fitted)", fontsize=9)
    ax.legend(fontsize=6.5, loc="upper left")
    dev.axhspan(-100 * TOLERANCE, 100 * TOLERANCE, color="#d9f0d3", zorder=0)
    dev.set_ylabel("fit / measured - 1 (%)")
    dev.set_title("how far the line is from each median (green: the 30% check)", fontsize=9)
    say(f"picture: {pictures.save(fig, '02_alpha_beta_fit')}")

# %% [markdown]
# **Against the ring's prediction.** On p = 2 the ring's bytes per rank predict each $\beta$ from one `Sendrecv`'s:
# Allreduce sends 2(p-1)/p = 1 x n, so the same; Allgather, Reduce-Scatter and Alltoall (p-1)/p = 1/2 x n; a Bcast
# one message of n. For short messages MPICH uses fewer-step algorithms (recursive doubling, binomial trees), one
# exchange on two ranks, so each $\alpha$ is compared with one `Sendrecv`'s.

# %%
alpha_sr, beta_sr = fits["Sendrecv"]
factor = {"Sendrecv": 1.0, "Bcast": 1.0, "Allreduce": 1.0, "Allgather": 0.5, "Reduce_scatter_block": 0.5,
          "Alltoall": 0.5}                                        # bytes sent per rank / payload, p = 2
say(f"{'p = 2':<22}{'beta (ns/B)':>12}{'ring predicts':>15}{'measured/predicted':>20}{'alpha / alpha_Sendrecv':>24}")
for op in OPS:
    alpha, beta = fits[op]
    say(f"{op:<22}{beta * 1e9:>12.3f}{factor[op] * beta_sr * 1e9:>15.3f}{beta / (factor[op] * beta_sr):>20.2f}"
        f"{alpha / alpha_sr:>24.2f}")
check.holds("beta: Allreduce costs more per payload byte than Allgather",
            fits["Allreduce"][1] > fits["Allgather"][1])

# %% [markdown]
# On one computer a "message" is a memory copy, and so is everything else a collective does with memory: Allgather
# and Alltoall also copy the rank's own block, the reductions add (the $\gamma$ term). The ring counts only bytes
# that travel, so these come out above it, the reductions most, and a Bcast closest. The ordering holds and is
# checked: an Allreduce costs more per payload byte than an Allgather. Between GPUs the links are the slow part
# and carry exactly the ring's bytes, which is why nccl-tests report a "bus bandwidth" (payload rate times
# 2(p-1)/p for an All-Reduce, (p-1)/p for an All-Gather), as DeepSpeed's communication logger does.
#
# **When is a step communication-bound?** Data parallelism (chapter 4) sums every weight gradient once per step.
# For one linear layer W of C x 4C, C = 256 (a 2 MiB float64 gradient, inside the fitted range), the matmuls
# Y = XW, dX = dY W^T, dW = X^T dY cost 6 N C (4C) flops on N tokens: 0.75 N flops per gradient byte. The
# intensity grows with the tokens per rank, the All-Reduce does not; below some N the step waits more than it
# computes (unless the two overlap, chapter 8). With the fitted Allreduce line and the matmuls timed on one core:

# %%
grad_bytes = C_LAYER * 4 * C_LAYER * 8                            # the layer's gradient, float64
alpha_ar, beta_ar = fits["Allreduce"]
t_ar = alpha_ar + beta_ar * grad_bytes                            # the model's time for that Allreduce (p = 2)
flops = {N: 6 * N * C_LAYER * 4 * C_LAYER for N in TOKENS}
say(f"layer W: {C_LAYER} x {4 * C_LAYER}, gradient {grad_bytes / MiB:.0f} MiB; Allreduce on 2 ranks "
    f"(fitted line): {t_ar * 1e3:.2f} ms")
say(f"{'tokens N':>9}{'matmuls (ms)':>14}{'GFLOP/s':>9}{'flops per gradient byte':>25}{'Allreduce / matmuls':>21}")
for N in TOKENS:
    say(f"{N:>9}{mm[N] * 1e3:>14.2f}{flops[N] / mm[N] / 1e9:>9.1f}{flops[N] / grad_bytes:>25.0f}"
        f"{t_ar / mm[N]:>21.2f}")
per_token = mm[TOKENS[-1]] / TOKENS[-1]                           # seconds per token, from the largest N
say(f"break-even: below about {t_ar / per_token:.0f} tokens per rank, this layer's Allreduce takes longer than "
    f"its matmuls (here, on one core and shared memory)")

# %% [markdown]
# One CPU core computing against the same machine's memory "communicating" puts the break-even low. On GPUs the
# matmuls get far faster than the links (NVLink in a server, InfiniBand between servers), so the break-even grows
# by that ratio and communication becomes the part to hide and to place: hence the lecture's section 4.1 keeps
# tensor-parallel traffic inside a server, overlaps the data-parallel All-Reduce with the backward and recommends
# NCCL (chapters 3, 8 and 21). The method carries over: fit the real $\alpha$ and $\beta$, count bytes with the
# ring's factors, compare with the flops.

# %% [markdown]
# **How NCCL really runs a collective.** Section 4's ring is one ring on one link. A GPU has several NVLinks and a
# node several NICs, which one ring cannot fill, so NCCL runs several **channels** at once, each a ring (or tree)
# over its own share of the buffer, on its own links and thread block (`NCCL_MIN_NCHANNELS`, `NCCL_MAX_NCHANNELS`).
# With c channels on c independent links the bandwidth term becomes $2\frac{p-1}{p}\frac{n}{c}\beta$; the latency
# term stays, the channels stepping in parallel.
#
# For small messages the ring's 2(p-1) latencies dominate. NCCL's **tree** All-Reduce reduces up a binary tree and
# broadcasts down it, 2 log2 p steps, on two complementary trees (a rank interior in one is a leaf in the other;
# Sanders, Speck and Träff 2009, "Two-tree algorithms for full bandwidth broadcast, reduction and scan"), each
# carrying half the data, so each rank still sends about 2n: $T \approx 2\log_2 p\,\alpha + 2n\beta$. On H100
# systems **NVLS** (NVLink SHARP) reduces inside the NVSwitch: each GPU sends its buffer to the switch once and
# reads the sum back, about n each way instead of 2(p-1)/p n through its peers; CollNet does the same in
# InfiniBand SHARP switches. `NCCL_ALGO` restricts the choice (Ring, Tree, NVLS, NVLSTree, CollnetDirect,
# CollnetChain).
#
# The **protocol** (`NCCL_PROTO`) trades $\alpha$ for $\beta$: Simple moves large chunks behind a memory fence
# (full bandwidth, highest latency); LL stores 4 bytes of data with a 4-byte flag (lowest latency, half the
# bandwidth); LL128 puts 120 bytes of data in each 128-byte line (nearly full bandwidth, where NVLink keeps a line's
# order). NCCL picks algorithm, protocol and channels per call from its own alpha-beta tables. The latency steps of
# ring and tree, for this chapter's p and larger:

# %%
def tree_depth(p):
    """Hops from the deepest rank to the root of a binary tree over p ranks in heap order (children 2i+1, 2i+2)."""
    depth = [0] * p
    for i in range(1, p):
        depth[i] = depth[(i - 1) // 2] + 1                        # one hop below its parent
    return max(depth)


P_SHOWN = [P, 8, 64, 512]
say(f"{'p':>5}{'ring steps 2(p-1)':>19}{'tree steps 2 log2 p':>20}{'latency, ring (us)':>20}{'tree (us)':>11}")
for p in P_SHOWN:
    say(f"{p:>5}{2 * (p - 1):>19}{2 * tree_depth(p):>20}{2 * (p - 1) * alpha_sr * 1e6:>20.1f}"
        f"{2 * tree_depth(p) * alpha_sr * 1e6:>11.1f}")
say("(latency: steps x this machine's Sendrecv alpha; the bandwidth terms are about equal, 2n beta)")
check.equal("ring: 2(p-1) Sendrecv steps, counted in section 4's trace", len(trace), 2 * (P - 1))
check.equal("binary tree over p ranks: depth log2 p", [tree_depth(p) for p in P_SHOWN],
            [int(np.log2(p)) for p in P_SHOWN])

# %% [markdown]
# ## 6. Debugging: a hang that is caught, a rank that fails
#
# **(a) A mismatched collective.** The classic SPMD bug: one rank takes another branch and calls a different
# collective (or another shape, or one fewer). MPI does not check; the job hangs silently until its time limit, or
# finishes with wrong numbers when the calls happen to exchange compatible bytes.
#
# `Comm(..., check=True)`, or `HSGD_CHECK_COLLECTIVES=1` for every `Comm` made without `check=`, makes the ranks
# agree before each collective through a small pickled `allgather` of (operation, communicator name, shapes,
# dtype, call number). On a difference every rank raises `CollectiveMismatch`, naming each rank's call; since this
# happens *before* the real collective, no rank is left inside MPI. The price, one small-message latency per call,
# is why it is off by default. Here rank 0 calls `Allreduce`, the others `Allgather`:

# %%
checked = Comm(world, "world", CommStats(), check=True)
y = np.ones(3)                                                    # (3,)
ys = np.empty((P, 3))                                             # (P, 3)


def raised(call):
    """call() on every rank; what each rank's CollectiveMismatch said ("" where none was raised), gathered."""
    try:
        call()
        caught = ""
    except CollectiveMismatch as e:
        caught = str(e)
    return world.allgather(caught)                                # what each rank saw


messages = raised(lambda: checked.Allreduce(y) if rank == 0       # the planted bug: rank 0 sums ...
                  else checked.Allgather(y, ys))                  # ... while the others gather
say(f"every rank raised:\n  {messages[0]}")
check.holds("wrong collective: every rank raised CollectiveMismatch", all(messages))
check.holds("the message names rank 0's Allreduce and ranks 1-3's Allgather",
            all("rank 0: Allreduce" in m and "ranks 1,2,3: Allgather" in m for m in messages))

z = np.ones(4 if rank != 3 else 5)                                # the planted bug: rank 3's buffer is longer
messages = raised(lambda: checked.Allreduce(z))
say(f"every rank raised:\n  {messages[0]}")
check.holds("wrong shape: every rank raised, naming rank 3's (5,)",
            all("rank 3: Allreduce shapes=[(5,)]" in m for m in messages))

os.environ["HSGD_CHECK_COLLECTIVES"] = "1"                        # the environment switch, for a Comm without check=
from_env = Comm(world, "world").check
del os.environ["HSGD_CHECK_COLLECTIVES"]
check.holds("HSGD_CHECK_COLLECTIVES=1 turns the check on", from_env and not Comm(world, "world").check)

# %% [markdown]
# Unchecked, rank 0 would sit in `MPI_Allreduce` and ranks 1-3 in `MPI_Allgather`: erroneous by the MPI standard,
# in practice a hang or garbage. The check's limit (stated in `hsgd/grid/comm.py`): a rank that skips a collective
# and then makes a *different* one on the same communicator is caught; one that skips it and waits elsewhere (another
# communicator, a raw mpi4py call) leaves the others hanging in the check's own `allgather`. Exercise 3 is such a
# hunt.
#
# **(b) A rank that raises.** The danger is to the other ranks, already waiting in their next collective for a
# partner that will never come; mpi4py's documentation warns that an unhandled exception plus its automatic
# `MPI_Finalize` may deadlock. hsgd's entry points run through `hsgd.grid.launch.run`: on an exception that is not
# a usage error or an agreed numerical fault, the rank prints its traceback (lines prefixed `[rank r]`) and calls
# `MPI_Abort` on `COMM_WORLD`, which ends every rank; `mpiexec` exits non-zero. Below, rank 0 runs such a two-rank
# job in a subprocess under `timeout`: rank 1 raises while rank 0 waits in an `Allreduce`.

# %%
JOB = '''
import sys
import numpy as np
from mpi4py import MPI
from hsgd.grid import launch


def main():
    world = MPI.COMM_WORLD
    if world.Get_rank() == 1:
        raise ValueError("planted failure on rank 1")
    x = np.ones(4)
    world.Allreduce(MPI.IN_PLACE, x)          # rank 0 waits here for rank 1, which never comes


sys.exit(launch.run(main))
'''


def run_failing_job(limit_s=60):
    """Run JOB on 2 ranks in a subprocess; (exit code, seconds, stderr)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))          # the repository: hsgd importable
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")          # the launcher of this Python
    if not os.path.exists(mpiexec):
        mpiexec = "mpiexec"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMI_")}     # not a member of *this* job
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "failing_job.py")
        with open(script, "w") as f:
            f.write(JOB)
        t0 = time.perf_counter()
        r = subprocess.run(["timeout", "-k", "5", str(limit_s), mpiexec, "-n", "2", sys.executable, script],
                           capture_output=True, text=True, env=env, cwd=root)
    return r.returncode, time.perf_counter() - t0, r.stderr


outcome = run_failing_job() if rank == 0 else None
politely_wait(world.Ibarrier())                                   # ranks 1-3 sleep while rank 0 waits for it
code, seconds, stderr = world.bcast(outcome, root=0)
for line in stderr.splitlines():
    if line.startswith("[rank") or "MPI_Abort" in line:
        say(f"  | {line}")
say(f"mpiexec exited with code {code} after {seconds:.1f} s")
check.holds("a rank that raises: the job ends with a non-zero exit code", code not in (0, 124, 137))
check.holds("... within seconds (under 30 s), not at the outer timeout", seconds < 30)
check.holds("... with one clear message: the traceback and the abort",
            "[rank 1] ValueError: planted failure on rank 1" in stderr and "MPI_Abort" in stderr)

# %% [markdown]
# ## 7. The all-to-all: a transpose, with counts, and its adjoint
#
# **Equal blocks.** Stack the send buffers as a p x p matrix of blocks, $S_{ij}$ = what rank i has for rank j, and
# the receive buffers likewise, $R_{ji}$ = what j got from i: `Alltoall` makes $R = S^T$. It only moves numbers (a
# permutation), so its adjoint is its inverse, itself.
#
# **Counted rows: `Alltoallv`.** A mixture-of-experts layer sends each token to the rank of its chosen expert:
# rank i has $M_{ij}$ rows for rank j, a different number every step. `Comm.Alltoallv(send, send_counts, recv,
# recv_counts)` takes counts in rows; the send buffer holds the rows in rank order (the displacements are running
# sums), and so does the receive buffer. send_counts is row i of M, recv_counts column i, which no rank knows
# beforehand: every expert-parallel dispatch first sends the counts by an `Alltoall` of p integers, then the rows.
# Below M is uneven, with zeros (rank 2 keeps none of its rows and receives from rank 1 only), and each row carries
# a tag 100(i+1) + 10j + k (sender i, receiver j, k-th row) that the picture decodes.

# %%
ep = Comm(world, "world", CommStats())                            # hsgd's wrappers, with their own records
swapped_h, again = np.empty(P), np.empty(P)                       # (P,) one element per block
ep.Alltoall(x, swapped_h)                                         # section 2's Alltoall, through Comm
ep.Alltoall(swapped_h, again)                                     # the transpose of the transpose
EXACT.append("Comm.Alltoall: max |got[s] - x_s[rank]| (X transposed)")
check(EXACT[-1], float(np.max(np.abs(swapped_h - X.T[rank]))))
check.holds("Alltoall twice gives back x, bit for bit (its own adjoint)", np.array_equal(again, x))

routes = np.array([[1, 2, 0, 1],                                  # routes[i, j]: rows rank i sends to rank j
                   [0, 1, 3, 0],
                   [2, 0, 0, 1],
                   [1, 3, 0, 2]])                                  # (P, P) M: uneven, with zeros


def tags_of(i):
    """Rank i's send buffer of tags, in rank order: 100(i+1) + 10j + k for its k-th row for rank j."""
    return np.array([100.0 * (i + 1) + 10 * j + k for j in range(P) for k in range(routes[i, j])])


send_counts = routes[rank].copy()                                 # (P,) int64: my row of M
recv_counts = np.empty_like(send_counts)                          # (P,) my column of M, once exchanged
ep.Alltoall(send_counts, recv_counts)                             # step 1: the counts
check.equal("Alltoall of the counts: rank j learns column j of M", recv_counts.tolist(), routes[:, rank].tolist())
tags = tags_of(rank)                                              # (sum_j M[rank, j],)
got_tags = np.empty(int(recv_counts.sum()))                       # (sum_i M[i, rank],)
ep.Alltoallv(tags, send_counts, got_tags, recv_counts)            # step 2: the rows
offsets = [np.concatenate([[0], np.cumsum(routes[i])]) for i in range(P)]     # where rank i's block j starts
ref_tags = np.concatenate([tags_of(i)[offsets[i][rank]:offsets[i][rank + 1]] for i in range(P)])
EXACT.append("Comm.Alltoallv: max |got - rows for me from every rank|")
check(EXACT[-1], float(np.max(np.abs(got_tags - ref_tags))) if ref_tags.size else 0.0)
check.holds("Alltoallv: every rank received sum_i M[i, rank] rows", got_tags.shape == ref_tags.shape)

# %% [markdown]
# The picture: M and its transpose, and each rank's buffers, one cell per row tagged "i>j" and coloured by the
# receiver: every colour in rank order before the call, one colour after.

# %%
buffers = world.gather((tags, got_tags), root=0)                  # small: lowercase, for the picture


def draw_alltoallv():
    from matplotlib.patches import Rectangle
    fig, axes = pictures.figure(12, 3.6, ncols=3, gridspec_kw={"width_ratios": [1.6, 2.2, 2.2]})
    for k, (mat, title) in enumerate(((routes, "M: rows rank i sends to rank j"),
                                      (routes.T, "M^T: rows rank j receives from rank i"))):
        for i in range(P):
            for j in range(P):
                axes[0].add_patch(Rectangle((5 * k + j, P - 1 - i), 0.92, 0.9, ec="black", lw=0.6,
                                            fc=RANK_COLOURS[j if k == 0 else i] if mat[i, j] else "white"))
                axes[0].text(5 * k + j + 0.46, P - 1 - i + 0.45, str(mat[i, j]), ha="center", va="center",
                             fontsize=8)
        axes[0].text(5 * k + P / 2, P + 0.2, title.split(":")[0], ha="center", fontsize=9)
    axes[0].set_title("counts: Alltoall turns row i of M into column i", fontsize=8.5)
    axes[0].set_xlim(-0.2, 9.2)
    for ax, which, title in ((axes[1], 0, "before: send buffers (rows by receiver)"),
                             (axes[2], 1, "after Alltoallv: receive buffers (rows by sender)")):
        for r in range(P):
            row = buffers[r][which]
            for c, tag in enumerate(row):
                i, j = int(tag) // 100 - 1, int(tag) // 10 % 10
                ax.add_patch(Rectangle((c, P - 1 - r), 0.92, 0.9, fc=RANK_COLOURS[j], ec="black", lw=0.6))
                ax.text(c + 0.46, P - 1 - r + 0.45, f"{i}>{j}", ha="center", va="center", fontsize=7)
            if not len(row):
                ax.text(0.1, P - 1 - r + 0.45, "(nothing)", va="center", fontsize=7, color="0.4")
            ax.text(-0.15, P - 1 - r + 0.45, f"rank {r}", ha="right", va="center", fontsize=7)
        ax.set_title(title, fontsize=8.5)
        ax.set_xlim(-1.3, max(len(b[which]) for b in buffers) + 0.2)
    for ax in axes:
        ax.set_ylim(-0.1, P + 0.6)
        ax.axis("off")
    return pictures.save(fig, "02_alltoallv")


if rank == 0:
    say(f"picture: {draw_alltoallv()}")

# %% [markdown]
# **The adjoint.** `Alltoallv` with counts (row of M, column of M) is a 0/1 matrix A with one 1 per row and column,
# so $A^T = A^{-1}$: the `Alltoallv` with the counts swapped. In a mixture-of-experts layer the first is the
# **dispatch**, the second the **combine**, so each one's backward is the other's communication. Checked:
# $\langle A x, y\rangle = \langle x, A^T y\rangle$ summed over ranks, the combine undoing the dispatch bit for bit,
# and the records (one call each, the send buffer's bytes, own block included).

# %%
WIDTH = 3                                                         # numbers per row (a token's features)
n_out, n_in = int(send_counts.sum()), int(recv_counts.sum())      # rows I send, rows I receive
xs = np.random.default_rng(200 + rank).standard_normal((n_out, WIDTH))    # (n_out, 3) my rows before the dispatch
ys = np.random.default_rng(300 + rank).standard_normal((n_in, WIDTH))     # (n_in, 3) a gradient at the experts
Ax, ATy, back = np.empty((n_in, WIDTH)), np.empty((n_out, WIDTH)), np.empty((n_out, WIDTH))
ep.Alltoallv(xs, send_counts, Ax, recv_counts)                    # A x: the dispatch
ep.Alltoallv(ys, recv_counts, ATy, send_counts)                   # A^T y: the counts swapped, the combine
ep.Alltoallv(Ax, recv_counts, back, send_counts)                  # A^T A x: the combine of the dispatch
dots = np.array([np.vdot(Ax, ys), np.vdot(xs, ATy)])              # my terms of <A x, y> and <x, A^T y>
world.Allreduce(MPI.IN_PLACE, dots)                               # the sums over all ranks
say(f"<A x, y> = {dots[0]:.17g}, <x, A^T y> = {dots[1]:.17g}")
check("Alltoallv adjoint: |<A x, y> - <x, A^T y>| / |<A x, y>|", abs(dots[0] - dots[1]) / abs(dots[0]))
check.holds("the combine undoes the dispatch: A^T A x == x, bit for bit", np.array_equal(back, xs))
row_bytes = WIDTH * 8
check.equal("CommStats: 3 Alltoall, 4 Alltoallv, payload = the send buffers",
            ep.stats.counts(),
            {("world", "Alltoall"): (3, 2 * P * 8 + P * 8),
             ("world", "Alltoallv"): (4, n_out * 8 + n_out * row_bytes + 2 * n_in * row_bytes)})

# %% [markdown]
# **Its cost.** With equal blocks (p-1)/p x n bytes leave each rank and as many arrive. The pairwise exchange
# (exercise 4; MPICH's long-message algorithm) takes p-1 steps of one message each way:
#
# $$T_{Alltoall} \approx (p-1)\,\alpha + \frac{p-1}{p}\, n\,\beta,$$
#
# the bytes of an All-Gather, but no step can forward or combine. (For short blocks MPICH uses Bruck's algorithm,
# $\lceil\log_2 p\rceil$ steps of bigger messages.) With uneven counts the busiest rank sets the time, about
# $(p-1)\,\alpha + \beta \max_r \max(\text{out}_r, \text{in}_r)$: an unbalanced router slows the experts' matmuls
# *and* the all-to-all. For M above:

# %%
keep = np.diag(routes)                                            # (P,) rows a rank keeps: copied, not sent
out_rows, in_rows = routes.sum(axis=1) - keep, routes.sum(axis=0) - keep    # (P,) rows that leave, that arrive
say(f"{'rank':>5}{'payload rows':>14}{'kept':>6}{'leave':>7}{'arrive':>8}")
for r in range(P):
    say(f"{r:>5}{routes[r].sum():>14}{keep[r]:>6}{out_rows[r]:>7}{in_rows[r]:>8}")
busiest = int(np.argmax(np.maximum(out_rows, in_rows)))
say(f"busiest rank {busiest}: {max(out_rows[busiest], in_rows[busiest])} rows against "
    f"{(routes.sum() - keep.sum()) / P:.2f} on average")
check.holds("leave = payload - kept; all leaves = all arrivals",
            out_rows.sum() == in_rows.sum() and all(out_rows + keep == routes.sum(axis=1)))
alpha_sr, beta_sr = fits["Sendrecv"]                               # one message's line, section 5 (p = 2)
T_TOK, C_TOK, TOPK, P_EP = 4096, 1024, 2, 8                       # tokens per rank, features, experts per token
n_dispatch = T_TOK * TOPK * C_TOK * 4                             # float32 rows, one per (token, expert)
t_dispatch = (P_EP - 1) * alpha_sr + (P_EP - 1) / P_EP * n_dispatch * beta_sr
say(f"a dispatch of {T_TOK} tokens x top-{TOPK} x {C_TOK} float32 features over p = {P_EP} ranks, routed "
    f"evenly: n = {n_dispatch / MiB:.0f} MiB, {(P_EP - 1) / P_EP * n_dispatch / MiB:.0f} MiB leave each rank; with "
    f"this machine's Sendrecv line, ~{t_dispatch * 1e3:.1f} ms (and as much again for the combine, and both "
    f"again in the backward)")
say(f"(section 5's Alltoall line, p = 2, fitted within {max(abs(d) for d in deviation('Alltoall', FITTED)):.0%} "
    f"of its medians)")

# %% [markdown]
# **A mismatched count.** Before an `Alltoallv` the check (section 6) also compares the counts: rank i's
# send_counts[j] must equal rank j's recv_counts[i]. Here rank 3 expects one row more from rank 0 than it sends
# (the classic bug: counts computed locally instead of exchanged):

# %%
wrong = routes[:, rank].copy()                                    # (P,) my column of M ...
if rank == 3:
    wrong[0] += 1                                                 # ... but rank 3 expects 2 rows from rank 0
messages = raised(lambda: checked.Alltoallv(xs, send_counts, np.empty((int(wrong.sum()), WIDTH)), wrong))
say(f"every rank raised:\n  {messages[0]}")
check.holds("wrong counts: every rank raised, naming ranks 0 and 3's counts",
            all("rank 0's send_counts[3] = 1 but rank 3's recv_counts[0] = 2" in m for m in messages))

# %% [markdown]
# **Where it is used.** Expert parallelism (chapter 16) spreads a mixture-of-experts layer's experts over p ranks:
# the router picks experts, tokens are sorted by their expert's rank (the permutation kept), counts go by `Alltoall`
# and tokens by `Alltoallv` (dispatch), each rank runs its experts, and the swapped `Alltoallv` plus the inverse
# permutation bring the outputs home (combine); the backward runs both the other way round. Exercise 5 builds it.

# %% [markdown]
# ## Check against serial
#
# On 4 ranks, every verdict collective:
#
# * every collective, raw and through `Comm`, gives exactly what NumPy computes, and `CommStats` records one call
#   and the logical tensor's bytes for each;
# * the hand-written ring equals `Allreduce` and NumPy within $(p-1)\epsilon \sum_r |x_r|$, gives every rank the
#   same bits, and sends 2(p-1)/p of the payload per rank;
# * the alpha-beta line fits the measured small and large messages within 30%;
# * a mismatched collective raises on every rank instead of hanging; a raising rank ends its whole job;
# * `Alltoall` is its own inverse, `Alltoallv`'s adjoint is the swapped-counts call, and counts that do not pair up
#   raise on every rank.
#
# Chapter 3 builds the communicators these calls run on.

# %%
what, worst = check.worst(EXACT)                                  # the checks against NumPy and MPI
fit_worst = max(check.errors[w] for w in check.errors if w.startswith("alpha-beta fit"))
say(f"chapter 2: all {len(check.passed)} checks passed on {P} ranks; largest error against NumPy {worst:.1e} "
    f"({what.split(':')[0]}); alpha-beta fits within {fit_worst:.0%} of the measured times")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# Megatron-LM calls its collectives through `torch.distributed`, DeepSpeed through `deepspeed.comm` on top of it,
# mostly with the NCCL backend on GPU memory. The operations are this chapter's; names and buffer conventions differ.
#
# | hsgd (MPI, mpi4py) | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `Comm.Allreduce(x)`: `MPI_Allreduce`, in place (`MPI.IN_PLACE`) | `torch.distributed.all_reduce`, e.g. `_reduce` (megatron/core/tensor_parallel/mappings.py) and `start_grad_sync` (megatron/core/distributed/param_and_grad_buffer.py) | `deepspeed.comm.all_reduce` (deepspeed/comm/comm.py) | `torch.distributed.all_reduce` | NumPy buffers, CPU or staged GPU memory; NCCL works on GPU memory directly |
# | `Comm.Allgather(part, out)`, out of shape (p, *part.shape) | `dist_all_gather_func` = `torch.distributed.all_gather_into_tensor` (`_gather_along_first_dim`, mappings.py) | `deepspeed.comm.all_gather_into_tensor` | `torch.distributed.all_gather_into_tensor` | a new leading axis of size p instead of p blocks concatenated along dim 0: the same memory, explicit shape |
# | `Comm.Reduce_scatter_block(full, out)` | `dist_reduce_scatter_func` = `torch.distributed.reduce_scatter_tensor` (`_reduce_scatter_along_first_dim`) | `deepspeed.comm.reduce_scatter_tensor` | `torch.distributed.reduce_scatter_tensor` | the input has the leading axis of size p |
# | `Comm.Alltoall(send, recv)`, `Comm.Alltoallv(send, send_counts, recv, recv_counts)` | `all_to_all(group, input, output_split_sizes, input_split_sizes)`: `_AllToAll` over `torch.distributed.all_to_all_single` (mappings.py), its backward the same call with the split sizes swapped; the MoE dispatcher `MoEAlltoAllTokenDispatcher` (megatron/core/transformer/moe/token_dispatcher.py) | `deepspeed.comm.all_to_all_single`; `_AllToAll` in deepspeed/moe/sharded_moe.py (equal blocks: tokens padded to the experts' capacity) | `torch.distributed.all_to_all_single(output, input, output_split_sizes, input_split_sizes)` | counts in rows of a NumPy buffer, checked to pair up across ranks under `HSGD_CHECK_COLLECTIVES=1` |
# | `Comm.Bcast(x, root)` | `torch.distributed.broadcast` in `broadcast_data` (megatron/core/tensor_parallel/data.py) | `deepspeed.comm.broadcast` | `torch.distributed.broadcast` | - |
# | `Comm.Send`/`Recv`/`Isend`/`Irecv` | `torch.distributed.isend`/`irecv`, `batch_isend_irecv` (megatron/core/pipeline_parallel/p2p_communication.py) | `deepspeed.comm.send`/`recv`/`isend`/`irecv` | `torch.distributed.send`/`recv`/`isend`/`irecv` | - |
# | mpi4py `Reduce` (no hsgd wrapper) | none | `deepspeed.comm.reduce` | `torch.distributed.reduce` | every hsgd reduction wants its result on all ranks |
# | `CommStats`: calls, payload bytes, seconds per (communicator, operation) | none | the communication logger: `deepspeed.comm.log_summary()`; `calc_bw_log` (deepspeed/utils/comms_logging.py) converts to "bus bandwidth" with 2(n-1)/n and (n-1)/n | none in `torch.distributed` | hsgd records the payload and leaves the algorithm's factor to the formulas (section 4) |
# | `Comm(check=True)` / `HSGD_CHECK_COLLECTIVES=1` -> `CollectiveMismatch` | none | none | `TORCH_DISTRIBUTED_DEBUG=DETAIL` wraps each process group in a `ProcessGroupWrapper` (torch/csrc/distributed/c10d/ProcessGroupWrapper.cpp) that compares the ranks' collective fingerprints: "Detected mismatch between collectives on ranks" | the same idea: one small exchange of (operation, shapes, dtype, sequence number) before each collective |
# | `hsgd.grid.launch.run`: traceback, `MPI_Abort`, every rank ended | launched by `torchrun` (examples/gpt3/train_gpt3_175b_distributed.sh) | the `deepspeed` launcher (deepspeed/launcher/launch.py) kills all local ranks when one exits non-zero (`sigkill_handler`) | `torchrun`'s `LocalElasticAgent` starts and stops the workers of a node as one unit | inside the job, through MPI, rather than in a supervising launcher process |
# | `ring_allreduce` (section 4): one ring, one link, p-1 + p-1 `Sendrecv` steps | per-communicator `min_ctas`/`max_ctas` (NCCL's channels) read from `--nccl-communicator-config-path` by `get_nccl_options` (megatron/core/parallel_state.py) | none: NCCL's defaults or `NCCL_MIN_NCHANNELS`/`NCCL_MAX_NCHANNELS` in the environment | `ProcessGroupNCCL.Options().config.min_ctas`/`max_ctas` | NCCL runs one ring per channel, each on its share of the data and its own links |
# | MPICH's algorithm choice (its `MPIR_CVAR_*` thresholds); no tree All-Reduce in hsgd | none: `NCCL_ALGO` (Ring, Tree, NVLS, NVLSTree, CollnetDirect, CollnetChain) and `NCCL_PROTO` (Simple, LL, LL128) in the job's environment | none (the environment) | none (the environment) | hsgd keeps the ring's 2(p-1) latencies and its fitted alpha; NCCL picks algorithm and protocol per call from its own cost model |
#
# (Megatron-LM falls back to the older `_all_gather_base` and `_reduce_scatter_base` where `torch.distributed` lacks
# `all_gather_into_tensor` and `reduce_scatter_tensor`.)

# %% [markdown]
# ## Exercises
#
# ### Exercise 1: a ring All-Gather by hand
# Write `ring_allgather(comm, part)` from `Sendrecv`: in p-1 steps rank r passes on the block it received last
# (its own at first) and receives a new one from the left. Check it equals MPI's `Allgather` bit for bit, also on a
# 3-rank sub-communicator (`world.Split`), and that each rank sent (p-1)/p x the gathered tensor's bytes.
# (solution: `tutorials/solutions/02_collectives.py`, `exercise_1`)
#
# ### Exercise 2: a binomial-tree broadcast in log2 p rounds
# Write `tree_bcast(comm, buf, root)` from `Send`/`Recv`: with d = (r - root) mod p, in round k every rank with
# d < 2^k sends to d + 2^k, if it exists. Check it against `Bcast` for every root on 4 ranks and on 3, that it takes
# ceil(log2 p) rounds, and that each non-root rank receives n bytes while the root sends ceil(log2 p) x n. Compare
# its cost, ceil(log2 p)(alpha + n beta), with a scatter plus ring All-Gather, about (log2 p + p - 1) alpha +
# 2 (p-1)/p n beta: which wins for small messages, which for large, and why?
# (solution: `tutorials/solutions/02_collectives.py`, `exercise_2`)
#
# ### Exercise 3: find the planted hang
# This gradient sync skips the update when the loss is not finite, then averages the loss for the log:
#
#     def sync(comm, grad, loss):                    # comm: an hsgd.grid.comm.Comm
#         if not np.isfinite(loss):                  # a NaN on one rank only
#             skipped = True
#         else:
#             comm.Allreduce(grad)                   # sum the gradients
#             skipped = False
#         logged = np.array([loss])
#         comm.Allreduce(logged)                     # the loss, for the log
#         return skipped
#
# Give rank 2 a NaN loss and run it with `Comm(world, "world", check=True)`. Which ranks raise, with what message,
# and which call of rank 2 would meet which call of the others without the check? Fix it so the ranks *agree* on
# skipping (an Allreduce of a flag with `MPI.MAX`, as chapter 19 does); check that every rank takes the same branch,
# and that without a NaN the gradient is NumPy's sum.
# (solution: `tutorials/solutions/02_collectives.py`, `exercise_3`)
#
# ### Exercise 4: Alltoall from Sendrecv
# Write `pairwise_alltoall(comm, send)`, `send` of shape (p, m): in step k = 1..p-1 rank r sends block (r+k) mod p
# to that rank and receives block r from rank (r-k) mod p in one `Sendrecv`, and copies its own block. Check it
# equals `Alltoall` bit for bit on 4 ranks and on 3, and that each rank sent (p-1)/p x the send buffer's bytes.
# (solution: `tutorials/solutions/02_collectives.py`, `exercise_4`)
#
# ### Exercise 5: dispatch tokens to experts, and combine them back
# Each rank holds T = 6 tokens of width C = 3; there are E = 2p experts, expert e on rank e // 2, a (C, C) matrix
# $W_e$ from seed e; a router gives every token one expert (random integers). Write `dispatch(comm, x, expert)`
# (sort by expert with `np.argsort(expert, kind="stable")`, count rows per rank with `np.bincount`, exchange counts
# by `Comm.Alltoall`, rows and expert ids by `Comm.Alltoallv`) and `combine(comm, y, state)` (the swapped
# `Alltoallv`, then the inverse permutation). Check that (a) combine undoes dispatch bit for bit; (b) with each
# rank applying its experts, the result is the serial $y_t = x_t W_{e(t)}$; (c) the backward as the adjoints (dy to
# the experts by the combine's adjoint, times $W_e^T$, back by the dispatch's adjoint) gives
# $dx_t = dy_t W_{e(t)}^T$; (d) summed over ranks, `CommStats` recorded p T C 8 bytes for the dispatch's rows and as
# many for the combine's.
# (solution: `tutorials/solutions/02_collectives.py`, `exercise_5`)
