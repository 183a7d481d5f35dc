"""Mixture of experts on 8 ranks, float64: layouts of dp x pp x cp x tp (and ep, the experts split over ranks folded
out of dp x cp; ep = 2, 4, 8, the tokens sent to their experts' ranks by all-to-all) end three steps with serial
SGD's parameters and losses (cross-entropy, balance loss and z-loss), where serial counts as the layout does: its
balance loss over the layout's micro-batches (or sequences, or the global batch), each rank's rows routed together with
their own capacity (hsgd.ep.layout.capacity_groups). The model: llama's block with 4 experts, top-2, in blocks 0
and 2 of 4 (blocks 1 and 3 dense), a capacity factor of 1.0 (slots are dropped), the balance loss (alpha 0.1) and the
z-loss (beta 0.01); one layout with GELU experts and biases, one with auxiliary-loss-free balancing. Each layout also
routes the same slots to the same experts and drops the same ones as serial (the kept slots per expert, summed over
the ranks, equal serial's in every step), and every rank's bytes on every communicator equal step_formula's (the
all-to-all's from the step's routing histogram, hsgd.ep.dispatch.all_to_all_formula). Clipping by the global norm
with experts split over ranks (each counted once: hsgd.dp.folded); with ep > 1 the plain exchange (FoldedExchange) and
ZeRO 1, 2, 3, --dp-overlap, --dp-staleness 1, --hierarchical and hybrid sharding (PairedExchange: the dense part over
dp_comm, the experts' over edp_comm)."""
from dataclasses import replace

import numpy as np
import pytest
from mpi4py import MPI

from hsgd.accounting.traffic import step_formula
from hsgd.dp.average import replica_divergence
from hsgd.ep.layout import capacity_groups
from hsgd.model.config import ModelConfig
from hsgd.model.data import Corpus
from hsgd.tp import shards as tp_shards

from .conftest import WORLD, check, float64_config, say, world_max

pytestmark = pytest.mark.mpi(min_size=8)

CFG = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=4, d_ff=16, arch="llama",
                  moe_experts=4, moe_every=2, moe_capacity_factor=1.0, moe_balance=0.1, moe_z_loss=0.01)
CORPUS = Corpus(np.random.default_rng(2).integers(0, 256, 4000, dtype=np.uint8).tobytes(), "random bytes", 16)

LAYOUTS = [  # (dp, pp, cp, tp), settings, model fields
    ((8, 1, 1, 1), dict(zero=3), dict(moe_balance_domain="global")),
    ((2, 1, 1, 4), dict(micro_batches=2, zero=1), dict(arch="gpt2", moe_every=1)),
    ((1, 2, 2, 2), dict(micro_batches=2, tp_scheme="sequence"), dict(moe_balance_domain="sequence")),
    ((2, 2, 1, 2), dict(micro_batches=2, tp_scheme="gather", schedule="interleaved", virtual_stages=2,
                        recompute="full", zero=2), {}),
    ((1, 4, 2, 1), dict(micro_batches=4, schedule="zb-h1", recompute="selective"), {}),
    ((2, 1, 4, 1), dict(cp_scheme="allgather", zero=3), dict(moe_bias_rate=0.05)),
    ((8, 1, 1, 1), dict(ep=8, dp_overlap=True), dict(moe_experts=8, moe_balance_domain="global")),
    ((2, 1, 2, 2), dict(ep=4, micro_batches=2, clip=0.01, zero=1), {}),
    ((4, 1, 1, 2), dict(ep=4, micro_batches=2, clip=0.01, zero=3), dict(moe_balance_domain="sequence")),
    ((2, 2, 2, 1), dict(ep=4, micro_batches=2, zero=2), {}),
    ((4, 1, 1, 2), dict(ep=2, dp_staleness=1), {}),
    ((8, 1, 1, 1), dict(ep=2, hierarchical=True, ranks_per_node=4), {}),
    ((4, 1, 1, 2), dict(ep=2, zero=3, hierarchical=True, ranks_per_node=2, micro_batches=2, clip=0.01), {}),
    ((4, 2, 1, 1), dict(ep=2, micro_batches=2, schedule="zb-h1"), dict(moe_bias_rate=0.05)),
    ((1, 2, 4, 1), dict(ep=4, micro_batches=2, recompute="full", tp_scheme="sequence"),
     dict(moe_balance_domain="sequence")),
]


