"""What kind of bug a wrong gradient shows. Each test compares the system's gradient G of one parameter (every
replica of it) with the reference's R, and says what G is, if it is R changed in a simple way:

    not finite       G holds inf or NaN
    missing          G = 0 where R is not, on every replica or on some: the gradient never arrived there
    partial sum      the replicas differ, and their sum (or mean) over the k distinct copies is R: a reduction
                     over k ranks is missing (a replicated parameter's partial gradients never added up)
    unreduced        G (every replica, or those that are not R) is one data-parallel rank's own rows' gradient R_d
                     (or R_d / dp): the reduction over dp is missing, or ran over a group whose ranks hold the same
                     rows (tp), or its result never reached those ranks' buffers (hsgd.crosscheck.local)
    stale replica    some replicas are R and the others hold something else (not zero, not a part): their buffer was
                     not updated with the reduced gradient (stale, or written before the reduction)
    replicas differ  no replica is R, and they differ without adding up to it: a reduction over the wrong group
    padding          entries that stand for no real index (a vocabulary padded to divide by tp) carry gradient:
                     the padding takes part in the loss
    constant factor  G = c R; c is named by the layout's sizes when it is one of them, a product of two, or an
                     inverse (tp, dp, pp, cp, micro-batches, tokens): a sum where a mean belongs, a 1/n missing
                     (the simplest names that fit, all of them when two sizes are equal: choose layouts whose
                     sizes differ to tell them apart)
    permutation      G's blocks along one axis are R's in another order: the shards (ranks gathered in another
                     order), heads (blocks of hs), rows or columns; or blocks of a fused tensor (q|k|v, gate|up,
                     head groups) moved among its parts (hsgd.crosscheck.fused)
    transposed       G = R^T (a square weight stored the other way round)
    swapped          G is another parameter's gradient: one fused with it in the same tensor (gate and up of a
                     fused [gate | up], read in another order than layout.json says), or any other of its shape
    part missing     G is one part of R, a sum of several uses of one weight: with tied embeddings wte's gradient
                     is the embedding lookup's plus the LM head's (logits = x wte^T), and one was not added
    wrong group      an expert's G is the sum (or mean) of other experts' R: averaged over ranks that hold other
                     experts (hsgd.crosscheck.experts)
    balance domain   G is R with the balance loss over each rank's rows instead of its declared domain
    no simple pattern   none of these: a bug in the arithmetic itself (or several at once)

`match` decides equality up to `tol`, the relative distance ||a - b|| / ||b|| (Frobenius norms) that the dump's
dtype allows (hsgd.crosscheck.__main__ sets it: float64 1e-10, float32 1e-4, the rounding band otherwise).
"""
import itertools

import numpy as np


def rel(a, b):
    """||a - b|| / ||b|| (Frobenius; 0 when both are 0, inf when only b is)."""
    nb = float(np.linalg.norm(b))
    d = float(np.linalg.norm(a - b))
    return d / nb if nb > 0 else (0.0 if d == 0 else float("inf"))


def match(a, b, tol):
    return a.shape == b.shape and rel(a, b) <= tol


def factor_names(parallel, tokens):
    """[(value, name, how many sizes)]: the sizes a wrong constant factor may be (the layout's, ep among them, the
    batch's tokens B T and a dp rank's B T / dp), products of two of them (a size squared: two layers that each miss
    it), and the inverses of all."""
    sizes = {"tp": parallel.get("tp", 1), "dp": parallel.get("dp", 1), "pp": parallel.get("pp", 1),
             "cp": parallel.get("cp", 1), "ep": parallel.get("ep", 1),
             "micro-batches": parallel.get("micro_batches", 1),
             "tokens": tokens, "tokens per dp rank": tokens / max(1, parallel.get("dp", 1))}
    base = [(v, k) for k, v in sizes.items() if v > 1]
    out = []
    for v, k in base:
        out.append((v, k, 1))
    for (v1, k1), (v2, k2) in itertools.combinations_with_replacement(base, 2):
        out.append((v1 * v2, f"{k1} x {k2}", 2))
    both = out + [(1.0 / v, f"1/{k}" if " x " not in k else f"1/({k})", n) for v, k, n in out]
    return both


NAMING = 0.01             # a factor is named by a size within 1% of it, however wide the dtype's tolerance


def name_factor(c, names, tol):
    """The simplest names of c among factor_names (all that fit, simplest first), or []: a size fits within 10 x
    tol, and never more than NAMING (in bfloat16 a wide tolerance would otherwise name 2 by 2.1)."""
    fits = [(n, k) for v, k, n in names if abs(c / v - 1.0) <= min(max(tol, 1e-9) * 10, NAMING)]
    fits.sort()
    if not fits:
        return []
    best = fits[0][0]
    return [k for n, k in fits if n == best]


def distinct(copies, tol):
    """The different values among the replicas: [(value, [indices])]."""
    out = []
    for i, a in enumerate(copies):
        for value, held in out:
            if match(a, value, tol) or (float(np.linalg.norm(value)) == 0 and float(np.linalg.norm(a)) == 0):
                held.append(i)
                break
        else:
            out.append((a, [i]))
    return out


