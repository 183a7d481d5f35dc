"""ZeRO 2 and 3 layer by layer, hybrid sharding and activation recomputation on 8 ranks, float64: every
factorization of 8 with --zero 3, --recompute selective, --recompute full and their combination ends three steps
with serial SGD's parameters (1e-10) and moves exactly the bytes of its formula; recomputation is bit-identical to
none in every layout (the three schemes in turn); checkpoints reshard between ZeRO stages 0, 1, 2 and 3.

Then checkpoints that must not go wrong quietly (here, so that one mpiexec start-up serves both): `--resume auto`
when the ranks see a shared folder differently (a node's NFS cache after a restart) is decided once, on rank 0, and
every rank follows it; a state that is not finite is never saved; a save that fails on one rank keeps the previous
checkpoint."""
import dataclasses
import os
import shutil
import tempfile

import numpy as np
import pytest
from hsgd.model.config import ModelConfig
from hsgd.checkpoint import store as checkpoint
from hsgd.tp import schemes as tp_schemes, shards as tp_shards
from hsgd.model.data import Corpus
from hsgd.grid.process_grid import ProcessGrid, factorizations
from hsgd.step.trainer import HybridTrainer
from hsgd.checkpoint.resume import resume
from hsgd.accounting.traffic import step_formula

from .conftest import WORLD, check, float64_config, say, serial_params, world_max

pytestmark = pytest.mark.mpi(min_size=8)

CFG = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=8, n_layers=8, d_ff=16)   # pp up to 8
SMALL = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=8, n_layers=2, d_ff=16)  # pp up to 2
CORPUS = Corpus(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes(), "random bytes", 8)


def blocks_for(pp):
    """The model for a layout with pp stages: 3 blocks per stage up to CFG's 8 (pp 1: 3, pp 2: 6, pp 4: 2 a stage,
    pp 8: 1), so that a stage holds a first, a middle and a last block wherever 8 blocks allow."""
    return dataclasses.replace(CFG, n_layers=min(CFG.n_layers, 3 * pp))


def config(**kw):
    return float64_config(**{**dict(steps=3, micro_batches=2, warmup=1, seed=5), **kw})


def run(tc, trainer=None, start=1, stop=None, cfg=CFG, grid=None):
    """Steps start..stop (default tc.steps) on a new trainer, on `grid` or a new grid of tc's layout (or on
    `trainer` and its grid). Returns (grid, trainer, this rank's parameters {name: tp shard}, the traffic of the
    last step)."""
    if trainer is None:
        grid = grid or ProcessGrid(WORLD, dp=tc.dp, pp=tc.pp, tp=tc.tp)
        trainer = HybridTrainer(cfg, grid, tc)
    grid, per_step = trainer.grid, None
    for step in range(start, (stop or tc.steps) + 1):
        before = grid.stats.counts()
        trainer.step(*CORPUS.batch(tc.seed, step, tc.batch_size), step)
        per_step = grid.stats.since(before)
    trainer.finish()
    return grid, trainer, {n: p.copy() for n, p in trainer.exchange.full_params().items()}, per_step


def param_err(params, grid, ref, scheme):
    return max(float(np.abs(p - tp_shards.shard(ref[n], n, grid.tp_rank, grid.tp, scheme)).max()
                     / max(np.abs(ref[n]).max(), 0.02)) for n, p in params.items())


# each variant: the settings of its runs, one run per entry on every layout (the recomputation variant runs
# without it too: its parameters must be the same bits)
VARIANTS = {"zero3": [dict(zero=3)],
            "recompute": [dict(recompute="selective"), dict(recompute="full"), dict(recompute="none")],
            "zero3+full": [dict(zero=3, recompute="full", optimizer="adamw", lr=0.01, weight_decay=0.1, clip=0.5)]}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_layout_equals_serial_sgd(variant):
    """All 10 factorizations of 8 ranks (2 micro-batches; the schemes megatron, gather and sequence in turn; 3
    blocks per stage, up to 8 blocks) with --zero 3, with --recompute selective and full, and with both: parameters
    after 3 steps against serial SGD, and every communicator's bytes against the formula (ZeRO-3's gathers and
    reduce-scatters, full recomputation's repeated tensor-parallel collectives); recomputation's parameters are
    the same bits as those of the same layout without it."""
    worst, ok, identical = 0.0, True, True
    for i, (dp, pp, tp) in enumerate(factorizations(8)):
        scheme = tp_schemes.SCHEMES[i % 3]                                 # each layout one scheme, in turn
        cfg = blocks_for(pp)
        finals, ref = [], None
        grid = ProcessGrid(WORLD, dp=dp, pp=pp, tp=tp)                  # one grid for the layout's runs
        for extra in VARIANTS[variant]:
            tc = config(dp=dp, pp=pp, tp=tp, tp_scheme=scheme, **extra)
            if ref is None:                                              # (a variant's runs share the optimizer)
                ref = serial_params(cfg, CORPUS, tc)
            grid, trainer, params, per_step = run(tc, cfg=cfg, grid=grid)
            err = world_max(param_err(params, grid, ref, tc.tp_scheme))
            same = per_step == step_formula(cfg, tc, trainer)
            ok &= err <= 1e-10 and same
            worst = max(worst, err)
            if not same or err > 1e-10:
                say(f"  {extra} dp={dp} pp={pp} tp={tp} {scheme}: err {err:.1e}\n  measured {per_step}\n"
                    f"  formula  {step_formula(cfg, tc, trainer)}")
            finals.append(params)
            trainer.free()
        grid.free()
        identical &= all(all(np.array_equal(f[n], finals[-1][n]) for n in f) for f in finals)
    say(f"{variant}: 10 layouts x 3 steps, max param rel err vs serial {worst:.1e}, bytes == formula: {ok}"
        + (f", selective and full bit-identical to none: {identical}" if variant == "recompute" else ""))
    check(ok and identical)


