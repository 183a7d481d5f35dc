"""Solutions to the exercises of chapter 2 (tutorials/02_collectives.py).

    mpirun -n 4 python tutorials/solutions/02_collectives.py

Solutions 1-4 are written from `Sendrecv`, `Send` and `Recv` only, and checked against MPI's own collective and
against the byte counts of the chapter's table, on 4 ranks and on a sub-communicator of 3 (rank 3 then waits);
solution 5 dispatches tokens to experts with hsgd's `Comm.Alltoall` and `Comm.Alltoallv` and checks the combine,
the experts' outputs and the backward against serial.
"""
# mpirun -n 4 python tutorials/solutions/02_collectives.py
import math
import os
import sys

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, rel_err, solve  # noqa: E402

from hsgd.grid.comm import CollectiveMismatch, Comm, CommStats  # noqa: E402

threadpool_limits(1)                      # four ranks share the cores: one BLAS thread each
world = MPI.COMM_WORLD
rank = world.Get_rank()


def communicators():
    """[(name, comm)] of every communicator this rank is in, in the same order on every rank: the world, and
    ranks 0-2 (None on rank 3, which skips the work but still makes every check)."""
    three = world.Split(color=0 if rank < 3 else MPI.UNDEFINED, key=rank)
    return [("p=4", world), ("p=3", three if three != MPI.COMM_NULL else None)]


# ---------------------------------------------------------------------------------------------------- exercise 1
def ring_allgather(comm, part):
    """(out, bytes sent): out[s] <- `part` of rank s, by a ring of p-1 Sendrecv steps. At step s rank r passes
    block (r-s) mod p (its own at step 0, then the one it received last) to the right and receives block
    (r-s-1) mod p from the left."""
    p, r = comm.Get_size(), comm.Get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    out = np.empty((p, *part.shape), dtype=part.dtype)              # (p, *part.shape)
    out[r] = part
    sent = 0
    for s in range(p - 1):
        out_b, in_b = (r - s) % p, (r - s - 1) % p
        comm.Sendrecv(out[out_b], dest=right, recvbuf=out[in_b], source=left)
        sent += out[out_b].nbytes
    return out, sent


def exercise_1(check):
    """A ring All-Gather by hand."""
    for name, comm in communicators():
        same, sent_ok = True, True
        if comm is not None:
            part = np.random.default_rng(comm.Get_rank()).standard_normal((5, 3))   # (5, 3) my block
            mine, sent = ring_allgather(comm, part)
            theirs = np.empty_like(mine)
            comm.Allgather(part, theirs)
            same = np.array_equal(mine, theirs)                     # copies only: bit for bit
            p = comm.Get_size()
            sent_ok = sent * p == (p - 1) * mine.nbytes             # (p-1)/p x the gathered tensor
            check.say(f"  {name}: payload {mine.nbytes} B, sent {sent} B per rank = (p-1)/p x payload")
            if comm is not world:
                comm.Free()
        check.holds(f"{name}: ring All-Gather == MPI Allgather, bit for bit", same)
        check.holds(f"{name}: bytes sent per rank == (p-1)/p x payload", sent_ok)


# ---------------------------------------------------------------------------------------------------- exercise 2
def tree_bcast(comm, buf, root=0):
    """In place: buf <- the root's buf, by a binomial tree. With d = (rank - root) mod p, in round k every rank
    with d < 2^k (it has the data) sends to d + 2^k if that rank exists, and the ranks with 2^k <= d < 2^(k+1)
    receive. Returns (rounds, bytes sent, bytes received) of this rank."""
    p, r = comm.Get_size(), comm.Get_rank()
    d = (r - root) % p
    rounds = sent = received = 0
    while (1 << rounds) < p:
        step = 1 << rounds
        if d < step and d + step < p:                               # I have it: pass it on
            comm.Send(buf, dest=(d + step + root) % p)
            sent += buf.nbytes
        elif step <= d < 2 * step:                                  # I get it in this round
            comm.Recv(buf, source=(d - step + root) % p)
            received += buf.nbytes
        rounds += 1
    return rounds, sent, received


