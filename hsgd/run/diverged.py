"""A run that has diverged ends, and keeps what it had (chapter 19): data-parallel replicas whose parameters differ
(--check-replicas) stop the run; a run whose updates keep being skipped (non-finite values at every step, a loss
scale below its floor: hsgd.step.loss_scale) stops with a checkpoint of its last finite state. Both are
NumericalFault, exit code 3, on every rank at once.
"""
from hsgd.checkpoint import store as checkpoint
from hsgd.checkpoint.store import CheckpointError
from hsgd.dp.average import replica_divergence
from hsgd.errors import NumericalFault
from hsgd.run.watchdog import checkpoint_limit


def check_replicas(trainer, world, step):
    """Stop (exit 3) if any DP group's replicas hold different parameters, naming the first that differs."""
    found = world.allgather(replica_divergence(trainer.exchange, trainer.grid.dp_comm))
    for r, d in enumerate(found):
        if d:
            raise NumericalFault(f"data-parallel replicas diverged by step {step}: the first parameter that differs is "
                                 f"{d[0]} (dp ranks holding each version: {d[1]}, seen by world rank {r}); "
                                 "resume from the last checkpoint")

def save_last_finite(run):
    """Every rank, after Skipping: a checkpoint of the last finite state (the step of the last applied update: the
    skipped ones left the parameters as they were; the loss scale rewound to then), with --save-dir. Returns what
    was saved, for the message."""
    tc, trainer = run.tc, run.trainer
    step = trainer.scaler.last_applied
    advice = "resume from it with a smaller --lr"
    if not tc.save_dir:
        return "no --save-dir, so nothing was saved"
    if step is None:
        return (f"no update was applied since step {run.start - 1}: nothing new to save" if run.start > 1 else
                "no update was applied: nothing to save") + "; start again with a smaller --lr"
    if step == run.saved_step:
        return f"the last finite state is the checkpoint after step {step}, already written; {advice}"
    trainer.scaler.rewind()
    try:
        with run.dog.phase(f"the checkpoint save after step {step} (the last finite state)",
                           *checkpoint_limit(tc.step_timeout), kind="save", step=step):
            path = checkpoint.save(trainer, step, tc.save_dir, tc.keep, identity=run.identity)
    except (CheckpointError, NumericalFault) as e:
        return f"no checkpoint of the last finite state ({e})"
    run.say(f"checkpoint after step {step}: {path}")
    return f"checkpoint of the last finite state (after step {step}): {path}; {advice}"