@pytest.mark.parametrize("zero", [2, 3])
def test_hybrid_sharding_and_bucketed_zero2(zero):
    """--zero 2|3 --hierarchical (2 ranks per node: shard over the 2, replicate over the 4 nodes) and plain
    --zero 2, on dp 8 and on dp 4 x tp 2: serial SGD's parameters, the formula's bytes, and what each rank keeps
    between steps: 1/n of the parameters (stage 3) and of the gradients."""
    ok = True
    for dp, tp in ((8, 1), (4, 2)):
        grid = ProcessGrid(WORLD, dp=dp, tp=tp)                          # one grid for the layout's two runs
        for hybrid in (False, True):
            extra = dict(hierarchical=True, ranks_per_node=2) if hybrid else {}
            tc = config(dp=dp, tp=tp, zero=zero, optimizer="adamw", lr=0.01, **extra)
            ref = serial_params(SMALL, CORPUS, tc)
            grid, trainer, params, per_step = run(tc, cfg=SMALL, grid=grid)
            err = world_max(param_err(params, grid, ref, tc.tp_scheme))
            n = 2 if hybrid else dp
            size = trainer.exchange.sizes.size                               # padded elements of the flat layout
            mem = trainer.memory()
            held = mem["grads"] == size // n * 8 and mem["optimizer"] == 2 * size // n * 8
            held &= mem["params"] == (size // n * 8 if zero == 3 else size * 8 + size // n * 8)
            same = per_step == step_formula(SMALL, tc, trainer)
            say(f"zero {zero}{' hybrid (2 per node)' if hybrid else ''} dp={dp} tp={tp}: err {err:.1e}, bytes == "
                f"formula {same}, kept {mem} of {size * 8} B of parameters")
            ok &= err <= 1e-10 and same and held
            trainer.free()
        grid.free()
    check(ok)


def test_checkpoints_reshard_between_zero_stages(tmp_path_factory):
    """Save after 2 steps under each ZeRO stage, resume for 2 more steps under another stage (and another layout):
    0, 1, 2 -> 3 and 3 -> 0, 1, 2. The parameters equal 4 uninterrupted serial AdamW steps."""
    tc = config(steps=4, optimizer="adamw", lr=0.01, weight_decay=0.1, micro_batches=1, batch_size=8)
    ref = serial_params(SMALL, CORPUS, tc)
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("ckpt")) if WORLD.Get_rank() == 0 else None)
    ok, worst = True, 0.0
    for saved in (0, 1, 2, 3):
        first = config(**{**vars(tc), "zero": saved, "dp": 4, "tp": 2})
        grid, trainer, _, _ = run(first, stop=2, cfg=SMALL)
        path = checkpoint.save(trainer, 2, f"{folder}/z{saved}", keep=1)
        trainer.free()
        grid.free()
        for resumed in ((0, 1, 2) if saved == 3 else (3,)):                # to and from stage 3
            layout = dict(dp=8, tp=1) if resumed % 2 else dict(dp=2, pp=2, tp=2)
            second = config(**{**vars(tc), **layout, "zero": resumed})
            grid = ProcessGrid(WORLD, dp=second.dp, pp=second.pp, tp=second.tp)
            trainer = HybridTrainer(SMALL, grid, second)
            checkpoint.load(trainer, checkpoint.open_checkpoint(path, SMALL))
            grid, trainer, params, _ = run(second, trainer, start=3, cfg=SMALL)
            err = world_max(param_err(params, grid, ref, second.tp_scheme))
            worst = max(worst, err)
            ok &= err <= 1e-10
            trainer.free()
            grid.free()
    say(f"checkpoints: zero 0/1/2 -> 3 and 3 -> 0/1/2, each under another layout: max param rel err vs 4 serial "
        f"steps {worst:.1e}")
    check(ok)


# ------------------------------------------------------------------------- checkpoints that must not go wrong quietly

RESUME_CFG = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=16)


