"""Finite differences: a hand-written backward checked against the loss itself (chapter 1 derives it).

For a scalar loss L(a) and one coordinate a_j the central differences

    order 2:  fd_j = (L(a + h e_j) - L(a - h e_j)) / 2h                                          error O(h^2)
    order 4:  fd_j = (-L(a + 2h e_j) + 8 L(a + h e_j) - 8 L(a - h e_j) + L(a - 2h e_j)) / 12h     error O(h^4)

approach dL/da_j, and fd_error compares them with the backward pass's gradient an_j on the coordinates checked (all
of them, or n drawn per array), in one of two measures:

    "coordinate"  max_j |fd_j - an_j| / max(|fd_j| + |an_j|, floor)     each coordinate relative to itself
    "array"       max_j |fd_j - an_j| / max(max_j |an_j|, floor)        relative to the array's largest entry (the
                                                                        measure hsgd's tests print)

The floor keeps a gradient that is zero in exact arithmetic from dividing rounding noise by rounding noise. Across
the ranks of a tensor-parallel group (comm given; loss() collective, every rank calls it) an array that every rank
holds alike is one logical parameter, perturbed on every rank at once; a shard is perturbed on its owner alone, one
rank after the other, and each owner measures its own.
"""
import numpy as np

H, FLOOR = 1e-5, 1e-3        # chapter 1's step (float64's rounding and truncation errors both near 1e-10) and floor
STEPS = {2: ((1.0, 1.0), (-1.0, -1.0)), 4: ((2.0, -1.0), (1.0, 8.0), (-1.0, -8.0), (-2.0, 1.0))}   # (x h, weight)
DENOMINATOR = {2: 2.0, 4: 12.0}


def central_difference(loss, flat, j, h, order=2):
    """dL/d flat[j] by a central difference of `order` (2 or 4); flat (a view of the array loss() reads) is
    perturbed in place and restored."""
    old, total = flat[j], 0.0
    for k, w in STEPS[order]:
        flat[j] = old + k * h
        total += w * loss()
    flat[j] = old
    return total / (DENOMINATOR[order] * h)


def fd_error(loss, arrays, grads, n=None, h=H, floor=FLOOR, order=2, measure="coordinate", rng=None, comm=None,
             replicated=None):
    """The worst disagreement (see the module docstring) between grads[i], the backward's gradient of arrays[i],
    and central differences of loss(), which reads the arrays as they are (they are perturbed in place and
    restored). n: coordinates drawn per array (rng, default seed 0), or all of them; comm, replicated[i]: across
    the ranks of comm, whether arrays[i] is held alike by every rank (else: a shard, perturbed on its owner)."""
    rng = rng if rng is not None else np.random.default_rng(0)
    worst = 0.0
    for i, (a, an) in enumerate(zip(arrays, grads)):
        flat, an = a.reshape(-1), np.asarray(an).reshape(-1)            # flat is a view: writing it perturbs a
        coords = np.arange(flat.size) if n is None else rng.choice(flat.size, min(n, flat.size), replace=False)
        owners = [None] if comm is None or replicated[i] else range(comm.size)
        for owner in owners:                                            # (one rank's shard at a time)
            mine = owner is None or owner == comm.rank
            fd = np.array([central_difference(loss, flat if mine else flat.copy(), j, h, order) for j in coords])
            if mine:
                worst = max(worst, disagreement(fd, an[coords], floor, measure))
    return worst


def disagreement(fd, an, floor, measure):
    if measure == "coordinate":
        return float(np.max(np.abs(fd - an) / np.maximum(np.abs(fd) + np.abs(an), floor))) if fd.size else 0.0
    return float(np.max(np.abs(fd - an)) / max(float(np.max(np.abs(an))), floor)) if fd.size else 0.0
