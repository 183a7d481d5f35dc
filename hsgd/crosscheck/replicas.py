"""What each shard of a failing gradient holds, rank by rank: the verdict on replicas names ranks, not copies.

A copy of a tensor's gradient is assembled from one shard of every box (hsgd.crosscheck.__main__.copies_of: copy k
takes the k-th shard listed for each box), so when a tensor is split (over tp, or along two axes) a copy mixes ranks,
and which ranks go together depends only on the order layout.json lists them. Whether rank 1's half never arrived or
rank 0's did not either cannot be told from the copy "0+1". So each shard is judged on its own: its real entries put
in place of the reference's, in the stored tensor R_s = t.from_reference(R), the rest of R_s left as it is, and the
part read back (t.to_reference) and compared with the part's reference R_p, where

    "R"            the shard's piece of the part equals the reference's (within tol ||R_p||, the verdict's measure)
    "zero"         it is zero where the reference's is not: the gradient never arrived on that rank
    ("own", what)  it equals one dp rank's own rows' gradient there (hsgd.crosscheck.local: R_d or R_d / dp)
    "not finite"   it holds inf or NaN
    "other"        anything else

A shard that holds no entry of the part (a fused tensor's shard of other heads) is not listed.
"""
import numpy as np


def stored_candidates(t, local):
    """[(what, stored array)]: each dp rank's own rows' gradient of tensor t in its stored layout (R_d, R_d / dp),
    from hsgd.crosscheck.local.Local (run the first time a gradient fails)."""
    return [(what, t.from_reference(g)) for what, g in local.candidates()]


def shard_states(t, part, grads, R_s, candidates, tol):
    """[(rank, state)] of the shards of tensor t that hold entries of reference parameter `part` (module docstring).
    grads: the ranks' arrays {key: array}; R_s: the reference in t's stored layout; candidates: stored_candidates."""
    R_p = t.to_reference(R_s)[part]
    scale = max(float(np.linalg.norm(R_p)), 1e-300)
    ndim = len(t.shape)
    near = lambda a, b: float(np.linalg.norm(a - b)) <= tol * scale

    def placed(values, where):                               # R_s with the box replaced, read back as the part
        A = R_s.copy()
        A[where] = values
        return t.to_reference(A)[part]

    out = []
    for s in t.shards:
        real, _ = s.split(grads[s.rank][s.key].astype(np.float64))
        where = s.where(ndim)
        box = np.zeros(t.shape)
        box[where] = 1.0
        if not t.to_reference(box)[part].any():
            continue                                         # (no entry of this part in the box)
        mine = placed(real, where)
        if not np.isfinite(mine).all():
            state = "not finite"
        elif near(mine, R_p):
            state = "R"
        elif np.array_equal(mine, placed(np.zeros_like(real), where)):
            state = "zero"
        else:
            state = next((("own", what) for what, L in candidates if near(mine, placed(L[where], where))), "other")
        out.append((str(s.rank), state))
    return out
