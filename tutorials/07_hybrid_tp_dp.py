# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 7: hybrid tensor x data parallelism
#
# Chapters 5 and 6 split one copy of the model over tp ranks; chapter 4 made dp copies of the model, each training
# on its own rows of the batch. The lecture combines the two, and this is the algorithm `python -m hsgd.train`
# runs. Its section 2 (in translation):
#
# > We divide the P workers into G model-parallel groups of M workers each (P = G x M); inside a group the workers
# > use model parallelism. The G groups are data-parallel replicas of each other: each group holds a complete
# > model, but that model is stored and computed by the M workers of the group together. Each group works on a
# > different subset of the data; forward and backward passes run across the M workers of a group, with
# > communication inside the group; after the backward pass, the gradients of the *same parameter shard* are
# > aggregated across the groups.
#
# G and M are the lecture's names for hsgd's dp and tp (chapter 3): here P = dp x tp, with pp = 1.
#
# The reason for the combination (also section 2): a model of tens or hundreds of billions of parameters does not
# fit one worker, so pure data parallelism is out (chapter 4's memory table); pure model parallelism moves
# activations in every layer, and cannot use more workers than the model has heads or columns to split. Tensor
# parallelism makes the model fit, data parallelism multiplies the throughput. This chapter
#
# 1. draws the P = dp x tp grid and says which ranks talk to which, about what, and how often;
# 2. follows one hybrid step and checks every rank's gradient shard against the serial gradient of the global
#    batch, first by hand, then with `hsgd.verify`;
# 3. measures the bytes on each communicator in one step and explains every term of the formulas; a table of
#    layouts shows the trade-off between the two dimensions;
# 4. computes the global gradient norm for clipping when some parameters are split and others replicated;
# 5. trains for a few dozen steps with `hsgd.train.train` and ends with the parameters of serial SGD.
#
# Run it with eight ranks (a few seconds; on failure every rank raises, so it exits non-zero without hanging):
#
# mpirun -n 8 python tutorials/07_hybrid_tp_dp.py
#
# The notebook form (`jupytext --to ipynb tutorials/07_hybrid_tp_dp.py`) is for reading: the code needs eight MPI
# ranks. Only rank 0 prints.
#
# Legend: P ranks, dp replicas (groups), tp ranks per group, B global batch, b = B/dp sequences per group, k =
# micro_batches per group, N = (b/k)*T positions of a micro-batch, T sequence, C d_model, NH heads, F d_ff, V
# vocabulary, Vp = ceil(V/tp), L layers, s bytes per number.

# %%
import io
import math
import sys
from dataclasses import replace

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from hsgd import ModelConfig, serial, tp_model
from hsgd.data import Corpus
from hsgd.dp import FlatBuffer, dp_average, dp_formula, dp_rows, params_digest
from hsgd.grid import ProcessGrid
from hsgd.hybrid import HybridTrainer
from hsgd.optim import clip_grads, global_grad_norm
from hsgd.train import fmt_bytes, train
from hsgd.verify import verify

from checks import FLOOR, Checks, rel_err, train_config   # tutorials/checks.py, shared by the chapters

threadpool_limits(1)                    # eight ranks share the cores, tiny matrices: one BLAS thread each
P, DP, TP = 8, 4, 2                     # P = dp x tp: 4 groups of 2
world = MPI.COMM_WORLD
if world.Get_size() != P:               # every rank exits non-zero; rank 0 says why
    raise SystemExit(f"run this chapter on {P} ranks: mpirun -n {P} python {__file__}"
                     if world.Get_rank() == 0 else 1)
grid = ProcessGrid(world, dp=DP, tp=TP)
TOL = 1e-10                             # float64: parallel and serial differ by rounding, ~1e-16 relative
check = Checks(world, tol=TOL, width=66)  # check(what, err, tol): collective, raises on every rank unless err < tol
say = check.say                           # print on world rank 0 only


