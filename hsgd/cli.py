"""The command line of every hsgd command: one parser, one way to end on a usage error (chapter 19).

    parser = cli.Parser(prog="python -m hsgd.plan", description="...")           # a one-process command
    sys.exit(cli.run(lambda: work(parser.parse_args(argv))))
    parser = cli.Parser(prog="mpirun -n P python -m hsgd.train", speaks=launch.on_rank_zero)   # an MPI command,
    sys.exit(launch.run(lambda: work(parser.parse_args(argv))))                            # ended by hsgd.grid.launch

The rules every command (hsgd.train, verify, schedule, sample, plan, plan.calibrate, crosscheck, checkpoint, grid)
keeps through this module:
* A usage error, whether argparse finds it (an unknown flag, a value of the wrong type, a missing argument) or a
  check before the work does (a value out of range, a file that cannot be read or written), ends the command with
  exactly one line on stderr, `hsgd: error: <what is wrong and what would work>`, and exit code 2. argparse's own
  errors end with `(see <prog> --help)` instead of argparse's multi-line usage. Under MPI every rank exits 2 and
  rank 0 alone prints the line (hsgd.grid.launch.run).
* `--help` prints the full help and exits 0; under mpirun rank 0 alone prints (the help, or a one-process
  command's error line), every rank exits with the same code.
* The line is one line: a newline or another control character in the message (a flag's value echoed back) is
  printed escaped, so no value can add lines or draw on the terminal.
"""
import argparse
import os
import sys

from hsgd.errors import EXIT_USAGE, UsageError
from hsgd.readers import escaped


class LineBreakHelpFormatter(argparse.HelpFormatter):
    """argparse's help layout, except that a line break in a flag's help text starts a new line (one per choice)."""

    def _split_lines(self, text, width):
        lines = []
        for part in text.split("\n"):
            lines += super()._split_lines(part, width)
        return lines


# where MPI launchers tell a process its rank: MPICH's Hydra, Open MPI, PMIx, Slurm's srun
LAUNCHER_RANK = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_ID", "SLURM_PROCID")


def first_process():
    """Whether this process is the one that prints: rank 0 of the job as the launcher's environment says (without
    importing mpi4py, which a one-process command does not need), or a process started alone."""
    for name in LAUNCHER_RANK:
        value = os.environ.get(name, "")
        if value.isascii() and value.isdigit():
            return int(value) == 0
    return True


class Parser(argparse.ArgumentParser):
    """The parser of every hsgd command: an ArgumentParser whose errors raise UsageError (one line, `... (see PROG
    --help)`) instead of printing the usage and exiting, and whose help and messages are printed only where
    speaks() is true (rank 0 of an MPI job; by default the first process of the launcher, see first_process)."""

    def __init__(self, speaks=first_process, **kwargs):
        kwargs.setdefault("formatter_class", LineBreakHelpFormatter)
        super().__init__(**kwargs)
        self.speaks = speaks

    def add_subparsers(self, **kwargs):
        """Sub-commands (`python -m hsgd.checkpoint export ...`) are Parsers that print where this one does."""
        kwargs.setdefault("parser_class", lambda **kw: Parser(speaks=self.speaks, **kw))
        return super().add_subparsers(**kwargs)

    def _print_message(self, message, file=None):
        if self.speaks():
            super()._print_message(message, file)

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


MAX_LINE = 2000         # characters of an error line shown (a value echoed back can be a 5000-digit number)


def one_line(text):
    """text with every control character (a newline, an escape code) written as its escape (readers.escaped; a
    backslash stays one: the message's own !r already escaped what it quotes), at most MAX_LINE characters of it:
    one printable line."""
    text = str(text)
    shown = "".join(c if c == "\\" else escaped(c) for c in text[:MAX_LINE])
    return shown + (f"... ({len(text)} characters)" if len(text) > MAX_LINE else "")


def error_line(err):
    """The line a usage error is reported with: `hsgd: error: <message>`."""
    return f"hsgd: error: {one_line(err)}"


def run(main):
    """Call main() in a one-process command and turn its outcome into an exit code: a UsageError is printed as one
    line (error_line) and gives EXIT_USAGE; --help's exit gives 0. (MPI commands end through hsgd.grid.launch.run,
    which does the same on every rank and prints once.)"""
    try:
        return main() or 0
    except UsageError as e:
        if first_process():                       # one line, also when the command was started under mpirun
            print(error_line(e), file=sys.stderr, flush=True)
        return EXIT_USAGE
    except SystemExit as e:                       # argparse's --help (and exit(0) of a sub-command's help)
        return 0 if e.code is None else e.code if isinstance(e.code, int) else EXIT_USAGE
