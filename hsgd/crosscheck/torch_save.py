"""One tensor as torch.save wrote it into a chunk of a Distributed Checkpoint (DCP's default torch_save format),
read without unpickling (hsgd.crosscheck.dcp reads the chunks with it).

torch.save writes a zip: ARCHIVE/data.pkl, a pickle of a few opcodes naming the storage's dtype and the tensor's
offset, size and strides, `_rebuild_tensor_v2(persistent storage, offset, size, stride, requires_grad,
OrderedDict())`; ARCHIVE/data/KEY, the raw storage; ARCHIVE/byteorder. plain_tensor walks data.pkl with
pickletools.genops, a disassembler that executes nothing, and accepts only those opcodes and three globals;
torch_chunk checks every member (stored, not compressed; the storage numel x itemsize bytes; the strided view
inside it) before it makes the array. Anything else is one DumpError line naming the chunk.

    torch_chunk(raw bytes, dtype, sizes, where) -> np.ndarray       zeros(size, dtype, where): an empty chunk's
"""
import io
import math
import pickletools
import zipfile
import zlib
from dataclasses import dataclass

import numpy as np

from hsgd.readers import printable
from .dump import DumpError
from .safetensors import bf16_to_float32

MAX_PICKLE = 1 << 16              # bytes of a chunk's data.pkl (a plain tensor's is ~160)
MAX_DIMS = 64
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}
STORAGES = {"torch DoubleStorage": "float64", "torch FloatStorage": "float32", "torch HalfStorage": "float16",
            "torch BFloat16Storage": "bfloat16", "torch LongStorage": "int64", "torch IntStorage": "int32"}
REBUILD, HOOKS = "torch._utils _rebuild_tensor_v2", "collections OrderedDict"


def zeros(size, dtype, where):
    """np.zeros(size) (bfloat16 as float32), a shape numpy refuses one DumpError line (Checkpoint's check_shape
    bounds keep it from happening)."""
    try:
        return np.zeros(size, np.float32 if dtype == "bfloat16" else dtype)
    except (ValueError, MemoryError) as e:
        raise DumpError(f"{where}: numpy cannot make its array of size {list(size)} ({type(e).__name__}: "
                        f"{printable(str(e), 80)}); the metadata is corrupt or crafted") from None


@dataclass
class Global:
    name: str             # "module name", as GLOBAL's argument


@dataclass
class Persistent:
    pid: tuple


@dataclass
class Call:
    func: object
    args: tuple


def plain_tensor(pkl, where):
    """(storage dtype, storage key, storage numel, offset, size, stride) of a torch.save'd plain tensor's data.pkl,
    read by disassembling it (pickletools.genops: nothing is executed) with a stack of plain values; any opcode or
    global a plain tensor's pickle does not have is refused."""
    stack, marks = [], []
    try:
        for op, arg, _ in pickletools.genops(pkl):
            name = op.name
            if name in ("PROTO", "BINPUT", "LONG_BINPUT", "MEMOIZE", "FRAME"):
                continue                                       # (the memo is never read back: no BINGET accepted)
            if name == "STOP":
                break
            if name in ("BININT", "BININT1", "BININT2", "LONG1", "BINUNICODE", "SHORT_BINUNICODE"):
                stack.append(arg)
            elif name in ("NEWTRUE", "NEWFALSE"):
                stack.append(name == "NEWTRUE")
            elif name == "GLOBAL" and (arg in STORAGES or arg in (REBUILD, HOOKS)):
                stack.append(Global(arg))
            elif name == "MARK":
                marks.append(len(stack))
            elif name == "TUPLE":
                k = marks.pop()
                stack[k:] = [tuple(stack[k:])]
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE"):
                n = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}.get(name, 0)
                stack[len(stack) - n:] = [tuple(stack[len(stack) - n:])]
            elif name == "BINPERSID":
                stack.append(Persistent(stack.pop()))
            elif name == "REDUCE":
                args = stack.pop()
                stack.append(Call(stack.pop(), args))
            else:
                raise ValueError(f"opcode {name}{' ' + printable(str(arg), 60) if arg is not None else ''}")
    except (ValueError, IndexError, TypeError) as e:
        raise DumpError(f"{where}: its data.pkl is not a plain tensor's pickle ({printable(str(e), 100)}); hsgd "
                        "reads the chunks torch.save writes for a tensor, and unpickles nothing") from None
    shape_ok = len(stack) == 1 and isinstance(stack[0], Call) and stack[0].func == Global(REBUILD) and \
        isinstance(stack[0].args, tuple) and len(stack[0].args) == 6
    if shape_ok:
        pid, offset, size, stride, _, hooks = stack[0].args
        shape_ok = isinstance(pid, Persistent) and isinstance(pid.pid, tuple) and len(pid.pid) == 5 and \
            pid.pid[0] == "storage" and isinstance(pid.pid[1], Global) and isinstance(pid.pid[2], str) and \
            _count(pid.pid[4]) and _count(offset) and isinstance(size, tuple) and isinstance(stride, tuple) and \
            len(size) == len(stride) <= MAX_DIMS and all(map(_count, size + stride)) and hooks == Call(Global(HOOKS),
                                                                                                        ())
    if not shape_ok:
        raise DumpError(f"{where}: its data.pkl is not _rebuild_tensor_v2(storage, offset, size, stride, "
                        "requires_grad, OrderedDict()) of a plain tensor; hsgd reads nothing else")
    return STORAGES[pid.pid[1].name], pid.pid[2], pid.pid[4], offset, size, stride


