"""One rank's part of training on the dp x pp x cp x tp grid: the lecture's algorithm, step by step.

P = dp x pp x cp x tp ranks (the lecture's P = G x M workers, with G = dp, M = tp, and pp = cp = 1). One
synchronous SGD step (`HybridTrainer.step`):
  1. the global batch (B sequences, the same on every rank) is split into dp equal slices; DP group r takes slice r,
     and every rank of the group reads the same slice (hsgd.dp.average.dp_rows); with context parallelism each of its cp
     ranks keeps only its T/cp positions of every sequence (the stage's context layout, hsgd.cp.split);
  2. the slice is cut into m micro-batches, which flow through this rank's pipeline stage (hsgd.pp.stage; pp = 1 is
     a pipeline of one stage): the tensor-parallel forward and backward (collectives on tp_comm inside,
     hsgd.tp.model) accumulate the gradient of (1/m) * each micro-batch's mean loss into the rank's shards;
  3. the ranks holding the same shard (dp x cp of them) average its gradient over dp_comm (hsgd.dp.exchange: one
     Allreduce, or overlapped, hierarchical, ZeRO's reduce-scatter, or one step late);
  4. the gradients are clipped by the global norm (optional) and the optimizer updates the shards this rank owns.
Result: the same update as serial mini-batch SGD on the global batch (tests/mpi/test_hybrid.py, test_comm_opt.py).

The optimizer sees the rank's parameters as one flat array (the exchange's `master`; ZeRO: only its chunks of it),
with per-element 0/1 masks: which elements get weight decay (those of 2-D parameters) and, for the gradient norm,
which belong to tensor-sharded parameters.
"""
import time
from dataclasses import dataclass

from hsgd.tp import shards as tp_shards
from hsgd.dp.average import dp_rows, micro_batches, params_digest
from hsgd.dp.make import make_exchange
from hsgd.step.health import all_finite, check_finite, global_norm, step_numbers, stop_after_skips
from hsgd.tp.hooks import ChainedHooks
from hsgd.step.loss_scale import LossScaler
from hsgd.model.optim import decays, lr_at, make_optimizer
from hsgd.pp.stage import make_stage
from hsgd.grid.trace import NullTracer


@dataclass
class StepInfo:
    loss: float          # mean loss over the global batch (averaged over dp groups)
    lr: float            # learning rate used
    grad_norm: float     # global gradient norm before clipping (nan when no update was applied)
    seconds: float       # wall time of the step
    tp_seconds: float    # of which in tp_comm collectives
    dp_seconds: float    # of which waiting for dp_comm collectives (an overlapped Iallreduce counts only while
                         # the rank waits for it)
    loss_scale: float = None   # float16 with loss scaling: the S this step's backward pass started from (with
                               # --dp-staleness 1 the update applies the step before's gradient, made with its S)
    scale_skips: int = 0       # ... and the updates skipped so far for an inf or NaN (the scaler halved S)


