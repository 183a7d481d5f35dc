"""The planner's step time against hsgd's measured one on this machine, for the 10 factorizations dp x pp x tp of 8.

    mpirun -n 8 python benchmarks/plan_this_machine.py [--rounds 4] [--steps 3] [--hw this-machine]

(Calibrate first: mpirun -n 8 python -m hsgd.plan.calibrate --out hsgd/plan/hw/this-machine.toml.)

The model: vocabulary 256, T = 64, C = 128, NH = 8, L = 8, F = 512 (hsgd.train's default model with 8 heads and 8
layers, so that it splits over tp = 8 and pp = 8), float32, AdamW, the 1F1B schedule, global batch B = 32. Every
layout runs m = 2 pp micro-batches (b = B / (dp m) = 2 tp sequences each): enough that the pipeline is not mostly
bubble (p = 8: 7 of 23 slots), the same for pp = 1 (m = 2).

Measured: each rank builds every layout's ProcessGrid and HybridTrainer once (as hsgd.train does, one BLAS thread a
rank) and takes 2 warm-up steps; then `rounds` rounds, each timing `steps` steps of every layout in turn (Barrier,
steps, Barrier: the slowest rank's time), the order reversed every other round so that the machine's drift is
spread over all; a layout's time is the median over rounds. Next to it the measured time in tp and dp collectives
(hsgd's StepInfo, the slowest rank's median).
Predicted: hsgd.plan.search.evaluate(..., impl="hsgd", dtype="float32") with the hardware file, split as the
model splits it. Reported: error = predicted / measured - 1 per layout, the median |error|, Spearman's rank
correlation of the two columns, and whether the best predicted layout is among the two fastest measured.

Writes benchmarks/results/plan_this_machine.md and prints it on rank 0. About 2-3 minutes on 8 ranks sharing 2 cores.
Left out: ZeRO, recomputation, interleaving, sequence parallelism (the other options the planner prices).
"""
import argparse
import os
import sys
import time


# before NumPy: hsgd sets how OpenBLAS threads wait (see hsgd/model/threads.py)
from hsgd.model.config import ModelConfig
import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from hsgd.model.data import Corpus
from hsgd.grid.process_grid import ProcessGrid, factorizations
from hsgd.step.trainer import HybridTrainer
from hsgd.plan.hardware import load
from hsgd.plan.search import Layout, evaluate
from hsgd.model.threads import tune_allocator

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = ModelConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=8, n_layers=8, d_ff=512)
BATCH, DTYPE, OPTIMIZER = 32, "float32", "adamw"
PARTS = ("compute", "elementwise", "tp", "pp bubble", "pp transfer", "dp")      # the model's split, as printed


def layout(dp, pp, tp):
    """The layout measured for (dp, pp, tp): m = 2 pp micro-batches of b = B / (dp m) sequences."""
    m = 2 * pp
    return Layout(dp=dp, pp=pp, tp=tp, b=BATCH // (dp * m), m=m)


def trainer_of(world, lay):
    """(grid, trainer) of layout lay on world, as hsgd.train builds them (lr tiny: the weights barely move)."""
    tc = lay.train_config(BATCH, DTYPE, OPTIMIZER)
    tc.lr, tc.warmup, tc.steps = 1e-5, 0, 10 ** 6
    grid = ProcessGrid(world, dp=tc.dp, pp=tc.pp, tp=tc.tp, cp=tc.cp)
    return grid, HybridTrainer(MODEL, grid, tc)


def measure(world, lays, rounds, steps, say):
    """{layout: (median s per step, median tp s, median dp s)}: the slowest rank's, over alternating rounds."""
    corpus = Corpus(np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes(), "random bytes",
                    MODEL.seq_len)
    batches = [corpus.batch(0, s, BATCH) for s in range(steps)]
    built = {}
    for lay in lays:
        t0 = time.perf_counter()
        grid, trainer = built[lay] = trainer_of(world, lay)
        for s in (1, 2):                                                     # warm-up
            trainer.step(*batches[s % steps], s)
        say(f"  built {lay.name()}, 2 warm-up steps: {time.perf_counter() - t0:.1f} s")
    times = {lay: [] for lay in lays}                                        # [(s, tp s, dp s) per round]
    for r in range(rounds):
        t_round = time.perf_counter()
        for lay in (lays if r % 2 == 0 else lays[::-1]):
            grid, trainer = built[lay]
            tp = dp = 0.0
            world.Barrier()
            t0 = time.perf_counter()
            for s in range(steps):
                info = trainer.step(*batches[s], 3 + s)
                tp, dp = tp + info.tp_seconds, dp + info.dp_seconds
            world.Barrier()
            step = (time.perf_counter() - t0) / steps
            mine = np.array([step, tp / steps, dp / steps])                    # (3,) s per step
            world.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)                     # the slowest rank's
            times[lay].append(mine)
        say(f"  round {r + 1}/{rounds}: {time.perf_counter() - t_round:.1f} s")
    for grid, trainer in built.values():
        trainer.free()
        grid.free()
    return {lay: tuple(np.median(np.array(t), axis=0)) for lay, t in times.items()}


