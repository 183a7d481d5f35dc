"""--step-timeout S: end the job when a collective phase of a run (a step, a checkpoint, a validation) runs far
longer than it should.

A rank that stops without dying (a stuck file system, a debugger, a node that freezes) leaves every other rank
waiting in the next collective, at full CPU, until the job's wall-clock limit: nothing fails, so nothing is
reported. Each rank therefore runs a watchdog thread that looks at the clock of the phase it is in every so often;
when the phase has run longer than its limit, the rank that notices first prints one line to stderr (the phase, how
long it ran) and calls MPI_Abort with exit code 5, which ends every rank of the job. What is watched, and its limit:

    the checkpoint load of --resume                         10 S (a checkpoint is all the state, read once)
    the validation before the first step                    S per validation batch
    each training step, with the stop agreement after it    S (the one-number Allreduce of every rank's signal
                                                               flag: a rank stopped after the step's last
                                                               collective is caught too)
    the --dump-step dump, inside its step                   S (the step's clock stops meanwhile)
    each checkpoint save (--save-interval, the last step,   10 S (written and synced to disk; a shared file
      after a signal, after the loss scale's floor)           system is slower than a step)
    each validation of --eval-interval                      S per validation batch
    the validation after the last step                      S per validation batch
    the reports at the end of the run (plots included)      S + 60 s
    the sample, and the agreement that every rank is done   S per sampled byte (at least S)

A phase that ends past its limit ends the job the same way, when it ends, so that the verdict does not depend on
when the thread looked: `--step-timeout 0.001` ends every job at its first phase, with exit code 5. A rank whose
watchdog has fired goes past no phase's end (it waits for MPI_Abort), so it cannot finish and exit 0 before the
abort lands: the job's exit code is 5 however early that is. A phase inside another (the dump inside its step)
stops the outer one's clock while it runs. What is not watched: the set-up before the first phase (the folder
lock, reading the data, building the model).
0 (the default) turns the watchdog off; set S well above the slowest of these you expect (the first step includes
warm-up).

    with watchdog.phase("the checkpoint save after step 7"):        # limit S
        ...
"""
import sys
import threading
import time
from contextlib import contextmanager

EXIT_TIMEOUT = 5
REPORTS_S = 60.0            # added to S for the reports at the end of a run (matplotlib's plots take seconds)
CHECKPOINT_TIMES = 10       # a checkpoint save or load may take this many times S


class Watchdog:
    def __init__(self, seconds, world, entering=None):
        """seconds: S (0: off); world: the communicator MPI_Abort ends; entering(kind, step): called as a phase
        starts (hsgd.run.faults' stop-in-* faults stop this rank there)."""
        self.seconds, self.world = seconds, world
        self.entering = entering or (lambda kind, step: None)
        self.phases = []            # [what, limit, rule, t0, spent] of the phases this rank is in, innermost last
        self.longest = 0.0          # the longest training step so far, seconds
        self.fired = False          # the job is being ended
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def __enter__(self):
        if self.seconds > 0:
            threading.Thread(target=self.watch, daemon=True, name="hsgd-watchdog").start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.fired:
            self.wait_for_abort()
        return False

    @contextmanager
    def phase(self, what, limit=None, rule=None, kind=None, step=None):
        """Watch `what` ("the checkpoint save after step 7") for `limit` seconds (default S); rule: how the limit
        was made, for the message (default "--step-timeout S s"); kind, step: what `entering` is told."""
        limit = self.seconds if limit is None else limit
        with self.lock:
            now = time.monotonic()
            if self.phases:                                     # the outer phase's clock stops meanwhile
                outer = self.phases[-1]
                outer[4] += now - outer[3]
            self.phases.append([what, limit, rule or f"--step-timeout {self.seconds:g} s", now, 0.0])
        try:
            self.entering(kind, step)
            yield
        finally:
            with self.lock:
                what, limit, rule, t0, spent = self.phases.pop()
                now = time.monotonic()
                ran = spent + now - t0
                if self.phases:
                    self.phases[-1][3] = now
                late = self.seconds > 0 and ran > limit and not self.fired
            if late:
                self.expire(what, limit, rule, ran)
            if self.fired:
                self.wait_for_abort()

    @contextmanager
    def step(self, step):
        """Training step `step` and the stop agreement after it (limit S); keeps the longest step for the message."""
        with self.phase(f"step {step}", kind="step", step=step):
            t0 = time.monotonic()
            yield
        self.longest = max(self.longest, time.monotonic() - t0)

    def watch(self):
        while not self.stop.wait(min(1.0, max(0.005, self.seconds / 4))):
            with self.lock:
                top = self.phases[-1] if self.phases else None
                ran = top and top[4] + time.monotonic() - top[3]
                late = top is not None and ran > top[1] and not self.fired
            if late:
                self.expire(*top[:3], ran)

    def expire(self, what, limit, rule, ran):
        """One line to stderr, then MPI_Abort(5) on every rank; the caller never returns from here."""
        with self.lock:
            first, self.fired = not self.fired, True
        if first:
            rank = self.world.Get_rank()
            if what.startswith("step ") and rule.startswith("--step-timeout"):
                before = f"the steps before it took at most {self.longest:.2f} s" if self.longest else "the first step"
                timed = f"{what} has run for more than {rule} ({before})"
            else:
                timed = f"{what} has run for more than {limit:g} s ({rule})"
            sys.stderr.write(f"[rank {rank}] hsgd: stopped: {timed}: a rank has stopped, or waits in a collective "
                             "that cannot complete; ending the job (MPI_Abort)\n")
            sys.stderr.flush()
            time.sleep(0.5)                 # the launcher forwards the line before the abort tears its streams down
            self.world.Abort(EXIT_TIMEOUT)
        self.wait_for_abort()

    @staticmethod
    def wait_for_abort():
        """Once the job is being ended this rank goes no further: a rank that finished and exited 0 first would
        make the job's exit code 0."""
        while True:
            time.sleep(1.0)


def per_batch(seconds, batches):
    """The limit of a validation of `batches` batches, and its rule for the message."""
    return seconds * max(1, batches), f"--step-timeout {seconds:g} s per validation batch"


def checkpoint_limit(seconds):
    """The limit of a checkpoint save or load, and its rule for the message."""
    return seconds * CHECKPOINT_TIMES, f"{CHECKPOINT_TIMES} x --step-timeout {seconds:g} s for a checkpoint"