def shard_err(local, full, tp_rank, tp, floor=FLOOR):
    """The largest rel_err of this rank's shards against the matching slices of full (serial) arrays."""
    return max(rel_err(local[n], tp_model.shard(full[n], n, tp_rank, tp), floor) for n in local)


cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=8, n_layers=2, d_ff=128)   # NH, F split 1..8 ways
SEED = 0
corpus = Corpus.load(None, cfg.seq_len) # the built-in corpus (the Python standard library's source), as hsgd.train
say(f"{P} ranks = dp {DP} groups x tp {TP} workers; model {cfg.n_params():,} parameters "
    f"(L={cfg.n_layers} C={cfg.d_model} NH={cfg.n_heads} F={cfg.d_ff} T={cfg.seq_len} V={cfg.vocab_size})")

# %% [markdown]
# ## 1. The grid, and who talks to whom
#
# `ProcessGrid(world, dp=4, tp=2)` (chapter 3) numbers the ranks tp fastest, `rank = dp_rank * tp + tp_rank`, and
# splits two communicators off the world:
#
# * **`tp_comm`, a row of the picture**: the tp ranks of one group, which hold one copy of the model between them.
#   They talk **in every layer**, forward and backward: with Megatron's scheme (chapter 6) an All-Reduce of the
#   partial sums of the (N, C) activations after the attention projection and after the MLP projection, and of
#   the partial input gradients before q, k, v and before fc. The next layer cannot start before that exchange is
#   done, so this traffic sits on the critical path: on a cluster it belongs on the fast links inside a node, which
#   is what numbering tp fastest gives (consecutive ranks share a node).
# * **`dp_comm`, a column**: the dp ranks, one per group, that sit at the same position and so hold the **same
#   shard** of every parameter. They talk **once per step**: the All-Reduce that averages the gradient of their
#   shard (chapter 4's `dp_average`, on a shard instead of a whole model). This is the lecture's section 3.4:
#   "all the 'first GPUs' of the tensor-parallel groups hold W_part1; they form a cross-group communication set
#   and All-Reduce the gradient of this shard".
#
# The data goes by rows of the picture (every rank of a group reads the same rows of the global batch,
# `dp_rows(B, dp, dp_rank)`), the parameters by columns. The picture is drawn from `grid.groups()`, which computes
# the members of every communicator from the sizes alone:

# %%
B = 8                                   # global batch: b = B/dp = 2 sequences per group
groups = grid.groups()                  # {"tp": [[0, 1], [2, 3], ...], "dp": [[0, 2, 4, 6], [1, 3, 5, 7]], ...}
nh, Fp, Vp = cfg.n_heads // TP, cfg.d_ff // TP, math.ceil(cfg.vocab_size / TP)
width = 11                              # of a column of the picture
say((" " * 15 + "".join(f"{f'tp_rank {t}':^{width}}" for t in range(TP))).rstrip())
for d, members in enumerate(groups["tp"]):
    rows = dp_rows(B, DP, d)
    say(f"{f'group dp {d}:':<15}" + "".join(f"{r:^{width}}" for r in members)
        + f"  <- tp_comm {members}: rows [{rows.start}, {rows.stop}) of the batch, every layer")
say((" " * 15 + "".join(f"{'^':^{width}}" for _ in range(TP))).rstrip())
for t, members in enumerate(groups["dp"]):
    say(f"  dp_comm {members}: shard {t} (heads {t * nh}..{(t + 1) * nh - 1}, MLP columns {t * Fp}..{(t + 1) * Fp - 1},"
        f" vocab ids {t * Vp}..{(t + 1) * Vp - 1}), once per step")

# %% [markdown]
# Each rank builds its shards with `tp_model.init_params` (the slices of `serial.init_params` for the seed), so the
# statement "columns hold the same shard, rows hold different shards and the same data" can be checked with
# digests: along `dp_comm` every rank must have the same parameters and different rows of the batch, along
# `tp_comm` different parameters and the same rows.

