"""hsgd.model.threads: parallel_rows and parallel_batches (errors wait for every piece, pieces do not split again), and
whether OPENBLAS_THREAD_TIMEOUT took effect (a note when NumPy was imported before hsgd)."""
import os
import subprocess
import sys
import threading
import time

import pytest

from hsgd.model.threads import cpu_threads, parallel_batches, parallel_rows


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


def note_in_fresh_process(imports, timeout_value=None):
    """threads.openblas_note() in a new Python process that runs `imports` first; the environment without
    OPENBLAS_THREAD_TIMEOUT, or with it set to timeout_value. Returns (note, the variable as the process saw it)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if timeout_value is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = timeout_value
    code = (f"{imports}; import os, hsgd.model.threads as t; print(t.openblas_note()); "
            "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    note, value = out.stdout.strip().splitlines()
    return note, value


@pytest.mark.parametrize("imports, timeout_value, expect_note", [
    ("import numpy; import hsgd", None, True),          # NumPy first: OpenBLAS started with its default
    ("import hsgd; import numpy", None, False),         # hsgd first: hsgd set the variable before OpenBLAS loaded
    ("import numpy; import hsgd", "4", False),          # set where the process started: in effect either way
])
def test_openblas_note_says_when_the_timeout_did_not_take_effect(imports, timeout_value, expect_note):
    note, value = note_in_fresh_process(imports, timeout_value)
    print(f"{imports!r}, OPENBLAS_THREAD_TIMEOUT={timeout_value} at start: note {note!r}; variable {value!r}")
    if expect_note:
        assert "OPENBLAS_THREAD_TIMEOUT=4" in note and value == "None"
    else:
        assert note == "None" and value == "4"
