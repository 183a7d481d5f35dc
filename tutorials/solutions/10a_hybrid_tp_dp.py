"""Solutions to the exercises of chapter 10 (tutorials/10a_hybrid_tp_dp.py).

    mpirun -n 8 python tutorials/solutions/10a_hybrid_tp_dp.py

Each solution checks itself against the serial model or against what the grid's CommStats measured; every check
is collective, so a failure stops every rank at the same point.
"""
# mpirun -n 8 python tutorials/solutions/10a_hybrid_tp_dp.py
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from hsgd.model.config import ModelConfig  # noqa: E402  (hsgd before NumPy: OpenBLAS's thread timeout)
from hsgd.model import serial
from hsgd.tp import model as tp_model, shards as tp_shards

import math  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from hsgd.model.data import Corpus  # noqa: E402
from hsgd.dp.average import FlatBuffer, dp_rows  # noqa: E402
from hsgd.grid.process_grid import ProcessGrid  # noqa: E402
from hsgd.step.trainer import HybridTrainer  # noqa: E402
from hsgd.model.optim import global_grad_norm  # noqa: E402

from checks import Checks, rel_err, solve, train_config  # noqa: E402

threadpool_limits(1)                    # eight ranks share the cores: one BLAS thread each
world = MPI.COMM_WORLD
cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=8, n_layers=2, d_ff=128)   # chapter 10's toy
SEED = 0
corpus = Corpus.load(None, cfg.seq_len)


def exercise_1(check):
    """The bytes of one step, by formula, for dp = 2, tp = 4, micro_batches = 4."""
    dp, tp, k, B = 2, 4, 4, 8
    L, C, s = cfg.n_layers, cfg.d_model, 8                     # float64
    N = B // dp * cfg.seq_len                                  # positions of a group's slice in one step
    local = 0                                                  # parameters on one rank
    for name, shape in cfg.param_shapes().items():
        kind, axis = tp_shards.split_of(name)
        rest = math.prod(shape) // shape[axis] if kind != "rep" else math.prod(shape)
        local += rest if kind == "rep" else rest * (math.ceil(shape[axis] / tp) if kind == "vocab"
                                                    else shape[axis] // tp)
    mine = {("tp", "Allreduce"): (k * (4 * L + 4), ((4 * L + 2) * C + 3) * N * s),
            ("dp", "Allreduce"): (1, local * s)}

    grid = ProcessGrid(world, dp=dp, tp=tp)
    trainer = HybridTrainer(cfg, grid, train_config(tp=tp, dp=dp, batch_size=B, micro_batches=k, seed=SEED))
    before = grid.stats.counts()
    trainer.step(*corpus.batch(SEED, 1, B), 1)
    measured = grid.stats.since(before)
    ring = {"tp": 2 * (tp - 1) / tp * mine[("tp", "Allreduce")][1], "dp": 2 * (dp - 1) / dp * local * s}
    check.say(f"  tp_comm: {mine[('tp', 'Allreduce')]} (calls, payload); a ring sends {ring['tp']:,.0f} bytes per rank")
    check.say(f"  dp_comm: {mine[('dp', 'Allreduce')]} (calls, payload); a ring sends {ring['dp']:,.0f} bytes per rank")
    check.equal("my (calls, payload) per communicator == CommStats of one step", measured, mine)
    check.equal("my parameter count == the trainer's buffer", local, trainer.pbuf.flat.size)
    grid.free()


def exercise_2(check):
    """The global gradient norm in one All-Reduce over the world."""
    dp, tp, B = 4, 2, 8
    grid = ProcessGrid(world, dp=dp, tp=tp)
    trainer = HybridTrainer(cfg, grid, train_config(tp=tp, dp=dp, batch_size=B, seed=SEED))
    idx, targets = corpus.batch(SEED, 1, B)
    trainer.gradients(idx, targets)                            # averaged over dp_comm: the same on every replica
    weighted = 0.0
    for name, g in trainer.grads.items():
        copies = dp if trainer.is_sharded(name) else dp * tp   # how many ranks hold this very array
        weighted += float(np.sum(g * g)) / copies
    norm = math.sqrt(world.allreduce(weighted))                # one float over all 8 ranks
    _, grads_ref = serial.loss_and_grads(serial.init_params(cfg, SEED, "float64"), idx, targets, cfg)
    serial_norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads_ref.values()))
    check.say(f"  one All-Reduce over the world: {norm:.12f}; serial: {serial_norm:.12f}")
    check("norm, one world All-Reduce vs serial", abs(norm - serial_norm) / serial_norm, 1e-12)
    check("norm, one world All-Reduce vs global_grad_norm",
          abs(norm - global_grad_norm(trainer.grads, trainer.norm_weight, grid.tp_comm)) / serial_norm, 1e-12)
    grid.free()


