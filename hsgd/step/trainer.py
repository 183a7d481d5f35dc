"""One rank's part of training on the dp x pp x cp x tp grid: the lecture's algorithm, step by step.

P = dp x pp x cp x tp ranks (the lecture's P = G x M workers, with G = dp, M = tp, and pp = cp = 1). One
synchronous SGD step (`HybridTrainer.step`):
  1. the global batch (B sequences, the same on every rank) is split into dp equal slices; DP group r takes slice r,
     and every rank of the group reads the same slice (hsgd.dp.average.dp_rows); with context parallelism each of
     its cp ranks keeps only its T/cp positions of every sequence (the stage's context layout, hsgd.cp);
  2. the slice is cut into m micro-batches, which flow through this rank's pipeline stage (hsgd.pp.stage; pp = 1 is
     a pipeline of one stage): the tensor-parallel forward and backward (collectives on tp_comm inside,
     hsgd.tp.model) accumulate the gradient of (S/m) * each micro-batch's mean loss into the rank's shards;
  3. the ranks holding the same shard (dp x cp of them) average its gradient over dp_comm (hsgd.dp: one
     Allreduce, or overlapped, hierarchical, ZeRO's reduce-scatter, or one step late);
  4. the gradients are unscaled (1/S), clipped by the global norm (optional), and the optimizer updates the shards
     this rank owns.
Result: the same update as serial mini-batch SGD on the global batch (tests/mpi/test_hybrid.py, test_comm_opt.py).

S is the loss scale (hsgd.step.loss_scale: 1 unless float16 with dynamic loss scaling, which also decides when a
non-finite step is skipped). The optimizer sees the rank's parameters as one flat array (the exchange's `master`;
ZeRO: only its chunks of it), with per-element 0/1 masks: which elements get weight decay (those of 2-D parameters)
and, for the gradient norm, which belong to tensor-sharded parameters. Where a bfloat16 or float16 run rounds is
the stage's and the exchange's business (use_numerics), not the step's.
"""
import time
from dataclasses import dataclass

from hsgd.dp.average import dp_rows, global_loss, micro_batches
from hsgd.dp.fp8_gather import gather_wire
from hsgd.dp.make import make_exchange
from hsgd.ep.layout import check_moe_layout
from hsgd.fp8.domains import check_fp8_layout
from hsgd.model.optim import decays, lr_at, make_optimizer
from hsgd.pp.make import make_stage
from hsgd.grid.trace import NullTracer
from hsgd.step.health import global_norm, step_numbers
from hsgd.step.loss_scale import make_scaler
from hsgd.step.settings import Data, Exchange, Layout
from hsgd.tp import shards as tp_shards
from hsgd.tp.hooks import ChainedHooks


@dataclass
class StepInfo:
    loss: float          # mean loss over the global batch (averaged over dp groups)
    lr: float            # learning rate used (nan when the update was skipped)
    grad_norm: float     # global gradient norm before clipping (nan when no update was applied)
    seconds: float       # wall time of the step
    tp_seconds: float    # of which in tp_comm collectives
    dp_seconds: float    # of which waiting for dp_comm collectives (an overlapped Iallreduce counts only while
                         # the rank waits for it)
    loss_scale: float = None   # float16 with loss scaling: the S this step's backward pass started from (with
                               # --dp-staleness 1 the update applies the step before's gradient, made with its S)
    scale_skips: int = 0       # ... and the updates skipped so far for an inf or NaN (the scaler halved S)
    fp8: dict = None           # --fp8: {"values", "overflow", "underflow"} the step's casts, summed over the ranks


