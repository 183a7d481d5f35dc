"""The one place that chooses the array module: NumPy on CPU, CuPy on GPU.

Model code never imports numpy for model arrays. It asks an array which module it belongs to
(`array_module(x)`) and computes with that, so the same code runs on NumPy and CuPy arrays. Arrays are
created on a device only here (`get_xp`, `to_device`), and come back to the host only through `to_numpy`.

    device: "cpu" (NumPy, the default) or "gpu" (CuPy); the HSGD_DEVICE environment variable sets the default.
    dtype:  "float32" (default) or "float64" (for exactness checks against the serial reference).

Also here: the counted device-to-host copies (to_host), the GPU each rank uses (select_gpu) and the scatter-add
the embedding's backward needs on either module. CPU threads are in hsgd/model/threads.py.
"""
import os

import numpy as np

from hsgd.errors import ConfigError

DEVICES = ("cpu", "gpu")
# the arrays' dtype for each --dtype: bfloat16 and float16 are emulated on float32 arrays (hsgd.model.precision)
DTYPES = {"float32": np.float32, "float64": np.float64, "bfloat16": np.float32, "float16": np.float32}


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
    """A NumPy dtype from a name ("float32", "float64"; "bfloat16" and "float16": float32, whose arrays hold
    their values, hsgd.model.precision) or a dtype."""
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
