"""The layers of a GPT-2-style Transformer, each a hand-written forward/backward pair.

    *_forward(inputs..., params...) -> (out, cache)
    *_backward(dout, cache, dparams...) -> dinputs

Weight gradients are accumulated with `+=` into arrays the caller owns (a grads dict), so gradient
accumulation over micro-batches and tensor-parallel shards compose without extra code. The layers know
nothing about parallelism: the tensor-parallel code calls the same functions on local shards
(a column-split linear is `linear_forward` on W[:, part]; head-split attention is `attention_forward`
on the local heads).

Legend: B batch, T sequence, C d_model (C/tp on a TP shard), NH heads, hs head size, F d_ff, V vocab,
N = B*T rows.

Arrays may be NumPy or CuPy; each function computes with the module its inputs belong to.
"""
import math

from .backend import array_module

LN_EPS = 1e-5
GELU_C = math.sqrt(2.0 / math.pi)


# --------------------------------------------------------------------------------------------------------------
# Embedding: x = wte[idx] + wpe[:T]

def embedding_forward(idx, wte, wpe):
    """x[b, t] = wte[idx[b, t]] + wpe[t]."""
    B, T = idx.shape
    out = wte[idx]                                            # (B, T, C) gather: a copy
    out += wpe[:T]                                            # (B, T, C) broadcast over B
    return out, (idx, wte.shape[0])


def embedding_backward(dout, cache, dwte, dwpe):
    """dwte[v] += sum of dout over the positions holding token v; dwpe[t] += sum over the batch."""
    idx, V = cache
    xp = array_module(dout)
    B, T, C = dout.shape
    dwpe[:T] += dout.sum(axis=0)                              # (T, C)
    xp.add.at(dwte, idx.reshape(-1), dout.reshape(-1, C))     # scatter-add rows: (N,) -> (V, C)


# --------------------------------------------------------------------------------------------------------------
# Linear: y = x @ W + b, with W stored (in, out)

