"""The gradient exchange over dp_comm: one interface, one class per way of averaging.

After the backward pass every rank holds the gradient of its DP group's slice of the batch; the ranks holding the
same shard (dp_comm) average it, g <- (1/dp) sum_r g_r (the lecture, section 3.4; hsgd.dp.average). hsgd has
several ways to do that, each a class with the same methods, chosen in one place (hsgd.dp.make):

    AllreduceExchange     one Allreduce of the whole flat gradient after the backward pass (here)
    OverlappedExchange    one Iallreduce per layer's bucket, started during the backward pass (hsgd.dp.overlapped)
    HierarchicalExchange  reduce-scatter inside the node, all-reduce across nodes, all-gather inside
                          (hsgd.dp.hierarchical)
    ZeroExchange          reduce-scatter: each DP rank averages and updates 1/dp of the flat buffer (hsgd.dp.zero1)
    ShardedExchange       ZeRO 2 and 3: each layer's gradient reduce-scattered during the backward pass; stage 3 also
                          shards the parameters, gathered layer by layer (hsgd.dp.sharded)
    StaleExchange         the average started at step s is applied at step s+1 (asynchronous, one step late;
                          hsgd.dp.stale)

The interface, in the order a step uses it:
    pbuf, order                 the rank's parameters as one FlatBuffer, laid out by the exchange in `order` (the
                                backward pass's groups, each a contiguous bucket; ZeRO pads it to dp chunks);
                                ZeRO-3 has no pbuf: it holds only its chunks (hsgd.dp.sharded)
    params                      {name: array} the stage computes with (ZeRO-3: filled group by group by hooks)
    hooks                       None, or an hsgd.tp.hooks.Hooks run around each group's forward and backward
    offsets, size               where each parameter lies in the flat layout, and its length (padding included)
    buf                         the gradient buffer (pbuf's layout) of the current step; None when released (ZeRO 2)
    begin() -> FlatBuffer       the zeroed gradient buffer the backward pass accumulates into
    on_ready(group)             the backward pass has finished a group's gradients (a bucket), or None: not needed
    arrive()                    nothing, or --straggler's sleep (an experiment: this rank arrives late)
    finish() -> seconds         the average is complete (stale: started); returns the seconds this rank waited
    owned                       the slice of the flat layout this rank updates (ZeRO: its chunk; else all of it)
    master                      the parameters this rank updates, a view the optimizer writes into in place
    mask(predicate)             (master.size,) 1.0 where predicate(name, shape) holds: per-element flags
    grads() -> flat or None     the averaged gradient of `master` to apply now (None: nothing has arrived yet)
    checked() -> flat           the gradient the step's non-finite check looks at
    after_update()              every replica gets the updated parameters (ZeRO: Allgather; else nothing)
    shard_comm                  the communicator over which `owned` differs (dp_comm; hybrid sharding: the node's),
                                so that sums over it add up; None when every DP rank owns everything
    gather(part) -> flat        the whole flat array from every DP rank's `owned` part (checkpoints)
    own(flat) -> part           this rank's part of a whole flat array (the inverse of gather, no communication)
    full_params() -> {name: a}  collective over shard_comm: every parameter whole (ZeRO-3 All-Gathers a copy)
    set_params({name: a})       set this rank's parameters from whole ones (checkpoints)
    formula(), param_bytes(), grad_bytes(), describe(), comms(), close(), free()

The formulas (formula, memory_formula, param_bytes, grad_bytes, owned_numel) read only sizes, which `sizes()` sets
from the elements of each gradient group, the itemsize and the dp_comm's size: the trainer's exchange sets them from
its arrays, and `sized_exchange` makes the same class with its sizes alone (no arrays, no communicator), for a
layout that is only planned (hsgd.plan) and for runs far larger than this machine.
"""
import time

from hsgd.model.backend import array_module
from hsgd.dp.average import FlatBuffer, dp_average


