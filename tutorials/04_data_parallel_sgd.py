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
# Chapters 5 and 6 split one copy of the model over a tensor-parallel group. This chapter takes the other direction
# of the lecture, the simpler one: **data parallelism**. Every worker holds the *whole* model and works on a
# different part of the data. Section 1 of the lecture puts it like this (in translation):
#
# > split the training data into disjoint subsets; every worker (a GPU or a server) holds a complete replica of
# > the model but computes gradients only on its own subset. Synchronous SGD: after each mini-batch the
# > gradients of all workers are aggregated globally (usually averaged), and every worker updates its own replica
# > with the average gradient, which keeps the parameters identical on all workers. The aggregation is done with
# > the All-Reduce collective.
#
# This chapter runs that algorithm on dp = 4 ranks (tp = 1: a "tensor-parallel group" of one rank is just the
# serial model) and shows
#
# 1. how hsgd hands out the data: the global batch of a step is a pure function of (seed, step), and replica g
#    keeps its own rows of it;
# 2. **why** averaging the replicas' gradients gives exactly the serial mini-batch gradient, and measures it;
# 3. gradient accumulation (micro-batches) inside a replica, which gives the same gradient again;
# 4. **why** the replicas stay identical, bit for bit, and that a few steps of data-parallel training end with the
#    parameters of serial SGD;
# 5. what it costs: one All-Reduce of every gradient byte per step, and the two weaknesses the lecture names.
#
# Run it with four ranks (a few seconds; on failure every rank raises, so it exits non-zero without hanging):
#
# mpirun -n 4 python tutorials/04_data_parallel_sgd.py
#
# The notebook form (`jupytext --to ipynb tutorials/04_data_parallel_sgd.py`) is for reading: the code needs four
# MPI ranks. Only rank 0 prints.
#
# Legend: B global batch (sequences per step), dp replicas, b = B/dp sequences per replica, k = micro_batches per
# replica, T sequence, C d_model, V vocabulary, L layers, g a replica (its `dp_rank`), $\theta$ all parameters,
# $\eta$ the learning rate.

# %%
import time

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from hsgd import ModelConfig, serial
from hsgd.data import Corpus
from hsgd.dp import FlatBuffer, check_batch, dp_average, dp_formula, dp_rows, micro_batches, params_digest
from hsgd.errors import ConfigError
from hsgd.generate import printable
from hsgd.grid import ProcessGrid

from hsgd.hybrid import HybridTrainer
from hsgd.optim import lr_at
from hsgd.train import fmt_bytes

from checks import Checks, rel_err, train_config   # tutorials/checks.py, shared by the chapters

threadpool_limits(1)                    # four ranks share the cores, tiny matrices: one BLAS thread each
DP = 4                                  # data-parallel size dp
world = MPI.COMM_WORLD
if world.Get_size() != DP:              # every rank exits non-zero; rank 0 says why
    raise SystemExit(f"run this chapter on {DP} ranks: mpirun -n {DP} python {__file__}"
                     if world.Get_rank() == 0 else 1)
grid = ProcessGrid(world, dp=DP, tp=1)  # dp = 4 replicas of one rank each
dp, g = grid.dp_comm, grid.dp_rank      # the data-parallel communicator (hsgd.comm.Comm) and my replica
TOL = 1e-10                             # float64: parallel and serial differ by rounding, ~1e-16 relative
check = Checks(world, tol=TOL, width=64)  # check(what, err, tol): collective, raises on every rank unless err < tol
say = check.say                           # print on world rank 0 only


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
# The lecture's "disjoint subsets" could be fixed shards of the data set, one per worker. hsgd cuts the data per
# step instead, which gives the same algorithm and makes it testable against the serial run:
#
# * the **global batch** of step $s$, B sequences of T bytes, is a pure function of (seed, step)
#   (`Corpus.batch`: B windows at offsets drawn from a generator seeded with (seed, split, step)). Every rank
#   computes it for itself, so no data is ever sent, and it is exactly the batch serial SGD trains on at step $s$;
# * replica g keeps rows `dp_rows(B, dp, g)` = $[g\,b, (g+1)\,b)$ with $b = B/dp$: the dp slices are disjoint and
#   together they are the whole batch.
#
# With B = 8 and dp = 4 each replica trains on 2 sequences per step:

