"""ZeRO stages 2 and 3 layer by layer: the gradients reduce-scattered during the backward pass, and (stage 3) the
parameters themselves sharded over the data-parallel ranks (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models"; stage 3 is what PyTorch calls fully sharded data parallelism).

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
"""
from contextlib import contextmanager
from types import SimpleNamespace

from hsgd.model.backend import array_module
from hsgd.dp.exchange import GradExchange
from hsgd.model.config import divisors
from hsgd.errors import ConfigError
from hsgd.dp.exchange import group_numel
from hsgd.dp.hierarchical import node_split
from hsgd.tp.hooks import Hooks
from hsgd.model.precision import EXACT


class ShardedExchange(GradExchange):
    """The exchange of --zero 2 and --zero 3 (see the module docstring). params: this rank's parameter shards,
    groups: {group: [names]} in backward order; hybrid: shard within the node, replicate across nodes."""

    def __init__(self, params, groups, dp_comm, stage, hybrid=False, ranks_per_node=None, micro_batches=1):
        assert stage in (2, 3)
        self.dp_comm, self.groups, self.zero, self.m = dp_comm, groups, stage, micro_batches
        self.order = [n for names in groups.values() for n in names]
        self.node_comm = self.cross_comm = None
        if hybrid:
            self.node_comm, self.cross_comm = node_split(dp_comm, ranks_per_node)      # (hsgd.dp.hierarchical)
        shard = self.node_comm if hybrid else dp_comm
        self.shard_comm, self.n = shard, shard.size                   # norms add up over the shard comm
        self.cross_name = self.cross_comm.name if hybrid else None
        first = params[self.order[0]]
        xp, self.dtype = array_module(first), first.dtype
        self.shapes = {name: params[name].shape for name in self.order}
        self.sizes(group_numel(params, groups), self.dtype.itemsize, dp_comm.size, dp_comm.name)
        self.offsets = {}                                             # name -> (lo, hi) in the flat layout
        for g, names in groups.items():                               # inner: {name: (lo, hi) inside the bucket}
            lay, k = self.layout[g], 0
            for name in names:
                lay.inner[name] = (k, k + params[name].size)
                self.offsets[name] = (lay.off + k, lay.off + k + params[name].size)
                k += params[name].size
        full = xp.zeros(self.size, dtype=self.dtype)                  # (size,) once, to cut my chunks from
        for name in self.order:
            lo, hi = self.offsets[name]
            full[lo:hi] = params[name].reshape(-1)
        self.master_ = self.own(full)                                 # (sum c_g,) the parameters I update
        self.g_owned = xp.zeros_like(self.master_)                    # (sum c_g,) their averaged gradient
        if stage == 2:
            self.whole = full                                         # (size,) every parameter, between steps
            self.params = self.views(full)
        else:
            del full                                                  # stage 3 keeps only master
            self.params = {}                                          # filled group by group by the hooks
        self.pbuf, self.buf, self.owned = None, None, None
        self.gdict, self.live, self.pending = {}, {}, []
        self.hooks = ShardHooks(self)
        self.num = EXACT                                              # how gathered groups are rounded (stage 3)

    # ------------------------------------------------------------------------------------------ the flat layout
    def configure(self, tc, dp_size):
        """sized_exchange: the stage, the micro-batches, and who shards: the dp_size ranks, or (hybrid, with
        --hierarchical) the tc.ranks_per_node ranks of a node, replicated over dp_size / ranks_per_node nodes."""
        self.zero, self.m = tc.zero, tc.micro_batches
        self.n, self.cross_name = dp_size, None
        if tc.hierarchical:
            n = tc.ranks_per_node
            if not n or dp_size % n:
                raise ConfigError(f"ranks_per_node={n!r} does not split the {dp_size} dp ranks into equal nodes; "
                                  f"give one of {divisors(dp_size)}")
            self.n, self.cross_name = n, "dp-cross"

    def sizes(self, numel, itemsize, dp_size, name="dp"):
        """The layout from the sizes: group g at offset off_g of the flat layout, n_g elements padded to n * c_g;
        its chunk at own_g in master (inner, the names inside the bucket, is filled by __init__)."""
        self.numel, self.itemsize, self.dp_size, self.dp_name = dict(numel), itemsize, dp_size, name
        self.shard_name = f"{name}-node" if self.cross_name else name    # (hsgd.dp.hierarchical.node_split's names)
        self.layout, off, own = {}, 0, 0
        for g, k in numel.items():
            c = -(-k // self.n)                                       # ceil(n_g / n)
            self.layout[g] = SimpleNamespace(off=off, n_g=k, c=c, own=own, inner={})
            off, own = off + self.n * c, own + c
        self.size = off

    def owned_numel(self):
        return sum(lay.c for lay in self.layout.values())

    def views(self, flat):
        """{name: view of flat (the whole flat layout) with the parameter's shape}."""
        return {n: flat[lo:hi].reshape(self.shapes[n]) for n, (lo, hi) in self.offsets.items()}

    @property
    def master(self):
        return self.master_

    def own(self, flat):
        """My chunk of every group of a whole flat array: (sum c_g,), a copy."""
        xp, r = array_module(flat), self.shard_comm.rank
        return xp.concatenate([flat[lay.off + r * lay.c: lay.off + (r + 1) * lay.c] for lay in self.layout.values()])

    def mask(self, predicate):
        xp = array_module(self.master_)
        full = xp.zeros(self.size, dtype=self.dtype)
        for name, (lo, hi) in self.offsets.items():
            full[lo:hi] = 1.0 if predicate(name, self.shapes[name]) else 0.0
        return self.own(full)

    def gather(self, part):
        """Collective over the shard comm: the whole flat layout from every rank's part (sum c_g,)."""
        xp = array_module(part)
        got = xp.empty((self.n, part.size), dtype=part.dtype)                 # (n, sum c_g)
        self.shard_comm.Allgather(xp.ascontiguousarray(part), got)
        full = xp.empty(self.size, dtype=part.dtype)
        for lay in self.layout.values():
            full[lay.off:lay.off + self.n * lay.c] = got[:, lay.own:lay.own + lay.c].reshape(-1)
        return full

    def full_params(self):
        """Stage 2: the parameters (held whole). Stage 3: collective, a gathered copy of every parameter."""
        return self.params if self.zero == 2 else self.views(self.gather(self.master_))

    def set_params(self, named):
        xp = array_module(self.master_)
        full = self.whole if self.zero == 2 else xp.zeros(self.size, dtype=self.dtype)
        for n, p in named.items():
            lo, hi = self.offsets[n]
            full[lo:hi] = xp.asarray(p).reshape(-1)
        self.master_[...] = self.own(full)

    # ------------------------------------------------------------------------------------------ one group
    def gather_group(self, g):
        """Stage 3: params_g = Allgather(master_g) over the shard comm, into `params` (views of one buffer)."""
        lay = self.layout[g]
        xp = array_module(self.master_)
        got = xp.empty((self.n, lay.c), dtype=self.dtype)                       # (n, c_g) the group, whole
        self.shard_comm.Allgather(self.master_[lay.own:lay.own + lay.c], got)   # every rank's chunk c_g of g
        flat = self.num.round_(got.reshape(-1), "weights")                     # bf16 / fp16: the model's copy
        for name, (lo, hi) in lay.inner.items():
            self.params[name] = flat[lo:hi].reshape(self.shapes[name])

    def model_weights(self, num):
        """Stage 2: GradExchange's. Stage 3: `params` itself, which the hooks fill group by group; gather_group
        rounds each gathered group in place as `num` says (no second copy: the gathered one is already a copy)."""
        self.num = num
        return super().model_weights(num) if self.zero == 2 else self.params

    def free_group(self, g):
        """Stage 3: drop the group's gathered parameters (nothing else refers to them: caches hold none)."""
        for name in self.layout[g].inner:
            del self.params[name]

    def grad_bucket(self, g):
        """The group's whole gradient for one micro-batch's backward: zeros (n c_g,), views into the grads dict."""
        lay = self.layout[g]
        bucket = array_module(self.master_).zeros(self.n * lay.c, dtype=self.dtype)   # (n c_g,)
        for name, (lo, hi) in lay.inner.items():
            self.gdict[name] = bucket[lo:hi].reshape(self.shapes[name])
        self.live[g] = bucket

    def start_reduce_scatter(self, g):
        """The group's gradient is final for this micro-batch: start its Reduce-Scatter over the shard comm, then
        complete the one started before (it ran while this group's backward did) and free its bucket."""
        lay, bucket = self.layout[g], self.live.pop(g)
        for name in lay.inner:
            del self.gdict[name]
        recv = array_module(bucket).empty(lay.c, dtype=self.dtype)               # (c_g,) my chunk of the sum
        req = self.shard_comm.Ireduce_scatter_block(bucket.reshape(self.n, lay.c), recv)   # (n, c_g) -> (c_g,)
        self.complete()
        self.pending.append((req, g, recv))

    def complete(self):
        """Wait for the reduce-scatters in flight and add each into my chunk of the gradient."""
        for req, g, recv in self.pending:
            req.Wait()
            lay = self.layout[g]
            self.g_owned[lay.own:lay.own + lay.c] += recv
        self.pending = []

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

    def after_update(self):
        """Stage 2: every group's updated chunks All-Gathered into the whole parameters. Stage 3: nothing."""
        if self.zero == 3:
            return
        for lay in self.layout.values():
            self.shard_comm.Allgather(self.master_[lay.own:lay.own + lay.c],                # my updated chunk ->
                                      self.whole[lay.off:lay.off + self.n * lay.c].reshape(self.n, lay.c))   # (n, c_g)

    # ------------------------------------------------------------------------------------------ reports
    def formula(self):
        """{(comm, op): (calls, payload bytes)} of one step of m micro-batches (see the module docstring)."""
        G, psi, m = len(self.layout), self.size * self.itemsize, self.m
        name = self.shard_name
        out = {(name, "Ireduce_scatter_block"): (m * G, m * psi),
               (name, "Allgather"): ((2 * m if self.zero == 3 else 1) * G, (2 * m if self.zero == 3 else 1) * psi)}
        if self.cross_name is not None:
            out[(self.cross_name, "Allreduce")] = (1, self.owned_numel() * self.itemsize)
        return out

    def memory_formula(self):
        """{"params", "grads", "comm": bytes} at each one's peak over a step, as the memory probe samples them
        (inside this exchange's hooks, after a group's forward or backward):
            params  master, plus stage 2 the whole parameters, stage 3 the largest gathered group n c_g
            grads   g_owned, plus two whole buckets: the group being filled and the one before it, whose
                    Reduce-Scatter is still in flight (consecutive groups in backward order; with m > 1 the last
                    group's is still in flight when the next micro-batch's backward fills the first)
            comm    the receive chunk c_g of the Reduce-Scatter in flight"""
        s, n, m = self.itemsize, self.n, self.m
        cs = [lay.c for lay in self.layout.values()]                          # backward order
        pairs = list(zip(cs, cs[1:])) + ([(cs[-1], cs[0])] if m > 1 else [])
        in_flight = max((a + b for a, b in pairs), default=cs[0] * (2 if m > 1 else 1))
        return {"params": self.param_bytes() + (s * n * max(cs) if self.zero == 3 else 0),
                "grads": self.grad_bytes() + s * n * in_flight,
                "comm": s * max((a for a, _ in pairs), default=0)}

    def param_bytes(self):
        """master (sum c_g,), and stage 2 the whole parameters (size,)."""
        return (self.owned_numel() + (self.size if self.zero == 2 else 0)) * self.itemsize

    def grad_bytes(self):
        """g_owned (sum c_g,)."""
        return self.owned_numel() * self.itemsize

    def describe(self):
        where = (f"sharded over the {self.n} dp ranks of a node, replicated over {self.cross_comm.size} nodes"
                 if self.cross_comm is not None else f"sharded over {self.n} dp ranks")
        what = "gradients and optimizer state" if self.zero == 2 else "parameters, gradients and optimizer state"
        return (f"ZeRO stage {self.zero}: {what} {where}; per layer"
                + (" Allgather before forward and backward," if self.zero == 3 else "")
                + " Ireduce_scatter_block during the backward pass")

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
    """What ShardedExchange does around each group's forward (stage 3: gather, free) and backward (stage 3:
    gather; a whole gradient bucket; its Reduce-Scatter started on exit; stage 3: free)."""

    def __init__(self, ex):
        self.ex = ex

    @contextmanager
    def forward(self, group):
        if self.ex.zero == 3:
            self.ex.gather_group(group)
        yield
        if self.ex.zero == 3:
            self.ex.free_group(group)

    @contextmanager
    def backward(self, group):
        if self.ex.zero == 3:
            self.ex.gather_group(group)
        self.ex.grad_bucket(group)
        yield
        self.ex.start_reduce_scatter(group)
        if self.ex.zero == 3:
            self.ex.free_group(group)
