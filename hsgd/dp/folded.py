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
every element's square is weighted by 1/(the ranks of tp x ep that hold it alike) (HybridTrainer.norm_weight, with
holders()): the sum over tp and ep_comm counts each parameter once.

    FoldedExchange   the plain All-Reduce: one flat buffer, dense first, two Allreduces
    PairedExchange   the others (ZeRO 1-3, overlap, staleness, hierarchical): two of that kind, the dense part over
                     dp_comm and the experts' over edp_comm, behind the one interface (its docstring says how)
"""
from collections import ChainMap
from contextlib import nullcontext

from hsgd.dp.exchange import AllreduceExchange, AllreduceSizes
from hsgd.model.backend import array_module
from hsgd.tp.hooks import ChainedHooks, Hooks


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

    def holders(self, name):
        """The ranks of shard_comm (ep_comm) that hold this rank's element of `name` alike: every one for a dense
        parameter, this rank alone for an expert's."""
        return 1 if name in self.experts else self.ep_comm.size

    def average(self):
        """The dense span over dp_comm, the experts' span over edp_comm (rounded to --reduce-dtype as they leave)."""
        flat = self.buf.flat
        self.num.reduced(flat)
        for part, comm in ((flat[:self.n_dense], self.dp_comm), (flat[self.n_dense:], self.edp_comm)):
            comm.Allreduce(part)                                      # (span,) in place
        if self.dp_comm.size > 1:
            flat *= 1.0 / self.dp_comm.size                           # 1/D for both: the D shards' mean


class PairedSizes:
    """The formulas of a PairedExchange from its two parts' sizes: the dense part's (keys "dp") and the experts'
    (keys "edp"), added."""

    def __init__(self, dense, experts):
        self.dense, self.experts = dense, experts
        self.itemsize, self.hidden_by = dense.itemsize, dense.hidden_by
        self.holds_weight_copy = getattr(dense, "holds_weight_copy", True)
        self.size = dense.size + experts.size

    def owned_numel(self):
        return self.dense.owned_numel() + self.experts.owned_numel()

    def formula(self):
        out = dict(self.dense.formula())
        for key, (calls, nbytes) in self.experts.formula().items():
            c0, b0 = out.get(key, (0, 0))
            out[key] = (c0 + calls, b0 + nbytes)
        return out

    def param_bytes(self):
        return self.dense.param_bytes() + self.experts.param_bytes()

    def grad_bytes(self):
        return self.dense.grad_bytes() + self.experts.grad_bytes()

    def memory_formula(self):
        a, b = self.dense.memory_formula(), self.experts.memory_formula()
        return {k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b)}

    def comms(self):
        return {**self.dense.comms(), **self.experts.comms()}

    def when(self, key):
        return (self.experts if key[0] == "edp" else self.dense).when(key)

    def describe(self):
        return f"dense: {self.dense.describe()}; experts over edp_comm: {self.experts.describe()}"


class GroupHooks(Hooks):
    """A part's hooks, run around the groups that part holds parameters of only."""

    def __init__(self, hooks, groups):
        self.hooks, self.groups = hooks, set(groups)

    def forward(self, group):
        return self.hooks.forward(group) if group in self.groups else nullcontext()

    def backward(self, group):
        return self.hooks.backward(group) if group in self.groups else nullcontext()

    def point(self, group, what):
        if group in self.groups:
            self.hooks.point(group, what)


class PairedBuffer:
    """The step's gradient buffers of both parts (what each part's begin() returned, or its buf), as one
    {name: view} (views; ZeRO 2 and 3 fill and empty theirs group by group, which the ChainMap reads as they are)."""

    def __init__(self, bufs):
        self.views = ChainMap(*[b.views for b in bufs])


