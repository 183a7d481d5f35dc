"""The one place that chooses the array module: NumPy on CPU, CuPy on GPU.

Model code never imports numpy for model arrays. It asks an array which module it belongs to
(`array_module(x)`) and computes with that, so the same code runs on NumPy and CuPy arrays. Arrays are
created on a device only here (`get_xp`, `to_device`), and come back to the host only through `to_numpy`.

    device: "cpu" (NumPy, the default) or "gpu" (CuPy); the HSGD_DEVICE environment variable sets the default.
    dtype:  "float32" (default) or "float64" (for exactness checks against the serial reference).
"""
import contextlib
import ctypes
import os
import threading
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .errors import ConfigError

DEVICES = ("cpu", "gpu")
DTYPES = {"float32": np.float32, "float64": np.float64}


def resolve_device(device=None):
    """The device name to use: the argument, else $HSGD_DEVICE, else "cpu"."""
    name = device or os.environ.get("HSGD_DEVICE") or "cpu"
    if name not in DEVICES:
        raise ConfigError(f"device={name!r} is not known; use one of {', '.join(DEVICES)}")
    return name


def get_xp(device=None):
    """The array module for `device`: numpy for "cpu", cupy for "gpu"."""
    if resolve_device(device) == "cpu":
        return np
    try:
        import cupy
    except ImportError as e:
        raise ConfigError(f"device='gpu' needs CuPy, which failed to import ({e}); "
                          "install it with `pip install -e '.[gpu]'` or use --device cpu") from None
    return cupy


def resolve_dtype(dtype="float32"):
    """A NumPy dtype from a name ("float32", "float64") or a dtype."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}")
        return np.dtype(DTYPES[dtype])
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ConfigError(f"dtype={dt.name!r} is not supported; use float32 or float64")
    return dt


def array_module(x):
    """numpy or cupy, whichever `x` belongs to (without importing cupy for NumPy arrays)."""
    if type(x).__module__.startswith("cupy"):
        import cupy
        return cupy
    return np


def to_device(a, xp):
    """Copy a host array onto the device of module `xp` (no copy for NumPy)."""
    return a if xp is np else xp.asarray(a)


def to_numpy(x):
    """A NumPy copy (or view, on CPU) of an array from either module."""
    if type(x).__module__.startswith("cupy"):
        return x.get()
    return np.asarray(x)


# ----------------------------------------------------------------------------------------------------------------
# CPU threads. NumPy releases the GIL inside ufuncs and BLAS calls, so Python threads can compute side by side.
# Two ways to use them:
#   * inside one layer (parallel_rows): BLAS runs each matrix product on several threads; the heavy elementwise
#     layers (GELU, LayerNorm, attention) split their rows over cpu_threads() threads of hsgd's own;
#   * across the batch (parallel_batches): each thread runs whole layers on its own slice of the sequences, with
#     one BLAS thread, and the gradients are added at the end (data parallelism inside one process). No work is
#     handed between threads inside the step, which on small and mid-size models is the faster of the two.
# One rank of an MPI job with one BLAS thread keeps 1 (everything inline).

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


# ----------------------------------------------------------------------------------------------------------------
# Device-to-host copies. A training step on the GPU should copy nothing back but its one small vector of
# numbers for logging and decisions (loss, non-finite count, gradient-norm parts); every such copy in the step
# goes through to_host, which counts them (tests and `make gpu-check` read the count).

_d2h = {"n": 0}


def to_host(x):
    """A NumPy copy of a (small) device array, counted as one device-to-host copy (free on the CPU)."""
    if type(x).__module__.startswith("cupy"):
        _d2h["n"] += 1
        return x.get()
    _d2h["n"] += 1
    return np.asarray(x)


def d2h_count():
    """How many to_host copies this process has made (compare before and after a step)."""
    return _d2h["n"]


def select_gpu(local_rank):
    """Use GPU local_rank % (GPUs on this machine): one GPU per rank when there are enough, else ranks share."""
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(local_rank % n).use()
    return local_rank % n, n


def scatter_add(target, index, values):
    """target[index[i]] += values[i] for every i, repeated indices adding up (NumPy's add.at, CuPy's scatter_add)."""
    if type(target).__module__.startswith("cupy"):
        import cupyx
        cupyx.scatter_add(target, index, values)
    elif index.size < target.shape[0] or index.size == 0:     # few indices, mostly distinct: add row by row
        np.add.at(target, index, values)
    else:                                                     # many repeats (vocabulary <= positions): sort the
        order = np.argsort(index, kind="stable")              # rows by index, sum each run of equal indices in
        sorted_index = index[order]                           # one reduction, add each sum once (3x faster)
        starts = np.flatnonzero(np.concatenate(([True], sorted_index[1:] != sorted_index[:-1])))
        target[sorted_index[starts]] += np.add.reduceat(values[order], starts, axis=0)
