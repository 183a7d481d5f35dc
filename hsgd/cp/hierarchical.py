"""Hierarchical context parallelism (--cp-scheme a2a+p2p): Ulysses' all-to-all inside groups of a cp ranks, ring
attention across the r = cp/a groups, as Megatron-LM's `--cp-comm-type a2a+p2p` with
`--hierarchical-context-parallel-sizes a r`.

Why two levels. Ulysses (hsgd.cp.ulysses) sends a constant number of bytes per rank as cp grows, but cp must divide
every tp rank's heads, and an all-to-all among many ranks wants a fast network among all of them; the ring
(hsgd.cp.ring) splits no heads and talks only to its two neighbours, but makes cp - 1 hops per pass. Megatron-LM
puts the all-to-all on the a adjacent ranks of a node and the ring across the groups: the heads need only be
divisible by a, and the ring makes r - 1 hops of blocks as large as the plain ring's.

The groups. cp rank c is member j = c mod a of group G = c // a (Megatron-LM's order: "every a adjacent ranks form
the first level, the ranks of one index in their groups the second"). Two sub-communicators of cp_comm, made with
Split when the layout is made and freed with it (free()), both named "cp" (the accounting and the planner read one
cp communicator; hsgd.cp.split.cp_formula counts both):
    a2a comm   Split(color=G, key=j): the a ranks of group G, in cp order          (size a)
    ring comm  Split(color=j, key=G): member j of every group, in group order      (size r)

The positions. Every cp rank holds the zigzag chunks c and 2cp-1-c of the 2 cp chunks of c_ = T/(2 cp) positions
(hsgd.cp.split), as with the other schemes. The a2a turns that into a head split inside the group: member j receives
head group j (g = NH/(tp a) query heads, gk = NKV/(tp a) kv heads) of the positions of the a members, in member
order: rows i Tl .. (i+1) Tl - 1 hold member i's, positions split.positions(T, cp, G a + i), that is chunks G a + i
and 2cp-1-G a-i. Group G thus holds the 2a chunks G a .. G a + a - 1 and their mirrors, and ring step k brings group
G - k's (k, v) of the same head group. Its chunk pairs (group_chunks, mine against the owner group's) are those of
the ring: skipped when every key is after every query, masked when they share a chunk, whole otherwise; every group
computes the same (2cp + 1) c_^2 scores per head, as every ring rank does.

    forward   Alltoall on the a2a comm  [q | k | v]  (a, B, g + 2gk, T/cp, hs): block i, my positions of head group
                                                     i, to member i; received: member i's positions of my group
              ring attention on the ring comm over the group's a T/cp rows and g heads (hsgd.cp.ring.Ring's code,
              its chunks the group's): (k, v) of the group's rows passed r - 1 times, merged by the online softmax
              Alltoall on the a2a comm  y            (a, B, g, T/cp, hs): block i, member i's rows, back to member i
    backward  the adjoint from the bottom up: Alltoall of dy, the ring's backward (r - 1 hops of (k, v), r of (dk,
              dv)), Alltoall of [dq | dk | dv] back to the sequence split.
A ring block is 2 B (a T/cp) (NKV/(tp a)) hs s = 2 B T/cp NKV/tp hs s bytes: the plain ring's, with r - 1 hops in
place of cp - 1; the all-to-alls are Ulysses' on a ranks (hsgd.cp.split.cp_formula).

The sizes (a rule, not a flag). Megatron-LM takes a and r from the user. hsgd fixes them from cp alone,
a2a_sizes(cp): r is cp's smallest prime factor and a = cp / r, the largest all-to-all group that leaves a ring of at
least two groups (cp 4: 2 x 2; 8: 4 x 2; 6: 3 x 2); a prime cp has no such split and is refused, and a must divide
each tp rank's query and kv heads (hsgd.cp.split.check_heads). Every formula (bytes, memory, the planner) reads a
and r from cp, so no setting has to travel to them.

Memory. The cache is the ring's on the group (q by heads, the own (k, v) block, lse) and the group's y, which the
ring's backward reads (D = rowsum(dy y)) and which is not the array handed on (that is the second all-to-all's): N
C/tp more than the ring's, no probabilities, so --recompute selective has nothing to drop
(hsgd.cp.split.attention_cache_bytes).

Run: mpirun -n 8 python -m hsgd.train --cp 4 --tp 2 --cp-scheme a2a+p2p (tests/mpi/test_cp.py; chapter 13).

Left out: a and r as a flag; overlapping the all-to-alls with anything; more than two levels.

Legend: cp = a r, Tl = T/cp a rank's positions, B sequences, NH/tp and NKV/tp the rank's query and kv heads, g and
gk a head group's, hs the head size, s bytes per number.
"""
import numpy as np

