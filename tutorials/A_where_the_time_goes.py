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
# # Appendix A: Where a step's time goes
#
# The chapters so far asked whether hsgd computes the right numbers. This one asks how fast, on one CPU process,
# and why. A training step is mostly matrix products, and a matrix product is the one thing a CPU does close to its
# peak; everything the step does besides them costs time without adding model FLOPs. The chapter shows
#
# 1. the FLOPs of a training step, by formula (`ModelConfig.step_flops`) and counted from the matrix products the
#    layers actually perform; MFU, the FLOPs per second of a step over the machine's peak (estimated here from
#    `/proc/cpuinfo`), and the same over the matmul rate this machine measurably reaches;
# 2. where the time goes: every layer timed inside a real step, next to what its FLOPs would take at the matmul
#    rate; why the tuned layers (`hsgd.model.kernels`) are written with `out=` and in place, where `hsgd.model.layers`
#    writes the plain formulas;
# 3. causal attention skipping the blocks the mask zeroes, checked against the plain dense attention of
#    `hsgd.model.layers` in float64;
# 4. threads: NumPy releases the GIL, so hsgd splits rows over threads of its own (`threads.parallel_rows`), or
#    splits the batch over them (`threads.parallel_batches`); the gradients change with the thread count only by
#    rounding (the same terms, added in another order);
#    why `import hsgd` comes before `import numpy`;
# 5. memory as well as time: GELU caches its derivative instead of its input and tanh, checked against the
#    activation formula of chapter 6 and a finite difference;
# 6. how to compare fairly with another library (`make bench`).
#
# Run it as a script, one process, no mpirun (it exits non-zero if any check fails):
#
#     python tutorials/A_where_the_time_goes.py
#
# or open it as a notebook: `jupytext --to ipynb tutorials/A_where_the_time_goes.py`. It takes about 5 s at best on
# a 2-core machine; on the same machine, while other jobs kept its cores busy (load averages of 7 to 15), runs took
# from 10 s to 88 s. Most of the chapter splits every layer over two threads (section 4), and
# a layer is done only when its slower thread is: on a busy machine that is the thread waiting for a core, once per
# layer, hundreds of times a step. The chapter prints the load average at the start. The timings it prints vary in
# the same way, from machine to machine and from run to run; no check depends on one. The checks are about FLOPs,
# bytes and values, which do not vary.
#
# Every layer exists twice with the same signature: `hsgd.model.layers`, the plain formulas (the reference, which
# `hsgd.model.serial` runs by default), and `hsgd.model.kernels`, the tuned versions, which `hsgd.model.ops` hands to
# the models (tests/test_kernels.py checks that both give the same numbers). This chapter is about the second: it runs
# the serial model on them, `serial.loss_and_grads(..., ops=ops)`.
#
# Legend: B batch, T sequence, C d_model, NH heads, hs = C/NH head size, F d_ff, V vocabulary, L layers,
# N = B*T rows. A FLOP is one floating-point operation (a multiply-add is 2); GFLOP/s = 1e9 FLOPs per second;
# MFU = model FLOPs utilization; ms = milliseconds.

# %%
# before NumPy: hsgd sets OPENBLAS_THREAD_TIMEOUT, which OpenBLAS reads only when it is loaded (section 4)
from hsgd.model.config import ModelConfig

import os
import threading
import time
import types
from fractions import Fraction

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_info, threadpool_limits

from hsgd.model import kernels, layers, ops, serial, threads
from hsgd.accounting import activations
from hsgd.tp import model as tp_model, shards as tp_shards
from hsgd.model.threads import parallel_rows, set_cpu_threads, tune_allocator
from hsgd.grid.comm import Comm
from hsgd.model.optim import SGD

import pictures                         # tutorials/pictures.py: where the PNGs go
from checks import Checks, rel_err      # tutorials/checks.py: the check every chapter uses

# check(what, err, tol): print err, record it, stop unless err <= tol (tol=0: exactly 0)
check = Checks(tol=1e-12, width=64, strict=False)
THREADS = min(os.cpu_count() or 1, 4)       # the machine's cores, at most 4: the matrices here are small
set_cpu_threads(THREADS)                    # hsgd's own threads for the elementwise layers and attention (section 4)
threadpool_limits(THREADS)                  # BLAS threads, the same number, as hsgd.train sets both
tune_allocator()                            # glibc keeps freed memory: a step's temporaries reuse warm pages
rng = np.random.default_rng(0)
blas = next((i for i in threadpool_info() if i["user_api"] == "blas"), {})      # the BLAS NumPy loaded
print(f"{THREADS} threads; BLAS: {blas.get('internal_api', '?')} {blas.get('version', '')} "
      f"({blas.get('architecture', '?')} kernels); NumPy {np.__version__}")
if hasattr(os, "getloadavg"):                  # other processes competing for the cores slow every timing below
    print(f"load average over the last minute: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


def best_and_median(f, repeats):
    """(best, median) seconds of `repeats` calls of f, after one call that is not counted (warm-up)."""
    f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times), float(np.median(times))


# %% [markdown]
# ## 1. FLOPs and MFU
#
# Nearly all the arithmetic of a Transformer is in its matrix products, so the FLOPs of a step are counted from
# them alone (a product of an (m, k) and a (k, n) matrix is $2mkn$ FLOPs). Per block and per token, the forward
# pass multiplies by $W_q, W_k, W_v, W_o$ ($4C^2$ multiply-adds) and by the two MLP weights ($2CF$); attention adds,
# per sequence, $S = qk^\top$ and $y = Pv$ ($2T^2C$ multiply-adds over all heads); the LM head adds $CV$ per token.
# The backward pass does two products for each one of the forward pass: for $y = xW$ it computes
# $dx = dy\,W^\top$ and $dW = x^\top dy$, each as large as the forward product (attention's backward likewise
# computes $dP$, $dv$, $dq$, $dk$: four products for the forward's two). So a step is 3 times the forward pass:
#
# $$\text{FLOPs} = L\left[6BT(4C^2 + 2CF) + 12BT^2C\right] + 6BTCV,$$
#
# which is `ModelConfig.step_flops(B)`. It leaves out the elementwise work (LayerNorm, GELU, softmax, the residual
# adds, the update), a few percent of the FLOPs; these are *model* FLOPs, what the model needs, whatever the
# implementation does. Two conventions to keep in mind: attention is counted over the full $T \times T$ scores,
# although the mask zeroes nearly half of them and hsgd skips part of those (section 3); and the backward pass of the
# first layer's input is counted too (it is needed: the embedding's gradients come from it).
#
# The model of this section is `ModelConfig`'s default (what `hsgd.train` trains unless told otherwise) with
# T = 128 instead of 64. Instead of trusting the
# formula, count the products: wrap every layer function of `hsgd.model.ops` with a function that records its
# arguments, as a profiler would, hand the wrapped functions to the serial model (its `ops` argument), run one
# step, and add up each call's matrix products from the shapes it was actually given. The same wrappers time each
# call, for section 2.

