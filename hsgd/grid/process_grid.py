"""The process grid: P = dp x pp x cp x tp ranks, and a communicator for each parallel dimension.

    mpirun -n 8 python -m hsgd.grid --tp 2 --pp 1 --dp 4      # print the layout table
    mpirun -n 8 python -m hsgd.grid --tp 2 --cp 2 --dp 2      # with context parallelism (hsgd.cp.split)

Ranks are placed with tp fastest, then cp, then pp, then dp:

    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank

so consecutive ranks form a tensor-parallel group (on a cluster launched with consecutive ranks per node, a TP
group sits inside one node, where the bandwidth is), and the next-closest ranks form the context-parallel ring,
which moves keys and values in every layer (cp = 1, the default: rank = (dp_rank * pp + pp_rank) * tp + tp_rank).
The pipeline's point-to-point messages and the data-parallel exchange, once per micro-batch and once per step,
take the farther links. Each dimension's communicator comes from `Split(color, key)`: ranks with the same color
land in the same new communicator, ordered by key.

    tp_comm: same (dp, pp, cp), key tp_rank   -> the M ranks that together hold one copy of a stage's parameters
    cp_comm: same (dp, pp, tp), key cp_rank   -> the ranks that hold the pieces of the same sequences (hsgd.cp.split)
    pp_comm: same (dp, cp, tp), key pp_rank   -> the stages of one pipeline
    dp_comm: same (pp, tp), key dp_rank * cp + cp_rank
                                              -> every rank that holds the same parameter shard: the G replicas,
                                                 and within each the cp ranks (parameters are replicated over cp);
                                                 they average its gradient. dp x cp ranks; dp when cp = 1.
    ep_comm:  ep consecutive ranks of dp_comm (in its key order), key their place   (expert parallelism, hsgd.ep:
              the ranks that split each MoE block's experts; parallel folding out of dp x cp)
    edp_comm: the ranks at the same place of every ep group of dp_comm              (they hold the same experts
              and average their gradients; dp x cp / ep ranks). With ep = 1: ep_comm is each rank alone, edp_comm
              is dp_comm.

For 8 ranks with dp=4, tp=2 (pp=1, cp=1):

              tp_rank 0   tp_rank 1
    dp 0:       0           1          <- tp_comm {0, 1}
    dp 1:       2           3
    dp 2:       4           5
    dp 3:       6           7
                ^ dp_comm {0, 2, 4, 6}  (the "first GPU of every group" of the lecture)
"""
import numbers

from mpi4py import MPI

from hsgd.grid.comm import Comm, CommStats
from hsgd.model.config import divisors
from hsgd.errors import UsageError


class GridError(UsageError):
    """The sizes cannot form a grid on this communicator."""


