"""A second real external system for the crosscheck: one training step of the Llama block (or GPT-2's) in PyTorch
with FSDP2 (`fully_shard`) over "dp" and tensor parallelism over "tp" of one 2-D DeviceMesh, the layout torchtitan
trains with, its state saved through torch.distributed.checkpoint (DCP) the way a PyTorch user saves a checkpoint.

    python benchmarks/crosscheck_fsdp2.py --dp 3 --tp 2 --out DIR [--arch gpt2] [--bug NAME]
    python -m hsgd.crosscheck.from_dcp DIR --out DUMP --trust-pickled-metadata && python -m hsgd.crosscheck DUMP
    python benchmarks/crosscheck_fsdp2.py --dp 3 --tp 2 --out DIR --crosscheck     (the two steps above, after it)

The program is written the way a PyTorch user writes it:
  * an nn.Module in torchtitan's llama3 names: tok_embeddings, layers.{i}.attention_norm, attention.wq/wk/wv/wo,
    ffn_norm, feed_forward.w1 (gate), w3 (up), w2 (down), norm, output; nn.Linear weights (out, in), no biases,
    untied; rotary positions on the adjacent pairs (2i, 2i+1) of a head as torchtitan turns them (angle t
    theta^(-2i/hs), theta 10000), so that wq's and wk's rows are in rotary-pair order (to_pairs: hsgd's reference
    turns the pairs (i, i + hs/2), and its checkpoint's "torchtitan" names table says "rotary": "interleaved"),
    grouped-query attention with NKV = NH/2: hsgd.model.serial's llama model exactly. --arch gpt2: GPT-2's block
    under the same names (LayerNorm eps 1e-5 with biases, learned positions pos_embeddings, GELU tanh, w1 = fc,
    w2 = proj, biases on the linears, no w3);
  * dp * tp processes (torch.multiprocessing, gloo on the CPU, rendezvous through a file: no network port) form
    init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")): global rank = dp_rank * tp + tp_rank;
  * tensor parallelism over "tp" (parallelize_module), heads split over tp (tp divides NKV):
        wq, wk, wv, w1, w3   ColwiseParallel   W split by output rows: each rank its NH/tp q heads, NKV/tp kv heads,
                                               F/tp hidden units; no communication
        wo, w2               RowwiseParallel   W split by input columns: partial products, All-Reduce over tp
        tok_embeddings       RowwiseParallel(input_layouts=Replicate()): the vocabulary-parallel lookup
        output               ColwiseParallel(output_layouts=Shard(-1), use_local_output=False): the logits stay
                             split over the vocabulary and loss_parallel() takes the cross-entropy on them
  * FSDP2 over "dp" as torchtitan lays it out: fully_shard(block, mesh=mesh["dp"]) per block, then the root; a
    tensor-parallel parameter becomes a 2-D DTensor, its tp piece cut again along dim 0 over dp (wq:
    (_StridedShard(0), Shard(0)), rank (d, t) the d-th part of tp piece t's rows; wo: (Shard(0), Shard(1)); a
    row-parallel bias: (Shard(0), Replicate())),
    pos_embeddings (no DTensor before) a 1-D one over dp; uneven cuts are fine (32 rows over dp 3: 11, 11, 10).
    FSDP2 all-gathers a block's weights before its forward and backward, and reduce-scatters its gradients over dp,
    divided by dp: the mean over the dp ranks;
  * the norms' weights (and biases) stay out of fully_shard (ignored_params): small, replicated on every rank, and
    averaged over dp by hand as DDP does it (ReplicatedGrads): one flat bucket, each parameter's slot filled by a
    post-accumulate-grad hook, one All-Reduce of the bucket over the "dp" group after the backward, copied back;
  * dp rank d takes rows [d B/dp, (d+1) B/dp) of the global batch of B sequences; each rank's loss is the mean over
    its B/dp * T tokens, so FSDP2's mean over dp makes the gradient of the global mean over B * T tokens.

FSDP2 on the CPU with gloo, PyTorch 2.13: it runs as it is. gloo has reduce_scatter (FSDP2 calls
reduce_scatter_single), and which reduction FSDP2 asks for depends on the dtype. In float64 it always reduces with
SUM and divides separately (by dp, as a pre- and a post-factor: 2 and 1.5 for dp 3), which gloo has. In float32 or
bfloat16 it asks for AVG by default (gloo has it too), but for PREMUL_SUM once a divide factor other than the group
size is set (torchtitan sets 1.0, its loss being divided by the global token count already), and gloo refuses that
("Cannot use ReduceOp.PREMUL_SUM with Gloo"): set_force_sum_reduction_for_comms(True) on every FSDP module is the
way around it (SUM, then a division). No custom reduce-scatter (set_custom_reduce_scatter) is needed.

What the program saves: ONE DCP folder DIR (dcp.save, FileSystemWriter, the default format) of
    {"params": {FQN: the parameter (the step takes no optimizer step: these are its weights)},
     "grads":  {FQN: p.grad after the backward and the reductions: DTensors with FSDP2's 2-D placements, plain
                tensors for the replicated norms},
     "batch":  {"idx": int64 (B, T), "targets": int64 (B, T)},   "loss": 0-d float64, the global mean}
and rank 0 then writes DIR/hsgd.json: {"system", "model" (the layout.json model object), "parallel": {"dp", "tp"},
"dtype": "float64", "names": "torchtitan"}. The parent removes what an earlier run left (DCP's .metadata and
__{r}_{i}.distcp files, hsgd.json; nothing else) before the ranks start, so a run cut short leaves no hsgd.json.
DCP deduplicates replicated tensors: a plain tensor that every rank holds (a norm's gradient) is saved once, from one
rank of DCP's choosing (its save planner spreads them over the ranks), so replicas that differ are invisible in DIR.
The bugs below are made so that every copy shows them, whichever is saved.

--bug switches on one real mistake; what `python -m hsgd.crosscheck` says of it:
    no-divide          FSDP2 told not to divide (set_gradient_divide_factor(1.0), as for a loss already divided by
                       the global token count, which this one is not): every FSDP2 gradient is the SUM over the dp
                       ranks of their means, "constant factor" = dp (the hand-averaged norms stay right)
    wrong-mesh-dim     the norms' bucket All-Reduced over the "tp" mesh dimension instead of "dp" (and divided by its
                       size): on dp rank d every copy is dp slice d's gradient alone, "unreduced", the detail naming
                       the dp rank whose copy DCP saved (not the same one for every norm)
    missing-norm-grad  the post-accumulate-grad hooks are registered on the blocks' norms only (where the blocks are
                       built), not on the final norm: its bucket slot stays zero and the copy-back writes zeros into
                       its gradient (weight, and bias with LayerNorm) on every rank, "missing"

--self-check loads DIR back (dcp.load, no process group) and compares every gradient with hsgd.model.serial's
float64 reference itself, without the converter. --crosscheck runs the converter and the crosscheck after the step
(--dump DUMP, default DIR-dump) and exits with the crosscheck's code; with --expect CLASS it exits 0 only when the
check fails and every parameter over tolerance is classified CLASS (for `make bench`'s bug runs).

Left out: optimizer steps, mixed precision (MixedPrecisionPolicy), sequence parallelism (torchtitan shards the
norms' activations over tp; here they are replicated), activation checkpointing, a vocabulary that tp does not
divide, and experts.
"""
import datetime
import glob
import json
import os
import sys
import tempfile
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository: hsgd

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module)

