"""The planner's sizes-only formulas (hsgd.plan.layout) against the trainer on 8 ranks: for every factorization
dp x pp x tp of 8 (and cp layouts) and a covering set of options (ZeRO 0-3, overlapped, hierarchical and stale
exchanges, the three tp schemes, recomputation, micro-batches, gpipe / 1f1b / interleaved / zero-bubble schedules,
bfloat16 and float16), each rank's bytes per communicator equal hsgd.accounting.traffic.step_formula's and its
memory per category equals hsgd.accounting.step_memory.step_formula's, exactly; and on a few layouts the bytes equal
what CommStats measures in a training step (a DualPipe layout among them: two pieces a stage, its gradients sent to
the twin stage). (The trainer's formulas equal the measurements within the tolerances of tests/mpi/test_memory.py
and exactly in tests/mpi/test_hybrid.py, test_cp.py and test_pipeline.py.)"""
import numpy as np
import pytest

import hsgd

from hsgd.model.config import ModelConfig
from hsgd.accounting import step_memory
from hsgd.model.data import Corpus
from hsgd.errors import UsageError
from hsgd.grid.process_grid import ProcessGrid, factorizations
from hsgd.step.trainer import HybridTrainer
from hsgd.plan.layout import plan_rank
from hsgd.accounting.traffic import step_formula

from .conftest import WORLD, check, float64_config, say

pytestmark = pytest.mark.mpi(min_size=8)

CFG = ModelConfig(vocab_size=61, seq_len=16, d_model=16, n_heads=8, n_layers=8, d_ff=32)   # V % tp != 0
CORPUS = Corpus(np.random.default_rng(0).integers(0, 61, 4000, dtype=np.uint8).tobytes(), "random bytes", 16)

# every row on every factorization that accepts it (a row the settings refuse is skipped, the same on every rank)
OPTIONS = [dict(),
           dict(zero=1, tp_scheme="gather", micro_batches=2, recompute="selective"),
           dict(zero=2, tp_scheme="sequence", micro_batches=2, schedule="gpipe", recompute="full"),
           dict(zero=3, micro_batches=2, dtype="bfloat16", momentum=0.0),
           dict(dp_overlap=True, micro_batches=4, schedule="interleaved", virtual_stages=2),
           dict(dp_staleness=1, micro_batches=4, schedule="zb-h1", dtype="float16"),
           dict(hierarchical=True, ranks_per_node=2, tp_scheme="sequence", optimizer="adamw"),
           dict(zero=2, hierarchical=True, ranks_per_node=2, micro_batches=2)]


def settings(dp, pp, tp, cp=1, **opts):
    """A validated TrainConfig, or None where the settings refuse this layout."""
    try:
        tc = float64_config(**{**dict(tp=tp, pp=pp, cp=cp), **opts})
        tc.validate()
        tc.resolve_layout(WORLD.Get_size())
        hsgd.pp.schedules.check_pipeline(CFG.n_layers, tc)
        if tc.dp != dp:
            return None
        if tc.hierarchical and (tc.dp * tc.cp) % tc.ranks_per_node:
            return None
    except UsageError:
        return None
    return tc


def compare(tc, train=False):
    """(this rank's planned bytes == the trainer's, planned memory == the trainer's (or None), measured bytes of
    step 2 == planned (or None))."""
    grid = ProcessGrid(WORLD, dp=tc.dp, pp=tc.pp, tp=tc.tp, cp=tc.cp)
    trainer = HybridTrainer(CFG, grid, tc)
    plan = plan_rank(CFG, tc, tc.dp, tc.pp, tc.tp, tc.cp, grid.pp_rank)
    same_bytes = plan["bytes"] == step_formula(CFG, tc, trainer)
    same_memory = None
    if plan["memory"] is not None:
        mine = step_memory.step_formula(trainer)
        same_memory = plan["memory"]["peak"] == mine["peak"] and plan["memory"]["total"] == mine["total"]
    measured = None
    if train:
        for step in (1, 2):
            before = grid.stats.counts()
            idx, targets = CORPUS.batch(tc.seed, step, tc.batch_size)
            trainer.step(idx, targets, step)
        measured = grid.stats.since(before) == plan["bytes"]
    trainer.free()
    grid.free()
    return same_bytes, same_memory, measured


def test_every_factorization_of_8_and_option_equals_the_trainers_formulas():
    ran, memory_rows = [], 0
    for dp, pp, tp in factorizations(8):
        for i, opts in enumerate(OPTIONS):
            tc = settings(dp, pp, tp, **opts)
            if tc is None:
                continue
            same_bytes, same_memory, _ = compare(tc)
            check(same_bytes, f"dp{dp} pp{pp} tp{tp} {opts}: planned bytes differ from the trainer's")
            check(same_memory in (True, None), f"dp{dp} pp{pp} tp{tp} {opts}: planned memory differs")
            memory_rows += same_memory is not None
            ran.append((dp, pp, tp, i))
    say(f"{len(ran)} layouts x options: bytes equal on every rank; memory equal on the {memory_rows} with one "
        f"chunk per stage; factorizations covered {sorted({r[:3] for r in ran})}")
    check(len({r[:3] for r in ran}) == 10 and len(ran) >= 40, f"too few layouts ran: {ran}")


@pytest.mark.parametrize("layout", [(2, 1, 2, 2, "ring"), (1, 2, 2, 2, "allgather"), (1, 1, 8, 1, "ring")])
def test_context_parallel_layouts_equal_the_trainers_formulas(layout):
    dp, pp, cp, tp, scheme = layout
    tc = settings(dp, pp, tp, cp, cp_scheme=scheme, recompute="selective", micro_batches=2)
    check(tc is not None, f"{layout} refused")
    same_bytes, same_memory, _ = compare(tc)
    say(f"dp{dp} pp{pp} cp{cp} tp{tp} {scheme}: bytes equal {same_bytes}, memory equal {same_memory}")
    check(same_bytes and same_memory, f"{layout}: bytes {same_bytes} memory {same_memory}")


@pytest.mark.parametrize("opts", [dict(dp=2, pp=2, tp=2, zero=3, micro_batches=2),
                                  dict(dp=4, pp=1, tp=2, dp_overlap=True, tp_scheme="sequence"),
                                  dict(dp=1, pp=4, tp=2, micro_batches=4, schedule="interleaved", virtual_stages=2),
                                  dict(dp=2, pp=4, tp=1, micro_batches=8, schedule="dualpipe")])
def test_planned_bytes_equal_what_a_training_step_sends(opts):
    opts = dict(opts)
    tc = settings(opts.pop("dp"), opts.pop("pp"), opts.pop("tp"), **opts)
    check(tc is not None, f"{opts} refused")
    same_bytes, _, measured = compare(tc, train=True)
    say(f"{opts}: step 2's measured bytes on every communicator equal the plan's: {measured}")
    check(same_bytes and measured, f"{opts}: formula {same_bytes}, measured {measured}")
