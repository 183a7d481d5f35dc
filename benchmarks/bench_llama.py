"""make bench: attention that stores no scores against materialized attention, and the Llama-family step against
PyTorch eager on the same model.

    python benchmarks/bench_llama.py [--threads N] [--quick] [--part attention|llama]
                                                       (make bench; needs torch: pip install -e '.[bench]')

Writes benchmarks/results/bench_llama.md (the tables) and bench_llama.json (every number), and prints the tables:
  a. causal attention, forward + backward of one layer (float32, B = 1, NH = 4, hs = 64, T = 1024 and 4096), in
     three ways with the same signatures: hsgd.model.flash (blocks of 64 queries and keys, the online softmax, the
     cache q, k, v, y and the log-sum-exp: O(B NH T) numbers beyond the inputs), hsgd.model.ops (the tuned
     materialized kernels: P (B, NH, T, T) cached, masked blocks skipped) and hsgd.model.layers (the plain
     formulas: P cached, every score computed). Time: the best forward + backward over alternating repetitions
     (the three take turns, so that all see the same machine noise; one untimed warm-up each). Memory, in a
     separate pass under tracemalloc (NumPy reports its arrays' buffers to it; tracing costs time, so the timed
     pass is untraced): the bytes the forward leaves allocated beyond its inputs and its output y (the cache, held
     until the backward), and the peak above the inputs during forward + backward (the temporaries, y, and dq,
     dk, dv included). B NH T^2 x 4 bytes, one float32 matrix of scores, is shown next to them;
  b. one step's forward and backward (the loss and every gradient) of a Llama-family model (arch="llama": RMSNorm,
     rotary positions, SwiGLU, NKV = NH/2, no biases), hsgd's serial model on its tuned kernels
     (serial.loss_and_grads(split=True, ops=hsgd.model.ops): the batch split over the threads, one BLAS thread
     each, as the trainer runs one rank) against the same model in PyTorch eager (benchmarks/torch_llama.py), the
     same weights, batch and thread count (torch.set_num_threads and OpenBLAS's limit both --threads). First the
     two losses and all gradients are compared (they must agree to float32 rounding), then the two are timed in
     alternating blocks of steps, the first step of every block not counted (the other library's threads may
     still be spinning). Medians, with the best in parentheses: how far apart they are is the noise of the run.
Run it on an idle machine. The VM this was written on wanders by 5-15% from run to run.

Legend: B batch, T sequence, C d_model, NH query heads, NKV key/value heads, hs head size, F d_ff, L layers.
"""
import argparse
import json
import os
import platform
import sys
import time
import tracemalloc

# before NumPy: hsgd sets how OpenBLAS threads wait (see hsgd/model/threads.py)
from hsgd.model.config import ModelConfig
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from hsgd.model import flash, layers, ops, serial
from hsgd.model.threads import set_cpu_threads, tune_allocator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_serial import alternating  # noqa: E402

ATTENTION = {"flash": flash, "materialized, tuned (ops)": ops, "materialized, plain (layers)": layers}
ATT_B, ATT_NH, ATT_HS = 1, 4, 64
ATT_REPEATS = {1024: 5, 4096: 3}                     # timed repetitions per T (each after a warm-up)

# model, batch, rounds, steps per block
LLAMA = {"small": (ModelConfig(256, 64, 128, 4, 4, 512, arch="llama"), 16, 5, 6),
         "mid-size": (ModelConfig(256, 256, 512, 8, 4, 2048, arch="llama"), 8, 4, 3)}


# ----------------------------------------------------------------------------------------------------------------
# a. Attention: flash against materialized

def attention_inputs(T, seed=0):
    """q, k, v and dy, each (B, T, NH hs) float32, of order 1 (scores of order sqrt(hs) before the scaling)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((ATT_B, T, ATT_NH * ATT_HS), dtype=np.float32) for _ in range(4)]


def forward_backward(impl, q, k, v, dy):
    """Seconds of the forward and of the backward."""
    t0 = time.perf_counter()
    y, cache = impl.attention_forward(q, k, v, ATT_NH)
    t1 = time.perf_counter()
    impl.attention_backward(dy, cache)
    return t1 - t0, time.perf_counter() - t1


def traced_bytes(impl, q, k, v, dy):
    """(held, peak): bytes the forward leaves allocated beyond its inputs and y (its cache), and the peak above the
    inputs during forward + backward, by tracemalloc."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    y, cache = impl.attention_forward(q, k, v, ATT_NH)
    held = tracemalloc.get_traced_memory()[0] - base - y.nbytes
    grads = impl.attention_backward(dy, cache)
    peak = tracemalloc.get_traced_memory()[1] - base
    del y, cache, grads
    tracemalloc.stop()
    return held, peak


def section_attention(a, res, md, say):
    res["attention"] = rows = []
    for T in (1024, 4096):
        say(f"attention, T = {T}: timing flash and materialized, alternating ...")
        q, k, v, dy = attention_inputs(T)
        ref = None
        for name, impl in ATTENTION.items():                  # warm-up, and the same numbers from all three
            y, cache = impl.attention_forward(q, k, v, ATT_NH)
            dq = impl.attention_backward(dy, cache)[0]
            if ref is None:
                ref = (y, dq)
            err = max(float(np.abs(got - want).max() / np.abs(want).max()) for got, want in zip((y, dq), ref))
            if err > 1e-4:
                raise SystemExit(f"attention {name} differs from flash by {err:.1e} (relative) at T = {T}")
            del y, cache, dq
        best = {name: (np.inf, np.inf, np.inf) for name in ATTENTION}
        for _ in range(1 if a.quick else ATT_REPEATS[T]):
            for name, impl in ATTENTION.items():
                f, b = forward_backward(impl, q, k, v, dy)
                if f + b < best[name][2]:
                    best[name] = (f, b, f + b)
        for name, impl in ATTENTION.items():
            held, peak = traced_bytes(impl, q, k, v, dy)
            f, b, fb = best[name]
            rows.append({"T": T, "attention": name, "forward_s": f, "backward_s": b, "step_s": fb,
                         "cache_bytes": held, "peak_bytes": peak})
    md += [f"## a. Causal attention, forward + backward of one layer: float32, B = {ATT_B}, NH = {ATT_NH}, "
           f"hs = {ATT_HS}, {a.threads} threads", "",
           "| T | attention | forward + backward, best (forward + backward) | / flash | cache held between them "
           "| peak during them | one score matrix B NH T^2 x 4 |", "|---|---|---|---|---|---|---|"]
    MB = 2 ** 20
    for r in rows:
        fl = next(x for x in rows if x["T"] == r["T"] and x["attention"] == "flash")
        md.append(f"| {r['T']} | {r['attention']} | {r['step_s'] * 1e3:.0f} ms ({r['forward_s'] * 1e3:.0f} + "
                  f"{r['backward_s'] * 1e3:.0f}) | {r['step_s'] / fl['step_s']:.2f} | {r['cache_bytes'] / MB:.1f} MiB "
                  f"| {r['peak_bytes'] / MB:.1f} MiB | {ATT_B * ATT_NH * r['T'] ** 2 * 4 / MB:.0f} MiB |")
    reps = {T: 1 if a.quick else n for T, n in ATT_REPEATS.items()}
    md += ["", f"Best of {reps[1024]} (T = 1024) and {reps[4096]} (T = 4096) alternating repetitions. "
               "Bytes by tracemalloc, in a separate pass: the cache is what the forward leaves allocated beyond "
               "its inputs and y; the peak is above the inputs (q, k, v, dy) and includes y and dq, dk, dv. The "
               "plain layers' cache holds views of q, k, v, so P alone; flash keeps q / sqrt(hs), k, v by heads and "
               "the log-sum-exp, 3 B T C + B NH T numbers (and y). NumPy writes each block's temporaries to "
               "main memory: flash here shows the algorithm's memory bound, not a GPU kernel's speed."]


# ----------------------------------------------------------------------------------------------------------------
# b. The Llama step against PyTorch eager

def compare_with_torch(cfg, batch, rounds, block, threads):
    """Forward and backward of one step in both libraries on the same model, weights and batch; the losses and
    gradients checked equal first; then timed in alternating blocks (module docstring)."""
    import torch

    from torch_gpt import to_torch
    from torch_llama import loss_fn
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))
    targets = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))
    params = serial.init_params(cfg, 0, "float32")
    grads = serial.zeros_like_params(params)
    tparams, ti, tt = to_torch(params), torch.tensor(idx), torch.tensor(targets)
    cos, sin = (torch.tensor(t) for t in serial.rope_tables(cfg, cfg.seq_len, "float32"))

    def hsgd_step():
        for g in grads.values():
            g.fill(0)
        return serial.loss_and_grads(params, idx, targets, cfg, grads=grads, split=True, ops=ops)[0]

    def torch_step():
        for t in tparams.values():
            t.grad = None
        loss = loss_fn(tparams, ti, tt, cfg, cos, sin)
        loss.backward()
        return float(loss.detach())

    with threadpool_limits(threads):
        ours = hsgd_step()
    theirs = torch_step()
    grad_err = max(float(np.linalg.norm(grads[n] - t.grad.numpy()) / np.linalg.norm(t.grad.numpy()))
                   for n, t in tparams.items())
    if abs(ours - theirs) > 1e-5 * abs(theirs) or grad_err > 1e-4:
        raise SystemExit(f"the two models disagree: loss {ours} (hsgd) vs {theirs} (PyTorch), largest relative "
                         f"gradient difference {grad_err:.1e}")
    with threadpool_limits(threads):
        times = alternating({"hsgd": hsgd_step, "torch": torch_step}, rounds, block)
    return {"loss_hsgd": ours, "loss_torch": theirs, "grad_rel_err": grad_err,
            "hsgd_s": float(np.median(times["hsgd"])), "torch_s": float(np.median(times["torch"])),
            "hsgd_best_s": min(times["hsgd"]), "torch_best_s": min(times["torch"]), "steps": len(times["hsgd"])}


