"""Solutions to the exercises of chapter 10 (tutorials/10_3d_parallelism.py).

    mpirun -n 8 python tutorials/solutions/10_3d_parallelism.py

Exercise 1 is arithmetic on the formulas (every rank computes the same numbers and checks them collectively);
exercises 2 to 5 build grids on the 8 ranks and run real steps or gradients. float64, the chapter's model.
"""
# mpirun -n 8 python tutorials/solutions/10_3d_parallelism.py
import math
import os
import sys

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, rel_err, ring_share, solve, train_config  # noqa: E402

from hsgd.model.config import ModelConfig  # noqa: E402
from hsgd.model import serial  # noqa: E402
from hsgd.model.optim import global_grad_norm  # noqa: E402
from hsgd.tp import model as tp_model, shards as tp_shards  # noqa: E402
from hsgd.model.data import Corpus  # noqa: E402
from hsgd.dp.average import FlatBuffer, check_batch  # noqa: E402
from hsgd.errors import ConfigError  # noqa: E402
from hsgd.grid.process_grid import ProcessGrid, factorizations  # noqa: E402
from hsgd.step.trainer import HybridTrainer  # noqa: E402
from hsgd.accounting.activations import activation_formula  # noqa: E402
from hsgd.pp.chunks import split_layers, stage_names  # noqa: E402
from hsgd.run.report import fmt_bytes  # noqa: E402

threadpool_limits(1)                    # eight ranks share the cores, tiny matrices: one BLAS thread each
world = MPI.COMM_WORLD
cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=8, n_layers=8, d_ff=64)   # the chapter's model
corpus = Corpus.load(None, cfg.seq_len)
S = 8                                   # bytes per float64


def by_hand(cfg, dp, pp, tp, batch, m, st, s=S):
    """{(comm, op): (calls, payload bytes)} one rank of stage st moves in one step: the closed forms of the
    chapter's section 2 (every call is counted, also on a one-rank communicator, where nothing moves)."""
    blocks = split_layers(cfg.n_layers, pp)[st]
    first, last, L_s, C = st == 0, st == pp - 1, len(blocks), cfg.d_model
    N = batch // dp // m * cfg.seq_len                                    # positions of a micro-batch
    out = {("tp", "Allreduce"): (m * (4 * L_s + first + 3 * last),                  # per micro-batch, times m
                                 m * (4 * L_s * C + first * C + last * (C + 3)) * N * s),
           ("dp", "Allreduce"): (1, tp_shards.shard_numel(cfg, tp, stage_names(cfg, blocks, first, last)) * s)}
    sends = m * ((not first) + (not last))
    if sends:
        out[("pp", "Isend")] = out[("pp", "Recv")] = (sends, sends * N * C * s)
    return out


def sent(f, sizes):
    """{comm: (payload, bytes a ring sends)} of one rank's formula dict (pp: its sends, not its receives)."""
    out = {}
    for (comm, op), (_, n) in f.items():
        if op != "Recv":
            payload, wire = out.get(comm, (0, 0.0))
            out[comm] = (payload + n, wire + n * float(ring_share(op, sizes[comm])))
    return out


def rank_memory(cfg, dp, pp, tp, batch, m, st, s=S):
    """Bytes one rank of stage st holds: parameters, gradients, momentum, and 1F1B's min(p - st, m) micro-batches
    of activations (the chapter's section 4)."""
    blocks = split_layers(cfg.n_layers, pp)[st]
    first, last = st == 0, st == pp - 1
    b = batch // dp // m
    N, C, Vp = b * cfg.seq_len, cfg.d_model, math.ceil(cfg.vocab_size / tp)
    act = (len(blocks) * activation_formula(cfg, b, s, tp, "megatron")["block"] + first * 9 * N
           + last * (N * (2 * C + 1) * s + N * Vp * s + 17 * N))
    return 3 * tp_shards.shard_numel(cfg, tp, stage_names(cfg, blocks, first, last)) * s + min(pp - st, m) * act