from hsgd import cli  # noqa: E402
from hsgd.crosscheck.dump import FAMILY_KEYS, MODEL_KEYS  # noqa: E402
from hsgd.crosscheck.write import write_text  # noqa: E402
from hsgd.errors import ConfigError, UsageError  # noqa: E402
from hsgd.model import serial  # noqa: E402
from hsgd.model.config import ModelConfig  # noqa: E402

PROG = "crosscheck_fsdp2.py"
BUGS = {
    "none": "the correct program",
    "no-divide": "FSDP2's gradient divide factor set to 1: the dp ranks' gradients summed, not averaged",
    "wrong-mesh-dim": "the replicated norms' gradients All-Reduced over the tp mesh dimension instead of dp",
    "missing-norm-grad": "the final norm's post-accumulate-grad hook never registered: its gradient never reaches "
                         "the bucket, which writes zeros back",
}
SAVED = (".metadata", "hsgd.json")             # with __{rank}_{i}.distcp: the files a run writes into DIR


def build_parser():
    p = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=3, help="data-parallel (FSDP2) ranks, a divisor of --batch (default 3)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks, a divisor of n_kv_heads, d_ff and the "
                   "vocabulary (default 2)")
    p.add_argument("--out", required=True, metavar="DIR", help="the DCP folder (created; what an earlier run left "
                   "there, .metadata, *.distcp and hsgd.json, is removed first)")
    p.add_argument("--arch", default="llama", choices=("llama", "gpt2"), help="the model family (default llama)")
    p.add_argument("--bug", default="none", choices=list(BUGS), help="one real mistake to make (default none): "
                   + "; ".join(f"{k}: {v}" for k, v in BUGS.items() if k != "none"))
    p.add_argument("--self-check", action="store_true", help="after the step, load DIR back and compare every "
                   "gradient with hsgd's serial reference (exit 1 if any is over 1e-10)")
    p.add_argument("--crosscheck", action="store_true", help="after the step, convert DIR "
                   "(hsgd.crosscheck.from_dcp) and run hsgd.crosscheck on the dump; exit with its code")
    p.add_argument("--dump", metavar="DUMP", help="with --crosscheck: the dump folder (default DIR-dump)")
    p.add_argument("--expect", metavar="CLASS", help="with --crosscheck: exit 0 only if the crosscheck fails and "
                   "classifies every parameter over tolerance CLASS (e.g. 'constant factor')")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights (hsgd.model.serial.init_params) and "
                   "of the batch (default 0)")
    p.add_argument("--vocab", type=int, default=256, metavar="V", help="vocabulary size (default 256)")
    p.add_argument("--batch", type=int, default=6, metavar="B", help="global batch, sequences (default 6)")
    p.add_argument("--seq-len", type=int, default=16, metavar="T", help="sequence length (default 16)")
    p.add_argument("--d-model", type=int, default=32, metavar="C", help="model width (default 32)")
    p.add_argument("--n-heads", type=int, default=4, metavar="NH", help="attention heads (default 4; llama: "
                   "NKV = NH/2)")
    p.add_argument("--n-layers", type=int, default=2, metavar="L", help="Transformer blocks (default 2)")
    p.add_argument("--d-ff", type=int, default=64, metavar="F", help="MLP hidden width (default 64)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds a collective may wait before "
                   "the process group gives up (a failed rank must not hang the others; default 60)")
    return p


