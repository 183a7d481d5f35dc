"""--step-timeout S: end the job when one training step runs far longer than it should.

A rank that stops without dying (a stuck file system, a debugger, a node that freezes) leaves every other rank
waiting in the step's next collective, at full CPU, until the job's wall-clock limit: nothing fails, so nothing is
reported. Each rank therefore runs a watchdog thread that looks at the clock of the current step every so often;
when a step has run longer than S seconds, the rank that notices first prints one line to stderr (the step, how
long it ran, how long the steps before it took) and calls MPI_Abort with exit code 5, which ends every rank of the
job. Only the steps themselves are timed, not evaluations or checkpoints between them. 0 (the default) turns it
off; set S well above the slowest step you expect (the first includes warm-up).
"""
import sys
import threading
import time

EXIT_TIMEOUT = 5


class Watchdog:
    def __init__(self, seconds, world):
        self.seconds, self.world = seconds, world
        self.step, self.t0, self.longest = None, None, 0.0
        self.stop = threading.Event()

    def __enter__(self):
        if self.seconds > 0:
            threading.Thread(target=self.watch, daemon=True, name="hsgd-watchdog").start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        return False

    def started(self, step):
        self.step, self.t0 = step, time.monotonic()

    def done(self):
        self.longest = max(self.longest, time.monotonic() - self.t0)
        self.t0 = None

    def watch(self):
        while not self.stop.wait(min(1.0, self.seconds / 4)):
            t0, step = self.t0, self.step
            if t0 is not None and time.monotonic() - t0 > self.seconds:
                rank = self.world.Get_rank()
                before = f"the steps before it took at most {self.longest:.2f} s" if self.longest else "the first step"
                sys.stderr.write(f"[rank {rank}] hsgd: stopped: step {step} has run for more than --step-timeout "
                                 f"{self.seconds:g} s ({before}): a rank has stopped, or waits in a collective that "
                                 "cannot complete; ending the job (MPI_Abort)\n")
                sys.stderr.flush()
                time.sleep(0.5)
                self.world.Abort(EXIT_TIMEOUT)
