"""A real external system for the crosscheck: one training step of hsgd's GPT in PyTorch, tensor-parallel with
PyTorch's own DTensor API and data-parallel over a second mesh dimension, written as the dump directory of
hsgd/crosscheck/FORMAT.md, so that `python -m hsgd.crosscheck DIR` checks its gradients against hsgd's serial
float64 reference.

    python benchmarks/crosscheck_torch.py --tp 2 --dp 2 --out dump [--micro-batches 2] [--bug NAME]
    python -m hsgd.crosscheck dump

The program is written the way a PyTorch user writes it, not the way hsgd does:
  * the model is an nn.Module (nn.Embedding, nn.LayerNorm, nn.Linear with its (out, in) weights) whose attention
    has one FUSED qkv Linear(C, 3C); its output rows are laid out per head, [q_0 k_0 v_0 q_1 k_1 v_1 ...] (each
    piece hs = C / NH rows, Megatron-LM's layout), so that a column split gives every tp rank whole heads;
  * tp*dp processes (torch.multiprocessing, gloo on the CPU, rendezvous through a file: no network port) form the
    2-D mesh init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")): global rank = dp_rank * tp + tp_rank;
  * tensor parallelism over "tp" with torch.distributed.tensor.parallel.parallelize_module:
        qkv, fc           ColwiseParallel   W split by output rows: y_r = x W_r^T + b_r, no communication;
        proj, mlp_proj    RowwiseParallel   W split by input columns: y = sum_r y_r W_r^T (All-Reduce over tp) + b;
        wte               RowwiseParallel(input_layouts=Replicate()): the vocabulary-parallel lookup, each rank
                          looks up the ids of its rows (zeros for the others), All-Reduce over tp;
        lm_head           ColwiseParallel(output_layouts=Shard(-1), use_local_output=False): the logits stay split
                          over the vocabulary, and loss_parallel() computes the cross-entropy on them (All-Reduces
                          of the row maxima and the sums of exponentials over tp), never gathering them;
    the LayerNorms, wpe and the row-parallel biases are replicated (every tp rank holds all of them);
  * data parallelism over "dp", by hand: dp rank d takes rows [d B/dp, (d+1) B/dp) of the global batch, and after
    the backward every gradient (the local shard of a DTensor) is summed over the dp group with dist.all_reduce
    and divided by dp: the gradient of the global mean loss (the mini-batch identity);
  * with --micro-batches M each dp rank runs its rows as M micro-batches, each loss divided by M, the gradients
    accumulating in .grad (gradient accumulation), before the one dp All-Reduce.

When tp does not divide the vocabulary V, wte and lm_head are padded with zero rows to Vp * tp (Vp = ceil(V / tp),
so that DTensor's Shard(0) splits them evenly) and the padded logits are set to -inf before the cross-entropy, so
that they take no part in the softmax: their gradient is zero. The dump's tensors are unpadded; the last rank(s)'
shards say how many padding rows their arrays carry (a rank whose rows are all padding holds no shard of them).

Two things PyTorch 2.13's DTensor does that a reader might not expect: the vocabulary-parallel embedding's weight
is Shard(0), but the gradient its backward leaves in wte.weight.grad is a Replicate DTensor holding all the rows
on every tp rank (correct values); the program keeps its own rows (redistribute to Shard(0): a local slice, no
communication) before the dp All-Reduce. And the padded logits are masked on the local shard (to_local, then
DTensor.from_local with the same Shard(-1) placement), which autograd follows through both conversions.

The dump (gradients after the step's reductions, before any optimizer), one set of files of one run
(hsgd.crosscheck.manifest): the parent removes what an earlier dump left in the folder; every rank writes
grads-rank{r}.npz, rank 0 layout.json, params.npz and batch.npz, each whole or absent (hsgd.crosscheck.write) and
stamped with the run's id; after a barrier rank 0 writes dump.json, last, with every file's size and sha256. A
tensor that is one reference parameter is written under the reference's name ("wte", "h.0.attn.proj.weight", ...;
module name h.0.proj.weight); the fused qkv weight and bias are "h.{i}.attn.qkv.weight" / ".bias", with a "fused"
entry (interleave "head"). nn.Linear weights are "transposed" (stored (out, in)).

--bug switches on one real mistake, for the checker to find (see --help).
"""
import argparse
import datetime
import math
import os
import sys
import tempfile
import textwrap

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository: hsgd

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module)