def check_args(args):
    """The ModelConfig for the flags, or UsageError saying what is wrong and what would work."""
    for name in ("dp", "tp", "batch", "timeout"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name} {getattr(args, name)} must be positive")
    try:
        cfg = ModelConfig(arch=args.arch, vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
                          n_heads=args.n_heads, n_layers=args.n_layers, d_ff=args.d_ff)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    for name, n, share in (("n_kv_heads", cfg.n_kv_heads, "whole key/value heads"), ("d_ff", cfg.d_ff, "F/tp hidden "
                           "units"), ("--vocab", cfg.vocab_size, "V/tp rows of tok_embeddings and output")):
        if n % args.tp:
            raise UsageError(f"--tp {args.tp} does not divide {name} = {n}: each tp rank takes {share}; use a "
                             f"divisor of {n}")
    if args.batch % args.dp:
        raise UsageError(f"--dp {args.dp} does not divide --batch {args.batch}: each dp rank takes B/dp sequences")
    if (args.dump or args.expect) and not args.crosscheck:
        raise UsageError("--dump and --expect go with --crosscheck")
    return cfg


# --------------------------------------------------------------------------------------------------------------
# The model, as a PyTorch user writes it (torchtitan's llama3 names). Legend: B batch (here a dp rank's B/dp), T
# sequence, C d_model, NH / NKV query / key-value heads, hs = C/NH, F d_ff, V vocabulary; /tp: a tp rank's share

