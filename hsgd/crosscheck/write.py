"""Writing a crosscheck dump (hsgd/crosscheck/FORMAT.md) as one set of files from one run (hsgd.crosscheck.manifest):

    manifest.clean(DIR)               first: what an earlier dump left there removed (its dump.json first)
    write_rank(DIR, r, arrays, run)   every rank: grads-rank{r}.npz
    write_layout(DIR, ..., run=run)   rank 0: layout.json, params.npz, batch.npz
    manifest.write_manifest(DIR, run, ranks, files)    rank 0, LAST, once every rank's file is written: dump.json

Each file is written to a temporary name, synced and renamed, so that it is whole or absent, and stamped with the
run's id (manifest.new_run(); layout.json's "run", an .npz's archive comment); each writer returns {name: {"size",
"sha256"}} of what it wrote, the entries dump.json lists. hsgd.crosscheck.hsgd_dump writes hsgd's own runs with
them; benchmarks/crosscheck_torch.py writes PyTorch's (manifest.seal hashes the files it wrote). write_one_rank: a
whole one-rank dump with the model stored as a PyTorch module stores it; write_sharded: a whole dump of tp x dp
ranks of any storage (hsgd.crosscheck.systems: Megatron-LM's, Hugging Face's), each rank writing its tp shards (the
tests' and the exercises' hand-made dumps).
"""
import json
import os
import zipfile

import numpy as np

from .dump import FAMILY_KEYS, FORMAT, MODEL_KEYS, MOE_KEYS, VERSION, Tensor, grads_file
from .manifest import STAMP, clean, file_entry, new_run, write_manifest


def write_layout(path, *, system, cfg, dtype, loss, ranks, parallel, tensors, params, idx, targets, run=None,
                 selection_bias=None):
    """Rank 0's files: layout.json (tensors: {name: description as in FORMAT.md}; the experts' fields with experts;
    selection_bias: {"h.{i}.moe": (E,)}, or None), params.npz, batch.npz, each stamped with `run` (None:
    unstamped). Returns their {name: {"size", "sha256"}} for dump.json."""
    os.makedirs(path, exist_ok=True)
    keys = MODEL_KEYS + FAMILY_KEYS + (MOE_KEYS if cfg.moe_experts else ())
    meta = {"format": FORMAT, "version": VERSION, **({"run": run} if run else {}), "system": system,
            "model": {k: getattr(cfg, k) for k in keys}, "dtype": dtype, "loss": float(loss),
            "ranks": ranks, "parallel": parallel, "tensors": tensors}
    if selection_bias:
        meta["selection_bias"] = {k: [float(x) for x in v] for k, v in selection_bias.items()}
    return {**write_npz(os.path.join(path, "params.npz"), params, run),
            **write_npz(os.path.join(path, "batch.npz"), {"idx": np.asarray(idx), "targets": np.asarray(targets)},
                        run),
            **write_text(os.path.join(path, "layout.json"), layout_text(meta))}


def layout_text(meta):
    """layout.json's text: the header one key per line, then one line per tensor (readable, and diffable)."""
    head = {k: v for k, v in meta.items() if k != "tensors"}
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    tensors = [f"  {json.dumps(n)}: {json.dumps(t)}" for n, t in meta["tensors"].items()]
    return "{\n" + "\n".join(lines) + '\n "tensors": {\n' + ",\n".join(tensors) + "\n }\n}\n"


def write_rank(path, rank, arrays, run=None):
    """grads-rank{rank}.npz: this rank's gradient pieces {key: array}, stamped with `run`. Returns its entry."""
    os.makedirs(path, exist_ok=True)
    return write_npz(os.path.join(path, grads_file(rank)), arrays, run)


def write_npz(final, arrays, run=None):
    """The .npz file `final` of arrays {name: array} (numpy.savez), its zip archive comment "hsgd-crosscheck run
    RUN" (None: none). Returns {basename: {"size", "sha256"}}."""
    def write(f):
        np.savez(f, **arrays)
        if run:
            with zipfile.ZipFile(f, "a") as z:                    # rewrites only the end of the archive
                z.comment = STAMP + run.encode("ascii")
    return _atomic(final, write)


def write_text(final, text):
    """The text file `final` (UTF-8). Returns {basename: {"size", "sha256"}}."""
    return _atomic(final, lambda f: f.write(text.encode("utf-8")))


def _atomic(final, write):
    """write(f) into a temporary name beside `final`, synced to disk, then renamed: the file is whole or absent."""
    tmp = f"{final}.tmp{os.getpid()}"
    with open(tmp, "w+b") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    entry = file_entry(tmp)
    os.replace(tmp, final)
    return {os.path.basename(final): entry}


def shard_entry(rank, axis=None, offset=0, length=0, padding=0, key=None):
    """One shard's description for layout.json."""
    e = {"rank": rank, "axis": axis}
    if axis is not None:
        e.update(offset=offset, length=length, padding=padding)
    if key is not None:
        e["key"] = key
    return e



