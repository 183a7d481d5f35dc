"""Solutions to the exercises of chapter 13 (tutorials/13_context_parallelism.py).

    mpirun -n 8 python tutorials/solutions/13_context_parallelism.py

Exercise 1 counts the work of three layouts and runs the striped one as a subclass of hsgd.cp.ring.Ring on cp 8;
exercise 2 runs Ulysses with fewer kv heads than cp (hsgd.cp.ulysses.Ulysses subclassed to copy them) and compares
its bytes with the all-gather's; exercises 3 and 4 are arithmetic that every rank does (cheap), checked collectively.
"""
# mpirun -n 8 python tutorials/solutions/13_context_parallelism.py
import dataclasses
import os
import sys
from fractions import Fraction

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, rel_err, solve  # noqa: E402

from hsgd.model.config import ModelConfig  # noqa: E402
from hsgd.cp import split
from hsgd.cp.ring import Ring  # noqa: E402
from hsgd.cp.ulysses import Ulysses  # noqa: E402
from hsgd.errors import ConfigError  # noqa: E402
from hsgd.grid.process_grid import ProcessGrid  # noqa: E402
from hsgd.model.layers import attention_backward, attention_forward  # noqa: E402
from hsgd.accounting.activations import activation_formula  # noqa: E402

threadpool_limits(1)                    # eight ranks share the cores, tiny matrices: one BLAS thread each
world = MPI.COMM_WORLD
B, T, C = 2, 64, 16                     # the attention tests: batch, sequence, width


def serial_attention(nh, seed):
    """q, k, v, dy of the whole sequence (the same on every rank) and serial attention's y, dq, dk, dv."""
    rng = np.random.default_rng(seed)
    q, k, v, dy = (rng.standard_normal((B, T, C)) for _ in range(4))
    y, cache = attention_forward(q, k, v, nh)
    return (q, k, v, dy), (y, *attention_backward(dy, cache))


# ---------------------------------------------------------------------------------------------------- exercise 1

def needed(pos):
    """The scores the causal mask keeps for queries at positions pos: query t reads keys 0..t."""
    return int(sum(int(t) + 1 for t in pos))


class Striped(Ring):
    """Ring attention with rank r holding the positions t = r mod cp (Brandon et al. 2023): every block is one pair
    of all my rows and all the owner's rows, masked by their positions."""

    def __init__(self, comm, T):
        super().__init__(comm, T)
        self.pos = np.arange(self.r, T, self.cp)                 # (T/cp,) r, r + cp, r + 2cp, ...
        self.dev_pos = self.pos

    def pairs(self, owner):
        pk = np.arange(owner, self.T, self.cp)                   # the owner's key positions
        if pk[0] > self.pos[-1]:
            return []                                            # every key after every query
        mask = np.where(pk[None, :] > self.pos[:, None], -np.inf, 0.0)
        return [(slice(None), slice(None), mask if np.isinf(mask).any() else None)]


