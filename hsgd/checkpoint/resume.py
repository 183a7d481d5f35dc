"""--resume: which checkpoint a run continues from (auto: the newest of --save-dir's newest line, decided on rank 0),
opened and checked on every rank, loaded into the trainer resharded to the run's layout, and what changed said
(chapter 19)."""
from hsgd.checkpoint.manifest import say_changes
from hsgd.checkpoint.runs import complete_checkpoints, newest
from hsgd.checkpoint.store import load, open_checkpoint
from hsgd.grid import launch


def resume(trainer, cfg, tc, world, say):
    """Load --resume's checkpoint (checked on every rank first). Returns the first step to run and the
    checkpoint's manifest (None when starting at step 1)."""
    if not tc.resume:
        return 1, None
    where = tc.resume
    if tc.resume == "auto":             # decided once, on rank 0: nodes may see a shared folder differently
        found = launch.agree(world, lambda: complete_checkpoints(tc.save_dir) if world.Get_rank() == 0
                             else None)
        found = world.bcast(found, root=0)
        if not found:
            say(f"--resume auto: no complete checkpoint in {tc.save_dir!r}; starting at step 1")
            return 1, None
        where = newest(found)                                        # the newest line's last, the same everywhere
    manifest = launch.agree(world, lambda: open_checkpoint(where, cfg))
    launch.agree(world, lambda: say_changes(manifest, tc, say))  # (hsgd.checkpoint.manifest)
    step = launch.agree(world, lambda: load(trainer, manifest))
    lay, grid = manifest["layout"], trainer.grid
    say(f"resumed from {manifest['path']} after step {step} (saved as dp {lay['dp']} x pp {lay['pp']} x cp "
        f"{lay.get('cp', 1)} x tp {lay['tp']} {lay['tp_scheme']}; now dp {grid.dp} x pp {grid.pp} x cp {grid.cp} x tp "
        f"{grid.tp} {trainer.scheme})")
    return step + 1, manifest
