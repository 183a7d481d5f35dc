"""All-gather attention (--cp-scheme allgather): the core attention of a context-parallel rank against the keys and
values of the whole sequence, gathered.

Dubey et al. 2024 ("The Llama 3 Herd of Models") train Llama 3's long context this way: All-Gather k and v of the
whole sequence over cp_comm, score this rank's queries against all T keys with the mask of their positions, and in
the backward pass Reduce-Scatter dk, dv back to their owners. Two collectives per layer and no online softmax, but
the rank holds all T keys and values and the (T/cp x T) probabilities, and computes the masked blocks too.

With grouped-query attention the rank's NKV/tp kv heads are gathered (and their gradients reduce-scattered) as they
are, and repeated to the NH/tp query heads only for the products (hsgd.model.llama_layers.repeat_kv_forward, and
its adjoint for dk, dv).

The layout of the positions and what both cp schemes share: hsgd.cp.split. Legend as there and in hsgd.cp.ring.
"""
import math

import numpy as np

from hsgd.model.backend import array_module
from hsgd.cp.split import ContextSplit, positions
from hsgd.model.layers import merge_heads, split_heads
from hsgd.model.llama_layers import repeat_kv_backward, repeat_kv_forward


class AllGather(ContextSplit):
    """All-Gather of k and v along the sequence, attention of this rank's queries against all T keys, and the
    Reduce-Scatter of dk, dv in the backward pass (see the module docstring)."""
    keeps_probabilities = True

    def __init__(self, comm, T, balanced=True, xp=np):
        super().__init__(comm, T, balanced, xp)
        # (T/cp, T): -inf where a gathered key's position is after my query's
        self.mask = xp.asarray(np.where(self.key_positions()[None, :] > self.pos[:, None], -np.inf, 0.0))

    def key_positions(self):
        """The positions of the gathered keys, rank by rank: (T,)."""
        return np.concatenate([positions(self.T, self.cp, o, self.balanced) for o in range(self.cp)])

    def attention_forward(self, q, k, v, nh):
        """q (B, T/cp, C/tp), k, v (B, T/cp, K/tp). Cache: q / sqrt(hs) (B, NH/tp, T/cp, hs), the gathered K and V
        (B, NKV/tp, T, hs) each, their positions in rank order (key_positions), and the probabilities (B, NH/tp,
        T/cp, T)."""
        xp, cp = array_module(q), self.cp
        B, Tl, C = q.shape
        hs, n_rep = C // nh, C // k.shape[-1]
        nkv = nh // n_rep
        qh = xp.ascontiguousarray(split_heads(q, nh)) * (1.0 / math.sqrt(hs))      # (B, NH, Tl, hs)
        own = xp.empty_like(q, shape=(2, B, nkv, Tl, hs))
        own[0], own[1] = split_heads(k, nkv), split_heads(v, nkv)
        kv = xp.empty_like(own, shape=(cp, *own.shape))
        self.comm.Allgather(own, kv)                                                # every rank's [k | v]
        K = kv[:, 0].transpose(1, 2, 0, 3, 4).reshape(B, nkv, cp * Tl, hs)          # (B, NKV, T, hs) by rank
        V = kv[:, 1].transpose(1, 2, 0, 3, 4).reshape(B, nkv, cp * Tl, hs)
        with self.span("attention (all keys)"):
            s = qh @ repeat_kv_forward(K, n_rep)[0].transpose(0, 1, 3, 2)           # (B, NH, Tl, T)
            s += self.mask
            self.work["forward"] += s.shape[-2] * s.shape[-1]
            s -= s.max(axis=-1, keepdims=True)
            P = xp.exp(s)
            P /= P.sum(axis=-1, keepdims=True)
            yh = P @ repeat_kv_forward(V, n_rep)[0]
        return merge_heads(yh), (qh, K, V, P)

    def attention_backward(self, dy, cache, out=None):
        qh, K, V, P = cache
        xp, cp = array_module(dy), self.cp
        B, nh, Tl, hs = qh.shape
        nkv = K.shape[1]
        C, Kc, n_rep = nh * hs, nkv * hs, nh // nkv
        if out is None:
            out = xp.empty_like(dy, shape=(B, Tl, C + 2 * Kc))
        dyh = xp.ascontiguousarray(split_heads(dy, nh))
        with self.span("attention (all keys, backward)"):
            self.work["backward"] += P.shape[-2] * P.shape[-1]
            dP = dyh @ repeat_kv_forward(V, n_rep)[0].transpose(0, 1, 3, 2)                 # (B, NH, Tl, T)
            dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))
            dq = dS @ repeat_kv_forward(K, n_rep)[0] * (1.0 / math.sqrt(hs))                 # (B, NH, Tl, hs)
            dkv = xp.empty_like(qh, shape=(cp, 2, B, nkv, Tl, hs))                   # partial, by owner
            dK = repeat_kv_backward(dS.transpose(0, 1, 3, 2) @ qh, n_rep)                      # (B, NKV, T, hs)
            dV = repeat_kv_backward(P.transpose(0, 1, 3, 2) @ dyh, n_rep)
            dkv[:, 0] = dK.reshape(B, nkv, cp, Tl, hs).transpose(2, 0, 1, 3, 4)
            dkv[:, 1] = dV.reshape(B, nkv, cp, Tl, hs).transpose(2, 0, 1, 3, 4)
        mine = xp.empty_like(dkv[0])
        self.comm.Reduce_scatter_block(dkv, mine)                                   # sum over ranks, my rows
        split_heads(out[..., :C], nh)[...] = dq
        split_heads(out[..., C:C + Kc], nkv)[...] = mine[0]
        split_heads(out[..., C + Kc:], nkv)[...] = mine[1]
        return out[..., :C], out[..., C:C + Kc], out[..., C + Kc:]
