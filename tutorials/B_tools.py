# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Appendix B: the tools' internals
#
# Two pieces of hsgd are tools rather than training: the threads that run one process's step on several cores, and
# the memory probe that chapter 11 uses to measure a step by category. This appendix shows how each works and checks
# it: threads change the numbers only by rounding, and the probe's bytes are the allocator's.
#
# Run it as a script, one process, no mpirun (it exits non-zero if any check fails), in about 5 s on a 2-core
# machine:
#
#     python tutorials/B_tools.py
#
# Legend: B batch, T sequence, C d_model, NH heads, F d_ff, V vocabulary, L layers, N = B*T rows.

# %%
# before NumPy: hsgd sets OPENBLAS_THREAD_TIMEOUT, which OpenBLAS reads only when it is loaded (section 1)
from hsgd.model.config import ModelConfig

import os
import threading
import tracemalloc

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from hsgd.model import kernels, ops, serial, threads
from hsgd.model.threads import parallel_rows, set_cpu_threads, tune_allocator
from hsgd.model.optim import SGD
from hsgd.model.data import Corpus
from hsgd.accounting import allocations, step_memory
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer

from checks import Checks, best_and_median, rel_err, train_config  # tutorials/checks.py: what the chapters share

check = Checks(tol=1e-12, width=64, strict=False)
THREADS = min(os.cpu_count() or 1, 4)
set_cpu_threads(THREADS)                    # hsgd's own threads for the elementwise layers and attention
threadpool_limits(THREADS)                  # BLAS threads, the same number, as hsgd.train sets both
tune_allocator()
rng = np.random.default_rng(0)


# %% [markdown]
# ## 1. Threads
#
# BLAS runs each product on several threads; NumPy's ufuncs run on one, but release Python's global interpreter lock
# (GIL) while they loop, so Python threads can run them at once on different cores, each on its own rows.
# `threads.parallel_rows(fn, n_rows)` cuts `range(n_rows)` into `cpu_threads()` contiguous pieces, hands all but the
# last to a thread pool, runs the last on the calling thread (one hand-off fewer), and returns when all are done.
# `fn(lo, hi)` writes its rows into arrays allocated before, so pieces share no activation. With one thread, or
# fewer than `min_rows` rows, it runs inline. On 10 rows with 3 threads:

# %%
pieces = []
set_cpu_threads(3)
try:
    parallel_rows(lambda lo, hi: pieces.append((lo, hi, threading.current_thread().name)), 10, min_rows=1)
finally:
    set_cpu_threads(THREADS)
pieces.sort()                                                          # by first row
for lo, hi, name in pieces:
    print(f"  rows {lo}..{hi - 1} on thread {name}")
check.equal("parallel_rows: the rows covered, each once, in order",
            sorted(r for lo, hi, _ in pieces for r in range(lo, hi)), list(range(10)))
check.holds("parallel_rows: the last piece ran on the calling thread", pieces[-1][2] == threading.current_thread().name)

# %% [markdown]
# Which pool thread takes which other piece is the pool's choice; only the last piece's place is fixed.
#
# LayerNorm, GELU and the attention softmax use it. Attention splits *sequences* over the threads, a few at a time
# (`kernels._sequences_per_piece`: a piece's scores stay in cache from the first product to the second), and does its
# products inside the pieces with BLAS held to one thread (`threads.one_blas_thread`): one small product per core
# side by side beats each split over all cores in turn.
#
# Each row goes through the same operations in the same order whichever thread runs it, so a float64 step long
# enough for attention's blocks (T = 128), with every threaded layer split, must give the same loss and gradients
# on 2 threads as on 1. A wrapper on `kernels.parallel_rows` notes which threads ran each layer.

# %%
cfg4 = ModelConfig(vocab_size=256, seq_len=128, d_model=64, n_heads=4, n_layers=2, d_ff=256)
B4 = 64                                                                # N = 8192 rows: every layer splits
p64 = serial.init_params(cfg4, seed=1, dtype="float64")
idx4, targets4 = rng.integers(0, 256, (B4, 128)), rng.integers(0, 256, (B4, 128))
used, rows_parallel = {}, kernels.parallel_rows