def rotary_tables(T, hs, theta):
    """cos, sin (T, hs/2) of the angles t theta^(-2i/hs): pair i of a head turns by angle i."""
    freqs = theta ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)          # (hs/2,)
    angles = torch.outer(torch.arange(T, dtype=torch.float64), freqs)             # (T, hs/2)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """Rotary positions on the adjacent pairs (2i, 2i+1) of a head, as torchtitan's llama3 turns them (and Meta's
    original Llama code, as complex numbers): (x_2i, x_2i+1) -> (x_2i cos - x_2i+1 sin, x_2i+1 cos + x_2i sin).
    x (B, heads, T, hs)."""
    even, odd = x[..., 0::2], x[..., 1::2]                                        # (B, heads, T, hs/2)
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def to_pairs(w, hs):
    """The rows (output features) of a q or k weight or bias in rotary-pair order: hsgd's reference turns the pairs
    (i, i + hs/2) of a head (Hugging Face's halves), this model the pairs (2i, 2i+1); the same model has the feature
    h hs + j hs/2 + i of the one at h hs + 2i + j of the other. w (heads hs, ...), halves order -> pairs order."""
    rest = w.shape[1:]
    return w.reshape((-1, 2, hs // 2) + rest).swapaxes(1, 2).reshape((-1,) + rest)


def from_pairs(w, hs):
    """to_pairs undone: pairs order -> halves order."""
    rest = w.shape[1:]
    return w.reshape((-1, hs // 2, 2) + rest).swapaxes(1, 2).reshape((-1,) + rest)


class Attention(nn.Module):
    """Causal attention with NKV key/value heads, each read by NH/NKV query heads; under tp each rank holds NH/tp
    query heads and the NKV/tp kv heads they read (ColwiseParallel wq, wk, wv; RowwiseParallel wo)."""

    def __init__(self, cfg):
        super().__init__()
        self.hs, self.n_rep, bias = cfg.head_size, cfg.n_heads // cfg.n_kv_heads, cfg.bias
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.hs, bias=bias)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.hs, bias=bias)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.hs, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * self.hs, cfg.d_model, bias=bias)

    def forward(self, x, rope):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.hs).transpose(1, 2)          # (B, NH/tp, T, hs)
        k = self.wk(x).view(B, T, -1, self.hs).transpose(1, 2)          # (B, NKV/tp, T, hs)
        v = self.wv(x).view(B, T, -1, self.hs).transpose(1, 2)
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)   # q head j: kv j//n_rep
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)     # (B, NH/tp, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))             # RowwiseParallel: All-Reduce over tp


class FeedForward(nn.Module):
    """llama: w2(silu(w1 x) * w3 x) (w1 gate, w3 up, w2 down); gpt2: w2(gelu_tanh(w1 x))."""

    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias) if cfg.mlp == "swiglu" else None

    def forward(self, x):
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x), approximate="tanh"))     # (B, T, F/tp) inside
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def make_norm(cfg):
    return nn.LayerNorm(cfg.d_model, eps=1e-5) if cfg.norm == "layernorm" else nn.RMSNorm(cfg.d_model, eps=1e-5)


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm, self.attention = make_norm(cfg), Attention(cfg)
        self.ffn_norm, self.feed_forward = make_norm(cfg), FeedForward(cfg)

    def forward(self, x, rope):
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """logits = norm(x) output^T, x = tok_embeddings[idx] (+ pos_embeddings[:T]) through the blocks."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embeddings = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.positions == "learned" else None
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok_embeddings(idx)                                    # (B, T, C), All-Reduce over tp
        rope = None
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(torch.arange(T))
        else:
            rope = rotary_tables(T, self.cfg.head_size, self.cfg.rope_theta)
        for block in self.layers:
            x = block(x, rope)
        return self.output(self.norm(x))                                # (B, T, V) a DTensor split over V


def tp_plan(cfg):
    """parallelize_module's plan over the "tp" mesh dimension."""
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}       # for loss_parallel
    for i in range(cfg.n_layers):
        for m in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1") + (
                ("feed_forward.w3",) if cfg.mlp == "swiglu" else ()):
            plan[f"layers.{i}.{m}"] = ColwiseParallel()
        plan[f"layers.{i}.attention.wo"] = RowwiseParallel()
        plan[f"layers.{i}.feed_forward.w2"] = RowwiseParallel()
    return plan


