"""A layout that is only planned: what one rank of it holds and sends in a training step of hsgd, from the sizes
alone (no array is made, no message sent), so that runs far larger than this machine can be costed.

hsgd.train reports, for the layout it runs, bytes per communicator (hsgd.accounting.traffic.step_formula) and
memory per category (hsgd.accounting.step_memory.step_formula), each equal to what it measures. Both are functions
of sizes (hsgd.accounting.traffic.rank_bytes, hsgd.accounting.step_memory.rank_formula), given a stage (its blocks,
whether it holds the embedding or the head, its schedule) and the exchange's sizes (hsgd.dp.make.exchange_sizes).
This module makes those two from the settings, for rank (pp stage s; every dp, cp and tp rank of a stage holds and
sends the same):

    stage s     PlannedStage: hsgd.pp.chunks.stage_chunks's blocks, hsgd.pp.schedules.build's actions (as
                hsgd.pp.stage.Stage)
    exchange    exchange_sizes(tc, {group: elements of stage s's tp shards}, itemsize, dp x cp, micro-batches)
    bytes       rank_bytes(cfg, tc, dp, tp, cp, stage, exchange)
    memory      rank_formula(cfg, tc, dp, tp, cp, stage, exchange, ...)   (gpipe and 1f1b: one chunk per stage)

tests/mpi/test_plan_layout.py holds them equal to the trainer's for every factorization of 8 ranks.
"""
from functools import lru_cache
from types import SimpleNamespace

from hsgd.cp.layouts import make_split
from hsgd.dp.make import exchange_sizes
from hsgd.pp.chunks import parse_split, stage_chunks, stage_names
from hsgd.accounting.traffic import rank_bytes
from hsgd.pp.schedules import build, effective, placement_of
from hsgd.pp.stage import Chunk
from hsgd.accounting.step_memory import rank_formula
from hsgd.tp.shards import shard_numel

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 4, "float16": 4}    # hsgd emulates the narrow formats in float32


@lru_cache(maxsize=8)
def all_actions(kind, m, p, v):
    """hsgd.pp.schedules.build's actions of every stage, kept for the planner's next stage of the same pipeline."""
    return build(kind, m, p, v)


class PlannedStage:
    """Stage s of pp as hsgd.pp.stage.Stage lays it out: its chunks' blocks (v chunks with virtual stages), whether it
    holds the embedding (first) and the head (last), its parameter names and its actions."""

    def __init__(self, cfg, tc, pp, s):
        v = tc.virtual_stages
        self.v, self.s = v, s
        self.kind, self.m, self.pp = effective(tc.schedule, pp, v), tc.micro_batches, pp
        self.placement = placement_of(self.kind, pp, v)                # which stage holds each piece
        self.chunks = [Chunk(*ch) for ch in stage_chunks(cfg.n_layers, pp, s, v, parse_split(tc.pp_split),
                                                         self.placement)]
        self.layers = [i for _, layers, _, _ in self.chunks for i in layers]
        self.first, self.last = any(ch[2] for ch in self.chunks), any(ch[3] for ch in self.chunks)
        self.cfg = cfg

    @property
    def names(self):
        """Its parameters' names (built when first asked)."""
        return [n for _, layers, first, last in self.chunks for n in stage_names(self.cfg, layers, first, last)]

    @property
    def actions(self):
        """Its actions in hsgd.pp.schedules' list (built when first asked: memory needs them, bytes do not)."""
        return all_actions(self.kind, self.m, self.pp, self.v)[self.s]

    def pieces(self, rows):
        """A micro-batch in one piece (the planner leaves --threads out)."""
        return [rows]

    def group_numel(self, cfg, tp, scheme, per=None):
        """{group: elements of this stage's tp shards} in the order the backward pass finishes the groups; per:
        {"embedding", "h", "head": elements of each kind} (default hsgd's shards, kind_numel; the planner's
        Megatron-style run: hsgd.plan.family.megatron_numel), and "moe" for a MoE block's when cfg has experts
        (theirs are groups of their own: hsgd.plan.experts.expert_groups)."""
        per = per or kind_numel(cfg, tp, scheme)
        blocks = {f"h.{i}": per["moe" if cfg.is_moe(i) else "h"] for i in reversed(self.layers)}
        return ({"head": per["head"]} if self.last else {}) | blocks | (
            {"embedding": per["embedding"]} if self.first else {})


@lru_cache(maxsize=256)
def kind_numel(cfg, tp, scheme):
    """{"embedding", "h", "head": elements of one tp rank's shards of that group} (every block alike)."""
    names = {"embedding": stage_names(cfg, [], True, False), "h": stage_names(cfg, [0], False, False),
             "head": stage_names(cfg, [], False, True)}
    return {k: shard_numel(cfg, tp, v, scheme) for k, v in names.items()}


def context_held_bytes(cfg, tc, cp, cp_rank=0):
    """What the context layout of cp_rank holds for the run (ctx.held_bytes(): positions, masks), made on the host
    without a communicator (it asks only the size and the rank)."""
    if cp == 1:
        return 0
    return make_split(tc.cp_scheme, SimpleNamespace(size=cp, rank=cp_rank), cfg.seq_len).held_bytes()


def plan_rank(cfg, tc, dp, pp, tp, cp, s):
    """{"bytes": {(comm, op): (calls, bytes)}, "memory": step_formula's dict or None (interleaved and zero-bubble
    schedules: not modelled), "exchange": the exchange's sizes, "stage": the PlannedStage} of pp stage s."""
    stage = PlannedStage(cfg, tc, pp, s)
    ex = exchange_sizes(tc, stage.group_numel(cfg, tp, tc.tp_scheme), ITEMSIZE[tc.dtype], dp * cp, tc.micro_batches)
    out = {"bytes": rank_bytes(cfg, tc, dp, tp, cp, stage, ex), "exchange": ex, "stage": stage, "memory": None}
    one_chunk = stage.v == 1 and not any(a.kind == "W" for a in stage.actions)
    if one_chunk:
        rounds = tc.dtype in ("bfloat16", "float16")
        out["memory"] = rank_formula(cfg, tc, dp, tp, cp, stage, ex, rounds, context_held_bytes(cfg, tc, cp))
    return out
