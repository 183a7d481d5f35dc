"""Solutions to the exercises of chapter 11 (tutorials/11_memory.py).

    mpirun -n 8 python tutorials/solutions/11_memory.py

Each solution checks itself against the paper's numbers, against serial SGD, against hsgd's own formulas or
against what CommStats and the trainer measured; every check is collective, so a failure stops every rank at the
same point.
"""
# mpirun -n 8 python tutorials/solutions/11_memory.py
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from hsgd.model.config import ModelConfig  # noqa: E402  (hsgd before NumPy: OpenBLAS)
from hsgd.tp import hooks, shards as tp_shards
from hsgd.model import serial
from hsgd.accounting import step_memory

from contextlib import contextmanager  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from hsgd.model.data import Corpus  # noqa: E402
from hsgd.grid.process_grid import ProcessGrid  # noqa: E402
from hsgd.step.trainer import HybridTrainer  # noqa: E402
from hsgd.accounting.activations import activation_formula  # noqa: E402
from hsgd.accounting.traffic import step_formula  # noqa: E402
from hsgd.dp.sharded import ShardHooks  # noqa: E402
from hsgd.tp.schemes import make_scheme  # noqa: E402

import pictures  # noqa: E402  (on_rank0: the serial reference on rank 0, the others asleep)
from checks import Checks, rel_err, ring_share, solve, train_config  # noqa: E402

threadpool_limits(1)                    # eight ranks share the cores: one BLAS thread each
world = MPI.COMM_WORLD
P = 8
cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=8, n_layers=4, d_ff=128)   # chapter 11's model
SEED, B, S = 0, 8, 8
corpus = Corpus.load(None, cfg.seq_len)


def config(**kw):
    """Chapter 11's run: AdamW with weight decay and clipping, two steps, float64."""
    return train_config(**{**dict(dp=4, tp=2, steps=2, batch_size=B, optimizer="adamw", lr=0.01, weight_decay=0.1,
                                  clip=1.0, seed=SEED), **kw})


def serial_params(tc):
    """Serial AdamW's parameters after tc.steps steps (rank 0 computes while the others wait asleep, so that they
    leave it the cores; every rank gets them)."""
    ref = pictures.on_rank0(world, lambda: serial.sgd(cfg, tc, lambda st: corpus.batch(SEED, st, B))[0])
    return world.bcast(ref, root=0)


def shard_err(params, ref, g, scheme="megatron"):
    return max(rel_err(np.asarray(p), tp_shards.shard(ref[n], n, g.tp_rank, g.tp, scheme), floor=0.02)
               for n, p in params.items())


