"""The schedule lab: a pipeline schedule drawn, simulated and (under mpirun, with --run) executed and measured.

    python -m hsgd.schedule --pp 4 --micro-batches 8 --schedule interleaved --virtual-stages 2 [--costs 1,1,1]
                            [--plot schedule.png]
    mpirun -n 8 python -m hsgd.schedule --pp 4 --tp 2 --micro-batches 8 --schedule zb-h1 --run

Without --run nothing is trained (one process is enough; under mpirun rank 0 does it): the schedule's actions
(hsgd.pp.schedules), checked, are simulated with the relative costs of F, B and W per chunk action (--costs F,B,W,
each from 0.001 to 1000; a fused backward costs B + W) and printed as a grid (one row per stage, one column per time
slot), with the bubble (simulated, and its closed form), the (micro-batch, chunk) pairs and the activation bytes
each stage holds at its peak, and the bytes each stage sends on pp_comm per step. With --run, every rank trains
--steps steps of the model on the dp x pp x tp grid with that schedule and the last step is measured: the timeline
of every stage, the bubble as the time stages waited, and the bytes sent; the pairs and bytes held (what the caches
and the kept weight-gradient products reach) are measured in the step before (walking the caches after every action
takes time). Each is printed next to its prediction, for the list hsgd.pp.stage runs: zb-h1's as training builds it,
for equal costs (--costs then only changes the simulation it is compared with). One stage (pp = 1) runs 1F1B
whatever --schedule says. Before any work: the flags (one line and exit 2 on every rank for a bad one), --plot
created and removed, and the lab's stated maxima (LIMITS: pp 64, micro-batches 1024, virtual stages 16, layers
4096).

Activation bytes per (micro-batch, chunk), b sequences per micro-batch, s bytes per element (recompute none):
    from F to its backward: what the chunk's forward caches (hsgd.accounting.activations.activation_formula per
        block; the embedding's and the head's caches: hsgd.accounting.step_memory.pieces E and H)
    from a split B to its W: what the W products read, X and dY of every linear (hsgd.tp.wgrad) per block
        megatron, sequence: N s (4C + (4C + 2F)/tp);   gather: N s (3C + F + (5C + F)/tp) (its projections' dO are
        the local slices, copies);   the head N s (C + Vp)
"""
import math
import sys

from hsgd.model.config import MAX_SIZES, flag_names
from hsgd.errors import ConfigError
from hsgd.run.preflight import check_memory
from hsgd.files import needs_module, writable_file
from hsgd.run.flags import GROUPS, MODEL_FLAGS, configs_from_args, flags_parser
from hsgd.step.settings import Layout
from hsgd.pp.schedules import MAX_PIECES, build, chunk_count, effective, placement_of, simulate
from hsgd.pp.timelines import (FORMULA, PEAK_FORMULA, TABLE2, bubble_formula, bubble_fraction, grid, held_bytes,
                               idle_per_stage, most_idle, peak_formula, peak_held, picture, stage_idle, table2)

LAB_FLAGS = flag_names(Layout) + MODEL_FLAGS + ("batch_size", "seed", "dtype", "steps", "recompute")
LAB_DEFAULTS = dict(pp=4, micro_batches=8, batch_size=16, steps=3, dtype="float32")
# the lab's stated maxima (checked before any work): stages are the picture's rows, micro-batches and chunks its
# columns, and layers are listed per stage
LIMITS = {"--pp": 64, "--micro-batches": 1024, "--virtual-stages": 16, "--n-layers": MAX_SIZES["n_layers"]}
COSTS = (1e-3, 1e3)             # each relative cost F, B, W from 0.001 to 1000 (B and W may also be 0)


def build_parser():
    p = flags_parser(GROUPS, only=LAB_FLAGS, overrides=LAB_DEFAULTS, prog="python -m hsgd.schedule",
                     description="A pipeline schedule as a grid of actions per stage, its bubble and memory, predicted "
                                 "for the given costs; with --run under mpirun (P = dp x pp x tp ranks) also executed "
                                 "on the model and measured next to the prediction.")
    g = p.add_argument_group("the lab")
    g.add_argument("--costs", default="1,1,1", metavar="F,B,W[,F&B]",
                   help="relative cost of a forward, an input-gradient backward B and a weight-gradient pass W, "
                        f"per chunk action, each from {COSTS[0]:g} to {COSTS[1]:g} (B and W may be 0); a fused "
                        "backward costs B + W; F&B: an overlapped pair of a forward and a fused backward "
                        "(dualpipe, dualpipev), default F + B + W: no overlap (1,1,1)")
    g.add_argument("--plot", metavar="FILE.png", help="draw the timeline(s) to this file (off)")
    g.add_argument("--run", action="store_true", help="execute the schedule under mpirun and measure it (off)")
    p.epilog = ("The lab draws at most " + ", ".join(f"{flag} {high}" for flag, high in LIMITS.items())
                + f", and pp x virtual-stages x micro-batches at most {MAX_PIECES} (hsgd.pp.schedules).")
    return p


