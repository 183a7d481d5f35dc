"""The command lines of hsgd.train, hsgd.verify and the schedule lab, made from the settings' dataclasses.

Every field of hsgd.step.settings' groups (and of ModelConfig) made with config.flag(default, help_text, ...) becomes a
flag: `flags_parser` turns batch_size into --batch-size, its help the help text with the default at the end, so
that a default and its help are written once and the parsers cannot drift apart. `--config FILE.toml` fills the
same fields (keys are the field names; flags on the command line win), and `configs_from_args` checks everything
a run needs before any communication: bad values, layouts that do not fit the world size, batches that do not
split, layers that do not split into stages, sequences that do not cut into the cp ranks' chunks.
"""
import argparse
from dataclasses import fields

from hsgd.cli import Parser
from hsgd.grid import launch
from hsgd.tp import shards as tp_shards
from hsgd.model.config import ModelConfig, flag_names
from hsgd.run.config_file import read_toml
from hsgd.cp.split import check_cp, check_heads, heads_fit
from hsgd.ep.layout import check_moe_layout
from hsgd.fp8.domains import check_fp8_layout
from hsgd.dp.average import check_batch
from hsgd.pp.schedules import check_pipeline
from hsgd.step.experiments import Experiments
from hsgd.step.settings import Checkpoints, Data, Exchange, Layout, Memory, Optimization, Output, TrainConfig


# The argument groups of --help, in order: (title, dataclass).
GROUPS = (("parallel layout: P = dp x pp x cp x tp ranks", Layout), ("model", ModelConfig),
          ("optimization", Optimization), ("data and numerics", Data), ("output", Output),
          ("checkpoints", Checkpoints),
          ("data-parallel exchange (at most one of --dp-overlap, --zero, --hierarchical, --dp-staleness; "
           "--zero 2|3 --hierarchical is hybrid sharding)", Exchange),
          ("memory", Memory),
          ("experiments", Experiments))
MODEL_FLAGS = flag_names(ModelConfig)


def add_flag(group, f, overrides):
    """--field-name from a dataclass field: its help text with the default in parentheses at the end of the first
    line, and its argparse keywords; an int or float field takes an int or float, a bool one --x / --no-x."""
    keywords = {k: v for k, v in f.metadata.items() if k not in ("help", "shown")}
    if f.name in overrides:
        keywords["default"] = shown = overrides[f.name]
    else:
        shown = f.metadata["shown"] or f.default
    if shown is None or shown is False:
        shown = "off"
    if f.type is bool:
        keywords["action"] = argparse.BooleanOptionalAction
    elif f.type in (int, float):
        keywords["type"] = f.type
    first, *rest = f.metadata["help"].split("\n")
    group.add_argument("--" + f.name.replace("_", "-"), help="\n".join([f"{first} ({shown})", *rest]), **keywords)


def flags_parser(groups, prog, description, epilog=None, only=None, overrides=None):
    """An argparse parser with a flag for every field of the (title, dataclass) `groups` that is a flag (of those
    named in `only`, if given), one argument group per dataclass. Flags default to None, so that only the flags
    given override the TOML file and the dataclass defaults; `overrides` {name: value} are the parser's own
    defaults instead (hsgd.verify's small model), shown in the help."""
    p = Parser(prog=prog, description=description, epilog=epilog, argument_default=None, speaks=launch.on_rank_zero)
    for title, config_class in groups:
        chosen = [f for f in fields(config_class) if "help" in f.metadata and (only is None or f.name in only)]
        if chosen:
            g = p.add_argument_group(title)
            for f in chosen:
                add_flag(g, f, overrides or {})
    return p


def build_parser():
    """The flags of `python -m hsgd.train`: every field of TrainConfig and ModelConfig, and --config."""
    p = flags_parser(
        GROUPS, prog="mpirun -n P python -m hsgd.train",
        description="Train a GPT-style Transformer with hybrid-parallel synchronous mini-batch SGD on P = dp x pp x "
                    "cp x tp MPI ranks (one process works too): dp data-parallel replicas (the lecture's G groups), "
                    "each a pipeline of pp stages, each stage split over tp tensor-parallel ranks (the lecture's M) "
                    "and, with context parallelism, every sequence over cp ranks; every backward pass and every "
                    "collective written out. Trains on the Python standard library's source "
                    "files unless --data is given.",
        epilog="Example: mpirun -n 8 python -m hsgd.train --tp 4 --steps 100 --optimizer adamw --lr 3e-3. "
               "--micro-batches (TOML key micro_batches) replaces --grad-accum (grad_accum).")
    p.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file, the flag names with "
                                                         "underscores as keys (lr = 0.01); flags on the command line "
                                                         "win")
    return p


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
    tc.check_targets(world_size)
    tp_shards.check_tp(model, tc.tp, tc.tp_scheme)
    tp_shards.check_tied(model, tc.pp, tc.zero)
    heads = lambda c: heads_fit(model.n_heads, model.n_kv_heads, c, tc.tp, tc.cp_scheme)
    check_cp(model.seq_len, tc.cp, tc.tp, tc.tp_scheme == "sequence", heads)   # 2cp chunks (and tp T-shards of each)
    check_heads(model.n_heads, model.n_kv_heads, tc.cp, tc.tp, tc.cp_scheme, model.seq_len)   # Ulysses, a2a+p2p
    check_batch(tc.batch_size, tc.dp, tc.micro_batches)
    check_pipeline(model.n_layers, tc)                                   # layers per chunk, the schedule
    check_moe_layout(model, tc)                                          # ep, the balance loss's domain
    check_fp8_layout(model, tc)                                          # FP8: its tiles, within the pieces
    return model, tc
