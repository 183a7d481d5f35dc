"""The GPT split over a tensor-parallel group: M = tp ranks hold one copy of the model together.

Three schemes, all exact (every gradient shard equals the matching slice of hsgd.serial's gradient):

  "megatron" (default) -- per block, q, k, v are column-parallel (rank i holds heads i*NH/tp ... (i+1)*NH/tp - 1
      whole, and computes their attention locally), the attention output projection is row-parallel; the MLP is
      column-parallel fc -> GELU -> row-parallel proj. One f (identity / Allreduce) at the entry of each branch,
      one g (Allreduce / identity) at its exit: 2 Allreduces of (B, T, C) per block forward, 2 backward.
  "gather" (the lecture) -- every linear is column-split and its output All-Gathered so that every rank holds
      the full activation; backward takes the slice of dY the rank's columns produced (the 1/tp-scaled
      Reduce-scatter, see tp_layers.allgather_backward) and All-Reduces the partial dX. q, k, v stay local (attention
      consumes exactly the local heads) and the gather happens after attention; fc's gather happens after GELU
      (an elementwise op commutes with the gather).
  "sequence" (Korthikanti et al. 2022, hsgd.tp_sequence) -- megatron's split, with LayerNorm, the residual stream
      and the embedding split along T between the ranks; an All-Gather along T enters each column-parallel region,
      a Reduce-Scatter along T leaves each row-parallel one. Every cached activation is divided by tp.

In all three: the token embedding and the LM head are vocab-parallel (rank i holds vocabulary ids [i*Vp, (i+1)*Vp),
Vp = ceil(V/tp), padded past V), the cross-entropy is computed without gathering the logits, and LayerNorm
parameters, wpe and the biases of row-parallel layers are replicated (their gradients come out identical on
every rank; "sequence" All-Reduces them, since each rank saw only its positions).

Legend: B batch, T sequence, C d_model, NH heads, F d_ff, V vocab, Vp vocab rows per rank, tp ranks.
Parameters keep their serial names; a shard's shape shows its split, e.g. h.0.attn.q.weight (C, C/tp).
"""
import math

from . import serial, tp_sequence
from .backend import array_module
from .errors import ConfigError
from .layers import (attention_backward, attention_forward, gelu_backward, gelu_forward, layernorm_backward,
                     layernorm_forward, linear_backward, linear_forward)
from .tp_layers import (allgather_backward, allgather_forward, f_backward, f_forward, gather_linear_backward,
                        gather_linear_forward, row_linear_backward, row_linear_forward, vocab_cross_entropy_backward,
                        vocab_cross_entropy_forward, vocab_embedding_backward, vocab_embedding_forward, vocab_range)

SCHEMES = ("megatron", "gather", "sequence")


def check_tp(cfg, tp, scheme="megatron"):
    """Raise ConfigError unless the model splits over tp ranks (the vocabulary may be padded; heads and d_ff not)."""
    if scheme not in SCHEMES:
        raise ConfigError(f"tp_scheme={scheme!r} is not known; use one of {', '.join(SCHEMES)}")
    ok = [t for t in range(1, 65) if cfg.n_heads % t == 0 and cfg.d_ff % t == 0]
    if cfg.n_heads % tp:
        raise ConfigError(f"n_heads={cfg.n_heads} is not divisible by tp={tp}: each tensor-parallel rank holds "
                          f"n_heads/tp whole heads; use tp in {ok}")
    if cfg.d_ff % tp:
        raise ConfigError(f"d_ff={cfg.d_ff} is not divisible by tp={tp}: each tensor-parallel rank holds d_ff/tp "
                          f"MLP columns; use tp in {ok}")
    if scheme == "sequence":                                             # T-shards of seq_len/tp positions
        tp_sequence.check_seq_len(cfg.seq_len, tp, [t for t in ok if cfg.seq_len % t == 0])


def split_of(name, scheme="megatron"):
    """How a parameter is split: ("rep", None), ("split", axis) or ("vocab", axis)."""
    if name == "wte":
        return "vocab", 0
    if name == "lm_head.weight":
        return "vocab", 1
    if ".attn.q." in name or ".attn.k." in name or ".attn.v." in name or ".mlp.fc." in name:
        return "split", 1 if name.endswith(".weight") else 0
    if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
        return "split", 0 if scheme != "gather" else 1                   # row-parallel / column-parallel
    if name.endswith("attn.proj.bias") or name.endswith("mlp.proj.bias"):
        return ("rep", None) if scheme != "gather" else ("split", 0)
    return "rep", None                                                   # wpe, LayerNorms


