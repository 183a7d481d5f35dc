"""Training on the dp x pp x tp grid:  mpirun -n 8 python -m hsgd.train  (--help for every flag)

P = dp x pp x tp ranks; by default pp = 1, tp = 2 and dp = P / tp. Each step is the lecture's synchronous
mini-batch SGD on the global batch (hsgd/hybrid.py): every DP group computes its slice's gradients, the tensor-
parallel model inside each pipeline stage (hsgd/tp_model.py, hsgd/pp.py), the ranks holding the same shard
average it over dp_comm, and every rank updates its shards. One process (`python -m hsgd.train`) is the special
case dp = pp = tp = 1.

Rank 0 prints a header, the rank layout, a progress line every few steps (loss, learning rate, tokens/s, ETA,
and the step time split into compute / TP communication / DP communication), the validation loss at intervals,
a summary (validation loss before -> after, bytes per step on each communicator against the formula, the
pipeline's measured schedule, memory per rank, wall time) and a generated sample. The settings are in
hsgd/settings.py (flags and `--config FILE.toml`).
"""
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import replace

from mpi4py import MPI
from threadpoolctl import threadpool_limits

from . import checkpoint, launch
from .backend import resolve_device, select_gpu, set_cpu_threads, tune_allocator
from .data import Corpus
from .errors import NumericalFault
from .generate import generate, printable
from .grid import ProcessGrid
from .hybrid import HybridTrainer
from .plots import write_plots
from .pp import ideal_bubble, parse_split, split_layers
from .report import describe_dp, fmt_bytes, fmt_time, report_pipeline, step_formula
from .settings import TrainConfig, build_parser, configs_from_args
from .trace import Tracer

__all__ = ["TrainConfig", "train", "main", "build_parser", "configs_from_args", "step_formula"]


def local_ranks(world):
    """(this rank's index among the job's ranks on this machine, how many there are)."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    rank, n = node.Get_rank(), node.Get_size()
    node.Free()
    return rank, n


def place_on_device(tc, world):
    """"cpu", or for --device gpu: use the GPU of this node-local rank (ranks share GPUs when there are more
    ranks than GPUs) and say how buffers reach MPI. Returns a description for the header."""
    if resolve_device(tc.device) == "cpu":
        return "cpu (NumPy)"
    from .comm import cuda_aware_mpi
    local, _ = local_ranks(world)
    gpu, n_gpus = launch.agree(world, lambda: select_gpu(local))
    set_cpu_threads(1)                                               # the GPU does the elementwise work
    path = "CUDA-aware MPI: device buffers to MPI" if cuda_aware_mpi() else \
        "MPI not CUDA-aware: buffers staged through host memory"
    import cupy
    return (f"gpu (CuPy {cupy.__version__}), {n_gpus} GPU(s) on this node, rank 0 on GPU {gpu}; {path} "
            "(HSGD_CUDA_AWARE=0|1 overrides)")


def train(cfg, tc, world=MPI.COMM_WORLD, out=sys.stdout):
    """Train on `world` (every rank calls this); returns a summary dict on every rank."""
    tc = replace(tc)
    tc.validate()
    tc.resolve_layout(world.Get_size())
    threads = tc.threads or max(1, (os.cpu_count() or 1) // local_ranks(world)[1])
    set_cpu_threads(threads)                                         # BLAS and the elementwise layers alike
    tune_allocator()
    with threadpool_limits(limits=threads):
        return _train(cfg, tc, world, out, threads)


def staging_pools(grid, trainer):
    """The pinned host-buffer pools of this rank's communicators (used only to stage device arrays)."""
    comms = [grid.world, grid.tp_comm, grid.dp_comm, grid.pp_comm]
    if trainer.hier:
        comms += [trainer.hier.node_comm, trainer.hier.cross_comm]
    return [c.staging for c in comms]


