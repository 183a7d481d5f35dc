"""An FP8 run's state: the formats, the recipe, the amax histories of delayed scaling, what the casts counted.

    fp8 = Fp8("hybrid", make_recipe("delayed", history=16))
    q = fp8.quantize(x2, "x", key, spread_of_x, holders, axis=1)     # hsgd.fp8.linear calls it for every operand
                                                                      # (--fp8-allgather: the weights cast before
                                                                      # ZeRO-3 sends them, hsgd.dp.fp8_gather)
    fp8.end_step(tp_comm, dp_comm)                                    # after each step: the histories move on

quantize(x) returns round(x s, fmt, saturating) / s in x's dtype, with s from the recipe (hsgd.fp8.recipes) and the
amax reduced over the operand's domain (hsgd.fp8.domains). In a float64 run this is the exact FP8 mode: the values
are FP8 numbers (times 1/s) and everything else is float64, so two layouts that cast the same numbers with the same
scales agree to float64's rounding, and a scale taken over the wrong ranks shows as a difference of whole FP8 steps
(tests/mpi/test_fp8.py). In a float32 run the products of FP8 values accumulate in float32, as a tensor core's do.

Counted per step and operand role (x: activations, w: weights, dy: gradients): the values cast, those that round
past the format's largest (saturated: an overflow; x s within half a step of fmax rounds to fmax, as the largest
value of a tensor cast on its own amax does), and the nonzero ones that became zero (an underflow).
"""
import math
from collections import defaultdict, namedtuple

import numpy as np
from mpi4py import MPI

from hsgd.fp8.accumulate import limited_matmul
from hsgd.fp8.domains import check_same, reduce_max
from hsgd.fp8.recipes import FP8_FORMATS, Delayed, make_recipe
from hsgd.model.backend import array_module, to_host
from hsgd.model.precision import FORMATS, round_to

# bugs on purpose (hsgd.check.mutations): the amax reductions a real run has been seen to get wrong
# an FP8 run's settings (hsgd.step.settings.Data.fp8_settings): --fp8, --fp8-recipe, --fp8-history, --fp8-margin,
# --fp8-block, --fp8-accumulate as (bits, nc) or None, --fp8-check
Fp8Settings = namedtuple("Fp8Settings", "fmt recipe history margin block accumulate check")

BUGS = {
    "amax-dp-only": "the amax reduced over the data-parallel ranks only, never over tp (Megatron-LM PR #442)",
    "amax-local-shard": "a weight's amax taken on this rank's piece alone: its tp shard, and with --fp8-allgather its "
                        "ZeRO-3 chunk, whose codes the other ranks read with their own scale (the regression of "
                        "pytorch/torchtitan #3109: a per-tensor amax of a DTensor's local shard)",
    "amax-no-sp-reduce": "the sequence scheme's inputs cast on their T-shard's amax, not reduced over tp "
                         "(TransformerEngine PR #74)",
    "stale-history": "a resumed run starts with empty amax histories instead of the checkpoint's",
}


