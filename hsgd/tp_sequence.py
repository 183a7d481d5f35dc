"""Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198): tensor parallelism with the rest split along T.

Megatron's scheme (tp_model "megatron") splits the matmuls and the attention heads over the tp ranks, but between
them -- LayerNorm, the residual adds (and, in the paper, dropout) -- every rank holds and caches the whole
(B, T, C) activation. Those operations treat every position on its own, so there they can be split along T:
rank r holds positions [r T/tp, (r+1) T/tp), the T-shard x^s of shape (B, T/tp, C). Two conjugate operators switch
between the layouts (the paper's g and g-bar; they take the place of Megatron's f and g):

    g      forward: All-Gather along T       (B, T/tp, C) -> (B, T, C)         backward: Reduce-Scatter along T
    g-bar  forward: Reduce-Scatter along T   (B, T, C) partial -> (B, T/tp, C)  backward: All-Gather along T

Adjoints: after g every rank holds the whole X = [X^s_0; ...; X^s_tp-1] (stacked along T), but each uses it for its
own columns, so rank r's backward yields a *partial* dL/dX^(r); dL/dX^s_i = sum_r (dL/dX^(r))_i, a Reduce-Scatter.
g-bar's forward Y^s_i = (sum_r Y^(r))_i hands row block i to rank i, so dL/dY^(r) = [dL/dY^s_0; ...] on every
rank: an All-Gather. An Allreduce is a Reduce-Scatter followed by an All-Gather, so g-bar then g moves the bytes
of megatron's one Allreduce.

One block, x^s (B, T/tp, C) in and out (column-parallel W_i = W[:, cols of rank i], row-parallel W_i = W[rows, :]):
    a^s = LN1(x^s)                                                   (B, T/tp, C)
    q, k, v = g(a^s) Wq_i + bq_i, ... Wk_i, Wv_i                     (B, T, C/tp)  local heads, all T positions
    x^s = x^s + g-bar(attention(q, k, v) Wo_i) + bo                  (B, T/tp, C)  bias once, after the sum
    m^s = LN2(x^s);   x^s = x^s + g-bar(GELU(g(m^s) W1_i + b1_i) W2_i) + b2
Embedding: x^s = g-bar(wte_i[idx], zero where the token is owned elsewhere) + wpe[my positions].
Head: logits_i = g(LN_f(x^s)) lm_head_i (B, T, Vp): the vocab-parallel cross-entropy of tp_layers, all B*T rows.

Memory: a linear's backward needs its input (dW = X^T dY). As in Megatron-LM (and the paper's 34/t), only the
shard a^s is cached and g's All-Gather is repeated in the backward pass, so every cached activation is divided by
tp (activation_formula); the price is 2L + 1 more All-Gathers per step (tp_model.comm_formula), which Megatron-LM
overlaps with the dX matmul.

Replicated parameters (LayerNorms, row-parallel biases, wpe) see only this rank's T rows: their gradients are
partial, dw = sum_r dw^(r), and are All-Reduced over tp, one contiguous buffer per gradient group, before
on_ready(group) reports the group final.

Legend: B batch, T sequence, C d_model, NH heads, F d_ff, V vocab, Vp = ceil(V/tp), L layers, N = B*T, tp ranks.
Left out: dropout (hsgd has none), overlapping the collectives with compute, selective recomputation.
"""
from .backend import array_module, scatter_add
from .errors import ConfigError
from .layers import attention_backward, attention_forward, gelu_backward, gelu_forward, layernorm_backward, \
    layernorm_forward, linear_backward, linear_forward
from .tp_layers import vocab_cross_entropy_backward, vocab_cross_entropy_forward, vocab_range

BLOCK_REPLICATED = ("ln1.weight", "ln1.bias", "attn.proj.bias", "ln2.weight", "ln2.bias", "mlp.proj.bias")
HEAD_REPLICATED = ("ln_f.weight", "ln_f.bias")
EMBEDDING_REPLICATED = ("wpe",)


def check_seq_len(T, tp, tps=None):
    """Raise ConfigError unless T splits into tp equal T-shards. tps: the tp values to suggest."""
    if T % tp:
        tps = tps if tps is not None else [t for t in range(1, min(T, 64) + 1) if T % t == 0]
        raise ConfigError(f"seq_len={T} is not divisible by tp={tp}: the sequence scheme gives each tensor-parallel "
                          f"rank seq_len/tp positions; use a seq_len that is a multiple of {tp} "
                          f"(e.g. {[tp * k for k in range(max(T // tp, 1), max(T // tp, 1) + 3)]}) or tp in {tps}")


