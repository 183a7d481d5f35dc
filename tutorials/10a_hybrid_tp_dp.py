# %% [markdown]
# # Chapter 10: hybrid tensor x data parallelism
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
# 3. measures the bytes on each communicator in one step and explains every term of the formulas, in two columns
#    (the payload, and the bytes a ring sends per rank); a table of layouts shows the trade-off between the two
#    dimensions;
# 4. computes the global gradient norm for clipping when some parameters are split and others replicated;
# 5. trains for 30 steps with `hsgd.train.train` and ends with the parameters of serial SGD.
#
# Run it with eight ranks (about 8 s on a 2-core machine; on failure every rank raises, so it exits non-zero
# without hanging). Rank 0 draws two pictures into `$HSGD_FIGURES` (default `tutorials/figures/`):
#
# mpirun -n 8 python tutorials/10a_hybrid_tp_dp.py
#
# The notebook form (`jupytext --to ipynb tutorials/10a_hybrid_tp_dp.py`) is for reading: the code needs eight MPI
# ranks. Only rank 0 prints.
#
# Legend: P ranks, dp replicas (groups), tp ranks per group, B global batch, b = B/dp sequences per group, k =
# micro_batches per group, T sequence, N = b*T positions of a group's slice in one step (its k micro-batches
# together, N/k each), C d_model, NH heads, F d_ff, V vocabulary, Vp = ceil(V/tp), L layers, s bytes per number.

# %%
from hsgd.model.config import ModelConfig   # hsgd before NumPy: it sets OpenBLAS's thread timeout (hsgd.model.threads)
from hsgd.model import serial
from hsgd.tp import model as tp_model, shards as tp_shards

import io
import math
import sys
from dataclasses import replace

import numpy as np

from hsgd.model.data import Corpus
from hsgd.dp.average import FlatBuffer, dp_average, dp_formula, dp_rows, params_digest
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.model.optim import clip_grads, global_grad_norm
from hsgd.train import train
from hsgd.run.report import fmt_bytes
from hsgd.verify import verify

import pictures                                            # tutorials/pictures.py: where the PNGs go
from checks import FLOOR, mpi_chapter, rel_err, ring_share, train_config

P, DP, TP = 8, 4, 2                     # P = dp x tp: 4 groups of 2
TOL = 1e-10                             # float64: parallel and serial differ by rounding, ~1e-16 relative
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, P, tol=TOL, width=66)
grid = ProcessGrid(world, dp=DP, tp=TP)


def shard_err(local, full, tp_rank, tp, floor=FLOOR):
    """The largest rel_err of this rank's shards against the matching slices of full (serial) arrays."""
    return max(rel_err(local[n], tp_shards.shard(full[n], n, tp_rank, tp), floor) for n in local)


cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=8, n_layers=2, d_ff=128)   # NH, F split 1..8 ways
SEED = 0
corpus = Corpus.load(None, cfg.seq_len) # the built-in corpus (the Python standard library's source), as hsgd.train
say(f"{P} ranks = dp {DP} groups x tp {TP} workers; model {cfg.n_params():,} parameters "
    f"(L={cfg.n_layers} C={cfg.d_model} NH={cfg.n_heads} F={cfg.d_ff} T={cfg.seq_len} V={cfg.vocab_size})")

