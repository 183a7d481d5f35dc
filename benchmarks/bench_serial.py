"""Time one serial training step (forward, backward, SGD update; float32) and compare with the matmul rate.

    python benchmarks/bench_serial.py [--d-model 512 --n-layers 4 --n-heads 8 --d-ff 2048 --seq-len 256
                                       --batch-size 8 --repeats 5 --threads N]      (or: make bench)

Reports the model FLOPs of the step (by formula, ModelConfig.step_flops: the matmuls, backward = 2 x forward)
per second of the measured step, as a fraction of the float32 GEMM rate of this machine measured in the same
run (a square 2048 x 2048 x 2048 matmul, best of several), for the step's two ways of using the threads: each
layer splitting its work over them (timed in phases: forward, backward, update), and the batch split over them,
one slice per thread (serial.loss_and_grads(split=True)). The serial model runs on hsgd.model.ops, the tuned kernels
the models use (its default, hsgd.model.layers, is the plain reference). Prints a markdown table and writes
benchmarks/results/serial.json.
"""
import argparse
import json
import os
import platform
import sys
import time

from hsgd.model.config import ModelConfig   # before NumPy: hsgd sets how OpenBLAS threads wait (see hsgd/__init__.py)
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from hsgd.model import ops, serial
from hsgd.model.ops import cross_entropy_backward, cross_entropy_forward
from hsgd.model.optim import SGD
from hsgd.model.threads import set_cpu_threads, tune_allocator


def alternating(steps, rounds, block):
    """{name: [seconds of each counted call]}: `rounds` times, each function of `steps` in turn called `block` times
    in a row, the first call of each block not counted (it pays for the other's threads and caches)."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, f in steps.items():
            f()                                                        # not counted: the other's threads
            for _ in range(block - 1):
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
    return times


def matmul_rate(n=2048, repeats=5, dtype=np.float32):
    """Best FLOP/s of an n x n x n float32 matmul into a preallocated output."""
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), dtype=dtype), rng.random((n, n), dtype=dtype)
    c = np.empty((n, n), dtype=dtype)
    np.matmul(a, b, out=c)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def time_step(cfg, batch_size, repeats):
    """Best time of each phase of one training step over `repeats` steps (after one warm-up step)."""
    params = serial.init_params(cfg, seed=0, dtype="float32")
    grads = serial.zeros_like_params(params)
    opt = SGD(lr=1e-4, momentum=0.9)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, cfg.vocab_size, (batch_size, cfg.seq_len))
    targets = rng.integers(0, cfg.vocab_size, (batch_size, cfg.seq_len))
    best = {"forward": np.inf, "backward": np.inf, "update": np.inf, "step": np.inf, "step, batch split": np.inf}
    for it in range(repeats + 1):
        t0 = time.perf_counter()
        for g in grads.values():
            g.fill(0)
        serial.loss_and_grads(params, idx, targets, cfg, grads=grads, split=True, ops=ops)   # slices on threads
        opt.step(params, grads)
        if it > 0:
            best["step, batch split"] = min(best["step, batch split"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        logits, caches = serial.forward(params, idx, cfg, ops)
        loss, c_ce = cross_entropy_forward(logits, targets)
        t1 = time.perf_counter()
        for g in grads.values():
            g.fill(0)
        serial.backward(cross_entropy_backward(1.0, c_ce), caches, grads, cfg, ops)
        t2 = time.perf_counter()
        opt.step(params, grads)
        t3 = time.perf_counter()
        del logits, caches, c_ce
        if it == 0:
            continue                                                  # warm-up
        for k, v in (("forward", t1 - t0), ("backward", t2 - t1), ("update", t3 - t2), ("step", t3 - t0)):
            best[k] = min(best[k], v)
    return best, float(loss)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = p.parse_args(argv)
    cfg = ModelConfig(vocab_size=256, seq_len=a.seq_len, d_model=a.d_model, n_heads=a.n_heads,
                           n_layers=a.n_layers, d_ff=a.d_ff)
    set_cpu_threads(a.threads)
    tune_allocator()
    with threadpool_limits(limits=a.threads):
        blas = [(i["internal_api"], i.get("architecture"), i["num_threads"]) for i in threadpool_info()]
        print(f"measuring: float32 matmul rate, then {a.repeats} + 1 training steps ...", file=sys.stderr)
        peak = matmul_rate()
        best, loss = time_step(cfg, a.batch_size, a.repeats)
    flops = cfg.step_flops(a.batch_size)
    achieved = flops / best["step, batch split"]
    achieved_rows = flops / best["step"]
    result = {
        "config": {"L": cfg.n_layers, "C": cfg.d_model, "NH": cfg.n_heads, "F": cfg.d_ff, "T": cfg.seq_len,
                   "V": cfg.vocab_size, "B": a.batch_size},
        "machine": {"cpus": os.cpu_count(), "threads": a.threads, "blas": blas, "processor": platform.processor()},
        "matmul_gflops": peak / 1e9, "step_gflop": flops / 1e9, "achieved_gflops": achieved / 1e9,
        "fraction_of_matmul": achieved / peak, "fraction_of_matmul_layers_split": achieved_rows / peak,
        "times_s": best, "loss": loss,
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "serial.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"\n## Serial training step (float32), L={cfg.n_layers} C={cfg.d_model} NH={cfg.n_heads} F={cfg.d_ff} "
          f"T={cfg.seq_len} B={a.batch_size}, {a.threads} BLAS threads ({blas[0][0] if blas else '?'})\n")
    print("| quantity | value |\n|---|---|")
    print(f"| float32 matmul rate (2048^3 GEMM) | {peak / 1e9:.1f} GFLOP/s |")
    print(f"| model FLOPs per step | {flops / 1e9:.2f} GFLOP |")
    for k in ("forward", "backward", "update", "step"):
        print(f"| {k} time, each layer split over the threads | {best[k] * 1e3:.1f} ms |")
    print(f"| fraction of matmul rate, each layer split over the threads | {100 * achieved_rows / peak:.1f} % |")
    print(f"| step time, the batch split over the threads | {best['step, batch split'] * 1e3:.1f} ms |")
    print(f"| achieved, the batch split over the threads | {achieved / 1e9:.1f} GFLOP/s |")
    print(f"| fraction of matmul rate, the batch split over the threads | {100 * achieved / peak:.1f} % |")
    print(f"\n(written to {os.path.join(os.path.relpath(a.out), 'serial.json')})")


if __name__ == "__main__":
    main()