# %%
tc = train_config(tp=TP, dp=DP, batch_size=B, seed=SEED)
trainer = HybridTrainer(cfg, grid, tc)                        # my shards (float64) and a FlatBuffer for their gradients
idx, targets = corpus.batch(SEED, 1, B)                       # (B, T): the global batch of step 1, on every rank
rows = dp_rows(B, DP, grid.dp_rank)                           # my group's rows
p_digest = params_digest(trainer.params)
d_digest = params_digest({"idx": idx[rows]})
same = {name: (len(set(comm.allgather_obj(p_digest))), len(set(comm.allgather_obj(d_digest))))
        for name, comm in (("dp", grid.dp_comm), ("tp", grid.tp_comm))}   # (distinct shards, distinct slices)
n_local = sum(p.size for p in trainer.params.values())
members = {n: c.allgather_obj(grid.rank) for n, c in (("tp", grid.tp_comm), ("dp", grid.dp_comm))}
say(f"rank 0 holds {n_local:,} of the {cfg.n_params():,} parameters: 1/{TP} of the split ones, and the LayerNorms, "
    "wpe and the row-parallel biases whole")
check.holds("my tp_comm and dp_comm members are groups of grid.groups()", all(members[n] in groups[n] for n in members))
check.equal("dp_comm: (distinct shards, distinct data slices) == (1, dp)", same["dp"], (1, DP))
check.equal("tp_comm: (distinct shards, distinct data slices) == (tp, 1)", same["tp"], (TP, 1))

# %% [markdown]
# ## 2. One hybrid step, checked against serial
#
# The lecture's sections 3.2 to 3.5 as `HybridTrainer.step` runs them (hsgd/hybrid.py):
#
# 1. group g takes rows $[g\,b, (g+1)\,b)$ of the global batch; every rank of the group reads the same rows;
# 2. the group runs the tensor-parallel forward and backward on them (collectives on `tp_comm` inside
#    `tp_model.loss_and_grads`). Each rank ends with **its shard of the gradient of its group's slice**: the group
#    is an exact tensor-parallel model of its $b$ sequences (chapter 6);
# 3. the ranks of each `dp_comm` All-Reduce their shard's gradient and divide by dp. By chapter 4's argument (the
#    loss is a mean, the slices are equal), $\frac{1}{dp}\sum_g$ shard of $\nabla\text{loss}_g$ = shard of
#    $\frac{1}{dp}\sum_g \nabla\text{loss}_g$ = **shard of the serial gradient of the global batch**: slicing and
#    averaging commute, because both are linear;
# 4. every rank updates its shard with that gradient (section 3.5; the update is elementwise, so the shard of the
#    serial update).
#
# By hand first, with the pieces of hsgd, and checking after steps 2 and 3. The serial references, on the slice
# and on the whole batch, are cheap for this toy, and every rank computes them itself:

# %%
full = serial.init_params(cfg, seed=SEED, dtype="float64")              # the serial model, on every rank
local = tp_model.shard_params(full, grid.tp_rank, TP)                   # my shards of it (= trainer.params)
_, grads_slice = serial.loss_and_grads(full, idx[rows], targets[rows], cfg)     # serial gradient of my slice
loss_ref, grads_ref = serial.loss_and_grads(full, idx, targets, cfg)            # ... of the global batch

buf = FlatBuffer(local)                                                 # my gradient shards, one flat buffer
loss_g, _ = tp_model.loss_and_grads(local, idx[rows], targets[rows], cfg, grid.tp_comm, grads=buf.views)
check("step 2: my shard of my group's gradient vs serial, on the slice", shard_err(buf.views, grads_slice,
                                                                                   grid.tp_rank, TP))
say(f"  (the same shard against the global batch's gradient, before averaging: "
    f"{shard_err(buf.views, grads_ref, grid.tp_rank, TP):.2f}: one group's slice is not the batch)")