class GradExchange:
    """The plain All-Reduce, and the defaults every other exchange shares: see the module docstring.

    params: this rank's parameter shards {name: array}; groups: {group: [names]} in the order the backward pass
    finishes them (tp_model.backward_order). The exchange lays out the flat parameter buffer `pbuf` (each group a
    contiguous bucket, padded to a multiple of `pad`) and a gradient buffer `buf` with the same layout."""
    on_ready = None                                                   # no per-bucket work during the backward
    hooks = None                                                      # no per-group work in forward or backward
    delay, tracer = 0.0, None                                         # --straggler: seconds to sleep before finish
    lag = 0                                                           # steps from a gradient's backward to its update

    def __init__(self, params, groups, dp_comm, pad=1):
        self.dp_comm, self.groups, self.pad = dp_comm, groups, pad
        self.order = [n for names in groups.values() for n in names]
        self.sizes(group_numel(params, groups), next(iter(params.values())).dtype.itemsize, dp_comm.size,
                   dp_comm.name)
        self.pbuf = FlatBuffer(params, self.order, pad)               # (N + padding,) the parameters
        for name, p in params.items():
            self.pbuf.views[name][...] = p
        self.buf = self.new_buffer()                                  # (N + padding,) their gradients
        self.owned = slice(0, self.pbuf.flat.size)
        self.shard_comm = None
        self.params = self.pbuf.views                                 # {name: view into pbuf.flat}
        self.offsets, self.size = self.pbuf.offsets, self.pbuf.flat.size

    def configure(self, tc, dp_size):
        """sized_exchange: the settings __init__ takes as arguments (here: none; pad 1)."""
        self.pad = 1

    def sizes(self, numel, itemsize, dp_size, name="dp"):
        """What the formulas read: numel {group: elements} in backward order, itemsize bytes, dp_size ranks in
        dp_comm (named `name`). The flat layout is sum numel, padded to a multiple of `pad`."""
        self.numel, self.itemsize, self.dp_size, self.dp_name = dict(numel), itemsize, dp_size, name
        total = sum(numel.values())
        self.size = total + (-total % self.pad)                       # (N + padding,) the flat layout

    def owned_numel(self):
        """Elements this rank updates and keeps optimizer state for (the size of `master`)."""
        return self.size

    @property
    def master(self):
        return self.pbuf.flat[self.owned]                             # a view: the optimizer updates in place

    def mask(self, predicate):
        return self.own(self.pbuf.mask(lambda n, p: predicate(n, p.shape))).copy()   # (not a view of the whole)

    def own(self, flat):
        return flat[self.owned]

    def full_params(self):
        return self.params

    def set_params(self, named):
        xp = array_module(self.pbuf.flat)
        for n, p in named.items():
            self.params[n][...] = xp.asarray(p)                       # (host arrays onto the device)

    def new_buffer(self):
        """A zeroed buffer with the parameters' layout."""
        return FlatBuffer(self.pbuf.views, self.order, self.pad)

    def begin(self):
        self.buf.zero()
        return self.buf

    def arrive(self):
        """Called before finish(): --straggler makes its rank sleep here, so that it arrives late."""
        if self.delay:
            with self.tracer.span("straggler delay"):
                time.sleep(self.delay)

    def finish(self):
        t0 = time.perf_counter()
        self.average()
        return time.perf_counter() - t0

    def average(self):
        dp_average(self.buf, self.dp_comm)                            # one Allreduce over dp_comm, then / dp

    def grads(self):
        return self.buf.flat

    def checked(self):
        return self.grads()

    def after_update(self):
        pass

    def gather(self, part):
        return part

    def model_weights(self, num):
        """The weights the model computes with in this step: the parameters as `num` (hsgd.model.precision.Numerics)
        rounds them: a rounded copy in bfloat16 and float16, the parameters themselves otherwise."""
        return num.weights(self.params)

    def formula(self):
        """{(comm, op): (calls, payload bytes)} of one step's exchange, as CommStats records it."""
        return {(self.dp_name, "Allreduce"): (1, self.size * self.itemsize)}

    def param_bytes(self):
        """Bytes of parameter storage this rank keeps between steps: pbuf (size,)."""
        return self.size * self.itemsize

    def grad_bytes(self):
        """Bytes of gradient storage this rank keeps between steps: buf (size,)."""
        return self.size * self.itemsize

    def memory_formula(self):
        """{"params", "grads", "comm"}: bytes of this exchange's own buffers at their peaks in a step
        (hsgd.accounting.step_memory): the flat parameters pbuf and the gradient buffer buf, (size,) each; no other
        buffer."""
        n = self.size * self.itemsize
        return {"params": n, "grads": n, "comm": 0}

    def describe(self):
        return "one Allreduce of all gradients after the backward pass"

    def comms(self):
        """Communicators of this exchange's own (beyond the grid's), e.g. for tracing and staging reports."""
        return []

    def close(self):
        """Complete anything still in flight (idempotent)."""

    def free(self):
        """close(), then free the exchange's own communicators."""
        self.close()


AllreduceExchange = GradExchange


def group_numel(params, groups):
    """{group: elements of its parameters}, in the groups' order."""
    return {g: sum(int(params[n].size) for n in names) for g, names in groups.items()}