def shard(full, name, tp_rank, tp, scheme="megatron"):
    """This rank's shard of a full (serial) parameter or gradient: a copy."""
    xp = array_module(full)
    kind, axis = split_of(name, scheme)
    if kind == "rep":
        return full.copy()
    n = full.shape[axis]
    if kind == "vocab":
        start, size = vocab_range(n, tp, tp_rank)
        padded_shape = list(full.shape)
        padded_shape[axis] = size * tp
        padded = xp.zeros(padded_shape, dtype=full.dtype)                # rows/columns past V stay zero
        padded[(slice(None),) * axis + (slice(0, n),)] = full
        full = padded
    else:
        size, start = n // tp, tp_rank * (n // tp)
    return xp.ascontiguousarray(full[(slice(None),) * axis + (slice(start, start + size),)])


def shard_params(full_params, tp_rank, tp, scheme="megatron"):
    return {name: shard(p, name, tp_rank, tp, scheme) for name, p in full_params.items()}


def init_params(cfg, comm, seed=0, dtype="float32", device=None, scheme="megatron"):
    """This rank's shards: exact slices of hsgd.serial.init_params for the same seed. (Each rank draws the full
    model and keeps its slice: simple, and for the model sizes of this project cheap.)"""
    check_tp(cfg, comm.size, scheme)
    return shard_params(serial.init_params(cfg, seed, dtype, device), comm.rank, comm.size, scheme)


# ------------------------------------------------------------------------------------------------ one block

def block_forward(x, p, h, cfg, comm, scheme):
    nh = cfg.n_heads // comm.size                                        # local heads
    a, c_ln1 = layernorm_forward(x, p[h + "ln1.weight"], p[h + "ln1.bias"])          # (B, T, C) replicated
    a = f_forward(a, comm)                                               # enters the column-parallel q, k, v
    q, c_q = linear_forward(a, p[h + "attn.q.weight"], p[h + "attn.q.bias"])          # (B, T, C/tp) local heads
    k, c_k = linear_forward(a, p[h + "attn.k.weight"], p[h + "attn.k.bias"])          # (B, T, C/tp)
    v, c_v = linear_forward(a, p[h + "attn.v.weight"], p[h + "attn.v.bias"])          # (B, T, C/tp)
    y, c_att = attention_forward(q, k, v, nh)                            # (B, T, C/tp) heads are independent
    W, b = p[h + "attn.proj.weight"], p[h + "attn.proj.bias"]
    if scheme == "megatron":
        o, c_proj = row_linear_forward(y, W, b, comm)                    # (B, T, C) g: Allreduce
    else:
        y = allgather_forward(y, comm)                                   # (B, T, C) Allgather of the heads
        o, c_proj = gather_linear_forward(y, W, b, comm)                 # (B, T, C) Allgather
    x = x + o
    m, c_ln2 = layernorm_forward(x, p[h + "ln2.weight"], p[h + "ln2.bias"])          # (B, T, C) replicated
    m = f_forward(m, comm)
    u, c_fc = linear_forward(m, p[h + "mlp.fc.weight"], p[h + "mlp.fc.bias"])         # (B, T, F/tp)
    g, c_gelu = gelu_forward(u)                                          # (B, T, F/tp)
    W, b = p[h + "mlp.proj.weight"], p[h + "mlp.proj.bias"]
    if scheme == "megatron":
        o2, c_mproj = row_linear_forward(g, W, b, comm)                  # (B, T, C) g: Allreduce
    else:
        g = allgather_forward(g, comm)                                   # (B, T, F) Allgather
        o2, c_mproj = gather_linear_forward(g, W, b, comm)               # (B, T, C) Allgather
    x = x + o2
    return x, (c_ln1, c_q, c_k, c_v, c_att, c_proj, c_ln2, c_fc, c_gelu, c_mproj)


