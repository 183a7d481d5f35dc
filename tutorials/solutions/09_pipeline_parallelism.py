"""Solutions to the exercises of chapter 9 (tutorials/09_pipeline_parallelism.py).

    mpirun -n 4 python tutorials/solutions/09_pipeline_parallelism.py

Four ranks form one pipeline of 4 stages (pp = 4, tp = dp = 1), as in the chapter. Exercises 1 and the first half of
2 and 3 are pure arithmetic (every rank computes the same numbers, and checks them collectively); the rest run real
steps of `HybridTrainer` on the pipeline. float64, the chapter's toy model.
"""
# mpirun -n 4 python tutorials/solutions/09_pipeline_parallelism.py
import os
import sys
import time

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, rel_err, solve, train_config  # noqa: E402

from hsgd.model.config import ModelConfig  # noqa: E402
from hsgd.model import serial
from hsgd.tp import model as tp_model
from hsgd.model.data import Corpus  # noqa: E402
from hsgd.grid.process_grid import ProcessGrid  # noqa: E402
from hsgd.step.trainer import HybridTrainer  # noqa: E402
from hsgd.accounting.activations import activation_bytes  # noqa: E402
from hsgd.pp.chunks import split_layers, stage_names  # noqa: E402
from hsgd.pp.schedules import build, simulate  # noqa: E402
from hsgd.run.report import fmt_bytes  # noqa: E402

threadpool_limits(1)                    # four ranks share the cores, tiny matrices: one BLAS thread each
PP = 4
world = MPI.COMM_WORLD
grid = ProcessGrid(world, dp=1, pp=PP, tp=1)
s = grid.pp_rank                        # my stage
cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=16, n_heads=4, n_layers=8, d_ff=64)   # the chapter's toy
corpus = Corpus.load(None, cfg.seq_len)


def config(**kw):
    """The chapter's float64 run: SGD with momentum, B = 16, m = 8, seed 0."""
    return train_config(**{**dict(dp=1, pp=PP, tp=1, steps=2, batch_size=16, micro_batches=2 * PP, seed=0), **kw})


def run(tc):
    """tc.steps steps of HybridTrainer on the pipeline; returns (trainer, seconds of each step)."""
    trainer = HybridTrainer(cfg, grid, tc)
    seconds = []
    for step in range(1, tc.steps + 1):
        world.Barrier()                                      # every stage starts the step together
        t0 = time.perf_counter()
        trainer.step(*corpus.batch(tc.seed, step, tc.batch_size), step)
        seconds.append(time.perf_counter() - t0)
    return trainer, seconds


# ---------------------------------------------------------------------------------------------------- exercise 1

def simulate_costs(kind, m, f, b):
    """hsgd.pp.schedules.simulate with a forward cost f[s] and a backward cost b[s] per stage: [[(action, start,
    end)] per stage]."""
    p = len(f)
    acts = [build(kind, m, p)[st] for st in range(p)]
    done, timeline, nxt, free = {}, [[] for _ in range(p)], [0] * p, [0.0] * p
    while any(nxt[st] < len(acts[st]) for st in range(p)):
        for st in range(p):
            if nxt[st] == len(acts[st]):
                continue
            a, j = acts[st][nxt[st]].kind, acts[st][nxt[st]].mb                  # an Action (kind, mb, chunk)
            need = (("F", st - 1, j) if st > 0 else None) if a == "F" else \
                (("B", st + 1, j) if st < p - 1 else ("F", st, j))
            if need is not None and need not in done:
                continue
            start = max(free[st], done[need] if need else 0.0)
            done[a, st, j] = free[st] = start + (f[st] if a == "F" else b[st])
            timeline[st].append((f"{a}{j}", start, free[st]))
            nxt[st] += 1
    return timeline


def slot_table(kind, m, p, f=1, b=2):
    """The step as a table: rows[s] = list of slots, each None (idle) or "F j" / "B j": simulate_costs (below) with
    whole-slot costs, every action in the schedule's order at the first slot where its stage is free and its input
    exists; each action fills the slots from its start to its end."""
    timeline = simulate_costs(kind, m, [f] * p, [b] * p)
    slots = int(max(e for stage in timeline for _, _, e in stage))
    rows = [[None] * slots for _ in range(p)]
    for st, stage in enumerate(timeline):
        for name, start, end in stage:
            rows[st][int(start):int(end)] = [name] * int(end - start)
    return rows, timeline