def noting_parallel_rows(fn, n_rows, min_rows=2, **options):
    layer = fn.__qualname__.split(".")[0] if hasattr(fn, "__qualname__") else "?"

    def noted(lo, hi):
        used.setdefault(layer, set()).add(threading.get_ident())
        return fn(lo, hi)
    return rows_parallel(noted, n_rows, min_rows, **options)


results = {}
kernels.parallel_rows = noting_parallel_rows
try:
    for n_threads in (1, 2):
        set_cpu_threads(n_threads)
        used.clear()
        results[n_threads] = serial.loss_and_grads(p64, idx4, targets4, cfg4, ops=ops)
        print(f"set_cpu_threads({n_threads}): loss {results[n_threads][0]:.12f}; threads that ran each layer's "
              "rows: " + ", ".join(f"{layer} {len(ids)}" for layer, ids in sorted(used.items())))
finally:
    kernels.parallel_rows = rows_parallel
    set_cpu_threads(THREADS)
(loss1, g1), (loss2, g2) = results[1], results[2]
check("float64 loss, 2 threads vs 1 (abs)", abs(loss2 - loss1), 1e-13)
check("float64 gradients, 2 threads vs 1: max |difference| over all arrays",
      max(float(np.max(np.abs(g2[n] - g1[n]))) for n in g1), 1e-13)
check.equal("layers that ran on fewer than 2 threads with set_cpu_threads(2)",
            sorted(name for name, ids in used.items() if len(ids) < 2), [])

# %% [markdown]
# **Why `import hsgd` comes before `import numpy`.** OpenBLAS's worker threads spin after each product, waiting for
# the next, instead of sleeping (`OPENBLAS_THREAD_TIMEOUT`; by default $2^{28}$ cycles, about 0.1 s at 3 GHz), and a
# spinning BLAS thread takes a core from `parallel_rows`' threads between two products. So `import hsgd` first imports
# `hsgd.model.threads`, which sets `OPENBLAS_THREAD_TIMEOUT=4` (sleep almost at once) unless already set. OpenBLAS
# reads it once, when NumPy loads it, hence the first line of the chapters, `benchmarks/` and `python -m hsgd.*`.
# When it is too late `threads.openblas_note()` says so (`hsgd.train` prints it); setting it where the process starts
# always works:
#
#     OPENBLAS_THREAD_TIMEOUT=4 python tutorials/B_tools.py

# %%
note = threads.openblas_note()                                         # None when the setting took effect
print(f"OPENBLAS_THREAD_TIMEOUT = {os.environ.get('OPENBLAS_THREAD_TIMEOUT')}: "
      + (note or "in effect (set before NumPy loaded OpenBLAS, or where the process started)"))

# %% [markdown]
# **Splitting the batch instead.** Splitting layers hands work between threads several times per layer, which adds
# up where idle cores take tens of microseconds to wake. The other way is chapter 4's identity: the mean loss over B
# sequences, and its gradients, are the $B_i/B$-weighted means over any slices. `serial.loss_and_grads(...,
# split=True)` runs `cpu_threads()` slices of whole sequences each on its own thread (`threads.parallel_batches`),
# one BLAS thread each, into gradients of their own added at the end: data parallelism in one process, a sum for the
# All-Reduce. Same terms, other sums:

# %%
set_cpu_threads(2)
try:
    loss_split, g_split = serial.loss_and_grads(p64, idx4, targets4, cfg4, split=True, ops=ops)
finally:
    set_cpu_threads(THREADS)
check("float64 loss, batch split over 2 threads vs 1 thread (rel)", abs(loss_split - loss1) / abs(loss1), 1e-13)
check("float64 gradients, batch split over 2 threads vs 1 thread (rel)",
      max(rel_err(g_split[n], g1[n]) for n in g1), 1e-13)

