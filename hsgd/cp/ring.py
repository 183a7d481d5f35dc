"""Ring attention (--cp-scheme ring): the core attention of a context-parallel rank, its keys and values passed
around cp_comm and merged block by block.

Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"; the layout of the
positions (rank r holds chunks r and 2cp-1-r) and what both cp schemes share: hsgd.cp.split.

    forward: each rank keeps its queries; the (k, v) blocks travel around cp_comm (rank r -> r+1), cp - 1 hops,
             the next block's Isend/Irecv posted before the current one is computed (whether its bytes move during
             that block is the MPI library's progress: chapter 13 measures it). Blocks are merged with the
             online softmax (Milakov and Gimelshein 2018; FlashAttention): per query a running max m and sum l,
             and an output accumulator o that is rescaled when m grows:
                 s = q k_b^T / sqrt(hs) (+ mask);  m' = max(m, rowmax s);  p = exp(s - m')
                 l <- l e^(m - m') + rowsum p;  o <- o e^(m - m') + p v_b;  m <- m'
             and at the end y = o / l, with lse = m + log l kept for the backward pass (no T x T matrix).
             Each block pair is hsgd.model.flash's step: flash.scores, flash.merge (start and finish around them).
    backward: the (k, v) blocks go around the ring again; with p = exp(s - lse) and D = rowsum(dy * y):
                 dp = dy v_b^T;  ds = p (dp - D);  dq += ds k_b / sqrt(hs);  dk_b += ds^T q / sqrt(hs);  dv_b += p^T dy
             (flash.block_grads). dq stays; (dk_b, dv_b) travel with their block, each rank adding its share,
             and after cp hops they are back with their owner. Per layer and micro-batch: Isend of (k, v) cp - 1
             times forward, cp - 1 times backward, of (dk, dv) cp times (hsgd.cp.split.cp_formula).

With grouped-query attention the blocks that travel are the rank's kv heads, NKV/tp of them (K/tp = C/tp / n_rep
columns), and each block pair repeats them to the NH/tp query heads (query head j reads kv head j // n_rep); the
backward sums each group's dk, dv before they travel on: cp_comm carries the kv heads, not their copies.

Legend: Tl = T/cp a rank's positions, B sequences, NH/tp the rank's heads, hs the head size, C/tp = NH/tp hs, NKV/tp
its kv heads, n_rep = NH/NKV.
"""
import math

from hsgd.model import flash
from hsgd.model.backend import array_module
from hsgd.cp.split import ContextSplit
from hsgd.model.layers import merge_heads, split_heads
from hsgd.model.llama_layers import repeat_kv_backward, repeat_kv_forward

TAG_KV, TAG_KV_BACK, TAG_DKV = 0, 1, 2          # forward (k, v); backward (k, v); backward (dk, dv)


class Ring(ContextSplit):
    """Ring attention over cp_comm, blockwise with the online softmax (see the module docstring)."""

    def attention_forward(self, q, k, v, nh):
        """q (B, T/cp, C/tp), k, v (B, T/cp, K/tp), this rank's positions -> y (B, T/cp, C/tp). Cache: q / sqrt(hs),
        this rank's (k, v) as one (2, B, NKV/tp, T/cp, hs) block, y itself (the array handed on, which the output
        projection keeps as its input) and lse = m + log l (B, NH/tp, T/cp)."""
        xp = array_module(q)
        B, Tl, C = q.shape
        hs, n_rep = C // nh, C // k.shape[-1]
        qh = xp.ascontiguousarray(split_heads(q, nh)) * (1.0 / math.sqrt(hs))      # (B, NH, Tl, hs)
        own = xp.empty_like(q, shape=(2, B, nh // n_rep, Tl, hs))                   # what travels: [k | v]
        own[0], own[1] = split_heads(k, nh // n_rep), split_heads(v, nh // n_rep)
        m, l, o = flash.start(qh)                                                   # (B, NH, Tl), .., (.., hs)
        for owner, kv in self.around(own, TAG_KV):                                 # block of rank r - i
            with self.span("attention block", owner=owner):
                for sq, sk, mask in self.pairs(owner):
                    kb, vb = (repeat_kv_forward(a[:, :, sk], n_rep)[0] for a in kv)         # (B, NH, nk, hs)
                    s = flash.scores(qh[:, :, sq], kb, mask)                        # (B, NH, nq, nk)
                    self.work["forward"] += s.shape[-2] * s.shape[-1]
                    flash.merge(s, vb, m[:, :, sq], l[:, :, sq], o[:, :, sq])
        yh, lse = flash.finish(m, l, o)                                             # (B, NH, Tl, hs), (B, NH, Tl)
        y = merge_heads(yh)                                                         # (B, Tl, C) the one copy kept:
        return y, (qh, own, y, lse)                                                 # the projection keeps it too

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

    def attention_backward(self, dy, cache, out=None):
        """dq (B, T/cp, C/tp), dk, dv (B, T/cp, K/tp), views of out (B, T/cp, C/tp + 2K/tp): dq from every block,
        dk and dv of this rank's positions after their round of the ring."""
        qh, own, y, lse = cache
        xp, cp, comm = array_module(dy), self.cp, self.comm
        B, nh, Tl, hs = qh.shape
        C, nkv = nh * hs, own.shape[2]
        n_rep, K = nh // nkv, nkv * hs
        if out is None:
            out = xp.empty_like(dy, shape=(B, Tl, C + 2 * K))
        dyh = xp.ascontiguousarray(split_heads(dy, nh))                            # (B, NH, Tl, hs)
        D = (dyh * split_heads(y, nh)).sum(axis=-1)                                 # (B, NH, Tl) rowsum(dy * y)
        dqh = xp.zeros_like(qh)
        sending = None
        for i, (owner, kv) in enumerate(self.around(own, TAG_KV_BACK)):           # block of rank r - i
            acc_in = None
            if i > 0:                                   # owner's (dk, dv) so far, from the ranks before me
                acc_in = xp.empty_like(own)
                receiving = comm.Irecv(acc_in, source=(self.r - 1) % cp, tag=TAG_DKV)
            mine = xp.zeros_like(own)                                               # my share: [dk | dv]
            with self.span("attention block (backward)", owner=owner):
                for sq, sk, mask in self.pairs(owner):                              # my queries, owner's keys
                    qb = qh[:, :, sq]                                               # (B, NH, nq, hs)
                    kb, vb = (repeat_kv_forward(a[:, :, sk], n_rep)[0] for a in kv)         # (B, NH, nk, hs)
                    s = flash.scores(qb, kb, mask)                                  # (B, NH, nq, nk)
                    self.work["backward"] += s.shape[-2] * s.shape[-1]
                    dkb, dvb = (mine[i][:, :, sk] if n_rep == 1 else xp.zeros_like(kb) for i in (0, 1))
                    flash.block_grads(s, qb, kb, vb, dyh[:, :, sq], lse[:, :, sq], D[:, :, sq],
                                      dqh[:, :, sq], dkb, dvb)                      # dq; dk_b, dv_b
                    if n_rep > 1:                                                   # the group's sum: kv heads
                        mine[0][:, :, sk] += repeat_kv_backward(dkb, n_rep)
                        mine[1][:, :, sk] += repeat_kv_backward(dvb, n_rep)
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
        split_heads(out[..., C:C + K], nkv)[...] = dkv[0]
        split_heads(out[..., C + K:], nkv)[...] = dkv[1]
        return out[..., :C], out[..., C:C + K], out[..., C + K:]
