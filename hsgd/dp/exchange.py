"""The gradient exchange over dp_comm: one interface, one class per way of averaging.

After the backward pass every rank holds the gradient of its DP group's slice of the batch; the ranks holding the
same shard (dp_comm) average it, g <- (1/dp) sum_r g_r (the lecture, section 3.4; hsgd.dp.average). hsgd has
several ways to do that, each a class with the same methods, chosen in one place (hsgd.dp.make):

    AllreduceExchange     one Allreduce of the whole flat gradient after the backward pass (here)
    OverlappedExchange    one Iallreduce per layer's bucket, started during the backward pass (hsgd.dp.overlapped)
    HierarchicalExchange  reduce-scatter inside the node, all-reduce across nodes, all-gather inside
                          (hsgd.dp.hierarchical)
    StaleExchange         the average started at step s is applied at step s+1 (asynchronous, one step late;
                          hsgd.dp.stale)
    Zero1Exchange         reduce-scatter: each DP rank averages and updates 1/dp of the flat buffer (hsgd.dp.zero1)
    Zero2Exchange         each layer's gradient reduce-scattered during the backward pass (hsgd.dp.zero2)
    Zero3Exchange         ... and the parameters sharded too, gathered layer by layer (hsgd.dp.zero3)

The interface, in the order a step uses it:
    pbuf, order                 the rank's parameters as one FlatBuffer, laid out by the exchange in `order` (the
                                backward pass's groups, each a contiguous bucket; ZeRO pads it to dp chunks);
                                ZeRO 2 and 3 have none: they hold their chunks (hsgd.dp.sharded)
    params                      {name: array} the stage computes with (ZeRO-3: filled group by group by hooks)
    hooks                       None, or an hsgd.tp.hooks.Hooks run around each group's forward and backward
    offsets                     where each parameter lies in the flat layout
    use(num)                    where --reduce-dtype and the weights round (hsgd.model.precision.Numerics)
    model_weights()             the weights the model computes with this step (bfloat16, float16: rounded copies)
    buf                         the gradient buffer (pbuf's layout) of the current step; None when released
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
    named(part) -> {name: a}    gather(part) cut into this rank's parameter shards' shapes (collective with ZeRO)
    owned_part({name: a})       own() of a flat array filled from whole shards (the inverse of named)
    full_params() -> {name: a}  collective over shard_comm: every parameter whole (ZeRO-3 All-Gathers a copy)
    set_params({name: a})       set this rank's parameters from whole ones (checkpoints)
    comms(), close(), free()    its own communicators; complete what is in flight; free them
    sizes                       its bytes and memory as formulas of sizes alone (below)

Every exchange's formulas are an object of their own that reads only sizes: the elements of each gradient group,
the itemsize and the dp_comm's size (and the settings that shape it). The exchange makes its `sizes` from its arrays;
hsgd.dp.make.exchange_sizes makes the same object from sizes alone (no array, no communicator) for a layout that is
only planned (hsgd.plan) and for runs far larger than this machine. What a sizes object answers:
    size, itemsize, numel       the flat layout's length (padding included), bytes per element, {group: elements}
    owned_numel()               elements this rank updates and keeps optimizer state for
    formula()                   {(comm, op): (calls, payload bytes)} of one step, as CommStats records it
    param_bytes(), grad_bytes() storage kept between steps
    memory_formula()            {"params", "grads", "comm"}: its buffers at their peaks in a step
    comms()                     {name: ranks} of its own communicators (beyond dp_comm)
    when(key)                   when a collective of formula() runs: "after" the pipeline, "backward" (behind each
                                micro-batch's backward pass), "forward and backward" (before each)
    hidden_by                   what hides the exchange that runs "after": None, "buckets" (the backward pass, all
                                but a bucket), "next step" (the whole next step)
    describe()                  one line for the run's header
"""
import time

from hsgd.dp.average import FlatBuffer, dp_average
from hsgd.model.backend import array_module
from hsgd.model.precision import EXACT


class AllreduceSizes:
    """The plain exchange from sizes alone: numel {group: elements} in backward order, itemsize bytes, dp_size ranks
    in dp_comm (named `name`). The flat layout is sum numel, padded to a multiple of `pad`."""
    hidden_by = None                                                  # nothing hides it: after the pipeline
    holds_weight_copy = True          # bfloat16, float16: the model's rounded copy of the weights lives all step

    def __init__(self, numel, itemsize, dp_size, name="dp", pad=1):
        self.numel, self.itemsize, self.dp_size, self.dp_name, self.pad = dict(numel), itemsize, dp_size, name, pad
        total = sum(self.numel.values())
        self.size = total + (-total % pad)                            # (N + padding,) the flat layout

    def owned_numel(self):
        """Elements this rank updates and keeps optimizer state for (the size of `master`)."""
        return self.size

    def formula(self):
        """One Allreduce of the whole flat gradient."""
        return {(self.dp_name, "Allreduce"): (1, self.size * self.itemsize)}

    def param_bytes(self):
        """Bytes of parameter storage this rank keeps between steps: pbuf (size,)."""
        return self.size * self.itemsize

    def grad_bytes(self):
        """Bytes of gradient storage this rank keeps between steps: buf (size,)."""
        return self.size * self.itemsize

    def memory_formula(self):
        """{"params", "grads", "comm"}: bytes of this exchange's own buffers at their peaks in a step
        (hsgd.accounting.step_memory): the flat parameters pbuf and the gradient buffer buf, (size,) each."""
        n = self.size * self.itemsize
        return {"params": n, "grads": n, "comm": 0}

    def comms(self):
        return {}

    def when(self, key):
        return "after"

    def describe(self):
        return "one Allreduce of all gradients after the backward pass"


