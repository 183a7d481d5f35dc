"""The serial reference model: a GPT-2-style decoder with a hand-written backward pass.

Every parallel layout in hsgd is checked against this file: same seed, same batch, same loss, and every
gradient shard equal to the matching slice of `loss_and_grads`' gradients.

    x = wte[idx] + wpe[:T]
    for each block:  x = x + Attn(LN1(x));  x = x + MLP(LN2(x))
    logits = LN_f(x) @ lm_head;   loss = mean cross-entropy over all B*T positions

Attn: q, k, v = LN1(x) @ Wq + bq, ...; NH causal heads of size hs = C/NH; output projection.
MLP: fc (C -> F), GELU (tanh approximation), proj (F -> C). No dropout, untied LM head without bias.

The same file runs the Llama family (cfg.arch "llama", or any mix of the family's fields, hsgd.model.config):
    x = wte[idx]                                       (no wpe: the positions enter as rotations of q and k)
    for each block:  x = x + Attn(RMSNorm1(x));  x = x + SwiGLU(RMSNorm2(x))
    logits = RMSNorm_f(x) @ lm_head   (or wte^T, tied)
with NKV key/value heads, each read by NH/NKV query heads, and no biases; the layers are hsgd.model.llama_layers'.

Legend: B batch, T sequence, C d_model, NH heads, F d_ff, V vocab, L layers.

Public API: init_params(cfg, seed, dtype, device), loss_and_grads(params, idx, targets, cfg, grads, split) (split:
the batch over the CPU threads), forward / backward for callers that want the pieces, loss(params, idx, targets,
cfg) for evaluation, and sgd(cfg, tc, batch, params, delayed): whole runs of serial mini-batch SGD, the reference
every parallel layout's training must reproduce.

The model runs the plain layers of hsgd.model.layers, the formulas a reader checks. Every model function takes
ops=hsgd.model.ops instead to run the tuned kernels, which have the same signatures (benchmarks and appendix A time
the model that way).
"""
import zlib

import numpy as np

from hsgd.model import layers, llama_layers
from hsgd.model.backend import array_module, get_xp, resolve_dtype, scatter_add, to_device
from hsgd.model.layers import cross_entropy_forward
from hsgd.model.moe import update_selection_bias
from hsgd.model.moe_pass import MoEPass, serial_pass
from hsgd.model.threads import parallel_batches


def init_std(name, cfg):
    """Initial standard deviation of a parameter (None: a constant, see init_params)."""
    if name.endswith(".bias"):
        return None                                           # zeros
    if ".ln" in name or name.startswith("ln_f"):
        return None                                           # LayerNorm weights: ones
    if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight") or (
            ".experts." in name and name.endswith("proj.weight")):
        return 0.02 / np.sqrt(2 * cfg.n_layers)               # residual projections (an expert's too), GPT-2's
    return 0.02


def init_param(name, shape, cfg, seed):
    """One parameter as a float64 NumPy array. Its values depend only on (seed, name, shape), drawn from
    NumPy's PCG64 generator, so they are the same on every machine and independent of the other parameters."""
    std = init_std(name, cfg)
    if std is None:
        fill = 0.0 if name.endswith(".bias") else 1.0
        return np.full(shape, fill)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.normal(0.0, std, size=shape)


def init_params(cfg, seed=0, dtype="float32", device=None):
    """All parameters, keyed by their GPT-2 names (see ModelConfig.param_shapes), on `device`."""
    xp, dt = get_xp(device), resolve_dtype(dtype)
    return {name: to_device(init_param(name, shape, cfg, seed).astype(dt), xp)
            for name, shape in cfg.param_shapes().items()}


def zeros_like_params(params):
    return {name: array_module(p).zeros_like(p) for name, p in params.items()}


# --------------------------------------------------------------------------------------------------------------
# One Transformer block, of either family (cfg.norm, cfg.positions, cfg.mlp, cfg.n_kv_heads, cfg.bias)