# %% [markdown]
# ## 1. The grid, and who talks to whom
#
# `ProcessGrid(world, dp=4, tp=2)` (chapter 3) numbers the ranks tp fastest, then pp, then dp:
# `rank = (dp_rank * pp + pp_rank) * tp + tp_rank`, here with pp = 1 simply `dp_rank * tp + tp_rank`. tp is
# innermost because its traffic comes in every layer, on the critical path, and for models of real size it is the
# largest (the GPT-2 rows of section 3): on a cluster it must stay on the node's fastest links, and consecutive
# ranks share a node. dp is outermost, so that each data-parallel replica (one pipeline of tp-groups; here one
# tp-group) is a contiguous block of ranks, the lecture's G groups of M consecutive workers. The grid splits two
# communicators off the world:
#
# * **`tp_comm`, a row of the printout below (a blue bar in the picture)**: the tp ranks of one group, which hold
#   one copy of the model between them. They talk **in every layer**, forward and backward: with Megatron's
#   scheme (chapters 5 and 6) an All-Reduce of the partial sums of the (b, T, C) activations after the attention
#   projection and after the MLP projection, and of the partial input gradients before q, k, v and before fc. The
#   next layer cannot start before that exchange is done, so this traffic sits on the critical path.
# * **`dp_comm`, a column (a red dashed line)**: the dp ranks, one per group, that sit at the same position and
#   so hold the **same shard** of every parameter. They talk **once per step**: the All-Reduce that averages the
#   gradient of their shard (chapter 4's `dp_average`, on a shard instead of a whole model). This is the lecture's
#   section 3.4: "all the 'first GPUs' of the tensor-parallel groups hold W_part1; they form a cross-group
#   communication set and All-Reduce the gradient of this shard".
#
# The data goes by rows of the printout (every rank of a group reads the same rows of the global batch,
# `dp_rows(B, dp, dp_rank)`), the parameters by columns. The printout is computed from `grid.groups()`, which
# gives the members of every communicator from the sizes alone; the picture is `pictures.grid`, drawn from the same
# numbering. (Megatron-LM orders the other way round at the slow end: its default `order="tp-cp-ep-dp-pp"` puts
# tp fastest too but pp slowest, because pp carries the least, one activation per micro-batch between neighbours.
# With hsgd's order the dp All-Reduce is what crosses nodes, once per step and overlappable; with Megatron's, the
# pipeline's point-to-point sends do. Both keep tp inside the node.)

# %%
B = 8                                   # global batch: b = B/dp = 2 sequences per group
groups = grid.groups()                  # {"tp": [[0, 1], [2, 3], ...], "dp": [[0, 2, 4, 6], [1, 3, 5, 7]], ...}
nh, Fp, Vp = cfg.n_heads // TP, cfg.d_ff // TP, math.ceil(cfg.vocab_size / TP)
width = 11                              # of a column of the printout
say((" " * 15 + "".join(f"{f'tp_rank {t}':^{width}}" for t in range(TP))).rstrip())
for d, members in enumerate(groups["tp"]):
    rows = dp_rows(B, DP, d)
    say(f"{f'group dp {d}:':<15}" + "".join(f"{r:^{width}}" for r in members)
        + f"  <- tp_comm {members}: rows [{rows.start}, {rows.stop}) of the batch, every layer")
say((" " * 15 + "".join(f"{'^':^{width}}" for _ in range(TP))).rstrip())
for t, members in enumerate(groups["dp"]):
    say(f"  dp_comm {members}: shard {t} (heads {t * nh}..{(t + 1) * nh - 1}, MLP columns {t * Fp}..{(t + 1) * Fp - 1},"
        f" vocab ids {t * Vp}..{(t + 1) * Vp - 1}), once per step")
path = pictures.on_rank0(world, lambda: pictures.grid(DP, 1, TP, "10_grid_dp4_tp2"))
say(f"picture: {path}")

# %% [markdown]
# Each rank builds its shards with `tp_shards.init_params` (the slices of `serial.init_params` for the seed), so the
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
# The lecture's sections 3.2 to 3.5 as `HybridTrainer.step` runs them (hsgd/step/trainer.py):
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
local = tp_shards.shard_params(full, grid.tp_rank, TP)                   # my shards of it (= trainer.params)
_, grads_slice = serial.loss_and_grads(full, idx[rows], targets[rows], cfg)     # serial gradient of my slice
loss_ref, grads_ref = serial.loss_and_grads(full, idx, targets, cfg)            # ... of the global batch

