"""Overlapped averaging (--dp-overlap): each layer's gradient bucket starts its Iallreduce over dp_comm as soon as
the backward pass has finished the layer, while the backward pass goes on with the layers below (the lecture,
section 4.1; chapter 8, section 1). The same numbers as one Allreduce; what the backward pass cannot hide (at
least the last bucket's exchange) is what the step waits for in finish()."""
from hsgd.dp.exchange import AllreduceExchange, AllreduceSizes, numel_of


class OverlappedSizes(AllreduceSizes):
    """One Iallreduce per gradient group (a bucket), the backward pass hiding all but the last."""
    hidden_by = "buckets"

    def formula(self):
        return {(self.dp_name, "Iallreduce"): (len(self.numel), self.size * self.itemsize)}

    def describe(self):
        return f"overlapped, {len(self.numel)} buckets, one Iallreduce each during the backward pass"


class OverlappedExchange(AllreduceExchange):
    """Bucketed, overlapped averaging: each bucket's Iallreduce over dp_comm starts as soon as the backward pass
    has finished its group (on_ready), while the backward pass goes on with the layers below; finish() waits for
    all of them and divides by dp. The same numbers as one Allreduce, in len(buckets) calls instead of one.

    buckets: {group: slice of the flat layout}, in backward order (tp_model.backward_order)."""

    def __init__(self, params, groups, dp_comm):
        super().__init__(params, groups, dp_comm, OverlappedSizes(*numel_of(params, groups), dp_comm.size,
                                                                  dp_comm.name))
        self.buckets = {grp: self.pbuf.span(names) for grp, names in groups.items()}   # group -> slice of flat
        self.pending = []

    def on_ready(self, group):
        """The group's bucket, rounded to --reduce-dtype as it leaves: its Iallreduce starts, and returns."""
        self.pending.append(self.dp_comm.Iallreduce(self.num.reduced(self.buf.flat[self.buckets[group]])))

    def average(self):
        for req in self.pending:
            req.Wait()                                                # what has not arrived yet is exposed here
        self.pending = []
        if self.dp_comm.size > 1:
            self.buf.flat *= 1.0 / self.dp_comm.size
