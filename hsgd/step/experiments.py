"""The settings group of experiments: faults and slow ranks made on purpose (--inject-fault, --straggler), to test
the fault tolerance (chapter 19) and see what a straggler costs (chapter 8). A group of hsgd.step.settings'
TrainConfig; hsgd.run.faults acts on --inject-fault.
"""
from dataclasses import dataclass

from hsgd.errors import ConfigError
from hsgd.model.config import flag

FAULTS = ("raise", "kill", "kill-in-save", "nan", "diverge") + tuple(    # the KINDs of --inject-fault
    f"stop-in-{phase}" for phase in ("load", "validation", "save", "dump", "sample"))
MAX_STRAGGLER_MS = 60_000                                            # a minute of sleep per step, at most


@dataclass
class Experiments:
    """Faults and slow ranks, made on purpose to test the fault tolerance and see what stragglers cost."""

    inject_fault: str = flag(None, "a fault on RANK at STEP, for testing; KIND is one of\n"
                                   "raise: an exception (the default)\n"
                                   "kill: SIGKILL\n"
                                   "kill-in-save: SIGKILL while writing a checkpoint\n"
                                   "nan: a NaN in the gradient\n"
                                   "diverge: one parameter perturbed, on that rank only\n"
                                   "stop-in-PHASE: SIGSTOP as PHASE starts (load, validation, save, dump, sample; "
                                   "see --step-timeout)", metavar="RANK:STEP[:KIND]")
    straggler: str = flag(None, "make RANK sleep MS milliseconds in every step", metavar="RANK:MS")

    def check_experiments(self):
        digits = lambda p: p.isascii() and p.isdigit()            # "²".isdigit() is True, int("²") fails
        if self.straggler is not None:
            parts = str(self.straggler).split(":")
            if len(parts) != 2 or not all(digits(p) for p in parts):
                raise ConfigError(f"straggler={self.straggler!r} must look like RANK:MILLISECONDS, e.g. 3:50")
            if int(parts[1]) > MAX_STRAGGLER_MS:
                raise ConfigError(f"straggler={self.straggler!r}: at most {MAX_STRAGGLER_MS} ms of sleep per step")
        if self.inject_fault is not None:
            parts = str(self.inject_fault).split(":")
            if not 2 <= len(parts) <= 3 or not all(digits(p) for p in parts[:2]) or \
                    (len(parts) == 3 and parts[2] not in FAULTS):
                raise ConfigError(f"inject_fault={self.inject_fault!r} must look like RANK:STEP or RANK:STEP:KIND with "
                                  f"KIND one of {', '.join(FAULTS)}, e.g. 3:5 or 3:5:kill")

    def check_experiment_targets(self, world_size, steps):
        """The ranks and steps named by --straggler and --inject-fault exist (else they would be silently ignored)."""
        for name, value in (("straggler", self.straggler), ("inject_fault", self.inject_fault)):
            if value is None:
                continue
            rank = int(str(value).split(":")[0])
            if rank >= world_size:
                raise ConfigError(f"{name}={value!r} names rank {rank}, but the job has ranks 0..{world_size - 1}")
        if self.inject_fault is not None:
            step = int(str(self.inject_fault).split(":")[1])
            if not 1 <= step <= steps:
                raise ConfigError(f"inject_fault={self.inject_fault!r} names step {step}, but the run has steps "
                                  f"1..{steps}")
