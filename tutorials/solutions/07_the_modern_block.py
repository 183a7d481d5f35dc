"""Solutions to the exercises of chapter 7 (tutorials/07_the_modern_block.py).

    python tutorials/solutions/07_the_modern_block.py

One process, float64, tiny arrays (exercise 3 only counts, from shapes). Every check compares with hsgd, finite
differences or a formula, and stops (non-zero exit) at the first one that fails.
"""
import math
import os
import sys

import numpy as np
from threadpoolctl import threadpool_limits

from hsgd.model import flash, gradcheck, llama_layers
from hsgd.model.config import ModelConfig
from hsgd.tp import shards as tp_shards

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks
from checks import Checks, rel_err, solve  # noqa: E402

threadpool_limits(1)


# ------------------------------------------------------------------------------------------------------------ 1
def rmsnorm_backward_by_hand(dy, x, w, eps):
    """dx, dw of y = w * x r, r = 1/sqrt(mean(x^2) + eps), over the last axis. With g = dy * w and
    dr/dx_j = -r^3 x_j / C:  dx_j = r g_j - r^3 x_j (sum_i g_i x_i) / C;  dw = sum over rows of dy * x r."""
    C = x.shape[-1]
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)          # (..., 1)
    g = dy * w                                                             # (..., C) dL/dxhat
    dx = r * g - r ** 3 * x * (g * x).sum(axis=-1, keepdims=True) / C     # (..., C)
    dw = (dy * x * r).reshape(-1, C).sum(axis=0)                           # (C,)
    return dx, dw


def exercise_1(check):
    """RMSNorm's backward by hand."""
    rng = np.random.default_rng(1)
    x, R = rng.standard_normal((3, 4, 10)), rng.standard_normal((3, 4, 10))     # (B, T, C), a fixed dL/dy
    w = 1.0 + 0.3 * rng.standard_normal(10)
    eps = llama_layers.RMS_EPS
    dx, dw = rmsnorm_backward_by_hand(R, x, w, eps)

    def loss():
        return float(np.sum(w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * R))

    check("by hand: dx, dw vs finite differences",
          gradcheck.fd_error(loss, [x, w], [dx, dw], h=1e-4, order=4, measure="array"), 1e-7)
    dw_h = np.zeros(10)
    dx_h = llama_layers.rmsnorm_backward(R, llama_layers.rmsnorm_forward(x, w)[1], dw_h)
    check("by hand: dx, dw vs llama_layers.rmsnorm_backward", max(rel_err(dx, dx_h), rel_err(dw, dw_h)), 1e-13)
    worst = 0.0
    for _ in range(5):                                  # eps = 0: x . dx = 0 whatever dL/dy
        d0, _ = rmsnorm_backward_by_hand(rng.standard_normal(x.shape), x, w, 0.0)
        cos = np.abs((x * d0).sum(-1)) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(d0, axis=-1))
        worst = max(worst, float(cos.max()))
    check("eps = 0: |cos(x, dx)| for 5 random dL/dy", worst, 1e-13)


# ------------------------------------------------------------------------------------------------------------ 2
def rope_interleaved(x, positions, base=llama_layers.ROPE_BASE):
    """The RoFormer / original Llama rotation: pair i is coordinates (2i, 2i + 1), turned by positions * theta_i,
    as the complex number x[2i] + i x[2i + 1] times e^{i a}. x: (..., T, hs)."""
    hs = x.shape[-1]
    a = np.asarray(positions, dtype=np.float64)[:, None] * llama_layers.rope_frequencies(hs, base)   # (T, hs/2)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * a)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def exercise_2(check):
    """Rotary positions in the other order."""
    rng = np.random.default_rng(2)
    hs, T, NH, C = 8, 12, 2, 16
    pos = np.arange(T)
    q1, k1 = rng.standard_normal(hs), rng.standard_normal(hs)
    Qm = rope_interleaved(np.broadcast_to(q1, (T, hs)), pos)                  # (T, hs) R(m) q
    Kn = rope_interleaved(np.broadcast_to(k1, (T, hs)), pos)
    S = Qm @ Kn.T                                                            # (T, T)
    check("interleaved: scores constant along diagonals (m - n)", rel_err(S[1:, 1:], S[:-1, :-1]), 1e-12)

    order = llama_layers.rope_half_order(hs)                                  # x_half = x_interleaved[..., order]
    x = rng.standard_normal((1, NH, T, hs))
    cos, sin = llama_layers.rope_angles(pos, hs)
    check("rope_forward(x[order]) == rope_interleaved(x)[order]",
          rel_err(llama_layers.rope_forward(x[..., order], cos, sin)[0], rope_interleaved(x, pos)[..., order]), 1e-13)

    # a checkpoint: W_q, W_k (C, NH hs) in the interleaved order; permute each head's columns and use rope_forward
    a = rng.standard_normal((T, C))                                          # (T, C) one sequence's input
    Wq, Wk = rng.standard_normal((C, NH * hs)), rng.standard_normal((C, NH * hs))
    cols = (np.arange(0, NH * hs, hs)[:, None] + order).reshape(-1)           # order within every head
    heads = lambda y: y.reshape(T, NH, hs).transpose(1, 0, 2)                 # (T, NH hs) -> (NH, T, hs)
    S_int = (rope_interleaved(heads(a @ Wq), pos) @ rope_interleaved(heads(a @ Wk), pos).transpose(0, 2, 1))
    q_h = llama_layers.rope_forward(heads(a @ Wq[:, cols]), cos, sin)[0]
    k_h = llama_layers.rope_forward(heads(a @ Wk[:, cols]), cos, sin)[0]
    check("converted checkpoint (W_q, W_k columns permuted): the same scores", rel_err(q_h @ k_h.transpose(0, 2, 1),
                                                                                       S_int), 1e-13)


