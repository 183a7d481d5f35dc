"""One rank's part of training on the dp x pp x tp grid: the lecture's algorithm, step by step.

P = dp x pp x tp ranks (pp = 1: the lecture's P = G x M). Each synchronous SGD step:
  1. the global batch of the step (B sequences, the same on every rank) is split into dp equal slices; DP group g
     takes slice g, and every TP rank of the group reads the same slice (hsgd.dp.dp_rows);
  2. the slice is cut into k = grad_accum micro-batches; for each, the tensor-parallel forward and backward
     (collectives on tp_comm inside, hsgd.tp_model) accumulate the gradient of (1/k) * its mean loss into the
     rank's gradient shards; with pp > 1 the micro-batches flow through the pipeline stages (hsgd.pp.run_stage);
  3. the gradient shards are averaged over dp_comm, in one of these ways (--dp-overlap, --hierarchical, --zero):
       blocking      one Allreduce of the whole flat gradient buffer after the backward pass (hsgd.dp.dp_average)
       overlapped    one Iallreduce per layer's bucket, started while the backward pass goes on (OverlappedAverage)
       hierarchical  reduce-scatter inside the node, all-reduce across nodes, all-gather inside (hsgd.hier)
       ZeRO 1 / 2    reduce-scatter: each DP rank gets the average of its 1/dp of the parameters (hsgd.zero)
  4. optionally the gradients are clipped by the global norm (hsgd.optim.global_grad_norm); the optimizer updates
     the local shards (ZeRO: the owned chunk, then an All-Gather of the parameters).
Result: the same update as serial mini-batch SGD on the global batch (tests/mpi/test_hybrid.py, test_comm_opt.py).

--dp-staleness 1 is the asynchronous exception: the average of step s's gradients travels (Iallreduce) while step
s+1 computes, and is applied one step late: w_{s+1} = w_s - lr * avg g(w_{s-1}). --straggler RANK:MS makes one
rank slower, to show what synchronous SGD pays for it.

Parameters and gradients live in flat buffers laid out in the order the backward pass finishes them, so each
layer's gradients are one contiguous bucket.
"""
import time
from dataclasses import dataclass

from . import tp_model
from .backend import array_module, to_host
from .dp import (GradBuffer, OverlappedAverage, backward_layout, dp_average, dp_formula, dp_rows, micro_batches,
                 params_digest)
from .errors import NumericalFault
from .hier import HierarchicalAverager
from .optim import clip_grads, decays, grad_square_sums, lr_at, make_optimizer, norm_from_squares
from .pp import parse_split, run_stage, schedule, split_layers, stage_names
from .zero import ZeroOptimizer


@dataclass
class StepInfo:
    loss: float          # mean loss over the global batch (averaged over dp groups)
    lr: float            # learning rate used
    grad_norm: float     # global gradient norm before clipping (nan when no update was applied)
    seconds: float       # wall time of the step
    tp_seconds: float    # of which in tp_comm collectives
    dp_seconds: float    # of which waiting for dp_comm collectives (the exposed part: an overlapped Iallreduce
                         # counts only while the rank waits for it)


class _Null:
    """A stand-in tracer that records nothing."""

    def span(self, *args, **kwargs):
        from contextlib import nullcontext
        return nullcontext()


