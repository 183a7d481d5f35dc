"""Errors a user can fix: bad flags, bad files, bad layouts.

Every such error carries one sentence that says what is wrong and what would work. Entry points
(`python -m hsgd.train`, ...) catch `UsageError`, print `hsgd: error: <message>` once and exit with code 2;
anything else is a bug and shows its traceback.
"""

EXIT_USAGE = 2      # exit code of every usage error (bad flag, bad file, bad layout, bad checkpoint)
EXIT_NUMERICAL = 3  # exit code of a run stopped by a numerical fault (non-finite values, diverged replicas, updates
                    # skipped for good: hsgd.step.health.Skipping)
EXIT_SIGNAL = 4     # exit code of a run stopped cleanly by SIGTERM or SIGINT (after a checkpoint, with --save-dir)


class UsageError(ValueError):
    """Something the user asked for cannot work; the message says why and what would."""


class ConfigError(UsageError):
    """A configuration field has a value that cannot work."""


class DataError(UsageError):
    """A data file is missing, unreadable, empty or too short."""


class NumericalFault(RuntimeError):
    """All ranks agreed that the run cannot go on: a non-finite loss or gradient (--on-nan stop), data-parallel
    replicas whose parameters differ (--check-replicas), or updates skipped for good (hsgd.step.health.Skipping:
    --max-skips in a row, the loss scale below its floor, none applied at all)."""


class Stopped(RuntimeError):
    """All ranks agreed to stop after a SIGTERM or SIGINT (hsgd.run.signals); the message says what was saved."""