def block_backward(dx, cache, g, h, comm, scheme, reduce_scatter=False):
    """block_forward read from the bottom up; every collective is the adjoint of one in the forward pass."""
    c_ln1, c_q, c_k, c_v, c_att, c_proj, c_ln2, c_fc, c_gelu, c_mproj = cache
    dW, db = g[h + "mlp.proj.weight"], g[h + "mlp.proj.bias"]
    if scheme == "megatron":
        dg = row_linear_backward(dx, c_mproj, dW, db, comm)              # (B, T, F/tp) no communication
    else:
        dg = gather_linear_backward(dx, c_mproj, dW, db, comm, reduce_scatter)        # (B, T, F) Allreduce
        dg = allgather_backward(dg, comm, replicated=True, reduce_scatter=reduce_scatter)  # (B, T, F/tp)
    du = gelu_backward(dg, c_gelu)                                       # (B, T, F/tp)
    dm = linear_backward(du, c_fc, g[h + "mlp.fc.weight"], g[h + "mlp.fc.bias"])      # (B, T, C) partial
    dm = f_backward(dm, comm)                                            # Allreduce: full dm
    dx = dx + layernorm_backward(dm, c_ln2, g[h + "ln2.weight"], g[h + "ln2.bias"])
    dW, db = g[h + "attn.proj.weight"], g[h + "attn.proj.bias"]
    if scheme == "megatron":
        dy = row_linear_backward(dx, c_proj, dW, db, comm)               # (B, T, C/tp)
    else:
        dy = gather_linear_backward(dx, c_proj, dW, db, comm, reduce_scatter)         # (B, T, C) Allreduce
        dy = allgather_backward(dy, comm, replicated=True, reduce_scatter=reduce_scatter)  # (B, T, C/tp)
    dq, dk, dv = attention_backward(dy, c_att)                           # (B, T, C/tp) x 3
    da = linear_backward(dq, c_q, g[h + "attn.q.weight"], g[h + "attn.q.bias"])       # (B, T, C) partial
    da += linear_backward(dk, c_k, g[h + "attn.k.weight"], g[h + "attn.k.bias"])
    da += linear_backward(dv, c_v, g[h + "attn.v.weight"], g[h + "attn.v.bias"])
    da = f_backward(da, comm)                                            # Allreduce: full da
    dx = dx + layernorm_backward(da, c_ln1, g[h + "ln1.weight"], g[h + "ln1.bias"])
    return dx


# ------------------------------------------------------------------------------------------------ the whole model

def forward(params, idx, targets, cfg, comm, scheme="megatron"):
    """The mean loss (the same on every rank) and the caches of the backward pass."""
    if scheme == "sequence":
        return tp_sequence.forward(params, idx, targets, cfg, comm)
    return stage_forward(params, idx, targets, cfg, comm, scheme, range(cfg.n_layers), first=True, last=True)


def backward(caches, grads, comm, scheme="megatron", reduce_scatter=False, dloss=1.0, on_ready=None):
    """Accumulate (+=) the gradient of dloss * loss into this rank's gradient shards.

    on_ready(group), if given, is called as soon as a group of gradients is final, in this order: "head"
    (lm_head, ln_f), "h.{L-1}", ..., "h.0" (the blocks), "embedding" (wte, wpe). Data parallelism uses it to
    start each bucket's Allreduce while the backward pass goes on (see backward_order).
    """
    if scheme == "sequence":
        return tp_sequence.backward(caches, grads, comm, dloss, on_ready)
    stage_backward(dloss, caches, grads, comm, scheme, reduce_scatter, on_ready)


def stage_forward(params, inp, targets, cfg, comm, scheme, layers, first, last):
    """Forward through one pipeline stage (the whole model when first and last): the embedding if `first`, the
    blocks in `layers`, the final LayerNorm, LM head and loss if `last`.

    inp: token ids (B, T) on the first stage, else the activation (B, T, C) received from the previous stage.
    Returns (out, caches): out is the mean loss on the last stage, else the activation (B, T, C) to send on.
    """
    p = params
    start, _ = vocab_range(cfg.vocab_size, comm.size, comm.rank)
    c_emb = c_lnf = c_head = c_ce = None
    if first:
        x, c_emb = vocab_embedding_forward(inp, p["wte"], p["wpe"], start, comm)    # (B, T, C) Allreduce
    else:
        x = inp                                                                     # (B, T, C) from stage s-1
    c_blocks = []
    for i in layers:
        x, c = block_forward(x, p, f"h.{i}.", cfg, comm, scheme)
        c_blocks.append((i, c))
    if not last:
        return x, (c_emb, c_blocks, c_lnf, c_head, c_ce)
    xf, c_lnf = layernorm_forward(x, p["ln_f.weight"], p["ln_f.bias"])             # (B, T, C)
    xf = f_forward(xf, comm)
    logits, c_head = linear_forward(xf, p["lm_head.weight"])                        # (B, T, Vp) local vocab
    loss, c_ce = vocab_cross_entropy_forward(logits, targets, start, cfg.vocab_size, comm)  # 2 Allreduces
    return loss, (c_emb, c_blocks, c_lnf, c_head, c_ce)