@pytest.mark.parametrize("rank0_sees", [True, False])
def test_resume_auto_follows_rank_0_when_ranks_see_different_folders(rank0_sees):
    """Rank 0 and the others look at different save folders: one holds the checkpoint of step 2, the other is
    empty. Every rank must take rank 0's decision (resume after step 2 from rank 0's path, or start at step 1);
    deciding on each rank would send some into the checkpoint's collectives and the others into training."""
    tc = float64_config(dp=2, tp=4, steps=4, batch_size=8)
    where = WORLD.bcast(tempfile.mkdtemp() if WORLD.Get_rank() == 0 else None)
    full, empty = os.path.join(where, "full"), os.path.join(where, "empty")
    grid = ProcessGrid(WORLD, dp=tc.dp, tp=tc.tp)
    trainer = HybridTrainer(RESUME_CFG, grid, tc)
    for step in (1, 2):
        trainer.step(*CORPUS.batch(tc.seed, step, tc.batch_size), step)
    checkpoint.save(trainer, 2, full)
    os.makedirs(empty, exist_ok=True)
    mine = full if (WORLD.Get_rank() == 0) == rank0_sees else empty      # rank 0 sees one, the others the other
    fresh = HybridTrainer(RESUME_CFG, grid, tc)
    start, _ = resume(fresh, RESUME_CFG, dataclasses.replace(tc, resume="auto", save_dir=mine), WORLD, say)
    expected = 3 if rank0_sees else 1
    same = all(np.array_equal(fresh.params[n], trainer.params[n]) for n in trainer.params)
    say(f"rank 0 sees the checkpoint: {rank0_sees}; every rank starts at step {start} (expected {expected}); "
        f"parameters {'equal to' if same else 'not'} the saved run's")
    grid.free()
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(where, ignore_errors=True)
    check(start == expected and same == rank0_sees, f"start {start}, loaded {same}")


def saved_after_step_1():
    """(folder, grid, trainer, checkpoint of step 1): one float64 SGD step on dp 2 x tp 4, saved into a new folder."""
    tc = float64_config(dp=2, tp=4, steps=4, batch_size=8)
    where = WORLD.bcast(tempfile.mkdtemp() if WORLD.Get_rank() == 0 else None)
    grid = ProcessGrid(WORLD, dp=tc.dp, tp=tc.tp)
    trainer = HybridTrainer(RESUME_CFG, grid, tc)
    trainer.step(*CORPUS.batch(tc.seed, 1, tc.batch_size), 1)
    return where, grid, trainer, checkpoint.save(trainer, 1, where)


def test_a_state_that_is_not_finite_is_never_saved():
    """One infinite parameter on one rank: every rank refuses to save (NumericalFault, exit code 3 from the command
    line), and the checkpoint saved before stays the newest."""
    from hsgd.errors import NumericalFault
    where, grid, trainer, good = saved_after_step_1()
    if WORLD.Get_rank() == 6:
        trainer.params["h.1.mlp.fc.weight"][0, 0] = np.inf
    try:
        checkpoint.save(trainer, 2, where)
        message = None
    except NumericalFault as e:
        message = str(e)
    kept = sorted(os.listdir(where))                                    # no other checkpoint, no leftover
    say(f"after an infinite parameter on rank 6: {message}; checkpoints {kept}")
    grid.free()
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(where, ignore_errors=True)
    check(message is not None and "not finite after step 2 (on ranks [6])" in message and
          kept == [os.path.basename(good)], f"{message} {kept}")


@pytest.mark.parametrize("where_it_fails", ["a shard on rank 3", "the manifest on rank 0"])
def test_a_save_that_fails_on_one_rank_keeps_the_previous_checkpoint(monkeypatch, where_it_fails):
    """A full disk while saving: the error reaches every rank (CheckpointError, one line from the command line),
    the partial checkpoint is removed, the previous one is untouched; leftovers of an interrupted save are cleaned
    up, anything else in the folder is left alone."""
    import errno

    from hsgd.checkpoint.store import CheckpointError

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    where, grid, trainer, good = saved_after_step_1()
    if WORLD.Get_rank() == 0:
        os.makedirs(os.path.join(where, ".tmp-step-000001-99999"))          # a leftover of a killed save
        os.makedirs(os.path.join(where, ".tmp-notes"))                      # not ours
    WORLD.Barrier()
    if where_it_fails == "a shard on rank 3" and WORLD.Get_rank() == 3:
        monkeypatch.setattr(checkpoint.np, "savez", full)
    if where_it_fails == "the manifest on rank 0" and WORLD.Get_rank() == 0:
        monkeypatch.setattr(checkpoint.json, "dump", full)
    try:
        checkpoint.save(trainer, 2, where)
        message = None
    except CheckpointError as e:
        message = str(e)
    monkeypatch.undo()
    kept = sorted(os.listdir(where))
    say(f"{where_it_fails} fails: {message}; the folder holds {kept}")
    grid.free()
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(where, ignore_errors=True)
    rank = 3 if where_it_fails.endswith("3") else 0
    check(message is not None and "No space left on device" in message and f"rank {rank}" in message
          and kept == [".tmp-notes", os.path.basename(good)], f"{message} {kept}")