from hsgd.cp.ring import Ring
from hsgd.cp.ulysses import head_groups
from hsgd.cp.split import ContextSplit, a2a_sizes, chunk_pairs, chunk_starts
from hsgd.grid.comm import Comm
from hsgd.model.backend import array_module


def group_chunks(T, cp, a, G, balanced=True):
    """[(local offset, global start, length)] of the chunks group G holds after the all-to-all: member i's chunks at
    local offset i T/cp (rows in member order)."""
    Tl = T // cp
    return [(i * Tl + lo, g, n) for i in range(a) for lo, g, n in chunk_starts(T, cp, G * a + i, balanced)]


def group_scores(T, cp, a, G, balanced=True):
    """The scores per head of a rank's NH/tp that a rank of group G computes in one forward: the group's chunk pairs
    that are not wholly masked, over the a ranks' heads (its g = NH/(tp a) heads of a T/cp queries): (2cp + 1) c^2,
    the ring's, with the balanced split."""
    mine = group_chunks(T, cp, a, G, balanced)
    return per_head(sum(nq * nk for o in range(cp // a) for _, gq, nq in mine
                        for _, gk, nk in group_chunks(T, cp, a, o, balanced) if gk <= gq + nq - 1), a)


def per_head(scores, a):
    """A group's scores per head of its g = NH/(tp a) heads, counted per head of the rank's NH/tp: / a (an integer
    where it divides)."""
    return scores // a if scores % a == 0 else scores / a


class Place:
    """A stand-in for a communicator that only says its size and rank (the planner's layouts; hsgd.plan.layout)."""

    def __init__(self, size, rank):
        self.size, self.rank = size, rank


class GroupRing(Ring):
    """Ring attention among the r groups, on the group's a T/cp rows (group_chunks) and its head group: hsgd.cp.ring's
    forward and backward with this layout's chunk pairs."""

    def __init__(self, comm, T, cp, a, balanced, xp):
        self.comm, self.T, self.cp, self.r, self.balanced = comm, T, comm.size, comm.rank, balanced
        self.work = {"forward": 0, "backward": 0}
        self.chunks = group_chunks(T, cp, a, self.r, balanced)
        self.blocks = [chunk_pairs(self.chunks, group_chunks(T, cp, a, o, balanced), xp) for o in range(self.cp)]


class Hierarchical(ContextSplit):
    """Ulysses inside groups of a adjacent cp ranks, ring attention across the r groups (see the module docstring).
    comm: cp_comm, or a Place (size and rank only: the layout's positions and masks, no communication)."""
    keeps_probabilities = False

    def __init__(self, comm, T, balanced=True, xp=np):
        super().__init__(comm, T, balanced, xp)
        self.a, self.n_groups = a2a_sizes(self.cp)
        self.group, self.member = divmod(self.r, self.a)
        self.a2a_comm = ring_comm = None
        if isinstance(comm, Comm):
            self.a2a_comm = Comm(comm.comm.Split(color=self.group, key=self.member), "cp", comm.stats, comm.check)
            ring_comm = Comm(comm.comm.Split(color=self.member, key=self.group), "cp", comm.stats, comm.check)
            self.a2a_comm.tracer = ring_comm.tracer = comm.tracer
        self.ring = GroupRing(ring_comm or Place(self.n_groups, self.group), T, self.cp, self.a, balanced, xp)

    def block_pairs(self, owner, xp):
        """None over cp itself: the chunk pairs are the ring of groups' (self.ring.blocks)."""
        return []

    def held_bytes(self):
        """Positions (host and device) and the masks of the ring of groups' chunk pairs."""
        masks = [m for pairs in self.ring.blocks for _, _, m in pairs if m is not None]
        arrays = {id(a): a for a in [self.pos, self.dev_pos] + masks}
        return sum(int(a.nbytes) for a in arrays.values())

    def free(self):
        """Free the two sub-communicators (collective over cp_comm), once: the trainer frees its layout when it is
        freed (HybridTrainer.free), and a caller that freed it before does no harm."""
        if getattr(self, "freed", False):
            return
        for c in (self.a2a_comm, self.ring.comm):
            if isinstance(c, Comm):
                c.free()
        self.a2a_comm, self.freed = None, True

    def attention_forward(self, q, k, v, nh):
        """q (B, T/cp, C/tp), k, v (B, T/cp, K/tp) -> y (B, T/cp, C/tp). Cache: the ring's on the group (q / sqrt(hs)
        (B, g, a Tl, hs), the own (k, v) (2, B, gk, a Tl, hs), the group's y (B, a Tl, g hs), lse (B, g, a Tl))."""
        xp, a = array_module(q), self.a
        B, Tl, C = q.shape
        send, g, gk, hs = head_groups(q, k, v, a, nh)                              # block i: head group i
        recv = xp.empty_like(send)
        self.a2a_comm.Alltoall(send, recv)                  # recv[i]: member i's positions of my head group
        rows = lambda x: x.transpose(1, 0, 3, 2, 4).reshape(B, a * Tl, -1)         # (a, B, h, Tl, hs) -> (B, aTl, h hs)
        yg, cache = self.ring.attention_forward(rows(recv[:, :, :g]), rows(recv[:, :, g:g + gk]),
                                                rows(recv[:, :, g + gk:]), g)      # (B, a Tl, g hs)
        self.work["forward"] = per_head(self.ring.work["forward"], a)
        back = xp.ascontiguousarray(yg.reshape(B, a, Tl, g, hs).transpose(1, 0, 3, 2, 4))   # block i: member i's rows
        mine = xp.empty_like(back)
        self.a2a_comm.Alltoall(back, mine)                  # mine[i]: my positions of head group i
        return mine.transpose(1, 3, 0, 2, 4).reshape(B, Tl, C), cache               # (B, Tl, C/tp) heads in order

    def attention_backward(self, dy, cache, out=None):
        """dq (B, T/cp, C/tp), dk, dv (B, T/cp, K/tp), views of out (B, T/cp, C/tp + 2K/tp)."""
        xp, a = array_module(dy), self.a
        qh, own = cache[0], cache[1]
        B, g, aTl, hs = qh.shape
        gk, Tl = own.shape[2], aTl // a
        C, Kc = g * a * hs, gk * a * hs
        if out is None:
            out = xp.empty_like(dy, shape=(B, Tl, C + 2 * Kc))
        send = xp.ascontiguousarray(dy.reshape(B, Tl, a, g, hs).transpose(2, 0, 3, 1, 4))    # (a, B, g, Tl, hs)
        recv = xp.empty_like(send)
        self.a2a_comm.Alltoall(send, recv)                  # the adjoint of y's all-to-all: dy by head groups
        dq, dk, dv = self.ring.attention_backward(recv.transpose(1, 0, 3, 2, 4).reshape(B, aTl, g * hs), cache)
        self.work["backward"] = per_head(self.ring.work["backward"], a)
        grads = xp.empty_like(dy, shape=(a, B, g + 2 * gk, Tl, hs))                 # block i: member i's rows
        for at, d, h in ((0, dq, g), (g, dk, gk), (g + gk, dv, gk)):
            grads[:, :, at:at + h] = d.reshape(B, a, Tl, h, hs).transpose(1, 0, 3, 2, 4)
        mine = xp.empty_like(grads)
        self.a2a_comm.Alltoall(grads, mine)                 # the adjoint of q, k, v's: back to the sequence split
        out[..., :C].reshape(B, Tl, a, g, hs)[...] = mine[:, :, :g].transpose(1, 3, 0, 2, 4)
        out[..., C:C + Kc].reshape(B, Tl, a, gk, hs)[...] = mine[:, :, g:g + gk].transpose(1, 3, 0, 2, 4)
        out[..., C + Kc:].reshape(B, Tl, a, gk, hs)[...] = mine[:, :, g + gk:].transpose(1, 3, 0, 2, 4)
        return out[..., :C], out[..., C:C + Kc], out[..., C + Kc:]
