"""Solutions to the exercises of chapter 4 (tutorials/04_data_parallel_sgd.py).

    mpirun -n 4 python tutorials/solutions/04_data_parallel_sgd.py

dp = 4 replicas of the chapter's tiny model in float64; every solution checks its gradients or parameters against
serial SGD on the whole batch (or a formula), collectively on the 4 ranks.
"""
# mpirun -n 4 python tutorials/solutions/04_data_parallel_sgd.py
import os
import sys

from hsgd.model.config import ModelConfig   # hsgd before NumPy: it sets OpenBLAS's thread timeout first
from hsgd.model import serial
from hsgd.model.data import Corpus
from hsgd.dp.average import FlatBuffer, dp_average, params_digest
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, rel_err, solve, train_config  # noqa: E402

threadpool_limits(1)
DP = 4
cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=16, n_heads=2, n_layers=2, d_ff=64)
corpus = Corpus.load(None, cfg.seq_len)
grid = ProcessGrid(MPI.COMM_WORLD, dp=DP, tp=1)
dp, g = grid.dp_comm, grid.dp_rank


def max_rel_err(grads, ref, floor=1e-6):
    return max(rel_err(grads[n], ref[n], floor) for n in ref)


# ------------------------------------------------------------------------------------------------------------ 1
def exercise_1(check):
    """Unequal DP slices."""
    sizes = [1, 2, 3, 2]                                             # b_g: the replicas' slices of B = 8
    B = sum(sizes)
    idx, targets = corpus.batch(0, 1, B)                             # (B, T) the global batch
    lo = sum(sizes[:g])
    rows = slice(lo, lo + sizes[g])                                  # my slice
    params = serial.init_params(cfg, seed=0, dtype="float64")
    _, ref = serial.loss_and_grads(params, idx, targets, cfg)        # serial: the whole batch

    def slice_gradient():
        buf = FlatBuffer(params)
        serial.loss_and_grads(params, idx[rows], targets[rows], cfg, grads=buf.views)   # mean over my b_g rows
        return buf

    weighted = slice_gradient()
    weighted.flat *= sizes[g] / B                                    # b_g / B: my share of the batch
    dp.Allreduce(weighted.flat)                                      # sum over the replicas
    plain = slice_gradient()
    dp_average(plain, dp)                                            # (1/dp) sum: right only for equal slices
    err, wrong = max_rel_err(weighted.views, ref), max_rel_err(plain.views, ref)
    check.say(f"  slices {sizes}: weights b_g/B max rel err {err:.1e}; weights 1/dp {wrong:.1e}")
    check("weights b_g/B, one Allreduce vs the serial gradient", err, 1e-12)
    check.holds("dp_average (1/dp) with unequal slices is off by > 1e-2", wrong > 1e-2)


# ------------------------------------------------------------------------------------------------------------ 2
def exercise_2(check):
    """Gradient accumulation by hand, and the batch-size bookkeeping."""
    micro, gas = 2, 3                                                # micro batch per GPU, accumulation steps
    B = micro * gas * DP                                             # train_batch_size
    idx, targets = corpus.batch(0, 2, B)                             # (24, T)
    params = serial.init_params(cfg, seed=0, dtype="float64")
    _, ref = serial.loss_and_grads(params, idx, targets, cfg)
    buf = FlatBuffer(params)                                         # zero
    grid.stats.reset()
    first = g * micro * gas                                          # my b = micro * gas rows start here
    for m in range(gas):
        mb = slice(first + m * micro, first + (m + 1) * micro)
        serial.loss_and_grads(params, idx[mb], targets[mb], cfg, grads=buf.views)   # adds grad of mb's mean loss
    dp.Allreduce(buf.flat)                                           # once, after the last micro-batch
    buf.flat *= 1.0 / (gas * DP)                                     # mean over micro-batches and replicas
    check.say(f"  train_batch_size = {micro} x {gas} x {DP} = {B}")
    check("micro 2 x accumulation 3 x dp 4 vs the serial gradient of 24", max_rel_err(buf.views, ref), 1e-12)
    check.equal("one dp Allreduce for the whole step", grid.stats.counts(),
                {("dp", "Allreduce"): (1, buf.flat.nbytes)})