def factorizations(n):
    """All (dp, pp, tp) with dp * pp * tp = n: pp a divisor of n, tp one of n / pp (hsgd.model.config.divisors, in
    O(sqrt n) each)."""
    return [(n // (p * t), p, t) for p in divisors(n) for t in divisors(n // p)]


def check_sizes(world_size, dp, pp, tp, cp=1):
    """Raise GridError unless dp, pp, tp, cp are positive integers with dp * pp * cp * tp == world_size."""
    for name, v in (("dp", dp), ("pp", pp), ("tp", tp), ("cp", cp)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise GridError(f"{name}={v} must be a positive integer")
    if dp * pp * cp * tp != world_size:
        if cp == 1:
            options = ", ".join(f"dp={d} pp={p} tp={t}" for d, p, t in factorizations(world_size))
            raise GridError(f"dp*pp*tp = {dp}*{pp}*{tp} = {dp * pp * tp} does not match the {world_size} ranks; "
                            f"choose sizes whose product is {world_size}: {options}")
        options = ", ".join(f"dp={d // cp} pp={p} cp={cp} tp={t}" for d, p, t in factorizations(world_size)
                            if d % cp == 0)
        raise GridError(f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {dp * pp * cp * tp} does not match the {world_size} "
                        f"ranks; choose sizes whose product is {world_size}: {options or 'a cp that divides it'}")


class ProcessGrid:
    def __init__(self, base=MPI.COMM_WORLD, dp=1, pp=1, tp=1, stats=None, check=None, cp=1, ep=1):
        check_sizes(base.Get_size(), dp, pp, tp, cp)             # before any communication
        if (dp * cp) % ep:
            raise GridError(f"ep={ep} does not divide dp x cp = {dp * cp}: the expert-parallel ranks are folded out "
                            f"of the data- and context-parallel ones; use ep in {divisors(dp * cp)}")
        self.base = base
        self.dp, self.pp, self.tp, self.cp = int(dp), int(pp), int(tp), int(cp)
        self.rank = base.Get_rank()
        self.tp_rank = self.rank % tp
        self.cp_rank = self.rank // tp % cp
        self.pp_rank = self.rank // (tp * cp) % pp
        self.dp_rank = self.rank // (tp * cp * pp)
        self.stats = stats if stats is not None else CommStats()
        self.world = Comm(base, "world", self.stats, check)
        d, p, c, t = self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank
        self.tp_comm = Comm(base.Split(color=(d * pp + p) * cp + c, key=t), "tp", self.stats, check)
        self.cp_comm = Comm(base.Split(color=(d * pp + p) * tp + t, key=c), "cp", self.stats, check)
        self.pp_comm = Comm(base.Split(color=(d * cp + c) * tp + t, key=p), "pp", self.stats, check)
        self.dp_comm = Comm(base.Split(color=p * tp + t, key=d * cp + c), "dp", self.stats, check)
        self.ep, q, groups = int(ep), d * cp + c, dp * cp // ep              # my place in dp_comm; ep groups
        self.ep_rank = q % ep
        self.ep_comm = Comm(base.Split(color=(p * tp + t) * groups + q // ep, key=q % ep), "ep", self.stats, check)
        self.edp_comm = Comm(base.Split(color=(p * tp + t) * ep + q % ep, key=q // ep), "edp", self.stats, check)

    @staticmethod
    def rank_of(dp_rank, pp_rank, tp_rank, pp, tp, cp_rank=0, cp=1):
        return ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank

    def layout_table(self):
        """The layout of every rank (world rank, dp, pp, cp, tp, host) as text. Collective: call on all ranks."""
        rows = self.base.allgather((self.rank, self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank,
                                    MPI.Get_processor_name()))
        lines = [f"{'rank':>5} {'dp':>4} {'pp':>4} {'cp':>4} {'tp':>4}  host"]
        lines += [f"{r:>5} {d:>4} {p:>4} {c:>4} {t:>4}  {h}" for r, d, p, c, t, h in sorted(rows)]
        return "\n".join(lines)

    def groups(self):
        """{"tp": [[ranks of group 0], ...], "pp": ..., "dp": ..., and "cp" when cp > 1}: who talks to whom
        (computed, no comm). The dp groups hold every rank of a parameter shard: dp x cp ranks."""
        dp, pp, tp, cp = self.dp, self.pp, self.tp, self.cp
        r = lambda d, p, t, c=0: self.rank_of(d, p, t, pp, tp, c, cp)
        out = {
            "tp": [[r(d, p, t, c) for t in range(tp)] for d in range(dp) for p in range(pp) for c in range(cp)],
            "cp": [[r(d, p, t, c) for c in range(cp)] for d in range(dp) for p in range(pp) for t in range(tp)],
            "pp": [[r(d, p, t, c) for p in range(pp)] for d in range(dp) for c in range(cp) for t in range(tp)],
            "dp": [[r(d, p, t, c) for d in range(dp) for c in range(cp)] for p in range(pp) for t in range(tp)],
        }
        if cp == 1:
            del out["cp"]                                        # one rank each: nobody to talk to
        return out

    def free(self):
        for c in (self.tp_comm, self.cp_comm, self.pp_comm, self.dp_comm, self.ep_comm, self.edp_comm):
            c.free()
