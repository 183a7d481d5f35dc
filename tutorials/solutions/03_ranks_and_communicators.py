"""Solutions to the exercises of chapter 3 (tutorials/03_ranks_and_communicators.py).

    mpirun -n 8 python tutorials/solutions/03_ranks_and_communicators.py

Every solution predicts who lands with whom (or what a collective sums to) without communicating, builds the
communicators with Split, and checks the two against each other on every rank (Checks: collective verdicts).
"""
# mpirun -n 8 python tutorials/solutions/03_ranks_and_communicators.py
import os
import sys

from hsgd.grid.comm import Comm, CommStats               # hsgd before NumPy: it sets OpenBLAS's thread timeout first
from hsgd.grid.process_grid import ProcessGrid, factorizations
from hsgd.dp.hierarchical import hierarchical_allreduce, node_split
from hsgd.grid.devices import local_ranks

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, rel_err, ring_share, solve  # noqa: E402

world = MPI.COMM_WORLD
rank, P = world.Get_rank(), world.Get_size()


def split_members(color, key):
    """The world ranks of the communicator Split(color, key) gives me, in their new order. Collective."""
    sub = world.Split(color=color, key=key)
    out = sub.allgather(rank)
    sub.Free()
    return out


def mine(groups):
    """The group of `groups` (lists of world ranks) that holds me."""
    return next(g for g in groups if rank in g)


# ------------------------------------------------------------------------------------------------------------ 1
def megatron_coords(r, dp, pp, tp):
    """(dp_rank, pp_rank, tp_rank) of world rank r in Megatron-LM's order "tp-dp-pp": tp fastest, pp slowest,
    rank = (pp_rank * dp + dp_rank) * tp + tp_rank."""
    return r // tp % dp, r // (tp * dp), r % tp