def _train(cfg, tc, world, out, threads):
    rank0 = world.Get_rank() == 0
    say = (lambda s="": print(s, file=out, flush=True)) if rank0 else (lambda s="": None)
    device = place_on_device(tc, world)
    corpus = launch.agree(world, lambda: Corpus.load(tc.data, cfg.seq_len))
    grid = ProcessGrid(world, dp=tc.dp, pp=tc.pp, tp=tc.tp)
    tracer = Tracer(world.Get_rank(), world, enabled=False) if (tc.trace or tc.plot) else None
    trainer = launch.agree(world, lambda: HybridTrainer(cfg, grid, tc, tracer))
    if tracer:
        for c in (grid.tp_comm, grid.dp_comm, grid.pp_comm, grid.world) + ((trainer.hier.node_comm,
                                                                           trainer.hier.cross_comm)
                                                              if trainer.hier else ()):
            c.tracer = tracer
    traced = (min(2, tc.steps), min(4, tc.steps))                   # the steps the trace and timeline show
    table = grid.layout_table()
    fault = parse_fault(tc.inject_fault)
    start = resume(trainer, cfg, tc, world, say)                     # 1, or the step after the checkpoint

    n_local = sum(p.size for p in trainer.params.values())
    tokens = tc.batch_size * cfg.seq_len
    say(f"hsgd | {world.Get_size()} ranks = dp {grid.dp} x pp {grid.pp} x tp {grid.tp} ({tc.tp_scheme}) | "
        f"{tc.dtype} | {threads} CPU thread(s) per rank")
    say(f"device: {device}")
    say(f"model: {cfg.n_params():,} parameters (L={cfg.n_layers} C={cfg.d_model} NH={cfg.n_heads} F={cfg.d_ff} "
        f"T={cfg.seq_len} V={cfg.vocab_size}); {n_local:,} on each rank (incl. vocab padding)")
    say(f"data:  {corpus.describe()}")
    say(f"batch: global {tc.batch_size} x {cfg.seq_len} = {tokens:,} tokens/step; per DP group "
        f"{tc.batch_size // grid.dp} sequences in {tc.grad_accum} micro-batch(es)")
    say(f"optim: {tc.optimizer} lr={tc.lr} warmup={tc.warmup} cosine to lr/10"
        + (f" momentum={tc.momentum}" if tc.optimizer == "sgd" else "")
        + f" weight_decay={tc.weight_decay} clip={tc.clip or 'off'} | {tc.steps} steps")
    if grid.pp > 1:
        layers = [len(r) for r in split_layers(cfg.n_layers, grid.pp, parse_split(tc.pp_split))]
        say(f"pipeline: {grid.pp} stages with {layers} blocks, {tc.schedule}, {tc.grad_accum} micro-batches of "
            f"{tc.batch_size // grid.dp // tc.grad_accum} sequences; ideal bubble (p-1)/(m+p-1) = "
            f"{ideal_bubble(tc.grad_accum, grid.pp):.3f}")
    say(f"dp exchange: {describe_dp(trainer)}" + (f" | straggler: rank {tc.straggler.split(':')[0]} sleeps "
                                                   f"{tc.straggler.split(':')[1]} ms per step" if tc.straggler else ""))
    say("layout:\n" + table)
    val0 = trainer.evaluate(corpus, tc.eval_batches, tc.batch_size)
    say(f"val loss {val0:.4f} before training (uniform guess: {math.log(cfg.vocab_size):.4f})")

    log = open(tc.log_json, "w") if (tc.log_json and rank0) else None
    t_start = time.perf_counter()
    window = {"n": 0, "loss": 0.0, "s": 0.0, "tp": 0.0, "dp": 0.0}
    losses, per_step, val_points = [], {}, [(start - 1, val0)]
    pinned_first = sum(st.allocated for st in staging_pools(grid, trainer))     # staging buffers after step `start`
    measured_step = min(start + 1, tc.steps)  # bytes of one step, the same every step (staleness' first: none)
    for step in range(start, tc.steps + 1):
        kind = fault[2] if fault and fault[:2] == (world.Get_rank(), step) else None
        if kind == "raise":
            raise RuntimeError(f"fault injected on rank {world.Get_rank()} at step {step} (--inject-fault)")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)                         # no cleanup, no message: a dead rank
        idx, targets = corpus.batch(tc.seed, step, tc.batch_size)
        before = grid.stats.counts()
        if tracer:
            tracer.enabled = traced[0] <= step <= traced[1]
        with (tracer.span(f"step {step}") if tracer else nullcontext()):
            info = trainer.step(idx, targets, step, poison=kind == "nan")
        if step == start:
            pinned_first = sum(st.allocated for st in staging_pools(grid, trainer))
        if step == measured_step:
            per_step = grid.stats.since(before)                          # this step's traffic, nothing else
        if kind == "diverge":
            trainer.params[trainer.order[-1]].reshape(-1)[0] += 1e-3     # this replica alone drifts away
        if tc.check_replicas and step % tc.check_replicas == 0:
            check_replicas(trainer, world, step)
        if tc.save_dir and ((tc.save_interval and step % tc.save_interval == 0) or step == tc.steps):
            path = checkpoint.save(trainer, step, tc.save_dir, tc.keep, kill_in_save=kind == "kill-in-save")
            say(f"checkpoint after step {step}: {path}")
        losses.append(info.loss)
        for k, v in (("n", 1), ("loss", info.loss), ("s", info.seconds), ("tp", info.tp_seconds),
                     ("dp", info.dp_seconds)):
            window[k] += v
        if log:
            log.write(json.dumps({"step": step, "loss": info.loss, "lr": info.lr, "grad_norm": info.grad_norm,
                                  "seconds": info.seconds, "tp_seconds": info.tp_seconds,
                                  "dp_seconds": info.dp_seconds}) + "\n")
        if step % tc.log_interval == 0 or step == tc.steps:
            w, elapsed = window, time.perf_counter() - t_start
            comp = w["s"] - w["tp"] - w["dp"]
            say(f"step {step:>{len(str(tc.steps))}}/{tc.steps} | loss {w['loss'] / w['n']:.4f} | lr {info.lr:.2e} | "
                f"{w['n'] * tokens / w['s']:,.0f} tok/s | "
                f"ETA {fmt_time(elapsed / (step - start + 1) * (tc.steps - step))} | "
                f"step {1e3 * w['s'] / w['n']:.0f} ms = compute {1e3 * comp / w['n']:.0f} + "
                f"tp {1e3 * w['tp'] / w['n']:.0f} + dp {1e3 * w['dp'] / w['n']:.0f}")
            window = dict.fromkeys(window, 0.0)
        if tc.eval_interval and step % tc.eval_interval == 0 and step != tc.steps:
            val_points.append((step, trainer.evaluate(corpus, tc.eval_batches, tc.batch_size)))
            say(f"val loss {val_points[-1][1]:.4f} at step {step}")
    trainer.finish()
    wall = time.perf_counter() - t_start
    if log:
        log.close()
    val1 = trainer.evaluate(corpus, tc.eval_batches, tc.batch_size)
    n_steps = tc.steps - start + 1
    say(f"val loss {val0:.4f} -> {val1:.4f} after {n_steps} steps in {fmt_time(wall)} "
        f"({n_steps * tokens / max(wall, 1e-9):,.0f} tok/s)"
        + (f"; {trainer.skipped} update(s) skipped for non-finite values (--on-nan skip)" if trainer.skipped else ""))
    val_points.append((tc.steps, val1))
    formula = step_formula(cfg, tc, trainer)
    # every stage's first rank reports its own measurement and formula (the stages differ)
    reports = world.gather((grid.pp_rank, per_step, formula) if grid.dp_rank == 0 and grid.tp_rank == 0 else None)
    sizes = {"tp": grid.tp, "dp": grid.dp, "pp": grid.pp}
    for stage, measured, expected in sorted(r for r in (reports or []) if r):
        say(f"communication per step on each rank{f' of stage {stage}' if grid.pp > 1 else ''}, step "
            f"{measured_step} (measured | formula):")
        for key in sorted(set(measured) | set(expected)):
            m, f = measured.get(key, (0, 0)), expected.get(key, (0, 0))
            say(f"  {key[0]:<4} {key[1]:<22} {m[0]:>4} calls {fmt_bytes(m[1]):>11} | {f[0]:>4} calls "
                f"{fmt_bytes(f[1]):>11}" + ("" if m == f else "   <- differs")
                + ("   (a 1-rank communicator: nothing moves)" if sizes.get(key[0]) == 1 else ""))
    if grid.pp > 1:
        report_pipeline(world, grid, tc, trainer, say)
    mem = trainer.memory()
    say(f"memory per rank: parameters {fmt_bytes(mem['params'])}, gradients {fmt_bytes(mem['grads'])}, "
        f"optimizer state {fmt_bytes(mem['optimizer'])}")
    pools = staging_pools(grid, trainer)
    later = world.allreduce(sum(st.allocated for st in pools) - pinned_first, op=MPI.MAX)     # every rank calls it
    held = sum(st.free_bytes for st in pools)
    if held or later:
        say(f"host staging (MPI not CUDA-aware): {sum(len(st.free) for st in pools)} pinned buffers, "
            f"{fmt_bytes(held)} on rank 0; allocated after step {start}, most on any rank: {later}")
    if tracer:
        events = tracer.write(world, tc.trace) if tc.trace else world.gather(tracer.chrome_events(), root=0)
        if rank0 and not tc.trace:
            events = [e for rank_events in events for e in rank_events]
        if tc.trace:
            say(f"trace of steps {traced[0]}-{traced[1]}, all ranks: {tc.trace} (open it at ui.perfetto.dev)")
        if tc.plot and rank0:
            window_of = [e for e in events if e.get("name") == f"step {traced[0]}"]
            t_range = (min(e["ts"] for e in window_of), max(e["ts"] + e["dur"] for e in window_of)) \
                if window_of else None
            paths = write_plots(tc.plot, losses, val_points, events, t_range,
                                f"dp {grid.dp} x tp {grid.tp}, {describe_dp(trainer)}")
            say("plots: " + ", ".join(paths))
    full = trainer.full_params() if tc.sample_bytes else None
    if tc.sample_bytes and rank0:
        say("sample:\n" + printable(generate(full, cfg, tc.prompt.encode(), tc.sample_bytes, seed=tc.seed)))
    summary = {"val_before": val0, "val_after": val1, "losses": losses, "wall_s": wall, "comm_per_step": per_step,
               "comm_formula": formula, "params": trainer.params, "memory": mem}
    trainer.free()
    grid.free()
    return summary


def parse_fault(text):
    """'3:5' -> (3, 5, 'raise'); '3:5:kill' -> (3, 5, 'kill'); None -> None."""
    if not text:
        return None
    parts = text.split(":")
    return int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "raise"


def resume(trainer, cfg, tc, world, say):
    """Load --resume's checkpoint (checked on every rank first). Returns the first step to run."""
    if not tc.resume:
        return 1
    if tc.resume == "auto" and not checkpoint.complete_checkpoints(tc.save_dir):
        say(f"--resume auto: no complete checkpoint in {tc.save_dir!r}; starting at step 1")
        return 1
    where = tc.save_dir if tc.resume == "auto" else tc.resume
    manifest = launch.agree(world, lambda: checkpoint.open_checkpoint(where, cfg))
    step = launch.agree(world, lambda: checkpoint.load(trainer, manifest))
    lay, g = manifest["layout"], trainer.grid
    say(f"resumed from {manifest['path']} after step {step} (saved as dp {lay['dp']} x pp {lay['pp']} x tp "
        f"{lay['tp']} {lay['tp_scheme']}; now dp {g.dp} x pp {g.pp} x tp {g.tp} {trainer.scheme})")
    return step + 1


def check_replicas(trainer, world, step):
    """Stop (exit 3) if any DP group's replicas hold different parameters, naming the first that differs."""
    found = world.allgather(trainer.replica_divergence())
    for r, d in enumerate(found):
        if d:
            raise NumericalFault(f"data-parallel replicas diverged by step {step}: the first parameter that differs is "
                                 f"{d[0]} (dp ranks holding each version: {d[1]}, seen by world rank {r}); "
                                 "resume from the last checkpoint")


def main(argv=None):
    world = MPI.COMM_WORLD

    def body():
        args = build_parser().parse_args(argv)
        cfg, tc = launch.agree(world, lambda: configs_from_args(args, world.Get_size()))
        train(cfg, tc, world)

    return launch.run(body, world)


if __name__ == "__main__":
    sys.exit(main())