def exercise_3(check):
    """A hybrid step by hand, twice, against serial SGD."""
    dp, tp, B, lr = 4, 2, 8, 0.1
    grid = ProcessGrid(world, dp=dp, tp=tp)
    ref = serial.init_params(cfg, SEED, "float64")             # serial SGD's parameters, on every rank
    mine = {n: p.copy() for n, p in tp_shards.shard_params(ref, grid.tp_rank, tp).items()}   # my shards: copies,
    # since a replicated parameter's "shard" is the serial array itself, which serial SGD below updates too
    rows = dp_rows(B, dp, grid.dp_rank)
    for step in (1, 2):
        idx, targets = corpus.batch(SEED, step, B)
        _, grads = tp_model.loss_and_grads(mine, idx[rows], targets[rows],
                                           tp_model.TPSetup(cfg, grid.tp_comm))   # my group's slice
        for name, g in grads.items():
            grid.dp_comm.comm.Allreduce(MPI.IN_PLACE, g)        # the same shard, summed over the replicas
            g /= dp
            mine[name] -= lr * g                                 # SGD on my shard
        _, grads_ref = serial.loss_and_grads(ref, idx, targets, cfg)
        for name, g in grads_ref.items():
            ref[name] -= lr * g
        err = max(rel_err(p, tp_shards.shard(ref[n], n, grid.tp_rank, tp), floor=0.02) for n, p in mine.items())
        check(f"step {step}: my shards vs serial SGD", err, 1e-12)
    grid.free()


def exercise_4(check):
    """Unequal slices: the weighted average."""
    dp, tp = 4, 2
    sizes = [3, 3, 2, 2]                                       # rows per group
    B, starts = sum(sizes), np.cumsum([0] + sizes)
    grid = ProcessGrid(world, dp=dp, tp=tp)
    full = serial.init_params(cfg, SEED, "float64")
    local = tp_shards.shard_params(full, grid.tp_rank, tp)
    idx, targets = corpus.batch(SEED, 1, B)
    rows = slice(starts[grid.dp_rank], starts[grid.dp_rank + 1])
    buf = FlatBuffer(local)                                    # my gradient shards, one flat array
    tp_model.loss_and_grads(local, idx[rows], targets[rows], tp_model.TPSetup(cfg, grid.tp_comm), grads=buf.views)
    plain = buf.flat.copy()
    buf.flat *= sizes[grid.dp_rank] / B                        # the global mean is a size-weighted mean of means
    grid.dp_comm.Allreduce(buf.flat)                           # one All-Reduce of the weighted gradients
    grid.dp_comm.Allreduce(plain)
    plain /= dp                                                # the plain average: wrong for unequal slices
    _, grads_ref = serial.loss_and_grads(full, idx, targets, cfg)
    ref = np.concatenate([tp_shards.shard(grads_ref[n], n, grid.tp_rank, tp).ravel() for n in local])   # buf's order
    weighted_err, plain_err = rel_err(buf.flat, ref), rel_err(plain, ref)
    check.say(f"  rows per group {sizes}: weighted average off by {weighted_err:.1e}, plain 1/dp average by "
              f"{plain_err:.1e}")
    check("weighted average vs serial gradient of the 10 rows", weighted_err, 1e-12)
    check.holds("the plain 1/dp average is off by more than 1e-3", plain_err > 1e-3)
    grid.free()


if __name__ == "__main__":
    if world.Get_size() != 8:
        raise SystemExit("run on 8 ranks: mpirun -n 8 python tutorials/solutions/10a_hybrid_tp_dp.py"
                         if world.Get_rank() == 0 else 1)
    solve(Checks(world, tol=1e-12, width=66), [exercise_1, exercise_2, exercise_3, exercise_4])
