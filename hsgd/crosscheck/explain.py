"""Why a gradient over its tolerance fails: everything classify (hsgd.crosscheck.classify) may compare it with,
gathered once per dump and tensor, and the order it is asked in.

    Explainer(dump, params, grads0, names, floor2).of(t, name, copies, labels, mine, tol, bad_pad) -> (class, detail)

First, once per fused tensor, whether the whole tensor is another layout of its parts (relaid: layout.json says
another interleave than the system wrote) or its blocks moved among the parts (fused_moves, hsgd.crosscheck.fused);
then the parameter alone: classify with what each rank's shard holds (hsgd.crosscheck.replicas, against each dp
rank's own rows' gradient, hsgd.crosscheck.local) and with the gradients the system may have given in its place
(other_gradients: another part or parameter of its shape, a tied weight's one use; an expert-parallel bug's,
hsgd.crosscheck.experts; a dp rank's own). The candidates that need more reference runs (the experts', the dp
slices') are made the first time a gradient fails, once.
"""
from dataclasses import replace

import numpy as np

from . import fused
from .classify import classify, match
from .experts import Others, reference
from .local import Local
from .replicas import shard_states, stored_candidates


class Explainer:
    """(class, detail) of failing gradients of one dump (see the module docstring): names, the layout's factor names
    (classify.factor_names); floor2, the norm a difference is at least relative to."""

    def __init__(self, dump, params, grads0, names, floor2):
        self.dump, self.params, self.grads0, self.names, self.floor2 = dump, params, grads0, names, floor2
        self.moe = Others(dump, params, grads0)           # what an expert-parallel bug gives, when first asked
        self.local = Local(dump, params)                  # each dp rank's own rows' gradient, when first asked
        self.relayouts, self.candidates = {}, {}          # per tensor: the fused verdicts, the dp ranks' own

    def of(self, t, name, copies, labels, mine, tol, bad_pad):
        """(class, detail) of parameter `name` of tensor t: copies, labels as copies_of gives them, mine the copies
        in the reference's orientation, tol the distance that counts as equal, bad_pad the largest padding entry
        over its tolerance (0: none)."""
        dump, grads0, cfg = self.dump, self.grads0, self.dump.cfg
        if len(t.parts) > 1 and t.name not in self.relayouts:       # (once per fused tensor)
            self.relayouts[t.name] = relaid(t, copies[0], grads0, tol, cfg, dump.parallel["tp"]) or \
                fused_moves(t, copies[0], grads0, tol, cfg.head_size)
        found = self.relayouts.get(t.name)
        if isinstance(found, dict):
            found = found.get(name)                                  # (this part's blocks moved, or not)
        if found is not None:
            return found
        if t.name not in self.candidates:                           # (once per tensor, when it fails)
            self.candidates[t.name] = (t.from_reference(grads0), stored_candidates(t, self.local))
        R_s, candidates = self.candidates[t.name]
        states = shard_states(t, name, dump.grads, R_s, candidates, tol)
        others = other_gradients(dump, self.params, grads0, t, name, self.floor2) + self.moe.of(name) + \
            self.local.of(name)
        return classify(name, mine, grads0[name], tol, self.names, cfg.head_size, labels, bad_pad, self.floor2,
                        shard_blocks(t), others, states)


def relaid(t, G, grads0, tol, cfg, tp):
    """(class, detail) when the fused tensor t's stored gradient G, read with another of the usual layouts, gives
    every part's reference gradient within tol: [p0 | p1 | p2] (groups 1), per query group (NKV), per head (NH), per
    tp rank (tp); else None. A layout.json that says another layout than the system wrote."""
    said = t.n_pieces()
    for n in sorted({1, cfg.n_kv_heads, cfg.n_heads, tp} - {said}):
        if any(length % n for length in t.lengths):
            continue
        other = replace(t, interleave="groups", groups=n)
        if all(match(a, grads0[p], tol) for p, a in other.to_reference(G).items()):
            layout = "[p0 | p1 | ...] (interleave block)" if n == 1 else f"interleave groups, groups = {n}"
            return "fused layout", (f"{t.name} holds its parts as {layout}, not as layout.json says ("
                                    f"{t.interleave}, {said} pieces per part): read so, every part is the reference")
    return None


def tied_parts(dump, params):
    """The two uses' parts of a tied wte's reference gradient, as classify's `others`: with tied embeddings
    (logits = x wte^T) dL/dwte = the lookup's (rows of the batch's ids) + the LM head's; the reference of the same
    model untied, with lm_head = wte^T, gives them apart (its wte and lm_head.weight^T)."""
    untied = replace(dump.cfg, tied=False)
    _, g = reference(replace(dump, cfg=untied), {**params, "lm_head.weight": params["wte"].T.copy()})
    return [("part missing", "G is the embedding lookup's part alone: the LM head's (tied: logits = x wte^T) is "
                             "not added to wte's gradient", g["wte"]),
            ("part missing", "G is the LM head's part alone: the embedding lookup's is not added to wte's gradient",
             g["lm_head.weight"].T)]


def other_gradients(dump, params, grads0, t, name, floor2):
    """[(class, detail, gradient)] the system may have given in name's place: a part fused beside it in t with its
    shape, or any other parameter of its shape whose gradient is not near zero ("swapped": every k-bias gradient is
    0, and a zero would hold them all), and with a tied head wte's two parts alone ("part missing")."""
    others = [("swapped", f"{name} holds {o}'s gradient, fused beside it in {t.name}: the parts are in another order "
                          f"than layout.json's fused.parts", grads0[o])
              for o in t.parts if o != name and grads0[o].shape == grads0[name].shape]
    others += [("swapped", f"{name} holds {o}'s gradient: the gradients are written under other names (or the "
                           f"layers in another order) than layout.json says", g)
               for o, g in grads0.items() if o not in t.parts and g.shape == grads0[name].shape and
               float(np.linalg.norm(g)) > floor2]
    if name == "wte" and dump.cfg.tied:
        others += tied_parts(dump, params)
    return others


def fused_moves(t, G, grads0, tol, hs):
    """{part: (class, detail)} when the fused tensor t's stored gradient G is the reference's with blocks moved among
    its parts (hsgd.crosscheck.fused), else {}."""
    R = t.from_reference(grads0)
    moved = fused.moves(t, G, R, tol, hs)
    if moved is None:
        return {}
    u = fused.unit(t, hs)
    word = "heads" if u == hs and any(".attn." in p for p in t.parts) else f"blocks of {u} entries"
    return fused.describe(t, moved, word, hs)


def shard_blocks(t):
    """[(axis, length, "shards")]: the blocks of a split tensor's shards, in the reference's orientation, when it
    is one parameter split along one axis into equal shards (a permutation of them is the ranks gathered in another
    order)."""
    lengths = {s.length for s in t.shards if s.axis is not None and s.length}
    axes = {s.axis for s in t.shards if s.slices}
    if len(t.parts) > 1 or len(axes) != 1 or None in axes or len(lengths) != 1 or \
            any(s.padding for s in t.shards):
        return []
    axis = axes.pop()
    if t.transposed:
        axis = 1 - axis
    return [(axis, lengths.pop(), "shards")]
