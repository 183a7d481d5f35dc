"""python -m hsgd.crosscheck.from_dcp DIR --out DUMP --trust-pickled-metadata: a PyTorch Distributed Checkpoint (DCP)
of one training step, turned into a crosscheck dump (hsgd/crosscheck/FORMAT.md) that `python -m hsgd.crosscheck DUMP`
checks against hsgd's serial reference. The layout is the checkpoint's own: each chunk DCP saved of a gradient is a
shard on the rank whose file holds it (__{rank}_{n}.distcp), sliced along the dimensions where the chunk is smaller
than the tensor (a chunk of a whole tensor is a whole shard). The dump's ranks are the run's: hsgd.json's
dp x tp x pp x cp (without them, the ranks the chunks are on); a chunk or a .distcp file of a rank beyond them is
refused, so a stray file in the folder never sets how many files are written.

The checkpoint: DIR written by torch.distributed.checkpoint.save of the state dict
    {"params": {FQN: the parameter before the step}, "grads": {FQN: its gradient after the step's reductions},
     "batch": {"idx": int64 (B, T), "targets": int64 (B, T)}, "loss": a 0-d float tensor}
(DCP flattens it: "params.FQN", "grads.FQN", "batch.idx", "batch.targets", "loss"), and beside its .metadata
DIR/hsgd.json: {"system": "...", "model": {layout.json's model}, "parallel": {"dp": .., "tp": .., ...},
"dtype": "float32", "names": "torchtitan"}. --params, --batch and --loss take those from elsewhere.

Names (--names, or hsgd.json's "names"): how a FQN is hsgd's parameters:
    torchtitan   hsgd.crosscheck.systems.torchtitan_tensors (llama3's names; nn.Linear weights transposed)
    torchtitan-0.3  torchtitan_03_tensors: 0.3's fused qkv_linear.wqkv (per kv group, q and k in rotary-pair order)
                 and lm_head.weight
    hf           hsgd.crosscheck.systems.hf_tensors (LlamaForCausalLM's)
    hsgd         the reference's own names, (in, out)
    FILE.json    {FQN: {"parts": [reference names], "transposed": bool, "fused": {"axis" (>= 0), "interleave",
                 "group", "groups" (>= 1)}, "rotary": "halves" or "interleaved" (q or k of a rope model only)}, or
                 null for a buffer that is no parameter}; "{i}" in a FQN and its parts stands for a block number

.metadata is a Python pickle: PyTorch's reader unpickles it (hsgd.crosscheck.dcp.read_metadata), which can run any
code its author put in it. So nothing is read without --trust-pickled-metadata; --save-metadata-json keeps what was
read as DIR/dcp-metadata.json, which --metadata-json reads instead, with no pickle and no PyTorch. Nothing else of
the checkpoint is unpickled: the chunks' bytes are parsed (hsgd.crosscheck.dcp).

DCP saves each distinct chunk once (its save plans are deduplicated): a replicated gradient is on one rank only,
so its replicas are not checked, and neither is whether every rank held what the saving rank did.

Exit 0 with the dump written; 2 with one line for a checkpoint that cannot be read (a FQN without a mapping, a
parameter missing, a chunk outside its tensor, a dtype not floating, a model over the memory check, a .distcp file
shorter than its chunks, a truncated zip, ...), before anything large is allocated.
"""
import math
import os
import re
import sys

import numpy as np

from hsgd import cli
from hsgd.cli import Parser
from hsgd.errors import ConfigError, UsageError
from hsgd.model.config import ModelConfig
from hsgd.readers import Npz, machine_memory, printable, read_json
from . import dcp
from .dump import (DTYPES, FAMILY_KEYS, INTERLEAVES, MODEL_KEYS, MOE_KEYS, PARALLEL, DumpError, Tensor,
                   check_reference_fits, reference_shapes)
