"""SIGTERM and SIGINT (a preempted job, Ctrl-C): end the run cleanly instead of losing what it did.

A signal handler only sets a flag (`StopRequest.signum`); it never touches MPI or the model. After every step the
ranks agree on the flag with one Allreduce (MAX), because the signal does not reach every rank at the same moment
(or at all: a scheduler may signal some tasks first), and every rank must take the same branch. Once they agree
the run writes a checkpoint of the step it just finished (with --save-dir; not after a step skipped for non-finite
values; watched by --step-timeout like every save), rank 0 says where, and every rank exits with code 4
(`hsgd: stopped: ...`): `--resume auto` goes on from there. A second signal of the same kind is not caught any
more: it ends the process at once, for a user who does not want to wait for the step to finish.
"""
import signal
import threading

from mpi4py import MPI

from hsgd.checkpoint.store import CheckpointError, save
from hsgd.errors import Stopped
from hsgd.run.watchdog import checkpoint_limit

CAUGHT = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self):
        self.signum = self.signum_agreed = 0
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():     # (Python handles signals in the main thread)
            for s in CAUGHT:
                self.previous[s] = signal.signal(s, self.handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        return False

    def handle(self, signum, frame):
        self.signum = signum
        signal.signal(signum, signal.SIG_DFL)           # the next one of the same kind ends the process

    def agreed(self, world):
        """Collective: True if any rank received a signal; then signum_agreed is the largest signal number seen."""
        self.signum_agreed = world.allreduce(self.signum, op=MPI.MAX)
        return self.signum_agreed != 0

    @staticmethod
    def name(signum):
        return signal.Signals(signum).name


def stop_after_signal(run, step, signum, saved):
    """Every rank, after a SIGTERM or SIGINT that the ranks agreed on: a checkpoint of this step (with --save-dir,
    unless just written or the step was skipped), then Stopped (exit code 4) with what to do next."""
    tc, trainer, name = run.tc, run.trainer, StopRequest.name(signum)
    run.progress.close()
    if not tc.save_dir:
        raise Stopped(f"{name} after step {step}; no --save-dir, so nothing was saved")
    if trainer.scaler.in_a_row:
        raise Stopped(f"{name} after step {step}, a step with non-finite values: no checkpoint written; the newest in "
                      f"{tc.save_dir!r} is older")
    try:
        with run.dog.phase(f"the checkpoint save after step {step} ({name})",
                           *checkpoint_limit(run.tc.step_timeout), kind="save", step=step):
            path = saved or save(trainer, step, tc.save_dir, tc.keep, identity=run.identity)
    except CheckpointError as e:
        raise Stopped(f"{name} after step {step}; {e}") from None
    raise Stopped(f"{name} after step {step}; checkpoint {path}; continue with --resume auto")
