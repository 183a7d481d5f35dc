"""The amax's domain: over which ranks each operand's amax is reduced, declared per operand and checked.

One logical tensor of a step (a weight, or one micro-batch's activation or gradient on one data-parallel replica)
may lie on several ranks, and every rank that holds a piece of it must cast it with the same scale, or the pieces
are different numbers than the serial model's. How an operand of a linear Y = X W (X (N, K) rows = tokens, W (K, M),
dY (N, M)) lies on a layout:

    operand   tensor parallelism (tp_comm)                                  context parallelism (cp_comm)
    W         split along M (column-parallel: q k v, fc, gate, up),         replicated
              along K (row-parallel: the output projections), or whole
    X         split along K where W is (a row-parallel input, Y_i);         split along the tokens
              gathered from T-shards (the sequence scheme's inputs of the
              column-parallel linears, cast before the All-Gather); else a copy
    dY        split along M where W is; gathered from T-shards (the         split along the tokens
              sequence scheme's dO of a projection); else a copy

The amax of a tile is reduced (Allreduce MAX) over the communicators that split the tile; a tile inside one piece
needs none:

    one scale per tensor (delayed, tensorwise)   tp where the tensor is split or gathered; cp
    one per row along axis a (rowwise)           tp where the tensor is split along a; cp where a is the tokens
    1 x b, b x b tiles (blockwise)               none: check_blocks refuses a layout whose pieces cut a tile

Delayed scaling records each use's amax and reduces the step's record at its end over tp and dp_comm (the dp x cp
ranks): the amax of the whole global batch, one history on every rank (hsgd.fp8.scaling.Fp8.end_step).

What the frameworks reduce over. Megatron-LM hands TransformerEngine an "amax reduction group" of the data-parallel,
context-parallel and tensor-parallel ranks together (Megatron-LM PR #442 fixed a run whose group left out tp: its
40B model diverged at tp = 8); TransformerEngine's fp8_group is whatever the caller passes (its docs once named the
wrong group, TransformerEngine #656 and #852), and its sequence-parallel All-Gather of FP8 inputs reduces over tp
(PR #74). torchao's Float8Linear takes the amax of a DTensor: a reduction over the mesh dimensions the tensor is
sharded on (the regression of torchtitan #3109 took a local shard's). Where several scales (rowwise, blockwise) keep
each tile on one rank, no reduction is needed at all: one reason DeepSeek-V3 chose fine-grained tiles.

Checked: with check=True every scale is compared (Allreduce MIN and MAX) over the ranks that hold its tile whether or
not the recipe reduces there (a copy of a tensor counts: its holders must agree too), and a difference raises
ScaleMismatch naming the operand.
"""
from collections import namedtuple

from mpi4py import MPI

from hsgd.errors import ConfigError
from hsgd.fp8.recipes import check_block

# how one operand lies on the layout: tp: "split" (along tp_axis), "gathered" (from T-shards: rows t0..t1 of each
# sequence of T_here positions are this rank's), "copy" or None (tp = 1); cp: split along the tokens (axis 0)
Spread = namedtuple("Spread", "tp tp_axis cp")


class ScaleMismatch(RuntimeError):
    """Ranks that hold pieces of one tensor cast them with different scales."""


class Holders:
    """Where the operands of the model's linears lie on one rank's layout.

    tp_comm, cp_comm: the communicators (None or size 1: not split); split_of(name) -> ("split", axis) | ("vocab",
    axis) | ("rep", None): how tp splits a parameter (hsgd.tp.schemes); splits_T: the sequence scheme (the column-
    parallel inputs and the projections' dO are gathered from T-shards); rows: this rank's T-shard (t0, t1) of the
    T_here positions a sequence has after the gather; run: the length of the runs of consecutive positions a rank
    holds."""

    def __init__(self, tp_comm=None, cp_comm=None, split_of=None, splits_T=False, rows=None, T_here=None):
        self.tp = tp_comm if tp_comm is not None and tp_comm.size > 1 else None
        self.cp = cp_comm if cp_comm is not None and cp_comm.size > 1 else None
        self.split_of, self.splits_T, self.rows, self.T_here = split_of, splits_T, rows, T_here

    def spread(self, name, role):
        """The Spread of operand `role` ("x", "w", "dy") of the linear whose weight is `name`."""
        cp = self.cp is not None
        if self.tp is None:
            return Spread(None, None, cp and role != "w")
        kind, axis = self.split_of(name)
        w_axis = axis if kind != "rep" else None                    # W (K, M): 0 along K, 1 along M
        if role == "w":
            return Spread("split" if w_axis is not None else "copy", w_axis, False)
        mine = 1 if (role == "x" and w_axis == 0) or (role == "dy" and w_axis == 1) else None
        if mine is not None:
            return Spread("split", 1, cp)
        gathered = self.splits_T and ((role == "x" and w_axis == 1) or (role == "dy" and w_axis == 0))
        return Spread("gathered" if gathered else "copy", 0 if gathered else None, cp)

    def reduce_over(self, spread, recipe, axis):
        """The communicators an amax of this operand is reduced over (MAX), for tiles along `axis`."""
        out = []
        if recipe.per_tensor:
            if spread.tp in ("split", "gathered"):
                out.append(self.tp)
            if spread.cp:
                out.append(self.cp)
        elif recipe.block is None:                                  # rowwise: the tiles run along axis
            if spread.tp == "split" and spread.tp_axis == axis % 2:
                out.append(self.tp)
            if spread.cp and axis % 2 == 0:
                out.append(self.cp)
        return out

    def share(self, spread, recipe, axis):
        """The communicators whose ranks hold the same tiles of this operand (their scales must agree)."""
        out = []
        if spread.tp == "copy" or spread.tp == "gathered" or (
                spread.tp == "split" and (recipe.per_tensor or (recipe.block is None and spread.tp_axis == axis % 2))):
            out.append(self.tp)
        if spread.cp and (recipe.per_tensor or (recipe.block is None and axis % 2 == 0)):
            out.append(self.cp)
        return [c for c in out if c is not None]

    def own_rows(self, x2, spread):
        """The rows of a gathered operand x2 (B T_here, K) that are this rank's T-shard (a per-tensor amax is taken
        on them, then reduced over tp: the cast before the All-Gather); x2 itself otherwise."""
        if spread.tp != "gathered":
            return x2
        t0, t1 = self.rows
        return x2.reshape(-1, self.T_here, x2.shape[-1])[:, t0:t1].reshape(-1, x2.shape[-1])   # (B (t1 - t0), K)


