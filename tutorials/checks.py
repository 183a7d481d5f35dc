"""The check every tutorial chapter ends its steps with: print an error once, record it, stop if it is too large.

Each chapter compares what it computed with a serial reference and must exit non-zero at the first error that
is too large. Under mpirun that stop has to happen on *every* rank at the same check: a rank that raised alone
would leave the others waiting forever inside their next collective. So a check is itself collective: every
rank passes its own error, a small pickled `allgather` gives every rank the same list, and every rank reaches
the same verdict from it. Every rank must therefore make the same checks, in the same order.

    from checks import Checks, rel_err
    check = Checks(MPI.COMM_WORLD, tol=1e-10)          # or Checks(tol=...) in a one-process chapter, without MPI
    check("dW vs serial", rel_err(dW_i, dW[:, cols]))  # rank 0 prints the worst error over the ranks
    check.equal("bytes of a step", measured, formula)  # counts, tuples, dicts: exactly equal on every rank
    ring_bytes(counts, p), payload(counts)              # a step's bytes on the wire and its payload (two columns)
    check.holds("DP replicas bit-identical", same)     # a fact: true on every rank (printed PASS or FAIL)
    check.note("L/p blocks per stage", len(mine) == L // pp)   # structure, true by construction: NOTE, not counted
    what, err = check.worst()                          # for the chapter's closing line
    require_ranks(MPI.COMM_WORLD, 8, __file__)           # a chapter for 8 ranks, started with another number

This is not a chapter (tests/test_tutorials.py runs only the files named NN_*.py and [A-Z]_*.py) nor a test framework:
it holds only what the chapters share. Chapter-specific measures (finite differences, shard errors, traffic)
stay in their chapters, and so do their configs, built with `train_config` (one set of defaults for all).
"""
import time
from fractions import Fraction

import numpy as np
from threadpoolctl import threadpool_limits

from hsgd.step.settings import TrainConfig

FLOOR = 1e-6        # rel_err's absolute floor, for arrays that are (nearly) zero (chapter 6 explains why)