MAX_BLOCKS = 4096         # a permutation is looked for among at most this many blocks (k^2 distances)


def block_permutation(G, R, axis, block, tol):
    """The order p with G's block i = R's block p[i] along `axis` (blocks of `block` entries), if G is R with its
    blocks permuted (not the identity); else None. Each block of G takes the nearest block of R not taken yet,
    within tol ||R|| (blocks that are equal, such as the zero rows of tokens absent from the batch, match among
    themselves in order). Not tried above MAX_BLOCKS blocks."""
    n = G.shape[axis]
    if n % block or not 2 <= n // block <= MAX_BLOCKS:
        return None
    k = n // block
    g = np.moveaxis(G, axis, 0).reshape(k, -1)
    r = np.moveaxis(R, axis, 0).reshape(k, -1)
    scale = float(np.linalg.norm(R))
    if scale == 0:
        return None
    # (k, k) distances by |g|^2 + |r|^2 - 2 g.r: a k x k matrix, not (k, k, block) differences; it loses digits
    # to cancellation (about sqrt(eps) |g|), so it only orders the candidates, which are then measured exactly
    d2 = (g * g).sum(1)[:, None] + (r * r).sum(1)[None, :] - 2.0 * g @ r.T
    d = np.sqrt(np.maximum(d2, 0.0)) / scale
    slack = 1e-6 + tol
    taken, order = np.zeros(k, bool), []
    for i in range(k):
        for j in np.argsort(d[i], kind="stable"):
            if d[i, j] > tol + slack:
                return None                                  # no block of R is near enough
            if not taken[j] and float(np.linalg.norm(g[i] - r[j])) / scale <= tol:
                taken[j] = True
                order.append(int(j))
                break
        else:
            return None
    if order == list(range(k)):
        return None
    return order if telling(g, r, order, scale, tol) else None


def telling(g, r, order, scale, tol):
    """Whether G's blocks taken in `order` tell a reordering, not rounding: G reordered equals R within tol as a
    whole, and an order of magnitude closer than G as it is. A block is matched within tol ||R||, the whole tensor's
    norm, so in a vector slightly off everywhere (a rounding band's worth) a block of one entry finds some other
    entry that near; only a reordering brings the whole error down."""
    moved = float(np.linalg.norm(g - r[order])) / scale
    return moved <= tol and moved * 10 <= float(np.linalg.norm(g - r)) / scale


def axis_words(name, axis, hs):
    """(what a block of hs entries along `axis` is: "heads" or None, and what one entry is: "rows" / "columns")."""
    heads = None
    if (any(f".attn.{m}.weight" in name for m in "qkv") and axis == 1) or \
            (any(f".attn.{m}.bias" in name for m in "qkv") and axis == 0) or \
            (name.endswith("attn.proj.weight") and axis == 0):
        heads = "heads"
    return heads, ("rows" if axis == 0 else "columns")


def classify(name, copies, R, tol, names, hs, labels=None, bad_pad=0.0, floor=0.0, blocks=(), others=(), states=()):
    """(class, detail) of one parameter whose gradient failed. copies: the assembled replicas of G (reference
    orientation, at least one); R: the reference gradient; tol: the relative distance that counts as equal;
    names: factor_names(...); hs: the head size; labels: the ranks each copy came from ("3", or "0+1" for one
    assembled from the shards of ranks 0 and 1); bad_pad: the largest padding entry, when over its tolerance;
    floor: the norm a difference is at least relative to in the detail (the zero gradient of a k-bias);
    blocks: more (axis, length, word) blocks to look for a permutation of (the tensor's shards);
    others: [(class, detail, array)]: what else G may be (swapped, part missing, unreduced; of_others);
    states: [(rank, what its shard holds)] (hsgd.crosscheck.replicas.shard_states), for the replicas.
    First what the replicas show (not finite, padding, missing, a partial sum), then whether G is one of the
    others, then what one replica's shape shows (a factor, a transpose, a permutation)."""
    labels = labels or [str(i) for i in range(len(copies))]
    return (of_replicas(copies, R, tol, labels, bad_pad, states) or
            of_others(copies[0], tol, others) or
            of_values(name, copies[0], R, tol, names, hs, floor, blocks))


