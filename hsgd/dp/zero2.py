"""ZeRO stage 2 (--zero 2; Rajbhandari et al. 2020): the gradients and the optimizer state sharded over the
data-parallel ranks, each layer's gradient reduce-scattered during the backward pass (hsgd.dp.sharded: the layout
and the Reduce-Scatters); the parameters stay whole on every rank, and after the update every group's updated
chunks are All-Gathered into them. Chapter 8; --zero 2 --hierarchical shards within a node (hybrid sharding).

Bytes per step on the shard comm, m micro-batches, Psi' the padded parameter bytes of this rank's stage:
Reduce_scatter_block m Psi' (one call per group per micro-batch), Allgather Psi' (one per group).
"""
from hsgd.dp.sharded import ShardedExchange, ShardedSizes
from hsgd.model.backend import array_module


class Zero2Sizes(ShardedSizes):
    """ZeRO 2 from sizes: the whole parameters kept, one All-Gather per group and step."""

    def gathers_per_step(self):
        return 1

    def param_bytes(self):
        """master (sum c_g,), and the whole parameters (size,)."""
        return (self.owned_numel() + self.size) * self.itemsize

    def gathered_bytes(self):
        return 0

    def describe(self):
        return (f"ZeRO stage 2: gradients and optimizer state {self.where()}; per layer Ireduce_scatter_block "
                "during the backward pass")


class Zero2Exchange(ShardedExchange):
    """The exchange of --zero 2 (see the module docstring)."""

    def __init__(self, params, groups, dp_comm, micro_batches=1, hybrid=False, ranks_per_node=None):
        sizes_of = lambda *a, **kw: Zero2Sizes(*a, micro_batches=micro_batches, **kw)   # noqa: E731
        super().__init__(params, groups, dp_comm, sizes_of, hybrid, ranks_per_node)
        self.params = self.views(self.whole)                          # every parameter, whole, between steps

    def full_params(self):
        return self.params

    def set_params(self, named):
        xp = array_module(self.master_)
        for n, p in named.items():
            lo, hi = self.offsets[n]
            self.whole[lo:hi] = xp.asarray(p).reshape(-1)
        self.master_[...] = self.own(self.whole)

    def after_update(self):
        """Every group's updated chunks All-Gathered into the whole parameters."""
        n = self.sizes.n
        for lay in self.sizes.layout.values():
            self.shard_comm.Allgather(self.master_[lay.own:lay.own + lay.c],                # my updated chunk ->
                                      self.whole[lay.off:lay.off + n * lay.c].reshape(n, lay.c))   # (n, c_g)