from hsgd.model import serial  # noqa: E402
from hsgd.model.config import ModelConfig  # noqa: E402
from hsgd.crosscheck.dump import DumpError  # noqa: E402
from hsgd.crosscheck.manifest import clean, new_run, seal  # noqa: E402
from hsgd.crosscheck.write import layout_text, write_npz, write_rank, write_text  # noqa: E402
from hsgd.errors import ConfigError  # noqa: E402

BUGS = {
    "none": "the correct program",
    "no-microbatch-scale": "the micro-batch losses are not divided by M before their backward: every gradient is "
                           "M times too large (needs --micro-batches M > 1 to show)",
    "ln-not-reduced": "the LayerNorm weights' and biases' gradients are left out of the dp All-Reduce: each dp rank "
                      "keeps the gradient of its own rows' mean loss (needs --dp > 1 to show)",
    "vocab-padding": "the padded vocabulary's logits are not masked: they enter the softmax (the loss and every "
                     "gradient change) and the padded rows of lm_head get gradient (needs tp not dividing --vocab)",
}
DTYPES = {"float64": torch.float64, "float32": torch.float32}
PADDED = ("wte.weight", "lm_head.weight")                       # their rows: the vocabulary, padded to tp's multiple


class UsageError(Exception):
    """A bad combination of flags: one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):                                  # one line (argparse's usage line left out)
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None):
    p = Parser(prog="crosscheck_torch.py", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog="bugs (--bug):\n" + "\n".join(textwrap.fill(text, 100, initial_indent=f"  {name:21s}",
                                                                   subsequent_indent=" " * 23)
                                                     for name, text in BUGS.items())
               + "\n\nthen: python -m hsgd.crosscheck DIR (a per-parameter table; exit 0: all gradients right)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks, a divisor of n_heads and d_ff "
                   "(default 2)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks, a divisor of batch / micro-batches "
                   "(default 2)")
    p.add_argument("--out", required=True, metavar="DIR", help="the dump directory (created; the files an earlier "
                   "dump left there are removed first)")
    p.add_argument("--micro-batches", type=int, default=1, metavar="M", help="micro-batches per dp rank, "
                   "gradient accumulation (default 1)")
    p.add_argument("--bug", default="none", choices=list(BUGS), help="one real mistake to make (default none; "
                   "listed below)")
    p.add_argument("--vocab", type=int, default=256, metavar="V", help="vocabulary size V; if tp does not divide "
                   "it, wte and lm_head are padded to ceil(V/tp)*tp rows (default 256)")
    p.add_argument("--dtype", default="float64", choices=list(DTYPES), help="the step's precision (default float64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights "
                   "(hsgd.model.serial.init_params) and of the batch (default 0)")
    p.add_argument("--batch", type=int, default=8, metavar="B", help="global batch, sequences (default 8)")
    p.add_argument("--seq-len", type=int, default=16, metavar="T", help="sequence length (default 16)")
    p.add_argument("--d-model", type=int, default=32, metavar="C", help="model width (default 32)")
    p.add_argument("--n-heads", type=int, default=4, metavar="NH", help="attention heads (default 4)")
    p.add_argument("--n-layers", type=int, default=2, metavar="L", help="Transformer blocks (default 2)")
    p.add_argument("--d-ff", type=int, default=64, metavar="F", help="MLP hidden width (default 64)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds a collective may wait "
                   "before the process group gives up (a failed rank must not hang the others; default 60)")
    return p.parse_args(argv)


def check_args(args):
    """The ModelConfig for the flags, or UsageError saying what is wrong."""
    for name in ("tp", "dp", "micro_batches", "batch", "timeout"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    try:
        cfg = ModelConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_heads=args.n_heads,
                          n_layers=args.n_layers, d_ff=args.d_ff)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if cfg.n_heads % args.tp:
        raise UsageError(f"--tp {args.tp} does not divide n_heads {cfg.n_heads}: each tp rank needs whole heads")
    if cfg.d_ff % args.tp:
        raise UsageError(f"--tp {args.tp} does not divide d_ff {cfg.d_ff}")
    if args.batch % (args.dp * args.micro_batches):
        raise UsageError(f"--batch {args.batch} is not divisible by dp * micro-batches = "
                         f"{args.dp * args.micro_batches}")
    if args.bug == "vocab-padding" and cfg.vocab_size % args.tp == 0:
        raise UsageError(f"--bug vocab-padding needs a vocabulary that tp does not divide (--vocab {cfg.vocab_size}, "
                         f"--tp {args.tp}: no padding); e.g. --vocab {cfg.vocab_size - 1}")
    return cfg


# --------------------------------------------------------------------------------------------------------------
# The model, as a PyTorch user writes it

class Block(nn.Module):
    """x + Attn(LN1(x)), then x + MLP(LN2(x)). Under tp, qkv and fc hold this rank's output rows (its NH/tp whole
    heads, its F/tp hidden units) and proj, mlp_proj the matching input columns: the block's only communication
    is the All-Reduce over tp at the end of each RowwiseParallel layer (and its mirror in the backward)."""

    def __init__(self, C, NH, d_ff):
        super().__init__()
        self.hs = C // NH
        self.ln1 = nn.LayerNorm(C, eps=1e-5)
        self.qkv = nn.Linear(C, 3 * C)              # output rows [q_0 k_0 v_0 q_1 k_1 v_1 ...], hs rows each
        self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C, eps=1e-5)
        self.fc = nn.Linear(C, d_ff)
        self.mlp_proj = nn.Linear(d_ff, C)

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.qkv(self.ln1(x))                 # (B, T, 3C/tp): the local heads, no communication
        nh = qkv.shape[-1] // (3 * self.hs)         # heads on this rank, NH / tp
        q, k, v = qkv.view(B, T, nh, 3, self.hs).permute(3, 0, 2, 1, 4)       # 3 x (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)           # softmax(q k^T / sqrt(hs) + mask) v
        y = y.transpose(1, 2).reshape(B, T, nh * self.hs)                     # (B, T, C/tp): columns of the heads
        x = x + self.proj(y)                        # RowwiseParallel: partial products, All-Reduce over tp
        g = F.gelu(self.fc(self.ln2(x)), approximate="tanh")                   # (B, T, F/tp)
        return x + self.mlp_proj(g)                 # RowwiseParallel: All-Reduce over tp


class GPT(nn.Module):
    """logits = LN_f(x) lm_head^T with x = wte[idx] + wpe[:T] through the blocks. vocab_rows >= V: the rows of wte
    and lm_head, padded so that tp divides them."""

    def __init__(self, cfg, vocab_rows):
        super().__init__()
        self.wte = nn.Embedding(vocab_rows, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.h = nn.ModuleList(Block(cfg.d_model, cfg.n_heads, cfg.d_ff) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=1e-5)
        self.lm_head = nn.Linear(cfg.d_model, vocab_rows, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))    # wte: vocabulary-parallel, All-Reduce over tp
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))           # (B, T, V_rows) as a DTensor split over the vocabulary


def head_interleave(parts, NH):
    """[q | k | v] (each (C, ...) along axis 0) -> [q_0 k_0 v_0 q_1 k_1 v_1 ...], pieces of hs = C / NH rows."""
    stacked = np.stack([p.reshape(NH, -1, *p.shape[1:]) for p in parts], axis=1)   # (NH, 3, hs, ...)
    return stacked.reshape(-1, *parts[0].shape[1:])


def module_weights(params, cfg, vocab_rows):
    """hsgd's parameters (reference names, (in, out) weights) -> the module's state dict (NumPy float64): Linear
    weights transposed to (out, in), q, k, v fused per head, wte and lm_head padded with zero rows."""
    pad = ((0, vocab_rows - cfg.vocab_size), (0, 0))
    sd = {"wte.weight": np.pad(params["wte"], pad), "wpe.weight": params["wpe"],
          "ln_f.weight": params["ln_f.weight"], "ln_f.bias": params["ln_f.bias"],
          "lm_head.weight": np.pad(params["lm_head.weight"].T, pad)}
    for i in range(cfg.n_layers):
        h = f"h.{i}."
        for ln in ("ln1", "ln2"):
            sd[h + ln + ".weight"], sd[h + ln + ".bias"] = params[h + ln + ".weight"], params[h + ln + ".bias"]
        sd[h + "qkv.weight"] = head_interleave([params[h + f"attn.{m}.weight"].T for m in "qkv"], cfg.n_heads)
        sd[h + "qkv.bias"] = head_interleave([params[h + f"attn.{m}.bias"] for m in "qkv"], cfg.n_heads)
        for mine, ref in (("proj", "attn.proj"), ("fc", "mlp.fc"), ("mlp_proj", "mlp.proj")):
            sd[h + mine + ".weight"] = params[h + ref + ".weight"].T
            sd[h + mine + ".bias"] = params[h + ref + ".bias"]
    return sd


def tp_plan(cfg):
    """parallelize_module's plan: which nn.Module is split how over the "tp" mesh dimension."""
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),                 # vocabulary-parallel embedding
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}   # for loss_parallel
    for i in range(cfg.n_layers):
        plan.update({f"h.{i}.qkv": ColwiseParallel(), f"h.{i}.proj": RowwiseParallel(),
                     f"h.{i}.fc": ColwiseParallel(), f"h.{i}.mlp_proj": RowwiseParallel()})
    return plan


