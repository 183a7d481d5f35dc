"""Reading a crosscheck dump (hsgd/crosscheck/FORMAT.md): `load(DIR)` reads layout.json, params.npz, batch.npz and
every rank's grads-rank{r}.npz and checks each against the others: the tensors give every parameter of the model
once, in its shape (fused, transposed); the shards lie inside their tensors, cover them, and are the arrays the
ranks wrote; the parameters are finite, the batch's ids in the vocabulary; with experts, the layout's sizes count
the batch (its micro-batches, each rank's positions) and the selection biases are the MoE blocks'. Anything that
does not fit is one DumpError (exit 2) saying what and what would. Only JSON, and .npz read with allow_pickle=False.
"""
import math
import os

import numpy as np

from hsgd.model.config import ModelConfig
from hsgd.errors import ConfigError
from hsgd.readers import Npz, machine_memory, printable, read_json
from .manifest import ARRAYS
from .safetensors import read_safetensors
from .dump import (DTYPES, FAMILY_KEYS, FORMAT, INTERLEAVES, MODEL_KEYS, MOE_KEYS, PARALLEL, VERSION, Dump, DumpError,
                   Shard, Tensor, check_reference_fits, check_sizes, grads_file, reference_shapes)

MAX_LAYOUT_BYTES = 64 << 20    # layout.json: a model of 1000 layers over 1000 ranks describes itself in a few MB


def _arrays(path, stem, what, shapes=None, max_bytes=None):
    """{name: array} of the dump's file `stem` in folder path: stem.npz (numpy.savez, read without pickle after its
    headers are checked: hsgd.readers.Npz) or stem.safetensors (hsgd.crosscheck.safetensors: its header checked
    before a byte of data is read); the expected shapes, every array's bytes and all of them at most max_bytes.
    DumpError for anything else, for neither file or for both."""
    found = [stem + ext for ext in ARRAYS if os.path.isfile(os.path.join(path, stem + ext))]
    if len(found) != 1:
        missing = f"{os.path.join(path, stem)}.npz: no such file ({what})"
        raise DumpError(f"{missing}; a dump holds layout.json, params.npz, batch.npz and grads-rank{{r}}.npz for every "
                        f"rank (or .safetensors for any of them, hsgd/crosscheck/FORMAT.md)" if not found else
                        f"{os.path.join(path, stem)}: both .npz and .safetensors; a dump holds each file once")
    name = os.path.join(path, found[0])
    if name.endswith(".safetensors"):
        return read_safetensors(name, "dump file", DumpError, shapes, max_bytes)
    with Npz(name, "dump file", DumpError, shapes, max_bytes) as z:
        return {k: z[k] for k in z.files}


def _int(value, what, low=0):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise DumpError(f"layout.json: {what} = {value!r} must be an integer >= {low}")
    return value


def load(path):
    """The Dump in folder `path`, every part checked against the others; DumpError says what does not fit."""
    if not os.path.isdir(path):
        raise DumpError(f"{path}: not a folder; give the folder a dump was written to (hsgd.train --dump-step N DIR, "
                        "or another system's writer of hsgd/crosscheck/FORMAT.md)")
    meta = _layout_json(os.path.join(path, "layout.json"), path)
    cfg, dtype, loss, ranks, parallel = _header(meta)
    tensors = _tensors(meta.get("tensors"), cfg, ranks)
    params = _params(path, tensors)
    idx, targets = _batch(path, cfg)
    biases = _experts(meta, cfg, parallel, idx.shape)
    grads = _grads(path, tensors, ranks)
    return Dump(path, meta, cfg, dtype, loss, ranks, parallel, tensors, params, idx, targets, grads, biases)


