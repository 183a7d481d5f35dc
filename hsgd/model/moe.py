"""The mixture-of-experts layer as plain formulas, a hand-written forward/backward pair (hsgd.model.layers'
conventions: *_forward(...) -> (out, cache), *_backward(dout, cache, ...) -> dinputs, weight gradients accumulated
with `+=` into a grads dict), in place of a block's MLP: a router picks k of E expert MLPs for each token, and the
token's output is the gated sum of theirs (Shazeer et al. 2017, "Outrageously Large Neural Networks"; Lepikhin et al.
2020, "GShard"; Fedus et al. 2021, "Switch Transformers"; Jiang et al. 2024, "Mixtral of Experts").

    moe_forward(x, params, settings, prefix, groups, selection_bias) -> (y, aux, cache)
    moe_backward(dy, daux, cache, grads) -> dx

The steps, for the N rows x (N, C) (the rows of a batch, B*T):
  1. router    logits = x W_r (N, E), no bias (Mixtral, Switch and DeepSeek-V3 have none); scores s:
                   softmax over the E experts ("renormalized", "probabilities"), or sigmoid ("sigmoid");
               top-k: the k largest of s + b (b the selection bias, zero unless given), ties to the lower expert
               index; gates g (N, k) from the chosen scores s_c (the bias never enters a gate):
                   "renormalized"   g_j = s_cj / sum_j' s_cj'  = softmax over the k chosen logits (Mixtral; GShard's
                                    top-2 too: g1 / (g1 + g2), in DeepSpeed's and fairseq's versions after the drops)
                   "probabilities"  g_j = s_cj, the softmax probability as it is (Switch, k = 1: renormalizing one
                                    gate would make it 1 and leave the router no gradient)
                   "sigmoid"        g_j = s_cj / sum_j' s_cj', s = sigmoid(logits) (DeepSeek-V3, without its
                                    routed scaling factor and its group-limited routing)
  2. capacity  capacity = ceil(capacity_factor * N * k / E) token-slots per expert, or None: nothing dropped. The
               N*k token-slots (slot s = n*k + j: token n's j-th choice) queue at their experts in token order, first
               come first served (Switch; Megatron-LM's drop policy "position"); the first `capacity` of each
               expert's queue are kept, the rest dropped. A dropped slot contributes 0 to its token's output (the
               residual around the layer carries the token); the other gates are not renormalized.
  3. experts   the kept slots sorted by expert (a stable sort: by token within an expert) are the permutation
               perm (S_kept,); dispatch is the gather xs = x[perm // k]; expert e computes its segment of xs,
               GELU MLP (fc, GELU, proj) or SwiGLU MLP (gate, up, proj), biases where params holds them; combine
               is the gather by the inverse permutation inv (N*k,) (inv[perm[r]] = r; a dropped slot reads a row of
               zeros): y[n] = sum_j g[n, j] * out[inv[n*k + j]].
  4. aux       balance = alpha E mean_G sum_i f_Gi P_Gi over the token groups G of the domain (Switch's
               load-balancing loss; hsgd.model.balance counts it over many blocks and ranks):
               f_Gi = (slots of G routed to i) / (|G| k), counted from the top-k choice before any drop (as
               Megatron-LM and Hugging Face count), P_Gi = mean over G's tokens of the probability of i (the
               softmax; for "sigmoid" the scores normalized over the E experts, DeepSeek-V3's sequence-wise
               loss's). Uniform routing gives f = P = 1/E and balance = alpha. (Hugging Face's
               load_balancing_loss_func counts f per token, summing to k: k times this.)
               z = beta mean_n logsumexp(logits[n])^2 over all N rows (Zoph et al. 2022, "ST-MoE").

The backward: f is piecewise constant (a count), so balance's gradient flows through P alone: dp[n, i] = alpha E
f_Gi / (|G| #groups); the gates' gradient goes through the renormalization and the softmax (or sigmoid) to the
logits; the dispatch gather's adjoint is a scatter-add to the tokens, the combine gather's is the gather by perm.

Auxiliary-loss-free balancing (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-
Experts"; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report"): the per-expert bias b of step 1 moves, after each step,
by update_selection_bias: b_i += gamma sign(mean load - load_i). It is state, not a parameter: no gradient.

Parameter names, under a prefix ("moe" here; the model's blocks would use "h.{i}.moe"), weights (in, out):
    {prefix}.router.weight              (C, E)
    {prefix}.experts.{e}.fc.weight      (C, F) [+ .bias (F,)]                 gelu experts
    {prefix}.experts.{e}.gate.weight    (C, F), .up.weight (C, F) [+ biases]  swiglu experts
    {prefix}.experts.{e}.proj.weight    (F, C) [+ .bias (C,)]
(moe_param_shapes lists them.) The model's blocks use the layer through hsgd.model.serial (and its layouts through
hsgd.tp.experts). Left out: shared experts, router jitter noise, DeepSeek-V3's node-limited routing.

Legend: N rows, C d_model, E experts, k top-k, F expert width, S = N*k token-slots, S_kept the kept ones.

Arrays may be NumPy or CuPy; each function computes with the module its inputs belong to.
"""
import math
from collections import namedtuple
from itertools import accumulate
from dataclasses import dataclass

