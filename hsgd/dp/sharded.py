"""What ZeRO stages 2 and 3 share, layer by layer: the gradients reduce-scattered during the backward pass, and (stage
3, hsgd.dp.zero3) the parameters themselves sharded over the data-parallel ranks (Rajbhandari et al. 2020, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models"; stage 3 is what PyTorch calls fully sharded data
parallelism).

The lecture's data parallelism keeps a whole copy of a rank's parameter shards on every dp rank; ZeRO-1 (hsgd.dp.zero1)
shards only the optimizer's work and state. Here the unit is a gradient group, a layer of the backward pass
(tp_model.backward_order: "head", "h.{L-1}", ..., "h.0", "embedding"). With n ranks sharding (dp, or the ranks of
one node for hybrid sharding), group g's n_g elements are padded to n * c_g and rank r owns chunk r of each:

    bucket_g (n c_g,) = [ chunk_0 | chunk_1 | ... | chunk_{n-1} ]          rank r owns chunk_r of every group
    master (sum_g c_g,) = [ chunk_r of group 0 | chunk_r of group 1 | ... ]  the parameters rank r updates

In each micro-batch's backward, around group g (the Hooks this exchange hands to the stage):
    enter  (stage 3) params_g = Allgather(master_g) over the shard comm   (n, c_g): the layer's parameters, whole
           grads_g = zeros(n c_g)                                        the layer's gradient, whole, for now
    exit   Ireduce_scatter_block(grads_g -> recv_g (c_g,)) started: it runs while the next layer's backward does;
           the previous layer's is waited for, g_owned_g += recv_g, and its whole gradient is freed
           (stage 3) params_g freed
and around group g's forward (stage 3 only): params_g gathered on entry, freed on exit. Between steps a rank holds
c_g per group of parameters (stage 3; stage 2: the whole parameters too), gradients and optimizer state.
finish(): the last reduce-scatters complete, g_owned *= 1/dp (hybrid sharding: first an Allreduce of g_owned over
the nodes, the ranks holding the same chunk). The optimizer updates `master` with g_owned; stage 2 then All-Gathers
each group's updated chunks into the whole parameters, stage 3 gathers them again in the next forward.

Bytes per step on the shard comm, m micro-batches, Psi' the padded parameter bytes of this rank's stage:
    stage 2: Reduce_scatter_block m Psi' (one call per group per micro-batch), Allgather Psi' (one per group)
    stage 3: Allgather 2 m Psi' (before each forward and each backward), Reduce_scatter_block m Psi'
With m = 1, ZeRO's 2 Psi against 3 Psi: stage 3 pays one more All-Gather of the parameters for never holding them.
Hybrid (--hierarchical, n = ranks per node): the same on the node comm, plus an Allreduce of the owned chunks
(Psi' / n) over the cross-node comm.
Left out: prefetching the next layer's parameters (here the gather is exposed), and keeping the last layers'
parameters gathered between the forward and the backward. A checkpoint (hsgd.checkpoint.store) gathers the stage's
whole parameters and optimizer state on every dp rank for a moment, as with the other exchanges.

This module holds the layout (ShardedSizes) and the machinery (ShardedExchange: chunks, buckets, Reduce-Scatters);
hsgd.dp.zero2 and hsgd.dp.zero3 say what each stage does with the parameters.
"""
from contextlib import contextmanager
from types import SimpleNamespace

from hsgd.dp.exchange import AllreduceExchange, AllreduceSizes, numel_of
from hsgd.dp.hierarchical import node_split
from hsgd.errors import ConfigError
from hsgd.model.backend import array_module
from hsgd.model.config import divisors
from hsgd.tp.hooks import Hooks