def _layout_json(lpath, path):
    """layout.json's object, of this format and version."""
    if not os.path.lexists(lpath):
        raise DumpError(f"{lpath}: no such file; {path} is not a dump (hsgd/crosscheck/FORMAT.md)")
    if os.path.isdir(lpath):
        raise DumpError(f"{lpath}: a folder, not a file; layout.json is the dump's JSON description")
    meta = read_json(lpath, "layout.json", DumpError, max_bytes=MAX_LAYOUT_BYTES, constants=True)  # (a NaN loss)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DumpError(f"{lpath}: \"format\" must be \"{FORMAT}\" (hsgd/crosscheck/FORMAT.md)")
    if meta.get("version") != VERSION or isinstance(meta.get("version"), bool):
        raise DumpError(f"{lpath}: version {meta.get('version')!r}; this hsgd reads version {VERSION}")
    return meta


def _header(meta):
    """(ModelConfig, dtype, loss, ranks, {dp, tp, pp, cp, micro_batches, ep}) from layout.json, checked."""
    cfg = _model(meta.get("model"))
    dtype = meta.get("dtype")
    if dtype not in DTYPES:
        raise DumpError(f"layout.json: dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    loss = meta.get("loss")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        raise DumpError(f"layout.json: loss {loss!r} must be a number (the step's mean loss)")
    ranks = _int(meta.get("ranks"), "ranks", 1)
    check_reference_fits(cfg)                                  # before params.npz is read
    parallel = meta.get("parallel", {})
    if not isinstance(parallel, dict) or set(parallel) - set(PARALLEL):
        raise DumpError(f"layout.json: \"parallel\" may give {', '.join(PARALLEL)} only")
    parallel = {k: _int(parallel.get(k, 1), f"parallel.{k}", 1) for k in PARALLEL}
    check_sizes(ranks, parallel)
    return cfg, dtype, float(loss), ranks, parallel


def _model(model):
    """The ModelConfig of layout.json's "model": the sizes (MODEL_KEYS) it must give, the family's fields
    (FAMILY_KEYS) and the experts' (MOE_KEYS) it may; an absent field is the arch's preset or the default, no arch
    gpt2 (a dump of format 1 before the family: the GPT-2 block). ModelConfig checks every value (its ConfigError's
    words, one line)."""
    optional = FAMILY_KEYS + MOE_KEYS
    if not isinstance(model, dict) or not set(MODEL_KEYS) <= set(model):
        raise DumpError(f"layout.json: \"model\" must give {', '.join(MODEL_KEYS)} (and may give "
                        f"{', '.join(optional)})")
    extra = sorted(set(model) - set(MODEL_KEYS) - set(optional), key=str)
    if extra:
        raise DumpError(f"layout.json: model: {extra[0]!r:.80} is not a field of the model; give "
                        f"{', '.join(MODEL_KEYS)} and any of {', '.join(optional)}")
    if not isinstance(model.get("arch", "gpt2"), str):                # (a list is no dict key of the presets)
        raise DumpError(f"layout.json: model: arch={model['arch']!r:.80} must be a string: gpt2 or llama")
    # a text longer than any value a field takes is shortened before ModelConfig repeats it in its message
    model = {k: v[:40] + "..." if isinstance(v, str) and len(v) > 40 else v for k, v in model.items()}
    try:
        return ModelConfig(**model)
    except ConfigError as e:
        raise DumpError(f"layout.json: model: {printable(str(e), 400)}") from None


def _experts(meta, cfg, parallel, batch_shape):
    """The selection biases {"h.{i}.moe": (E,)} of layout.json's "selection_bias" (None when it gives none), after
    checking that the layout can hold the experts (ep divides them and dp x cp) and count the batch as hsgd.ep.layout
    does: B sequences in dp x micro_batches micro-batches, T positions in 2 cp chunks (hsgd.cp.split)."""
    p, E = parallel, cfg.moe_experts
    if not E:
        if p["ep"] > 1 or "selection_bias" in meta:
            raise DumpError(f"layout.json: parallel.ep = {p['ep']} or a selection_bias, but the model has no experts "
                            "(model.moe_experts)")
        return None
    if E % p["ep"] or p["dp"] * p["cp"] % p["ep"]:
        raise DumpError(f"layout.json: parallel.ep = {p['ep']} must divide moe_experts = {E} and dp x cp = "
                        f"{p['dp'] * p['cp']} (expert e on ep rank e // (E/ep), the ep ranks folded out of dp x cp)")
    (B, T), n = batch_shape, p["dp"] * p["micro_batches"]
    if B % n or (p["cp"] > 1 and T % (2 * p["cp"])):
        chunks = f" and T into 2 cp = {2 * p['cp']} chunks" if p["cp"] > 1 else ""
        raise DumpError(f"batch.npz: (B, T) = {(B, T)} with experts: B must split into dp x micro_batches = {n} "
                        f"micro-batches{chunks}, the rows the layout routes and balances together")
    biases = meta.get("selection_bias", {})
    prefixes = [f"h.{i}.moe" for i in cfg.moe_layers()]
    if not isinstance(biases, dict) or set(biases) - set(prefixes):
        raise DumpError(f"layout.json: selection_bias must map MoE blocks ({', '.join(prefixes[:3])}, ...) to E "
                        "numbers each")
    out = {}
    for k, v in biases.items():
        if not isinstance(v, list) or len(v) != E or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
            raise DumpError(f"layout.json: selection_bias[{k!r}] must be a list of moe_experts = {E} finite numbers")
        out[k] = np.array(v, dtype=np.float64)
    return out or None


def _params(path, tensors):
    """params.npz: every tensor whole, of its shape, finite floating point, nothing else."""
    shapes = {name: t.shape for name, t in tensors.items()}
    params = _arrays(path, "params", "the parameters before the step", shapes,
                     sum(16 * math.prod(s) for s in shapes.values()))
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
    return params


def _batch(path, cfg):
    """(idx, targets) of batch.npz: integer ids of the vocabulary, (B, T) with T <= seq_len, as int64."""
    batch = _arrays(path, "batch", "the step's batch", max_bytes=machine_memory() // 4)   # (the reference's check
    #                                                                                        follows)
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
    check_reference_fits(cfg, idx.shape)                       # before the reference runs on it
    return idx.astype(np.int64), targets.astype(np.int64)


def _grads(path, tensors, ranks):
    """[{key: array}] of every rank's grads-rank{r}.npz: each shard of layout.json there, of its shape (padding
    included), and nothing else."""
    held = [0] * ranks                                          # elements of the shards each rank holds
    for t in tensors.values():
        for s in t.shards:
            held[s.rank] += math.prod(s.stored_shape(t.shape))
    grads = [_arrays(path, grads_file(r)[:-len(".npz")], f"rank {r}'s gradients", max_bytes=(1 << 20) + 16 * held[r])
             for r in range(ranks)]
    used = [set() for _ in range(ranks)]
    for t in tensors.values():
        for s in t.shards:
            have = grads[s.rank].get(s.key)
            if have is None:
                raise DumpError(f"{grads_file(s.rank)}: no array {s.key!r} (a shard of {t.name})")
            want = s.stored_shape(t.shape)
            if tuple(have.shape) != want:
                raise DumpError(f"{grads_file(s.rank)}: {s.key} has shape {have.shape}, its shard of {t.name} "
                                f"needs {tuple(want)}")
            _floating(have, f"{grads_file(s.rank)}: {s.key}")
            used[s.rank].add(s.key)
    for r in range(ranks):
        extra = sorted(set(grads[r]) - used[r])
        if extra:
            raise DumpError(f"{grads_file(r)}: {extra[0]!r} is no shard of layout.json")
    return grads


def _floating(a, what):
    if not np.issubdtype(a.dtype, np.floating):
        raise DumpError(f"{what} is {a.dtype}; write floating-point arrays (bfloat16 as float32)")


def _tensors(entries, cfg, ranks):
    """{name: Tensor} from layout.json's "tensors", checked: they give every reference parameter once, their shapes
    are the reference's, their shards lie inside them and cover them."""
    if not isinstance(entries, dict) or not entries:
        raise DumpError("layout.json: \"tensors\" must map each tensor's name to its description")
    owner, out = {}, {}
    for name, e in entries.items():
        out[name] = t = _tensor(name, e, cfg, ranks)
        for p in t.parts:
            if p in owner:
                raise DumpError(f"layout.json: tensor {name}: {p} is held by {owner[p]} too; every parameter is held "
                                "once")
            owner[p] = name
    missing = [p for p in reference_shapes(cfg) if p not in owner]
    if missing:
        raise DumpError(f"layout.json: no tensor holds {missing[0]}" +
                        (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") +
                        "; the tensors together must hold every parameter of the model")
    return out


def _tensor(name, e, cfg, ranks):
    """One tensor's Tensor from its entry: its parts (itself, or the fused ones), transpose, shape and shards."""
    where = f"layout.json: tensor {name}"
    ref_shapes = reference_shapes(cfg)
    if not isinstance(e, dict):
        raise DumpError(f"{where}: must be an object (hsgd/crosscheck/FORMAT.md)")
    parts, axis, interleave, group, groups = _fused(e.get("fused"), name, where, cfg.head_size)
    for p in parts:
        if p not in ref_shapes:
            raise DumpError(f"{where}: {p!r:.80} is not a parameter of the model ({cfg.arch}'s family: "
                            f"names as in hsgd.model.config's param_shapes, e.g. h.0.attn.q.weight); without \"fused\" "
                            f"a tensor's name is the parameter's (fused with one part: another name for it)")
    transposed = e.get("transposed", False)
    if not isinstance(transposed, bool):
        raise DumpError(f"{where}: transposed {transposed!r} must be true or false")
    if e.get("dtype", "float64") not in DTYPES:
        raise DumpError(f"{where}: dtype {e.get('dtype')!r} must be one of {', '.join(DTYPES)}")
    ndims = {len(ref_shapes[p]) for p in parts}
    if transposed and ndims != {2}:
        raise DumpError(f"{where}: transposed is for 2-D weights only")
    if len(ndims) != 1 or axis >= next(iter(ndims)):
        raise DumpError(f"{where}: fused parts must have the same number of dimensions, more than fused.axis {axis}")
    t = Tensor(name, (), transposed, parts, axis, interleave, group, [], (), groups, _rotary(e, parts, cfg, where))
    stored = t.part_shapes(ref_shapes)
    if len(parts) > 1:
        if len({s[:axis] + s[axis + 1:] for s in stored}) != 1:
            raise DumpError(f"{where}: fused parts of shapes {stored} do not line up: all but axis {axis} must be "
                            "equal")
        t.lengths = tuple(s[axis] for s in stored)
        if interleave == "head" and (len(set(t.lengths)) != 1 or t.lengths[0] % group):
            raise DumpError(f"{where}: interleave head needs parts of one length along the axis, a multiple of "
                            f"group {group}; parts of other lengths (grouped k, v) take interleave groups")
        if interleave == "groups" and any(n % groups for n in t.lengths):
            raise DumpError(f"{where}: interleave groups cuts each part into groups = {groups} pieces, but the parts' "
                            f"lengths along axis {axis} are {list(t.lengths)}; groups must divide each")
    t.shape = tuple(t.stored_shape(ref_shapes))
    given = e.get("shape")
    if not isinstance(given, list) or tuple(given) != t.shape:
        raise DumpError(f"{where}: shape {given!r}, but its parameters give {list(t.shape)}")
    t.shards = _shards(e.get("shards"), t, ranks, where)
    return t


def _rotary(e, parts, cfg, where):
    """Tensor.rotary of an entry's "rotary": "halves" (default: the reference's order, 0) or "interleaved" (the head
    size: q's and k's output features stored in rotary-pair order), for a tensor that holds q or k of a rope model."""
    rotary = e.get("rotary", "halves")
    if rotary not in ("halves", "interleaved"):
        raise DumpError(f"{where}: rotary {rotary!r:.80} must be \"halves\" (pair i of a head is features i and i + "
                        "hs/2, Hugging Face's) or \"interleaved\" (features 2i and 2i + 1: torchtitan's, Meta's Llama)")
    if rotary == "halves":
        return 0
    if cfg.positions != "rope" or not any(f".attn.{m}." in p for p in parts for m in "qk"):
        raise DumpError(f"{where}: rotary \"interleaved\" is for the q and k weights (and biases) of a model with "
                        f"rotary positions (this one: positions {cfg.positions}, parts {', '.join(parts[:3])})")
    return cfg.head_size


def _fused(fused, name, where, hs):
    """(parts, axis, interleave, group, groups) of a tensor's "fused" entry, or of a plain tensor (None). One part:
    the tensor is that parameter under another name (its axis may be left out)."""
    if fused is None:
        return [name], 0, "block", 0, 0
    if not isinstance(fused, dict) or not isinstance(fused.get("parts"), list) or len(fused["parts"]) < 1:
        raise DumpError(f"{where}: fused must give \"parts\" (reference names) and \"axis\"")
    parts, interleave = fused["parts"], fused.get("interleave", "block")
    if not all(isinstance(p, str) for p in parts):
        raise DumpError(f"{where}: fused.parts must be the reference parameters' names (strings)")
    if not isinstance(interleave, str) or interleave not in INTERLEAVES:
        raise DumpError(f"{where}: fused.interleave {interleave!r:.80} must be one of {', '.join(INTERLEAVES)}")
    group = _int(fused.get("group", hs), f"{name}: fused.group", 1)
    groups = _int(fused.get("groups", 1), f"{name}: fused.groups", 1)
    if interleave == "groups" and "groups" not in fused:
        raise DumpError(f"{where}: interleave groups needs \"groups\": how many pieces each part is cut into (the "
                        "kv heads of a grouped q|k|v, tp for one [gate_i | up_i] per rank)")
    axis = _int(fused.get("axis", 0 if len(parts) == 1 else None), f"{name}: fused.axis")
    return parts, axis, interleave, group, groups


def _shards(entries, t, ranks, where):
    """[Shard] of a tensor's "shards": each whole, cut along one axis (axis, offset, length, padding) or along
    several ("slices": a list of such objects, distinct axes: FSDP x TP); their boxes are the same (replicas) or
    disjoint, and (unless a rank holds it whole) they cover the tensor."""
    if not isinstance(entries, list) or not entries:
        raise DumpError(f"{where}: \"shards\" must list where its gradient's pieces are (at least one)")
    shards = [_shard(i, s, t, ranks, where) for i, s in enumerate(entries)]
    boxes = sorted({s.box() for s in shards if s.slices and all(n for _, _, n in s.box())})
    _disjoint(boxes, t, where)
    if all(s.slices for s in shards):
        if not boxes:
            raise DumpError(f"{where}: its shards hold padding only (length 0); the shards must cover the tensor's "
                            "real entries")
        volume = sum(math.prod(n for _, _, n in b) * math.prod(t.shape) //
                     math.prod(t.shape[a] for a, _, _ in b) for b in boxes)
        if volume != math.prod(t.shape):
            hole, axes = _hole(boxes, t.shape), sorted({a for b in boxes for a, _, _ in b})
            at = f"{hole[axes[0]]} of axis {axes[0]}" if len(axes) == 1 else f"{hole} of shape {list(t.shape)}"
            raise DumpError(f"{where}: no shard holds entry {at}; the shards must cover it")
    return shards


def _shard(i, s, t, ranks, where):
    """Shard i's Shard: whole (no axis, or axis null), one axis (axis, offset, length, padding: format 1), or the
    "slices" list; each slice inside the tensor along its axis."""
    if not isinstance(s, dict):
        raise DumpError(f"{where}: shard {i} must be an object with rank, axis, offset, length (or slices)")
    rank = _int(s.get("rank"), f"{t.name} shard {i}: rank")
    if rank >= ranks:
        raise DumpError(f"{where}: shard {i} is on rank {rank}, but the dump has ranks 0..{ranks - 1}")
    key = s.get("key", t.name)
    if not isinstance(key, str):
        raise DumpError(f"{where}: shard {i}: key must be a string")
    if "slices" in s:
        if s.get("axis") is not None:
            raise DumpError(f"{where}: shard {i} gives both axis and slices; give one (slices for several axes)")
        given = s["slices"]
        if not isinstance(given, list) or not 1 <= len(given) <= len(t.shape):
            raise DumpError(f"{where}: shard {i}: slices must be a list of 1 to {len(t.shape)} objects (axis, "
                            "offset, length, padding), one per axis the shard is cut along")
    else:
        given = [] if s.get("axis") is None else [s]
    slices = [_slice(c, f"{t.name} shard {i}", t, where) for c in given]
    axes = [c[0] for c in slices]
    if len(set(axes)) != len(axes):
        raise DumpError(f"{where}: shard {i} cuts axis {max(axes, key=axes.count)} twice; one slice per axis")
    # a slice of a whole axis without padding cuts nothing: left out, so that the same box reads the same however
    # it is written (axis 1 [0, 8) of a (37, 8) tensor is the whole tensor; with rows [0, 19) the box of those rows)
    cuts = tuple(sorted(c for c in slices if (c[1], c[2], c[3]) != (0, t.shape[c[0]], 0)))
    return Shard(rank, cuts, key)


def _slice(c, what, t, where):
    """(axis, offset, length, padding) of one slice object, inside the tensor."""
    if not isinstance(c, dict):
        raise DumpError(f"{where}: {what}: a slice must be an object with axis, offset, length (padding)")
    axis = _int(c.get("axis"), f"{what}: axis")
    if axis >= len(t.shape):
        raise DumpError(f"{where}: {what}: axis {axis} is not an axis of shape {list(t.shape)}")
    offset = _int(c.get("offset"), f"{what}: offset")
    length = _int(c.get("length"), f"{what}: length")
    padding = _int(c.get("padding", 0), f"{what}: padding")
    if length + padding < 1:
        raise DumpError(f"{where}: {what} holds nothing along axis {axis} (length 0 and no padding)")
    if offset + length > t.shape[axis]:
        raise DumpError(f"{where}: {what} ({offset} + {length}) runs past {t.shape[axis]} entries of axis {axis}")
    return axis, offset, length, padding


def _disjoint(boxes, t, where):
    """DumpError when two different boxes overlap (they hold some entry both, without being the same slice). A box
    leaves the axes it does not cut whole. Pairwise over the boxes, in blocks of rows (k^2 tests, k the shards)."""
    if len(boxes) < 2:
        return
    lo = np.zeros((len(boxes), len(t.shape)), np.int64)
    hi = np.tile(np.array(t.shape, np.int64), (len(boxes), 1))
    for k, b in enumerate(boxes):
        for a, o, n in b:
            lo[k, a], hi[k, a] = o, o + n
    for start in range(0, len(boxes), 256):
        both = (np.maximum(lo[start:start + 256, None], lo[None]) <
                np.minimum(hi[start:start + 256, None], hi[None])).all(axis=2)       # (256, k): overlap on every axis
        both[np.arange(both.shape[0]), np.arange(start, start + both.shape[0])] = False
        if both.any():
            i, j = np.argwhere(both)[0]
            b1, b2 = boxes[start + i], boxes[j]
            raise DumpError(f"{where}: shards {_text(b1)} and {_text(b2)} overlap without being the same slice; "
                            "replicas hold the same slice, other shards disjoint ones")


def _text(box):
    return " x ".join(f"axis {a} [{o}, {o + n})" for a, o, n in box)


def _hole(boxes, shape):
    """The first entry of the tensor no box holds (an index tuple); found on the grid of the boxes' cut points."""
    cuts = [sorted({0, shape[a]} | {v for b in boxes for ax, o, n in b if ax == a for v in (o, o + n)})
            for a in range(len(shape))]
    held = np.zeros([len(c) - 1 for c in cuts], bool)
    for b in boxes:
        index = [slice(None)] * len(shape)
        for a, o, n in b:
            index[a] = slice(cuts[a].index(o), cuts[a].index(o + n))
        held[tuple(index)] = True
    cell = np.argwhere(~held)[0]
    return tuple(int(cuts[a][k]) for a, k in enumerate(cell))