def vocab_parallel_loss(logits, targets, vocab_size, mask_padding):
    """Mean cross-entropy of logits (a DTensor (b, T, V_rows) split over the vocabulary on the tp ranks) under
    loss_parallel(): log softmax with the row max and the sum of exponentials All-Reduced over tp, the target's
    logit taken on the rank that holds it. Padded vocabulary columns (>= vocab_size) are set to -inf first:
    exp(-inf) = 0, they take no part in the softmax and get no gradient (mask_padding=False: the vocab-padding bug).
    Call (and backward) inside `with loss_parallel():`."""
    if mask_padding:
        local = logits.to_local()                                    # (b, T, V_rows / tp): this rank's columns
        first = logits.device_mesh.get_local_rank() * local.shape[-1]
        padded = torch.arange(first, first + local.shape[-1]) >= vocab_size
        if padded.any():
            local = local.masked_fill(padded, float("-inf"))
        logits = DTensor.from_local(local, logits.device_mesh, logits.placements)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --------------------------------------------------------------------------------------------------------------
# The dump: names, layout

REF_NAMES = {"ln1": "ln1", "ln2": "ln2", "proj": "attn.proj", "fc": "mlp.fc", "mlp_proj": "mlp.proj"}


def dump_name(name, hs):
    """A module parameter's name in the dump and its layout entry's extra fields: the reference's name where the
    tensor is one reference parameter ("transposed" for an nn.Linear weight, stored (out, in)); for the fused qkv
    "h.{i}.attn.qkv.weight" / ".bias" with "fused": q, k, v interleaved per head, pieces of hs rows."""
    if name in ("wte.weight", "wpe.weight"):
        return name[:3], {}                                     # nn.Embedding: (rows, C), as the reference
    if not name.startswith("h."):                               # ln_f.weight, ln_f.bias, lm_head.weight
        return name, {"transposed": True} if name == "lm_head.weight" else {}
    _, i, mod, kind = name.split(".")
    linear = {"transposed": True} if kind == "weight" and mod not in ("ln1", "ln2") else {}
    if mod == "qkv":
        parts = [f"h.{i}.attn.{m}.{kind}" for m in "qkv"]
        return f"h.{i}.attn.qkv.{kind}", {**linear, "fused": {"axis": 0, "parts": parts, "interleave": "head",
                                                               "group": hs}}
    return f"h.{i}.{REF_NAMES[mod]}.{kind}", linear


