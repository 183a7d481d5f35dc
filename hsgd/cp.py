"""Context parallelism: the sequence split over the cp ranks of cp_comm, with ring attention or an all-gather of the
keys and values (--cp N --cp-scheme ring|allgather).

Activations grow with T and attention's work with T^2, so a long enough sequence outgrows one device however the
weights are split. Context parallelism splits the sequence itself: each of the cp ranks of cp_comm holds T/cp
positions of every sequence, and everything but the core attention (the embedding, LayerNorm, the linears, the
MLP, the loss) works on its own positions as if they were a shorter batch. Parameters are replicated over cp:
their gradients are averaged over the dp x cp ranks of dp_comm, each rank's loss being the mean over its
positions (all ranks hold the same number of them).

Which positions (load balancing). Under the causal mask query t reads keys 0..t: the plain split (rank r holds
[r T/cp, (r+1) T/cp)) leaves rank 0 one diagonal block of work and rank cp-1 cp blocks, so every layer waits for
the last rank. Cut the sequence into 2 cp chunks of c = T/(2 cp) positions instead; rank r holds chunks r and
2cp-1-r (the "zigzag" split of Dubey et al. 2024, used by Megatron-LM's context parallelism too; Brandon et al.
2023 balance the same work with a striped layout, position t on rank t mod cp). In units of c x c score blocks,
rank r's early chunk reads r full blocks and one diagonal, its late chunk 2cp-1-r full blocks and one diagonal:
2cp-1 + 2 = 2cp + 1 blocks on every rank (attention_blocks counts both splits).

The core attention over the ring (Liu et al. 2023, Ring Attention with Blockwise Transformers):

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
             times backward, of (dk, dv) cp times (cp_formula).

The all-gather variant (--cp-scheme allgather; Dubey et al. 2024 train Llama 3's long context this way): All-Gather
k and v of the whole sequence over cp_comm, score this rank's queries against all T keys with the mask of their
positions, and in the backward pass Reduce-Scatter dk, dv back to their owners. Two collectives per layer and no
online softmax, but the rank holds all T keys and values and the (T/cp x T) probabilities, and computes the masked
blocks too.

    ctx = make_context(cfg, grid, tc)     # hsgd.context: WHOLE, Ring or AllGather; Stage owns it
    ctx.local(idx)                        # (B, T) -> (B, T/cp), this rank's positions of each sequence
"""
import math
from contextlib import nullcontext

import numpy as np

from .backend import array_module
from .errors import ConfigError
from .layers import merge_heads, split_heads

CP_SCHEMES = ("ring", "allgather")
TAG_KV, TAG_KV_BACK, TAG_DKV = 0, 1, 2          # forward (k, v); backward (k, v); backward (dk, dv)


