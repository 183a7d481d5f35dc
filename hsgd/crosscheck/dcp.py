"""A PyTorch Distributed Checkpoint (DCP) folder, read without unpickling anything but its .metadata, and that only
through PyTorch's own reader for a caller that trusts the folder (hsgd.crosscheck.from_dcp turns one into a dump).

    DIR/.metadata              a Python pickle of torch.distributed.checkpoint.metadata.Metadata: per state-dict
                               key (FQN; nested keys joined by ".") its dtype, global size and chunks (offsets,
                               sizes), and per chunk where its bytes are (storage_data: file, offset, length)
    DIR/__{rank}_{n}.distcp    the chunks rank `rank` saved, one after another, as torch.save wrote each (DCP's
                               default torch_save format: a zip whose member ARCHIVE/data/0 is the raw storage,
                               stored uncompressed, and ARCHIVE/data.pkl a pickle of a few opcodes saying the
                               storage's dtype and the tensor's offset, size and strides), or, in DCP's safetensors
                               format, one safetensors blob of all of them (its __metadata__'s DCP_SHARDING_INFO
                               gives each FQN's saved_offsets) starting at the chunks' offset

Unpickling .metadata can run any code the file's author put there: read_metadata does it (PyTorch's
FileSystemReader(DIR).read_metadata(), after check_folder has bounded the file's size by a stat) only for a caller
that passes the trust on, and turns what it read into a plain description (describe):

    {"format": "hsgd-dcp-metadata", "version": 1,
     "tensors": {FQN: {"dtype": "float32", "size": [37, 16],
                       "chunks": [{"offsets": [0, 0], "sizes": [19, 8], "file": "__0_0.distcp", "offset": 0,
                                   "length": 2153}, ...]}},
     "objects": [FQN, ...]}          (non-tensor entries: pickles, never read)

which may be kept as JSON (read_description reads it back, bounded, with no pickle and no PyTorch). Everything
after is plain data checked before it is used: Checkpoint(DIR, description) checks every size (each dimension
below 2^31, the non-zero ones' product at most 2^48: hsgd.crosscheck.safetensors.check_shape) and every chunk
inside its tensor, check(FQN) that each chunk's declared bytes fit in its file's range (so a declared shape larger
than the files is refused before any allocation) and that the chunks add up to the tensor, disjoint(FQN) that none
overlap, world(n) that no chunk and no .distcp file of the folder is on a rank beyond the run's n ranks. A
torch_save chunk (hsgd.crosscheck.torch_save) has its data.pkl read with pickletools.genops, a disassembler (it
executes nothing), and only the opcodes of a plain tensor, `_rebuild_tensor_v2(persistent storage, offset, size,
stride, requires_grad, OrderedDict())`, are accepted; the storage's bytes must be numel x itemsize, the strided
view inside them. Anything else is one DumpError line naming the file: a zip member compressed (data.pkl too must
be stored, as torch.save writes it), a DCP_SHARDING_INFO whose saved_offsets are not the chunk's offsets.

DCP saves each distinct chunk once (torch.distributed.checkpoint's plans are deduplicated, _dedup_save_plans):
a chunk every rank of a replica group held is on one rank's file only. Left out: stream transforms (compressed
chunks), BYTE_IO entries (pickled objects: listed, never read), and file systems other than a local folder.
"""
import json
import math
import os
import re
import stat
from dataclasses import dataclass

import numpy as np

from hsgd.readers import check_depth, opened, printable, read_json, JSON_STRINGS
from .dump import DumpError
from .safetensors import check_shape, open_header, read_tensor
from .torch_save import ITEMSIZE, MAX_DIMS, torch_chunk, zeros

METADATA = ".metadata"
MAX_METADATA = 256 << 20          # bytes of .metadata a reader unpickles: a 100000-chunk checkpoint has ~50 MB
FORMAT, VERSION = "hsgd-dcp-metadata", 1
FILE = re.compile(r"__(0|[1-9][0-9]{0,6})_(0|[1-9][0-9]{0,8})\.distcp")      # __{rank}_{n}.distcp
SAFETENSORS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
               "I32": "int32"}
TRUST = ("is a Python pickle, which PyTorch's reader unpickles, and unpickling can run any code its author put "
         "there: pass --trust-pickled-metadata only for a checkpoint you trust")


# ------------------------------------------------------------------------------------------------ .metadata

