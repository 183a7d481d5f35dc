"""Data parallelism across the G = dp groups: slice the global batch, average each gradient shard over dp_comm.

The seed paper, section 3.4: every parameter shard W_part exists in G copies, one per model-parallel group; the
ranks that hold the same shard (the same tp_rank, in every group) form dp_comm, and after the backward pass they
All-Reduce its gradient and divide by G. Each group computed the mean loss over its own B/G sequences, so

    (1/G) sum_g grad(mean loss of slice g) = grad(mean loss of the global batch)

(equal slices): the update is exactly serial mini-batch SGD on the global batch, and since every replica applies
the same averaged gradient to the same parameters, the replicas stay identical.

The gradient shards live in one contiguous buffer (`GradBuffer`), so the whole exchange is one Allreduce of all
the rank's gradient bytes rather than one call per parameter.
"""
import hashlib

from .backend import array_module, to_numpy
from .errors import ConfigError


def dp_rows(batch_size, dp, dp_rank):
    """Rows of the global batch that DP group dp_rank trains on: a contiguous slice of B/dp sequences."""
    per = batch_size // dp
    return slice(dp_rank * per, (dp_rank + 1) * per)


def micro_batches(rows, grad_accum):
    """Split a slice of rows into grad_accum equal, consecutive micro-batches."""
    n = (rows.stop - rows.start) // grad_accum
    return [slice(rows.start + j * n, rows.start + (j + 1) * n) for j in range(grad_accum)]


def check_batch(batch_size, dp, grad_accum):
    """Raise ConfigError unless the global batch splits into dp groups of grad_accum equal micro-batches."""
    if batch_size % (dp * grad_accum):
        per = dp * grad_accum
        options = [b for b in range(per, 4 * per + 1, per)]
        raise ConfigError(f"batch_size={batch_size} does not split into dp={dp} groups x grad_accum={grad_accum} "
                          f"equal micro-batches; use a multiple of dp*grad_accum = {per}, e.g. {options}")


class GradBuffer:
    """All gradient shards of a rank in one flat contiguous array; `grads[name]` are views into it."""

    def __init__(self, params):
        xp = array_module(next(iter(params.values())))
        dtype = next(iter(params.values())).dtype
        total = sum(p.size for p in params.values())
        self.flat = xp.zeros(total, dtype=dtype)                     # (sum of shard sizes,)
        self.grads, offset = {}, 0
        for name, p in params.items():
            self.grads[name] = self.flat[offset:offset + p.size].reshape(p.shape)
            offset += p.size

    def zero(self):
        self.flat.fill(0)


def dp_average(buf, dp_comm):
    """g <- (1/dp) * sum over the dp replicas of g, for every gradient shard at once."""
    dp_comm.Allreduce(buf.flat)                                      # (all shards,) sum over the G groups
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
