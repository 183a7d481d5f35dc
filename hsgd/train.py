"""Hybrid tensor x data parallel training of the GPT:  mpirun -n 8 python -m hsgd.train  (--help for the flags)

P = dp x tp ranks; by default tp = 2 and dp = P / tp (tp = 1 on an odd number of ranks). Each step is the seed
paper's synchronous mini-batch SGD on the global batch (see hsgd/hybrid.py): the TP groups compute their
slices' gradients with the tensor-parallel model, the ranks holding the same shard average it over dp_comm, and
every rank updates its shards. One process (`python -m hsgd.train`) is the special case tp = dp = 1.

Rank 0 prints a header, the rank layout, a progress line every few steps (loss, learning rate, tokens/s, ETA,
and the step time split into compute / TP communication / DP communication), the validation loss at intervals,
a summary (validation loss before -> after, bytes per step on each communicator against the formula, wall
time) and a generated sample.

Settings come from the flags, or from `--config FILE.toml` (keys are the flag names with underscores; flags
given on the command line win).
"""
import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace

from mpi4py import MPI
from threadpoolctl import threadpool_limits

from . import launch, tp_model
from .backend import resolve_device, resolve_dtype
from .config import ModelConfig, check_positive_int
from .data import Corpus
from .dp import check_batch
from .errors import ConfigError
from .generate import generate, printable
from .grid import ProcessGrid, check_sizes
from .hybrid import HybridTrainer
from .pp import ideal_bubble, parse_split, picture, pp_formula, split_layers
from .plots import write_plots
from .trace import Tracer

try:
    import tomllib
except ImportError:                                  # Python < 3.11
    import tomli as tomllib