from hsgd.errors import ConfigError
from hsgd.model.backend import array_module, scatter_add, to_host
from hsgd.model.balance import Balance, Domain
from hsgd.model import layers, llama_layers
from hsgd.model.layers import linear_backward, linear_forward
from hsgd.model.llama_layers import sigmoid

GATES = ("renormalized", "probabilities", "sigmoid")
MLPS = ("gelu", "swiglu")


@dataclass(frozen=True)
class MoESettings:
    """What the layer computes besides its parameters (the module docstring's steps 1, 2 and 4)."""
    experts: int                        # E, the experts of the layer
    top_k: int                          # k, the experts each token is sent to (1 <= k <= E)
    mlp: str = "swiglu"                 # the experts' MLP: "gelu" (fc, GELU, proj) or "swiglu" (gate, up, proj)
    gates: str = "renormalized"         # "renormalized" (Mixtral), "probabilities" (Switch), "sigmoid" (DeepSeek-V3)
    capacity_factor: float | None = None   # token-slots per expert = ceil(factor N k / E); None: nothing dropped
    balance_coef: float = 0.0           # alpha of the load-balancing loss
    z_coef: float = 0.0                 # beta of the router z-loss

    def __post_init__(self):
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"moe top_k is {self.top_k} with {self.experts} experts; use 1 <= top_k <= experts")
        if self.mlp not in MLPS or self.gates not in GATES:
            raise ConfigError(f"moe mlp {self.mlp!r} / gates {self.gates!r}: use mlp in {MLPS}, gates in {GATES}")
        if self.capacity_factor is not None and not 0 < self.capacity_factor < math.inf:
            raise ConfigError(f"moe capacity_factor is {self.capacity_factor}; use a finite number above 0, or None")


def moe_param_shapes(prefix, C, F, E, mlp, bias=False):
    """{name: shape} of the layer's parameters (the module docstring's table)."""
    shapes = {f"{prefix}.router.weight": (C, E)}
    for e in range(E):
        ex = f"{prefix}.experts.{e}."
        ins = ("fc",) if mlp == "gelu" else ("gate", "up")
        for part in ins:
            shapes[ex + part + ".weight"] = (C, F)
            if bias:
                shapes[ex + part + ".bias"] = (F,)
        shapes[ex + "proj.weight"] = (F, C)
        if bias:
            shapes[ex + "proj.bias"] = (C,)
    return shapes


# --------------------------------------------------------------------------------------------------------------
# Router: logits, scores, top-k, gates

def softmax(z):
    """exp(z - max) normalized over the last axis."""
    xp = array_module(z)
    e = xp.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def top_k(scores, k):
    """(N, k) the indices of the k largest scores of each row, largest first, ties to the lower index (a stable sort
    of -scores)."""
    xp = array_module(scores)
    return xp.argsort(-scores, axis=-1, kind="stable")[:, :k]


def router_forward(x, W, settings, selection_bias=None):
    """(chosen (N, k), gates (N, k), probs (N, E), logits (N, E)), cache. probs: the distribution the balance loss
    averages (the softmax; for "sigmoid" the scores normalized over the experts)."""
    xp = array_module(x)
    logits, c_lin = linear_forward(x, W)                      # (N, E)
    if settings.gates == "sigmoid":
        s = sigmoid(logits)                                   # (N, E) scores
        probs = s / s.sum(axis=-1, keepdims=True)             # (N, E)
    else:
        s = probs = softmax(logits)                           # (N, E)
    chosen = top_k(s if selection_bias is None else s + selection_bias, settings.top_k)      # (N, k)
    s_c = s[xp.arange(s.shape[0])[:, None], chosen]          # (N, k) the chosen scores
    total = s_c.sum(axis=-1, keepdims=True)                   # (N, 1)
    gates = s_c if settings.gates == "probabilities" else s_c / total                       # (N, k)
    return (chosen, gates, probs, logits), (c_lin, s, probs, chosen, gates, total, settings.gates)


