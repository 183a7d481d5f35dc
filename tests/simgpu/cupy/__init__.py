"""A simulated GPU: a stand-in for CuPy, backed by NumPy, that keeps CuPy's rules at the host/device boundary.

    PYTHONPATH=tests/simgpu mpirun -n 2 python -m hsgd.verify --device gpu      # the GPU path, on a CPU

It is not a GPU and says nothing about kernels, speed or memory. What it does check, on any machine, is the part of
the GPU path that goes wrong silently on a real one:

  * device arrays are their own type (`cupy.ndarray`, which does not subclass numpy.ndarray), so hsgd's
    `array_module` and `HostStaging` take their GPU branches;
  * an implicit conversion to NumPy raises (`np.asarray(x)`, `np.exp(x)` into a NumPy `out=`), as in CuPy;
  * a host array mixed into device arithmetic raises (`x + numpy_array`, `cupy.exp(numpy_array)`), as in CuPy;
  * every device-to-host transfer is counted (`.get()`, `asnumpy`, `float(x)`, `x.item()`, `bool(x)`, printing,
    a boolean mask, `nonzero`, `unique`), and under `cupyx.allow_synchronize(False)` raises
    `cupyx.DeviceSynchronized`, as CuPy does for the transfers that synchronize;
  * host-to-device copies are counted (`cupy.asarray(numpy_array)`, `x.set(host)`);
  * MPI sees device memory only through `__cuda_array_interface__` (no buffer protocol), which is how mpi4py hands
    a CuPy array to a CUDA-aware MPI. Here the "device" pointer is host memory, so any MPI can read it: both of
    hsgd's transfer paths run, the CUDA-aware one (HSGD_CUDA_AWARE=1) and pinned host staging (HSGD_CUDA_AWARE=0);
  * the stream: every device operation counts as a kernel queued on it, and a synchronization (the stream's or
    the device's, or a device-to-host copy) waits for them all. Handing MPI a device pointer while kernels are
    still queued raises, because a real GPU might still be writing that memory while MPI reads it. `x.set(host)`
    is an asynchronous copy, as in CuPy: if `host` changes before the next synchronization (MPI writing into a
    staging buffer that is still being read), that synchronization raises;

  * only functions CuPy has: the module offers an explicit list (FUNCTIONS), each checked against CuPy's table
    of NumPy functions it implements, so that hsgd cannot start using one a real GPU would lack.

`counts` holds the totals: d2h (device-to-host transfers, explicit or implicit), h2d, pinned (pinned host
allocations). `cupy.cuda` simulates $SIMGPU_DEVICES devices (default 1): `runtime.getDeviceCount`,
`Device(i).use()`, streams, and `alloc_pinned_memory`. Functions come from NumPy through the module's
`__getattr__`: arguments are unwrapped, results wrapped.

What it cannot see: CuPy's kernels and their rounding, arguments CuPy's versions of a function do not take, a
kernel on the wrong stream, and memory. Those need `make gpu-check` on a GPU.
"""
import contextlib
import operator
import os

import numpy as _np

__version__ = "simulated"
SIMULATED = True

counts = {"d2h": 0, "h2d": 0, "pinned": 0}   # device-to-host transfers (each one a sync), host-to-device
                                             # copies, pinned host allocations
_allow_sync = [True]                         # cupyx.allow_synchronize(False) sets False
_queued = [False]                            # kernels queued on the stream since the last synchronization
_reading = []                                # (host array, its contents): asynchronous copies still reading it
SIZED = ("nonzero", "unique", "argwhere", "flatnonzero", "bincount")   # results whose size the host must read: a
                                                                         # transfer


class DeviceSynchronized(RuntimeError):
    """Raised for a synchronizing transfer inside cupyx.allow_synchronize(False) (cupyx.DeviceSynchronized)."""


def _synchronize(what):
    """The host waits for everything queued on the stream: refused inside allow_synchronize(False); and an
    asynchronous copy from host memory (ndarray.set) must have read what the host had when it was queued."""
    if not _allow_sync[0]:
        raise DeviceSynchronized(f"{what} synchronizes the device")
    _queued[0] = False
    changed = [src for src, was in _reading if not _np.array_equal(src, was, equal_nan=True)]
    _reading.clear()
    if changed:
        raise RuntimeError("host memory was overwritten while an asynchronous host-to-device copy (ndarray.set) "
                           "was still reading it; synchronize the stream before reusing the host buffer "
                           "(simulated GPU)")


