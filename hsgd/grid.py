"""The process grid: P = dp x pp x tp ranks, and a communicator for each parallel dimension.

    mpirun -n 8 python -m hsgd.grid --tp 2 --pp 1 --dp 4      # print the layout table

Ranks are placed with tp fastest, then pp, then dp:

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank

so consecutive ranks form a tensor-parallel group (on a cluster launched with consecutive ranks per node, a TP
group sits inside one node, where the bandwidth is). Each dimension's communicator comes from
`Split(color, key)`: ranks with the same color land in the same new communicator, ordered by key.

    tp_comm: same (dp, pp), key tp_rank  -> the M ranks that together hold one copy of a stage's parameters
    pp_comm: same (dp, tp), key pp_rank  -> the stages of one pipeline
    dp_comm: same (pp, tp), key dp_rank  -> the G replicas of one parameter shard (they average its gradient)

For 8 ranks with dp=4, tp=2 (pp=1):

              tp_rank 0   tp_rank 1
    dp 0:       0           1          <- tp_comm {0, 1}
    dp 1:       2           3
    dp 2:       4           5
    dp 3:       6           7
                ^ dp_comm {0, 2, 4, 6}  (the "first GPU of every group" of the lecture)
"""
import argparse
import numbers
import sys

from mpi4py import MPI

from .comm import Comm, CommStats
from .errors import EXIT_USAGE, UsageError


class GridError(UsageError):
    """The sizes cannot form a grid on this communicator."""


def factorizations(n):
    """All (dp, pp, tp) with dp * pp * tp = n."""
    return [(n // (p * t), p, t) for p in range(1, n + 1) if n % p == 0
            for t in range(1, n // p + 1) if (n // p) % t == 0]


def check_sizes(world_size, dp, pp, tp):
    """Raise GridError unless dp, pp, tp are positive integers with dp * pp * tp == world_size."""
    for name, v in (("dp", dp), ("pp", pp), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise GridError(f"{name}={v} must be a positive integer")
    if dp * pp * tp != world_size:
        options = ", ".join(f"dp={d} pp={p} tp={t}" for d, p, t in factorizations(world_size))
        raise GridError(f"dp*pp*tp = {dp}*{pp}*{tp} = {dp * pp * tp} does not match the {world_size} ranks; "
                        f"choose sizes whose product is {world_size}: {options}")


class ProcessGrid:
    def __init__(self, base=MPI.COMM_WORLD, dp=1, pp=1, tp=1, stats=None, check=None):
        check_sizes(base.Get_size(), dp, pp, tp)                 # before any communication
        self.base = base
        self.dp, self.pp, self.tp = int(dp), int(pp), int(tp)
        self.rank = base.Get_rank()
        self.tp_rank = self.rank % tp
        self.pp_rank = self.rank // tp % pp
        self.dp_rank = self.rank // (tp * pp)
        self.stats = stats if stats is not None else CommStats()
        self.world = Comm(base, "world", self.stats, check)
        self.tp_comm = Comm(base.Split(color=self.dp_rank * pp + self.pp_rank, key=self.tp_rank),
                            "tp", self.stats, check)
        self.pp_comm = Comm(base.Split(color=self.dp_rank * tp + self.tp_rank, key=self.pp_rank),
                            "pp", self.stats, check)
        self.dp_comm = Comm(base.Split(color=self.pp_rank * tp + self.tp_rank, key=self.dp_rank),
                            "dp", self.stats, check)

    @staticmethod
    def rank_of(dp_rank, pp_rank, tp_rank, pp, tp):
        return (dp_rank * pp + pp_rank) * tp + tp_rank

    def layout_table(self):
        """The layout of every rank (world rank, dp, pp, tp, host) as text. Collective: call on all ranks."""
        rows = self.base.allgather((self.rank, self.dp_rank, self.pp_rank, self.tp_rank, MPI.Get_processor_name()))
        lines = [f"{'rank':>5} {'dp':>4} {'pp':>4} {'tp':>4}  host"]
        lines += [f"{r:>5} {d:>4} {p:>4} {t:>4}  {h}" for r, d, p, t, h in sorted(rows)]
        return "\n".join(lines)

    def groups(self):
        """{"tp": [[ranks of group 0], ...], "pp": ..., "dp": ...}: who talks to whom (computed, no comm)."""
        dp, pp, tp, r = self.dp, self.pp, self.tp, self.rank_of
        return {
            "tp": [[r(d, p, t, pp, tp) for t in range(tp)] for d in range(dp) for p in range(pp)],
            "pp": [[r(d, p, t, pp, tp) for p in range(pp)] for d in range(dp) for t in range(tp)],
            "dp": [[r(d, p, t, pp, tp) for d in range(dp)] for p in range(pp) for t in range(tp)],
        }

    def free(self):
        for c in (self.tp_comm, self.pp_comm, self.dp_comm):
            c.free()


def main(argv=None):
    p = argparse.ArgumentParser(prog="mpirun -n P python -m hsgd.grid",
                                description="Build the dp x pp x tp process grid and print which rank is where.")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: P / (pp * tp))")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    args = p.parse_args(argv)
    world = MPI.COMM_WORLD
    try:
        dp = args.dp if args.dp is not None else max(world.Get_size() // max(args.pp * args.tp, 1), 1)
        grid = ProcessGrid(world, dp=dp, pp=args.pp, tp=args.tp)
    except UsageError as e:
        if world.Get_rank() == 0:                               # every rank found the same error: report once
            print(f"hsgd: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    table = grid.layout_table()
    if grid.rank == 0:
        print(f"{world.Get_size()} ranks = dp {grid.dp} x pp {grid.pp} x tp {grid.tp}\n{table}")
        for dim, groups in grid.groups().items():
            print(f"{dim}_comm groups: {groups}")
    grid.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
