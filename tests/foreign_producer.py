"""A crosscheck dump written as another system would write it, from hsgd/crosscheck/FORMAT.md alone.

It imports nothing of hsgd.crosscheck: layout.json is written with json, the arrays with numpy.savez (or by hand as
safetensors: an 8-byte little-endian header length, a JSON header, the raw little-endian bytes), dump.json with
hashlib. tests/test_crosscheck_foreign.py checks its dumps with `python -m hsgd.crosscheck`; read top to bottom it is
also FORMAT.md by example. It is given gradients under hsgd's parameter names (the tests take hsgd.model.serial's,
which play the system's correct gradients, or change them to plant a bug) and stores them by conventions unlike
hsgd's own writers':

    names         tok_emb, pos_emb, blk{i}.norm1.scale | .shift, blk{i}.attn.wqkv | .bqkv, blk{i}.attn.wo | .bo,
                  blk{i}.norm2.*, blk{i}.ffn.w1 | .b1 (GELU) or blk{i}.ffn.w13 | .b13 (SwiGLU), blk{i}.ffn.w2 | .b2,
                  norm_f.*, head.weight; with experts blk{i}.moe.gate_w (the router) and blk{i}.moe.experts.{e}.w13,
                  .w2, ..., each rank's array keyed by the expert's local index there (blk{i}.moe.local_experts.{j}.*)
    storage       every linear weight (out, in): "transposed", as torch.nn.Linear stores it
    tensor par.   wqkv is [q_i | k_i | v_i] per tp rank (fused "groups", groups = tp; with GQA k_i, v_i hold NKV/tp
                  kv heads), w13 [gate_i | up_i] per tp rank; w1 and the fused tensors split by their output rows
                  (stored axis 0), wo and w2 by their input columns (stored axis 1); their biases as their output
                  axis, the norms and wo's, w2's biases whole on every tp rank; tok_emb and head split by vocabulary,
                  each rank's rows padded to ceil(V / tp), the short slices first: the padding lies between ranks' rows
    rank order    rank = tp_rank * dp + dp_rank ("tp-major"; hsgd numbers its ranks dp_rank * tp + tp_rank:
                  "dp-major")
    data par.     every dp rank a replica of its tp rank's pieces; two_d (FSDP x TP): each piece cut once more over
                  the dp ranks, a weight along its other axis than tp's (axis 0 where tp cuts none), a vector along
                  axis 0 (inside its tp slice), ceil(n / dp) entries a rank, the last one's padded: FORMAT.md's
                  "slices", two axes per weight
    experts       expert e on ep rank q = e // (E / ep), which is the dp ranks q dp/ep .. (q + 1) dp/ep - 1 (a block
                  of consecutive ranks; hsgd folds every ep-th), each tp rank holding its shard as of the MLP

To plant a bug: `grads` itself changed (a wrong value everywhere), `replica_grads` {dp rank: gradients} (what one data-
parallel replica holds instead: an earlier step's, its own rows'), `change(key, place, array)` (one rank's array as
written, padding included), `edit_layout(layout)` (layout.json saying something else than the arrays are),
`replicas=False` (only the first dp rank holding a tensor writes it).

Leaves out: pipeline and context parallelism (pp = cp = 1), dtypes other than float64, and the run stamps (optional
in FORMAT.md: the digests of dump.json decide).

    run = write(path, cfg, params, grads, idx, targets, loss, tp=2, dp=3)
"""
import hashlib
import json
import os
import re
import secrets
import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

SIZES = ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff")
FAMILY = ("arch", "norm", "positions", "rope_theta", "mlp", "n_kv_heads", "bias", "tied", "moe_experts", "moe_every")
EXPERT_FIELDS = ("moe_top_k", "moe_gates", "moe_capacity_factor", "moe_balance", "moe_balance_domain",
                 "moe_balance_layers", "moe_z_loss", "moe_bias_rate")
DUMP_FILE = re.compile(r"(layout\.json|(params|batch|grads-rank\d+)\.(npz|safetensors))(\.tmp\d+)?")


class Place(NamedTuple):
    """Where an array is written: the rank and its coordinates."""
    rank: int
    dp_rank: int
    tp_rank: int