def _to_host(what):
    """Count one device-to-host transfer, which synchronizes the device."""
    counts["d2h"] += 1
    _synchronize(f"{what} copies device memory to the host, which")


def _queue():
    """A kernel (or an asynchronous copy) is queued on the stream: the host must synchronize before MPI reads."""
    _queued[0] = True


def _unwrap(x):
    """The NumPy array inside a device array, recursively through lists and tuples; a host array raises."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, _np.ndarray):
        raise TypeError(f"Unsupported type {type(x)}: a host (NumPy) array cannot be an operand of a device "
                        "operation; copy it with cupy.asarray first")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    return x


def _operand(x):
    """An operand of arithmetic or a ufunc: a device array or a scalar (CuPy refuses host arrays and lists)."""
    if isinstance(x, (list, tuple)):
        raise TypeError(f"Unsupported type {type(x)}: a list is not an operand of a device operation")
    return _unwrap(x)


def _wrap(r):
    """Device arrays for NumPy results (scalars from reductions become 0-d device arrays, as in CuPy)."""
    if isinstance(r, _np.ndarray):
        return ndarray(r)
    if isinstance(r, _np.generic):
        return ndarray(_np.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(v) for v in r)
    if isinstance(r, list):
        return [_wrap(v) for v in r]
    return r


def _device_call(fn, args, kwargs):
    _queue()
    return _wrap(fn(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()}))


class _Pointer:
    def __init__(self, ptr):
        self.ptr = ptr


class ndarray:
    """A device array: a NumPy array the host may not read without a counted transfer."""
    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100

    def __init__(self, a):
        self._a = a

    # ---- metadata: free, as in CuPy
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray(self._a.T))
    data = property(lambda self: _Pointer(self._a.__array_interface__["data"][0]))
    device = property(lambda self: cuda.Device())

    def __len__(self):
        return len(self._a)

    @property
    def __cuda_array_interface__(self):
        """How mpi4py finds the memory of a device array (the pointer is host memory here)."""
        if _queued[0]:
            raise RuntimeError("a device pointer handed out while kernels are still queued on the stream: MPI could "
                               "read memory the GPU is still writing; synchronize the stream first (simulated GPU)")
        ai = self._a.__array_interface__
        return {"shape": ai["shape"], "typestr": ai["typestr"], "data": ai["data"], "strides": ai["strides"],
                "version": 3, "stream": None}

    # ---- transfers
    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is not None and not (isinstance(out, _np.ndarray) and out.shape == self.shape and
                                    out.dtype == self.dtype and out.flags.c_contiguous):
            raise TypeError("get(out=...) needs a C-contiguous numpy.ndarray of the array's shape and dtype")
        _to_host("ndarray.get()")
        if out is None:
            return self._a.copy()
        out[...] = self._a
        return out

    def set(self, arr, stream=None):
        """An asynchronous copy from host memory: `arr` must not change until the stream is synchronized."""
        if not (isinstance(arr, _np.ndarray) and arr.shape == self.shape and arr.dtype == self.dtype):
            raise TypeError("set() needs a numpy.ndarray of the array's shape and dtype")
        _queue()
        counts["h2d"] += 1
        self._a[...] = arr
        _reading.append((arr, arr.copy()))

    def tobytes(self, order="C"):
        _to_host("ndarray.tobytes()")
        return self._a.tobytes(order)

    def item(self):
        _to_host("ndarray.item()")
        return self._a.item()

    def tolist(self):
        _to_host("ndarray.tolist()")
        return self._a.tolist()

    def __float__(self):
        _to_host("float(device array)")
        return float(self._a)

    def __int__(self):
        _to_host("int(device array)")
        return int(self._a)

    def __index__(self):
        _to_host("a device array used as an index")
        return operator.index(self._a)

    def __bool__(self):
        _to_host("bool(device array)")
        return bool(self._a)

    def __repr__(self):
        _to_host("printing a device array")
        return repr(self._a).replace("array(", "device_array(")

    __str__ = __repr__

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct "
                        "a NumPy array explicitly.")

    def __iter__(self):
        return (ndarray(row) if isinstance(row, _np.ndarray) else _wrap(row) for row in self._a)

    # ---- indexing
    def _key(self, key):
        k = key if isinstance(key, tuple) else (key,)
        for part in k:
            if isinstance(part, ndarray) and part.dtype == bool:
                _to_host("a boolean mask (the result's size)")
            if isinstance(part, _np.ndarray):               # CuPy copies a NumPy index to the device
                counts["h2d"] += 1
        return tuple(p._a if isinstance(p, ndarray) else p for p in k) if isinstance(key, tuple) else \
            (key._a if isinstance(key, ndarray) else key)

    def __getitem__(self, key):
        return _wrap(self._a[self._key(key)])

    def __setitem__(self, key, value):
        _queue()
        if isinstance(value, _np.ndarray):                  # CuPy copies a NumPy value to the device
            counts["h2d"] += 1
        else:
            value = _unwrap(value)
        self._a[self._key(key)] = value

    # ---- the rest of the methods (sum, reshape, astype, fill, ...): NumPy's, on the device
    def __getattr__(self, name):
        if name.startswith("__") or name in ("ctypes", "tofile", "dump", "dumps"):
            raise AttributeError(name)                      # no __array_interface__, no buffer: stay on the device
        attr = getattr(self._a, name)
        if callable(attr):
            return lambda *args, **kwargs: _device_call(attr, args, kwargs)
        return _wrap(attr)

    # ---- NumPy functions and ufuncs on device arrays dispatch to this module, as CuPy's do
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if any(isinstance(x, _np.ndarray) for x in inputs + tuple(kwargs.get("out", ()))):
            return NotImplemented                           # a host array among the operands: TypeError
        return _device_call(getattr(ufunc, method), inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        if func.__name__ not in FUNCTIONS:
            raise TypeError(f"numpy.{func.__name__} on a device array: not among the functions the simulated cupy "
                            "offers (FUNCTIONS: those checked to exist in CuPy)")
        if func.__name__ in SIZED:
            _to_host(f"{func.__name__} (the result's size)")
        return _device_call(func, args, kwargs)


def _op(name):
    return getattr(operator, name + "_" if name in ("and", "or") else name)


def _binary(name):
    op = _op(name)

    def f(self, other):
        _queue()
        return _wrap(op(self._a, _operand(other)))
    return f


def _reflected(name):
    op = _op(name)

    def f(self, other):
        _queue()
        return _wrap(op(_operand(other), self._a))
    return f


def _inplace(name):
    op = _op(name)

    def f(self, other):
        _queue()
        op(self._a, _operand(other))
        return self
    return f


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
              "lshift", "rshift"):
    setattr(ndarray, f"__{_name}__", _binary(_name))
    setattr(ndarray, f"__r{_name}__", _reflected(_name))
    setattr(ndarray, f"__i{_name}__", _inplace(f"i{_name}"))
for _name in ("lt", "le", "eq", "ne", "gt", "ge"):
    setattr(ndarray, f"__{_name}__", _binary(_name))
for _name in ("neg", "pos", "abs", "invert"):
    setattr(ndarray, f"__{_name}__", (lambda op: lambda self: (_queue(), ndarray(op(self._a)))[1])(
        getattr(operator, _name)))
ndarray.__hash__ = None


# ---------------------------------------------------------------------------------------------- module functions
def asarray(a, dtype=None, order=None):
    """A device array: no copy for one already on the device, a counted host-to-device copy otherwise."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    _queue()
    counts["h2d"] += 1
    return ndarray(_np.array(a, dtype=dtype, order=order or "K"))