def megatron_groups(dp, pp, tp):
    """{dim: [[world ranks], ...]} in Megatron-LM's order, from the formula alone."""
    at = lambda d, p, t: (p * dp + d) * tp + t                                  # noqa: E731
    return {"tp": [[at(d, p, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
            "pp": [[at(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
            "dp": [[at(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]}


def exercise_1(check):
    """Megatron-LM's rank order, built with Split."""
    dp = pp = tp = 2
    d, p, t = megatron_coords(rank, dp, pp, tp)
    built = {"tp": split_members(color=p * dp + d, key=t),          # same (pp, dp): one tensor-parallel group
             "pp": split_members(color=d * tp + t, key=p),          # same (dp, tp): the stages of one pipeline
             "dp": split_members(color=p * tp + t, key=d)}          # same (pp, tp): the replicas of one shard
    predicted = megatron_groups(dp, pp, tp)
    check.equal("Megatron order: Split members == predicted groups", built,
                {dim: mine(g) for dim, g in predicted.items()})
    grid = ProcessGrid(world, dp=dp, pp=pp, tp=tp)
    ours = grid.groups()
    grid.free()
    same = [dim for dim in ("tp", "pp", "dp") if sorted(ours[dim]) == sorted(predicted[dim])]
    node = lambda r: r // 4                                                      # noqa: E731  4 ranks per node
    crossing = {name: [dim for dim, gs in groups.items() if any(len({node(r) for r in g}) > 1 for g in gs)]
                for name, groups in (("hsgd", ours), ("Megatron-LM", predicted))}
    check.say(f"  Megatron-LM: {predicted}\n  hsgd:        {ours}\n  the same members in both orders: {same}; "
              f"with 4 ranks per node, crossing nodes: hsgd {crossing['hsgd']}, "
              f"Megatron-LM {crossing['Megatron-LM']}")
    check.equal("communicators with the same members in both orders", same, ["tp"])
    check.equal("crossing nodes: hsgd dp, Megatron-LM pp", crossing, {"hsgd": ["dp"], "Megatron-LM": ["pp"]})


# ------------------------------------------------------------------------------------------------------------ 2
def exercise_2(check):
    """The ranks of one node, with Split_type."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    members = node.allgather(rank)                                   # world ranks on my node, in rank order
    local, size = node.Get_rank(), node.Get_size()
    node.Free()
    names = world.allgather(MPI.Get_processor_name())                # small metadata: pickled
    same_host = [r for r in range(P) if names[r] == names[rank]]
    check.say(f"  rank 0's node: {members} (host {names[0]}); local rank {local} of {size}")
    check.equal("Split_type(COMM_TYPE_SHARED) members == ranks with my host name", members, same_host)
    check.equal("local rank == my position among my host's ranks", local, same_host.index(rank))
    check.equal("local rank == hsgd.train.local_ranks", (local, size), local_ranks(world))

    grid = ProcessGrid(world, dp=4, tp=2)
    on_my_node = split_members(color=rank // 4, key=rank)            # pretend: nodes of 4 consecutive ranks
    dp_members = grid.dp_comm.allgather_obj(rank)
    together = [r for r in dp_members if r in on_my_node]
    grid.free()
    check.say(f"  rank 0: dp_comm {dp_members}, on its pretend node {on_my_node}: {together}")
    check.equal("dp_comm ranks on my pretend node of 4", together,
                [r for r in range(rank % 2, P, 2) if r // 4 == rank // 4])


# ------------------------------------------------------------------------------------------------------------ 3
def groups(dp, pp, tp):
    """{dim: [[world ranks], ...]} of hsgd's grid, rank = (dp_rank * pp + pp_rank) * tp + tp_rank."""
    at = lambda d, p, t: (d * pp + p) * tp + t                                  # noqa: E731
    return {"tp": [[at(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
            "pp": [[at(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
            "dp": [[at(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]}


def exercise_3(check):
    """The grid of 12 ranks."""
    shapes = factorizations(12)
    ok = True
    for dp, pp, tp in shapes:
        g = groups(dp, pp, tp)
        once = all(sorted(r for grp in g[dim] for r in grp) == list(range(12)) for dim in g)
        blocks = all(grp == list(range(grp[0], grp[0] + tp)) for grp in g["tp"])
        ok = ok and once and blocks
    check.say(f"  12 ranks: {len(shapes)} grids, e.g. dp=3 pp=2 tp=2: {groups(3, 2, 2)}")
    check.holds("12 ranks, every grid: each rank once per dimension, tp blocks", ok)
    agree = []
    for dp, pp, tp in factorizations(P):
        grid = ProcessGrid(world, dp=dp, pp=pp, tp=tp)
        built = {dim: getattr(grid, f"{dim}_comm").allgather_obj(rank) for dim in ("tp", "pp", "dp")}
        predicted = groups(dp, pp, tp)
        agree.append(predicted == grid.groups() and built == {d: mine(g) for d, g in predicted.items()})
        grid.free()
    check.holds(f"8 ranks, all {len(agree)} grids: groups() == ProcessGrid's, and the Split members", all(agree))


# ------------------------------------------------------------------------------------------------------------ 4
def exercise_4(check):
    """The lecture's 2-D mesh all-reduce on one dp_comm."""
    grid = ProcessGrid(world, dp=P, tp=1)                            # one dp_comm of all 8 ranks
    dp = grid.dp_comm
    n, k, N = 4, P // 4, 1000                                        # n ranks per node, k nodes, N gradient entries
    g = np.random.default_rng(rank).standard_normal(N)               # (N,) my gradient
    stats = CommStats()
    node = Comm(dp.comm.Split(color=dp.rank // n, key=dp.rank % n), "node", stats)    # the n ranks of my node
    cross = Comm(dp.comm.Split(color=dp.rank % n, key=dp.rank // n), "cross", stats)  # my position, every node
    m = -(-N // n)                                                   # chunk length, ceil(N / n)
    full = np.zeros(n * m)                                           # (n*m,) the gradient, zero padded
    full[:N] = g
    chunk = np.empty(m)                                              # (m,)
    node.Reduce_scatter_block(full.reshape(n, m), chunk)             # 1. chunk j of my node's sum
    cross.Allreduce(chunk)                                           # 2. ... summed over the k nodes
    node.Allgather(chunk, full.reshape(n, m))                        # 3. every chunk back to every rank of the node
    mesh = full[:N].copy()

    flat = g.copy()
    dp.Allreduce(flat)                                               # the flat all-reduce over all 8
    ref = g.copy()
    node_comm, cross_comm = node_split(dp, ranks_per_node=n)
    hierarchical_allreduce(ref, node_comm, cross_comm)               # hsgd's version
    exact = sum(np.random.default_rng(r).standard_normal(N) for r in range(P))   # the serial sum
    check("2-D mesh all-reduce vs flat dp_comm Allreduce", rel_err(mesh, flat), 1e-14)
    check("2-D mesh all-reduce vs hsgd.dp.hierarchical.hierarchical_allreduce", rel_err(mesh, ref), 1e-14)
    check("2-D mesh all-reduce vs the sum NumPy computes", rel_err(mesh, exact), 1e-14)

    sizes = {"node": n, "cross": k}
    check.say(f"  {'step':<28}{'ranks':>6}{'payload':>9}{'ring bytes per rank':>21}{'leaves the node':>17}")
    for (name, op), (_, payload) in stats.counts().items():
        sent = float(ring_share(op, sizes[name]) * payload)
        check.say(f"  {name + ' ' + op:<28}{sizes[name]:>6}{payload:>9}{sent:>21.0f}"
                  f"{sent if name == 'cross' else 0:>17.0f}")
    flat_sent = float(ring_share("Allreduce", P) * 8 * N)
    check.say(f"  {'flat Allreduce':<28}{P:>6}{8 * N:>9}{flat_sent:>21.0f}{flat_sent:>17.0f}  (the one rank per node "
              "whose ring neighbour is on the other node)")
    check.equal("payloads: node n*m*8, cross m*8, node n*m*8 bytes", stats.counts(),
                {("node", "Reduce_scatter_block"): (1, n * m * 8), ("cross", "Allreduce"): (1, m * 8),
                 ("node", "Allgather"): (1, n * m * 8)})
    for c in (node, cross, node_comm, cross_comm):
        c.free()
    grid.free()


if __name__ == "__main__":
    solve(Checks(MPI.COMM_WORLD, tol=1e-12, width=66), [exercise_1, exercise_2, exercise_3, exercise_4])