def check_cp(T, cp, tp=1, splits_T=False):
    """Raise ConfigError unless a sequence of T positions cuts into 2 cp chunks (and, with the sequence scheme, a
    rank's T/cp positions into tp T-shards, which may cross its chunks' border), naming the seq_len and cp values
    that would work."""
    if cp == 1:
        return
    need = lambda c: math.lcm(2 * c, c * tp) if splits_T else 2 * c   # T must be a multiple of this
    step = need(cp)
    if T % step:
        near = sorted({max(step, T // step * step), T // step * step + step, T // step * step + 2 * step})
        cps = [c for c in range(2, 33) if T % need(c) == 0]
        shards = f" and into tp={tp} T-shards (the sequence scheme)" if splits_T else ""
        raise ConfigError(f"seq_len={T} does not cut into 2*cp = {2 * cp} equal chunks{shards}: context parallelism "
                          f"gives rank r chunks r and 2cp-1-r of each sequence; use seq_len a multiple of {step} "
                          f"(e.g. {near}) or cp in {cps or 'none: T is too short'}")


def chunk_starts(T, cp, r, balanced=True):
    """[(local offset, global start, length)] of the chunks rank r holds: (0, r c, c) and (c, (2cp-1-r) c, c) with
    c = T/(2 cp) (balanced), or the plain split's one chunk (0, r T/cp, T/cp)."""
    if not balanced or cp == 1:
        n = T // cp
        return [(0, r * n, n)]
    c = T // (2 * cp)
    return [(0, r * c, c), (c, (2 * cp - 1 - r) * c, c)]


def positions(T, cp, r, balanced=True):
    """The global positions of rank r's local rows, in order: (T/cp,) int64."""
    return np.concatenate([np.arange(g, g + n) for _, g, n in chunk_starts(T, cp, r, balanced)])


def attention_blocks(T, cp, r, balanced=True):
    """How many query-key scores rank r computes per head and sequence in one ring attention forward: the chunk
    pairs that are not wholly masked, each n_q x n_k. Balanced: (2cp + 1) c^2 on every rank (c = T/(2cp));
    plain: (r + 1) (T/cp)^2, cp times more on the last rank than on the first."""
    mine = chunk_starts(T, cp, r, balanced)
    return sum(nq * nk for o in range(cp) for _, gq, nq in mine for _, gk, nk in chunk_starts(T, cp, o, balanced)
               if gk <= gq + nq - 1)


class ContextSplit:
    """The context layout of one rank of cp_comm (hsgd.context's interface): its positions, and the bookkeeping
    of the score blocks its core attention computes (work: {"forward": scores, "backward": scores})."""
    keeps_probabilities = False

    def __init__(self, comm, T, balanced=True, xp=np):
        self.comm, self.T, self.cp, self.r = comm, T, comm.size, comm.rank
        self.balanced = balanced
        self.chunks = chunk_starts(T, self.cp, self.r, balanced)
        self.pos = positions(T, self.cp, self.r, balanced)          # (T/cp,) host: to select the token ids
        self.dev_pos = xp.asarray(self.pos)                         # (T/cp,) on the device: wpe's rows
        self.work = {"forward": 0, "backward": 0}
        self.blocks = [self.block_pairs(o, xp) for o in range(self.cp)]   # per owner, masks on the device

    def held_bytes(self):
        """The bytes this layout holds for the whole run (hsgd.memtrace's "other"): its positions, on the host and
        on the device, and its masks."""
        masks = [m for pairs in self.blocks for _, _, m in pairs if m is not None] + [getattr(self, "mask", None)]
        arrays = {id(a): a for a in [self.pos, self.dev_pos] + masks if a is not None}
        return sum(int(a.nbytes) for a in arrays.values())

    def local(self, a):
        """(B, T) -> (B, T/cp): this rank's positions of each sequence (a copy)."""
        return a[:, self.pos]

    def rows(self, t0, t1):
        """The global positions of local rows t0..t1-1: indices into wpe."""
        return self.dev_pos[t0:t1]

    def span(self, name, **args):
        """A span on the trace's compute track (hsgd.trace), when cp_comm has a tracer."""
        tracer = getattr(self.comm, "tracer", None)
        return tracer.span(name, **args) if tracer is not None else nullcontext()

    def pairs(self, owner):
        """The chunk pairs of my queries and owner's keys that are not wholly masked: (q rows, k rows, mask or
        None), rows as local slices; mask (nq, nk) is -inf where the key's position is after the query's (built
        once per layout, block_pairs)."""
        return self.blocks[owner]

    def block_pairs(self, owner, xp):
        out = []
        for lq, gq, nq in self.chunks:
            for lk, gk, nk in chunk_starts(self.T, self.cp, owner, self.balanced):
                if gk > gq + nq - 1:
                    continue                                        # every key after every query: skipped
                mask = None
                if gk + nk - 1 > gq:                                # a diagonal block: part masked
                    pq, pk = np.arange(gq, gq + nq), np.arange(gk, gk + nk)
                    mask = xp.asarray(np.where(pk[None, :] > pq[:, None], -np.inf, 0.0))
                out.append((slice(lq, lq + nq), slice(lk, lk + nk), mask))
        return out


class Ring(ContextSplit):
    """Ring attention over cp_comm, blockwise with the online softmax (see the module docstring)."""

    def attention_forward(self, q, k, v, nh):
        """q, k, v (B, T/cp, C/tp), this rank's positions -> y (B, T/cp, C/tp). Cache: q / sqrt(hs), this rank's
        (k, v) as one (2, B, NH/tp, T/cp, hs) block, y by heads and lse = m + log l (B, NH/tp, T/cp)."""
        xp, cp, comm = array_module(q), self.cp, self.comm
        B, Tl, C = q.shape
        hs = C // nh
        qh = xp.ascontiguousarray(split_heads(q, nh)) * (1.0 / math.sqrt(hs))      # (B, NH, Tl, hs)
        own = xp.empty_like(q, shape=(2, B, nh, Tl, hs))                            # what travels: [k | v]
        own[0], own[1] = split_heads(k, nh), split_heads(v, nh)
        m = xp.full((B, nh, Tl), -xp.inf, dtype=q.dtype)                            # running max
        l = xp.zeros((B, nh, Tl), dtype=q.dtype)                                    # running sum
        o = xp.zeros((B, nh, Tl, hs), dtype=q.dtype)                                # running output
        ring = [own, xp.empty_like(own), xp.empty_like(own)]                        # own, then two to alternate
        cur = 0
        for i in range(cp):                                                         # block of rank r - i
            owner, nxt = (self.r - i) % cp, (1 if cur != 1 else 2)
            reqs = []
            if i < cp - 1:                                                          # the next block, in flight
                reqs = [comm.Irecv(ring[nxt], source=(self.r - 1) % cp, tag=TAG_KV),
                        comm.Isend(ring[cur], dest=(self.r + 1) % cp, tag=TAG_KV)]
            with self.span("attention block", owner=owner):
                for sq, sk, mask in self.pairs(owner):
                    self.merge(qh, ring[cur], sq, sk, mask, m, l, o, xp)
            for req in reqs:
                req.Wait()
            cur = nxt
        yh = o / l[..., None]                                                       # (B, NH, Tl, hs)
        return merge_heads(yh), (qh, own, yh, m + xp.log(l))

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
        ring, cur, sending, acc_in = [own, xp.empty_like(own), xp.empty_like(own)], 0, None, None
        for i in range(cp):                                                         # block of rank r - i
            owner, nxt = (self.r - i) % cp, (1 if cur != 1 else 2)
            reqs = []
            if i < cp - 1:
                reqs = [comm.Irecv(ring[nxt], source=(self.r - 1) % cp, tag=TAG_KV_BACK),
                        comm.Isend(ring[cur], dest=(self.r + 1) % cp, tag=TAG_KV_BACK)]
            if i > 0:                                   # owner's (dk, dv) so far, from the ranks before me
                acc_in = xp.empty_like(own)
                reqs.append(comm.Irecv(acc_in, source=(self.r - 1) % cp, tag=TAG_DKV))
            mine = xp.zeros_like(own)                                               # my share: [dk | dv]
            with self.span("attention block (backward)", owner=owner):
                for sq, sk, mask in self.pairs(owner):
                    self.grads(qh, dyh, D, lse, ring[cur], sq, sk, mask, dqh, mine, xp)
            for req in reqs:
                req.Wait()
            if acc_in is not None:
                mine += acc_in
            if sending is not None:
                sending.Wait()                                                      # (its buffer is dropped)
            sending = comm.Isend(mine, dest=(self.r + 1) % cp, tag=TAG_DKV)        # on, to owner's next rank
            cur = nxt
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
        """Cache: q / sqrt(hs) (B, NH/tp, T/cp, hs), the gathered K and V (B, NH/tp, T, hs) each, their positions in
        rank order (key_positions), and the probabilities (B, NH/tp, T/cp, T)."""
        xp, cp = array_module(q), self.cp
        B, Tl, C = q.shape
        hs = C // nh
        qh = xp.ascontiguousarray(split_heads(q, nh)) * (1.0 / math.sqrt(hs))      # (B, NH, Tl, hs)
        own = xp.empty_like(q, shape=(2, B, nh, Tl, hs))
        own[0], own[1] = split_heads(k, nh), split_heads(v, nh)
        kv = xp.empty_like(own, shape=(cp, *own.shape))
        self.comm.Allgather(own, kv)                                                # every rank's [k | v]
        K = kv[:, 0].transpose(1, 2, 0, 3, 4).reshape(B, nh, cp * Tl, hs)           # (B, NH, T, hs) by rank
        V = kv[:, 1].transpose(1, 2, 0, 3, 4).reshape(B, nh, cp * Tl, hs)
        with self.span("attention (all keys)"):
            s = qh @ K.transpose(0, 1, 3, 2)                                        # (B, NH, Tl, T)
            s += self.mask
            self.work["forward"] += s.shape[-2] * s.shape[-1]
            s -= s.max(axis=-1, keepdims=True)
            P = xp.exp(s)
            P /= P.sum(axis=-1, keepdims=True)
            yh = P @ V
        return merge_heads(yh), (qh, K, V, P)

    def attention_backward(self, dy, cache, out=None):
        qh, K, V, P = cache
        xp, cp = array_module(dy), self.cp
        B, nh, Tl, hs = qh.shape
        C = nh * hs
        if out is None:
            out = xp.empty_like(dy, shape=(B, Tl, 3 * C))
        dyh = xp.ascontiguousarray(split_heads(dy, nh))
        with self.span("attention (all keys, backward)"):
            self.work["backward"] += P.shape[-2] * P.shape[-1]
            dP = dyh @ V.transpose(0, 1, 3, 2)                                      # (B, NH, Tl, T)
            dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))
            dq = dS @ K * (1.0 / math.sqrt(hs))                                      # (B, NH, Tl, hs)
            dkv = xp.empty_like(qh, shape=(cp, 2, B, nh, Tl, hs))                    # partial, by owner
            dkv[:, 0] = (dS.transpose(0, 1, 3, 2) @ qh).reshape(B, nh, cp, Tl, hs).transpose(2, 0, 1, 3, 4)
            dkv[:, 1] = (P.transpose(0, 1, 3, 2) @ dyh).reshape(B, nh, cp, Tl, hs).transpose(2, 0, 1, 3, 4)
        mine = xp.empty_like(dkv[0])
        self.comm.Reduce_scatter_block(dkv, mine)                                   # sum over ranks, my rows
        split_heads(out[..., :C], nh)[...] = dq
        split_heads(out[..., C:2 * C], nh)[...] = mine[0]
        split_heads(out[..., 2 * C:], nh)[...] = mine[1]
        return out[..., :C], out[..., C:2 * C], out[..., 2 * C:]


def attention_cache_bytes(cp, scheme, b, T, C, NH, tp, s):
    """(bytes one block's core attention caches for a micro-batch of b sequences, of which the probabilities)
    on a rank holding T/cp positions (Tl) and NH/tp heads, N = b Tl:
        cp = 1 (hsgd.ops)   q, k, v by heads 3 N C/tp, the probabilities b NH/tp T^2
        ring                q, own (k, v), y by heads: 4 N C/tp, and lse b NH/tp Tl; no probabilities
        allgather           q N C/tp, the gathered k and v 2 b T C/tp, the probabilities b NH/tp Tl T"""
    Tl, c, nh = T // cp, C // tp, NH // tp
    N = b * Tl
    if cp == 1:
        P = b * nh * T * T * s
        return 3 * N * c * s + P, P
    if scheme == "ring":
        return 4 * N * c * s + b * nh * Tl * s, 0
    P = b * nh * Tl * T * s
    return N * c * s + 2 * b * T * c * s + P, P


def make_split(scheme, comm, T, xp=np, balanced=True):
    """The context layout of --cp-scheme ring | allgather on cp_comm."""
    if scheme not in CP_SCHEMES:
        raise ConfigError(f"unknown cp scheme {scheme!r}; use one of {list(CP_SCHEMES)}")
    return (Ring if scheme == "ring" else AllGather)(comm, T, balanced, xp)


def cp_formula(scheme, cp, batch, T, C, tp, itemsize, n_blocks, recompute="none"):
    """{("cp", op): (calls, payload bytes)} of one forward and backward of n_blocks blocks on a micro-batch of
    `batch` sequences. A (k, v) block is 2N bytes, N = batch (T/cp) (C/tp) itemsize.
      ring:      Isend and Irecv (cp-1) + (cp-1) + cp times per block: (k, v) forward, again backward, (dk, dv);
                 --recompute full runs the forward's ring again (+ cp-1); selective keeps what the ring keeps.
      allgather: one Allgather (payload: the gathered cp 2N) and one Reduce_scatter_block (its input, cp 2N) per
                 block; --recompute selective or full gathers again (+ 1 Allgather)."""
    if cp == 1 or not n_blocks:
        return {}
    kv = 2 * batch * (T // cp) * (C // tp) * itemsize
    if scheme == "ring":
        hops = (cp - 1) + (cp - 1) + cp + (cp - 1) * (recompute == "full")
        return {("cp", "Isend"): (n_blocks * hops, n_blocks * hops * kv),
                ("cp", "Irecv"): (n_blocks * hops, n_blocks * hops * kv)}
    gathers = 1 + (recompute != "none")
    return {("cp", "Allgather"): (n_blocks * gathers, n_blocks * gathers * cp * kv),
            ("cp", "Reduce_scatter_block"): (n_blocks, n_blocks * cp * kv)}