cfg = ModelConfig(vocab_size=256, seq_len=128, d_model=128, n_heads=4, n_layers=4, d_ff=512)   # appendix A's model
B = 8
params = serial.init_params(cfg, seed=0, dtype="float32")
grads = serial.zeros_like_params(params)
idx, targets = rng.integers(0, cfg.vocab_size, (B, cfg.seq_len)), rng.integers(0, cfg.vocab_size, (B, cfg.seq_len))
opt = SGD(lr=1e-4, momentum=0.9)


def train_step(split=False):
    for g in grads.values():
        g.fill(0)
    serial.loss_and_grads(params, idx, targets, cfg, grads=grads, split=split, ops=ops)
    opt.step(params, grads)


if THREADS > 1:
    by_layer, by_batch = best_and_median(train_step, 5), best_and_median(lambda: train_step(True), 5)
    print(f"appendix A's float32 training step on {THREADS} threads: each layer split {by_layer[1] * 1e3:.1f} ms, "
          f"the batch split {by_batch[1] * 1e3:.1f} ms (medians of 5)")

# %% [markdown]
# Which is faster depends on the machine and the model. A rank holding the whole model (pp = tp = 1) runs a
# `stage.ThreadedStage`, which splits each micro-batch this way (`make bench` times it); a tensor-parallel rank, whose
# layers talk to other ranks mid-step, splits layers. `threads.tune_allocator()` (called at the top, as by
# `hsgd.train`) tells glibc to keep large freed blocks, so the next step's temporaries reuse warm pages.
#
# ## 2. The memory probe
#
# `hsgd.accounting.allocations.MemoryProbe` (`hsgd.train --memory`; chapter 11's section 9) measures a step from the
# allocator's side. NumPy reports every array buffer to Python's `tracemalloc`, in its own domain
# (`np.lib.tracemalloc_domain`), with the allocating stack:

# %%
def allocate(n):
    return np.empty(n)                                                 # n float64


tracemalloc.start(4)
kept = allocate(1000)
snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
tracemalloc.stop()
mine = [t for t in snap.traces if t.traceback[-1].lineno == allocate.__code__.co_firstlineno + 1]
print("traced:", [(t.size, [f"line {f.lineno}" for f in t.traceback]) for t in mine])
check.equal("tracemalloc's NumPy domain: one trace of the array's bytes, allocated in allocate()",
            [t.size for t in mine], [kept.nbytes])

# %% [markdown]
# The probe puts each buffer in a category: walking the stack from the innermost frame outward, the first frame in a
# function `allocations.CATEGORY_TABLE` names decides (`Stage.forward` activations, `hsgd.model.optim` optimizer,
# `recompute_block` recompute, `Stage.recv_activation` comm; the rest other, such as the step's token windows). Frames
# carry only a file and a line, so each hsgd module is parsed once with `ast` (`allocations.function_spans`) to find
# the function around a line. The probe samples at the step's start, every group's forward and backward exit (its
# hooks, chained into the trainer's), after each block's recomputation and at the end, and reads the tracker's own
# peak in between, which catches arrays living and dying inside a group. `step_memory.step_formula(trainer)` walks the
# schedule through the same moments. One process, AdamW, full recomputation (so the recompute category shows), step 2
# traced, the probe started before the trainer so that parameters and optimizer state are traced:

# %%
cfg_m = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=128)
corpus = Corpus.load(None, cfg_m.seq_len)
grid = ProcessGrid(MPI.COMM_WORLD, dp=1, pp=1, tp=1)
tc = train_config(dp=1, tp=1, steps=2, batch_size=4, optimizer="adamw", lr=0.01, weight_decay=0.1, recompute="full")
probe = allocations.MemoryProbe()
probe.start()
try:
    trainer = HybridTrainer(cfg_m, grid, tc)
    trainer.step(*corpus.batch(0, 1, 4), 1)
    batch = corpus.batch(0, 2, 4)                                      # made before the step: category other
    allocations.traced_step(trainer, probe, lambda: trainer.step(*batch, 2))
finally:
    probe.stop()