def array(a, dtype=None, copy=True, order="K"):
    if isinstance(a, ndarray):
        return ndarray(_np.array(a._a, dtype=dtype, copy=copy, order=order))
    return asarray(a, dtype=dtype)


def asnumpy(a, stream=None, out=None):
    if isinstance(a, ndarray):
        return a.get(out=out)
    return _np.asarray(a)


def get_array_module(*args):
    import sys
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else _np


class _Ufunc:
    """A NumPy ufunc applied to device arrays, with its methods (reduce, at, ...)."""

    def __init__(self, uf):
        self._uf, self.__name__ = uf, uf.__name__

    def __call__(self, *args, **kwargs):
        for a in args:
            _operand(a)                                     # refuses lists and host arrays
        return _device_call(self._uf, args, kwargs)

    def __getattr__(self, method):
        fn = getattr(self._uf, method)
        return (lambda *args, **kwargs: _device_call(fn, args, kwargs)) if callable(fn) else fn


# The functions this module offers: each one exists in CuPy (its "Comparison Table" of NumPy and CuPy APIs lists it
# as implemented). NumPy has many CuPy lacks, and NumPy would run them all here, so a function is added to this
# list only after checking that table: then hsgd code cannot start using one that a real GPU would not have.
FUNCTIONS = frozenset("""
    abs absolute add all allclose any arange argmax argmin argsort argwhere array_equal ascontiguousarray bincount
    broadcast_to clip
    concatenate copysign copyto cos count_nonzero cumsum divide dot einsum empty empty_like equal exp expand_dims
    expm1 eye
    flatnonzero frexp full full_like greater greater_equal isfinite isinf isnan ldexp less less_equal log log1p
    logical_and logical_not logical_or matmul max maximum mean min minimum multiply negative nonzero ones ones_like
    outer power prod reciprocal reshape rint searchsorted sign signbit sin split sqrt square squeeze stack subtract
    sum swapaxes take
    tanh tensordot transpose tril triu unique where zeros zeros_like
""".split())
CONSTANTS = frozenset("inf nan pi e newaxis float16 float32 float64 int8 int16 int32 int64 uint8 uint32 uint64 "
                      "bool_ complex64 complex128 dtype".split())