def llama_ops(ops):
    """Where the Llama layers come from: hsgd.model.llama_layers beside the plain layers, ops itself (the tuned
    kernels' module, hsgd.model.ops, has them all) otherwise."""
    return llama_layers if ops is layers else ops


def norm_forward(x, p, prefix, cfg, ops=layers):
    """LayerNorm (weight and bias) or RMSNorm (weight only), as cfg.norm says. prefix: "h.{i}.ln1", "ln_f", ..."""
    if cfg.norm == "layernorm":
        return ops.layernorm_forward(x, p[prefix + ".weight"], p[prefix + ".bias"])
    return llama_ops(ops).rmsnorm_forward(x, p[prefix + ".weight"])


def norm_backward(dy, cache, grads, prefix, cfg, ops=layers):
    if cfg.norm == "layernorm":
        return ops.layernorm_backward(dy, cache, grads[prefix + ".weight"], grads[prefix + ".bias"])
    return llama_ops(ops).rmsnorm_backward(dy, cache, grads[prefix + ".weight"])


def rope_tables(cfg, T, dtype, xp=np):
    """(cos, sin) (T, hs) of positions 0..T-1 with rotary positions, else None."""
    if cfg.positions != "rope":
        return None
    return llama_layers.rope_angles(xp.arange(T), cfg.head_size, cfg.rope_theta, dtype)


def block_forward(x, p, h, cfg, ops=layers, rope=None, moe=None):
    """x + Attn(Norm1(x)), then + MLP(Norm2(x)). p: the params dict, h: the name prefix "h.{i}.", ops: the layer
    functions (hsgd.model.layers, or hsgd.model.ops for the tuned kernels), rope: rope_tables (rotary positions),
    moe: the call's MoEPass, which runs the MoE layer (hsgd.model.moe) in place of the MLP where p has h.{i}.moe.

    Attn: q = a Wq (+ bq) (B, T, C), k and v (B, T, NKV hs); with rotary positions q and k rotated by each row's
    position; each kv head repeated for its n_rep = NH/NKV query heads; causal attention; the projection.
    MLP: GELU(m W_fc) W_proj, or SwiGLU: (silu(m W_gate) * (m W_up)) W_proj (hsgd.model.llama_layers)."""
    b = lambda name: p.get(h + name)                                               # a bias, or None without
    lops = llama_ops(ops)
    n_rep = cfg.n_heads // cfg.n_kv_heads
    a, c_ln1 = norm_forward(x, p, h + "ln1", cfg, ops)                             # (B, T, C)
    q, c_q = ops.linear_forward(a, p[h + "attn.q.weight"], b("attn.q.bias"))      # (B, T, C)
    k, c_k = ops.linear_forward(a, p[h + "attn.k.weight"], b("attn.k.bias"))      # (B, T, NKV hs)
    v, c_v = ops.linear_forward(a, p[h + "attn.v.weight"], b("attn.v.bias"))      # (B, T, NKV hs)
    c_rope = None
    if rope is not None:                                                           # q, k turned by position
        q, c_rope = lops.rope_rows_forward(q, cfg.n_heads, *rope)
        k, _ = lops.rope_rows_forward(k, cfg.n_kv_heads, *rope)
    k, c_rep = lops.repeat_kv_rows_forward(k, cfg.n_kv_heads, n_rep)       # (B, T, C) head j: kv j // n_rep
    v, _ = lops.repeat_kv_rows_forward(v, cfg.n_kv_heads, n_rep)
    y, c_att = ops.attention_forward(q, k, v, cfg.n_heads)                         # (B, T, C)
    o, c_proj = ops.linear_forward(y, p[h + "attn.proj.weight"], b("attn.proj.bias"))
    x = x + o                                                                      # residual
    m, c_ln2 = norm_forward(x, p, h + "ln2", cfg, ops)                             # (B, T, C)
    if h + "moe.router.weight" in p:                                               # experts in place of the MLP
        o2, c_moe = moe.forward(m, p, h + "moe")                                   # (B, T, C)
        return x + o2, (c_ln1, c_q, c_k, c_v, c_rope, c_rep, c_att, c_proj, c_ln2, None, None, ("moe", c_moe))
    if cfg.mlp == "gelu":
        f, c_fc = ops.linear_forward(m, p[h + "mlp.fc.weight"], b("mlp.fc.bias"))  # (B, T, F)
        gl, c_act = ops.gelu_forward(f)                                             # (B, T, F)
    else:
        g, c_gate = ops.linear_forward(m, p[h + "mlp.gate.weight"], b("mlp.gate.bias"))   # (B, T, F)
        u, c_up = ops.linear_forward(m, p[h + "mlp.up.weight"], b("mlp.up.bias"))         # (B, T, F)
        gl, c_act = lops.swiglu_forward(g, u)                              # (B, T, F) silu(g) * u
        c_fc = (c_gate, c_up)
    o2, c_mproj = ops.linear_forward(gl, p[h + "mlp.proj.weight"], b("mlp.proj.bias"))
    x = x + o2                                                                     # residual
    return x, (c_ln1, c_q, c_k, c_v, c_rope, c_rep, c_att, c_proj, c_ln2, c_fc, c_act, c_mproj)