def parse_costs(text):
    """(F, B, W) or (F, B, W, F&B) from --costs: finite numbers from COSTS[0] to COSTS[1], F > 0, B and W also 0;
    F&B (an overlapped pair's cost, DualPipe's) at least the larger of F and B + W."""
    try:
        costs = tuple(float(x) for x in text.split(","))
    except ValueError:
        costs = ()
    low, high = COSTS
    if len(costs) not in (3, 4) or costs[0] == 0 or not all(c == 0 or low <= c <= high for c in costs):
        raise ConfigError(f"costs={text[:60]!r} must be three numbers F,B,W, each from {low:g} to {high:g} (relative "
                          f"costs; B and W may be 0), e.g. 1,1,1 or 1,2,0, and for an overlapped pair F&B a fourth, "
                          "e.g. 1,1,1,2.5")
    if len(costs) == 4 and costs[3] < max(costs[0], costs[1] + costs[2]):
        raise ConfigError(f"costs={text[:60]!r}: an overlapped pair F&B = {costs[3]:g} cannot take less than its "
                          f"longer part, max(F, B+W) = {max(costs[0], costs[1] + costs[2]):g}")
    return costs


def check_sizes(args):
    """The sizes the lab's lists, simulation and picture grow with, against its stated maxima (LIMITS), before
    anything depends on them."""
    for flag, high in LIMITS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value > high:
            raise ConfigError(f"{flag} {value} is more than the schedule lab draws (at most {high}); give a smaller "
                              "number")


def check_plot(path):
    """--plot: matplotlib imports and the file can be written (created and removed), before any work."""
    if path:
        needs_module("matplotlib", "--plot", ConfigError)
        writable_file(path, "--plot", ConfigError)


