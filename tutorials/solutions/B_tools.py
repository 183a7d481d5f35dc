"""Solutions to the exercises of appendix B (tutorials/B_tools.py).

    python tutorials/solutions/B_tools.py

One process, no MPI.
"""
import hsgd  # noqa: F401  (before NumPy: hsgd sets OPENBLAS_THREAD_TIMEOUT before OpenBLAS is loaded)

import os
import sys
import threading
import tracemalloc

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, rel_err, solve  # noqa: E402

from hsgd.model.config import ModelConfig  # noqa: E402
from hsgd.model import serial  # noqa: E402
from hsgd.model.threads import set_cpu_threads  # noqa: E402
from hsgd.accounting import allocations  # noqa: E402

threadpool_limits(1)
set_cpu_threads(1)


# ---------------------------------------------------------------------------------------------------- exercise 1

def rows_on_threads(fn, n_rows, k):
    """fn(lo, hi) on k contiguous pieces of range(n_rows): the first k - 1 on threads of their own, the last on the
    calling thread; returns when all are done."""
    edges = [n_rows * i // k for i in range(k + 1)]
    workers = [threading.Thread(target=fn, args=(lo, hi)) for lo, hi in zip(edges[:-2], edges[1:-1])]
    for w in workers:
        w.start()
    fn(edges[-2], edges[-1])
    for w in workers:
        w.join()


def exercise_1(check):
    """rows on threads, by hand: a LayerNorm split by rows, bit for bit"""
    x = np.random.default_rng(0).standard_normal((4096, 64))            # (N, C) float64
    out, covered = np.empty_like(x), np.zeros(len(x), dtype=int)

    def layernorm_rows(lo, hi):
        xs = x[lo:hi]
        mu = xs.mean(axis=1, keepdims=True)
        var = ((xs - mu) ** 2).mean(axis=1, keepdims=True)
        out[lo:hi] = (xs - mu) / np.sqrt(var + 1e-5)                   # writes only its own rows
        covered[lo:hi] += 1

    layernorm_rows(0, len(x))
    one = out.copy()
    covered[:] = 0
    rows_on_threads(layernorm_rows, len(x), 3)
    check.equal("every row covered once", covered.tolist(), [1] * len(x))
    check.holds("LayerNorm on 3 threads == on 1, bit for bit", np.array_equal(out, one))


# ---------------------------------------------------------------------------------------------------- exercise 2

def exercise_2(check):
    """the mini-batch identity: slices' losses and gradients, weighted B_i/B, are the whole batch's"""
    cfg = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=128)
    rng = np.random.default_rng(1)
    params = serial.init_params(cfg, seed=0, dtype="float64")
    idx, targets = rng.integers(0, 64, (8, 16)), rng.integers(0, 64, (8, 16))    # (B, T) each
    loss, grads = serial.loss_and_grads(params, idx, targets, cfg)
    parts = [serial.loss_and_grads(params, idx[sl], targets[sl], cfg) for sl in (slice(0, 3), slice(3, 8))]
    w = (3 / 8, 5 / 8)
    check("loss: 3/8 L(0:3) + 5/8 L(3:8) vs L(0:8) (rel)",
          abs(sum(wi * p[0] for wi, p in zip(w, parts)) - loss) / abs(loss), 1e-13)
    check("gradients: the same weighted sum vs the whole batch's (rel)",
          max(rel_err(sum(wi * p[1][n] for wi, p in zip(w, parts)), grads[n]) for n in grads), 1e-12)


# ---------------------------------------------------------------------------------------------------- exercise 3

def make_weights(n):
    return np.ones(n)                                                   # category "weights"


def make_scratch(n):
    return np.zeros(n)                                                  # category "scratch"


def build(n):
    """Calls the two above, and allocates one array of its own (category "build")."""
    return make_weights(n), make_scratch(2 * n), np.empty(3 * n)


TABLE = {"make_weights": "weights", "make_scratch": "scratch", "build": "build"}


def category(traceback, table):
    """The category of the innermost frame (tracemalloc's traceback: the innermost last) whose function, found from
    its line with allocations.function_spans, the table names; "other" if none does."""
    for frame in reversed(traceback):
        if not frame.filename.endswith(".py") or not os.path.exists(frame.filename):
            continue
        _, spans = allocations.function_spans(frame.filename)
        around = [name for start, end, name in spans if start <= frame.lineno <= end]
        if around and around[-1] in table:                              # the innermost function around the line
            return table[around[-1]]
    return "other"


def exercise_3(check):
    """a category per stack: bytes by the allocating function, from tracemalloc"""
    allocations.function_spans(os.path.abspath(__file__))               # parsed before tracing starts
    tracemalloc.start(8)
    try:
        arrays = build(1000)
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    finally:
        tracemalloc.stop()
    found = {}
    for t in snap.traces:
        cat = category(t.traceback, TABLE)
        found[cat] = found.get(cat, 0) + t.size
    check.say(f"bytes per category: {found}")
    want = {"weights": arrays[0].nbytes, "scratch": arrays[1].nbytes, "build": arrays[2].nbytes}
    check.equal("bytes per category == the arrays' nbytes", {c: found.get(c, 0) for c in want}, want)


if __name__ == "__main__":
    solve(Checks(tol=1e-12, width=78), [exercise_1, exercise_2, exercise_3])
