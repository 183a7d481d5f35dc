"""The layers of hsgd.model.layers tuned for speed: the same functions, signatures and results, written for the machine.

hsgd.model.layers holds each layer as its plain formulas; this module holds the versions the models run (hsgd.model.ops
chooses them): the split llm.c makes between its reference and its fast path. tests/test_kernels.py checks that
each gives the plain one's outputs and gradients (float64, ~1e-12) on one thread and on two. A forward's cache is
consumed by the same module's backward; what it holds may differ from the plain one's. The speed tricks:
  * ufuncs with `out=` into preallocated arrays, updates in place, row sums with einsum: no temporary per operator;
  * GELU in pieces of PIECE elements that stay in the CPU's cache, its derivative computed in the forward pass
    while x and tanh are in cache (the cache is one array, the backward one multiplication); SwiGLU's sigmoid as
    one exp, computed once in each pass;
  * rows or sequences split over CPU threads (threads.parallel_rows), attention's pieces with one BLAS thread each;
  * causal attention by row blocks (causal_blocks), skipping the blocks the mask zeroes; heads written in place;
  * q, k, v as one GEMM on [Wq Wk Wv] (qkv_forward, qkv_backward; attention_backward(..., out=) fills its buffer).

Legend: B batch, T sequence, C d_model (C/tp on a TP shard), NH heads, hs head size, F d_ff, V vocab,
N = B*T rows. Arrays may be NumPy or CuPy (threads are for NumPy arrays only).
"""
import math

import numpy as np

from hsgd.model.backend import array_module, scatter_add
from hsgd.model.layers import GELU_C, LN_EPS, split_heads
from hsgd.model.threads import one_blas_thread, parallel_rows


# --------------------------------------------------------------------------------------------------------------
# Embedding: x = wte[idx] + wpe[:T]

def embedding_forward(idx, wte, wpe):
    """x[b, t] = wte[idx[b, t]] + wpe[t] (layers.embedding_forward), the positions added in place."""
    B, T = idx.shape
    out = wte[idx]                                            # (B, T, C) gather: a copy
    out += wpe[:T]                                            # (B, T, C) broadcast over B
    return out, (idx, wte.shape[0])


def embedding_backward(dout, cache, dwte, dwpe):
    """dwte[v] += sum of dout over the positions holding token v; dwpe[t] += sum over the batch
    (layers.embedding_backward; backend.scatter_add sums runs of repeated tokens at once)."""
    idx, V = cache
    B, T, C = dout.shape
    dwpe[:T] += dout.sum(axis=0)                              # (T, C)
    scatter_add(dwte, idx.reshape(-1), dout.reshape(-1, C))   # scatter-add rows: (N,) -> (V, C)


# --------------------------------------------------------------------------------------------------------------
# Linear: y = x @ W + b, with W stored (in, out)

