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
# # Chapter 6: attention split by heads, the vocab-parallel embedding and loss, and the whole TP model
#
# Chapter 5 split one linear layer, and the MLP, over a tensor-parallel group of tp ranks. A GPT has three more
# places where the model is wide: the attention, the token embedding and the LM head with its softmax over the
# vocabulary. This chapter splits each of them, following the lecture's section 3.2 ("for attention, the heads can
# be assigned to different workers") and Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053):
#
# 1. attention by heads: q, k, v column-parallel, each rank computing whole heads locally, and the output
#    projection row-parallel: one All-Reduce forward, one backward, as for the MLP;
# 2. the vocab-parallel embedding: each rank holds V/tp rows of `wte` (padded when tp does not divide V);
# 3. the vocab-parallel LM head and cross-entropy: the loss from three numbers per position, without ever
#    gathering the (N, V) logits;
# 4. the whole model, `hsgd.tp_model`, in both schemes, against `hsgd.serial` shard by shard, and its
#    communication per step against `tp_model.comm_formula`.
#
# Run it with four ranks (a few seconds; on failure every rank raises, so it exits non-zero without hanging):
#
# mpirun -n 4 python tutorials/06_attention_heads_and_vocab_parallel.py
#
# The notebook form (`jupytext --to ipynb`) is for reading: the code needs four MPI ranks. Only rank 0 prints.
#
# Legend: B batch, T sequence, C d_model, NH heads, hs = C/NH head size, F d_ff, V vocabulary,
# Vp = ceil(V/tp) vocabulary rows per rank, N = B*T positions, L layers, tp tensor-parallel ranks, i a rank.
# A `/tp` in a shape comment marks the split dimension, e.g. `(C, C/tp)`; `Vp` marks a vocabulary shard.

# %%
import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from hsgd import ModelConfig, layers, serial, tp_layers, tp_model
from hsgd.errors import ConfigError
from hsgd.grid import ProcessGrid

from checks import Checks, rel_err   # tutorials/checks.py, shared by the chapters

threadpool_limits(1)                    # four ranks share the cores, tiny matrices: one BLAS thread each
TP = 4                                  # tensor-parallel size; more ranks than 4 form data-parallel copies
world = MPI.COMM_WORLD
if world.Get_size() % TP:               # every rank exits non-zero; rank 0 says why
    raise SystemExit(f"run this chapter on a multiple of {TP} ranks: mpirun -n {TP} python {__file__}"
                     if world.Get_rank() == 0 else 1)
