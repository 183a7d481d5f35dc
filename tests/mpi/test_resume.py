"""Checkpoints on 8 ranks that must not go wrong quietly: `--resume auto` when the ranks see a shared folder
differently (a node's NFS cache after a restart) is decided once, on rank 0, and every rank follows it; a state
that is not finite is never saved."""
import os
import shutil
import tempfile
from dataclasses import replace

import numpy as np
import pytest

import hsgd
from hsgd import checkpoint
from hsgd.data import Corpus
from hsgd.grid import ProcessGrid
from hsgd.hybrid import HybridTrainer
from hsgd.train import TrainConfig, resume

from .conftest import WORLD, check, say

pytestmark = pytest.mark.mpi(min_size=8)

CFG = hsgd.ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=16)
CORPUS = Corpus(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes(), "random bytes", 8)


@pytest.mark.parametrize("rank0_sees", [True, False])
def test_resume_auto_follows_rank_0_when_ranks_see_different_folders(rank0_sees):
    """Rank 0 and the others look at different save folders: one holds the checkpoint of step 2, the other is
    empty. Every rank must take rank 0's decision (resume after step 2 from rank 0's path, or start at step 1);
    deciding on each rank would send some into the checkpoint's collectives and the others into training."""
    tc = TrainConfig(dp=2, tp=4, steps=4, batch_size=8, lr=0.05, momentum=0.9, dtype="float64", seed=3)
    where = WORLD.bcast(tempfile.mkdtemp() if WORLD.Get_rank() == 0 else None)
    full, empty = os.path.join(where, "full"), os.path.join(where, "empty")
    grid = ProcessGrid(WORLD, dp=tc.dp, tp=tc.tp)
    trainer = HybridTrainer(CFG, grid, tc)
    for step in (1, 2):
        trainer.step(*CORPUS.batch(tc.seed, step, tc.batch_size), step)
    checkpoint.save(trainer, 2, full)
    os.makedirs(empty, exist_ok=True)
    mine = full if (WORLD.Get_rank() == 0) == rank0_sees else empty      # rank 0 sees one, the others the other
    fresh = HybridTrainer(CFG, grid, tc)
    start, _ = resume(fresh, CFG, replace(tc, resume="auto", save_dir=mine), WORLD, say)
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
    tc = TrainConfig(dp=2, tp=4, steps=4, batch_size=8, lr=0.05, momentum=0.9, dtype="float64", seed=3)
    where = WORLD.bcast(tempfile.mkdtemp() if WORLD.Get_rank() == 0 else None)
    grid = ProcessGrid(WORLD, dp=tc.dp, tp=tc.tp)
    trainer = HybridTrainer(CFG, grid, tc)
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

    from hsgd.checkpoint import CheckpointError

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
