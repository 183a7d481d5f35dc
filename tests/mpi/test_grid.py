"""The process grid on 8 ranks: placement (tp fastest, then pp, then dp), communicators from Split, errors."""
import pytest
from mpi4py import MPI

from hsgd.errors import UsageError
from hsgd.grid import GridError, ProcessGrid, factorizations

from .conftest import WORLD, check, say

pytestmark = pytest.mark.mpi(min_size=8)


def test_every_factorization_places_ranks_and_splits_communicators():
    assert len(factorizations(8)) == 10
    for dp, pp, tp in factorizations(8):
        grid = ProcessGrid(WORLD, dp=dp, pp=pp, tp=tp)
        r = WORLD.Get_rank()
        ok = (r == ProcessGrid.rank_of(grid.dp_rank, grid.pp_rank, grid.tp_rank, pp, tp)
              and (grid.tp_comm.size, grid.pp_comm.size, grid.dp_comm.size) == (tp, pp, dp)
              and (grid.tp_comm.rank, grid.pp_comm.rank, grid.dp_comm.rank) == (grid.tp_rank, grid.pp_rank,
                                                                               grid.dp_rank))
        # the members of each communicator, as world ranks, are the group the formula predicts
        groups = grid.groups()
        for dim in ("tp", "pp", "dp"):
            c = getattr(grid, f"{dim}_comm")
            members = c.comm.allgather(r)
            ok = ok and members in groups[dim] and r in members
        check(ok, f"layout dp={dp} pp={pp} tp={tp}")
        grid.free()
    say("all 10 factorizations of 8 ranks: placement and communicators as documented")


def test_tp_groups_are_consecutive_ranks():
    grid = ProcessGrid(WORLD, dp=2, pp=2, tp=2)
    g = grid.groups()
    say("dp=2 pp=2 tp=2 groups:", g)
    check(g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and g["pp"][0] == [0, 2] and g["dp"][0] == [0, 4])
    table = grid.layout_table()
    check(table.splitlines()[1].split()[:4] == ["0", "0", "0", "0"] and len(table.splitlines()) == 9)
    say(table)
    grid.free()


@pytest.mark.parametrize("sizes, words", [
    ((3, 1, 2), "dp*pp*tp = 3*1*2 = 6 does not match the 8 ranks"),
    ((8, 1, 0), "tp=0 must be a positive integer"),
    ((-1, 1, 8), "dp=-1 must be a positive integer"),
])
def test_bad_sizes_raise_on_every_rank_before_communicating(sizes, words):
    dp, pp, tp = sizes
    try:
        ProcessGrid(WORLD, dp=dp, pp=pp, tp=tp)
        msg = "no error"
    except GridError as e:
        msg = str(e)
    check(words in msg and isinstance(GridError(msg), UsageError), msg)


def test_grid_on_a_sub_communicator():
    """Any communicator works as the base: two independent 4-rank grids side by side."""
    half = WORLD.Split(color=WORLD.Get_rank() // 4, key=WORLD.Get_rank())
    grid = ProcessGrid(half, dp=2, tp=2)
    members = grid.tp_comm.comm.allgather(WORLD.Get_rank())
    base = 4 * (WORLD.Get_rank() // 4)
    check(members in ([base, base + 1], [base + 2, base + 3]), f"tp members {members}")
    total = grid.world.comm.allreduce(1, op=MPI.SUM)
    check(total == 4)
    grid.free()
    half.Free()
