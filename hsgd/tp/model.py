"""The GPT split over a tensor-parallel group: tp ranks hold one copy of the model together. Written once for the
three schemes of hsgd.tp.schemes, which say how activations enter and leave the split matmuls:

  "megatron" (default) -- q, k, v and fc column-parallel (rank i holds heads i*NH/tp ... (i+1)*NH/tp - 1 whole and
      computes their attention locally), the output projections row-parallel; f enters, g leaves.
  "gather" (the lecture) -- every linear column-split and its output All-Gathered; the projections' too.
  "sequence" (Korthikanti et al. 2022) -- megatron's split, with LayerNorm, the residual stream and the embedding
      split along T; gather_T enters, scatter_T leaves, and only T-shards are cached.

One block, with S the scheme (T~ = T, or T/tp where the scheme splits T; W_i this rank's shard):
    a = LN1(x);  a_in = S.enter(a);  q, k, v = a_in Wq_i + bq_i, ...      (B, T~, C) -> (B, T, C) -> (B, T, C/tp)
    x = x + S.proj(attention(q, k, v), Wo_i, bo)                          (B, T~, C)
    m = LN2(x);  x = x + S.proj(GELU(S.enter(m) W1_i + b1_i), W2_i, b2)   (B, T~, C)
Embedding: x = S.leave(wte_i[idx], zero where the token is owned elsewhere) + wpe[S.rows(T)].
Head: logits_i = S.enter(LN_f(x)) lm_head_i (B, T, Vp), then the vocab-parallel cross-entropy over all B*T rows.
The column-parallel linears cache their input as this rank holds it (x, before entering) and enter it again in the
backward pass: free for f (an identity), an All-Gather for gather_T, so that the sequence scheme caches T-shards.

In all three the token embedding and the LM head are vocab-parallel (rank i holds vocabulary ids [i*Vp, (i+1)*Vp),
Vp = ceil(V/tp), padded past V), the cross-entropy never gathers the logits, and every gradient shard equals the
matching slice of hsgd.model.serial's gradient. A pipeline stage (stage_forward/stage_backward) runs the embedding if it
is the first, its blocks, the head if it is the last; it hands on the (B, T~, C) activation (stage_activation_shape).

Legend: B batch, T sequence, C d_model, NH heads, F d_ff, V vocab, Vp vocab rows per rank, L layers, tp ranks.
Parameters keep their serial names; a shard's shape shows its split, e.g. h.0.attn.q.weight (C, C/tp).
"""
from collections import namedtuple

from hsgd.model import serial
from hsgd.model.backend import array_module
from hsgd.tp.attention import WHOLE
from hsgd.model.precision import EXACT
from hsgd.tp.hooks import NO_HOOKS
from hsgd.tp.wgrad import WeightGrads
from hsgd.model.ops import (gelu_backward, gelu_forward, layernorm_backward,
                  layernorm_forward, linear_forward, linear_input_grad, linear_weight_grad, qkv_forward,
                  qkv_input_grad, qkv_weight_grad)
from hsgd.tp.layers import (vocab_cross_entropy_backward, vocab_cross_entropy_forward, vocab_lookup_backward,
                        vocab_lookup_forward, vocab_range)
from hsgd.tp.schemes import make_scheme

# the replicated parameters of each gradient group (the sequence scheme All-Reduces their partial gradients)
BLOCK_REPLICATED = ("ln1.weight", "ln1.bias", "attn.proj.bias", "ln2.weight", "ln2.bias", "mlp.proj.bias")
HEAD_REPLICATED = ("ln_f.weight", "ln_f.bias")
EMBEDDING_REPLICATED = ("wpe",)


# ------------------------------------------------------------------------------------------------ one block

RECOMPUTE = ("none", "selective", "full")


# what a stage's forward keeps for its backward: the parameters dict (ZeRO-3 fills it group by group), the model
# config, the embedding's cache (first stage), [(i, block i's cache)], the head's cache (last stage), the context
# layout (hsgd.tp.attention: which positions this rank holds, and its core attention), the numerics (precision)
StageCache = namedtuple("StageCache", "params cfg emb blocks head ctx num")


