"""Pipeline schedules as data on 8 ranks, float64: every schedule (GPipe, 1F1B, interleaved with v = 2 chunks,
ZB-H1) on every factorization of 8 with pp > 1 ends several steps with serial SGD's parameters, bit-identical to
each other; every stage's bytes (pp_comm included) equal the formulas; the stages hold the pairs their lists
promise; the B/W split works in all three tensor-parallel schemes; checkpoints reshard between schedules."""

import numpy as np
import pytest
from mpi4py import MPI

from hsgd.checkpoint import store as checkpoint
from hsgd.grid.process_grid import ProcessGrid, factorizations
from hsgd.step.trainer import HybridTrainer
from hsgd.pp.schedules import build
from hsgd.pp.timelines import peak_held
from hsgd.accounting.traffic import step_formula

from .conftest import WORLD, check, say, world_max
from .test_pipeline import CFG, CORPUS, config, param_err, run, serial_sgd

pytestmark = pytest.mark.mpi(min_size=8)


def schedules_for(pp):
    """(schedule, v) pairs a layout with pp stages allows on CFG's 8 layers (interleaving needs pp v <= 8)."""
    out = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)]
    return out + ([("interleaved", 2)] if 2 * pp <= CFG.n_layers else [])


@pytest.mark.parametrize("dp, pp, tp", [f for f in factorizations(8) if f[1] > 1])
def test_every_schedule_on_every_pipelined_layout(dp, pp, tp):
    m = max(pp, 4)                                                      # interleaving: a multiple of pp
    base = config(dp=dp, pp=pp, tp=tp, micro_batches=m, batch_size=dp * m * (2 if dp * m < 16 else 1))
    ref = serial_sgd(base)
    ok, first, lines = True, None, []
    for kind, v in schedules_for(pp):
        tc = config(**{**vars(base), "schedule": kind, "virtual_stages": v})
        grid, trainer, identical, per_step = run(tc)
        err = world_max(param_err(trainer, grid, ref))
        if first is None:                                              # every shard of the first schedule's
            first = {(t, n): p for mine in WORLD.allgather((grid.tp_rank, trainer.params)) for t, ps in [mine]
                     for n, p in ps.items()}
        diff = world_max(max(float(np.abs(p - first[grid.tp_rank, n]).max()) for n, p in trainer.params.items()))
        formula = step_formula(CFG, tc, trainer)
        promised = peak_held(build(kind, m, pp, v)[grid.pp_rank])
        good = err <= 1e-10 and diff == 0.0 and identical and per_step == formula and \
            trainer.stage.peak_held == promised
        lines.append(f"  {kind:<11} v={v}: max param rel err vs serial {err:.1e}, max diff to gpipe {diff:.1e}, "
                     f"bytes == formula {per_step == formula}, pairs held {trainer.stage.peak_held} (list: {promised})")
        ok &= WORLD.allreduce(good, op=MPI.LAND)
        trainer.free()
        grid.free()
    say(f"dp={dp} pp={pp} tp={tp}, m={m}, 3 steps:\n" + "\n".join(lines))
    check(ok)


@pytest.mark.parametrize("scheme", ["gather", "sequence"])
def test_the_split_backward_in_the_other_schemes(scheme):
    """The W pass of zb-h1 and the chunks of interleaving with the gather scheme (whose projections' weight
    gradients carry their bias) and the sequence scheme (T-shards between stages, partial replicated gradients)."""
    ok, lines = True, []
    for kind, v, (dp, pp, tp) in (("zb-h1", 1, (1, 4, 2)), ("interleaved", 2, (2, 2, 2))):
        tc = config(dp=dp, pp=pp, tp=tp, micro_batches=4, batch_size=8 * dp, schedule=kind, virtual_stages=v,
                    tp_scheme=scheme)
        ref = serial_sgd(tc)
        grid, trainer, identical, per_step = run(tc)
        err = world_max(param_err(trainer, grid, ref, scheme))
        same = per_step == step_formula(CFG, tc, trainer)
        lines.append(f"  {kind} v={v} dp={dp} pp={pp} tp={tp}: max param rel err vs serial {err:.1e}, bytes == "
                     f"formula {same}")
        ok &= err <= 1e-10 and identical and WORLD.allreduce(same, op=MPI.LAND)
        trainer.free()
        grid.free()
    say(f"{scheme}:\n" + "\n".join(lines))
    check(ok)


