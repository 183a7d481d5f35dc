"""The layers of a GPT-2-style Transformer as plain formulas, each a hand-written forward/backward pair.

    *_forward(inputs..., params...) -> (out, cache)
    *_backward(dout, cache, dparams...) -> dinputs

Weight gradients are accumulated with `+=` into arrays the caller owns (a grads dict), so gradient
accumulation over micro-batches and tensor-parallel shards compose without extra code. The layers know
nothing about parallelism: the tensor-parallel code calls the same functions on local shards
(a column-split linear is `linear_forward` on W[:, part]; head-split attention is `attention_forward`
on the local heads).

This is the reference a reader checks against the math, and the one the serial model (hsgd.model.serial) runs.
hsgd.model.kernels holds the same functions tuned for speed (preallocated buffers, threads, causal blocks), and
hsgd.model.ops is where the models take those from; tests/test_kernels.py checks that both give the same numbers.

Legend: B batch, T sequence, C d_model (C/tp on a TP shard), NH heads, hs head size, F d_ff, V vocab,
N = B*T rows.

Arrays may be NumPy or CuPy; each function computes with the module its inputs belong to.
"""
import math

from hsgd.model.backend import array_module, scatter_add

LN_EPS = 1e-5
GELU_C = math.sqrt(2.0 / math.pi)


# --------------------------------------------------------------------------------------------------------------
# The residual connection: y = x + f(x)

def residual_forward(x, o):
    """y = x + o: the residual stream x plus a sublayer's output o = f(x)."""
    return x + o


def residual_backward(dout, dbranch):
    """y = x + f(x) reads x twice, through the skip and through f, so the gradient of x is the sum of both paths:
    dL/dx = dout (the skip: dy/dx = 1) + dbranch (dout carried back through f to x)."""
    return dout + dbranch


# --------------------------------------------------------------------------------------------------------------
# Embedding: x = wte[idx] + wpe[:T]

def embedding_forward(idx, wte, wpe):
    """x[b, t] = wte[idx[b, t]] + wpe[t]: a token's row plus its position's row."""
    T = idx.shape[1]
    return wte[idx] + wpe[:T], idx                            # (B, T, C)


def embedding_backward(dout, cache, dwte, dwpe):
    """x[b, t] depends on wte[idx[b, t]] and wpe[t] with derivative 1, so
        dwte[v] += sum of dout[b, t] over the positions with idx[b, t] = v;   dwpe[t] += sum_b dout[b, t]."""
    idx = cache                                               # (B, T)
    B, T, C = dout.shape
    dwpe[:T] += dout.sum(axis=0)                              # (T, C)
    scatter_add(dwte, idx.reshape(-1), dout.reshape(-1, C))   # (N,) rows -> (V, C), repeated tokens adding up


# --------------------------------------------------------------------------------------------------------------
# Linear: y = x @ W + b, with W stored (in, out)

def linear_forward(x, W, b=None):
    """y = x W + b over the last axis. x: (..., Cin), W: (Cin, Cout), b: (Cout,) or None."""
    x2 = x.reshape(-1, x.shape[-1])                           # (N, Cin)
    y = x2 @ W if b is None else x2 @ W + b                   # (N, Cout)
    return y.reshape(*x.shape[:-1], W.shape[1]), (x2, W)


def linear_backward(dy, cache, dW, db=None):
    """From y[n, j] = sum_i x[n, i] W[i, j] + b[j]:
        dW += x^T dy  (dW[i, j] = sum_n x[n, i] dy[n, j]);  db += sum_n dy[n];  dx = dy W^T.
    Its two halves: linear_weight_grad (dW, db) and linear_input_grad (dx), which a zero-bubble pipeline runs at
    different times (hsgd.pp.schedules)."""
    linear_weight_grad(dy, cache, dW, db)
    return linear_input_grad(dy, cache)


def linear_input_grad(dy, cache):
    """dx = dy W^T (..., Cin)."""
    x2, W = cache                                             # (N, Cin), (Cin, Cout)
    return (dy.reshape(-1, dy.shape[-1]) @ W.T).reshape(*dy.shape[:-1], W.shape[0])


def linear_weight_grad(dy, cache, dW, db=None):
    """dW += x^T dy;  db += sum_n dy[n]."""
    x2, _ = cache
    dy2 = dy.reshape(-1, dy.shape[-1])                        # (N, Cout)
    dW += x2.T @ dy2                                          # (Cin, Cout)
    if db is not None:
        db += dy2.sum(axis=0)                                 # (Cout,)


# --------------------------------------------------------------------------------------------------------------
# LayerNorm over the last axis: y = (x - mean) / sqrt(var + eps) * w + b, biased variance

def layernorm_forward(x, w, b):
    """xhat = (x - mean) * rstd, rstd = 1 / sqrt(var + eps), over the last axis;  y = xhat * w + b."""
    xp = array_module(x)
    xc = x - x.mean(axis=-1, keepdims=True)                   # (..., C) centred
    rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + LN_EPS)     # (..., 1)
    xhat = xc * rstd                                          # (..., C) normalized
    return xhat * w + b, (xhat, rstd, w)


def layernorm_backward(dout, cache, dw, db):
    """dw += sum over rows of dout * xhat;  db += sum over rows of dout;  with g = dout * w (= dL/dxhat):
        dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).

    (xhat is x projected away from the all-ones direction, then scaled to unit length: the backward removes from g
    its component along the all-ones direction (mean(g)) and along xhat (mean(g * xhat), as mean(xhat^2) = 1),
    the two directions the normalization is invariant to, and applies the scale rstd.)
    """
    xhat, rstd, w = cache                                     # (..., C), (..., 1), (C,)
    C = xhat.shape[-1]
    dw += (dout * xhat).reshape(-1, C).sum(axis=0)            # (C,)
    db += dout.reshape(-1, C).sum(axis=0)                     # (C,)
    g = dout * w                                              # (..., C)
    return rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))


