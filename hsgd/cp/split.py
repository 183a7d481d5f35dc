"""Context parallelism: the sequence split over the cp ranks of cp_comm, with ring attention, an all-gather of the
keys and values, Ulysses' all-to-all to a head split, or Ulysses inside groups and the ring across them
(--cp N --cp-scheme ring|allgather|ulysses|a2a+p2p).

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

The core attention, four ways (--cp-scheme): hsgd.cp.ring (Liu et al. 2023: the keys and values travel
around the ring of cp ranks, merged by the online softmax), hsgd.cp.allgather (All-Gather the keys and
values, as Dubey et al. 2024 train Llama 3's long context), hsgd.cp.ulysses (Jacobs et al. 2023: an all-to-all
from the sequence split to a head split and back, the attention whole in between; cp must divide the heads) and
hsgd.cp.hierarchical (a2a+p2p, Megatron-LM's hierarchical context parallelism: Ulysses inside groups of a adjacent
ranks, the ring across the r = cp/a groups; a2a_sizes gives a and r from cp, a must divide the heads). This
module holds what they share: the layout (which positions, ContextSplit), the checks, and the work and byte
counts; hsgd.cp.layouts makes a layout.

Legend: T sequence, cp ranks of cp_comm, c = T/(2 cp) a chunk, Tl = T/cp a rank's positions, B or b sequences,
C d_model, NH heads (NH/tp on a rank), hs = C/NH, tp, s bytes per number.

    ctx = make_context(cfg, grid, tc)     # hsgd.cp.layouts: WHOLE, Ring, AllGather, Ulysses or Hierarchical
    ctx.local(idx)                        # (B, T) -> (B, T/cp), this rank's positions of each sequence
"""
import math
import numpy as np

from hsgd.errors import ConfigError
from hsgd.grid.trace import NullTracer

CP_SCHEMES = ("ring", "allgather", "ulysses", "a2a+p2p")


