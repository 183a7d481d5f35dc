"""What rank 0 prints about a run: before training, its header (layout, device, model, data, batch, optimizer,
pipeline, exchange); at the end, bytes per step against the formulas, the pipeline's measured schedule, memory per
rank, the staging buffers of the GPU path, the trace and the plots. Every function at the end is collective (called
on every rank; only rank 0's `say` prints)."""
import math
import os

from mpi4py import MPI

from hsgd.accounting import step_memory
from hsgd.tp import model as tp_model
from hsgd.tp.schemes import make_scheme
from hsgd.model.threads import openblas_note
from hsgd.pp.chunks import chunk_layers, parse_split
from hsgd.pp.schedules import build, simulate
from hsgd.pp.timelines import FORMULA, PEAK_FORMULA, bubble_formula, bubble_fraction, peak_formula, peak_held, picture


def fmt_time(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def header(run, device, threads):
    """What rank 0 prints before training: layout, device, model, data, batch, optimizer, pipeline, exchange."""
    cfg, tc, grid, say, m = run.cfg, run.tc, run.grid, run.say, run.tc.micro_batches
    cp = f" x cp {grid.cp} ({tc.cp_scheme})" if grid.cp > 1 else ""
    say(f"hsgd | {run.world.Get_size()} ranks = dp {grid.dp} x pp {grid.pp}{cp} x tp {grid.tp} ({tc.tp_scheme}) | "
        f"{tc.dtype} | {threads} CPU thread(s) per rank")
    if openblas_note():
        say(openblas_note())
    say(f"device: {device}")
    say(f"model: {cfg.n_params():,} parameters (L={cfg.n_layers} C={cfg.d_model} NH={cfg.n_heads} F={cfg.d_ff} "
        f"T={cfg.seq_len} V={cfg.vocab_size}); {sum(map(math.prod, run.trainer.shard_shapes.values())):,} on each rank "
        "(incl. vocab padding)")
    say(f"block: {cfg.describe_family()}")
    say(f"data:  {run.corpus.describe()}")
    say(f"batch: global {tc.batch_size} x {cfg.seq_len} = {tc.batch_size * cfg.seq_len:,} tokens/step; per DP "
        f"group {tc.batch_size // grid.dp} sequences in {m} micro-batch(es)"
        + (f"; each cp rank holds {cfg.seq_len // grid.cp} positions of each (chunks r and {2 * grid.cp - 1}-r of "
           f"{2 * grid.cp}), gradients averaged over dp x cp = {grid.dp_comm.size} ranks" if grid.cp > 1 else ""))
    say(f"optim: {tc.optimizer} lr={tc.lr} warmup={tc.warmup} cosine to lr/10"
        + (f" momentum={tc.momentum}" if tc.optimizer == "sgd" else "")
        + f" weight_decay={tc.weight_decay} clip={tc.clip or 'off'} | {tc.steps} steps")
    if grid.pp > 1:
        v, pl = run.trainer.stage.v, run.trainer.stage.placement
        layers = [len(r) for r in chunk_layers(cfg.n_layers, grid.pp, pl.K // grid.pp, parse_split(tc.pp_split))]
        closed = bubble_formula(tc.schedule, m, grid.pp, v)
        where = {"loop": "chunk c of stage s = entry c*pp + s", "v": "stage s holds entries s and 2pp-1-s",
                 "dual": "stage s holds entries s and pp-1-s, each entry on two stages"}[pl.shape]
        say(f"pipeline: {grid.pp} stages with {layers} blocks" + (f" ({v} chunks per stage, {where})" if v > 1 else "")
            + f", {tc.schedule}, {m} micro-batches of "
            f"{tc.batch_size // grid.dp // m} sequences; equal-cost bubble {FORMULA[tc.schedule]} = "
            + (f"{closed:.3f}" if closed is not None else "n/a (outside where it holds: hsgd.pp.timelines)"))
    rank, ms = tc.straggler.split(":") if tc.straggler else (None, None)
    say(f"dp exchange: {run.trainer.exchange.sizes.describe()}"
        + (f" | straggler: rank {rank} sleeps {ms} ms per step" if tc.straggler else ""))
    say("layout:\n" + grid.layout_table())


def report_pipeline(world, grid, tc, trainer, say):
    """The last step's measured schedule: a text picture, the bubble fraction and the micro-batches held."""
    st = trainer.stage
    mine = (grid.pp_rank, st.timeline, st.peak_held) if grid.dp_comm.rank == 0 and grid.tp_rank == 0 else None
    stages = sorted(r for r in (world.gather(mine) or []) if r)
    if not stages:
        return
    timeline = [t for _, t, _ in stages]
    m, p, v = tc.micro_batches, grid.pp, st.v
    acts = build(tc.schedule, m, p, v)
    ideal, closed = simulate(acts, m, v, pl=st.placement), bubble_formula(tc.schedule, m, p, v)
    say(f"pipeline schedule of the last step, measured ({tc.schedule}, m={m}, p={p}" + (f", v={v}" if v > 1 else "")
        + "; F forward, B backward, W weight gradients of micro-batch j[.chunk], X a pair F&B):\n" + picture(timeline))
    say(f"bubble fraction: measured {bubble_fraction(timeline):.3f} | equal-cost model {bubble_fraction(ideal):.3f} "
        f"| {FORMULA[tc.schedule]} = " + (f"{closed:.3f}" if closed is not None else "n/a (outside where it holds)"))
    say("micro-batches held at once per stage: measured " + str([h for _, _, h in stages]) + " | schedule "
        + str([peak_held(a) for a in acts]) + f" | {PEAK_FORMULA[tc.schedule]} = "
        + str([peak_formula(tc.schedule, m, p, s, v) for s in range(p)]))


def report_comm(world, grid, measured_step, per_step, formula, say):
    """Bytes of one step on each communicator: measured (CommStats) next to the formula, for the first rank of
    every pipeline stage (the stages differ)."""
    reports = world.gather((grid.pp_rank, per_step, formula) if grid.dp_comm.rank == 0 and grid.tp_rank == 0 else None)
    sizes = {"tp": grid.tp, "dp": grid.dp_comm.size, "pp": grid.pp, "cp": grid.cp}
    for stage, measured, expected in sorted(r for r in (reports or []) if r):
        say(f"communication per step on each rank{f' of stage {stage}' if grid.pp > 1 else ''}, step "
            f"{measured_step} (measured | formula):")
        for key in sorted(set(measured) | set(expected)):
            m, f = measured.get(key, (0, 0)), expected.get(key, (0, 0))
            say(f"  {key[0]:<4} {key[1]:<22} {m[0]:>4} calls {fmt_bytes(m[1]):>11} | {f[0]:>4} calls "
                f"{fmt_bytes(f[1]):>11}" + ("" if m == f else "   <- differs")
                + ("   (a 1-rank communicator: nothing moves)" if sizes.get(key[0]) == 1 else ""))


# ZeRO's accounting of data-parallel traffic in units of the parameter bytes Psi: an All-Reduce is a Reduce-Scatter
# and an All-Gather, 2 Psi; each of those 1 Psi (a ring sends (p-1)/p of each per rank)
PSI_UNITS = {"Allreduce": 2, "Iallreduce": 2, "Allgather": 1, "Reduce_scatter_block": 1, "Ireduce_scatter_block": 1}


def dp_traffic(counts, comm_names):
    """The data-parallel traffic of one step in Psi-units: sum over the exchange's communicators of payload x
    PSI_UNITS (the cross-node Allreduce of hybrid sharding included)."""
    return sum(nbytes * PSI_UNITS.get(op, 0) for (comm, op), (_, nbytes) in counts.items() if comm in comm_names)


def report_traffic(world, grid, tc, trainer, per_step, say):
    """What memory savings cost in bytes, for the first rank of every stage: the dp traffic in units of this rank's
    padded parameter bytes Psi' (ZeRO 0 and 1: 2; ZeRO-2: m + 1; ZeRO-3: 3m, with m micro-batches: Rajbhandari
    et al. 2020's 2 Psi against 3 Psi at m = 1), and the tensor-parallel bytes that --recompute full repeats (every
    block's forward collectives once more), measured against the formulas."""
    ex, m = trainer.exchange, tc.micro_batches
    names = {grid.dp_comm.name} | {c.name for c in ex.comms()}
    psi = ex.sizes.size * trainer.dtype.itemsize
    row = None
    if grid.dp_comm.rank == 0 and grid.tp_rank == 0:
        st, rows = trainer.stage, tc.batch_size // grid.dp // m
        plain = dict(per_step)
        repeated = {}
        if tc.recompute == "full":
            for k, (calls, nbytes) in make_scheme(tc.tp_scheme).block_forward_formula(
                    trainer.cfg, rows, trainer.dtype.itemsize, grid.cp).items():
                repeated[k] = (m * len(st.layers) * calls, m * len(st.layers) * nbytes)
        base = {k: v for k, v in tp_model.comm_formula(trainer.cfg, rows, trainer.dtype.itemsize, tc.tp_scheme,
                                                        stage=(len(st.layers), st.first, st.last),
                                                        cp=grid.cp, tp=grid.tp).items()}
        extra = {k: plain.get(k, (0, 0))[1] - m * base.get(k, (0, 0))[1] for k in repeated}
        row = (grid.pp_rank, dp_traffic(per_step, names) / psi, dp_traffic(ex.sizes.formula(), names) / psi, repeated,
               extra, psi)
    rows = sorted(r for r in (world.gather(row) or []) if r)
    for stage, measured, formula, repeated, extra, psi in rows:
        say(f"stage {stage}: dp traffic {measured:.3f} Psi' per step (formula {formula:.3f}; Psi' = {fmt_bytes(psi)}, "
            f"this rank's padded parameters; {exchange_rule(tc)})")
        for (comm, op), (calls, nbytes) in repeated.items():
            say(f"stage {stage}: --recompute full repeats {calls} {op} on {comm}, {fmt_bytes(nbytes)} (measured "
                f"beyond the formula without recomputation: {fmt_bytes(extra[(comm, op)])})")


def exchange_rule(tc):
    m = tc.micro_batches
    if tc.hierarchical and not tc.zero:
        return "node Reduce-Scatter and All-Gather 2, plus 2/n for the cross-node All-Reduce of the 1/n chunk"
    return {0: "an All-Reduce: 2", 1: "Reduce-Scatter + All-Gather: 2", 2: f"m + 1 = {m + 1}",
            3: f"3m = {3 * m}"}[tc.zero] + (", plus 2/n for the cross-node All-Reduce of the 1/n chunk"
                                            if tc.zero >= 2 and tc.hierarchical else "") + (
        "; --fp8-allgather: the block linears' weights gathered at 1 byte a value, so less; FP8's scale "
        "Allreduces are in the measured bytes, not in this formula" if getattr(tc, "fp8_allgather", False) else "")


def report_memory(mem, say, world=None, grid=None, measured=None, formula=None, step=None):
    """Between steps: parameters, gradients, optimizer state (HybridTrainer.memory). With --memory (measured: this
    rank's hsgd.accounting.allocations result, formula: hsgd.accounting.step_memory.step_formula), collective: the
    measured step's peak per category next to the formula, one table per group of ranks whose numbers are the same."""
    say(f"memory per rank: parameters {fmt_bytes(mem['params'])}, gradients {fmt_bytes(mem['grads'])}, "
        f"optimizer state {fmt_bytes(mem['optimizer'])}")
    if world is None or measured is None:
        return
    row = ((grid.pp_rank, grid.tp_rank, grid.dp_rank, grid.cp_rank), measured["peak"], formula["peak"],
           measured["total"], formula["total"], measured["true_peak"], measured["at"])
    rows = world.gather((world.Get_rank(), row))
    if rows is None:
        return
    groups = {}
    for rank, r in rows:
        groups.setdefault(repr((r[1], r[2], r[3], r[4], r[6])), []).append((rank, r))
    tracker = "CuPy's memory pool, its total only" if "device" in measured["peak"] else "tracemalloc"
    say(f"memory by category, peak over step {step} (sampled at every group's forward and backward exit; "
        f"measured: {tracker}, unthreaded | formula: hsgd.accounting.step_memory):")
    for members in groups.values():
        r = members[0][1]
        cp = grid.cp > 1
        where = ", ".join(f"{rank} (pp {p} tp {t} dp {d}" + (f" cp {c})" if cp else ")")
                          for rank, ((p, t, d, c), *_) in members)
        say(f"  ranks {where}:")
        for cat in sorted(set(r[1]) | set(r[2]), key=memory_order):
            m, f = r[1].get(cat, 0), r[2].get(cat, 0)
            ratio = f"{m / f:6.3f}" if f else ("     -" if not m else "   inf")
            say(f"    {cat:<12} {fmt_bytes(m):>11} | {fmt_bytes(f):>11}  measured/formula {ratio}")
        say(f"    {'total':<12} {fmt_bytes(r[3]):>11} | {fmt_bytes(r[4]):>11}  at {r[6]}; tracker's true peak "
            f"{fmt_bytes(r[5])} (+{fmt_bytes(r[5] - r[3])} transient inside a group)")


def memory_order(cat):
    order = ("params", "grads", "optimizer", "activations", "comm", "recompute", "other", "device")
    return order.index(cat) if cat in order else len(order)


def staging_pools(grid, trainer):
    """The pinned host-buffer pools of this rank's communicators (used only to stage device arrays)."""
    comms = [grid.world, grid.tp_comm, grid.cp_comm, grid.dp_comm, grid.pp_comm, grid.ep_comm, grid.edp_comm] \
        + trainer.exchange.comms()
    return [c.staging for c in comms]


def report_staging(world, grid, trainer, allocated_first, start, say):
    """Pinned staging buffers held, and how many were allocated after the first step (the most on any rank)."""
    pools = staging_pools(grid, trainer)
    later = world.allreduce(sum(st.allocated for st in pools) - allocated_first, op=MPI.MAX)   # every rank
    held = sum(st.free_bytes for st in pools)
    if held or later:
        say(f"host staging (MPI not CUDA-aware): {sum(len(st.free) for st in pools)} pinned buffers, "
            f"{fmt_bytes(held)} on rank 0; allocated after step {start}, most on any rank: {later}")


def report_trace(world, tracer, tc, traced, losses, val_points, title, say):
    """--trace: every rank's events into one file; --plot: the loss curves and a timeline of one step."""
    from hsgd.run.plots import write_plots
    events = tracer.write(world, tc.trace) if tc.trace else world.gather(tracer.chrome_events(), root=0)
    if world.Get_rank() == 0 and not tc.trace:
        events = [e for rank_events in events for e in rank_events]
    if tc.trace:
        say(f"trace of steps {traced[0]}-{traced[1]}, all ranks: {tc.trace} (open it at ui.perfetto.dev)")
    if tc.plot and world.Get_rank() == 0:
        window = [e for e in events if e.get("name") == f"step {traced[0]}"]
        t_range = (min(e["ts"] for e in window), max(e["ts"] + e["dur"] for e in window)) if window else None
        paths = write_plots(tc.plot, losses, val_points, events, t_range, title, first_step=val_points[0][0] + 1)
        say("plots: " + ", ".join(paths))


def report_experts(run, say):
    """With experts: each MoE block's load per expert and drops over the run, the all-to-all bytes of the measured
    step against their formula, --plot's load.png (rank 0; hsgd.run.experts)."""
    from hsgd.run.experts import all_to_all_ratio
    for line in run.routing.summary():
        say(line)
    ratio = all_to_all_ratio(run.per_step, run.formula)
    if ratio is not None:
        say(f"  all-to-all on ep_comm, step {run.measured_step}: measured/formula = {ratio:.3f} (the formula from "
            f"that step's routing)")
    if run.tc.plot and run.world.Get_rank() == 0 and run.routing.steps:
        say("plots: " + run.routing.plot(run.tc.plot))


def report_end(run):
    """Rank 0 prints the reports of hsgd.run.report (collective): bytes per step against the formula, the pipeline,
    memory (returned: this rank's), staging buffers, trace and plots."""
    tc, world, grid, trainer, say = run.tc, run.world, run.grid, run.trainer, run.say
    report_comm(world, grid, run.measured_step, run.per_step, run.formula, say)
    report_traffic(world, grid, tc, trainer, run.per_step, say)
    if grid.pp > 1:
        report_pipeline(world, grid, tc, trainer, say)
    mem = trainer.memory()
    report_memory(mem, say, world, grid, run.memory, step_memory.step_formula(trainer) if run.memory else None,
                  run.measured_step)
    if run.memory and tc.plot:
        samples = world.gather((world.Get_rank(), run.memory["samples"]))
        if samples:
            from hsgd.run.plots import plot_memory
            say("plots: " + plot_memory(samples, os.path.join(tc.plot, "memory.png"),
                                        f"memory over step {run.measured_step} per rank, by category"))
    if run.routing:
        report_experts(run, say)
    report_staging(world, grid, trainer, run.pinned, run.start, say)
    if run.tracer:
        report_trace(world, run.tracer, tc, run.traced, run.progress.losses, run.val_points,
                     f"dp {grid.dp} x tp {grid.tp}, {trainer.exchange.sizes.describe()}", say)
    return mem