# %%
B = 8
idx, targets = corpus.batch(SEED, 1, B)                 # (B, T) int64 each: the global batch of step 1
rows = dp_rows(B, DP, g)                                # my rows of it
batch_digests = dp.allgather_obj(params_digest({"idx": idx, "targets": targets}))
slices = dp.allgather_obj((g, rows.start, rows.stop, printable(bytes(idx[rows.start, :12].astype(np.uint8)))))
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
# hsgd's loss is a mean over every position of the batch (chapter 1). Write $\ell_{j,t}$ for the cross-entropy of
# sequence $j$ at position $t$ and $S_g$ for the $b$ rows of replica $g$. The serial loss of the global batch and
# the loss replica $g$ computes on its slice are
#
# $$\text{loss}(\theta) = \frac{1}{BT}\sum_{j=1}^{B}\sum_{t=1}^{T} \ell_{j,t}, \qquad
# \text{loss}_g(\theta) = \frac{1}{bT}\sum_{j \in S_g}\sum_{t=1}^{T} \ell_{j,t}.$$
#
# The slices are disjoint, cover the batch, and all have $b = B/dp$ rows, so the average of the dp slice losses is
#
# $$\frac{1}{dp} \sum_{g=1}^{dp} \text{loss}_g = \frac{1}{dp\,b\,T} \sum_{g}\sum_{j \in S_g}\sum_t \ell_{j,t}
# = \frac{1}{BT}\sum_{j=1}^{B}\sum_t \ell_{j,t} = \text{loss},$$
#
# and since the gradient is linear, $\frac{1}{dp} \sum_g \nabla \text{loss}_g = \nabla \text{loss}$: the All-Reduce
# (sum) followed by a division by dp *is* serial mini-batch SGD's gradient of the global batch, not an
# approximation of it. Each replica's own gradient is a noisier estimate from $b$ sequences; only the average is
# the serial one. (Equal slices matter: with slices of sizes $b_g$ the right weights would be $b_g/B$, not $1/dp$.
# hsgd simply requires B to be a multiple of dp, see below.)
#
# In hsgd the replica's gradients live in one flat buffer (`FlatBuffer`: every `buf.views[name]` is a view into
# `buf.flat`), so the exchange is **one** `Allreduce` of all of them instead of one call per parameter array;
# `dp_average` is that call followed by `buf.flat *= 1/dp`. Every replica starts from the same parameters (the same
# seed: `serial.init_params` on every rank), computes its slice's gradient, and then they average:

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
# A batch that does not split into dp equal slices is refused before anything runs, with a suggestion:

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
# The activations a replica stores for its backward pass grow with the number of sequences it processes at
# once. When $b$ sequences do not fit, hsgd cuts the slice into $k$ = `micro_batches` consecutive micro-batches of
# $b/k$ sequences (`dp.micro_batches`), runs the forward and backward of each in turn, and adds up the gradients of
# $\frac1k \text{loss}_{g,m}$, the micro-batch losses scaled by $1/k$ (`loss_scale` in `tp_model.loss_and_grads`;
# the layers accumulate weight gradients with `+=`). By the same argument as above,
#
# $$\sum_{m=1}^{k} \nabla\Big(\frac1k\,\text{loss}_{g,m}\Big) = \nabla \text{loss}_g ,$$
#
# so the replica ends with the gradient of its whole slice, and the one All-Reduce over the replicas comes after
# the last micro-batch: accumulation costs time (k smaller passes), never extra data-parallel communication.
# `HybridTrainer.gradients` does steps 1 to 3 of a training step (slice, micro-batches, `dp_average`); with
# B = 16 every replica has $b$ = 4 sequences, and $k$ = 1, 2, 4 all give the serial gradient:

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
# Nothing in data-parallel SGD ever sends a parameter. The replicas agree anyway, by induction over the steps:
#
# 1. **the same start**: every rank draws the initial parameters from the same seed (PyTorch's
#    DistributedDataParallel broadcasts rank 0's parameters instead; either works);
# 2. **the same gradient**: the All-Reduce hands every member the result of the same sum, and every replica
#    multiplies it by the same $1/dp$. (Here every rank receives the same bits, as the digests below show. An MPI
#    library that let ranks add the dp terms in different orders could give them results that differ in the last
#    bit, and the digests would catch that too.)
# 3. **the same update**: the optimizer step is deterministic and elementwise. Plain SGD is
#    $\theta \leftarrow \theta - \eta_s\, \bar g$; with momentum $v \leftarrow \mu v + \bar g$,
#    $\theta \leftarrow \theta - \eta_s v$, where the velocity $v$ starts at zero on every replica and then sees
#    the same gradients; the learning rate $\eta_s$ = `lr_at(step, ...)` depends only on the step number.
#
# Same inputs, same deterministic arithmetic: the same bits. This is the lecture's section 3.5: "since all the
# nodes that hold the same parameter shard perform the same All-Reduce and the same update, the shards stay
# consistent everywhere". It is also fragile in a way worth knowing: nothing ever re-synchronizes the replicas, so a
# reduction that gave different ranks different bits, or one flipped bit, would make them drift apart for
# good. We check after every step with a SHA-256 of each replica's parameters (`params_digest`).
#
# And because each step's averaged gradient is the serial gradient of the same global batch (section 2), the
# whole run is serial mini-batch SGD: after $s$ steps the parameters equal those of serial SGD, up to rounding
# (the All-Reduce adds the dp partial gradients in a different order than one big matrix product does, about
# $10^{-16}$ relative per step). Six steps of SGD with momentum and a warm-up, on 4 replicas:

