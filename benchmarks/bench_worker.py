"""One measurement of `make bench` that needs MPI ranks; started by benchmarks/bench.py under mpiexec.

    mpiexec -n N python benchmarks/bench_worker.py TASK     TASK: dp | ddp | tp | threaded | torch | memory | memcost
                                                                  | schedules | cp

    dp        the trainer, dp = N (one thread per rank), the global batch 16 x 128 split over the ranks
    ddp       PyTorch DistributedDataParallel (gloo, on loopback) on the same model, batch and thread count
    tp        the trainer, tp = 2 on 2 ranks (one thread each), or tp = 1 on 1 rank
    threaded  the trainer on 1 rank with BENCH_THREADS threads (default 2): ThreadedStage splits the batch
    torch     PyTorch eager on 1 rank with BENCH_THREADS threads (default 2), the anchor of `threaded`
    memory    per-rank memory and bytes per step on 8 ranks against the formulas
    memcost   what recomputation (selective, full) and ZeRO-3 cost in time: dp = N, every variant's step timed
              in alternating rounds, against --recompute none and --zero 0
    schedules the pipeline schedules on pp = N stages (8 layers, 2N micro-batches): each one's step time and its
              measured bubble, in alternating rounds, next to the equal-cost simulation
    cp        context parallelism on N ranks (a long sequence): cp = N with ring attention and with the all-gather
              of keys and values, and dp = N on the same batch, timed in alternating rounds; cp_comm's bytes and
              the activation bytes per rank against the formulas, the attention scores each rank computed
Rank 0 prints one JSON object on its last line. Every rank uses one BLAS thread unless BENCH_THREADS says more.
"""
import json
import os
import socket
import sys
import time


# before NumPy: hsgd sets how OpenBLAS threads wait (see hsgd/model/threads.py)
from hsgd.model.config import ModelConfig
import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from hsgd.model import serial
from hsgd.tp import model as tp_model
from hsgd.model.data import Corpus
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.accounting.activations import activation_bytes, activation_formula
from hsgd.accounting.traffic import step_formula
from hsgd.step.settings import TrainConfig
from hsgd.pp.stage import ThreadedStage
from hsgd.model.threads import set_cpu_threads, tune_allocator

WORLD = MPI.COMM_WORLD
SCALING = ModelConfig(vocab_size=256, seq_len=128, d_model=256, n_heads=8, n_layers=4, d_ff=1024)
CORPUS = Corpus(np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes(), "random", 128)


