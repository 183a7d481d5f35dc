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
# The chapters asked whether hsgd computes the right numbers; this appendix asks how fast, on one CPU process, and
# why. A step is mostly matrix products, the one thing a CPU does near its peak; everything else costs time without
# adding model FLOPs. It counts a step's FLOPs and its MFU (section 1), times every layer and shows why the tuned
# layers are written in place (2), skips the blocks the causal mask zeroes (3), trades GELU's cached input for its
# derivative (4), and says how to compare fairly with another library (5). How hsgd's threads split a layer or a
# batch, and why `import hsgd` comes before `import numpy`, are in appendix B.
#
# Run it as a script, one process, no mpirun (it exits non-zero if any check fails):
#
#     python tutorials/A_where_the_time_goes.py
#
# About 5 s on an idle 2-core machine; with other jobs on the cores (load 7 to 15), 10 s to 88 s, since every layer
# waits for the slower of its two threads, hundreds of times a step (the load average is printed first). No check
# depends on a timing; the checks are about FLOPs, bytes and values.
#
# Every layer exists twice: `hsgd.model.layers`, the plain formulas (the reference), and `hsgd.model.kernels`, the
# tuned versions `hsgd.model.ops` hands to the models (tests/test_kernels.py checks they agree), which this appendix
# runs: `serial.loss_and_grads(..., ops=ops)`.
#
# Legend: B batch, T sequence, C d_model, NH heads, hs = C/NH head size, F d_ff, V vocabulary, L layers,
# N = B*T rows. A FLOP is one floating-point operation (a multiply-add is 2); GFLOP/s = 1e9 FLOPs per second;
# MFU = model FLOPs utilization; ms = milliseconds.

# %%
# before NumPy: hsgd sets OPENBLAS_THREAD_TIMEOUT, which OpenBLAS reads only when it is loaded (appendix B)
from hsgd.model.config import ModelConfig

import os
import time
import types
from fractions import Fraction

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_info, threadpool_limits

from hsgd.model import kernels, layers, ops, serial
from hsgd.accounting import activations
from hsgd.tp import model as tp_model, shards as tp_shards
from hsgd.model.threads import set_cpu_threads, tune_allocator
from hsgd.grid.comm import Comm
from hsgd.model.optim import SGD

import pictures                         # tutorials/pictures.py: where the PNGs go
from checks import Checks, best_and_median, rel_err      # tutorials/checks.py: the check every chapter uses

# check(what, err, tol): print err, record it, stop unless err <= tol (tol=0: exactly 0)
check = Checks(tol=1e-12, width=64, strict=False)
THREADS = min(os.cpu_count() or 1, 4)       # the machine's cores, at most 4: the matrices here are small
set_cpu_threads(THREADS)                    # hsgd's own threads for the elementwise layers and attention (app. B)
threadpool_limits(THREADS)                  # BLAS threads, the same number, as hsgd.train sets both
tune_allocator()                            # glibc keeps freed memory: a step's temporaries reuse warm pages
rng = np.random.default_rng(0)
blas = next((i for i in threadpool_info() if i["user_api"] == "blas"), {})      # the BLAS NumPy loaded
print(f"{THREADS} threads; BLAS: {blas.get('internal_api', '?')} {blas.get('version', '')} "
      f"({blas.get('architecture', '?')} kernels); NumPy {np.__version__}")
