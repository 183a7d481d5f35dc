"""FP8 weights sent as FP8 (--fp8-allgather, with --zero 3): each rank casts its chunk of a layer's block-linear
weights to one byte a value before ZeRO-3's All-Gather, instead of sending the run's 4 or 8 bytes and casting after
(torchao's FP8 All-Gather for PyTorch's FSDP2 does this; its precompute_float8_dynamic_scale_for_fsdp reduces all
the weights' amaxes over the shards in one call after the optimizer's step, where scales() here reduces a layer's at
each of its gathers).

For group g (a layer, hsgd.dp.sharded: its parameters laid end to end and cut into n chunks of c_g; each weight's
elements lie in the chunks of one or more shard ranks):

    amax_W = MAX over the shard comm (and over tp, where tp splits W) of max |my piece of W|       (tensorwise)
    s_W    = fmax / amax_W              (delayed: from W's amax history; my piece's amax is recorded for it)
    row    = [ the bytes of the chunk's other elements | codes of round(w s_W, E4M3) for my pieces of FP8 weights ]
             (hsgd.fp8.codes), padded to the widest rank's row (a multiple of itemsize: every row's others aligned)
    Allgather(row) -> (n, width) bytes over the shard comm
    rank j's piece of W = decode(codes) / s_W; its other elements as they were sent

s_W is the scale hsgd.fp8.linear would take from the whole weight, and the cast is the same, so the values are the
ones the linear layers would cast: they take them as they come (Fp8.precast), forward and dgrad alike (one scale per
tensor). Rowwise and blockwise are not built here (a tile may cross a chunk boundary; torchao sends per-tensor
scaled weights only). Bytes of one gather: n x width, width = the largest over the ranks of (FP8 elements + itemsize
x other elements) of a chunk: a block's weights in about a quarter of float32's bytes (hsgd.dp.sharded.ShardedSizes
.gather_bytes; the scales' Allreduces in formula()).

The bytes travel, the scale does not: every rank decodes with its own s_W, so a rank that took its amax on its own
piece alone (hsgd.fp8.scaling.BUGS "amax-local-shard") sent codes of w s_r that the others read as w s_r / s_W, its
piece of the weight s_r / s_W times too large or too small. The error model's draws (hsgd.check.oracle.PerturbedFp8)
cast to values no format holds: theirs travel in the run's type, decoded alike.
"""
from collections import namedtuple

from hsgd.dp.zero3 import Wire
from hsgd.fp8.codes import decode, encode
from hsgd.fp8.domains import check_same, reduce_max
from hsgd.fp8.linear import FP8_LINEARS, key as fp8_key
from hsgd.fp8.scaling import past_max
from hsgd.model.backend import array_module
from hsgd.model.precision import FORMATS

# a group's plan: its FP8 weights' names; per shard rank, the pieces of its chunk that are FP8 weights
# [(weight index, a, b)] and the others [(a, b)] (offsets in the chunk), how many elements each holds (n_fp8,
# n_others, per rank), and the row's width in bytes
Plan = namedtuple("Plan", "weights pieces others n_fp8 n_others width")


