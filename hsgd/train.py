"""Training on the dp x pp x cp x tp grid:  mpirun -n 8 python -m hsgd.train  (--help for every flag)

P = dp x pp x cp x tp ranks; by default pp = cp = 1, tp = 2 and dp = P / tp. Each step is the lecture's synchronous
mini-batch SGD on the global batch (hsgd/step/trainer.py): every DP group computes its slice's gradients with the
tensor-parallel model inside each pipeline stage (hsgd/tp/model.py, hsgd/pp/stage.py), the ranks holding the same shard
average it over dp_comm (hsgd/dp/exchange.py), and every rank updates its shards. One process
(`python -m hsgd.train`) is the special case dp = pp = tp = 1.

This file is the run's outline: `setup` (grid, data, trainer, a checkpoint to resume, the header), `loop` (the
steps), `summary` (validation loss before -> after, then hsgd/run/report.py's reports: bytes per step on each
communicator against the formula, the pipeline's measured schedule, memory per rank, staging buffers, trace and
plots, and a generated sample). Every collective phase runs inside the watchdog's `phase` (--step-timeout:
hsgd/run/watchdog.py); a run that diverged ends through hsgd/run/diverged.py. Progress lines and the --log-json
records: hsgd/run/progress.py; --inject-fault: hsgd/run/faults.py; the settings (flags and `--config FILE.toml`):
hsgd/step/settings.py.
"""
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

from mpi4py import MPI
from threadpoolctl import threadpool_limits

from hsgd.checkpoint import store as checkpoint
from hsgd.grid import launch
from hsgd.accounting import allocations
from hsgd.model.backend import resolve_device
from hsgd.grid.devices import local_ranks, place_on_device
from hsgd.accounting.traffic import step_formula
from hsgd.run.experts import RoutingLog
from hsgd.checkpoint.store import CheckpointError
from hsgd.model.data import Corpus, same_data
from hsgd.errors import ConfigError
from hsgd.run.faults import Faults
from hsgd.model.generate import generate, sample_text
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.run.preflight import check_memory, check_run
from hsgd.run.progress import Progress
from hsgd.run.report import fmt_time, header, report_end, staging_pools
from hsgd.run.diverged import check_replicas, save_last_finite
from hsgd.checkpoint.resume import resume
from hsgd.checkpoint.runs import choose_line, lock_folder
from hsgd.run.flags import build_parser, configs_from_args
from hsgd.run.signals import StopRequest, stop_after_signal
from hsgd.model.threads import set_cpu_threads, tune_allocator
from hsgd.grid.trace import Tracer
from hsgd.run.watchdog import REPORTS_S, Watchdog, checkpoint_limit, per_batch
from hsgd.step.health import Skipping