def tp_piece(rows, real_rows, tp, t):
    """The rows that Shard(d) puts on tp rank t: (offset, length, padding) along d, its real rows first. rows: the
    stored size along d, padding included; real_rows: without (they differ for wte and lm_head only)."""
    chunk = math.ceil(rows / tp)                                # torch.chunk's pieces, as Shard(d) cuts
    first = min(t * chunk, rows)
    length = min(chunk, rows - first)
    real = max(0, min(length, real_rows - first))               # rows < real_rows are real, the others padding
    return min(first, real_rows), real, length - real


def shard_entries(p, shape, mesh):
    """The shards of parameter p (its full shape `shape`, without padding): one per global rank, dp replicas
    and the tp replicas of a replicated parameter included. A rank whose rows are all padding (a vocabulary
    smaller than (tp - 1) ceil(V / tp)) holds none of it."""
    placement = p.placements[0] if isinstance(p, DTensor) else Replicate()       # on the "tp" mesh dimension
    dp, tp = mesh.shape
    out = []
    for d in range(dp):
        for t in range(tp):
            rank = int(mesh.mesh[d, t])                               # init_device_mesh: dp_rank * tp + tp_rank
            if not isinstance(placement, Shard):
                out.append({"rank": rank, "axis": None, "offset": 0, "length": shape[0], "padding": 0})
                continue
            axis = placement.dim % p.ndim
            offset, length, padding = tp_piece(p.shape[axis], shape[axis], tp, t)
            if length:
                out.append({"rank": rank, "axis": axis, "offset": offset, "length": length, "padding": padding})
    return out


