"""Host staging buffers for device arrays (comm.HostStaging): allocated once per device buffer and role, reused,
bounded. The copies themselves need a GPU (tests/test_gpu.py); the bookkeeping is tested here with plain memory."""
import numpy as np

from hsgd.comm import HostStaging


def test_one_buffer_per_device_buffer_and_role_reused_every_step():
    st = HostStaging(alloc=bytearray)
    a = st.get(1000, (3, 4), np.float32, "inout")
    assert a.shape == (3, 4) and a.dtype == np.float32 and a.flags.writeable
    for _ in range(5):                                                  # the same device buffer, step after step
        assert st.get(1000, (3, 4), np.float32, "inout") is a
    b = st.get(1000, (3, 4), np.float32, "recv")                        # another role: its own buffer
    c = st.get(2000, (3, 4), np.float32, "inout")                       # another device buffer: its own
    d = st.get(1000, (12,), np.float32, "inout")                        # another shape at the same address
    assert len({id(x) for x in (a, b, c, d)}) == 4 and st.allocated == 4
    assert not np.shares_memory(a, c)
    assert st.get(7, (0,), np.float64, "send").shape == (0,)            # empty arrays work too
    print(f"buffers allocated: {st.allocated}")


def test_least_recently_used_buffers_are_dropped():
    st = HostStaging(alloc=bytearray, max_buffers=2)
    a = st.get(1, (2,), np.float64, "inout")
    st.get(2, (2,), np.float64, "inout")
    assert st.get(1, (2,), np.float64, "inout") is a                    # 1 is now the most recently used
    st.get(3, (2,), np.float64, "inout")                                # drops 2, keeps 1
    assert st.get(1, (2,), np.float64, "inout") is a and st.allocated == 3
    st.get(2, (2,), np.float64, "inout")                                # 2 was dropped: allocated again
    assert st.allocated == 4 and len(st.buffers) == 2


def test_bytes_are_bounded_too():
    st = HostStaging(alloc=bytearray, max_bytes=3 * 8 * 100)            # room for three (100,) float64 buffers
    bufs = [st.get(p, (100,), np.float64, "inout") for p in range(5)]
    assert st.nbytes == sum(b.nbytes for b in st.buffers.values()) <= st.max_bytes and len(st.buffers) == 3
    assert st.get(4, (100,), np.float64, "inout") is bufs[4] and st.allocated == 5
    big = st.get(9, (1000,), np.float64, "inout")                       # larger than the cap alone: kept alone
    assert list(st.buffers.values()) == [big] and st.nbytes == big.nbytes