# --------------------------------------------------------------------------------------------------------------
# GELU, tanh approximation: y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)

def gelu_forward(x):
    """y = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), elementwise. The cache is x."""
    xp = array_module(x)
    return 0.5 * x * (1 + xp.tanh(GELU_C * (x + 0.044715 * x ** 3))), x


def gelu_backward(dout, cache):
    """dx = dout * dy/dx, by the product and chain rules with t = tanh(u), dt/du = 1 - t^2:
        dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx,   du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)."""
    x = cache
    t = array_module(x).tanh(GELU_C * (x + 0.044715 * x ** 3))
    return dout * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * GELU_C * (1 + 3 * 0.044715 * x * x))


# --------------------------------------------------------------------------------------------------------------
# Causal multi-head self-attention on already projected q, k, v

def split_heads(x, n_heads):
    """(B, T, C) -> (B, NH, T, hs), a view: head h owns columns h*hs:(h+1)*hs."""
    B, T, C = x.shape
    return x.reshape(B, T, n_heads, C // n_heads).transpose(0, 2, 1, 3)


def merge_heads(xh):
    """(B, NH, T, hs) -> (B, T, C), the heads side by side again: split_heads undone."""
    B, NH, T, hs = xh.shape
    return xh.transpose(0, 2, 1, 3).reshape(B, T, NH * hs)


def attention_forward(q, k, v, n_heads):
    """y = softmax(q k^T / sqrt(hs) + causal mask) v, for each head on its own.

    q, k, v: (B, T, C) with the heads side by side along C (split_heads). On a tensor-parallel rank these are the
    local NH/tp heads, C/tp columns; nothing else changes. The mask is -inf above the diagonal: position t attends
    to positions 0..t, and exp(-inf) = 0 gives the later ones probability 0. The cache holds P (index 3).
    """
    xp = array_module(q)
    B, T, C = q.shape
    qh, kh, vh = (split_heads(a, n_heads) for a in (q, k, v))                  # (B, NH, T, hs) each
    S = qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(C // n_heads)                 # (B, NH, T, T) scores
    S = S + xp.triu(xp.full((T, T), -xp.inf, dtype=S.dtype), k=1)              # causal mask
    P = xp.exp(S - S.max(axis=-1, keepdims=True))                              # (shifted: exp never overflows)
    P = P / P.sum(axis=-1, keepdims=True)                                      # (B, NH, T, T) softmax over keys
    return merge_heads(P @ vh), (qh, kh, vh, P)                                # (B, T, C)


def attention_backward(dy, cache):
    """dq, dk, dv, each (B, T, C). With S = q k^T / sqrt(hs), P = softmax(S) row by row, y = P v:
        dv = P^T dy;   dP = dy v^T;
        dS = P * (dP - rowsum(dP * P))     (softmax's Jacobian: dS_ij = P_ij (dP_ij - sum_k dP_ik P_ik));
        dq = dS k / sqrt(hs);   dk = dS^T q / sqrt(hs).
    Masked entries have P = 0, hence dS = 0: the mask needs no backward of its own.
    """
    qh, kh, vh, P = cache                                     # (B, NH, T, hs) x 3, (B, NH, T, T)
    hs = qh.shape[-1]
    dyh = split_heads(dy, qh.shape[1])                        # (B, NH, T, hs)
    dv = P.transpose(0, 1, 3, 2) @ dyh                        # (B, NH, T, hs)
    dP = dyh @ vh.transpose(0, 1, 3, 2)                       # (B, NH, T, T)
    dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))      # (B, NH, T, T)
    dq = dS @ kh / math.sqrt(hs)                              # (B, NH, T, hs)
    dk = dS.transpose(0, 1, 3, 2) @ qh / math.sqrt(hs)        # (B, NH, T, hs)
    return merge_heads(dq), merge_heads(dk), merge_heads(dv)


# --------------------------------------------------------------------------------------------------------------
# Softmax cross-entropy, mean over all N = B*T positions (natural log)

def cross_entropy_forward(logits, targets):
    """loss = mean_n [ logsumexp(z[n]) - z[n, targets[n]] ] = mean_n -log softmax(z[n])[targets[n]].
    logits: (B, T, V), targets: (B, T). logsumexp is taken after subtracting the row's max (no overflow)."""
    xp = array_module(logits)
    V = logits.shape[-1]
    z = logits.reshape(-1, V)                                 # (N, V)
    tgt = targets.reshape(-1)                                 # (N,)
    m = z.max(axis=1, keepdims=True)                          # (N, 1)
    lse = m + xp.log(xp.exp(z - m).sum(axis=1, keepdims=True))                # (N, 1) log sum_v exp z[n, v]
    loss = (lse[:, 0] - z[xp.arange(z.shape[0]), tgt]).mean()
    return loss, (xp.exp(z - lse), tgt, logits.shape)         # the softmax (N, V), for the backward


def cross_entropy_backward(dloss, cache):
    """d/dz[n, v] of -log softmax(z[n])[t_n] is softmax(z[n])[v] - [v = t_n]; the mean divides by N:
        dlogits = dloss * (softmax(logits) - onehot(targets)) / N."""
    probs, tgt, shape = cache                                 # (N, V), (N,)
    xp = array_module(probs)
    N = probs.shape[0]
    onehot = xp.zeros_like(probs)
    onehot[xp.arange(N), tgt] = 1.0                           # (N, V)
    return (dloss / N * (probs - onehot)).reshape(shape)