def exercise_2(check):
    """A binomial-tree broadcast in ceil(log2 p) rounds."""
    n = 6 * 8                                                       # bytes of the message
    for name, comm in communicators():
        same, counts_ok = True, True
        if comm is not None:
            p, r = comm.Get_size(), comm.Get_rank()
            for root in range(p):
                mine = np.random.default_rng(root).standard_normal(6) if r == root else np.zeros(6)
                theirs = mine.copy()
                rounds, sent, received = tree_bcast(comm, mine, root)
                comm.Bcast(theirs, root=root)
                same = same and np.array_equal(mine, theirs)
                depth = math.ceil(math.log2(p))
                expect = (depth * n, 0) if r == root else (sent, n)  # the root sends log2 p times; others get n once
                counts_ok = counts_ok and rounds == depth and (sent, received) == expect
            check.say(f"  {name}: {math.ceil(math.log2(p))} rounds; every root gives MPI's Bcast")
            if comm is not world:
                comm.Free()
        check.holds(f"{name}: tree Bcast == MPI Bcast, every root", same)
        check.holds(f"{name}: ceil(log2 p) rounds, root sends that x n, others get n", counts_ok)

    # The alpha-beta costs. Tree: ceil(log2 p) (alpha + n beta). Scatter then ring All-Gather (the long-message
    # Bcast of Thakur, Rabenseifner and Gropp 2005): log2 p alpha + (p-1)/p n beta for the scatter (a binomial
    # tree of halving messages), (p-1) alpha + (p-1)/p n beta for the ring. The tree has fewer latencies, the other
    # fewer bytes from the root (about 2 n instead of log2 p x n): the tree wins below n*, where the two are equal.
    # In units of n_1/2 = alpha / beta (the size where a message is half latency), for p a power of two:
    #   n* = (p - 1) / (log2 p - 2 (p-1)/p)  x  alpha / beta.
    check.say("  p     n* (in units of alpha/beta)   tree wins below n*, scatter + ring All-Gather above")
    worst = 0.0
    for p in (4, 8, 64, 1024):
        lg = math.log2(p)
        n_star = (p - 1) / (lg - 2 * (p - 1) / p)                   # with alpha = beta = 1
        tree = lg * (1 + n_star)
        scatter_ring = (lg + p - 1) + 2 * (p - 1) / p * n_star
        worst = max(worst, abs(tree - scatter_ring) / tree)
        check.say(f"  {p:<6}{n_star:>10.1f}")
    check("the two costs are equal at n* (the algebra)", worst)


# ---------------------------------------------------------------------------------------------------- exercise 3
def buggy_sync(comm, grad, loss):
    """The exercise's planted bug: the branch depends on a rank-local value."""
    if not np.isfinite(loss):                                       # a NaN on one rank only
        skipped = True
    else:
        comm.Allreduce(grad)                                        # sum the gradients
        skipped = False
    logged = np.array([loss])
    comm.Allreduce(logged)                                          # the loss, for the log
    return skipped


def fixed_sync(comm, grad, loss):
    """The ranks agree first: one Allreduce (MAX) of a 'bad' flag, so that all of them take the same branch."""
    bad = np.array([0.0 if np.isfinite(loss) else 1.0])
    comm.Allreduce(bad, op=MPI.MAX)                                 # 1 on every rank if any rank saw a NaN
    skipped = bool(bad[0])
    if not skipped:
        comm.Allreduce(grad)
    logged = np.array([loss])
    comm.Allreduce(logged)
    return skipped