if hasattr(os, "getloadavg"):                  # other processes competing for the cores slow every timing below
    print(f"load average over the last minute: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


# %% [markdown]
# ## 1. FLOPs and MFU
#
# The FLOPs of a step are counted from the matrix products alone (an (m, k) by (k, n) product is $2mkn$ FLOPs).
# Per block and token the forward pass multiplies by $W_q, W_k, W_v, W_o$ ($4C^2$ multiply-adds) and the two MLP
# weights ($2CF$); attention adds $S = qk^\top$ and $y = Pv$ per sequence ($2T^2C$ over all heads); the LM head
# $CV$ per token. The backward pass does two products per forward product ($dx = dy\,W^\top$, $dW = x^\top dy$;
# attention's $dP$, $dv$, $dq$, $dk$), so a step is 3 forwards:
#
# $$\text{FLOPs} = L\left[6BT(4C^2 + 2CF) + 12BT^2C\right] + 6BTCV,$$
#
# which is `ModelConfig.step_flops(B)`. These are *model* FLOPs: the elementwise work (a few percent) is left out,
# attention is counted over the full $T \times T$ scores although hsgd skips part of the masked half (section 3), and
# the first layer's input gradient is counted (the embedding's gradients need it).
#
# The model is `ModelConfig`'s default with T = 128. Rather than trust the formula, count the products: wrap every
# layer function of `hsgd.model.ops` to record its arguments, as a profiler would, hand the wrappers to the serial
# model (its `ops` argument), run one step, and add up each call's products from the shapes it was given. The same
# wrappers time each call, for section 2.

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
# Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"), is the model FLOPs per second of a step
# over the hardware's **peak** FLOP rate:
#
# $$\text{MFU} = \frac{\text{step\_flops}(B) / \text{step time}}{\text{peak FLOP/s}}.$$
#
# A CPU's peak is cores x clock x the float32 lanes of a vector register (16 with AVX-512, 8 with AVX2) x 2 (a fused
# multiply-add) x the FMA units per core. `/proc/cpuinfo` shows neither the FMA units (one or two on Intel's server
# cores since Skylake) nor the clock under full vector load (turbo, AVX-512 slowdown, a VM's nominal clock), so the
# peak below is an **estimate**, printed with every factor: two FMA units assumed, the clock the highest cpufreq
# reports, else `cpu MHz`; without AVX2 + FMA or AVX-512 no peak is claimed.
#
# The second denominator is one this machine demonstrably reaches, a float32 square matmul into a preallocated
# output. A step's rate over this **measured matmul rate** is what the step keeps of what the BLAS delivers; it
# exceeds the MFU whenever the matmul stays below the estimated peak, and papers report only the first. Both are
# below 1: the rest of the step (section 2) and a small model's small products pull them down.

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
# The same wrappers, over a few more steps, time every layer function, summed per kind of layer (forward and
# backward) and per step, next to what its FLOPs would take at the matmul rate; "rest" is the step outside the layer
# functions (residual adds, zeroing the gradients, the update). The rows with FLOPs mostly reach below the matmul
# rate: small products, and a little more than multiplying (biases, their gradients; q, k, v three linears). A row
# above 1 means the machine was busier while the matmul rate was measured. The rows without FLOPs (LayerNorm, GELU,
# cross-entropy, embedding) are time no FLOP count sees; attention's row counts the full $T \times T$ it partly skips
# (section 3), and contains its softmax.

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
# The picture: each kind of layer's measured milliseconds per step and, for those with FLOPs, what its FLOPs would
# take at the measured matmul rate and at the estimated peak; the gap is what a faster implementation could win.

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
# **Why the elementwise layers cost more than their arithmetic.** A matrix product uses each element it reads from
# memory K or M times from cache and registers, so BLAS runs near the arithmetic units' rate. GELU, LayerNorm and the
# softmax do a few operations per element: their speed is set by how often the array passes between memory and the
# cores, and by `tanh` and `exp`. NumPy makes it worse: every operator in `0.5 * x * (1 + np.tanh(c * (x + 0.044715
# * x**3)))` allocates a fresh (N, F) temporary, which is how `hsgd.model.layers` writes them, to be read.
# `hsgd.model.kernels` writes the same layers as ufuncs with `out=` into preallocated arrays, updates in place
# (`a *= r`), takes row sums with `einsum` (no `x * x` temporary), cuts GELU's rows into pieces of `kernels.PIECE`
# elements that stay in cache, and splits rows over threads (appendix B). GELU with its derivative, written both ways,
# on an (N, F) array four times this model's (the plain version multiplies, `x * x * x`, since `x ** 3` may take the
# slower general power): expect the plain expressions a few times slower than `kernels.gelu_forward` on one thread,
# and more threads faster still.

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
# Position t attends to positions $\le t$ only; a dense implementation computes the masked scores and discards them.
# hsgd cuts the $T \times T$ matrix into $n_b \times n_b$ blocks (`kernels.causal_blocks(T)`: $n_b = \lfloor T/64
# \rfloor$, at most 4, each block worth a product of its own) and scores row block $i$ only against keys
# $0 \ldots (i+1)T/n_b - 1$, skipping the fully masked blocks in the forward and backward passes. The work left is
#
# $$\frac{1}{n_b^2}\sum_{i=1}^{n_b} i = \frac{n_b + 1}{2 n_b}:$$
#
# all of it for $n_b = 1$, 3/4 for 2 blocks, 5/8 for 4 (FlashAttention skips masked blocks the same way, with
# smaller blocks). `step_flops` keeps the full $T \times T$, the usual convention, so MFU compares models, not
# implementations.

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
# The products attention performs can be counted too: they all go through `kernels._matmul_into`, so wrapping that
# one function for a forward and backward gives the FLOPs performed (the pieces run on several threads; appending to
# a list is thread-safe).

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
# Skipping work must not change the result. The reference is `hsgd.model.layers`' dense attention, masked over the
# whole score matrix, with chapter 1's backward: $dv = P^\top dy$, $dP = dy\, v^\top$,
# $dS = P \odot (dP - \text{rowsum}(dP \odot P))$, $dq = dS\, k/\sqrt{hs}$, $dk = dS^\top q/\sqrt{hs}$. Both caches
# hold the whole P (index 3), the kernel's with zeros set in the skipped blocks; that is compared too.

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
# The time saved, float32 forward and backward at T = 128 and 512, with the blocks and with one block: less than
# the products saved (copying heads, writing P's zeros, smaller products run further below the matmul rate), and
# at short sequences with 2 blocks it can vanish; it grows with T.

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
# ## 4. Memory as well as time
#
# GELU's backward needs the derivative
#
# $$y'(x) = \tfrac12 (1 + t) + \tfrac12 x\, (1 - t^2)\, \sqrt{2/\pi}\, (1 + 3 \cdot 0.044715\, x^2),
# \qquad t = \tanh\!\big(\sqrt{2/\pi}\,(x + 0.044715\,x^3)\big).$$
#
# A straightforward GELU caches $x$ and $t$, two (N, F) arrays; the plain `layers.gelu_forward` caches $x$ and
# computes $t$ again in the backward pass. `kernels.gelu_forward` computes $y'$ in the forward pass, while $x$ and $t$
# are in cache, and keeps only $y'$: one (N, F) array less, no second `tanh`, a backward of one multiplication. (With
# F = 4C the (N, F) arrays are a block's largest after the attention probabilities.)
#
# Chapter 6 counted a block's cached bytes (`activations.activation_bytes`: distinct arrays, parameters excluded)
# against `activations.activation_formula`, whose MLP term is $2NF$ elements: GELU's derivative and its output. Here
# at tp = 1, Megatron's scheme of `hsgd.tp.model` (which runs the kernels) on `COMM_SELF`, in float64:

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
# The picture: block 0's cache entry by entry, in bytes, and (hatched) the array a GELU caching its input and tanh
# would add. An array two entries shared would appear in both bars and once in the block's total.

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
# Moving work to the forward pass is right only if the derivative is: `kernels.gelu_forward`'s $y$ and $y'$ against
# the formulas as plain expressions (`gelu_plain`, section 2), and `gelu_backward` against a central finite
# difference; GELU acts elementwise, so one difference moving every element by h gives every derivative, to $O(h^2)$.

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
# ## 5. How to measure fairly against another library
#
# A step time means little until set next to another on the same machine. `make bench` (which installs PyTorch:
# `pip install -e '.[bench]'`) runs `benchmarks/bench_serial.py` (forward, backward and update timed, MFU against a
# 2048^3 matmul) and `benchmarks/bench.py`, which times the trainer's step (`HybridTrainer.step` on one rank, the
# batch split over threads, SGD with momentum) and PyTorch eager's on the same model, weights, batch and threads,
# after checking that both give the same loss. Two libraries in one process need care:
#
# * **Alternating blocks of steps.** The machine's speed drifts (other jobs, clock, a VM's neighbours); timing all
#   of one library and then all of the other would put the drift into the ratio. Blocks of each, in turns, share it.
# * **The first step of each block is not counted.** PyTorch's OpenMP workers, like OpenBLAS's (appendix B), spin
#   for a while after their last work; the first step after a switch competes with them (`bench.py`'s
#   `compare_with_torch` drops it).
# * **Medians and bests.** The median of the counted steps is the headline (slow outliers do not move it); the best,
#   what the code does undisturbed, is printed next to it. For the step of section 1:

# %%
print(f"training step of section 1: best {step_best * 1e3:.1f} ms, median {step_median * 1e3:.1f} ms "
      f"(median / best = {step_median / step_best:.2f}: how noisy this machine was just now)")

# %% [markdown]
# Both libraries' utilization is taken against the *same* matmul rate, NumPy's BLAS measured in the same run
# (PyTorch's is printed too), so a faster BLAS shows as higher utilization instead of being divided out; it is
# section 1's second ratio, not PaLM's MFU. `bench.py` also measures data-parallel scaling against PyTorch DDP,
# tensor-parallel overhead, and memory and bytes per rank against their formulas, into
# `benchmarks/results/bench.md` and `bench.json`; the README's Speed section shows one run.
#
# ## Check against serial
#
# Chapter 1 checked the serial model against calculus; this appendix checked that making it fast leaves it the same
# model. The layers' products in a step are `step_flops` exactly, the backward twice the forward; causal attention
# skipping its masked blocks does $(n_b + 1)/(2n_b)$ of the products and matches dense attention's output,
# probabilities and gradients to rounding; GELU's cached derivative keeps a block's activations at the formula and
# its gradient at the finite difference. The timings are the machine's, to read, not to assert.

# %%
worst, err = check.worst()
print(f"appendix A: all {len(check.errors)} checks passed; largest error {err:.1e} ({worst})")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `ModelConfig.step_flops(B)`: matrix products only, full T x T attention | `num_floating_point_operations(args, batch_size)` (megatron/training/training.py), by formula | `FlopsProfiler.get_total_flops()` (deepspeed/profiling/flops_profiler/profiler.py): counted per module as a step runs | `torch.utils.flop_counter.FlopCounterMode` (`get_total_flops()`): matmul-like operators as they run | a formula checked exactly against the products performed (section 1) |
# | section 1's wrappers on `hsgd.model.ops`: every layer call timed and its products counted | `--log-timers-to-tensorboard` | `FlopsProfiler` / `get_model_profile` (deepspeed/profiling/flops_profiler/profiler.py), the `"flops_profiler"` config section | `torch.profiler.profile(with_flops=True)` and `key_averages()` | twenty lines of Python around the layer functions |
# | MFU over the peak estimated from `/proc/cpuinfo`, and over the measured matmul rate | `--log-throughput` (TFLOP/s per GPU; MFU over the data-sheet peak left to the reader) | the flops profiler prints FLOP/s per module | none built in (`FlopCounterMode` over time, over a peak the user supplies) | a VM's CPU has no trustworthy data-sheet peak: both denominators, the estimate explained |
# | `activations.activation_bytes` / `activation_formula` (chapter 6) | `report_theoretical_memory` (megatron/training/theoretical_memory_usage.py) by formula; `report_memory` (megatron/training/utils/common_utils.py) from the allocator | `see_memory_usage` (deepspeed/runtime/utils.py); `estimate_zero2_model_states_mem_needs_all_live` (deepspeed/runtime/zero/stage_1_and_2.py) | `torch.cuda.max_memory_allocated()`; `torch.profiler.profile(profile_memory=True)` | counted array by array, so the formula is checked exactly |
# | `make bench`: hsgd against PyTorch eager on one CPU, alternating blocks, medians and bests (section 5) | - | - | `torch.utils.benchmark.Timer` | - |
#
# ## Exercises
#
# ### Exercise 1: the FLOPs of a step, three ways
# Write a step's FLOPs from the model's shape: per layer the four attention projections, the two MLP products,
# $QK^\top$ and $PV$ over the full $T \times T$, the LM head; the backward twice the forward. Write it also in PaLM's
# per-token form, $6N + 12LTC$, N the weights of the matrices that multiply (not the embedding tables, biases or
# LayerNorms). Check both against `ModelConfig.step_flops` for a few shapes, and against the products a float64 step
# performs, counted by wrapping `hsgd.model.ops` as section 1 does.
# (solution: `tutorials/solutions/A_where_the_time_goes.py`, `exercise_1`)
#
# ### Exercise 2: a CPU's peak, and MFU with two denominators
# Write `peak_from_cpuinfo(text, threads)`: from a `/proc/cpuinfo` text, the physical cores (distinct (physical id,
# core id) pairs, at most `threads`), the clock (`cpu MHz`) and the float32 lanes of the widest vector unit (16 for
# `avx512f`, 8 for `avx2` with `fma`); return cores x clock x lanes x 2 x 2 (FMA = 2 FLOPs, 2 units assumed), or None
# when the flags show neither. Check it on three made-up texts: two cores of two hyper-threads, one with AVX-512, an
# ARM machine. Then give a small step's MFU over your estimate of this machine's peak and over a measured matmul
# rate: which is larger, and what does that say about the estimate?
# (solution: `tutorials/solutions/A_where_the_time_goes.py`, `exercise_2`)
#
# ### Exercise 3: the memory of a layout
# Write the bytes a tensor-parallel rank holds for parameters, gradients and optimizer state (one velocity for SGD
# with momentum, two moments for AdamW) from the shapes: a replicated parameter whole, a split one 1/tp of its split
# axis, the vocabulary ceil(V/tp) rows. Check it against `tp_shards.shard`'s shards for Megatron's and the All-Gather
# scheme at tp = 2 and 4, then print it for GPT-2 small (L 12, C 768, NH 12, F 3072, V 50257, T 1024), float32,
# AdamW, at tp = 1, 2, 4, 6 (`tp_shards.check_tp` refuses 8, which does not divide 12 heads).
# (solution: `tutorials/solutions/A_where_the_time_goes.py`, `exercise_3`)