def check_cp(T, cp, tp=1, splits_T=False, fits=None):
    """Raise ConfigError unless a sequence of T positions cuts into 2 cp chunks (and, with the sequence scheme, a
    rank's T/cp positions into tp T-shards, which may cross its chunks' border), naming the seq_len and cp values
    that would work (the cp values among those `fits(cp)` allows: the scheme's heads rule, heads_fit)."""
    if cp == 1:
        return
    need = lambda c: math.lcm(2 * c, c * tp) if splits_T else 2 * c   # T must be a multiple of this
    step = need(cp)
    if T % step:
        near = sorted({max(step, T // step * step), T // step * step + step, T // step * step + 2 * step})
        cps = [c for c in range(2, 33) if T % need(c) == 0 and (fits is None or fits(c))]
        shards = f" and into tp={tp} T-shards (the sequence scheme)" if splits_T else ""
        raise ConfigError(f"seq_len={T} does not cut into 2*cp = {2 * cp} equal chunks{shards}: context parallelism "
                          f"gives rank r chunks r and 2cp-1-r of each sequence; use seq_len a multiple of {step} "
                          f"(e.g. {near}) or cp in {cps or 'none: T is too short'}")


def a2a_sizes(cp):
    """(a, r) of --cp-scheme a2a+p2p (hsgd.cp.hierarchical): r the smallest prime factor of cp, a = cp / r, the
    largest all-to-all group that leaves a ring of at least two groups (4: 2 x 2, 8: 4 x 2, 6: 3 x 2); (1, cp) when
    cp is prime (no such split: check_heads refuses it)."""
    r = next((p for p in range(2, cp + 1) if cp % p == 0), 1)
    return cp // r, r


def heads_fit(n_heads, n_kv_heads, cp, tp, scheme):
    """Whether the cp scheme can split each tp rank's heads over cp (check_heads says why not): Ulysses gives each
    cp rank NH/(tp cp) query heads and NKV/(tp cp) kv heads (hsgd.cp.ulysses), so cp divides both NH/tp and the
    rank's kv heads (NKV/tp, or the one replicated head when tp > NKV); a2a+p2p splits them over its all-to-all group
    of a ranks (a2a_sizes: a > 1, dividing both); ring and allgather split no heads."""
    if scheme not in ("ulysses", "a2a+p2p") or cp == 1:
        return True
    nh, nkv = n_heads // tp, max(n_kv_heads // tp, 1)
    a = a2a_sizes(cp)[0] if scheme == "a2a+p2p" else cp
    return a > 1 and nh % a == 0 and nkv % a == 0


def check_heads(n_heads, n_kv_heads, cp, tp, scheme, T=None):
    """Raise ConfigError unless heads_fit, naming the cp values that would (and cut a sequence of T positions into
    2 cp chunks, when T is given)."""
    if heads_fit(n_heads, n_kv_heads, cp, tp, scheme):
        return
    nh, nkv = n_heads // tp, max(n_kv_heads // tp, 1)
    cps = [c for c in range(2, 33) if heads_fit(n_heads, n_kv_heads, c, tp, scheme) and (T is None or T % (2 * c) == 0)]
    if scheme == "a2a+p2p":
        a, r = a2a_sizes(cp)
        why = (f"cp={cp} is prime: no all-to-all group of a > 1 ranks with a ring of r > 1 groups" if a == 1 else
               f"its all-to-all group of a={a} ranks (cp = {a} x {r}) must divide the {nh} query and {nkv} kv heads "
               f"per tp rank (n_heads={n_heads}, n_kv_heads={n_kv_heads}, tp={tp})")
        raise ConfigError(f"--cp-scheme a2a+p2p: {why}; use cp in {cps or 'none'} (seq_len a multiple of 2 cp) or "
                          f"--cp-scheme ring or allgather")
    works = f"use cp in {cps} (seq_len a multiple of 2 cp) or " if cps else "no cp > 1 divides them; use "
    raise ConfigError(f"--cp-scheme ulysses splits each tp rank's heads over cp, but n_heads={n_heads} and "
                      f"n_kv_heads={n_kv_heads} over tp={tp} leave {nh} query and {nkv} kv heads per rank, which "
                      f"cp={cp} does not divide; {works}--cp-scheme ring or allgather")


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
    """A context layout (hsgd.tp.attention's interface) of one rank of cp_comm: its positions, and the bookkeeping
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
        """The bytes this layout holds for the whole run (hsgd.accounting.allocations's "other"): its positions, on the
        host and on the device, and its masks."""
        masks = [m for pairs in self.blocks for _, _, m in pairs if m is not None] + [getattr(self, "mask", None)]
        arrays = {id(a): a for a in [self.pos, self.dev_pos] + masks if a is not None}
        return sum(int(a.nbytes) for a in arrays.values())

    def free(self):
        """Nothing to free: the layout talks on cp_comm alone (hsgd.cp.hierarchical's makes communicators of its
        own, and frees them here)."""

    def local(self, a):
        """(B, T) -> (B, T/cp): this rank's positions of each sequence (a copy)."""
        return a[:, self.pos]

    def rows(self, t0, t1):
        """The global positions of local rows t0..t1-1: indices into wpe."""
        return self.dev_pos[t0:t1]

    def span(self, name, **args):
        """A span on the trace's compute track (hsgd.grid.trace), when cp_comm has a tracer."""
        return (getattr(self.comm, "tracer", None) or NullTracer()).span(name, **args)

    def pairs(self, owner):
        """The chunk pairs of my queries and owner's keys that are not wholly masked: (q rows, k rows, mask or
        None), rows as local slices; mask (nq, nk) is -inf where the key's position is after the query's (built
        once per layout, block_pairs)."""
        return self.blocks[owner]

    def block_pairs(self, owner, xp):
        return chunk_pairs(self.chunks, chunk_starts(self.T, self.cp, owner, self.balanced), xp)


def chunk_pairs(mine, theirs, xp=np):
    """[(q rows, k rows, mask or None)] of my chunks' queries against their chunks' keys ((local offset, global
    start, length) each): the pairs not wholly masked, rows as local slices; mask (nq, nk) -inf where the key's
    global position is after the query's (a diagonal pair), None where no key is."""
    out = []
    for lq, gq, nq in mine:
        for lk, gk, nk in theirs:
            if gk > gq + nq - 1:
                continue                                            # every key after every query: skipped
            mask = None
            if gk + nk - 1 > gq:                                    # a diagonal block: part masked
                pq, pk = np.arange(gq, gq + nq), np.arange(gk, gk + nk)
                mask = xp.asarray(np.where(pk[None, :] > pq[:, None], -np.inf, 0.0))
            out.append((slice(lq, lq + nq), slice(lk, lk + nk), mask))
    return out


def attention_cache_bytes(cp, scheme, b, T, C, NH, tp, s, attention="materialized", kv=None):
    """(bytes one block's core attention caches for a micro-batch of b sequences, of which the probabilities)
    on a rank holding T/cp positions (Tl), NH/tp heads and kv = K/tp columns of k and of v (its kv heads; default
    C/tp, multi-head attention), N = b Tl:
        cp = 1, materialized (hsgd.model.ops)   q, k, v by heads 3 N C/tp, the probabilities b NH/tp T^2
        cp = 1, flash (hsgd.model.flash)        q, k, v by heads 3 N C/tp, and lse b NH/tp T; no probabilities (and
                                                y, which the output projection keeps as its input: counted there)
        ring                q by heads N C/tp, own (k, v) 2 N kv, and lse b NH/tp Tl; no probabilities (and y, as
                            flash's: counted with the projection's input)
        allgather           q N C/tp, the gathered k and v 2 b T kv, the probabilities b NH/tp Tl T
        ulysses             its head group's q (b T x NH/(tp cp) heads = N C/tp), k and v 2 b T kv/cp, and the
                            probabilities b NH/(tp cp) T^2 = b NH/tp Tl T, as many as allgather's
        a2a+p2p             the ring's on its group's a Tl rows and NH/(tp a) heads: q N C/tp, own (k, v) 2 N kv,
                            lse b NH/tp Tl; and the group's y N C/tp (the ring's backward reads it; the array handed
                            on is the second all-to-all's); no probabilities (hsgd.cp.hierarchical)
    (attention, --attention, only says which cp = 1 takes.) With cp = 1 the kv heads are repeated to the NH/tp query
    heads before the attention (hsgd.tp.attention.grouped_forward), and its cache holds them so: C/tp wide."""
    Tl, c, nh = T // cp, C // tp, NH // tp
    kv = c if kv is None else kv
    N = b * Tl
    if cp == 1 and attention == "flash":
        return 3 * N * c * s + b * nh * T * s, 0
    if cp == 1:
        P = b * nh * T * T * s
        return 3 * N * c * s + P, P
    if scheme in ("ring", "a2a+p2p"):
        return N * c * s * (1 + (scheme == "a2a+p2p")) + 2 * N * kv * s + b * nh * Tl * s, 0
    P = b * nh * Tl * T * s
    if scheme == "ulysses":
        return N * c * s + 2 * b * T * (kv // cp) * s + P, P
    return N * c * s + 2 * b * T * kv * s + P, P


def cp_formula(scheme, cp, batch, T, C, tp, itemsize, n_blocks, recompute="none", kv=None):
    """{("cp", op): (calls, payload bytes)} of one forward and backward of n_blocks blocks on a micro-batch of
    `batch` sequences. A (k, v) block is 2N bytes, N = batch (T/cp) kv itemsize, kv = K/tp the columns of k a rank
    holds (its kv heads; default C/tp, multi-head attention).
      ring:      Isend and Irecv (cp-1) + (cp-1) + cp times per block: (k, v) forward, again backward, (dk, dv);
                 --recompute full runs the forward's ring again (+ cp-1); selective keeps what the ring keeps.
      allgather: one Allgather (payload: the gathered cp 2N) and one Reduce_scatter_block (its input, cp 2N) per
                 block; --recompute selective or full gathers again (+ 1 Allgather).
      ulysses:   four Alltoalls per block (payload: the send buffer): [q | k | v] and y forward, dy and
                 [dq | dk | dv] backward, Q = batch (T/cp) (C/tp + 2 kv) itemsize and Y = batch (T/cp) (C/tp)
                 itemsize, 2 (Q + Y) per block; --recompute selective or full runs the forward's two again
                 (+ Q + Y). A rank sends (cp-1)/cp of the payload: constant when T grows with cp.
      a2a+p2p:   cp = a r (a2a_sizes): Ulysses' four Alltoalls per block on the a ranks of a group, the same payloads
                 2 (Q + Y), and the ring's Isend/Irecv on the r groups, (r-1) + (r-1) + r per block of 2N bytes (a
                 group's a Tl rows of its NKV/(tp a) kv heads: the plain ring's block); it keeps no probabilities, so
                 only --recompute full runs the forward again (+ 2 Alltoalls, Q + Y, and r-1 hops). A rank sends
                 (a-1)/a of the all-to-alls' payload and (3r-2) 2N: both named "cp" (its sub-communicators').
    With grouped-query attention the blocks are the kv heads themselves, NH/NKV times fewer bytes than the query
    heads' (hsgd.cp.ring and hsgd.cp.allgather repeat them only for the products)."""
    if cp == 1 or not n_blocks:
        return {}
    kvc = C // tp if kv is None else kv
    kv = 2 * batch * (T // cp) * kvc * itemsize
    if scheme == "ulysses":
        again = recompute != "none"
        Q, Y = batch * (T // cp) * (C // tp + 2 * kvc) * itemsize, batch * (T // cp) * (C // tp) * itemsize
        return {("cp", "Alltoall"): (n_blocks * (4 + 2 * again), n_blocks * (2 + again) * (Q + Y))}
    if scheme == "a2a+p2p":
        r = a2a_sizes(cp)[1]
        again = recompute == "full"
        Q, Y = batch * (T // cp) * (C // tp + 2 * kvc) * itemsize, batch * (T // cp) * (C // tp) * itemsize
        hops = (r - 1) + (r - 1) + r + (r - 1) * again
        return {("cp", "Alltoall"): (n_blocks * (4 + 2 * again), n_blocks * (2 + again) * (Q + Y)),
                ("cp", "Isend"): (n_blocks * hops, n_blocks * hops * kv),
                ("cp", "Irecv"): (n_blocks * hops, n_blocks * hops * kv)}
    if scheme == "ring":
        hops = (cp - 1) + (cp - 1) + cp + (cp - 1) * (recompute == "full")
        return {("cp", "Isend"): (n_blocks * hops, n_blocks * hops * kv),
                ("cp", "Irecv"): (n_blocks * hops, n_blocks * hops * kv)}
    gathers = 1 + (recompute != "none")
    return {("cp", "Allgather"): (n_blocks * gathers, n_blocks * gathers * cp * kv),
            ("cp", "Reduce_scatter_block"): (n_blocks, n_blocks * cp * kv)}