class HybridTrainer:
    def __init__(self, cfg, grid, tc, tracer=None):
        """cfg: ModelConfig; grid: ProcessGrid; tc: TrainConfig."""
        self.cfg, self.grid, self.tc, self.scheme = cfg, grid, tc, tc.tp_scheme
        self.tracer = tracer or NullTracer()
        self.stage = make_stage(cfg, grid, tc)                          # my layers, my schedule
        shards = tp_shards.init_params(cfg, grid.tp_comm, seed=tc.seed, dtype=tc.dtype, device=tc.device,
                                      scheme=tc.tp_scheme)
        shards = {n: shards[n] for n in self.stage.names}
        self.exchange = make_exchange(tc, shards, self.stage.groups(), grid, self.tracer)
        self.pbuf = self.exchange.pbuf                                  # my parameters, one flat buffer (ZeRO-3: None)
        self.params = self.exchange.params                              # {name: view} (ZeRO-3: filled per group)
        self.dtype = shards[self.stage.names[0]].dtype
        self.shard_shapes = {n: a.shape for n, a in shards.items()}     # this rank's tp shards' shapes
        # after gradients(): {name: view} of the step's gradient buffer: averaged over dp (all-reduce, overlapped,
        # hierarchical), this rank's own (ZeRO 1, stale: the average is elsewhere), None (ZeRO 2 released it)
        self.grads = None
        self.opt = make_optimizer(tc.optimizer, tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
        self.decay = self.exchange.mask(decays)                         # (owned,) 1 where weight decay applies
        self.sharded = self.exchange.mask(lambda n, shape: self.is_sharded(n))   # (owned,) 1: split over tp
        self.scaler = LossScaler() if tc.dtype == "float16" and tc.loss_scale == "dynamic" else None
        self.probe = None                                               # --memory: an hsgd.accounting.allocations probe
        self.skipped = self.in_a_row = 0                                # updates skipped for non-finite values
        self.scales = []                                                # S of each step's backward pass, the last 2
        self.t_start = self.tp_start = self.dp_start = self.dp_waited = 0.0   # set by gradients(), for update()

    @property
    def num(self):
        """The stage's numerics (hsgd.model.precision): where a bfloat16 or float16 run rounds."""
        return self.stage.num

    def is_sharded(self, name):
        return self.grid.tp > 1 and tp_shards.split_of(name, self.scheme)[0] != "rep"

    def step(self, idx, targets, step):
        """One optimizer step on the global batch idx, targets (B, T); `step` counts from 1 (for the schedule)."""
        return self.update(self.gradients(idx, targets), step)

    def gradients(self, idx, targets):
        """Steps 1-3: this rank's gradient of the global batch's mean loss, averaged over dp (ZeRO: of its chunk;
        stale: the exchange only started). Returns this DP group's loss on the device (0.0 before the last stage)."""
        stats, m = self.grid.stats, self.tc.micro_batches
        self.t_start, self.tp_start = time.perf_counter(), stats.seconds("tp")
        rows = dp_rows(len(idx), self.grid.dp, self.grid.dp_rank)                   # 1. my group's slice
        local = self.stage.ctx.local                                                #    my positions (cp)
        mbs = [(local(idx[mb]), local(targets[mb])) for mb in micro_batches(rows, m)]   # 2. its micro-batches
        buf = self.exchange.begin()                                                 # zeroed gradient buffer
        self.grads = buf.views
        self.stage.loss_scale = self.scaler.scale if self.scaler else 1.0          # float16: dloss = S / m
        self.scales = (self.scales + [self.stage.loss_scale])[-2:]                  # (the S of the last two steps)
        weights = self.exchange.model_weights(self.num)                            # bf16 / fp16: rounded copies
        loss = self.stage.run(weights, self.grads, mbs, self.rounded_ready(), self.tracer, self.hooks())
        if self.exchange.on_ready is None and self.num.reduce != "float32":
            self.num.reduced(buf.flat)                  # --reduce-dtype: my gradient as it travels (else per group)
        self.exchange.arrive()                                                      # (--straggler: sleeps)
        with self.tracer.span("dp sync"):
            self.dp_waited = self.exchange.finish()                                 # 3. average over dp_comm
        if self.exchange.grads() is not None:
            self.num.reduced(self.exchange.grads())     # --reduce-dtype: the average as it arrives
        self.grads = self.exchange.buf.views if self.exchange.buf is not None else None     # ZeRO 2: released
        self.dp_start = stats.seconds("dp")
        return loss

    def rounded_ready(self):
        """The exchange's on_ready, after rounding the group's gradients to --reduce-dtype (an exchange that starts
        each group's Allreduce during the backward pass sends them as they are then); on_ready itself otherwise."""
        on_ready = self.exchange.on_ready
        if on_ready is None or self.num.reduce == "float32":
            return on_ready
        groups = self.stage.groups()

        def ready(group):
            for name in groups[group]:
                self.num.reduced(self.grads[name])
            on_ready(group)
        return ready

    def update(self, loss, step):
        """Step 4, after the step's one device-to-host copy (loss, non-finite count, norm parts): stop or skip on a
        non-finite value (--on-nan), else clip by the global norm and update the owned shards with the
        scheduled learning rate. Returns the StepInfo."""
        grads, stats, tc = self.exchange.grads(), self.grid.stats, self.tc        # (owned,) or None (stale, step 1)
        numbers = step_numbers(loss, self.exchange.checked(), grads, self.sharded)
        lr, norm = lr_at(step, tc.lr, tc.warmup, tc.steps), float("nan")
        s = self.applied_scale()                                                # 1: not scaled
        finite = check_finite(self.grid.world, numbers.bad, step, "skip" if self.scaler else tc.on_nan)
        if self.scaler:                             # S x 0.5 after an inf or NaN, x 2 after 2000 good steps in a row,
            made_now = finite if not self.exchange.lag else check_finite(  # judged on the gradient made with the
                self.grid.world, not all_finite(self.exchange.fresh()), step, "skip")   # current S (stale: its own)
            self.scaler.update(not made_now)
        self.in_a_row = 0 if finite else self.in_a_row + 1
        if not finite:
            lr, self.skipped = float("nan"), self.skipped + 1                   # --on-nan skip: no update
            if not self.scaler:                     # (with loss scaling a skip is how S comes down: expected)
                stop_after_skips(self.in_a_row, tc.max_skips, step)             # (a run that diverged for good)
        elif grads is not None:
            norm = global_norm(numbers, self.grid, self.exchange.shard_comm) / s
            with self.tracer.span("optimizer"):
                if s != 1.0:
                    grads *= 1.0 / s                                            # unscaled, in float32
                if tc.clip and norm > tc.clip:
                    grads *= tc.clip / (norm + 1e-12)                               # a device multiply, no host copy
                mine = self.exchange.master                                     # a view: updated in place
                self.opt.step({"flat": mine}, {"flat": grads}, lr, decay={"flat": self.decay})
                self.exchange.after_update()                                    # ZeRO: Allgather the chunks
        return StepInfo(self.global_loss(numbers.loss), lr, norm, time.perf_counter() - self.t_start,
                        stats.seconds("tp") - self.tp_start, self.dp_waited + stats.seconds("dp") - self.dp_start,
                        self.stage.loss_scale if self.scaler else None, self.scaler.skipped if self.scaler else 0)

    def applied_scale(self):
        """The loss scale S the gradient this update applies was made with: this step's, or with --dp-staleness 1
        (the exchange's lag) the step before's, which the scaler may have halved or doubled since. (The scaler
        itself judges the gradient made with the current S, the step's own: an overflow is one back-off, not two.)"""
        lag = self.exchange.lag
        return self.scales[-1 - lag] if len(self.scales) > lag else self.scales[-1]

    def global_loss(self, group_loss):
        """The global batch's loss from this DP group's (held by the last stage; with context parallelism its cp
        ranks' losses of their positions, which are averaged too): metadata, pickled."""
        grid = self.grid
        return grid.dp_comm.comm.allreduce(grid.pp_comm.comm.bcast(group_loss, root=grid.pp - 1)) / grid.dp_comm.size

    def evaluate(self, corpus, n_batches, batch_size):
        """Mean loss over n_batches fixed validation batches; rows split over the dp groups like training."""
        rows, total, local = dp_rows(batch_size, self.grid.dp, self.grid.dp_rank), 0.0, self.stage.ctx.local
        for i in range(n_batches):
            idx, targets = corpus.batch(self.tc.seed, i, batch_size, split="val")
            total += self.stage.loss_only(self.exchange.model_weights(self.num), local(idx[rows]), local(targets[rows]),
                                          self.exchange.hooks)
        return self.grid.dp_comm.comm.allreduce(total) / (self.grid.dp_comm.size * n_batches)

    # ------------------------------------------------------------------------------------------ reports
    def averaged_grads(self):
        """After gradients(): {name: this rank's gradient shard averaged over dp_comm (dp x cp ranks), whole}.
        Collective over dp_comm when the exchange keeps only a chunk of the average (ZeRO: the chunks are
        All-Gathered)."""
        full = self.exchange.gather(self.exchange.grads())
        return {n: full[lo:hi].reshape(self.shard_shapes[n]) for n, (lo, hi) in self.exchange.offsets.items()}

    def shapes(self):
        """{name: shape} of this rank's parameter shards (its stage's, tp-split)."""
        return self.shard_shapes

    def hooks(self):
        """What runs around each group's forward and backward in a training step: the exchange's (ZeRO 2 and 3),
        then the memory probe's (--memory), or nothing (None)."""
        chain = [h for h in (self.exchange.hooks, self.probe and self.probe.hooks) if h]
        return None if not chain else chain[0] if len(chain) == 1 else ChainedHooks(chain)

    def memory(self):
        """Bytes this rank holds between steps: parameters, gradients, optimizer state."""
        state = sum(a.nbytes for v in self.opt.state.values() for a in (v if isinstance(v, tuple) else (v,)))
        return {"params": self.exchange.param_bytes(), "grads": self.exchange.grad_bytes(), "optimizer": int(state)}

    def dp_comm_formula(self):
        """{(comm, op): (calls, bytes)} of one step's data-parallel exchange."""
        return self.exchange.formula()

    def replica_divergence(self):
        """Collective: None if every DP replica holds the same parameters, else the first parameter (in the
        buffer's order) whose replicas differ, and the dp_comm ranks holding each version (dp_rank cp + cp_rank)."""
        order = self.exchange.order
        params = self.exchange.full_params()
        digests = self.grid.dp_comm.allgather_obj([params_digest({n: params[n]}) for n in order])
        for i, name in enumerate(order):
            groups = {}
            for r, d in enumerate(digests):
                groups.setdefault(d[i], []).append(r)
            if len(groups) > 1:
                return name, sorted(groups.values())
        return None

    def full_params(self):
        """The whole model (serial names and shapes) on every rank (pickled: for sampling and checks only)."""
        full = {}
        mine = self.exchange.full_params()                                      # (ZeRO-3: All-Gathered over dp)
        for part in self.grid.pp_comm.allgather_obj(tp_shards.gather_full(mine, self.cfg, self.grid.tp_comm,
                                                                         self.scheme)):
            full.update(part)                                                   # every stage's parameters
        return {n: full[n] for n in self.cfg.param_shapes()}

    def finish(self):
        """Complete what is still in flight (the stale exchange's last Iallreduce: not applied)."""
        self.exchange.close()

    def free(self):
        self.exchange.free()