class Checks:
    """`check(what, err, tol)` on every rank: passes when err < tol on every rank, or err <= tol with
    strict=False (then tol=0 means "exactly 0"); a NaN never passes. Rank 0 prints `what`, the worst err, the
    bound and PASS or FAIL (every verdict in the course reads PASS or FAIL, never 0/1 or yes/no); the worst is
    recorded in `errors`, and a failure raises AssertionError on every rank.
    `check.holds(what, cond)` and `check.equal(what, a, b)` are the same for facts that have no tolerance: a
    condition, or two counts (tuples, dicts) that must be exactly equal. Every check passed is in `passed`.
    `check.note(what, cond)` states structure instead: something true by construction (the chapter's own
    configuration, a definition, what an earlier check already established), which no bug could make false and so
    is no check. It prints NOTE, never PASS, and goes to `notes`, not to `passed`: a chapter's "all K checks passed"
    counts only checks that could have failed."""

    def __init__(self, comm=None, tol=0.0, width=60, strict=True, prefix=""):
        self.comm = comm            # an mpi4py communicator (COMM_WORLD), or None: one process, MPI not needed
        self.rank = comm.Get_rank() if comm is not None else 0
        self.tol = tol              # the tolerance of a check that names none
        self.strict = strict        # True: pass if err < tol; False: pass if err <= tol
        self.width = width          # column width of `what` in the printed line
        self.prefix = prefix        # printed before `what`, e.g. "  check: "
        self.errors = {}            # what was checked with a tolerance -> the worst error over all ranks
        self.passed = []            # `what` of every check passed so far, in order
        self.notes = []             # `what` of every statement of structure (check.note), in order: not checks

    def say(self, *args):
        """Print once, from rank 0 (P ranks printing the same line would only be noise)."""
        if self.rank == 0:
            print(*args, flush=True)

    def __call__(self, what, err, tol=None):
        tol = self.tol if tol is None else tol
        errs = self.comm.allgather(err) if self.comm is not None else [err]   # small metadata: lowercase, pickled
        ok = all(e < tol if self.strict else e <= tol for e in errs)          # NaN compares False: a NaN fails
        worst = max(errs) if all(e == e for e in errs) else float("nan")     # e != e only for a NaN
        shown = worst if isinstance(worst, int) else f"{worst:.1e}"          # counts as they are, errors 1.2e-13
        bound = f"{'<' if self.strict else '<='} {tol:.0e}"
        self.say(f"{self.prefix}{what:<{self.width}s} {shown:>8} {bound:>8}  {'PASS' if ok else 'FAIL'}")
        self.errors[what] = worst
        if not ok:
            per_rank = f" (errors per rank: {errs})" if len(errs) > 1 else ""
            raise AssertionError(f"{what}: error {worst:.2e} is not {'below' if self.strict else 'at most'} "
                                 f"{tol:.0e}{per_rank}")
        self.passed.append(what)

    def holds(self, what, cond):
        """Passes when cond is true on every rank. Rank 0 prints `what` and PASS; a failure names the ranks."""
        self._verdict(what, cond, "PASS", "false")
        self.passed.append(what)

    def _verdict(self, what, cond, word, why):
        """cond gathered from every rank; rank 0 prints `what` and `word` (FAIL if a rank's is false, then raise)."""
        conds = self.comm.allgather(bool(cond)) if self.comm is not None else [bool(cond)]
        failed = [r for r, c in enumerate(conds) if not c]
        self.say(f"{self.prefix}{what:<{self.width}s} {'':>18}  {'FAIL' if failed else word}")
        if failed:
            raise AssertionError(f"{what}: {why} on rank(s) {failed}")

    def note(self, what, cond=True):
        """A statement of structure, not a check (see the class docstring): rank 0 prints `what` and NOTE, and it
        is recorded in `notes`, never in `passed`. cond is still verified on every rank, so that a statement which
        stopped being true (the chapter's configuration changed under its prose) ends the chapter with FAIL
        instead of being printed wrong."""
        self._verdict(what, cond, "NOTE", "stated as structure, but false")
        self.notes.append(what)

    def equal(self, what, a, b):
        """Passes when a == b exactly on every rank (counts, tuples, dicts; not arrays). Rank 0 prints `what` and
        PASS; a failure shows both sides (of two dicts, the entries that differ) on every rank where they differ."""
        mine = None if a == b else differing(a, b)            # only what differs travels
        seen = self.comm.allgather(mine) if self.comm is not None else [mine]
        wrong = {r: d for r, d in enumerate(seen) if d is not None}
        self.say(f"{self.prefix}{what:<{self.width}s} {'':>18}  {'FAIL' if wrong else 'PASS'}")
        if wrong:
            sides = "\n".join(f"  rank {r}: got      {got}\n  rank {r}: expected {want}"
                              for r, (got, want) in wrong.items())
            raise AssertionError(f"{what}: not equal on rank(s) {list(wrong)}\n{sides}")
        self.passed.append(what)

    def worst(self, names=None):
        """(what, err) of the largest error recorded, among `names` if given, else among all checks."""
        what = max(self.errors if names is None else names, key=self.errors.get)
        return what, self.errors[what]


def require_ranks(world, P, path, multiple=False):
    """A chapter written for P ranks (or a multiple of P), started with another number: every rank exits non-zero,
    rank 0 saying how to run it (no rank waits in a collective that the others never reach)."""
    if world.Get_size() % P if multiple else world.Get_size() != P:
        raise SystemExit(f"run this chapter on {'a multiple of ' if multiple else ''}{P} ranks: "
                         f"mpirun -n {P} python {path}" if world.Get_rank() == 0 else 1)


