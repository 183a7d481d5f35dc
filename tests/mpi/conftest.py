"""Helpers for tests that run on every rank of `mpiexec -n 8` (see tests/test_mpi.py).

Rule: a test computes its local verdict, then `check(ok, msg)` agrees on it over COMM_WORLD before asserting,
so that every rank fails together and nobody is left waiting in a collective.
"""
import pytest
from mpi4py import MPI
from threadpoolctl import threadpool_limits

WORLD = MPI.COMM_WORLD

threadpool_limits(1)                                  # eight ranks share the cores


def check(ok, msg=""):
    """Collective assertion: passes on every rank iff `ok` holds on every rank."""
    oks = WORLD.allgather(bool(ok))
    bad = [r for r, o in enumerate(oks) if not o]
    assert not bad, f"failed on ranks {bad}: {msg}"


def say(*args):
    """Print on world rank 0 only."""
    if WORLD.Get_rank() == 0:
        print(*args, flush=True)


def world_max(x):
    return WORLD.allreduce(float(x), op=MPI.MAX)


@pytest.fixture
def world():
    return WORLD