# %%
cfg = ModelConfig(vocab_size=256, seq_len=128, d_model=128, n_heads=4, n_layers=4, d_ff=512)
B = 8
N, C, F, V, T = B * cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.seq_len
LAYER_FUNCTIONS = sorted(n for n in dir(ops) if n.endswith(("_forward", "_backward")))   # what hsgd.model.ops offers
LINEAR = {"attn.q": "qkv", "attn.k": "qkv", "attn.v": "qkv", "attn.proj": "attn proj", "mlp.fc": "mlp fc",
          "mlp.proj": "mlp proj", "lm_head": "LM head"}                # a weight's name -> which product


def linear_kind(W):
    """Which product a linear's weight W belongs to, from its name in `params` (the arrays the step runs on)."""
    name = next(n for n, p in params.items() if p is W)                 # e.g. "h.0.attn.q.weight"
    return next(kind for part, kind in LINEAR.items() if part + ".weight" in name)


def gemms(name, args):
    """(kind, FLOPs, shapes) of one call of the layer function `name`: the matrix products it performs, dense."""
    if name == "linear_forward":                                       # y = x W
        x, W = args[0], args[1]
        n = x.size // x.shape[-1]
        return linear_kind(W), 2 * n * W.size, f"({n}, {W.shape[0]}) @ {W.shape}"
    if name == "linear_backward":                                      # dx = dy W^T and dW = x^T dy
        x2, W = args[1]
        return linear_kind(W), 2 * 2 * x2.shape[0] * W.size, f"2 x ({x2.shape[0]}, {W.shape[1]}) . {W.shape}"
    if name == "attention_forward":                                    # S = q k^T and y = P v, full T x T
        Bq, Tq, Cq = args[0].shape
        return "attention", 2 * 2 * Bq * Tq * Tq * Cq, f"2 x {Bq * args[3]} heads of ({Tq}, {Cq // args[3]}) x {Tq}"
    if name == "attention_backward":                                   # dP, dS k, dS^T q, P^T dy
        Bq, nh, Tq, hs = args[1][0].shape
        return "attention", 4 * 2 * Bq * Tq * Tq * nh * hs, f"4 x {Bq * nh} heads of ({Tq}, {hs}) x {Tq}"
    return name.rsplit("_", 1)[0], 0, ""                               # layernorm, gelu, embedding, cross_entropy


def profiled(calls):
    """hsgd.model.ops' layer functions, each wrapped to append (name, kind, FLOPs, shapes, seconds) to `calls` when it
    is called: an object with the same attributes as hsgd.model.ops, for the serial model's `ops` argument."""
    def wrapped(name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds = time.perf_counter() - t0
            calls.append((name, *gemms(name, args), seconds))
            return out
        return timed

    return types.SimpleNamespace(**{name: wrapped(name, getattr(ops, name)) for name in LAYER_FUNCTIONS})


params = serial.init_params(cfg, seed=0, dtype="float32")
grads = serial.zeros_like_params(params)
idx, targets = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))      # (B, T) each: random bytes
opt = SGD(lr=1e-4, momentum=0.9)

calls = []
serial.loss_and_grads(params, idx, targets, cfg, grads=grads, ops=profiled(calls))
counted = sum(c[2] for c in calls)
forward_flops = sum(c[2] for c in calls if c[0].endswith("_forward"))
print(f"model: L={cfg.n_layers} C={C} NH={cfg.n_heads} F={F} T={T} V={V}, B={B} ({cfg.n_params():,} parameters)")
print("the matrix products of block 0's forward pass and of the LM head, as the layers were called:")
block0 = calls[:calls.index(next(c for c in calls if c[0] == "layernorm_forward")) + 10]  # embedding .. mlp proj
head = [c for c in calls if c[1] == "LM head" and c[0] == "linear_forward"]
for name, kind, flops, shapes, _ in block0 + head:
    if flops:
        print(f"  {kind:<10} {shapes:<42} {flops / 1e6:8.1f} MFLOP")
print(f"step_flops(B) = {cfg.step_flops(B) / 1e9:.4f} GFLOP; counted from {len(calls)} layer calls: "
      f"{counted / 1e9:.4f} GFLOP")
check("|FLOPs counted from the layer calls - step_flops(B)|", abs(counted - cfg.step_flops(B)), 0)
check("|backward FLOPs / forward FLOPs - 2|", abs((counted - forward_flops) / forward_flops - 2), 0)

# %% [markdown]
# **MFU, and its denominator.** Model FLOPs utilization, as PaLM defined it (Chowdhery et al. 2022, "PaLM: Scaling
# Language Modeling with Pathways") and as Megatron-LM's authors report it (Narayanan et al. 2021, "Efficient
# Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", as a percentage of the GPUs' theoretical
# peak), is the model FLOPs per second a step achieves over the **peak** FLOP rate of the hardware, the number on the
# data sheet:
#
# $$\text{MFU} = \frac{\text{step\_flops}(B) / \text{step time}}{\text{peak FLOP/s}}.$$
#
# For a CPU the peak is cores x clock x FLOPs per cycle per core, and the FLOPs per cycle are the float32 lanes of a
# vector register (16 with AVX-512, 8 with AVX2) x 2 (a fused multiply-add is two FLOPs) x the fused multiply-add
# units per core. `/proc/cpuinfo` gives the cores, a clock and the instruction sets (its `flags`), but not all of
# it: it does not say how many FMA units a core has (Intel's server cores since Skylake have one or two 512-bit
# units, depending on the model), nor the clock the cores keep under a full vector load (they may turbo above the
# nominal clock, or drop below it running AVX-512, and a virtual machine reports a nominal clock). So the peak
# below is an **estimate**, printed with every factor and where it came from: two FMA units are assumed, and the
# clock is the highest the kernel's cpufreq reports, else the `cpu MHz` of `/proc/cpuinfo`. Where the flags show
# neither AVX2 with FMA nor AVX-512 (another architecture, for one), no peak is claimed and only the formula is
# printed.
#
# The second denominator is one this machine demonstrably reaches: the rate of a float32 square matrix product into a
# preallocated output, best of a few (a larger one, as `make bench` uses, is a little faster still). A step's FLOPs per
# second over that **measured matmul rate** says how much of what the BLAS actually delivers the step keeps, whatever
# the BLAS's own efficiency on this CPU; it is larger than the MFU whenever the matmul stays below the estimated peak (a
# peak estimated from a clock below the one the cores really run at would reverse that), and it is not what papers
# report, so numbers from papers compare only with the first. Then a few float32 training steps (forward, backward, SGD
# update; the first not counted), and both ratios. Either is below 1: everything else in the step (section 2) and the
# smaller, less efficient products of a small model pull it down. A mid-size model comes closer to the matmul rate than
# this small one (the README's Speed section has both).

