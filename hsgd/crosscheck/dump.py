"""The crosscheck dump: one training step of any system, in a neutral format (hsgd/crosscheck/FORMAT.md).

    DIR/layout.json        what every tensor is (its global shape, its mapping to the reference's parameters: a
                           name, a transpose, a fused q|k|v) and where its gradient's pieces are (per rank: axis,
                           offset, length, padding; several ranks with one slice are replicas)
    DIR/params.npz         the whole parameters before the step, as the system stores them
    DIR/batch.npz          idx, targets (B, T): the step's global batch
    DIR/grads-rank{r}.npz  rank r's gradient pieces

`load(DIR)` reads and checks all of it (DumpError, one line, for anything that does not fit) and returns a Dump;
`Tensor.to_reference` / `from_reference` map a stored tensor to the reference parameters it holds and back;
`write_layout` and `write_rank` write the files (hsgd.crosscheck.hsgd_dump writes hsgd's own runs with them;
benchmarks/crosscheck_torch.py writes PyTorch's without hsgd). Only JSON and .npz read with allow_pickle=False.
"""
import json
import os
import zipfile
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError, UsageError

FORMAT, VERSION = "hsgd-crosscheck", 1
DTYPES = ("float64", "float32", "bfloat16", "float16")
PARALLEL = ("dp", "tp", "pp", "cp", "micro_batches")
MODEL_KEYS = ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff")


class DumpError(UsageError):
    """A dump that cannot be checked: a missing or unreadable file, a layout that does not describe the arrays."""


def grads_file(r):
    return f"grads-rank{r}.npz"


# ------------------------------------------------------------------------------------------------ a tensor

@dataclass
class Shard:
    rank: int
    axis: object          # int, or None: the whole tensor
    offset: int
    length: int
    padding: int
    key: str

    def where(self, ndim):
        """The index of this shard's real entries in the full tensor."""
        if self.axis is None:
            return (slice(None),) * ndim
        return (slice(None),) * self.axis + (slice(self.offset, self.offset + self.length),)

    def split(self, a):
        """(real entries, padding entries) of the rank's array a."""
        if self.axis is None:
            return a, a[:0]
        lead = (slice(None),) * self.axis
        return a[lead + (slice(0, self.length),)], a[lead + (slice(self.length, None),)]


@dataclass
class Tensor:
    name: str
    shape: tuple
    transposed: bool
    parts: list           # the reference parameters it holds (one, or the fused ones)
    fuse_axis: int
    interleave: str       # "block" or "head" (fused only)
    group: int
    shards: list
    lengths: tuple = ()   # each part's length along the fused axis (fused only)

    def part_shapes(self, ref_shapes):
        """Each part's shape as stored (transposed where the tensor is)."""
        return [tuple(reversed(ref_shapes[p])) if self.transposed else tuple(ref_shapes[p]) for p in self.parts]

    def stored_shape(self, ref_shapes):
        """The full stored shape its reference parameters give."""
        shapes = self.part_shapes(ref_shapes)
        if len(self.parts) == 1:
            return shapes[0]
        out = list(shapes[0])
        out[self.fuse_axis] = sum(s[self.fuse_axis] for s in shapes)
        return tuple(out)

    def to_reference(self, x):
        """{reference name: array in the reference's orientation} from the stored full tensor x."""
        if len(self.parts) == 1:
            pieces = [x]
        else:
            moved = np.moveaxis(x, self.fuse_axis, 0)
            J = len(self.parts)
            if self.interleave == "head":      # [p0_h0 p1_h0 p2_h0 p0_h1 ...], pieces of `group` entries
                g = self.group
                H = moved.shape[0] // (J * g)
                cut = moved.reshape((H, J, g) + moved.shape[1:])
                pieces = [cut[:, j].reshape((H * g,) + moved.shape[1:]) for j in range(J)]
            else:                              # [p0 | p1 | p2], each its own length along the axis
                pieces = np.split(moved, np.cumsum(self.lengths[:-1]), axis=0)
            pieces = [np.moveaxis(p, 0, self.fuse_axis) for p in pieces]
        return {p: (a.T if self.transposed else a) for p, a in zip(self.parts, pieces)}

    def from_reference(self, ref):
        """The stored full tensor from the reference's arrays {name: array} (the inverse of to_reference)."""
        pieces = [ref[p].T if self.transposed else ref[p] for p in self.parts]
        if len(pieces) == 1:
            return np.ascontiguousarray(pieces[0])
        moved = [np.moveaxis(p, self.fuse_axis, 0) for p in pieces]
        if self.interleave == "head":
            g = self.group
            H = moved[0].shape[0] // g
            cut = np.stack([m.reshape((H, g) + m.shape[1:]) for m in moved], axis=1)     # (H, J, g, ...)
            out = cut.reshape((H * len(pieces) * g,) + moved[0].shape[1:])
        else:
            out = np.concatenate(moved, axis=0)
        return np.ascontiguousarray(np.moveaxis(out, 0, self.fuse_axis))