# --------------------------------------------------------------------------------------------------------------
# Names: hsgd's reference parameter <-> the module's FQN

MODULES = {"ln1": "attention_norm", "attn.q": "attention.wq", "attn.k": "attention.wk", "attn.v": "attention.wv",
           "attn.proj": "attention.wo", "ln2": "ffn_norm", "mlp.gate": "feed_forward.w1", "mlp.fc": "feed_forward.w1",
           "mlp.up": "feed_forward.w3", "mlp.proj": "feed_forward.w2"}
TOP = {"wte": "tok_embeddings.weight", "wpe": "pos_embeddings.weight", "lm_head.weight": "output.weight"}


def names(cfg):
    """[(FQN, hsgd's name, transposed)] of every parameter: transposed for an nn.Linear weight, stored (out, in)
    where hsgd stores (in, out)."""
    out = []
    for ref, shape in cfg.param_shapes().items():
        if ref.startswith("h."):
            _, i, rest = ref.split(".", 2)
            module, kind = rest.rsplit(".", 1)
            fqn = f"layers.{i}.{MODULES[module]}.{kind}"
        else:
            fqn = TOP.get(ref, ref.replace("ln_f", "norm"))
        out.append((fqn, ref, len(shape) == 2 and ref not in ("wte", "wpe")))
    return out


def paired(ref, cfg):
    """Whether hsgd's parameter ref is stored in rotary-pair order here: q's and k's weights and biases with rope."""
    return cfg.positions == "rope" and (".attn.q." in ref or ".attn.k." in ref)


def norm_params(model):
    """The parameters kept out of fully_shard: every norm's weight (and bias)."""
    return [p for name, p in model.named_parameters() if name.split(".")[-2].endswith("norm")]


# --------------------------------------------------------------------------------------------------------------
# The replicated norms' gradients, averaged over a process group as DDP does it

class ReplicatedGrads:
    """One flat bucket for the gradients of parameters every rank holds whole: watch(module) registers a
    post-accumulate-grad hook on each of the module's parameters that copies its gradient into its slot when
    autograd has finished it; sync() All-Reduces the bucket over `group` (a sum), divides by the group's size and
    copies every slot back into its parameter's .grad: each .grad is then the mean of the group's gradients."""

    def __init__(self, params, group):
        self.params, self.group = params, group
        sizes = [p.numel() for p in params]
        self.bucket = torch.zeros(sum(sizes), dtype=params[0].dtype)                     # (sum of sizes,)
        self.slots = dict(zip(map(id, params), self.bucket.split(sizes)))

    def watch(self, module):
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self.fill)

    def fill(self, p):
        self.slots[id(p)].copy_(p.grad.flatten())

    def sync(self):
        dist.all_reduce(self.bucket, op=dist.ReduceOp.SUM, group=self.group)    # the group's gradients summed
        self.bucket /= self.group.size()
        for p in self.params:
            p.grad.copy_(self.slots[id(p)].view_as(p))


# --------------------------------------------------------------------------------------------------------------
# One rank