def linear_forward(x, W, b=None):
    """y = x W + b over the last axis. x: (..., Cin), W: (Cin, Cout), b: (Cout,) or None."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])                           # (N, Cin) view
    y = x2 @ W                                                # (N, Cout) one GEMM
    if b is not None:
        y += b
    return y.reshape(*lead, W.shape[1]), (x2, W)


def linear_backward(dy, cache, dW, db=None):
    """dx = dy W^T;  dW += x^T dy;  db += sum_rows dy."""
    x2, W = cache
    dy2 = dy.reshape(-1, dy.shape[-1])                        # (N, Cout)
    dW += x2.T @ dy2                                          # (Cin, Cout)
    if db is not None:
        db += dy2.sum(axis=0)                                 # (Cout,)
    dx = dy2 @ W.T                                            # (N, Cin)
    return dx.reshape(*dy.shape[:-1], W.shape[0])


# --------------------------------------------------------------------------------------------------------------
# LayerNorm over the last axis: y = (x - mean) / sqrt(var + eps) * w + b, biased variance

def layernorm_forward(x, w, b):
    xp = array_module(x)
    mean = x.mean(axis=-1, keepdims=True)                     # (B, T, 1)
    xhat = x - mean                                           # (B, T, C)
    var = (xhat * xhat).mean(axis=-1, keepdims=True)          # (B, T, 1) biased
    rstd = 1.0 / xp.sqrt(var + LN_EPS)                        # (B, T, 1)
    xhat *= rstd                                              # (B, T, C) normalized
    out = xhat * w
    out += b
    return out, (xhat, rstd, w)


def layernorm_backward(dout, cache, dw, db):
    """With g = dout * w:  dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).

    (The mean subtraction removes the component along the all-ones direction, the second term the
    component along xhat: the two directions the normalization is invariant to.)
    """
    xhat, rstd, w = cache
    axes = tuple(range(dout.ndim - 1))
    dw += (dout * xhat).sum(axis=axes)                        # (C,)
    db += dout.sum(axis=axes)                                 # (C,)
    g = dout * w                                              # (B, T, C)
    dx = g - g.mean(axis=-1, keepdims=True)
    dx -= xhat * (g * xhat).mean(axis=-1, keepdims=True)
    dx *= rstd
    return dx


# --------------------------------------------------------------------------------------------------------------
# GELU, tanh approximation: y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)

def gelu_forward(x):
    """Written to allocate few temporaries (each large temporary costs a pass over fresh memory)."""
    xp = array_module(x)
    u = x * x
    u *= 0.044715 * GELU_C
    u += GELU_C
    u *= x                                                    # u = c (x + 0.044715 x^3)
    t = xp.tanh(u, out=u)                                     # t = tanh(u), in place
    y = x * 0.5
    y += y * t                                                # 0.5 x (1 + t)
    return y, (x, t)


def gelu_backward(dout, cache):
    """dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2)."""
    xp = array_module(dout)
    x, t = cache
    d = x * x
    d *= 3 * 0.044715 * GELU_C
    d += GELU_C                                               # c (1 + 3 * 0.044715 x^2) = du/dx
    s = t * t
    xp.subtract(1.0, s, out=s)                                # 1 - t^2
    d *= s
    d *= x
    d += 1.0
    d += t
    d *= dout
    d *= 0.5                                                  # 0.5 (1 + t + x (1 - t^2) du/dx) * dout
    return d


# --------------------------------------------------------------------------------------------------------------
# Causal multi-head self-attention on already projected q, k, v

def _split_heads(x, n_heads):
    B, T, C = x.shape
    return x.reshape(B, T, n_heads, C // n_heads).transpose(0, 2, 1, 3)   # (B, NH, T, hs) view


def _merge_heads(x):
    B, NH, T, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, NH * hs)                # (B, T, C) copy


def attention_forward(q, k, v, n_heads):
    """y = softmax(q k^T / sqrt(hs) + causal mask) v, head by head.

    q, k, v: (B, T, C) with the heads side by side along C (head h owns columns h*hs:(h+1)*hs).
    On a tensor-parallel rank these are the local NH/tp heads, C/tp columns; nothing else changes.
    """
    xp = array_module(q)
    B, T, C = q.shape
    hs = C // n_heads
    qh = xp.ascontiguousarray(_split_heads(q, n_heads))       # (B, NH, T, hs) copies: contiguous heads make
    qh *= 1.0 / math.sqrt(hs)                                 # the batched GEMMs faster; q carries the scale
    kh = xp.ascontiguousarray(_split_heads(k, n_heads))
    vh = xp.ascontiguousarray(_split_heads(v, n_heads))
    att = qh @ kh.transpose(0, 1, 3, 2)                       # (B, NH, T, T) scores / sqrt(hs)
    mask = xp.triu(xp.full((T, T), -xp.inf, dtype=att.dtype), k=1)   # (T, T) -inf above the diagonal
    att += mask                                               # causal: position t sees 0..t
    att -= att.max(axis=-1, keepdims=True)                    # softmax over keys, in place
    xp.exp(att, out=att)
    att *= 1.0 / att.sum(axis=-1, keepdims=True)
    yh = att @ vh                                             # (B, NH, T, hs)
    return _merge_heads(yh), (qh, kh, vh, att)


def attention_backward(dy, cache):
    """Returns dq, dk, dv (each (B, T, C)).

    With P = softmax(S), S = q k^T / sqrt(hs), y = P v:
        dv = P^T dy;  dP = dy v^T;  dS = P * (dP - rowsum(dP * P));  dq = dS k / sqrt(hs);  dk = dS^T q / sqrt(hs)
    Masked entries have P = 0, hence dS = 0: the mask needs no backward of its own.
    """
    qh, kh, vh, att = cache                                   # qh holds q / sqrt(hs)
    xp = array_module(dy)
    n_heads, hs = qh.shape[1], qh.shape[3]
    dyh = xp.ascontiguousarray(_split_heads(dy, n_heads))     # (B, NH, T, hs)
    dvh = att.transpose(0, 1, 3, 2) @ dyh                     # (B, NH, T, hs)
    dS = dyh @ vh.transpose(0, 1, 3, 2)                       # (B, NH, T, T) dP
    rowdot = xp.einsum("bhij,bhij->bhi", dS, att)[..., None]  # (B, NH, T, 1) sum_j dP * P, no temporary
    dS -= rowdot                                              # softmax backward, in place
    dS *= att
    dS *= 1.0 / math.sqrt(hs)
    dqh = dS @ kh                                             # (B, NH, T, hs)
    dkh = dS.transpose(0, 1, 3, 2) @ qh                       # (B, NH, T, hs) = dS^T q / sqrt(hs)
    dkh *= math.sqrt(hs)                                      # qh carries 1/sqrt(hs); dk needs q itself
    return _merge_heads(dqh), _merge_heads(dkh), _merge_heads(dvh)


# --------------------------------------------------------------------------------------------------------------
# Softmax cross-entropy, mean over all N = B*T positions (natural log)

def cross_entropy_forward(logits, targets):
    """loss = mean_n [ logsumexp(logits[n]) - logits[n, targets[n]] ].  logits: (B, T, V), targets: (B, T)."""
    xp = array_module(logits)
    V = logits.shape[-1]
    z = logits.reshape(-1, V)                                 # (N, V) view
    tgt = targets.reshape(-1)                                 # (N,)
    rows = xp.arange(z.shape[0])
    m = z.max(axis=1, keepdims=True)                          # (N, 1)
    probs = z - m                                             # (N, V) shifted logits
    zt = probs[rows, tgt]                                     # (N,) shifted target logits
    xp.exp(probs, out=probs)
    s = probs.sum(axis=1)                                     # (N,)
    loss = (xp.log(s) - zt).mean()
    probs /= s[:, None]                                       # softmax
    return loss, (probs, tgt, rows, logits.shape)


def cross_entropy_backward(dloss, cache):
    """dlogits = dloss * (softmax(logits) - onehot(targets)) / N."""
    probs, tgt, rows, shape = cache
    N = probs.shape[0]
    dz = probs * (dloss / N)                                  # (N, V)
    dz[rows, tgt] -= dloss / N
    return dz.reshape(shape)
