"""Writing a crosscheck dump (hsgd/crosscheck/FORMAT.md): rank 0's layout.json, params.npz and batch.npz
(write_layout), every rank's grads-rank{r}.npz (write_rank), each written to a temporary name and renamed, so that
a file is whole or absent. hsgd.crosscheck.hsgd_dump writes hsgd's own runs with them; benchmarks/crosscheck_torch.py
writes PyTorch's. write_one_rank: a one-rank dump with the model stored as a PyTorch module stores it (the
tests' and the exercises' hand-made dumps).
"""
import json
import os

import numpy as np

from .dump import FORMAT, MODEL_KEYS, VERSION, Tensor, grads_file


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



def pytorch_tensors(cfg, interleave="head"):
    """{stored name: Tensor} of the reference model as a PyTorch module stores it: nn.Linear weights (out, in),
    i.e. transposed; each block's q, k and v weights and biases fused along the output axis as
    "h.{i}.attn.qkv.weight" / ".bias", [q_h0 k_h0 v_h0 q_h1 ...] (interleave "head", pieces of hs) or [q | k | v]
    ("block"); wte, wpe, the LayerNorms and the biases as they are."""
    hs, out = cfg.d_model // cfg.n_heads, {}
    for n, shape in cfg.param_shapes().items():
        if ".attn.k." in n or ".attn.v." in n:
            continue                                         # (in the fused tensor of q)
        if ".attn.q." in n:
            name = n.replace(".q.", ".qkv.")
            parts = [n, n.replace(".q.", ".k."), n.replace(".q.", ".v.")]
            out[name] = Tensor(name, (), n.endswith("weight"), parts, 0, interleave, hs, [], (cfg.d_model,) * 3)
        else:
            out[n] = Tensor(n, (), len(shape) == 2 and n not in ("wte", "wpe"), [n], 0, "block", 0, [])
    return out


def write_one_rank(path, cfg, params, grads, *, loss, idx, targets, system, stored="head", said=None,
                   parallel=None):
    """A dump of one rank holding every tensor whole, in PyTorch's storage (pytorch_tensors): the q|k|v fused as
    `stored` interleaves them, while layout.json says `said` (default: the same; another value is a layout.json
    that lies). params, grads: the reference's {name: array}. Returns the stored parameters {name: array}."""
    hs = cfg.d_model // cfg.n_heads
    tensors, stored_p, stored_g = {}, {}, {}
    for name, t in pytorch_tensors(cfg, stored).items():
        stored_p[name], stored_g[name] = t.from_reference(params), t.from_reference(grads)
        e = {"shape": list(stored_p[name].shape), "dtype": "float64", "transposed": t.transposed,
             "shards": [shard_entry(0)]}
        if len(t.parts) > 1:
            e["fused"] = {"axis": 0, "parts": t.parts, "interleave": said or stored, "group": hs}
        tensors[name] = e
    write_rank(path, 0, stored_g)
    write_layout(path, system=system, cfg=cfg, dtype="float64", loss=loss, ranks=1, parallel=parallel or {},
                 tensors=tensors, params=stored_p, idx=idx, targets=targets)
    return stored_p