def worker(rank, args, cfg, params, idx, targets, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.dp * args.tp,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        step(rank, args, cfg, params, idx, targets)
    finally:
        dist.destroy_process_group()


def step(rank, args, cfg, params, idx, targets):
    """Build, split over tp, shard over dp, one forward and backward of this dp rank's rows, the norms' average,
    dcp.save of the state (and rank 0's hsgd.json)."""
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    model = Transformer(cfg).to(torch.float64)
    module_params = dict(model.named_parameters())
    with torch.no_grad():                                        # hsgd's initial weights, (in, out) -> (out, in)
        for fqn, ref, transposed in names(cfg):
            w = params[ref].T if transposed else params[ref]
            if paired(ref, cfg):
                w = to_pairs(w, cfg.head_size)                     # this model turns the pairs (2i, 2i+1)
            module_params[fqn].copy_(torch.from_numpy(np.ascontiguousarray(w)))
    parallelize_module(model, mesh["tp"], tp_plan(cfg))

    norms = norm_params(model)                                   # replicated: out of fully_shard, averaged by hand
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], ignored_params=set(norms))
    fully_shard(model, mesh=mesh["dp"], ignored_params=set(norms))
    if args.bug == "no-divide":
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)                # sum over dp, no mean
    replicated = ReplicatedGrads(norms, mesh["tp" if args.bug == "wrong-mesh-dim" else "dp"].get_group())
    for block in model.layers:
        replicated.watch(block.attention_norm)
        replicated.watch(block.ffn_norm)
    if args.bug != "missing-norm-grad":
        replicated.watch(model.norm)                             # the final norm, outside the blocks

    rows = args.batch // args.dp                                 # this dp rank's sequences of the global batch
    my_idx = torch.from_numpy(idx[dp_rank * rows:(dp_rank + 1) * rows])
    my_targets = torch.from_numpy(targets[dp_rank * rows:(dp_rank + 1) * rows])
    with loss_parallel():                                        # the vocabulary-parallel cross-entropy
        loss = F.cross_entropy(model(my_idx).flatten(0, 1), my_targets.flatten())   # mean over (B/dp) T tokens
        loss.backward()                                          # FSDP2: reduce-scatter over dp, / dp
    replicated.sync()                                            # the norms: All-Reduce over dp, / dp

    total = loss.full_tensor().detach().clone()                  # the global mean: the mean of the dp ranks' means
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mesh["dp"].get_group())
    total /= args.dp
    state = {"params": {n: p for n, p in model.named_parameters()},
             "grads": {n: p.grad for n, p in model.named_parameters()},
             "batch": {"idx": torch.from_numpy(idx), "targets": torch.from_numpy(targets)},
             "loss": total}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(args.out))
    if rank == 0:
        write_text(os.path.join(args.out, "hsgd.json"), json.dumps(
            {"system": system(args), "model": {k: getattr(cfg, k) for k in MODEL_KEYS + FAMILY_KEYS},
             "parallel": {"dp": args.dp, "tp": args.tp}, "dtype": "float64", "names": "torchtitan"}, indent=1) + "\n")
        print(f"{PROG}: wrote {args.out} (DCP, {args.dp * args.tp} ranks, dp {args.dp} x tp {args.tp}, {args.arch}, "
              f"bug {args.bug}): loss {total.item():.12g}", flush=True)


def system(args):
    return (f"PyTorch {torch.__version__} FSDP2 dp {args.dp} x tp {args.tp} (gloo), torchtitan-style {args.arch}, "
            f"DCP, bug: {args.bug}")


# --------------------------------------------------------------------------------------------------------------
# After the step: the checks

def load_saved(path, cfg, batch):
    """The saved step read back with dcp.load (no process group), in hsgd's names and orientation: (params, grads,
    idx, targets, loss)."""
    shapes = {fqn: cfg.param_shapes()[ref][::-1] if t else cfg.param_shapes()[ref] for fqn, ref, t in names(cfg)}
    state = {"params": {f: torch.zeros(s, dtype=torch.float64) for f, s in shapes.items()},
             "grads": {f: torch.zeros(s, dtype=torch.float64) for f, s in shapes.items()},
             "batch": {k: torch.zeros((batch, cfg.seq_len), dtype=torch.int64) for k in ("idx", "targets")},
             "loss": torch.zeros((), dtype=torch.float64)}
    with warnings.catch_warnings():                              # "... assuming the intent is to load in a single
        warnings.simplefilter("ignore", UserWarning)             # process": it is
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    back = lambda f, r, a: from_pairs(a, cfg.head_size) if paired(r, cfg) else a
    ref = {k: {r: (back(f, r, state[k][f].numpy()).T if t else back(f, r, state[k][f].numpy())) for f, r, t in
               names(cfg)} for k in ("params", "grads")}
    return ref["params"], ref["grads"], state["batch"]["idx"].numpy(), state["batch"]["targets"].numpy(), \
        state["loss"].item()