# ------------------------------------------------------------------------------------------------------------ 3
def torchtitan_ffn_dim(dim, multiple_of, ffn_dim_multiplier):
    """torchtitan's FeedForward width: 2/3 of 4 dim, times the multiplier, rounded up to a multiple."""
    hidden = int(2 * (4 * dim) / 3)
    hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def exercise_3(check):
    """Llama 3 70B's key/value bytes on tp = 8."""
    F = torchtitan_ffn_dim(8192, 4096, 1.3)
    check.equal(f"torchtitan's F of Llama 3 70B: {F} == 28672", F, 28672)
    shape = dict(vocab_size=128256, seq_len=8192, d_model=8192, n_heads=64, n_layers=80, d_ff=F, arch="llama",
                 rope_theta=500000.0)
    gqa, mha = ModelConfig(**shape, n_kv_heads=8), ModelConfig(**shape, n_kv_heads=64)
    kv = [f"h.{i}.attn.{m}.weight" for i in range(gqa.n_layers) for m in "kv"]
    q = [f"h.{i}.attn.q.weight" for i in range(gqa.n_layers)]
    s, C, hs, L = 2, gqa.d_model, gqa.head_size, gqa.n_layers                  # bfloat16
    w = {(c.n_kv_heads, t): tp_shards.shard_numel(c, t, kv) * s for c in (gqa, mha) for t in (8, 16)}
    check.equal("GQA, tp = 8: k, v weights per rank == L 2 C (NKV/tp) hs s", w[8, 8], L * 2 * C * (8 // 8) * hs * s)
    check.equal("MHA, tp = 8: k, v weights per rank == L 2 C (C/tp) s", w[64, 8], L * 2 * C * (C // 8) * s)
    cache = {nkv: 2 * max(nkv // t, 1) * hs * gqa.seq_len * L * s for nkv, t in ((8, 8), (64, 8))}
    check.equal("k, v weights and the kv cache: MHA / GQA == NH / NKV = 8",
                (w[64, 8] // w[8, 8], cache[64] // cache[8]), (8, 8))
    check.say(f"  per rank on tp = 8, bfloat16: k, v weights {w[8, 8] / 2**20:.0f} MiB (MHA "
              f"{w[64, 8] / 2**20:.0f} MiB); kv cache of one {gqa.seq_len}-token sequence "
              f"{cache[8] / 2**20:.0f} MiB (MHA {cache[64] / 2**30:.1f} GiB)")
    tp_shards.check_tp(gqa, 16)                                  # NKV = 8 < tp = 16: replicated, allowed
    check.equal("tp = 16: k, v weights per rank stop shrinking (one whole kv head)", w[8, 16], w[8, 8])
    check.equal("tp = 16: q's weights per rank halve", tp_shards.shard_numel(gqa, 16, q) * 2,
                tp_shards.shard_numel(gqa, 8, q))


# ------------------------------------------------------------------------------------------------------------ 4
def partial(s, v):
    """One block alone: (m, l, o) = (rowmax s, rowsum e^(s - m), e^(s - m) v). s (nq, nk), v (nk, hs)."""
    m = s.max(axis=-1)
    p = np.exp(s - m[:, None])
    return m, p.sum(axis=-1), p @ v


def merge_two(a, b):
    """Two partial results of the same queries over disjoint keys, each rescaled to the larger max:
    m = max(m_a, m_b);  l = l_a e^(m_a - m) + l_b e^(m_b - m);  o = o_a e^(m_a - m) + o_b e^(m_b - m)."""
    (ma, la, oa), (mb, lb, ob) = a, b
    m = np.maximum(ma, mb)
    ea, eb = np.exp(ma - m), np.exp(mb - m)
    return m, la * ea + lb * eb, oa * ea[:, None] + ob * eb[:, None]


def exercise_4(check):
    """The online softmax merge of two blocks."""
    rng = np.random.default_rng(4)
    nq, nk, hs, cut = 5, 11, 4, 6
    s, v = 3.0 * rng.standard_normal((nq, nk)), rng.standard_normal((nk, hs))   # scores (some large), values
    P = np.exp(s - s.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)                                              # (nq, nk) the softmax over all keys
    first, second = partial(s[:, :cut], v[:cut]), partial(s[:, cut:], v[cut:])
    m, l, o = merge_two(first, second)
    check("merge of two blocks: y = o / l vs softmax(s) v", rel_err(o / l[:, None], P @ v), 1e-13)
    m2, l2, o2 = merge_two(second, first)
    check("merged in the other order: the same y", rel_err(o2 / l2[:, None], o / l[:, None]), 1e-13)
    fm, fl, fo = flash.start(np.zeros((1, 1, nq, hs)))                          # (1, 1, nq), .., (.., hs)
    for j0, j1 in ((0, cut), (cut, nk)):
        flash.merge(s[None, None, :, j0:j1], v[None, None, j0:j1], fm, fl, fo)
    y_f, lse = flash.finish(fm, fl, fo)
    check("flash.merge, the blocks one after the other: the same y", rel_err(y_f[0, 0], o / l[:, None]), 1e-13)
    check("lse = m + log l: exp(s - lse) == the probabilities", rel_err(np.exp(s - (m + np.log(l))[:, None]), P),
          1e-13)
    check("flash's lse == the merge's", rel_err(lse[0, 0], m + np.log(l)), 1e-13)
    check.holds("the merge never exponentiates above 0 (e^(m_a - m), e^(m_b - m) <= 1)",
                bool(np.all(first[0] <= m) and np.all(second[0] <= m) and math.isfinite(float(l.max()))))


if __name__ == "__main__":
    check = Checks(tol=1e-12, width=70)
    solve(check, [exercise_1, exercise_2, exercise_3, exercise_4])
