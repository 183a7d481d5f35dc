"""Staleness 1 (--dp-staleness 1): asynchronous SGD with every replica one step behind, each step's exchange
overlapping the whole next step (chapter 8, section 4): w_{s+1} = w_s - lr * avg g(w_{s-1})."""
from hsgd.dp.exchange import AllreduceExchange, AllreduceSizes, numel_of


class StaleSizes(AllreduceSizes):
    """One Iallreduce per step, hidden by the whole next step; the gradient buffer and two spares."""
    hidden_by = "next step"

    def formula(self):
        return {(self.dp_name, "Iallreduce"): (1, self.size * self.itemsize)}

    def grad_bytes(self):
        """The gradient buffer and its two spares: 3 (size,)."""
        return 3 * self.size * self.itemsize

    def memory_formula(self):
        """The gradient buffer and the two spares it is copied into for its Iallreduce: 3 (size,) of gradients
        (its new_buffer allocates them, as the gradient buffer)."""
        n = self.size * self.itemsize
        return {"params": n, "grads": 3 * n, "comm": 0}

    def describe(self):
        return "stale by one step: each step's Iallreduce completes during the next step, applied one step late"


class StaleExchange(AllreduceExchange):
    """Staleness 1 (asynchronous SGD): step s copies its gradient into a free exchange buffer and starts its
    Iallreduce; it applies the average started at step s-1, which had a whole step to arrive. Nothing is applied
    at step 1:  w_{s+1} = w_s - lr * avg g(w_{s-1})."""
    lag = 1                                                           # steps from a gradient's backward to its update

    def __init__(self, params, groups, dp_comm):
        super().__init__(params, groups, dp_comm, StaleSizes(*numel_of(params, groups), dp_comm.size, dp_comm.name))
        self.spare = [self.new_buffer(), self.new_buffer()]          # exchange buffers, used alternately
        self.inflight = None                                          # (buffer, request) of the last exchange
        self.ready = None                                             # the average to apply now

    def average(self):
        busy = self.inflight[0] if self.inflight else None
        free = self.spare[1] if busy is self.spare[0] else self.spare[0]
        free.flat[...] = self.num.reduced(self.buf.flat)              # (--reduce-dtype: as it leaves)
        previous, self.inflight = self.inflight, (free, self.dp_comm.Iallreduce(free.flat))
        self.ready = None
        if previous is not None:
            previous[1].Wait()
            previous[0].flat *= 1.0 / self.dp_comm.size
            self.ready = previous[0]

    def grads(self):
        return self.ready.flat if self.ready is not None else None

    def fresh(self):
        """This step's own gradient, as it left this rank (made with this step's loss scale; applied next step)."""
        return self.buf.flat

    def checked(self):
        return self.ready.flat if self.ready is not None else self.buf.flat

    def close(self):
        """The exchange in flight completes; its gradient is not applied."""
        if self.inflight is not None:
            self.inflight[1].Wait()
            self.inflight = None
