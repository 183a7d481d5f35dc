"""The hierarchical all-reduce on 8 ranks (and on two 4-rank sub-communicators side by side): it equals a flat
Allreduce, it is bit-identical on every rank, CommStats matches hier_formula exactly (padding included), the node
groups are consecutive ranks and the cross groups strided, and a ranks_per_node that does not divide the ranks is
a ConfigError on every rank. ranks_per_node=None is MPI's shared-memory split: one node on this machine."""
import hashlib

import numpy as np
import pytest
from mpi4py import MPI

from hsgd.comm import Comm, CommStats
from hsgd.dp import FlatBuffer, dp_average
from hsgd.errors import ConfigError
from hsgd.hier import HierarchicalExchange, cross_node_bytes, hier_formula, hierarchical_allreduce, node_split

from .conftest import WORLD, check, say, world_max

pytestmark = pytest.mark.mpi(min_size=8)

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
        check(err <= 1e-15 and same and dp.stats.counts() == ex.formula() and ex.scratch is scratch,
              f"err {err:.2e}, replicas identical {same}, {dp.stats.counts()}")
    say(f"HierarchicalExchange(ranks_per_node={ranks_per_node}) vs dp_average: max |diff| {world_max(err):.1e}\n"
        + dp.stats.format())
    ex.free()