def check_folder(path):
    """DumpError unless `path` is a folder holding .metadata, a regular file of at most MAX_METADATA bytes (a stat:
    nothing is read)."""
    if not os.path.isdir(path):
        raise DumpError(f"{path}: not a folder; give the folder torch.distributed.checkpoint.save wrote")
    mpath = os.path.join(path, METADATA)
    try:
        st = os.stat(mpath)
    except OSError:
        raise DumpError(f"{mpath}: no such file; a Distributed Checkpoint's folder holds .metadata (written last by "
                        "torch.distributed.checkpoint.save: without it the save did not finish)") from None
    if not stat.S_ISREG(st.st_mode):
        raise DumpError(f"{mpath}: not a regular file; .metadata is the checkpoint's description")
    if st.st_size > MAX_METADATA:
        raise DumpError(f"{mpath}: {st.st_size} bytes, more than the {MAX_METADATA} hsgd lets PyTorch unpickle; "
                        "pass the right folder")


def read_metadata(path):
    """The description (module docstring) of the checkpoint in folder `path`: its .metadata unpickled by PyTorch's
    own reader. The caller has decided to trust the folder; check_folder bounds the file first."""
    check_folder(path)
    try:
        from torch.distributed.checkpoint import FileSystemReader
    except ImportError:
        raise DumpError("reading a Distributed Checkpoint's .metadata needs PyTorch: pip install torch (or read "
                        "dcp-metadata.json with --metadata-json)") from None
    try:
        meta = FileSystemReader(path).read_metadata()
    except Exception as e:                   # (whatever an unpickler raises: the file is no Metadata pickle)
        raise DumpError(f"{os.path.join(path, METADATA)}: PyTorch's reader cannot read it ({type(e).__name__}: "
                        f"{printable(str(e), 120)}); pass the folder of a whole checkpoint") from None
    return describe(meta)