def serial_run(cfg, tc):
    """Serial SGD counted as the layout tc counts (rank 0 computes, every rank receives): (params, routing)."""
    from hsgd.model import serial
    if WORLD.Get_rank() == 0:
        state = {}
        groups = capacity_groups(tc.batch_size, cfg.seq_len, tc.dp, tc.micro_batches, tc.cp)
        params, losses = serial.sgd(cfg, tc, lambda step: CORPUS.batch(tc.seed, step, tc.batch_size),
                               micro_sequences=tc.batch_size // (tc.dp * tc.micro_batches), capacity_groups=groups,
                               moe_state=state, delayed=bool(tc.dp_staleness))
        out = (params, state["routing"], state["biases"], losses)
    return WORLD.bcast(out if WORLD.Get_rank() == 0 else None)


def kept_per_step(trainer, grid):
    """{prefix: (E,) kept slots} of the last step, summed over the ranks that route other rows (dp x cp; one tp
    rank, every stage)."""
    mine = {k: np.asarray(r["kept"]) for k, r in trainer.stage.routing.items()} if grid.tp_rank == 0 else {}
    total = {}
    for part in WORLD.allgather(mine):
        for k, v in part.items():
            total[k] = total.get(k, 0) + v
    return total


@pytest.mark.parametrize("layout, kw, fields", LAYOUTS, ids=[f"dp{d}-pp{p}-cp{c}-tp{t}" for (d, p, c, t), _, _
                                                               in LAYOUTS])
def test_layouts_with_experts_equal_serial_sgd(layout, kw, fields):
    check(*compare(layout, kw, fields))