@dataclass
class Dump:
    path: str
    meta: dict
    cfg: ModelConfig
    dtype: str
    loss: float
    ranks: int
    parallel: dict
    tensors: dict         # {name: Tensor}
    params: dict          # {tensor name: stored full array}
    idx: np.ndarray
    targets: np.ndarray
    grads: list           # [{key: array}] per rank

    def reference_params(self):
        """{reference name: float64 array}: the parameters before the step, as hsgd.serial names them."""
        out = {}
        for t in self.tensors.values():
            for name, a in t.to_reference(self.params[t.name].astype(np.float64)).items():
                out[name] = np.ascontiguousarray(a)
        return out


# ------------------------------------------------------------------------------------------------ reading

def _npz(path, what):
    """{name: array} of an .npz file written by numpy.savez, read without pickle; DumpError for anything else."""
    if not os.path.isfile(path):
        raise DumpError(f"{path}: no such file ({what}); a dump holds layout.json, params.npz, batch.npz and "
                        f"grads-rank{{r}}.npz for every rank (hsgd/crosscheck/FORMAT.md)")
    fix = "write it with numpy.savez (arrays of numbers, no objects)"
    try:
        z = np.load(path, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile, EOFError):
        raise DumpError(f"{path}: not an .npz file NumPy can read without pickle; {fix}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise DumpError(f"{path}: one array (.npy), not an .npz archive of named arrays; {fix}")
    try:
        with z:
            out = {k: z[k] for k in z.files}
    except (ValueError, OSError, zipfile.BadZipFile, EOFError):
        raise DumpError(f"{path}: an entry is not an array NumPy can read without pickle; {fix}") from None
    bad = [k for k, a in out.items() if not isinstance(a, np.ndarray)]
    if bad:
        raise DumpError(f"{path}: entry {bad[0]!r} is not a .npy array; {fix}")
    return out


def _int(value, what, low=0):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise DumpError(f"layout.json: {what} = {value!r} must be an integer >= {low}")
    return value


def load(path):
    """The Dump in folder `path`, every part checked against the others; DumpError says what does not fit."""
    if not os.path.isdir(path):
        raise DumpError(f"{path}: not a folder; give the folder a dump was written to (hsgd.train --dump-step N DIR, "
                        "or another system's writer of hsgd/crosscheck/FORMAT.md)")
    lpath = os.path.join(path, "layout.json")
    try:
        with open(lpath, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DumpError(f"{lpath}: no such file; {path} is not a dump (hsgd/crosscheck/FORMAT.md)") from None
    except IsADirectoryError:
        raise DumpError(f"{lpath}: a folder, not a file; layout.json is the dump's JSON description") from None
    except (ValueError, OSError) as e:
        raise DumpError(f"{lpath}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DumpError(f"{lpath}: \"format\" must be \"{FORMAT}\" (hsgd/crosscheck/FORMAT.md)")
    if meta.get("version") != VERSION or isinstance(meta.get("version"), bool):
        raise DumpError(f"{lpath}: version {meta.get('version')!r}; this hsgd reads version {VERSION}")
    model = meta.get("model")
    if not isinstance(model, dict) or sorted(model) != sorted(MODEL_KEYS):
        raise DumpError(f"layout.json: \"model\" must give exactly {', '.join(MODEL_KEYS)}")
    try:
        cfg = ModelConfig(**model)
    except ConfigError as e:
        raise DumpError(f"layout.json: model: {e}") from None
    dtype = meta.get("dtype")
    if dtype not in DTYPES:
        raise DumpError(f"layout.json: dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    loss = meta.get("loss")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        raise DumpError(f"layout.json: loss {loss!r} must be a number (the step's mean loss)")
    ranks = _int(meta.get("ranks"), "ranks", 1)
    parallel = meta.get("parallel", {})
    if not isinstance(parallel, dict) or set(parallel) - set(PARALLEL):
        raise DumpError(f"layout.json: \"parallel\" may give {', '.join(PARALLEL)} only")
    parallel = {k: _int(parallel.get(k, 1), f"parallel.{k}", 1) for k in PARALLEL}
    tensors = _tensors(meta.get("tensors"), cfg, ranks)
    params = _npz(os.path.join(path, "params.npz"), "the parameters before the step")
    for name, t in tensors.items():
        if name not in params:
            raise DumpError(f"params.npz: no array {name!r}; it holds every tensor of layout.json, whole")
        if tuple(params[name].shape) != t.shape:
            raise DumpError(f"params.npz: {name} has shape {params[name].shape}, layout.json says {list(t.shape)}")
        _floating(params[name], f"params.npz: {name}")
        if not np.isfinite(params[name]).all():
            raise DumpError(f"params.npz: {name} holds inf or NaN; the parameters before the step must be finite")
    extra = sorted(set(params) - set(tensors))
    if extra:
        raise DumpError(f"params.npz: {extra[0]!r} is not a tensor of layout.json")
    batch = _npz(os.path.join(path, "batch.npz"), "the step's batch")
    idx, targets = batch.get("idx"), batch.get("targets")
    if idx is None or targets is None:
        raise DumpError("batch.npz: must hold arrays \"idx\" and \"targets\" (B, T)")
    for what, a in (("idx", idx), ("targets", targets)):
        if a.ndim != 2 or a.shape != idx.shape or not np.issubdtype(a.dtype, np.integer):
            raise DumpError(f"batch.npz: {what} must be integers of one shape (B, T); it is {a.dtype} {a.shape}")
        if a.size and (a.min() < 0 or a.max() >= cfg.vocab_size):
            raise DumpError(f"batch.npz: {what} holds ids outside 0..{cfg.vocab_size - 1} (vocab_size)")
    if idx.shape[1] > cfg.seq_len or idx.size == 0:
        raise DumpError(f"batch.npz: (B, T) = {idx.shape}; T must be 1..seq_len = {cfg.seq_len}")
    grads = [_npz(os.path.join(path, grads_file(r)), f"rank {r}'s gradients") for r in range(ranks)]
    used = [set() for _ in range(ranks)]
    for t in tensors.values():
        for s in t.shards:
            have = grads[s.rank].get(s.key)
            if have is None:
                raise DumpError(f"{grads_file(s.rank)}: no array {s.key!r} (a shard of {t.name})")
            want = list(t.shape)
            if s.axis is not None:
                want[s.axis] = s.length + s.padding
            if list(have.shape) != want:
                raise DumpError(f"{grads_file(s.rank)}: {s.key} has shape {have.shape}, its shard of {t.name} "
                                f"needs {tuple(want)}")
            _floating(have, f"{grads_file(s.rank)}: {s.key}")
            used[s.rank].add(s.key)
    for r in range(ranks):
        extra = sorted(set(grads[r]) - used[r])
        if extra:
            raise DumpError(f"{grads_file(r)}: {extra[0]!r} is no shard of layout.json")
    return Dump(path, meta, cfg, dtype, float(loss), ranks, parallel, tensors, params, idx.astype(np.int64),
                targets.astype(np.int64), grads)


def _floating(a, what):
    if not np.issubdtype(a.dtype, np.floating):
        raise DumpError(f"{what} is {a.dtype}; write floating-point arrays (bfloat16 as float32)")


def _tensors(entries, cfg, ranks):
    """{name: Tensor} from layout.json's "tensors", checked: they give every reference parameter once, their shapes
    are the reference's, their shards lie inside them and cover them."""
    if not isinstance(entries, dict) or not entries:
        raise DumpError("layout.json: \"tensors\" must map each tensor's name to its description")
    ref_shapes = cfg.param_shapes()
    hs = cfg.d_model // cfg.n_heads
    owner, out = {}, {}
    for name, e in entries.items():
        where = f"layout.json: tensor {name}"
        if not isinstance(e, dict):
            raise DumpError(f"{where}: must be an object (hsgd/crosscheck/FORMAT.md)")
        fused = e.get("fused")
        if fused is None:
            parts, axis, interleave, group = [name], 0, "block", 0
        else:
            if not isinstance(fused, dict) or not isinstance(fused.get("parts"), list) or len(fused["parts"]) < 1:
                raise DumpError(f"{where}: fused must give \"parts\" (reference names) and \"axis\"")
            parts, interleave = fused["parts"], fused.get("interleave", "block")
            if not all(isinstance(p, str) for p in parts):
                raise DumpError(f"{where}: fused.parts must be the reference parameters' names (strings)")
            if interleave not in ("block", "head"):
                raise DumpError(f"{where}: fused.interleave {interleave!r} must be block or head")
            group = _int(fused.get("group", hs), f"{name}: fused.group", 1)
            axis = fused.get("axis")
        for p in parts:
            if p not in ref_shapes:
                raise DumpError(f"{where}: {p!r} is not a parameter of the model (names as in hsgd.serial, e.g. "
                                f"h.0.attn.q.weight); without \"fused\" a tensor's name is the parameter's")
            if p in owner:
                raise DumpError(f"{where}: {p} is held by {owner[p]} too; every parameter is held once")
            owner[p] = name
        transposed = e.get("transposed", False)
        if not isinstance(transposed, bool):
            raise DumpError(f"{where}: transposed {transposed!r} must be true or false")
        if e.get("dtype", "float64") not in DTYPES:
            raise DumpError(f"{where}: dtype {e.get('dtype')!r} must be one of {', '.join(DTYPES)}")
        shapes = {p: ref_shapes[p] for p in parts}
        if transposed and any(len(s) != 2 for s in shapes.values()):
            raise DumpError(f"{where}: transposed is for 2-D weights only")
        if len({len(s) for s in shapes.values()}) != 1:
            raise DumpError(f"{where}: fused parts must have the same number of dimensions")
        ndim = len(next(iter(shapes.values())))
        if fused is not None:
            _int(axis, f"{name}: fused.axis")
            if axis >= ndim:
                raise DumpError(f"{where}: fused.axis {axis} is not an axis of a {ndim}-D tensor")
        t = Tensor(name, (), transposed, parts, axis, interleave, group, [])
        stored = t.part_shapes(ref_shapes)
        if len(parts) > 1:
            off_axis = {s[:axis] + s[axis + 1:] for s in stored}
            if len(off_axis) != 1:
                raise DumpError(f"{where}: fused parts of shapes {stored} do not line up: all but axis {axis} must "
                                "be equal")
            t.lengths = tuple(s[axis] for s in stored)
        t.shape = tuple(t.stored_shape(ref_shapes))
        given = e.get("shape")
        if not isinstance(given, list) or tuple(given) != t.shape:
            raise DumpError(f"{where}: shape {given!r}, but its parameters give {list(t.shape)}")
        if interleave == "head" and len(parts) > 1:
            lengths = {(tuple(reversed(s)) if transposed else s)[axis] for s in shapes.values()}
            if len(lengths) != 1 or next(iter(lengths)) % group:
                raise DumpError(f"{where}: interleave head needs parts of one length along the axis, a multiple "
                                f"of group {group}")
        t.shards = _shards(e.get("shards"), t, ranks, where)
        out[name] = t
    missing = [p for p in ref_shapes if p not in owner]
    if missing:
        raise DumpError(f"layout.json: no tensor holds {missing[0]}" +
                        (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") +
                        "; the tensors together must hold every parameter of the model")
    return out


def _shards(entries, t, ranks, where):
    if not isinstance(entries, list) or not entries:
        raise DumpError(f"{where}: \"shards\" must list where its gradient's pieces are (at least one)")
    shards, axes = [], set()
    for i, s in enumerate(entries):
        if not isinstance(s, dict):
            raise DumpError(f"{where}: shard {i} must be an object with rank, axis, offset, length")
        rank = _int(s.get("rank"), f"{t.name} shard {i}: rank")
        if rank >= ranks:
            raise DumpError(f"{where}: shard {i} is on rank {rank}, but the dump has ranks 0..{ranks - 1}")
        axis = s.get("axis")
        key = s.get("key", t.name)
        if not isinstance(key, str):
            raise DumpError(f"{where}: shard {i}: key must be a string")
        if axis is None:
            shards.append(Shard(rank, None, 0, 0, 0, key))
            axes.add(None)
            continue
        _int(axis, f"{t.name} shard {i}: axis")
        if axis >= len(t.shape):
            raise DumpError(f"{where}: shard {i}: axis {axis} is not an axis of shape {list(t.shape)}")
        offset = _int(s.get("offset"), f"{t.name} shard {i}: offset")
        length = _int(s.get("length"), f"{t.name} shard {i}: length")
        padding = _int(s.get("padding", 0), f"{t.name} shard {i}: padding")
        if length + padding < 1:
            raise DumpError(f"{where}: shard {i} holds nothing (length 0 and no padding)")
        if offset + length > t.shape[axis]:
            raise DumpError(f"{where}: shard {i} ({offset} + {length}) runs past {t.shape[axis]} entries of axis "
                            f"{axis}")
        shards.append(Shard(rank, axis, offset, length, padding, key))
        axes.add(axis)
    split = axes - {None}
    if len(split) > 1:
        raise DumpError(f"{where}: its shards split it along axes {sorted(split)}; one axis per tensor")
    slices = sorted({(s.offset, s.length) for s in shards if s.axis is not None and s.length})
    for (o1, n1), (o2, n2) in zip(slices, slices[1:]):
        if o2 < o1 + n1:
            raise DumpError(f"{where}: shards [{o1}, {o1 + n1}) and [{o2}, {o2 + n2}) overlap without being the same "
                            "slice; replicas hold the same slice, other shards disjoint ones")
    if split and None not in axes:
        axis = split.pop()
        covered = np.zeros(t.shape[axis], bool)
        for s in shards:
            covered[s.offset:s.offset + s.length] = True
        if not covered.all():
            hole = int(np.argmin(covered))
            raise DumpError(f"{where}: no shard holds entry {hole} of axis {axis}; the shards must cover it")
    return shards


# ------------------------------------------------------------------------------------------------ writing

def write_layout(path, *, system, cfg, dtype, loss, ranks, parallel, tensors, params, idx, targets):
    """Rank 0's files: layout.json (tensors: {name: description as in FORMAT.md}), params.npz, batch.npz.
    Written to temporary names and renamed, so that a dump is either whole or absent."""
    os.makedirs(path, exist_ok=True)
    meta = {"format": FORMAT, "version": VERSION, "system": system,
            "model": {k: getattr(cfg, k) for k in MODEL_KEYS}, "dtype": dtype, "loss": float(loss),
            "ranks": ranks, "parallel": parallel, "tensors": tensors}
    _atomic(os.path.join(path, "params.npz"), lambda f: np.savez(f, **params))
    _atomic(os.path.join(path, "batch.npz"), lambda f: np.savez(f, idx=np.asarray(idx), targets=np.asarray(targets)))
    _atomic(os.path.join(path, "layout.json"), lambda f: f.write(layout_text(meta).encode()))


def layout_text(meta):
    """layout.json's text: the header one key per line, then one line per tensor (readable, and diffable)."""
    head = {k: v for k, v in meta.items() if k != "tensors"}
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    tensors = [f"  {json.dumps(n)}: {json.dumps(t)}" for n, t in meta["tensors"].items()]
    return "{\n" + "\n".join(lines) + '\n "tensors": {\n' + ",\n".join(tensors) + "\n }\n}\n"


def write_rank(path, rank, arrays):
    """grads-rank{rank}.npz: this rank's gradient pieces {key: array}."""
    os.makedirs(path, exist_ok=True)
    _atomic(os.path.join(path, grads_file(rank)), lambda f: np.savez(f, **arrays))


def _atomic(final, write):
    tmp = f"{final}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, final)


def shard_entry(rank, axis=None, offset=0, length=0, padding=0, key=None):
    """One shard's description for layout.json."""
    e = {"rank": rank, "axis": axis}
    if axis is not None:
        e.update(offset=offset, length=length, padding=padding)
    if key is not None:
        e["key"] = key
    return e

