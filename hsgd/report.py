"""What rank 0 prints about a run: byte formulas per step, the pipeline's measured schedule, sizes and times."""
from . import tp_model
from .pp import bubble_fraction, ideal_bubble, peak_in_flight, picture, pp_formula, schedule, simulate


def fmt_time(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def step_formula(cfg, tc, trainer):
    """{(comm, op): (calls, bytes)} this rank should see in one training step, from the closed forms."""
    grid, per_mb = trainer.grid, tc.batch_size // trainer.grid.dp // tc.grad_accum
    stage = (len(trainer.layers), trainer.first, trainer.last) if grid.pp > 1 else None
    f = tp_model.comm_formula(cfg, per_mb, trainer.pbuf.flat.itemsize, tc.tp_scheme, stage=stage)
    f = {k: (v[0] * tc.grad_accum, v[1] * tc.grad_accum) for k, v in f.items()}
    if grid.pp > 1:
        f.update(pp_formula(per_mb, cfg, tc.grad_accum, trainer.first, trainer.last, trainer.pbuf.flat.itemsize))
    f.update(trainer.dp_comm_formula())
    return f


def report_pipeline(world, grid, tc, trainer, say):
    """The last step's measured schedule: a text picture, the bubble fraction and the micro-batches held."""
    mine = (grid.pp_rank, trainer.timeline, trainer.peak_held) if grid.dp_rank == 0 and grid.tp_rank == 0 else None
    stages = sorted(r for r in (world.gather(mine) or []) if r)
    if not stages:
        return
    timeline = [t for _, t, _ in stages]
    m, p = tc.grad_accum, grid.pp
    ideal = simulate(tc.schedule, m, p)
    say(f"pipeline schedule of the last step, measured ({tc.schedule}, m={m}, p={p}; F = forward, B = backward of "
        "micro-batch j):\n" + picture(timeline))
    say(f"bubble fraction: measured {bubble_fraction(timeline):.3f} | equal-cost model {bubble_fraction(ideal):.3f} "
        f"| (p-1)/(m+p-1) = {ideal_bubble(m, p):.3f}")
    say("micro-batches held at once per stage: measured " + str([h for _, _, h in stages]) + " | schedule "
        + str([peak_in_flight(schedule(tc.schedule, tc.grad_accum, p, s)) for s in range(p)]))


def describe_dp(trainer):
    tc = trainer.tc
    if trainer.zero:
        return f"ZeRO stage {tc.zero} (Reduce_scatter_block + sharded optimizer + Allgather over dp_comm)"
    if tc.dp_overlap:
        return f"overlapped, {len(trainer.buckets)} buckets, one Iallreduce each during the backward pass"
    if trainer.hier:
        return (f"hierarchical: {trainer.hier.ranks_per_node} dp ranks per node x {trainer.hier.n_nodes} nodes "
                "(node Reduce_scatter_block, cross-node Allreduce, node Allgather)")
    if tc.dp_staleness:
        return "stale by one step: each step's Iallreduce completes during the next step, applied one step late"
    return "one Allreduce of all gradients after the backward pass"
