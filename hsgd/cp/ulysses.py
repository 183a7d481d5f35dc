"""Ulysses attention (--cp-scheme ulysses): an all-to-all turns the sequence split into a head split before the core
attention, and another turns it back after, so that the attention itself is the serial one on all T positions.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
Transformer Models". A context-parallel rank holds T/cp positions of every head (hsgd.cp.split); attention needs all
T positions of a head, but the heads are independent. So cut the rank's NH/tp query heads into cp groups of
g = NH/(tp cp) and its NKV/tp kv heads into cp groups of gk = NKV/(tp cp), send head group j of my positions to cp
rank j, and receive every rank's positions of my head group j = r: then rank r holds all T positions of g query
heads and gk kv heads and runs the whole causal attention on them. The output goes back by the inverse all-to-all.

    forward   Alltoall  [q | k | v]  (cp, B, g + 2gk, T/cp, hs): block j, my positions of head group j, to rank j;
                        received: rank i's positions of my group, in rank order (positions split.positions(T, cp, i))
              attention over all T rows of the group, the causal mask by their global positions (T x T, made
                        in each forward from the rows' positions)
              Alltoall  y            (cp, B, g, T/cp, hs): block j, rank j's positions of my group, back to rank j
    backward  the adjoint, read from the bottom up. An all-to-all is a permutation of all ranks' data, so its adjoint
              is its inverse (hsgd.grid.comm.Comm.Alltoall): Alltoall of dy to the head split, the attention's
              backward on the group, Alltoall of [dq | dk | dv] back to the sequence split.
Four all-to-alls per block and micro-batch, of q, k, v (B T/cp (C + 2K)/tp s each way) and of y and dy (B T/cp C/tp
s); the bytes a rank sends are (cp-1)/cp of them, so with T = cp x const they stay constant as cp grows
(hsgd.cp.split.cp_formula; chapter 13 measures it against the ring and the all-gather).

Grouped-query attention: each group's gk = NKV/(tp cp) kv heads are the ones its g query heads read (query head j
reads kv head j // n_rep, n_rep = NH/NKV = g/gk), repeated only for the products; cp must divide the rank's NKV/tp
kv heads (hsgd.cp.split.check_heads refuses the rest; copying a kv head to several groups is left out).

Left out: overlapping the all-to-alls with anything (they wait for q, k, v and the attention waits for them); a
blockwise (flash) attention on the group: the probabilities (B, g, T, T) are kept, as many bytes as the all-gather
scheme's (B, NH/tp, T/cp, T).

Legend: B sequences, T sequence, Tl = T/cp a rank's positions, C/tp = NH/tp hs and K/tp = NKV/tp hs the rank's
query and kv columns, g and gk the heads of a group, hs the head size, s bytes per number.
"""
import math

import numpy as np

from hsgd.cp.split import ContextSplit, positions
from hsgd.model.backend import array_module
from hsgd.model.llama_layers import repeat_kv_backward, repeat_kv_forward


def head_groups(q, k, v, n, nh):
    """(send, g, gk, hs): this rank's q (B, Tl, NH hs), k, v (B, Tl, NKV hs) cut into n head groups, block j of send
    (n, B, g + 2 gk, Tl, hs) being [q | k | v] of group j (g = NH/n query heads, gk = NKV/n kv heads): what an
    all-to-all over n ranks sends to rank j (Ulysses; a2a+p2p inside its groups)."""
    xp = array_module(q)
    B, Tl, C = q.shape
    hs = C // nh
    g, gk = nh // n, k.shape[-1] // hs // n
    send = xp.empty_like(q, shape=(n, B, g + 2 * gk, Tl, hs))
    send[:, :, :g] = q.reshape(B, Tl, n, g, hs).transpose(2, 0, 3, 1, 4)
    send[:, :, g:g + gk] = k.reshape(B, Tl, n, gk, hs).transpose(2, 0, 3, 1, 4)
    send[:, :, g + gk:] = v.reshape(B, Tl, n, gk, hs).transpose(2, 0, 3, 1, 4)
    return send, g, gk, hs