from .manifest import clean, new_run, write_manifest
from .safetensors import read_safetensors
from .systems import TORCHTITAN_BUFFERS, hf_tensors, torchtitan_03_tensors, torchtitan_tensors
from .write import shard_entry, tensor_entry, write_layout, write_rank

MAX_JSON = 16 << 20               # bytes of hsgd.json, a names file, dcp-metadata.json's neighbours
DCP_JSON = "dcp-metadata.json"
BLOCK = re.compile(r"(0|[1-9][0-9]{0,5})")


def build_parser():
    p = Parser(
        prog="python -m hsgd.crosscheck.from_dcp",
        description="Turn a PyTorch Distributed Checkpoint of one step ({params, grads, batch, loss} saved by "
                    "torch.distributed.checkpoint.save, hsgd.json beside it) into a crosscheck dump: each gradient "
                    "chunk a shard of the rank whose .distcp file holds it. DCP saves a replicated chunk once, so "
                    "replicas are not checked. .metadata is a Python pickle: PyTorch's reader unpickles it, which "
                    "can run code, so it is read only with --trust-pickled-metadata (or its JSON copy with "
                    "--metadata-json); nothing else is unpickled.",
        epilog="Example: python benchmarks/make_dcp_fixture.py ckpt && python -m hsgd.crosscheck.from_dcp ckpt "
               "--out dump --trust-pickled-metadata && python -m hsgd.crosscheck dump")
    p.add_argument("dir", metavar="DIR", help="the checkpoint's folder (.metadata, __{rank}_{n}.distcp, hsgd.json)")
    p.add_argument("--out", metavar="DUMP", required=True, help="the dump's folder (an earlier dump there is "
                                                                "removed first)")
    p.add_argument("--trust-pickled-metadata", action="store_true",
                   help="let PyTorch's reader unpickle DIR/.metadata (and --params' .metadata): unpickling runs "
                        "whatever code the file holds, so pass it only for a checkpoint you trust")
    p.add_argument("--metadata-json", action="store_true",
                   help=f"read DIR/{DCP_JSON} (and --params' one: what --save-metadata-json wrote) instead of "
                        ".metadata: no pickle, no PyTorch")
    p.add_argument("--save-metadata-json", action="store_true",
                   help=f"also write what was read of .metadata as DIR/{DCP_JSON}, for --metadata-json later")
    p.add_argument("--model", metavar="FILE", help="the model, layout and names as JSON (default DIR/hsgd.json)")
    p.add_argument("--names", metavar="NAMES", help="torchtitan, torchtitan-0.3, hf, hsgd or a FILE.json mapping FQNs "
                                                    "to hsgd's parameters (default: hsgd.json's \"names\", else "
                                                    "torchtitan)")
    p.add_argument("--params", metavar="OTHER_DIR", help="read the parameters from this checkpoint instead")
    p.add_argument("--params-prefix", metavar="P", default="params.", help="the parameters' FQN prefix "
                                                                         "(default params.)")
    p.add_argument("--grads-prefix", metavar="P", default="grads.", help="the gradients' FQN prefix (default grads.)")
    p.add_argument("--batch", metavar="FILE", help="idx and targets (B, T) from an .npz or .safetensors file "
                                                   "instead of the checkpoint's batch.idx, batch.targets")
    p.add_argument("--loss", metavar="X", type=float, help="the step's loss instead of the checkpoint's \"loss\"")
    return p


# ------------------------------------------------------------------------------------------------ names