def self_check(args, cfg):
    """Every saved gradient against hsgd.model.serial.loss_and_grads in float64: the largest error of each,
    relative to the reference's largest entry or to 1e-3 of the model's largest, whichever is larger (as the
    crosscheck measures: a key bias's gradient is zero up to rounding); True when all (and the loss) are within
    1e-10."""
    params, grads, idx, targets, loss = load_saved(args.out, cfg, args.batch)
    ref_loss, ref_grads = serial.loss_and_grads(params, idx, targets, cfg)
    floor = 1e-3 * max(float(np.abs(g).max()) for g in ref_grads.values())
    errors = {n: float(np.abs(grads[n] - g).max() / max(np.abs(g).max(), floor)) for n, g in ref_grads.items()}
    bad = sorted(n for n, e in errors.items() if not e <= 1e-10)
    worst = max(errors, key=errors.get)
    loss_error = abs(loss - ref_loss) / abs(ref_loss)
    print(f"{PROG}: self-check against hsgd.model.serial: loss rel err {loss_error:.1e}, largest gradient rel err "
          f"{errors[worst]:.1e} ({worst}), {len(bad)} of {len(errors)} over 1e-10" +
          (f": {', '.join(f'{n} {errors[n]:.2g}' for n in bad[:6])}" if bad else ""), flush=True)
    return not bad and loss_error <= 1e-10


def crosscheck(args):
    """The converter (hsgd.crosscheck.from_dcp), then the crosscheck on its dump, printed as `python -m
    hsgd.crosscheck DUMP` prints it. Returns the exit code: the crosscheck's (the converter's when it fails), or
    with --expect 0 only when the check failed and classified every parameter over tolerance as that class."""
    from hsgd.crosscheck import from_dcp
    from hsgd.crosscheck.__main__ import check, report
    from hsgd.crosscheck.manifest import check_set
    from hsgd.crosscheck.read import load
    dump = args.dump or args.out.rstrip("/") + "-dump"
    code = from_dcp.main([args.out, "--out", dump, "--trust-pickled-metadata"])     # our own .metadata: trusted
    if code:
        return code
    check_set(dump)
    loaded = load(dump)
    ok, loss_row, rows = check(loaded)
    report(loaded, ok, loss_row, rows)
    if not args.expect:
        return 0 if ok else 1
    classes = sorted({r["class"] for r in rows if not r["ok"]})
    named = not ok and classes == [args.expect]
    print(f"{PROG}: --bug {args.bug}: the crosscheck {'named' if named else 'did NOT name'} {args.expect!r} "
          f"(classes over tolerance: {', '.join(classes) or 'none'})", flush=True)
    return 0 if named else 1


def clean(path):
    """Remove what an earlier run wrote into path (its hsgd.json first, DCP's .metadata, __{r}_{i}.distcp)."""
    os.makedirs(path, exist_ok=True)
    for name in [*SAVED[::-1], *sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "__*_*.distcp")))]:
        if os.path.lexists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))


def command(args):
    cfg = check_args(args)
    params = serial.init_params(cfg, seed=args.seed, dtype="float64")
    rng = np.random.default_rng(args.seed)
    idx = rng.integers(0, cfg.vocab_size, size=(args.batch, cfg.seq_len), dtype=np.int64)
    targets = rng.integers(0, cfg.vocab_size, size=(args.batch, cfg.seq_len), dtype=np.int64)
    try:
        clean(args.out)
    except OSError as e:
        raise UsageError(f"--out {args.out!r}: {e.strerror}; give a folder this user can write") from None
    with tempfile.TemporaryDirectory(prefix="crosscheck_fsdp2-") as tmp:
        try:
            # fork: the children share the parent's imports (torch takes ~2 s to import, on each rank with spawn);
            # if a rank fails, join() ends the others and raises here
            mp.start_processes(worker, args=(args, cfg, params, idx, targets, os.path.join(tmp, "rendezvous")),
                               nprocs=args.dp * args.tp, join=True, start_method="fork")
        except Exception as e:                                  # ProcessRaisedException, ProcessExitedException
            lines = [x for x in str(e).strip().splitlines() if x.strip()]
            print(f"{PROG}: a rank failed: {lines[-1] if lines else type(e).__name__}", file=sys.stderr)
            return 1
    code = 0
    if args.self_check and not self_check(args, cfg):
        code = 1
    if args.crosscheck:
        code = crosscheck(args) or code
    return code


def main(argv=None):
    """Exit status 0, 1 (a rank failed, a check failed) or 2 (bad flags)."""
    return cli.run(lambda: command(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
