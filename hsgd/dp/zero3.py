"""ZeRO stage 3 (--zero 3; Rajbhandari et al. 2020; what PyTorch calls fully sharded data parallelism): the
parameters sharded too. A rank keeps only its chunk of every group between steps; each group's parameters are
All-Gathered before its forward and again before its backward, and freed after each (hsgd.dp.sharded: the layout and
the gradients' Reduce-Scatters, as in stage 2). Chapters 8 and 11; --zero 3 --hierarchical shards within a node.

Bytes per step on the shard comm, m micro-batches, Psi' the padded parameter bytes of this rank's stage:
Allgather 2 m Psi' (before each forward and each backward), Reduce_scatter_block m Psi'. With m = 1, ZeRO's 3 Psi
against stage 2's 2 Psi: one more All-Gather of the parameters for never holding them whole.
How a group's chunks travel is a Wire: as they are, in the run's type (Wire), or, with --fp8-allgather, the FP8
weights cast to one byte each before they leave (hsgd.dp.fp8_gather.Fp8Gather, as torchao's FP8 All-Gather for PyTorch's
FSDP2). Left out: prefetching the next layer's parameters (here the gather is exposed).
"""
from hsgd.dp.sharded import ShardedExchange, ShardedSizes
from hsgd.model.backend import array_module


class Zero3Sizes(ShardedSizes):
    """ZeRO 3 from sizes: only the chunks kept; two All-Gathers per group and micro-batch."""
    holds_weight_copy = False                 # bfloat16, float16: the gathered group is the rounded copy

    def gathers_per_step(self):
        return 2 * self.m

    def param_bytes(self):
        """master (sum c_g,)."""
        return self.owned_numel() * self.itemsize

    def gathered_bytes(self):
        """The largest gathered group, n c_g."""
        return self.itemsize * self.n * max(lay.c for lay in self.layout.values())

    def when(self, key):
        """The gathers run before each micro-batch's forward and backward; the rest as in stage 2."""
        return "forward and backward" if key[1] == "Allgather" else super().when(key)

    def describe(self):
        return (f"ZeRO stage 3: parameters, gradients and optimizer state {self.where()}; per layer Allgather "
                "before forward and backward, Ireduce_scatter_block during the backward pass")


class Zero3Exchange(ShardedExchange):
    """The exchange of --zero 3 (see the module docstring): `params` is filled group by group by its hooks."""

    def __init__(self, params, groups, dp_comm, micro_batches=1, hybrid=False, ranks_per_node=None, wire=None):
        sizes_of = lambda *a, **kw: Zero3Sizes(*a, micro_batches=micro_batches, **kw)   # noqa: E731
        super().__init__(params, groups, dp_comm, sizes_of, hybrid, ranks_per_node)
        self.whole = None                                             # only my chunks are kept
        self.params = {}                                              # filled group by group by the hooks
        self.wire = wire if wire is not None else Wire()              # how a group's chunks travel
        self.wire.attach(self)

    def model_weights(self):
        """`params` itself, which the hooks fill group by group; gather_group rounds each gathered group in place
        as `num` says (no second copy: the gathered one is already a copy)."""
        return self.params

    def full_params(self):
        """Collective over the shard comm: a gathered copy of every parameter."""
        return self.views(self.gather(self.master_))

    def set_params(self, named):
        xp = array_module(self.master_)
        full = xp.zeros(self.sizes.size, dtype=self.dtype)
        for n, p in named.items():
            lo, hi = self.offsets[n]
            full[lo:hi] = xp.asarray(p).reshape(-1)
        self.master_[...] = self.own(full)

    def gather_group(self, g):
        """params_g = Allgather(master_g) over the shard comm (the wire's), into `params` (views of one buffer)."""
        flat = self.wire.gather(g)                                                # (n c_g,) the group, whole
        for name in self.groups[g]:
            lo, hi = self.inner[name]
            self.params[name] = flat[lo:hi].reshape(self.shapes[name])

    def free_group(self, g):
        """Drop the group's gathered parameters (nothing else refers to them: caches hold none)."""
        for name in self.groups[g]:
            del self.params[name]
        self.wire.free(g)

    def before_forward(self, g):
        self.gather_group(g)

    def after_forward(self, g):
        self.free_group(g)

    def before_backward(self, g):
        self.gather_group(g)
        self.grad_bucket(g)

    def after_backward(self, g):
        self.start_reduce_scatter(g)
        self.free_group(g)


class Wire:
    """How ZeRO-3 moves a group's chunks to every rank of the shard comm: one Allgather of the chunks as they are,
    in the run's type (bfloat16, float16: then rounded, the model's copy of the weights). hsgd.dp.fp8_gather.Fp8Gather
    sends some of them as FP8 codes instead."""

    def attach(self, ex):
        """ex: the Zero3Exchange whose groups this wire moves (its layout, chunks and shard comm)."""
        self.ex = ex

    def gather(self, g):
        """Collective over the shard comm: group g whole, (n c_g,) in the run's type."""
        ex = self.ex
        lay, n = ex.sizes.layout[g], ex.sizes.n
        got = array_module(ex.master_).empty((n, lay.c), dtype=ex.dtype)         # (n, c_g)
        ex.shard_comm.Allgather(ex.master_[lay.own:lay.own + lay.c], got)         # every rank's chunk c_g of g
        return ex.num.round_(got.reshape(-1), "weights")                         # bf16 / fp16: the model's copy

    def free(self, g):
        """Group g's gathered parameters are dropped."""