def ranks(x):
    """Ranks 1..n of the values in x, ties sharing the mean of their ranks."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    out, i = [0.0] * len(x), 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x, y):
    """Spearman's rank correlation: Pearson's correlation of the ranks (with ties averaged)."""
    rx, ry = np.array(ranks(x)), np.array(ranks(y))
    dx, dy = rx - rx.mean(), ry - ry.mean()
    return float((dx * dy).sum() / np.sqrt((dx * dx).sum() * (dy * dy).sum()))


def table(rows, hw_name, rounds, steps, wall):
    """The markdown report: per layout predicted (split), measured, error; then the verdict and the setup."""
    head = (["layout (b, m)", "predicted ms"] + [f"{p}" for p in PARTS]
            + ["measured ms", "meas. tp ms", "meas. dp ms", "error"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = ([r["lay"].name().replace(", 1f1b", ""), f"{r['pred'] * 1e3:.1f}"]
                 + [f"{r['parts'][p] * 1e3:.1f}" for p in PARTS]
                 + [f"{r['meas'] * 1e3:.1f}", f"{r['tp'] * 1e3:.1f}", f"{r['dp'] * 1e3:.1f}", f"{r['error']:+.0%}"])
        lines.append("| " + " | ".join(cells) + " |")
    pred, meas = [r["pred"] for r in rows], [r["meas"] for r in rows]
    best = min(range(len(rows)), key=lambda i: pred[i])
    fastest = sorted(range(len(rows)), key=lambda i: meas[i])[:2]
    med = float(np.median([abs(r["error"]) for r in rows]))
    rho = spearman(pred, meas)
    verdict = (f"Median |error| {med:.0%}; Spearman's rank correlation {rho:+.2f}; best predicted "
               f"({rows[best]['lay'].name()}) is {'' if best in fastest else 'NOT '}among the two fastest measured "
               f"({'; '.join(rows[i]['lay'].name() for i in fastest)}).")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shown = os.path.relpath(hw_name, root) if os.path.isabs(hw_name) else hw_name   # (no machine paths)
    setup = (f"Model: {MODEL}, batch {BATCH}, {DTYPE}, {OPTIMIZER}, 1F1B, m = 2 pp micro-batches; hardware file "
             f"{shown}. Measured: median over {rounds} alternating rounds of {steps} steps, the slowest rank; "
             f"'meas. tp/dp': time in tp and dp collectives (StepInfo). Run: `mpirun -n 8 python "
             f"benchmarks/plan_this_machine.py --rounds {rounds} --steps {steps}`, {wall:.0f} s.")
    summary = [verdict, "", setup]
    return "\n".join(lines + [""] + summary) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="mpirun -n 8 python benchmarks/plan_this_machine.py", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds over the layouts (default 4)")
    ap.add_argument("--steps", type=int, default=3, help="steps timed per layout per round (default 3)")
    ap.add_argument("--hw", default="this-machine", help="the hardware file or name (default this-machine)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "plan_this_machine.md"))
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    if world.Get_size() != 8:
        print("run on 8 ranks: mpirun -n 8 python benchmarks/plan_this_machine.py", file=sys.stderr)
        return 2
    say = (lambda s="": print(s, flush=True)) if world.Get_rank() == 0 else (lambda s="": None)
    t_start = time.perf_counter()
    hw = load(args.hw)
    lays = [layout(*f) for f in factorizations(world.Get_size())]
    say(f"plan_this_machine: {len(lays)} layouts, {MODEL}, batch {BATCH}; hardware {hw.source}")
    tune_allocator()
    with threadpool_limits(1):
        measured = measure(world, lays, args.rounds, args.steps, say)
    if world.Get_rank() != 0:
        return 0
    rows = []
    for lay in lays:
        e = evaluate(MODEL, BATCH, lay, hw, impl="hsgd", dtype=DTYPE, optimizer=OPTIMIZER)
        parts = e.time.parts()
        parts["dp"] += parts.pop("zero-3 gather") + parts.pop("cp")                  # (both 0 here)
        meas, tp, dp = measured[lay]
        rows.append({"lay": lay, "pred": e.time.total, "parts": parts, "meas": meas, "tp": tp, "dp": dp,
                     "error": e.time.total / meas - 1})
    text = table(rows, hw.source, args.rounds, args.steps, time.perf_counter() - t_start)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(f"# The planner against hsgd on this machine (8 ranks)\n\n{text}")
    print(text, flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
