"""The communication layer on 8 ranks, in one file (one mpiexec start-up for all of it):

  * the process grid: placement (tp fastest, then pp, then dp), communicators from Split, errors;
  * the collective wrappers: results equal NumPy's, every call is counted with its bytes, and the
    collective-sequence check turns a mismatched call into an error instead of a hang;
  * the hierarchical all-reduce (and on two 4-rank sub-communicators side by side): it equals a flat Allreduce,
    it is bit-identical on every rank, CommStats matches hier_formula exactly (padding included), the node groups
    are consecutive ranks and the cross groups strided, and a ranks_per_node that does not divide the ranks is a
    ConfigError on every rank. ranks_per_node=None is MPI's shared-memory split: one node on this machine.
"""
import hashlib

import numpy as np
import pytest
from mpi4py import MPI

from hsgd.grid.comm import CollectiveMismatch, Comm, CommStats
from hsgd.dp.average import FlatBuffer, dp_average
from hsgd.errors import ConfigError, UsageError
from hsgd.grid.process_grid import GridError, ProcessGrid, factorizations
from hsgd.dp.hierarchical import (HierarchicalExchange, cross_node_bytes, hier_formula, hierarchical_allreduce,
                                  node_split)

from .conftest import WORLD, check, say, world_max

pytestmark = pytest.mark.mpi(min_size=8)


# --------------------------------------------------------------------------------------------------- the process grid

def test_every_factorization_places_ranks_and_splits_communicators():
    assert len(factorizations(8)) == 10
    for dp, pp, tp in factorizations(8):
        grid = ProcessGrid(WORLD, dp=dp, pp=pp, tp=tp)
        r = WORLD.Get_rank()
        ok = (r == ProcessGrid.rank_of(grid.dp_rank, grid.pp_rank, grid.tp_rank, pp, tp)
              and (grid.tp_comm.size, grid.pp_comm.size, grid.dp_comm.size) == (tp, pp, dp)
              and (grid.tp_comm.rank, grid.pp_comm.rank, grid.dp_comm.rank) == (grid.tp_rank, grid.pp_rank,
                                                                               grid.dp_rank))
        # the members of each communicator, as world ranks, are the group the formula predicts
        groups = grid.groups()
        for dim in ("tp", "pp", "dp"):
            c = getattr(grid, f"{dim}_comm")
            members = c.comm.allgather(r)
            ok = ok and members in groups[dim] and r in members
        check(ok, f"layout dp={dp} pp={pp} tp={tp}")
        grid.free()
    say("all 10 factorizations of 8 ranks: placement and communicators as documented")