def exercise_1(check):
    """The bubble from a table of time slots."""
    worst_ours = worst_megatron = worst_sim = 0.0
    for p in range(2, 7):
        for m in range(1, 2 * p + 1):
            for kind in ("gpipe", "1f1b"):
                rows, mine = slot_table(kind, m, p)
                idle = sum(cell is None for row in rows for cell in row)
                busy = sum(cell is not None for row in rows for cell in row)
                worst_ours = max(worst_ours, abs(idle / (p * len(rows[0])) - (p - 1) / (m + p - 1)))
                worst_megatron = max(worst_megatron, abs(idle / busy - (p - 1) / m))
                sim = simulate(build(kind, m, p), m, costs=(1.0, 2.0, 0.0))
                same_actions = [[str(a) for a, _, _ in row] for row in sim] == [[a for a, _, _ in row] for row in mine]
                worst_sim = max(worst_sim, float("inf") if not same_actions else
                                max(abs(e - e_mine) for st in range(p)
                                    for (_, _, e), (_, _, e_mine) in zip(sim[st], mine[st])))
    rows, _ = slot_table("1f1b", 4, 4)
    check.say("1F1B, m = 4, p = 4, two characters per slot ('..' idle):")
    for st, row in enumerate(rows):
        check.say(f"  stage {st} |" + "".join(".." if c is None else c for c in row) + "|")
    check("p = 2..6, m = 1..2p: idle/(p x slots) - (p-1)/(m+p-1)", worst_ours, 1e-12)
    check("p = 2..6, m = 1..2p: idle/busy - (p-1)/m", worst_megatron, 1e-12)
    check("every action ends in the slot where hsgd.pp.schedules.simulate ends it", worst_sim, 1e-12)


# ---------------------------------------------------------------------------------------------------- exercise 2

def one_f_one_b(m, p, st):
    """Stage st's 1F1B: min(p-st-1, m) warm-up forwards, then F and B in turn, then the remaining backwards."""
    warm = min(p - st - 1, m)
    acts = [("F", j) for j in range(warm)]
    for j in range(m - warm):
        acts += [("F", warm + j), ("B", j)]
    return acts + [("B", j) for j in range(m - warm, m)]


def held(actions):
    """Micro-batches forwarded and not yet backwarded, after each action (("F", j) pairs, or pp's Actions)."""
    out, live = [], 0
    for a in actions:
        live += 1 if a[0] == "F" else -1
        out.append(live)
    return out


def exercise_2(check):
    """What GPipe and 1F1B hold."""
    check.holds("my 1F1B == build('1f1b'), p <= 6, m <= 12, every stage",
                all(one_f_one_b(m, p, st) == [(a.kind, a.mb) for a in build("1f1b", m, p)[st]]
                    for p in range(1, 7) for m in range(1, 13) for st in range(p)))
    check.holds("peak held: GPipe m, 1F1B min(p - s, m), p <= 6, m <= 12",
                all(max(held(build("gpipe", m, p)[st])) == m and max(held(one_f_one_b(m, p, st))) == min(p - st, m)
                    for p in range(1, 7) for m in range(1, 13) for st in range(p)))
    m = 2 * PP
    tc = config()
    idx, targets = corpus.batch(tc.seed, 1, tc.batch_size // m)            # one micro-batch, (B/m, T)
    layers = split_layers(cfg.n_layers, PP)[s]
    first, last = s == 0, s == PP - 1
    full = serial.init_params(cfg, seed=0, dtype="float64")
    params = {n: full[n] for n in stage_names(cfg, layers, first, last)}
    inp = idx if first else np.random.default_rng(s).standard_normal((len(idx), cfg.seq_len, cfg.d_model))
    _, caches = tp_model.stage_forward(params, inp, targets, tp_model.Piece(layers, first, last),
                                       tp_model.TPSetup(cfg, grid.tp_comm, "megatron"))
    one = activation_bytes(caches, params)                                # bytes one micro-batch keeps alive
    peaks = {kind: max(held(build(kind, m, PP)[s])) for kind in ("gpipe", "1f1b")}
    check.say(f"m = {m}: stage  one micro-batch  GPipe peak          1F1B peak")
    for st, (b1, pk) in enumerate(grid.pp_comm.allgather_obj((one, peaks))):
        check.say(f"{st:>12}  {fmt_bytes(b1):>14}  {pk['gpipe']} x = {fmt_bytes(pk['gpipe'] * b1):>9}   "
                  f"{pk['1f1b']} x = {fmt_bytes(pk['1f1b'] * b1):>9}")
    measured = {kind: run(config(schedule=kind, steps=1))[0].stage.peak_held for kind in ("gpipe", "1f1b")}
    check.equal("Stage.peak_held after a real step == my peak, both schedules", measured, peaks)


# ---------------------------------------------------------------------------------------------------- exercise 3

def gpipe_step(f, b, m):
    """The length of a GPipe step with per-stage costs: two flows of m identical jobs through the stages."""
    return sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b)


def stage_costs(cfg, split):
    """Each stage's matmul FLOPs per sequence and step, in blocks: its blocks, plus the LM head on the last stage
    (ModelConfig.step_flops, as in the chapter's section 7)."""
    head = 6 * cfg.seq_len * cfg.d_model * cfg.vocab_size
    block = (cfg.step_flops(1) - head) / cfg.n_layers
    return [n + (head / block) * (i == len(split) - 1) for i, n in enumerate(split)]


