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
matching slice of hsgd.model.serial's gradient. A pipeline stage (stage_forward/stage_backward) runs the embedding if
it is the first, its blocks, the head if it is the last; it hands on the (B, T~, C) activation
(stage_activation_shape).

Every function takes a TPSetup, built once per stage (hsgd.pp.stage.Stage; `TPSetup(cfg, comm, scheme)` for the
whole model on a group): the communicator, the scheme, the layer functions, the context layout, what the blocks
recompute. In a bfloat16 or float16 run its scheme, layer functions and attention are the rounded ones of
hsgd.tp.rounded: the lines below are the formulas, and where a low-precision run rounds is decided there.

The Llama family (hsgd.model.config: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases, a tied
head) changes the same lines, never the collectives: Norm is RMSNorm where cfg.norm says; q and k are turned by their
rows' global positions (TPSetup.rope: all T positions, or a context-parallel rank's chunks; the sequence scheme
rotates after gather_T, on every position); the SwiGLU MLP's gate and up are column-split like fc and computed as one
product [gate_i | up_i] (ops.fused_forward); the key/value heads are split over tp when NKV is a multiple of tp, as
Megatron-LM does (it divides num_query_groups by tp and asserts that it divides), and, where tp is a multiple of NKV,
every rank holds the one kv head its NH/tp query heads read (replicated over tp/NKV ranks, as vLLM and
TensorRT-LLM do): their partial dk, dv are then summed over tp (kv_sum) before the weight gradients, so that every
holder of a kv head gets the whole of its gradient. The tied head reads wte_i^T: the same vocabulary split.

