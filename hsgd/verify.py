"""Check the parallel model against the serial reference:  mpirun -n N python -m hsgd.verify [--tp --dp ...]

One step of the parallel model on the dp x pp x cp x tp grid (the same code path as training: micro-batches through
the pipeline stages, tensor-parallel forward and backward, the exchange over dp_comm; with --zero, --recompute and
--hierarchical as given) and of hsgd.model.serial on the same global batch, then a table with, for every parameter, the
largest error of any rank's averaged gradient shard against the matching slice of the serial gradient (with ZeRO
each dp rank holds the average of its chunk only: the chunks are All-Gathered first).
Exit code 0 when every error is within the tolerance of the dtype, 1 otherwise (2 for a usage error):

    float64: loss within 1e-12 and every gradient within 1e-10, relative
    float32: loss within 1e-6 and every gradient within 1e-4, relative (the float32 error budget; the serial
             reference is computed in float64)
    bfloat16, float16: no fixed tolerance; the tolerance oracle (hsgd.check.oracle) runs --layouts over --seeds and
             predicts each difference's band from a model of the rounding errors
    fp8:     the same oracle for FP8 products (--fp8 hybrid, float32 otherwise, --fp8-recipe tensorwise by
             default): its error model perturbs every cast at the scale the run takes (hsgd.check.oracle.PerturbedFp8)

"Relative" means relative to the largest serial gradient entry of that parameter, or to 1e-3 of the model's
largest gradient entry when that is larger (some gradients are exactly zero, e.g. the attention k-bias: a
softmax ignores a shift shared by a row of scores, so what is computed there is rounding noise).
With experts the serial reference counts as the layout does (its balance domain's micro-batches, each rank's rows
routed together with their own capacity: hsgd.model.moe_pass.serial_pass), and each rank's experts are compared.
"""
import argparse
import sys
from dataclasses import replace

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from hsgd.grid import launch
from hsgd.ep.layout import capacity_groups
from hsgd.model import serial
from hsgd.model.moe_pass import serial_pass
from hsgd.tp import shards as tp_shards
from hsgd.model.backend import to_numpy
from hsgd.model.config import flag_names
from hsgd.errors import ConfigError
from hsgd.run.preflight import check_memory
from hsgd.grid.process_grid import ProcessGrid
from hsgd.dp.average import global_loss
from hsgd.step.trainer import HybridTrainer
from hsgd.check.oracle import oracle, parse_layouts
from hsgd.check.verdict import report
from hsgd.model.precision import LOW
from hsgd.files import needs_module, writable_file
from hsgd.run.flags import GROUPS, MODEL_FLAGS, configs_from_args, flags_parser
from hsgd.step.settings import Layout, TrainConfig
from hsgd.grid.devices import place_on_device

TOLERANCE = {"float64": (1e-12, 1e-10), "float32": (1e-6, 1e-4)}      # (loss, gradients)
# the flags of hsgd.verify (hsgd.train's, less those a single checked step does not use), and its defaults
VERIFY_FLAGS = flag_names(Layout) + MODEL_FLAGS + ("batch_size", "seed", "data", "dtype", "device", "zero",
                                                   "hierarchical", "ranks_per_node", "recompute", "reduce_dtype",
                                                   "loss_scale", "lr", "warmup", "fp8", "fp8_recipe", "fp8_history",
                                                   "fp8_margin", "fp8_block", "fp8_allgather")
VERIFY_DEFAULTS = dict(dtype="float64", batch_size=8, seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)


ORACLE_FLAGS = ("layouts", "seeds", "loss_steps", "resume_after", "plot")
MAX_SEEDS = 64                  # --seeds at most: each is a run of every layout
MAX_LOSS_STEPS = 10_000         # --loss-steps at most: each is a step of every layout, for every seed


def build_parser():
    """hsgd.train's flags for the layout, the model, the batch and the numerics (flags.flags_parser, the same
    help texts), with verify's defaults: a small model and float64; and the tolerance oracle's."""
    p = flags_parser(GROUPS, only=VERIFY_FLAGS, overrides=VERIFY_DEFAULTS, prog="mpirun -n P python -m hsgd.verify",
                     description="One step of the parallel model on P = dp x pp x cp x tp MPI ranks against the "
                                 "serial reference: a table of the largest gradient error of every parameter; exit 0 "
                                 "if all are within tolerance (float64 1e-10, float32 1e-4), else 1. With --dtype "
                                 "bfloat16 or float16, the tolerance oracle: how far each layout's gradients may "
                                 "differ from float64 and from each other through rounding alone.",
                     epilog="Example: mpirun -n 8 python -m hsgd.verify --dtype bfloat16 --layouts 1x1x1,2x1x4,1x2x4 "
                            "--seeds 8 --plot oracle.png")
    for a in p._actions:                                   # verify's own --dtype fp8: the oracle of FP8 products
        if a.dest == "dtype":
            a.choices = (*a.choices, "fp8")                 # (the help is hsgd.train's; the group below says it)
    g = p.add_argument_group("The tolerance oracle (--dtype bfloat16, float16, or fp8: FP8 products, --fp8 hybrid "
                             "in float32, --fp8-recipe tensorwise unless given)")
    g.add_argument("--layouts", metavar="DPxPPxTP,...", help="the layouts to compare, each dp x pp x tp or dp x pp x "
                   "cp x tp on the first ranks; the first is the base the others are compared with (default: 1x1x1 "
                   "and the layout of the flags on all P ranks)")
    g.add_argument("--seeds", type=int, default=None, help="seeds per layout, --seed, --seed + 1, ... (the weights "
                   f"and the batch): medians and maxima over them, at most {MAX_SEEDS} (default: 4)")
    g.add_argument("--loss-steps", type=int, default=0, metavar="K", help="compare the loss after K training steps "
                   "(with --lr and --warmup) instead of one step's gradients (default: 0, the gradients; at most "
                   f"{MAX_LOSS_STEPS})")
    g.add_argument("--resume-after", type=int, default=0, metavar="K", help="train K steps, load the state a "
                   "checkpoint keeps into a new run, then compare the next step's gradients: what a resume carries "
                   "(the optimizer's moments, FP8's amax histories) checked too (default: 0, no resume; at most "
                   f"{MAX_LOSS_STEPS})")
    g.add_argument("--plot", metavar="FILE.png", help="draw each layout's differences against their bands")
    return p


def verify(cfg, tc, world=MPI.COMM_WORLD, out=sys.stdout, where=None):
    """Returns (ok, rows): rows = [(name, full shape, local shape, split, max abs err, max rel err)] on rank 0.
    where: the device line of the header (train.place_on_device's description), if any."""
    from hsgd.model.data import Corpus
    corpus = launch.agree(world, lambda: Corpus.load(tc.data, cfg.seq_len))
    grid = ProcessGrid(world, dp=tc.dp, pp=tc.pp, tp=tc.tp, cp=tc.cp, ep=tc.ep)
    trainer = HybridTrainer(cfg, grid, tc)
    idx, targets = corpus.batch(tc.seed, 1, tc.batch_size)
    loss = trainer.gradients(idx, targets)                           # my group's loss (its stage's share)
    loss = global_loss(float(to_numpy(loss)), trainer.grid)                # the global batch's, on every rank
    ref = serial.init_params(cfg, seed=tc.seed, dtype="float64", device="cpu")     # the host reference
    moe = None
    if cfg.moe_experts:                                                    # experts: counted as the layout counts
        B, T = np.shape(idx)
        moe = serial_pass(cfg, B, T, np, micro_sequences=B // (tc.dp * tc.micro_batches),
                          capacity_groups=capacity_groups(B, T, tc.dp, tc.micro_batches, tc.cp))
    loss0, grads0 = serial.loss_and_grads(ref, idx, targets, cfg, moe=moe)
    scale = 1e-3 * max(float(np.abs(grad).max()) for grad in grads0.values())
    mine = {}
    for name, grad in trainer.averaged_grads().items():                # collective with ZeRO
        expect = tp_shards.shard(grads0[name], name, grid.tp_rank, grid.tp, tc.tp_scheme, cfg)
        diff = float(np.abs(to_numpy(grad).astype(np.float64) - expect).max())
        mine[name] = (diff, diff / max(float(np.abs(expect).max()), scale), grad.shape)
    everyone = world.gather((grid.pp_rank, mine))                     # (stage, errors) of every rank
    tol_loss, tol_grad = TOLERANCE[tc.dtype]
    loss_err = abs(loss - loss0) / abs(loss0)
    ok, rows = loss_err <= tol_loss, []
    if world.Get_rank() == 0:
        for name, shape in cfg.param_shapes().items():
            holders = [(stage, r) for stage, r in everyone if name in r]  # with pp > 1, the ranks of its stage
            abs_err = max(r[name][0] for _, r in holders)
            rel_err = max(r[name][1] for _, r in holders)
            kind, axis = tp_shards.split_of(name, tc.tp_scheme)
            split = "replicated" if kind == "rep" or grid.tp == 1 else f"{kind} axis {axis} / {grid.tp}"
            if grid.pp > 1:
                split += f", stage {holders[0][0]}"
            rows.append((name, shape, holders[0][1][name][2], split, abs_err, rel_err))
            ok = ok and rel_err <= tol_grad
        cp = f" x cp {grid.cp} ({tc.cp_scheme})" if grid.cp > 1 else ""
        print(f"hsgd.verify | {world.Get_size()} ranks = dp {grid.dp} x pp {grid.pp}{cp} x tp {grid.tp} "
              f"({tc.tp_scheme}) | {tc.dtype} | batch {tc.batch_size} x {cfg.seq_len}, {tc.micro_batches} "
              f"micro-batch(es) | zero {tc.zero}{' hierarchical' if tc.hierarchical else ''} | recompute "
              f"{tc.recompute}", file=out)
        if where:
            print(f"device: {where}", file=out)
        print(f"loss: parallel {loss:.12g}  serial {loss0:.12g}  rel err {loss_err:.1e} (tolerance {tol_loss:.0e})",
              file=out)
        print(f"{'parameter':<24}{'shape':>12}{'shard':>12}  {'split':<28}{'max abs err':>12}{'max rel err':>12}",
              file=out)
        for name, shape, local, split, a, r in rows:
            flag = "" if r <= tol_grad else "   <- over tolerance"
            print(f"{name:<24}{str(tuple(shape)):>12}{str(tuple(local)):>12}  {split:<28}{a:>12.1e}{r:>12.1e}{flag}",
                  file=out)
        worst = max(rows, key=lambda r: r[5])
        print(f"{'PASS' if ok else 'FAIL'}: largest gradient error {worst[5]:.1e} ({worst[0]}), tolerance "
              f"{tol_grad:.0e}", file=out)
    ok = world.bcast(ok)
    grid.free()
    return ok, rows