def rank_of(dp_rank, tp_rank, tp, dp, order="tp-major"):
    """The rank number of (dp_rank, tp_rank): tp-major tp_rank * dp + dp_rank, dp-major (hsgd's) dp_rank * tp +
    tp_rank."""
    if order == "tp-major":
        return tp_rank * dp + dp_rank
    if order == "dp-major":
        return dp_rank * tp + tp_rank
    raise ValueError(f"rank order {order!r}: use tp-major or dp-major")


@dataclass
class Tensor:
    """One tensor of the system: its name, the hsgd parameters it holds, how it is stored and split."""
    name: str
    parts: list                 # hsgd's names; several: fused along stored axis 0, [p0_i | p1_i | ...] per tp rank
    transposed: bool = False    # stored (out, in)
    tp_axis: int = None         # the stored axis cut over tp; None: whole on every tp rank
    vocab: bool = False         # cut by vocabulary, each rank's rows padded to ceil(V / tp)
    holders: tuple = None       # the dp ranks that hold it (None: all; an expert: its ep rank's)
    key: str = None             # its arrays' name in the rank files (None: its name)


def tensors(cfg, dp, ep):
    """[Tensor]: the system's tensors of model cfg (a ModelConfig's sizes and family)."""
    def norm(mine, ref):
        out = [Tensor(f"{mine}.scale", [f"{ref}.weight"])]
        return out + ([Tensor(f"{mine}.shift", [f"{ref}.bias"])] if cfg.norm == "layernorm" else [])

    def linear(weight, bias, refs, tp_axis, holders=None, local=None):
        """A linear layer's weight (stored (out, in)) and, with biases, its bias (cut as the weight's output axis)."""
        key = (lambda name: local + name.rsplit(".", 1)[1]) if local else (lambda name: None)
        out = [Tensor(weight, [r + ".weight" for r in refs], True, tp_axis, False, holders, key(weight))]
        if cfg.bias:
            out.append(Tensor(bias, [r + ".bias" for r in refs], False, 0 if tp_axis == 0 else None, False, holders,
                              key(bias)))
        return out

    def mlp(mine, ref, holders=None, local=None):
        first = ([ref + "fc"], "w1", "b1") if cfg.mlp == "gelu" else ([ref + "gate", ref + "up"], "w13", "b13")
        return (linear(mine + first[1], mine + first[2], first[0], 0, holders, local) +
                linear(mine + "w2", mine + "b2", [ref + "proj"], 1, holders, local))

    out = [Tensor("tok_emb", ["wte"], tp_axis=0, vocab=True)]
    if cfg.positions == "learned":
        out.append(Tensor("pos_emb", ["wpe"]))
    for i in range(cfg.n_layers):
        b, h = f"blk{i}.", f"h.{i}."
        out += norm(b + "norm1", h + "ln1")
        out += linear(b + "attn.wqkv", b + "attn.bqkv", [h + "attn.q", h + "attn.k", h + "attn.v"], 0)
        out += linear(b + "attn.wo", b + "attn.bo", [h + "attn.proj"], 1)
        out += norm(b + "norm2", h + "ln2")
        if cfg.is_moe(i):
            out.append(Tensor(b + "moe.gate_w", [h + "moe.router.weight"], transposed=True))
            for e in range(cfg.moe_experts):
                j = e % (cfg.moe_experts // ep)                  # its local index on its ep rank
                out += mlp(f"{b}moe.experts.{e}.", f"{h}moe.experts.{e}.", tuple(expert_holders(e, cfg, dp, ep)),
                           f"{b}moe.local_experts.{j}.")
        else:
            out += mlp(b + "ffn.", h + "mlp.")
    out += norm("norm_f", "ln_f")
    if not cfg.tied:
        out.append(Tensor("head.weight", ["lm_head.weight"], transposed=True, tp_axis=0, vocab=True))
    return out


def stored(t, ref, tp):
    """Tensor t's full stored array from hsgd's arrays `ref`: transposed, and fused [p0_i | p1_i | ...] per tp rank."""
    mats = [ref[p].T if t.transposed else ref[p] for p in t.parts]
    if len(mats) == 1:
        return np.ascontiguousarray(mats[0])
    cut = [np.split(m, tp, axis=0) for m in mats]              # part j: tp pieces along axis 0
    return np.concatenate([pieces[i] for i in range(tp) for pieces in cut], axis=0)


def vocab_cuts(V, tp):
    """[(offset, length, padding)] per tp rank: V // tp rows, or one more on the last V % tp ranks, each padded to
    ceil(V / tp) (37 rows on 2 ranks: 18 + 1 padding, then 19)."""
    lengths = [V // tp + (i >= tp - V % tp) for i in range(tp)]
    offsets = np.cumsum([0] + lengths[:-1])
    return [(int(o), n, -(-V // tp) - n) for o, n in zip(offsets, lengths)]


def padded_cuts(n, k):
    """[(offset, length, padding)] of n entries over k ranks: ceil(n / k) each, the last ones short and padded."""
    rows = -(-n // k)
    return [(min(i * rows, n), max(0, min(rows, n - i * rows)), rows - max(0, min(rows, n - i * rows)))
            for i in range(k)]


def pieces(t, shape, tp, dp, two_d, replicas):
    """[(dp_rank, tp_rank, {axis: (offset, length, padding)})]: each rank's box of tensor t's full stored array."""
    holders = list(t.holders or range(dp))
    if t.tp_axis is None:
        tp_cuts = [{} for _ in range(tp)]                        # whole on every tp rank
    elif t.vocab:
        tp_cuts = [{t.tp_axis: c} for c in vocab_cuts(shape[t.tp_axis], tp)]
    else:
        n = shape[t.tp_axis] // tp
        tp_cuts = [{t.tp_axis: (i * n, n, 0)} for i in range(tp)]
    out = []
    for tp_rank, cut in enumerate(tp_cuts):
        if not two_d:                                            # replicas over the holders (or the first only)
            out += [(d, tp_rank, cut) for d in (holders if replicas else holders[:1])]
            continue
        axis = 1 - t.tp_axis if len(shape) == 2 and t.tp_axis is not None else 0
        offset, length, _ = cut.get(axis, (0, shape[axis], 0))  # inside the tp slice when tp cuts this axis too
        for d, (o, n, p) in zip(holders, padded_cuts(length, len(holders))):
            out.append((d, tp_rank, {**cut, axis: (offset + o, n, p)}))
    return out


def box(full, cut):
    """The rank's array of box `cut` of `full`: the real entries, then zeros for the padding along each cut axis."""
    index, pad = [slice(None)] * full.ndim, [(0, 0)] * full.ndim
    for axis, (o, n, p) in cut.items():
        index[axis], pad[axis] = slice(o, o + n), (0, p)
    return np.pad(full[tuple(index)], pad)


def shard_entry(rank, cut, key, two_d):
    """The shard's entry in layout.json: the whole tensor (axis null), one axis, or (two_d) "slices"."""
    entry = {"rank": rank}
    if two_d:
        entry["slices"] = [{"axis": a, "offset": o, "length": n, "padding": p} for a, (o, n, p) in sorted(cut.items())]
    elif not cut:
        entry["axis"] = None
    else:
        (a, (o, n, p)), = cut.items()
        entry.update(axis=a, offset=o, length=n, padding=p)
    if key:
        entry["key"] = key
    return entry


def write(path, cfg, params, grads, idx, targets, loss, *, tp=2, dp=3, ep=1, micro_batches=1, two_d=False,
          rank_order="tp-major", change=None, replica_grads=None, replicas=True, edit_layout=None, safetensors=False,
          system="foreign_producer"):
    """One dump of tp x dp ranks in folder `path` (see the module docstring); returns its run id. params, grads:
    {hsgd name: float64 array}; idx, targets (B, T); loss: the system's loss."""
    os.makedirs(path, exist_ok=True)
    clean(path)
    ranks, run = tp * dp, f"foreign-{secrets.token_hex(6)}"
    layout_tensors, arrays = {}, [{} for _ in range(ranks)]
    for t in tensors(cfg, dp, ep):
        full = {d: stored(t, g, tp) for d, g in (replica_grads or {}).items()}
        default = stored(t, grads, tp)
        entry = {"shape": list(default.shape), "dtype": "float64", "transposed": t.transposed,
                 "fused": {"parts": t.parts}, "shards": []}
        if len(t.parts) > 1:
            entry["fused"].update(axis=0, interleave="groups", groups=tp)
        for d, tp_rank, cut in pieces(t, default.shape, tp, dp, two_d, replicas):
            place = Place(rank_of(d, tp_rank, tp, dp, rank_order), d, tp_rank)
            a = box(full.get(d, default), cut)
            arrays[place.rank][t.key or t.name] = change(t.key or t.name, place, a) if change else a
            entry["shards"].append(shard_entry(place.rank, cut, t.key, two_d))
        layout_tensors[t.name] = entry
    layout = {"format": "hsgd-crosscheck", "version": 1,
              "system": f"{system}: tp {tp} x dp {dp}{' (FSDP x TP)' if two_d else ''}, ranks {rank_order}",
              "model": {k: getattr(cfg, k) for k in SIZES + FAMILY + (EXPERT_FIELDS if cfg.moe_experts else ())},
              "dtype": "float64", "loss": float(loss), "ranks": ranks,
              "parallel": {"dp": dp, "tp": tp, "ep": ep, "micro_batches": micro_batches}, "tensors": layout_tensors}
    if edit_layout:
        edit_layout(layout)
    ext = "safetensors" if safetensors else "npz"
    save = save_safetensors if safetensors else save_npz
    stored_params = {t.name: stored(t, params, tp) for t in tensors(cfg, dp, ep)}
    files = {"layout.json": atomic(path, "layout.json", lambda f: f.write(json.dumps(layout, indent=1).encode())),
             f"params.{ext}": atomic(path, f"params.{ext}", lambda f: save(f, stored_params)),
             f"batch.{ext}": atomic(path, f"batch.{ext}", lambda f: save(f, {"idx": np.asarray(idx, np.int64),
                                                                            "targets": np.asarray(targets, np.int64)}))}
    for r in range(ranks):
        files[f"grads-rank{r}.{ext}"] = atomic(path, f"grads-rank{r}.{ext}", lambda f, r=r: save(f, arrays[r]))
    manifest = {"format": "hsgd-crosscheck-files", "version": 1, "run": run, "ranks": ranks, "files": files}
    atomic(path, "dump.json", lambda f: f.write(json.dumps(manifest, indent=1).encode()))     # last
    return run


def clean(path):
    """What an earlier dump left in `path`: dump.json first, then every file with a dump file's name."""
    if os.path.exists(os.path.join(path, "dump.json")):
        os.remove(os.path.join(path, "dump.json"))
    for name in os.listdir(path):
        if DUMP_FILE.fullmatch(name) or re.fullmatch(r"dump\.json\.tmp\d+", name):
            os.remove(os.path.join(path, name))


def atomic(path, name, write_to):
    """write_to(f) into NAME.tmp{pid}, renamed to NAME: the file is whole or absent. Returns its size and sha256."""
    final = os.path.join(path, name)
    tmp = f"{final}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write_to(f)
    os.replace(tmp, final)
    with open(final, "rb") as f:
        data = f.read()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def save_npz(f, arrays):
    np.savez(f, **arrays)


SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "int64": "I64", "int32": "I32"}


def save_safetensors(f, arrays):
    """A safetensors file by hand: 8 bytes little-endian N, N bytes of JSON header {name: {"dtype", "shape",
    "data_offsets": [begin, end)}} (padded with spaces to a multiple of 8), then the arrays' little-endian bytes."""
    header, blobs, offset = {}, [], 0
    for name, a in arrays.items():
        data = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": SAFETENSORS_DTYPES[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def expert_holders(e, cfg, dp, ep):
    """The dp ranks that hold expert e (its ep rank's block of dp / ep consecutive ranks)."""
    q = e // (cfg.moe_experts // ep)
    return list(range(q * dp // ep, (q + 1) * dp // ep))


def capacity_groups(B, T, dp, micro_batches):
    """The rows each rank routes together (FORMAT.md, "Experts", cp = 1): dp rank d's micro-batch j, sequences
    d B/dp + j b .. d B/dp + (j + 1) b - 1 (b = B / (dp m)), every position: rows s T + t."""
    b = B // (dp * micro_batches)
    return [np.arange(s * T, (s + b) * T) for d in range(dp) for s in range(d * B // dp, (d + 1) * B // dp, b)]