class Fp8Gather(Wire):
    """ZeRO-3's wire with the block linears' weights sent as FP8 codes (the module docstring). stage: the
    hsgd.pp.stage.Stage whose Fp8 (stage.fp8) and Holders (stage.setup.products.holders) it casts with, read at each
    gather (the oracle's draws put another Fp8 in)."""
    sends_fp8 = True

    def __init__(self, stage):
        self.stage = stage

    def attach(self, ex):
        super().attach(ex)
        n, size = ex.sizes.n, ex.dtype.itemsize
        self.plans = {}
        for g, names in ex.groups.items():
            weights = [w for w in names if FP8_LINEARS.match(w)]
            if not weights:
                continue
            c = ex.sizes.layout[g].c
            pieces, others = [], []
            for r in range(n):
                lo, hi, mine, rest, at = r * c, (r + 1) * c, [], [], r * c
                for i, w in enumerate(weights):                  # (the FP8 weights' ranges, in order)
                    a, b = ex.inner[w]
                    a, b = max(a, lo), min(b, hi)
                    if a < b:
                        if at < a:
                            rest.append((at - lo, a - lo))
                        mine.append((i, a - lo, b - lo))
                        at = b
                if at < hi:
                    rest.append((at - lo, hi - lo))
                pieces.append(mine)
                others.append(rest)
            n_fp8 = [sum(b - a for _, a, b in mine) for mine in pieces]
            n_others = [sum(b - a for a, b in rest) for rest in others]
            width = max(k + size * m for k, m in zip(n_fp8, n_others))
            width = -(-width // size) * size                      # (a multiple of itemsize: each row aligned)
            self.plans[g] = Plan(weights, pieces, others, n_fp8, n_others, width)
            ex.sizes.gather_bytes[g] = n * width

    def gather(self, g):
        """Group g whole (n c_g,): its FP8 weights cast before the Allgather (the module docstring)."""
        plan = self.plans.get(g)
        if plan is None:
            return super().gather(g)                             # (the embedding, the head: as they are)
        ex, fp8 = self.ex, self.stage.fp8
        xp, dtype = array_module(ex.master_), ex.dtype
        lay, n, r = ex.sizes.layout[g], ex.sizes.n, ex.shard_comm.rank
        mine = ex.master_[lay.own:lay.own + lay.c]                                 # (c_g,) my chunk
        f = FORMATS[fp8.formats["w"]]
        s = self.scales(plan, mine, f)                                             # (weights,) one each
        y = xp.concatenate([mine[a:b] * s[i] for i, a, b in plan.pieces[r]] or [xp.zeros(0, dtype)])
        q = fp8.cast(y, f, "w")                                                    # my pieces, cast
        if fp8.recording:
            fp8.counts[("w", "values")] += y.size
            fp8.counts[("w", "overflow")] += xp.count_nonzero(xp.abs(y) > past_max(f))
            fp8.counts[("w", "underflow")] += xp.count_nonzero((q == 0) & (y != 0))
        rest = xp.concatenate([mine[a:b] for a, b in plan.others[r]] or [xp.zeros(0, dtype)])   # the others
        out = xp.empty((n, lay.c), dtype=dtype)
        if fp8.sends_codes:                                                        # FP8 numbers: one byte each
            row = xp.zeros(plan.width, dtype=xp.uint8)
            body = xp.concatenate([rest.view(xp.uint8), encode(q, f.name)])       # (the others first: aligned)
            row[:body.size] = body
            got = xp.empty((n, plan.width), dtype=xp.uint8)
            ex.shard_comm.Allgather(row, got)                                      # (n, width) every rank's row
            for j in range(n):
                m, k = plan.n_others[j] * dtype.itemsize, plan.n_fp8[j]           # rank j's bytes, its codes
                self.unpack(plan, j, out[j], got[j, :m].view(dtype), decode(got[j, m:m + k], f.name, dtype), s)
        else:                                                                      # (a draw: values, in dtype)
            got = xp.empty((n, lay.c), dtype=dtype)
            ex.shard_comm.Allgather(xp.concatenate([rest, q]), got)
            for j in range(n):
                m = plan.n_others[j]
                self.unpack(plan, j, out[j], got[j, :m], got[j, m:], s)
        fp8.precast.update(plan.weights)
        return out.reshape(-1)            # (FP8 runs are float32 or float64: nothing for num to round)

    @staticmethod
    def unpack(plan, j, out, others, values, s):
        """Rank j's chunk into out (c_g,): its other elements as sent, its FP8 values / s (read with my scales)."""
        at = 0
        for a, b in plan.others[j]:
            out[a:b] = others[at:at + b - a]
            at += b - a
        at = 0
        for i, a, b in plan.pieces[j]:
            out[a:b] = values[at:at + b - a] / s[i]
            at += b - a

    def scales(self, plan, mine, f):
        """(weights,) in the run's dtype: each FP8 weight's scale, the same on every rank that holds a piece of it
        (tensorwise: my pieces' amaxes reduced over the shard comm and the weight's tp domain; delayed: from the
        histories, my pieces' amaxes recorded for the step's end, hsgd.fp8.scaling.Fp8.end_step)."""
        ex, fp8, holders = self.ex, self.stage.fp8, self.stage.setup.products.holders
        xp, dtype, R = array_module(mine), ex.dtype, fp8.recipe
        r = ex.shard_comm.rank
        amax = xp.zeros(len(plan.weights), dtype=dtype)
        for i, a, b in plan.pieces[r]:
            amax[i] = xp.abs(mine[a:b]).max()
        spread = holders.spread(plan.weights[0], "w")             # (a block's weights lie alike: split, or tp 1)
        if R.delayed:
            if fp8.recording:
                for i, w in enumerate(plan.weights):
                    key, a = fp8_key(w, "w"), amax[i].astype(xp.float64)
                    fp8.pending[key] = a if key not in fp8.pending else xp.maximum(fp8.pending[key], a)
            past = [fp8.histories.get(fp8_key(w, "w")) for w in plan.weights]
            s = xp.stack([R.scale(xp.asarray(max(h) if h else 0.0, dtype=dtype), f.max) for h in past]).astype(dtype)
        else:
            comms = self.amax_comms(spread)
            s = R.scale(reduce_max(amax, comms), f.max).astype(dtype)
        if fp8.check:
            check_same(s.astype(xp.float64), [ex.shard_comm] + holders.share(spread, R, 0),
                       f"the weights {', '.join(plan.weights)} (w, {R.name}, sent in FP8)")
        return s

    def amax_comms(self, spread):
        """What a tensorwise weight's amax is reduced over: the shard comm, then the weight's tp domain (the bugs of
        the run's Fp8 applied: amax-local-shard reduces over neither)."""
        fp8 = self.stage.fp8
        mine = [] if "amax-local-shard" in fp8.bugs else [self.ex.shard_comm]
        return mine + fp8.domain(spread, self.stage.setup.products.holders, 0, "w")

    def free(self, g):
        plan = self.plans.get(g)
        if plan is not None:
            self.stage.fp8.precast.difference_update(plan.weights)

    def formula(self):
        """{(comm, "Allreduce"): (calls, bytes)} of one step's scales of the gathers: tensorwise, one Allreduce of
        the group's amaxes (one number a weight) over the shard comm and over the weights' tp domain per gather;
        --fp8-check, two (MIN, MAX) of the scales as float64 over the shard comm and the tp ranks that share them;
        delayed, nothing here (its amaxes go in the step's end, hsgd.fp8.traffic)."""
        ex, fp8, holders = self.ex, self.stage.fp8, self.stage.setup.products.holders
        out, k = {}, ex.sizes.gathers_per_step()

        def add(comms, nbytes, times):
            for c in comms:
                calls, b = out.get((c.name, "Allreduce"), (0, 0))
                out[(c.name, "Allreduce")] = (calls + times * k, b + times * k * nbytes)

        for plan in self.plans.values():
            spread, w = holders.spread(plan.weights[0], "w"), len(plan.weights)
            if not fp8.recipe.delayed:
                add(self.amax_comms(spread),
                    w * ex.dtype.itemsize, 1)
            if fp8.check:
                add([ex.shard_comm] + holders.share(spread, fp8.recipe, 0), w * 8, 2)
        return out


def gather_wire(tc, stage):
    """The wire ZeRO-3 sends a run's groups by: Fp8Gather with --fp8-allgather, else None (as they are)."""
    return Fp8Gather(stage) if getattr(tc, "fp8_allgather", False) else None