def exercise_3(check):
    """Find the planted hang."""
    P = world.Get_size()
    comm = Comm(world, "world", CommStats(), check=True)
    grad = np.random.default_rng(rank).standard_normal(4)          # (4,) this rank's gradient
    loss = float("nan") if rank == 2 else 1.0
    try:
        buggy_sync(comm, grad.copy(), loss)
        caught = ""
    except CollectiveMismatch as e:
        caught = str(e)
    messages = world.allgather(caught)
    check.say(f"  buggy_sync, NaN on rank 2:\n    {messages[0]}")
    # Without the check: ranks 0, 1, 3 enter the gradient Allreduce (4 numbers) while rank 2 enters the loss
    # Allreduce (1 number). Mismatched counts in one collective are erroneous: at best an MPI error, usually a
    # hang; and the loss Allreduce of ranks 0, 1, 3 then waits for a rank 2 that has already left.
    check.holds("buggy_sync: every rank raised CollectiveMismatch", all(messages))
    check.holds("the message points at rank 2's shorter Allreduce",
                all("rank 2: Allreduce shapes=[(1,)]" in m and "ranks 0,1,3: Allreduce shapes=[(4,)]" in m
                    for m in messages))

    comm = Comm(world, "world", CommStats(), check=True)
    skipped = fixed_sync(comm, grad.copy(), loss)
    check.holds("fixed_sync, NaN on rank 2: every rank skips, no mismatch", all(world.allgather(skipped)))
    summed = grad.copy()
    skipped = fixed_sync(comm, summed, 1.0)
    ref = np.stack([np.random.default_rng(r).standard_normal(4) for r in range(P)]).sum(axis=0)
    check.holds("fixed_sync, no NaN: no rank skips", not any(world.allgather(skipped)))
    check("fixed_sync, no NaN: gradient vs NumPy's sum", rel_err(summed, ref))


# ---------------------------------------------------------------------------------------------------- exercise 4
def pairwise_alltoall(comm, send):
    """(recv, bytes sent): recv[s] <- block `rank` of rank s's send, in p-1 Sendrecv steps. send: (p, m). In step
    k, rank r sends block (r+k) mod p to rank (r+k) mod p and receives from rank (r-k) mod p; its own block it
    copies."""
    p, r = comm.Get_size(), comm.Get_rank()
    recv = np.empty_like(send)                                      # (p, m)
    recv[r] = send[r]
    sent = 0
    for k in range(1, p):
        dest, source = (r + k) % p, (r - k) % p
        comm.Sendrecv(send[dest], dest=dest, recvbuf=recv[source], source=source)
        sent += send[dest].nbytes
    return recv, sent


def exercise_4(check):
    """Alltoall from Sendrecv."""
    for name, comm in communicators():
        same, sent_ok = True, True
        if comm is not None:
            p, r = comm.Get_size(), comm.Get_rank()
            send = np.random.default_rng(10 + r).standard_normal((p, 3))   # (p, 3) block s goes to rank s
            mine, sent = pairwise_alltoall(comm, send)
            theirs = np.empty_like(send)
            comm.Alltoall(send, theirs)
            same = np.array_equal(mine, theirs)
            sent_ok = sent * p == (p - 1) * send.nbytes             # (p-1)/p x the send buffer
            check.say(f"  {name}: payload {send.nbytes} B, sent {sent} B per rank = (p-1)/p x payload")
            if comm is not world:
                comm.Free()
        check.holds(f"{name}: pairwise Alltoall == MPI Alltoall, bit for bit", same)
        check.holds(f"{name}: bytes sent per rank == (p-1)/p x payload", sent_ok)


