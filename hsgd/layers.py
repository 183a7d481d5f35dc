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

from .backend import array_module, parallel_rows, scatter_add

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
    B, T, C = dout.shape
    dwpe[:T] += dout.sum(axis=0)                              # (T, C)
    scatter_add(dwte, idx.reshape(-1), dout.reshape(-1, C))   # scatter-add rows: (N,) -> (V, C)


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
# q, k, v: three linears on the same input, computed as one GEMM on [Wq Wk Wv]

def qkv_forward(x, Wq, bq, Wk, bk, Wv, bv):
    """q, k, v = x Wq + bq, x Wk + bk, x Wv + bv, as one GEMM with the weights side by side (C, 3C'): one large
    matrix product is faster than three, and the parameters stay separate. Returns views q, k, v (B, T, C')."""
    xp = array_module(x)
    W = xp.concatenate((Wq, Wk, Wv), axis=1)                  # (C, 3C') a copy of the three weights
    b = xp.concatenate((bq, bk, bv))                          # (3C',)
    y, cache = linear_forward(x, W, b)                        # (B, T, 3C')
    c = Wq.shape[1]
    return y[..., :c], y[..., c:2 * c], y[..., 2 * c:], cache


def qkv_backward(dqkv, cache, dWq, dbq, dWk, dbk, dWv, dbv):
    """The adjoint of qkv_forward: dx = [dq dk dv] [Wq Wk Wv]^T, one GEMM for dx and one for the three dW.
    dqkv: (B, T, 3C'), [dq | dk | dv] side by side (attention_backward's buffer)."""
    x2, W = cache
    c = dqkv.shape[-1] // 3
    dy = dqkv.reshape(-1, 3 * c)                                        # (N, 3C')
    dW = x2.T @ dy                                                      # (C, 3C')
    db = dy.sum(axis=0)                                                 # (3C',)
    for i, (gw, gb) in enumerate(((dWq, dbq), (dWk, dbk), (dWv, dbv))):
        gw += dW[:, i * c:(i + 1) * c]
        gb += db[i * c:(i + 1) * c]
    dx = dy @ W.T                                                       # (N, C)
    return dx.reshape(*dqkv.shape[:-1], W.shape[0])


# --------------------------------------------------------------------------------------------------------------
# LayerNorm over the last axis: y = (x - mean) / sqrt(var + eps) * w + b, biased variance

def layernorm_forward(x, w, b):
    """Row blocks in parallel (backend.parallel_rows)."""
    xp = array_module(x)
    C = x.shape[-1]
    x2 = x.reshape(-1, C)                                     # (N, C)
    xhat, out = xp.empty_like(x2), xp.empty_like(x2)
    rstd = xp.empty((x2.shape[0], 1), dtype=x.dtype)          # (N, 1)

    def rows(lo, hi):
        xs, xh, r = x2[lo:hi], xhat[lo:hi], rstd[lo:hi]
        xp.subtract(xs, xs.mean(axis=-1, keepdims=True), out=xh)               # x - mean
        var = xp.einsum("nc,nc->n", xh, xh)[:, None] / C                        # biased variance, no temporary
        xp.divide(1.0, xp.sqrt(var + LN_EPS), out=r)
        xh *= r                                                                 # normalized
        xp.multiply(xh, w, out=out[lo:hi])
        out[lo:hi] += b

    parallel_rows(rows, x2.shape[0], min_rows=64)
    return out.reshape(x.shape), (xhat, rstd, w)


def layernorm_backward(dout, cache, dw, db):
    """With g = dout * w:  dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).

    (The mean subtraction removes the component along the all-ones direction, the second term the
    component along xhat: the two directions the normalization is invariant to.)
    """
    xp = array_module(dout)
    xhat, rstd, w = cache                                     # (N, C), (N, 1), (C,)
    C = xhat.shape[-1]
    d2 = dout.reshape(-1, C)                                  # (N, C)
    dw += xp.einsum("nc,nc->c", d2, xhat)                     # (C,)
    db += d2.sum(axis=0)                                      # (C,)
    dx = xp.empty_like(d2)

    def rows(lo, hi):
        g, xh = dx[lo:hi], xhat[lo:hi]
        xp.multiply(d2[lo:hi], w, out=g)                                        # g = dout * w
        m1 = g.mean(axis=-1, keepdims=True)                                     # mean(g)
        m2 = xp.einsum("nc,nc->n", g, xh)[:, None] / C                          # mean(g * xhat)
        g -= m1
        g -= xh * m2
        g *= rstd[lo:hi]

    parallel_rows(rows, d2.shape[0], min_rows=64)
    return dx.reshape(dout.shape)


# --------------------------------------------------------------------------------------------------------------
# GELU, tanh approximation: y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)

