"""Sharded optimizer over dp_comm (ZeRO stage 1): reduce-scatter the gradients, update 1/dp, all-gather.

The lecture, section 3.4, names the optimization: instead of All-Reducing every gradient and letting every
replica do the same full update, Reduce-Scatter over the data-parallel dimension, so that DP rank r receives the
averaged gradient of its own 1/dp of the parameters, updates only that part (and keeps optimizer state only
for it), then All-Gather the updated parameters. An All-Reduce *is* a Reduce-Scatter followed by an All-Gather,
so the bytes are the same; what falls by dp is the optimizer's state and work (Rajbhandari et al. 2020, ZeRO).

    flat (padded to dp * chunk) = [ chunk_0 | chunk_1 | ... | chunk_{dp-1} ]     rank r owns chunk_r
    g_r = (1/dp) Reduce_scatter_block(grads.reshape(dp, chunk))[r]              (chunk,)
    p[chunk_r] <- optimizer(p[chunk_r], g_r)                                    state: (chunk,) per moment
    p = Allgather(p[chunk_r])                                                    (dp, chunk) -> flat

Stage 1 keeps the full gradient buffer, and the Reduce-Scatter runs after the whole backward pass. Stages 2 and 3
(hsgd.dp.zero2, hsgd.dp.zero3) reduce-scatter layer by layer during the backward pass and keep only the owned chunk
of the gradient; stage 3 shards the parameters too.

The optimizer works on the flat layout in every exchange (hsgd.step.trainer): element masks say which elements get
weight decay (2-D parameters) and which belong to tensor-sharded parameters (for the global gradient norm); here it
sees only the owned chunk of them.
"""
from hsgd.dp.exchange import AllreduceExchange, AllreduceSizes, numel_of
from hsgd.model.backend import array_module


class Zero1Sizes(AllreduceSizes):
    """ZeRO 1 from sizes: the flat layout padded to dp_size equal chunks, one of which this rank owns."""

    def __init__(self, numel, itemsize, dp_size, name="dp"):
        super().__init__(numel, itemsize, dp_size, name, pad=dp_size)
        self.chunk = self.size // dp_size                               # my part of the padded flat layout

    def owned_numel(self):
        return self.chunk

    def formula(self):
        """One Reduce_scatter_block of the padded gradient buffer and one Allgather of the padded parameters (the
        two halves of an All-Reduce)."""
        n = self.size * self.itemsize
        return {(self.dp_name, "Reduce_scatter_block"): (1, n), (self.dp_name, "Allgather"): (1, n)}

    def grad_bytes(self):
        """Between steps: the full buffer (size,) and my averaged chunk (chunk,)."""
        return (self.size + self.chunk) * self.itemsize

    def memory_formula(self):
        """Parameters (size,) whole; gradients: the full buffer and my averaged chunk (chunk,); comm: the
        Allgather's send buffer (chunk,)."""
        s = self.itemsize
        return {"params": self.size * s, "grads": (self.size + self.chunk) * s, "comm": self.chunk * s}

    def describe(self):
        return "ZeRO stage 1 (Reduce_scatter_block + sharded optimizer + Allgather over dp_comm)"


class Zero1Exchange(AllreduceExchange):
    """The exchange of ZeRO stage 1 (see the module docstring): the flat layout is padded to dp equal chunks;
    `owned` is this rank's chunk, the only part it averages, updates and keeps optimizer state for."""

    def __init__(self, params, groups, dp_comm):
        super().__init__(params, groups, dp_comm, Zero1Sizes(*numel_of(params, groups), dp_comm.size, dp_comm.name))
        xp, r, chunk = array_module(self.pbuf.flat), dp_comm.rank, self.sizes.chunk
        self.owned = slice(r * chunk, (r + 1) * chunk)                  # my part of the flat layout
        self.shard_comm = dp_comm                                       # each DP rank holds a different chunk
        self.g_chunk = xp.zeros(chunk, dtype=self.pbuf.flat.dtype)      # (chunk,) my averaged gradient
        self.p_send = xp.zeros(chunk, dtype=self.pbuf.flat.dtype)       # (chunk,) send buffer of the Allgather

    def average(self):
        """g_r <- (1/dp) * (sum over dp of the full gradient, rounded to --reduce-dtype as it leaves)[my chunk]."""
        dp = self.dp_comm.size
        self.dp_comm.Reduce_scatter_block(self.num.reduced(self.buf.flat).reshape(dp, self.sizes.chunk),
                                          self.g_chunk)
        self.g_chunk *= 1.0 / dp

    def grads(self):
        return self.g_chunk

    def after_update(self):
        """All-Gather every rank's updated chunk into every rank's parameters."""
        self.p_send[...] = self.pbuf.flat[self.owned]
        self.dp_comm.Allgather(self.p_send, self.pbuf.flat.reshape(self.dp_comm.size, self.sizes.chunk))

    def gather(self, part):
        """Collective over dp_comm: the whole flat array from every DP rank's chunk `part` (chunk,)."""
        xp = array_module(part)
        full = xp.empty((self.dp_comm.size, self.sizes.chunk), dtype=part.dtype)
        self.dp_comm.Allgather(xp.ascontiguousarray(part), full)
        return full.reshape(-1)