def block_backward(dx, cache, grads, h, cfg, ops=layers, daux=1.0):
    """The block's backward: block_forward read from the bottom up. grads: the gradients dict (+=); daux: the
    upstream gradient of the auxiliary losses (a MoE block's)."""
    c_ln1, c_q, c_k, c_v, c_rope, c_rep, c_att, c_proj, c_ln2, c_fc, c_act, c_mproj = cache
    g = lambda name: grads.get(h + name)                                           # a bias's gradient, or None
    lops = llama_ops(ops)
    # x = x + MLP(Norm2(x)): the residual passes dx through, the branch adds its own
    if isinstance(c_mproj[0], str):                                              # ("moe", the layer's cache)
        dm = MoEPass.backward(dx, c_mproj[1], grads, daux)                        # (B, T, C)
    else:
        dm = mlp_backward(dx, h, cfg, ops, (c_fc, c_act, c_mproj), grads)
    dx = dx + norm_backward(dm, c_ln2, grads, h + "ln2", cfg, ops)
    # x = x + Attn(Norm1(x))
    dy = ops.linear_backward(dx, c_proj, grads[h + "attn.proj.weight"], g("attn.proj.bias"))  # (B, T, C)
    dq, dk, dv = ops.attention_backward(dy, c_att)                                          # (B, T, C) x 3
    dk = lops.repeat_kv_rows_backward(dk, c_rep)                                    # (B, T, NKV hs): the
    dv = lops.repeat_kv_rows_backward(dv, c_rep)                                    # sum over each group
    if c_rope is not None:                                                                  # turned back by -a
        dq = lops.rope_rows_backward(dq, c_rope)
        dk = lops.rope_rows_backward(dk, (*c_rope[:2], cfg.n_kv_heads))
    da = ops.linear_backward(dq, c_q, grads[h + "attn.q.weight"], g("attn.q.bias"))         # (B, T, C)
    da += ops.linear_backward(dk, c_k, grads[h + "attn.k.weight"], g("attn.k.bias"))        # a feeds q, k, v:
    da += ops.linear_backward(dv, c_v, grads[h + "attn.v.weight"], g("attn.v.bias"))        # its gradients add
    dx = dx + norm_backward(da, c_ln1, grads, h + "ln1", cfg, ops)
    return dx