def exercise_1(check):
    """Table 2 at GPT-3's scale: the paper's claims, and what is left of them in hsgd's accounting."""
    s, b, h, a, t, L = 2048, 1, 12288, 96, 8, 96

    def paper(sp, sel, tt=t):                                   # Korthikanti et al. 2022, Table 2, per layer
        att = 0 if sel else 5 * a * s / (h * tt)
        return s * b * h * ((34 / tt if sp else 10 + 24 / tt) + att) if tt > 1 else s * b * h * (34 + att)

    def hsgd(shape, sp, sel, tt=t):                             # activation_formula, 2-byte elements
        T = shape.seq_len
        K = activation_formula(shape, b, 2, tt, "sequence" if sp else "megatron")["block"]
        return K - (2 * b * shape.n_heads * T * T // tt if sel else 0)

    gpt3 = ModelConfig(vocab_size=51200, seq_len=s, d_model=h, n_heads=a, n_layers=L, d_ff=4 * h)
    rows = {"tensor parallel": (False, False), "tensor + sequence": (True, False),
            "tensor + selective": (False, True), "tensor + sequence + selective": (True, True)}
    check.say(f"  {'GPT-3 175B, t = 8, 96 layers, b = 1':<34}{'paper (GB)':>12}{'hsgd (GB)':>12}")
    for name, (sp, sel) in rows.items():
        check.say(f"  {name:<34}{L * paper(sp, sel) / 1e9:>12.2f}{L * hsgd(gpt3, sp, sel) / 1e9:>12.2f}")
    saving = 1 - paper(False, True, 1) / paper(False, False, 1)          # no parallelism: probabilities' share
    factor = paper(False, False) / paper(True, True)
    check.say(f"  paper: selective saves {saving:.1%} of a layer without parallelism; sequence + selective needs "
              f"{factor:.2f}x less than tensor parallelism")
    check("paper: selective saves ~70% of the unparallelized layer", abs(saving - 0.70), 0.01)
    check.holds("paper: sequence + selective needs >= 5x less than tensor parallel", factor >= 5)
    h_saving = 1 - hsgd(gpt3, False, True, 1) / hsgd(gpt3, False, False, 1)
    h_factor = hsgd(gpt3, False, False) / hsgd(gpt3, True, True)
    check.say(f"  hsgd:  selective saves {h_saving:.1%}; sequence + selective needs {h_factor:.2f}x less")
    check.holds("hsgd keeps less per attention score (2 bytes vs 5): smaller saving, both below the paper's",
                h_saving < saving and h_factor < factor)
    # the shortest power-of-2 sequence at which selective saves >= half of hsgd's tensor-parallel row

    def sel_share(T):
        shape = ModelConfig(vocab_size=51200, seq_len=T, d_model=h, n_heads=a, n_layers=L, d_ff=4 * h)
        return 1 - hsgd(shape, False, True) / hsgd(shape, False, False)
    T = 2
    while sel_share(T) < 0.5:
        T *= 2
    check.say(f"  hsgd's tensor-parallel row: selective saves {sel_share(T // 2):.1%} at T = {T // 2}, "
              f"{sel_share(T):.1%} at T = {T}")
    check.holds(f"T = {T}: selective saves >= half, T = {T // 2} less", sel_share(T) >= 0.5 > sel_share(T // 2))


def exercise_2(check):
    """ZeRO-3 with a prefetch: the next layer gathered while this one computes."""

    class PrefetchHooks(ShardHooks):
        """ShardHooks that, on entering a group, also gather the next group (forward or backward order)."""

        def __init__(self, ex):
            super().__init__(ex)
            self.back = list(ex.sizes.layout)                    # backward order: head, h.3, ..., embedding
            self.fwd = self.back[::-1]
            self.gathers = 0

        def ensure(self, g):
            if g is not None and self.ex.groups[g][0] not in self.ex.params:
                self.ex.gather_group(g)
                self.gathers += 1

        def after(self, order, g):
            i = order.index(g)
            return order[i + 1] if i + 1 < len(order) else None

        @contextmanager
        def forward(self, group):
            self.ensure(group)
            self.ensure(self.after(self.fwd, group))             # prefetch: in flight while this group computes
            yield
            self.ex.free_group(group)

        @contextmanager
        def backward(self, group):
            self.ensure(group)
            self.ensure(self.after(self.back, group))
            self.ex.grad_bucket(group)
            yield
            self.ex.start_reduce_scatter(group)
            self.ex.free_group(group)

    class ParamMeter(hooks.Hooks):
        """Bytes of parameters the exchange holds at each group's exit, its chunks and the gathered groups, as the
        chapter's ExchangeMeter counts them (hsgd's memory probe measures the same, at ten times the cost)."""

        def __init__(self, ex):
            self.ex, self.hooks, self.peak = ex, self, 0            # HybridTrainer.hooks() runs probe.hooks last

        def held(self):
            owners = {}
            for a in [self.ex.master_] + list(self.ex.params.values()):
                while isinstance(a.base, np.ndarray):
                    a = a.base
                owners[id(a)] = a.nbytes
            return sum(owners.values())

        @contextmanager
        def forward(self, group):
            yield
            self.peak = max(self.peak, self.held())

        @contextmanager
        def backward(self, group):
            yield
            self.peak = max(self.peak, self.held())

    tc = config(zero=3)
    grid = ProcessGrid(world, dp=4, tp=2)
    tr = HybridTrainer(cfg, grid, tc)
    ex = tr.exchange
    ex.hooks = prefetch = PrefetchHooks(ex)
    meter = ParamMeter(ex)
    tr.probe = meter                                             # inside the prefetch's hooks: sees both groups
    tr.step(*corpus.batch(SEED, 1, B), 1)
    before = grid.stats.counts()
    tr.step(*corpus.batch(SEED, 2, B), 2)
    measured = grid.stats.since(before)
    peak = meter.peak
    cs = [ex.sizes.layout[g].c for g in prefetch.fwd]
    predicted = ex.master_.nbytes + S * ex.sizes.n * max(x + y for x, y in zip(cs, cs[1:]))
    plain = step_memory.step_formula(tr)["peak"]["params"]       # without the prefetch: one group at a time
    check.say(f"  parameters at the peak: prefetch {peak:,} B (predicted {predicted:,}), without {plain:,} "
              f"(step_memory): +{(peak - plain) / plain:.0%} for hiding each gather behind the layer before")
    check.equal("prefetch: measured parameter peak == chunks + two consecutive groups", peak, predicted)
    check.equal("without: step_memory.step_formula's == chunks + the largest group", plain,
                ex.master_.nbytes + S * ex.sizes.n * max(cs))
    check.equal("prefetch: 2 gathers per group and step, as without", prefetch.gathers, 2 * 2 * len(cs))
    check.equal("prefetch: step 2's bytes == traffic.step_formula (unchanged)", measured, step_formula(cfg, tc, tr))
    check("prefetch: parameters after 2 steps vs serial AdamW", shard_err(ex.full_params(), serial_params(tc), grid),
          1e-10)
    tr.free()
    grid.free()


def exercise_3(check):
    """Full recomputation's repeated collectives under the sequence scheme, by hand."""
    grid = ProcessGrid(world, dp=2, pp=2, tp=2)
    m, t = 2, 2
    b = B // 2 // m                                              # sequences per micro-batch
    N, C = b * cfg.seq_len, cfg.d_model
    steps = {}
    for rc in ("none", "full"):
        tc = config(dp=2, pp=2, tp=2, micro_batches=m, tp_scheme="sequence", recompute=rc)
        tr = HybridTrainer(cfg, grid, tc)
        tr.step(*corpus.batch(SEED, 1, B), 1)
        before = grid.stats.counts()
        tr.step(*corpus.batch(SEED, 2, B), 2)
        steps[rc] = grid.stats.since(before)
        n_blocks = len(tr.stage.layers)
        tr.free()
    # one block's forward: All-Gather along T into q, k, v and into fc, Reduce-Scatter out of both projections
    by_hand = {("tp", "Allgather"): (2, 2 * N * C * S), ("tp", "Reduce_scatter_block"): (2, 2 * N * C * S)}
    extra = {k: (steps["full"][k][0] - steps["none"][k][0], steps["full"][k][1] - steps["none"][k][1])
             for k in steps["full"] if k[0] == "tp"}
    extra = {k: v for k, v in extra.items() if v != (0, 0)}
    want = {k: (m * n_blocks * c, m * n_blocks * n) for k, (c, n) in by_hand.items()}
    for (comm, op), (calls, nbytes) in sorted(want.items()):
        check.say(f"  {comm} {op:<22} +{calls} calls, payload +{nbytes:,} B, ring per rank "
                  f"+{float(ring_share(op, t) * nbytes):,.0f} B per step")
    check.equal("by hand == the scheme's block_forward_formula",
                by_hand, make_scheme("sequence").block_forward_formula(cfg, b, S))
    check.equal("full minus none, measured on tp_comm == m x L_s x one block's forward", extra, want)
    grid.free()


def exercise_4(check):
    """Hybrid sharding: how many ranks per node."""
    grid = ProcessGrid(world, dp=8, tp=1)
    rows = {}
    for n in (8, 4, 2):
        kw = dict(zero=3) if n == 8 else dict(zero=3, hierarchical=True, ranks_per_node=n)
        tc = config(dp=8, tp=1, **kw)
        tr = HybridTrainer(cfg, grid, tc)
        sizes = [sum(int(np.prod(tr.shard_shapes[name])) for name in names) for names in tr.stage.groups().values()]
        cbar = sum(-(-k // n) for k in sizes)                    # my chunk of every group
        kept = {"params": S * cbar, "grads": S * cbar, "optimizer": 2 * S * cbar}
        psi = S * n * cbar                                       # the padded flat layout
        node = "dp" if n == 8 else "dp-node"
        moved = {(node, "Allgather"): (2 * len(sizes), 2 * psi), (node, "Ireduce_scatter_block"): (len(sizes), psi)}
        if n < 8:
            moved[("dp-cross", "Allreduce")] = (1, S * cbar)
        tr.step(*corpus.batch(SEED, 1, B), 1)
        before = grid.stats.counts()
        tr.step(*corpus.batch(SEED, 2, B), 2)
        measured = {k: v for k, v in grid.stats.since(before).items() if k[0].startswith("dp")}
        check.equal(f"n = {n}: trainer.memory() == the chunks by hand", tr.memory(), kept)
        check.equal(f"n = {n}: step 2's dp traffic == by hand", measured, moved)
        ring = {(c, op): float(ring_share(op, n if c != "dp-cross" else 8 // n) * nb)
                for (c, op), (_, nb) in moved.items()}
        across = sum(v for (c, _), v in ring.items() if c in ("dp", "dp-cross"))   # what crosses the nodes
        rows[n] = (sum(kept.values()), sum(ring.values()), across)
        tr.free()
    check.say(f"  {'ranks sharing':<14}{'kept between steps':>20}{'ring bytes per rank':>21}{'across nodes':>14}")
    for n, (mem, total, across) in rows.items():
        check.say(f"  {n:<14}{mem:>20,}{total:>21,.0f}{across:>14,.0f}")
    best = min(rows, key=lambda n: rows[n][2])
    check.say(f"  fewest bytes between nodes: n = {best}, at {rows[best][0] / rows[8][0]:.1f}x the memory of n = 8")
    # hybrid: a rank keeps 1/n and sends 2(k-1)/k of its owned chunk (1/n) over the k = 8/n nodes; larger nodes
    # win twice, and plain ZeRO-3 (all of its 3 Psi' crossing) loses on bytes what it wins on memory
    check.holds("memory: n = 2 > n = 4 > n = 8; bytes between nodes: n = 4 < n = 2 < n = 8",
                rows[2][0] > rows[4][0] > rows[8][0] and rows[4][2] < rows[2][2] < rows[8][2])
    grid.free()


if __name__ == "__main__":
    if world.Get_size() != P:
        raise SystemExit(f"run on {P} ranks: mpirun -n {P} python tutorials/solutions/11_memory.py"
                         if world.Get_rank() == 0 else 1)
    solve(Checks(world, tol=1e-10, width=74), [exercise_1, exercise_2, exercise_3, exercise_4])
