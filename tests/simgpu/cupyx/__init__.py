"""cupyx for the simulated GPU (see tests/simgpu/cupy): scatter_add, allow_synchronize, DeviceSynchronized."""
import numpy as _np

import cupy
from cupy import DeviceSynchronized  # noqa: F401

allow_synchronize = cupy._allow_synchronize


def scatter_add(a, slices, value):
    """a[slices] += value with repeated indices adding up (CuPy's atomic scatter-add; NumPy's add.at here)."""
    _np.add.at(a._a, cupy._unwrap(slices), cupy._unwrap(value))