def keep_bytes(cfg, b, s, tp, scheme, recompute, chunk, cp=1, cp_scheme="ring"):
    """(bytes from F to the backward, bytes from a split B to its W) of one micro-batch on one chunk (see the module
    docstring); chunk: (number of blocks, first, last); with context parallelism, of the rank's T/cp positions."""
    from hsgd.accounting.step_memory import pieces
    from hsgd.tp.schemes import make_scheme
    n, first, last = chunk
    pc, S, C, F = pieces(cfg, b, s, tp, scheme, recompute, cp, cp_scheme), make_scheme(scheme), cfg.d_model, cfg.d_ff
    N = b * (cfg.seq_len // cp)
    cache = n * pc["K"] + pc["E"] * first + pc["H"] * last
    per_block = N * s * ((3 * C + F + (5 * C + F) // tp) if S.gathers_proj_inputs else (4 * C + (4 * C + 2 * F) // tp))
    head = N * s * (C + -(-cfg.vocab_size // tp))
    return cache, n * per_block + head * last


class Plan:
    """The schedule of the flags, its simulation and its predicted quantities per stage."""

    def __init__(self, cfg, tc, costs, built_with=None):
        """built_with: the costs the list is built with (zb-h1 places its W's by them), default `costs`; --run
        passes (1, 1, 1), the costs hsgd.pp.stage builds with, so that the prediction is of the list that runs."""
        from hsgd.pp.chunks import parse_split, pp_formula, stage_chunks, stage_names
        from hsgd.tp.shards import shard_numel
        from hsgd.tp.model import stage_activation_shape                    # (the V's turn: one activation kept)
        self.cfg, self.tc, self.costs = cfg, tc, costs
        p, m, v = tc.pp, tc.micro_batches, chunk_count(tc.schedule, tc.virtual_stages)
        self.kind = effective(tc.schedule, p, v)                            # (one stage runs 1F1B)
        self.placement = pl = placement_of(self.kind, p, v)                 # which stage holds each piece
        self.actions = build(self.kind, m, p, v, (built_with or costs)[:3])
        self.timeline = simulate(self.actions, m, v, costs, pl)             # also the static check
        b, s, split = tc.batch_size // tc.dp // m, 8 if tc.dtype == "float64" else 4, parse_split(tc.pp_split)
        self.held = [peak_held(a) for a in self.actions]
        self.bytes, self.sent = [], []
        for st in range(p):
            chunks = [(len(layers), first, last)
                      for _, layers, first, last in stage_chunks(cfg.n_layers, p, st, v, split, pl)]
            kept = [keep_bytes(cfg, b, s, tc.tp, tc.tp_scheme, tc.recompute, ch, tc.cp, tc.cp_scheme) for ch in chunks]
            turn = pl.local_handoffs(st) * s * math.prod(stage_activation_shape(tc.tp_scheme, b, cfg, tc.tp, tc.cp))
            self.bytes.append(held_bytes(self.actions[st], [k[0] for k in kept], [k[1] for k in kept], turn))
            if pl.shape == "dual":                        # down and up, half each; the gradients to the twin stage
                names = [n for _, layers, first, last in stage_chunks(cfg.n_layers, p, st, v, split, pl)
                         for n in stage_names(cfg, layers, first, last)]
                f = pp_formula(b, cfg, m, st == 0, st == p - 1, s, tc.tp_scheme, tc.tp, 1, tc.cp,
                               twin=s * shard_numel(cfg, tc.tp, names, tc.tp_scheme))
            else:
                f = pp_formula(b, cfg, m, st == pl.stage(0), st == pl.stage(p * v - 1), s, tc.tp_scheme, tc.tp, v,
                               tc.cp, pl.local_handoffs(st))                # pieces 0 and pv-1, hand-offs to itself
            self.sent.append(f.get(("pp", "Isend"), (0, 0)))

    def report(self, say):
        tc, (f, b, w), p, m = self.tc, self.costs[:3], self.tc.pp, self.tc.micro_batches
        kind, v = self.kind, self.placement.v
        closed = bubble_formula(kind, m, p, v, self.costs)
        say(f"hsgd.schedule | {kind}" + (" (one stage runs 1F1B)" if kind != tc.schedule else "")
            + (f", v={v} chunks per stage" if v > 1 else "") + f" | p={p} stages, "
            f"m={m} micro-batches | costs per chunk action F={f:g} B={b:g} W={w:g} (fused backward B+W)"
            + (f" F&B={self.costs[3]:g}" if len(self.costs) > 3 else ""))
        say(grid(self.timeline))
        idle = idle_per_stage(self.timeline)
        say(f"bubble: simulated {bubble_fraction(self.timeline):.4f} of the step (idle {idle:g} time units per stage) "
            f"| closed form {FORMULA[kind]} = "
            + (f"{closed:.4f}" if closed is not None else "n/a (outside where it holds: hsgd.pp.timelines)"))
        if kind in TABLE2:
            t2, timeline, which = table2(kind, m, p, self.costs), self.timeline, ""
            if kind == "zb-h1" and tuple(self.costs[:3]) != (1.0, 1.0, 1.0):   # the table's list: built for equal costs
                timeline = simulate(build(kind, m, p, v), m, v, self.costs, self.placement)
                which = " (of the list built for equal costs, which training runs)"
            say(f"DeepSeek-V3 Table 2 (B a whole backward, here B+W; F&B an overlapped pair): idle of the least busy "
                f"stage simulated {most_idle(timeline):g}{which} | {TABLE2[kind]} = "
                + (f"{t2:g}" if t2 is not None else "n/a (it holds for F = B, W <= F, m >= 2p; hsgd.pp.timelines)"))
        if kind == "zb-v":
            say(f"zero-bubble papers' measure (a stage's own span minus its busy time, the longest): simulated "
                f"{stage_idle(self.timeline):g} (0 for F = B = W)")
        closed = [peak_formula(kind, m, p, s, v) for s in range(p)]
        say(f"held at the peak, per stage: (micro-batch, chunk) pairs {self.held} (closed form "
            f"{PEAK_FORMULA[kind]}: {closed}) | activation bytes {[human(x) for x in self.bytes]}")
        say(f"pp_comm per stage and step: messages sent {[c for c, _ in self.sent]}, bytes "
            f"{[human(x) for _, x in self.sent]}")


def human(n):
    from hsgd.run.report import fmt_bytes
    return fmt_bytes(n)


def measure(cfg, tc, plan, say, plot):
    """--run: tc.steps steps on the grid; the last one measured against the plan. Collective."""
    from mpi4py import MPI

    from hsgd.model.data import Corpus
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer
    world = MPI.COMM_WORLD
    corpus = Corpus.load(None, cfg.seq_len)
    g = ProcessGrid(world, dp=tc.dp, pp=tc.pp, tp=tc.tp, cp=tc.cp, ep=tc.ep)
    trainer = HybridTrainer(cfg, g, tc)
    held_bytes_measured = 0
    for step in range(1, tc.steps + 1):          # bytes measured one step before the timed one (walking the caches
        trainer.stage.measure_bytes = step == max(tc.steps - 1, 1)         # after every action takes time)
        before = g.stats.counts()
        trainer.step(*corpus.batch(tc.seed, step, tc.batch_size), step)
        if trainer.stage.measure_bytes:
            held_bytes_measured = trainer.stage.peak_bytes
    sent = g.stats.since(before).get(("pp", "Isend"), (0, 0))
    st = trainer.stage
    first = g.dp_comm.rank == 0 and g.tp_rank == 0
    mine = (g.pp_rank, st.timeline, st.peak_held, held_bytes_measured, sent) if first else None
    rows = sorted(r for r in (world.gather(mine) or []) if r)
    trainer.finish()
    if world.Get_rank() == 0:
        timeline = [r[1] for r in rows]
        say(f"measured on {world.Get_size()} ranks (dp {tc.dp} x pp {tc.pp} x cp {tc.cp} x tp {tc.tp}, {tc.tp_scheme}, "
            f"{tc.dtype}), step {tc.steps}:")
        say(picture(timeline))
        say(f"bubble: measured {bubble_fraction(timeline):.4f} | predicted {bubble_fraction(plan.timeline):.4f} "
            f"(simulated with F={plan.costs[0]:g} B={plan.costs[1]:g} W={plan.costs[2]:g})")
        say(f"held at the peak: pairs measured {[r[2] for r in rows]} | predicted {plan.held}")
        say(f"                  activation bytes measured {[r[3] for r in rows]} | predicted {plan.bytes}")
        say(f"pp_comm sent per step: measured {[r[4] for r in rows]} | formula {plan.sent}")
        if plot:
            draw(plot, [("predicted", plan.timeline, 1.0), ("measured", timeline, 1e-3)])
    g.free()
    return rows


def draw(path, panels):
    from hsgd.run.plots import pyplot, draw_pipeline
    plt = pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.2 + 0.45 * len(panels[0][1]) * len(panels)),
                             squeeze=False)
    for ax, (title, timeline, unit) in zip(axes[:, 0], panels):
        draw_pipeline(ax, timeline, title=title, unit=unit, xlabel="time (ms)" if unit != 1.0 else "time (cost units)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None):
    """The exit code on every rank: 0, or 2 with one line from rank 0 for a usage error (hsgd.grid.launch). Every
    check comes before any work: the flags, --plot (created and removed), the sizes, the costs, the layout."""
    from mpi4py import MPI

    from hsgd.grid import launch
    world = MPI.COMM_WORLD
    rank0 = world.Get_rank() == 0
    say = print if rank0 else (lambda *a: None)

    def checked(args):
        check_plot(args.plot)                                         # (rank 0 draws; every rank checks)
        check_sizes(args)
        costs = parse_costs(args.costs)
        world_size = world.Get_size() if args.run else (args.dp or 1) * (args.tp or 1) * args.pp * (args.cp or 1)
        cfg, tc = configs_from_args(lab_flags_removed(args), world_size)
        if args.run:                                                  # (a simulation allocates nothing)
            check_memory(cfg, tc, 1, ConfigError)
        return cfg, tc, costs

    def body():
        args = build_parser().parse_args(argv)
        cfg, tc, costs = launch.agree(world, lambda: checked(args))
        if not args.run:                                              # nothing trained: rank 0 simulates
            plan = launch.agree(world, lambda: Plan(cfg, tc, costs) if rank0 else None)
            if rank0:
                plan.report(print)
                if args.plot:
                    draw(args.plot, [(f"{tc.schedule} (simulated)", plan.timeline, 1.0)])
                    print(f"wrote {args.plot}")
            return 0
        plan = Plan(cfg, tc, costs, built_with=(1.0, 1.0, 1.0))            # the list training builds
        plan.report(say)
        measure(cfg, tc, plan, say, args.plot)
        return 0

    return launch.run(body, world)


def lab_flags_removed(args):
    """The flags that configs_from_args reads (the lab's own removed)."""
    import argparse
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in ("costs", "plot", "run")})


if __name__ == "__main__":
    sys.exit(main())