def median_step_seconds(step, reps):
    step()                                                               # warm-up
    times = []
    for _ in range(reps):
        WORLD.Barrier()
        t0 = time.perf_counter()
        step()
        times.append(WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return float(np.median(times))


def hsgd_steps(cfg, batch, tp, reps, threads=1):
    """(median seconds of the trainer's step, its stage's class name) with tp ranks per model, dp = ranks / tp."""
    n = WORLD.Get_size()
    tc = TrainConfig(tp=tp, dp=n // tp, steps=reps + 1, batch_size=batch, lr=1e-4, momentum=0.9, warmup=0)
    grid = ProcessGrid(WORLD, dp=n // tp, tp=tp)
    set_cpu_threads(threads)                                             # as hsgd.train does for its ranks
    trainer = HybridTrainer(cfg, grid, tc)
    idx, targets = CORPUS.batch(0, 1, batch)
    with threadpool_limits(threads):
        t = median_step_seconds(lambda: trainer.step(idx, targets, 1), reps)
    grid.free()
    return t, type(trainer.stage).__name__


def bench_threads():
    return int(os.environ.get("BENCH_THREADS", "2"))


def task_dp():
    return {"seconds": hsgd_steps(SCALING, 16, 1, 5)[0]}


def task_tp():
    return {"seconds": hsgd_steps(SCALING, 16, 2 if WORLD.Get_size() == 2 else 1, 5)[0]}


def task_threaded():
    """One rank, its threads splitting the batch (the trainer picks ThreadedStage for a whole model on one rank)."""
    t, stage = hsgd_steps(SCALING, 16, 1, 5, threads=bench_threads())
    assert stage == ThreadedStage.__name__, f"one rank with threads runs {stage}, not ThreadedStage"
    return {"seconds": t, "stage": stage}


def torch_model(torch):
    """SCALING in PyTorch as a Module (for DDP), with hsgd's initial weights."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch_gpt import loss_fn, to_torch
    names, init = list(SCALING.param_shapes()), to_torch(serial.init_params(SCALING, 0))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList([torch.nn.Parameter(init[n].detach()) for n in names])

        def forward(self, idx, targets):
            return loss_fn(dict(zip(names, self.ps)), idx, targets, SCALING)

    return Model()


def torch_steps(torch, model, rows):
    """Median seconds of PyTorch's step (zero_grad, forward, backward, SGD with momentum) on rows of the batch."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    idx, targets = CORPUS.batch(0, 1, 16)
    ti, tt = torch.tensor(idx[rows]), torch.tensor(targets[rows])

    def step():
        opt.zero_grad()
        model(ti, tt).backward()
        opt.step()

    return median_step_seconds(step, 5)


def task_ddp():
    """PyTorch DistributedDataParallel (gloo, on loopback) on the same model, batch and thread count."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    port = WORLD.bcast(_free_port() if r == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=n)
    model = torch.nn.parallel.DistributedDataParallel(torch_model(torch))
    t = torch_steps(torch, model, slice(r * 16 // n, (r + 1) * 16 // n))
    dist.destroy_process_group()
    return {"seconds": t}


def task_torch():
    """PyTorch eager on one process with BENCH_THREADS threads, the whole batch."""
    import torch
    torch.set_num_threads(bench_threads())
    with threadpool_limits(bench_threads()):
        return {"seconds": torch_steps(torch, torch_model(torch), slice(0, 16))}


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def param_bytes_formula(cfg, tp, itemsize):
    """Parameters per rank, megatron split: replicated (LayerNorms, wpe, row-parallel biases) whole, the rest /tp,
    the vocabulary padded to a multiple of tp."""
    C, F, L, T = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.seq_len
    Vp = -(-cfg.vocab_size // tp)
    per_block = 4 * C + 2 * C + (3 * C * C + 3 * C + C * C + C * F + F + F * C) // tp
    return itemsize * (L * per_block + T * C + 2 * C + 2 * Vp * C)


def task_memory():
    """Per-rank memory and communication per step for tp in {1, 2, 4, 8} and zero in {0, 1} (dp = 8 / tp)."""
    cfg = ModelConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=8, n_layers=2, d_ff=512)
    rows, batch = [], 16
    for tp in (1, 2, 4, 8):
        for zero in (0, 1):
            dp = WORLD.Get_size() // tp
            tc = TrainConfig(tp=tp, dp=dp, zero=zero, steps=3, batch_size=batch, lr=1e-4, momentum=0.9)
            grid = ProcessGrid(WORLD, dp=dp, tp=tp)
            trainer = HybridTrainer(cfg, grid, tc)
            idx, targets = CORPUS.batch(0, 1, batch)
            before = None
            for step in (1, 2):
                if step == 2:
                    before = grid.stats.counts()
                trainer.step(idx[:, :64], targets[:, :64], step)
            measured = grid.stats.since(before)
            formula = step_formula(cfg, tc, trainer)
            rows_ = slice(grid.dp_rank * batch // dp, (grid.dp_rank + 1) * batch // dp)
            _, caches = tp_model.forward(trainer.params, idx[rows_, :64], targets[rows_, :64],
                                         tp_model.TPSetup(cfg, grid.tp_comm))
            act = activation_bytes(caches, trainer.params)
            mem = trainer.memory()
            s = trainer.dtype.itemsize
            pbytes = param_bytes_formula(cfg, tp, s)
            n_elems = pbytes // s
            chunk = -(-n_elems // dp)
            opt_formula = s * (chunk if zero else n_elems)
            grad_formula = s * ((chunk * dp + chunk) if zero else n_elems)
            row = {"tp": tp, "dp": dp, "zero": zero, "params": mem["params"], "params_formula": pbytes,
                   "grads": mem["grads"], "grads_formula": grad_formula, "optimizer": mem["optimizer"],
                   "optimizer_formula": opt_formula, "activations": act,
                   "activations_formula": activation_formula(cfg, batch // dp, s, tp, "megatron")["model"],
                   "comm": {f"{k[0]} {k[1]}": [measured.get(k, (0, 0))[1], formula.get(k, (0, 0))[1]]
                            for k in sorted(set(measured) | set(formula))}}
            everyone = WORLD.gather(row)
            if WORLD.Get_rank() == 0:                                    # every rank against the formulas
                row["all_ranks_match"] = all(all(r[k] == r[k + "_formula"] for k in
                                                 ("params", "grads", "optimizer", "activations")) and
                                             all(m == f for m, f in r["comm"].values()) for r in everyone)
                rows.append(row)
            grid.free()
    return {"rows": rows, "config": {"C": 128, "L": 2, "NH": 8, "F": 512, "T": 64, "V": 256, "B": batch}}


def alternate(trainers, idx, targets, rounds, times, after=None):
    """`rounds` rounds of one step of every trainer in turn (so that all see the same machine noise): the slowest
    rank's seconds appended to times[name]; after(name, trainer), if given, once each step is timed."""
    for _ in range(rounds):
        for name, trainer in trainers.items():
            WORLD.Barrier()
            t0 = time.perf_counter()
            trainer.step(idx, targets, 1)
            times[name].append(WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            if after is not None:
                after(name, trainer)


MEMCOST = {"none, zero 0": {}, "selective": dict(recompute="selective"), "full": dict(recompute="full"),
           "zero 3": dict(zero=3), "zero 3 + full": dict(zero=3, recompute="full")}


def task_memcost():
    """Median step seconds of each MEMCOST variant (SCALING, global batch 16 x 128, dp = N ranks, one thread
    each), the variants' steps alternating round by round so that all see the same machine noise; and the tp and
    dp bytes of one step."""
    n, rounds = WORLD.Get_size(), int(os.environ.get("BENCH_ROUNDS", "5"))
    idx, targets = CORPUS.batch(0, 1, 16)
    trainers, times, traffic = {}, {k: [] for k in MEMCOST}, {}
    for name, extra in MEMCOST.items():
        tc = TrainConfig(dp=n, tp=1, steps=10 ** 6, batch_size=16, lr=1e-4, momentum=0.9, warmup=0, **extra)
        grid = ProcessGrid(WORLD, dp=n, tp=1)
        trainers[name] = HybridTrainer(SCALING, grid, tc)
        trainers[name].step(idx, targets, 1)                             # warm-up (and the optimizer state)
        before = grid.stats.counts()
        trainers[name].step(idx, targets, 1)
        traffic[name] = {f"{c} {op}": b for (c, op), (_, b) in grid.stats.since(before).items()}
    alternate(trainers, idx, targets, rounds, times)
    for trainer in trainers.values():
        trainer.free()
        trainer.grid.free()
    return {"seconds": {k: float(np.median(v)) for k, v in times.items()},
            "best": {k: float(min(v)) for k, v in times.items()}, "bytes": traffic, "ranks": n}


SCHEDULES = {"gpipe": {}, "1f1b": {}, "interleaved v=2": dict(schedule="interleaved", virtual_stages=2),
             "zb-h1": dict(schedule="zb-h1")}


def task_schedules():
    """Median step seconds and the bubble of the last measured step (hsgd.pp.timelines.bubble_fraction of every
    stage's measured timeline) of each SCHEDULES entry, pp = N stages of an 8-layer SCALING model, global batch
    4N x 128 in 2N micro-batches; and each schedule's equal-cost simulated bubble."""
    from hsgd.pp.schedules import build, simulate
    from hsgd.pp.timelines import bubble_fraction
    n, rounds = WORLD.Get_size(), int(os.environ.get("BENCH_ROUNDS", "5"))
    cfg, m = ModelConfig(**{**SCALING.__dict__, "n_layers": 8}), 2 * n
    idx, targets = CORPUS.batch(0, 1, 2 * m)
    trainers, times, bubbles, predicted = {}, {k: [] for k in SCHEDULES}, {k: [] for k in SCHEDULES}, {}
    for name, extra in SCHEDULES.items():
        kind = extra.get("schedule", name)
        tc = TrainConfig(dp=1, pp=n, tp=1, steps=10 ** 6, batch_size=2 * m, micro_batches=m, lr=1e-4,
                         momentum=0.9, warmup=0, **{"schedule": kind, **extra})
        grid = ProcessGrid(WORLD, dp=1, pp=n, tp=1)
        trainers[name] = HybridTrainer(cfg, grid, tc)
        trainers[name].step(idx, targets, 1)                             # warm-up (and the optimizer state)
        v = extra.get("virtual_stages", 1)
        predicted[name] = bubble_fraction(simulate(build(kind, m, n, v), m, v))
    alternate(trainers, idx, targets, rounds, times,
              after=lambda name, tr: bubbles[name].append(bubble_fraction(WORLD.allgather(tr.stage.timeline))))
    for trainer in trainers.values():
        trainer.free()
        trainer.grid.free()
    return {"seconds": {k: float(np.median(v)) for k, v in times.items()},
            "best": {k: float(min(v)) for k, v in times.items()},
            "bubble": {k: float(np.median(v)) for k, v in bubbles.items()}, "predicted": predicted, "ranks": n,
            "micro_batches": m}


LONG = ModelConfig(vocab_size=256, seq_len=1024, d_model=128, n_heads=4, n_layers=2, d_ff=512)
CP_VARIANTS = {"dp (whole sequences)": dict(), "cp ring": dict(cp_scheme="ring"),
               "cp allgather": dict(cp_scheme="allgather")}


def task_cp():
    """Median step seconds of each CP_VARIANTS entry on LONG (T = 1024), global batch N x 1024, N ranks one thread
    each: dp = N, or cp = N; the variants alternate round by round. For the cp variants also: cp_comm's bytes of one
    step (measured, formula), the activation bytes per rank (hsgd.accounting.activations.activation_formula) and the
    attention scores computed per rank in one forward (every rank's, counted)."""
    from hsgd.cp.split import cp_formula
    n, rounds = WORLD.Get_size(), int(os.environ.get("BENCH_ROUNDS", "5"))
    idx, targets = long_batch(n)
    trainers, times, extra = {}, {k: [] for k in CP_VARIANTS}, {}
    for name, kw in CP_VARIANTS.items():
        cp = n if kw else 1
        b = n // (n // cp)                                                # sequences per DP group
        tc = TrainConfig(dp=n // cp, cp=cp, tp=1, steps=10 ** 6, batch_size=n, lr=1e-4, momentum=0.9, warmup=0, **kw)
        grid = ProcessGrid(WORLD, dp=n // cp, tp=1, cp=cp)
        trainers[name] = tr = HybridTrainer(LONG, grid, tc)
        tr.step(idx, targets, 1)                                          # warm-up (and the optimizer state)
        before, work0 = grid.stats.counts(), getattr(tr.stage.ctx, "work", {}).get("forward", 0)
        tr.step(idx, targets, 1)
        measured = {op: b for (c, op), (_, b) in grid.stats.since(before).items() if c == "cp"}
        formula = {op: nbytes for (c, op), (_, nbytes) in cp_formula(tc.cp_scheme, cp, b, LONG.seq_len, LONG.d_model,
                                                                     1, 4, LONG.n_layers).items()}
        work = WORLD.allgather(getattr(tr.stage.ctx, "work", {}).get("forward", 0) - work0)
        act = activation_formula(LONG, b, 4, 1, "megatron", cp, tc.cp_scheme)["model"]
        extra[name] = {"cp_bytes": measured, "cp_formula": formula, "activation_bytes": act,
                       "scores_per_rank": work}
    alternate(trainers, idx, targets, rounds, times)
    for trainer in trainers.values():
        trainer.free()
        trainer.grid.free()
    return {"seconds": {k: float(np.median(v)) for k, v in times.items()},
            "best": {k: float(min(v)) for k, v in times.items()}, "ranks": n, "seq_len": LONG.seq_len, **extra}


def long_batch(n):
    """n random sequences of LONG.seq_len bytes (and their next bytes), the same on every rank."""
    rng = np.random.default_rng(0)
    w = rng.integers(0, 256, (n, LONG.seq_len + 1), dtype=np.int64)
    return w[:, :-1], w[:, 1:]


if __name__ == "__main__":
    task = sys.argv[1]
    tune_allocator()
    with threadpool_limits(1):
        result = {"dp": task_dp, "tp": task_tp, "threaded": task_threaded, "ddp": task_ddp, "torch": task_torch,
                  "memory": task_memory, "memcost": task_memcost, "schedules": task_schedules, "cp": task_cp}[task]()
    if WORLD.Get_rank() == 0:
        print(json.dumps(result))
