"""The collective wrappers: results equal NumPy's, every call is counted with its bytes, and the
collective-sequence check turns a mismatched call into an error instead of a hang."""
import numpy as np
import pytest
from mpi4py import MPI

from hsgd.comm import Comm, CollectiveMismatch, CommStats

from .conftest import WORLD, check, say

pytestmark = pytest.mark.mpi(min_size=8)


def make(check_seq=False):
    return Comm(WORLD, "world", CommStats(), check=check_seq)


def test_allreduce_allgather_reduce_scatter_bcast():
    c = make()
    r, P = c.rank, c.size
    rows = np.arange(P, dtype=np.float64)[:, None] * 10 + np.arange(3)          # (P, 3): rank q's data is row q
    x = rows[r].copy()
    c.Allreduce(x)
    ok = np.array_equal(x, rows.sum(0))
    m = rows[r].copy()
    c.Allreduce(m, op=MPI.MAX)
    ok &= np.array_equal(m, rows.max(0))
    out = np.empty((P, 3))
    c.Allgather(rows[r].copy(), out)
    ok &= np.array_equal(out, rows)
    full = np.stack([rows * (q + 1) for q in range(P)], axis=0)[r].reshape(P, 3)  # rank r sends rows*(r+1)
    part = np.empty(3)
    c.Reduce_scatter_block(np.ascontiguousarray(full), part)
    ok &= np.allclose(part, rows[r] * sum(q + 1 for q in range(P)))
    b = np.full(4, float(r))
    c.Bcast(b, root=3)
    ok &= np.all(b == 3.0)
    req = c.Iallreduce(y := np.full(5, 1.0 + r))
    req.Wait()
    ok &= np.all(y == sum(1.0 + q for q in range(P)))
    counts = c.stats.counts()
    expected = {("world", "Allreduce"): (2, 48), ("world", "Allgather"): (1, P * 24),
                ("world", "Reduce_scatter_block"): (1, P * 24), ("world", "Bcast"): (1, 32),
                ("world", "Iallreduce"): (1, 40)}
    say("recorded:\n" + c.stats.format())
    check(ok and counts == expected, f"results ok={ok}, counts {counts}")


def test_send_recv_ring():
    c = make()
    r, P = c.rank, c.size
    x, y = np.full(6, float(r)), np.empty(6)
    if r % 2 == 0:                                    # even ranks send first: no deadlock on blocking calls
        c.Send(x, dest=(r + 1) % P)
        c.Recv(y, source=(r - 1) % P)
    else:
        c.Recv(y, source=(r - 1) % P)
        c.Send(x, dest=(r + 1) % P)
    z = np.empty(6)
    reqs = [c.Irecv(z, source=(r + 1) % P), c.Isend(x, dest=(r - 1) % P)]
    for q in reqs:
        q.Wait()
    counts = c.stats.counts()
    check(np.all(y == (r - 1) % P) and np.all(z == (r + 1) % P)
          and counts[("world", "Send")] == (1, 48) and counts[("world", "Isend")] == (1, 48))


def test_non_contiguous_buffer_is_refused():
    c = make()
    a = np.zeros((4, 4))[:, 1]
    try:
        c.Allreduce(a)
        msg = "accepted"
    except ValueError as e:
        msg = str(e)
    check("must be C-contiguous" in msg, msg)


def test_mismatched_shapes_raise_instead_of_hanging():
    c = make(check_seq=True)
    n = 3 if c.rank == 5 else 4                       # rank 5 disagrees about the shape
    try:
        c.Allreduce(np.zeros(n))
        msg = "no error"
    except CollectiveMismatch as e:
        msg = str(e)
    say(msg)
    check("rank 5: Allreduce shapes=[(3,)]" in msg and "ranks 0,1,2,3,4,6,7: Allreduce shapes=[(4,)]" in msg, msg)


def test_mismatched_operations_raise_instead_of_hanging():
    c = make(check_seq=True)
    c.Allreduce(np.zeros(2))                          # one good call first: the sequence numbers agree
    try:
        if c.rank == 2:
            c.Bcast(np.zeros(2))                      # rank 2 calls a different collective
        else:
            c.Allreduce(np.zeros(2))
        msg = "no error"
    except CollectiveMismatch as e:
        msg = str(e)
    check("rank 2: Bcast" in msg and "ranks 0,1,3,4,5,6,7: Allreduce" in msg and "call #1" in msg, msg)