buf = FlatBuffer(local)                                                 # my gradient shards, one flat buffer
setup = tp_model.TPSetup(cfg, grid.tp_comm)                             # the model on my tp group (megatron)
loss_g, _ = tp_model.loss_and_grads(local, idx[rows], targets[rows], setup, grads=buf.views)
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
# The grid's `CommStats` records every collective under (communicator, operation): the calls and the **payload**,
# the size of the logical tensor of each call. A snapshot of the counts before and after one `HybridTrainer.step`
# gives the traffic of a step on each rank, to compare with the formulas. N = b T is, as in the legend, the positions
# of a group's slice in one step; each of its k micro-batches carries N/k of them.
#
# **tp_comm**, Megatron's scheme (`tp_model.comm_formula`): each micro-batch makes $4L + 4$ All-Reduces carrying
# $((4L + 2)C + 3)\,\frac{N}{k}\,s$ bytes, so one step makes $k(4L + 4)$ calls carrying
# $((4L + 2)C + 3)\,N s$ bytes: k times the calls, the same bytes as one micro-batch of all N positions. Term by
# term, for a micro-batch of $n = N/k$ positions:
#
# * $L \cdot 4 \cdot nCs$: in each block the forward All-Reduces the partial sums of the attention projection and
#   of the MLP projection ($g$), the backward the partial input gradients of q, k, v and of fc ($f$), each (n, C);
# * $nCs$: the vocab-parallel embedding (every rank looks up the tokens it owns, zeros elsewhere; the sum puts the
#   rows together);
# * $nCs$: the LM head's input gradient, partial over the vocabulary shards ($f$ backward);
# * $3ns$: the vocab-parallel cross-entropy, a MAX of (n,) and a SUM of (2, n).
#
# It grows with the activations of the group's slice, $N C$ per layer, and does not depend on the number of
# parameters.
#
# **dp_comm**, once per step (`dp.dp_formula`): one All-Reduce of the rank's whole gradient buffer, the split
# parameters' $1/tp$ shares plus the replicated ones (LayerNorms, `wpe`, the row-parallel biases) plus the
# vocabulary padding. It grows with the number of parameters over tp, and does not depend on the batch.
#
# **On the wire.** A ring All-Reduce over a communicator of p ranks sends $2\frac{p-1}{p}$ times its payload from
# every rank (chapter 2): $\times 2\frac{tp-1}{tp}$ on `tp_comm`, $\times 2\frac{dp-1}{dp}$ on `dp_comm`. Every
# comparison below gives both columns, since a ratio of payloads is not a ratio of bytes sent.
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


measured = {}                                            # tp -> {(comm, op): (calls, bytes)} of one step
for dp_, tp_ in ((4, 2), (2, 4)):
    g2 = grid if (dp_, tp_) == (DP, TP) else ProcessGrid(world, dp=dp_, tp=tp_)
    tc2 = train_config(tp=tp_, dp=dp_, batch_size=B, micro_batches=2, seed=SEED)
    counts, tr = step_traffic(g2, tc2)
    formula = expected_traffic(cfg, tc2, tr.params)
    measured[tp_] = counts
    say(f"dp={dp_} tp={tp_}, micro_batches=2, B={B}: one step on rank 0 (calls, payload bytes), and a ring's bytes")
    for key in sorted(set(counts) | set(formula)):
        p = tp_ if key[0] == "tp" else dp_                   # ranks of the communicator
        calls, nbytes = counts.get(key, (0, 0))
        sent = float(ring_share(key[1], p) * nbytes)
        say(f"  {key[0]:<3} {key[1]:<10} measured {str((calls, nbytes)):<14} "
            f"formula {str(formula.get(key, (0, 0))):<14} ring, sent per rank {sent:>9,.0f}")
    check.equal(f"dp={dp_} tp={tp_}: one step's traffic == comm_formula x k + dp_formula", counts, formula)
    if g2 is not grid:
        g2.free()