@dataclass
class TrainConfig:
    tp: int = None                 # tensor-parallel size M (None: 2 when the ranks per stage are even, else 1)
    dp: int = None                 # data-parallel size G (None: world size / (pp * tp))
    pp: int = 1                    # pipeline stages
    pp_split: str = None           # layers per stage, e.g. "3,1" (None: as even as possible)
    schedule: str = "1f1b"         # pipeline schedule: 1f1b (PipeDream-Flush) or gpipe
    micro_batches: int = None      # micro-batches per DP group and step (the pipeline's m; same as grad_accum)
    tp_scheme: str = "megatron"    # megatron (f/g pairs) or gather (the seed paper: all-gather + reduce-scatter)
    steps: int = 1000              # optimizer steps
    batch_size: int = 16           # B: sequences in the global batch of every step
    grad_accum: int = 1            # micro-batches per DP group and step (gradient accumulation)
    optimizer: str = "sgd"         # sgd (with momentum) or adamw
    lr: float = 0.05               # peak learning rate
    momentum: float = 0.9          # heavy-ball momentum of SGD (0 = plain SGD)
    weight_decay: float = 0.0      # decoupled weight decay on weight matrices
    warmup: int = 20               # linear warmup steps, then cosine decay to lr/10 at the last step
    clip: float = 0.0              # clip the global gradient norm to this value (0 = no clipping)
    seed: int = 0                  # seeds the parameters, the batches and the sample
    data: str = None               # text file to train on; None = the built-in corpus
    dtype: str = "float32"         # float32, or float64 for exactness checks
    device: str = None             # cpu or gpu; None = $HSGD_DEVICE or cpu
    eval_interval: int = 250       # steps between validation losses (0 = only before and after training)
    eval_batches: int = 4          # batches averaged for one validation loss
    log_interval: int = 50         # steps between progress lines
    sample_bytes: int = 200        # bytes generated at the end (0 = none)
    prompt: str = "def "           # prompt of the generated sample
    threads: int = None            # BLAS threads per rank; None = cores / ranks on the machine (at least 1)
    log_json: str = None           # write one JSON object per step to this file (rank 0)
    inject_fault: str = None       # "RANK:STEP": raise an exception on that rank at that step (tests fail-fast)
    dp_overlap: bool = False       # start each layer's gradient Iallreduce during the backward pass
    zero: int = 0                  # 0: all-reduce; 1, 2: reduce-scatter + sharded optimizer + all-gather (ZeRO)
    hierarchical: bool = False     # dp all-reduce as node reduce-scatter, cross-node all-reduce, node all-gather
    ranks_per_node: int = None     # dp ranks per node for --hierarchical (None: MPI's shared-memory split)
    straggler: str = None          # "RANK:MS": that rank sleeps MS milliseconds in every step
    dp_staleness: int = 0          # 1: apply each step's averaged gradient one step late (asynchronous SGD)
    trace: str = None              # write a Chrome/Perfetto trace of all ranks to this JSON file
    plot: str = None               # write PNG plots (loss curves, a per-rank timeline of one step) to this folder

    def validate(self):
        for name in ("steps", "batch_size", "grad_accum", "eval_batches", "log_interval"):
            check_positive_int(name, getattr(self, name))
        for name in ("eval_interval", "sample_bytes", "warmup"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name}={v!r} must be an integer >= 0")
        for name in ("threads", "tp", "dp"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr!r} must be > 0 (typical: SGD 0.01 to 0.1, AdamW 1e-4 to 3e-3)")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum={self.momentum!r} must be in [0, 1) (typical: 0.9)")
        if not self.weight_decay >= 0:
            raise ConfigError(f"weight_decay={self.weight_decay!r} must be >= 0")
        if not self.clip >= 0:
            raise ConfigError(f"clip={self.clip!r} must be >= 0 (0 turns clipping off)")
        if self.micro_batches is not None:
            check_positive_int("micro_batches", self.micro_batches)
            if self.grad_accum not in (1, self.micro_batches):
                raise ConfigError(f"micro_batches={self.micro_batches} and grad_accum={self.grad_accum} disagree; "
                                  "they name the same number: give one of them")
            self.grad_accum = self.micro_batches
        check_positive_int("pp", self.pp)
        if self.schedule not in ("1f1b", "gpipe"):
            raise ConfigError(f"schedule={self.schedule!r} is not known; use 1f1b or gpipe")
        if self.pp > 1 and self.tp_scheme == "sequence":
            raise ConfigError("tp_scheme='sequence' is not supported with pp > 1 (its activations are split along T "
                              "between stages too); use --tp-scheme megatron or gather with --pp")
        if self.optimizer not in ("sgd", "adamw"):
            raise ConfigError(f"optimizer={self.optimizer!r} is not known; use sgd or adamw")
        for name, example in (("inject_fault", "3:5"), ("straggler", "3:50")):
            v = getattr(self, name)
            if v is not None and (len(str(v).split(":")) != 2 or not all(p.isdigit() for p in str(v).split(":"))):
                what = "RANK:STEP" if name == "inject_fault" else "RANK:MILLISECONDS"
                raise ConfigError(f"{name}={v!r} must look like {what}, e.g. {example}")
        if self.zero not in (0, 1, 2):
            raise ConfigError(f"zero={self.zero!r} must be 0 (all-reduce), 1 or 2 (ZeRO stage)")
        if self.dp_staleness not in (0, 1):
            raise ConfigError(f"dp_staleness={self.dp_staleness!r} must be 0 (synchronous) or 1 (one step late)")
        if self.ranks_per_node is not None:
            check_positive_int("ranks_per_node", self.ranks_per_node)
        modes = [m for m, on in (("--dp-overlap", self.dp_overlap), (f"--zero {self.zero}", self.zero),
                                 ("--hierarchical", self.hierarchical), ("--dp-staleness 1", self.dp_staleness))
                 if on]
        if len(modes) > 1:
            raise ConfigError(f"{' and '.join(modes)} cannot be combined: each is its own way of exchanging the "
                              "gradients over dp_comm; choose one")
        resolve_dtype(self.dtype)
        resolve_device(self.device)

    def resolve_layout(self, world_size):
        """Fill in tp and dp from the world size, then check that dp * pp * tp == world size."""
        per_stage = world_size // self.pp if world_size % self.pp == 0 else 1
        if self.tp is None:
            self.tp = 2 if per_stage % 2 == 0 and (self.dp is None or per_stage // self.dp % 2 == 0) else 1
        if self.dp is None:
            self.dp = max(world_size // (self.tp * self.pp), 1)
        check_sizes(world_size, self.dp, self.pp, self.tp)


MODEL_FLAGS = ("seq_len", "d_model", "n_layers", "n_heads", "d_ff")


def build_parser():
    d, m = TrainConfig(), ModelConfig()
    p = launch.RankZeroParser(
        prog="mpirun -n P python -m hsgd.train",
        description="Train a GPT-style Transformer with hybrid tensor x data parallel synchronous mini-batch SGD "
                    "(P = dp x tp MPI ranks; one process works too), every backward pass and every collective "
                    "written out. Trains on the Python standard library's source files unless --data is given.",
        epilog="Example: mpirun -n 8 python -m hsgd.train --tp 4 --steps 100 --optimizer adamw --lr 3e-3",
        argument_default=None)
    g = p.add_argument_group("parallel layout")
    g.add_argument("--tp", type=int, help="tensor-parallel size M (default: 2 on an even number of ranks, else 1)")
    g.add_argument("--dp", type=int, help="data-parallel size G (default: ranks / tp)")
    g.add_argument("--pp", type=int, help="pipeline stages (1)")
    g.add_argument("--pp-split", metavar="N,N,...", help="layers per pipeline stage (default: as even as possible)")
    g.add_argument("--schedule", choices=["1f1b", "gpipe"], help="pipeline schedule (1f1b)")
    g.add_argument("--micro-batches", type=int, help="micro-batches per DP group and step: the pipeline's m "
                                                     "(the same number as --grad-accum)")
    g.add_argument("--tp-scheme", choices=tp_model.SCHEMES,
                   help=f"tensor-parallel scheme: megatron f/g pairs or the seed paper's all-gather ({d.tp_scheme})")
    g = p.add_argument_group("model")
    g.add_argument("--seq-len", type=int, help=f"T: context length in bytes ({m.seq_len})")
    g.add_argument("--d-model", type=int, help=f"C: width of the residual stream ({m.d_model})")
    g.add_argument("--n-layers", type=int, help=f"L: Transformer blocks ({m.n_layers})")
    g.add_argument("--n-heads", type=int, help=f"NH: attention heads, must divide d-model and be divisible by tp "
                                               f"({m.n_heads})")
    g.add_argument("--d-ff", type=int, help=f"F: hidden width of the MLP, divisible by tp ({m.d_ff})")
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, help=f"optimizer steps ({d.steps})")
    g.add_argument("--batch-size", type=int, help=f"B: sequences in the global batch, a multiple of "
                                                  f"dp * grad-accum ({d.batch_size})")
    g.add_argument("--grad-accum", type=int, help=f"micro-batches per DP group and step ({d.grad_accum})")
    g.add_argument("--optimizer", choices=["sgd", "adamw"], help=f"optimizer ({d.optimizer})")
    g.add_argument("--lr", type=float, help=f"peak learning rate ({d.lr})")
    g.add_argument("--momentum", type=float, help=f"SGD momentum, 0 for plain SGD ({d.momentum})")
    g.add_argument("--weight-decay", type=float, help=f"decoupled weight decay ({d.weight_decay})")
    g.add_argument("--warmup", type=int, help=f"warmup steps before the cosine decay ({d.warmup})")
    g.add_argument("--clip", type=float, help=f"max global gradient norm, 0 = off ({d.clip})")
    g.add_argument("--seed", type=int, help=f"seed of parameters, batches and sampling ({d.seed})")
    g = p.add_argument_group("data and numerics")
    g.add_argument("--data", metavar="FILE", help="text file to train on (bytes are tokens); default: the Python "
                                                  "standard library's source files")
    g.add_argument("--dtype", choices=["float32", "float64"], help=f"floating-point type ({d.dtype})")
    g.add_argument("--device", choices=["cpu", "gpu"], help="cpu (NumPy) or gpu (CuPy); default $HSGD_DEVICE or cpu")
    g.add_argument("--threads", type=int, help="BLAS threads per rank (default: cores / ranks, at least 1)")
    g = p.add_argument_group("output")
    g.add_argument("--log-interval", type=int, help=f"steps between progress lines ({d.log_interval})")
    g.add_argument("--eval-interval", type=int, help=f"steps between validation losses, 0 = only before and after "
                                                     f"({d.eval_interval})")
    g.add_argument("--eval-batches", type=int, help=f"batches per validation loss ({d.eval_batches})")
    g.add_argument("--sample-bytes", type=int, help=f"bytes to generate at the end ({d.sample_bytes})")
    g.add_argument("--prompt", help=f"prompt of the generated sample ({d.prompt!r})")
    g.add_argument("--log-json", metavar="FILE", help="write one JSON object per step (rank 0)")
    g.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file (flags win)")
    g.add_argument("--inject-fault", metavar="RANK:STEP", help="raise an exception on RANK at STEP (testing)")
    g.add_argument("--trace", metavar="FILE.json", help="write a Chrome/Perfetto trace of every rank (compute phases "
                                                        "and collectives) to FILE.json")
    g.add_argument("--plot", metavar="DIR", help="write PNG plots to DIR: loss curves and a per-rank timeline of "
                                                 "one step")
    g = p.add_argument_group("data-parallel communication (choose at most one of the first four)")
    g.add_argument("--dp-overlap", action=argparse.BooleanOptionalAction,
                   help="start each layer's gradient Iallreduce while the backward pass goes on (default: off)")
    g.add_argument("--zero", type=int, choices=[0, 1, 2], help="ZeRO stage: reduce-scatter the gradients, update "
                                                              "1/dp of the parameters, all-gather them (0: off)")
    g.add_argument("--hierarchical", action=argparse.BooleanOptionalAction,
                   help="all-reduce as reduce-scatter in the node, all-reduce across nodes, all-gather in the node")
    g.add_argument("--dp-staleness", type=int, choices=[0, 1], help="1: apply each step's averaged gradient one step "
                                                                    "late, its exchange overlapping the next step")
    g.add_argument("--ranks-per-node", type=int, help="dp ranks per node for --hierarchical (default: MPI's "
                                                      "shared-memory split)")
    g.add_argument("--straggler", metavar="RANK:MS", help="make RANK sleep MS milliseconds in every step")
    return p


def read_toml(path):
    """The settings in a TOML file, checked against the known keys."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e}") from None
    known = {f.name for f in fields(TrainConfig)} | set(MODEL_FLAGS)
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"config file {path!r} has unknown keys {unknown}; known keys: {sorted(known)}")
    return table


def configs_from_args(args, world_size):
    """(ModelConfig, TrainConfig) from parsed flags (and --config), validated; raises UsageError."""
    given = {k: v for k, v in vars(args).items() if v is not None and k != "config"}
    config = getattr(args, "config", None)
    settings = read_toml(config) if config else {}
    settings.update(given)                                      # flags win over the file
    model = ModelConfig(vocab_size=256, **{k: settings[k] for k in MODEL_FLAGS if k in settings})
    tc = TrainConfig(**{k: v for k, v in settings.items() if k not in MODEL_FLAGS})
    tc.validate()
    tc.resolve_layout(world_size)
    tp_model.check_tp(model, tc.tp, tc.tp_scheme)
    check_batch(tc.batch_size, tc.dp, tc.grad_accum)
    split_layers(model.n_layers, tc.pp, parse_split(tc.pp_split))
    return model, tc


def fmt_time(seconds):
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def local_ranks(world):
    """Ranks of this job on this machine (for the default number of BLAS threads)."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    n = node.Get_size()
    node.Free()
    return n


def train(cfg, tc, world=MPI.COMM_WORLD, out=sys.stdout):
    """Train on `world` (every rank calls this); returns a summary dict on every rank."""
    tc = replace(tc)
    tc.validate()
    tc.resolve_layout(world.Get_size())
    threads = tc.threads or max(1, (os.cpu_count() or 1) // local_ranks(world))
    with threadpool_limits(limits=threads):
        return _train(cfg, tc, world, out, threads)


def _train(cfg, tc, world, out, threads):
    rank0 = world.Get_rank() == 0
    say = (lambda s="": print(s, file=out, flush=True)) if rank0 else (lambda s="": None)
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
    fault = tuple(int(x) for x in tc.inject_fault.split(":")) if tc.inject_fault else None

    n_local = sum(p.size for p in trainer.params.values())
    tokens = tc.batch_size * cfg.seq_len
    say(f"hsgd | {world.Get_size()} ranks = dp {grid.dp} x pp {grid.pp} x tp {grid.tp} ({tc.tp_scheme}) | "
        f"{resolve_device(tc.device)} {tc.dtype} | {threads} BLAS thread(s) per rank")
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
    losses, per_step, val_points = [], None, [(0, val0)]
    measured_step = min(2, tc.steps)        # bytes of one step, the same every step (step 1 of staleness: none)
    for step in range(1, tc.steps + 1):
        if fault and fault == (world.Get_rank(), step):
            raise RuntimeError(f"fault injected on rank {world.Get_rank()} at step {step} (--inject-fault)")
        idx, targets = corpus.batch(tc.seed, step, tc.batch_size)
        before = grid.stats.counts()
        if tracer:
            tracer.enabled = traced[0] <= step <= traced[1]
        with (tracer.span(f"step {step}") if tracer else nullcontext()):
            info = trainer.step(idx, targets, step)
        if step == measured_step:
            after = grid.stats.counts()
            per_step = {k: (v[0] - before.get(k, (0, 0))[0], v[1] - before.get(k, (0, 0))[1])
                        for k, v in after.items() if v != before.get(k)}
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
                f"{w['n'] * tokens / w['s']:,.0f} tok/s | ETA {fmt_time(elapsed / step * (tc.steps - step))} | "
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
    say(f"val loss {val0:.4f} -> {val1:.4f} after {tc.steps} steps in {fmt_time(wall)} "
        f"({tc.steps * tokens / wall:,.0f} tok/s)")
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
    from .pp import bubble_fraction, peak_in_flight, simulate
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
        + str([peak_in_flight(trainer_actions(tc, p, s)) for s in range(p)]))


def trainer_actions(tc, p, s):
    from .pp import schedule
    return schedule(tc.schedule, tc.grad_accum, p, s)


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


def main(argv=None):
    world = MPI.COMM_WORLD

    def body():
        args = build_parser().parse_args(argv)
        cfg, tc = launch.agree(world, lambda: configs_from_args(args, world.Get_size()))
        train(cfg, tc, world)

    return launch.run(body, world)


if __name__ == "__main__":
    sys.exit(main())
