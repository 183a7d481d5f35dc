"""Host staging buffers for device arrays (comm.HostStaging): a pool of buffers taken for one MPI call and given
back after it, so that a step that sends the same shapes every step allocates nothing after the first. The
copies run on the simulated GPU (tests/test_simgpu.py) and on a real one (tests/test_gpu.py); the bookkeeping is
tested here with plain memory."""
import numpy as np
import pytest

from hsgd.grid.comm import HostStaging


def test_a_given_back_buffer_is_taken_again_for_its_shape():
    st = HostStaging(alloc=bytearray)
    a = st.take((3, 4), np.float32)
    assert a.shape == (3, 4) and a.dtype == np.float32 and a.flags.writeable
    for _ in range(5):                                                  # one call per step, step after step
        st.give(a)
        assert st.take((3, 4), np.float32) is a
    b = st.take((3, 4), np.float32)                                     # a is in use: another buffer
    c = st.take((12,), np.float32)                                      # another shape
    d = st.take((3, 4), np.float64)                                     # another dtype
    assert len({id(x) for x in (a, b, c, d)}) == 4 and st.allocated == 4
    assert not np.shares_memory(a, b)
    assert st.take((0,), np.float64).shape == (0,)                      # empty arrays work too
    print(f"buffers allocated: {st.allocated}")


def test_buffers_in_use_at_once_each_get_their_own():
    st = HostStaging(alloc=bytearray)
    for step in range(4):                                               # three calls in flight, then all Wait
        bufs = [st.take((8,), np.float64) for _ in range(3)]
        assert len({id(b) for b in bufs}) == 3
        for b in bufs:
            st.give(b)
    assert st.allocated == 3


def test_by_default_the_pool_keeps_every_buffer_and_refuses_one_given_back_twice():
    st = HostStaging(alloc=bytearray)
    bufs = [st.take((100,), np.float64) for _ in range(5)]              # five calls in flight at once
    for b in bufs:
        st.give(b)
    again = [st.take((100,), np.float64) for _ in range(5)]            # the next step: the same five
    assert {id(b) for b in again} == {id(b) for b in bufs} and st.allocated == 5
    st.give(bufs[0])
    with pytest.raises(ValueError, match="given back twice"):
        st.give(bufs[0])                                                # would be handed to two calls at once


def test_max_bytes_drops_free_buffers_in_take_least_recently_returned_first():
    """Dropping happens in take, which runs after the stream is synchronized (a copy may read a buffer until then);
    the most recently returned buffer is always kept, so a buffer larger than the cap is still reused."""
    cap = 3 * 8 * 100                                                   # three free (100,) float64 buffers
    st = HostStaging(alloc=bytearray, max_bytes=cap)
    bufs = [st.take((100,), np.float64) for _ in range(5)]
    for b in bufs:
        st.give(b)
    assert len(st.free) == 5                                            # give drops nothing
    assert st.take((100,), np.float64) is bufs[4]                       # the most recently returned
    assert [id(b) for b in st.free] == [id(b) for b in bufs[2:4]] and st.free_bytes == sum(b.nbytes for b in st.free)
    big = st.take((1000,), np.float64)                                  # larger than the cap
    st.give(big)
    assert st.take((1000,), np.float64) is big and st.allocated == 6
    st.give(big)
    st.take((7,), np.float64)
    assert [id(b) for b in st.free] == [id(big)]                        # the older ones dropped, the last kept


def test_a_request_waited_twice_gives_its_buffer_back_once():
    from mpi4py import MPI

    from hsgd.grid.comm import Comm, Request
    comm, given = Comm(MPI.COMM_SELF, "self"), []
    req = Request(MPI.REQUEST_NULL, comm, "Irecv", 8, 0.0, done=lambda: given.append(1))
    req.Wait()
    req.Wait()
    assert given == [1] and comm.stats.calls("self", "Irecv") == 1


def test_the_cuda_support_query_is_found_in_a_privately_loaded_mpi():
    """hsgd asks the MPI whether it is CUDA-aware (MPIX_Query_cuda_support). PyPI's mpich wheel is loaded out of the
    process's global namespace, where a lookup of the global symbols alone misses the query and would take every
    MPI for one that is not CUDA-aware: the query must be found wherever a loaded libmpi exports it."""
    import ctypes
    import os

    from mpi4py import MPI  # noqa: F401 (loads the MPI library)

    from hsgd.grid.comm import cuda_support_query
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc/self/maps: the loaded libraries cannot be listed here")
    libs = sorted({line.split()[-1] for line in open("/proc/self/maps") if "/libmpi" in line})
    exported = [p for p in libs if hasattr(ctypes.CDLL(p), "MPIX_Query_cuda_support")]
    print(f"loaded MPI libraries {libs}; exporting the query: {exported}")
    if not exported:
        pytest.skip("this MPI does not export MPIX_Query_cuda_support")
    query = cuda_support_query()
    assert query is not None and query() in (0, 1)