# %%
tc = train_config(tp=1, dp=DP, steps=6, batch_size=B, warmup=2, seed=SEED)
trainer = HybridTrainer(cfg, grid, tc)
digests = [dp.allgather_obj(params_digest(trainer.params))]             # step 0: the initial parameters
losses, per_step = [], None
for step in range(1, tc.steps + 1):
    idx, targets = corpus.batch(tc.seed, step, tc.batch_size)           # the global batch of this step
    before = grid.stats.counts()
    info = trainer.step(idx, targets, step)                             # slice, backward, dp_average, update
    if per_step is None:                                                # the bytes of one step, for section 5
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
# Now the reference: serial mini-batch SGD, one process, the whole batch of every step, the same optimizer and
# schedule: `serial.sgd(cfg, tc, batch)`, with `batch(step)` the global batch of the step. Rank 0 runs it and
# broadcasts the result, and every rank compares its replica. The error is relative to each parameter's largest
# entry, but at least to 0.02 (the scale of the initialization): the attention k-biases start at zero and only ever
# receive rounding noise (their exact gradient is zero, chapter 6), so a purely relative error would divide noise
# by noise.

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
# ## 5. What it costs
#
# **Communication.** One step moves, on each rank, one All-Reduce of the whole gradient: `dp_formula` says (1 call,
# $4 \cdot$ n_params bytes in float32, $8 \cdot$ n_params in float64), and the byte accounting of the grid measured
# exactly that during step 1 of the run above. (The `tp` line is the tensor-parallel model's collectives on a
# one-rank `tp_comm`: calls that move nothing to anyone.) A bandwidth-optimal All-Reduce (a ring, or Rabenseifner's
# Reduce-Scatter + All-Gather: Thakur, Rabenseifner and Gropp 2005) sends and receives about $2\frac{dp-1}{dp}$
# times the payload per rank, so the traffic per rank hardly depends on dp, while the computation per rank shrinks
# like $B/dp$: at a fixed global batch, more replicas means more communication per unit of work. And the traffic
# scales with the size of the model, not of the batch.

# %%
formula = dp_formula(trainer.params)
flops = cfg.step_flops(B // DP)                                # forward + backward of my b sequences
say(f"step 1, measured on rank 0 (calls, bytes): {per_step}")
say(f"dp_formula(params):                      {formula}  = {cfg.n_params():,} parameters x 8 bytes")
say(f"per rank and step: {flops / 1e6:.1f} MFLOP of compute for {formula[('dp', 'Allreduce')][1] / 1e3:.0f} kB "
    f"of gradient (x {2 * (DP - 1) / DP:.2f} on the wire for a ring)")
check.equal("step 1: dp calls, bytes measured == dp_formula",
            per_step[("dp", "Allreduce")], formula[("dp", "Allreduce")])

# %% [markdown]
# **Stragglers.** The All-Reduce cannot finish before the last replica has joined it, so every step runs at the
# pace of the slowest rank, and the others wait inside the collective. Two more steps: a normal one, then one for
# which replica 3 is 50 ms late. The time the others spend in the dp All-Reduce (`StepInfo.dp_seconds`) grows by
# about that much. (Timing on a shared machine is noisy; this is printed, not checked.)

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
# **Memory.** Every replica holds the whole model, its gradient and the optimizer's state: with SGD and momentum
# three numbers per parameter (AdamW: four), before any activations. That is fine for this toy and for GPT-2 small
# (163 M parameters in hsgd, whose LM head is not tied to `wte`), and impossible for the models the lecture's
# section 2 is about:

# %%
gpt2 = ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072)
for name, n in (("this toy", cfg.n_params()), ("GPT-2 small", gpt2.n_params()), ("GPT-3", 175e9)):
    say(f"{name:<12} {n:>16,.0f} parameters: params + grads + momentum in float32 = {fmt_bytes(3 * 4 * n):>11} "
        "on every replica")

# %% [markdown]
# Hundreds of GiB do not fit on one accelerator, so data parallelism alone cannot train such a model. The lecture's
# answer (section 2) is to split the model over a group of tp workers (tensor parallelism, chapters 5 and 6) and
# make dp data-parallel replicas of that *group*: the hybrid of chapter 7. For the stragglers the lecture (section
# 4.4) names the trade-off: synchronous SGD, as here, keeps serial SGD's convergence guarantees (given unbiased
# gradients and a suitable learning rate); asynchronous updates, which do not wait for the slowest worker, add
# noise.
#
# ## Check against serial
#
# On 4 ranks, each verdict reached collectively: the replicas' slices partition the global batch; the All-Reduce
# average of their gradients is the serial gradient of the whole batch, with and without gradient accumulation;
# the replicas stay bit-identical through six steps of SGD with momentum; and their parameters are those of
# serial SGD up to rounding.

# %%
worst, err = check.worst()
say(f"\nchapter 5: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error {err:.1e} "
    f"({worst})")
grid.free()