def __getattr__(name):
    """cupy.<name>: NumPy's function of that name on device arrays (FUNCTIONS); NumPy's types and constants."""
    if name in CONSTANTS:
        return getattr(_np, name)
    if name not in FUNCTIONS:
        raise AttributeError(f"the simulated cupy offers no {name!r}: it offers only functions that CuPy has "
                             "(tests/simgpu/cupy FUNCTIONS; add one after checking CuPy's comparison table)")
    obj = getattr(_np, name)
    if isinstance(obj, _np.ufunc):
        return _Ufunc(obj)
    if name in SIZED + ("where",):
        def sized(*args, **kwargs):
            if name != "where" or len(args) == 1:           # where(cond) is nonzero(cond)
                _to_host(f"cupy.{name} (the result's size)")
            return _device_call(obj, args, kwargs)
        return sized
    return lambda *args, **kwargs: _device_call(obj, args, kwargs)


# ---------------------------------------------------------------------------------------------- cupy.cuda
class _Stream:
    def synchronize(self):                                  # every queued kernel and copy is done
        _synchronize("Stream.synchronize()")


class _Device:
    _current = [0]

    def __init__(self, device=None):
        self.id = self._current[0] if device is None else int(device)
        if not 0 <= self.id < _n_devices():
            raise RuntimeError(f"cudaErrorInvalidDevice: device {self.id} of {_n_devices()} (simulated)")

    def use(self):
        self._current[0] = self.id

    def synchronize(self):
        _synchronize("Device.synchronize()")

    def __enter__(self):
        self._before = self._current[0]
        self.use()
        return self

    def __exit__(self, *exc):
        self._current[0] = self._before


def _n_devices():
    return int(os.environ.get("SIMGPU_DEVICES", "1"))


class _Runtime:
    @staticmethod
    def getDeviceCount():
        return _n_devices()

    @staticmethod
    def getDeviceProperties(i):
        return {"name": b"simulated GPU (NumPy)", "totalGlobalMem": 0}


class _Cuda:
    Device = _Device
    runtime = _Runtime()
    Stream = _Stream
    _stream = _Stream()

    def get_current_stream(self):
        return self._stream

    @staticmethod
    def alloc_pinned_memory(nbytes):
        """Page-locked host memory in CuPy; plain host memory here (any object with the buffer protocol)."""
        counts["pinned"] += 1
        return bytearray(nbytes)


cuda = _Cuda()


@contextlib.contextmanager
def _allow_synchronize(allow):
    before = _allow_sync[0]
    _allow_sync[0] = bool(allow)
    try:
        yield
    finally:
        _allow_sync[0] = before