def layout(args, cfg, model, mesh, loss, run):
    """layout.json's dict (rank 0 writes it), stamped with the run's id."""
    tensors = {}
    for name, p in model.named_parameters():
        key, extra = dump_name(name, cfg.d_model // cfg.n_heads)
        shape = [cfg.vocab_size, *p.shape[1:]] if name in PADDED else list(p.shape)   # the full shape, unpadded
        tensors[key] = {"shape": shape, "dtype": args.dtype, **extra, "shards": shard_entries(p, shape, mesh)}
    return {"format": "hsgd-crosscheck", "version": 1, "run": run,
            "system": f"PyTorch {torch.__version__} DTensor tp {args.tp} x dp {args.dp} (gloo), micro-batches "
                      f"{args.micro_batches}, bug: {args.bug}",
            "model": {"vocab_size": cfg.vocab_size, "seq_len": cfg.seq_len, "d_model": cfg.d_model,
                      "n_heads": cfg.n_heads, "n_layers": cfg.n_layers, "d_ff": cfg.d_ff},
            "dtype": args.dtype, "loss": loss, "ranks": args.tp * args.dp,
            "parallel": {"dp": args.dp, "tp": args.tp, "pp": 1, "cp": 1, "micro_batches": args.micro_batches},
            "tensors": tensors}


# --------------------------------------------------------------------------------------------------------------
# One rank

def worker(rank, args, cfg, params, idx, targets, run, init_file):
    """Global rank `rank` of tp * dp: build, split, run one step, dump."""
    torch.set_num_threads(1)
    world = args.tp * args.dp
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        step(rank, args, cfg, params, idx, targets, run)
    finally:
        dist.destroy_process_group()


def step(rank, args, cfg, params, idx, targets, run):
    """One step of the model on this rank: forward and backward per micro-batch, the dp All-Reduce, the dump (its
    files stamped with `run`)."""
    dtype, M, V, hs = DTYPES[args.dtype], args.micro_batches, cfg.vocab_size, cfg.d_model // cfg.n_heads
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    dp_group = mesh["dp"].get_group()

    # the model: hsgd's initial weights, padded so that tp divides the vocabulary, then split over tp
    vocab_rows = math.ceil(V / args.tp) * args.tp
    model = GPT(cfg, vocab_rows).to(dtype)
    state = module_weights(params, cfg, vocab_rows)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(state[name]))          # (float32: rounded from the float64 weights)
    if rank == 0:
        before = {name: p.detach().clone() for name, p in model.named_parameters()}   # params.npz, whole
    parallelize_module(model, mesh["tp"], tp_plan(cfg))

    # this dp rank's rows of the global batch, as M micro-batches; every tp rank of it sees the same rows
    rows = args.batch // args.dp
    my_idx = torch.from_numpy(idx[dp_rank * rows:(dp_rank + 1) * rows])
    my_targets = torch.from_numpy(targets[dp_rank * rows:(dp_rank + 1) * rows])
    scale = 1.0 if args.bug == "no-microbatch-scale" else 1.0 / M
    losses = []
    for mb_idx, mb_targets in zip(my_idx.chunk(M), my_targets.chunk(M)):
        with loss_parallel():                                   # the vocab-parallel cross-entropy and its backward
            loss = vocab_parallel_loss(model(mb_idx), mb_targets, V, mask_padding=args.bug != "vocab-padding")
            (loss * scale).backward()                           # gradients accumulate in .grad over micro-batches
        losses.append(loss.full_tensor().item())

    # data parallelism: every gradient summed over the dp group (All-Reduce), divided by dp
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if name in PADDED and tp_piece(p.shape[0], V, args.tp, tp_rank)[1] == 0:
            continue                                            # only padding rows on this rank: no shard of it
        if isinstance(g, DTensor):
            if g.placements != p.placements:                   # wte: the lookup's backward gives a Replicate
                g = g.redistribute(p.device_mesh, p.placements)  # gradient; keep this rank's rows (no comm.)
            g = g.to_local()                                    # this tp rank's shard
        if not (args.bug == "ln-not-reduced" and (".ln" in name or name.startswith("ln_f"))):
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=dp_group)          # over dp: sum of the dp ranks' grads
            g = g / args.dp
        grads[dump_name(name, hs)[0]] = g.detach().cpu().numpy()

    # the global batch's mean loss: the mean of the dp ranks' means (equal rows on each)
    total = torch.tensor(sum(losses) / M, dtype=torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dp_group)
    loss_value = total.item() / args.dp

    write_rank(args.out, rank, grads, run)                      # each file whole or absent, stamped with run
    if rank == 0:
        write_text(os.path.join(args.out, "layout.json"),
                   layout_text(layout(args, cfg, model, mesh, loss_value, run)))    # one line per tensor
        whole = {}
        for name, p in before.items():
            whole[dump_name(name, hs)[0]] = p.numpy()[:V] if name in PADDED else p.numpy()
        write_npz(os.path.join(args.out, "params.npz"), whole, run)
        write_npz(os.path.join(args.out, "batch.npz"), {"idx": idx, "targets": targets}, run)
    dist.barrier()                                              # every rank's file whole before dump.json
    if rank == 0:
        seal(args.out, run, args.tp * args.dp)                  # dump.json, last: every file's size and sha256
        print(f"crosscheck_torch: wrote {args.out} ({args.tp * args.dp} ranks, tp {args.tp} x dp {args.dp}, "
              f"micro-batches {M}, bug {args.bug}): loss {loss_value:.6f}", flush=True)


