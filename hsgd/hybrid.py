"""One rank's part of hybrid tensor x data parallel training: the seed paper's algorithm, step by step.

P = dp x tp ranks. Each synchronous SGD step:
  1. the global batch of the step (B sequences, the same on every rank) is split into dp equal slices; DP group g
     takes slice g, and every TP rank of the group reads the same slice (hsgd.dp.dp_rows);
  2. the slice is cut into k = grad_accum micro-batches; for each, the tensor-parallel forward and backward
     (collectives on tp_comm inside, hsgd.tp_model) accumulate the gradient of (1/k) * its mean loss into the
     rank's gradient shards;
  3. every gradient shard is All-Reduced over dp_comm and divided by dp (hsgd.dp.dp_average);
  4. optionally the gradients are clipped by the global norm (hsgd.optim.global_grad_norm); the optimizer updates
     the local shards with the learning rate of the schedule.
Result: the same update as serial mini-batch SGD on the global batch (tests/mpi/test_hybrid.py checks it).
"""
import time
from dataclasses import dataclass

from . import tp_model
from .dp import GradBuffer, dp_average, dp_rows, micro_batches
from .optim import clip_grads, global_grad_norm, lr_at, make_optimizer


@dataclass
class StepInfo:
    loss: float          # mean loss over the global batch (averaged over dp groups)
    lr: float            # learning rate used
    grad_norm: float     # global gradient norm before clipping
    seconds: float       # wall time of the step
    tp_seconds: float    # of which in tp_comm collectives
    dp_seconds: float    # of which in dp_comm collectives


class HybridTrainer:
    def __init__(self, cfg, grid, tc):
        """cfg: ModelConfig; grid: ProcessGrid (pp = 1); tc: TrainConfig (optimizer, schedule, scheme, dtype...)."""
        self.cfg, self.grid, self.tc = cfg, grid, tc
        self.scheme = tc.tp_scheme
        self.params = tp_model.init_params(cfg, grid.tp_comm, seed=tc.seed, dtype=tc.dtype, device=tc.device,
                                           scheme=tc.tp_scheme)
        self.buf = GradBuffer(self.params)
        self.grads = self.buf.grads
        self.opt = make_optimizer(tc.optimizer, tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)

    def is_sharded(self, name):
        return self.grid.tp > 1 and tp_model.split_of(name, self.scheme)[0] != "rep"

    def compute_grads(self, idx, targets):
        """Steps 1-3: this rank's gradient shards of the global batch's mean loss, averaged over dp.
        Returns this DP group's loss (the mean over its slice)."""
        g, k = self.grid, self.tc.grad_accum
        self.buf.zero()
        loss = 0.0
        for mb in micro_batches(dp_rows(len(idx), g.dp, g.dp_rank), k):
            mb_loss, _ = tp_model.loss_and_grads(self.params, idx[mb], targets[mb], self.cfg, g.tp_comm,
                                                 self.scheme, grads=self.grads, loss_scale=1.0 / k)
            loss += mb_loss / k
        dp_average(self.buf, g.dp_comm)                                  # Allreduce over dp_comm, then / dp
        return loss

    def update(self, step):
        """Step 4: clip by the global norm, then the optimizer step with the scheduled learning rate."""
        tc = self.tc
        norm = global_grad_norm(self.grads, self.is_sharded, self.grid.tp_comm)
        clip_grads(self.grads, norm, tc.clip)
        lr = lr_at(step, tc.lr, tc.warmup, tc.steps)
        self.opt.step(self.params, self.grads, lr)
        return lr, norm

    def step(self, idx, targets, step):
        """One optimizer step on the global batch idx, targets (B, T). `step` counts from 1 (for the schedule)."""
        g, stats = self.grid, self.grid.stats
        t0, tp0, dp0 = time.perf_counter(), stats.seconds("tp"), stats.seconds("dp")
        loss = self.compute_grads(idx, targets)
        lr, norm = self.update(step)
        loss = g.dp_comm.comm.allreduce(loss) / g.dp                     # metadata: the global batch's loss
        return StepInfo(loss, lr, norm, time.perf_counter() - t0, stats.seconds("tp") - tp0,
                        stats.seconds("dp") - dp0)

    def evaluate(self, corpus, n_batches, batch_size):
        """Mean loss over n_batches fixed validation batches; rows split over the dp groups like training."""
        g = self.grid
        total = 0.0
        for i in range(n_batches):
            idx, targets = corpus.batch(self.tc.seed, i, batch_size, split="val")
            rows = dp_rows(batch_size, g.dp, g.dp_rank)
            loss, _ = tp_model.forward(self.params, idx[rows], targets[rows], self.cfg, g.tp_comm, self.scheme)
            total += float(loss)
        return g.dp_comm.comm.allreduce(total) / (g.dp * n_batches)

    def full_params(self):
        """The whole model (serial names and shapes) on every rank of the TP group."""
        return tp_model.gather_full(self.params, self.cfg, self.grid.tp_comm, self.scheme)