dp_average(buf, grid.dp_comm)                                           # Allreduce over dp_comm, / dp
check("step 3: my shard after dp_average vs serial, global batch", shard_err(buf.views, grads_ref, grid.tp_rank, TP))
loss_avg = grid.dp_comm.comm.allreduce(loss_g) / DP                     # metadata: one float
check("loss: mean over the groups vs serial loss of the global batch", abs(loss_avg - loss_ref) / loss_ref)

trainer.gradients(idx, targets)                                         # the same steps 1-3, as training runs them
check("HybridTrainer.gradients vs the steps by hand: max |difference|",
      max(float(np.max(np.abs(trainer.grads[n] - buf.views[n]))) for n in local))

# %% [markdown]
# `hsgd.verify` is the same check as a tool: one step of `HybridTrainer.gradients` and a table of the largest
# error of any rank's shard of every parameter, exit code 0 when every one is within the float64 tolerance
# ($10^{-10}$). On the command line:
#
#     mpirun -n 8 python -m hsgd.verify                      # tp = 2, dp = 4
#     mpirun -n 8 python -m hsgd.verify --tp 4 --tp-scheme gather --micro-batches 2
#
# Here it is called as a function, on the layout above and on dp = 2, tp = 4 with the lecture's All-Gather
# scheme and two micro-batches; a few lines of each report:

# %%
for layout in (dict(dp=4, tp=2), dict(dp=2, tp=4, tp_scheme="gather", micro_batches=2)):
    report = io.StringIO()
    ok, _ = verify(cfg, train_config(batch_size=B, seed=SEED, **layout), world, out=report)
    lines = report.getvalue().splitlines()                             # rank 0's report; empty elsewhere
    say("\n".join(lines[:4] + ["    ..."] + lines[-2:]) + "\n")
    check.holds(f"hsgd.verify {layout}: PASS", ok)

# %% [markdown]
# ## 3. What one step sends, and where
#
# The grid's `CommStats` records every collective under (communicator, operation). A snapshot of the counts before
# and after one `HybridTrainer.step` gives the traffic of a step on each rank, to compare with the formulas:
#
# **tp_comm**, per micro-batch of N = (b/k) T positions, Megatron's scheme (`tp_model.comm_formula`):
# $4L + 4$ All-Reduces, $((4L + 2)C + 3)\,N s$ bytes. Term by term:
#
# * $L \cdot 4 \cdot NCs$: in each block the forward All-Reduces the partial sums of the attention projection and
#   of the MLP projection ($g$), the backward the partial input gradients of q, k, v and of fc ($f$), each (N, C);
# * $NCs$: the vocab-parallel embedding (every rank looks up the tokens it owns, zeros elsewhere; the sum puts the
#   rows together);
# * $NCs$: the LM head's input gradient, partial over the vocabulary shards ($f$ backward);
# * $3Ns$: the vocab-parallel cross-entropy, a MAX of (N,) and a SUM of (2, N).
#
# With $k$ micro-batches all of it happens $k$ times on $N/k$ of the positions: $k$ times the calls, the same bytes.
# It grows with the activations, $B\,T\,C$ per layer, and does not depend on the number of parameters.
#
# **dp_comm**, once per step (`dp.dp_formula`): one All-Reduce of the rank's whole gradient buffer, the split
# parameters' $1/tp$ shares plus the replicated ones (LayerNorms, `wpe`, the row-parallel biases) plus the
# vocabulary padding. It grows with the number of parameters over tp, and does not depend on the batch.
#
# Not recorded: the loss and the squared gradient norm (section 4) travel as single pickled floats.
#
# Measured for two layouts of the 8 ranks, with $k$ = 2 micro-batches:

# %%
def step_traffic(grid, tc, step=1):
    """{(comm, op): (calls, bytes)} of one HybridTrainer.step on this rank, and the trainer."""
    trainer = HybridTrainer(cfg, grid, tc)
    idx, targets = corpus.batch(tc.seed, step, tc.batch_size)
    before = grid.stats.counts()
    trainer.step(idx, targets, step)
    return grid.stats.since(before), trainer


def expected_traffic(cfg, tc, params):
    """comm_formula for one micro-batch, times micro_batches, plus dp_formula: what one step should send."""
    k = tc.micro_batches
    per_mb = tp_model.comm_formula(cfg, tc.batch_size // tc.dp // k, params["wte"].itemsize, tc.tp_scheme)
    out = {key: (calls * k, nbytes * k) for key, (calls, nbytes) in per_mb.items()}
    out.update(dp_formula(params))
    return out


measured = {}
for dp_, tp_ in ((4, 2), (2, 4)):
    g2 = grid if (dp_, tp_) == (DP, TP) else ProcessGrid(world, dp=dp_, tp=tp_)
    tc2 = train_config(tp=tp_, dp=dp_, batch_size=B, micro_batches=2, seed=SEED)
    counts, tr = step_traffic(g2, tc2)
    formula = expected_traffic(cfg, tc2, tr.params)
    measured[tp_] = counts
    say(f"dp={dp_} tp={tp_}, micro_batches=2, B={B}: one step on rank 0 (calls, bytes)")
    for key in sorted(set(counts) | set(formula)):
        say(f"  {key[0]:<3} {key[1]:<10} measured {str(counts.get(key, (0, 0))):<14} formula "
            f"{formula.get(key, (0, 0))}")
    check.equal(f"dp={dp_} tp={tp_}: one step's traffic == comm_formula x k + dp_formula", counts, formula)
    if g2 is not grid:
        g2.free()

# %% [markdown]
# The formulas give the same numbers for any layout without running it. Per rank and step, for the 8 ranks as
# dp x tp with $k$ = 1 (a "-" is a communicator of one rank, which moves nothing):

# %%
def local_numel(cfg, tp):
    """Parameters on one rank: split ones / tp (vocabulary padded to tp * ceil(V/tp)), replicated ones whole."""
    total = 0
    for name, shape in cfg.param_shapes().items():
        kind, axis = tp_model.split_of(name)
        n = math.prod(shape)
        total += n if kind == "rep" else n // shape[axis] * (math.ceil(shape[axis] / tp) if kind == "vocab"
                                                             else shape[axis] // tp)
    return total


def layout_table(cfg, batch, s, tps, measured=None):
    """Rows of per-rank traffic for P = 8 ranks as (8/tp) x tp: formula bytes of tp_comm and dp_comm."""
    lines = [f"{'dp x tp':>7} {'b':>5} {'params/rank':>12} {'tp_comm/step':>13} {'dp_comm/step':>13}"
             + ("   measured (tp, dp)" if measured else "")]
    for tp in tps:
        dp = P // tp
        tp_bytes = sum(n for _, n in tp_model.comm_formula(cfg, batch // dp, s).values())
        dp_bytes = local_numel(cfg, tp) * s
        line = (f"{f'{dp} x {tp}':>7} {batch // dp:>5} {local_numel(cfg, tp):>12,} "
                f"{fmt_bytes(tp_bytes) if tp > 1 else '-':>13} {fmt_bytes(dp_bytes) if dp > 1 else '-':>13}")
        if measured and tp in measured:
            m = measured[tp]
            line += (f"   {fmt_bytes(sum(n for (c, _), (_, n) in m.items() if c == 'tp')):>9}, "
                     f"{fmt_bytes(sum(n for (c, _), (_, n) in m.items() if c == 'dp'))}")
        lines.append(line)
    return "\n".join(lines)


say(f"this toy, B = {B}, float64:")
say(layout_table(cfg, B, 8, (1, 2, 4, 8), measured))
check.equal("local_numel(cfg, tp) == the trainer's shard sizes", local_numel(cfg, TP), n_local)

gpt2 = ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072)
say(f"\nGPT-2 small's shape ({gpt2.n_params() / 1e6:.0f} M parameters), B = 32 sequences of 1024, float32 "
    "(tp = 8 does not divide its 12 heads):")
say(layout_table(gpt2, 32, 4, (1, 2, 4)))

# %% [markdown]
# Read the columns against each other. At a fixed P and global batch, doubling tp halves dp, so each group gets
# twice the rows ($b = B\,tp/P$): the tensor-parallel payload per rank, proportional to $b\,T\,C\,L$, doubles,
# while the data-parallel payload, proportional to the parameters over tp, roughly halves (the replicated
# parameters do not shrink). Which total is smallest depends on the ratio of activations to parameters: for the
# toy, whose parameters outweigh its tiny batch, tp = 2 moves the least; for GPT-2's shape the activations dominate
# and pure data parallelism would move the least, if the model fitted. The lecture's point is that for a large
# model tp must be at least what makes the model fit on the ranks of a group. Past that, the two payloads are not
# equally expensive: the tensor-parallel one comes in $4L + 4$ pieces on the critical path of every layer, hence
# inside a node; the data-parallel one comes once per step and can overlap the backward pass (the lecture's section
# 4.1, a later chapter). (These are payloads; a ring All-Reduce sends about $2\frac{n-1}{n}$ times the payload per
# rank.)
#
# ## 4. The global gradient norm, for clipping
#
# Clipping rescales the whole gradient when its norm exceeds a threshold, $g \leftarrow g \cdot \min(1, c/\lVert
# g\rVert)$. In serial SGD that norm is over every parameter. On the grid no rank holds the whole gradient, and
# naive sums get it wrong in two ways: a split parameter's squares are spread over the tp ranks of a group, and a
# replicated parameter's squares are on all of them. `optim.global_grad_norm` adds each kind correctly:
#
# $$\lVert g\rVert^2 = \sum_{\text{split } p} \ \sum_{i=1}^{tp} \lVert g_{p,i} \rVert^2
# \;+\; \sum_{\text{replicated } p} \lVert g_p \rVert^2 ,$$
#
# the first sum with one All-Reduce of a float over `tp_comm`, the second counted once, locally (every rank of the
# group holds the same replicated gradients). Nothing is needed over `dp_comm`: after `dp_average` every replica
# holds the same gradient and computes the same norm. Every rank then scales by the same factor, so the clipped
# update is still the shard of serial SGD's clipped update.

# %%
norm = global_grad_norm(trainer.grads, trainer.is_sharded, grid.tp_comm)   # trainer.grads: step 1's, averaged
serial_norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads_ref.values()))
mine = sum(float(np.sum(g * g)) for g in trainer.grads.values())          # all my squares
every_rank_once = math.sqrt(grid.tp_comm.comm.allreduce(mine))           # wrong: replicated ones tp times
say(f"serial norm of the global batch's gradient       {serial_norm:.12f}")
say(f"global_grad_norm on the grid                     {norm:.12f}")
say(f"wrong: my shards only                            {math.sqrt(mine):.12f}")
say(f"wrong: everything summed over tp_comm            {every_rank_once:.12f}")
norms = world.allgather(norm)
check("global_grad_norm vs serial norm", abs(norm - serial_norm) / serial_norm, 1e-12)
check("global_grad_norm: spread over all 8 ranks", (max(norms) - min(norms)) / serial_norm, 1e-15)
factor = clip_grads(trainer.grads, norm, 0.5 * norm)                        # clip to half the norm
clipped_ref = {n: g * factor for n, g in grads_ref.items()}
check("clipped to half the norm: my shards vs serial clipped gradient", shard_err(trainer.grads, clipped_ref,
                                                                                   grid.tp_rank, TP))

# %% [markdown]
# ## 5. Training, and the check against serial SGD
#
# `hsgd.train.train(cfg, tc, world)` is the whole loop of `mpirun -n 8 python -m hsgd.train` (default tp = 2,
# dp = 4; `--tp 4` for the other layout, `--help` for the rest): the batch of each step from (seed, step),
# `HybridTrainer.step`, progress lines with the step time split into compute, tp and dp communication, the
# validation loss before and after, and the bytes per step against the formulas. Here in float64, 30 steps of SGD
# with momentum, a warm-up, a cosine schedule and clipping at 1.0. Its output, from rank 0:

# %%
tc = train_config(tp=TP, dp=DP, steps=30, batch_size=B, warmup=5, clip=1.0, seed=SEED, eval_batches=2,
                  log_interval=10)
run = train(cfg, tc, world, out=sys.stdout)           # rank 0 prints; every rank returns its summary
losses = run["losses"]
say(f"\ntraining loss: first step {losses[0]:.3f}, mean of the last 5 {np.mean(losses[-5:]):.3f}")
check.holds("training loss fell by at least 1.0", np.mean(losses[-5:]) < losses[0] - 1.0)
check.holds("validation loss fell", run["val_after"] < run["val_before"])

# %% [markdown]
# The reference: serial mini-batch SGD on one process, the whole batch of every step, the same optimizer, schedule
# and clipping (the serial norm), `serial.sgd`. Rank 0 runs it, and once more without clipping to show that the
# clipping was active, and broadcasts the result; every rank compares its shards with the matching slices. As in
# chapter 4 the error is relative to each parameter's largest entry, but at least to 0.02, the scale of the
# initialization: the attention k-biases start at zero and only ever receive rounding noise.

