"""Run pytest on every rank of an MPI job: `mpiexec -n 8 python tests/mpi_run.py tests/mpi/test_x.py ...`.

Rank 0 reports to the terminal; the other ranks write their output to $HSGD_MPI_LOGDIR/rank<r>.log (shown by
tests/test_mpi.py when something fails). Every test in tests/mpi reaches its verdict collectively before it
asserts, so all ranks pass or fail together and none waits forever in a collective.
"""
import os
import sys

from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
logdir = os.environ.get("HSGD_MPI_LOGDIR")
if rank and logdir:
    os.makedirs(logdir, exist_ok=True)
    fd = os.open(os.path.join(logdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
os.environ["HSGD_MPI_SUITE"] = "1"

import pytest  # noqa: E402  (after the redirection, so that pytest's terminal writes to the log)

sys.exit(pytest.main(sys.argv[1:]))