# ------------------------------------------------------------------------------------------ T-axis collectives

def allgather_T(x_s, comm):
    """(B, T/tp, C) on every rank -> (B, T, C), rank r's rows at [r T/tp, (r+1) T/tp)."""
    xp = array_module(x_s)
    B, Tl, C = x_s.shape
    out = xp.empty((comm.size, B, Tl, C), dtype=x_s.dtype)             # (tp, B, T/tp, C) block r from rank r
    comm.Allgather(xp.ascontiguousarray(x_s), out)                     # out[r] = x^s of rank r
    return out.transpose(1, 0, 2, 3).reshape(B, comm.size * Tl, C)     # (B, T, C) copy, blocks along T


def reduce_scatter_T(y, comm):
    """(B, T, C), a different partial sum on every rank -> (B, T/tp, C): the sum's rows of this rank."""
    xp = array_module(y)
    B, T, C = y.shape
    Tl = T // comm.size
    full = xp.ascontiguousarray(y.reshape(B, comm.size, Tl, C).transpose(1, 0, 2, 3))   # (tp, B, T/tp, C)
    out = xp.empty((B, Tl, C), dtype=y.dtype)                          # (B, T/tp, C)
    comm.Reduce_scatter_block(full, out)                               # out = sum over ranks of full[rank]
    return out


def g_forward(x_s, comm):
    """g, forward: All-Gather along T. x^s (B, T/tp, C) enters a tensor-parallel region that needs all T."""
    return allgather_T(x_s, comm)


def g_backward(dx, comm):
    """g, backward: each rank's dX (B, T, C) is partial (its columns' share); Reduce-Scatter sums it, keeps my rows."""
    return reduce_scatter_T(dx, comm)


def gbar_forward(y, comm):
    """g-bar, forward: the partial Y (B, T, C) of a row-parallel linear; Reduce-Scatter sums it into T-shards."""
    return reduce_scatter_T(y, comm)


def gbar_backward(dy_s, comm):
    """g-bar, backward: every rank needs the whole dY for its rows of W: All-Gather the T-shards dY^s."""
    return allgather_T(dy_s, comm)


# ------------------------------------------------------------------------------------------ sequence-parallel linears

def column_linears_forward(x_s, weights, comm):
    """Y_j = g(X^s) A_j,i + b_j,i for column-parallel linears sharing one input (q, k, v). weights: [(W, b or None)].
    Caches the T-shard X^s only, not the gathered X (its backward gathers again)."""
    x = g_forward(x_s, comm)                                           # (B, T, C) All-Gather along T
    ys = [linear_forward(x, W, b)[0] for W, b in weights]             # (B, T, Cout/tp) each
    return ys, (x_s, [W for W, _ in weights])


def column_linears_backward(dys, cache, dweights, comm):
    """dA_j,i += X^T dY_j; db_j,i += sum dY_j; dX^s = g^T(sum_j dY_j A_j,i^T) = Reduce-Scatter of the partial dX."""
    x_s, Ws = cache
    x = g_forward(x_s, comm)                                           # (B, T, C) All-Gather again: X was not kept
    x2 = x.reshape(-1, x.shape[-1])                                    # (N, C) the cache linear_forward would hold
    dx = linear_backward(dys[0], (x2, Ws[0]), *dweights[0])            # (B, T, C) partial
    for dy, W, (dW, db) in zip(dys[1:], Ws[1:], dweights[1:]):
        dx += linear_backward(dy, (x2, W), dW, db)
    return g_backward(dx, comm)                                        # (B, T/tp, C) Reduce-Scatter along T


def row_linear_forward(x_part, W_part, b, comm):
    """Y^s = g-bar(X_i B_i) + b. x_part (B, T, Cin/tp), W_part (Cin/tp, C), b (C,) replicated."""
    y, cache = linear_forward(x_part, W_part)                          # (B, T, C) partial product
    y_s = gbar_forward(y, comm)                                        # (B, T/tp, C) Reduce-Scatter along T
    y_s += b                                                           # once, after the sum
    return y_s, cache


def row_linear_backward(dy_s, cache, dW_part, db, comm):
    """db += sum of my rows of dY (partial: All-Reduced with its group); dY = All-Gather; dX_i = dY B_i^T."""
    db += dy_s.reshape(-1, dy_s.shape[-1]).sum(axis=0)                 # (C,) this rank's T rows only
    dy = gbar_backward(dy_s, comm)                                     # (B, T, C) All-Gather along T
    return linear_backward(dy, cache, dW_part)                         # (B, T, Cin/tp)


