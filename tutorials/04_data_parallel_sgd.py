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
# # Chapter 4: data-parallel SGD
#
# This chapter puts chapter 3's `dp_comm` to work on **data parallelism**: every worker holds the *whole* model,
# works on its own part of the data, and the one collective is chapter 2's All-Reduce. The lecture's section 1 (in
# translation):
#
# > split the training data into disjoint subsets; every worker (a GPU or a server) holds a complete replica of
# > the model but computes gradients only on its own subset. Synchronous SGD: after each mini-batch the
# > gradients of all workers are aggregated globally (usually averaged), and every worker updates its own replica
# > with the average gradient, which keeps the parameters identical on all workers. The aggregation is done with
# > the All-Reduce collective.
#
# It runs on dp = 4 ranks, a grid of dp = 4, tp = 1 (chapters 5 and 6 split the model, chapter 10 combines both):
# how the data is handed out; why the averaged gradient is exactly the serial one, also with micro-batches; why the
# replicas stay bit-identical and equal to serial SGD; the learning rate when dp grows the batch (the lecture's
# section 4.4); and the cost in bytes, stragglers and memory.
#
# Run it with four ranks (about 12 s on a quiet 2-core machine; on failure every rank raises, so it exits non-zero
# without hanging). Rank 0 prints, and draws two pictures into `$HSGD_FIGURES` (default `tutorials/figures/`):
#
# mpirun -n 4 python tutorials/04_data_parallel_sgd.py
#
# Legend: B global batch (sequences per step), dp replicas, b = B/dp sequences per replica, k = micro_batches per
# replica, T sequence, C d_model, V vocabulary, L layers, g a replica (its `dp_rank`), $\theta$ all parameters,
# $\eta$ the learning rate, S samples (sequences) seen by a run.

# %%
import time

from hsgd.model.config import ModelConfig   # hsgd before NumPy: it sets OpenBLAS's thread timeout first
from hsgd.model import serial
from hsgd.tp import model as tp_model
from hsgd.grid.comm import Comm
from hsgd.model.data import Corpus
from hsgd.dp.average import FlatBuffer, check_batch, dp_average, dp_formula, dp_rows, micro_batches, params_digest
from hsgd.errors import ConfigError
from hsgd.model.generate import sample_text
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.accounting.activations import activation_bytes, activation_formula
from hsgd.model.optim import lr_at
from hsgd.run.report import fmt_bytes

import numpy as np
from mpi4py import MPI

import pictures                                    # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, rel_err, train_config   # tutorials/checks.py, shared by the chapters

DP = 4                                  # data-parallel size dp
TOL = 1e-10                             # float64: parallel and serial differ by rounding, ~1e-16 relative
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, DP, tol=TOL, width=64)
grid = ProcessGrid(world, dp=DP, tp=1)  # dp = 4 replicas of one rank each
dp, g = grid.dp_comm, grid.dp_rank      # the data-parallel communicator (hsgd.grid.comm.Comm) and my replica


def max_rel_err(grads, ref, floor=1e-6):
    """The largest rel_err over all parameters of two {name: array} dicts."""
    return max(rel_err(grads[n], ref[n], floor) for n in ref)


cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=16, n_heads=2, n_layers=2, d_ff=64)   # bytes in, bytes out
SEED = 0
corpus = Corpus.load(None, cfg.seq_len) # the built-in corpus: the Python standard library's source, as hsgd.train
say(f"{world.Get_size()} ranks = dp {grid.dp} replicas x tp {grid.tp}; model {cfg.n_params():,} parameters "
    f"(L={cfg.n_layers} C={cfg.d_model} T={cfg.seq_len} V={cfg.vocab_size}); data {corpus.describe()}")

# %% [markdown]
# ## 1. Who trains on what
#
# hsgd cuts the data per step rather than into fixed shards, the same algorithm but testable against serial:
#
# * the **global batch** of step $s$, B sequences of T bytes, is a pure function of (seed, step) (`Corpus.batch`),
#   so every rank computes it itself, nothing is sent, and it is the batch serial SGD trains on at step $s$;
# * replica g keeps rows `dp_rows(B, dp, g)` = $[g\,b, (g+1)\,b)$, $b = B/dp$: disjoint slices covering the batch.
#
# With B = 8 and dp = 4 each replica trains on 2 sequences per step:

# %%
B = 8
idx, targets = corpus.batch(SEED, 1, B)                 # (B, T) int64 each: the global batch of step 1
rows = dp_rows(B, DP, g)                                # my rows of it
batch_digests = dp.allgather_obj(params_digest({"idx": idx, "targets": targets}))
slices = dp.allgather_obj((g, rows.start, rows.stop, sample_text(bytes(idx[rows.start, :12].astype(np.uint8)))))
say(f"global batch of step 1: {idx.shape}; its SHA-256 on the 4 ranks: {sorted(set(d[:12] for d in batch_digests))}")
say("replica  rows of the global batch   its first sequence begins")
for r, r0, r1, text in slices:
    say(f"{r:>7}  [{r0}, {r1})                     {text!r}")
owners = np.zeros(B, dtype=int)
owners[rows] = 1                                        # (B,) 1 where a row is mine
dp.Allreduce(owners)                                    # (B,) how many replicas train on each row
check.equal("distinct global batches over the ranks", len(set(batch_digests)), 1)
check.equal("replicas training on each row of the batch", owners.tolist(), [1] * B)

# %% [markdown]
# ## 2. Why the average of the replicas' gradients is the serial gradient
#
# With $\ell_{j,t}$ the cross-entropy of sequence $j$ at position $t$ and $S_g$ replica $g$'s $b$ rows, the serial
# loss and replica $g$'s loss are
#
# $$\text{loss}(\theta) = \frac{1}{BT}\sum_{j=1}^{B}\sum_{t=1}^{T} \ell_{j,t}, \qquad
# \text{loss}_g(\theta) = \frac{1}{bT}\sum_{j \in S_g}\sum_{t=1}^{T} \ell_{j,t}.$$
#
# The slices are disjoint, cover the batch and have $b = B/dp$ rows each, so
#
# $$\frac{1}{dp} \sum_{g=1}^{dp} \text{loss}_g = \frac{1}{dp\,b\,T} \sum_{g}\sum_{j \in S_g}\sum_t \ell_{j,t}
# = \frac{1}{BT}\sum_{j=1}^{B}\sum_t \ell_{j,t} = \text{loss},$$
#
# and by linearity $\frac{1}{dp} \sum_g \nabla \text{loss}_g = \nabla \text{loss}$: the All-Reduce (sum) divided by
# dp *is* the serial gradient of the global batch, not an approximation. (Unequal slices would need weights
# $b_g/B$, exercise 1; hsgd requires B to be a multiple of dp.)
#
# The gradients live in one flat buffer (`FlatBuffer`: every `buf.views[name]` is a view into `buf.flat`), so the
# exchange is **one** `Allreduce`; `dp_average` is that call and `buf.flat *= 1/dp`. Every replica starts from the
# same seed, computes its slice's gradient, and they average:

# %%
params = serial.init_params(cfg, seed=SEED, dtype="float64")   # the same full model on every replica
buf = FlatBuffer(params)                                        # buf.flat: (n_params,) float64, zero
loss_g, _ = serial.loss_and_grads(params, idx[rows], targets[rows], cfg, grads=buf.views)  # accumulates into buf
loss_ref, grads_ref = serial.loss_and_grads(params, idx, targets, cfg)  # the serial reference: the whole batch

before = max_rel_err(buf.views, grads_ref)              # my slice's gradient vs the global batch's
mine = dp.allgather_obj((g, loss_g, before))
grid.stats.reset()
dp_average(buf, dp)                                     # Allreduce of buf.flat over the dp replicas, then / dp
dp_counts = grid.stats.counts()
loss_avg = dp.comm.allreduce(loss_g) / DP               # (metadata: one float, pickled)

say("replica  loss of its slice  its gradient vs the serial one (max rel diff)")
for r, lg, diff in mine:
    say(f"{r:>7}  {lg:>17.6f}  {diff:>10.2f}")
say(f"average  {loss_avg:>17.6f}  (serial loss of the global batch: {loss_ref:.6f})")
say(f"FlatBuffer: {len(buf.views)} gradient arrays in one buffer of {buf.flat.size:,} float64 "
    f"= {buf.flat.nbytes:,} bytes")
check.holds("every replica's own gradient differs from serial by > 0.1", min(d for _, _, d in mine) > 0.1)
check("mean of the slice losses vs serial loss", abs(loss_avg - loss_ref) / loss_ref)
check("dp_average of the replicas' gradients vs serial gradient", max_rel_err(buf.views, grads_ref))
check.equal("dp_average: calls, bytes == dp_formula (one Allreduce)", dp_counts, dp_formula(params))

# %% [markdown]
# A batch that does not split into dp equal slices is refused before anything runs:

# %%
try:
    check_batch(10, DP, 1)
    refused = ""
except ConfigError as e:
    refused = str(e)
say(f"check_batch(10, dp={DP}, micro_batches=1): ConfigError: {refused}")
check.holds("check_batch refuses B=10 on dp=4, naming batch_size", refused.startswith("batch_size=10"))

# %% [markdown]
# ## 3. Gradient accumulation: micro-batches inside a replica
#
# A replica's stored activations grow with the sequences it processes at once. When $b$ do not fit, hsgd cuts the
# slice into $k$ = `micro_batches` micro-batches of $b/k$ (`dp.micro_batches`) and accumulates (`+=`) the gradients
# of $\frac1k \text{loss}_{g,m}$ (`dloss` in `tp_model.loss_and_grads`, which for tp = 1 computes what
# `serial.loss_and_grads` does). By the same argument,
#
# $$\sum_{m=1}^{k} \nabla\Big(\frac1k\,\text{loss}_{g,m}\Big) = \nabla \text{loss}_g ,$$
#
# and the one All-Reduce comes after the last micro-batch: accumulation costs time, never extra communication.
# `HybridTrainer.gradients` does slice, micro-batches and `dp_average`; with B = 16 ($b$ = 4), $k$ = 1, 2, 4 all
# give the serial gradient:

# %%
B16 = 16
idx16, targets16 = corpus.batch(SEED, 2, B16)                       # (16, T): a bigger global batch
_, grads16 = serial.loss_and_grads(params, idx16, targets16, cfg)   # the serial reference
for k in (1, 2, 4):
    tc = train_config(tp=1, dp=DP, batch_size=B16, micro_batches=k, seed=SEED)
    trainer = HybridTrainer(cfg, grid, tc)                          # params: serial.init_params(seed) again
    grid.stats.reset()
    trainer.gradients(idx16, targets16)                             # k passes, then one Allreduce over dp
    counts = grid.stats.counts()
    mbs = [(m.start, m.stop) for m in micro_batches(dp_rows(B16, DP, g), k)]
    say(f"micro_batches={k}: replica 0's micro-batches (rows) {mbs}; dp Allreduces {counts[('dp', 'Allreduce')][0]}")
    check(f"micro_batches={k}: gradient vs serial gradient of the global batch", max_rel_err(trainer.grads, grads16))
    check.equal(f"micro_batches={k}: dp_comm Allreduce calls", counts[("dp", "Allreduce")][0], 1)

# %% [markdown]
# ## 4. Why the replicas stay identical, and equal to serial SGD
#
# No parameter is ever sent; the replicas agree by induction over the steps:
#
# 1. **the same start**: every rank draws the parameters from the same seed (PyTorch's DDP broadcasts rank 0's
#    instead; either works);
# 2. **the same gradient**: the All-Reduce hands every member the same sum (here the same bits, as the digests
#    show; an MPI library that added in a different order per rank would differ in the last bit, and the digests
#    would catch it), each multiplied by the same $1/dp$;
# 3. **the same update**: the optimizer step is deterministic and elementwise; the momentum $v$ starts at zero
#    everywhere and sees the same gradients, and $\eta_s$ = `lr_at(step, ...)` depends only on the step.
#
# This is the lecture's section 3.5: the nodes holding the same shard do the same All-Reduce and update, so the
# shards stay consistent. It is fragile: nothing re-synchronizes the replicas, so one differing bit would make them
# drift for good, hence a SHA-256 of each replica's parameters (`params_digest`) after every step.
#
# And since each step's gradient is the serial one (section 2), the run is serial mini-batch SGD, up to rounding
# (about $10^{-16}$ relative per step, the All-Reduce adding in another order). Six steps of SGD with momentum and
# warm-up, on 4 replicas:

# %%
tc = train_config(tp=1, dp=DP, steps=6, batch_size=B, warmup=2, seed=SEED)
trainer = HybridTrainer(cfg, grid, tc)
digests = [dp.allgather_obj(params_digest(trainer.params))]             # step 0: the initial parameters
losses, per_step = [], None
for step in range(1, tc.steps + 1):
    idx, targets = corpus.batch(tc.seed, step, tc.batch_size)           # the global batch of this step
    before = grid.stats.counts()
    info = trainer.step(idx, targets, step)                             # slice, backward, dp_average, update
    if per_step is None:                                                # the bytes of one step, for section 6
        per_step = {key: (c - before.get(key, (0, 0))[0], n - before.get(key, (0, 0))[1])
                    for key, (c, n) in grid.stats.counts().items()}
    losses.append(info.loss)
    digests.append(dp.allgather_obj(params_digest(trainer.params)))    # every replica's SHA-256

say("step  loss of the global batch  lr       SHA-256 of the parameters on replicas 0..3")
for step, ds in enumerate(digests):
    loss_lr = f"{losses[step - 1]:<24.6f}  {lr_at(step, tc.lr, tc.warmup, tc.steps):.4f}" if step else " " * 32
    say(f"{step:>4}  {loss_lr}   " + " ".join(d[:10] for d in ds))