class AllreduceExchange:
    """The plain All-Reduce, and what every other exchange shares (see the module docstring).

    params: this rank's parameter shards {name: array}; groups: {group: [names]} in the order the backward pass
    finishes them (tp_model.backward_order); sizes: the exchange's formulas (here AllreduceSizes of the arrays). The
    exchange lays out the flat parameter buffer `pbuf` (each group a contiguous bucket, padded to sizes.pad) and a
    gradient buffer `buf` with the same layout."""
    on_ready = None                                                   # no per-bucket work during the backward
    hooks = None                                                      # no per-group work in forward or backward
    delay, tracer = 0.0, None                                         # --straggler: seconds to sleep before finish
    lag = 0                                                           # steps from a gradient's backward to its update
    num = EXACT                                                       # where --reduce-dtype rounds: nowhere

    def __init__(self, params, groups, dp_comm, sizes=None):
        self.dp_comm, self.groups = dp_comm, groups
        self.order = [n for names in groups.values() for n in names]
        self.sizes = sizes or AllreduceSizes(*numel_of(params, groups), dp_comm.size, dp_comm.name)
        self.pbuf = FlatBuffer(params, self.order, self.sizes.pad)    # (N + padding,) the parameters
        for name, p in params.items():
            self.pbuf.views[name][...] = p
        self.buf = self.new_buffer()                                  # (N + padding,) their gradients
        self.owned = slice(0, self.pbuf.flat.size)
        self.shard_comm = None
        self.params = self.pbuf.views                                 # {name: view into pbuf.flat}
        self.offsets = self.pbuf.offsets
        self.shapes = {n: p.shape for n, p in params.items()}

    def use(self, num):
        """Round where `num` says: --reduce-dtype's format for the gradients this exchange sends and receives
        ("reduce"), the compute format for the weights the model computes with ("weights")."""
        self.num = num

    def model_weights(self):
        """The weights the model computes with in this step: a rounded copy in bfloat16 and float16, the parameters
        themselves otherwise."""
        return self.num.weights(self.params)

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
        return FlatBuffer(self.pbuf.views, self.order, self.sizes.pad)

    def begin(self):
        self.buf.zero()
        return self.buf

    def slow_down(self, seconds, tracer):
        """--straggler: sleep `seconds` before every exchange (arrive), shown on the trace as "straggler delay"."""
        self.delay, self.tracer = seconds, tracer

    def arrive(self):
        """Called before finish(): --straggler makes its rank sleep here, so that it arrives late."""
        if self.delay:
            with self.tracer.span("straggler delay"):
                time.sleep(self.delay)

    def finish(self):
        """The average (average()), then --reduce-dtype: the average rounded as it arrives. Returns the seconds this
        rank waited."""
        t0 = time.perf_counter()
        self.average()
        waited = time.perf_counter() - t0
        if self.grads() is not None:
            self.num.reduced(self.grads())
        return waited

    def average(self):
        """My gradient (rounded to --reduce-dtype as it leaves), one Allreduce over dp_comm, then / dp."""
        self.num.reduced(self.buf.flat)
        dp_average(self.buf, self.dp_comm)

    def grads(self):
        return self.buf.flat

    def checked(self):
        return self.grads()

    def after_update(self):
        pass

    def gather(self, part):
        return part

    def named(self, part):
        """{name: this rank's shard, whole} from every DP rank's `owned` part of a flat array (a gradient, an
        optimizer moment): gather(part), collective over shard_comm when the exchange shards."""
        flat = self.gather(part)
        return {n: flat[lo:hi].reshape(self.shapes[n]) for n, (lo, hi) in self.offsets.items()}

    def owned_part(self, named):
        """This rank's `owned` part of the flat array laid out from {name: whole shard} (zeros where none is given):
        the inverse of named, without communication."""
        xp = array_module(self.master)
        flat = xp.zeros(self.sizes.size, dtype=self.master.dtype)
        for n, a in named.items():
            lo, hi = self.offsets[n]
            flat[lo:hi] = xp.asarray(a).reshape(-1)
        return xp.array(self.own(flat))

    def comms(self):
        """Communicators of this exchange's own (beyond the grid's), e.g. for tracing and staging reports."""
        return []

    def close(self):
        """Complete anything still in flight (idempotent)."""

    def free(self):
        """close(), then free the exchange's own communicators."""
        self.close()


def numel_of(params, groups):
    """({group: elements of its parameters}, in the groups' order; bytes per element)."""
    numel = {g: sum(int(params[n].size) for n in names) for g, names in groups.items()}
    return numel, next(iter(params.values())).dtype.itemsize