def main(argv=None):
    """Check the flags, draw the weights and the batch, run the tp * dp ranks; exit status 0, 1 (a rank failed)
    or 2 (bad flags)."""
    args = parse_args(argv)
    try:
        cfg = check_args(args)
    except UsageError as e:
        print(f"crosscheck_torch.py: error: {e}", file=sys.stderr)
        return 2
    params = serial.init_params(cfg, seed=args.seed, dtype="float64")
    rng = np.random.default_rng(args.seed)
    idx = rng.integers(0, cfg.vocab_size, size=(args.batch, cfg.seq_len), dtype=np.int64)
    targets = rng.integers(0, cfg.vocab_size, size=(args.batch, cfg.seq_len), dtype=np.int64)

    try:
        clean(args.out)                                         # an earlier dump's files: none may be left over
    except (DumpError, OSError) as e:
        print(f"crosscheck_torch.py: error: --out {args.out}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    run = new_run()                                             # the id every file of this dump is stamped with
    with tempfile.TemporaryDirectory(prefix="crosscheck_torch-") as tmp:
        try:
            # fork: the children share the parent's imports (torch takes ~2 s to import, on each rank with spawn);
            # if a rank fails, join() ends the others and raises here
            mp.start_processes(worker, args=(args, cfg, params, idx, targets, run, os.path.join(tmp, "rendezvous")),
                               nprocs=args.tp * args.dp, join=True, start_method="fork")
        except Exception as e:                                  # ProcessRaisedException, ProcessExitedException
            lines = [x for x in str(e).strip().splitlines() if x.strip()]
            print(f"crosscheck_torch.py: a rank failed: {lines[-1] if lines else type(e).__name__}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
