"""Sharded optimizer over dp_comm (ZeRO stages 1 and 2): reduce-scatter the gradients, update 1/dp, all-gather.

The lecture, section 3.4, names the optimization: instead of All-Reducing every gradient and letting every
replica do the same full update, Reduce-Scatter over the data-parallel dimension, so that DP rank r receives the
averaged gradient of its own 1/dp of the parameters, updates only that part (and keeps optimizer state only
for it), then All-Gather the updated parameters. An All-Reduce *is* a Reduce-Scatter followed by an All-Gather,
so the bytes are the same; what falls by dp is the optimizer's state and work (Rajbhandari et al. 2020, ZeRO).

    flat (padded to dp * chunk) = [ chunk_0 | chunk_1 | ... | chunk_{dp-1} ]     rank r owns chunk_r
    g_r = (1/dp) Reduce_scatter_block(grads.reshape(dp, chunk))[r]              (chunk,)
    p[chunk_r] <- optimizer(p[chunk_r], g_r)                                    state: (chunk,) per moment
    p = Allgather(p[chunk_r])                                                    (dp, chunk) -> flat

Stage 1 keeps the full gradient buffer between steps; stage 2 keeps only the owned chunk (the full-size buffer
exists from the backward pass to the Reduce-Scatter and is released after it). Here the Reduce-Scatter runs after
the whole backward pass, so the peak still holds one full gradient; bucketing the Reduce-Scatter into the
backward pass, which would lower the peak too, is left out.

Element masks replace what the per-parameter optimizer knew from names: which elements get weight decay
(2-D parameters) and which belong to tensor-sharded parameters (for the global gradient norm).
"""
from .backend import array_module


class ZeroOptimizer:
    def __init__(self, params, pbuf, make_buf, dp_comm, opt, stage, decays, is_sharded):
        """params: {name: view into pbuf.flat}; make_buf(): a new zeroed GradBuffer with pbuf's layout;
        opt: an hsgd.optim optimizer (works on any dict of arrays); decays(name, p), is_sharded(name): bools."""
        assert stage in (1, 2)
        xp = array_module(pbuf.flat)
        self.dp_comm, self.opt, self.stage, self.make_buf = dp_comm, opt, stage, make_buf
        self.pbuf = pbuf
        dp, r = dp_comm.size, dp_comm.rank
        self.chunk = pbuf.flat.size // dp
        self.mine = slice(r * self.chunk, (r + 1) * self.chunk)         # my part of the flat layout
        self.g_chunk = xp.zeros(self.chunk, dtype=pbuf.flat.dtype)       # (chunk,) my averaged gradient
        self.p_send = xp.zeros(self.chunk, dtype=pbuf.flat.dtype)        # (chunk,) send buffer of the Allgather
        decay, sharded = xp.zeros(pbuf.flat.size, bool), xp.zeros(pbuf.flat.size, bool)
        for name, (lo, hi) in pbuf.offsets.items():
            decay[lo:hi] = decays(name, params[name])
            sharded[lo:hi] = is_sharded(name)
        self.decay_mask = decay[self.mine].astype(pbuf.flat.dtype)      # (chunk,) 1 where weight decay applies
        self.sharded_mask = sharded[self.mine]                          # (chunk,) True for tensor-sharded params
        self.buf = make_buf()                                           # the full-size gradient buffer

    def grads_for_backward(self):
        """The gradient buffer the backward pass accumulates into (stage 2: allocated anew each step)."""
        if self.buf is None:
            self.buf = self.make_buf()
        self.buf.zero()
        return self.buf

    def reduce_scatter(self):
        """g_r <- (1/dp) * (sum over dp of the full gradient)[my chunk]; stage 2 then releases the full buffer."""
        dp = self.dp_comm.size
        self.dp_comm.Reduce_scatter_block(self.buf.flat.reshape(dp, self.chunk), self.g_chunk)
        self.g_chunk *= 1.0 / dp
        if self.stage == 2:
            self.buf = None

    def step(self, lr, clip_factor=1.0):
        """Update my chunk of the parameters, then All-Gather all chunks into every rank's parameters."""
        if clip_factor != 1.0:
            self.g_chunk *= clip_factor
        mine = self.pbuf.flat[self.mine]                                 # (chunk,) a view: updated in place
        self.opt.step({"chunk": mine}, {"chunk": self.g_chunk}, lr, decay={"chunk": self.decay_mask})
        self.p_send[...] = mine
        self.dp_comm.Allgather(self.p_send, self.pbuf.flat.reshape(self.dp_comm.size, self.chunk))

    def full_state(self):
        """Collective over dp_comm: the optimizer state of the whole flat buffer, {key: flat array}, assembled from
        every DP rank's chunk (for checkpoints). Keys: "velocity" (SGD) or "m", "v" (AdamW)."""
        state = self.opt.state.get("chunk")
        if state is None:
            return {}
        arrays = dict(zip(("m", "v"), state)) if isinstance(state, tuple) else {"velocity": state}
        out = {}
        for key, chunk in arrays.items():
            full = array_module(chunk).empty((self.dp_comm.size, self.chunk), dtype=chunk.dtype)
            self.dp_comm.Allgather(array_module(chunk).ascontiguousarray(chunk), full)
            out[key] = full.reshape(-1)
        return out

    def load_state(self, flat_state):
        """Keep my chunk of a full flat optimizer state {key: flat array} (the inverse of full_state)."""
        xp = array_module(self.pbuf.flat)
        chunks = {k: xp.array(xp.asarray(v)[self.mine]) for k, v in flat_state.items()}
        if "velocity" in chunks:
            self.opt.state["chunk"] = chunks["velocity"]
        elif chunks:
            self.opt.state["chunk"] = (chunks["m"], chunks["v"])

    def state_bytes(self):
        """Bytes of optimizer state on this rank."""
        return sum(a.nbytes for v in self.opt.state.values() for a in (v if isinstance(v, tuple) else (v,)))

    def grad_bytes(self):
        """Bytes of gradient storage this rank keeps between steps."""
        return self.g_chunk.nbytes + (self.buf.flat.nbytes if self.buf is not None else 0)

    def formula(self):
        """{(comm, op): (calls, bytes)} per step: one Reduce_scatter_block of the padded gradient buffer and one
        Allgather of the padded parameters (the two halves of an All-Reduce)."""
        n = self.pbuf.flat.nbytes
        return {("dp", "Reduce_scatter_block"): (1, n), ("dp", "Allgather"): (1, n)}

