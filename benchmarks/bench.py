"""make bench: the trainer's own step measured side by side with PyTorch on this machine, and the per-rank memory and
bytes story.

    python benchmarks/bench.py [--quick]          (make bench; needs torch: pip install -e '.[bench]')

Writes benchmarks/results/bench.md (the tables) and bench.json (every number), and prints the tables:
  a. one training step (float32) of hsgd's trainer and of PyTorch eager on the CPU, the same model and weights
     (equal loss checked first), the same batch and thread count, for a small and a mid-size model: the time ratio
     hsgd / PyTorch (medians over alternating blocks of steps). What each side does in a step:
       hsgd     HybridTrainer.step on a one-rank grid (dp = pp = tp = 1), as `python -m hsgd.train` runs it: zero
                the flat gradient buffer; forward and backward with the batch split over the threads (ThreadedStage:
                each thread one slice of the sequences, one BLAS thread each, the slices' gradients added at the
                end); the step's one host copy (loss, non-finite count, the gradient's sums of squares for its
                norm); SGD with momentum 0.9 on the flat parameter buffer;
       PyTorch  zero_grad, the forward and backward of the same model (hsgd's specification written with PyTorch's
                fused CPU kernels, benchmarks/torch_gpt.py; each operation split over the threads), and
                torch.optim.SGD with momentum 0.9: the same update, v <- 0.9 v + g, w <- w - lr v;
  b. utilization of the matmul rate: the model FLOPs of the step (ModelConfig.step_flops) per second over the
     float32 matmul rate of this machine measured in the same run (NumPy's BLAS; PyTorch's own matmul rate is shown
     too). Not PaLM's MFU, whose denominator is the hardware's peak (appendix A of the course has both);
  c. data-parallel scaling: the same global batch on 1 rank and on 2 ranks (dp = 2, one thread each), the trainer
     and PyTorch DistributedDataParallel (gloo, on loopback) as the anchor;
  d. tensor parallelism: the trainer with tp = 2 on 2 ranks (one thread each) against the trainer on one rank with
     2 threads (ThreadedStage), and PyTorch eager on 2 threads as the anchor;
  e. per-rank memory (parameters, gradients, optimizer state, activations) for tp in {1, 2, 4, 8} and zero in
     {0, 1} on 8 ranks, against the formulas;
  f. communication bytes per step against the formulas (the ratio must be exactly 1);
  g. what memory savings cost in time: --recompute selective and full, --zero 3 and both, against the plain step,
     on 2 ranks (dp = 2, one thread each), alternating, with the bytes each moves;
  h. the pipeline schedules (gpipe, 1f1b, interleaved with 2 chunks, zb-h1) on 4 stages: step time and measured
     bubble, alternating, next to each schedule's equal-cost bubble (hsgd.pp.schedules);
  i. context parallelism on 4 ranks, T = 1024: cp = 4 with ring attention and with the all-gather of keys and
     values, against dp = 4 on the same batch, alternating; cp_comm's bytes and the activation bytes per rank
     against the formulas, and the attention scores each rank computed (hsgd.cp.split).
Timings are medians over repetitions, with the best next to them: how far apart the two are is the run-to-run
noise of this machine. Run it on an idle machine. benchmarks/compare_commits.py runs section a for two commits in
turn, to compare their hsgd / PyTorch ratios against that noise.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time


# before NumPy: hsgd sets how OpenBLAS threads wait (see hsgd/model/threads.py)
from hsgd.model.config import ModelConfig
import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_info, threadpool_limits

from hsgd.model import serial
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.step.settings import TrainConfig
from hsgd.model.threads import set_cpu_threads, tune_allocator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_serial import alternating, matmul_rate  # noqa: E402

# model, batch, rounds, steps per block (see compare_with_torch)
CONFIGS = {"small (the default training model)": (ModelConfig(256, 64, 128, 4, 4, 512), 16, 6, 6),
           "mid-size": (ModelConfig(256, 256, 512, 8, 4, 2048), 8, 4, 3)}
LR, MOMENTUM = 1e-4, 0.9                      # a tiny step: the weights barely move while they are timed


def one_rank_trainer(cfg, batch):
    """The trainer as `python -m hsgd.train` builds it on one process: a one-rank grid, SGD with momentum, float32,
    no warmup (the schedule's cosine runs over a million steps: the learning rate stays LR)."""
    tc = TrainConfig(tp=1, dp=1, steps=10 ** 6, batch_size=batch, dtype="float32", optimizer="sgd", lr=LR,
                     momentum=MOMENTUM, warmup=0)
    tc.validate()
    return HybridTrainer(cfg, ProcessGrid(MPI.COMM_SELF), tc)


def compare_with_torch(cfg, batch, rounds, block, threads):
    """Both libraries' steps on the same model, weights and batch (see the module docstring for what each does).
    Timed in alternating blocks (`rounds` blocks of `block` steps each), so that both see the same machine noise,
    and the first step of every block is not counted: each library leaves worker threads that spin for a while
    after it (PyTorch's OpenMP threads, for instance), and a step that starts under the other's spinning threads
    measures that, not itself. The caller sets hsgd's thread count (set_cpu_threads(threads))."""
    import torch

    from torch_gpt import loss_fn, momentum_sgd, to_torch
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))
    targets = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))
    trainer = one_rank_trainer(cfg, batch)
    tparams, ti, tt = to_torch(serial.init_params(cfg, 0, "float32")), torch.tensor(idx), torch.tensor(targets)
    opt = momentum_sgd(tparams, LR, MOMENTUM)
    theirs = float(loss_fn(tparams, ti, tt, cfg).detach())             # before any update
    with threadpool_limits(threads):
        ours = trainer.step(idx, targets, 1).loss                      # the loss before its first update
    if abs(ours - theirs) > 1e-4 * abs(theirs):
        raise SystemExit(f"the two models disagree: loss {ours} (hsgd) vs {theirs} (PyTorch)")

    def hsgd_step():
        trainer.step(idx, targets, 1)

    def torch_step():
        opt.zero_grad()
        loss_fn(tparams, ti, tt, cfg).backward()
        opt.step()

    with threadpool_limits(threads):
        times = alternating({"hsgd": hsgd_step, "torch": torch_step}, rounds, block)
    trainer.grid.free()
    return {"loss_hsgd": ours, "loss_torch": theirs, "hsgd_s": float(np.median(times["hsgd"])),
            "torch_s": float(np.median(times["torch"])), "hsgd_best_s": min(times["hsgd"]),
            "torch_best_s": min(times["torch"]), "torch_matmul_flops": torch_matmul_rate(),
            "stage": type(trainer.stage).__name__}


