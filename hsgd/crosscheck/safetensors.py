"""The safetensors format, read with every number checked before a byte of data is read or an array allocated, and
written (no `safetensors` package needed for either: the format is a JSON header and raw bytes).

    [N: 8 bytes, unsigned little-endian] [header: N bytes of JSON] [data: the tensors' bytes, one after another]
    header = {"NAME": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
              "__metadata__": {"key": "text", ...}}          (offsets relative to the data's start)

    read_safetensors(path, what, error, shapes=None, max_bytes=None)   {name: array}
    write_safetensors(path, arrays, metadata=None)                      {basename: {"size", "sha256"}}
    open_header(f, size, where, error, start=0)                         the header of a blob at byte `start` of
                                                                        an open file (a DCP .distcp file holds one)
    check_shape(shape, where, error)                                    the bounds of a shape (below)

What a reader checks, in this order, each failure one line error(...) naming the file: N at most the bytes after
it and at most MAX_HEADER; the header UTF-8 JSON, nested at most hsgd.readers.MAX_DEPTH deep, no integer of more
than 20 digits; every entry a known dtype, a shape of integers >= 0 (each below MAX_DIM = 2^31, the product of
the non-zero ones at most MAX_ENTRIES = 2^48: a shape with a zero has no bytes, so only these bounds keep
[0, 2^40, 2^40] from numpy, which refuses to make it), offsets 0 <= begin <= end <= the data's
bytes, end - begin = prod(shape) x itemsize, no two entries overlapping; the shapes the caller expects; all the
arrays together at most max_bytes (as the caller receives them: BF16 becomes float32, twice its bytes). Only then
are the tensors read, each exactly its bytes.

Dtypes: F64, F32, F16 (as themselves), BF16 (to float32 by moving its 16 bits to the top of a float32's: bfloat16
is float32's upper half, so this is exact), I64, I32; little-endian as the format says. Left out: the other
dtypes (booleans, 8- and 16-bit integers, FP8), and reading a file lazily (memory-mapped).
"""
import json
import math
import os
import struct

import numpy as np

from hsgd.readers import check_depth, finite_float, opened, refuse_constant, refuse_integer, JSON_STRINGS, Refused

MAX_HEADER = 100 << 20            # bytes of the JSON header (the safetensors package's own limit)
MAX_DIMS = 64
MAX_DIM = 1 << 31                 # a dimension is below it (no tensor of a model is near: a vocabulary is ~10^5)
MAX_ENTRIES = 1 << 48             # entries of a shape's non-zero dimensions (a petabyte of float32)
DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
          "I64": np.dtype("<i8"), "I32": np.dtype("<i4")}                 # BF16: its raw 16 bits
CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32"}


def bf16_to_float32(bits):
    """float32 values of bfloat16 bit patterns (uint16): the 16 bits become a float32's upper half, exactly."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def check_shape(shape, where, error):
    """error(...) unless every dimension of `shape` (integers >= 0) is below MAX_DIM and the product of the non-zero
    ones at most MAX_ENTRIES: numpy makes any such array (also one with no entries), and nothing larger is read."""
    if any(n >= MAX_DIM for n in shape):
        wrong = f"a dimension of {MAX_DIM} or more"
    elif math.prod(n for n in shape if n) > MAX_ENTRIES:
        wrong = f"more than {MAX_ENTRIES} entries in its non-zero dimensions"
    else:
        return
    raise error(f"{where}: shape {str(list(shape))[:80]} has {wrong}; no tensor hsgd reads is so large: the file is "
                "corrupt or crafted")


def open_header(f, size, where, error, start=0):
    """({name: (dtype code, shape, begin, end)}, {metadata}) of the safetensors blob at byte `start` of the open
    binary file f of `size` bytes; begin and end are positions in the file, checked as the module docstring says
    (everything except the caller's shapes and max_bytes)."""
    f.seek(start)
    head = f.read(8)
    if len(head) < 8:
        raise error(f"{where}: {len(head)} bytes where a safetensors header length (8 bytes) belongs; the file is "
                    "truncated or not safetensors")
    n = struct.unpack("<Q", head)[0]
    if n > min(size - start - 8, MAX_HEADER):
        raise error(f"{where}: declares a header of {n} bytes, more than the {size - start - 8} bytes after it (or "
                    f"the {MAX_HEADER} a header may have); the file is truncated or not safetensors")
    data_start = start + 8 + n
    text = f.read(n)
    try:
        text = text.decode("utf-8")
        check_depth(text, JSON_STRINGS, where, error, 64)
        header = json.loads(text, parse_int=refuse_integer, parse_float=finite_float,
                            parse_constant=refuse_constant)
    except UnicodeDecodeError:
        raise error(f"{where}: its header is not UTF-8 JSON; the file is not safetensors") from None
    except Refused as e:
        raise error(f"{where}: its header: {e}") from None
    except ValueError as e:
        raise error(f"{where}: its header is not valid JSON ({str(e)[:80]}); the file is not safetensors") from None
    if not isinstance(header, dict):
        raise error(f"{where}: its header must be a JSON object of tensors")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise error(f"{where}: __metadata__ must map names to strings")
    data_bytes, entries = size - data_start, {}
    for name, e in header.items():
        entries[name] = _entry(name, e, data_start, data_bytes, where, error)
    spans = sorted((b, e, name) for name, (_, _, b, e) in entries.items() if e > b)
    for (_, e1, n1), (b2, _, n2) in zip(spans, spans[1:]):
        if b2 < e1:
            raise error(f"{where}: tensors {n1[:80]!r} and {n2[:80]!r} overlap in the data; each has its own bytes")
    return entries, metadata


def _entry(name, e, data_start, data_bytes, where, error):
    """(dtype code, shape, begin, end) of one header entry, checked against the data's bytes."""
    what = f"{where}: tensor {name[:80]!r}"
    if not isinstance(e, dict) or e.get("dtype") not in DTYPES:
        dtype = e.get("dtype") if isinstance(e, dict) else None
        raise error(f"{what}: dtype {str(dtype)[:20]!r}; hsgd reads {', '.join(DTYPES)}")
    shape, offsets = e.get("shape"), e.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_count(n) for n in shape):
        raise error(f"{what}: shape must be a list of at most {MAX_DIMS} integers >= 0")
    check_shape(shape, what, error)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(n) for n in offsets) or \
            not offsets[0] <= offsets[1] <= data_bytes:
        raise error(f"{what}: data_offsets {str(offsets)[:60]} must be [begin, end] with 0 <= begin <= end <= "
                    f"{data_bytes}, the data's bytes: the file is truncated or crafted")
    nbytes = math.prod(shape) * DTYPES[e["dtype"]].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise error(f"{what}: shape {shape} of {e['dtype']} is {nbytes} bytes, but its data_offsets hold "
                    f"{offsets[1] - offsets[0]}; the file is corrupt or crafted")
    return e["dtype"], tuple(shape), data_start + offsets[0], data_start + offsets[1]


