"""Ring attention (--cp-scheme ring): the core attention of a context-parallel rank, its keys and values passed
around cp_comm and merged block by block.

Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"; the layout of the
positions (rank r holds chunks r and 2cp-1-r) and what both cp schemes share: hsgd.cp.split.

    forward: each rank keeps its queries; the (k, v) blocks travel around cp_comm (rank r -> r+1), cp - 1 hops,
             the next block's Isend/Irecv in flight while the current one is computed. Blocks are merged with the
             online softmax (Milakov and Gimelshein 2018; FlashAttention): per query a running max m and sum l,
             and an output accumulator o that is rescaled when m grows:
                 s = q k_b^T / sqrt(hs) (+ mask);  m' = max(m, rowmax s);  p = exp(s - m')
                 l <- l e^(m - m') + rowsum p;  o <- o e^(m - m') + p v_b;  m <- m'
             and at the end y = o / l, with lse = m + log l kept for the backward pass (no T x T matrix).
    backward: the (k, v) blocks go around the ring again; with p = exp(s - lse) and D = rowsum(dy * y):
                 dp = dy v_b^T;  ds = p (dp - D);  dq += ds k_b / sqrt(hs);  dk_b += ds^T q / sqrt(hs);  dv_b += p^T dy
             dq stays; (dk_b, dv_b) travel with their block, each rank adding its share, and after cp hops they
             are back with their owner. Per layer and micro-batch: Isend of (k, v) cp - 1 times forward, cp - 1
             times backward, of (dk, dv) cp times (hsgd.cp.split.cp_formula).

Legend: Tl = T/cp a rank's positions, B sequences, NH/tp the rank's heads, hs the head size, C/tp = NH/tp hs.
"""
import math

from hsgd.model.backend import array_module
from hsgd.cp.split import ContextSplit
from hsgd.model.layers import merge_heads, split_heads

TAG_KV, TAG_KV_BACK, TAG_DKV = 0, 1, 2          # forward (k, v); backward (k, v); backward (dk, dv)