def torch_matmul_rate(n=2048, repeats=5):
    """FLOP/s of PyTorch's float32 n x n x n matmul (after one warm-up product)."""
    import torch
    x = torch.rand(n, n)
    torch.mm(x, x)
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.mm(x, x)
    return repeats * 2 * n ** 3 / (time.perf_counter() - t0)


def mpi(n, task, env=None):
    """Rank 0's JSON result of `mpiexec -n n bench_worker.py task`."""
    exe = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = ["timeout", "600", exe if os.path.exists(exe) else "mpiexec", "-n", str(n), sys.executable,
           os.path.join(HERE, "bench_worker.py"), task]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------------------
# The sections: each times its part, adds its numbers to res and its lines to md

def section_step(a, res, md, say):
    """a-b: the trainer's step against PyTorch's, and both utilizations of the matmul rate."""
    md += [f"## a-b. One training step (float32), hsgd's trainer vs PyTorch eager, {a.threads} threads", "",
           "| model | B x T | hsgd median (best) | PyTorch median (best) | hsgd / PyTorch | hsgd / matmul rate "
           "| PyTorch / matmul rate | equal loss |", "|---|---|---|---|---|---|---|---|"]
    res["serial"], peak = {}, res["matmul_flops"]
    for name, (cfg, batch, rounds, block) in CONFIGS.items():
        say(f"timing {name} ...")
        r = compare_with_torch(cfg, batch, 2 if a.quick else rounds, block, a.threads)
        flops = cfg.step_flops(batch)
        r.update(ratio=r["hsgd_s"] / r["torch_s"], ratio_best=r["hsgd_best_s"] / r["torch_best_s"], flops=flops,
                 mfu_hsgd=flops / r["hsgd_s"] / peak, mfu_torch=flops / r["torch_s"] / peak,
                 mfu_hsgd_best=flops / r["hsgd_best_s"] / peak, mfu_torch_best=flops / r["torch_best_s"] / peak)
        res["serial"][name] = r
        md.append(f"| {name}: L={cfg.n_layers} C={cfg.d_model} NH={cfg.n_heads} F={cfg.d_ff} | {batch} x "
                  f"{cfg.seq_len} | {r['hsgd_s'] * 1e3:.1f} ({r['hsgd_best_s'] * 1e3:.1f}) ms | "
                  f"{r['torch_s'] * 1e3:.1f} ({r['torch_best_s'] * 1e3:.1f}) ms | {r['ratio']:.2f} "
                  f"({r['ratio_best']:.2f}) | {100 * r['mfu_hsgd']:.0f}% ({100 * r['mfu_hsgd_best']:.0f}%) | "
                  f"{100 * r['mfu_torch']:.0f}% ({100 * r['mfu_torch_best']:.0f}%) | {r['loss_hsgd']:.5f} = "
                  f"{r['loss_torch']:.5f} |")
    md += ["", "hsgd: `HybridTrainer.step` on one rank (the batch split over the threads, SGD with momentum on the "
               "flat buffer, the step's norm and non-finite check); PyTorch: zero_grad, forward, backward, "
               "`torch.optim.SGD` with momentum. The ratio of the medians, and in parentheses of the bests: how far "
               "apart they are is the noise of this run.",
           "", f"Utilization of the matmul rate: model FLOPs per second / the float32 matmul rate measured in the "
               f"same run "
               f"({peak / 1e9:.0f} GFLOP/s with NumPy's BLAS; PyTorch's own matmul ran at "
               f"{res['serial']['mid-size']['torch_matmul_flops'] / 1e9:.0f} GFLOP/s)."]


def section_dp(a, res, md, say):
    """c: the same global batch on 1 and 2 ranks, the trainer and PyTorch DDP."""
    say("timing data-parallel scaling (hsgd and PyTorch DDP, 1 and 2 ranks) ...")
    runs = {(k, n): [] for k in ("dp", "ddp") for n in (1, 2)}
    for _ in range(1 if a.quick else 3):                                 # alternating runs see the same noise
        for k, n in runs:
            runs[k, n].append(mpi(n, k)["seconds"])
    dp = {k: {n: float(np.median(runs[k, n])) for n in (1, 2)} for k in ("dp", "ddp")}
    res["dp_scaling"] = dp
    res["dp_runs"] = {f"{k} {n}": v for (k, n), v in runs.items()}
    sc = ModelConfig(256, 128, 256, 8, 4, 1024)
    md += ["", "## c. Data-parallel scaling: the same global batch (16 x 128) on 1 and 2 ranks, 1 thread each", "",
           f"Model L={sc.n_layers} C={sc.d_model} NH={sc.n_heads} F={sc.d_ff}. Each time is the median of "
           f"{len(runs['dp', 1])} runs (alternating between the four; every run below), each run the median of 5 "
           "steps.", "", "| | 1 rank | 2 ranks | speedup | efficiency | runs, 1 rank / 2 ranks |",
           "|---|---|---|---|---|---|"]
    for k, label in (("dp", "hsgd's trainer (Allreduce over dp_comm)"), ("ddp", "PyTorch DDP (gloo)")):
        s = dp[k][1] / dp[k][2]
        spread = " / ".join(", ".join(f"{t * 1e3:.0f}" for t in runs[k, n]) for n in (1, 2))
        md.append(f"| {label} | {dp[k][1] * 1e3:.0f} ms | {dp[k][2] * 1e3:.0f} ms | {s:.2f}x | {50 * s:.0f}% | "
                  f"{spread} ms |")


def section_tp(a, res, md, say):
    """d: tp = 2 on 2 ranks against the trainer on one rank with 2 threads, and PyTorch on 2 threads."""
    say("timing tensor parallelism against the trainer on one rank with 2 threads ...")
    two = {"BENCH_THREADS": "2"}
    tp2, threaded2, torch2 = mpi(2, "tp")["seconds"], mpi(1, "threaded", two), mpi(1, "torch", two)["seconds"]
    t2 = threaded2["seconds"]
    res["tp_overhead"] = {"tp2_2ranks_s": tp2, "one_rank_2threads_s": t2, "torch_2threads_s": torch2,
                          "ratio": tp2 / t2, "one_rank_stage": threaded2["stage"]}
    md += ["", "## d. Tensor parallelism: tp = 2 on 2 ranks (1 thread each) vs one rank with 2 threads", "",
           f"Same model and batch as c, the trainer each time: tp = 2 {tp2 * 1e3:.0f} ms, one rank with 2 threads "
           f"({threaded2['stage']}) {t2 * 1e3:.0f} ms, ratio {tp2 / t2:.2f}; PyTorch eager on 2 threads "
           f"{torch2 * 1e3:.0f} ms (hsgd's one rank / PyTorch {t2 / torch2:.2f}). The tensor-parallel step does "
           "the same products on half the columns and adds two All-Reduces of (N, C) activations per block, forward "
           "and backward; the one-rank step splits the batch over its 2 threads and exchanges nothing."]


def section_memory(a, res, md, say):
    """e-f: per-rank memory and bytes per step on 8 ranks, against the formulas."""
    say("measuring memory and bytes on 8 ranks ...")
    mem = mpi(8, "memory")
    res["memory"] = mem
    c = mem["config"]
    md += ["", f"## e. Memory per rank (float32, bytes; measured = formula), L={c['L']} C={c['C']} NH={c['NH']} "
               f"F={c['F']} T={c['T']}, global batch {c['B']}, SGD with momentum, 8 ranks, dp = 8 / tp", "",
           "| tp | dp | zero | parameters | gradients | optimizer state | activations | all ranks = formula |",
           "|---|---|---|---|---|---|---|---|"]
    for r in mem["rows"]:
        md.append(f"| {r['tp']} | {r['dp']} | {r['zero']} | {r['params']:,} | {r['grads']:,} | {r['optimizer']:,} | "
                  f"{r['activations']:,} | {'yes' if r['all_ranks_match'] else 'NO'} |")
    md += ["", "## f. Communication per step and rank: measured bytes / formula", "",
           "| tp | zero | communicator operation: measured / formula |", "|---|---|---|"]
    for r in mem["rows"]:
        cells = ", ".join(f"{k} {m:,} / {f:,} = {m / f:.3f}" for k, (m, f) in r["comm"].items())
        md.append(f"| {r['tp']} | {r['zero']} | {cells} |")


def section_memcost(a, res, md, say):
    """g: the time cost of recomputation and of ZeRO-3 against the plain step."""
    say("timing recomputation and ZeRO-3 on 2 ranks ...")
    r = mpi(2, "memcost", {"BENCH_ROUNDS": "3" if a.quick else "7"})
    res["memcost"] = r
    base = r["seconds"]["none, zero 0"]
    md += ["", "## g. What memory costs in time: recomputation and ZeRO-3, dp = 2 ranks (1 thread each)", "",
           "Model and batch as c. Each variant's median step over alternating rounds (best in parentheses); bytes "
           "per rank and step on each communicator.", "",
           "| variant | step median (best) | / plain | bytes per step |", "|---|---|---|---|"]
    for name, t in r["seconds"].items():
        moved = ", ".join(f"{k} {v:,}" for k, v in sorted(r["bytes"][name].items()))
        md.append(f"| {name} | {t * 1e3:.0f} ({r['best'][name] * 1e3:.0f}) ms | {t / base:.2f} | {moved} |")
    md += ["", "Full recomputation runs every block's forward twice (about 4/3 of the step's matmul work when the "
               "backward costs twice the forward); selective recomputes only the attention's probabilities. "
               "ZeRO-3 All-Gathers every layer's parameters before its forward and again before its backward: 3 "
               "times the parameter bytes per step against the All-Reduce's 2 (by payload: Allgather 2 x, "
               "Reduce-Scatter 1 x the padded parameters)."]


def section_schedules(a, res, md, say):
    """h: the pipeline schedules on 4 stages, timed, with their measured bubbles."""
    say("timing the pipeline schedules on 4 stages ...")
    r = mpi(4, "schedules", {"BENCH_ROUNDS": "3" if a.quick else "7"})
    res["schedules"] = r
    base = r["seconds"]["1f1b"]
    md += ["", f"## h. Pipeline schedules: pp = {r['ranks']} stages (1 thread each), {r['micro_batches']} "
               f"micro-batches", "",
           "Model as c with 8 layers, global batch 4 pp x 128. Each schedule's median step over alternating rounds "
           "(best in parentheses), the bubble measured in those steps (1 - busy / (stages x span), from each "
           "stage's timeline; a median) and the equal-cost simulation's (hsgd.pp.schedules).", "",
           "| schedule | step median (best) | / 1f1b | bubble measured | bubble, equal costs |",
           "|---|---|---|---|---|"]
    for name, t in r["seconds"].items():
        md.append(f"| {name} | {t * 1e3:.0f} ({r['best'][name] * 1e3:.0f}) ms | {t / base:.2f} | "
                  f"{r['bubble'][name]:.3f} | {r['predicted'][name]:.3f} |")
    md += ["", "Four ranks share the cores of a small machine here: a stage that waits gives its core to another, "
               "so the measured bubble mixes the schedule's idle time with the machine's sharing. The equal-cost "
               "column is what the schedule itself leaves idle."]


def section_cp(a, res, md, say):
    """i: context parallelism on 4 ranks, ring against all-gather, with dp as the anchor."""
    say("timing context parallelism on 4 ranks ...")
    r = mpi(4, "cp", {"BENCH_ROUNDS": "3" if a.quick else "7"})
    res["cp"] = r
    base = r["seconds"]["dp (whole sequences)"]
    md += ["", f"## i. Context parallelism: {r['ranks']} ranks (1 thread each), T = {r['seq_len']}", "",
           "L=2 C=128 NH=4 F=512, global batch 4 x T. dp = 4 gives each rank whole sequences; cp = 4 gives each "
           "rank T/4 positions of every sequence (chunks r and 7-r of 8). Median step over alternating rounds (best "
           "in parentheses); cp_comm's bytes of one step measured and by hsgd.cp.split.cp_formula; the "
           "activation bytes one rank caches (hsgd.accounting.activations.activation_formula); the attention scores "
           "each rank computed in one forward of its 2 layers, per head and sequence (counted).", "",
           "| variant | step median (best) | / dp | cp_comm bytes (formula) | activation bytes per rank | scores "
           "per rank |", "|---|---|---|---|---|---|"]
    for name, t in r["seconds"].items():
        e = r[name]
        sent = ", ".join(f"{op} {b / 2**20:.1f} MiB" for op, b in sorted(e["cp_bytes"].items())) or "-"
        same = "equal" if e["cp_bytes"] == e["cp_formula"] else f"formula {e['cp_formula']}"
        scores = e["scores_per_rank"] if any(e["scores_per_rank"]) else "-"
        md.append(f"| {name} | {t * 1e3:.0f} ({r['best'][name] * 1e3:.0f}) ms | {t / base:.2f} | {sent} ({same}) | "
                  f"{e['activation_bytes'] / 2**20:.1f} MiB | {scores} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for the one-rank comparison")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    a = p.parse_args(argv)
    say = lambda s="": print(s, flush=True)
    set_cpu_threads(a.threads)                                           # as hsgd.train does for its ranks
    tune_allocator()
    res = {"machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                       "blas": [(i["internal_api"], i.get("architecture")) for i in threadpool_info()],
                       "python": platform.python_version(), "numpy": np.__version__}}
    with threadpool_limits(a.threads):
        res["matmul_flops"] = matmul_rate()
    say(f"float32 matmul rate (NumPy, {a.threads} threads): {res['matmul_flops'] / 1e9:.1f} GFLOP/s")
    md = []
    for section in (section_step, section_dp, section_tp, section_memory, section_memcost,
                    section_schedules, section_cp):
        section(a, res, md, say)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench.json"), "w") as f:
        json.dump(res, f, indent=1)
    text = "\n".join(md) + "\n"
    with open(os.path.join(a.out, "bench.md"), "w") as f:
        f.write(f"Machine: {res['machine']}\n\n" + text)
    say("\n" + text)
    say(f"(written to {os.path.relpath(os.path.join(a.out, 'bench.md'))} and bench.json)")


if __name__ == "__main__":
    main()