def pytorch_tensors(cfg, interleave="head"):
    """{stored name: Tensor} of the reference model as a PyTorch module stores it: nn.Linear weights (out, in),
    i.e. transposed; each block's q, k and v weights and biases fused along the output axis as
    "h.{i}.attn.qkv.weight" / ".bias", [q_h0 k_h0 v_h0 q_h1 ...] (interleave "head", pieces of hs), [q | k | v]
    ("block"), or per kv head [q heads of kv head 0, k_0, v_0, q heads of kv head 1, ...] ("groups", NKV groups:
    the head layout when NKV = NH; "head" needs NKV = NH); wte, wpe, the norms and the other linears as they are."""
    out = {}
    for n, shape in cfg.param_shapes().items():
        if ".attn.k." in n or ".attn.v." in n:
            continue                                         # (in the fused tensor of q)
        if ".attn.q." in n:
            name = n.replace(".q.", ".qkv.")
            parts = [n, n.replace(".q.", ".k."), n.replace(".q.", ".v.")]
            out[name] = Tensor(name, (), n.endswith("weight"), parts, 0, interleave, cfg.head_size, [],
                               (cfg.d_model, cfg.kv_width, cfg.kv_width), cfg.n_kv_heads)
        else:
            out[n] = Tensor(n, (), len(shape) == 2 and n not in ("wte", "wpe"), [n], 0, "block", 0, [])
    return out


def write_one_rank(path, cfg, params, grads, *, loss, idx, targets, system, stored="head", said=None,
                   parallel=None):
    """A whole dump (cleaned, written, dump.json last) of one rank holding every tensor whole, in PyTorch's storage
    (pytorch_tensors): the q|k|v fused as `stored` interleaves them, while layout.json says `said` (default: the
    same; another value is a layout.json that lies). params, grads: the reference's {name: array}. Returns the
    stored parameters {name: array}."""
    hs = cfg.d_model // cfg.n_heads
    tensors, stored_p, stored_g = {}, {}, {}
    for name, t in pytorch_tensors(cfg, stored).items():
        stored_p[name], stored_g[name] = t.from_reference(params), t.from_reference(grads)
        e = {"shape": list(stored_p[name].shape), "dtype": "float64", "transposed": t.transposed,
             "shards": [shard_entry(0)]}
        if len(t.parts) > 1:
            e["fused"] = {"axis": 0, "parts": t.parts, "interleave": said or stored, "group": hs}
            if e["fused"]["interleave"] == "groups":
                e["fused"]["groups"] = cfg.n_kv_heads                # per kv head: [q heads of g | k_g | v_g]
        tensors[name] = e
    run = new_run()
    clean(path)
    files = write_rank(path, 0, stored_g, run)
    files.update(write_layout(path, system=system, cfg=cfg, dtype="float64", loss=loss, ranks=1,
                              parallel=parallel or {}, tensors=tensors, params=stored_p, idx=idx, targets=targets,
                              run=run))
    write_manifest(path, run, 1, files)
    return stored_p


def tensor_entry(t, shards, dtype="float64"):
    """Tensor t's description for layout.json (FORMAT.md), with its shards' entries: "fused" when it holds several
    parameters, or one under another name."""
    e = {"shape": list(t.shape), "dtype": dtype, "transposed": t.transposed}
    if len(t.parts) == 1 and t.parts != [t.name]:
        e["fused"] = {"parts": list(t.parts)}                    # the parameter under another name
    elif len(t.parts) > 1:
        e["fused"] = {"axis": t.fuse_axis, "parts": list(t.parts), "interleave": t.interleave}
        if t.interleave != "block":
            e["fused"].update({"group": t.group} if t.interleave == "head" else {"groups": t.groups})
    if t.rotary:
        e["rotary"] = "interleaved"
    e["shards"] = shards
    return e


def tp_piece(a, axis, tp, t):
    """(tp rank t's piece of the full stored array a along `axis`, its shard entry's (offset, length, padding)):
    ceil(n/tp) entries, those past n zeros (a vocabulary padded to divide by tp)."""
    n = a.shape[axis]
    size = -(-n // tp)
    start = min(t * size, n)
    length = max(0, min(size, n - start))
    piece = np.moveaxis(a, axis, 0)[start:start + length]
    pad = np.zeros((size - length,) + piece.shape[1:], a.dtype)
    return np.ascontiguousarray(np.moveaxis(np.concatenate([piece, pad]), 0, axis)), (start, length, size - length)


def write_sharded(path, cfg, tensors, params, grads, *, tp, dp=1, loss, idx, targets, system, dtype="float64",
                  change=None):
    """A whole dump (cleaned, written, dump.json last) of tp x dp ranks: rank r = d tp + t holds tp rank t's piece
    (tp_piece) of every tensor split along an axis and every other tensor whole, the dp ranks replicas.
    tensors: {stored name: (Tensor, split axis or None)} (hsgd.crosscheck.systems); params, grads: the reference's
    {name: array}; change(stored name, rank, array) may alter what a rank writes. Returns the stored parameters."""
    stored_p = {n: t.from_reference(params) for n, (t, _) in tensors.items()}
    shards = {n: [] for n in tensors}
    run, files = new_run(), {}
    clean(path)
    for r in range(tp * dp):
        mine = {}
        for n, (t, axis) in tensors.items():
            g = t.from_reference(grads)
            if axis is None:
                a, e = g, shard_entry(r)
            else:
                a, (offset, length, padding) = tp_piece(g, axis, tp, r % tp)
                e = shard_entry(r, axis, offset, length, padding)
            mine[n] = change(n, r, a) if change else a
            shards[n].append(e)
        files.update(write_rank(path, r, mine, run))
    entries = {n: tensor_entry(t, shards[n], dtype) for n, (t, _) in tensors.items()}
    files.update(write_layout(path, system=system, cfg=cfg, dtype=dtype, loss=loss, ranks=tp * dp,
                              parallel={"dp": dp, "tp": tp}, tensors=entries, params=stored_p, idx=idx,
                              targets=targets, run=run))
    write_manifest(path, run, tp * dp, files)
    return stored_p