def _count(n):
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def torch_chunk(raw, dtype, sizes, where):
    """The array of shape `sizes` in the bytes of one torch.save'd tensor (a zip): its data.pkl read by
    plain_tensor, its storage the member data/KEY (stored, numel x itemsize bytes, CRC checked), the strided view
    inside it; bfloat16 as float32."""
    try:
        z = zipfile.ZipFile(io.BytesIO(raw))
        members = {i.filename: i for i in z.infolist()}
        pkls = [n for n in members if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1 or members[pkls[0]].file_size > MAX_PICKLE or \
                members[pkls[0]].compress_type != zipfile.ZIP_STORED:
            raise DumpError(f"{where}: not a torch.save zip of one tensor (one ARCHIVE/data.pkl of at most "
                            f"{MAX_PICKLE} bytes, stored uncompressed as torch.save writes it)")
        prefix = pkls[0][:-len("data.pkl")]
        kind, key, numel, offset, size, stride = plain_tensor(z.read(members[pkls[0]]), where)
        order = members.get(prefix + "byteorder")
        if order is not None and (order.file_size > 16 or order.compress_type != zipfile.ZIP_STORED or
                                  z.read(order) != b"little"):
            raise DumpError(f"{where}: its byteorder is not \"little\" (stored): saved big-endian, or damaged; hsgd "
                            "reads little-endian checkpoints as torch.save writes them")
        if kind != dtype or size != tuple(sizes):
            raise DumpError(f"{where}: holds {kind} {list(size)}, the metadata says {dtype} {list(sizes)}")
        data = members.get(prefix + "data/" + key)
        if data is None or data.compress_type != zipfile.ZIP_STORED or data.file_size != numel * ITEMSIZE[kind]:
            raise DumpError(f"{where}: its storage data/{printable(key, 20)} is missing, compressed, or not "
                            f"{numel} x {ITEMSIZE[kind]} bytes; the file is corrupt")
        buf = z.read(data)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, KeyError, NotImplementedError,
            zlib.error) as e:                   # (NotImplementedError: a compression method zipfile does not have)
        if isinstance(e, DumpError):
            raise
        raise DumpError(f"{where}: a truncated or corrupt zip ({type(e).__name__}: {printable(str(e), 100)}); the "
                        "checkpoint file is damaged") from None
    n = math.prod(size)
    if n and offset + sum((k - 1) * s for k, s in zip(size, stride)) >= numel:
        raise DumpError(f"{where}: offset {offset}, size {list(size)} and stride {list(stride)} reach past its "
                        f"storage of {numel} entries; the file is corrupt or crafted")
    if not n:
        return zeros(size, kind, where)
    flat = np.frombuffer(buf, "<u2" if kind == "bfloat16" else np.dtype(kind).newbyteorder("<"))
    item = flat.dtype.itemsize
    a = np.lib.stride_tricks.as_strided(flat[offset:], size, [s * item for s in stride]).copy()
    return bf16_to_float32(a) if kind == "bfloat16" else a.astype(a.dtype.newbyteorder("="))