def gelu_forward(x):
    """Row blocks in parallel (backend.parallel_rows); each written with out= to allocate no temporaries."""
    xp = array_module(x)
    x2 = x.reshape(-1, x.shape[-1])
    y, t = xp.empty_like(x2), xp.empty_like(x2)

    def rows(lo, hi):
        xs, ts, ys = x2[lo:hi], t[lo:hi], y[lo:hi]
        xp.multiply(xs, xs, out=ts)
        ts *= 0.044715 * GELU_C
        ts += GELU_C
        ts *= xs                                              # u = c (x + 0.044715 x^3)
        xp.tanh(ts, out=ts)                                   # t = tanh(u)
        xp.add(ts, 1.0, out=ys)
        ys *= xs
        ys *= 0.5                                             # y = 0.5 x (1 + t)

    parallel_rows(rows, x2.shape[0])
    return y.reshape(x.shape), (x2, t)


def gelu_backward(dout, cache):
    """dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2)."""
    xp = array_module(dout)
    x2, t = cache
    g = dout.reshape(-1, x2.shape[-1])
    d = xp.empty_like(x2)

    def rows(lo, hi):
        xs, ts, ds = x2[lo:hi], t[lo:hi], d[lo:hi]
        xp.multiply(xs, xs, out=ds)
        ds *= 3 * 0.044715 * GELU_C
        ds += GELU_C                                          # c (1 + 3 * 0.044715 x^2) = du/dx
        s = ts * ts
        xp.subtract(1.0, s, out=s)                            # 1 - t^2
        ds *= s
        ds *= xs
        ds += 1.0
        ds += ts
        ds *= g[lo:hi]
        ds *= 0.5                                             # 0.5 (1 + t + x (1 - t^2) du/dx) * dout

    parallel_rows(rows, x2.shape[0])
    return d.reshape(dout.shape)


# --------------------------------------------------------------------------------------------------------------
# Causal multi-head self-attention on already projected q, k, v

def _matmul_into(a, b, out):
    """out[...] = a @ b, written straight into `out` (a strided view) where the array module allows it."""
    xp = array_module(a)
    if xp.__name__ == "numpy":
        xp.matmul(a, b, out=out)
    else:                                                     # CuPy: compute, then copy into the view
        out[...] = a @ b
    return out


def _split_heads(x, n_heads):
    B, T, C = x.shape
    return x.reshape(B, T, n_heads, C // n_heads).transpose(0, 2, 1, 3)   # (B, NH, T, hs) view


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

    def softmax(lo, hi):                                      # sequences lo..hi-1, in place
        a = att[lo:hi]
        a += mask                                             # causal: position t sees 0..t
        a -= a.max(axis=-1, keepdims=True)
        xp.exp(a, out=a)
        a *= 1.0 / a.sum(axis=-1, keepdims=True)

    parallel_rows(softmax, B, min_rows=1)
    y = xp.empty_like(q, shape=(B, T, C))                     # (B, T, C)
    _matmul_into(att, vh, _split_heads(y, n_heads))           # heads written in place: no merge copy
    return y, (qh, kh, vh, att)


def attention_backward(dy, cache, out=None):
    """Returns dq, dk, dv (each (B, T, C)): views of one buffer (B, T, 3C) laid out [dq | dk | dv], `out` if
    given (qkv_backward takes that buffer whole).

    With P = softmax(S), S = q k^T / sqrt(hs), y = P v (the cache holds q / sqrt(hs), not q):
        dv = P^T dy;  dP = dy v^T;  dS = P * (dP - rowsum(dP * P));  dq = dS k / sqrt(hs);  dk = dS^T q / sqrt(hs)
    Masked entries have P = 0, hence dS = 0: the mask needs no backward of its own.
    """
    qh, kh, vh, att = cache                                   # qh holds q / sqrt(hs)
    xp = array_module(dy)
    B, n_heads, T, hs = qh.shape
    C = n_heads * hs
    if out is None:
        out = xp.empty_like(dy, shape=(B, T, 3 * C))
    dq, dk, dv = out[..., :C], out[..., C:2 * C], out[..., 2 * C:]             # (B, T, C) views
    dyh = xp.ascontiguousarray(_split_heads(dy, n_heads))     # (B, NH, T, hs)
    _matmul_into(att.transpose(0, 1, 3, 2), dyh, _split_heads(dv, n_heads))    # dv = P^T dy, in place
    dS = dyh @ vh.transpose(0, 1, 3, 2)                       # (B, NH, T, T) dP

    def softmax_backward(lo, hi):                             # sequences lo..hi-1, in place
        d, a = dS[lo:hi], att[lo:hi]
        d -= xp.einsum("bhij,bhij->bhi", d, a)[..., None]     # dP - sum_j dP * P (einsum: no temporary)
        d *= a                                                # dS = dL/d(scores), before the 1/sqrt(hs)

    parallel_rows(softmax_backward, dS.shape[0], min_rows=1)
    dqh = _split_heads(dq, n_heads)                           # (B, NH, T, hs) views into out
    _matmul_into(dS, kh, dqh)
    dqh *= 1.0 / math.sqrt(hs)                                # dq = dS k / sqrt(hs)
    _matmul_into(dS.transpose(0, 1, 3, 2), qh, _split_heads(dk, n_heads))      # dk = dS^T q / sqrt(hs): qh
    return dq, dk, dv                                         #   holds q / sqrt(hs) already


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