def mlp_backward(dx, h, cfg, ops, cache, grads):
    """The dense MLP's backward: dm (B, T, C) from dx, its weight gradients into grads."""
    c_fc, c_act, c_mproj = cache
    g = lambda name: grads.get(h + name)
    lops = llama_ops(ops)
    dgl = ops.linear_backward(dx, c_mproj, grads[h + "mlp.proj.weight"], g("mlp.proj.bias"))   # (B, T, F)
    if cfg.mlp == "gelu":
        df = ops.gelu_backward(dgl, c_act)                                                      # (B, T, F)
        dm = ops.linear_backward(df, c_fc, grads[h + "mlp.fc.weight"], g("mlp.fc.bias"))         # (B, T, C)
    else:
        dgate, dup = lops.swiglu_backward(dgl, c_act)                                   # (B, T, F) x 2
        dm = ops.linear_backward(dup, c_fc[1], grads[h + "mlp.up.weight"], g("mlp.up.bias"))    # m feeds gate and
        dm += ops.linear_backward(dgate, c_fc[0], grads[h + "mlp.gate.weight"], g("mlp.gate.bias"))   # up: add
    return dm


# --------------------------------------------------------------------------------------------------------------
# The whole model

def head_weight(p, cfg):
    """The LM head (C, V): lm_head.weight, or wte^T (a view) with tied embeddings."""
    return p["wte"].T if cfg.tied else p["lm_head.weight"]


def forward(params, idx, cfg, ops=layers, moe=None):
    """logits (B, T, V) for token ids idx (B, T), and the caches the backward pass needs (the backward takes the
    same ops and cfg). A model with experts: moe is the call's MoEPass (default: serial_pass, all B sequences one
    micro-batch); moe.finish() then gives the auxiliary losses to add to the loss."""
    p, xp = params, array_module(params["wte"])
    if cfg.moe_experts and moe is None:
        moe = serial_pass(cfg, *idx.shape, xp)
    if cfg.positions == "learned":
        x, c_emb = ops.embedding_forward(idx, p["wte"], p["wpe"])                  # (B, T, C) token + position
    else:
        x, c_emb = p["wte"][idx], idx                                              # (B, T, C) token only
    rope = rope_tables(cfg, idx.shape[1], p["wte"].dtype, xp)
    c_blocks = []
    for i in range(cfg.n_layers):
        x, c = block_forward(x, p, f"h.{i}.", cfg, ops, rope, moe)
        c_blocks.append(c)
    xf, c_lnf = norm_forward(x, p, "ln_f", cfg, ops)                               # (B, T, C)
    logits, c_head = ops.linear_forward(xf, head_weight(p, cfg))                  # (B, T, V)
    return logits, (c_emb, c_blocks, c_lnf, c_head)


def backward(dlogits, caches, grads, cfg, ops=layers, daux=1.0):
    """Accumulate (+=) every parameter's gradient into `grads`, given dloss/dlogits (and daux, the upstream gradient
    of the auxiliary losses of a model with experts)."""
    c_emb, c_blocks, c_lnf, c_head = caches
    dxf = ops.linear_backward(dlogits, c_head, head_weight(grads, cfg))               # (B, T, C) (tied: into wte^T)
    dx = norm_backward(dxf, c_lnf, grads, "ln_f", cfg, ops)                           # (B, T, C)
    for i in reversed(range(len(c_blocks))):
        dx = block_backward(dx, c_blocks[i], grads, f"h.{i}.", cfg, ops, daux)
    if cfg.positions == "learned":
        ops.embedding_backward(dx, c_emb, grads["wte"], grads["wpe"])
    else:
        scatter_add(grads["wte"], c_emb.reshape(-1), dx.reshape(-1, dx.shape[-1]))   # rows of the tokens read


