"""Data parallelism across the G = dp groups: slice the global batch, average each gradient shard over dp_comm.

The lecture, section 3.4: every parameter shard W_part exists in G copies, one per model-parallel group; the
ranks that hold the same shard (the same pp and tp coordinates, in every group) form dp_comm, and after the
backward pass they All-Reduce its gradient and divide by G. Each group computed the mean loss over its own B/G
sequences, so

    (1/G) sum_g grad(mean loss of slice g) = grad(mean loss of the global batch)

(equal slices): the update is exactly serial mini-batch SGD on the global batch, and since every replica applies
the same averaged gradient to the same parameters, the replicas stay identical.

A rank's parameters and gradients each live in one contiguous buffer (`FlatBuffer`), so the whole exchange is one
Allreduce of all the rank's gradient bytes rather than one call per parameter (`dp_average`). The other ways of
doing the exchange (overlapped, hierarchical, ZeRO, stale) are classes behind one interface: hsgd.dp.exchange.
"""
import hashlib

from hsgd.model.backend import array_module, to_numpy
from hsgd.errors import ConfigError


def dp_rows(batch_size, dp, dp_rank):
    """Rows of the global batch that DP group dp_rank trains on: a contiguous slice of B/dp sequences."""
    per = batch_size // dp
    return slice(dp_rank * per, (dp_rank + 1) * per)


def micro_batches(rows, m):
    """Split a slice of rows into m equal, consecutive micro-batches."""
    n = (rows.stop - rows.start) // m
    return [slice(rows.start + j * n, rows.start + (j + 1) * n) for j in range(m)]


def check_batch(batch_size, dp, m):
    """Raise ConfigError unless the global batch splits into dp groups of m equal micro-batches."""
    if batch_size % (dp * m):
        per = dp * m
        options = [b for b in range(per, 4 * per + 1, per)]
        raise ConfigError(f"batch_size={batch_size} does not split into dp={dp} groups x micro_batches={m} "
                          f"equal micro-batches; use a multiple of dp*micro_batches = {per}, e.g. {options}")


class FlatBuffer:
    """Arrays of the shapes of `params`, all views into one flat contiguous array: `views[name]`, `flat`.

    A rank's parameters live in one (hsgd.dp.exchange: `pbuf`) and their gradients in others with the same layout (the
    exchange's `buf`; the stale exchange keeps two more, ZeRO 2 allocates `buf` each step), so that a slice of one
    (a bucket, a ZeRO chunk) is the same parameters in the other.
    order: the names in buffer order (default: the order of params). Laid out in the order the backward pass
    finishes them (tp_model.backward_order), each gradient group is a contiguous slice: a bucket.
    pad_multiple: the flat length is rounded up to a multiple of this (ZeRO splits it into dp equal chunks).
    """

    def __init__(self, params, order=None, pad_multiple=1):
        first = next(iter(params.values()))
        xp = array_module(first)
        order = list(order or params)
        total = sum(params[n].size for n in order)
        total += -total % pad_multiple
        self.flat = xp.zeros(total, dtype=first.dtype)                  # (sum of shard sizes + padding,)
        self.views, self.offsets, offset = {}, {}, 0
        for name in order:
            size = params[name].size
            self.views[name] = self.flat[offset:offset + size].reshape(params[name].shape)
            self.offsets[name] = (offset, offset + size)
            offset += size
        self.views = {name: self.views[name] for name in params}         # the caller's order for iteration

    def zero(self):
        self.flat.fill(0)

    def span(self, names):
        """The slice of flat covering `names` (which must be contiguous in the layout)."""
        lo = min(self.offsets[n][0] for n in names)
        hi = max(self.offsets[n][1] for n in names)
        assert hi - lo == sum(self.offsets[n][1] - self.offsets[n][0] for n in names), "names are not contiguous"
        return slice(lo, hi)

    def mask(self, predicate):
        """(flat.size,) 1.0 where predicate(name, view) holds, else 0.0 (padding: 0): per-element flags; a number
        the predicate returns is written as it is (a weight)."""
        out = array_module(self.flat).zeros(self.flat.size, dtype=self.flat.dtype)
        for name, (lo, hi) in self.offsets.items():
            out[lo:hi] = float(predicate(name, self.views[name]))           # a flag, or a weight
        return out


def dp_average(buf, dp_comm):
    """g <- (1/n) * sum over the n ranks of dp_comm of g (the dp replicas; with context parallelism dp x cp), for
    every gradient shard at once. buf: a FlatBuffer."""
    dp_comm.Allreduce(buf.flat)                                      # (all shards,) sum over the G groups (x cp)
    if dp_comm.size > 1:
        buf.flat *= 1.0 / dp_comm.size


def dp_formula(params):
    """{("dp", "Allreduce"): (calls, bytes)} of one training step: one Allreduce of all local gradient bytes."""
    return {("dp", "Allreduce"): (1, int(sum(p.nbytes for p in params.values())))}


def params_digest(params):
    """SHA-256 of a replica's parameters, for checking that replicas agree bit for bit."""
    h = hashlib.sha256()
    for name in params:
        h.update(to_numpy(params[name]).tobytes())
    return h.hexdigest()


def global_loss(group_loss, grid):
    """The global batch's loss from this DP group's (the sum over its pipeline stages: the loss of the stage that
    holds the last piece, and the auxiliary losses of every stage's MoE blocks, 0.0 without; with context
    parallelism its cp ranks' losses of their positions, which are averaged too): metadata, pickled. Collective over
    the grid."""
    return grid.dp_comm.comm.allreduce(grid.pp_comm.comm.allreduce(group_loss)) / grid.dp_comm.size


def replica_divergence(exchange, dp_comm):
    """Collective over dp_comm: None if every DP replica holds the same parameters, else the first parameter (in
    the exchange's order) whose replicas differ, and the dp_comm ranks holding each version (dp_rank cp + cp_rank).
    With experts split over ep ranks (the folded exchange), each rank's experts are compared over their own
    replicas (edp_comm; ranks numbered there) and the dense parameters over dp_comm."""
    params, experts = exchange.full_params(), getattr(exchange, "experts", set())
    dense = [n for n in exchange.order if n not in experts]
    found = first_difference(params, dense, dp_comm)
    if experts:
        found = found or first_difference(params, [n for n in exchange.order if n in experts], exchange.edp_comm)
    return found


def first_difference(params, order, comm):
    """Collective over comm: the first parameter of `order` whose copies differ, with the comm ranks holding each
    version; None if none does."""
    digests = comm.allgather_obj([params_digest({n: params[n]}) for n in order])
    for i, name in enumerate(order):
        groups = {}
        for r, d in enumerate(digests):
            groups.setdefault(d[i], []).append(r)
        if len(groups) > 1:
            return name, sorted(groups.values())
    return None