def linear_forward(x, W, b=None):
    """y = x W + b over the last axis (layers.linear_forward), the bias added in place."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])                           # (N, Cin) view
    y = x2 @ W                                                # (N, Cout) one GEMM
    if b is not None:
        y += b
    return y.reshape(*lead, W.shape[1]), (x2, W)


def linear_backward(dy, cache, dW, db=None):
    """dx = dy W^T;  dW += x^T dy;  db += sum_rows dy (layers.linear_backward): the two halves below."""
    linear_weight_grad(dy, cache, dW, db)
    return linear_input_grad(dy, cache)


def linear_input_grad(dy, cache):
    """dx = dy W^T (the "B" half of linear_backward: what the layer below needs)."""
    x2, W = cache
    dx = dy.reshape(-1, dy.shape[-1]) @ W.T                   # (N, Cin)
    return dx.reshape(*dy.shape[:-1], W.shape[0])


def linear_weight_grad(dy, cache, dW, db=None):
    """dW += x^T dy;  db += sum_rows dy (the "W" half: nothing below waits for it)."""
    x2, _ = cache
    dy2 = dy.reshape(-1, dy.shape[-1])                        # (N, Cout)
    dW += x2.T @ dy2                                          # (Cin, Cout)
    if db is not None:
        db += dy2.sum(axis=0)                                 # (Cout,)


# --------------------------------------------------------------------------------------------------------------
# q, k, v: three linears on the same input, computed as one GEMM on [Wq Wk Wv]

def fused_forward(x, weights, biases):
    """y_j = x W_j + b_j for several linears reading the same x, as one GEMM with the weights side by side
    (C, sum of widths): one large matrix product is faster than several, and the parameters stay separate.
    biases: one per weight, or all None. Returns the views y_j (..., width_j) and the cache."""
    xp = array_module(x)
    W = xp.concatenate(weights, axis=1) if len(weights) > 1 else weights[0]     # (C, sum C_j) a copy of them
    b = None if biases[0] is None else xp.concatenate(biases) if len(biases) > 1 else biases[0]
    y, (x2, _) = linear_forward(x, W, b)                      # (..., sum C_j)
    ends = [0]
    for w in weights:
        ends.append(ends[-1] + w.shape[1])
    return [y[..., lo:hi] for lo, hi in zip(ends, ends[1:])], (x2, tuple(weights))   # the cache holds the
                                                                                     # parameters, not the copy


def fused_input_grad(dy, cache):
    """dx = [dy_1 .. dy_n] [W_1 .. W_n]^T (..., C): one GEMM. dy: the outputs' gradients side by side."""
    x2, weights = cache
    W = array_module(x2).concatenate(weights, axis=1) if len(weights) > 1 else weights[0]   # again, not cached
    dx = dy.reshape(-1, W.shape[1]) @ W.T                               # (N, C)
    return dx.reshape(*dy.shape[:-1], W.shape[0])


def fused_weight_grad(dy, cache, *grads):
    """[dW_1 .. dW_n] += x^T [dy_1 .. dy_n] as one GEMM, and the biases' row sums. grads: (dW_1, db_1, ..., dW_n,
    db_n), the db's None without biases."""
    x2, weights = cache
    dy2 = dy.reshape(-1, dy.shape[-1])                                  # (N, sum C_j)
    dW = x2.T @ dy2                                                     # (C, sum C_j)
    db = dy2.sum(axis=0) if grads[1] is not None else None              # (sum C_j,)
    lo = 0
    for w, gw, gb in zip(weights, grads[0::2], grads[1::2]):
        hi = lo + w.shape[1]
        gw += dW[:, lo:hi]
        if gb is not None:
            gb += db[lo:hi]
        lo = hi


def qkv_forward(x, Wq, bq, Wk, bk, Wv, bv):
    """q, k, v = x Wq + bq, x Wk + bk, x Wv + bv as one GEMM (fused_forward): views (B, T, C'), (B, T, K'),
    (B, T, K') (K' = C' but with grouped-query attention); the biases all None without biases."""
    (q, k, v), cache = fused_forward(x, (Wq, Wk, Wv), (bq, bk, bv))
    return q, k, v, cache


def qkv_backward(dqkv, cache, dWq, dbq, dWk, dbk, dWv, dbv):
    """The adjoint of qkv_forward: dx = [dq dk dv] [Wq Wk Wv]^T, one GEMM for dx and one for the three dW.
    dqkv: (B, T, C' + 2K'), [dq | dk | dv] side by side (attention_backward's buffer). The two halves below."""
    qkv_weight_grad(dqkv, cache, dWq, dbq, dWk, dbk, dWv, dbv)
    return qkv_input_grad(dqkv, cache)


def qkv_input_grad(dqkv, cache):
    """dx = [dq dk dv] [Wq Wk Wv]^T (N, C): one GEMM."""
    return fused_input_grad(dqkv, cache)


