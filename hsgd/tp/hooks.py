"""What runs around each gradient group's forward and backward in a pipeline stage (hsgd.tp.model.stage_forward
and stage_backward call them): nothing by default; ZeRO 2 and 3 gather parameters and reduce-scatter gradients
layer by layer (hsgd.dp.sharded.ShardHooks), the memory probe samples (hsgd.accounting.allocations.ProbeHooks). A group
is "embedding", "h.{i}" or "head" (tp_model.backward_order)."""
from contextlib import ExitStack, contextmanager, nullcontext


class Hooks:
    """What runs around each gradient group's forward and backward in a stage (stage_forward, stage_backward):
    here nothing. Two subclasses do something: ZeRO 2 and 3 allocate a group's gradient bucket on entry and
    Reduce-Scatter and free it on exit, and ZeRO-3 also All-Gathers the group's parameters into `params` on entry
    and frees them on exit (hsgd.dp.sharded); the memory probe samples the bytes held on exit
    (hsgd.accounting.allocations). Groups are "embedding", "h.{i}", "head"."""

    def forward(self, group):
        return nullcontext()

    def backward(self, group):
        return nullcontext()

    def point(self, group, what):
        """A moment worth seeing inside a group's backward: "recomputed" (the recomputation's arrays are all
        alive). Nothing here; the memory probe samples."""


NO_HOOKS = Hooks()


class ChainedHooks(Hooks):
    """Several Hooks around each group, the first outermost (ZeRO-3's gather, then the memory probe's sample, so
    that the probe sees the gathered parameters)."""

    def __init__(self, chain):
        self.chain = chain

    def forward(self, group):
        return _nested([h.forward(group) for h in self.chain])

    def backward(self, group):
        return _nested([h.backward(group) for h in self.chain])

    def point(self, group, what):
        for h in self.chain:
            h.point(group, what)


@contextmanager
def _nested(contexts):
    with ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield
