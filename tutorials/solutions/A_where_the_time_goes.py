"""Solutions to the exercises of appendix A (tutorials/A_where_the_time_goes.py).

    python tutorials/solutions/A_where_the_time_goes.py

One process, no MPI. The timings it prints (exercise 2) are this machine's; no check depends on them.
"""
import hsgd  # noqa: F401  (before NumPy: hsgd sets OPENBLAS_THREAD_TIMEOUT before OpenBLAS is loaded)

import math
import os
import sys
import time
import types

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, solve  # noqa: E402

from hsgd.model.config import ModelConfig  # noqa: E402
from hsgd.model import ops, serial
from hsgd.tp import shards as tp_shards
from hsgd.model.optim import SGD  # noqa: E402
from hsgd.model.threads import set_cpu_threads  # noqa: E402

threadpool_limits(1)                    # one BLAS thread, and one of hsgd's own: exercise 2 times one core
set_cpu_threads(1)


# ---------------------------------------------------------------------------------------------------- exercise 1

def my_step_flops(cfg, B):
    """Forward: per layer and token 2 (4 C^2 + 2 C F) for q, k, v, proj, fc, proj; per layer and sequence 2 * 2 T^2 C
    for q k^T and P v; per token 2 C V for the LM head. The step: 3 x the forward (the backward does two products
    for each one)."""
    L, T, C, F, V = cfg.n_layers, cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.vocab_size
    forward = L * (B * T * 2 * (4 * C * C + 2 * C * F) + B * 2 * 2 * T * T * C) + B * T * 2 * C * V
    return 3 * forward


def palm_step_flops(cfg, B):
    """PaLM's form: (6 N + 12 L T C) per token, N the weights that multiply (blocks' matrices and the LM head)."""
    N = sum(math.prod(s) for n, s in cfg.param_shapes().items()
            if len(s) == 2 and n not in ("wte", "wpe"))
    return B * cfg.seq_len * (6 * N + 12 * cfg.n_layers * cfg.seq_len * cfg.d_model)


def counted_step_flops(cfg, B):
    """The FLOPs of the products one float64 step performs: hsgd.model.ops' linear and attention functions wrapped, each
    call's products counted from the shapes it was given (dense attention, full T x T)."""
    count = []

    def linear_forward(x, W, *rest, **kw):
        count.append(2 * (x.size // x.shape[-1]) * W.size)              # (n, Cin) @ (Cin, Cout)
        return ops.linear_forward(x, W, *rest, **kw)

    def linear_backward(dy, cache, *rest, **kw):
        x2, W = cache
        count.append(2 * 2 * x2.shape[0] * W.size)                      # dx = dy W^T and dW = x^T dy
        return ops.linear_backward(dy, cache, *rest, **kw)

    def attention_forward(q, k, v, n_heads, *rest, **kw):
        Bq, Tq, Cq = q.shape
        count.append(2 * 2 * Bq * Tq * Tq * Cq)                         # q k^T and P v
        return ops.attention_forward(q, k, v, n_heads, *rest, **kw)

    def attention_backward(dy, cache, *rest, **kw):
        Bq, Tq, Cq = dy.shape
        count.append(4 * 2 * Bq * Tq * Tq * Cq)                         # dP, dv, dq, dk
        return ops.attention_backward(dy, cache, *rest, **kw)

    wrapped = {n: getattr(ops, n) for n in dir(ops) if n.endswith(("_forward", "_backward"))}
    wrapped.update(linear_forward=linear_forward, linear_backward=linear_backward,
                   attention_forward=attention_forward, attention_backward=attention_backward)
    rng = np.random.default_rng(0)
    params = serial.init_params(cfg, seed=0, dtype="float64")
    idx, targets = (rng.integers(0, cfg.vocab_size, (B, cfg.seq_len)) for _ in range(2))
    serial.loss_and_grads(params, idx, targets, cfg, ops=types.SimpleNamespace(**wrapped))
    return sum(count)


def exercise_1(check):
    """The FLOPs of a step, three ways."""
    shapes = [ModelConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4, d_ff=512),
              ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072),
              ModelConfig(vocab_size=100, seq_len=7, d_model=12, n_heads=3, n_layers=3, d_ff=20)]
    for cfg, B in zip(shapes, (8, 16, 5)):
        mine, palm, hsgds = my_step_flops(cfg, B), palm_step_flops(cfg, B), cfg.step_flops(B)
        attention = 3 * cfg.n_layers * B * 4 * cfg.seq_len ** 2 * cfg.d_model
        check.say(f"L={cfg.n_layers} C={cfg.d_model} T={cfg.seq_len} V={cfg.vocab_size} B={B}: {mine / 1e9:,.3f} GFLOP "
                  f"per step, attention's T^2 terms {attention / mine:.1%} of it")
        check.equal(f"C={cfg.d_model}: (by shape, PaLM's form) == step_flops", (mine, palm), (hsgds, hsgds))
    small = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
    counted = counted_step_flops(small, 3)
    check.say(f"small model, B=3: counted from the layer calls {counted:,} FLOPs, by shape {my_step_flops(small, 3):,}")
    check.equal("FLOPs counted from a real step == by shape", counted, my_step_flops(small, 3))


# ---------------------------------------------------------------------------------------------------- exercise 2

def peak_from_cpuinfo(text, threads, fma_units=2):
    """(float32 FLOP/s, cores, GHz, lanes) of `threads` threads from a /proc/cpuinfo text; None if the flags show
    neither avx512f nor avx2 with fma."""
    cpus = [dict((k.strip(), v.strip()) for k, v in (line.split(":", 1) for line in block.splitlines() if ":" in line))
            for block in text.split("\n\n") if block.strip()]
    flags = set(cpus[0].get("flags", "").split())
    lanes = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= flags else 0
    if not lanes:
        return None
    cores = min(threads, len({(c.get("physical id"), c.get("core id")) for c in cpus}))
    ghz = max(float(c["cpu MHz"]) for c in cpus) / 1e3
    return cores * ghz * 1e9 * lanes * 2 * fma_units, cores, ghz, lanes


def fake_cpuinfo(cores, threads_per_core, mhz, flags, arm=False):
    """A /proc/cpuinfo text of `cores` x `threads_per_core` logical CPUs."""
    blocks = []
    for c in range(cores):
        for t in range(threads_per_core):
            n = c * threads_per_core + t
            if arm:
                blocks.append(f"processor\t: {n}\nBogoMIPS\t: 50.00\nFeatures\t: {flags}\nCPU implementer\t: 0x41")
            else:
                blocks.append(f"processor\t: {n}\nmodel name\t: made up\ncpu MHz\t\t: {mhz}\nphysical id\t: 0\n"
                              f"core id\t\t: {c}\nflags\t\t: {flags}")
    return "\n\n".join(blocks) + "\n"


B_STEP = 8                              # exercise 2's batch