# %%
def cpu_peak(threads):
    """(float32 FLOP/s, how it was computed) of the cores `threads` threads run on, estimated from /proc/cpuinfo;
    (None, why not) when it cannot be. Assumes 2 fused multiply-add units per core, which /proc/cpuinfo does not
    show. Two threads on one core (hyper-threading) share its units: the cores counted are the physical ones."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return None, "no /proc/cpuinfo (not Linux)"
    cpus = [{k.strip(): v.strip() for k, v in (line.split(":", 1) for line in block.splitlines() if ":" in line)}
            for block in text.split("\n\n") if block.strip()]                # one dict per logical CPU
    physical = (len({(c["physical id"], c["core id"]) for c in cpus})
                if all("physical id" in c and "core id" in c for c in cpus) else len(cpus))
    cores = min(threads, physical)
    flags = set(cpus[0].get("flags", "").split()) if cpus else set()
    lanes, isa = (16, "avx512f") if "avx512f" in flags else (8, "avx2 + fma") if {"avx2", "fma"} <= flags else (0, "")
    try:                                                              # the highest clock cpufreq may set, in kHz
        ghz, clock = int(open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read()) / 1e6, "cpufreq max"
    except (OSError, ValueError):
        mhz = [float(c["cpu MHz"]) for c in cpus if "cpu MHz" in c]
        ghz, clock = (max(mhz) / 1e3 if mhz else 0.0), "cpu MHz of /proc/cpuinfo"
    if not lanes or not ghz:
        return None, f"flags without avx2 + fma or avx512f, or no clock ({clock}): no peak is claimed"
    fma_units = 2                                                     # assumed: not in /proc/cpuinfo
    how = (f"{cores} cores x {ghz:.2f} GHz ({clock}) x {lanes} float32 lanes ({isa}) x 2 (fused multiply-add) x "
           f"{fma_units} FMA units per core (assumed)")
    return cores * ghz * 1e9 * lanes * 2 * fma_units, how


def matmul_rate(n=1024, repeats=5):
    """Best FLOP/s of an n x n x n float32 matmul into a preallocated output."""
    a, b = rng.random((n, n), dtype=np.float32), rng.random((n, n), dtype=np.float32)
    out = np.empty((n, n), dtype=np.float32)
    best, _ = best_and_median(lambda: np.matmul(a, b, out=out), repeats)
    return 2 * n ** 3 / best


def train_step(layer_ops=ops):
    for g in grads.values():
        g.fill(0)
    serial.loss_and_grads(params, idx, targets, cfg, grads=grads, ops=layer_ops)
    opt.step(params, grads)


PEAK, PEAK_HOW = cpu_peak(THREADS)
RATE = matmul_rate()
step_best, step_median = best_and_median(train_step, 5)
flops = cfg.step_flops(B)
print(f"peak, estimated: {PEAK_HOW}" + (f" = {PEAK / 1e9:.1f} GFLOP/s" if PEAK else ""))
print(f"float32 matmul rate, 1024^3, {THREADS} threads, measured: {RATE / 1e9:.1f} GFLOP/s"
      + (f" ({RATE / PEAK:.0%} of the estimated peak)" if PEAK else ""))
print(f"training step: best {step_best * 1e3:.1f} ms, median {step_median * 1e3:.1f} ms of 5: "
      f"{flops / step_best / 1e9:.1f} GFLOP/s (best), {flops / step_median / 1e9:.1f} GFLOP/s (median)")
if PEAK:
    print(f"MFU (PaLM's, over the estimated peak) = {flops / 1e9:.3f} GFLOP / {step_best * 1e3:.1f} ms / "
          f"{PEAK / 1e9:.1f} GFLOP/s = {flops / step_best / PEAK:.0%} (best step), {flops / step_median / PEAK:.0%} "
          "(median step)")
else:
    print("MFU (PaLM's) = step_flops / step time / (cores x clock x lanes x 2 x FMA units): not computed here, "
          f"{PEAK_HOW}")
print(f"over the measured matmul rate = {flops / 1e9:.3f} GFLOP / {step_best * 1e3:.1f} ms / {RATE / 1e9:.1f} GFLOP/s "
      f"= {flops / step_best / RATE:.0%} (best step), {flops / step_median / RATE:.0%} (median step)")

# %% [markdown]
# ## 2. Where the time goes
#
# The same wrappers, on a few more steps, give the time of every layer function; summed per kind of layer
# (forward and backward together) and per step, next to what its FLOPs would take at the matmul rate. The row
# "rest" is the step's time outside the layer functions: the residual adds, zeroing the gradients, the SGD update.
#
# What to look for: the rows with FLOPs (the linears, q/k/v, attention, the LM head) take a time of the order of
# their FLOPs at the matmul rate; their last column, the fraction of that rate they reach, is mostly below 1,
# because this model's products are small and each layer function does a little more than multiply (the linears add
# their biases and sum the bias gradients; q, k and v are three linears on the same input). (A row above 1 means
# the machine was busier while the matmul rate was measured than during the step: both are timings of a machine
# that may be shared.) The rows without FLOPs
# (LayerNorm, GELU, the cross-entropy, the embedding) add time that no FLOP count sees. Attention's row counts the
# full $T \times T$ scores and it does only part of them (section 3), so its fraction can look better than it is;
# it also contains its softmax, elementwise work again.

# %%
STEPS = 3
calls, step_times = [], []
train_step()                                                           # warm-up, outside the profile
profiled_ops = profiled(calls)
for _ in range(STEPS):
    t0 = time.perf_counter()
    train_step(profiled_ops)
    step_times.append(time.perf_counter() - t0)
step_ms = 1e3 * sum(step_times) / STEPS
KINDS = ["embedding", "layernorm", "qkv", "attention", "attn proj", "mlp fc", "gelu", "mlp proj", "LM head",
         "cross_entropy"]
print(f"{'layer':<14}{'calls':>6}{'ms/step':>9}{'% of step':>10}{'GFLOP':>8}{'ms at matmul rate':>19}"
      f"{'of matmul rate':>16}")
accounted, rows = 0.0, []
for kind in KINDS:
    mine = [c for c in calls if c[1] == kind]
    ms = 1e3 * sum(c[4] for c in mine) / STEPS
    gflop = sum(c[2] for c in mine) / STEPS / 1e9
    accounted += ms
    rows.append((kind, ms, gflop))
    ideal = f"{gflop / RATE * 1e12:19.2f}{gflop * 1e12 / RATE / ms:16.0%}" if gflop else f"{'-':>19}{'-':>16}"
    print(f"{kind:<14}{len(mine) // STEPS:>6}{ms:9.2f}{ms / step_ms:10.0%}{gflop:8.3f}{ideal}")
print(f"{'rest':<14}{'':>6}{step_ms - accounted:9.2f}{(step_ms - accounted) / step_ms:10.0%}")
print(f"{'step':<14}{'':>6}{step_ms:9.2f}{1:10.0%}{flops / 1e9:8.3f}{flops / RATE * 1e3:19.2f}"
      f"{flops / RATE * 1e3 / step_ms:16.0%}")
rows.append(("rest", step_ms - accounted, 0.0))

# %% [markdown]
# The same table as a picture: for each kind of layer, the milliseconds it took per step (measured inside the
# profiled steps), and for the layers with FLOPs, what its FLOPs would take at the measured matmul rate and at the
# estimated peak of section 1. The distance between the first bar and the others is what a faster implementation
# could win; the layers without FLOPs have only the first.

# %%
fig, ax = pictures.figure(7, 4.2)
y = np.arange(len(rows))[::-1]                                         # the first kind at the top
ax.barh(y + 0.27, [ms for _, ms, _ in rows], height=0.27, color=pictures.COLORS["tp"], label="measured")
ax.barh(y, [g / RATE * 1e12 for _, _, g in rows], height=0.27, color="0.55",
        label=f"its FLOPs at the measured matmul rate ({RATE / 1e9:.0f} GFLOP/s)")
if PEAK:
    ax.barh(y - 0.27, [g / PEAK * 1e12 for _, _, g in rows], height=0.27, color="0.8",
            label=f"its FLOPs at the estimated peak ({PEAK / 1e9:.0f} GFLOP/s)")
ax.set_yticks(y, [kind for kind, _, _ in rows], fontsize=8)
ax.set_xlabel("milliseconds per training step")
ax.set_title(f"where a step's {step_ms:.0f} ms go: L={cfg.n_layers} C={C} F={F} T={T} B={B}, float32, "
             f"{THREADS} threads", fontsize=8)
ax.legend(fontsize=7, loc="lower right")
print(f"picture: {pictures.save(fig, 'A_step_time_by_layer')}")

# %% [markdown]
# **Why the elementwise layers cost more than their arithmetic.** A matrix product of an (N, K) and a (K, M) matrix
# reads each input element once from memory and uses it K or M times from cache and registers: it does many
# FLOPs per byte moved, and BLAS runs it near the rate of the arithmetic units. GELU, LayerNorm and the softmax do a
# few operations per element. Their speed is set by how many times the array passes between memory and the cores,
# and by the cost of `tanh` and `exp` per element. NumPy makes this worse by default: every operator in an
# expression like `0.5 * x * (1 + np.tanh(c * (x + 0.044715 * x**3)))` allocates a fresh (N, F) temporary and
# passes over it. That is how `hsgd.model.layers` writes them, to be read. `hsgd.model.kernels` writes the same layers
# as sequences of ufuncs with `out=` into preallocated arrays, updates in place (`a *= r`), takes row sums with
# `einsum` (no temporary for `x * x` before the sum), and cuts GELU's rows into pieces of `kernels.PIECE` elements
# so that its temporaries stay in the CPU's cache. On top of that it splits the rows over threads (section 4). The
# same arithmetic, written both ways, on one (N, F) array four times the size of this model's: GELU with its
# derivative, as plain expressions and as `kernels.gelu_forward` (which computes both, section 5). (The plain
# version here multiplies, `x * x * x`: NumPy may compute `x ** 3` with the general power function, slower still,
# which would blur the point.) Expect the plain expressions to take a few times as long as `kernels.gelu_forward`
# on one thread, though they do the same arithmetic, and more threads to cut the time again; on an array small
# enough to stay in cache the first gap shrinks.

# %%
def gelu_plain(x):
    """GELU and its derivative as NumPy expressions: every operator a new temporary."""
    t = np.tanh(layers.GELU_C * (x + 0.044715 * x * x * x))
    y = 0.5 * x * (1 + t)
    d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * layers.GELU_C * (1 + 3 * 0.044715 * x * x)
    return y, d


xg = rng.standard_normal((4 * N, F)).astype(np.float32)                # (4N, F)
plain_best, _ = best_and_median(lambda: gelu_plain(xg), 3)
set_cpu_threads(1)
one_best, _ = best_and_median(lambda: kernels.gelu_forward(xg), 3)
set_cpu_threads(THREADS)
many_best, _ = best_and_median(lambda: kernels.gelu_forward(xg), 3)
print(f"GELU forward with its derivative on {xg.shape} float32: plain expressions {plain_best * 1e3:.1f} ms, "
      f"gelu_forward on 1 thread {one_best * 1e3:.1f} ms, on {THREADS} threads {many_best * 1e3:.1f} ms")
check("gelu_forward vs plain expressions, float32: y and dy/dx (rel)",
      max(rel_err(a, b) for a, b in zip(kernels.gelu_forward(xg), gelu_plain(xg))), 1e-5)

# %% [markdown]
# ## 3. Skipping the masked blocks of causal attention
#
# Position t attends to positions $\le t$ only: the mask sets every score above the diagonal to $-\infty$ and its
# probability to 0. A dense implementation computes those scores anyway and throws them away. hsgd cuts the
# $T \times T$ matrix into $n_b \times n_b$ blocks (`kernels.causal_blocks(T)`: $n_b = \lfloor T/64 \rfloor$, at most 4,
# so that each block is large enough to be worth a separate product). Row block $i$ (queries
# $iT/n_b \ldots (i+1)T/n_b - 1$) is scored only against keys $0 \ldots (i+1)T/n_b - 1$; the blocks right of that are
# entirely masked and are skipped, in the forward pass (the products and the softmax) and in the backward pass.
# The work left is
#
# $$\frac{1}{n_b^2}\sum_{i=1}^{n_b} i = \frac{n_b + 1}{2 n_b}:$$
#
# all of it for $n_b = 1$, 3/4 for 2 blocks, 5/8 for 4. (FlashAttention skips masked blocks the same way, with
# smaller blocks.) `step_flops` keeps counting the full $T \times T$, the usual convention, so that MFU compares
# models and not implementations.

# %%
print(f"{'T':>6}  {'causal_blocks(T)':<28}{'nb':>4}{'work left':>11}")
frac_err = 0
for t_ in (32, 64, 128, 192, 256, 512, 1024):
    edges = kernels.causal_blocks(t_)
    nb = len(edges) - 1
    left = sum(Fraction((r1 - r0) * r1, t_ * t_) for r0, r1 in zip(edges[:-1], edges[1:]))   # rows x keys kept
    frac_err += abs(left - Fraction(nb + 1, 2 * nb))
    print(f"{t_:>6}  {str(edges):<28}{nb:>4}{str(left):>11}")
check("work left by the blocks - (nb + 1) / (2 nb), summed over T", float(frac_err), 0)

# %% [markdown]
# That is the arithmetic; the products attention actually makes can be counted too. Its products all go through
# `kernels._matmul_into`, so wrapping that one function (inside `hsgd.model.kernels`, for one forward and backward)
# gives the FLOPs performed, to compare with the dense count. The pieces run on several threads (section 4), so the
# wrapper appends to a list, which is safe across threads.

# %%
Ba, NHa, Ta, Ca = 3, 4, 256, 64                                        # a float64 attention, nb = 4
q, k, v = (rng.standard_normal((Ba, Ta, Ca)) for _ in range(3))        # (B, T, C) each
dy = rng.standard_normal((Ba, Ta, Ca))                                  # (B, T, C) dL/dy
performed, matmul_into = [], kernels._matmul_into


def counting_matmul_into(a, b, out):
    performed.append(2 * out.size * a.shape[-1])                       # (.., m, k) @ (.., k, n): 2 m k n each
    return matmul_into(a, b, out)


kernels._matmul_into = counting_matmul_into
try:
    y, cache = kernels.attention_forward(q, k, v, NHa)
    dq, dk, dv = kernels.attention_backward(dy, cache)
finally:
    kernels._matmul_into = matmul_into
dense = 12 * Ba * Ta * Ta * Ca                                         # forward 2 products, backward 4, full T x T
nb = len(kernels.causal_blocks(Ta)) - 1
print(f"T = {Ta}: {len(performed)} products, {sum(performed) / 1e6:.1f} MFLOP performed of {dense / 1e6:.1f} "
      f"MFLOP dense: {Fraction(sum(performed), dense)}")
check("attention FLOPs performed / dense - (nb + 1) / (2 nb)",
      float(abs(Fraction(sum(performed), dense) - Fraction(nb + 1, 2 * nb))), 0)

# %% [markdown]
# Skipping work must not change the result. The reference is the plain attention of `hsgd.model.layers`: dense, with the
# mask applied to the whole score matrix, and the backward of chapter 1:
# $dv = P^\top dy$, $dP = dy\, v^\top$, $dS = P \odot (dP - \text{rowsum}(dP \odot P))$, $dq = dS\, k/\sqrt{hs}$,
# $dk = dS^\top q/\sqrt{hs}$. Both caches hold the whole probability matrix P (index 3), the kernel's with exact
# zeros in the skipped blocks (they were never computed, so they are set), and that is compared too.

# %%
y_ref, cache_ref = layers.attention_forward(q, k, v, NHa)              # every (T, T) score computed, then masked
dq_ref, dk_ref, dv_ref = layers.attention_backward(dy, cache_ref)
P_ref = cache_ref[3]                                                   # (B, NH, T, T)
above = np.triu(np.ones((Ta, Ta), dtype=bool), k=1)                    # (T, T) the masked positions
print(f"cached P {cache[3].shape}; largest |P| above the diagonal: {np.max(np.abs(cache[3][..., above]))}")
check("attention y: blocked vs dense (rel)", rel_err(y, y_ref))
check("attention cached P, zeros above the diagonal included (rel)", rel_err(cache[3], P_ref))
check("attention P above the diagonal: exactly 0", float(np.max(np.abs(cache[3][..., above]))), 0)
check("attention dq, dk, dv: blocked vs dense (rel)",
      max(rel_err(a, b) for a, b in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref))))

# %% [markdown]
# And the time it saves: float32 attention, forward and backward, as in this chapter's model (T = 128) and with
# T = 512, each once with its blocks and once with `causal_blocks` replaced by one block (every score computed,
# then masked). What to look for: the blocks save less time than they save products, because the rest is not
# skipped in proportion (copying the heads, the zeros written into the skipped part of P, the smaller products
# running further below the matmul rate), and at short sequences, with 2 blocks, the saving can vanish; it grows
# with T.

# %%
def attention_seconds(Bt, Tt):
    """Best seconds of attention forward + backward on random float32 (Bt, Tt, C) inputs, NH = cfg.n_heads."""
    qf, kf, vf, dyf = (rng.standard_normal((Bt, Tt, C)).astype(np.float32) for _ in range(4))   # (B, T, C) each

    def attention_step():
        _, c = kernels.attention_forward(qf, kf, vf, cfg.n_heads)
        kernels.attention_backward(dyf, c)
    return best_and_median(attention_step, 5)[0]


causal_blocks = kernels.causal_blocks
for Bt, Tt in ((B, T), (B, 512)):
    blocked = attention_seconds(Bt, Tt)
    kernels.causal_blocks = lambda T, min_rows=64: [0, T]               # one block: every score computed
    try:
        one_block = attention_seconds(Bt, Tt)
    finally:
        kernels.causal_blocks = causal_blocks
    nbt = len(causal_blocks(Tt)) - 1
    print(f"attention forward + backward, B={Bt} NH={cfg.n_heads} T={Tt} C={C} float32: {nbt} blocks "
          f"{blocked * 1e3:.1f} ms, one block {one_block * 1e3:.1f} ms: ratio {blocked / one_block:.2f} "
          f"(products: {(nbt + 1) / (2 * nbt):.3f})")

# %% [markdown]
# ## 4. Threads
#
# BLAS runs each matrix product on several threads. NumPy's elementwise ufuncs run on one. But a ufunc, like a
# BLAS call, releases Python's global interpreter lock (GIL) while it loops over the array, so several Python
# threads can run ufuncs at once, on different cores, as long as each works on its own rows.
# `threads.parallel_rows(fn, n_rows)` does that: it cuts `range(n_rows)` into `cpu_threads()` contiguous pieces,
# hands all but the last to a pool of threads, runs the last itself on the calling thread (one hand-off fewer, and
# the caller would only wait otherwise), and returns when every piece is done. `fn(lo, hi)` writes its rows into
# arrays allocated before, so the pieces never touch the same activations. It runs everything inline when there is one
# thread or too few rows to be worth a hand-off (`min_rows`). Here it is on 10 rows with 3 threads:

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
# Which pool thread takes which of the other pieces is up to the pool: pieces as small as these may all go to one
# pool thread, which finishes one before another thread has started. Only the last piece's place is fixed.
#
# LayerNorm, GELU and the attention softmax use it (with `min_rows` chosen so that a piece holds enough elements).
# Attention splits *sequences* over the threads, a few at a time (`kernels._sequences_per_piece`: few enough that a
# piece's scores stay in cache from the first product through the softmax to the second), and does its products
# inside the pieces. Those products are small, and a product split over all cores by BLAS, one after another, is
# slower than one product per core side by side; so while the pieces run, BLAS is held to one thread
# (`threads.one_blas_thread`, through threadpoolctl).
#
# Splitting rows over threads must not change any number: each row is computed by the same operations, in the same
# order, whichever thread does it. So a whole step in float64, on a model long enough for the attention blocks
# (T = 128) and wide enough in rows that every threaded layer actually splits, must give the same loss and
# gradients with 2 threads as with 1. (BLAS keeps its own thread count in both runs, except that with 2 threads
# attention's pieces hold it to one; a BLAS gives each product the same result on one thread as on several, so
# this changes nothing either, up to rounding at most.) A wrapper on `kernels.parallel_rows` notes which threads
# ran each layer's pieces.

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
# **Why `import hsgd` comes before `import numpy`.** OpenBLAS, the BLAS that NumPy's wheels carry, starts its worker
# threads once and, after each product, lets them spin for a while, waiting for the next one, instead of going to
# sleep (`OPENBLAS_THREAD_TIMEOUT`; by default $2^{28}$ cycles, about a tenth of a second at 3 GHz). For a program that
# only multiplies matrices that saves a wake-up. In hsgd, between two products come LayerNorm, GELU and attention's
# pieces on `parallel_rows`' threads, and a spinning BLAS thread takes a core from them. `import hsgd` therefore
# imports `hsgd.model.threads` before anything else, which sets `OPENBLAS_THREAD_TIMEOUT=4` ($2^4$ cycles: sleep almost
# at once) in the environment, unless it is set already. OpenBLAS reads the variable once, when it is loaded, and it
# is loaded when NumPy is first imported: a program that imports NumPy first has started OpenBLAS with the default,
# and setting the variable afterwards changes nothing. Hence this chapter's first line, and those of `benchmarks/`
# and `python -m hsgd.*`. When it is too late, `threads.openblas_note()` says so (`hsgd.train` prints it in its
# header); setting the variable where the process starts works whatever the order of the imports:
#
#     OPENBLAS_THREAD_TIMEOUT=4 python tutorials/A_where_the_time_goes.py

# %%
note = threads.openblas_note()                                         # None when the setting took effect
print(f"OPENBLAS_THREAD_TIMEOUT = {os.environ.get('OPENBLAS_THREAD_TIMEOUT')}: "
      + (note or "in effect (set before NumPy loaded OpenBLAS, or where the process started)"))

# %% [markdown]
# **Splitting the batch instead.** Everything above splits *each layer* over the threads, which hands work from one
# thread to another several times per layer: at every matrix product (BLAS wakes its threads) and at every
# `parallel_rows` call. On a machine whose idle cores take tens of microseconds to wake, those hand-offs add up.
# The other way uses the mini-batch identity of chapter 4: the mean loss over B sequences is the $B_i/B$-weighted
# mean of the mean losses over any slices of them, and so are its gradients. `serial.loss_and_grads(...,
# split=True)` cuts the batch into `cpu_threads()` slices of whole sequences and gives each its own thread
# (`threads.parallel_batches`): the slice's whole forward and backward run there with one BLAS thread and no
# further splitting (`cpu_threads()` is 1 on that thread), into gradients of its own, which are added at the end.
# It is data parallelism inside one process, with the final sum in place of the All-Reduce; nothing is handed
# over inside the step. The numbers are those of the unsplit step up to rounding (different sums, same terms):

# %%
set_cpu_threads(2)
try:
    loss_split, g_split = serial.loss_and_grads(p64, idx4, targets4, cfg4, split=True, ops=ops)
finally:
    set_cpu_threads(THREADS)
check("float64 loss, batch split over 2 threads vs 1 thread (rel)", abs(loss_split - loss1) / abs(loss1), 1e-13)
check("float64 gradients, batch split over 2 threads vs 1 thread (rel)",
      max(rel_err(g_split[n], g1[n]) for n in g1), 1e-13)


def train_step_split():
    for g in grads.values():
        g.fill(0)
    serial.loss_and_grads(params, idx, targets, cfg, grads=grads, split=True, ops=ops)
    opt.step(params, grads)


if THREADS > 1:
    by_layer, by_batch = best_and_median(train_step, 5), best_and_median(train_step_split, 5)
    print(f"section 1's float32 training step on {THREADS} threads: each layer split {by_layer[1] * 1e3:.1f} ms, "
          f"the batch split {by_batch[1] * 1e3:.1f} ms (medians of 5)")

# %% [markdown]
# Which way is faster depends on the machine and the model. The trainer uses the batch split where it can: a rank
# that holds the whole model alone (pp = tp = 1) runs a `stage.ThreadedStage`, which does exactly this with each
# micro-batch, and `make bench` times that step, `HybridTrainer.step` (the README's Speed section). A
# tensor-parallel rank, whose layers talk to other ranks in the middle of the step, keeps to splitting layers.
#
# `threads.tune_allocator()` (called at the top, as `hsgd.train` does) is the other setting outside the model
# code: glibc hands large freed blocks back to the operating system, and the next step's temporaries of the same
# size then fault in fresh pages; it is told to keep them.
#
# ## 5. Memory as well as time
#
# Section 2 showed GELU among the elementwise layers. Its backward needs the derivative
#
# $$y'(x) = \tfrac12 (1 + t) + \tfrac12 x\, (1 - t^2)\, \sqrt{2/\pi}\, (1 + 3 \cdot 0.044715\, x^2),
# \qquad t = \tanh\!\big(\sqrt{2/\pi}\,(x + 0.044715\,x^3)\big).$$
#
# A straightforward GELU layer caches $x$ and $t$, two (N, F) arrays, and computes $y'$ in the backward pass; the
# plain `layers.gelu_forward` caches $x$ alone and computes $t$ a second time in the backward pass.
# `kernels.gelu_forward` computes $y'$ in the forward pass instead, while $x$ and $t$ are in cache, and keeps only
# $y'$: one (N, F) array less than caching $x$ and $t$, no second `tanh`, and a backward that is one
# multiplication.
# (With GPT-2's F = 4C, the (N, F) arrays are the largest a block caches, after the attention probabilities.)
#
# Chapter 6 counted a block's cached bytes (`activations.activation_bytes`: the distinct arrays in the cache,
# parameters excluded) against `activations.activation_formula`, whose block term has $2NF$ elements for the MLP:
# GELU's derivative and GELU's output (the input of the MLP projection). Here with tp = 1, the Megatron scheme of
# `hsgd.tp.model` (which runs the kernels, from `hsgd.model.ops`), on a one-rank communicator (MPI's `COMM_SELF`: no
# second process; `hsgd.grid.comm.Comm` skips MPI on one rank), in float64:

# %%
cfg5 = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=128)
B5, itemsize = 3, 8
comm = Comm(MPI.COMM_SELF, "tp")                                       # tp = 1
local = tp_shards.init_params(cfg5, comm, seed=0, dtype="float64")
idx5, targets5 = rng.integers(0, 64, (B5, 16)), rng.integers(0, 64, (B5, 16))
_, caches = tp_model.forward(local, idx5, targets5, tp_model.TPSetup(cfg5, comm, "megatron"))
block = caches.blocks[0][1]                                                # block 0's cache
formula = activations.activation_formula(cfg5, B5, itemsize, 1, "megatron")
N5 = B5 * cfg5.seq_len
names = ("ln1", "qkv in", "attention", "attn proj", "ln2", "fc in", "gelu", "mlp proj")
print("block 0's cache, entry by entry (an array two entries share is counted in both lines, once in the sum; "
      "the weights are not in it: the backward takes them from the parameters again):")
for name, entry in zip(names, block):
    print(f"  {name:<10} {activations.activation_bytes(entry, local):>8,} bytes")
measured_block = activations.activation_bytes(block, local)
print(f"  {'block':<10} {measured_block:>8,} bytes; activation_formula {formula['block']:,}")
check("block 0's cached bytes - activation_formula (megatron, tp = 1)", abs(measured_block - formula["block"]), 0)
check("whole forward's cached bytes - activation_formula", abs(activations.activation_bytes(caches, local)
                                                               - formula["model"]), 0)
check("GELU's cache - one (N, F) array, in bytes",
      abs(activations.activation_bytes(block[names.index("gelu")], local) - N5 * cfg5.d_ff * itemsize), 0)
print(f"caching GELU's input and tanh instead would hold {N5 * cfg5.d_ff * itemsize:,} bytes more per block: "
      f"{N5 * cfg5.d_ff * itemsize / formula['block']:.0%} of this block's cache")

# %% [markdown]
# The picture: block 0's cache, entry by entry, in bytes, as counted above, and (hatched) the array a GELU that
# cached its input and tanh would hold in addition. An entry's bar counts every array it holds, so an array that two
# entries shared would appear in both bars and once in the block's total, which is the formula's.

# %%
entry_bytes = [activations.activation_bytes(entry, local) for entry in block]
fig, ax = pictures.figure(7, 3.6)
y = np.arange(len(names))[::-1]
ax.barh(y, entry_bytes, color=pictures.COLORS["tp"], label="cached (activations.activation_bytes)")
ax.barh(y[names.index("gelu")], N5 * cfg5.d_ff * itemsize, left=entry_bytes[names.index("gelu")], color="white",
        edgecolor=pictures.COLORS["dp"], hatch="//", label="one (N, F) array more: caching x and tanh")
for yy, b in zip(y, entry_bytes):
    ax.text(b, yy, f" {b:,}", va="center", fontsize=7)
ax.set_yticks(y, names, fontsize=8)
ax.set_xlabel("bytes")
ax.set_title(f"block 0's cache, float64, N = B*T = {N5}, C = {cfg5.d_model}, F = {cfg5.d_ff}: distinct arrays "
             f"{measured_block:,} B = activation_formula", fontsize=8)
ax.legend(fontsize=7, loc="upper right")
print(f"picture: {pictures.save(fig, 'A_block_cache_bytes')}")

# %% [markdown]
# Moving work from the backward to the forward pass is only right if the derivative is: `kernels.gelu_forward`'s $y$ and
# $y'$ against the formulas above written as plain expressions (`gelu_plain` of section 2), and `gelu_backward`
# against a central finite difference of `gelu_forward`. GELU acts on each element alone, so one difference with
# every element moved by h at once gives every element's derivative, with an error of order $h^2$.

# %%
x = rng.standard_normal((64, 48)) * 3                                  # (N, F) float64, well into both tails
dout = rng.standard_normal(x.shape)                                    # (N, F) dL/dy
y, d = kernels.gelu_forward(x)
dx = kernels.gelu_backward(dout, d)
h = 1e-5
fd = dout * (kernels.gelu_forward(x + h)[0] - kernels.gelu_forward(x - h)[0]) / (2 * h)
y_ref, d_ref = gelu_plain(x)
check("gelu_forward y and cached dy/dx vs the formulas, float64 (rel)", max(rel_err(y, y_ref), rel_err(d, d_ref)))
check("gelu_backward vs central finite difference (rel)", rel_err(dx, fd), 1e-8)

# %% [markdown]
# ## 6. How to measure fairly against another library
#
# An MFU, or a step time, says little until it is set next to something else on the same machine. `make bench`
# (which installs PyTorch: `pip install -e '.[bench]'`) runs `benchmarks/bench_serial.py` (the step split into
# forward, backward and update, and MFU against a 2048^3 matmul) and `benchmarks/bench.py`, which times the trainer's
# own step (`HybridTrainer.step` on one rank, the batch split over the threads, SGD with momentum) and PyTorch
# eager's (`torch.optim.SGD` with the same momentum) on the same model, weights, batch and thread count, after
# checking that the two give the same loss. Timing two libraries in one process has pitfalls, and the
# comparison is written around them:
#
# * **Alternating blocks of steps.** The machine's speed drifts (other jobs, CPU frequency, a shared VM's
#   neighbours). Timing all of hsgd's steps and then all of PyTorch's would put any drift into the ratio. So the
#   two take turns: a block of steps of one, a block of the other, several rounds, and both see the same noise.
# * **The first step of each block is not counted.** Each library leaves threads behind: PyTorch's OpenMP workers,
#   like OpenBLAS's (section 4), spin for a while after their last piece of work, waiting for more. The first step
#   after a switch runs while the other library's threads still hold cores, and measures them as much as itself.
#   Dropping it from every block (`bench.py`'s `compare_with_torch`) leaves the steps that had the machine alone.
# * **Medians and bests.** The median of the counted steps is the summary (a shared machine's slow outliers do not
#   move it); the best is reported next to it, as what the code can do when nothing interferes. Both are printed,
#   and the ratio of medians is the headline. Here, for the step of section 1:

# %%
print(f"training step of section 1: best {step_best * 1e3:.1f} ms, median {step_median * 1e3:.1f} ms "
      f"(median / best = {step_median / step_best:.2f}: how noisy this machine was just now)")

# %% [markdown]
# The utilization of both libraries is taken against the *same* matmul rate, NumPy's BLAS measured in the same run
# (PyTorch's own is printed too), so that a faster BLAS in one library shows as a higher utilization instead of
# being divided out. (It is section 1's second ratio, over the measured matmul rate, not PaLM's MFU over the
# hardware's peak; `bench.py` and the README say so.) `bench.py` also measures data-parallel scaling
# against PyTorch DDP, tensor-parallel overhead, and per-rank memory and bytes against their formulas. It writes
# `benchmarks/results/bench.md` (the tables) and `bench.json`; the README's Speed section shows one run, and what
# made hsgd's step fast: the pieces of this chapter.
#
# ## Check against serial
#
# The serial model was checked against calculus in chapter 1; this chapter checked that the ways hsgd makes it
# fast leave it the same model. The FLOPs the layers perform in a step are `step_flops` exactly, with the backward
# pass twice the forward; causal attention skipping its masked blocks does $(n_b + 1)/(2n_b)$ of the products and
# gives the dense attention's output, probabilities and gradients to rounding; splitting rows, or the batch, over
# threads gives the 1-thread step's loss and gradients; and GELU's cached derivative keeps a block's activations at
# the formula and its gradient at the finite difference. The timings around these checks are the machine's, to
# read, not to assert.

# %%
worst, err = check.worst()
print(f"appendix A: all {len(check.errors)} checks passed; largest error {err:.1e} ({worst})")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `ModelConfig.step_flops(B)`: the model FLOPs of a step from its shape, matrix products only, full T x T attention | `num_floating_point_operations(args, batch_size)` (megatron/training/training.py), the same kind of count by formula | `FlopsProfiler.get_total_flops()` (deepspeed/profiling/flops_profiler/profiler.py): counted per module as a step runs, not from a formula | `torch.utils.flop_counter.FlopCounterMode`: counts the FLOPs of the matmul-like operators as they run (`get_total_flops()`) | a formula checked exactly against the products the layers perform (section 1), so neither can drift |
# | section 1's wrappers on `hsgd.model.ops`: every layer call timed and its products counted, inside a real step | `--log-timers-to-tensorboard`, the timers around the step's phases | `FlopsProfiler` / `get_model_profile` (deepspeed/profiling/flops_profiler/profiler.py), the `"flops_profiler"` config section: FLOPs, time and parameters per module | `torch.profiler.profile(with_flops=True)` and `key_averages()`: time per operator, FLOPs for matmuls and convolutions | twenty lines of Python around the layer functions: the reader sees what is measured |
# | MFU over the peak estimated from `/proc/cpuinfo`, and over the measured matmul rate | `--log-throughput`: "throughput per GPU (TFLOP/s/GPU)" per iteration; MFU is that over the GPU's data-sheet peak, done by the reader; `gpu_sniff_test.py` measures GEMM TFLOP/s per GPU | the flops profiler prints FLOP/s per module | none built in: FLOPs from `FlopCounterMode` over time, over a peak the user supplies | a CPU's peak is not on a data sheet one can trust for a VM, so both denominators, and how the peak was estimated |
# | `activations.activation_bytes` / `activation_formula`: the cached bytes counted and predicted (chapter 6) | `report_theoretical_memory` (megatron/training/theoretical_memory_usage.py) by formula; `report_memory` (megatron/training/utils/common_utils.py) from the allocator | `see_memory_usage` (deepspeed/runtime/utils.py); `estimate_zero2_model_states_mem_needs_all_live` (deepspeed/runtime/zero/stage_1_and_2.py) | `torch.cuda.max_memory_allocated()`; `torch.profiler.profile(profile_memory=True)` | counted array by array in the caches, so the formula is checked exactly, not against an allocator's rounding |
# | `make bench`: hsgd against PyTorch eager on one CPU, alternating blocks, medians and bests (section 6) | - | - | `torch.utils.benchmark.Timer` | - |
#
# ## Exercises
#
# ### Exercise 1: the FLOPs of a step, three ways
# Write the FLOPs of a training step from the model's shape yourself: per layer the four attention projections and
# the two MLP products, attention's $QK^\top$ and $PV$ over the full $T \times T$, the LM head; the backward pass
# twice the forward. Write it also in PaLM's per-token form, $6N + 12LTC$ per token, with N the parameters of the
# weight matrices that multiply (the blocks' and the LM head's; not the embedding tables, whose lookups are no
# products, nor biases and LayerNorms). Check both against `ModelConfig.step_flops` for a few shapes, and against
# the products a float64 step of a small model actually performs, counted by wrapping the layer functions of
# `hsgd.model.ops` as section 1 does.
# (solution: `tutorials/solutions/A_where_the_time_goes.py`, `exercise_1`)
#
# ### Exercise 2: a CPU's peak, and MFU with two denominators
# Write `peak_from_cpuinfo(text, threads)` that finds, in the text of a `/proc/cpuinfo`, the physical cores (the
# distinct (physical id, core id) pairs, at most `threads`), the clock (`cpu MHz`) and the float32 lanes of the widest
# vector unit its flags show (16 for `avx512f`, 8 for `avx2` with `fma`), and returns cores x clock x lanes x 2 x 2
# (a fused multiply-add is 2 FLOPs; 2 FMA units assumed), or None when the flags show neither. Check it on three
# made-up texts: two cores with two hyper-threads each, another with AVX-512, and an ARM machine. Then time a small
# step on this machine and give its MFU over your estimate of this machine's peak and over a measured matmul rate:
# which is the larger, and what does that say about the estimate?
# (solution: `tutorials/solutions/A_where_the_time_goes.py`, `exercise_2`)
#
# ### Exercise 3: the memory of a layout
# Write the bytes a tensor-parallel rank holds for the model's state: its parameters, their gradients and the
# optimizer's state (one velocity for SGD with momentum, two moments for AdamW), from the shapes: a replicated
# parameter whole, a split one 1/tp of its split axis, the vocabulary ceil(V/tp) rows. Check it against the shards
# `tp_shards.shard` cuts from the serial parameters, for Megatron's scheme and the All-Gather scheme at tp = 2 and 4,
# then print the table for a GPT-2-small shape (L 12, C 768, NH 12, F 3072, V 50257, T 1024) in float32 with AdamW at
# tp = 1, 2, 4 and 6 (`tp_shards.check_tp` refuses tp = 8, which does not divide the 12 heads).
# (solution: `tutorials/solutions/A_where_the_time_goes.py`, `exercise_3`)