class Fp8:
    """fmt: "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3"; recipe: an hsgd.fp8.recipes.Recipe; accumulate:
    (acc_bits, promote_every) of --fp8-accumulate, or None (products accumulated in the compute type); check: compare
    every scale over the ranks that hold its tile (hsgd.fp8.domains.check_same); bugs: names of BUGS to commit."""

    def __init__(self, fmt="hybrid", recipe=None, accumulate=None, check=False, bugs=()):
        self.fmt, self.formats = fmt, FP8_FORMATS[fmt]
        self.recipe = recipe if recipe is not None else Delayed()
        self.accumulate, self.check, self.bugs = accumulate, check, set(bugs)
        self.histories = {}                  # delayed: {key: [amax of a step, oldest first]} (at most history)
        self.pending = {}                    # delayed: {key: this step's amax so far, on this rank}
        self.recording = True                # False: an evaluation's forward leaves the histories alone
        self.counts = defaultdict(int)       # {(role, "values" | "overflow" | "underflow"): this step's count}
        self.last = {}                       # the last finished step's counts
        self.precast = set()                 # weights that arrive cast (hsgd.dp.fp8_gather: sent as FP8 codes)
        self.sends_codes = True              # a cast's values are FP8 numbers (the oracle's draws: not)

    # -------------------------------------------------------------------------------------------- the cast
    def quantize(self, x2, role, key, spread, holders, axis):
        """x2 (2-D) cast to the FP8 format of `role` with the recipe's scales for tiles along `axis`: the values
        round(x2 s, fmt, saturating) / s, in x2's dtype. key: the operand's name in the histories; spread: how it
        lies on the layout (holders.spread); holders: the layout's communicators (hsgd.fp8.domains.Holders)."""
        R, xp = self.recipe, array_module(x2)
        f = FORMATS[self.formats[role]]
        comms = self.domain(spread, holders, axis, role)
        if R.delayed:
            if self.recording:
                a = xp.abs(holders.own_rows(x2, spread)).max().astype(xp.float64)
                self.pending[key] = a if key not in self.pending else xp.maximum(self.pending[key], a)
            past = self.histories.get(key)
            s = R.scale(xp.asarray(max(past) if past else 0.0, dtype=x2.dtype), f.max)
        else:
            amax = R.amax(holders.own_rows(x2, spread) if R.per_tensor else x2, axis, role)
            s = R.scale(reduce_max(amax, comms), f.max).astype(x2.dtype)
        if self.check:
            check_same(xp.asarray(s, dtype=xp.float64).reshape(-1), holders.share(spread, R, axis),
                       f"{key} ({role}, {R.name})")
        if spread.tp == "gathered" and holders.tp is not None and holders.tp not in comms and not R.delayed \
                and R.per_tensor:
            return self.read_apart(x2, s, f, role, holders)         # a bug: pieces cast apart, read with mine
        s = R.expand(s, x2.shape, axis, role)
        y = x2 * s
        q = self.cast(y, f, role)
        if self.recording:
            self.counts[(role, "values")] += x2.size
            self.counts[(role, "overflow")] += xp.count_nonzero(xp.abs(y) > past_max(f))
            self.counts[(role, "underflow")] += xp.count_nonzero((q == 0) & (x2 != 0))
        return q / s

    def read_apart(self, x2, s, f, role, holders):
        """What an All-Gather of FP8 pieces cast with different scales gives (the sequence scheme's input cast on
        each T-shard's own amax, never reduced over tp): piece r is cast by its rank with s_r = fmax / amax_r and
        read here with this rank's s, so it arrives s_r / s times too large (the bytes travel, not the scale).
        Only a bug takes this path (BUGS: amax-no-sp-reduce, amax-dp-only)."""
        xp = array_module(x2)
        t0, t1 = holders.rows
        x3 = x2.reshape(-1, holders.T_here // (t1 - t0), t1 - t0, x2.shape[-1])    # (B, tp, T/tp, K)
        amax = xp.abs(x3).max(axis=(0, 2, 3), keepdims=True)                      # each piece's own
        s_r = self.recipe.scale(amax, f.max).astype(x2.dtype)
        q = self.cast(x3 * s_r, f, role)
        if self.recording:
            self.counts[(role, "values")] += x2.size
        return (q / s).reshape(x2.shape)

    def cast(self, y, f, role):
        """y (x times its scale) rounded to format f, saturating: the one place an FP8 run rounds (the tolerance
        oracle's error model, hsgd.check.oracle.PerturbedFp8, puts its random perturbation here instead)."""
        return round_to(y, f.name, saturate=True)

    def domain(self, spread, holders, axis, role):
        """The communicators this use's amax is reduced over now (current scaling), with the bugs in self.bugs."""
        if self.recipe.delayed:
            return []                                               # (reduced at the end of the step)
        comms = holders.reduce_over(spread, self.recipe, axis)
        if "amax-dp-only" in self.bugs or ("amax-local-shard" in self.bugs and role == "w") or (
                "amax-no-sp-reduce" in self.bugs and spread.tp == "gathered"):
            comms = [c for c in comms if c is not holders.tp]
        return comms

    def matmul(self, a, b):
        """a @ b: in the compute type, or with --fp8-accumulate's limited accumulator (hsgd.fp8.accumulate). The
        operands are the cast values q/s, so the accumulator adds products of those, not of the FP8 numbers with
        the scales applied after the sum as a tensor core does: with a scale that is not a power of two their
        significands are the compute type's, not 4 bits, and the accumulator loses somewhat more than
        hsgd.fp8.accumulate's figures for FP8 numbers (the pessimistic side)."""
        if self.accumulate is None:
            return a @ b
        bits, every = self.accumulate
        return limited_matmul(a, b, acc_bits=bits, promote_every=every)

    # -------------------------------------------------------------------------------------------- a step ends
    def end_step(self, tp_comm=None, dp_comm=None):
        """After a training step: delayed scaling's amaxes of the step, reduced (MAX) over tp and dp_comm (dp x cp:
        every rank that held a piece of each tensor in the step, as Megatron-LM's amax reduction group), pushed into
        the histories; the step's counts summed over the same ranks into self.last. Collective over tp_comm and
        dp_comm (every rank of them has the same keys: the same layers)."""
        comms = [c for c in (tp_comm, dp_comm) if c is not None and c.size > 1]
        if "amax-dp-only" in self.bugs:
            comms = [c for c in comms if c is not tp_comm]
        if self.pending:
            keys = sorted(self.pending)
            xp = array_module(self.pending[keys[0]])
            vec = xp.stack([self.pending[k] for k in keys]).astype(xp.float64)
            for c in comms:
                c.Allreduce(vec, op=MPI.MAX)
            for k, a in zip(keys, to_host(vec).tolist()):
                h = self.histories.setdefault(k, [])
                h.append(float(a))
                del h[:-self.recipe.history]
        self.pending = {}
        self.last = {k: int(v) for k, v in self.counts.items()}
        self.counts = defaultdict(int)

    def summary(self, comms=()):
        """{"overflow": n, "underflow": n, "values": n} of the last step over every role, summed over comms
        (collective): the run's log line. A cast is counted on every rank that makes it: an operand held as a copy
        on tp ranks counts tp times, and --recompute full casts the forward twice; a weight ZeRO-3 sends in FP8
        (--fp8-allgather) counts once per gather, on the rank that casts its chunk."""
        tot = np.array([sum(v for (r, k), v in self.last.items() if k == what)
                        for what in ("values", "overflow", "underflow")], dtype=np.float64)
        for c in comms:
            c = getattr(c, "comm", c)                               # (an hsgd communicator, or mpi4py's own)
            if c is not None and c.Get_size() > 1:
                c.Allreduce(MPI.IN_PLACE, tot, op=MPI.SUM)
        return dict(zip(("values", "overflow", "underflow"), (int(t) for t in tot)))

    # -------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self):
        """{"histories": {key: [amax, ...]}}: what a resume needs to cast as the run would have (delayed)."""
        return {"histories": {k: list(v) for k, v in self.histories.items()}}

    def load_state_dict(self, state):
        if "stale-history" in self.bugs:
            return
        self.histories = {k: [float(a) for a in v][-self.recipe.history:] if self.recipe.delayed else []
                          for k, v in (state or {}).get("histories", {}).items()}     # (a shorter --fp8-history)


def make_fp8(settings, bugs=()):
    """The Fp8 of a run from Data.fp8_settings() (format, recipe, history, margin, block, accumulate, check), or
    None without --fp8."""
    if settings is None:
        return None
    s = Fp8Settings(*settings)
    return Fp8(s.fmt, make_recipe(s.recipe, s.history, s.margin, s.block), s.accumulate, s.check, bugs)


def past_max(f):
    """Where rounding to format f passes its largest value: fmax plus half the spacing of its top binade."""
    return f.max + 2.0 ** (math.floor(math.log2(f.max)) - f.p + 1) / 2