def stage_backward(dout, caches, grads, comm, scheme="megatron", reduce_scatter=False, on_ready=None):
    """stage_forward read from the bottom up. dout: dloss (a number) on the last stage, else dL/d(the stage's
    output activation) received from the next stage. Returns dL/d(input activation), or None on the first stage."""
    c_emb, c_blocks, c_lnf, c_head, c_ce = caches
    g = grads
    ready = on_ready or (lambda group: None)
    if c_ce is not None:
        dlogits = vocab_cross_entropy_backward(dout, c_ce)              # (B, T, Vp) no communication
        dxf = linear_backward(dlogits, c_head, g["lm_head.weight"])      # (B, T, C) partial
        dxf = f_backward(dxf, comm)                                      # Allreduce
        dx = layernorm_backward(dxf, c_lnf, g["ln_f.weight"], g["ln_f.bias"])
        ready("head")
    else:
        dx = dout                                                        # (B, T, C) from stage s+1
    for i, c in reversed(c_blocks):
        dx = block_backward(dx, c, g, f"h.{i}.", comm, scheme, reduce_scatter)
        ready(f"h.{i}")
    if c_emb is None:
        return dx
    vocab_embedding_backward(dx, c_emb, g["wte"], g["wpe"])             # no communication
    ready("embedding")
    return None


def param_group(name):
    """The gradient group of a parameter, as passed to backward's on_ready: "head", "h.{i}" or "embedding"."""
    if name in ("wte", "wpe"):
        return "embedding"
    if name.startswith("h."):
        return ".".join(name.split(".")[:2])
    return "head"


def backward_order(cfg):
    """The groups in the order the backward pass finishes them."""
    return ["head"] + [f"h.{i}" for i in reversed(range(cfg.n_layers))] + ["embedding"]


def loss_and_grads(params, idx, targets, cfg, comm, scheme="megatron", grads=None, reduce_scatter=False,
                   loss_scale=1.0, on_ready=None):
    """(loss, grads) on this rank's shards. idx, targets (B, T): the same batch on every rank of the group.
    With `grads` given, the gradient of loss_scale * loss is accumulated into it (gradient accumulation)."""
    xp = array_module(params["wte"])
    idx, targets = xp.asarray(idx), xp.asarray(targets)
    loss, caches = forward(params, idx, targets, cfg, comm, scheme)
    if grads is None:
        grads = serial.zeros_like_params(params)
    backward(caches, grads, comm, scheme, reduce_scatter, dloss=loss_scale, on_ready=on_ready)
    return float(loss), grads


def unshard(pieces, name, cfg, scheme="megatron"):
    """The full parameter from the shards of all tp ranks, in rank order (the inverse of `shard`)."""
    xp = array_module(pieces[0])
    kind, axis = split_of(name, scheme)
    if kind == "rep":
        return pieces[0].copy()
    full = xp.concatenate(pieces, axis=axis)
    if kind == "vocab":
        full = full[(slice(None),) * axis + (slice(0, cfg.vocab_size),)]      # drop the padding
    return xp.ascontiguousarray(full)


def gather_full(params, cfg, comm, scheme="megatron"):
    """Every full parameter on every rank of the group (pickled allgather: for small models, sampling and checks,
    never in the training step)."""
    return {name: unshard(comm.allgather_obj(p), name, cfg, scheme) for name, p in params.items()}


# ------------------------------------------------------------------------------------------------ communication

