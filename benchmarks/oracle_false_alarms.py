"""How often does the tolerance oracle (hsgd.check.oracle) flag a correct layout? Its band is a rule of thumb from a
model of rounding, not a proven bound, so its false-alarm rate is measured here, not assumed.

    mpirun -n 8 python benchmarks/oracle_false_alarms.py [--seeds 24] [--loss-runs 16]

1. Gradients: the oracle on 1x1x1, 2x1x4 and 1x2x4 with --seeds N, in bfloat16 and float16 (verify's small model,
   batch 8 x 16): every seed's difference of every parameter divided by its band (the band is made from all N
   seeds), against float64 and against 1x1x1: the median, 99th percentile and largest ratio, and how many exceed 1.
   A single seed held to a band made from N seeds is the strictest reading of the table the oracle prints.
2. The loss after 3 bfloat16 steps (--loss-steps 3, lr 0.05, no warmup) on 1x1x1 and 2x2x2, in --loss-runs separate
   one-seed oracles (each with its 9 draws of the model): the held ratio (the median over one seed: the seed itself)
   of every row.
Correct code, so every ratio above 1 is a false alarm. Takes about 2 minutes on 2 cores. Prints one line per case.
"""
import argparse

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from hsgd.model.config import ModelConfig
from hsgd.model.data import Corpus
from hsgd.check.oracle import oracle
from hsgd.step.settings import TrainConfig

CFG = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)


def describe(ratios):
    a = np.array(ratios)
    return (f"median {np.median(a):.3f}, 99th percentile {np.percentile(a, 99):.3f}, largest {a.max():.3f}; "
            f"above 1: {(a > 1).sum()} of {a.size}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=24)
    p.add_argument("--loss-runs", type=int, default=16)
    a = p.parse_args()
    world, corpus = MPI.COMM_WORLD, Corpus.load(None, CFG.seq_len)
    say = print if world.Get_rank() == 0 else (lambda *args, **kw: None)
    with threadpool_limits(1):
        for dtype in ("bfloat16", "float16"):
            tc = TrainConfig(dtype=dtype, batch_size=8, tp=1, dp=world.Get_size(), seed=100)
            v = oracle(CFG, tc, [(1, 1, 1, 1), (2, 1, 1, 4), (1, 2, 1, 4)], a.seeds, world, corpus)
            if v is not None:
                vs64 = [x / v.band(L, k) for L in v.layouts for k in v.names for x in v.vs64[L][k]]
                vsbase = [x / v.band(L, k, base=True) for L in v.layouts[1:] for k in v.names for x in v.vsbase[L][k]]
                say(f"{dtype}, gradients, {a.seeds} seeds x 3 layouts x {len(v.names)} parameters, each seed's "
                    f"difference / band: against float64 {describe(vs64)}; against 1x1x1 {describe(vsbase)}",
                    flush=True)
        held = []
        for s in range(a.loss_runs):
            tc = TrainConfig(dtype="bfloat16", batch_size=8, tp=1, dp=world.Get_size(), seed=200 + s, lr=0.05,
                             warmup=0)
            v = oracle(CFG, tc, [(1, 1, 1, 1), (2, 2, 1, 2)], 1, world, corpus, loss_steps=3)
            if v is not None:
                held += [v.ratio(r) for r in v.rows()]
        if world.Get_rank() == 0:
            say(f"bfloat16, the loss after 3 steps, {a.loss_runs} one-seed oracles x 2 layouts, held difference / "
                f"band: {describe(held)}")


if __name__ == "__main__":
    main()
