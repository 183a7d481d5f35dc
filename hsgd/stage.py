"""One rank's pipeline stage: its layers, its schedule of micro-batches, and the activations it sends and receives.

A step of one DP group runs m micro-batches through the pp stages (hsgd.pp): stage s holds the blocks
split_layers(L, pp)[s], the embedding on stage 0, the final LayerNorm, LM head and loss on stage pp-1, and runs its
schedule, a list of actions ("F", j) and ("B", j). Between stages, over pp_comm (the same dp and tp coordinates):

    forward of micro-batch j:   stage s  --activation-->        stage s+1   (Isend / Recv, tag 2j)
    backward of micro-batch j:  stage s  <--dL/d(activation)--  stage s+1   (Isend / Recv, tag 2j+1)

The activation is what the tensor-parallel scheme hands from block to block: (B/m, T, C), or for the sequence
scheme this rank's T-shard (B/m, T/tp, C) (tp_model.stage_activation_shape). Sends are non-blocking and completed
at the end of the step; receives block. With a distinct tag per message and a schedule whose dependencies have no
cycle, no stage waits forever.

pp = 1 is a pipeline of one stage: the whole model, nobody to send to, and the schedule F0 B0 F1 B1 ... (1F1B with
no warm-up): plain gradient accumulation. Each micro-batch's backward starts from dloss = 1/m, so the gradients
that accumulate (+=) are those of the mean of the micro-batches' mean losses: the gradient of the DP group's slice.
"""
import time

from . import tp_model
from .backend import get_xp, resolve_dtype, to_host
from .hooks import NO_HOOKS
from .pp import parse_split, schedule, split_layers, stage_names
from .threads import cpu_threads, parallel_batches
from .trace import NullTracer


class Stage:
    def __init__(self, cfg, grid, tc):
        """cfg: ModelConfig; grid: ProcessGrid; tc: TrainConfig (pp_split, schedule, micro_batches, tp_scheme)."""
        self.cfg, self.scheme, self.m = cfg, tc.tp_scheme, tc.micro_batches
        self.recompute = getattr(tc, "recompute", "none")             # what the blocks keep (tp_model.block_forward)
        self.xp, self.dtype = get_xp(tc.device), resolve_dtype(tc.dtype)   # (ZeRO-3: params may be empty here)
        self.tp_comm, self.pp_comm, self.s = grid.tp_comm, grid.pp_comm, grid.pp_rank
        self.layers = split_layers(cfg.n_layers, grid.pp, parse_split(tc.pp_split))[grid.pp_rank]
        self.first, self.last = grid.pp_rank == 0, grid.pp_rank == grid.pp - 1
        self.names = stage_names(cfg, self.layers, self.first, self.last)    # the parameters this stage holds
        # one stage has no bubble to fill: it runs F0 B0 F1 B1 ... (1F1B), which holds one micro-batch at a time
        self.actions = schedule(tc.schedule if grid.pp > 1 else "1f1b", self.m, grid.pp, grid.pp_rank)
        self.peak_held, self.timeline = 0, []                          # measured by the last run()

    def pieces(self, rows):
        """How a micro-batch of `rows` sequences is computed: in one piece (ThreadedStage: one per thread)."""
        return [rows]

    def groups(self):
        """{group: [names]}: this stage's parameters by gradient group, in the order the backward pass ends them."""
        out = {}
        for grp in tp_model.backward_order(self.cfg):
            names = [n for n in self.names if tp_model.param_group(n) == grp]
            if names:
                out[grp] = names
        return out

    def run(self, params, grads, mbs, on_ready=None, tracer=None, hooks=None):
        """One step of this stage: its actions on the micro-batches mbs = [(idx, targets)] (every stage has them;
        only the first uses idx, only the last targets). The gradients of (1/m) * each micro-batch's mean loss
        accumulate into `grads`; on_ready(group) is passed to the last backward action; hooks (hsgd.hooks.Hooks)
        run around every group's forward and backward. Returns (1/m) * the sum of the micro-batches' losses on
        the last stage (on the device), else 0.0. Records the micro-batches held at once (peak_held) and when
        each action ran (timeline)."""
        tracer, self.hooks = tracer or NullTracer(), hooks or NO_HOOKS
        self.caches, self.sends, self.loss, self.live = {}, [], 0.0, 0
        self.peak_held, self.timeline = 0, []
        last_b = max(j for a, j in self.actions if a == "B")
        for kind, j in self.actions:
            inp = self.receive(kind, j, params, mbs)                   # the wait here is the bubble
            t0 = time.perf_counter()
            with tracer.span("forward" if kind == "F" else "backward", micro_batch=j):
                if kind == "F":
                    self.forward(j, inp, params, mbs[j][1])
                else:
                    self.backward(j, inp, grads, on_ready if j == last_b else None)
            self.timeline.append((f"{kind}{j}", t0, time.perf_counter()))
        for req, _ in self.sends:
            req.Wait()
        self.sends, self.caches = [], {}                               # nothing held until the next step
        return self.loss / self.m if self.last else 0.0

    def receive(self, kind, j, params, mbs):
        """The input of action (kind, j): the token ids, or the activation from stage s-1 (F); dloss = 1/m on the
        last stage, or the gradient from stage s+1 (B)."""
        if kind == "F" and self.first:
            return self.xp.asarray(mbs[j][0])
        if kind == "B" and self.last:
            return 1.0 / self.m                                        # d(mean over the micro-batches)
        if kind == "F":
            return self.recv_activation(len(mbs[j][0]), params, source=self.s - 1, tag=2 * j)     # activation in
        return self.recv_activation(len(mbs[j][0]), params, source=self.s + 1, tag=2 * j + 1)     # gradient in

    def recv_activation(self, batch, params, source, tag):
        shape = tp_model.stage_activation_shape(self.scheme, batch, self.cfg, self.tp_comm.size)
        return self.pp_comm.Recv(self.xp.empty(shape, dtype=self.dtype), source=source, tag=tag)

    def forward(self, j, inp, params, targets):
        xp = self.xp
        out, self.caches[j] = tp_model.stage_forward(params, inp, xp.asarray(targets), self.cfg, self.tp_comm,
                                                     self.scheme, self.layers, self.first, self.last, self.hooks,
                                                     self.recompute)
        if self.last:
            self.loss = self.loss + out                                # stays on the device
        else:
            out = xp.ascontiguousarray(out)
            self.sends.append((self.pp_comm.Isend(out, dest=self.s + 1, tag=2 * j), out))      # activation out
        self.live += 1
        self.peak_held = max(self.peak_held, self.live)

    def backward(self, j, dout, grads, on_ready):
        dx = tp_model.stage_backward(dout, self.caches.pop(j), grads, self.tp_comm, self.scheme, on_ready=on_ready,
                                     hooks=self.hooks)
        if not self.first:
            dx = self.xp.ascontiguousarray(dx)
            self.sends.append((self.pp_comm.Isend(dx, dest=self.s - 1, tag=2 * j + 1), dx))   # gradient out
        self.live -= 1

    def loss_only(self, params, idx, targets, hooks=None):
        """The mean loss of one batch, forwards only through the stages (evaluation): a float on every stage."""
        xp = self.xp
        inp = xp.asarray(idx) if self.first else self.recv_activation(len(idx), params, source=self.s - 1, tag=0)
        out, _ = tp_model.stage_forward(params, inp, xp.asarray(targets), self.cfg, self.tp_comm, self.scheme,
                                        self.layers, self.first, self.last, hooks or NO_HOOKS)
        if not self.last:
            self.pp_comm.Isend(xp.ascontiguousarray(out), dest=self.s + 1, tag=0).Wait()       # activation out
            return self.pp_comm.comm.bcast(None, root=self.pp_comm.size - 1)
        return self.pp_comm.comm.bcast(float(to_host(xp.asarray(out))), root=self.pp_comm.size - 1)