class ShardedSizes(AllreduceSizes):
    """ZeRO 2 and 3 from sizes: group g at offset off_g of the flat layout, its n_g elements padded to n c_g, its
    chunk c_g at own_g in master. n: the ranks sharding, dp_size (or, hybrid sharding, ranks_per_node of them,
    replicated over dp_size / ranks_per_node nodes); m: micro-batches per step (every one reduce-scatters)."""

    def __init__(self, numel, itemsize, dp_size, micro_batches=1, ranks_per_node=None, name="dp"):
        super().__init__(numel, itemsize, dp_size, name)
        self.m, self.n, self.cross_name = micro_batches, dp_size, None
        if ranks_per_node is not None:                                # hybrid: shard within, replicate across
            if dp_size % ranks_per_node:
                raise ConfigError(f"ranks_per_node={ranks_per_node!r} does not split the {dp_size} dp ranks into "
                                  f"equal nodes; give one of {divisors(dp_size)}")
            self.n, self.cross_name = ranks_per_node, f"{name}-cross"
        self.shard_name = f"{name}-node" if self.cross_name else name  # (hsgd.dp.hierarchical.node_split's names)
        self.layout, off, own = {}, 0, 0
        for g, k in self.numel.items():
            c = -(-k // self.n)                                       # ceil(n_g / n)
            self.layout[g] = SimpleNamespace(off=off, n_g=k, c=c, own=own)
            off, own = off + self.n * c, own + c
        self.size = off
        self.gather_bytes = {}          # {group: payload of one All-Gather} where a wire sends fewer bytes (FP8)

    def owned_numel(self):
        return sum(lay.c for lay in self.layout.values())

    def grad_bytes(self):
        """g_owned (sum c_g,)."""
        return self.owned_numel() * self.itemsize

    def formula(self):
        """{(comm, op): (calls, payload bytes)} of one step of m micro-batches (see the module docstring): the
        reduce-scatters of every group in every micro-batch, the gathers of the stage (gathers_per_step), and with
        hybrid sharding the Allreduce of the owned chunks across the nodes."""
        G, psi, m = len(self.layout), self.size * self.itemsize, self.m
        k = self.gathers_per_step()
        sent = sum(self.gather_bytes.get(g, self.n * lay.c * self.itemsize) for g, lay in self.layout.items())
        out = {(self.shard_name, "Ireduce_scatter_block"): (m * G, m * psi),
               (self.shard_name, "Allgather"): (k * G, k * sent)}
        if self.cross_name is not None:
            out[(self.cross_name, "Allreduce")] = (1, self.owned_numel() * self.itemsize)
        return out

    def in_flight_bytes(self):
        """The bytes of two whole buckets at most (see memory_formula) and the receive chunk."""
        s, n, m = self.itemsize, self.n, self.m
        cs = [lay.c for lay in self.layout.values()]                          # backward order
        pairs = list(zip(cs, cs[1:])) + ([(cs[-1], cs[0])] if m > 1 else [])
        in_flight = max((a + b for a, b in pairs), default=cs[0] * (2 if m > 1 else 1))
        return s * n * in_flight, s * max((a for a, _ in pairs), default=0)

    def memory_formula(self):
        """{"params", "grads", "comm": bytes} at each one's peak over a step, as the memory probe samples them
        (inside this exchange's hooks, after a group's forward or backward):
            params  param_bytes(), plus (stage 3) the largest gathered group n c_g
            grads   g_owned, plus two whole buckets: the group being filled and the one before it, whose
                    Reduce-Scatter is still in flight (consecutive groups in backward order; with m > 1 the last
                    group's is still in flight when the next micro-batch's backward fills the first)
            comm    the receive chunk c_g of the Reduce-Scatter in flight"""
        buckets, recv = self.in_flight_bytes()
        return {"params": self.param_bytes() + self.gathered_bytes(), "grads": self.grad_bytes() + buckets,
                "comm": recv}

    def comms(self):
        return {} if self.cross_name is None else {self.shard_name: self.n, self.cross_name: self.dp_size // self.n}

    def when(self, key):
        """The reduce-scatters run behind each micro-batch's backward pass; the rest after it (see zero3 too)."""
        return "backward" if key[1] == "Ireduce_scatter_block" else "after"

    def where(self):
        n = self.n
        return (f"sharded over the {n} dp ranks of a node, replicated over {self.dp_size // n} nodes"
                if self.cross_name is not None else f"sharded over {n} dp ranks")


class ShardedExchange(AllreduceExchange):
    """What ZeRO 2 and 3 share (see the module docstring): the layout of sizes (ShardedSizes), my chunks of every
    group (master, g_owned), a whole bucket per group during its backward and its Reduce-Scatter started when the
    group is done. params: this rank's parameter shards, groups: {group: [names]} in backward order; sizes: the
    stage's; hybrid: shard within the node (ranks_per_node, or MPI's shared-memory split), replicate across nodes.
    Zero2Exchange and Zero3Exchange say what happens around each group's forward and backward."""

    def __init__(self, params, groups, dp_comm, sizes_of, hybrid=False, ranks_per_node=None):
        self.dp_comm, self.groups = dp_comm, groups
        self.order = [n for names in groups.values() for n in names]
        self.node_comm = self.cross_comm = None
        if hybrid:
            self.node_comm, self.cross_comm = node_split(dp_comm, ranks_per_node)      # (hsgd.dp.hierarchical)
        self.shard_comm = self.node_comm if hybrid else dp_comm       # norms add up over the shard comm
        self.sizes = sizes_of(*numel_of(params, groups), dp_comm.size,
                              ranks_per_node=self.node_comm.size if hybrid else None, name=dp_comm.name)
        first = params[self.order[0]]
        xp, self.dtype = array_module(first), first.dtype
        self.shapes = {name: params[name].shape for name in self.order}
        self.offsets, self.inner = {}, {}                             # name -> (lo, hi) in the flat layout, and
        for g, names in groups.items():                               # inside its group's bucket
            lay, k = self.sizes.layout[g], 0
            for name in names:
                self.inner[name] = (k, k + params[name].size)
                self.offsets[name] = (lay.off + k, lay.off + k + params[name].size)
                k += params[name].size
        full = xp.zeros(self.sizes.size, dtype=self.dtype)            # (size,) once, to cut my chunks from
        for name in self.order:
            lo, hi = self.offsets[name]
            full[lo:hi] = params[name].reshape(-1)
        self.master_ = self.own(full)                                 # (sum c_g,) the parameters I update
        self.g_owned = xp.zeros_like(self.master_)                    # (sum c_g,) their averaged gradient
        self.whole = full                                             # (stage 2 keeps it; stage 3 drops it)
        self.pbuf, self.buf, self.owned = None, None, None
        self.gdict, self.live, self.pending = {}, {}, []
        self.hooks = ShardHooks(self)

    # ------------------------------------------------------------------------------------------ the flat layout
    def views(self, flat):
        """{name: view of flat (the whole flat layout) with the parameter's shape}."""
        return {n: flat[lo:hi].reshape(self.shapes[n]) for n, (lo, hi) in self.offsets.items()}

    @property
    def master(self):
        return self.master_

    def own(self, flat):
        """My chunk of every group of a whole flat array: (sum c_g,), a copy."""
        xp, r = array_module(flat), self.shard_comm.rank
        return xp.concatenate([flat[lay.off + r * lay.c: lay.off + (r + 1) * lay.c]
                               for lay in self.sizes.layout.values()])

    def mask(self, predicate):
        xp = array_module(self.master_)
        full = xp.zeros(self.sizes.size, dtype=self.dtype)
        for name, (lo, hi) in self.offsets.items():
            full[lo:hi] = float(predicate(name, self.shapes[name]))         # a flag, or a weight
        return self.own(full)

    def gather(self, part):
        """Collective over the shard comm: the whole flat layout from every rank's part (sum c_g,)."""
        xp, n = array_module(part), self.sizes.n
        got = xp.empty((n, part.size), dtype=part.dtype)                      # (n, sum c_g)
        self.shard_comm.Allgather(xp.ascontiguousarray(part), got)
        full = xp.empty(self.sizes.size, dtype=part.dtype)
        for lay in self.sizes.layout.values():
            full[lay.off:lay.off + n * lay.c] = got[:, lay.own:lay.own + lay.c].reshape(-1)
        return full

    # ------------------------------------------------------------------------------------------ one group
    def grad_bucket(self, g):
        """The group's whole gradient for one micro-batch's backward: zeros (n c_g,), views into the grads dict."""
        lay = self.sizes.layout[g]
        bucket = array_module(self.master_).zeros(self.sizes.n * lay.c, dtype=self.dtype)   # (n c_g,)
        for name in self.groups[g]:
            lo, hi = self.inner[name]
            self.gdict[name] = bucket[lo:hi].reshape(self.shapes[name])
        self.live[g] = bucket

    def start_reduce_scatter(self, g):
        """The group's gradient is final for this micro-batch: start its Reduce-Scatter over the shard comm, then
        complete the one started before (it ran while this group's backward did) and free its bucket."""
        lay, bucket = self.sizes.layout[g], self.live.pop(g)
        for name in self.groups[g]:
            del self.gdict[name]
        recv = array_module(bucket).empty(lay.c, dtype=self.dtype)               # (c_g,) my chunk of the sum
        req = self.shard_comm.Ireduce_scatter_block(bucket.reshape(self.sizes.n, lay.c), recv)   # (n, c_g) -> (c_g,)
        self.complete()
        self.pending.append((req, g, recv))

    def complete(self):
        """Wait for the reduce-scatters in flight and add each into my chunk of the gradient."""
        for req, g, recv in self.pending:
            req.Wait()
            lay = self.sizes.layout[g]
            self.g_owned[lay.own:lay.own + lay.c] += recv
        self.pending = []

    def before_backward(self, g):
        self.grad_bucket(g)

    def after_backward(self, g):
        self.start_reduce_scatter(g)

    def before_forward(self, g):
        pass

    def after_forward(self, g):
        pass

    # ------------------------------------------------------------------------------------------ the step
    def begin(self):
        self.g_owned.fill(0)
        self.gdict = {}
        return SimpleNamespace(views=self.gdict)

    def average(self):
        self.complete()
        if self.cross_comm is not None:
            self.cross_comm.Allreduce(self.g_owned)                   # the same chunk, summed over the nodes
        if self.dp_comm.size > 1:
            self.g_owned *= 1.0 / self.dp_comm.size

    def grads(self):
        return self.g_owned

    def comms(self):
        return [c for c in (self.node_comm, self.cross_comm) if c is not None]

    def close(self):
        self.complete()

    def free(self):
        self.close()
        for c in self.comms():
            c.free()
        self.node_comm = self.cross_comm = None


class ShardHooks(Hooks):
    """What a ZeRO 2 or 3 exchange does around each group's forward and backward (before_* on entry, after_* on
    exit: its Zero2Exchange and Zero3Exchange methods)."""

    def __init__(self, ex):
        self.ex = ex

    @contextmanager
    def forward(self, group):
        self.ex.before_forward(group)
        yield
        self.ex.after_forward(group)

    @contextmanager
    def backward(self, group):
        self.ex.before_backward(group)
        yield
        self.ex.after_backward(group)