def describe(meta):
    """The plain description of a torch.distributed.checkpoint Metadata (module docstring): per tensor its dtype,
    size and chunks, each chunk with its storage_data (file, offset, length); DumpError for anything else."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
    where = METADATA
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict) or \
            not isinstance(meta.storage_data, dict):
        raise DumpError(f"{where}: not the Metadata of a checkpoint FileSystemWriter saved (its storage_data a dict)")
    stored = {}
    for index, info in meta.storage_data.items():
        offset = getattr(index, "offset", None)
        stored[(getattr(index, "fqn", None), None if offset is None else tuple(offset))] = info
    tensors, objects = {}, []
    for fqn, m in meta.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            objects.append(fqn)
            continue
        if not isinstance(m, TensorStorageMetadata):
            raise DumpError(f"{where}: {printable(fqn, 80)}: a {type(m).__name__}, neither a tensor nor bytes")
        chunks = []
        for c in m.chunks:
            info = stored.get((fqn, tuple(c.offsets)))
            if info is None:
                raise DumpError(f"{where}: {printable(fqn, 80)}: its chunk at {list(c.offsets)} has no storage_data")
            if getattr(info, "transform_descriptors", None):
                raise DumpError(f"{where}: {printable(fqn, 80)}: written through stream transforms "
                                f"{list(info.transform_descriptors)} (compression), which hsgd does not read")
            chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes),      # (Checkpoint checks them)
                           **{k: getattr(info, a, None) for k, a in (("file", "relative_path"), ("offset", "offset"),
                                                                   ("length", "length"))}})
        tensors[fqn] = {"dtype": str(m.properties.dtype).removeprefix("torch."), "size": list(m.size),
                        "chunks": chunks}
    return {"format": FORMAT, "version": VERSION, "tensors": tensors, "objects": objects}


def read_description(path, max_bytes=MAX_METADATA):
    """The description kept as JSON (describe's, json.dump'ed): read bounded, no pickle, no PyTorch."""
    return read_json(path, "a checkpoint's metadata as JSON", DumpError, max_bytes=max_bytes)


# ------------------------------------------------------------------------------------------------ the chunks

@dataclass
class Chunk:
    fqn: str
    offsets: tuple        # where its box starts in the tensor, per dimension
    sizes: tuple          # its box's lengths
    file: str             # __{rank}_{n}.distcp
    rank: int
    offset: int           # its bytes in the file: [offset, offset + length)
    length: int


class Checkpoint:
    """A DCP folder and its description, every number of it checked (module docstring):
        .tensors {FQN: (dtype, size, [Chunk])}, .ranks (1 + the highest rank a chunk is on, each below MAX_RANKS),
        .world(n) the run's ranks, .check(fqn) and .disjoint(fqn) before reading, .read(chunk) -> the chunk's array,
        .whole(fqn) -> the tensor's."""

    def __init__(self, path, description, what=METADATA):
        from hsgd.step.settings import MAX_RANKS                    # (a large module: imported when used)
        self.path, self.where, self.max_ranks = path, f"{os.path.join(path, what)}", MAX_RANKS
        d = description
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != VERSION or \
                not isinstance(d.get("tensors"), dict):
            raise DumpError(f"{self.where}: must be {{\"format\": \"{FORMAT}\", \"version\": {VERSION}, \"tensors\": "
                            "...} (hsgd.crosscheck.dcp.describe)")
        self.tensors = {fqn: self._tensor(fqn, e) for fqn, e in d["tensors"].items()}
        self.ranks = 1 + max((c.rank for _, _, chunks in self.tensors.values() for c in chunks), default=0)
        self.headers = {}                                # (file, offset): a safetensors blob's header

    def world(self, n=None):
        """The run's ranks: n (the parallel sizes' product, dp x tp x pp x cp, when the caller knows them) or else
        the ranks the chunks are on (.ranks). DumpError (nothing written yet) if that is more than MAX_RANKS, or a
        chunk or a __{rank}_{k}.distcp file of the folder is on a rank beyond it (a stray file, or one of another
        run: every rank of a run writes its file, also when it saved nothing). The folder's names only are read."""
        ranks = self.ranks if n is None else n
        given = "hsgd.json's parallel sizes give" if n is not None else "the metadata's chunks are on"
        if ranks > self.max_ranks:
            raise DumpError(f"{self.path}: {given} {ranks} ranks, more than a job has (at most {self.max_ranks})")
        if self.ranks > ranks:
            c = max((c for _, _, chunks in self.tensors.values() for c in chunks), key=lambda c: c.rank)
            raise DumpError(f"{self.where}: a chunk of {printable(c.fqn, 80)} is in {c.file} (rank {c.rank}), but "
                            f"{given} {ranks} ranks; give hsgd.json's \"parallel\" sizes of the run that saved it")
        stray = sorted((int(m.group(1)), name) for name in os.listdir(self.path)
                       for m in [FILE.fullmatch(name)] if m and int(m.group(1)) >= ranks)
        if stray:
            rank, name = stray[-1]
            raise DumpError(f"{os.path.join(self.path, name)}: a file of rank {rank}, but {given} {ranks} ranks: a "
                            "file of another run or a stray one; remove it (or give hsgd.json's \"parallel\" sizes "
                            "of the run when it is one of its ranks)")
        return ranks

    def _tensor(self, fqn, e):
        what = f"{self.where}: {printable(fqn, 80)}"
        if not isinstance(fqn, str) or not isinstance(e, dict) or not isinstance(e.get("dtype"), str) or \
                not _ints(e.get("size"), MAX_DIMS) or not isinstance(e.get("chunks"), list):
            raise DumpError(f"{what}: must give dtype (a name), size (at most {MAX_DIMS} integers >= 0) and chunks")
        check_shape(e["size"], f"{what}: size", DumpError)
        size, chunks = tuple(e["size"]), []
        for k, c in enumerate(e["chunks"]):
            if not isinstance(c, dict) or not _ints(c.get("offsets"), len(size), len(size)) or \
                    not _ints(c.get("sizes"), len(size), len(size)) or not _ints([c.get("offset"), c.get("length")]):
                raise DumpError(f"{what}: chunk {k} must give offsets and sizes ({len(size)} integers >= 0 each), "
                                "offset and length (integers >= 0)")
            if any(o + n > s for o, n, s in zip(c["offsets"], c["sizes"], size)):
                raise DumpError(f"{what}: chunk {k} (offsets {c['offsets']}, sizes {c['sizes']}) runs outside the "
                                f"tensor's size {list(size)}")
            m = FILE.fullmatch(c.get("file")) if isinstance(c.get("file"), str) else None
            if m is None:
                raise DumpError(f"{what}: chunk {k}'s file {printable(str(c.get('file')), 60)!r} is not one "
                                "FileSystemWriter writes (__{rank}_{n}.distcp in the folder)")
            if int(m.group(1)) >= self.max_ranks:
                raise DumpError(f"{what}: chunk {k}'s file {c['file']} is of rank {m.group(1)}, more than a job has "
                                f"(at most {self.max_ranks} ranks)")
            chunks.append(Chunk(fqn, tuple(c["offsets"]), tuple(c["sizes"]), c["file"], int(m.group(1)),
                                c["offset"], c["length"]))
        return e["dtype"], size, chunks

    def check(self, fqn, kinds="float"):
        """DumpError unless tensor fqn is there, of a dtype hsgd reads (kinds "float" or "int"), its chunks' entries
        add up to its size, and every chunk's bytes are inside its file and hold what the chunk declares. Nothing is
        allocated (a shape larger than the files is refused here); disjoint(fqn) checks the boxes."""
        if fqn not in self.tensors:
            raise DumpError(f"{self.where}: no tensor {printable(fqn, 80)!r} in the checkpoint")
        dtype, size, chunks = self.tensors[fqn]
        what = f"{self.where}: {printable(fqn, 80)}"
        want = ("float64", "float32", "float16", "bfloat16") if kinds == "float" else ("int64", "int32")
        if dtype not in want:
            raise DumpError(f"{what} is {printable(dtype, 30)}; hsgd reads {' or '.join(want)} here")
        for c in chunks:
            fpath = os.path.join(self.path, c.file)
            try:
                st = os.stat(fpath)
            except OSError:
                raise DumpError(f"{fpath}: no such file, where the metadata puts a chunk of {printable(fqn, 80)}; "
                                "the checkpoint is incomplete") from None
            if not stat.S_ISREG(st.st_mode) or st.st_size < c.offset + c.length:
                raise DumpError(f"{fpath}: {st.st_size} bytes, shorter than its declared chunks (a chunk of "
                                f"{printable(fqn, 80)} at bytes {c.offset}..{c.offset + c.length}): truncated")
            nbytes = math.prod(c.sizes) * ITEMSIZE[dtype]
            if nbytes > c.length:
                raise DumpError(f"{what}: chunk {list(c.sizes)} of {dtype} declares {nbytes} bytes, more than the "
                                f"{c.length} its file holds for it; the metadata is corrupt or crafted")
        held = sum(math.prod(c.sizes) for c in chunks)
        if held != math.prod(size):
            raise DumpError(f"{what}: its chunks hold {held} entries, its size {list(size)} has {math.prod(size)}; the "
                            "chunks must cover the tensor once")

    def disjoint(self, fqn):
        """DumpError if two chunks of tensor fqn overlap (after check(fqn), whose count of entries makes disjoint
        chunks cover it), marked on a mask of its size: call it once that size is known to fit (the model's)."""
        dtype, size, chunks = self.tensors[fqn]
        mask = zeros(size, bool, f"{self.where}: {printable(fqn, 80)}")
        for c in chunks:
            box = tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))
            if mask[box].any():
                raise DumpError(f"{self.where}: {printable(fqn, 80)}: its chunk at {list(c.offsets)} overlaps another;"
                                " DCP saves each piece once")
            mask[box] = True

    def read(self, c):
        """The array of chunk c (its sizes; bfloat16 as float32), after check(c.fqn)."""
        dtype = self.tensors[c.fqn][0]
        fpath = os.path.join(self.path, c.file)
        where = f"{fpath} (a chunk of {printable(c.fqn, 80)} at byte {c.offset})"
        with opened(fpath, "a checkpoint file", DumpError) as f:
            try:
                f.seek(c.offset)
                if f.read(4) == b"PK\x03\x04":                      # torch_save: a zip of one tensor
                    f.seek(c.offset)
                    raw = f.read(c.length)
                    if len(raw) != c.length:
                        raise DumpError(f"{where}: the file ended early; it is truncated")
                    return torch_chunk(raw, dtype, c.sizes, where)
                return self._safetensors_chunk(f, c, dtype, where)  # safetensors: one blob of the file's chunks
            except OSError as e:
                raise DumpError(f"{where} cannot be read ({e.strerror or e})") from None

    def _safetensors_chunk(self, f, c, dtype, where):
        key = (c.file, c.offset)
        if key not in self.headers:
            self.headers[key] = open_header(f, os.fstat(f.fileno()).st_size, where, DumpError, c.offset)
        entries, meta = self.headers[key]
        e = entries.get(c.fqn)
        if e is None or SAFETENSORS[e[0]] != dtype or e[1] != c.sizes:
            raise DumpError(f"{where}: neither a torch.save zip nor a safetensors blob holding it as {dtype} "
                            f"{list(c.sizes)}")
        info = meta.get("DCP_SHARDING_INFO")
        if info is not None:
            check_depth(info, JSON_STRINGS, where, DumpError, 8)
            try:
                saved = json.loads(info).get(c.fqn, {}).get("saved_offsets")
            except (ValueError, AttributeError):
                raise DumpError(f"{where}: its DCP_SHARDING_INFO is not a JSON object of FQNs") from None
            if saved is not None and not _ints(saved, MAX_DIMS):
                raise DumpError(f"{where}: its DCP_SHARDING_INFO gives saved_offsets "
                                f"{printable(json.dumps(saved), 60)}, not a list of integers >= 0 (its offsets)")
            if saved is not None and saved != list(c.offsets):
                raise DumpError(f"{where}: its DCP_SHARDING_INFO says offsets {saved}, the metadata {list(c.offsets)}")
        return read_tensor(f, e)

    def whole(self, fqn):
        """Tensor fqn's full array, its chunks put in place (after check(fqn); its size known to fit)."""
        self.disjoint(fqn)
        dtype, size, chunks = self.tensors[fqn]
        out = None
        for c in chunks:
            if math.prod(c.sizes):
                a = self.read(c)
                out = np.zeros(size, a.dtype) if out is None else out
                out[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))] = a
        return out if out is not None else zeros(size, dtype, f"{self.where}: {printable(fqn, 80)}")


def _ints(xs, most=1 << 20, least=0):
    return isinstance(xs, list) and least <= len(xs) <= most and \
        all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)
