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