def of_replicas(copies, R, tol, labels, bad_pad, states=()):
    """(class, detail) from the replicas together, or None when they agree and none is zero or not finite. states:
    [(rank, what its shard holds)] (hsgd.crosscheck.replicas.shard_states: "R", "zero", ("own", what), "not finite",
    "other"), so that the ranks named are the ones that hold each value; without them each copy stands for its ranks.
    Replicas that differ: unreduced when every shard that is not R is a dp rank's own rows' gradient, a partial sum
    when the copies' sum or mean is R, a stale replica when some ranks hold R, else none of them R."""
    states = list(states) or [(labels[i], "not finite" if not np.isfinite(c).all() else "R" if match(c, R, tol) else
                               "zero" if not np.any(c) else "other") for i, c in enumerate(copies)]
    ranks = lambda which: " | ".join(sorted(set(which), key=lambda r: (len(r), r)))      # (rank numbers, in order)
    bad = [r for r, st in states if st == "not finite"]
    if bad:
        return "not finite", f"the gradient holds inf or NaN (ranks {ranks(bad)})"
    if bad_pad:
        scale = float(np.abs(R).max()) or 1.0
        return "padding", (f"the padded entries carry gradient (largest {bad_pad:.2g}, {bad_pad / scale:.2g} of the "
                           f"largest real entry): entries that stand for no real index (a vocabulary padded to divide "
                           f"by tp, a dimension padded to split evenly) take part in the computation")
    zero = [r for r, st in states if st == "zero"]
    if zero and np.any(R):
        where = "" if len(zero) == len(states) else f" on ranks {ranks(zero)}"
        return "missing", f"the gradient is zero{where}: it never arrived there"
    groups = distinct(copies, tol)
    if len(groups) == 1:
        return None
    k = len(groups)
    total = sum(v for v, _ in groups)
    held = " | ".join(",".join(labels[i] for i in idx) for _, idx in groups)
    right = [r for r, st in states if st == "R"]
    own = [(r, st[1]) for r, st in states if isinstance(st, tuple)]
    other = [r for r, st in states if st == "other"]
    if own and not other:
        holding = {}
        for r, what in own:
            holding.setdefault(what, []).append(r)
        each = "; ".join(f"ranks {ranks(rs).replace(' | ', ',')}: {what}" for what, rs in holding.items())
        if right:
            return "unreduced", (f"ranks {ranks(right)} hold the reference; ranks {ranks([r for r, _ in own])} hold "
                                 f"their own rows' gradient ({each}): the reduced gradient never reached their "
                                 f"buffers")
        return "unreduced", (f"no replica holds the reference, each its own rows' gradient ({each}): the reduction "
                             f"over dp is missing, or ran over a group whose ranks hold the same rows (such as tp)")
    if match(total, R, tol):
        return "partial sum", (f"the replicas hold {k} different values (ranks {held}); their sum is the "
                               f"reference: a sum over {k} ranks is missing")
    if match(total / k, R, tol):
        return "partial sum", (f"the replicas hold {k} different values (ranks {held}); their mean is the "
                               f"reference: an average over {k} ranks is missing")
    if right:
        return "stale replica", (f"ranks {ranks(right)} hold the reference; ranks {ranks(other + [r for r, _ in own])} "
                                 f"hold another value, neither a part of it nor a dp rank's own: their buffer was not "
                                 f"updated with the reduced gradient (stale, or written before the reduction)")
    return "replicas differ", (f"the replicas hold {k} different values (ranks {held}), none of them the reference "
                               f"nor adding up to it: a reduction over the wrong group")


def of_others(G, tol, others):
    """(class, detail) of the first of `others` [(class, detail, A)] that G equals within tol: G is A, not R (the
    gradient of the part fused beside it, one use of a weight used twice); else None."""
    for cls, detail, A in others:
        if match(G, A, tol):
            return cls, detail
    return None


def of_values(name, G, R, tol, names, hs, floor, blocks):
    """(class, detail) from one replica G against R: a constant factor, a transpose, a permutation, or none."""
    nR = float(np.linalg.norm(R))
    if nR > 0:
        c = float((G * R).sum()) / nR ** 2
        if match(G, c * R, tol) and abs(c - 1) > tol:
            return "constant factor", factor_detail(c, name_factor(c, names, tol))
    if G.ndim == 2 and G.shape[0] == G.shape[1] and match(G, R.T, tol):
        return "transposed", "the gradient is the reference's transpose"
    tries = list(blocks)
    for axis in range(G.ndim):
        heads, entry = axis_words(name, axis, hs)
        tries += [(axis, hs, heads), (axis, 1, entry)]
    for axis, block, word in tries:
        order = None if word is None else block_permutation(G, R, axis, block, tol)
        if order is not None:
            return "permutation", (f"{word} along axis {axis} in another order: {order} (G's block i is R's "
                                   f"order[i])")
    d = float(np.linalg.norm(G - R)) / max(nR, floor) if max(nR, floor) > 0 else float("inf")
    return "no simple pattern", f"differs by {d:.2g} (relative), in no pattern tried"


def factor_detail(c, fit):
    """What G = c R says, with the sizes `fit` that name c (name_factor), if any."""
    what = f"{c:.6g} x the reference"
    if not fit:
        return f"{what} (not a size of the layout)"
    bare = [k[2:] if k.startswith("1/") else k for k in fit]
    n = " or ".join(k if " x " not in k or k.startswith("(") else f"({k})" for k in bare)
    missing = f"1/{n}" if len(fit) == 1 else f"1/({n})"
    hint = (f"a sum over {n} where an average belongs, or a {missing} missing" if c > 1 else
            f"divided by {n} once too often, or an average over {n} where a sum belongs")
    return f"{what} = {' or '.join(fit)}: {hint}"
