"""Host staging buffers for device arrays (comm.HostStaging): a pool of buffers taken for one MPI call and given
back after it, so that a step that sends the same shapes every step allocates nothing after the first. The
copies run on the simulated GPU (tests/test_simgpu.py) and on a real one (tests/test_gpu.py); the bookkeeping is
tested here with plain memory."""
import numpy as np

from hsgd.comm import HostStaging


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


def test_free_bytes_are_bounded_least_recently_returned_dropped():
    st = HostStaging(alloc=bytearray, max_bytes=3 * 8 * 100)            # room for three free (100,) float64
    bufs = [st.take((100,), np.float64) for _ in range(5)]
    for b in bufs:
        st.give(b)
    assert st.free_bytes == sum(b.nbytes for b in st.free) <= st.max_bytes and len(st.free) == 3
    assert [id(b) for b in st.free] == [id(b) for b in bufs[2:]]          # the first two returned were dropped
    assert st.take((100,), np.float64) is bufs[4] and st.allocated == 5
    big = st.take((1000,), np.float64)                                  # larger than the cap: used, not kept
    st.give(big)
    assert all(b is not big for b in st.free) and st.free_bytes <= st.max_bytes