class PairedExchange:
    """Expert parallelism with every exchange but the plain one (--zero 1, 2, 3, --dp-overlap, --dp-staleness,
    --hierarchical, hybrid sharding):
    two exchanges of the same kind, made by `make(params, groups, comm)`, the dense part over dp_comm and the experts'
    over edp_comm, behind the one interface of hsgd.dp.exchange that the trainer uses.

    - params, the gradient views: a ChainMap of both parts' dicts (ZeRO-3 fills and frees each part's group by group,
      and a ChainMap reads them as they are);
    - hooks, on_ready: each part's, for the groups it holds parameters of;
    - finish: both averages; each part divides by its own communicator's size, so the experts' average is then
      multiplied by edp/(dp cp) = 1/ep (the factor FoldedExchange's module docstring derives);
    - master: one flat array, the dense part's owned elements then the experts', which the optimizer updates in
      place; after_update copies each slice back into its part, which then does its own after_update (ZeRO: the
      All-Gather of its chunks). grads(), checked(), mask() are the same concatenation;
    - the global norm: shard_comm is dp_comm, every element's square weighted by 1/(the ranks of tp x dp_comm holding
      it alike) (holders: the dense part's D/shards, the experts' edp/shards), so that the sums over tp and dp_comm
      count each parameter once."""
    on_ready = None

    def __init__(self, params, groups, grid, experts, make):
        self.experts = set(experts)
        part_groups = [{g: [n for n in names if (n in self.experts) == e] for g, names in groups.items()}
                       for e in (False, True)]
        part_groups = [{g: names for g, names in pg.items() if names} for pg in part_groups]
        self.parts = [make({n: params[n] for names in pg.values() for n in names}, pg, comm)
                      for pg, comm in zip(part_groups, (grid.dp_comm, grid.edp_comm))]
        self.part_groups, self.dp_comm, self.edp_comm, self.ep_comm = part_groups, grid.dp_comm, grid.edp_comm, \
            grid.ep_comm
        self.shard_comm, self.ep = grid.dp_comm, grid.ep
        self.order = [n for p in self.parts for n in p.order]
        self.sizes = PairedSizes(self.parts[0].sizes, self.parts[1].sizes)
        self.pbuf = self.parts[0].pbuf
        self.params = ChainMap(self.parts[0].params, self.parts[1].params)
        hooks = [GroupHooks(p.hooks, pg) for p, pg in zip(self.parts, part_groups) if p.hooks is not None]
        self.hooks = ChainedHooks(hooks) if hooks else None
        if any(p.on_ready is not None for p in self.parts):
            self.on_ready = self.ready
        self.master_ = self.concat([p.master for p in self.parts]).copy()
        self.buf, self.lag = None, self.parts[0].lag                   # (--dp-staleness 1: both parts one step late)

    @staticmethod
    def concat(arrays):
        return array_module(arrays[0]).concatenate([a.reshape(-1) for a in arrays])

    def split(self, flat):
        n = self.parts[0].master.size
        return flat[:n], flat[n:]

    def holders(self, name):
        """The ranks of shard_comm (dp_comm) that hold this rank's element of `name` alike."""
        part, comm = (self.parts[1], self.edp_comm) if name in self.experts else (self.parts[0], self.dp_comm)
        return comm.size // (part.shard_comm.size if part.shard_comm is not None else 1)

    def ready(self, group):
        for p, pg in zip(self.parts, self.part_groups):
            if p.on_ready is not None and group in pg:
                p.on_ready(group)

    def use(self, num):
        for p in self.parts:
            p.use(num)

    def model_weights(self):
        return ChainMap(*[p.model_weights() for p in self.parts])

    def slow_down(self, seconds, tracer):
        self.parts[0].slow_down(seconds, tracer)

    def begin(self):
        self.buf = PairedBuffer([p.begin() for p in self.parts])
        return self.buf

    def arrive(self):
        self.parts[0].arrive()

    def finish(self):
        waited = sum(p.finish() for p in self.parts)
        g = self.parts[1].grads()
        if g is not None:
            g *= self.edp_comm.size / self.dp_comm.size               # 1/edp -> 1/(dp cp)
        self.buf = PairedBuffer([p.buf for p in self.parts]) if all(p.buf is not None for p in self.parts) else None
        return waited

    def grads(self):
        gs = [p.grads() for p in self.parts]
        return None if any(g is None for g in gs) else self.concat(gs)

    def checked(self):
        return self.concat([p.checked() for p in self.parts])

    def fresh(self):
        """--dp-staleness 1: this step's own gradient of both parts, as it left this rank."""
        return self.concat([p.fresh() for p in self.parts])

    @property
    def master(self):
        return self.master_

    def mask(self, predicate):
        return self.concat([p.mask(predicate) for p in self.parts])

    def after_update(self):
        for p, part in zip(self.parts, self.split(self.master_)):
            p.master[...] = part.reshape(p.master.shape)
            p.after_update()

    def named(self, part):
        out = {}
        for p, piece in zip(self.parts, self.split(part)):
            out.update(p.named(piece))
        return out

    def owned_part(self, named):
        return self.concat([p.owned_part({n: a for n, a in named.items() if n in p.shapes}) for p in self.parts])

    def full_params(self):
        return {**self.parts[0].full_params(), **self.parts[1].full_params()}

    def set_params(self, named):
        for p in self.parts:
            p.set_params({n: a for n, a in named.items() if n in p.shapes})
        self.master_[...] = self.concat([p.master for p in self.parts])

    def comms(self):
        return [c for p in self.parts for c in p.comms()]

    def close(self):
        for p in self.parts:
            p.close()

    def free(self):
        for p in self.parts:
            p.free()