def groups(dp, pp, tp, rank_of):
    """{dim: [[ranks of one group]]}: the ranks that differ only in dim, numbered by rank_of(d, p, t)."""
    return {"tp": [[rank_of(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
            "pp": [[rank_of(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
            "dp": [[rank_of(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]}


# ---------------------------------------------------------------------------------------------------- exercise 1

def exercise_1(check):
    """16 ranks on 2 nodes of 8."""
    P, PER_NODE, B, m = 16, 8, 64, 4
    rows, refused = {}, []
    for dp, pp, tp in factorizations(P):
        try:
            tp_shards.check_tp(cfg, tp)
            split_layers(cfg.n_layers, pp)
            check_batch(B, dp, m)
        except ConfigError as e:
            refused.append(f"{dp} x {pp} x {tp}: {str(e).split(':')[0]}")
            continue
        sizes = {"dp": dp, "pp": pp, "tp": tp}
        per_stage = [sent(by_hand(cfg, dp, pp, tp, B, m, st), sizes) for st in range(pp)]
        g = groups(dp, pp, tp, lambda d, p, t: ProcessGrid.rank_of(d, p, t, pp, tp))
        across = [c for c in ("tp", "pp", "dp") if any(len({r // PER_NODE for r in grp}) > 1 for grp in g[c])]
        rows[dp, pp, tp] = dict(
            memory=max(rank_memory(cfg, dp, pp, tp, B, m, st) for st in range(pp)),
            wire=max(sum(w for _, w in f.values()) for f in per_stage),
            between=max(sum(f[c][1] for c in across if c in f) for f in per_stage),   # sent on crossing comms
            across=across)
    check.say(f"B = {B}, m = {m}; not possible with this model: " + "; ".join(refused))
    check.say(f"{'dp x pp x tp':>12} {'memory/rank':>11} {'sent/rank':>10} {'across nodes':>14} {'sent on them':>12}")
    for (dp, pp, tp), r in rows.items():
        check.say(f"{f'{dp} x {pp} x {tp}':>12} {fmt_bytes(r['memory']):>11} {fmt_bytes(r['wire']):>10} "
                  f"{', '.join(r['across']) or '-':>14} {fmt_bytes(r['between']):>12}")
    check.holds("tp stays inside a node exactly when tp divides 8",
                all(("tp" not in r["across"]) == (PER_NODE % tp == 0) for (_, _, tp), r in rows.items()))
    check.holds("hsgd's order: pp crosses exactly when pp x tp > 8 (pp > 1)",
                all(("pp" in r["across"]) == (pp > 1 and pp * tp > PER_NODE) for (_, pp, tp), r in rows.items()))
    check.holds("hsgd's order: dp crosses exactly when pp x tp <= 8 (dp > 1)",
                all(("dp" in r["across"]) == (dp > 1 and pp * tp <= PER_NODE) for (dp, pp, tp), r in rows.items()))
    budget = rows[2, 2, 4]["memory"]
    fits = {k: r for k, r in rows.items() if r["memory"] <= budget and "tp" not in r["across"]}
    best = min(fits, key=lambda k: (fits[k]["between"], fits[k]["wire"]))
    check.say(f"memory budget {fmt_bytes(budget)} (2 x 2 x 4): {len(fits)} layouts fit with tp inside a node; the "
              f"fewest bytes between nodes: {best[0]} x {best[1]} x {best[2]}, {fmt_bytes(fits[best]['between'])} "
              f"per rank and step on {', '.join(fits[best]['across']) or 'nothing'}")
    check.holds("the choice keeps tp inside a node and fits the budget",
                PER_NODE % best[2] == 0 and rows[best]["memory"] <= budget)


# ---------------------------------------------------------------------------------------------------- exercise 2

def exercise_2(check):
    """The bytes of another layout."""
    for dp, pp, tp in ((1, 4, 2), (4, 2, 1)):
        grid = ProcessGrid(world, dp=dp, pp=pp, tp=tp)
        tc = train_config(dp=dp, pp=pp, tp=tp, steps=2, batch_size=8, micro_batches=2, clip=1.0, seed=0)
        trainer = HybridTrainer(cfg, grid, tc)
        before = grid.stats.counts()
        trainer.step(*corpus.batch(tc.seed, 1, tc.batch_size), 1)
        measured = grid.stats.since(before)
        mine = by_hand(cfg, dp, pp, tp, tc.batch_size, tc.micro_batches, grid.pp_rank)
        sizes = {"dp": dp, "pp": pp, "tp": tp}
        report = world.allgather((grid.pp_rank, sent(mine, sizes)) if grid.dp_rank == 0 and grid.tp_rank == 0
                                 else None)
        check.say(f"{dp} x {pp} x {tp}, one step, per rank: payload / sent by a ring")
        for st, per in [r for r in report if r]:
            check.say(f"  stage {st}: " + "   ".join(
                f"{c}_comm {fmt_bytes(a)} / {fmt_bytes(w) if sizes[c] > 1 else '0 (one rank: nothing moves)'}"
                for c, (a, w) in sorted(per.items())))
        check.equal(f"{dp} x {pp} x {tp}: every rank's calls and payloads == by hand", measured, mine)
        trainer.free()
        grid.free()


# ---------------------------------------------------------------------------------------------------- exercise 3

def megatron_rank(d, p, t, dp, tp):
    """Megatron-LM's default order tp-cp-ep-dp-pp with cp = ep = 1: tp fastest, then dp, pp slowest."""
    return (p * dp + d) * tp + t


def megatron_coords(rank, dp, tp):
    """(d, p, t) of a rank in Megatron-LM's order."""
    return rank // tp % dp, rank // (tp * dp), rank % tp


def exercise_3(check):
    """Megatron-LM's numbering."""
    DP = PP = TP = 2
    P = DP * PP * TP
    coords = [megatron_coords(r, DP, TP) for r in range(P)]
    check.holds("Megatron-LM's order: coordinates <-> ranks, a bijection",
                sorted(set(coords)) == sorted((d, p, t) for d in range(DP) for p in range(PP) for t in range(TP))
                and all(megatron_rank(d, p, t, DP, TP) == r for r, (d, p, t) in enumerate(coords)))
    # the docstring's example: order tp-pp-dp, sizes 2-2-2 (hsgd's order, as it happens): dp groups
    docstring = groups(2, 2, 2, lambda d, p, t: (d * 2 + p) * 2 + t)["dp"]
    check.equal("order tp-pp-dp, 2-2-2: dp groups == the docstring's", docstring, [[0, 4], [1, 5], [2, 6], [3, 7]])
    me = world.Get_rank()
    d, p, t = megatron_coords(me, DP, TP)
    base = world.Split(0, key=ProcessGrid.rank_of(d, p, t, PP, TP))         # my hsgd rank = my Megatron coords
    grid = ProcessGrid(base, dp=DP, pp=PP, tp=TP)
    want = groups(DP, PP, TP, lambda d, p, t: megatron_rank(d, p, t, DP, TP))
    mine = {dim: sorted(getattr(grid, f"{dim}_comm").allgather_obj(me)) for dim in ("tp", "pp", "dp")}
    check.equal("(dp_rank, pp_rank, tp_rank) == my Megatron-LM coordinates", (grid.dp_rank, grid.pp_rank, grid.tp_rank),
                (d, p, t))
    check.holds("my communicators' world ranks == Megatron-LM's groups", all(mine[k] in want[k] for k in mine))
    node = [r // 4 for r in range(P)]                                      # two nodes of 4 consecutive ranks
    across = {k: sum(len({node[r] for r in g}) > 1 for g in gs) for k, gs in want.items()}
    check.say(f"Megatron-LM's layout on nodes of 4: groups across nodes {across}")
    check.equal("Megatron-LM's layout: pp groups all cross nodes, tp and dp none", across,
                {"tp": 0, "pp": DP * TP, "dp": 0})
    tc = train_config(dp=DP, pp=PP, tp=TP, steps=2, batch_size=8, micro_batches=2, seed=0)
    batch = corpus.batch(tc.seed, 1, tc.batch_size)
    hsgd_grid = ProcessGrid(world, dp=DP, pp=PP, tp=TP)
    trainers = [HybridTrainer(cfg, g, tc) for g in (hsgd_grid, grid)]
    losses = [trainer.step(*batch, 1).loss for trainer in trainers]
    check.say(f"one step's loss: hsgd's layout {losses[0]:.12f}, Megatron-LM's {losses[1]:.12f}")
    check("loss in Megatron-LM's layout vs hsgd's", abs(losses[1] - losses[0]) / losses[0], 1e-12)
    for trainer, g in zip(trainers, (hsgd_grid, grid)):
        trainer.free()
        g.free()
    base.Free()


# ---------------------------------------------------------------------------------------------------- exercise 4

def exercise_4(check):
    """The global gradient norm in one All-Reduce over the world."""
    dp, tp, B = 4, 2, 8
    grid = ProcessGrid(world, dp=dp, tp=tp)
    trainer = HybridTrainer(cfg, grid, train_config(tp=tp, dp=dp, batch_size=B, seed=0))
    idx, targets = corpus.batch(0, 1, B)
    trainer.gradients(idx, targets)                            # averaged over dp_comm: the same on every replica
    weighted = 0.0
    for name, g in trainer.grads.items():
        copies = dp if trainer.is_sharded(name) else dp * tp   # how many ranks hold this very array
        weighted += float(np.sum(g * g)) / copies
    norm = math.sqrt(world.allreduce(weighted))                # one float over all 8 ranks
    _, grads_ref = serial.loss_and_grads(serial.init_params(cfg, 0, "float64"), idx, targets, cfg)
    serial_norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads_ref.values()))
    check.say(f"  one All-Reduce over the world: {norm:.12f}; serial: {serial_norm:.12f}")
    check("norm, one world All-Reduce vs serial", abs(norm - serial_norm) / serial_norm, 1e-12)
    check("norm, one world All-Reduce vs global_grad_norm",
          abs(norm - global_grad_norm(trainer.grads, trainer.norm_weight, grid.tp_comm)) / serial_norm, 1e-12)
    trainer.free()
    grid.free()


# ---------------------------------------------------------------------------------------------------- exercise 5

def exercise_5(check):
    """Unequal slices: the weighted average."""
    dp, tp = 4, 2
    sizes = [3, 3, 2, 2]                                       # rows per group
    B, starts = sum(sizes), np.cumsum([0] + sizes)
    grid = ProcessGrid(world, dp=dp, tp=tp)
    full = serial.init_params(cfg, 0, "float64")
    local = tp_shards.shard_params(full, grid.tp_rank, tp)
    idx, targets = corpus.batch(0, 1, B)
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
    solve(Checks(world, tol=1e-12, width=68), [exercise_1, exercise_2, exercise_3, exercise_4, exercise_5])
