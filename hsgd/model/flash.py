"""Attention that stores no scores (FlashAttention): causal multi-head attention computed block by block with the
online softmax, keeping per query only its output y and the log-sum-exp of its scores.

Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness"; Dao 2023,
"FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning"; the online softmax: Milakov and
Gimelshein 2018, "Online normalizer calculation for softmax". The same numbers as layers.attention_forward /
attention_backward (tests/test_flash.py), the signatures of kernels.attention_forward / attention_backward (plus
block=), so that one can stand in for the other.

The online softmax. Cut the keys into blocks; for a query keep a running max m, sum l and output o, start from
m = -inf, l = 0, o = 0, and take in key block b (scores s = q k_b^T / sqrt(hs), masked entries -inf) by

    m' = max(m, rowmax s);  p = exp(s - m')
    l <- l e^(m - m') + rowsum p;  o <- o e^(m - m') + p v_b;  m <- m'

Whenever the max grows, what was summed so far is rescaled to the new max, so after the last block
l = sum_j exp(s_j - m) and o = sum_j exp(s_j - m) v_j over every key: y = o / l is softmax(s) v exactly, and no
exponent ever exceeds 0. The forward keeps lse = m + log l, one number per query.

Why lse suffices for the backward: every probability is one exp away from it, p_j = exp(s_j - m) / l =
exp(s_j - lse), so any block of P can be computed again from q, k and lse alone; and the row sum in softmax's
Jacobian, sum_j p_j dp_j with dp_j = dy . v_j, is dy . (sum_j p_j v_j) = dy . y = D, one number per query. Block
by block (FlashAttention-2's backward, outer loop over key blocks, inner over the query blocks that see them):

    p = exp(s - lse);  dv_b += p^T dy;  dp = dy v_b^T;  ds = p (dp - D)
    dq += ds k_b / sqrt(hs);  dk_b += ds^T q / sqrt(hs)

Memory: materialized attention caches P, (B, NH, T, T); this cache holds q, k, v, y by heads and lse (B, NH, T):
besides the inputs, O(B NH T) numbers instead of O(B NH T^2). The largest temporary is one block's scores,
(B, NH, block, block). Causal blocks above the diagonal are skipped, about half the work; the diagonal blocks
take the mask. Query and key blocks share one size and start at 0, so every row of a diagonal block keeps its own
key, and key block 0 (taken first) is visible to every query: m is finite after the first block (no inf - inf).

hsgd.cp.ring runs the same per-block steps (scores, merge, block_grads; start and finish) on the key blocks that
travel around the ring of context-parallel ranks.

What it leaves out: the point of FlashAttention on a GPU is that the blocks stay in on-chip memory (SRAM) between
the two products; NumPy writes every temporary to main memory, so this module shows the algorithm and its memory
bound, not the speed. No dropout, no non-causal variant.

Legend: B batch, T sequence, C d_model (C/tp on a TP shard), NH heads, hs head size, nq and nk a block's queries
and keys.
"""
import math

from hsgd.model.backend import array_module
from hsgd.model.layers import merge_heads, split_heads

BLOCK = 64                      # queries and keys per block: scores (B, NH, 64, 64) at a time


def scores(q, k, mask=None):
    """s = q k^T (+ mask): one block's scores (B, NH, nq, nk); q already carries the 1/sqrt(hs)."""
    s = q @ k.transpose(0, 1, 3, 2)                           # (B, NH, nq, nk)
    if mask is not None:
        s += mask                                             # (nq, nk) -inf after the query's position
    return s


def start(q):
    """The running (m, l, o) of queries q (B, NH, nq, hs) before any key: -inf, 0, 0."""
    xp = array_module(q)
    m = xp.full(q.shape[:-1], -xp.inf, dtype=q.dtype)         # (B, NH, nq) running max
    l = xp.zeros(q.shape[:-1], dtype=q.dtype)                 # (B, NH, nq) running sum
    o = xp.zeros_like(q)                                      # (B, NH, nq, hs) running output
    return m, l, o


def merge(s, v, m, l, o):
    """One block of scores s (B, NH, nq, nk) and its values v (B, NH, nk, hs) into the running m, l (B, NH, nq)
    and o (B, NH, nq, hs) of its queries, in place (arrays or views):
        m' = max(m, rowmax s);  p = exp(s - m');  l <- l e^(m - m') + rowsum p;  o <- o e^(m - m') + p v;  m <- m'"""
    xp = array_module(s)
    m_new = xp.maximum(m, s.max(axis=-1))                     # (B, NH, nq)
    scale = xp.exp(m - m_new)                                 # e^(m - m'): 0 at the start
    p = xp.exp(s - m_new[..., None])                          # (B, NH, nq, nk)
    l[...] = l * scale + p.sum(axis=-1)
    o[...] = o * scale[..., None] + p @ v
    m[...] = m_new


def finish(m, l, o):
    """After the last block: y = o / l (B, NH, nq, hs) and lse = m + log l (B, NH, nq), all the backward needs."""
    xp = array_module(o)
    return o / l[..., None], m + xp.log(l)