check.holds("replicas bit-identical after every step", all(len(set(ds)) == 1 for ds in digests))

# %% [markdown]
# The reference: `serial.sgd(cfg, tc, batch)`, one process, the whole batch of every step, the same optimizer and
# schedule; rank 0 runs it and broadcasts the result. The error is relative to each parameter's largest entry but
# at least 0.02 (the initialization's scale): the attention k-biases start at zero and only receive rounding noise
# (chapter 1).

# %%
reference = None
if grid.rank == 0:                                   # the same global batches, on one process
    reference = serial.sgd(cfg, tc, lambda step: corpus.batch(tc.seed, step, tc.batch_size))
ref, ref_losses = world.bcast(reference, root=0)     # small metadata-sized model: a pickled broadcast is fine

param_errs = {n: rel_err(p, ref[n], floor=0.02) for n, p in trainer.params.items()}
worst = max(param_errs, key=param_errs.get)
say(f"serial SGD losses:        {' '.join(f'{x:.6f}' for x in ref_losses)}")
say(f"data-parallel SGD losses: {' '.join(f'{x:.6f}' for x in losses)}")
say(f"largest parameter difference: {worst} {param_errs[worst]:.1e}")
check(f"{tc.steps} steps: losses vs serial SGD", max(abs(a - b) / b for a, b in zip(losses, ref_losses)), 1e-9)
check(f"{tc.steps} steps: every replica's parameters vs serial SGD", max(param_errs.values()), 1e-9)

# %% [markdown]
# ## 5. Convergence: the learning rate when dp grows the batch
#
# The lecture's section 4.4 (in translation): "in theory, as long as the gradient is an unbiased estimate and the
# learning rate is set properly, synchronous hybrid-parallel SGD has the same convergence guarantees as serial
# SGD". Sections 2 to 4 showed the first condition, and more. The second is this section: adding replicas, each
# keeping its $b$ sequences, grows the global batch, and the rate that suited $B$ does not suit $4B$: with a fixed
# budget of $S$ sequences, a 4 times bigger batch takes 4 times fewer steps of about the same size.
#
# Goyal et al. (2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour") give the **linear scaling
# rule**: multiply the minibatch by $k$, multiply the rate by $k$. Compare $k$ steps on batches of $b$ with one step
# on their union, per-example losses $l$:
#
# $$w_{t+k} = w_t - \eta \sum_{j<k} \frac1b \sum_{x \in \mathcal B_j} \nabla l(x, w_{t+j}), \qquad
# \hat w_{t+1} = w_t - \hat\eta\, \frac{1}{kb} \sum_{j<k} \sum_{x \in \mathcal B_j} \nabla l(x, w_t),$$
#
# equal with $\hat\eta = k\eta$ if $\nabla l(x, w_{t+j}) \approx \nabla l(x, w_t)$. That fails where the network
# changes fastest, early on, hence a **gradual warm-up** from $\eta$ to $k\eta$ over 5 epochs. For their ResNet-50
# the rule holds up to minibatches of 8k images; McCandlish et al. (2018, "An Empirical Model of Large-Batch
# Training") predict the largest useful batch from the "gradient noise scale", which varies by task and grows as the
# loss falls. hsgd's `lr_at` ramps linearly from $\eta/w$ to $\eta$ over $w$ = `warmup` steps, then decays along a
# cosine to $\eta/10$.
#
# A data-parallel run *is* serial SGD on its global batch, so `serial.sgd` at batch $B$ stands for dp = $B/8$
# replicas of $b = 8$ (the four ranks share out the runs). Every run sees $S$ = 1024 training sequences (SGD,
# momentum 0.9, float32) and is measured on 128 held-out sequences:
#
# * B = 8 (one replica) at $\eta$ = 0.1: the reference;
# * B = 16 and 32 (dp = 2, 4) with the rate **unscaled** (0.1), **scaled** ($0.1 \cdot B/8$), and **scaled +
#   warm-up** (ramped over the first tenth of the steps);
# * two seeds, because short runs are noisy.

# %%
S, B0, LR0 = 1024, 8, 0.1               # sequences seen by every run; the one-replica batch and its rate
BATCHES, SEEDS = (8, 16, 32), (0, 1)    # global batches B = b * dp with b = 8: dp = 1, 2, 4
RULES = ("unscaled", "scaled", "scaled + warm-up")
val_batches = [corpus.batch(SEED, i, 64, split="val") for i in range(2)]   # 2 x (64, T): 128 held-out sequences