def exercise_3(check):
    """An unbalanced split."""
    rng = np.random.default_rng(3)
    worst = 0.0
    for p, m in ((2, 3), (4, 8), (5, 2), (6, 12)):
        f = rng.uniform(0.5, 2.0, p)
        b = 2 * f * rng.uniform(0.8, 1.2, p)
        span = max(e for stage in simulate_costs("gpipe", m, f, b) for _, _, e in stage)
        worst = max(worst, abs(span - gpipe_step(f, b, m)) / span)
    check("GPipe with random stage costs: simulated step - closed form", worst, 1e-12)
    equal = simulate_costs("1f1b", 8, [1.0] * PP, [2.0] * PP)
    check.holds("equal costs: my simulation == hsgd.pp.schedules.simulate (1F1B, m = 8)",
                equal == [[(str(a), t0, t1) for a, t0, t1 in row]
                         for row in simulate(build("1f1b", 8, PP), 8, costs=(1.0, 2.0, 0.0))])
    m, split = 2 * PP, [5, 1, 1, 1]
    predicted = {}
    for label, sp in (("2,2,2,2", [2, 2, 2, 2]), ("5,1,1,1", split)):
        c = stage_costs(cfg, sp)
        predicted[label] = gpipe_step([x / 3 for x in c], [2 * x / 3 for x in c], m)   # f : b_c = 1 : 2
        check.say(f"split {label}: stage costs in blocks {' '.join(f'{x:.2f}' for x in c)}; "
                  f"GPipe step {predicted[label]:.2f} block-times")
    even, t_even = run(config(schedule="gpipe"))
    uneven, t_uneven = run(config(schedule="gpipe", pp_split="5,1,1,1"))
    check.equal("my stage's blocks == split_layers(8, 4, [5, 1, 1, 1])[s]",
                list(uneven.stage.layers), list(split_layers(cfg.n_layers, PP, split)[s]))
    a, b = even.full_params(), uneven.full_params()
    check("splits 2,2,2,2 and 5,1,1,1 after 2 steps: parameters", max(rel_err(b[n], a[n], floor=0.02) for n in a),
          1e-12)
    check.say(f"predicted step 5,1,1,1 / 2,2,2,2: {predicted['5,1,1,1'] / predicted['2,2,2,2']:.2f}; measured "
              f"(step 2): {t_uneven[-1] / t_even[-1]:.2f} (noisy on shared cores, and Python's fixed cost per "
              f"call weighs as much as the FLOPs at this size)")


# ---------------------------------------------------------------------------------------------------- exercise 4

def pp_bytes(st, p, m, batch, T, C, itemsize=8):
    """{(comm, op): (calls, bytes)} of one step on pp_comm for stage st: per micro-batch of batch/m sequences, an
    activation out and a gradient in towards st+1, a gradient out and an activation in towards st-1."""
    neighbours = (st > 0) + (st < p - 1)
    msg = batch // m * T * C * itemsize                       # one (B/m, T, C) array
    calls = m * neighbours
    return {("pp", "Isend"): (calls, calls * msg), ("pp", "Recv"): (calls, calls * msg)}


def exercise_4(check):
    """The bytes between the stages."""
    B, per_m = 16, {}
    for m in (1, 2, 4, 8):
        trainer = HybridTrainer(cfg, grid, config(micro_batches=m))
        before = grid.stats.counts()
        trainer.step(*corpus.batch(0, 1, B), 1)
        measured = {k: v for k, v in grid.stats.since(before).items() if k[0] == "pp"}
        check.equal(f"m = {m}: my stage's pp_comm calls and bytes == by hand", measured,
                    pp_bytes(s, PP, m, B, cfg.seq_len, cfg.d_model))
        per_m[m] = measured[("pp", "Isend")][1]
    check.equal("bytes sent per step: the same for m = 1, 2, 4, 8", len(set(per_m.values())), 1)
    pp_sent = max(grid.pp_comm.allgather_obj(per_m[1]))                   # the busiest (a middle) stage
    tp_payload = sum(n for _, n in tp_model.comm_formula(cfg, B, 8).values())
    ring = 2 * (PP - 1) / PP
    check.say(f"per rank and step, B = {B}: pipeline {fmt_bytes(pp_sent)} payload = {fmt_bytes(pp_sent)} sent; "
              f"tensor-parallel group of {PP}: {fmt_bytes(tp_payload)} payload, {fmt_bytes(ring * tp_payload)} sent "
              f"by each rank of a ring; ratios {tp_payload / pp_sent:.1f} and {ring * tp_payload / pp_sent:.1f}")


if __name__ == "__main__":
    solve(Checks(world, tol=1e-12, width=68), [exercise_1, exercise_2, exercise_3, exercise_4])
    grid.free()