def router_backward(dgates, dprobs, dlogits, cache, dW):
    """dx of the router, dW += x^T dlogits, with the logits' gradient the sum of three paths:
        gates:  "probabilities": ds_c = dg;  renormalized: ds_c = (dg - sum_j dg_j g_j) / sum_j s_cj
                (the Jacobian of s_c / sum s_c), scattered to the chosen experts' columns of ds;
        dprobs: the balance loss's, onto s (itself for softmax; for sigmoid through q = s / sum s, the same rule);
        then softmax's Jacobian dlogits += s * (ds - sum_i ds_i s_i), or sigmoid's dlogits += ds s (1 - s);
        dlogits: the z-loss's, on the logits directly."""
    c_lin, s, probs, chosen, gates, total, kind = cache
    xp = array_module(s)
    ds_c = dgates if kind == "probabilities" else \
        (dgates - (dgates * gates).sum(axis=-1, keepdims=True)) / total                      # (N, k)
    ds = xp.zeros_like(s)                                     # (N, E)
    ds[xp.arange(s.shape[0])[:, None], chosen] = ds_c         # the k chosen are distinct: no sums needed
    if kind == "sigmoid":
        ds += (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True)) / s.sum(axis=-1, keepdims=True)
        dlogits = dlogits + ds * s * (1 - s)                  # (N, E)
    else:
        ds += dprobs
        dlogits = dlogits + s * (ds - (ds * s).sum(axis=-1, keepdims=True))                  # (N, E)
    return linear_backward(dlogits, c_lin, dW)                # (N, C)


# --------------------------------------------------------------------------------------------------------------
# Capacity and dispatch: the permutation of the kept token-slots by expert, and its inverse

def expert_capacity(N, settings):
    """ceil(capacity_factor * N * k / E), computed in that order, or None without a capacity factor."""
    if settings.capacity_factor is None:
        return None
    return math.ceil(settings.capacity_factor * N * settings.top_k / settings.experts)


def dispatch_indices(chosen, E, capacity):
    """(perm (S_kept,), inv (S,), load (E,), kept (E,)) of the choice `chosen` (N, k):
        slot s = n*k + j goes to expert chosen[n, j]; order = the slots stably sorted by expert (by token within
        an expert); an expert keeps the first `capacity` of its queue; perm = order without the dropped slots;
        inv[perm[r]] = r, and inv[s] = S_kept (one past the last row: a row of zeros) for a dropped slot s;
        load[e] = slots chosen for e (before drops), kept[e] = slots e computes."""
    xp = array_module(chosen)
    expert = chosen.reshape(-1)                               # (S,) the expert of each slot
    S = expert.shape[0]
    order = xp.argsort(expert, kind="stable")                 # (S,) slots by expert, then by token
    load = xp.bincount(expert, minlength=E)                   # (E,)
    start = xp.cumsum(load) - load                            # (E,) each expert's first place in order
    queue = xp.arange(S) - start[expert[order]]               # (S,) place of order[r] in its expert's queue
    perm = order if capacity is None else order[queue < capacity]          # (S_kept,)
    inv = xp.full(S, perm.shape[0], dtype=perm.dtype)         # (S,) dropped slots: the zero row
    inv[perm] = xp.arange(perm.shape[0])
    return perm, inv, load, xp.bincount(expert[perm], minlength=E)