def schedule(B, rule):
    """(learning rate, warm-up steps) of a run at global batch B under `rule`."""
    k = B // B0
    return (LR0 if rule == "unscaled" else LR0 * k), (max(1, S // B // 10) if rule == "scaled + warm-up" else 0)


def run(seed, B, rule):
    """Serial mini-batch SGD on S sequences at batch B: (validation loss at the end, every step's training loss)."""
    lr, warmup = schedule(B, rule)
    tc = train_config(steps=S // B, batch_size=B, lr=lr, warmup=warmup, seed=seed)
    params = serial.init_params(cfg, seed=seed, dtype="float32")
    params, losses = serial.sgd(cfg, tc, lambda step: corpus.batch(seed, step, B), params=params)
    return float(np.mean([serial.loss(params, i, t, cfg) for i, t in val_batches])), losses


jobs = [(seed, B0, "unscaled") for seed in SEEDS] + [(seed, B, rule) for seed in SEEDS for B in BATCHES[1:]
                                                     for rule in RULES]
t0 = time.perf_counter()
done = [(job, run(*job)) for job in jobs[g::DP]]         # replica g runs every DP-th job
runs = {job: result for part in dp.allgather_obj(done) for job, result in part}   # (seed, B, rule) -> result
seconds = time.perf_counter() - t0
val = {job: v for job, (v, _) in runs.items()}           # (seed, B, rule) -> validation loss
ref = {seed: val[seed, B0, "unscaled"] for seed in SEEDS}

say(f"{len(jobs)} runs of {S} sequences each, shared out over {DP} ranks: {seconds:.1f} s")
say(f"{'B':>4}{'dp':>4}{'steps':>7}  {'rule':<18}{'lr':>6}{'warm-up':>9}   "
    + "".join(f"{f'val loss, seed {s}':>18}" for s in SEEDS) + f"{'minus B=8, mean':>18}")
for bsz in BATCHES:                                     # (not B: that is section 4's batch, used again below)
    for rule in (RULES if bsz > B0 else ("unscaled",)):
        lr, warmup = schedule(bsz, rule)
        losses = [val[s, bsz, rule] for s in SEEDS]
        gap = np.mean([val[s, bsz, rule] - ref[s] for s in SEEDS])
        say(f"{bsz:>4}{bsz // B0:>4}{S // bsz:>7}  {rule if bsz > B0 else 'reference':<18}{lr:>6.2f}{warmup:>9}   "
            + "".join(f"{v:>18.3f}" for v in losses) + f"{gap:>+18.3f}")
closer = [abs(val[s, 32, "scaled + warm-up"] - ref[s]) < abs(val[s, 32, "unscaled"] - ref[s]) for s in SEEDS]
check.holds("B=32: scaled + warm-up ends closer to B=8 than unscaled, each seed", all(closer))
check.holds("B=32: scaled + warm-up still ends > 0.05 above B=8, each seed",
            all(val[s, 32, "scaled + warm-up"] > ref[s] + 0.05 for s in SEEDS))

# %% [markdown]
# Checked for each seed: at B = 32 (dp = 4) the scaled, warmed-up rate ends closer to the one-replica run than the
# unscaled one, but still clearly above it. Printed, not checked: the scaled rows with and without warm-up end
# close, in an order that changes with the seed, so this says nothing reliable about the warm-up. It fits the
# argument: the largest batch takes only S/32 steps, all early, where $k$ small steps are least like one big one.
#
# The picture: left, seed 0's training loss against sequences seen (moving averages over 128 sequences); right,
# every run's final validation loss against the global batch.

# %%
if grid.rank == 0:                                     # world rank 0 draws
    fig, (left, right) = pictures.figure(10, 3.6, ncols=2)
    window = 128                                                      # sequences per moving-average window
    for bsz, rule, style in ((B0, "unscaled", "k-"), (32, "unscaled", "C3-"), (32, "scaled", "C0-"),
                             (32, "scaled + warm-up", "C2-")):
        losses = np.array(runs[0, bsz, rule][1])                      # seed 0, one training loss per step
        w = max(1, window // bsz)
        smooth = np.convolve(losses, np.ones(w) / w, mode="valid")    # the mean of w consecutive steps
        seen = bsz * np.arange(w, len(losses) + 1)                    # sequences seen at the end of each window
        left.plot(seen, smooth, style, lw=1.3, label=f"B={bsz}, {'one replica' if bsz == B0 else rule}, "
                                                     f"lr {schedule(bsz, rule)[0]:g}")
    left.set_xlabel("training sequences seen")
    left.set_ylabel("training loss (moving average)")
    left.set_title("seed 0: the same data budget at B=8 and B=32", fontsize=9)
    left.legend(fontsize=7)
    for rule, color in zip(RULES, ("C3", "C0", "C2")):
        at = lambda s, bsz: val[s, bsz, rule if bsz > B0 else "unscaled"]    # noqa: E731  (B=8: the reference)
        right.plot(BATCHES, [np.mean([at(s, bsz) for s in SEEDS]) for bsz in BATCHES], "-", color=color, label=rule)
        for s, marker in zip(SEEDS, "ox"):
            right.plot(BATCHES, [at(s, bsz) for bsz in BATCHES], marker, color=color, ms=5)
    right.set_xscale("log", base=2)
    right.set_xticks(BATCHES, [f"{bsz}\n(dp={bsz // B0})" for bsz in BATCHES])
    right.set_xlabel("global batch B (replicas of b = 8)")
    right.set_ylabel(f"validation loss after {S} sequences")
    right.set_title("each seed a marker (o, x), the line their mean", fontsize=9)
    right.legend(fontsize=7)
    say("picture:", pictures.save(fig, "04_lr_scaling"))
pictures.wait_asleep(world)                          # the other ranks sleep while rank 0 draws

# %% [markdown]
# ## 6. What it costs
#
# **Communication.** Each step is one All-Reduce of the whole gradient: `dp_formula` says 1 call of
# $4 \cdot$ n_params bytes in float32 ($8 \cdot$ n_params in float64), and the grid's accounting measured exactly
# that in step 1 of section 4. (hsgd's model code serves every layout; with tp = 1 its tensor-parallel collectives
# run on a one-rank `tp_comm`, moving nothing but counted: the `tp` line.) That is the **payload**; a ring
# All-Reduce sends about $2\frac{dp-1}{dp}$ times it per rank (Thakur, Rabenseifner and Gropp 2005). So the traffic
# per rank hardly depends on dp while the work shrinks like $B/dp$, and it scales with the model, not the batch.

# %%
formula = dp_formula(trainer.params)
payload = formula[("dp", "Allreduce")][1]
say(f"step 1, measured on rank 0 (calls, bytes): {per_step}")
say(f"dp_formula(params):                      {formula}  = {cfg.n_params():,} parameters x 8 bytes")
say(f"\nat B = {B}, per rank and step:")
say(f"{'dp':>4}{'b = B/dp':>10}{'compute (MFLOP)':>17}{'payload (bytes)':>17}{'ring bytes sent':>17}"
    f"{'ring bytes per kFLOP':>22}")
for n in (1, 2, 4, 8):
    flops, ring = cfg.step_flops(B // n), 2 * (n - 1) / n * payload   # forward + backward of b sequences
    say(f"{n:>4}{B // n:>10}{flops / 1e6:>17.2f}{payload:>17,}{ring:>17,.0f}{1e3 * ring / flops:>22.2f}")
check.equal("step 1: dp calls, bytes measured == dp_formula",
            per_step[("dp", "Allreduce")], formula[("dp", "Allreduce")])

# %% [markdown]
# **Stragglers.** The All-Reduce cannot finish before the last replica joins, so every step runs at the slowest
# rank's pace. Two more steps, the second with replica 3 50 ms late: the others' time in the dp All-Reduce
# (`StepInfo.dp_seconds`) grows by about that much (printed, not checked: timing here is noisy).

# %%
say("time in the dp All-Reduce:    " + "  ".join(f"replica {r}" for r in range(DP)))
for step, late in ((tc.steps + 1, 0.0), (tc.steps + 2, 0.05)):
    idx, targets = corpus.batch(tc.seed, step, tc.batch_size)
    if g == DP - 1:
        time.sleep(late)                               # the straggler
    info = trainer.step(idx, targets, step)
    waits = dp.allgather_obj(info.dp_seconds)
    say(f"{'replica 3 50 ms late:' if late else 'a normal step:':<30}"
        + "  ".join(f"{1e3 * w:>6.0f} ms" for w in waits))

# %% [markdown]
# **Memory.** Every replica holds the whole model, its gradient and the optimizer state (three numbers per
# parameter with momentum SGD, four with AdamW), whatever dp is; only the activations shrink with $b = B/dp$.
# Measured at B = 16 in float64: the model state from `HybridTrainer.memory`, the activations from a forward's
# caches (`memory.activation_bytes`, each distinct array once), checked against `memory.activation_formula`:

# %%
mem = trainer.memory()                                   # {"params", "grads", "optimizer"}: bytes on this rank
self_comm = Comm(MPI.COMM_SELF, "tp")                    # a one-rank tp_comm: the serial model, with its caches
acts = {}                                                # dp -> activation bytes of one replica's b sequences
for n in (1, 2, 4, 8):
    b = B16 // n
    _, caches = tp_model.forward(trainer.params, idx16[:b], targets16[:b], tp_model.TPSetup(cfg, self_comm))
    acts[n] = activation_bytes(caches, trainer.params)
    check.equal(f"dp={n}, b={b}: activation bytes == activation_formula", acts[n],
                activation_formula(cfg, b, 8, 1, "megatron")["model"])
check.equal("params, grads, momentum per rank == 8 n_params bytes each",
            (mem["params"], mem["grads"], mem["optimizer"]), (8 * cfg.n_params(),) * 3)
say(f"{'dp':>4}{'b':>4}{'parameters':>13}{'gradients':>13}{'momentum':>13}{'activations':>14}{'total':>13}")
for n, a in acts.items():
    say(f"{n:>4}{B16 // n:>4}{fmt_bytes(mem['params']):>13}{fmt_bytes(mem['grads']):>13}"
        f"{fmt_bytes(mem['optimizer']):>13}{fmt_bytes(a):>14}{fmt_bytes(sum(mem.values()) + a):>13}")
if grid.rank == 0:                                     # world rank 0 draws
    fig, ax = pictures.figure(6, 3.2)
    xs, bottom = np.arange(len(acts)), np.zeros(len(acts))
    for label, values, color in (("parameters", [mem["params"]] * len(acts), "C0"),
                                 ("gradients", [mem["grads"]] * len(acts), "C1"),
                                 ("momentum (optimizer state)", [mem["optimizer"]] * len(acts), "C2"),
                                 ("activations (cached for the backward)", list(acts.values()), "C3")):
        kib = np.array(values) / 1024
        ax.bar(xs, kib, bottom=bottom, color=color, label=label, width=0.6)
        bottom += kib
    ax.set_xticks(xs, [f"dp={n}\nb={B16 // n}" for n in acts])
    ax.set_ylabel("KiB per rank (float64)")
    ax.set_title(f"Memory per rank at a global batch of {B16} sequences: only the activations shrink with dp",
                 fontsize=8)
    ax.legend(fontsize=7)
    say("picture:", pictures.save(fig, "04_memory_per_rank"))
pictures.wait_asleep(world)                          # the other ranks sleep while rank 0 draws
gpt2 = ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072)
for name, n in (("this toy", cfg.n_params()), ("GPT-2 small", gpt2.n_params()), ("GPT-3", 175e9)):
    say(f"{name:<12} {n:>16,.0f} parameters: params + grads + momentum in float32 = {fmt_bytes(3 * 4 * n):>11} "
        "on every replica")

# %% [markdown]
# The picture: the three blocks of model state are the same on every rank whatever dp is; only the activations
# (red) shrink. For this toy they dominate; for a large model the state does (the last lines: GPT-2 small, 163 M
# parameters in hsgd, its LM head untied). That does not fit one accelerator, so the lecture splits the model over
# tp workers (tensor parallelism, the next two chapters) and makes dp replicas of that *group*: the hybrid of
# chapter 10. (ZeRO, chapter 8, splits the optimizer state and gradients between the replicas instead.) For
# stragglers the lecture (section 4.4) names the trade-off: synchronous SGD keeps serial SGD's convergence
# guarantees; asynchronous updates, not waiting for the slowest, add noise.
#
# ## Check against serial
#
# On 4 ranks, each verdict collective: the slices partition the global batch; the averaged gradient is the serial
# one, with and without accumulation; the replicas stay bit-identical through six steps of momentum SGD, equal to
# serial SGD up to rounding; at the largest batch the scaled, warmed-up rate ends closer to the one-replica run than
# the unscaled one; and the bytes of a step and of a replica's memory match the formulas.

# %%
worst, err = check.worst()
say(f"\nchapter 4: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error {err:.1e} "
    f"({worst})")
grid.free()

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `dp_average(buf, dp_comm)`: one `Allreduce` of the flat gradient buffer (`FlatBuffer`) after the backward, then $\times 1/dp$ | `DistributedDataParallel` (megatron/core/distributed/distributed_data_parallel.py): contiguous `_ParamAndGradBuffer`s scaled by `gradient_scaling_factor` = 1/dp (or `average_in_collective`), in buckets overlapped with the backward (`overlap_grad_reduce`) | `DeepSpeedEngine.allreduce_gradients()` with ZeRO stage 0 (`"zero_optimization": {"stage": 0}`, `ZeroStageEnum.disabled`) | `torch.nn.parallel.DistributedDataParallel`: an averaging all-reduce per bucket (`bucket_cap_mb`) during the backward | one call after the backward; chapter 8 adds buckets and overlap |
# | the same seed on every replica (`serial.init_params`, `tp_shards.init_params`) | `DistributedDataParallel.broadcast_params()` from the first rank of the data-parallel group | `DeepSpeedEngine._broadcast_model()` | the DDP constructor broadcasts rank 0's `state_dict()` | nothing sent: the start is a function of the seed (exercise 4 broadcasts) |
# | `params_digest` after every step: replicas bit-identical | `--check-weight-hash-across-dp-replicas-interval` (`check_param_hashes_across_dp_replicas`) | none | none | checked every step in the tests and `--check-replicas` |
# | `micro_batches` $k$; $B = b \cdot dp$, $b$ = $k$ micro-batches | `--micro-batch-size`, `--global-batch-size`; `get_num_microbatches()` = global / (micro x dp) (megatron/core/num_microbatches_calculator.py) | `train_batch_size` = `train_micro_batch_size_per_gpu` x `gradient_accumulation_steps` x dp (deepspeed/runtime/config.py) | a loop of backward passes inside `DistributedDataParallel.no_sync()` except the last | one number, `micro_batches`, per replica |
# | `loss_scale` = $1/k$ per micro-batch | `forward_step` divides each micro-batch's loss by their number (megatron/core/pipeline_parallel/schedules.py) | `DeepSpeedEngine.backward(loss, scale_wrt_gas=True)` divides by `gradient_accumulation_steps` | the user divides the loss by the number of accumulation steps | - |
# | equal slices required (`check_batch`); unequal ones need the weights $b_g/B$ (exercise 1) | `calculate_per_token_loss` (TransformerConfig): gradients scaled by 1 / (the all-reduced token count) in `finalize_model_grads` (megatron/core/distributed/finalize_model_grads.py): the weights $b_g/B$ | none | none | refusing unequal slices keeps the average a plain $1/dp$ |
# | `lr_at`: linear warm-up, cosine decay; the rate scaled by hand | `OptimizerParamScheduler` (`--lr-warmup-iters`); `--step-batch-size-schedule` grows the batch instead (`StepBatchsizeNumMicroBatchesCalculator`) | `WarmupLR`, `WarmupDecayLR` (deepspeed/runtime/lr_schedules.py) | `torch.optim.lr_scheduler.LinearLR` | no automatic scaling with dp |
#
# ## Exercises
#
# ### Exercise 1: unequal DP slices
# Give the 4 replicas slices of 1, 2, 3 and 2 of a batch of 8; weight each slice's mean-loss gradient by $b_g/B$
# before one `dp_comm.Allreduce`. Check it against `serial.loss_and_grads` on all 8, and that `dp_average` (the
# plain $1/dp$) is not.
# (solution: `tutorials/solutions/04_data_parallel_sgd.py`, `exercise_1`)
#
# ### Exercise 2: gradient accumulation by hand, and the batch-size bookkeeping
# DeepSpeed's `train_micro_batch_size_per_gpu` = 2 and `gradient_accumulation_steps` = 3 on dp = 4 make
# `train_batch_size` = 24. Build that step: each replica accumulates 3 micro-batches of 2 into one `FlatBuffer`
# (`serial.loss_and_grads(..., grads=buf.views)` adds), then one `dp_comm.Allreduce` and one scaling. Check it
# against the serial gradient of the 24 and that the step made exactly one All-Reduce (`CommStats`).
# (solution: `tutorials/solutions/04_data_parallel_sgd.py`, `exercise_2`)
#
# ### Exercise 3: why the rule is linear, measured
# On the toy model in float64 with plain SGD, compare $k$ = 4 steps of rate $\eta$ on 4 batches of 2 with one step
# of $4\eta$ on the 8 together, for $\eta$ = 0.002 and $\eta/2$: the distance is $O(\eta^2)$ (the gradients drift
# by $O(\eta)$), so halving $\eta$ should divide it by about 4. With $\eta$ = 0.1 and 0.05 (section 5's rate), how
# far from 4 is the ratio? Then write Goyal et al.'s warm-up, `goyal_lr(step, lr, k, warmup)`, from the small-batch
# rate up by a constant per step to $k \cdot$ lr, and check it against the formula at a few steps.
# (solution: `tutorials/solutions/04_data_parallel_sgd.py`, `exercise_3`)
#
# ### Exercise 4: start from different parameters, then broadcast
# DDP and Megatron-LM broadcast the first rank's parameters instead of sharing a seed. Add rank-dependent noise to
# a `HybridTrainer`'s `pbuf.flat`, check the digests differ, make them equal with one `dp_comm.Bcast` from dp rank 0,
# and check that two data-parallel steps from there match `serial.sgd` from rank 0's parameters.
# (solution: `tutorials/solutions/04_data_parallel_sgd.py`, `exercise_4`)