def names_table(names, cfg, base):
    """({FQN pattern: Tensor or None (a buffer)}, what): the table of `names` (torchtitan, hf, hsgd, or a JSON file,
    relative to `base`, the model file's folder, when that file named it)."""
    try:
        if names == "torchtitan":
            return {**{n: t for n, (t, _) in torchtitan_tensors(cfg).items()},
                    **{b: None for b in TORCHTITAN_BUFFERS}}, "torchtitan's names"
        if names == "torchtitan-0.3":
            return {**{n: t for n, (t, _) in torchtitan_03_tensors(cfg).items()},
                    **{b: None for b in TORCHTITAN_BUFFERS}}, "torchtitan 0.3's names"
        if names == "hf":
            return {n: t for n, (t, _) in hf_tensors(cfg).items()}, "Hugging Face's names"
    except ValueError as e:
        raise DumpError(f"--names {names}: {e}") from None
    if names == "hsgd":
        return {n: Tensor(n, tuple(s), False, [n], 0, "block", cfg.head_size, []) for n, s in
                reference_shapes(cfg).items()}, "hsgd's names"
    path = names if os.path.isabs(names) or base is None else os.path.join(base, names)
    table = read_json(path, "names file", DumpError, max_bytes=MAX_JSON)
    if not isinstance(table, dict):
        raise DumpError(f"names file {path!r}: must map FQNs to {{\"parts\", \"transposed\", \"fused\"}} or null")
    return {fqn: None if e is None else _entry(fqn, e, path) for fqn, e in table.items()}, f"the names of {path}"


def _entry(fqn, e, path):
    """A names file's entry, checked for its form (its parts against the model when a FQN uses it)."""
    where = f"names file {path!r}: {printable(fqn, 80)}"
    fused = e.get("fused", {}) if isinstance(e, dict) else None
    if not isinstance(e, dict) or not isinstance(e.get("parts"), list) or not e["parts"] or \
            not all(isinstance(p, str) for p in e["parts"]) or not isinstance(e.get("transposed", False), bool) or \
            not isinstance(fused, dict):
        raise DumpError(f"{where}: must be {{\"parts\": [hsgd names], \"transposed\": true or false, \"fused\": "
                        "{...}} (or null for a buffer)")
    interleave = fused.get("interleave", "block")
    numbers = [(fused.get(k, least), least) for k, least in (("axis", 0), ("group", 1), ("groups", 1))]
    if interleave not in INTERLEAVES or not all(isinstance(n, int) and not isinstance(n, bool) and n >= least
                                                for n, least in numbers):
        raise DumpError(f"{where}: fused.interleave must be one of {', '.join(INTERLEAVES)}, axis an integer >= 0, "
                        "group and groups integers >= 1 (entries per piece, pieces per part)")
    if e.get("rotary", "halves") not in ("halves", "interleaved"):
        raise DumpError(f"{where}: rotary must be \"halves\" or \"interleaved\"")
    return Tensor(fqn, (), e.get("transposed", False), list(e["parts"]), fused.get("axis", 0), interleave,
                  fused.get("group", 0), [], (), fused.get("groups", 1), int(e.get("rotary") == "interleaved"))


