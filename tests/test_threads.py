"""backend.parallel_rows and backend.parallel_batches: errors wait for every piece, pieces do not split again."""
import threading
import time

import pytest

from hsgd.backend import cpu_threads, parallel_batches, parallel_rows


@pytest.fixture
def three_threads(set_threads):
    set_threads(3)


@pytest.mark.parametrize("split", [parallel_rows, parallel_batches])
def test_an_error_is_raised_after_every_piece_has_ended(three_threads, split):
    ended = []

    def piece(lo, hi):
        if lo == 0:
            raise ValueError("piece 0 fails at once")
        time.sleep(0.3)                                         # the others are still working when it fails
        ended.append(lo)

    kwargs = {"min_rows": 1} if split is parallel_rows else {}
    with pytest.raises(ValueError):
        split(piece, 3, **kwargs)
    print(f"{split.__name__}: pieces ended before the error arrived: {sorted(ended)}")
    assert sorted(ended) == [1, 2]


@pytest.mark.timeout(20)
def test_a_piece_does_not_split_again(three_threads):
    """Inside a piece cpu_threads() is 1, so a layer called there runs inline instead of waiting on the pool whose
    threads are all busy with the outer pieces (that would never end); outside, the count is the global one."""
    seen = []

    def outer(lo, hi):
        parallel_rows(lambda a, b: seen.append((lo, cpu_threads(), threading.current_thread().name)), 9, min_rows=1)

    parallel_rows(outer, 3, min_rows=1)
    results = parallel_batches(lambda lo, hi: cpu_threads(), 3)
    print(f"inner calls (outer piece, threads, thread): {sorted(seen)}; batch slices see {results}")
    assert sorted(lo for lo, _, _ in seen) == [0, 1, 2] and all(n == 1 for _, n, _ in seen)
    assert results == [1, 1, 1] and cpu_threads() == 3