class ThreadedStage(Stage):
    """A whole model on one rank (pp = 1, tp = 1) whose CPU threads split each micro-batch's sequences: data
    parallelism inside one process. Slice i of a micro-batch of b sequences (b_i of them) runs the forward and
    backward on its own thread with one BLAS thread (threads.parallel_batches), from dloss = (b_i / b) / m into a
    gradient buffer of its own (the last slice: into `grads` itself; the others allocate one per micro-batch,
    freed after it); the buffers are added at the end, in place of an All-Reduce. The same numbers as Stage.run up
    to rounding (the sums run in another order, which depends on the thread count), and no work is handed between
    threads inside a layer, which on small and mid-size models is the faster of the two ways to use the cores
    (tutorial 12).

    The tensor-parallel collectives of the slices run on a one-rank tp_comm: nothing moves, but each slice's calls
    are counted (pieces() says how many slices the last step used, for the byte formulas). An exchange that needs
    on_ready during the backward pass (--dp-overlap) or hooks around each group (ZeRO 2 and 3, --memory) gets the
    plain Stage.run: the slices finish their groups together, at the very end, so there would be nothing to
    overlap, and each slice would need the whole gradient."""
    threads_used = 1                                                   # slices per micro-batch in the last run

    def pieces(self, rows):
        """The slices' row counts for a micro-batch of `rows` sequences, as the last step split them."""
        n = max(1, min(self.threads_used, rows))
        return [rows * (i + 1) // n - rows * i // n for i in range(n)]

    def run(self, params, grads, mbs, on_ready=None, tracer=None, hooks=None):
        plain = self.xp.__name__ == "numpy" and on_ready is None and hooks is None
        self.threads_used = cpu_threads() if plain else 1
        if self.threads_used <= 1:
            return super().run(params, grads, mbs, on_ready, tracer, hooks)
        tracer = tracer or NullTracer()
        self.timeline, loss = [], 0.0
        for j, (idx, targets) in enumerate(mbs):
            t0 = time.perf_counter()
            with tracer.span("forward and backward", micro_batch=j):
                parts = parallel_batches(lambda lo, hi: self.part(params, grads, idx, targets, lo, hi), len(idx))
            for part_loss, part_grads in parts:
                loss = loss + part_loss
                if part_grads is not grads:
                    for name, a in part_grads.items():
                        grads[name] += a
            self.timeline.append((f"F{j}B{j}", t0, time.perf_counter()))
        self.peak_held = 1
        return loss / self.m

    def part(self, params, grads, idx, targets, lo, hi):
        """Sequences lo..hi-1 of a micro-batch: (their share of its loss, the gradient buffer they added into)."""
        xp, share = self.xp, (hi - lo) / len(idx)
        into = grads if hi == len(idx) else {n: xp.zeros_like(p) for n, p in grads.items()}
        out, cache = tp_model.stage_forward(params, xp.asarray(idx[lo:hi]), xp.asarray(targets[lo:hi]), self.cfg,
                                            self.tp_comm, self.scheme, self.layers, True, True,
                                            recompute=self.recompute)
        tp_model.stage_backward(share / self.m, cache, into, self.tp_comm, self.scheme)
        return out * share, into


def make_stage(cfg, grid, tc):
    """This rank's stage: a ThreadedStage when it holds the whole model alone (pp = 1, tp = 1), else a Stage."""
    return ThreadedStage(cfg, grid, tc) if grid.pp == 1 and grid.tp == 1 else Stage(cfg, grid, tc)
