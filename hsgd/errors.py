"""Errors a user can fix: bad flags, bad files, bad layouts.

Every such error carries one sentence that says what is wrong and what would work. Entry points
(`python -m hsgd.train`, ...) catch `UsageError`, print `hsgd: error: <message>` once and exit with code 2;
anything else is a bug and shows its traceback.
"""

EXIT_USAGE = 2  # exit code of every usage error (bad flag, bad file, bad layout)


class UsageError(ValueError):
    """Something the user asked for cannot work; the message says why and what would."""


class ConfigError(UsageError):
    """A configuration field has a value that cannot work."""


class DataError(UsageError):
    """A data file is missing, unreadable, empty or too short."""