Legend: B batch, T sequence, C d_model, NH heads, NKV kv heads, hs head size, F d_ff, V vocab, Vp vocab rows per rank,
L layers, tp ranks.
Parameters keep their serial names; a shard's shape shows its split, e.g. h.0.attn.q.weight (C, C/tp).
"""
from collections import namedtuple

from hsgd.fp8.domains import layout_holders
from hsgd.fp8.linear import fp8_ops
from hsgd.model import serial
from hsgd.model.backend import array_module
from hsgd.model.llama_layers import rope_angles
from hsgd.model.precision import EXACT
from hsgd.tp import ops as tp_ops
from hsgd.tp.attention import WHOLE
from hsgd.tp.experts import Experts
from hsgd.tp.hooks import NO_HOOKS
from hsgd.tp.kv import kv_backward, kv_heads, kv_sum
from hsgd.tp.rounded import rounded
from hsgd.tp.schemes import make_scheme
from hsgd.tp.wgrad import WeightGrads

# the replicated parameters of each gradient group (the sequence scheme All-Reduces their partial gradients)
BLOCK_REPLICATED = ("ln1.weight", "ln1.bias", "attn.proj.bias", "ln2.weight", "ln2.bias", "mlp.proj.bias")
HEAD_REPLICATED = ("ln_f.weight", "ln_f.bias")
EMBEDDING_REPLICATED = ("wpe",)
RECOMPUTE = ("none", "selective", "full")

# a piece of the model a stage runs: its blocks, whether it has the embedding, whether the head and the loss
Piece = namedtuple("Piece", "layers first last")
# what a stage's forward keeps for its backward: the parameters dict (ZeRO-3 fills it group by group), the
# embedding's cache (first stage), [(i, block i's cache)], the head's cache (last stage), the MoE blocks' pass
# (hsgd.model.moe_pass.MoEPass, or None) and their auxiliary losses' local value (0.0 without experts)
StageCache = namedtuple("StageCache", "params emb blocks head moe aux")


class TPSetup:
    """What every function of the model takes besides its arrays, made once per stage:
        cfg        the ModelConfig
        comm       tp_comm: the ranks that split each layer
        scheme     S, how activations enter and leave the split matmuls (hsgd.tp.schemes)
        ops        the layer functions (hsgd.tp.ops)
        ctx        the context layout: the rank's positions of each sequence and its core attention
                   (hsgd.tp.attention; with context parallelism T is this rank's T/cp positions)
        recompute  what the blocks keep for the backward pass (block_forward)
        experts    the MoE blocks' collectives and domain (hsgd.tp.experts.Experts; the Stage makes it with the
                   layout's communicators, default: this group alone, every expert here), None without experts
    With a Numerics that rounds (bfloat16, float16), scheme, ops and ctx are hsgd.tp.rounded's: each rounds its
    outputs at its point of hsgd.model.precision.POINTS. reduce_scatter: the gather scheme's backward pays for a
    Reduce_scatter_block where the local slice would do (hsgd.tp.schemes.Gather). fp8: an FP8 run's state
    (hsgd.fp8.scaling.Fp8): the block linears' products, the model's and the scheme's projections', are then
    hsgd.fp8.linear's, their operands cast with scales agreed over the ranks holders() names."""

    def __init__(self, cfg, comm, scheme="megatron", recompute="none", ctx=WHOLE, num=EXACT, reduce_scatter=False,
                 fp8=None):
        self.cfg, self.comm, self.recompute, self.cp = cfg, comm, recompute, getattr(ctx, "cp", 1)
        S = make_scheme(scheme, reduce_scatter)
        self.products = tp_ops if fp8 is None else fp8_ops(tp_ops, fp8, layout_holders(cfg, comm, S, ctx))
        S.ops = self.products                                   # the linears' products, the projections' too
        self.scheme, self.ops, self.ctx = rounded(S, self.products, ctx, num)
        self.nh = cfg.n_heads // comm.size                                   # the heads of this rank
        self.nkv, self.kv_owner = kv_heads(cfg, comm.size, comm.rank)        # its kv heads, and the first's index
        self.n_rep = self.nh // self.nkv                                     # q heads per kv head here
        self.kv_shared = cfg.n_kv_heads < comm.size                          # kv heads replicated over tp ranks
        self.start, _ = tp_ops.vocab_range(cfg.vocab_size, comm.size, comm.rank)   # its first vocabulary id
        self.tables = {}
        self.experts = Experts(cfg, comm) if cfg.moe_experts else None

    def bind(self, params):
        """The parameters dict this pass's model reads (an FP8 run's products learn the linears' names from it)."""
        if self.products is not tp_ops:
            self.products.bind(params)

    def rope(self, Tl, dtype, xp):
        """(cos, sin) (Tl, hs) of this rank's Tl positions (its context layout's; all T without context
        parallelism), made once per length and dtype; None with learned positions."""
        if self.cfg.positions != "rope":
            return None
        key = (Tl, str(dtype))
        if key not in self.tables:
            pos = xp.arange(self.cfg.seq_len)[self.ctx.rows(0, Tl)]         # the global positions of my rows
            self.tables[key] = rope_angles(pos, self.cfg.head_size, self.cfg.rope_theta, dtype)
        return self.tables[key]


def replicated(names, p, prefix=""):
    """Those of the replicated parameters `names` (prefix + name) that this model has (its family decides)."""
    return [prefix + n for n in names if prefix + n in p]


# ------------------------------------------------------------------------------------------------ one block

def block_forward(x, p, h, setup, moe=None):
    """x + Attn(LN1(x)), then + MLP(LN2(x)), on this rank's heads and MLP columns. x: (B, T~, C); p: the
    parameters; h: the block's prefix "h.{i}."; moe: the forward call's MoEPass (a MoE block: the experts in place
    of the MLP, hsgd.tp.experts).

    The cache holds activations only, never a parameter (block_backward takes them from p again: ZeRO-3 frees
    a layer's parameters between its forward and its backward). setup.recompute (Korthikanti et al. 2022):
      "none"       everything block_backward needs;
      "selective"  q, k, v in place of the attention's probabilities (B, NH/tp, T, T): the core attention is
                   computed again in the backward pass (no communication);
      "full"       only the block's input x: the whole forward runs again in the backward pass, collectives too."""
    if setup.recompute == "full":
        y, _ = attention_and_mlp(x, p, h, setup, True, moe)                 # everything it caches is dropped here
        return y, ("full", x, moe)
    return attention_and_mlp(x, p, h, setup, setup.recompute != "selective", moe)


def norm_forward(x, p, prefix, setup):
    """LayerNorm or RMSNorm (cfg.norm) of x (B, T~, C), replicated weights. The cache ends with the weight."""
    if setup.cfg.norm == "layernorm":
        return setup.ops.layernorm_forward(x, p[prefix + ".weight"], p[prefix + ".bias"])
    return setup.ops.rmsnorm_forward(x, p[prefix + ".weight"])


def norm_backward(dy, cache, grads, p, prefix, setup):
    """norm_forward's adjoint; cache: without its weight (taken from p again)."""
    if setup.cfg.norm == "layernorm":
        return setup.ops.layernorm_backward(dy, (*cache, p[prefix + ".weight"]), grads[prefix + ".weight"],
                                            grads[prefix + ".bias"])
    return setup.ops.rmsnorm_backward(dy, (*cache, p[prefix + ".weight"]), grads[prefix + ".weight"])


def mlp_names(setup, h):
    """The column-parallel linears of the MLP: [fc] (GELU) or [gate, up] (SwiGLU), as parameter prefixes."""
    return [h + "mlp.fc."] if setup.cfg.mlp == "gelu" else [h + "mlp.gate.", h + "mlp.up."]


def attention_and_mlp(x, p, h, setup, keep_probabilities, moe=None):
    """The block's forward: (x + Attn(Norm1(x)) + MLP(Norm2(...)), the cache of everything block_backward needs;
    with keep_probabilities False, q, k, v in place of the attention's probabilities)."""
    op, S, comm, ctx = setup.ops, setup.scheme, setup.comm, setup.ctx
    a, c_ln1 = norm_forward(x, p, h + "ln1", setup)                      # (B, T~, C)
    a_in = S.enter_forward(a, comm)                                      # (B, T, C) f: identity | gather_T: All-Gather
    # q = a_in Wq_i + bq_i, k = ..., v = ...: three column-parallel linears, computed as one product (ops.qkv_forward)
    q, k, v, _ = op.qkv_forward(a_in, *(p.get(h + f"attn.{n}.{w}") for n in "qkv" for w in ("weight", "bias")))
    rope = setup.rope(a_in.shape[1], a_in.dtype, array_module(a_in))
    if rope is not None:                                                 # q, k turned by their global positions
        q, _ = op.rope_rows_forward(q, setup.nh, *rope)                  # (B, T, C/tp)
        k, _ = op.rope_rows_forward(k, setup.nkv, *rope)                 # (B, T, NKV/tp hs)
    # the core attention: heads are independent (tp), query head j reads kv head j // n_rep; with cp, the kv heads
    # (k, v) go around cp_comm (ring: Isend/Irecv) or are All-Gathered (allgather), hsgd.cp
    y, c_att = ctx.attention_forward(q, k, v, setup.nh)                  # (B, T, C/tp)
    if not keep_probabilities and ctx.keeps_probabilities:               # probabilities dropped: q, k, v kept, the
        c_att = ("qkv", q, k, v.copy() if rope is not None else v)      # fused product or three arrays (N, C/tp +
                                                                         # 2 NKV/tp hs)
    o, c_proj = S.proj_forward(y, p[h + "attn.proj.weight"], p.get(h + "attn.proj.bias"), comm)  # (B, T~, C) leaves
    x = op.residual_forward(x, o)                                        # x + o
    m, c_ln2 = norm_forward(x, p, h + "ln2", setup)                      # (B, T~, C)
    m_in = S.enter_forward(m, comm)                                      # (B, T, C) f: identity | gather_T: All-Gather
    if h + "moe.router.weight" in p:                                     # experts: partial sums, then leave
        y2, c_moe = setup.experts.forward(m_in, p, h + "moe", moe, op)   # (B, T, C) partial over tp
        x = op.residual_forward(x, S.leave_forward(y2, comm))            # (B, T~, C) g: Allreduce | scatter_T
        return x, (c_ln1[:-1], a, c_att, c_proj[:-1], c_ln2[:-1], m, None, ("moe", c_moe))
    if setup.cfg.mlp == "gelu":
        u, _ = op.linear_forward(m_in, p[h + "mlp.fc.weight"], p.get(h + "mlp.fc.bias"))      # (B, T, F/tp)
        gl, c_act = op.gelu_forward(u)                                   # (B, T, F/tp)
    else:                                                                # [gate_i | up_i]: one product
        (g, u), _ = op.fused_forward(m_in, [p[n + "weight"] for n in mlp_names(setup, h)],
                                     [p.get(n + "bias") for n in mlp_names(setup, h)])        # (B, T, F/tp) x 2
        gl, c_act = op.swiglu_forward(g, u)                              # (B, T, F/tp) silu(g) * u
    o2, c_mproj = S.proj_forward(gl, p[h + "mlp.proj.weight"], p.get(h + "mlp.proj.bias"), comm)  # (B, T~, C)
    x = op.residual_forward(x, o2)                                       # x + o2
    # the column-parallel linears keep their input as this rank holds it, a or m (B, T~, C); the ops' caches end
    # with their weight, which is dropped ([:-1]) and taken from p again in the backward pass
    return x, (c_ln1[:-1], a, c_att, c_proj[:-1], c_ln2[:-1], m, c_act, c_mproj[:-1])


def recompute_block(x, p, h, setup, moe=None):
    """--recompute full, in the backward pass: the block's forward again from its input x (B, T~, C), its
    tensor-parallel collectives included (and a MoE block's dispatch); returns the cache that "none" would have
    kept. Bit-identical: the same operations on the same numbers."""
    return attention_and_mlp(x, p, h, setup, True, moe)[1]


def recompute_attention(q, k, v, setup):
    """--recompute selective, in the backward pass: the core attention again from q, k, v (B, T, C/tp); returns
    attention_forward's cache, the probabilities (B, NH/tp, T, T) included."""
    return setup.ctx.attention_forward(q, k, v, setup.nh)[1]


def block_backward(dx, cache, grads, p, h, setup, hooks=NO_HOOKS, wg=None, daux=1.0):
    """block_forward read from the bottom up; every collective is the adjoint of one in the forward pass.
    dx: (B, T~, C); p: the parameters (the weights the caches dropped); wg: where the weight-gradient products
    go (WeightGrads; default: done at once into grads); daux: the upstream gradient of the auxiliary losses (a MoE
    block's; its weight gradients are done at once, never kept for a W)."""
    op, S, comm, wg = setup.ops, setup.scheme, setup.comm, wg or WeightGrads(grads)
    recomputed = isinstance(cache[0], str)                               # ("full", x)
    if recomputed:
        cache = recompute_block(cache[1], p, h, setup, cache[2])         # the forward again, collectives too
    c_ln1, a, c_att, c_proj, c_ln2, m, c_act, c_mproj = cache
    if isinstance(c_att[0], str):                                        # ("qkv", q, k, v)
        c_att = recompute_attention(*c_att[1:], setup)                   # the probabilities again
        hooks.point(h[:-1], "recomputed")
    elif recomputed:
        hooks.point(h[:-1], "recomputed")
    W = lambda name: p[h + name]                                         # a weight the cache dropped
    if isinstance(c_mproj[0], str):                                      # ("moe", the experts' cache)
        dm = setup.experts.block_backward(dx, c_mproj[1], grads, S, daux)  # (B, T~, C)
    else:
        dm = mlp_backward(dx, m, c_act, c_mproj, grads, p, h, setup, wg)
    dln2 = norm_backward(dm, c_ln2, grads, p, h + "ln2", setup)
    dx = op.residual_backward(dx, dln2)                                  # dx + dln2: the skip and the MLP meet
    dy = S.proj_backward(dx, (*c_proj, W("attn.proj.weight")), grads, h + "attn.proj.", comm, wg)  # (B, T, C/tp)
    xp = array_module(dy)
    kv = setup.nkv * setup.cfg.head_size                                 # K/tp: the rank's kv columns
    dqkv = xp.empty_like(dy, shape=(*dy.shape[:-1], dy.shape[-1] + 2 * kv))   # (B, T, C/tp + 2K/tp)
    setup.ctx.attention_backward(dy, c_att, out=dqkv)                    # [dq | dk | dv] side by side
    # (cp: (dk, dv) back to their owners around cp_comm, or a Reduce-Scatter)
    dqkv = kv_backward(dqkv, a.dtype, setup)                             # dq, dk turned back by -a (RoPE)
    a_in = S.enter_forward(a, comm)                                      # (B, T, C) again: identity | All-Gather
    # the three linears' backward as one product each for dW and dX (ops.qkv_input_grad / qkv_weight_grad)
    c_qkv = (a_in.reshape(-1, a_in.shape[-1]), tuple(W(f"attn.{n}.weight") for n in "qkv"))
    da_in = op.qkv_input_grad(dqkv, c_qkv)                               # (B, T, C) partial
    if setup.kv_shared:                                                  # the weight gradient of a shared kv head
        c = dy.shape[-1]                                                 # needs every holder's dk, dv: summed by
        dqkv = xp.concatenate([dqkv[..., :c], kv_sum(dqkv[..., c:], setup)], axis=-1)   # an Allreduce over tp
    wg.add(op.qkv_weight_grad, (dqkv, c_qkv), *(bias_or_weight(h + f"attn.{n}.{w}", grads) for n in "qkv"
                                               for w in ("weight", "bias")))
    da = S.enter_backward(da_in, comm)                                   # (B, T~, C) f^T: Allreduce | Reduce-Scatter
    dln1 = norm_backward(da, c_ln1, grads, p, h + "ln1", setup)
    return op.residual_backward(dx, dln1)                                # dx + dln1: the skip and the attention meet


def mlp_backward(dx, m, c_act, c_mproj, grads, p, h, setup, wg):
    """The dense MLP's backward: dm (B, T~, C) from the block's dx (B, T~, C), its weight gradients handed to wg."""
    op, S, comm = setup.ops, setup.scheme, setup.comm
    dgl = S.proj_backward(dx, (*c_mproj, p[h + "mlp.proj.weight"]), grads, h + "mlp.proj.", comm, wg)  # (B, T, F/tp)
    m_in = S.enter_forward(m, comm)                                      # (B, T, C) again: identity | All-Gather
    names = mlp_names(setup, h)
    if setup.cfg.mlp == "gelu":
        dfc = op.gelu_backward(dgl, c_act)                               # (B, T, F/tp) du
    else:
        dfc = array_module(dgl).concatenate(op.swiglu_backward(dgl, c_act), axis=-1)  # (B, T, 2F/tp) [dg | du]
    c_mlp = (m_in.reshape(-1, m_in.shape[-1]), tuple(p[n + "weight"] for n in names))
    wg.add(op.fused_weight_grad, (dfc, c_mlp),
           *(bias_or_weight(n + w, grads) for n in names for w in ("weight", "bias")))
    dm_in = op.fused_input_grad(dfc, c_mlp)                              # (B, T, C) partial (m entered again)
    return S.enter_backward(dm_in, comm)                                 # (B, T~, C) f^T: Allreduce | Reduce-Scatter


def bias_or_weight(name, grads):
    """A parameter name for WeightGrads, or None for a bias this family has not (the kernels skip None)."""
    return name if name in grads or not name.endswith(".bias") else None


def column_backward(x_in, dy, W, names, op, wg):
    """A column-parallel linear Y = X W (+ b) (fc; the LM head): dW += X^T dY (db += sum dY), handed to wg for the
    parameters names = (weight, bias) or (weight,). x_in (B, T, C): X as entered. Returns this rank's partial
    dX = dY W^T (B, T, C): its columns' share. No communication."""
    x2 = x_in.reshape(-1, x_in.shape[-1])                                # (N, C) the cache linear_forward keeps
    wg.add(op.linear_weight_grad, (dy, (x2, W)), *names)                 # dW += X^T dY, db
    return op.linear_input_grad(dy, (x2, W))                             # (B, T, C)


# ------------------------------------------------------------------------------------------------ embedding, head

def embedding_forward(idx, p, setup):
    """x = wte[idx] + wpe[positions], wte split by vocabulary rows: each rank looks up its own tokens (zero rows
    for the others), a partial sum that the scheme's exit completes. idx (B, T) -> x (B, T~, C): T is this rank's
    positions of the sequence (setup.ctx.rows says which; all of them without context parallelism). With rotary
    positions there is no wpe: the positions enter in the attention."""
    op, S, comm = setup.ops, setup.scheme, setup.comm
    t0, t1 = S.rows(idx.shape[1], comm)                                  # the rows this rank holds
    x, c_look = op.vocab_lookup_forward(idx, p["wte"], setup.start)      # (B, T, C) partial: zeros where not mine
    x = S.leave_forward(x, comm)                                         # (B, T~, C) g: Allreduce | scatter_T: R-S
    if "wpe" in p:
        x = op.residual_forward(x, p["wpe"][setup.ctx.rows(t0, t1)])     # + wpe (T~, C): the residual stream
    return x, (c_look, t0, t1)                                           # (rows again in the backward pass)


def embedding_backward(dx, cache, grads, setup):
    """dwpe for the positions held (sequence, context parallelism: partial); dwte rows of this rank's tokens from
    the whole dx."""
    c_look, t0, t1 = cache
    if "wpe" in grads:
        grads["wpe"][setup.ctx.rows(t0, t1)] += dx.sum(axis=0)           # (T~, C) distinct rows
    dx = setup.scheme.leave_backward(dx, setup.comm)                     # (B, T, C) g^T: identity | All-Gather
    setup.ops.vocab_lookup_backward(dx, c_look, grads["wte"])            # no communication


def head_weight(p, setup):
    """(the LM head's shard (C, Vp), its parameter's name): lm_head.weight, or wte_i^T (a view: the same vocabulary
    rows) with a tied head."""
    return (p["wte"].T, "wte") if setup.cfg.tied else (p["lm_head.weight"], "lm_head.weight")


def tied_weight_grad(op, dlogits, cache, dwte):
    """The tied head's weight gradient: dW (C, Vp) += X^T dlogits, accumulated into wte's gradient rows (Vp, C)
    through their transpose (a view), the same vocabulary split."""
    op.linear_weight_grad(dlogits, cache, dwte.T)


def head_forward(x, p, targets, setup):
    """The mean cross-entropy of Norm_f(x) lm_head over all B*T positions, the logits split by vocabulary columns
    (the cross-entropy's softmax in float32 in every run)."""
    op, S, comm = setup.ops, setup.scheme, setup.comm
    xf, c_lnf = norm_forward(x, p, "ln_f", setup)                        # (B, T~, C)
    xf_in = S.enter_forward(xf, comm)                                    # (B, T, C) f: identity | gather_T: All-Gather
    logits, _ = op.linear_forward(xf_in, head_weight(p, setup)[0])      # (B, T, Vp) my vocabulary columns
    loss, c_ce = op.vocab_cross_entropy_forward(logits, targets, setup.start, setup.cfg.vocab_size, comm)  # 2 Allreduce
    return loss, (c_lnf[:-1], xf, c_ce)                                  # (no parameter in the cache)


def head_backward(dloss, cache, grads, p, setup, wg=None):
    """head_forward read from the bottom up: the vocab-parallel cross-entropy's dlogits (B, T, Vp), the head's
    weight gradient (lm_head's, or wte's rows with a tied head) handed to wg, the partial dX entered back over tp
    (f^T), the final norm's backward. Returns dx (B, T~, C)."""
    op, S, comm = setup.ops, setup.scheme, setup.comm
    c_lnf, xf, c_ce = cache
    W, name = head_weight(p, setup)
    dlogits = op.vocab_cross_entropy_backward(dloss, c_ce)               # (B, T, Vp) no communication
    wg = wg or WeightGrads(grads)
    xf_in = S.enter_forward(xf, comm)                                    # (B, T, C) xf entered again
    x2 = xf_in.reshape(-1, xf_in.shape[-1])
    if setup.cfg.tied:                                                   # dW^T: into wte's gradient rows
        wg.add(tied_weight_grad, (op, dlogits, (x2, W)), name)
        dxf_in = op.linear_input_grad(dlogits, (x2, W))                  # (B, T, C) partial
    else:
        dxf_in = column_backward(xf_in, dlogits, W, (name,), op, wg)     # (B, T, C) partial
    dxf = S.enter_backward(dxf_in, comm)                                 # (B, T~, C) f^T: Allreduce | Reduce-Scatter
    return norm_backward(dxf, c_lnf, grads, p, "ln_f", setup)


# ------------------------------------------------------------------------------------------------ a pipeline stage

def stage_forward(params, inp, targets, piece, setup, hooks=NO_HOOKS):
    """Forward through one piece of the model (a pipeline stage's chunk; the whole model when it is first and last):
    the embedding if piece.first, the blocks piece.layers, the final LayerNorm, LM head and loss if piece.last.
    hooks: what runs around each gradient group (Hooks). params: in a bfloat16 or float16 run, the rounded copy.

    inp: token ids (B, T) on the first stage, else the activation (B, T~, C) received from the previous stage.
    Returns (out, caches): out is the mean loss on the last stage (the cross-entropy), else the activation
    (B, T~, C) to send on. caches: a StageCache, for stage_backward with the same setup; with MoE blocks its aux is
    their auxiliary losses' local value (the balance loss over its domain, whose counts are summed over the domain's
    ranks here, after the piece's last block, and the z-losses), which the step adds to the loss.
    """
    c_emb, c_blocks, x = None, [], inp                                   # (B, T~, C) from stage s-1
    setup.bind(params)
    moe = None
    if setup.experts is not None and any(setup.cfg.is_moe(i) for i in piece.layers):
        moe = setup.experts.new_pass(len(inp), setup.cfg.seq_len // setup.cp, array_module(inp))
    if piece.first:
        with hooks.forward("embedding"):
            x, c_emb = embedding_forward(inp, params, setup)             # (B, T~, C)
    for i in piece.layers:
        with hooks.forward(f"h.{i}"):
            x, c = block_forward(x, params, f"h.{i}.", setup, moe)       # (B, T~, C)
        c_blocks.append((i, c))
    aux = 0.0 if moe is None else moe.finish()                           # (the domain's Allreduce of the counts)
    if not piece.last:
        return x, StageCache(params, c_emb, c_blocks, None, moe, aux)
    with hooks.forward("head"):
        loss, c_head = head_forward(x, params, targets, setup)
    return loss, StageCache(params, c_emb, c_blocks, c_head, moe, aux)


def stage_backward(dout, caches, grads, setup, on_ready=None, hooks=NO_HOOKS, wg=None, daux=1.0):
    """stage_forward read from the bottom up. dout: dloss (a number) on the last stage, else dL/d(the stage's
    output activation) (B, T~, C) from the next stage. Returns dL/d(input activation), or None on the first stage.

    Each gradient group is final when on_ready(group) is called (see backward): the replicated parameters'
    gradients first go where the scheme says (sequence: partial, All-Reduced per group by finish_replicated).
    hooks.backward(group) is entered before a group's gradients are touched and left when this pass is done with
    them: when they are final, unless wg keeps products for later.
    wg: a WeightGrads() that keeps the weight-gradient products for a later W action (then no group is final
    here, and on_ready is not called: the caller calls it after the W); default: done at once. daux: the upstream
    gradient of the MoE blocks' auxiliary losses (the loss's own: dloss on the last stage, S/m in a step)."""
    S, comm, (params, c_emb, c_blocks, c_head, _, _) = setup.scheme, setup.comm, caches
    wg = wg or WeightGrads(grads)
    setup.bind(params)
    ready = (None if wg.keeps else on_ready) or (lambda group: None)
    dx = dout                                                            # (B, T~, C) from stage s+1
    if c_head is not None:
        wg.group = "head"
        with hooks.backward("head"):
            into, part = S.replicated_grads(grads, replicated(HEAD_REPLICATED, grads))
            dx = head_backward(dout, c_head, into, params, setup, wg)    # (B, T~, C)
            S.finish_replicated(part, grads, comm)                       # sequence: Allreduce of partial grads
        ready("head")
    for i, c in reversed(c_blocks):
        wg.group = f"h.{i}"
        with hooks.backward(f"h.{i}"):
            into, part = S.replicated_grads(grads, replicated(BLOCK_REPLICATED, grads, f"h.{i}."))
            dx = block_backward(dx, c, into, params, f"h.{i}.", setup, hooks, wg, daux)   # (B, T~, C)
            S.finish_replicated(part, grads, comm)                       # sequence: Allreduce of partial grads
        ready(f"h.{i}")
    if c_emb is None:
        return dx
    with hooks.backward("embedding"):
        into, part = S.replicated_grads(grads, replicated(EMBEDDING_REPLICATED, grads))
        embedding_backward(dx, c_emb, into, setup)
        S.finish_replicated(part, grads, comm)                           # sequence: Allreduce of partial dwpe
    ready("embedding")
    return None


def stage_activation_shape(scheme, batch, cfg, tp, cp=1):
    """The activation a pipeline stage sends to the next: (B, T, C), or the T-shard (B, T/tp, C) (sequence); T/cp
    in place of T with context parallelism."""
    return make_scheme(scheme).activation_shape(batch, cfg, tp, cp)


# ------------------------------------------------------------------------------------------------ the whole model

def forward(params, idx, targets, setup):
    """The mean loss (the same on every rank; with experts plus their auxiliary losses) and the caches of the
    backward pass."""
    loss, caches = stage_forward(params, idx, targets, Piece(range(setup.cfg.n_layers), True, True), setup)
    return loss + caches.aux, caches


def backward(caches, grads, setup, dloss=1.0, on_ready=None):
    """Accumulate (+=) the gradient of dloss * loss into this rank's gradient shards.

    on_ready(group), if given, is called as soon as a group of gradients is final, in this order: "head"
    (lm_head, ln_f), "h.{L-1}", ..., "h.0" (the blocks), "embedding" (wte, wpe). Data parallelism uses it to
    start each bucket's Allreduce while the backward pass goes on (see backward_order).
    """
    stage_backward(dloss, caches, grads, setup, on_ready, daux=dloss)


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


def loss_and_grads(params, idx, targets, setup, grads=None, dloss=1.0, on_ready=None):
    """(loss, grads) on this rank's shards. idx, targets (B, T): the same batch on every rank of the group.
    With `grads` given, the gradient of dloss * loss is accumulated into it (gradient accumulation)."""
    xp = array_module(params["wte"])
    loss, caches = forward(params, xp.asarray(idx), xp.asarray(targets), setup)
    if grads is None:
        grads = serial.zeros_like_params(params)
    backward(caches, grads, setup, dloss, on_ready)
    return float(loss), grads


def comm_formula(cfg, batch_size, itemsize, scheme="megatron", reduce_scatter=False, stage=None, recompute="none",
                 cp=1, tp=1):
    """{(communicator, operation): (calls, payload bytes)} of one loss_and_grads call on the "tp" communicator:
    the whole model, or with stage=(n_blocks, first, last) one pipeline stage's share (its blocks' terms, the
    embedding's on the first stage, the LM head's and the cross-entropy's on the last). The terms of each scheme
    are in its comm_formula's docstring (hsgd.tp.schemes). --recompute full runs every block's forward twice:
    its collectives (the scheme's block_forward_formula) once more per block; selective moves nothing more. With
    context parallelism (cp > 1) a rank holds T/cp positions of each sequence: the same terms on N = B T/cp rows.
    Key/value heads replicated over tp (NKV < tp) add kv_sum's Allreduce of (N, 2 NKV hs) per block."""
    n_blocks, first, last = stage if stage is not None else (cfg.n_layers, True, True)
    S = make_scheme(scheme, reduce_scatter)
    out = S.comm_formula(cfg, batch_size, itemsize, n_blocks, first, last, cp)
    if recompute == "full" and n_blocks:
        for k, (calls, nbytes) in S.block_forward_formula(cfg, batch_size, itemsize, cp).items():
            c0, b0 = out.get(k, (0, 0))
            out[k] = (c0 + n_blocks * calls, b0 + n_blocks * nbytes)
    if cfg.n_kv_heads < tp and n_blocks:
        c0, b0 = out.get(("tp", "Allreduce"), (0, 0))
        N = batch_size * (cfg.seq_len // cp)
        out[("tp", "Allreduce")] = (c0 + n_blocks, b0 + n_blocks * N * 2 * cfg.kv_width * itemsize)
    return out