def block_forward(x, p, h, cfg, comm, S, recompute="none", ctx=WHOLE, num=EXACT):
    """x + Attn(LN1(x)), then + MLP(LN2(x)), on this rank's heads and MLP columns. x: (B, T~, C). ctx: the context
    layout (hsgd.tp.attention): the rank's positions of the sequence (T here is T/cp of them) and its core attention.
    num: where a bfloat16 or float16 run rounds (hsgd.model.precision.POINTS; nothing for float32 and float64).

    The cache holds activations only, never a parameter (block_backward takes them from p again: ZeRO-3 frees
    a layer's parameters between its forward and its backward). recompute (Korthikanti et al. 2022):
      "none"       everything block_backward needs;
      "selective"  q, k, v in place of the attention's probabilities (B, NH/tp, T, T): the core attention is
                   computed again in the backward pass (no communication);
      "full"       only the block's input x: the whole forward runs again in the backward pass, collectives too."""
    if recompute == "full":
        y, _ = block_forward(x, p, h, cfg, comm, S, ctx=ctx, num=num)    # everything it caches is dropped here
        return y, ("full", x)
    nh = cfg.n_heads // comm.size                                        # local heads
    R = num.round                                                        # R(x, point): identity for float32/64
    a, c_ln1 = layernorm_forward(x, p[h + "ln1.weight"], p[h + "ln1.bias"])          # (B, T~, C)
    a = R(a, "layernorm")
    a_in = S.enter_forward(a, comm)                                      # (B, T, C) f: identity | gather_T: All-Gather
    # q = a_in Wq_i + bq_i, k = ..., v = ...: three column-parallel linears, computed as one product (ops.qkv_forward)
    q, k, v, _ = qkv_forward(a_in, *(p[h + f"attn.{n}.{w}"] for n in "qkv" for w in ("weight", "bias")))
    q, k, v = (R(t, "matmul") for t in (q, k, v))
    # the core attention: heads are independent (tp); with cp, (k, v) go around cp_comm (ring: Isend/Irecv) or are
    # All-Gathered (allgather), hsgd.cp.split
    y, c_att = ctx.attention_forward(q, k, v, nh)                        # (B, T, C/tp)
    y = R(y, "attention")
    if recompute == "selective" and ctx.keeps_probabilities:
        c_att = ("qkv", q, k, v)                                         # (B, T, C/tp) x 3: probabilities dropped
    o, c_proj = S.proj_forward(y, p[h + "attn.proj.weight"], p[h + "attn.proj.bias"], comm)  # (B, T~, C) leaves
    x = R(x + R(o, "matmul"), "residual")
    m, c_ln2 = layernorm_forward(x, p[h + "ln2.weight"], p[h + "ln2.bias"])          # (B, T~, C)
    m = R(m, "layernorm")
    m_in = S.enter_forward(m, comm)                                      # (B, T, C) f: identity | gather_T: All-Gather
    u, _ = linear_forward(m_in, p[h + "mlp.fc.weight"], p[h + "mlp.fc.bias"])         # (B, T, F/tp)
    gl, c_gelu = gelu_forward(R(u, "matmul"))                            # (B, T, F/tp)
    gl = R(gl, "gelu")
    o2, c_mproj = S.proj_forward(gl, p[h + "mlp.proj.weight"], p[h + "mlp.proj.bias"], comm)  # (B, T~, C) leaves
    x = R(x + R(o2, "matmul"), "residual")
    # the column-parallel linears keep their input as this rank holds it, a or m (B, T~, C); the ops' caches end
    # with their weight, which is dropped ([:-1]) and taken from p again in the backward pass
    return x, (c_ln1[:-1], a, c_att, c_proj[:-1], c_ln2[:-1], m, c_gelu, c_mproj[:-1])


def recompute_block(x, p, h, cfg, comm, S, ctx=WHOLE, num=EXACT):
    """--recompute full, in the backward pass: block_forward again from the block's input x (B, T~, C), its
    tensor-parallel collectives included; returns the cache that "none" would have kept. Bit-identical: the
    same operations on the same numbers."""
    return block_forward(x, p, h, cfg, comm, S, ctx=ctx, num=num)[1]