# ---------------------------------------------------------------------------------------------------- exercise 5
def dispatch(comm, x, expert, experts_per_rank):
    """(rows, their experts, state): this rank's tokens x (T, C) sent to the ranks of their experts, expert (T,)
    each token's expert, expert e on rank e // experts_per_rank. The tokens are sorted by expert (a stable argsort:
    the permutation, kept as an index array), so by rank; the counts travel first (Alltoall), then the rows and
    their expert ids (Alltoallv). state: what the combine and the backward need."""
    order = np.argsort(expert, kind="stable")                       # (T,) token order -> sorted by expert
    send_counts = np.bincount(expert // experts_per_rank, minlength=comm.size)    # (p,) rows for each rank
    recv_counts = np.empty_like(send_counts)                        # (p,) rows from each rank
    comm.Alltoall(send_counts, recv_counts)
    n = int(recv_counts.sum())
    rows, ids = np.empty((n, x.shape[1])), np.empty(n, dtype=expert.dtype)        # (n, C), (n,)
    comm.Alltoallv(np.ascontiguousarray(x[order]), send_counts, rows, recv_counts)
    comm.Alltoallv(np.ascontiguousarray(expert[order]), send_counts, ids, recv_counts)
    return rows, ids, (order, send_counts, recv_counts)


def redispatch(comm, x, state):
    """The dispatch's communication again, for rows in token order (the routing of `state`): the adjoint of
    combine, used by the backward to send dy to the experts."""
    order, send_counts, recv_counts = state
    rows = np.empty((int(recv_counts.sum()), x.shape[1]))
    comm.Alltoallv(np.ascontiguousarray(x[order]), send_counts, rows, recv_counts)
    return rows


def combine(comm, y, state):
    """The rows y (n, C) at the experts back to their tokens, in token order: the Alltoallv with the counts
    swapped (the adjoint and inverse of the dispatch's), then the inverse permutation."""
    order, send_counts, recv_counts = state
    back = np.empty((len(order), y.shape[1]))                       # (T, C) sorted by expert
    comm.Alltoallv(np.ascontiguousarray(y), recv_counts, back, send_counts)
    out = np.empty_like(back)
    out[order] = back                                               # undo the sort
    return out


def exercise_5(check):
    """Dispatch tokens to experts, and combine them back."""
    P = world.Get_size()
    T, C, E = 6, 3, 2 * P                                           # tokens per rank, width, experts
    W = np.stack([np.random.default_rng(e).standard_normal((C, C)) for e in range(E)])   # (E, C, C) expert e: W[e]
    expert_of = [np.random.default_rng(50 + r).integers(0, E, T) for r in range(P)]   # (T,) the router's choice
    x_of = [np.random.default_rng(60 + r).standard_normal((T, C)) for r in range(P)]
    dy_of = [np.random.default_rng(70 + r).standard_normal((T, C)) for r in range(P)]
    expert, x, dy = expert_of[rank], x_of[rank], dy_of[rank]
    comm = Comm(world, "ep", CommStats())

    rows, ids, state = dispatch(comm, x, expert, E // P)
    check.holds("(a) combine(dispatch(x)) == x, bit for bit", np.array_equal(combine(comm, rows, state), x))
    y = combine(comm, np.einsum("nc,ncd->nd", rows, W[ids]), state)   # my experts: row n times W[ids[n]]
    check("(b) y_t = x_t W_e(t): max rel err vs serial", rel_err(y, np.stack([x[t] @ W[expert[t]] for t in range(T)])))
    drows = redispatch(comm, dy, state)                             # the combine's adjoint
    dx = combine(comm, np.einsum("nd,ncd->nc", drows, W[ids]), state)   # times W^T; the dispatch's adjoint
    check("(c) dx_t = dy_t W_e(t)^T: max rel err vs serial",
          rel_err(dx, np.stack([dy[t] @ W[expert[t]].T for t in range(T)])))

    # the bytes: every Alltoallv of rows sends its send buffer; a dispatch's is T rows on every rank, a combine's
    # the rows that rank's experts processed, which add up to the same p T rows
    mine = comm.stats.nbytes("ep", "Alltoallv")
    total = world.allreduce(mine)
    calls = comm.stats.calls("ep", "Alltoallv")                     # rows: x and dy dispatched, 3 combines; ids
    want = (2 + 3) * P * T * C * 8 + P * T * 8
    check.say(f"  {calls} Alltoallv: {mine} B on rank {rank}, {total} B on all {P} ranks = "
              f"5 x p T C 8 + p T 8 (the expert ids) = {want}")
    check.holds("(d) dispatch and combine: p T C 8 bytes each, in all",
                calls == 6 and total == want)


if __name__ == "__main__":
    solve(Checks(MPI.COMM_WORLD, tol=1e-12, width=60),
          [exercise_1, exercise_2, exercise_3, exercise_4, exercise_5])