# ------------------------------------------------------------------------------------------ embedding, block

def embedding_forward(idx, wte_part, wpe, start, comm):
    """x^s = g-bar(wte_i[idx] masked to this rank's tokens) + wpe[my positions]. idx (B, T) -> (B, T/tp, C)."""
    xp = array_module(wte_part)
    T, Vp = idx.shape[1], wte_part.shape[0]
    t0 = comm.rank * (T // comm.size)                                  # my first position
    local = idx - start                                                # (B, T) ids relative to the shard
    mine = (local >= 0) & (local < Vp)                                 # (B, T) tokens this rank owns
    local = xp.where(mine, local, 0)
    x = wte_part[local]                                                # (B, T, C) gather (a copy)
    x *= mine[..., None]                                               # zero the rows owned elsewhere
    x_s = gbar_forward(x, comm)                                        # (B, T/tp, C) each row from its owner
    x_s += wpe[t0:t0 + x_s.shape[1]]                                   # (T/tp, C) broadcast over B
    return x_s, (local, mine, t0)


def embedding_backward(dx_s, cache, dwte_part, dwpe, comm):
    """dwpe: my positions only (partial); dwte: rows of this rank's tokens from the All-Gathered dx."""
    local, mine, t0 = cache
    dwpe[t0:t0 + dx_s.shape[1]] += dx_s.sum(axis=0)                    # (T/tp, C)
    dx = gbar_backward(dx_s, comm)                                     # (B, T, C) All-Gather along T
    scatter_add(dwte_part, local.reshape(-1), (dx * mine[..., None]).reshape(-1, dx.shape[-1]))   # others add 0


def block_forward(x_s, p, h, cfg, comm):
    nh = cfg.n_heads // comm.size                                      # local heads
    a_s, c_ln1 = layernorm_forward(x_s, p[h + "ln1.weight"], p[h + "ln1.bias"])     # (B, T/tp, C)
    qkv = [(p[h + f"attn.{m}.weight"], p[h + f"attn.{m}.bias"]) for m in "qkv"]
    (q, k, v), c_qkv = column_linears_forward(a_s, qkv, comm)          # (B, T, C/tp) x 3, All-Gather
    y, c_att = attention_forward(q, k, v, nh)                          # (B, T, C/tp)
    o_s, c_proj = row_linear_forward(y, p[h + "attn.proj.weight"], p[h + "attn.proj.bias"], comm)  # Reduce-Scatter
    x_s = x_s + o_s                                                    # (B, T/tp, C) residual on the T-shard
    m_s, c_ln2 = layernorm_forward(x_s, p[h + "ln2.weight"], p[h + "ln2.bias"])     # (B, T/tp, C)
    (u,), c_fc = column_linears_forward(m_s, [(p[h + "mlp.fc.weight"], p[h + "mlp.fc.bias"])], comm)  # (B, T, F/tp)
    gl, c_gelu = gelu_forward(u)                                       # (B, T, F/tp)
    o2_s, c_mproj = row_linear_forward(gl, p[h + "mlp.proj.weight"], p[h + "mlp.proj.bias"], comm)   # (B, T/tp, C)
    x_s = x_s + o2_s
    return x_s, (c_ln1, c_qkv, c_att, c_proj, c_ln2, c_fc, c_gelu, c_mproj)


def block_backward(dx_s, cache, g, h, comm):
    """block_forward from the bottom up; each All-Gather's adjoint is a Reduce-Scatter and vice versa."""
    c_ln1, c_qkv, c_att, c_proj, c_ln2, c_fc, c_gelu, c_mproj = cache
    dgl = row_linear_backward(dx_s, c_mproj, g[h + "mlp.proj.weight"], g[h + "mlp.proj.bias"], comm)  # (B, T, F/tp)
    du = gelu_backward(dgl, c_gelu)                                    # (B, T, F/tp)
    dm_s = column_linears_backward([du], c_fc, [(g[h + "mlp.fc.weight"], g[h + "mlp.fc.bias"])], comm)
    dx_s = dx_s + layernorm_backward(dm_s, c_ln2, g[h + "ln2.weight"], g[h + "ln2.bias"])      # (B, T/tp, C)
    dy = row_linear_backward(dx_s, c_proj, g[h + "attn.proj.weight"], g[h + "attn.proj.bias"], comm)  # (B, T, C/tp)
    dq, dk, dv = attention_backward(dy, c_att)                         # (B, T, C/tp) x 3
    dqkv = [(g[h + f"attn.{m}.weight"], g[h + f"attn.{m}.bias"]) for m in "qkv"]
    da_s = column_linears_backward([dq, dk, dv], c_qkv, dqkv, comm)    # (B, T/tp, C) Reduce-Scatter
    return dx_s + layernorm_backward(da_s, c_ln1, g[h + "ln1.weight"], g[h + "ln1.bias"])


# ------------------------------------------------------------------------------------------ the whole model

def forward(params, idx, targets, cfg, comm):
    """The mean loss over all B*T positions (the same on every rank) and the caches of the backward pass."""
    p = params
    check_seq_len(idx.shape[1], comm.size)
    start, _ = vocab_range(cfg.vocab_size, comm.size, comm.rank)
    x_s, c_emb = embedding_forward(idx, p["wte"], p["wpe"], start, comm)          # (B, T/tp, C) Reduce-Scatter
    c_blocks = []
    for i in range(cfg.n_layers):
        x_s, c = block_forward(x_s, p, f"h.{i}.", cfg, comm)
        c_blocks.append(c)
    xf_s, c_lnf = layernorm_forward(x_s, p["ln_f.weight"], p["ln_f.bias"])         # (B, T/tp, C)
    (logits,), c_head = column_linears_forward(xf_s, [(p["lm_head.weight"], None)], comm)   # (B, T, Vp)
    loss, c_ce = vocab_cross_entropy_forward(logits, targets, start, cfg.vocab_size, comm)  # 2 Allreduces
    return loss, (c_emb, c_blocks, c_lnf, c_head, c_ce)


def partial_grads(g, names):
    """One zeroed contiguous buffer for the replicated gradients `names` of this backward pass, and a copy of the
    grads dict whose `names` point into it (the backward accumulates the partial gradients there)."""
    xp = array_module(g[names[0]])
    flat = xp.zeros(sum(g[n].size for n in names), dtype=g[names[0]].dtype)       # (sum of sizes,)
    local, offset = dict(g), 0
    for n in names:
        local[n] = flat[offset:offset + g[n].size].reshape(g[n].shape)
        offset += g[n].size
    return flat, local


def finish_partial_grads(flat, local, g, names, comm):
    """Each rank saw only its T rows: Allreduce the group's buffer (one call), then accumulate (+=) into g."""
    comm.Allreduce(flat)                                                          # sum of the tp partials
    for n in names:
        g[n] += local[n]


def backward(caches, grads, comm, dloss=1.0, on_ready=None):
    """Accumulate (+=) the gradient of dloss * loss into this rank's shards; on_ready(group) as in tp_model.backward,
    called once the group's replicated gradients have been All-Reduced."""
    c_emb, c_blocks, c_lnf, c_head, c_ce = caches
    g = grads
    ready = on_ready or (lambda group: None)
    flat, gl = partial_grads(g, HEAD_REPLICATED)
    dlogits = vocab_cross_entropy_backward(dloss, c_ce)                            # (B, T, Vp) no communication
    dxf_s = column_linears_backward([dlogits], c_head, [(g["lm_head.weight"], None)], comm)  # (B, T/tp, C)
    dx_s = layernorm_backward(dxf_s, c_lnf, gl["ln_f.weight"], gl["ln_f.bias"])
    finish_partial_grads(flat, gl, g, HEAD_REPLICATED, comm)
    ready("head")
    for i in reversed(range(len(c_blocks))):
        names = [f"h.{i}.{n}" for n in BLOCK_REPLICATED]
        flat, gl = partial_grads(g, names)
        dx_s = block_backward(dx_s, c_blocks[i], gl, f"h.{i}.", comm)
        finish_partial_grads(flat, gl, g, names, comm)
        ready(f"h.{i}")
    flat, gl = partial_grads(g, EMBEDDING_REPLICATED)
    embedding_backward(dx_s, c_emb, g["wte"], gl["wpe"], comm)
    finish_partial_grads(flat, gl, g, EMBEDDING_REPLICATED, comm)
    ready("embedding")


# ------------------------------------------------------------------------------------------ activation memory

def activation_bytes(caches, params):
    """Bytes of the distinct array buffers held by `caches` (any nesting of tuples and lists), each counted once
    through the array that owns the memory (a view counts as its base); parameters (caches hold W) do not count."""
    def owner(a):                                                      # a, or the base a view was made from
        while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
            a = a.base
        return a
    skip = {id(owner(p)) for p in params.values()}
    seen, todo = {}, [caches]
    while todo:
        x = todo.pop()
        if isinstance(x, (tuple, list)):
            todo.extend(x)
        elif hasattr(x, "nbytes") and getattr(x, "ndim", 0) > 0 and id(owner(x)) not in skip:
            seen[id(owner(x))] = owner(x).nbytes
    return sum(seen.values())


def activation_formula(cfg, batch_size, itemsize, tp, scheme):
    """{"block": bytes cached by one block's forward, "model": by the whole forward} in this implementation.

    What a block caches (elements of s bytes, N = B*T; megatron / sequence):
        LN1, LN2: xhat (N, C) and rstd (N, 1), each              N(C + 1)  /  N(C + 1)/tp
        the input of q,k,v and of fc (a, m)                       2NC       /  2NC/tp (the T-shard, gathered again)
        q, k, v (the attention cache views them), merged heads    4NC/tp
        softmax probabilities (B, NH/tp, T, T)                    B NH T^2/tp
        GELU's derivative, GELU output (the proj cache)            2NF/tp
      megatron: s (4NC + 2N + (4NC + B NH T^2 + 2NF)/tp);   sequence: s (8NC + 2N + B NH T^2 + 2NF)/tp.
    Outside the blocks: LN_f (xhat, rstd) and the LM head input, N(2C + 1) s (/tp for sequence); the loss's softmax
    (N, Vp) s; the token ids and owner masks of the embedding and the loss, int64 and bool, 2 (8 + 1) N bytes, and
    the loss's row numbers, 8N.
    """
    B, N, C, F, NH, V = batch_size, batch_size * cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.vocab_size
    s, Vp, T = itemsize, -(-V // tp), cfg.seq_len
    split = (4 * N * C + B * NH * T * T + 2 * N * F) * s // tp                    # the same in both schemes
    if scheme == "megatron":
        block = (4 * N * C + 2 * N) * s + split
        outside = N * (2 * C + 1) * s
    elif scheme == "sequence":
        block = (4 * N * C + 2 * N) * s // tp + split
        outside = N * (2 * C + 1) * s // tp
    else:
        raise ValueError(f"activation_formula covers megatron and sequence, not {scheme!r}")
    return {"block": block, "model": cfg.n_layers * block + outside + N * Vp * s + 26 * N}


def paper_activation_bytes(s, b, h, a, t, sequence):
    """Activation bytes per layer of the paper's Table 2 (16-bit activations, 1-byte dropout masks, F = 4h):
    tensor parallel s b h (10 + 24/t + 5 a s / (h t)); tensor + sequence parallel s b h (34/t + 5 a s / (h t)).

    hsgd's (activation_formula with s = T, b = B, h = C, a = NH), counted in 16-bit units to compare, F = 4h:
        megatron s b h (8 + 24/t + 2 a s / (h t)),  sequence s b h (32/t + 2 a s / (h t))  (+ rstd 4sb, /t in SP)
    The ratio megatron / sequence differs: for GPT-3 175B's shape (s = 2048, h = 12288, a = 96, t = 8) hsgd's is
    1.88, the paper's 1.61; for the test model (T = 8, C = F = 16, NH = 8, B = 3, t = 8, float64) 3.04 and 2.30.
      * no dropout: the paper's replicated 10 is LN inputs 4 + inputs of q,k,v and fc 4 + dropout masks 2;
        hsgd's replicated 8 is LN xhat 4 + the same linear inputs 4 (plus LN's rstd);
      * per attention entry the paper keeps scores, softmax and dropout output (2 bytes each) and the dropout mask
        (1): 5; hsgd keeps the softmax only (2). This term is split by t in both schemes, and it is what is left
        after sequence parallelism (the paper's 10 of 14.25 for GPT-3): the larger it is, the smaller the ratio;
      * hsgd caches q, k, v, the merged heads, and for GELU its derivative and output: 24/t, as the paper's
        terms split by t (where the paper keeps GELU's input, hsgd keeps its derivative);
      * hsgd's elements are 8 bytes (float64) or 4 (float32), not 2; only ratios compare.
    In both, sequence parallelism leaves nothing replicated: every term is divided by t.
    """
    return s * b * h * ((34 / t if sequence else 10 + 24 / t) + 5 * a * s / (h * t))