def main(argv=None):
    world = MPI.COMM_WORLD

    def body():
        args = build_parser().parse_args(argv)
        flags = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in ORACLE_FLAGS})
        fp8 = flags.dtype == "fp8"
        if fp8:                                             # FP8 products, float32 around them
            flags.dtype, flags.fp8 = "float32", flags.fp8 or "hybrid"
            flags.fp8_recipe = flags.fp8_recipe or "tensorwise"
        cfg, tc = launch.agree(world, lambda: configs_from_args(flags, world.Get_size()))
        if tc.fp8 and not fp8:
            raise ConfigError("hsgd.verify checks FP8 products with the tolerance oracle: give --dtype fp8 (with "
                              "--fp8-recipe), not --fp8 with a fixed tolerance")
        if fp8 and tc.fp8_recipe == "delayed" and args.loss_steps < 2 and args.resume_after < 1:
            raise ConfigError("--fp8-recipe delayed casts its first step with scale 1 (no amax history yet), which "
                              "one step's gradients cannot be held to; use --loss-steps K (K >= 2), --resume-after K "
                              "(K >= 1) or --fp8-recipe tensorwise, rowwise or blockwise")
        launch.agree(world, lambda: check_memory(cfg, tc, 1, ConfigError))   # one rank alone fits, before any work
        tc = replace(tc, steps=1, sample_bytes=0)
        if tc.dtype in LOW or fp8:
            return tolerance_oracle(args, cfg, tc, world)
        if args.layouts or args.plot or args.loss_steps or args.resume_after or args.seeds is not None:
            raise ConfigError(f"--layouts, --seeds, --loss-steps, --resume-after and --plot are the tolerance "
                              f"oracle's, for --dtype bfloat16, float16 or fp8; {tc.dtype} is held to a fixed "
                              "tolerance: leave them out")
        where = place_on_device(tc, world)
        with threadpool_limits(limits=1):
            ok, _ = verify(cfg, tc, world, where=where)
        return 0 if ok else 1

    return launch.run(body, world)


def tolerance_oracle(args, cfg, tc, world):
    """hsgd.check.oracle on the flags' layouts and seeds: its tables (and --plot) on rank 0; the exit code."""
    from hsgd.model.data import Corpus
    seeds = 4 if args.seeds is None else args.seeds
    if not 1 <= seeds <= MAX_SEEDS or not 0 <= args.loss_steps <= MAX_LOSS_STEPS or \
            not 0 <= args.resume_after <= MAX_LOSS_STEPS:
        raise ConfigError(f"--seeds {seeds} --loss-steps {args.loss_steps} --resume-after {args.resume_after}: give "
                          f"--seeds from 1 to {MAX_SEEDS}, --loss-steps and --resume-after from 0 to {MAX_LOSS_STEPS}")
    if args.loss_steps and args.resume_after:
        raise ConfigError("--loss-steps compares a loss, --resume-after the gradients after a resume: give one")
    mine = f"{tc.dp}x{tc.pp}x{tc.tp}" if tc.cp == 1 else f"{tc.dp}x{tc.pp}x{tc.cp}x{tc.tp}"
    text = args.layouts or ("1x1x1" if mine in ("1x1x1", "1x1x1x1") else f"1x1x1,{mine}")

    def checked():                                          # before any run: every rank agrees on what is wrong
        if args.plot:
            needs_module("matplotlib", "--plot", ConfigError)
            writable_file(args.plot, "--plot", ConfigError)
        return parse_layouts(text, cfg, tc, world.Get_size())

    layouts = launch.agree(world, checked)
    place_on_device(tc, world)
    corpus = launch.agree(world, lambda: Corpus.load(tc.data, cfg.seq_len))
    with threadpool_limits(limits=1):
        verdict = oracle(cfg, tc, layouts, seeds, world, corpus, args.loss_steps,
                         progress=lambda line: print(line, flush=True), resume_after=args.resume_after)
    ok = None
    if world.Get_rank() == 0:
        ok = report(verdict, tc, cfg, world.Get_size(), sys.stdout, args.loss_steps, args.resume_after)
        if args.plot:
            from hsgd.check.verdict import plot_tolerance
            plot_tolerance(verdict, args.plot)
            print(f"picture: {args.plot}")
    return 0 if world.bcast(ok) else 1


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["verify", "TOLERANCE", "TrainConfig"]