def exercise_1(check):
    """The striped layout."""
    counts = {}
    for cpn in (2, 4, 8):
        n, c = T // cpn, T // (2 * cpn)
        plain = [needed(split.positions(T, cpn, r, balanced=False)) for r in range(cpn)]
        zigzag = [needed(split.positions(T, cpn, r)) for r in range(cpn)]
        striped = [needed(np.arange(r, T, cpn)) for r in range(cpn)]
        counts[cpn] = (plain, zigzag, striped)
        check.equal(f"cp {cpn}: plain needs n (r n) + n (n + 1) / 2 on rank r", plain,
                    [n * r * n + n * (n + 1) // 2 for r in range(cpn)])
        check.equal(f"cp {cpn}: zig-zag needs 2 cp c^2 + c on every rank", zigzag, [2 * cpn * c * c + c] * cpn)
        check.equal(f"cp {cpn}: striped needs n (r + 1) + cp n (n - 1) / 2", striped,
                    [n * (r + 1) + cpn * n * (n - 1) // 2 for r in range(cpn)])
    for cpn, (plain, zigzag, striped) in counts.items():
        check.say(f"  cp {cpn}, T = {T}: scores needed per rank, plain {plain[0]}..{plain[-1]}, zig-zag {zigzag[0]} "
                  f"each, striped {striped[0]}..{striped[-1]}")
    g = ProcessGrid(world, dp=1, pp=1, tp=1, cp=8)
    (q, k, v, dy), want = serial_attention(4, 1)
    ring = Striped(g.cp_comm, T)
    mine = [np.ascontiguousarray(a[:, ring.pos]) for a in (q, k, v, dy)]
    y, cache = ring.attention_forward(*mine[:3], 4)
    got = (y, *ring.attention_backward(mine[3], cache))
    check("striped ring on cp 8: y, dq, dk, dv vs serial attention", max(rel_err(a, b[:, ring.pos])
                                                                        for a, b in zip(got, want)), 1e-13)
    n = T // 8
    check.equal("striped ring: every rank computes cp n^2 scores (no block is skipped)",
                g.cp_comm.allgather_obj(ring.work["forward"]), [8 * n * n] * 8)
    check.say(f"  striped computes {8 * n * n} scores a rank, hsgd's zig-zag {split.attention_blocks(T, 8, 0)}: its "
              f"blocks have no wholly masked parts to skip")
    g.free()


# ---------------------------------------------------------------------------------------------------- exercise 2

class CopiedKV(Ulysses):
    """Ulysses with fewer kv heads than cp (cp a multiple of them): each kv head copied to the cp/NKV head groups
    whose query heads read it, so that every group gets one; the copies' gradients summed on the way back."""

    def attention_forward(self, q, k, v, nh):
        B_, tl, kc = k.shape
        hs = q.shape[-1] // nh
        nkv = kc // hs
        r = self.cp // nkv                                                    # copies of each kv head
        copy = lambda a: np.repeat(a.reshape(B_, tl, nkv, 1, hs), r, axis=3).reshape(B_, tl, self.cp * hs)
        y, cache = super().attention_forward(q, copy(k), copy(v), nh)         # cp kv heads: one per group
        return y, (cache, nkv, r, hs)

    def attention_backward(self, dy, cache):
        cache, nkv, r, hs = cache
        dq, dk, dv = super().attention_backward(dy, cache)
        B_, tl, _ = dk.shape
        fold = lambda d: d.reshape(B_, tl, nkv, r, hs).sum(axis=3).reshape(B_, tl, nkv * hs)
        return dq, fold(dk), fold(dv)


def exercise_2(check):
    """Ulysses with fewer kv heads than cp: copies of the kv heads, and what they cost."""
    cpn, nh, nkv, s = 8, 8, 2, 8
    hs, n_rep = C // nh, nh // nkv
    g = ProcessGrid(world, dp=1, pp=1, tp=1, cp=cpn)
    rng = np.random.default_rng(2)
    q, dy = (rng.standard_normal((B, T, C)) for _ in range(2))
    k, v = (rng.standard_normal((B, T, nkv * hs)) for _ in range(2))
    rep = lambda a: np.repeat(a.reshape(B, T, nkv, 1, hs), n_rep, axis=3).reshape(B, T, C)
    y0, cache0 = attention_forward(q, rep(k), rep(v), nh)                     # serial grouped-query attention
    dq0, dk0, dv0 = attention_backward(dy, cache0)
    fold = lambda d: d.reshape(B, T, nkv, n_rep, hs).sum(axis=3).reshape(B, T, nkv * hs)
    want = (y0, dq0, fold(dk0), fold(dv0))
    try:
        split.check_heads(nh, nkv, cpn, 1, "ulysses")
        refused = False
    except ConfigError:
        refused = True
    check.holds(f"hsgd refuses Ulysses with NKV = {nkv} kv heads on cp = {cpn}", refused)
    ctx = CopiedKV(g.cp_comm, T)
    mine = [np.ascontiguousarray(a[:, ctx.pos]) for a in (q, k, v, dy)]
    before = g.stats.counts()
    y, cache = ctx.attention_forward(*mine[:3], nh)
    got = (y, *ctx.attention_backward(mine[3], cache))
    sent = g.stats.since(before)
    check(f"copied kv heads on cp {cpn}, NH = {nh}, NKV = {nkv}: y, dq, dk, dv vs serial grouped-query attention",
          max(rel_err(a, b[:, ctx.pos]) for a, b in zip(got, want)), 1e-13)
    tl = T // cpn
    qkv, yb = B * tl * (C + 2 * cpn * hs) * s, B * tl * C * s
    check.equal("the all-to-alls: 4 calls, payload 2 b T_l (C + 2 cp hs) s + 2 b T_l C s",
                sent, {("cp", "Alltoall"): (4, 2 * qkv + 2 * yb)})
    copies = Fraction(cpn - 1, cpn) * (2 * qkv + 2 * yb)                      # bytes a rank sends
    gather = 2 * (cpn - 1) * 2 * B * tl * nkv * hs * s                        # split.cp_formula's, sent: (cp-1)/cp
    check.equal("a rank sends 4 (cp-1)/cp b T_l (C + cp hs) s with copies, 4 (cp-1) b T_l NKV hs s gathering",
                (copies, gather), (Fraction(4 * (cpn - 1), cpn) * B * tl * (C + cpn * hs) * s,
                                   4 * (cpn - 1) * B * tl * nkv * hs * s))
    # copies / gather = (C + cp hs) / (cp NKV hs) = (NH + cp) / (cp NKV): less exactly when NH < cp (NKV - 1)
    for nh_, nkv_, cp_ in ((8, 2, 8), (8, 4, 8), (32, 8, 4), (4, 1, 4), (16, 2, 8)):
        ratio = Fraction(nh_ + cp_, cp_ * nkv_)
        check.equal(f"NH {nh_}, NKV {nkv_}, cp {cp_}: copies send less than the all-gather iff NH < cp (NKV - 1)",
                    ratio < 1, nh_ < cp_ * (nkv_ - 1))
        check.say(f"  NH {nh_:>2}, NKV {nkv_}, cp {cp_}: copies / all-gather = {float(ratio):.3f}")
    check.say(f"  here: copies {float(copies):.0f} B, all-gather {gather} B per rank and layer (NH = cp (NKV - 1): "
              "equal)")
    g.free()


# ---------------------------------------------------------------------------------------------------- exercise 3

def partial(s, V):
    """(m, l, o) of the scores s (nq, nk) and values V (nk, hs): max, sum of e^(s - m), sum of e^(s - m) v."""
    m = s.max(axis=1)
    p = np.exp(s - m[:, None])
    return m, p.sum(axis=1), p @ V


def merge(a, b):
    """Two partial results over disjoint keys -> the partial result over both."""
    (m1, l1, o1), (m2, l2, o2) = a, b
    m = np.maximum(m1, m2)
    e1, e2 = np.exp(m1 - m), np.exp(m2 - m)                   # each rescaled to the common maximum
    return m, l1 * e1 + l2 * e2, o1 * e1[:, None] + o2 * e2[:, None]


def finish(a):
    m, l, o = a
    return o / l[:, None], m + np.log(l)                      # y, lse


def exercise_3(check):
    """The merge of two partial results is associative."""
    rng = np.random.default_rng(3)
    nq, hs = 4, 8
    blocks = [(rng.standard_normal((nq, 8)) * 4, rng.standard_normal((8, hs))) for _ in range(8)]
    s_all, V_all = np.concatenate([s for s, _ in blocks], axis=1), np.concatenate([V for _, V in blocks])
    P = np.exp(s_all - s_all.max(axis=1, keepdims=True))
    y_ref = (P / P.sum(axis=1, keepdims=True)) @ V_all
    lse_ref = s_all.max(axis=1) + np.log(P.sum(axis=1))
    parts = [partial(s, V) for s, V in blocks]
    a, b, c = parts[:3]
    err = max(rel_err(x, w) for x, w in zip(merge(merge(a, b), c), merge(a, merge(b, c))))
    check("merge((a, b), c) vs merge(a, (b, c)): m, l, o", err, 1e-14)
    check("merge(a, b) vs merge(b, a)", max(rel_err(x, w) for x, w in zip(merge(a, b), merge(b, a))), 1e-15)

    def tree(ps):
        return ps[0] if len(ps) == 1 else merge(tree(ps[:len(ps) // 2]), tree(ps[len(ps) // 2:]))

    def fold(ps):
        out = ps[0]
        for x in ps[1:]:
            out = merge(out, x)
        return out
    orders = {"left to right": fold(parts), "right to left": fold(parts[::-1]), "as a tree": tree(parts),
              "shuffled": fold([parts[i] for i in rng.permutation(8)])}
    for name, res in orders.items():
        y, lse = finish(res)
        check(f"8 blocks merged {name}: y and lse vs the softmax at once", max(rel_err(y, y_ref),
                                                                            rel_err(lse, lse_ref)), 1e-14)
    empty = (np.full(nq, -np.inf), np.zeros(nq), np.zeros((nq, hs)))
    check("merge(a, empty) vs a: an empty block changes nothing", max(rel_err(x, w)
                                                                     for x, w in zip(merge(a, empty), a)), 1e-300)
    y, lse = finish(parts[0])
    for p_ in parts[1:]:                                      # normalised outputs merged by their lse alone
        y2, lse2 = finish(p_)
        sig = 1.0 / (1.0 + np.exp(lse2 - lse))                # sigma(lse - lse2)
        y, lse = sig[:, None] * y + (1.0 - sig)[:, None] * y2, np.logaddexp(lse, lse2)
    check("normalised outputs merged by lse (sigmoid weights) vs the softmax at once",
          max(rel_err(y, y_ref), rel_err(lse, lse_ref)), 1e-14)


# ---------------------------------------------------------------------------------------------------- exercise 4

def exercise_4(check):
    """Where the memory crosses over."""
    big = ModelConfig(vocab_size=256, seq_len=4096, d_model=4096, n_heads=32, n_layers=32, d_ff=16384)
    s, cpn = 2, 8
    Cb, F, NH = big.d_model, big.d_ff, big.n_heads

    def block(T_, cp_=cpn, scheme="ring"):
        return activation_formula(dataclasses.replace(big, seq_len=T_), 1, s, 1, "megatron", cp_, scheme)["block"]

    alpha = Fraction(s * (8 * Cb + 2 + 2 * F + NH), cpn)      # ring: s N_l (5C + 2 + 2F) + s (3 N_l C + NH T_l)
    beta = Fraction(s * (6 * Cb + 2 + 2 * F), cpn) + 2 * s * Cb    # all-gather: + s (N_l C + 2 T C) ...
    gamma = Fraction(s * NH, cpn)                                    # ... + s NH T_l T
    Ts = [16 * i for i in range(1, 200)]
    check.equal("ring block == alpha T, all-gather block == beta T + gamma T^2 (T = 16..3184)",
                ([block(T_) for T_ in Ts], [block(T_, scheme="allgather") for T_ in Ts]),
                ([alpha * T_ for T_ in Ts], [beta * T_ + gamma * T_ * T_ for T_ in Ts]))
    t_star = (2 * alpha - beta) / gamma                       # all-gather >= 2 ring from here on
    closed = -(-t_star.numerator // (t_star.denominator * 2 * cpn)) * 2 * cpn   # the next multiple of 2cp
    search = next(T_ for T_ in Ts if block(T_, scheme="allgather") >= 2 * block(T_))
    check.say(f"  all-gather >= 2 x ring from T = (10C + 2 + 2F + 2NH - 2C cp)/NH = {float(t_star):.2f}: "
              f"the first multiple of 2cp is {closed}")
    check.equal("the crossover T: closed form == search over activation_formula", closed, search)
    one = (8 * Cb + 2 + 2 * F) / NH                           # s NH T^2 > s (8TC + 2T + 2TF) from here on
    search1 = next(T_ for T_ in range(1, 4096) if s * NH * T_ * T_ > block(T_, 1) / 2)
    check.say(f"  one rank: probabilities > half the block from T > (8C + 2 + 2F)/NH = {one:.2f}, i.e. T = {search1}")
    check.equal("one rank: the first T where probabilities > half == floor((8C + 2 + 2F)/NH) + 1",
                search1, int(one) + 1)


check = Checks(world, tol=1e-10, width=84)
solve(check, [exercise_1, exercise_2, exercise_3, exercise_4])