def _count(n):
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def read_tensor(f, entry):
    """The array of one checked header entry (open_header) of the open file f: exactly its bytes read; BF16 as
    float32. OSError if the file is not as its header was (shorter now, or a shape numpy refuses)."""
    code, shape, begin, end = entry
    f.seek(begin)
    raw = f.read(end - begin)
    if len(raw) != end - begin:                                  # (the file shrank after its size was taken)
        raise OSError("the file is shorter than when its header was read")
    try:
        a = np.frombuffer(raw, DTYPES[code]).reshape(shape)
    except ValueError as e:                                      # (check_shape's bounds keep it from happening)
        raise OSError(f"numpy cannot make an array of shape {str(list(shape))[:80]} ({str(e)[:80]})") from None
    return bf16_to_float32(a) if code == "BF16" else a.astype(a.dtype.newbyteorder("="))


def out_bytes(entry):
    """Bytes of the array read_tensor returns for this entry."""
    code, shape = entry[0], entry[1]
    return math.prod(shape) * (4 if code == "BF16" else DTYPES[code].itemsize)


def read_safetensors(path, what, error, shapes=None, max_bytes=None):
    """{name: array} of the safetensors file at path (its __metadata__ left out), every header number checked
    before anything is read (module docstring): shapes {name: expected shape}, optional; max_bytes bounds all the
    arrays returned (default: none beyond the file's own size). error(...) names `what` and the file."""
    where = f"{what} {str(path)!r}"
    with opened(path, what, error) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            entries, _ = open_header(f, size, where, error)
            for name, want in (shapes or {}).items():
                if name in entries and entries[name][1] != tuple(want):
                    raise error(f"{where}: {name} declares shape {list(entries[name][1])}, {list(want)} expected")
            total = sum(out_bytes(e) for e in entries.values())
            if max_bytes is not None and total > max_bytes:
                raise error(f"{where}: its tensors declare {total} bytes, more than the {max_bytes} this file may "
                            "hold; pass the right file")
            return {name: read_tensor(f, e) for name, e in entries.items()}
        except OSError as e:
            raise error(f"{where} cannot be read ({e.strerror or e})") from None


def write_safetensors(path, arrays, metadata=None):
    """The safetensors file `path` of arrays {name: array} (float64, float32, float16, int64, int32, or ml_dtypes'
    bfloat16), metadata {name: text} (optional), written to a temporary name and renamed (whole or absent).
    Returns {basename: {"size", "sha256"}}, as hsgd.crosscheck.write's writers do."""
    from .write import _atomic                                      # (write.py's temporary-name-and-rename)
    header, blobs, at = {}, [], 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        code = CODES.get(a.dtype.name)
        if code is None:
            raise ValueError(f"{name}: dtype {a.dtype} has no safetensors code hsgd writes ({', '.join(CODES)})")
        raw = a.astype(a.dtype.newbyteorder("<")).tobytes() if code != "BF16" else a.tobytes()
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)                                   # the data starts 8-byte aligned

    def write(f):
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in blobs:
            f.write(raw)
    return _atomic(os.fspath(path), write)
