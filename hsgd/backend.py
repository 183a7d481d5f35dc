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
# CPU threads for elementwise work. BLAS runs matrix products on several threads; NumPy's elementwise ufuncs run
# on one. The few heavy elementwise layers (GELU, the attention softmax) split their rows over `cpu_threads()`
# threads instead (NumPy releases the GIL inside ufuncs). One rank of an MPI job with one BLAS thread keeps 1.

_threads = {"n": 1}
_pools = {}


def set_cpu_threads(n):
    """How many threads the heavy elementwise layers may use (entry points set it to the BLAS thread count)."""
    _threads["n"] = max(1, int(n))


def cpu_threads():
    return _threads["n"]


def parallel_rows(fn, n_rows, min_rows=2):
    """Call fn(lo, hi) on cpu_threads() contiguous pieces of range(n_rows), in parallel: the last piece on the
    calling thread, the others on a pool's threads; fn writes its results into preallocated arrays. Runs inline
    when there is one thread or fewer than 2 * min_rows rows (handing work to a thread costs tens of
    microseconds)."""
    n = min(cpu_threads(), n_rows // min_rows) if n_rows >= min_rows else 1
    if n <= 1:
        fn(0, n_rows)
        return
    if n not in _pools:
        _pools[n] = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="hsgd")
    bounds = [n_rows * i // n for i in range(n + 1)]
    others = [_pools[n].submit(fn, bounds[i], bounds[i + 1]) for i in range(n - 1)]
    try:
        fn(bounds[n - 1], bounds[n])
    finally:
        for f in others:                                      # every piece has ended before anyone returns
            f.result()


_blas = {}


@contextlib.contextmanager
def one_blas_thread():
    """While parallel_rows' workers each call BLAS on their own small matrices (attention, one sequence at a time),
    BLAS itself runs on one thread: cpu_threads() single-threaded products side by side beat one product at a time
    split over the same cores, for the small matrices of attention. No-op with one worker."""
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