def loss_and_grads(params, idx, targets, cfg, grads=None, split=False, ops=layers, moe=None, micro=None,
                   replicas=1):
    """(loss, grads): the mean cross-entropy over all B*T positions and its gradient for every parameter; with
    experts, the loss is the mean cross-entropy plus the auxiliary losses (the balance loss over its domain, the
    z-loss), over the MoEPass moe (default: hsgd.model.moe_pass.serial_pass, the batch one micro-batch), which keeps
    the blocks' routing statistics for the caller.

    idx, targets: integer arrays (B, T). If `grads` is given, gradients are accumulated into it.
    split=True (NumPy, threads.cpu_threads() > 1): the batch is cut into cpu_threads() slices of whole sequences,
    computed side by side, one thread each (threads.parallel_batches). Slice i, with B_i of the B sequences, adds
    B_i / B times its own mean loss and gradients: the mean over the batch is the B_i-weighted mean of the slices'
    means (the mini-batch identity of chapter 4: data parallelism inside one process, the final sum in place of
    the All-Reduce). The same numbers as split=False, up to rounding. Not with experts: the balance loss's domain and
    the capacity are counted over the rows routed together, which slices would change.
    ops: the layer functions, hsgd.model.layers (the plain formulas) or hsgd.model.ops (the tuned kernels): the same
    numbers; or an FP8 run's (hsgd.fp8.linear.Fp8Ops around them, bound to params).
    micro: the batch computed micro sequences at a time, one slice after another, each weighted by its share as
    with split (what an FP8 run's current scales are taken over: a layout's micro-batch on one dp replica).
    replicas: the gradient computed as a layout of that many replicas (dp x cp ranks of dp_comm) computes it: each
    slice's backward starts from replicas x its share (a replica differentiates the mean over its own rows and
    positions, 1/m per micro-batch), and the slices' gradients are divided by replicas when they are added up (the
    average over dp_comm). The same gradient up to rounding; but each operation sees the numbers a replica's does,
    which an FP8 cast with a fixed scale (delayed scaling's) tells apart.
    """
    xp = array_module(params["wte"])
    idx, targets = xp.asarray(idx), xp.asarray(targets)
    if grads is None:
        grads = zeros_like_params(params)
    B = idx.shape[0]
    if cfg.moe_experts:
        moe = moe or serial_pass(cfg, *idx.shape, xp)
        logits, caches = forward(params, idx, cfg, ops, moe)
        value, c_ce = ops.cross_entropy_forward(logits, targets)
        value = value + moe.finish()                            # + the auxiliary losses
        backward(ops.cross_entropy_backward(1.0, c_ce), caches, grads, cfg, ops, daux=1.0)
        return float(value), grads

    def part(lo, hi):                                         # sequences lo..hi-1, weighted by their share
        # the last slice adds into `grads` itself (with replicas, every slice into its own, scaled when added)
        into = grads if hi == B and replicas == 1 else zeros_like_params(params)
        logits, caches = forward(params, idx[lo:hi], cfg, ops)
        value, c_ce = ops.cross_entropy_forward(logits, targets[lo:hi])
        backward(ops.cross_entropy_backward((hi - lo) / B * replicas, c_ce), caches, into, cfg, ops)
        return value * ((hi - lo) / B), into

    if micro:
        parts = [part(lo, min(lo + micro, B)) for lo in range(0, B, micro)]
    else:
        parts = parallel_batches(part, B) if split and xp is np else [part(0, B)]
    for _, part_grads in parts if replicas != 1 else parts[:-1]:
        for name, a in part_grads.items():
            grads[name] += a if replicas == 1 else a * (1.0 / replicas)
    return float(sum(value for value, _ in parts)), grads


def loss(params, idx, targets, cfg):
    """The mean cross-entropy only (evaluation; no backward)."""
    xp = array_module(params["wte"])
    logits, _ = forward(params, xp.asarray(idx), cfg)
    value, _ = cross_entropy_forward(logits, xp.asarray(targets))
    return float(value)


# --------------------------------------------------------------------------------------------------------------
# The serial reference run

def experts_after_step(moe, state, cfg):
    """sgd's bookkeeping of a step's MoE blocks (moe: its MoEPass): the routing recorded in state["routing"], and
    with cfg.moe_bias_rate each selection bias moved by the step's load (not the update's)."""
    state["routing"].append({k: {n: a[n] for n in ("load", "kept", "dropped")} for k, a in moe.aux.items()})
    if cfg.moe_bias_rate:
        state["biases"] = {k: update_selection_bias(b, moe.loads()[k], cfg.moe_bias_rate)
                           for k, b in state["biases"].items()}