def recompute_attention(q, k, v, nh, ctx=WHOLE):
    """--recompute selective, in the backward pass: the core attention again from q, k, v (B, T, C/tp); returns
    attention_forward's cache, the probabilities (B, NH/tp, T, T) included."""
    return ctx.attention_forward(q, k, v, nh)[1]


def block_backward(dx, cache, grads, h, comm, S, p, cfg, hooks=NO_HOOKS, wg=None, ctx=WHOLE, num=EXACT):
    """block_forward read from the bottom up; every collective is the adjoint of one in the forward pass.
    dx: (B, T~, C); p: the parameters (the weights the caches dropped); wg: where the weight-gradient products
    go (WeightGrads; default: done at once into grads); ctx, num: the context layout and numerics of the forward
    pass (a low-precision run rounds every activation gradient an operation hands back: "grad")."""
    wg = wg or WeightGrads(grads)
    R = num.round
    recomputed = isinstance(cache[0], str)                               # ("full", x)
    if recomputed:
        cache = recompute_block(cache[1], p, h, cfg, comm, S, ctx, num)  # the forward again, collectives too
    c_ln1, a, c_att, c_proj, c_ln2, m, c_gelu, c_mproj = cache
    if isinstance(c_att[0], str):                                        # ("qkv", q, k, v)
        c_att = recompute_attention(*c_att[1:], cfg.n_heads // comm.size, ctx)   # the probabilities again
        hooks.point(h[:-1], "recomputed")
    elif recomputed:
        hooks.point(h[:-1], "recomputed")
    W = lambda name: p[h + name]                                         # a weight the cache dropped
    dgl = S.proj_backward(dx, (*c_mproj, W("mlp.proj.weight")), grads, h + "mlp.proj.", comm, wg)  # (B, T, F/tp)
    du = R(gelu_backward(R(dgl, "grad"), c_gelu), "grad")                # (B, T, F/tp)
    m_in = S.enter_forward(m, comm)                                      # (B, T, C) again: identity | All-Gather
    dm_in = columns_backward(m_in, [du], [W("mlp.fc.weight")], [(h + "mlp.fc.weight", h + "mlp.fc.bias")], wg)
    dm = R(S.enter_backward(R(dm_in, "grad"), comm), "grad")             # (B, T~, C) f^T: Allreduce | Reduce-Scatter
    dln2 = layernorm_backward(dm, (*c_ln2, W("ln2.weight")), grads[h + "ln2.weight"], grads[h + "ln2.bias"])
    dx = R(dx + R(dln2, "grad"), "grad")
    dy = S.proj_backward(dx, (*c_proj, W("attn.proj.weight")), grads, h + "attn.proj.", comm, wg)  # (B, T, C/tp)
    dy = R(dy, "grad")
    dqkv = array_module(dy).empty_like(dy, shape=(*dy.shape[:-1], 3 * dy.shape[-1]))   # (B, T, 3C/tp)
    ctx.attention_backward(dy, c_att, out=dqkv)                          # [dq | dk | dv] side by side
    # (cp: (dk, dv) back to their owners around cp_comm, or a Reduce-Scatter)
    num.round_(dqkv, "grad")
    a_in = S.enter_forward(a, comm)                                      # (B, T, C) again: identity | All-Gather
    # the three linears' columns_backward as one product each for dW and dX (ops.qkv_input_grad / qkv_weight_grad)
    c_qkv = (a_in.reshape(-1, a_in.shape[-1]), tuple(W(f"attn.{n}.weight") for n in "qkv"))
    wg.add(qkv_weight_grad, (dqkv, c_qkv), *(h + f"attn.{n}.{w}" for n in "qkv" for w in ("weight", "bias")))
    da_in = qkv_input_grad(dqkv, c_qkv)                                  # (B, T, C) partial
    da = R(S.enter_backward(R(da_in, "grad"), comm), "grad")             # (B, T~, C) f^T: Allreduce | Reduce-Scatter
    dln1 = layernorm_backward(da, (*c_ln1, W("ln1.weight")), grads[h + "ln1.weight"], grads[h + "ln1.bias"])
    return R(dx + R(dln1, "grad"), "grad")


def columns_backward(x_in, dys, weights, names, wg):
    """The column-parallel linears Y_j = X W_j (+ b_j) that share the input X (fc; the LM head): dW_j += X^T dY_j
    (db_j += sum dY_j), handed to wg for the parameters names[j] = (weight, bias) or (weight,). x_in (B, T, C): X
    as entered. Returns this rank's partial dX = sum_j dY_j W_j^T (B, T, C): its columns' share. No communication."""
    x2 = x_in.reshape(-1, x_in.shape[-1])                                # (N, C) the cache linear_forward keeps
    dx = None
    for dy, W, params in zip(dys, weights, names):
        wg.add(linear_weight_grad, (dy, (x2, W)), *params)               # dW_j += X^T dY_j, db_j
        part = linear_input_grad(dy, (x2, W))                            # (B, T, C)
        dx = part if dx is None else dx + part
    return dx


# ------------------------------------------------------------------------------------------------ embedding, head

def embedding_forward(idx, wte_part, wpe, start, comm, S, ctx=WHOLE, num=EXACT):
    """x = wte[idx] + wpe[positions], wte split by vocabulary rows: each rank looks up its own tokens (zero rows
    for the others), a partial sum that the scheme's exit completes. idx (B, T) -> x (B, T~, C): T is this rank's
    positions of the sequence (ctx.rows says which; all of them without context parallelism)."""
    t0, t1 = S.rows(idx.shape[1], comm)                                  # the rows this rank holds
    rows = ctx.rows(t0, t1)                                              # their positions: wpe's rows
    x, c_look = vocab_lookup_forward(idx, wte_part, start)               # (B, T, C) partial: zeros where not mine
    x = S.leave_forward(x, comm)                                         # (B, T~, C) g: Allreduce | scatter_T: R-S
    x += wpe[rows]                                                       # (T~, C) broadcast over B
    return num.round(x, "residual"), (c_look, t0, t1, ctx)               # (rows again in the backward pass)


def embedding_backward(dx, cache, dwte_part, dwpe, comm, S):
    """dwpe for the positions held (sequence, context parallelism: partial); dwte rows of this rank's tokens from
    the whole dx."""
    c_look, t0, t1, ctx = cache
    dwpe[ctx.rows(t0, t1)] += dx.sum(axis=0)                             # (T~, C) distinct rows
    dx = S.leave_backward(dx, comm)                                      # (B, T, C) g^T: identity | All-Gather
    vocab_lookup_backward(dx, c_look, dwte_part)                         # no communication


def head_forward(x, p, targets, start, cfg, comm, S, num=EXACT):
    """The mean cross-entropy of LN_f(x) lm_head over all B*T positions, the logits split by vocabulary columns
    (a low-precision run rounds the logits; the cross-entropy's softmax is float32)."""
    xf, c_lnf = layernorm_forward(x, p["ln_f.weight"], p["ln_f.bias"])             # (B, T~, C)
    xf = num.round(xf, "layernorm")
    xf_in = S.enter_forward(xf, comm)                                    # (B, T, C) f: identity | gather_T: All-Gather
    logits, _ = linear_forward(xf_in, p["lm_head.weight"])              # (B, T, Vp) my vocabulary columns
    logits = num.round(logits, "matmul")
    loss, c_ce = vocab_cross_entropy_forward(logits, targets, start, cfg.vocab_size, comm)  # 2 Allreduces
    return loss, (c_lnf[:-1], xf, c_ce)                                  # (no parameter in the cache)


def head_backward(dloss, cache, grads, comm, S, p, wg=None, num=EXACT):
    c_lnf, xf, c_ce = cache
    R = num.round
    dlogits = R(vocab_cross_entropy_backward(dloss, c_ce), "grad")       # (B, T, Vp) no communication
    xf_in = S.enter_forward(xf, comm)                                    # (B, T, C) again: identity | All-Gather
    dxf_in = columns_backward(xf_in, [dlogits], [p["lm_head.weight"]], [("lm_head.weight",)],
                              wg or WeightGrads(grads))
    dxf = R(S.enter_backward(R(dxf_in, "grad"), comm), "grad")           # (B, T~, C) f^T: Allreduce | Reduce-Scatter
    return R(layernorm_backward(dxf, (*c_lnf, p["ln_f.weight"]), grads["ln_f.weight"], grads["ln_f.bias"]), "grad")


# ------------------------------------------------------------------------------------------------ a pipeline stage

def stage_forward(params, inp, targets, cfg, comm, scheme, layers, first, last, hooks=NO_HOOKS, recompute="none",
                  ctx=WHOLE, num=EXACT):
    """Forward through one pipeline stage (the whole model when first and last): the embedding if `first`, the
    blocks in `layers`, the final LayerNorm, LM head and loss if `last`. scheme: a name or a scheme object.
    hooks: what runs around each gradient group (Hooks); recompute: what the blocks keep (block_forward); ctx: the
    context layout (hsgd.tp.attention; with context parallelism T is this rank's T/cp positions, ctx.local of them);
    num: the numerics (hsgd.model.precision: where a bfloat16 or float16 run rounds; params is then the rounded copy).

    inp: token ids (B, T) on the first stage, else the activation (B, T~, C) received from the previous stage.
    Returns (out, caches): out is the mean loss on the last stage, else the activation (B, T~, C) to send on.
    caches: a StageCache.
    """
    S = make_scheme(scheme)
    start, _ = vocab_range(cfg.vocab_size, comm.size, comm.rank)
    c_emb = None
    if first:
        with hooks.forward("embedding"):
            x, c_emb = embedding_forward(inp, params["wte"], params["wpe"], start, comm, S, ctx, num)  # (B, T~, C)
    else:
        x = inp                                                          # (B, T~, C) from stage s-1
    c_blocks = []
    for i in layers:
        with hooks.forward(f"h.{i}"):
            x, c = block_forward(x, params, f"h.{i}.", cfg, comm, S, recompute, ctx, num)   # (B, T~, C)
        c_blocks.append((i, c))
    if not last:
        return x, StageCache(params, cfg, c_emb, c_blocks, None, ctx, num)
    with hooks.forward("head"):
        loss, c_head = head_forward(x, params, targets, start, cfg, comm, S, num)
    return loss, StageCache(params, cfg, c_emb, c_blocks, c_head, ctx, num)


def stage_backward(dout, caches, grads, comm, scheme="megatron", reduce_scatter=False, on_ready=None,
                   hooks=NO_HOOKS, wg=None):
    """stage_forward read from the bottom up. dout: dloss (a number) on the last stage, else dL/d(the stage's
    output activation) (B, T~, C) from the next stage. Returns dL/d(input activation), or None on the first stage.

    Each gradient group is final when on_ready(group) is called (see backward): the replicated parameters'
    gradients first go where the scheme says (sequence: partial, All-Reduced per group by finish_replicated).
    hooks.backward(group) is entered before a group's gradients are touched and left when this pass is done with
    them: when they are final, unless wg keeps products for later.
    wg: a WeightGrads() that keeps the weight-gradient products for a later W action (then no group is final
    here, and on_ready is not called: the caller calls it after the W); default: done at once."""
    S = make_scheme(scheme, reduce_scatter)
    params, cfg, c_emb, c_blocks, c_head, ctx, num = caches
    wg = wg or WeightGrads(grads)
    ready = (None if wg.keeps else on_ready) or (lambda group: None)
    dx = dout                                                            # (B, T~, C) from stage s+1
    if c_head is not None:
        wg.group = "head"
        with hooks.backward("head"):
            into, part = S.replicated_grads(grads, HEAD_REPLICATED)
            dx = head_backward(dout, c_head, into, comm, S, params, wg, num)   # (B, T~, C)
            S.finish_replicated(part, grads, comm)                       # sequence: Allreduce of partial grads
        ready("head")
    for i, c in reversed(c_blocks):
        wg.group = f"h.{i}"
        with hooks.backward(f"h.{i}"):
            into, part = S.replicated_grads(grads, [f"h.{i}.{n}" for n in BLOCK_REPLICATED])
            dx = block_backward(dx, c, into, f"h.{i}.", comm, S, params, cfg, hooks, wg, ctx, num)   # (B, T~, C)
            S.finish_replicated(part, grads, comm)                       # sequence: Allreduce of partial grads
        ready(f"h.{i}")
    if c_emb is None:
        return dx
    with hooks.backward("embedding"):
        into, part = S.replicated_grads(grads, EMBEDDING_REPLICATED)
        embedding_backward(dx, c_emb, into["wte"], into["wpe"], comm, S)
        S.finish_replicated(part, grads, comm)                           # sequence: Allreduce of partial dwpe
    ready("embedding")
    return None


def stage_activation_shape(scheme, batch, cfg, tp, cp=1):
    """The activation a pipeline stage sends to the next: (B, T, C), or the T-shard (B, T/tp, C) (sequence); T/cp
    in place of T with context parallelism."""
    return make_scheme(scheme).activation_shape(batch, cfg, tp, cp)


# ------------------------------------------------------------------------------------------------ the whole model

def forward(params, idx, targets, cfg, comm, scheme="megatron", recompute="none"):
    """The mean loss (the same on every rank) and the caches of the backward pass."""
    return stage_forward(params, idx, targets, cfg, comm, scheme, range(cfg.n_layers), first=True, last=True,
                         recompute=recompute)


def backward(caches, grads, comm, scheme="megatron", reduce_scatter=False, dloss=1.0, on_ready=None):
    """Accumulate (+=) the gradient of dloss * loss into this rank's gradient shards.

    on_ready(group), if given, is called as soon as a group of gradients is final, in this order: "head"
    (lm_head, ln_f), "h.{L-1}", ..., "h.0" (the blocks), "embedding" (wte, wpe). Data parallelism uses it to
    start each bucket's Allreduce while the backward pass goes on (see backward_order).
    """
    stage_backward(dloss, caches, grads, comm, scheme, reduce_scatter, on_ready)


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
                   loss_scale=1.0, on_ready=None, recompute="none"):
    """(loss, grads) on this rank's shards. idx, targets (B, T): the same batch on every rank of the group.
    With `grads` given, the gradient of loss_scale * loss is accumulated into it (gradient accumulation)."""
    xp = array_module(params["wte"])
    idx, targets = xp.asarray(idx), xp.asarray(targets)
    loss, caches = forward(params, idx, targets, cfg, comm, scheme, recompute)
    if grads is None:
        grads = serial.zeros_like_params(params)
    backward(caches, grads, comm, scheme, reduce_scatter, dloss=loss_scale, on_ready=on_ready)
    return float(loss), grads