class HybridTrainer:
    def __init__(self, cfg, grid, tc, tracer=None):
        """cfg: ModelConfig; grid: ProcessGrid; tc: TrainConfig, whose groups make the parts (stage, exchange,
        optimizer, loss scale)."""
        self.cfg, self.grid, self.tc, self.scheme = cfg, grid, tc, tc.tp_scheme
        self.tracer = tracer or NullTracer()
        check_moe_layout(cfg, tc, grid.dp)                              # what the layout can compute of its experts
        check_fp8_layout(cfg, tc)                                       # ... and of its FP8 tiles
        self.stage = make_stage(cfg, grid, tc.group(Layout), tc.recompute, tc.group(Data))   # my layers, schedule
        shards = tp_shards.init_params(cfg, grid.tp_comm, tc.seed, tc.dtype, tc.device, tc.tp_scheme)
        self.shard_shapes = {n: shards[n].shape for n in self.stage.names}   # this rank's tp shards' shapes
        self.exchange = make_exchange(tc.group(Exchange), {n: shards[n] for n in self.stage.names},
                                      self.stage.groups(), grid, tc.micro_batches, self.stage.num,
                                      gather_wire(tc, self.stage))    # (--fp8-allgather: ZeRO-3 sends FP8)
        if tc.straggler and int(tc.straggler.split(":")[0]) == grid.rank:   # --straggler RANK:MS, an experiment
            self.exchange.slow_down(int(tc.straggler.split(":")[1]) / 1000.0, self.tracer)
        self.pbuf, self.params = self.exchange.pbuf, self.exchange.params  # my parameters (ZeRO-3: filled per group)
        self.dtype = shards[self.stage.names[0]].dtype
        # after gradients(): {name: view} of the step's gradient buffer: averaged over dp (all-reduce, overlapped,
        # hierarchical), this rank's own (ZeRO 1, stale: the average is elsewhere), None (ZeRO 2 released it)
        self.grads = None
        self.opt = make_optimizer(tc.optimizer, tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
        self.decay = self.exchange.mask(decays)                         # (owned,) 1 where weight decay applies
        self.sharded = self.exchange.mask(lambda n, shape: self.norm_weight(n))  # (owned,) 1: split over tp
        self.scaler = make_scaler(tc.dtype, tc.loss_scale, tc.on_nan, tc.max_skips)   # S, and the skips
        self.probe = None                                               # --memory: an allocations.MemoryProbe
        self.t_start = self.tp_start = self.dp_start = self.dp_waited = 0.0   # set by gradients(), for update()

    @property
    def num(self):
        """The numerics (hsgd.model.precision) the stage and the exchange compute with."""
        return self.stage.num

    def use_numerics(self, num):
        """Round where `num` says, in the stage (the model's points, the tp collectives) and the exchange (the
        weights, --reduce-dtype): the tolerance oracle's error model uses this."""
        self.stage.use(num)
        self.exchange.use(num)

    def is_sharded(self, name):
        """Whether a parameter is split over tp (each rank holds a part, or one kv head of several)."""
        return self.grid.tp > 1 and tp_shards.split_of(name, self.scheme)[0] != "rep"

    def norm_weight(self, name):
        """A parameter's squares' weight in this rank's share of the global norm: 1 for a parameter split over
        tp, 0 for a replicated one (counted once, apart), NKV/tp for a key/value head that tp/NKV ranks hold alike
        (hsgd.step.health.masked_square_sums, hsgd.model.optim.grad_square_sums). With ep > 1 every element is
        weighted by 1/(the ranks of tp x the exchange's shard_comm that hold it alike: exchange.holders): the sums
        over tp and shard_comm (hsgd.dp.folded) count each parameter once."""
        w = tp_shards.holders_weight(name, self.cfg, self.grid.tp) if self.is_sharded(name) else 0
        if self.grid.ep == 1 or not hasattr(self.exchange, "holders"):   # (a stage without experts)
            return w
        return (w or 1.0 / self.grid.tp) / self.exchange.holders(name)   # (replicated over tp: 1/tp each)

    def step(self, idx, targets, step):
        """One optimizer step on the global batch idx, targets (B, T); `step` counts from 1 (for the schedule)."""
        return self.update(self.gradients(idx, targets), step)

    def gradients(self, idx, targets):
        """Steps 1-3: this rank's gradient of S x the global batch's mean loss, averaged over dp (ZeRO: of its
        chunk; stale: the exchange only started). Returns this DP group's loss on the device: the last stage's, plus
        each stage's auxiliary losses of its MoE blocks (0.0 on a stage before the last without them)."""
        stats = self.grid.stats
        self.t_start, self.tp_start = time.perf_counter(), stats.seconds("tp")
        rows = dp_rows(len(idx), self.grid.dp, self.grid.dp_rank)                   # 1. my group's slice
        local = self.stage.ctx.local                                                #    my positions (cp)
        mbs = [(local(idx[mb]), local(targets[mb])) for mb in micro_batches(rows, self.tc.micro_batches)]
        buf = self.exchange.begin()                                                 # zeroed gradient buffer
        self.grads = buf.views
        self.stage.loss_scale = self.scaler.begin_step()                           # float16: dloss = S / m
        loss = self.stage.run(self.exchange.model_weights(), self.grads, mbs,      # 2. its micro-batches
                              self.exchange.on_ready, self.tracer, self.hooks())
        self.exchange.arrive()                                                      # (--straggler: sleeps)
        with self.tracer.span("dp sync"):
            self.dp_waited = self.exchange.finish()                                 # 3. average over dp_comm
        self.grads = self.exchange.buf.views if self.exchange.buf is not None else None     # ZeRO 2: released
        self.dp_start = stats.seconds("dp")
        return loss

    def update(self, loss, step):
        """Step 4, after the step's one device-to-host copy (loss, non-finite count, norm parts): the ranks agree
        whether the update is applied (the scaler: --on-nan, or the loss scale's skip), then the gradient is
        unscaled, clipped by the global norm and applied to the owned shards with the scheduled learning rate.
        Returns the StepInfo."""
        grads, stats, tc, ex = self.exchange.grads(), self.grid.stats, self.tc, self.exchange   # (owned,) or None
        numbers = step_numbers(loss, ex.checked(), grads, self.sharded)
        lr, norm, s = lr_at(step, tc.lr, tc.warmup, tc.steps), float("nan"), self.scaler.made_with(ex.lag)
        if not self.scaler.after_step(self.grid.world, step, numbers.bad, ex.fresh if ex.lag else None):
            lr = float("nan")                                                   # skipped: no update
        elif grads is not None:
            norm = global_norm(numbers, self.grid, ex.shard_comm, self.stage.copies) / s   # (DualPipe: 2)
            with self.tracer.span("optimizer"):
                if s != 1.0:
                    grads *= 1.0 / s                                            # unscaled, in float32
                if tc.clip and norm > tc.clip:
                    grads *= tc.clip / (norm + 1e-12)                           # a device multiply, no host copy
                self.opt.step({"flat": ex.master}, {"flat": grads}, lr, decay={"flat": self.decay})   # in place
                ex.after_update()                                               # ZeRO: Allgather the chunks
        if self.cfg.moe_bias_rate:
            self.stage.update_biases(self.grid.dp_comm)                         # after the step, by its load
        casts = None
        if self.stage.fp8 is not None:
            self.stage.fp8.end_step(self.grid.tp_comm, self.grid.dp_comm)       # the amax histories move on
            casts = self.stage.fp8.summary([self.grid.world.comm])              # (uncounted: a log's numbers)
        dynamic = self.scaler.dynamic
        return StepInfo(global_loss(numbers.loss, self.grid), lr, norm, time.perf_counter() - self.t_start,
                        stats.seconds("tp") - self.tp_start, self.dp_waited + stats.seconds("dp") - self.dp_start,
                        self.stage.loss_scale if dynamic else None, self.scaler.skipped if dynamic else 0, casts)

    def evaluate(self, corpus, n_batches, batch_size):
        """Mean loss over n_batches fixed validation batches; rows split over the dp groups like training."""
        rows, total, local = dp_rows(batch_size, self.grid.dp, self.grid.dp_rank), 0.0, self.stage.ctx.local
        for i in range(n_batches):
            idx, targets = corpus.batch(self.tc.seed, i, batch_size, split="val")
            total += self.stage.loss_only(self.exchange.model_weights(), local(idx[rows]), local(targets[rows]),
                                          self.exchange.hooks)
        return self.grid.dp_comm.comm.allreduce(total) / (self.grid.dp_comm.size * n_batches)

    def hooks(self):
        """What runs around each group's forward and backward in a training step: the exchange's (ZeRO 2 and 3),
        then the memory probe's (--memory), or nothing (None)."""
        chain = [h for h in (self.exchange.hooks, self.probe and self.probe.hooks) if h]
        return None if not chain else chain[0] if len(chain) == 1 else ChainedHooks(chain)

    # ------------------------------------------------------------------------------------------ what it holds
    def averaged_grads(self):
        """After gradients(): {name: this rank's shard of the gradient of the global batch's mean loss, averaged
        over dp_comm (dp x cp ranks), whole, unscaled (1/S)}. Collective over dp_comm when the exchange keeps only
        a chunk of the average (ZeRO: the chunks are All-Gathered)."""
        return self.exchange.named(self.exchange.grads() * (1.0 / self.scaler.made_with(0)))

    def memory(self):
        """Bytes this rank holds between steps: parameters, gradients, optimizer state."""
        sizes = self.exchange.sizes
        state = sum(a.nbytes for a in self.opt.moments("flat").values())
        return {"params": sizes.param_bytes(), "grads": sizes.grad_bytes(), "optimizer": int(state)}

    def state_dict(self):
        """Collective over dp_comm when the exchange shards (ZeRO): {"params": {name: this rank's tp shard, whole
        over dp}, "moments": {name: {"velocity" | "m", "v": its optimizer moments}}, "t": the optimizer's steps,
        "loss_scale": the scaler's state or None, "moe_biases": {"h.{i}.moe": (E,)} the selection biases of this
        stage's MoE blocks (auxiliary-loss-free balancing: state, not parameters), "fp8": the amax histories of an
        FP8 run's delayed scaling (hsgd.fp8.scaling.Fp8.state_dict) or None}: what a checkpoint keeps, by name, to
        cut again for any layout."""
        named = {k: self.exchange.named(v) for k, v in self.opt.moments("flat").items()}   # {moment: {name: a}}
        moments = {n: {k: v[n] for k, v in named.items()} for n in self.shard_shapes if named}
        return {"params": self.exchange.full_params(), "moments": moments, "t": self.opt.t,
                "loss_scale": self.scaler.state(), "moe_biases": dict(self.stage.biases),
                "fp8": self.stage.fp8.state_dict() if self.stage.fp8 is not None else None}

    def load_state_dict(self, state):
        """The inverse of state_dict on this rank's layout (no communication): its parameter shards, its part of
        the optimizer's moments (ZeRO: its chunk), the optimizer's steps and the loss scale."""
        self.exchange.set_params(state["params"])
        keys = {k for m in state["moments"].values() for k in m}                  # velocity, or m and v
        self.opt.set_moments("flat", {k: self.exchange.owned_part({n: m[k] for n, m in state["moments"].items()})
                                      for k in keys})                            # my part of the layout
        self.opt.t = state["t"]
        if self.scaler.dynamic and state.get("loss_scale"):
            self.scaler.load(state["loss_scale"])                         # float16: go on with the scale it had
        self.stage.biases.update(state.get("moe_biases") or {})          # (the same dict the stage's blocks read)
        if self.stage.fp8 is not None:
            self.stage.fp8.load_state_dict(state.get("fp8"))              # delayed scaling goes on from its history

    def full_params(self):
        """The whole model (serial names and shapes) on every rank (pickled: for sampling and checks only)."""
        return tp_shards.whole_model(self.exchange.full_params(), self.cfg, self.grid.tp_comm, self.grid.pp_comm,
                                     self.scheme, self.grid.ep_comm)            # (ZeRO-3: All-Gathered over dp)

    def finish(self):
        """Complete what is still in flight (the stale exchange's last Iallreduce: not applied)."""
        self.exchange.close()

    def free(self):
        self.exchange.free()
        getattr(self.stage.ctx, "free", lambda: None)()          # a context layout's own communicators (a2a+p2p)