def test_the_overlapped_exchange_starts_each_bucket_after_its_last_backward():
    """--dp-overlap: a bucket's Iallreduce starts when its group is final, after its chunk's last B (interleaved)
    or last W (zb-h1), and the steps still equal serial SGD."""
    ok, lines = True, []
    for kind, v in (("zb-h1", 1), ("interleaved", 2)):
        tc = config(dp=2, pp=2, tp=2, micro_batches=4, batch_size=16, schedule=kind, virtual_stages=v,
                    dp_overlap=True)
        grid, trainer, identical, per_step = run(tc)
        err = world_max(param_err(trainer, grid, serial_sgd(tc)))
        buckets = per_step.get(("dp", "Iallreduce"), (0, 0))[0]
        lines.append(f"  {kind} v={v}: max param rel err vs serial {err:.1e}, Iallreduce calls {buckets} = groups "
                     f"{len(trainer.stage.groups())}")
        ok &= err <= 1e-10 and identical and buckets == len(trainer.stage.groups())
        trainer.free()
        grid.free()
    say("overlapped exchange:\n" + "\n".join(lines))
    check(ok)


def test_checkpoints_reshard_between_schedules(tmp_path_factory):
    """Save after 2 steps under one schedule and layout, resume for 2 more under another, across placements (hsgd.
    pp.placement): dualpipe (two copies, dp1 pp4 tp2; the checkpoint keeps the downward one) -> interleaved (v = 2,
    the loop, dp1 pp4 tp2) and interleaved (v = 2, dp2 pp2 tp2) -> zb-v (the V, dp1 pp4 tp2). The parameters equal
    4 uninterrupted serial steps."""
    tc = config(steps=4, micro_batches=4, batch_size=8)
    ref = serial_sgd(tc)
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("ckpt")) if WORLD.Get_rank() == 0 else None)
    ok, lines = True, []
    for i, (saved, resumed) in enumerate(((dict(schedule="dualpipe", micro_batches=8, dp=1, pp=4, tp=2),
                                           dict(schedule="interleaved", virtual_stages=2, dp=1, pp=4, tp=2)),
                                          (dict(schedule="interleaved", virtual_stages=2, dp=2, pp=2, tp=2),
                                           dict(schedule="zb-v", dp=1, pp=4, tp=2)))):
        first = config(**{**vars(tc), **saved})
        grid = ProcessGrid(WORLD, dp=first.dp, pp=first.pp, tp=first.tp)
        trainer = HybridTrainer(CFG, grid, first)
        for step in (1, 2):                                            # 2 of the 4 steps (the lr schedule's)
            trainer.step(*CORPUS.batch(first.seed, step, first.batch_size), step)
        trainer.finish()
        path = checkpoint.save(trainer, 2, f"{folder}/s{i}", keep=1)
        trainer.free()
        grid.free()
        second = config(**{**vars(tc), "virtual_stages": 1, **resumed})
        grid = ProcessGrid(WORLD, dp=second.dp, pp=second.pp, tp=second.tp)
        trainer = HybridTrainer(CFG, grid, second)
        checkpoint.load(trainer, checkpoint.open_checkpoint(path, CFG))
        for step in (3, 4):
            trainer.step(*CORPUS.batch(second.seed, step, second.batch_size), step)
        trainer.finish()
        err = world_max(param_err(trainer, grid, ref))
        lines.append(f"  {saved} -> {resumed}: max param rel err vs 4 serial steps {err:.1e}")
        ok &= err <= 1e-10
        trainer.free()
        grid.free()
    say("checkpoints between schedules:\n" + "\n".join(lines))
    check(ok)