def qkv_weight_grad(dqkv, cache, dWq, dbq, dWk, dbk, dWv, dbv):
    """[dWq dWk dWv] += x^T [dq dk dv] as one GEMM, and the three biases' row sums."""
    fused_weight_grad(dqkv, cache, dWq, dbq, dWk, dbk, dWv, dbv)


# --------------------------------------------------------------------------------------------------------------
# LayerNorm over the last axis: y = (x - mean) / sqrt(var + eps) * w + b, biased variance

def layernorm_forward(x, w, b):
    """y = (x - mean) * rstd * w + b (layers.layernorm_forward): row blocks in parallel (threads.parallel_rows), each
    written with out= and einsum row sums. The cache holds xhat (N, C) and rstd (N, 1)."""
    xp = array_module(x)
    C = x.shape[-1]
    x2 = x.reshape(-1, C)                                     # (N, C)
    xhat, out = xp.empty_like(x2), xp.empty_like(x2)
    rstd = xp.empty((x2.shape[0], 1), dtype=x.dtype)          # (N, 1)

    def rows(lo, hi):
        xs, xh, r = x2[lo:hi], xhat[lo:hi], rstd[lo:hi]
        xp.subtract(xs, xp.einsum("nc->n", xs)[:, None] / C, out=xh)          # x - mean (einsum: faster row sums)
        var = xp.einsum("nc,nc->n", xh, xh)[:, None] / C                        # biased variance, no temporary
        xp.divide(1.0, xp.sqrt(var + LN_EPS), out=r)
        xh *= r                                                                 # normalized
        xp.multiply(xh, w, out=out[lo:hi])
        out[lo:hi] += b

    parallel_rows(rows, x2.shape[0], min_rows=max(1, (1 << 17) // C), xp=xp)   # pieces of >= 128K elements
    return out.reshape(x.shape), (xhat, rstd, w)


def layernorm_backward(dout, cache, dw, db):
    """With g = dout * w:  dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) (layers.layernorm_backward derives
    it), row blocks in parallel, g computed in dx's own rows."""
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
        m1 = xp.einsum("nc->n", g)[:, None] / C                                 # mean(g)
        m2 = xp.einsum("nc,nc->n", g, xh)[:, None] / C                          # mean(g * xhat)
        g -= m1
        g -= xh * m2
        g *= rstd[lo:hi]

    parallel_rows(rows, d2.shape[0], min_rows=max(1, (1 << 17) // C), xp=xp)
    return dx.reshape(dout.shape)


# --------------------------------------------------------------------------------------------------------------
# GELU, tanh approximation: y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)

PIECE = 1 << 16         # elements an elementwise pass works on at a time: its temporaries stay in the CPU's cache


def gelu_forward(x):
    """y and, for the backward pass, the derivative dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx, t = tanh(u),
    du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2). Computing the derivative here, while x and t are in cache, makes
    the backward pass one multiplication, and the cache one array (N, F) instead of the input and t.
    Row blocks in parallel (threads.parallel_rows), each in pieces of PIECE elements, all written with out=."""
    xp = array_module(x)
    x2 = x.reshape(-1, x.shape[-1])                           # (N, F)
    y, d = xp.empty_like(x2), xp.empty_like(x2)
    r = max(1, PIECE // x2.shape[1]) if xp.__name__ == "numpy" else x2.shape[0]   # rows per piece

    def rows(lo, hi):
        t, s = xp.empty_like(x2[:r]), xp.empty_like(x2[:r])  # scratch for one piece
        for a in range(lo, hi, r):
            b = min(a + r, hi)
            xs, ys, ds, ts, ss = x2[a:b], y[a:b], d[a:b], t[:b - a], s[:b - a]
            xp.multiply(xs, xs, out=ss)                                          # x^2
            xp.multiply(ss, 0.044715 * GELU_C, out=ts)
            ts += GELU_C
            ts *= xs                                                             # u
            xp.tanh(ts, out=ts)                                                  # t = tanh(u)
            xp.add(ts, 1.0, out=ys)
            ys *= xs
            ys *= 0.5                                                            # y = 0.5 x (1 + t)
            ss *= 3 * 0.044715 * GELU_C
            ss += GELU_C                                                         # du/dx
            xp.multiply(ts, ts, out=ds)
            xp.subtract(1.0, ds, out=ds)                                         # 1 - t^2
            ds *= ss
            ds *= xs
            ds += 1.0
            ds += ts
            ds *= 0.5                                                            # dy/dx

    parallel_rows(rows, x2.shape[0], xp=xp)
    return y.reshape(x.shape), d


def gelu_backward(dout, cache):
    """dx = dout * dy/dx (the derivative gelu_forward cached)."""
    xp = array_module(dout)
    d = cache                                                 # (N, F)
    dout2 = dout.reshape(d.shape)
    dx = xp.empty_like(d)
    parallel_rows(lambda lo, hi: xp.multiply(dout2[lo:hi], d[lo:hi], out=dx[lo:hi]), d.shape[0],
                  min_rows=max(1, (1 << 20) // d.shape[1]), xp=xp)    # one pass: only large arrays gain
    return dx.reshape(dout.shape)


# --------------------------------------------------------------------------------------------------------------
# SwiGLU: h = silu(g) * u, silu(g) = g sigmoid(g)

def _sigmoid_into(g, out):
    """sigmoid(g) = 1 / (1 + exp(-g)) into out: one exp, no where (llama_layers.sigmoid's exp of -|g| and its where
    cost about four times as much). For g below about -709 (float64; -88 in float32) exp(-g) overflows to inf and
    the result is 0, sigmoid's value to the format's precision; the overflow is expected, so not warned of. The
    relative error stays that of exp and one division for every g ((1 + tanh(g/2)) / 2 would cancel for g < 0)."""
    xp = array_module(g)
    with np.errstate(over="ignore"):
        xp.negative(g, out=out)
        xp.exp(out, out=out)
    out += 1.0
    xp.reciprocal(out, out=out)
    return out


def swiglu_forward(gate_pre, up_pre):
    """h = silu(g) u (llama_layers.swiglu_forward), in row blocks on threads, each written with out=. The cache is
    (g, u), as the plain one's."""
    xp = array_module(gate_pre)
    g2, u2 = gate_pre.reshape(-1, gate_pre.shape[-1]), up_pre.reshape(-1, up_pre.shape[-1])   # (N, F) views
    h = xp.empty(g2.shape, dtype=g2.dtype)

    def rows(lo, hi):
        _sigmoid_into(g2[lo:hi], h[lo:hi])                  # s
        h[lo:hi] *= g2[lo:hi]                               # silu(g) = g s
        h[lo:hi] *= u2[lo:hi]                               # h = silu(g) u

    parallel_rows(rows, g2.shape[0], xp=xp)
    return h.reshape(gate_pre.shape), (gate_pre, up_pre)


def swiglu_backward(dh, cache):
    """(dg, du) = (dh u s (1 + g (1 - s)), dh g s) with s = sigmoid(g) computed once (llama_layers.swiglu_backward
    computes it three times)."""
    gate_pre, up_pre = cache
    xp = array_module(dh)
    F = gate_pre.shape[-1]
    g2, u2, dh2 = gate_pre.reshape(-1, F), up_pre.reshape(-1, F), dh.reshape(-1, F)
    dg, du = xp.empty(g2.shape, dtype=dh.dtype), xp.empty(g2.shape, dtype=dh.dtype)

    def rows(lo, hi):
        s, a, b = dg[lo:hi], du[lo:hi], g2[lo:hi]
        _sigmoid_into(b, s)                                  # s
        xp.multiply(b, s, out=a)                             # silu(g) = g s
        t = xp.subtract(1.0, s)                              # 1 - s
        t *= b
        t += 1.0
        s *= t                                               # silu'(g) = s (1 + g (1 - s))
        s *= u2[lo:hi]
        s *= dh2[lo:hi]                                      # dg = dh u silu'(g)
        a *= dh2[lo:hi]                                      # du = dh silu(g)

    parallel_rows(rows, g2.shape[0], xp=xp)
    return dg.reshape(dh.shape), du.reshape(dh.shape)


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


def _sequences_per_piece(xp, B, n_heads, T):
    """Attention is done a few sequences at a time. On the CPU a piece is small enough that its scores
    (n, NH, T, T) stay in cache from the first product through the softmax to the second, and the pieces run
    on parallel_rows' threads with one BLAS thread each (threads.one_blas_thread): for these small matrices
    that is about twice as fast as whole-batch products split over the cores. A GPU takes the batch at once."""
    if xp.__name__ != "numpy":
        return B
    return max(1, min(B, (1 << 18) // (n_heads * T * T)))                # pieces of up to 256K scores


def causal_blocks(T, min_rows=64):
    """Edges of the row blocks attention is computed in: [0, T/nb, 2T/nb, ..., T], nb = T // min_rows (at most 4).

    The causal mask zeroes every score above the diagonal. Cut the (T, T) matrix into nb x nb blocks: the blocks
    above the diagonal blocks are all masked, so row block i needs only the keys 0 .. (i+1)T/nb - 1. Skipping the
    rest leaves (nb + 1) / (2 nb) of the products and of the softmax's work: 3/4 for nb = 2, 5/8 for nb = 4.
    (FlashAttention skips masked blocks the same way.) Blocks narrower than min_rows cost more in overhead than
    they save, so short sequences use one block."""
    nb = max(1, min(4, T // min_rows))
    return [T * i // nb for i in range(nb + 1)]


def attention_forward(q, k, v, n_heads):
    """y = softmax(q k^T / sqrt(hs) + causal mask) v, head by head (layers.attention_forward), a few sequences at a
    time on threads, by causal blocks, each head's output written in place into y.

    q, k, v: (B, T, C) with the heads side by side along C (head h owns columns h*hs:(h+1)*hs).
    On a tensor-parallel rank these are the local NH/tp heads, C/tp columns; nothing else changes.
    Row block by row block (causal_blocks): a block of queries r0..r1-1 is scored against keys 0..r1-1 only; the
    skipped probabilities are set to 0, so the cache holds the whole matrix P.
    """
    xp = array_module(q)
    B, T, C = q.shape
    hs = C // n_heads
    qh, kh, vh = (xp.empty_like(q, shape=(B, n_heads, T, hs)) for _ in range(3))    # contiguous heads: faster
    att = xp.empty_like(q, shape=(B, n_heads, T, T))                                 # GEMMs; kept for backward
    y = xp.empty_like(q)                                                             # (B, T, C)
    yh = split_heads(y, n_heads)                             # (B, NH, T, hs) view: heads written in place
    mask = xp.triu(xp.full((T, T), -xp.inf, dtype=att.dtype), k=1)   # (T, T) -inf above the diagonal
    n, edges = _sequences_per_piece(xp, B, n_heads, T), causal_blocks(T)

    def sequences(lo, hi):                                    # sequences lo..hi-1, n at a time
        for s in range(lo, hi, n):
            b = slice(s, min(s + n, hi))
            xp.multiply(split_heads(q[b], n_heads), 1.0 / math.sqrt(hs), out=qh[b])    # q carries the scale
            kh[b] = split_heads(k[b], n_heads)
            vh[b] = split_heads(v[b], n_heads)
            for r0, r1 in zip(edges[:-1], edges[1:]):                                   # queries r0..r1-1
                a = att[b, :, r0:r1, :r1]                                               # (n, NH, r1-r0, r1)
                _matmul_into(qh[b, :, r0:r1], kh[b, :, :r1].transpose(0, 1, 3, 2), a)   # scores / sqrt(hs)
                a += mask[r0:r1, :r1]                                                   # position t sees 0..t
                a -= a.max(axis=-1, keepdims=True)
                xp.exp(a, out=a)
                a *= 1.0 / xp.einsum("bhij->bhi", a)[..., None]                         # softmax, in place
                _matmul_into(a, vh[b, :, :r1], yh[b, :, r0:r1])                         # y = P v
                att[b, :, r0:r1, r1:] = 0                                               # the skipped keys

    with one_blas_thread():
        parallel_rows(sequences, B, min_rows=1, xp=xp)
    return y, (qh, kh, vh, att)


def attention_backward(dy, cache, out=None):
    """Returns dq, dk, dv (each (B, T, C)): views of one buffer (B, T, 3C) laid out [dq | dk | dv], `out` if
    given (qkv_backward takes that buffer whole).

    The formulas of layers.attention_backward (the cache holds q / sqrt(hs), not q). Masked entries have P = 0,
    hence dS = 0: the blocks the forward skipped are skipped again. dP, dS and dq go by row blocks (queries
    r0..r1-1 against keys 0..r1-1); dv and dk by column blocks (keys c0..c1-1 are seen by queries c0..T-1 only).
    """
    qh, kh, vh, att = cache                                   # qh holds q / sqrt(hs)
    xp = array_module(dy)
    B, n_heads, T, hs = qh.shape
    C = n_heads * hs
    if out is None:
        out = xp.empty_like(dy, shape=(B, T, 3 * C))
    dq, dk, dv = out[..., :C], out[..., C:2 * C], out[..., 2 * C:]             # (B, T, C) views
    dqh, dkh, dvh = (split_heads(d, n_heads) for d in (dq, dk, dv))           # (B, NH, T, hs) views
    n, edges = _sequences_per_piece(xp, B, n_heads, T), causal_blocks(T)

    def sequences(lo, hi):                                    # sequences lo..hi-1, n at a time
        for s in range(lo, hi, n):
            b = slice(s, min(s + n, hi))
            dyh = xp.ascontiguousarray(split_heads(dy[b], n_heads))                    # (n, NH, T, hs)
            dS = xp.empty_like(att[b])                                                  # (n, NH, T, T)
            for r0, r1 in zip(edges[:-1], edges[1:]):                                   # queries r0..r1-1
                a, d = att[b, :, r0:r1, :r1], dS[:, :, r0:r1, :r1]                      # P, dP: (n, NH, rows, r1)
                _matmul_into(dyh[:, :, r0:r1], vh[b, :, :r1].transpose(0, 1, 3, 2), d)  # dP = dy v^T
                d -= xp.einsum("bhij,bhij->bhi", d, a)[..., None]                       # dP - sum_j dP * P
                d *= a                                                                  # dL/d(scores)
                _matmul_into(d, kh[b, :, :r1], dqh[b, :, r0:r1])
                dqh[b, :, r0:r1] *= 1.0 / math.sqrt(hs)                                 # dq = dS k / sqrt(hs)
            for c0, c1 in zip(edges[:-1], edges[1:]):                                   # keys c0..c1-1
                _matmul_into(att[b, :, c0:, c0:c1].transpose(0, 1, 3, 2), dyh[:, :, c0:], dvh[b, :, c0:c1])
                _matmul_into(dS[:, :, c0:, c0:c1].transpose(0, 1, 3, 2), qh[b, :, c0:], dkh[b, :, c0:c1])
                # dv = P^T dy;  dk = dS^T q / sqrt(hs) (qh holds q / sqrt(hs))

    with one_blas_thread():
        parallel_rows(sequences, B, min_rows=1, xp=xp)
    return dq, dk, dv


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
    s = probs.sum(axis=1)                                     # (N,) pairwise sums: accurate over a long V
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
