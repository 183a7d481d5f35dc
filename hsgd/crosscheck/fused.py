"""A fused tensor searched as one: which of its blocks moved (q|k|v, gate|up, head groups).

A fused gradient (FORMAT.md "fused") is, along its fused axis, n pieces of a piece of each part in turn. Cut every
part into blocks of u entries, u the greatest common divisor of the parts' piece widths and, for attention's q|k|v,
of the head size (a head, however the pieces are laid out; F/n for a gate|up), and label each block (part, block
number within the part). The system's gradient G and the reference's R, both in the stored layout, are then lists of
blocks; a bug that concatenates or gathers the pieces in another order makes G's block i equal R's block p(i) for a
permutation p.

The search keeps every block that already equals its own reference block where it is (the identity first): a block
near zero (the gradient of a k-bias is exactly 0) equals every other such block, and taking it for one of them
would make a reordering out of a correct copy. Only the blocks that differ from their own reference are matched,
each to the first free block of R it equals, among the blocks that differ: a reordering moves blocks among
themselves, so its sources and its targets are the same set. If every differing block finds one, the moves are the
answer; otherwise G is not a reordering of R.

    moves(t, G, R, tol, hs)   {block: the reference block it holds} of the blocks that moved, or None
    describe(t, moved, word, hs)   {part: (class, detail)}: "swapped" when a whole part holds another part's gradient
                               ("h.0.attn.k holds h.0.attn.v's gradient"), "permutation" naming the blocks otherwise
"""
import math

import numpy as np

from .classify import telling


def unit(t, hs=0):
    """u: the entries of one block along the fused axis, the gcd of the parts' piece widths, and of the head size hs
    for attention's q|k|v (so that one head is a block also when the pieces are larger: [q | k | v], per tp rank)."""
    heads = [hs] if hs and all(".attn." in p for p in t.parts) else []
    return math.gcd(*[L // t.n_pieces() for L in t.lengths], *heads)


def blocks(t, hs=0):
    """[(part index, block number, stored start)] of every block of u entries, in the parts' order: part j's entry e
    sits in piece e // w_j at (piece) x (sum of widths) + (widths of the parts before j) + e mod w_j."""
    n, u = t.n_pieces(), unit(t, hs)
    widths = [L // n for L in t.lengths]
    out = []
    for j, L in enumerate(t.lengths):
        for b in range(L // u):
            e = b * u
            out.append((j, b, (e // widths[j]) * sum(widths) + sum(widths[:j]) + e % widths[j]))
    return out


def cut(t, X, hs=0):
    """(blocks, u entries along the fused axis x the rest) of the stored full array X."""
    u = unit(t, hs)
    moved = np.moveaxis(X, t.fuse_axis, 0)
    return np.stack([moved[start:start + u].ravel() for _, _, start in blocks(t, hs)])


def moves(t, G, R, tol, hs=0):
    """{i: j}: the blocks i of G that hold R's block j != i, when G is R with some blocks moved (G's other blocks equal
    R's where they are); None when it is not (a block that equals no free block of R) or nothing moved. Equal means
    within tol ||R|| (Frobenius, the whole tensor); and the moves must bring the whole error down as classify.telling
    asks (an order of magnitude, to within tol), not only each block under tol."""
    g, r = cut(t, G, hs), cut(t, R, hs)
    scale = float(np.linalg.norm(r))
    if scale == 0:
        return None
    near = lambda a, b: float(np.linalg.norm(a - b)) <= tol * scale
    differ = [i for i in range(len(g)) if not near(g[i], r[i])]           # the identity first
    free, found = list(differ), {}
    for i in differ:
        j = next((j for j in free if j != i and near(g[i], r[j])), None)
        if j is None:
            return None
        found[i] = j
        free.remove(j)
    order = np.arange(len(g))
    order[list(found)] = list(found.values())
    return found if found and telling(g, r, order, scale, tol) else None


def describe(t, moved, word, hs=0):
    """{part name: (class, detail)} of the parts whose blocks moved: "swapped" when every block of a part holds the
    same block of one other part, "permutation" listing the moves otherwise. word: what a block is ("heads" when u
    is the head size, else "blocks of u entries")."""
    labels = blocks(t, hs)
    count = {j: sum(1 for p, _, _ in labels if p == j) for j in range(len(t.parts))}
    out = {}
    for j, name in enumerate(t.parts):
        mine = [(labels[i][1], labels[k]) for i, k in moved.items() if labels[i][0] == j]
        if not mine:
            continue
        sources = {src[0] for _, src in mine}
        if len(mine) == count[j] and len(sources) == 1 and all(b == src[1] for b, src in mine):
            other = t.parts[sources.pop()]
            out[name] = ("swapped", f"{name} holds {other}'s gradient: the fused blocks of {t.name} are in another "
                                    f"order than layout.json says")
        else:
            listed = ", ".join(f"{name} {b} <- {t.parts[src[0]]} {src[1]}" for b, src in sorted(mine)[:6])
            more = f" and {len(mine) - 6} more" if len(mine) > 6 else ""
            out[name] = ("permutation", f"fused blocks of {t.name} in another order ({word}; a block <- the "
                                        f"reference block it holds): {listed}{more}")
    return out