def dispatch_groups(chosen, E, settings, capacity_groups=None):
    """dispatch_indices over the capacity groups (arrays of row indices, each routed together with its own capacity:
    a rank's micro-batch in a layout; None: all rows one group): (perm, inv, load, kept) as dispatch_indices's, perm
    holding the slots s = n*k + j of the call's rows, by expert, then by group, then by token within a group."""
    xp = array_module(chosen)
    N, k = chosen.shape
    if capacity_groups is None:
        return dispatch_indices(chosen, E, expert_capacity(N, settings))
    slots, load = [], xp.zeros(E, dtype=xp.int64)
    for G in capacity_groups:
        perm_G, _, load_G, _ = dispatch_indices(chosen[G], E, expert_capacity(len(G), settings))
        slots.append(G[perm_G // k] * k + perm_G % k)             # the group's kept slots, as the call's slots
        load += load_G
    kept_slots = xp.concatenate(slots)                            # (S_kept,) group by group, each by expert
    perm = kept_slots[xp.argsort(chosen.reshape(-1)[kept_slots], kind="stable")]   # by expert, then as above
    inv = xp.full(N * k, perm.shape[0], dtype=perm.dtype)
    inv[perm] = xp.arange(perm.shape[0])
    return perm, inv, load, xp.bincount(chosen.reshape(-1)[perm], minlength=E)


# --------------------------------------------------------------------------------------------------------------
# One expert: a GELU or SwiGLU MLP on its rows

def expert_forward(x, p, name, mlp, ops=layers, proj_bias=True):
    """GELU: out = gelu(x W_fc + b_fc) W_proj + b_proj;  SwiGLU: out = (silu(x W_gate) * (x W_up)) W_proj.
    name: the expert's prefix "{prefix}.experts.{e}."; a bias is used where p holds it (proj's only if proj_bias:
    under tp its partial sums add it once, on tp rank 0). x: (rows, C). ops: the layer functions
    (hsgd.model.layers; a layout's, which round where a bfloat16 run rounds: hsgd.tp.rounded)."""
    b = lambda part: None if part == "proj.bias" and not proj_bias else p.get(name + part)
    if mlp == "gelu":
        f, c_fc = ops.linear_forward(x, p[name + "fc.weight"], b("fc.bias"))                 # (rows, F)
        a, c_act = ops.gelu_forward(f)                                                      # (rows, F)
    else:
        g, c_gate = ops.linear_forward(x, p[name + "gate.weight"], b("gate.bias"))           # (rows, F)
        u, c_up = ops.linear_forward(x, p[name + "up.weight"], b("up.bias"))                 # (rows, F)
        a, c_act = glu_ops(ops).swiglu_forward(g, u)                                        # (rows, F)
        c_fc = (c_gate, c_up)
    out, c_proj = ops.linear_forward(a, p[name + "proj.weight"], b("proj.bias"))             # (rows, C)
    return out, (c_fc, c_act, c_proj, name, mlp, ops)


def glu_ops(ops):
    """Where SwiGLU comes from: hsgd.model.llama_layers beside the plain layers, ops itself otherwise."""
    return llama_layers if ops is layers else ops


def linear_back(dy, cache, grads, weight, bias, ops):
    """A linear's backward through ops: dW (+ db) into grads[weight] (grads[bias]), returns dX."""
    ops.linear_weight_grad(dy, cache, grads[weight], grads.get(bias))
    return ops.linear_input_grad(dy, cache)


def expert_backward(dout, cache, grads):
    """The forward upside down; with SwiGLU x feeds gate and up, so dx is the sum of both paths."""
    c_fc, c_act, c_proj, name, mlp, ops = cache
    da = linear_back(dout, c_proj, grads, name + "proj.weight", name + "proj.bias", ops)    # (rows, F)
    if mlp == "gelu":
        return linear_back(ops.gelu_backward(da, c_act), c_fc, grads, name + "fc.weight", name + "fc.bias", ops)
    dgate, dup = glu_ops(ops).swiglu_backward(da, c_act)                                    # (rows, F) each
    dx = linear_back(dup, c_fc[1], grads, name + "up.weight", name + "up.bias", ops)        # (rows, C)
    return dx + linear_back(dgate, c_fc[0], grads, name + "gate.weight", name + "gate.bias", ops)


# --------------------------------------------------------------------------------------------------------------
# Auxiliary losses

def z_loss_forward(logits, beta):
    """beta mean_n lse_n^2, lse_n = logsumexp(logits[n]) (ST-MoE's router z-loss)."""
    xp = array_module(logits)
    m = logits.max(axis=-1, keepdims=True)                    # (N, 1)
    lse = (m + xp.log(xp.exp(logits - m).sum(axis=-1, keepdims=True)))[:, 0]                # (N,)
    return beta * (lse * lse).mean(), (lse, softmax(logits), beta)


def z_loss_backward(dloss, cache):
    """dlogits[n] = dloss beta 2 lse_n softmax(logits[n]) / N  (d lse / d logits = softmax)."""
    lse, p, beta = cache
    return (dloss * beta * 2.0 / lse.shape[0]) * lse[:, None] * p          # (N, E)


def update_selection_bias(bias, load, gamma):
    """b_i + gamma sign(mean(load) - load_i): an overloaded expert's bias falls, an idle one's rises (DeepSeek-V3's
    auxiliary-loss-free balancing; load: the step's slots per expert, before drops). Returns the new (E,) bias."""
    xp = array_module(bias)
    load = xp.asarray(load, dtype=bias.dtype)
    return bias + gamma * xp.sign(load.mean() - load)


# --------------------------------------------------------------------------------------------------------------
# The layer

def route(x2, W, settings, selection_bias=None, capacity_groups=None):
    """Steps 1 and 2 on the N rows x2 (N, C): (Routing, the router's cache)."""
    (chosen, gates, probs, logits), c_router = router_forward(x2, W, settings, selection_bias)
    perm, inv, load, kept = dispatch_groups(chosen, settings.experts, settings, capacity_groups)
    N = x2.shape[0]
    capacity = expert_capacity(N if capacity_groups is None else len(capacity_groups[0]), settings)
    return Routing(chosen, gates, probs, logits, perm, inv, load, kept, capacity), c_router


Routing = namedtuple("Routing", "chosen gates probs logits perm inv load kept capacity")


def experts_forward(xs, params, prefix, settings, kept, ops=layers, proj_bias=True):
    """Step 3's experts on the dispatched rows xs (S, C), kept[e] of them expert e's, in expert order:
    (ys (S, C), bounds, caches), expert e computing rows bounds[e]:bounds[e + 1]. Experts may be any run of the
    layer's (ids from kept's index: expert parallelism hands a rank its own, E/ep of them, as a dict {e: rows});
    ops: the layer functions they compute with; proj_bias False: no proj bias added (expert_forward)."""
    xp = array_module(xs)
    counts = dict(kept) if isinstance(kept, dict) else dict(enumerate(int(c) for c in to_host(kept)))   # one copy
    bounds = [0, *accumulate(counts.values())]
    outs, caches = [xp.zeros((0, xs.shape[1]), dtype=xs.dtype)], []
    for j, e in enumerate(counts):
        o, c = expert_forward(xs[bounds[j]:bounds[j + 1]], params, f"{prefix}.experts.{e}.", settings.mlp, ops,
                              proj_bias)
        outs.append(o)
        caches.append(c)
    return xp.concatenate(outs), bounds, caches


def experts_backward(dys, bounds, caches, grads):
    """experts_forward's adjoint: dxs (S, C), each expert's weight gradients into grads."""
    xp = array_module(dys)
    return xp.concatenate([xp.zeros((0, dys.shape[1]), dtype=dys.dtype)] +
                          [expert_backward(dys[bounds[j]:bounds[j + 1]], c, grads) for j, c in enumerate(caches)])


def combine_forward(ys, inv, gates):
    """y[n] = sum_j g[n, j] ys[inv[n*k + j]] (a dropped slot reads the zero row appended at S_kept): (y (N, C),
    slot_out (N, k, C))."""
    xp = array_module(ys)
    N, k = gates.shape
    ys = xp.concatenate([ys, xp.zeros((1, ys.shape[1]), dtype=ys.dtype)])   # (S_kept + 1, C) and the zero row
    slot_out = ys[inv].reshape(N, k, ys.shape[1])             # (N, k, C) the inverse permutation
    return (gates[:, :, None] * slot_out).sum(axis=1), slot_out


def combine_backward(dy2, gates, slot_out):
    """(dgates (N, k), dslot (N*k, C)): dgates[n, j] = <dy[n], out_slot[n, j]>, dslot[n, j] = g[n, j] dy[n]."""
    N, k, C = slot_out.shape
    dgates = (dy2[:, None, :] * slot_out).sum(axis=-1)        # (N, k)
    return dgates, (gates[:, :, None] * dy2[:, None, :]).reshape(N * k, C)


def record_balance(balance, groups, prefix, settings, probs, chosen):
    """The balance loss: recorded in the model's Balance (the value None until its finish()), or, without one, over
    `groups` (None: all rows one group) at once, the layer alone. Returns (value, the Balance)."""
    if balance is not None:
        balance.add(prefix, probs, chosen)
        return None, balance
    xp, N = array_module(probs), probs.shape[0]
    groups = [xp.arange(N)] if groups is None else groups
    balance = Balance(settings.balance_coef, settings.experts, settings.top_k,
                      Domain(groups, [len(G) for G in groups], len(groups)))
    balance.add(prefix, probs, chosen)
    return balance.finish(), balance


def routing_aux(r, value, z, N, k):
    """The layer's aux dict (moe_forward's docstring)."""
    return dict(balance=value, z=z, load=r.load, kept=r.kept, dropped=N * k - r.perm.shape[0], capacity=r.capacity)


def moe_forward(x, params, settings, prefix="moe", groups=None, selection_bias=None, capacity_groups=None,
                balance=None):
    """y (x's shape), aux, cache. x: (..., C), flattened to N rows (groups and capacity_groups index those rows).
    aux: "balance" and "z" (the two losses, to be added to the model's loss), "load" (E,) slots per expert before
    drops, "kept" (E,) after, "dropped" (slots), "capacity" (of one capacity group, or None).
    The balance loss: over `groups` (row-index arrays; None: all rows one group), or, given balance (an
    hsgd.model.balance.Balance shared by a model's MoE blocks), recorded there under `prefix` and aux["balance"]
    None: the model calls balance.finish() after its last block. capacity_groups: the rows routed together, each
    with its own capacity (dispatch_groups); None: all rows."""
    C, k = x.shape[-1], settings.top_k
    x2 = x.reshape(-1, C)                                     # (N, C)
    r, c_router = route(x2, params[prefix + ".router.weight"], settings, selection_bias, capacity_groups)
    xs = x2[r.perm // k]                                      # (S_kept, C) dispatch: rows by expert
    ys, bounds, c_experts = experts_forward(xs, params, prefix, settings, r.kept)
    y, slot_out = combine_forward(ys, r.inv, r.gates)         # (N, C)
    value, balance = record_balance(balance, groups, prefix, settings, r.probs, r.chosen)
    z, c_z = z_loss_forward(r.logits, settings.z_coef)
    cache = (x.shape, c_router, r.perm, r.gates, slot_out, bounds, c_experts, balance, c_z, prefix)
    return y.reshape(x.shape), routing_aux(r, value, z, x2.shape[0], k), cache


def moe_backward(dy, daux, cache, grads):
    """dx (x's shape); grads (+=): the router's weight and each expert's. daux: the upstream gradients of
    aux["balance"] and aux["z"] (1.0 each where the model's loss adds them). The forward upside down:
        dgates[n, j] = <dy[n], out_slot[n, j]>;  dslot[n, j] = g[n, j] dy[n];  dys = dslot[perm] (the adjoint of
        the gather by inv); each expert's backward; dx[perm[r] // k] += dxs[r] (the adjoint of the dispatch
        gather); the router's backward with the balance loss's dprobs and the z-loss's dlogits."""
    shape, c_router, perm, gates, slot_out, bounds, c_experts, balance, c_z, prefix = cache
    xp = array_module(dy)
    N, k, C = slot_out.shape
    dgates, dslot = combine_backward(dy.reshape(N, C), gates, slot_out)     # (N, k), (S, C)
    dxs = experts_backward(dslot[perm], bounds, c_experts, grads)           # (S_kept, C)
    dx = xp.zeros((N, C), dtype=dy.dtype)
    scatter_add(dx, perm // k, dxs)                           # each slot's gradient back to its token
    dx += router_input_grad(dgates, daux, c_router, balance, c_z, prefix, grads)
    return dx.reshape(shape)


def router_input_grad(dgates, daux, c_router, balance, c_z, prefix, grads):
    """The router's backward with the three paths onto its logits: the gates', the balance loss's dprobs (f held
    constant) and the z-loss's dlogits. Returns its dx (N, C); the router's weight gradient into grads."""
    dprobs = balance.dprobs(prefix, daux["balance"], dgates.shape[0])      # (N, E)
    dlogits = z_loss_backward(daux["z"], c_z)                 # (N, E)
    return router_backward(dgates, dprobs, dlogits, c_router, grads[prefix + ".router.weight"])