grid = ProcessGrid(world, dp=world.Get_size() // TP, tp=TP)
tp, i = grid.tp_comm, grid.tp_rank      # the tensor-parallel communicator (hsgd.comm.Comm) and my place in it
TOL = 1e-10                             # float64: parallel and serial differ by rounding, ~1e-16 relative
check = Checks(world, tol=TOL, width=60)  # check(what, err, tol): collective, raises on every rank unless err < tol
say = check.say                           # print on world rank 0 only


rng = np.random.default_rng(0)          # the same seed on every rank: every rank can build the serial reference

# %% [markdown]
# ## 1. Attention, split by heads
#
# The attention branch of a block, on its (already layer-normed) input $a$: (N, C), is
#
# $$q = aW_q + b_q,\quad k = aW_k + b_k,\quad v = aW_v + b_v, \qquad
# y^h = \text{softmax}\Big(\frac{q^h (k^h)^\top}{\sqrt{hs}} + M\Big)\, v^h, \qquad o = [y^1 \cdots y^{NH}]\, W_o
# + b_o ,$$
#
# where head $h$ owns columns $h \cdot hs \ldots (h+1) hs - 1$ of q, k and v (chapter 1). Each head reads only its
# own columns of q, k, v, and those columns come from the same columns of $W_q, W_k, W_v$. So a column split of
# the three weights *at head boundaries* gives each rank whole heads: rank $i$ holds heads
# $i \frac{NH}{tp} \ldots (i+1)\frac{NH}{tp} - 1$, that is columns $i\frac{C}{tp} \ldots (i+1)\frac{C}{tp} - 1$ of
# $W_q, W_k, W_v$ (C, C/tp) and of $b_q, b_k, b_v$, and runs the *unchanged* `layers.attention_forward` on its
# NH/tp heads. Its output $y_i$: (N, C/tp) is a block of columns of $y$, exactly the input block of a row split
# of $W_o$ (rows $i\frac{C}{tp} \ldots$, shape (C/tp, C)). This is chapter 5's column -> row pair again, with
# the attention in place of GELU:
#
# $$a \xrightarrow{f} \text{q, k, v column-parallel} \to \text{attention on local heads} \to
# \text{row-parallel } W_o \xrightarrow{g} o .$$
#
# One All-Reduce forward ($g$), one backward ($f$), both of an (N, C) tensor, and the (B, NH, T, T) attention
# scores never leave their rank.

# %%
B, T, C, NH = 2, 5, 16, 8               # hs = 2; NH/tp = 2 heads and C/tp = 4 columns per rank
hs, nh = C // NH, NH // TP              # head size, local heads
cols = slice(i * C // TP, (i + 1) * C // TP)          # my columns of q, k, v = my rows of W_o

W = {m: 0.5 * rng.standard_normal((C, C)) for m in ("q", "k", "v", "o")}   # (C, C) full weights
bias = {m: rng.standard_normal(C) for m in ("q", "k", "v", "o")}           # (C,)   full biases
a = rng.standard_normal((B, T, C))                    # (B, T, C) the branch input, replicated
dO = rng.standard_normal((B, T, C))                   # (B, T, C) dL/do, replicated

owned = tp.allgather_obj((i, i * nh, (i + 1) * nh, cols.start, cols.stop))
say("rank  heads   columns of Wq, Wk, Wv, bq, bk, bv (C, C/tp)   rows of Wo (C/tp, C)")
for r, h0, h1, c0, c1 in owned:
    say(f"{r:>4}  {h0}..{h1 - 1}    [{c0:>2}, {c1:>2})                                 [{c0:>2}, {c1:>2})")

# %%
grid.stats.reset()
a_f = tp_layers.f_forward(a, tp)                                          # (B, T, C) f: identity
q_i, c_q = layers.linear_forward(a_f, W["q"][:, cols], bias["q"][cols])   # (B, T, C/tp) my heads' queries
k_i, c_k = layers.linear_forward(a_f, W["k"][:, cols], bias["k"][cols])   # (B, T, C/tp)
v_i, c_v = layers.linear_forward(a_f, W["v"][:, cols], bias["v"][cols])   # (B, T, C/tp)
y_i, c_att = layers.attention_forward(q_i, k_i, v_i, nh)                 # (B, T, C/tp) nh whole heads
o, c_o = tp_layers.row_linear_forward(y_i, W["o"][cols, :], bias["o"], tp)  # (B, T, C) g: Allreduce
fwd_counts = grid.stats.counts()

grid.stats.reset()
dW = {m: np.zeros((C, C // TP)) for m in ("q", "k", "v")}                 # (C, C/tp) my columns' gradients
dW["o"] = np.zeros((C // TP, C))                                          # (C/tp, C) my rows' gradient
db = {m: np.zeros(C // TP) for m in ("q", "k", "v")}                      # (C/tp,)
db["o"] = np.zeros(C)                                                     # (C,) replicated
dy_i = tp_layers.row_linear_backward(dO, c_o, dW["o"], db["o"], tp)      # (B, T, C/tp) g^T: identity
dq_i, dk_i, dv_i = layers.attention_backward(dy_i, c_att)                 # (B, T, C/tp) x 3, local heads
da = layers.linear_backward(dq_i, c_q, dW["q"], db["q"])                  # (B, T, C) partial
da += layers.linear_backward(dk_i, c_k, dW["k"], db["k"])
da += layers.linear_backward(dv_i, c_v, dW["v"], db["v"])
da = tp_layers.f_backward(da, tp)                                         # (B, T, C) f^T: Allreduce
bwd_counts = grid.stats.counts()

# %% [markdown]
# The serial branch on the full matrices, with all NH heads, and the comparison: the local heads' output is a
# block of columns of the serial $y$, the branch output and $da$ are the serial ones, and every weight and bias
# gradient is the serial gradient's block (columns for q, k, v; rows for $W_o$; $b_o$ whole).

# %%
q, c_qs = layers.linear_forward(a, W["q"], bias["q"])                     # (B, T, C)
k, c_ks = layers.linear_forward(a, W["k"], bias["k"])
v, c_vs = layers.linear_forward(a, W["v"], bias["v"])
y, c_atts = layers.attention_forward(q, k, v, NH)                        # (B, T, C) all heads
o_serial, c_os = layers.linear_forward(y, W["o"], bias["o"])             # (B, T, C)
sW = {m: np.zeros((C, C)) for m in W}
sb = {m: np.zeros(C) for m in bias}
dq, dk, dv = layers.attention_backward(layers.linear_backward(dO, c_os, sW["o"], sb["o"]), c_atts)
da_serial = (layers.linear_backward(dq, c_qs, sW["q"], sb["q"]) + layers.linear_backward(dk, c_ks, sW["k"], sb["k"])
             + layers.linear_backward(dv, c_vs, sW["v"], sb["v"]))

check("attention: my heads' y_i vs serial y[:, :, cols]", rel_err(y_i, y[..., cols]))
check("attention branch: output o vs serial", rel_err(o, o_serial))
check("attention branch: da vs serial", rel_err(da, da_serial))
check("attention: dWq, dWk, dWv, dbq, dbv column shards vs serial",
      max([rel_err(dW[m], sW[m][:, cols]) for m in ("q", "k", "v")] +
          [rel_err(db[m], sb[m][cols]) for m in ("q", "v")]))
check("attention: dWo row shard, dbo vs serial", max(rel_err(dW["o"], sW["o"][cols, :]), rel_err(db["o"], sb["o"])))
check("attention: db_k (exactly 0 in exact arithmetic), max |db_k|", float(np.max(np.abs(db["k"]))))
one = {("tp", "Allreduce"): (1, B * T * C * 8)}
check.equal("attention: forward calls, bytes == (1, N*C*8)", fwd_counts, one)
check.equal("attention: backward calls, bytes == (1, N*C*8)", bwd_counts, one)

# %% [markdown]
# Why is the k-bias gradient zero? Adding $b_k$ to every key adds the same number $q_t \cdot b_k^h$ to every
# score of row $t$, and softmax ignores a shift shared by a row. So its gradient vanishes in exact arithmetic,
# and what is computed is rounding noise: about $10^{-15}$ here, where the other gradients are of order 1, so it
# was checked in absolute terms above. Serial and parallel runs produce *different* noise, and a purely relative
# error of one noise against the other would come out near 1. That is why `rel_err` (`tutorials/checks.py`)
# divides by at least `FLOOR` = $10^{-6}$; in section 4's model, whose gradients are about $10^{-2}$, the k-bias
# noise is near $10^{-18}$ and its floored error stays around $10^{-12}$.
#
# The split must fall on head boundaries: a head cut in two would need the other half of its q and k to form
# its scores. `tp_model.check_tp` refuses such a configuration, naming the sizes that work:

# %%
try:
    tp_model.check_tp(ModelConfig(vocab_size=13, seq_len=4, d_model=12, n_heads=6, n_layers=1, d_ff=24), TP)
    refused = ""
except ConfigError as e:
    refused = str(e)
say(f"n_heads=6, tp={TP}: ConfigError: {refused}")
check.holds("check_tp refuses n_heads=6 on tp=4, naming n_heads", refused.startswith("n_heads=6"))

# %% [markdown]
# ## 2. The vocab-parallel embedding
#
# The token table `wte` is (V, C): for a byte-level model small, but for GPT-2's V = 50257 it is one of the
# largest matrices. Split it by rows (vocabulary ids): rank $i$ holds ids $[iV_p, (i+1)V_p)$ with
# $V_p = \lceil V/tp \rceil$. When tp does not divide V the last rank's range runs past V, and its rows there are
# *padding*: zero, never looked up, their gradient always zero. With V = 13 and tp = 4, $V_p = 4$ and the last
# rank holds one real row (id 12) and three padding rows.
#
# Each token id is owned by exactly one rank. The look-up $x_{b,t} = \text{wte}[\text{idx}_{b,t}]$ becomes: every
# rank looks up the tokens it owns (at their local row $\text{idx} - iV_p$) and writes zeros for all the others,
# and an All-Reduce (sum) of the (B, T, C) results puts every row together, since each row is the sum of one real
# look-up and tp - 1 zeros:
#
# $$x_{b,t} = \sum_{i} [\text{idx}_{b,t} \in \text{range}_i]\ \text{wte}_i[\text{idx}_{b,t} - iV_p] +
# \text{wpe}_t .$$
#
# The backward needs no communication: $dx$ is replicated, and each rank scatter-adds it into the rows it owns
# (`tp_layers.vocab_embedding_backward`); `wpe` is replicated, and so is its gradient.

# %%
V = 13
start, Vp = tp_layers.vocab_range(V, TP, i)                               # my ids are [start, start + Vp)
wte = rng.standard_normal((V, C))                                         # (V, C) full table
wpe = rng.standard_normal((T, C))                                         # (T, C) replicated
idx = rng.integers(0, V, (B, T))                                          # (B, T) token ids, the same everywhere
idx[0, 0] = V - 1                                                         # make sure the last rank owns one
wte_i = tp_model.shard(wte, "wte", i, TP)                                 # (Vp, C) my rows, zero past V

mine = int(np.sum((idx >= start) & (idx < start + Vp)))
rows = tp.allgather_obj((i, start, start + Vp, min(start + Vp, V) - start, mine))
say(f"V = {V}, tp = {TP}: Vp = {Vp}, {tp_model.vocab_padding(ModelConfig(vocab_size=V), TP)} padding rows")
say("rank  ids          real rows   tokens of idx owned (of N = %d)" % (B * T))
for r, s0, s1, real, n_mine in rows:
    say(f"{r:>4}  [{s0:>2}, {s1:>2})     {real:>5}      {n_mine:>5}")

grid.stats.reset()
x, c_emb = tp_layers.vocab_embedding_forward(idx, wte_i, wpe, start, tp)  # (B, T, C) Allreduce inside
emb_counts = grid.stats.counts()
dx = rng.standard_normal((B, T, C))                                       # (B, T, C) dL/dx, replicated
dwte_i, dwpe = np.zeros_like(wte_i), np.zeros_like(wpe)                   # (Vp, C), (T, C)
tp_layers.vocab_embedding_backward(dx, c_emb, dwte_i, dwpe)               # no communication

x_serial, c_embs = layers.embedding_forward(idx, wte, wpe)                # (B, T, C)
dwte, dwpe_serial = np.zeros_like(wte), np.zeros_like(wpe)
layers.embedding_backward(dx, c_embs, dwte, dwpe_serial)
check("vocab embedding: x vs serial wte[idx] + wpe", rel_err(x, x_serial))
check("vocab embedding: dwte shard (padding rows 0) vs serial",
      rel_err(dwte_i, tp_model.shard(dwte, "wte", i, TP)))
check("vocab embedding: dwpe vs serial", rel_err(dwpe, dwpe_serial))
check.equal("vocab embedding: calls, bytes == (1, N*C*8)", emb_counts, one)

# %% [markdown]
# ## 3. The vocab-parallel LM head and cross-entropy
#
# The LM head $z = x_f W_{head}$, $W_{head}$: (C, V), is split by columns the same way: rank $i$ holds
# $W_{head,i}$: (C, Vp), the columns of its vocabulary ids (padding columns zero), and computes the logits
# $z_i = x_f W_{head,i}$: (N, Vp) of its ids: a column-parallel linear, entered through $f$. The cross-entropy
# needs, for each position $n$ with target $t_n$,
#
# $$\ell_n = \log \sum_{v=1}^{V} e^{z_{nv}} - z_{n t_n} = \log \sum_{v} e^{z_{nv} - m_n} - (z_{n t_n} - m_n),
# \qquad m_n = \max_v z_{nv},$$
#
# a sum over the whole vocabulary. It is assembled from the shards with two All-Reduces of per-position numbers:
#
# 1. each rank takes the max of its own columns, and an All-Reduce **MAX** gives $m_n$ to all ranks (every rank
#    must subtract the *same* $m_n$ for the partial sums to add up; the max keeps $e^{z - m} \le 1$);
# 2. each rank sums $e^{z_{nv} - m_n}$ over its columns, and the owner of $t_n$ contributes the shifted target
#    logit $z_{n t_n} - m_n$ (the others 0); one All-Reduce **SUM** of the (2, N) array gives both totals.
#
# Padding columns are set to $-\infty$ first, so they add $e^{-\infty} = 0$. Then every rank has the loss, and
# the backward, $\partial\,\text{loss} / \partial z_{nv} = (e^{z_{nv} - m_n} / s_n - [v = t_n]) / N$ with
# $s_n$ the total sum, needs only the local columns and the already-reduced $m_n$, $s_n$: no communication (the
# padding columns get exactly 0). The (N, V) logits are never gathered on one rank. The LM head's backward is
# then that of a column-parallel linear: $dW_{head,i} = x_f^\top dz_i$ locally, and $f$'s All-Reduce of the
# partial $dz_i W_{head,i}^\top$.

# %%
xf = rng.standard_normal((B, T, C))                                       # (B, T, C) LN_f output, replicated
W_head = rng.standard_normal((C, V))                                      # (C, V) full
targets = rng.integers(0, V, (B, T))                                      # (B, T)
targets[0, 1] = V - 1                                                     # one target on the last rank
W_head_i = tp_model.shard(W_head, "lm_head.weight", i, TP)                # (C, Vp) my columns, zero past V

grid.stats.reset()
z_i, c_head = layers.linear_forward(tp_layers.f_forward(xf, tp), W_head_i)                 # (B, T, Vp)
loss, c_ce = tp_layers.vocab_cross_entropy_forward(z_i, targets, start, V, tp)           # MAX, SUM Allreduces
ce_counts = grid.stats.counts()
dz_i = tp_layers.vocab_cross_entropy_backward(1.0, c_ce)                                 # (B, T, Vp) local
dW_head_i = np.zeros_like(W_head_i)
dxf = tp_layers.f_backward(layers.linear_backward(dz_i, c_head, dW_head_i), tp)          # (B, T, C) Allreduce

z, c_heads = layers.linear_forward(xf, W_head)                            # (B, T, V) serial logits
loss_serial, c_ces = layers.cross_entropy_forward(z, targets)
dz = layers.cross_entropy_backward(1.0, c_ces)                            # (B, T, V)
dW_head = np.zeros_like(W_head)
dxf_serial = layers.linear_backward(dz, c_heads, dW_head)
dz_padded = np.concatenate([dz, np.zeros((B, T, Vp * TP - V))], axis=-1)  # (B, T, Vp*tp) zero past V

check("vocab cross-entropy: loss vs serial", abs(loss - loss_serial) / abs(loss_serial))
check("vocab cross-entropy: dlogits shard vs serial", rel_err(dz_i, dz_padded[..., start:start + Vp]))
pad = dz_i[..., max(V - start, 0):]                                       # my padding columns (none but on the last)
check("vocab cross-entropy: max |dlogits| in padding columns", float(np.max(np.abs(pad), initial=0.0)))
check("LM head: dW_head shard vs serial", rel_err(dW_head_i, tp_model.shard(dW_head, "lm_head.weight", i, TP)))
check("LM head: dxf vs serial", rel_err(dxf, dxf_serial))
N = B * T
ce_expected = {("tp", "Allreduce"): (2, 3 * N * 8)}                       # (N,) MAX + (2, N) SUM, float64
check.equal("vocab cross-entropy: calls, bytes == (2, 3*N*8)", ce_counts, ce_expected)

# %% [markdown]
# What that saves. The logits and the softmax saved for the backward are (N, V) on one device but (N, Vp) per
# rank here, and the only traffic of the loss is $3N$ numbers, where gathering the logits would move all
# $N \cdot V$. For this toy it hardly matters; for GPT-2's vocabulary it does:

# %%
say(f"this toy: logits per rank {z_i.shape} = {z_i.nbytes} bytes instead of {z.shape} = {z.nbytes} bytes; "
    f"loss traffic {3 * N * 8} bytes instead of an Allgather of {z.nbytes}")
Ng, Vg = 8 * 1024, 50257                                                  # B = 8 sequences of T = 1024, float32
Vpg = -(-Vg // TP)
say(f"GPT-2 vocabulary, N = {Ng}, float32, tp = {TP}: logits {Ng * Vg * 4 / 2**30:.2f} GiB on one device, "
    f"{Ng * Vpg * 4 / 2**30:.2f} GiB per rank; loss traffic {3 * Ng * 4 / 2**10:.0f} KiB instead of "
    f"{Ng * Vg * 4 / 2**30:.2f} GiB")

# %% [markdown]
# ## 4. The whole model: check against serial
#
# `hsgd.tp_model` puts the pieces together: vocab-parallel embedding, per block LayerNorms (replicated), the
# attention branch of section 1 and the MLP of chapter 5, LN_f, the vocab-parallel LM head and loss. LayerNorm
# parameters, `wpe` and the row-parallel biases are replicated; everything else is split, and every gradient
# shard must equal `tp_model.shard(serial_grad, name, rank, tp, scheme)`, the matching slice of
# `serial.loss_and_grads`. Three variants: Megatron's f/g ("megatron"), the lecture's All-Gather scheme
# ("gather", backward slices), and "gather" with `reduce_scatter=True` (backward by the $1/tp$-scaled
# Reduce-Scatter of chapter 5: the same numbers, paid for with communication).
#
# Communication of one `loss_and_grads` (forward + backward), $N = BT$, $s$ bytes per number, L blocks:
#
# * **megatron**: $4L + 4$ All-Reduces. The embedding 1 of (N, C); per block 2 forward ($g$ after the attention
#   projection and after the MLP projection) and 2 backward ($f$ before q, k, v and before fc), each (N, C); the
#   LM head's $f$ backward 1 of (N, C); the cross-entropy's MAX of (N,) and SUM of (2, N). In bytes
#   $((4L + 2)C + 3)\,N s$.
# * **gather**: per block 4 All-Gathers (the attention heads (N, C), their projection (N, C), the GELU output
#   (N, F), the MLP projection (N, C)): $L(3C + F)Ns$ bytes; and $4L + 4$ All-Reduces: per block, in the
#   backward, the partial input gradients of the attention projection (N, C), of the MLP projection (N, F), of fc
#   (N, C) and of q, k, v together (N, C), plus embedding, LM head and cross-entropy as above:
#   $((3C + F)L + 2C + 3)\,Ns$ bytes. With `reduce_scatter=True`, $4L$ Reduce-Scatters of $L(3C+F)Ns$ bytes more.

# %%
cfg = ModelConfig(vocab_size=13, seq_len=6, d_model=16, n_heads=8, n_layers=2, d_ff=16)
params = serial.init_params(cfg, seed=0, dtype="float64")
for p in params.values():               # noise, so LayerNorm weights are not all 1 and biases not all 0
    p += rng.normal(0.0, 0.1, p.shape)
batch = 3
idx = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))               # (B, T), the same on every rank
targets = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))
loss_serial, grads_serial = serial.loss_and_grads(params, idx, targets, cfg)
kb = grads_serial["h.0.attn.k.bias"]
say(f"tiny model: {cfg.n_params()} parameters in {len(params)} arrays, batch {batch}; serial loss "
    f"{loss_serial:.6f}; max |serial d(h.0.attn.k.bias)| = {np.max(np.abs(kb)):.0e} (zero up to rounding)")

for scheme, rs in (("megatron", False), ("gather", False), ("gather", True)):
    name = scheme + (" + reduce_scatter" if rs else "")
    local = tp_model.shard_params(params, i, TP, scheme)                  # my shards, cut the scheme's way
    grid.stats.reset()
    loss, grads = tp_model.loss_and_grads(local, idx, targets, cfg, tp, scheme, reduce_scatter=rs)
    measured = grid.stats.counts()
    formula = tp_model.comm_formula(cfg, batch, itemsize=8, scheme=scheme, reduce_scatter=rs)
    errs = {n: rel_err(grads[n], tp_model.shard(grads_serial[n], n, i, TP, scheme)) for n in grads}
    top = sorted(errs, key=errs.get, reverse=True)[:2]
    rest = max(e for n, e in errs.items() if "attn.k.bias" not in n)     # all but the zero k-bias gradients
    say(f"\n{name}: shards on rank 0: wte {local['wte'].shape}, h.0.attn.q.weight "
        f"{local['h.0.attn.q.weight'].shape}, h.0.mlp.proj.weight {local['h.0.mlp.proj.weight'].shape}, "
        f"lm_head.weight {local['lm_head.weight'].shape}")
    say("  largest gradient errors: " + ", ".join(f"{n} {errs[n]:.1e}" for n in top)
        + f"; largest of the others {rest:.1e}")
    for key in sorted(set(measured) | set(formula)):
        say(f"  {key[1]:<22s} measured {measured.get(key, (0, 0))}, formula {formula.get(key, (0, 0))} "
            "(calls, bytes)")
    check(f"{name}: loss vs serial", abs(loss - loss_serial) / abs(loss_serial))
    check(f"{name}: all {len(grads)} gradient shards vs serial", max(errs.values()))
    check.equal(f"{name}: communication == comm_formula", measured, formula)

# %% [markdown]
# At the size of GPT-2 small (C = 768, F = 3072, L = 12, V = 50257) with B = 8 sequences of T = 1024 in float32,
# the formula gives the traffic one TP group pays per step, in each scheme:

# %%
gpt2 = ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072)
per_step = {s: sum(b for _, b in tp_model.comm_formula(gpt2, 8, 4, s).values()) for s in ("megatron", "gather")}
say(f"GPT-2 small, B=8, T=1024, float32: megatron {per_step['megatron'] / 2**30:.2f} GiB, gather "
    f"{per_step['gather'] / 2**30:.2f} GiB of collective payload per step "
    f"({per_step['gather'] / per_step['megatron']:.1f}x)")

worst, err = check.worst()
say(f"\nchapter 4: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error "
    f"{err:.1e} ({worst}), tolerance {TOL:.0e}")
grid.free()