def comm_formula(cfg, batch_size, itemsize, scheme="megatron", reduce_scatter=False, stage=None, recompute="none",
                 cp=1):
    """{(communicator, operation): (calls, payload bytes)} of one loss_and_grads call on the "tp" communicator:
    the whole model, or with stage=(n_blocks, first, last) one pipeline stage's share (its blocks' terms, the
    embedding's on the first stage, the LM head's and the cross-entropy's on the last). The terms of each scheme
    are in its comm_formula's docstring (hsgd.tp.schemes). --recompute full runs every block's forward twice:
    its collectives (the scheme's block_forward_formula) once more per block; selective moves nothing more. With
    context parallelism (cp > 1) a rank holds T/cp positions of each sequence: the same terms on N = B T/cp rows."""
    n_blocks, first, last = stage if stage is not None else (cfg.n_layers, True, True)
    S = make_scheme(scheme, reduce_scatter)
    out = S.comm_formula(cfg, batch_size, itemsize, n_blocks, first, last, cp)
    if recompute == "full" and n_blocks:
        for k, (calls, nbytes) in S.block_forward_formula(cfg, batch_size, itemsize, cp).items():
            c0, b0 = out.get(k, (0, 0))
            out[k] = (c0 + n_blocks * calls, b0 + n_blocks * nbytes)
    return out