def block_grads(s, q, k, v, dy, lse, D, dq, dk, dv):
    """One block's share of the gradients, accumulated in place (arrays or views): s (B, NH, nq, nk) its scores
    (masked entries -inf), q (B, NH, nq, hs) holding q / sqrt(hs), k and v (B, NH, nk, hs), dy (B, NH, nq, hs),
    lse and D = rowsum(dy * y) (B, NH, nq):
        p = exp(s - lse);  dv += p^T dy;  dp = dy v^T;  ds = p (dp - D);  dq += ds k;  dk += ds^T q
    dq comes out times sqrt(hs) (the caller scales it once at the end); dk is exact, q carrying the 1/sqrt(hs)."""
    xp = array_module(s)
    p = xp.exp(s - lse[..., None])                            # (B, NH, nq, nk) the probabilities again
    dv += p.transpose(0, 1, 3, 2) @ dy                        # (B, NH, nk, hs)
    dp = dy @ v.transpose(0, 1, 3, 2)                         # (B, NH, nq, nk)
    ds = p * (dp - D[..., None])                              # dL/d(scores)
    dq += ds @ k                                              # (B, NH, nq, hs)
    dk += ds.transpose(0, 1, 3, 2) @ q                        # (B, NH, nk, hs)


def edges(T, block):
    """[(0, block), (block, 2 block), ..., (.., T)]: the blocks of T positions, the last one shorter if need be."""
    return [(t, min(t + block, T)) for t in range(0, T, block)]


def causal_mask(n, xp):
    """(n, n): -inf above the diagonal, 0 on and below it; a diagonal block's top-left corner (nq, nq) is the mask
    of a shorter diagonal block."""
    return xp.triu(xp.full((n, n), -xp.inf), k=1)


def attention_forward(q, k, v, n_heads, block=BLOCK):
    """y = softmax(q k^T / sqrt(hs) + causal mask) v (layers.attention_forward), by query blocks (outer) and key
    blocks (inner, those at or below the diagonal), without the (T, T) scores. q, k, v: (B, T, C), heads side by
    side along C. Returns y (B, T, C) and the cache (q / sqrt(hs), k, v by heads, y itself, lse (B, NH, T)): y is
    the array handed on, which the output projection keeps too (one copy held, not two)."""
    xp = array_module(q)
    B, T, C = q.shape
    hs = C // n_heads
    qh = xp.ascontiguousarray(split_heads(q, n_heads)) * (1.0 / math.sqrt(hs))     # (B, NH, T, hs) q / sqrt(hs)
    kh, vh = (xp.ascontiguousarray(split_heads(a, n_heads)) for a in (k, v))      # (B, NH, T, hs) each
    yh = xp.empty_like(qh)                                                          # (B, NH, T, hs)
    lse = xp.empty_like(qh, shape=qh.shape[:-1])                                    # (B, NH, T)
    mask = causal_mask(min(block, T), xp)                                           # a diagonal block's mask
    for i0, i1 in edges(T, block):                                                  # queries i0..i1-1
        m, l, o = start(qh[:, :, i0:i1])                                            # (B, NH, nq), .., (.., hs)
        for j0, j1 in edges(i1, block):                                             # keys j0..j1-1, j0 <= i0
            s = scores(qh[:, :, i0:i1], kh[:, :, j0:j1], mask[:i1 - i0, :j1 - j0] if j0 == i0 else None)
            merge(s, vh[:, :, j0:j1], m, l, o)
        yh[:, :, i0:i1], lse[:, :, i0:i1] = finish(m, l, o)
    y = merge_heads(yh)                                                             # (B, T, C)
    return y, (qh, kh, vh, y, lse)


def attention_backward(dy, cache, out=None, block=BLOCK):
    """dq, dk, dv (B, T, C), views of one buffer (B, T, 3C) laid out [dq | dk | dv] (`out` if given), as
    layers.attention_backward gives them, each block's probabilities computed again from lse. The blocks need not
    be the forward's: lse and D are per query."""
    qh, kh, vh, y, lse = cache                                # (B, NH, T, hs) x 3 (qh = q / sqrt(hs)), (B, T, C),
    xp = array_module(dy)                                     # (B, NH, T)
    B, n_heads, T, hs = qh.shape
    yh = split_heads(y, n_heads)                              # (B, NH, T, hs) a view
    C = n_heads * hs
    if out is None:
        out = xp.empty_like(dy, shape=(B, T, 3 * C))
    out[...] = 0                                              # the gradients are sums over blocks
    dqh, dkh, dvh = (split_heads(out[..., i * C:(i + 1) * C], n_heads) for i in range(3))   # (B, NH, T, hs) views
    dyh = xp.ascontiguousarray(split_heads(dy, n_heads))      # (B, NH, T, hs)
    D = (dyh * yh).sum(axis=-1)                               # (B, NH, T) rowsum(dy * y)
    mask = causal_mask(min(block, T), xp)
    for j0, j1 in edges(T, block):                            # keys j0..j1-1: dk, dv of the block stay put
        j = slice(j0, j1)
        for i0, i1 in edges(T, block)[j0 // block:]:          # queries i0..i1-1, i0 >= j0
            i = slice(i0, i1)
            s = scores(qh[:, :, i], kh[:, :, j], mask[:i1 - i0, :j1 - j0] if i0 == j0 else None)
            block_grads(s, qh[:, :, i], kh[:, :, j], vh[:, :, j], dyh[:, :, i], lse[:, :, i], D[:, :, i],
                        dqh[:, :, i], dkh[:, :, j], dvh[:, :, j])
    dqh *= 1.0 / math.sqrt(hs)                                # dq = ds k / sqrt(hs)
    return out[..., :C], out[..., C:2 * C], out[..., 2 * C:]