def exercise_2(check):
    """A CPU's peak, and MFU with two denominators."""
    cases = [(fake_cpuinfo(2, 2, "3000.000", "fpu sse2 avx avx2 fma"), 4, (2 * 3.0e9 * 8 * 2 * 2, 2, 3.0, 8)),
             (fake_cpuinfo(2, 1, "2100.000", "fpu avx2 fma avx512f avx512bw"), 2, (2 * 2.1e9 * 16 * 2 * 2, 2, 2.1, 16)),
             (fake_cpuinfo(4, 1, "", "fp asimd evtstrm sve", arm=True), 4, None)]
    got = [peak_from_cpuinfo(text, threads) for text, threads, _ in cases]
    check.equal("peaks of three made-up machines (hyper-threads, AVX-512, ARM)",
                [g if g is None else (round(g[0]), g[1], g[2], g[3]) for g in got],
                [w if w is None else (round(w[0]), w[1], w[2], w[3]) for _, _, w in cases])
    here = peak_from_cpuinfo(open("/proc/cpuinfo").read(), 1) if os.path.exists("/proc/cpuinfo") else None
    n = 512
    a, b = (np.random.default_rng(1).random((n, n), dtype=np.float32) for _ in range(2))
    out = np.empty((n, n), dtype=np.float32)
    np.matmul(a, b, out=out)
    rate = max(2 * n ** 3 / timed(lambda: np.matmul(a, b, out=out)) for _ in range(5))
    cfg = ModelConfig(vocab_size=256, seq_len=128, d_model=128, n_heads=4, n_layers=2, d_ff=512)   # appendix A's,
    params = serial.init_params(cfg, seed=0, dtype="float32")                                      # two layers
    grads = serial.zeros_like_params(params)
    idx, targets = (np.random.default_rng(2).integers(0, 256, (B_STEP, 128)) for _ in range(2))
    opt = SGD(lr=1e-4, momentum=0.9)

    def step():
        for g in grads.values():
            g.fill(0)
        serial.loss_and_grads(params, idx, targets, cfg, grads=grads, ops=ops)
        opt.step(params, grads)

    step()
    seconds = min(timed(step) for _ in range(3))
    achieved = cfg.step_flops(B_STEP) / seconds
    check.say(f"one thread: a float32 {n}^3 matmul at {rate / 1e9:.1f} GFLOP/s; a step at {achieved / 1e9:.2f} "
              f"GFLOP/s: {achieved / rate:.0%} of the matmul rate")
    if here is None:
        check.say("no peak for this machine from /proc/cpuinfo (not Linux, or no AVX2/AVX-512): MFU over the peak "
                  "is not computed")
        check.holds("no peak: the matmul-rate ratio is still defined and below 1", 0 < achieved / rate < 1)
    else:
        peak = here[0]
        check.say(f"this machine, one core: {here[1]} x {here[2]:.2f} GHz x {here[3]} lanes x 2 x 2 = "
                  f"{peak / 1e9:.1f} GFLOP/s (estimated); MFU {achieved / peak:.1%}, over the matmul rate "
                  f"{achieved / rate:.1%}; the matmul reaches {rate / peak:.0%} of the estimate, so the MFU is the "
                  f"{'smaller' if rate < peak else 'larger'} of the two")


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------- exercise 3

def state_bytes(cfg, tp, scheme, itemsize, optimizer):
    """Bytes one tensor-parallel rank holds: parameters, gradients and optimizer state (SGD: a velocity; AdamW: two
    moments), from the shapes and how the scheme splits each parameter."""
    copies = 2 + (1 if optimizer == "sgd" else 2)
    elements = 0
    for name, shape in cfg.param_shapes().items():
        kind, axis = tp_shards.split_of(name, scheme)
        n = math.prod(shape)
        if kind == "split":
            n //= tp
        elif kind == "vocab":
            n = n // shape[axis] * -(-shape[axis] // tp)                # ceil(V / tp) rows (columns)
        elements += n
    return copies * itemsize * elements


def exercise_3(check):
    """The memory of a layout."""
    cfg = ModelConfig(vocab_size=250, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
    full = serial.init_params(cfg, seed=0, dtype="float64")
    for scheme in ("megatron", "gather"):
        for tp in (2, 4):
            cut = [sum(tp_shards.shard(p, n, t, tp, scheme).size for n, p in full.items()) for t in range(tp)]
            for optimizer in ("sgd", "adamw"):
                copies = 2 + (1 if optimizer == "sgd" else 2)
                check.equal(f"{scheme} tp {tp} {optimizer}: bytes per rank == from tp_shards.shard on every rank",
                            [state_bytes(cfg, tp, scheme, 8, optimizer)] * tp, [copies * 8 * c for c in cut])
    gpt2 = ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072)
    check.say(f"GPT-2-small shape ({gpt2.n_params() / 1e6:.1f}M parameters: hsgd's LM head is not tied to wte), "
              "float32, AdamW, Megatron's scheme:")
    for tp in (1, 2, 4, 6):                                   # tp must divide the 12 heads: not 8
        tp_shards.check_tp(gpt2, tp)                           # raises ConfigError for a size hsgd cannot run
        check.say(f"  tp {tp}: {state_bytes(gpt2, tp, 'megatron', 4, 'adamw') / 2 ** 30:.3f} GiB per rank "
                  f"(parameters, gradients, two moments)")
    check.equal("tp 1: 16 bytes per parameter", state_bytes(gpt2, 1, "megatron", 4, "adamw"), 16 * gpt2.n_params())


if __name__ == "__main__":
    solve(Checks(tol=1e-12, width=78), [exercise_1, exercise_2, exercise_3])