def mpi_chapter(path, P, tol=0.0, width=60, multiple=False):
    """The preamble of every chapter from 4 on (chapters 2 and 3 write it out, line by line): one BLAS thread per
    rank (the ranks share the cores, the matrices are tiny); P ranks, or a multiple of P, else every rank exits
    non-zero and rank 0 says how to run it; the chapter's collective check. Returns (world, rank, check, say):
    COMM_WORLD and this rank in it; check(what, err, tol), check.holds(what, cond), check.equal(what, a, b), which
    raise on every rank unless err < tol, cond, a == b holds on all of them; say(...), print on rank 0 only."""
    from mpi4py import MPI
    threadpool_limits(1)
    world = MPI.COMM_WORLD
    require_ranks(world, P, path, multiple)
    check = Checks(world, tol=tol, width=width)
    return world, world.Get_rank(), check, check.say


def rel_err(a, b, floor=FLOOR):
    """max |a - b| / max(max |b|, floor): relative, with an absolute floor for arrays that are (nearly) zero."""
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), floor))



def ring_share(op, p):
    """What one rank sends on a ring of p ranks per byte of an operation's payload (chapter 2), exactly: an
    All-Reduce 2(p-1)/p, an All-Gather (p-1)/p of the gathered tensor, a Reduce-Scatter (p-1)/p of the full input,
    an All-to-All (p-1)/p of its send buffer, a point-to-point send all of it, a receive nothing; on one rank nothing
    at all. A non-blocking operation moves
    what its blocking twin moves."""
    if p == 1 or op in ("Recv", "Irecv"):
        return Fraction(0)
    shares = {"Allreduce": Fraction(2 * (p - 1), p), "Iallreduce": Fraction(2 * (p - 1), p),
              "Allgather": Fraction(p - 1, p), "Reduce_scatter_block": Fraction(p - 1, p),
              "Ireduce_scatter_block": Fraction(p - 1, p), "Alltoall": Fraction(p - 1, p), "Send": Fraction(1),
              "Isend": Fraction(1)}
    return shares[op]


def ring_bytes(counts, p):
    """Bytes one rank sends on a ring of p ranks for the collectives in `counts` ({(comm, op): (calls, payload
    bytes)}, as CommStats records them), exactly (a Fraction)."""
    return sum((ring_share(op, p) * nbytes for (_, op), (_, nbytes) in counts.items()), Fraction(0))


def payload(counts):
    """The payload bytes of all the calls in `counts` ({(comm, op): (calls, payload bytes)})."""
    return sum(nbytes for _, nbytes in counts.values())


def differing(a, b):
    """(a, b), or for two dicts only the entries where they differ (a missing key shows as None)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted((k for k in set(a) | set(b) if a.get(k) != b.get(k)), key=repr)
        return {k: a.get(k) for k in keys}, {k: b.get(k) for k in keys}
    return a, b


def train_config(**kw):
    """The TrainConfig of a chapter's float64 runs: SGD with momentum 0.9, lr 0.1, one warm-up step, seed 0,
    nothing evaluated, sampled or saved; then the chapter's own `kw`. Validated, as hsgd.train does."""
    base = dict(lr=0.1, momentum=0.9, warmup=1, dtype="float64", seed=0, eval_interval=0, eval_batches=1,
                sample_bytes=0)
    tc = TrainConfig(**{**base, **kw})
    tc.validate()
    return tc


def best_and_median(f, repeats):
    """(best, median) seconds of `repeats` calls of f, after one call that is not counted (warm-up)."""
    f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times), float(np.median(times))


def solve(check, exercises):
    """Run a chapter's exercise solutions in order, each `exercise_k(check)`, under a heading from its docstring's
    first line, then say "exercises: all k solved" (tests/test_tutorials.py looks for that line). A solution that
    fails raises on every rank at its check, as a chapter does, so the line never appears."""
    for k, exercise in enumerate(exercises, 1):
        assert exercise.__name__ == f"exercise_{k}", f"{exercise.__name__} given as exercise {k}"
        check.say(f"\nexercise {k}: {(exercise.__doc__ or '').strip().splitlines()[0]}")
        exercise(check)
    check.say(f"\nexercises: all {len(exercises)} solved ({len(check.passed)} checks passed)")
