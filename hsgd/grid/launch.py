"""Fail fast, never hang: how hsgd's MPI entry points start and end.

    sys.exit(launch.run(main))

* A usage error (bad flag, bad file, impossible layout) is found by every rank in the same set-up code, before
  any model communication. `agree` makes sure all ranks know about it even if only some found it (a file missing
  on one node), then rank 0 prints it once, `hsgd: error: ...`, and every rank exits with code 2.
* A numerical fault that all ranks agreed on (a non-finite loss with --on-nan stop, diverged replicas) is
  reported once by rank 0, `hsgd: stopped: ...`, and every rank exits with code 3.
* Any other exception on any rank prints its traceback, each line prefixed with `[rank r]`, and calls MPI_Abort
  on COMM_WORLD, which ends every rank of the job within seconds instead of leaving the others waiting in their
  next collective. (Ranks other than 0 wait a second before printing: when all ranks hit the same bug, rank 0's
  abort ends them first and the traceback appears once.)
"""
import sys
import time
import traceback

from mpi4py import MPI

from hsgd.cli import error_line, one_line
from hsgd.errors import EXIT_NUMERICAL, EXIT_SIGNAL, EXIT_USAGE, NumericalFault, Stopped, UsageError


def on_rank_zero():
    """Whether this process prints a command's help and messages: rank 0 of COMM_WORLD (hsgd.cli.Parser's speaks)."""
    return MPI.COMM_WORLD.Get_rank() == 0


def agree(world, fn):
    """Run fn() on every rank; if it raises UsageError on any rank, raise one on every rank (first message)."""
    try:
        result, err = fn(), None
    except UsageError as e:
        result, err = None, str(e)
    errors = world.allgather(err)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        r, e = bad[0]
        same = all(x == e for x in errors)
        raise UsageError(e if same else f"(rank {r}) {e}")
    return result


def run(main, world=MPI.COMM_WORLD):
    """Call main() and turn its outcome into an exit code, aborting the whole job on an unexpected exception."""
    try:
        code = main() or 0
        world.Barrier()             # nobody finalizes while another rank still works: its error must reach stderr
        return code
    except UsageError as e:
        if world.Get_rank() == 0:
            print(error_line(e), file=sys.stderr, flush=True)
        return EXIT_USAGE
    except (NumericalFault, Stopped) as e:
        if world.Get_rank() == 0:                                   # every rank agreed on it: report once
            print(f"hsgd: stopped: {one_line(e)}", file=sys.stderr, flush=True)
        return EXIT_NUMERICAL if isinstance(e, NumericalFault) else EXIT_SIGNAL
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    except BaseException:
        rank = world.Get_rank()
        text = "".join(f"[rank {rank}] {line}\n" for line in traceback.format_exc().splitlines())
        if rank != 0:
            # When every rank fails the same way, rank 0's abort ends the others during this pause, and the
            # traceback is printed once; a rank that fails alone prints its own a moment later.
            time.sleep(1.0)
        sys.stderr.write(text + f"[rank {rank}] aborting the job (MPI_Abort on COMM_WORLD)\n")
        sys.stderr.flush()
        time.sleep(0.5)             # the launcher forwards the message before the abort tears its streams down
        world.Abort(1)