def sgd(cfg, tc, batch, params=None, delayed=False, micro_sequences=None, capacity_groups=None, moe_state=None,
        ops=layers, after_step=None, replicas=1, sliced=False):
    """tc.steps steps of serial mini-batch SGD on one process: the run every parallel layout must reproduce.

    For s = 1 .. tc.steps, with the global batch (idx, targets) = batch(s) of all B sequences:

        g_s     = grad of the mean loss at w_s = (1/B) sum_j grad_j(w_s)       (the lecture's mini-batch SGD)
        g_s    <- g_s * min(1, tc.clip / ||g_s||)    ||.|| over all parameters together; tc.clip = 0: never
        w_{s+1} = opt(w_s, g_s, lr_s)                lr_s = lr_at(s, tc.lr, tc.warmup, tc.steps)

    opt is tc's optimizer (SGD with momentum or AdamW, decoupled weight decay: hsgd.model.optim). delayed=True applies
    each gradient one step late, w_{s+1} = opt(w_s, g_{s-1}, lr_s), and nothing at step 1: the update of
    --dp-staleness 1. The whole batch goes through at once: tc's layout and micro-batches change how the gradient
    is computed, never its value.

    params: the starting parameters, updated in place (default: init_params(cfg, tc.seed, "float64")).
    Returns (params, losses), losses[s - 1] being the mean loss at w_s (before step s's update).

    With experts, the loss adds the auxiliary losses counted as a layout counts them (micro_sequences: its
    micro-batches' sequences, B/(dp m); capacity_groups: each of its ranks' rows, routed together: serial_pass),
    and with cfg.moe_bias_rate each MoE block's selection bias moves after every step by the step's load
    (update_selection_bias); moe_state, a dict, receives {"biases": {prefix: (E,)}, "routing": [per step:
    {prefix: {"load", "kept": (E,), "dropped"}}]}.

    ops: the layer functions (an FP8 run's: hsgd.fp8.linear.Fp8Ops, bound to params); sliced: the batch computed
    micro_sequences at a time (loss_and_grads' micro: the slices an FP8 layout's current scales are taken over);
    after_step(): called after every step (an FP8 run's end_step: the amax histories move on); replicas: the
    gradient computed as a layout of that many replicas computes it (loss_and_grads' replicas, dp x cp).
    """
    from hsgd.model.optim import clip_grads, lr_at, make_optimizer   # here: optim imports mpi4py, the model does not
    if params is None:
        params = init_params(cfg, seed=tc.seed, dtype="float64")
    opt = make_optimizer(tc.optimizer, tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
    pending, losses = None, []
    state = moe_state if moe_state is not None else {}
    state.setdefault("biases", {f"h.{i}.moe": np.zeros(cfg.moe_experts) for i in cfg.moe_layers()})
    state.setdefault("routing", [])
    for step in range(1, tc.steps + 1):
        idx, targets = batch(step)
        moe = None
        if cfg.moe_experts:
            moe = serial_pass(cfg, *np.shape(idx), np, micro_sequences, capacity_groups,
                              state["biases"] if cfg.moe_bias_rate else None)
        value, grads = loss_and_grads(params, idx, targets, cfg, ops=ops, moe=moe,
                                      micro=micro_sequences if sliced else None, replicas=replicas)
        if after_step is not None:
            after_step()
        losses.append(value)
        if moe is not None:
            experts_after_step(moe, state, cfg)
        if delayed:
            grads, pending = pending, grads                 # apply the last step's gradient, keep this one
            if grads is None:
                continue                                    # step 1: no gradient in flight yet
        norm = float(sum(float((g * g).sum()) for g in grads.values()) ** 0.5)   # ||g_s||, one norm for all
        clip_grads(grads, norm, tc.clip)
        opt.step(params, grads, lr_at(step, tc.lr, tc.warmup, tc.steps))
    return params, losses