def train(cfg, tc, world=MPI.COMM_WORLD, out=sys.stdout):
    """Train on `world` (every rank calls this); returns a summary dict on every rank."""
    tc = replace(tc)
    tc.validate()
    tc.resolve_layout(world.Get_size())
    ranks_here = local_ranks(world)[1]
    threads = tc.threads or max(1, (os.cpu_count() or 1) // ranks_here)
    set_cpu_threads(threads)                                         # BLAS and the elementwise layers alike
    tune_allocator()
    with threadpool_limits(limits=threads):
        launch.agree(world, lambda: check_run(tc, ConfigError))      # outputs, optional modules: before any work
        launch.agree(world, lambda: check_memory(cfg, tc, ranks_here, ConfigError))   # sizes this machine holds
        lock = launch.agree(world, lambda: lock_folder(tc) if world.Get_rank() == 0 else None)   # (checkpoint.runs)
        faults = Faults(tc.inject_fault, world.Get_rank())
        try:
            with Watchdog(tc.step_timeout, world, faults.entering) as dog:   # --step-timeout: every collective phase
                run = setup(cfg, tc, world, out, threads, dog, faults)
                if run.start > tc.steps:
                    return nothing_to_do(run)
                loop(run)
                return summary(run)
        finally:
            if lock:
                lock.release()


def nothing_to_do(run):
    """A resumed run whose checkpoint is already at or past --steps: say so, train nothing, exit 0."""
    run.say(f"nothing to do: the checkpoint is after step {run.start - 1} and --steps is {run.tc.steps}; "
            "give a larger --steps to train further")
    run.progress.close()
    val = run.val_points[0][1]
    out = {"val_before": val, "val_after": val, "losses": [], "wall_s": 0.0, "comm_per_step": {},
           "comm_formula": {}, "params": run.trainer.exchange.full_params(), "memory": run.trainer.memory()}
    run.trainer.free()
    run.grid.free()
    return out


@dataclass
class Run:
    """What the pieces of one training run share."""
    cfg: object                     # ModelConfig
    tc: object                      # TrainConfig
    world: object                   # the mpi4py communicator of all ranks
    say: object                     # print on rank 0, nothing elsewhere
    grid: object = None             # ProcessGrid
    corpus: object = None           # Corpus: the batch of every step
    trainer: object = None          # HybridTrainer
    tracer: object = None           # Tracer, with --trace or --plot
    progress: object = None         # Progress: the progress lines and the --log-json records
    start: int = 1                  # the first step (after a checkpoint: the step after it)
    identity: dict = None           # {"line", "id", "started_from"} this run's checkpoints record (checkpoint.runs)
    val_points: list = field(default_factory=list)       # [(step, validation loss)]
    per_step: dict = field(default_factory=dict)         # one step's CommStats: {(comm, op): (calls, bytes)}
    formula: dict = field(default_factory=dict)          # ... and the closed forms of that step (its thread split)
    measured_step: int = 1          # the step per_step was measured in (staleness' first moves nothing)
    pinned: int = 0                 # staging buffers allocated by the end of the first step
    traced: tuple = (1, 1)          # the steps the trace and the timeline show
    wall: float = 0.0               # seconds in the training loop
    probe: object = None            # --memory: an allocations.MemoryProbe, tracing until the measured step
    memory: dict = None             # --memory: the probe's result for the measured step
    watchers: list = None           # what acts at the points of each step (step_watchers)
    dog: object = None              # the Watchdog of --step-timeout: `with run.dog.phase(...)` around collectives
    saved_step: int = None          # the step of the last checkpoint this run wrote
    routing: object = None          # with experts: the RoutingLog of every step (hsgd.run.experts)


def setup(cfg, tc, world, out, threads, dog, faults):
    """The grid, the data, the trainer (and a checkpoint to resume from), the header, the first validation loss."""
    say = (lambda s="": print(s, file=out, flush=True)) if world.Get_rank() == 0 else (lambda s="": None)
    run = Run(cfg, tc, world, say, dog=dog)
    run.watchers = step_watchers(cfg, tc, faults, say)
    device = place_on_device(tc, world)
    run.corpus = launch.agree(world, lambda: Corpus.load(tc.data, cfg.seq_len))
    launch.agree(world, lambda: same_data(world.allgather(run.corpus.fingerprint()), tc.data))
    run.grid = ProcessGrid(world, dp=tc.dp, pp=tc.pp, tp=tc.tp, cp=tc.cp, ep=tc.ep)
    run.tracer = Tracer(world.Get_rank(), world, enabled=False) if (tc.trace or tc.plot) else None
    run.routing = RoutingLog(cfg, world) if cfg.moe_experts else None
    if tc.memory:                                                    # traced from before the parameters exist
        run.probe = allocations.MemoryProbe(resolve_device(tc.device))
        run.probe.start()
    run.trainer = launch.agree(world, lambda: HybridTrainer(cfg, run.grid, tc, run.tracer))
    for c in [run.grid.tp_comm, run.grid.cp_comm, run.grid.dp_comm, run.grid.pp_comm, run.grid.world] + \
            run.trainer.exchange.comms():
        c.tracer = run.tracer
    with dog.phase("the checkpoint load of --resume", *checkpoint_limit(tc.step_timeout), kind="load", step=1) \
            if tc.resume else nullcontext():
        run.start, manifest = resume(run.trainer, cfg, tc, world, say)   # 1, or the step after the checkpoint
    if tc.dump_step and tc.dump_step[0] < run.start <= tc.steps:     # (every rank knows run.start: raised on all)
        raise ConfigError(f"--dump-step {tc.dump_step[0]}: the run resumes after step {run.start - 1}, so step "
                          f"{tc.dump_step[0]} is never run; give a step from {run.start} to {tc.steps}")
    identity = launch.agree(world, lambda: choose_line(tc, manifest) if world.Get_rank() == 0 else None)
    run.identity = world.bcast(identity, root=0)                     # line, run id, started from (hsgd.checkpoint.runs)
    header(run, device, threads)
    run.progress = Progress(tc, tc.batch_size * cfg.seq_len, run.start, say, world.Get_rank() == 0)
    with dog.phase(f"the validation before step {run.start}", *per_batch(tc.step_timeout, tc.eval_batches),
                   kind="validation", step=run.start):
        run.val_points = [(run.start - 1, run.trainer.evaluate(run.corpus, tc.eval_batches, tc.batch_size))]
    run.progress.validation(run.start - 1, run.val_points[0][1],
                            f"before training (uniform guess: {math.log(cfg.vocab_size):.4f})")
    return run


def loop(run):
    """The training loop: one synchronous SGD step after the other, and what happens at intervals."""
    tc, grid, trainer = run.tc, run.grid, run.trainer
    first = min(run.start + 1, tc.steps)                                   # traced: 3 steps after the first
    run.traced = (first, min(first + 2, tc.steps))
    run.measured_step, t0 = min(run.start + 1, tc.steps), time.perf_counter()
    run.pinned = sum(st.allocated for st in staging_pools(grid, trainer))   # (a resume past the last step: no step)
    with StopRequest() as stop:                                            # SIGTERM, SIGINT
        for step in range(run.start, tc.steps + 1):
            try:
                with run.dog.step(step):                                   # --step-timeout
                    info = one_step(run, step)
                    if run.routing:
                        run.routing.record(trainer)                        # (pickled, after the counted traffic)
                    stopping = stop.agreed(run.world)                      # one Allreduce, timed with the step
            except Skipping as e:                                          # on every rank: the run has diverged
                raise Skipping(f"{e}; {save_last_finite(run)}") from None
            run.progress.step(step, info)
            saved = at_intervals(run, step)
            if stopping:                                                   # every rank stops here
                stop_after_signal(run, step, stop.signum_agreed, saved)
    trainer.finish()
    if trainer.scaler.updates_applied == 0:                                # every update skipped: never exit 0
        raise Skipping(f"none of the {tc.steps - run.start + 1} update(s) of this run was applied (non-finite values "
                       f"at every step); {save_last_finite(run)}")
    run.wall = time.perf_counter() - t0
    if run.tracer:
        run.tracer.enabled = False                                         # the final validation is not traced


def step_watchers(cfg, tc, faults, say):
    """What acts at the points of a step besides the training itself (hsgd.run.watchers.StepWatcher), in order:
    --inject-fault (faults: hsgd.run.faults), --dump-step (hsgd.crosscheck.hsgd_dump)."""
    from hsgd.crosscheck.hsgd_dump import DumpStep
    return [faults] + ([DumpStep(*tc.dump_step, cfg, tc, say)] if tc.dump_step else [])


def one_step(run, step):
    """Step `step` (the lecture's steps 1-4) with its watchers (step_watchers); records the traffic of the
    measured step."""
    tc, grid, trainer, tracer = run.tc, run.grid, run.trainer, run.tracer
    idx, targets = run.corpus.batch(tc.seed, step, tc.batch_size)          # the global batch, on every rank
    for w in run.watchers:
        w.before_step(step, trainer, (idx, targets))
    before = grid.stats.counts()
    if tracer:
        tracer.enabled = run.traced[0] <= step <= run.traced[1]

    dumping = tc.dump_step and step == tc.dump_step[0]                     # (--dump-step: watched on its own)

    def steps_1_to_4():
        loss = trainer.gradients(idx, targets)                             # the lecture's steps 1-3
        with run.dog.phase(f"the --dump-step dump of step {step}", kind="dump", step=step) if dumping else \
                nullcontext():
            for w in run.watchers:
                w.after_gradients(trainer, step, loss)
        return trainer.update(loss, step)                                  # step 4

    measure = run.probe is not None and step == run.measured_step         # --memory: this step, sampled
    with (tracer.span(f"step {step}") if tracer else nullcontext()):
        info = allocations.traced_step(trainer, run.probe, steps_1_to_4) if measure else steps_1_to_4()
    if measure:
        run.memory = run.probe.result()
        run.probe.stop()                                                   # the rest of the run untraced
    for w in run.watchers:
        w.after_step(trainer, step)
    if step == run.start:
        run.pinned = sum(st.allocated for st in staging_pools(grid, trainer))
    if step == run.measured_step:                                          # this step's traffic, nothing else,
        run.per_step, run.formula = grid.stats.since(before), step_formula(run.cfg, tc, trainer)   # and its formula
    return info


def at_intervals(run, step):
    """--check-replicas, checkpoints (--save-interval and after the last step), validation (--eval-interval), each
    watched (--step-timeout). Returns the path of the checkpoint written, or None."""
    tc, trainer, path, dog = run.tc, run.trainer, None, run.dog
    if tc.check_replicas and step % tc.check_replicas == 0:
        check_replicas(trainer, run.world, step)
    if tc.save_dir and ((tc.save_interval and step % tc.save_interval == 0) or step == tc.steps):
        if trainer.scaler.in_a_row:             # a skipped step (--on-nan skip): keep the older, good checkpoints
            run.say(f"checkpoint after step {step} not written: the step's values were not finite (--on-nan skip)")
        else:
            try:
                cut = any(w.in_save(step) for w in run.watchers)
                with dog.phase(f"the checkpoint save after step {step}", *checkpoint_limit(tc.step_timeout),
                               kind="save", step=step):
                    path = checkpoint.save(trainer, step, tc.save_dir, tc.keep, kill_in_save=cut,
                                           identity=run.identity)
                run.saved_step = step
                run.say(f"checkpoint after step {step}: {path}")
            except CheckpointError as e:        # a full disk: every rank got it; retry at the next interval
                if step == tc.steps:
                    raise
                run.say(f"{e}; training goes on, the next save is tried at step "
                        f"{min(step + tc.save_interval, tc.steps)}")
    if tc.eval_interval and step % tc.eval_interval == 0 and step != tc.steps:
        with dog.phase(f"the validation after step {step}", *per_batch(tc.step_timeout, tc.eval_batches),
                       kind="validation", step=step):
            run.val_points.append((step, trainer.evaluate(run.corpus, tc.eval_batches, tc.batch_size)))
        run.progress.validation(step, run.val_points[-1][1])
    return path

def summary(run):
    """The end of a run: validation loss before -> after, the reports (hsgd.run.report), a sample; frees the grid."""
    cfg, tc, world, grid, trainer, say, dog = run.cfg, run.tc, run.world, run.grid, run.trainer, run.say, run.dog
    with dog.phase(f"the validation after step {tc.steps} (the last)", *per_batch(tc.step_timeout, tc.eval_batches),
                   kind="validation", step=tc.steps):
        val1 = trainer.evaluate(run.corpus, tc.eval_batches, tc.batch_size)
    n_steps, val0 = tc.steps - run.start + 1, run.val_points[0][1]
    say(f"val loss {val0:.4f} -> {val1:.4f} after {n_steps} steps in {fmt_time(run.wall)} "
        f"({n_steps * tc.batch_size * cfg.seq_len / max(run.wall, 1e-9):,.0f} tok/s)"
        + (f"; {trainer.scaler.updates_skipped} update(s) skipped for non-finite values"
           if trainer.scaler.updates_skipped else ""))
    run.val_points.append((tc.steps, val1))
    run.progress.write({"step": tc.steps, "val_loss": val1})
    run.progress.close()
    with dog.phase("the reports at the end of the run", tc.step_timeout + REPORTS_S,
                   f"--step-timeout {tc.step_timeout:g} s + {REPORTS_S:g} s"):
        mem = report_end(run)
    ending = ("the sample at the end of the run", f"--step-timeout {tc.step_timeout:g} s per sampled byte") \
        if tc.sample_bytes else ("the end of the run", None)                # and every rank's agreement that it is over
    with dog.phase(ending[0], tc.step_timeout * max(1, tc.sample_bytes), ending[1], kind="sample", step=tc.steps):
        full = trainer.full_params() if tc.sample_bytes else None
        if tc.sample_bytes and world.Get_rank() == 0:
            say("sample:\n" + sample_text(generate(full, cfg, tc.prompt.encode(), tc.sample_bytes, seed=tc.seed)))
        out = {"val_before": val0, "val_after": val1, "losses": run.progress.losses, "wall_s": run.wall,
               "comm_per_step": run.per_step, "comm_formula": run.formula, "params": trainer.exchange.full_params(),
               "memory": mem}
        world.Barrier()                     # every rank waits for rank 0's sample here, watched, not in launch.run
    trainer.free()
    grid.free()
    return out


def main(argv=None):
    world = MPI.COMM_WORLD

    def body():
        args = build_parser().parse_args(argv)
        cfg, tc = launch.agree(world, lambda: configs_from_args(args, world.Get_size()))
        train(cfg, tc, world)

    return launch.run(body, world)


if __name__ == "__main__":
    sys.exit(main())