def tensor_of(fqn, table, cfg, what, shown=None):
    """The Tensor of checkpoint name fqn (None: a buffer), its shape and parts those of cfg's model; a name with a
    block number matches a table name with "{i}" in its place. shown: the name in messages (default fqn)."""
    key, block, pieces = fqn, None, fqn.split(".")
    for k, piece in enumerate(pieces):                   # layers.3.attention.wq.weight -> layers.{i}.attention...
        if key not in table and BLOCK.fullmatch(piece):
            key, block = ".".join(pieces[:k] + ["{i}"] + pieces[k + 1:]), piece
    shown = printable(shown or fqn, 80)
    if key not in table:
        raise DumpError(f"{shown}: no mapping in {what} to hsgd's parameters; pass --names with the "
                        "system's names (torchtitan, hf, hsgd) or a names file that maps it (null for a buffer)")
    t = table[key]
    if t is None:
        return None
    parts = [p.replace("{i}", block) for p in t.parts] if block is not None else list(t.parts)
    if t.rotary and (cfg.positions != "rope" or not any(f".attn.{m}." in p for p in parts for m in "qk")):
        raise DumpError(f"{shown}: {what} give it \"rotary\": \"interleaved\", which is for the q and k weights (and "
                        f"biases) of a model with rotary positions (this one: positions {cfg.positions}, parts "
                        f"{printable(', '.join(parts[:3]), 120)}); leave it out")
    ref = reference_shapes(cfg)
    missing = [p for p in parts if p not in ref]
    if missing:
        raise DumpError(f"{shown}: {what} map it to {printable(missing[0], 80)!r}, no parameter of the "
                        f"model ({cfg.arch}, {cfg.n_layers} blocks: names as in hsgd.model.config's param_shapes)")
    out = Tensor(fqn, (), t.transposed, parts, t.fuse_axis, t.interleave, t.group or cfg.head_size, [], (),
                 t.groups, cfg.head_size if t.rotary else 0)
    shapes = out.part_shapes(ref)
    if (t.transposed and any(len(s) != 2 for s in shapes)) or any(len(s) <= t.fuse_axis for s in shapes):
        raise DumpError(f"{shown}: {what} transpose or fuse {parts} along an axis they do not have")
    if len(parts) > 1:
        out.lengths = tuple(s[t.fuse_axis] for s in shapes)
        if len({s[:t.fuse_axis] + s[t.fuse_axis + 1:] for s in shapes}) != 1 or \
                any(n % out.n_pieces() for n in out.lengths):
            raise DumpError(f"{shown}: {what} fuse parts of shapes {shapes}, which do not line up "
                            f"along axis {t.fuse_axis} in {out.n_pieces()} pieces each")
    out.shape = tuple(out.stored_shape(ref))
    return out


# ------------------------------------------------------------------------------------------------ the command

def model_file(path):
    """(ModelConfig, parallel, dtype, names, system) of hsgd.json."""
    from hsgd.step.settings import MAX_RANKS
    meta = read_json(path, "the checkpoint's model file", DumpError, max_bytes=MAX_JSON)
    model = meta.get("model") if isinstance(meta, dict) else None
    known = MODEL_KEYS + FAMILY_KEYS + MOE_KEYS
    if not isinstance(model, dict) or not set(MODEL_KEYS) <= set(model) or set(model) - set(known):
        raise DumpError(f"{path}: \"model\" must give {', '.join(MODEL_KEYS)} (and may give the family's fields), as "
                        "a dump's layout.json does (hsgd/crosscheck/FORMAT.md)")
    try:
        cfg = ModelConfig(**model)
    except (ConfigError, TypeError) as e:
        raise DumpError(f"{path}: model: {printable(str(e), 300)}") from None
    parallel = meta.get("parallel", {})
    if not isinstance(parallel, dict) or set(parallel) - set(PARALLEL) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_RANKS for v in parallel.values()):
        raise DumpError(f"{path}: \"parallel\" may give {', '.join(PARALLEL)}, integers from 1 to {MAX_RANKS}")
    dtype, names, system = meta.get("dtype", "float32"), meta.get("names", "torchtitan"), meta.get("system")
    if dtype not in DTYPES or not isinstance(names, str) or not isinstance(system, (str, type(None))):
        raise DumpError(f"{path}: \"dtype\" must be one of {', '.join(DTYPES)}, \"names\" and \"system\" strings")
    return cfg, parallel, dtype, names, system


def open_checkpoint(path, args):
    """The Checkpoint of folder `path`: its description from .metadata (trusted) or from dcp-metadata.json."""
    if args.metadata_json:
        return dcp.Checkpoint(path, dcp.read_description(os.path.join(path, DCP_JSON)), DCP_JSON)
    dcp.check_folder(path)
    if not args.trust_pickled_metadata:
        raise DumpError(f"{os.path.join(path, dcp.METADATA)} {dcp.TRUST} (or read its JSON copy with "
                        "--metadata-json); nothing was read")
    description = dcp.read_metadata(path)
    if args.save_metadata_json:
        import json
        from .write import write_text
        write_text(os.path.join(path, DCP_JSON), json.dumps(description) + "\n")
    return dcp.Checkpoint(path, description)