class Ring(ContextSplit):
    """Ring attention over cp_comm, blockwise with the online softmax (see the module docstring)."""

    def attention_forward(self, q, k, v, nh):
        """q, k, v (B, T/cp, C/tp), this rank's positions -> y (B, T/cp, C/tp). Cache: q / sqrt(hs), this rank's
        (k, v) as one (2, B, NH/tp, T/cp, hs) block, y by heads and lse = m + log l (B, NH/tp, T/cp)."""
        xp = array_module(q)
        B, Tl, C = q.shape
        hs = C // nh
        qh = xp.ascontiguousarray(split_heads(q, nh)) * (1.0 / math.sqrt(hs))      # (B, NH, Tl, hs)
        own = xp.empty_like(q, shape=(2, B, nh, Tl, hs))                            # what travels: [k | v]
        own[0], own[1] = split_heads(k, nh), split_heads(v, nh)
        m = xp.full((B, nh, Tl), -xp.inf, dtype=q.dtype)                            # running max
        l = xp.zeros((B, nh, Tl), dtype=q.dtype)                                    # running sum
        o = xp.zeros((B, nh, Tl, hs), dtype=q.dtype)                                # running output
        for owner, kv in self.around(own, TAG_KV):                                 # block of rank r - i
            with self.span("attention block", owner=owner):
                for sq, sk, mask in self.pairs(owner):
                    self.merge(qh, kv, sq, sk, mask, m, l, o, xp)
        yh = o / l[..., None]                                                       # (B, NH, Tl, hs)
        return merge_heads(yh), (qh, own, yh, m + xp.log(l))

    def around(self, own, tag):
        """This rank's (k, v) block, then each other rank's in ring order, as (owner, block): while the caller
        computes with one, the next is in flight (an Irecv from rank r-1 into one of two spare buffers, and this
        block's Isend on to rank r+1), waited for when the caller asks for it."""
        xp, cp, comm = array_module(own), self.cp, self.comm
        ring, cur = [own, xp.empty_like(own), xp.empty_like(own)], 0                # own, then two to alternate
        for i in range(cp):
            nxt = 1 if cur != 1 else 2                                              # (sent two blocks ago: free)
            reqs = [] if i == cp - 1 else [comm.Irecv(ring[nxt], source=(self.r - 1) % cp, tag=tag),
                                           comm.Isend(ring[cur], dest=(self.r + 1) % cp, tag=tag)]
            yield (self.r - i) % cp, ring[cur]
            for req in reqs:
                req.Wait()
            cur = nxt

    def merge(self, qh, kv, sq, sk, mask, m, l, o, xp):
        """One block into the running (m, l, o) of queries sq: the online softmax."""
        s = qh[:, :, sq] @ kv[0][:, :, sk].transpose(0, 1, 3, 2)                  # (B, NH, nq, nk) scores
        if mask is not None:
            s += mask                                                               # (float64 -inf / 0)
        self.work["forward"] += s.shape[-2] * s.shape[-1]
        m_new = xp.maximum(m[:, :, sq], s.max(axis=-1))                             # (B, NH, nq)
        scale = xp.exp(m[:, :, sq] - m_new)                                         # e^(m - m'): 0 at the start
        p = xp.exp(s - m_new[..., None])
        l[:, :, sq] = l[:, :, sq] * scale + p.sum(axis=-1)
        o[:, :, sq] = o[:, :, sq] * scale[..., None] + p @ kv[1][:, :, sk]
        m[:, :, sq] = m_new

    def attention_backward(self, dy, cache, out=None):
        """dq, dk, dv (B, T/cp, C/tp), views of out (B, T/cp, 3C/tp): dq from every block, dk and dv of this rank's
        positions after their round of the ring."""
        qh, own, yh, lse = cache
        xp, cp, comm = array_module(dy), self.cp, self.comm
        B, nh, Tl, hs = qh.shape
        C = nh * hs
        if out is None:
            out = xp.empty_like(dy, shape=(B, Tl, 3 * C))
        dyh = xp.ascontiguousarray(split_heads(dy, nh))                            # (B, NH, Tl, hs)
        D = (dyh * yh).sum(axis=-1)                                                 # (B, NH, Tl) rowsum(dy * y)
        dqh = xp.zeros_like(qh)
        sending = None
        for i, (owner, kv) in enumerate(self.around(own, TAG_KV_BACK)):           # block of rank r - i
            acc_in = None
            if i > 0:                                   # owner's (dk, dv) so far, from the ranks before me
                acc_in = xp.empty_like(own)
                receiving = comm.Irecv(acc_in, source=(self.r - 1) % cp, tag=TAG_DKV)
            mine = xp.zeros_like(own)                                               # my share: [dk | dv]
            with self.span("attention block (backward)", owner=owner):
                for sq, sk, mask in self.pairs(owner):
                    self.grads(qh, dyh, D, lse, kv, sq, sk, mask, dqh, mine, xp)
            if acc_in is not None:
                receiving.Wait()
                mine += acc_in
            if sending is not None:
                sending.Wait()                                                      # (its buffer is dropped)
            sending = comm.Isend(mine, dest=(self.r + 1) % cp, tag=TAG_DKV)        # on, to owner's next rank
        dkv = xp.empty_like(own)                                                    # my (dk, dv): every share
        comm.Irecv(dkv, source=(self.r - 1) % cp, tag=TAG_DKV).Wait()
        sending.Wait()
        split_heads(out[..., :C], nh)[...] = dqh * (1.0 / math.sqrt(hs))
        split_heads(out[..., C:2 * C], nh)[...] = dkv[0]
        split_heads(out[..., 2 * C:], nh)[...] = dkv[1]
        return out[..., :C], out[..., C:2 * C], out[..., 2 * C:]

    def grads(self, qh, dyh, D, lse, kv, sq, sk, mask, dqh, dkv, xp):
        """One block's share of dq (into dqh, still times sqrt(hs)) and of the owner's dk, dv (into dkv)."""
        k, v = kv[0][:, :, sk], kv[1][:, :, sk]                                     # (B, NH, nk, hs)
        s = qh[:, :, sq] @ k.transpose(0, 1, 3, 2)                                  # (B, NH, nq, nk)
        if mask is not None:
            s += mask
        self.work["backward"] += s.shape[-2] * s.shape[-1]
        p = xp.exp(s - lse[:, :, sq, None])                                         # the probabilities again
        dp = dyh[:, :, sq] @ v.transpose(0, 1, 3, 2)
        ds = p * (dp - D[:, :, sq, None])                                           # dL/d(scores)
        dqh[:, :, sq] += ds @ k
        dkv[0][:, :, sk] += ds.transpose(0, 1, 3, 2) @ qh[:, :, sq]                 # qh holds q / sqrt(hs)
        dkv[1][:, :, sk] += p.transpose(0, 1, 3, 2) @ dyh[:, :, sq]