def comm_formula(cfg, batch_size, itemsize, scheme="megatron", reduce_scatter=False, stage=None):
    """{(communicator, operation): (calls, payload bytes)} of one loss_and_grads call on the "tp" communicator.

    stage=(n_blocks, first, last) gives one pipeline stage's share (megatron and gather): its blocks' terms, the
    embedding's Allreduce on the first stage, the LM head's and the cross-entropy's on the last.

    N = B*T, s = bytes per element, L layers.
    megatron: Allreduce  calls 4L + 4:  embedding 1, per block 2 forward (g) + 2 backward (f), LM head f 1,
                                        cross-entropy 2 (MAX of (N,), SUM of (2, N))
                         bytes ((4L + 2) C + 3) N s
    gather:   Allgather  calls 4L, bytes L (3C + F) N s   (attention heads C, proj C, GELU output F, proj C)
              Allreduce  calls 4L + 4, bytes ((3C + F) L + 2C + 3) N s   (the partial dX of the same four, plus
                         embedding, LM head and cross-entropy)
              with reduce_scatter: Reduce_scatter_block calls 4L, bytes L (3C + F) N s as well
    sequence: Allgather  calls 6L + 3, bytes (6L + 3) N C s   forward: 2 per block (into q,k,v and fc), 1 into the
                                        LM head; backward: the same 2L + 1 again (only the T-shards are cached)
                                        and 2L + 1 adjoints of the Reduce-Scatters (2 per block, embedding)
              Reduce_scatter_block  calls 4L + 2, bytes (4L + 2) N C s   forward: embedding, 2 per block (attention
                                        and MLP proj); backward: adjoints of the 2L + 1 forward All-Gathers
              Allreduce  calls L + 4, bytes (3N + (6L + 2 + T) C) s   cross-entropy 2 (3N), the partial gradients
                                        of the replicated parameters, one call per group: head (ln_f: 2C), each
                                        block (ln1, ln2, attn.proj.bias, mlp.proj.bias: 6C), embedding (wpe: T C)
              (An Allreduce costs a ring 2 (tp-1)/tp of its bytes, an Allgather or Reduce-scatter (tp-1)/tp: the
              sequence scheme moves what megatron does, plus the 2L + 1 repeated All-Gathers and the small
              Allreduces of the replicated gradients.)
    """
    N, C, F, L, s = batch_size * cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.n_layers, itemsize
    if stage is not None:
        L, first, last = stage
        emb, head = int(first), int(last)                               # embedding: 1 call; head + loss: 3 calls
        ar_calls, ar_bytes = emb + 3 * head, (emb * C + head * (C + 3)) * N * s
        if scheme == "megatron":
            return {("tp", "Allreduce"): (4 * L + ar_calls, 4 * L * C * N * s + ar_bytes)}
        out = {("tp", "Allgather"): (4 * L, L * (3 * C + F) * N * s),
               ("tp", "Allreduce"): (4 * L + ar_calls, (3 * C + F) * L * N * s + ar_bytes)}
        if reduce_scatter:
            out[("tp", "Reduce_scatter_block")] = (4 * L, L * (3 * C + F) * N * s)
        return {k: v for k, v in out.items() if v[0]}
    if scheme == "megatron":
        return {("tp", "Allreduce"): (4 * L + 4, ((4 * L + 2) * C + 3) * N * s)}
    if scheme == "sequence":
        return {("tp", "Allgather"): (6 * L + 3, (6 * L + 3) * N * C * s),
                ("tp", "Reduce_scatter_block"): (4 * L + 2, (4 * L + 2) * N * C * s),
                ("tp", "Allreduce"): (L + 4, (3 * N + (6 * L + 2 + cfg.seq_len) * C) * s)}
    out = {("tp", "Allgather"): (4 * L, L * (3 * C + F) * N * s),
           ("tp", "Allreduce"): (4 * L + 4, ((3 * C + F) * L + 2 * C + 3) * N * s)}
    if reduce_scatter:
        out[("tp", "Reduce_scatter_block")] = (4 * L, L * (3 * C + F) * N * s)
    return out


def vocab_padding(cfg, tp):
    """Rows of wte (columns of lm_head) added so that every rank holds Vp = ceil(V/tp)."""
    return math.ceil(cfg.vocab_size / tp) * tp - cfg.vocab_size