# %%
reference = None
if grid.rank == 0:
    batch = lambda step: corpus.batch(tc.seed, step, tc.batch_size)          # the global batch of every step
    ref, ref_losses = serial.sgd(cfg, tc, batch)
    unclipped, _ = serial.sgd(cfg, replace(tc, clip=0.0), batch)
    reference = (ref, ref_losses, max(rel_err(unclipped[n], ref[n], floor=0.02) for n in ref))
ref, ref_losses, clip_effect = world.bcast(reference, root=0)   # a small model: a pickled broadcast is fine

param_errs = {n: rel_err(p, tp_model.shard(ref[n], n, grid.tp_rank, TP), floor=0.02) for n, p in run["params"].items()}
worst = max(param_errs, key=param_errs.get)
replicas = len(set(grid.dp_comm.allgather_obj(params_digest(run["params"]))))
say(f"serial SGD without clipping ends {clip_effect:.1e} away (rel) from serial SGD with it; largest parameter "
    f"difference of the grid on rank 0: {worst} {param_errs[worst]:.1e}")
check.holds("clipping was active: serial SGD without it ends > 1e-3 away", clip_effect > 1e-3)
check(f"{tc.steps} steps: losses vs serial SGD", max(abs(a - b) / b for a, b in zip(losses, ref_losses)), 1e-9)
check(f"{tc.steps} steps: every rank's shards vs serial SGD's parameters", max(param_errs.values()), 1e-9)
check.equal("distinct digests of the DP replicas of each shard", replicas, 1)

# %% [markdown]
# ## Check against serial
#
# On 8 ranks as 4 groups of 2 (and, through `hsgd.verify` and the traffic measurement, as 2 groups of 4), every
# verdict reached collectively: each group's tensor-parallel gradient is the shard of the serial gradient of its
# slice; after the All-Reduce over `dp_comm` it is the shard of the serial gradient of the global batch; the bytes
# on `tp_comm` and `dp_comm` are exactly `comm_formula` x k and `dp_formula`; the global gradient norm is the
# serial one on every rank; and 30 steps of hybrid SGD with momentum and clipping end with serial SGD's parameters,
# the replicas of every shard bit-identical.

# %%
worst, err = check.worst()
say(f"\nchapter 6: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error {err:.1e} "
    f"({worst})")
grid.free()