class Ulysses(ContextSplit):
    """Ulysses attention over cp_comm: all-to-all to a head split, the whole causal attention on this rank's head
    group, all-to-all back (see the module docstring)."""
    keeps_probabilities = True

    def __init__(self, comm, T, balanced=True, xp=np):
        super().__init__(comm, T, balanced, xp)
        self.blocks = [[] for _ in range(self.cp)]          # (the ring's chunk pairs: not used here, not held)
        # the global position of each row of a head group, rank by rank: (T,) on the device; the (T, T) causal mask
        # is made from it in each forward (as large as one head's scores), not held for the run
        rank_order = [positions(T, self.cp, o, balanced) for o in range(self.cp)]
        self.row_positions = xp.asarray(np.concatenate(rank_order))                   # (T,)

    def held_bytes(self):
        """ContextSplit's (the positions), and the rows' global positions (T,)."""
        return super().held_bytes() + int(self.row_positions.nbytes)

    def attention_forward(self, q, k, v, nh):
        """q (B, T/cp, C/tp), k, v (B, T/cp, K/tp) -> y (B, T/cp, C/tp). Cache: q / sqrt(hs) of the group (B, g, T,
        hs), its K and V (B, gk, T, hs) each (one array), and the probabilities (B, g, T, T); rows in rank order."""
        xp, cp = array_module(q), self.cp
        B, Tl, C = q.shape
        send, g, gk, hs = head_groups(q, k, v, cp, nh)                             # block j: head group j
        recv = xp.empty_like(send)
        self.comm.Alltoall(send, recv)                      # recv[i]: rank i's positions of my head group
        T = cp * Tl
        qh = recv[:, :, :g].transpose(1, 2, 0, 3, 4).reshape(B, g, T, hs) * (1.0 / math.sqrt(hs))   # (B, g, T, hs)
        kv = xp.empty_like(q, shape=(2, B, gk, cp, Tl, hs))
        kv[0], kv[1] = (recv[:, :, a:a + gk].transpose(1, 2, 0, 3, 4) for a in (g, g + gk))
        K, V = kv[0].reshape(B, gk, T, hs), kv[1].reshape(B, gk, T, hs)             # views of kv
        with self.span("attention (head group)"):
            n_rep = g // gk
            s = qh @ repeat_kv_forward(K, n_rep)[0].transpose(0, 1, 3, 2)           # (B, g, T, T)
            at = self.row_positions
            s += xp.where(at[None, :] > at[:, None], -np.inf, 0.0)             # (T, T): the later keys masked
            self.work["forward"] += Tl * T                  # g T^2 scores: T/cp x T per head of the rank's NH/tp
            s -= s.max(axis=-1, keepdims=True)
            P = xp.exp(s)
            P /= P.sum(axis=-1, keepdims=True)
            yh = P @ repeat_kv_forward(V, n_rep)[0]                                 # (B, g, T, hs)
        back = xp.ascontiguousarray(yh.reshape(B, g, cp, Tl, hs).transpose(2, 0, 1, 3, 4))   # block j: rank j's rows
        mine = xp.empty_like(back)
        self.comm.Alltoall(back, mine)                      # mine[j]: my positions of head group j
        y = mine.transpose(1, 3, 0, 2, 4).reshape(B, Tl, C)                         # (B, Tl, C/tp) heads in order
        return y, (qh, K, V, P)

    def attention_backward(self, dy, cache, out=None):
        """dq (B, T/cp, C/tp), dk, dv (B, T/cp, K/tp), views of out (B, T/cp, C/tp + 2K/tp)."""
        qh, K, V, P = cache
        xp, cp = array_module(dy), self.cp
        B, g, T, hs = qh.shape
        gk, Tl = K.shape[1], T // cp
        C, Kc, n_rep = g * cp * hs, gk * cp * hs, g // gk
        if out is None:
            out = xp.empty_like(dy, shape=(B, Tl, C + 2 * Kc))
        send = xp.ascontiguousarray(dy.reshape(B, Tl, cp, g, hs).transpose(2, 0, 3, 1, 4))   # (cp, B, g, Tl, hs)
        recv = xp.empty_like(send)
        self.comm.Alltoall(send, recv)                      # the adjoint of y's all-to-all: dy by head groups
        dyh = recv.transpose(1, 2, 0, 3, 4).reshape(B, g, T, hs)                    # (B, g, T, hs)
        grads = xp.empty_like(dy, shape=(cp, B, g + 2 * gk, Tl, hs))                # block j: rank j's rows
        with self.span("attention (head group, backward)"):
            self.work["backward"] += Tl * T
            dP = dyh @ repeat_kv_forward(V, n_rep)[0].transpose(0, 1, 3, 2)         # (B, g, T, T)
            dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))
            dq = dS @ repeat_kv_forward(K, n_rep)[0] * (1.0 / math.sqrt(hs))       # (B, g, T, hs)
            dK = repeat_kv_backward(dS.transpose(0, 1, 3, 2) @ qh, n_rep)           # (B, gk, T, hs)
            dV = repeat_kv_backward(P.transpose(0, 1, 3, 2) @ dyh, n_rep)
            for a, d in ((0, dq), (g, dK), (g + gk, dV)):
                grads[:, :, a:a + d.shape[1]] = d.reshape(B, d.shape[1], cp, Tl, hs).transpose(2, 0, 1, 3, 4)
        mine = xp.empty_like(grads)
        self.comm.Alltoall(grads, mine)                     # the adjoint of q, k, v's: back to the sequence split
        out[..., :C] = mine[:, :, :g].transpose(1, 3, 0, 2, 4).reshape(B, Tl, C)            # heads in order
        out[..., C:C + Kc] = mine[:, :, g:g + gk].transpose(1, 3, 0, 2, 4).reshape(B, Tl, Kc)
        out[..., C + Kc:] = mine[:, :, g + gk:].transpose(1, 3, 0, 2, 4).reshape(B, Tl, Kc)
        return out[..., :C], out[..., C:C + Kc], out[..., C + Kc:]
