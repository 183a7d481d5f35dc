"""--step-timeout S: end the job when one training step runs far longer than it should.

A rank that stops without dying (a stuck file system, a debugger, a node that freezes) leaves every other rank
waiting in the step's next collective, at full CPU, until the job's wall-clock limit: nothing fails, so nothing is
reported. Each rank therefore runs a watchdog thread that looks at the clock of the current step every so often;
when a step has run longer than S seconds, the rank that notices first prints one line to stderr (the step, how
long it ran, how long the steps before it took) and calls MPI_Abort with exit code 5, which ends every rank of the
job. A step is timed together with the stop agreement that closes it (the one-number Allreduce of every rank's
signal flag), so that a rank stopped after the step's last collective is caught too; a signal that arrives later,
during a checkpoint or a validation, is acted on after the next step. The validations of --eval-interval are timed
with a limit of S per validation batch (one batch's forward pass is less work than a step); the ones before the
first step and after the last are not, and neither are checkpoints: a save takes as long as the file system makes
it. 0 (the default) turns it off; set S well above the slowest step
you expect (the first includes warm-up).
"""
import sys
import threading
import time

EXIT_TIMEOUT = 5


class Watchdog:
    def __init__(self, seconds, world):
        self.seconds, self.world = seconds, world
        self.step, self.t0, self.longest = None, None, 0.0
        self.what, self.limit = None, seconds           # what is timed now ("step 7"), and its limit in seconds
        self.stop = threading.Event()

    def __enter__(self):
        if self.seconds > 0:
            threading.Thread(target=self.watch, daemon=True, name="hsgd-watchdog").start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        return False

    def started(self, step):
        """Step `step` (and the stop agreement after it) starts: limit S."""
        self.what, self.limit = None, self.seconds
        self.step, self.t0 = step, time.monotonic()

    def validating(self, step, batches):
        """The validation after step `step` starts: limit S x batches."""
        self.what, self.limit = f"the validation after step {step}", self.seconds * batches
        self.step, self.t0 = step, time.monotonic()

    def done(self):
        if self.what is None:
            self.longest = max(self.longest, time.monotonic() - self.t0)
        self.t0 = None

    def watch(self):
        while not self.stop.wait(min(1.0, self.seconds / 4)):
            t0, step, what, limit = self.t0, self.step, self.what, self.limit
            if t0 is not None and time.monotonic() - t0 > limit:
                rank = self.world.Get_rank()
                before = f"the steps before it took at most {self.longest:.2f} s" if self.longest else "the first step"
                timed = f"step {step} has run for more than --step-timeout {self.seconds:g} s ({before})" \
                    if what is None else (f"{what} has run for more than {limit:g} s (--step-timeout "
                                          f"{self.seconds:g} s per validation batch)")
                sys.stderr.write(f"[rank {rank}] hsgd: stopped: {timed}: a rank has stopped, or waits in a collective "
                                 "that cannot complete; ending the job (MPI_Abort)\n")
                sys.stderr.flush()
                time.sleep(0.5)
                self.world.Abort(EXIT_TIMEOUT)
