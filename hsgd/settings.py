"""The training run's settings: the TrainConfig dataclass, the command-line flags and TOML config files.

Every flag of `python -m hsgd.train` maps to a TrainConfig field (or a ModelConfig field), `--config FILE.toml`
fills the same fields (keys are the flag names with underscores; flags on the command line win), and
`configs_from_args` checks everything a run needs before any communication: bad values, layouts that do not fit
the world size, batches that do not split, layers that do not split into stages. Errors name the field, the
value and what would work.
"""
import argparse
import os
from dataclasses import dataclass, fields

from . import launch, tp_model
from .backend import resolve_device, resolve_dtype
from .config import ModelConfig, check_positive_int
from .dp import check_batch
from .errors import ConfigError
from .grid import check_sizes
from .pp import parse_split, split_layers

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
    tp_scheme: str = "megatron"    # megatron (f/g pairs) or gather (the lecture: all-gather + reduce-scatter)
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
    inject_fault: str = None       # "RANK:STEP[:KIND]": a fault on that rank at that step, KIND one of FAULTS
    save_dir: str = None           # write checkpoints into this directory
    save_interval: int = 0         # steps between checkpoints (0: only after the last step)
    keep: int = 3                  # checkpoints kept in save_dir (the newest)
    resume: str = None             # "auto" (the newest checkpoint in save_dir, if any) or a checkpoint path
    on_nan: str = "stop"           # a non-finite loss or gradient: "stop" the run (exit 3) or "skip" the update
    check_replicas: int = 0        # every N steps compare the DP replicas' parameters (0: never)
    dp_overlap: bool = False       # start each layer's gradient Iallreduce during the backward pass
    zero: int = 0                  # 0: all-reduce; 1, 2: reduce-scatter + sharded optimizer + all-gather (ZeRO)
    hierarchical: bool = False     # dp all-reduce as node reduce-scatter, cross-node all-reduce, node all-gather
    ranks_per_node: int = None     # dp ranks per node for --hierarchical (None: MPI's shared-memory split)
    straggler: str = None          # "RANK:MS": that rank sleeps MS milliseconds in every step
    dp_staleness: int = 0          # 1: apply each step's averaged gradient one step late (asynchronous SGD)
    trace: str = None              # write a Chrome/Perfetto trace of all ranks to this JSON file
    plot: str = None               # write PNG plots (loss curves, a per-rank timeline of one step) to this folder

    def __post_init__(self):
        if self.micro_batches is not None and self.grad_accum == 1:
            self.grad_accum = self.micro_batches        # the same number under its pipeline name

    def validate(self):
        if self.micro_batches is not None:                  # first: __post_init__ copied it into grad_accum
            check_positive_int("micro_batches", self.micro_batches)
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
        if self.straggler is not None:
            parts = str(self.straggler).split(":")
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                raise ConfigError(f"straggler={self.straggler!r} must look like RANK:MILLISECONDS, e.g. 3:50")
        if self.inject_fault is not None:
            parts = str(self.inject_fault).split(":")
            if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts[:2]) or \
                    (len(parts) == 3 and parts[2] not in FAULTS):
                raise ConfigError(f"inject_fault={self.inject_fault!r} must look like RANK:STEP or RANK:STEP:KIND with "
                                  f"KIND one of {', '.join(FAULTS)}, e.g. 3:5 or 3:5:kill")
        for name in ("save_interval", "check_replicas"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name}={v!r} must be an integer >= 0")
        check_positive_int("keep", self.keep)
        if self.on_nan not in ("stop", "skip"):
            raise ConfigError(f"on_nan={self.on_nan!r} must be stop or skip")
        if self.dp_staleness and (self.save_dir or self.resume):
            raise ConfigError("checkpoints do not hold the gradient in flight of --dp-staleness 1; run it without "
                              "--save-dir / --resume")
        if self.resume == "auto" and not self.save_dir:
            raise ConfigError("resume='auto' looks for the newest checkpoint in --save-dir; give --save-dir too")
        if self.save_dir and os.path.exists(self.save_dir) and not os.path.isdir(self.save_dir):
            raise ConfigError(f"save_dir={self.save_dir!r} exists and is not a directory; choose another path")
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
FAULTS = ("raise", "kill", "kill-in-save", "nan", "diverge")


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
                   help=f"tensor-parallel scheme: megatron f/g pairs or the lecture's all-gather ({d.tp_scheme})")
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
    g.add_argument("--inject-fault", metavar="RANK:STEP[:KIND]",
                   help="a fault on RANK at STEP, for testing: KIND raise (default, an exception), kill (SIGKILL), "
                        "kill-in-save (SIGKILL while writing a checkpoint), nan (a NaN in the gradient), diverge "
                        "(perturb one parameter on that rank only)")
    g = p.add_argument_group("checkpoints and faults")
    g.add_argument("--save-dir", metavar="DIR", help="write distributed checkpoints into DIR")
    g.add_argument("--save-interval", type=int, help="steps between checkpoints (0: only after the last step)")
    g.add_argument("--keep", type=int, help="checkpoints kept (3)")
    g.add_argument("--resume", metavar="auto|PATH", help="continue from the newest checkpoint in --save-dir (auto) "
                                                         "or from PATH, under any layout valid for the model")
    g.add_argument("--on-nan", choices=["stop", "skip"], help="a non-finite loss or gradient: stop with exit code 3 "
                                                              "or skip that step's update (stop)")
    g.add_argument("--check-replicas", type=int, metavar="N", help="compare the DP replicas' parameters every N steps "
                                                                   "and stop, naming the first that differs (0: off)")
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