# ------------------------------------------------------------------------------------------------------------ 3
def goyal_lr(step, lr, k, warmup):
    """Goyal et al.'s gradual warm-up (steps count from 1): lr at step 1, then a constant increment per step up to
    k * lr at step warmup + 1, then k * lr."""
    if step > warmup:
        return k * lr
    return lr + (k - 1) * lr * (step - 1) / warmup


def exercise_3(check):
    """Why the rule is linear, measured."""
    k, b = 4, 2
    idx, targets = corpus.batch(0, 3, k * b)                         # 4 batches of 2, together the batch of 8
    start = serial.init_params(cfg, seed=0, dtype="float64")

    def distance(eta):
        small = {n: p.copy() for n, p in start.items()}
        for j in range(k):                                           # k plain SGD steps of rate eta
            _, grads = serial.loss_and_grads(small, idx[j * b:(j + 1) * b], targets[j * b:(j + 1) * b], cfg)
            for n in small:
                small[n] -= eta * grads[n]
        _, grads = serial.loss_and_grads(start, idx, targets, cfg)   # one step of rate k * eta on all 8
        big = {n: start[n] - k * eta * grads[n] for n in start}
        return float(np.sqrt(sum(np.sum((small[n] - big[n]) ** 2) for n in start)))

    ratios = {}
    for eta in (0.002, 0.1):                                         # a small rate, and section 5's
        d1, d2 = distance(eta), distance(eta / 2)
        ratios[eta] = d1 / d2
        check.say(f"  |k small steps - one big step|: eta {eta} -> {d1:.2e}, eta {eta / 2} -> {d2:.2e}, "
                  f"ratio {d1 / d2:.2f} (second order: 4)")
    check("eta = 0.002: distance ratio for eta, eta/2 vs 4 (relative)", abs(ratios[0.002] - 4) / 4, 0.05)
    check.holds("eta = 0.1: the ratio is far from 4 (< 3): steps too big", ratios[0.1] < 3)

    lr, warmup = 0.1, 5
    got = [goyal_lr(s, lr, k, warmup) for s in range(1, warmup + 3)]
    want = [lr, 0.16, 0.22, 0.28, 0.34, 0.4, 0.4]                    # 0.1 + 0.06 per step, then k * lr = 0.4
    check.say(f"  goyal_lr, steps 1..{warmup + 2}: {' '.join(f'{x:.2f}' for x in got)}")
    check("goyal_lr vs its formula at steps 1..7", max(abs(a - w) for a, w in zip(got, want)), 1e-12)


# ------------------------------------------------------------------------------------------------------------ 4
def exercise_4(check):
    """Start from different parameters, then broadcast."""
    tc = train_config(tp=1, dp=DP, steps=2, batch_size=8, warmup=1, seed=0)
    trainer = HybridTrainer(cfg, grid, tc)
    trainer.pbuf.flat += 1e-3 * np.random.default_rng(100 + g).standard_normal(trainer.pbuf.flat.size)
    before = dp.allgather_obj(params_digest(trainer.params))
    dp.Bcast(trainer.pbuf.flat, root=0)                              # every replica <- dp rank 0's parameters
    after = dp.allgather_obj(params_digest(trainer.params))
    check.holds("before the broadcast: 4 different digests", len(set(before)) == DP)
    check.holds("after dp_comm.Bcast from dp rank 0: one digest", len(set(after)) == 1)

    start = {n: p.copy() for n, p in trainer.params.items()}         # rank 0's parameters, on every rank
    batch = lambda step: corpus.batch(tc.seed, step, tc.batch_size)  # noqa: E731
    for step in range(1, tc.steps + 1):
        trainer.step(*batch(step), step)
    ref, _ = serial.sgd(cfg, tc, batch, params=start)                # serial SGD from the broadcast start
    err = max(rel_err(trainer.params[n], ref[n], floor=0.02) for n in ref)
    check(f"{tc.steps} steps after the broadcast vs serial SGD from rank 0's start", err, 1e-9)
    trainer.free()


if __name__ == "__main__":
    solve(Checks(MPI.COMM_WORLD, tol=1e-12, width=66), [exercise_1, exercise_2, exercise_3, exercise_4])
    grid.free()