res, want = probe.result(), step_memory.step_formula(trainer)
CATS = allocations.CATEGORIES
print(f"{'sample':<20}" + "".join(f"{c:>12}" for c in CATS) + f"{'total':>10}{'formula':>10}")
for (label, _, got), (_, f) in zip(res["samples"], want["samples"]):
    print(f"{label:<20}" + "".join(f"{got[c]:>12,}" for c in CATS) + f"{sum(got.values()):>10,}"
          f"{sum(f.values()):>10,}")
print(f"largest sample {res['total']:,} B at {res['at']}; the tracker's true peak {res['true_peak']:,} B")
check.equal("probe: every sample's labels == step_formula's", [s[0] for s in res["samples"]],
            [s[0] for s in want["samples"]])
check.equal("probe: every sample, category by category == step_formula",
            [{c: got[c] for c in CATS} for _, _, got in res["samples"]],
            [{c: f.get(c, 0) for c in CATS} for _, f in want["samples"]])
check.holds("probe: the true peak is above the largest sample (working arrays inside a group)",
            res["true_peak"] > res["total"])
trainer.free()
grid.free()

# %% [markdown]
# Tracing costs a snapshot per sample, so `hsgd.train` traces one step, unthreaded (a `ThreadedStage` gives hooks the
# plain `Stage.run`). On a GPU there are no stacks: the probe reads the memory pool's used bytes at the same moments.
#
# ## Check
#
# Splitting rows, or the batch, over threads gives the 1-thread step's loss and gradients; the probe's traced bytes
# are the arrays' own, and on a real step every category at every sample equals `step_formula`'s.

# %%
worst, err = check.worst()
print(f"appendix B: all {len(check.passed)} checks passed; largest error {err:.1e} ({worst})")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `threads.parallel_rows`, `set_cpu_threads` | none (GPU kernels; one process per GPU) | launcher's `--bind_cores_to_rank` (sets `OMP_NUM_THREADS`) | `at::parallel_for` inside operators; `torch.set_num_threads` | Python threads around NumPy ufuncs, visible in the layers |
# | `serial.loss_and_grads(..., split=True)`, `stage.ThreadedStage` | none | none | none (`DistributedDataParallel` splits over processes) | data parallelism inside one process |
# | `OPENBLAS_THREAD_TIMEOUT=4` set by `import hsgd` | none | none | `torch.distributed.run` sets `OMP_NUM_THREADS=1` per process by default | idle BLAS threads sleep, leaving hsgd's threads the cores |
# | `allocations.MemoryProbe` (`hsgd.train --memory`) | `--record-memory-history`, `--memory-snapshot-path` | `see_memory_usage` (deepspeed/runtime/utils.py) | `torch.cuda.memory._record_memory_history`, `_snapshot` | categories by allocating function, checked against a formula |
#
# ## Exercises
#
# ### Exercise 1: rows on threads, by hand
# Write `rows_on_threads(fn, n_rows, k)` with `threading.Thread`: k contiguous pieces, the last on the calling
# thread. Use it to run a LayerNorm (without its affine) over the rows of a (4096, 64) float64 array into a
# preallocated output, and check that every row is covered once and that the output equals the one-thread result
# bit for bit.
# (solution: `tutorials/solutions/B_tools.py`, `exercise_1`)
#
# ### Exercise 2: the mini-batch identity behind the batch split
# With `serial.loss_and_grads` (one thread, float64), compute the loss and gradients of a batch of 8 sequences whole,
# and of slices of 3 and 5 of them; check that the $B_i/B$-weighted sums of the slices' losses and gradients equal
# the whole batch's.
# (solution: `tutorials/solutions/B_tools.py`, `exercise_2`)
#
# ### Exercise 3: a category per stack
# Under `tracemalloc`, allocate arrays in three functions of your own, two of them called from inside a third. Write
# `category(traceback, table)` that walks the frames from the innermost outward and returns the category of the first
# frame whose function (found from its line with `allocations.function_spans`) the table names, else "other"; check
# the bytes per category against the arrays' `nbytes`.
# (solution: `tutorials/solutions/B_tools.py`, `exercise_3`)
