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
from .shards import parse_shards
from .dump import (DTYPES, FAMILY_KEYS, FORMAT, INTERLEAVES, MODEL_KEYS, MOE_KEYS, PARALLEL, VERSION, Dump, DumpError,
                   Tensor, check_reference_fits, check_sizes, grads_file, integer, reference_shapes)

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
    ranks = integer(meta.get("ranks"), "ranks", 1)
    check_reference_fits(cfg)                                  # before params.npz is read
    parallel = meta.get("parallel", {})
    if not isinstance(parallel, dict) or set(parallel) - set(PARALLEL):
        raise DumpError(f"layout.json: \"parallel\" may give {', '.join(PARALLEL)} only")
    parallel = {k: integer(parallel.get(k, 1), f"parallel.{k}", 1) for k in PARALLEL}
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
    t.shards = parse_shards(e.get("shards"), t, ranks, where)
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
    group = integer(fused.get("group", hs), f"{name}: fused.group", 1)
    groups = integer(fused.get("groups", 1), f"{name}: fused.groups", 1)
    if interleave == "groups" and "groups" not in fused:
        raise DumpError(f"{where}: interleave groups needs \"groups\": how many pieces each part is cut into (the "
                        "kv heads of a grouped q|k|v, tp for one [gate_i | up_i] per rank)")
    axis = integer(fused.get("axis", 0 if len(parts) == 1 else None), f"{name}: fused.axis")
    return parts, axis, interleave, group, groups