class HybridTrainer:
    def __init__(self, cfg, grid, tc, tracer=None):
        """cfg: ModelConfig; grid: ProcessGrid; tc: TrainConfig (optimizer, schedule, scheme, dp modes, pipeline)."""
        self.cfg, self.grid, self.tc = cfg, grid, tc
        self.scheme = tc.tp_scheme
        self.tracer = tracer or _Null()
        zero, staleness = tc.zero, tc.dp_staleness
        shards = tp_model.init_params(cfg, grid.tp_comm, seed=tc.seed, dtype=tc.dtype, device=tc.device,
                                      scheme=tc.tp_scheme)
        # pipeline stage: my blocks, and the embedding (first stage) or the head (last stage)
        self.layers = split_layers(cfg.n_layers, grid.pp, parse_split(tc.pp_split))[grid.pp_rank]
        self.first, self.last = grid.pp_rank == 0, grid.pp_rank == grid.pp - 1
        shards = {n: shards[n] for n in stage_names(cfg, self.layers, self.first, self.last)}
        self.groups = [grp for grp in tp_model.backward_order(cfg)
                       if any(tp_model.param_group(n) == grp for n in shards)]
        self.order = backward_layout(shards, tp_model.param_group, self.groups)
        self.actions = schedule(tc.schedule, tc.grad_accum, grid.pp, grid.pp_rank)
        self.peak_held, self.timeline = 0, []                          # measured by the last pipelined step
        pad = grid.dp if zero else 1
        self.pbuf = GradBuffer(shards, self.order, pad)                 # the parameters, same flat layout
        for name, p in shards.items():
            self.pbuf.grads[name][...] = p
        self.params = self.pbuf.grads                                   # {name: view into pbuf.flat}
        self.opt = make_optimizer(tc.optimizer, tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
        new_buf = lambda: GradBuffer(self.params, self.order, pad)
        self.zero = ZeroOptimizer(self.params, self.pbuf, new_buf, grid.dp_comm, self.opt, zero, decays,
                                  self.is_sharded) if zero else None
        self.buf = None if self.zero else new_buf()                     # ZeRO owns its gradient buffer
        self.grads = self.zero.buf.grads if self.zero else self.buf.grads
        self.buckets = {grp: self.pbuf.span([n for n in self.order if tp_model.param_group(n) == grp])
                        for grp in self.groups}                                   # the same layout as pbuf
        self.hier = HierarchicalAverager(grid.dp_comm, tc.ranks_per_node) if tc.hierarchical else None
        self.stale = [new_buf(), new_buf()] if staleness else None     # exchange buffers, used alternately
        self.inflight = None                                            # (buffer, request) of the last exchange
        self.ready = None                                               # the averaged gradient to apply (stale)
        self.exposed_dp = 0.0                                           # seconds of the last dp sync phase
        self.skipped = 0                                                # updates skipped for non-finite values
        straggler = tc.straggler
        self.delay = 0.0
        if straggler:
            rank, ms = (int(x) for x in straggler.split(":"))
            self.delay = ms / 1000.0 if grid.rank == rank else 0.0

    def is_sharded(self, name):
        return self.grid.tp > 1 and tp_model.split_of(name, self.scheme)[0] != "rep"

    # ------------------------------------------------------------------------------------------ steps 1 to 3
    def compute_grads(self, idx, targets, host=True):
        """Steps 1-3: this rank's gradient shards of the global batch's mean loss, averaged over dp (ZeRO: the
        owned chunk in zero.g_chunk, and with stage 2 self.grads is None afterwards: the full buffer is released;
        staleness: the exchange is only started). Returns this DP group's loss: a float (host=True; with pp > 1
        broadcast from the last stage), or a device scalar that stays on the device (host=False; 0.0 on the
        stages before the last)."""
        g, k, tr = self.grid, self.tc.grad_accum, self.tracer
        xp = array_module(self.pbuf.flat)
        idx, targets = xp.asarray(idx), xp.asarray(targets)
        buf = self.zero.grads_for_backward() if self.zero else self.buf
        if not self.zero:
            buf.zero()
        self.grads = buf.grads
        overlap = OverlappedAverage(buf, g.dp_comm, self.buckets) if self.tc.dp_overlap else None
        loss = 0.0
        mbs = micro_batches(dp_rows(len(idx), g.dp, g.dp_rank), k)
        if g.pp > 1:                                                     # the pipeline runs this stage's schedule
            loss, self.peak_held, self.timeline = run_stage(
                self.actions, self.params, self.grads, [idx[mb] for mb in mbs], [targets[mb] for mb in mbs],
                self.cfg, g, self.scheme, self.layers, self.first, self.last, tr, overlap.on_ready if overlap else None)
            loss = loss / k
            mbs = []
        for j, mb in enumerate(mbs):
            with tr.span("forward", micro_batch=j):
                mb_loss, caches = tp_model.forward(self.params, idx[mb], targets[mb], self.cfg, g.tp_comm, self.scheme)
            ready = overlap.on_ready if (overlap and j == k - 1) else None
            with tr.span("backward", micro_batch=j):
                tp_model.backward(caches, self.grads, g.tp_comm, self.scheme, dloss=1.0 / k, on_ready=ready)
            loss = loss + mb_loss / k                                    # stays on the device
        if self.delay:
            with tr.span("straggler delay"):
                time.sleep(self.delay)
        t_sync = time.perf_counter()
        with tr.span("dp sync"):
            if self.zero:
                self.zero.reduce_scatter()                               # Reduce_scatter_block over dp_comm
                if self.zero.stage == 2:
                    self.grads = None                                    # only the owned chunk is kept
            elif overlap:
                overlap.finish()                                         # Wait for every bucket's Iallreduce
            elif self.hier:
                self.hier.average(buf)                                   # node / cross-node / node
            elif self.stale:
                self._start_exchange(buf)                                # Iallreduce, applied next step
            else:
                dp_average(buf, g.dp_comm)                               # one Allreduce over dp_comm
        self.exposed_dp = time.perf_counter() - t_sync
        if not host:
            return loss
        loss = float(to_host(array_module(self.pbuf.flat).asarray(loss)))
        return g.pp_comm.comm.bcast(loss, root=g.pp - 1) if g.pp > 1 else loss

    def _start_exchange(self, buf):
        """Staleness 1: copy this step's gradients into a free exchange buffer and start its Iallreduce; the
        previous exchange (if any) is completed and becomes the gradient to apply now."""
        free = self.stale[0] if self.inflight is None or self.inflight[0] is self.stale[1] else self.stale[1]
        free.flat[...] = buf.flat
        previous, self.inflight = self.inflight, (free, self.grid.dp_comm.Iallreduce(free.flat))
        self.ready = None
        if previous is not None:
            previous[1].Wait()
            previous[0].flat *= 1.0 / self.grid.dp
            self.ready = previous[0]

    def finish(self):
        """Complete a pending exchange (staleness) so that no request is left open; its gradient is not applied."""
        if self.inflight is not None:
            self.inflight[1].Wait()
            self.inflight = None

    # ------------------------------------------------------------------------------------------ step 4
    def update(self, step, norm=None):
        """Step 4: clip by the global norm, then the optimizer step with the scheduled learning rate.
        norm: the global gradient norm if already known (step() computes it with its one host copy)."""
        tc, tr = self.tc, self.tracer
        lr = lr_at(step, tc.lr, tc.warmup, tc.steps)
        if norm is None:
            norm = self.global_norm(to_host(self.grad_squares()))
        with tr.span("optimizer"):
            if self.zero:
                factor = tc.clip / (norm + 1e-12) if tc.clip and norm > tc.clip else 1.0
                self.zero.step(lr, factor)                               # my chunk, then Allgather over dp_comm
                return lr, norm
            grads = self.grads
            if self.stale is not None:
                if self.ready is None:                                   # step 1: nothing has arrived yet
                    return lr, float("nan")
                grads = self.ready.grads
            clip_grads(grads, norm, tc.clip)                             # a device multiply, no host copy
            self.opt.step(self.params, grads, lr)
        return lr, norm

    def grad_squares(self):
        """On the device: [sum of squares over tensor-sharded elements, over replicated ones] of the gradient about
        to be applied (ZeRO: of this rank's chunk)."""
        xp = array_module(self.pbuf.flat)
        if self.zero:
            sq = self.zero.g_chunk ** 2                                  # masks by multiplication: no sync
            sharded = (sq * self.zero.sharded_mask).sum()
            return xp.stack([sharded, sq.sum() - sharded])
        if self.stale is not None and self.ready is None:
            return xp.zeros(2, dtype=self.pbuf.flat.dtype)
        return grad_square_sums(self.ready.grads if self.stale is not None else self.grads, self.is_sharded)

    def global_norm(self, sq):
        """The full model's gradient norm from this rank's host [sharded, replicated] sums of squares (ZeRO: of
        its chunk, so the sums are first added over dp)."""
        g = self.grid
        return norm_from_squares(float(sq[0]), float(sq[1]), g.tp_comm if g.tp > 1 else None,
                                 g.pp_comm if g.pp > 1 else None, g.dp_comm if self.zero else None)

    def step(self, idx, targets, step, poison=False):
        """One optimizer step on the global batch idx, targets (B, T). `step` counts from 1 (for the schedule).
        poison=True puts a NaN into this rank's gradient (fault injection for --on-nan)."""
        g, stats = self.grid, self.grid.stats
        xp = array_module(self.pbuf.flat)
        t0, tp0 = time.perf_counter(), stats.seconds("tp")
        loss = self.compute_grads(idx, targets, host=False)             # on the device
        if poison:
            self.local_grads()[0] = float("nan")
        dp0 = stats.seconds("dp")
        # the step's one device-to-host copy: loss, count of non-finite gradient values, norm parts
        nonfinite = (~xp.isfinite(self.local_grads())).sum() + (~xp.isfinite(xp.asarray(loss))).sum()
        host = to_host(xp.stack([xp.asarray(loss, dtype=self.pbuf.flat.dtype),
                                 nonfinite.astype(self.pbuf.flat.dtype), *self.grad_squares()]))
        loss = g.pp_comm.comm.bcast(float(host[0]), root=g.pp - 1) if g.pp > 1 else float(host[0])
        bad = g.world.comm.allgather(bool(host[1] > 0))                 # every rank learns where it went wrong
        if any(bad):
            ranks = [r for r, b in enumerate(bad) if b]
            if self.tc.on_nan == "stop":
                raise NumericalFault(f"non-finite loss or gradient at step {step} on ranks {ranks} (--on-nan stop); "
                                     "resume from a checkpoint with a smaller --lr, or use --on-nan skip")
            lr, norm, self.skipped = float("nan"), float("nan"), self.skipped + 1   # --on-nan skip: no update
        else:
            lr, norm = self.update(step, self.global_norm(host[2:]))
        exposed = self.exposed_dp + stats.seconds("dp") - dp0            # + ZeRO's Allgather of the parameters
        loss = g.dp_comm.comm.allreduce(loss) / g.dp                     # metadata: the global batch's loss
        return StepInfo(loss, lr, norm, time.perf_counter() - t0, stats.seconds("tp") - tp0, exposed)

    # ------------------------------------------------------------------------------------------ reports
    def local_grads(self):
        """The flat gradient this rank is about to apply (ZeRO: its chunk; staleness: the arrived average)."""
        if self.zero:
            return self.zero.g_chunk
        if self.stale is not None:
            return self.ready.flat if self.ready is not None else self.buf.flat
        return self.buf.flat

    def replica_divergence(self):
        """Collective: None if every DP replica holds the same parameters, else the first parameter (in the
        canonical order) whose replicas differ, and the dp ranks holding each version."""
        digests = self.grid.dp_comm.allgather_obj([params_digest({n: self.params[n]}) for n in self.order])
        for i, name in enumerate(self.order):
            versions = [d[i] for d in digests]
            if len(set(versions)) > 1:
                groups = {}
                for r, v in enumerate(versions):
                    groups.setdefault(v, []).append(r)
                return name, sorted(groups.values())
        return None

    def dp_comm_formula(self):
        """{(comm, op): (calls, bytes)} of one step's data-parallel communication for the chosen mode."""
        if self.zero:
            return self.zero.formula()
        nbytes = int(self.buf.flat.nbytes)
        if self.tc.dp_overlap:
            return {("dp", "Iallreduce"): (len(self.buckets), nbytes)}
        if self.hier:
            return self.hier.formula(nbytes, self.pbuf.flat.itemsize)
        if self.stale:
            return {("dp", "Iallreduce"): (1, nbytes)}
        return dp_formula(self.params)

    def memory(self):
        """Bytes this rank holds between steps: parameters, gradients, optimizer state."""
        if self.zero:
            return {"params": int(self.pbuf.flat.nbytes), "grads": int(self.zero.grad_bytes()),
                    "optimizer": int(self.zero.state_bytes())}
        state = sum(a.nbytes for v in self.opt.state.values() for a in (v if isinstance(v, tuple) else (v,)))
        extra = sum(b.flat.nbytes for b in self.stale) if self.stale else 0
        return {"params": int(self.pbuf.flat.nbytes), "grads": int(self.buf.flat.nbytes + extra),
                "optimizer": int(state)}

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_by_name(self):
        """Collective over dp_comm when ZeRO is on. ({name: {key: shard}}, t): this rank's optimizer state per
        parameter shard (keys "velocity" for SGD, "m", "v" for AdamW) and AdamW's step count."""
        if self.zero:
            flat = self.zero.full_state()
            per = {n: {k: v[lo:hi].reshape(self.params[n].shape) for k, v in flat.items()}
                   for n, (lo, hi) in self.pbuf.offsets.items()}
        else:
            per = {}
            for n, st in self.opt.state.items():
                per[n] = dict(zip(("m", "v"), st)) if isinstance(st, tuple) else {"velocity": st}
        return {n: v for n, v in per.items() if v}, getattr(self.opt, "t", 0)

    def load_state(self, params, state, t):
        """Set this rank's parameter shards and optimizer state (the layout of state_by_name)."""
        xp = array_module(self.pbuf.flat)
        for n, p in params.items():
            self.params[n][...] = xp.asarray(p)                          # (host arrays onto the device)
        if hasattr(self.opt, "t"):
            self.opt.t = t
        if self.zero:
            keys = {k for st in state.values() for k in st}
            flat = {k: xp.zeros(self.pbuf.flat.size, dtype=self.pbuf.flat.dtype) for k in keys}
            for n, st in state.items():
                lo, hi = self.pbuf.offsets[n]
                for k, v in st.items():
                    flat[k][lo:hi] = v.reshape(-1)
            self.zero.load_state(flat)
            return
        self.opt.state.clear()
        for n, st in state.items():
            arrays = {k: xp.array(v) for k, v in st.items()}
            self.opt.state[n] = (arrays["m"], arrays["v"]) if "m" in arrays else arrays["velocity"]

    def evaluate(self, corpus, n_batches, batch_size):
        """Mean loss over n_batches fixed validation batches; rows split over the dp groups like training."""
        g = self.grid
        xp = array_module(self.pbuf.flat)
        total = 0.0
        for i in range(n_batches):
            idx, targets = corpus.batch(self.tc.seed, i, batch_size, split="val")
            rows = dp_rows(batch_size, g.dp, g.dp_rank)
            idx, targets = xp.asarray(idx[rows]), xp.asarray(targets[rows])          # onto the device
            if g.pp > 1:                                                 # forwards only, through the stages
                loss, _, _ = run_stage([("F", 0)], self.params, None, [idx], [targets], self.cfg, g,
                                       self.scheme, self.layers, self.first, self.last, _Null(), backward=False)
                loss = g.pp_comm.comm.bcast(float(to_host(xp.asarray(loss))), root=g.pp - 1)
            else:
                loss, _ = tp_model.forward(self.params, idx, targets, self.cfg, g.tp_comm, self.scheme)
                loss = float(to_host(xp.asarray(loss)))
            total += loss
        return g.dp_comm.comm.allreduce(total) / (g.dp * n_batches)

    def full_params(self):
        """The whole model (serial names and shapes) on every rank (pickled: for sampling and checks only)."""
        mine = tp_model.gather_full(self.params, self.cfg, self.grid.tp_comm, self.scheme)
        if self.grid.pp == 1:
            return mine
        full = {}
        for part in self.grid.pp_comm.allgather_obj(mine):             # every stage's parameters
            full.update(part)
        return {n: full[n] for n in self.cfg.param_shapes()}

    def free(self):
        self.finish()
        if self.hier:
            self.hier.free()
