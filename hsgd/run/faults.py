"""--inject-fault RANK:STEP[:KIND]: one fault, on purpose, on one rank at one step, to see what the run does.

    raise          an exception (the job must end on every rank within seconds, hsgd.grid.launch)
    kill           SIGKILL before the step: a dead rank, no cleanup, no message
    kill-in-save   SIGKILL while the checkpoint after that step is being written (the newest complete one survives)
    nan            a NaN in this rank's gradient after the exchange (--on-nan decides: stop or skip the update)
    diverge        after the step, one parameter of this replica alone moves (--check-replicas finds it)
    stop-in-PHASE  SIGSTOP as a watched phase starts (hsgd.run.watchdog): a rank that stops without dying, where
                   --step-timeout must end the job (exit code 5). PHASE: load (the --resume checkpoint; STEP is not
                   used), validation (before STEP when the run starts there, else after STEP), save (after STEP),
                   dump (of STEP), sample (at the end; STEP the last)

Each kind acts at one point of the training loop (hsgd.train's step watchers: before the step, after the
gradients, after the step, as a watched phase starts); outside those points the loop does not know faults exist.
"""
import os
import signal

from hsgd.run.watchers import StepWatcher


class Faults(StepWatcher):
    def __init__(self, text, rank):
        """text: the --inject-fault value or None; rank: this process's world rank."""
        parts = text.split(":") if text else None
        self.rank, self.step = (int(parts[0]), int(parts[1])) if parts else (None, None)
        self.kind = (parts[2] if len(parts) == 3 else "raise") if parts else None
        self.mine = parts is not None and self.rank == rank

    def now(self, step, kind):
        return self.mine and step == self.step and self.kind == kind

    def before_step(self, step, trainer=None, batch=None):
        if self.now(step, "raise"):
            raise RuntimeError(f"fault injected on rank {self.rank} at step {step} (--inject-fault)")
        if self.now(step, "kill"):
            os.kill(os.getpid(), signal.SIGKILL)                    # no cleanup, no message: a dead rank

    def after_gradients(self, trainer, step, loss=None):
        if self.now(step, "nan"):
            trainer.exchange.checked()[0] = float("nan")            # what the step's non-finite check sees

    def after_step(self, trainer, step):
        if self.now(step, "diverge"):
            if trainer.tc.zero == 3:                                # (hybrid: a chunk replicated across nodes)
                trainer.exchange.master[-1] += 1e-3                 # the parameters are gathered from it
            else:
                trainer.params[trainer.exchange.order[-1]].reshape(-1)[0] += 1e-3    # this replica alone drifts

    def entering(self, phase, step):
        """A watched phase (hsgd.run.watchdog) starts: stop-in-PHASE stops this process here, once."""
        if self.mine and self.kind == f"stop-in-{phase}" and (step == self.step or phase == "load"):
            self.mine = False
            os.kill(os.getpid(), signal.SIGSTOP)                    # stopped, not dead: the others wait for it

    def in_save(self, step):
        """True when the checkpoint after this step is to be cut short by a SIGKILL."""
        return self.now(step, "kill-in-save")