def section_llama(a, res, md, say):
    res["llama_step"] = {}
    md += ["", f"## b. One step's forward and backward of a Llama-family model (float32), hsgd vs PyTorch eager, "
               f"{a.threads} threads", "",
           "| model | B x T | hsgd median (best) | PyTorch median (best) | hsgd / PyTorch | loss hsgd = PyTorch "
           "| gradients, largest relative difference |", "|---|---|---|---|---|---|---|"]
    for name, (cfg, batch, rounds, block) in LLAMA.items():
        say(f"llama step, {name}: checking equal losses, then timing hsgd and PyTorch, alternating ...")
        r = compare_with_torch(cfg, batch, 2 if a.quick else rounds, block, a.threads)
        r["ratio"], r["ratio_best"] = r["hsgd_s"] / r["torch_s"], r["hsgd_best_s"] / r["torch_best_s"]
        res["llama_step"][name] = r
        md.append(f"| {name}: L={cfg.n_layers} C={cfg.d_model} NH={cfg.n_heads} NKV={cfg.n_kv_heads} "
                  f"F={cfg.d_ff} | {batch} x {cfg.seq_len} | {r['hsgd_s'] * 1e3:.1f} ({r['hsgd_best_s'] * 1e3:.1f})"
                  f" ms | {r['torch_s'] * 1e3:.1f} ({r['torch_best_s'] * 1e3:.1f}) ms | {r['ratio']:.2f} "
                  f"({r['ratio_best']:.2f}) | {r['loss_hsgd']:.6f} = {r['loss_torch']:.6f} | "
                  f"{r['grad_rel_err']:.1e} |")
    md += ["", "hsgd: the gradients zeroed, `serial.loss_and_grads(split=True, ops=hsgd.model.ops)` (the batch "
               "split over the threads, one BLAS thread each); PyTorch: the gradients dropped, forward, backward "
               "(benchmarks/torch_llama.py; its attention F.scaled_dot_product_attention). No optimizer update on "
               "either side. Gradient difference: the largest over parameters of |g_hsgd - g_torch| / |g_torch| "
               "(Frobenius norms)."]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both libraries")
    p.add_argument("--quick", action="store_true", help="one repetition of each measurement")
    p.add_argument("--part", choices=("all", "attention", "llama"), default="all", help="measure one section only")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    a = p.parse_args(argv)
    say = lambda s="": print(s, flush=True)
    set_cpu_threads(a.threads)
    tune_allocator()
    res = {"machine": {"cpus": os.cpu_count(), "threads": a.threads,
                       "processor": platform.processor() or platform.machine(),
                       "blas": [(i["internal_api"], i.get("architecture")) for i in threadpool_info()],
                       "python": platform.python_version(), "numpy": np.__version__}}
    md = []
    t0, load_start = time.perf_counter(), os.getloadavg()[0]
    if a.part in ("all", "attention"):
        with threadpool_limits(a.threads):
            section_attention(a, res, md, say)
    if a.part in ("all", "llama"):
        section_llama(a, res, md, say)
    res["seconds"] = time.perf_counter() - t0
    res["load_average_1min"] = {"start": load_start, "end": os.getloadavg()[0]}   # others' work on the cores
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_llama.json"), "w") as f:
        json.dump(res, f, indent=1)
    text = "\n".join(md) + "\n"
    with open(os.path.join(a.out, "bench_llama.md"), "w") as f:
        f.write(f"Machine: {res['machine']}; load average (1 min) {load_start:.1f} at the start, "
                f"{res['load_average_1min']['end']:.1f} at the end\n\n" + text)
    say("\n" + text)
    say(f"(written to {os.path.relpath(os.path.join(a.out, 'bench_llama.md'))} and bench_llama.json; "
        f"{res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
