"""CPU threads for the tuned layers (hsgd.model.kernels), and the process settings that go with them.

NumPy releases Python's GIL inside ufuncs and BLAS calls, so Python threads can compute side by side. hsgd uses
them two ways:
  * inside one layer (parallel_rows): BLAS runs each matrix product on its own threads; the heavy elementwise
    layers (GELU, LayerNorm, attention's pieces) split their rows over cpu_threads() threads of hsgd's own;
  * across the batch (parallel_batches): each thread runs whole layers on its own slice of the sequences, with
    one BLAS thread, and the gradients are added at the end (data parallelism inside one process). No work is
    handed between threads inside the step, which on small and mid-size models is the faster of the two.
One rank of an MPI job with one BLAS thread keeps cpu_threads() = 1: everything runs inline.

Process settings, outside the model code:
  * OPENBLAS_THREAD_TIMEOUT. OpenBLAS's worker threads spin for a while after each matrix product, waiting for
    the next one (2^28 cycles by default, about 0.1 s at 3 GHz). Between products hsgd runs its elementwise layers
    and attention on threads of its own, and a spinning BLAS thread takes a core from them: about a tenth of a
    mid-size step on 2 cores. A timeout of 2^4 cycles lets the BLAS threads sleep at once. OpenBLAS reads the
    variable once, when NumPy loads it, so it must be in the environment before NumPy is first imported.
    `import hsgd` imports this module before anything else and sets it (unless it is set already) when NumPy is
    not loaded yet, which is the case for `python -m hsgd.*`, the benchmarks and the tutorials. A program that
    imports NumPy first has started OpenBLAS with the default; setting the variable then changes nothing, and
    openblas_note() says so (hsgd.train prints it in its header). To be independent of import order, set it
    where the process starts:
        OPENBLAS_THREAD_TIMEOUT=4 python my_script.py        (or: export OPENBLAS_THREAD_TIMEOUT=4; mpirun ...)
    (Other BLAS libraries ignore the variable.)
  * tune_allocator(): glibc keeps freed memory instead of handing it back to the operating system.

Pass-through for GPU arrays: parallel_rows runs inline for arrays of a module other than NumPy (a GPU's current
device and stream belong to the thread that set them).
"""
import os
import sys

# Before NumPy is imported (below, and by any module imported after this one): see the docstring.
_TIMEOUT = "4"
_NUMPY_WAS_LOADED = "numpy" in sys.modules                    # then OpenBLAS has read its environment already
_TIMEOUT_GIVEN = "OPENBLAS_THREAD_TIMEOUT" in os.environ      # set where the process started: in effect
if not _TIMEOUT_GIVEN and not _NUMPY_WAS_LOADED:
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = _TIMEOUT

import contextlib  # noqa: E402
import ctypes  # noqa: E402
import threading  # noqa: E402
from concurrent import futures  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import numpy as np  # noqa: E402


def openblas_note():
    """None if OPENBLAS_THREAD_TIMEOUT is in effect for this process (it was in the environment at start, or hsgd
    set it before NumPy loaded OpenBLAS); else a one-line note saying how to set it (for a run's header)."""
    if _TIMEOUT_GIVEN or not _NUMPY_WAS_LOADED:
        return None
    return (f"note: NumPy was imported before hsgd, so OpenBLAS keeps its default thread timeout (idle BLAS "
            f"threads spin and take cores from hsgd's threads); set OPENBLAS_THREAD_TIMEOUT={_TIMEOUT} in the "
            f"environment, or import hsgd first")


# ----------------------------------------------------------------------------------------------------------------
# How many threads, and the pools that run them

_threads = {"n": 1}
_pools = {}
_local = threading.local()          # .n: this thread's own count (1 inside a batch slice), overriding _threads


def set_cpu_threads(n):
    """How many threads hsgd's layers may use (entry points set it to the BLAS thread count)."""
    _threads["n"] = max(1, int(n))


def cpu_threads():
    """The threads a layer may use from here: 1 on a thread that already is one of parallel_batches' slices."""
    return getattr(_local, "n", None) or _threads["n"]


def _pool(n):
    """The pool of n - 1 workers that, with the calling thread, make n."""
    if n not in _pools:
        _pools[n] = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="hsgd")
    return _pools[n]


def _side_by_side(fn, bounds):
    """[fn(lo, hi) for the pieces [bounds[i], bounds[i+1])]: the last piece on the calling thread, the others on the
    pool. Each piece runs alone on its thread (cpu_threads() is 1 there, so nothing inside a piece splits again and
    waits on the pool it is part of). Returns once every piece has ended; then raises the first error, if any."""
    n = len(bounds) - 1

    def alone(lo, hi):
        before = getattr(_local, "n", None)
        _local.n = 1
        try:
            return fn(lo, hi)
        finally:
            _local.n = before

    others = [_pool(n).submit(alone, bounds[i], bounds[i + 1]) for i in range(n - 1)]
    try:
        last = alone(bounds[n - 1], bounds[n])
    finally:
        futures.wait(others)                                    # every piece has ended before anyone returns
    return [f.result() for f in others] + [last]


# ----------------------------------------------------------------------------------------------------------------
# The two ways to split work

def parallel_batches(fn, n_items):
    """[fn(lo, hi) for the cpu_threads() contiguous slices of range(n_items)], computed side by side (the last on
    the calling thread), each slice alone on its thread (its layers do not split their rows again), with BLAS on one
    thread for the duration. With one thread (or one item): [fn(0, n_items)]. Results in slice order; an exception
    is raised after every slice has ended."""
    n = min(cpu_threads(), n_items)
    if n <= 1:
        return [fn(0, n_items)]
    with one_blas_thread():
        return _side_by_side(fn, [n_items * i // n for i in range(n + 1)])


def parallel_rows(fn, n_rows, min_rows=2, xp=np):
    """Call fn(lo, hi) on cpu_threads() contiguous pieces of range(n_rows), in parallel (the last piece on the
    calling thread); fn writes its results into preallocated arrays. Runs inline when there is one thread, fewer
    than 2 * min_rows rows (handing work to a thread costs tens of microseconds), or arrays of a module other than
    NumPy (xp: a GPU's current device and stream belong to the thread that set them). An exception is raised
    after every piece has ended."""
    n = min(cpu_threads(), n_rows // min_rows) if n_rows >= min_rows else 1
    if n <= 1 or xp is not np:
        fn(0, n_rows)
        return
    _side_by_side(fn, [n_rows * i // n for i in range(n + 1)])


_blas = {}


@contextlib.contextmanager
def one_blas_thread():
    """While several threads each call BLAS on their own matrices (parallel_rows' attention pieces, parallel_batches'
    slices), BLAS itself runs on one thread: single-threaded products side by side beat one product at a time split
    over the same cores, for these matrices. No-op with one thread."""
    if cpu_threads() <= 1:
        yield
        return
    if "ctl" not in _blas:
        from threadpoolctl import ThreadpoolController
        _blas["ctl"] = ThreadpoolController()
    with _blas["ctl"].limit(limits=1, user_api="blas"):
        yield


# ----------------------------------------------------------------------------------------------------------------
# Memory

def tune_allocator():
    """Keep freed memory in the process instead of returning it to the OS (glibc's mmap threshold), so that the
    large temporaries of a training step reuse pages instead of faulting in fresh ones every step (a few percent
    of a step). No effect outside glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)                               # M_MMAP_THRESHOLD: 1 GiB
        libc.mallopt(-1, (1 << 31) - 1)                         # M_TRIM_THRESHOLD: never trim
    except (OSError, AttributeError):
        pass