def test_every_4d_factorization_places_ranks_and_splits_communicators():
    """dp x pp x cp x tp = 8 (all 20): rank = ((dp_rank pp + pp_rank) cp + cp_rank) tp + tp_rank, each communicator
    the group grid.groups() names, and dp_comm every rank of a shard (dp x cp of them)."""
    layouts = [(8 // (p * c * t), p, c, t) for p in (1, 2, 4, 8) for c in (1, 2, 4, 8) for t in (1, 2, 4, 8)
               if 8 % (p * c * t) == 0]
    r = WORLD.Get_rank()
    for dp, pp, cp, tp in layouts:
        grid = ProcessGrid(WORLD, dp=dp, pp=pp, tp=tp, cp=cp)
        ok = (r == ProcessGrid.rank_of(grid.dp_rank, grid.pp_rank, grid.tp_rank, pp, tp, grid.cp_rank, cp)
              and (grid.tp_comm.size, grid.cp_comm.size, grid.pp_comm.size, grid.dp_comm.size) == (tp, cp, pp, dp * cp)
              and (grid.tp_comm.rank, grid.cp_comm.rank, grid.pp_comm.rank, grid.dp_comm.rank) ==
              (grid.tp_rank, grid.cp_rank, grid.pp_rank, grid.dp_rank * cp + grid.cp_rank))
        groups = grid.groups()
        for dim in ("tp", "cp", "pp", "dp"):
            members = getattr(grid, f"{dim}_comm").comm.allgather(r)
            ok = ok and (members in groups[dim] if dim in groups else members == [r])
        check(ok, f"layout dp={dp} pp={pp} cp={cp} tp={tp}")
        grid.free()
    say(f"all {len(layouts)} factorizations of 8 ranks into dp x pp x cp x tp: placement and communicators as "
        "documented")


def test_tp_groups_are_consecutive_ranks():
    grid = ProcessGrid(WORLD, dp=2, pp=2, tp=2)
    g = grid.groups()
    say("dp=2 pp=2 tp=2 groups:", g)
    check(g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and g["pp"][0] == [0, 2] and g["dp"][0] == [0, 4])
    table = grid.layout_table()
    check(table.splitlines()[1].split()[:4] == ["0", "0", "0", "0"] and len(table.splitlines()) == 9)
    say(table)
    grid.free()


@pytest.mark.parametrize("sizes, words", [
    ((3, 1, 2), "dp*pp*tp = 3*1*2 = 6 does not match the 8 ranks"),
    ((8, 1, 0), "tp=0 must be a positive integer"),
    ((-1, 1, 8), "dp=-1 must be a positive integer"),
])
def test_bad_sizes_raise_on_every_rank_before_communicating(sizes, words):
    dp, pp, tp = sizes
    try:
        ProcessGrid(WORLD, dp=dp, pp=pp, tp=tp)
        msg = "no error"
    except GridError as e:
        msg = str(e)
    check(words in msg and isinstance(GridError(msg), UsageError), msg)


def test_grid_on_a_sub_communicator():
    """Any communicator works as the base: two independent 4-rank grids side by side."""
    half = WORLD.Split(color=WORLD.Get_rank() // 4, key=WORLD.Get_rank())
    grid = ProcessGrid(half, dp=2, tp=2)
    members = grid.tp_comm.comm.allgather(WORLD.Get_rank())
    base = 4 * (WORLD.Get_rank() // 4)
    check(members in ([base, base + 1], [base + 2, base + 3]), f"tp members {members}")
    total = grid.world.comm.allreduce(1, op=MPI.SUM)
    check(total == 4)
    grid.free()
    half.Free()


# -------------------------------------------------------------------------------------------- the collective wrappers

def make(check_seq=False):
    return Comm(WORLD, "world", CommStats(), check=check_seq)


def test_allreduce_allgather_reduce_scatter_bcast():
    c = make()
    r, P = c.rank, c.size
    rows = np.arange(P, dtype=np.float64)[:, None] * 10 + np.arange(3)          # (P, 3): rank q's data is row q
    x = rows[r].copy()
    c.Allreduce(x)
    ok = np.array_equal(x, rows.sum(0))
    m = rows[r].copy()
    c.Allreduce(m, op=MPI.MAX)
    ok &= np.array_equal(m, rows.max(0))
    out = np.empty((P, 3))
    c.Allgather(rows[r].copy(), out)
    ok &= np.array_equal(out, rows)
    full = np.stack([rows * (q + 1) for q in range(P)], axis=0)[r].reshape(P, 3)  # rank r sends rows*(r+1)
    part = np.empty(3)
    c.Reduce_scatter_block(np.ascontiguousarray(full), part)
    ok &= np.allclose(part, rows[r] * sum(q + 1 for q in range(P)))
    b = np.full(4, float(r))
    c.Bcast(b, root=3)
    ok &= np.all(b == 3.0)
    req = c.Iallreduce(y := np.full(5, 1.0 + r))
    req.Wait()
    ok &= np.all(y == sum(1.0 + q for q in range(P)))
    counts = c.stats.counts()
    expected = {("world", "Allreduce"): (2, 48), ("world", "Allgather"): (1, P * 24),
                ("world", "Reduce_scatter_block"): (1, P * 24), ("world", "Bcast"): (1, 32),
                ("world", "Iallreduce"): (1, 40)}
    say("recorded:\n" + c.stats.format())
    check(ok and counts == expected, f"results ok={ok}, counts {counts}")


def test_send_recv_ring():
    c = make()
    r, P = c.rank, c.size
    x, y = np.full(6, float(r)), np.empty(6)
    if r % 2 == 0:                                    # even ranks send first: no deadlock on blocking calls
        c.Send(x, dest=(r + 1) % P)
        c.Recv(y, source=(r - 1) % P)
    else:
        c.Recv(y, source=(r - 1) % P)
        c.Send(x, dest=(r + 1) % P)
    z = np.empty(6)
    reqs = [c.Irecv(z, source=(r + 1) % P), c.Isend(x, dest=(r - 1) % P)]
    for q in reqs:
        q.Wait()
    counts = c.stats.counts()
    check(np.all(y == (r - 1) % P) and np.all(z == (r + 1) % P)
          and counts[("world", "Send")] == (1, 48) and counts[("world", "Isend")] == (1, 48))


def test_non_contiguous_buffer_is_refused():
    c = make()
    a = np.zeros((4, 4))[:, 1]
    try:
        c.Allreduce(a)
        msg = "accepted"
    except ValueError as e:
        msg = str(e)
    check("must be C-contiguous" in msg, msg)


def test_mismatched_shapes_raise_instead_of_hanging():
    c = make(check_seq=True)
    n = 3 if c.rank == 5 else 4                       # rank 5 disagrees about the shape
    try:
        c.Allreduce(np.zeros(n))
        msg = "no error"
    except CollectiveMismatch as e:
        msg = str(e)
    say(msg)
    check("rank 5: Allreduce shapes=[(3,)]" in msg and "ranks 0,1,2,3,4,6,7: Allreduce shapes=[(4,)]" in msg, msg)


def test_mismatched_operations_raise_instead_of_hanging():
    c = make(check_seq=True)
    c.Allreduce(np.zeros(2))                          # one good call first: the sequence numbers agree
    try:
        if c.rank == 2:
            c.Bcast(np.zeros(2))                      # rank 2 calls a different collective
        else:
            c.Allreduce(np.zeros(2))
        msg = "no error"
    except CollectiveMismatch as e:
        msg = str(e)
    check("rank 2: Bcast" in msg and "ranks 0,1,3,4,5,6,7: Allreduce" in msg and "call #1" in msg, msg)


# ------------------------------------------------------------------------------------------------- the all-to-alls

def routing(P):
    """M (P, P) int64: M[i, j] rows that rank i sends to rank j, the same on every rank (seed 0): uneven, with
    zeros on the diagonal of the odd ranks, rank 3 sending nothing and rank 5 receiving nothing."""
    M = np.random.default_rng(0).integers(0, 4, (P, P))
    M[np.arange(1, P, 2), np.arange(1, P, 2)] = 0
    M[3, :] = 0
    M[:, 5] = 0
    return M


def by_rank(counts):
    """The row offsets of the blocks of a buffer laid out in rank order: [0, c0, c0+c1, ...] (size+1,)."""
    return np.concatenate([[0], np.cumsum(counts)])


def test_alltoall_and_alltoallv_equal_numpy():
    """Alltoall and Alltoallv against the transpose NumPy builds from every rank's send buffer (float64 and
    int64; uneven and zero counts); the counts themselves exchanged with Alltoall, as a dispatch does; the payload
    recorded is the send buffer, own block included; a one-rank communicator copies and still counts."""
    c = make()
    r, P = c.rank, c.size
    rng = np.random.default_rng(10 + r)
    worst = 0.0
    for dtype in (np.float64, np.int64):                                        # Alltoall: 2 rows per block
        send = (rng.standard_normal((2 * P, 3)) * 100).astype(dtype)           # (2P, 3) block j: rows 2j, 2j+1
        recv = np.empty_like(send)
        c.Alltoall(send, recv)
        everyone = c.allgather_obj(send)
        ref = np.concatenate([everyone[j][2 * r:2 * r + 2] for j in range(P)])  # block rank of every rank j
        worst = max(worst, float(np.max(np.abs(recv - ref))))
    M = routing(P)
    send_counts = np.ascontiguousarray(M[r])                                    # (P,) int64: rows to each rank
    recv_counts = np.empty_like(send_counts)
    c.Alltoall(send_counts, recv_counts)                                        # what each rank will send me
    ok = np.array_equal(recv_counts, M[:, r])
    nbytes_v = 0
    for dtype, row in ((np.float64, (3,)), (np.int64, (2, 2))):
        send = (rng.standard_normal((int(send_counts.sum()), *row)) * 100).astype(dtype)
        recv = np.empty((int(recv_counts.sum()), *row), dtype)
        c.Alltoallv(send, send_counts, recv, recv_counts)
        everyone = c.allgather_obj(send)
        ref = np.concatenate([everyone[i][by_rank(M[i])[r]:by_rank(M[i])[r + 1]] for i in range(P)])
        worst = max(worst, float(np.max(np.abs(recv - ref))) if recv.size else 0.0)
        ok = ok and recv.shape == ref.shape
        nbytes_v += send.nbytes
    counts = c.stats.counts()
    want = {("world", "Alltoall"): (3, 2 * P * 3 * 8 * 2 + P * 8), ("world", "Alltoallv"): (2, nbytes_v)}
    ok = ok and counts == want and nbytes_v == int(M[r].sum()) * (3 + 4) * 8
    one = Comm(MPI.COMM_SELF, "self", CommStats())                              # one rank: a copy, counted
    x, y = np.arange(6.0).reshape(3, 2), np.empty((3, 2))
    one.Alltoallv(x, [3], y, [3])
    ok = ok and np.array_equal(x, y) and one.stats.counts() == {("self", "Alltoallv"): (1, 48)}
    say(f"Alltoall, Alltoallv vs NumPy's transpose (float64, int64; counts per rank\n{M}):\n"
        f"max |diff| {world_max(worst):.1e}\n" + c.stats.format())
    check(ok and worst == 0.0, f"max |diff| {worst}, counts {counts} vs {want}")


def test_alltoallv_adjoint_is_alltoallv_with_the_counts_swapped():
    """A = Alltoallv(send_counts = M[r], recv_counts = M[:, r]) is a permutation of all ranks' rows, so its adjoint
    is its inverse, the Alltoallv with the counts swapped: <A x, y> = <x, A^T y> (sums over every rank) to 1e-12,
    and the combine undoes the dispatch exactly (A^T A x = x)."""
    c = make()
    r, P = c.rank, c.size
    M = routing(P)
    rng = np.random.default_rng(20 + r)
    x = rng.standard_normal((int(M[r].sum()), 4))                               # (rows I send, 4)
    y = rng.standard_normal((int(M[:, r].sum()), 4))                            # (rows I receive, 4)
    Ax, ATy, back = np.empty_like(y), np.empty_like(x), np.empty_like(x)
    c.Alltoallv(x, M[r], Ax, M[:, r])                                           # dispatch
    c.Alltoallv(y, M[:, r], ATy, M[r])                                          # its adjoint: the combine
    c.Alltoallv(Ax, M[:, r], back, M[r])                                        # the combine of the dispatch
    lhs, rhs = np.array([np.vdot(Ax, y)]), np.array([np.vdot(x, ATy)])
    c.comm.Allreduce(MPI.IN_PLACE, lhs)
    c.comm.Allreduce(MPI.IN_PLACE, rhs)
    err = abs(lhs[0] - rhs[0]) / abs(lhs[0])
    say(f"<A x, y> = {lhs[0]:.15f}, <x, A^T y> = {rhs[0]:.15f}: relative difference {err:.1e}; "
        f"A^T A x = x exactly: {world_max(0.0 if np.array_equal(back, x) else 1.0) == 0.0}")
    check(err <= 1e-12 and np.array_equal(back, x), f"adjoint rel err {err:.2e}, round trip {np.array_equal(back, x)}")


def test_alltoallv_mismatched_counts_raise_instead_of_hanging():
    """With the check on, counts that do not pair up (rank 5 expects one row more from rank 2 than rank 2 sends)
    and a row shape that differs on one rank raise CollectiveMismatch on every rank, before MPI is entered; the
    communicator is still usable after (the last call is a good one)."""
    c = make(check_seq=True)
    r, P = c.rank, c.size
    M = routing(P)
    M[2, 5] = 2                                                                 # rank 2 sends 2 rows to rank 5 ...
    send_counts, recv_counts = M[r].copy(), M[:, r].copy()
    if r == 5:
        recv_counts[2] += 1                                                     # ... which expects 3
    messages = []
    for width in (3, 4 if r == 1 else 3):                                       # 2nd: rank 1's rows are wider
        if width == 4:
            send_counts, recv_counts = M[r], M[:, r]                            # the counts right this time
        try:
            c.Alltoallv(np.zeros((int(send_counts.sum()), width)), send_counts,
                        np.zeros((int(recv_counts.sum()), width)), recv_counts)
            messages.append("no error")
        except CollectiveMismatch as e:
            messages.append(str(e))
    good = np.empty((int(M[:, r].sum()), 3))
    c.Alltoallv(np.full((int(M[r].sum()), 3), float(r)), M[r], good, M[:, r])
    say("\n".join(messages))
    check("Alltoallv counts disagree on communicator 'world' (call #0): rank 2's send_counts[5] = 2 but rank 5's "
          "recv_counts[2] = 3 (they must be equal" in messages[0]
          and "rank 1: Alltoallv shapes=[('*', 4), ('*', 4)]" in messages[1] and "call #1" in messages[1]
          and np.array_equal(good[:, 0], np.repeat(np.arange(P), M[:, r])), messages)


# ---------------------------------------------------------------------------------------- the hierarchical all-reduce

SIZES = [1, 5, 8, 1000, 1001, 4099]               # elements: below, at, and off multiples of every node size


def dp_comms():
    """(label, a Comm named "dp"): all 8 ranks, and ranks 0-3 / 4-7 as two independent 4-rank communicators."""
    quad = WORLD.Split(color=WORLD.Get_rank() // 4, key=WORLD.Get_rank())
    return [("world", Comm(WORLD, "dp", CommStats())), ("quad", Comm(quad, "dp", CommStats()))]


def digest(x):
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


@pytest.mark.parametrize("ranks_per_node", [1, 2, 4, 8, None])
def test_equals_flat_allreduce_and_counts_match_the_formula(ranks_per_node):
    for label, dp in dp_comms():
        if ranks_per_node is not None and dp.size % ranks_per_node:
            dp.free()
            continue                                                    # 8 on a 4-rank communicator: see below
        node, cross = node_split(dp, ranks_per_node)
        n, k = node.size, cross.size
        ok = n * k == dp.size and (ranks_per_node is None or n == ranks_per_node)
        worst, lines = 0.0, []
        for N in SIZES:
            rng = np.random.default_rng(1000 * WORLD.Get_rank() + N)
            x = rng.standard_normal(N)                                  # (N,) float64, different on every rank
            ref = x.copy()
            dp.comm.Allreduce(MPI.IN_PLACE, ref)                        # the flat reference (not recorded)
            dp.stats.reset()
            hierarchical_allreduce(x, node, cross)
            err = float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))
            worst = max(worst, err)
            want = hier_formula(x.nbytes, n, k, x.itemsize)
            got = dp.stats.counts()
            ok = ok and err <= 1e-15 and got == want
            same = dp.comm.allgather(digest(x))                         # every rank bit-identical
            ok = ok and len(set(same)) == 1
            xi = rng.integers(-1000, 1000, N).astype(np.float64)        # integer-valued: exact
            refi = xi.copy()
            dp.comm.Allreduce(MPI.IN_PLACE, refi)
            hierarchical_allreduce(xi, node, cross)
            ii = rng.integers(-1000, 1000, N)                           # an integer dtype: exact too
            refii = ii.copy()
            dp.comm.Allreduce(MPI.IN_PLACE, refii)
            hierarchical_allreduce(ii, node, cross)
            ok = ok and np.array_equal(xi, refi) and np.array_equal(ii, refii)
            x_b = cross_node_bytes(x.nbytes, n, k, x.itemsize)
            lines.append(f"  N={N:5d}: measured {got[('dp-node', 'Reduce_scatter_block')][1]:6d} / "
                         f"{got[('dp-cross', 'Allreduce')][1]:5d} / {got[('dp-node', 'Allgather')][1]:6d} B "
                         f"(node RS / cross AR / node AG), formula {want[('dp-node', 'Reduce_scatter_block')][1]:6d}"
                         f" / {want[('dp-cross', 'Allreduce')][1]:5d} / {want[('dp-node', 'Allgather')][1]:6d}; "
                         f"leaves the node per rank: hier {x_b['hier']:.0f} B, flat ring {x_b['flat_ring']:.0f} B")
        check(ok, f"{label} ranks_per_node={ranks_per_node} (n={n}, k={k}): max rel err {worst:.2e}")
        say(f"{label}: P={dp.size} as {k} nodes x {n} ranks, max rel error vs flat Allreduce "
            f"{world_max(worst):.1e}, integers exact\n" + "\n".join(lines))
        for c in (node, cross, dp):
            c.free()


@pytest.mark.parametrize("ranks_per_node", [1, 2, 4, 8])
def test_node_groups_are_consecutive_and_cross_groups_strided(ranks_per_node):
    dp = Comm(WORLD, "dp", CommStats())
    node, cross = node_split(dp, ranks_per_node)
    n, r = ranks_per_node, WORLD.Get_rank()
    members_node, members_cross = node.comm.allgather(r), cross.comm.allgather(r)
    want_node = list(range(r // n * n, r // n * n + n))                 # [node*n, ..., node*n + n-1]
    want_cross = list(range(r % n, 8, n))                               # [local, local+n, ...]
    check(members_node == want_node and members_cross == want_cross
          and (node.name, cross.name) == ("dp-node", "dp-cross") and node.stats is dp.stats is cross.stats,
          f"node {members_node} vs {want_node}, cross {members_cross} vs {want_cross}")
    say(f"ranks_per_node={n}: rank 0's node group {members_node}, cross group {members_cross}")
    node.free()
    cross.free()


def test_shared_memory_default_is_one_node_here():
    dp = Comm(WORLD, "dp", CommStats())
    node, cross = node_split(dp)
    hosts = set(WORLD.allgather(MPI.Get_processor_name()))
    check(len(hosts) > 1 or (node.size, cross.size, node.rank) == (8, 1, WORLD.Get_rank()),
          f"hosts {hosts}: node {node.size}, cross {cross.size}")
    say(f"shared-memory split on {len(hosts)} host(s): {cross.size} node(s) of {node.size}")
    node.free()
    cross.free()


@pytest.mark.parametrize("which, bad", [("world", 3), ("world", 0), ("world", 16), ("quad", 8), ("quad", 3)])
def test_bad_ranks_per_node_is_a_config_error_on_every_rank(which, bad):
    comms = dict(dp_comms())
    try:
        node_split(comms[which], bad)
        msg = "no error"
    except ConfigError as e:
        msg = str(e)
    P = comms[which].size
    check(f"ranks_per_node={bad} does not split the {P} ranks of 'dp'" in msg and "use a divisor of" in msg, msg)
    say(msg)
    comms["quad"].free()


@pytest.mark.parametrize("ranks_per_node", [2, 4])
def test_exchange_equals_dp_average(ranks_per_node):
    """The drop-in for dp_average: the same mean gradient, replicas bit-identical, counts as its formula says."""
    dp = Comm(WORLD, "dp", CommStats())
    rng = np.random.default_rng(7 + WORLD.Get_rank())
    params = {"w": np.zeros((13, 7)), "b": np.zeros(7)}                 # 98 elements: padded to a multiple of n
    ex = HierarchicalExchange(params, {"all": ["w", "b"]}, dp, ranks_per_node)
    flat = FlatBuffer(params)
    hier = ex.begin()
    hier.flat[:] = flat.flat[:] = rng.standard_normal(hier.flat.size)
    ref_stats = Comm(WORLD, "ref", CommStats())
    dp_average(flat, ref_stats)
    scratch = ex.scratch
    for step in range(2):                                               # the second step reuses the buffers
        if step:
            hier = ex.begin()
            hier.flat[:] = rng.standard_normal(hier.flat.size)
            flat.flat[:] = hier.flat
            dp_average(flat, ref_stats)
        dp.stats.reset()
        ex.finish()
        err = float(np.max(np.abs(hier.flat - flat.flat)))
        same = len(set(WORLD.allgather(digest(hier.flat)))) == 1
        check(err <= 1e-15 and same and dp.stats.counts() == ex.sizes.formula() and ex.scratch is scratch,
              f"err {err:.2e}, replicas identical {same}, {dp.stats.counts()}")
    say(f"HierarchicalExchange(ranks_per_node={ranks_per_node}) vs dp_average: max |diff| {world_max(err):.1e}\n"
        + dp.stats.format())
    ex.free()
