"""The gradient exchange with expert parallelism: the dense parameters averaged over dp_comm, each rank's experts
over edp_comm, the ranks that hold the same experts (hsgd.ep.layout: parallel folding).

    g_dense   <- (1/D) sum over dp_comm's D = dp x cp ranks         (as AllreduceExchange)
    g_experts <- (1/D) sum over edp_comm's edp = D/ep ranks          (each expert's own replicas)

Each rank's backward starts from its own micro-batch shard's mean loss, and the average over the D shards is the
global batch's mean loss: so every parameter's gradient is (1/D) times the sum of all D shards' contributions. A
dense parameter gets one contribution from each rank: sum over dp_comm. An expert's owner already holds the sum of
its ep group's contributions (the all-to-all brought it their tokens, and their gradients back): the sum over the
edp replicas completes the D, and the factor is still 1/D, not 1/edp (dividing by edp leaves the experts' gradients
ep times too large, invisible in the loss: pytorch/pytorch #160285, NVIDIA/Megatron-LM PR #5956). The flat buffer
lays the dense parameters out first, by gradient group, then the experts', so that each average is one Allreduce
of a contiguous span.

The global gradient norm: the experts differ between the ep ranks, so the exchange's shard_comm is ep_comm and
every element's square is weighted by 1/(the ranks of tp x ep that hold it alike) (HybridTrainer.norm_weight): the
sum over tp and ep_comm counts each parameter once.
"""
from hsgd.dp.exchange import AllreduceExchange, AllreduceSizes


class FoldedSizes(AllreduceSizes):
    """The folded exchange from sizes alone: numel {group: elements} of the dense parameters, expert_numel of the
    experts', dp_size and edp_size ranks."""

    def __init__(self, numel, expert_numel, itemsize, dp_size, edp_size):
        super().__init__({**numel, "experts": expert_numel}, itemsize, dp_size)
        self.dense, self.experts, self.edp_size = self.size - expert_numel, expert_numel, edp_size

    def formula(self):
        """One Allreduce of the dense span over dp_comm, one of the experts' over edp_comm."""
        return {("dp", "Allreduce"): (1, self.dense * self.itemsize),
                ("edp", "Allreduce"): (1, self.experts * self.itemsize)}

    def describe(self):
        return ("one Allreduce of the dense gradients over dp_comm and one of the experts' over edp_comm (dp x cp / "
                "ep ranks), after the backward pass")


class FoldedExchange(AllreduceExchange):
    """AllreduceExchange with the experts' gradients averaged over edp_comm; ep_comm: the norm's shard_comm.
    experts: the names of this rank's expert parameters."""

    def __init__(self, params, groups, dp_comm, edp_comm, ep_comm, experts):
        dense = {g: [n for n in names if n not in experts] for g, names in groups.items()}
        ordered = {g: names for g, names in dense.items() if names}
        ordered["experts"] = [n for names in groups.values() for n in names if n in experts]
        numel = {g: sum(int(params[n].size) for n in names) for g, names in dense.items() if names}
        expert_numel = sum(int(params[n].size) for n in ordered["experts"])
        itemsize = next(iter(params.values())).dtype.itemsize
        super().__init__(params, ordered, dp_comm, FoldedSizes(numel, expert_numel, itemsize, dp_comm.size,
                                                              edp_comm.size))
        self.experts, self.ep_comm = set(experts), ep_comm
        self.edp_comm, self.shard_comm, self.n_dense = edp_comm, ep_comm, self.sizes.dense

    def comms(self):
        """ep_comm and edp_comm are the grid's; none of the exchange's own."""
        return []

    def average(self):
        """The dense span over dp_comm, the experts' span over edp_comm (rounded to --reduce-dtype as they leave)."""
        flat = self.buf.flat
        self.num.reduced(flat)
        for part, comm in ((flat[:self.n_dense], self.dp_comm), (flat[self.n_dense:], self.edp_comm)):
            comm.Allreduce(part)                                      # (span,) in place
        if self.dp_comm.size > 1:
            flat *= 1.0 / self.dp_comm.size                           # 1/D for both: the D shards' mean