def layout_holders(cfg, tp_comm, S, ctx):
    """The Holders of a tensor-parallel stage: tp_comm and the scheme S's splits (hsgd.tp.schemes), the context
    layout ctx's cp_comm (none without context parallelism), the sequence scheme's T-shard of the T/cp positions."""
    cp_comm = getattr(ctx, "comm", None)
    T_here = cfg.seq_len // (cp_comm.size if cp_comm is not None else 1)
    return Holders(tp_comm, cp_comm, S.split_of, S.splits_T, S.rows(T_here, tp_comm) if S.splits_T else None,
                   T_here)


def reduce_max(amax, comms):
    """amax (an array) reduced in place by MAX over each communicator of comms; returns it."""
    for c in comms:
        c.Allreduce(amax, op=MPI.MAX)
    return amax


def check_same(scale, comms, what):
    """Raise ScaleMismatch on every rank of a communicator of comms whose ranks hold different `scale` arrays
    (Allreduce MIN and MAX: every rank of the communicator reaches the same verdict). The ranks of another group
    may find theirs equal and go on: in hsgd.train an exception on any rank ends the job (hsgd.grid.launch prints
    its traceback, the message last, and calls MPI_Abort), so nobody waits; a test that checks raises on every
    rank of the world (its bugs change the scales of every group alike)."""
    for c in comms:
        lo, hi = scale.copy(), scale.copy()
        c.Allreduce(lo, op=MPI.MIN)
        c.Allreduce(hi, op=MPI.MAX)
        if bool((lo != hi).any()):
            worst = float((hi / lo).max())
            raise ScaleMismatch(f"the {c.size} ranks of {c.name} that hold {what} cast it with different scales "
                                f"(largest ratio {worst:.6g}): its amax must be reduced over {c.name} "
                                f"(hsgd.fp8.domains)")


def check_blocks(cfg, block, tp, cp):
    """Refuse (ConfigError) a blockwise layout whose pieces would cut a tile: every dimension a 1 x b or b x b tile
    runs along, as one rank holds it, must be a multiple of b: d_model, d_ff and the attention's widths (per tp
    shard where tp splits them), and the runs of consecutive positions of a sequence (T, or T/(2 cp) with context
    parallelism; the weight gradient's tiles run along the tokens)."""
    C, F = cfg.d_model, cfg.d_ff
    widths = {"d_model": C, "d_ff": F, "the key/value width": cfg.kv_width}
    for what, size in widths.items():
        check_block(what, size, block)
        if tp > 1 and what != "the key/value width":
            check_block(f"one tp rank's share of {what}, {size}/{tp}", size // tp if size % tp == 0 else size, block)
    if tp > 1 and cfg.kv_width % tp == 0:
        check_block(f"one tp rank's share of the key/value width, {cfg.kv_width}/{tp}", cfg.kv_width // tp, block)
    run = cfg.seq_len // (2 * cp) if cp > 1 else cfg.seq_len
    check_block("the consecutive positions of a sequence a rank holds" + (f" (seq_len/(2 cp) = {run})" if cp > 1
                                                                            else f" (seq_len {run})"), run, block)


def check_fp8_layout(cfg, tc):
    """What an FP8 run can compute (ConfigError, one line, before any communication)."""
    if not tc.fp8:
        return
    if cfg.moe_experts:
        raise ConfigError("--fp8 with experts (--moe-experts) is not built: the experts' products would need their "
                          "own amax domains (their rows move between ranks); train the dense model in FP8, or the "
                          "experts in float32 / bfloat16")
    if cfg.n_kv_heads < tc.tp:
        raise ConfigError(f"--fp8 with n_kv_heads={cfg.n_kv_heads} below tp={tc.tp} is not built: each tp rank that "
                          "holds a copy of a key/value head has a partial dk, dv until they are summed, and an FP8 "
                          "cast of a partial sum is not the cast of the sum; use tp <= n_kv_heads")
    if getattr(tc, "fp8_allgather", False) and tc.zero != 3:
        raise ConfigError(f"--fp8-allgather casts the weights ZeRO-3 gathers, but this run has --zero {tc.zero}, which "
                          "gathers no weights before a forward; add --zero 3, or leave --fp8-allgather off")
    s = tc.fp8_settings()
    if s.recipe == "blockwise":
        check_blocks(cfg, s.block, tc.tp, tc.cp)