def world(parallel):
    """The run's ranks by hsgd.json's parallel sizes, dp x tp x pp x cp (ep and micro_batches are no further ranks),
    or None when it gives none of them."""
    sizes = [parallel[k] for k in ("dp", "tp", "pp", "cp") if k in parallel]
    return math.prod(sizes) if sizes else None


def convert(args):
    ckpt = open_checkpoint(args.dir, args)
    model = args.model or os.path.join(args.dir, "hsgd.json")
    cfg, parallel, dtype, names, system = model_file(model)
    ranks = ckpt.world(world(parallel))             # before anything is written: a file per rank
    table, what = names_table(args.names or names, cfg, None if args.names else os.path.dirname(model))
    pre, gre = args.params_prefix, args.grads_prefix
    if pre == gre and not args.params:
        raise DumpError(f"--params-prefix and --grads-prefix are both {pre!r}; they tell parameters from gradients")
    other = open_checkpoint(args.params, args) if args.params else ckpt
    taken = {"batch.idx", "batch.targets", "loss"}
    grads = {f[len(gre):]: f for f in ckpt.tensors if f.startswith(gre) and f not in taken}
    params = {f[len(pre):]: f for f in other.tensors if f.startswith(pre) and (args.params or f not in taken)}
    tensors = {}
    for name in sorted(set(grads) | set(params)):
        t = tensor_of(name, table, cfg, what, grads.get(name) or params.get(name))
        if t is None:
            continue                                                 # a buffer: no gradient
        if name not in grads or name not in params:
            have, lack = ("parameter", gre + name) if name in params else ("gradient", pre + name)
            raise DumpError(f"the checkpoint has the {have} of {printable(name, 80)} but no {printable(lack, 80)}; "
                            f"it must hold both (or pass --params-prefix / --grads-prefix)")
        tensors[name] = t
    held = {p: n for n, t in tensors.items() for p in t.parts}
    missing = [p for p in reference_shapes(cfg) if p not in held]
    if missing:
        raise DumpError(f"no tensor of the checkpoint holds the parameter {missing[0]} (prefix {gre!r}, {what})"
                        + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    for name, t in tensors.items():
        for c, fqn in ((ckpt, grads[name]), (other, params[name])):
            c.check(fqn)                                             # the bytes, before anything is allocated
            if c.tensors[fqn][1] != t.shape:
                raise DumpError(f"{printable(fqn, 80)} has size {list(c.tensors[fqn][1])}; {what} make it "
                                f"{t.parts} of shape {list(t.shape)} in this model")
    check_reference_fits(cfg)
    for name in tensors:
        ckpt.disjoint(grads[name])
    idx, targets = batch(args, ckpt, cfg)
    loss = args.loss if args.loss is not None else the_loss(ckpt)
    return write(args.out, ckpt, other, cfg, tensors, grads, params, idx, targets, loss, dtype, parallel,
                 system or f"PyTorch Distributed Checkpoint {os.path.basename(os.path.abspath(args.dir))}", ranks)


def batch(args, ckpt, cfg):
    """(idx, targets) of --batch or of the checkpoint's batch.idx, batch.targets, checked before they are read."""
    if args.batch:
        if args.batch.endswith(".safetensors"):
            b = read_safetensors(args.batch, "--batch", DumpError, max_bytes=machine_memory() // 4)
        else:
            with Npz(args.batch, "--batch", DumpError, max_bytes=machine_memory() // 4) as z:
                b = {k: z[k] for k in z.files}
        if "idx" not in b or "targets" not in b:
            raise DumpError(f"--batch {args.batch!r}: must hold idx and targets (B, T)")
        idx, targets = b["idx"], b["targets"]
    else:
        for fqn in ("batch.idx", "batch.targets"):
            ckpt.check(fqn, "int")
            size = ckpt.tensors[fqn][1]
            if len(size) != 2:
                raise DumpError(f"{fqn} has size {list(size)}; the batch is (B, T)")
            check_reference_fits(cfg, size)
        idx, targets = ckpt.whole("batch.idx"), ckpt.whole("batch.targets")
    if idx.ndim != 2 or idx.shape != targets.shape or not np.issubdtype(idx.dtype, np.integer) or \
            not np.issubdtype(targets.dtype, np.integer):
        raise DumpError(f"the batch: idx and targets must be integers of one shape (B, T), not {idx.shape} and "
                        f"{targets.shape}")
    return idx, targets


def the_loss(ckpt):
    ckpt.check("loss")
    if ckpt.tensors["loss"][1] not in ((), (1,)):
        raise DumpError(f"loss has size {list(ckpt.tensors['loss'][1])}; the step's mean loss is one number")
    return float(ckpt.whole("loss").reshape(()))


def shards_of(name, chunks, size):
    """[(rank, layout.json shard entry, chunk)] of a gradient's chunks: sliced along the dimensions where any chunk
    is smaller than the tensor (one: the one-axis form; several: "slices"; none: a whole shard); empty chunks hold
    nothing and are left out; a rank holding several chunks names each by a key of its own."""
    chunks = [c for c in chunks if all(c.sizes)]
    axes = [d for d in range(len(size)) if any(c.sizes[d] < size[d] for c in chunks)]
    per_rank = {}
    for c in chunks:
        per_rank[c.rank] = per_rank.get(c.rank, 0) + 1
    out, seen = [], {}
    for c in chunks:
        k = seen[c.rank] = seen.get(c.rank, -1) + 1
        key = f"{name}#{k}" if per_rank[c.rank] > 1 else None
        if len(axes) == 1:
            a = axes[0]
            e = shard_entry(c.rank, a, c.offsets[a], c.sizes[a], 0, key)
        elif axes:
            e = {"rank": c.rank, "slices": [{"axis": a, "offset": c.offsets[a], "length": c.sizes[a], "padding": 0}
                                            for a in axes], **({"key": key} if key else {})}
        else:
            e = shard_entry(c.rank, key=key)
        out.append((c.rank, e, c))
    return out


def write(out, ckpt, other, cfg, tensors, grads, params, idx, targets, loss, dtype, parallel, system, ranks):
    """The dump of `ranks` ranks (cleaned, every rank's file, rank 0's, dump.json last). Returns 0."""
    entries, arrays = {}, [{} for _ in range(ranks)]
    for name, t in tensors.items():
        kind, size, chunks = ckpt.tensors[grads[name]]
        shards = []
        for rank, e, c in shards_of(name, chunks, size):
            arrays[rank][e.get("key", name)] = ckpt.read(c)
            shards.append(e)
        entries[name] = tensor_entry(t, shards, kind)
    stored = {name: other.whole(params[name]) for name in tensors}
    run = new_run()
    clean(out)
    files = {}
    for r in range(ranks):
        files.update(write_rank(out, r, arrays[r], run))
    files.update(write_layout(out, system=system, cfg=cfg, dtype=dtype, loss=loss, ranks=ranks, parallel=parallel,
                              tensors=entries, params=stored, idx=idx, targets=targets, run=run))
    write_manifest(out, run, ranks, files)
    print(f"wrote {out}: {len(tensors)} tensors, {sum(len(e['shards']) for e in entries.values())} shards on "
          f"{ranks} ranks (replicated chunks saved once by DCP: their replicas are not checked)")
    return 0


def main(argv=None):
    """The exit code of python -m hsgd.crosscheck.from_dcp argv: 0 with the dump written, 2 with one line."""
    return cli.run(lambda: command(build_parser().parse_args(argv)))


def command(args):
    if args.metadata_json and (args.trust_pickled_metadata or args.save_metadata_json):
        raise UsageError("--metadata-json reads the JSON copy instead of .metadata; --trust-pickled-metadata and "
                         "--save-metadata-json are for reading .metadata itself")
    return convert(args)


if __name__ == "__main__":
    sys.exit(main())