def grid_layouts(n=8):
    """Every (dp, pp, cp, tp) of n ranks (pp up to CFG's 4 layers) with an ep in {2, 4, 8} that divides dp x cp."""
    return [((n // (p * c * t), p, c, t), ep) for p in (1, 2, 4) for c in (1, 2, 4, 8) for t in (1, 2, 4, 8)
            if n % (p * c * t) == 0 for ep in (2, 4, 8) if (n // (p * t)) % ep == 0]


def grid_settings(i, layout, ep):
    """The settings layout i runs with: schemes, recomputation, exchanges, schedules and balance domains in turn."""
    dp, pp, cp, tp = layout
    kw = dict(ep=ep, tp_scheme=("megatron", "gather", "sequence")[i % 3],
              recompute=("none", "selective", "full")[i % 3],
              micro_batches=2 if pp < 4 else 4, zero=i % 4)
    if i % 5 == 4:
        kw.update(zero=0, dp_overlap=True)
    if pp > 1:
        kw["schedule"] = ("1f1b", "gpipe", "zb-h1", "interleaved")[i % 4] if pp == 2 else ("1f1b", "zb-h1")[i % 2]
        if kw["schedule"] == "interleaved":
            kw["virtual_stages"] = 2
        if kw["schedule"] == "zb-h1":
            kw["zero"] = min(kw["zero"], 1)                      # (ZeRO 2, 3 release what W needs later)
    return kw, dict(moe_experts=8 if ep == 8 else 4, moe_balance_domain=("micro-batch", "sequence")[i % 2])


@pytest.mark.parametrize("i, layout, ep", [(i, L, ep) for i, (L, ep) in enumerate(grid_layouts())],
                         ids=[f"dp{d}-pp{p}-cp{c}-tp{t}-ep{ep}" for (d, p, c, t), ep in grid_layouts()])
def test_every_layout_of_8_ranks_with_ep_2_4_8_equals_serial_sgd(i, layout, ep):
    """The float64 grid: every dp x pp x cp x tp of 8 ranks with each ep in {2, 4, 8} that divides dp x cp (8
    experts where ep = 8), the settings taking turns (grid_settings): serial SGD's parameters and losses, the same
    routing and drops, the bytes of step_formula."""
    check(*compare(layout, *grid_settings(i, layout, ep)))


def compare(layout, kw, fields):
    """Train `layout` with settings kw and model fields for 3 float64 steps and compare with serial SGD counted as
    the layout counts: (ok, what differs), collective; rank 0 says one line."""
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer
    dp, pp, cp, tp = layout
    cfg = replace(CFG, **fields) if "arch" not in fields else ModelConfig(
        **{**{k: getattr(CFG, k) for k in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff",
                                          "moe_experts", "moe_capacity_factor", "moe_balance", "moe_z_loss")},
           **fields})
    tc = float64_config(steps=3, warmup=1, dp=dp, pp=pp, cp=cp, tp=tp, **kw)
    tc.validate()
    ref, routing, biases, losses = serial_run(cfg, tc)
    grid = ProcessGrid(WORLD, dp=dp, pp=pp, tp=tp, cp=cp, ep=tc.ep)
    trainer = HybridTrainer(cfg, grid, tc)
    same_routing, loss_err = True, 0.0
    for step in range(1, tc.steps + 1):
        before = grid.stats.counts()
        info = trainer.step(*CORPUS.batch(tc.seed, step, tc.batch_size), step)
        loss_err = max(loss_err, abs(info.loss - losses[step - 1]) / losses[step - 1])
        per_step = grid.stats.since(before)
        kept = kept_per_step(trainer, grid)
        same_routing &= all(np.array_equal(kept[k], routing[step - 1][k]["kept"]) for k in routing[step - 1])
    trainer.finish()
    mine = trainer.exchange.full_params()
    err = world_max(max(float(np.abs(p - tp_shards.shard(ref[n], n, grid.tp_rank, grid.tp, tc.tp_scheme, cfg)).max()
                              / max(np.abs(ref[n]).max(), 0.02)) for n, p in mine.items()))
    replicas = WORLD.allgather(replica_divergence(trainer.exchange, grid.dp_comm) if tc.zero < 3 else None)
    formula = step_formula(cfg, tc, trainer)
    same = WORLD.allreduce(per_step == formula, op=MPI.LAND)
    if not same:
        say(f"measured {per_step}\nformula  {formula}")
    moved = 0.0
    if cfg.moe_bias_rate:
        moved = world_max(max(float(np.abs(trainer.stage.biases[k] - b).max()) for k, b in biases.items()
                              if k in trainer.stage.biases))
        moved = max(moved, 0.0) if all(np.abs(b).max() > 0 for b in biases.values()) else 1.0
    dropped = sum(int(r[k]["dropped"]) for r in routing for k in r)
    say(f"experts dp={dp} pp={pp} cp={cp} tp={tp} {kw} {fields}: max param rel err vs serial {err:.1e}, loss "
        f"(cross-entropy + balance + z) {loss_err:.1e}, kept per "
        f"expert equal to serial's in every step {same_routing} ({dropped} slots dropped in 3 steps), bytes == "
        f"formula {same}" + (f", selection biases vs serial {moved:.1e}" if cfg.moe_bias_rate else ""))
    trainer.free()
    grid.free()
    return (err <= 1e-10 and loss_err <= 1e-12 and same_routing and same and dropped > 0 and moved <= 1e-12
            and not any(replicas), f"{layout} {kw} {fields}: replicas differing {[r for r in replicas if r]}")


def test_an_expert_parallel_checkpoint_reshards_to_another_ep():
    """Saved after step 1 by dp 4 x tp 2 with ep 4 and ZeRO 1 (one expert per rank, each saved once:
    shard-pp0-tp{t}-ep{r}), resumed by dp 2 x pp 2 x tp 2 with ep 2 and ZeRO 3 for steps 2 and 3: serial SGD's
    parameters after 3 steps, with the selection biases of auxiliary-loss-free balancing saved and restored (step 2
    routes with them). (No capacity and the global balance domain: serial then counts the same whatever the layout,
    so one serial run is the reference of both halves.)"""
    import os
    import tempfile
    from hsgd.checkpoint import store
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer
    cfg = replace(CFG, moe_capacity_factor=None, moe_balance_domain="global", moe_bias_rate=0.05)
    tc = float64_config(steps=3, warmup=1, dp=4, tp=2, ep=4, zero=1)
    ref, _, _, _ = serial_run(cfg, tc)
    folder = WORLD.bcast(tempfile.mkdtemp() if WORLD.Get_rank() == 0 else None)
    grid = ProcessGrid(WORLD, dp=4, tp=2, ep=4)
    trainer = HybridTrainer(cfg, grid, tc)
    trainer.step(*CORPUS.batch(tc.seed, 1, tc.batch_size), 1)
    trainer.finish()
    path = store.save(trainer, 1, folder)
    trainer.free()
    grid.free()
    files = sorted(f for f in os.listdir(path) if f.endswith(".npz"))
    tc2 = replace(tc, dp=2, pp=2, tp=2, ep=2, zero=3)
    grid = ProcessGrid(WORLD, dp=2, pp=2, tp=2, ep=2)
    trainer = HybridTrainer(cfg, grid, tc2)
    step = store.load(trainer, store.open_checkpoint(path, cfg))
    for s in (2, 3):
        trainer.step(*CORPUS.batch(tc.seed, s, tc.batch_size), s)
    trainer.finish()
    mine = trainer.exchange.full_params()
    err = world_max(max(float(np.abs(p - tp_shards.shard(ref[n], n, grid.tp_rank, grid.tp, tc2.tp_scheme, cfg)).max()
                              / max(np.abs(ref[n]).max(), 0.02)) for n, p in mine.items()))
    say(f"saved by dp 4 x tp 2 ep 4 zero 1 after step {step} ({files}), resumed by dp 2 x pp 2 x tp 2 ep 2 zero 3: "
        f"max param rel "
        f"err vs serial after 3 steps {err:.1e}")
    check(step == 1 and err <= 1e-10 and files == [f"shard-pp0-tp{t}-ep{r}.npz" for t in range(2) for r in range(4)])
    trainer.free()
    grid.free()


@pytest.mark.parametrize("dtype, bug", [("bfloat16", None), ("float16", None), ("bfloat16", "experts-without-1/ep")])
def test_experts_in_bfloat16_and_float16_stay_inside_the_band(dtype, bug):
    """The tolerance oracle (hsgd.check.oracle) with experts split over ep = 2 ranks beside tp 1, 2, 4: each
    layout's gradient within the band that rounding explains (the experts' products, activations and input
    gradients rounded at their points, the router in float32), every layout exact in float64; with the experts'
    gradients not divided by ep the experts leave the band and the float64 runs are off by the factor (no capacity
    and the global domain: the oracle's one-rank reference counts as every layout does)."""
    import io
    from contextlib import nullcontext
    from hsgd.check.mutations import injected
    from hsgd.check.oracle import oracle
    from hsgd.check.verdict import report
    cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=8, n_layers=4, d_ff=16, arch="llama",
                      moe_experts=4, moe_every=2, moe_balance=0.1, moe_z_loss=0.01, moe_balance_domain="global")
    tc = float64_config(dtype=dtype, batch_size=8, tp=1, dp=8, ep=2)
    layouts = [(8, 1, 1, 1), (2, 1, 1, 4), (4, 1, 1, 2)]
    with injected(bug) if bug else nullcontext():
        verdict = oracle(cfg, tc, layouts, 1, WORLD, CORPUS, 0)
    ok = None
    if WORLD.Get_rank() == 0:
        out = io.StringIO()
        passed = report(verdict, tc, cfg, WORLD.Get_size(), out, 0)
        r = max(verdict.rows(), key=lambda r: max(r[3] / r[4], r[6] / r[7]))
        ratio, exact = max(r[3] / r[4], r[6] / r[7]), max(verdict.exact.values())
        say(f"experts {dtype}{' with ' + bug if bug else ''}: largest observed/band {ratio:.2f} ({r[0]} {r[1]}); "
            f"float64 runs within {exact:.1e} of the reference; {out.getvalue().splitlines()[-1][:160]}")
        ok = (passed and ratio < 1 and exact < 1e-12) if bug is None else \
            (not passed and ".experts." in r[1] and abs(exact - 1.0) < 1e-9)
    check(WORLD.bcast(ok), "the oracle's verdict on experts")


def test_verify_counts_as_the_layout_counts():
    """hsgd.verify with experts (capacity 1.0, the micro-batch domain, ep 2 beside tp 2 with 2 micro-batches): its
    serial reference counts as the layout does, so every parameter passes in float64, experts included."""
    import io
    from hsgd.verify import verify
    tc = float64_config(dp=4, tp=2, ep=2, micro_batches=2)
    ok, rows = verify(CFG, tc, WORLD, out=io.StringIO())
    if WORLD.Get_rank() == 0:
        worst = max(rows, key=lambda r: r[5])
        say(f"verify with experts: {len(rows)} parameters, largest relative error {worst[5]:.1e} ({worst[0]})")
        ok = ok and any(".moe.experts.3." in r[0] for r in rows)
    check(WORLD.bcast(ok), "hsgd.verify with experts")
