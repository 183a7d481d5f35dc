"""A tensor's shards in layout.json, read and checked (hsgd/crosscheck/FORMAT.md "shards"): each whole, cut along one
axis (axis, offset, length, padding), or a box cut along several ("slices": FSDP x TP). Their boxes are the same
(replicas) or disjoint, and together they cover the tensor's real entries; anything else is one DumpError naming the
shards. The check of disjointness is pairwise on the boxes' bounds, in blocks (k^2 tests for k shards, no array of
the tensor's size); a hole is found on the grid of the boxes' cut points.

    parse_shards(entries, t, ranks, where)   [Shard] of tensor t's "shards" entry
"""
import math

import numpy as np

from .dump import DumpError, Shard, integer


def parse_shards(entries, t, ranks, where):
    """[Shard] of a tensor's "shards": each whole, cut along one axis (axis, offset, length, padding) or along
    several ("slices": a list of such objects, distinct axes: FSDP x TP); their boxes are the same (replicas) or
    disjoint, and (unless a rank holds it whole) they cover the tensor."""
    if not isinstance(entries, list) or not entries:
        raise DumpError(f"{where}: \"shards\" must list where its gradient's pieces are (at least one)")
    shards = [_shard(i, s, t, ranks, where) for i, s in enumerate(entries)]
    boxes = sorted({s.box() for s in shards if s.slices and all(n for _, _, n in s.box())})
    _disjoint(boxes, t, where)
    if all(s.slices for s in shards):
        if not boxes:
            raise DumpError(f"{where}: its shards hold padding only (length 0); the shards must cover the tensor's "
                            "real entries")
        volume = sum(math.prod(n for _, _, n in b) * math.prod(t.shape) //
                     math.prod(t.shape[a] for a, _, _ in b) for b in boxes)
        if volume != math.prod(t.shape):
            hole, axes = _hole(boxes, t.shape), sorted({a for b in boxes for a, _, _ in b})
            at = f"{hole[axes[0]]} of axis {axes[0]}" if len(axes) == 1 else f"{hole} of shape {list(t.shape)}"
            raise DumpError(f"{where}: no shard holds entry {at}; the shards must cover it")
    return shards


def _shard(i, s, t, ranks, where):
    """Shard i's Shard: whole (no axis, or axis null), one axis (axis, offset, length, padding: format 1), or the
    "slices" list; each slice inside the tensor along its axis."""
    if not isinstance(s, dict):
        raise DumpError(f"{where}: shard {i} must be an object with rank, axis, offset, length (or slices)")
    rank = integer(s.get("rank"), f"{t.name} shard {i}: rank")
    if rank >= ranks:
        raise DumpError(f"{where}: shard {i} is on rank {rank}, but the dump has ranks 0..{ranks - 1}")
    key = s.get("key", t.name)
    if not isinstance(key, str):
        raise DumpError(f"{where}: shard {i}: key must be a string")
    if "slices" in s:
        if s.get("axis") is not None:
            raise DumpError(f"{where}: shard {i} gives both axis and slices; give one (slices for several axes)")
        given = s["slices"]
        if not isinstance(given, list) or not 1 <= len(given) <= len(t.shape):
            raise DumpError(f"{where}: shard {i}: slices must be a list of 1 to {len(t.shape)} objects (axis, "
                            "offset, length, padding), one per axis the shard is cut along")
    else:
        given = [] if s.get("axis") is None else [s]
    slices = [_slice(c, f"{t.name} shard {i}", t, where) for c in given]
    axes = [c[0] for c in slices]
    if len(set(axes)) != len(axes):
        raise DumpError(f"{where}: shard {i} cuts axis {max(axes, key=axes.count)} twice; one slice per axis")
    # a slice of a whole axis without padding cuts nothing: left out, so that the same box reads the same however
    # it is written (axis 1 [0, 8) of a (37, 8) tensor is the whole tensor; with rows [0, 19) the box of those rows)
    cuts = tuple(sorted(c for c in slices if (c[1], c[2], c[3]) != (0, t.shape[c[0]], 0)))
    return Shard(rank, cuts, key)


def _slice(c, what, t, where):
    """(axis, offset, length, padding) of one slice object, inside the tensor."""
    if not isinstance(c, dict):
        raise DumpError(f"{where}: {what}: a slice must be an object with axis, offset, length (padding)")
    axis = integer(c.get("axis"), f"{what}: axis")
    if axis >= len(t.shape):
        raise DumpError(f"{where}: {what}: axis {axis} is not an axis of shape {list(t.shape)}")
    offset = integer(c.get("offset"), f"{what}: offset")
    length = integer(c.get("length"), f"{what}: length")
    padding = integer(c.get("padding", 0), f"{what}: padding")
    if length + padding < 1:
        raise DumpError(f"{where}: {what} holds nothing along axis {axis} (length 0 and no padding)")
    if offset + length > t.shape[axis]:
        raise DumpError(f"{where}: {what} ({offset} + {length}) runs past {t.shape[axis]} entries of axis {axis}")
    return axis, offset, length, padding


def _disjoint(boxes, t, where):
    """DumpError when two different boxes overlap (they hold some entry both, without being the same slice). A box
    leaves the axes it does not cut whole. Pairwise over the boxes, in blocks of rows (k^2 tests, k the shards)."""
    if len(boxes) < 2:
        return
    lo = np.zeros((len(boxes), len(t.shape)), np.int64)
    hi = np.tile(np.array(t.shape, np.int64), (len(boxes), 1))
    for k, b in enumerate(boxes):
        for a, o, n in b:
            lo[k, a], hi[k, a] = o, o + n
    for start in range(0, len(boxes), 256):
        both = (np.maximum(lo[start:start + 256, None], lo[None]) <
                np.minimum(hi[start:start + 256, None], hi[None])).all(axis=2)       # (256, k): overlap on every axis
        both[np.arange(both.shape[0]), np.arange(start, start + both.shape[0])] = False
        if both.any():
            i, j = np.argwhere(both)[0]
            b1, b2 = boxes[start + i], boxes[j]
            raise DumpError(f"{where}: shards {_text(b1)} and {_text(b2)} overlap without being the same slice; "
                            "replicas hold the same slice, other shards disjoint ones")


def _text(box):
    return " x ".join(f"axis {a} [{o}, {o + n})" for a, o, n in box)


def _hole(boxes, shape):
    """The first entry of the tensor no box holds (an index tuple); found on the grid of the boxes' cut points."""
    cuts = [sorted({0, shape[a]} | {v for b in boxes for ax, o, n in b if ax == a for v in (o, o + n)})
            for a in range(len(shape))]
    held = np.zeros([len(c) - 1 for c in cuts], bool)
    for b in boxes:
        index = [slice(None)] * len(shape)
        for a, o, n in b:
            index[a] = slice(cuts[a].index(o), cuts[a].index(o + n))
        held[tuple(index)] = True
    cell = np.argwhere(~held)[0]
    return tuple(int(cuts[a][k]) for a, k in enumerate(cell))