# %% [markdown]
# The formulas give the same numbers for any layout without running it. Per rank and step, for the 8 ranks as
# dp x tp, in both columns (a "-" is a communicator of one rank, which moves nothing). The bytes do not depend on
# k, so the k = 1 formula must give what was just measured with k = 2:

# %%
def layout_bytes(cfg, batch, s, tp):
    """{"tp", "dp": (payload, ring bytes per rank)} of one step for P ranks as (P/tp) x tp, from the formulas. A
    communicator of one rank moves nothing: 0 (CommStats still counts its calls, as the formulas do)."""
    dp = P // tp
    tp_payload = sum(n for _, n in tp_model.comm_formula(cfg, batch // dp, s).values()) if tp > 1 else 0
    dp_payload = tp_shards.shard_numel(cfg, tp) * s if dp > 1 else 0
    return {c: (n, float(ring_share("Allreduce", p) * n))
            for c, n, p in (("tp", tp_payload, tp), ("dp", dp_payload, dp))}


def layout_table(cfg, batch, s, tps):
    """The per-rank traffic of P = 8 ranks as (8/tp) x tp: payload and ring bytes on each communicator, summed."""
    lines = [f"{'dp x tp':>7} {'b':>3} {'params/rank':>12} | {'tp_comm payload':>15} {'ring':>10} | "
             f"{'dp_comm payload':>15} {'ring':>10} | {'sum: payload':>12} {'ring':>10}"]
    for tp in tps:
        dp, x = P // tp, layout_bytes(cfg, batch, s, tp)
        tp_cells = [fmt_bytes(v) if tp > 1 else "-" for v in x["tp"]]
        dp_cells = [fmt_bytes(v) if dp > 1 else "-" for v in x["dp"]]
        lines.append(f"{f'{dp} x {tp}':>7} {batch // dp:>3} {tp_shards.shard_numel(cfg, tp):>12,} | "
                     f"{tp_cells[0]:>15} {tp_cells[1]:>10} | {dp_cells[0]:>15} {dp_cells[1]:>10} | "
                     f"{fmt_bytes(x['tp'][0] + x['dp'][0]):>12} {fmt_bytes(x['tp'][1] + x['dp'][1]):>10}")
    return "\n".join(lines)


def least(cfg, batch, s, tps):
    """(the layout with the least payload summed over both communicators, ... with the fewest ring bytes)."""
    totals = {tp: layout_bytes(cfg, batch, s, tp) for tp in tps}
    best = [min(tps, key=lambda t: totals[t]["tp"][col] + totals[t]["dp"][col]) for col in (0, 1)]
    return tuple(f"{P // tp} x {tp}" for tp in best)


say(f"this toy, B = {B}, float64:")
say(layout_table(cfg, B, 8, (1, 2, 4, 8)))
toy_best = least(cfg, B, 8, (1, 2, 4, 8))
say(f"least payload: dp x tp = {toy_best[0]}; fewest ring bytes: {toy_best[1]}")
check.equal("tp_shards.shard_numel(cfg, tp) == the trainer's shard sizes", tp_shards.shard_numel(cfg, TP), n_local)
check.equal("measured payloads at k = 2 == the table's formula at k = 1",
            {tp: {c: sum(n for (cc, _), (_, n) in measured[tp].items() if cc == c) for c in ("tp", "dp")}
             for tp in measured},
            {tp: {c: layout_bytes(cfg, B, 8, tp)[c][0] for c in ("tp", "dp")} for tp in measured})

gpt2 = ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072)
say(f"\nGPT-2 small's shape ({gpt2.n_params() / 1e6:.0f} M parameters), B = 32 sequences of 1024, float32 "
    "(tp = 8 does not divide its 12 heads):")
say(layout_table(gpt2, 32, 4, (1, 2, 4)))
gpt2_best = least(gpt2, 32, 4, (1, 2, 4))
say(f"least payload: dp x tp = {gpt2_best[0]}; fewest ring bytes: {gpt2_best[1]}")
check.holds("the toy: a mixed layout moves the least, in both columns", set(toy_best) <= {"4 x 2", "2 x 4"})
check.holds("GPT-2's shape: pure DP moves the least, in both columns", set(gpt2_best) == {"8 x 1"})

# %% [markdown]
# Read the columns against each other. At a fixed P and global batch, doubling tp halves dp, so each group gets
# twice the rows ($b = B\,tp/P$): the tensor-parallel payload per rank, proportional to $b\,T\,C\,L$, doubles, and
# its ring factor $2\frac{tp-1}{tp}$ grows too (1 at tp = 2, 1.5 at tp = 4); the data-parallel payload,
# proportional to the parameters over tp, roughly halves (the replicated parameters do not shrink), and its ring
# factor $2\frac{dp-1}{dp}$ shrinks with dp. Which total is smallest depends on the ratio of activations to
# parameters, and the two columns need not agree; the lines under each table say which layout wins in each. For
# the toy, whose parameters outweigh its tiny batch, the mixed layouts beat both pure ones; for GPT-2's shape the
# activations dominate, and pure data parallelism would move the least, if the model fitted. The lecture's point
# is that for a large model tp must be at least what makes the model fit on the ranks of a group. Past that, the
# two kinds of traffic are not equally expensive: the tensor-parallel one comes in $k(4L + 4)$ pieces on the
# critical path of every layer, hence inside a node; the data-parallel one comes once per step and can overlap the
# backward pass (the lecture's section 4.1, chapter 8).
#
# The picture shows the measured bytes of one step on each communicator of rank 0, for the two layouts measured
# above, in both columns: the payload `CommStats` recorded and what a ring sends for it.

# %%
def draw_bytes(measured):
    """Rank 0: the measured payload and ring bytes of one step on each communicator, for each layout."""
    fig, ax = pictures.figure(6.4, 3.0)
    bars = []                                                      # (label, tp bytes, dp bytes)
    for tp_ in sorted(measured):
        dp_ = P // tp_
        pay = {c: sum(n for (cc, _), (_, n) in measured[tp_].items() if cc == c) for c in ("tp", "dp")}
        bars.append((f"dp {dp_} x tp {tp_}\npayload", pay["tp"], pay["dp"]))
        bars.append((f"dp {dp_} x tp {tp_}\nring, sent per rank", float(ring_share("Allreduce", tp_) * pay["tp"]),
                     float(ring_share("Allreduce", dp_) * pay["dp"])))
    xs = np.arange(len(bars))
    tp_kib = np.array([t for _, t, _ in bars]) / 1024
    dp_kib = np.array([d for _, _, d in bars]) / 1024
    ax.bar(xs, tp_kib, 0.6, color=pictures.COLORS["tp"], label="tp_comm (k(4L+4) All-Reduces, every layer)")
    ax.bar(xs, dp_kib, 0.6, bottom=tp_kib, color=pictures.COLORS["dp"], label="dp_comm (1 All-Reduce per step)")
    for x, t, d in zip(xs, tp_kib, dp_kib):
        ax.text(x, t / 2, f"{t:.0f}", ha="center", va="center", fontsize=7, color="white")
        ax.text(x, t + d / 2, f"{d:.0f}", ha="center", va="center", fontsize=7, color="white")
        ax.text(x, t + d + 4, f"{t + d:.0f} KiB", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(xs, [label for label, _, _ in bars], fontsize=7)
    ax.set_ylabel("KiB per step, rank 0", fontsize=7)
    ax.set_ylim(0, 1.4 * max(tp_kib + dp_kib))
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, frameon=False, loc="upper center", ncol=2)
    ax.set_title(f"one step of the toy on {P} ranks (B={B}, k=2, float64), measured by CommStats", fontsize=8)
    return pictures.save(fig, "10_bytes_per_step")


path = pictures.on_rank0(world, lambda: draw_bytes(measured))
say(f"picture: {path}")

# %% [markdown]
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
norm = global_grad_norm(trainer.grads, trainer.norm_weight, grid.tp_comm)  # trainer.grads: step 1's, averaged
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
def serial_reference(tc):
    """serial.sgd with tc, and how far serial SGD without clipping ends from it: (params, losses, distance)."""
    batch = lambda step: corpus.batch(tc.seed, step, tc.batch_size)          # the global batch of every step
    ref, ref_losses = serial.sgd(cfg, tc, batch)
    unclipped, _ = serial.sgd(cfg, replace(tc, clip=0.0), batch)
    return ref, ref_losses, max(rel_err(unclipped[n], ref[n], floor=0.02) for n in ref)


reference = pictures.on_rank0(world, lambda: serial_reference(tc))
ref, ref_losses, clip_effect = world.bcast(reference, root=0)   # a small model: a pickled broadcast is fine

param_errs = {n: rel_err(p, tp_shards.shard(ref[n], n, grid.tp_rank, TP), floor=0.02) for n, p in run["params"].items()}
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
say(f"\nchapter 7: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error {err:.1e} "
    f"({worst})")
grid.free()

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `ProcessGrid(world, dp=4, tp=2)` with `grid.tp_comm`, `grid.dp_comm` (hsgd/grid/process_grid.py); rank = (dp_rank * pp + pp_rank) * tp + tp_rank | `initialize_model_parallel(tensor_model_parallel_size=...)`, then `get_tensor_model_parallel_group()`, `get_data_parallel_group()` (megatron/core/parallel_state.py); rank order `order="tp-cp-ep-dp-pp"` (`RankGenerator`) | `deepspeed.initialize(..., mpu=...)` (`deepspeed/__init__.py`): the model-parallel groups come from an `mpu` object such as Megatron's parallel_state | `init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))` (torch/distributed/device_mesh.py), then `mesh["tp"]`, `mesh["dp"]` | MPI communicators from `Split(color, key)`, printed and checked; dp outermost so that a replica is a block of consecutive ranks (Megatron puts pp outermost) |
# | `HybridTrainer.step` (hsgd/step/trainer.py): the group's rows, the tp forward and backward, the `dp_comm` average, clipping, the update | `train_step` (megatron/training/training.py): `forward_backward_func`, whose `finalize_model_grads` (megatron/core/distributed/finalize_model_grads.py) calls each model chunk's `finish_grad_sync`, then `optimizer.step()` | `DeepSpeedEngine` (deepspeed/runtime/engine.py): `engine.backward(loss)` reduces the gradients (`allreduce_gradients`), `engine.step()` clips and updates | a plain loop, `loss.backward()` then `optimizer.step()`, on a module made tensor-parallel by `parallelize_module(model, mesh["tp"], plan)` with `ColwiseParallel` / `RowwiseParallel` (torch/distributed/tensor/parallel) and data-parallel by `fully_shard(model, mesh=mesh["dp"])` or `DistributedDataParallel(model, process_group=mesh["dp"].get_group())` | one function per step of the lecture, no autograd hooks: every collective is visible where it is called |
# | `dp_average(buf, grid.dp_comm)` (hsgd/dp/average.py): one All-Reduce of a `FlatBuffer` holding all the rank's gradient shards | `DistributedDataParallel` (megatron/core/distributed/distributed_data_parallel.py) over contiguous gradient buffers (param_and_grad_buffer.py) | `allreduce_gradients` -> `buffered_allreduce_fallback` (deepspeed/runtime/engine.py) | `torch.nn.parallel.DistributedDataParallel`, buckets of `bucket_cap_mb` | one buffer, one call after the backward pass; buckets and overlap are chapter 8 |
# | `optim.global_grad_norm(grads, norm_weight, tp_comm)`, `health.global_norm`: the split parameters' squares summed over `tp_comm`, the replicated ones counted once | `MegatronOptimizer.clip_grad_norm` -> `get_grad_norm_fp32` (megatron/core/optimizer/clip_grads.py) over the gradients that pass `param_is_not_shared` and `param_is_not_tensor_parallel_duplicate`; `clip_grad` in `OptimizerConfig` | the `"gradient_clipping"` setting; `clip_grad_norm_(parameters, max_norm, mpu=...)` (deepspeed/runtime/utils.py) counts a replicated parameter only on model-parallel rank 0 (`is_model_parallel_parameter`) | `torch.nn.utils.clip_grad_norm_` (torch/nn/utils/clip_grad.py); with DTensor gradients the norms of sharded tensors are reduced over their mesh | the two sums are kept apart with 0/1 masks, so every tp rank gets the same norm to the last bit and its replicated parameters stay bit-identical |
# | `CommStats` with `tp_model.comm_formula` and `dp_formula`: calls and payload of every collective, checked for equality with a formula | none (profilers) | the `"comms_logger"` setting (deepspeed/comm/config.py): each collective's size and time, logged | `CommDebugMode` (torch.distributed.tensor.debug): counts the collectives of DTensor code, without bytes | the bytes are a test: a formula that is off by one term fails the chapter |
# | `hsgd.verify`: every shard of the parallel gradient against the serial gradient, one table | none (its tests compare against single-GPU runs) | none | none | the serial reference is part of the library, so any layout can be checked from the command line |
#
# ## Exercises
#
# ### Exercise 1: the bytes of one step, by formula, for another layout
# For dp = 2, tp = 4, micro_batches = 4 and B = 8, write the step's traffic yourself, without `comm_formula` or
# `dp_formula`: on `tp_comm` $k(4L + 4)$ All-Reduces of $((4L + 2)C + 3)\,N s$ bytes in all ($N = bT$), on
# `dp_comm` one All-Reduce of the rank's parameter count times $s$, counted from `cfg.param_shapes()` (split
# parameters over tp, the vocabulary padded to $tp\lceil V/tp\rceil$, replicated ones whole). Run one
# `HybridTrainer.step` on that grid and check your (calls, payload) against its `CommStats`; then give the bytes a
# ring sends per rank on each communicator.
# (solution: `tutorials/solutions/10a_hybrid_tp_dp.py`, `exercise_1`)
#
# ### Exercise 2: the global gradient norm in one All-Reduce over the world
# After one `HybridTrainer.gradients`, compute $\lVert g\rVert$ from `trainer.grads` with a single All-Reduce of one
# float over all 8 ranks. Weight each rank's squares so that every element of the model counts exactly once: a
# split parameter's shard exists on dp ranks (one per replica), a replicated parameter on dp x tp ranks. Check the
# result against the serial norm of the global batch's gradient and against `global_grad_norm`.
# (solution: `tutorials/solutions/10a_hybrid_tp_dp.py`, `exercise_2`)
#
# ### Exercise 3: a hybrid step by hand
# Write two steps of hybrid SGD from the pieces of chapters 4 to 6 only: `tp_shards.shard_params` of the serial
# initialization, `tp_model.loss_and_grads` on your group's rows (`dp_rows`), an All-Reduce of every gradient shard
# over `grid.dp_comm.comm` with mpi4py itself (`MPI.IN_PLACE`), the division by dp, and $w \leftarrow w - \eta\,g$.
# Check every rank's shards against two steps of serial SGD on the global batch (`serial.loss_and_grads`).
# (solution: `tutorials/solutions/10a_hybrid_tp_dp.py`, `exercise_3`)
#
# ### Exercise 4: unequal slices
# Split B = 10 sequences over dp = 4 groups as 3, 3, 2, 2 rows. Each group's `tp_model.loss_and_grads` returns the
# gradient of the mean loss over *its* rows. Find the weights of the average over `dp_comm` that give the serial
# gradient of the global batch (hint: the global mean is a mean of means weighted by their sizes), do it with one
# All-Reduce, and check against serial; show that the plain $1/dp$ average is off.
# (solution: `tutorials/solutions/10a_hybrid_tp_dp.py`, `exercise_4`)
