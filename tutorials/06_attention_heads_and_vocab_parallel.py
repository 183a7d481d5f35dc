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
# # Chapter 6: attention heads, the vocab-parallel embedding and loss, the whole TP model, sequence parallelism
#
# Chapter 5 split the linear layer and the MLP over tp ranks. A GPT is wide in three more places: the attention,
# the token embedding, and the LM head with its softmax over the vocabulary. This chapter splits each, following
# the lecture's section 3.2 ("for attention, the heads can be assigned to different workers") and Megatron-LM
# (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism",
# arXiv:1909.08053), checks the whole model and its bytes against serial and a formula, and then splits along the
# sequence what stays whole between the split matmuls (sequence parallelism, and its asynchronous form).
#
# Run it with four ranks (measured: about 5 s on a quiet 2-core machine, 13 to 21 s under load, mostly start-up
# and drawing). Rank 0 draws three pictures into `$HSGD_FIGURES` (default `tutorials/figures/`):
#
# mpirun -n 4 python tutorials/06_attention_heads_and_vocab_parallel.py
#
# Legend: B batch, T sequence, C d_model, NH heads, hs = C/NH head size, F d_ff, V vocabulary,
# Vp = ceil(V/tp) vocabulary rows per rank, N = B*T positions, L layers, tp tensor-parallel ranks, i a rank,
# s bytes per number. A `/tp` in a shape comment marks the split dimension, e.g. `(C, C/tp)`; `Vp` marks a
# vocabulary shard; `T/tp` a rank's positions under sequence parallelism.

# %%
from fractions import Fraction

import numpy as np
from mpi4py import MPI

from hsgd.model.config import ModelConfig
from hsgd.model import layers, serial
from hsgd.accounting import activations
from hsgd.tp import layers as tp_layers, model as tp_model, shards as tp_shards
from hsgd.errors import ConfigError
from hsgd.grid.process_grid import ProcessGrid
from hsgd.run.report import fmt_bytes

import pictures                      # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, payload, rel_err, ring_bytes, ring_share   # tutorials/checks.py, shared by the chapters

TP = 4                                  # tensor-parallel size; more ranks than 4 form data-parallel copies
TOL = 1e-10                             # float64: parallel and serial differ by rounding, ~1e-16 relative
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, TP, tol=TOL, width=64, multiple=True)
grid = ProcessGrid(world, dp=world.Get_size() // TP, tp=TP)
tp, i = grid.tp_comm, grid.tp_rank      # the tensor-parallel communicator (hsgd.grid.comm.Comm) and my place in it
RANK_COLORS = [f"C{r}" for r in range(TP)]  # one colour per tp rank in the pictures (matplotlib's cycle)


rng = np.random.default_rng(0)          # the same seed on every rank: every rank can build the serial reference

# %% [markdown]
# ## 1. Attention, split by heads
#
# The attention branch on its layer-normed input $a$: (N, C) is
#
# $$q = aW_q + b_q,\quad k = aW_k + b_k,\quad v = aW_v + b_v, \qquad
# y^h = \text{softmax}\Big(\frac{q^h (k^h)^\top}{\sqrt{hs}} + M\Big)\, v^h, \qquad o = [y^1 \cdots y^{NH}]\, W_o
# + b_o ,$$
#
# where head $h$ owns columns $h \cdot hs \ldots (h+1) hs - 1$ of q, k and v, which come from the same columns of
# $W_q, W_k, W_v$. A column split *at head boundaries* therefore gives each rank whole heads: rank $i$ holds
# columns $i\frac{C}{tp} \ldots (i+1)\frac{C}{tp} - 1$ of $W_q, W_k, W_v$ (C, C/tp) and their biases, and runs
# the unchanged `layers.attention_forward` on its NH/tp heads. Its output $y_i$: (N, C/tp) is exactly the input
# block of a row split of $W_o$ (C/tp, C): chapter 5's column -> row pair, with attention in place of GELU,
#
# $$a \xrightarrow{f} \text{q, k, v column-parallel} \to \text{attention on local heads} \to
# \text{row-parallel } W_o \xrightarrow{g} o .$$
#
# One (N, C) All-Reduce each way; the (B, NH, T, T) scores never leave their rank.

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
# Each rank's columns of $W_q$, $W_k$, $W_v$ and rows of $W_o$, head by head, and below, the causal attention
# probabilities of the first sequence that each rank computed for its own heads, never sent anywhere.

# %%
P_mine = c_att[3][0]                                                      # (NH/tp, T, T) my heads, sequence 0
P_all = tp.allgather_obj(P_mine)                                          # for the picture only: tiny
if rank == 0:
    from matplotlib.patches import Rectangle

    fig, axes = pictures.figure(10, 4.4, nrows=2, ncols=NH, gridspec_kw={"height_ratios": [1.5, 1]})
    for ax in axes[0]:
        ax.remove()
    top = fig.add_subplot(2, 1, 1)
    for m, name in enumerate(("W_q", "W_k", "W_v", "W_o")):
        x0 = m * (C + 4)
        for r in range(TP):                                               # columns (q, k, v) or rows (o) of rank r
            if name == "W_o":
                top.add_patch(Rectangle((x0, C - (r + 1) * C / TP), C, C / TP, fc=RANK_COLORS[r], ec="black",
                                        lw=0.6, alpha=0.85))
            else:
                top.add_patch(Rectangle((x0 + r * C / TP, 0), C / TP, C, fc=RANK_COLORS[r], ec="black", lw=0.6,
                                        alpha=0.85))
        for h in range(1, NH):                                            # head boundaries, every hs columns/rows
            if name == "W_o":
                top.plot([x0, x0 + C], [C - h * hs] * 2, color="white", lw=0.5)
            else:
                top.plot([x0 + h * hs] * 2, [0, C], color="white", lw=0.5)
        for h in range(NH):
            if name != "W_o":
                top.text(x0 + (h + 0.5) * hs, C + 0.5, f"h{h}", ha="center", va="bottom", fontsize=5.5)
        shape = f"({C}, {C // TP}) per rank" if name != "W_o" else f"({C // TP}, {C}) per rank"
        split = "columns" if name != "W_o" else "rows"
        top.text(x0 + C / 2, -1.0, f"${name}$ ({C}, {C}): {split}\n{shape}", ha="center", va="top", fontsize=7)
    top.set_xlim(-1, 4 * (C + 4))
    top.set_ylim(-6, C + 2.5)
    top.set_aspect("equal")
    top.axis("off")
    top.set_title(f"NH = {NH} heads of hs = {hs} columns on tp = {TP} ranks: rank i holds heads "
                  f"{nh}i .. {nh}i+{nh - 1} whole", fontsize=8)
    for r, P_r in enumerate(P_all):
        for j in range(nh):
            ax = axes[1][r * nh + j]
            ax.imshow(P_r[j], cmap="viridis", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
            for side in ax.spines.values():
                side.set_color(RANK_COLORS[r])
                side.set_linewidth(2.5)
            ax.set_title(f"head {r * nh + j} (rank {r})", fontsize=6)
    axes[1][0].set_ylabel(f"query t\n(T = {T})", fontsize=6)
    axes[1][0].set_xlabel("key t'", fontsize=6)
    say(f"picture: {pictures.save(fig, '06_attention_heads_split')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# Against the serial branch: the local heads' output, the branch output, $da$, and every gradient as the serial
# one's block (columns for q, k, v; rows for $W_o$; $b_o$ whole).

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
check("attention: my heads' probabilities vs serial", rel_err(c_att[3], c_atts[3][:, i * nh:(i + 1) * nh]))
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
# The k-bias gradient is zero: adding $b_k$ to every key shifts all scores of a row by $q_t \cdot b_k^h$, which
# softmax ignores. What is computed is rounding noise, different in serial and parallel runs, hence the absolute
# check above and `rel_err`'s floor (`FLOOR` = $10^{-6}$ in `tutorials/checks.py`).
#
# The split must fall on head boundaries, or a head would need the other half of its q and k. `tp_shards.check_tp`
# refuses such a configuration, naming sizes that work (exercise 2 splits heads unequally, as DeepSpeed allows):

# %%
try:
    tp_shards.check_tp(ModelConfig(vocab_size=13, seq_len=4, d_model=12, n_heads=6, n_layers=1, d_ff=24), TP)
    refused = ""
except ConfigError as e:
    refused = str(e)
say(f"n_heads=6, tp={TP}: ConfigError: {refused}")
check.holds("check_tp refuses n_heads=6 on tp=4, naming n_heads", refused.startswith("n_heads=6"))

# %% [markdown]
# ## 2. The vocab-parallel embedding
#
# `wte` is (V, C), for GPT-2's V = 50257 one of the largest matrices. Split it by rows: rank $i$ holds ids
# $[iV_p, (i+1)V_p)$, $V_p = \lceil V/tp \rceil$. Where the last range runs past V its rows are *padding*: zero,
# never looked up, gradient zero. With V = 13 and tp = 4, $V_p = 4$ and the last rank holds one real row.
#
# Every rank looks up the tokens it owns (local row $\text{idx} - iV_p$) and writes zeros for the others; an
# All-Reduce (sum) of the (B, T, C) results completes every row, one real look-up plus tp - 1 zeros:
#
# $$x_{b,t} = \sum_{i} [\text{idx}_{b,t} \in \text{range}_i]\ \text{wte}_i[\text{idx}_{b,t} - iV_p] +
# \text{wpe}_t .$$
#
# The backward is local: each rank scatter-adds the replicated $dx$ into its own rows.

# %%
V = 13
start, Vp = tp_layers.vocab_range(V, TP, i)                               # my ids are [start, start + Vp)
wte = rng.standard_normal((V, C))                                         # (V, C) full table
wpe = rng.standard_normal((T, C))                                         # (T, C) replicated
idx = rng.integers(0, V, (B, T))                                          # (B, T) token ids, the same everywhere
idx[0, 0] = V - 1                                                         # make sure the last rank owns one
wte_i = tp_shards.shard(wte, "wte", i, TP)                                 # (Vp, C) my rows, zero past V

mine = int(np.sum((idx >= start) & (idx < start + Vp)))
rows = tp.allgather_obj((i, start, start + Vp, min(start + Vp, V) - start, mine))
say(f"V = {V}, tp = {TP}: Vp = {Vp}, {tp_shards.vocab_padding(ModelConfig(vocab_size=V), TP)} padding rows")
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
      rel_err(dwte_i, tp_shards.shard(dwte, "wte", i, TP)))
check("vocab embedding: dwpe vs serial", rel_err(dwpe, dwpe_serial))
check.equal("vocab embedding: calls, bytes == (1, N*C*8)", emb_counts, one)

# %% [markdown]
# ## 3. The vocab-parallel LM head and cross-entropy
#
# The LM head $z = x_f W_{head}$ is split by columns the same way: rank $i$ holds $W_{head,i}$: (C, Vp) and
# computes its logits $z_i$: (N, Vp), a column-parallel linear entered through $f$. The cross-entropy of position
# $n$ with target $t_n$,
#
# $$\ell_n = \log \sum_{v=1}^{V} e^{z_{nv}} - z_{n t_n} = \log \sum_{v} e^{z_{nv} - m_n} - (z_{n t_n} - m_n),
# \qquad m_n = \max_v z_{nv},$$
#
# sums over the whole vocabulary. Three numbers per position, each reduced over the ranks, assemble it:
#
# 1. an All-Reduce **MAX** of each rank's own max gives $m_n$ (all ranks must subtract the *same* $m_n$ for the
#    partial sums to add up; it keeps $e^{z - m} \le 1$);
# 2. an All-Reduce **SUM** of each rank's $\sum e^{z_{nv} - m_n}$ gives $s_n$;
# 3. an All-Reduce **SUM** of the shifted target logit $z_{n t_n} - m_n$, contributed by its owner (others 0).
#
# `tp_layers.vocab_cross_entropy_forward` sends 2 and 3 in one (2, N) All-Reduce: two calls, $3N$ numbers.
# Padding columns are set to $-\infty$ and add 0. The backward, $\partial\,\text{loss} / \partial z_{nv} =
# (e^{z_{nv} - m_n} / s_n - [v = t_n]) / N$, needs only local columns and the reduced $m_n$, $s_n$: no
# communication. The LM head's backward is then a column-parallel linear's.

# %%
xf = rng.standard_normal((B, T, C))                                       # (B, T, C) LN_f output, replicated
W_head = rng.standard_normal((C, V))                                      # (C, V) full
targets = rng.integers(0, V, (B, T))                                      # (B, T)
targets[0, 1] = V - 1                                                     # one target on the last rank
W_head_i = tp_shards.shard(W_head, "lm_head.weight", i, TP)                # (C, Vp) my columns, zero past V

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
check("LM head: dW_head shard vs serial", rel_err(dW_head_i, tp_shards.shard(dW_head, "lm_head.weight", i, TP)))
check("LM head: dxf vs serial", rel_err(dxf, dxf_serial))
N = B * T
ce_expected = {("tp", "Allreduce"): (2, 3 * N * 8)}                       # (N,) MAX + (2, N) SUM, float64
check.equal("vocab cross-entropy: calls, bytes == (2, 3*N*8)", ce_counts, ce_expected)

# %% [markdown]
# The same three numbers by hand, one All-Reduce each (as Megatron-LM and PyTorch do), give the same loss.

# %%
zl = z_i.reshape(N, Vp).copy()                                            # (N, Vp) my logits
zl[:, max(V - start, 0):] = -np.inf                                       # my padding columns (if any)
m_i = zl.max(axis=1)                                                      # (N,) 1. my max ...
m = m_i.copy()
tp.Allreduce(m, op=MPI.MAX)                                               # (N,) ... the max over all V
e_i = np.exp(zl - m[:, None]).sum(axis=1)                                 # (N,) 2. my sum of exp(z - m) ...
s = e_i.copy()
tp.Allreduce(s)                                                           # (N,) ... the sum over all V
tgt = targets.reshape(-1) - start                                         # (N,) target column in my shard
owner = (tgt >= 0) & (tgt < Vp)
t_i = np.where(owner, zl[np.arange(N), np.where(owner, tgt, 0)] - m, 0.0)  # (N,) 3. z_t - m if I own t, else 0
zt = t_i.copy()
tp.Allreduce(zt)                                                          # (N,) ... from its owner
loss_by_hand = float(np.mean(np.log(s) - zt))
check("three All-Reduces by hand: loss vs serial", abs(loss_by_hand - loss_serial) / abs(loss_serial))

# %% [markdown]
# Left, the (N, tp Vp) logits, a block per rank (padding hatched, targets circled); right, for each of the three
# numbers, what every rank contributes and what the All-Reduce returns.

# %%
pieces = tp.allgather_obj((zl, m_i, e_i, t_i))                            # for the picture only: tiny
if rank == 0:
    from matplotlib.patches import Rectangle

    fig, axes = pictures.figure(10, 3.9, ncols=4, gridspec_kw={"width_ratios": [TP * Vp, TP + 2, TP + 2, TP + 2]})
    logits = np.concatenate([p[0] for p in pieces], axis=1)               # (N, tp*Vp), -inf on padding
    shown = np.where(np.isfinite(logits), logits, np.nan)
    axes[0].imshow(shown, cmap="coolwarm", aspect="auto")
    for c in range(V, TP * Vp):                                           # padding columns: -inf
        axes[0].add_patch(Rectangle((c - 0.5, -0.5), 1, N, fc="0.85", ec="0.5", hatch="///", lw=0.3))
    for r in range(TP):
        axes[0].add_patch(Rectangle((r * Vp - 0.4, -0.4), Vp - 0.2, N - 0.2, fill=False, ec=RANK_COLORS[r],
                                    lw=2.5))
        axes[0].text((r + 0.5) * Vp - 0.5, -0.7, f"rank {r}\nids [{r * Vp}, {(r + 1) * Vp})", ha="center",
                     va="bottom", fontsize=6.5, color=RANK_COLORS[r])
    axes[0].scatter(targets.reshape(-1), np.arange(N), s=40, facecolors="none", edgecolors="black", lw=1.2)
    axes[0].set_xlabel(f"vocabulary id (V = {V}, padded to tp Vp = {TP * Vp})", fontsize=7)
    axes[0].set_ylabel(f"position n (N = B T = {N})", fontsize=7)
    axes[0].set_title("logits z (each rank holds only its block; padding hatched, targets circled)", fontsize=8,
                      pad=24)
    for ax, k, reduced, title in ((axes[1], 1, m, "1. MAX: $m_n$"), (axes[2], 2, s, "2. SUM: $s_n$"),
                                  (axes[3], 3, zt, "3. SUM: $z_{n t_n} - m_n$")):
        table = np.full((N, TP + 2), np.nan)
        table[:, :TP] = np.stack([p[k] for p in pieces], axis=1)          # what each rank contributes
        table[:, TP + 1] = reduced                                        # what every rank gets back
        image = ax.imshow(table, cmap="viridis", aspect="auto")
        for n in range(N):
            for col in list(range(TP)) + [TP + 1]:                       # dark text on the light cells
                light = sum(image.cmap(image.norm(table[n, col]))[:3]) > 1.8
                ax.text(col, n, f"{table[n, col]:.1f}", ha="center", va="center", fontsize=5,
                        color="black" if light else "white")
        ax.set_xticks(list(range(TP)) + [TP + 1], [f"r{r}" for r in range(TP)] + ["all"], fontsize=6)
        ax.set_yticks([])
        ax.set_title(title, fontsize=8)
    axes[0].tick_params(labelsize=6)
    fig.suptitle(f"vocab-parallel cross-entropy, tp = {TP}: hsgd sends these in 2 All-Reduces (MAX of (N,), "
                 f"SUM of (2, N)), payload {payload(ce_counts):,} bytes; the logits never travel", fontsize=8)
    say(f"picture: {pictures.save(fig, '06_vocab_parallel_cross_entropy')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# The logits and the softmax saved for the backward are (N, Vp) per rank instead of (N, V), and the loss moves
# $3N$ numbers where gathering the logits would move $N \cdot V$. In both columns: the loss's two All-Reduces
# carry $3Ns$ bytes of payload, a ring sending $2\frac{tp-1}{tp}$ of it per rank; an All-Gather of the logits would
# carry $N \, tp V_p s$, a ring sending $\frac{tp-1}{tp}$ of it. For GPT-2's vocabulary that matters:

# %%
gather_logits = {("tp", "Allgather"): (1, N * TP * Vp * 8)}               # what gathering the logits would cost
say(f"this toy: logits per rank {z_i.shape} = {z_i.nbytes} bytes instead of {z.shape} = {z.nbytes} bytes")
say(f"{'':<36}{'payload':>12}{'ring, sent per rank':>22}")
say(f"{'loss: 2 All-Reduces (3N numbers)':<36}{payload(ce_counts):>12,}{float(ring_bytes(ce_counts, TP)):>22,.0f}")
say(f"{'an All-Gather of the logits':<36}{payload(gather_logits):>12,}{float(ring_bytes(gather_logits, TP)):>22,.0f}")
Ng, Vg = 8 * 1024, 50257                                                  # B = 8 sequences of T = 1024, float32
Vpg = -(-Vg // TP)
loss_g = {("tp", "Allreduce"): (2, 3 * Ng * 4)}
gather_g = {("tp", "Allgather"): (1, Ng * TP * Vpg * 4)}
say(f"GPT-2 vocabulary, N = {Ng}, float32, tp = {TP}: logits {Ng * Vg * 4 / 2**30:.2f} GiB on one device, "
    f"{Ng * Vpg * 4 / 2**30:.2f} GiB per rank; the loss's payload {payload(loss_g) / 2**10:.0f} KiB (ring "
    f"{float(ring_bytes(loss_g, TP)) / 2**10:.0f} KiB per rank) instead of {payload(gather_g) / 2**30:.2f} GiB (ring "
    f"{float(ring_bytes(gather_g, TP)) / 2**30:.2f} GiB per rank)")

# %% [markdown]
# ## 4. The whole model: check against serial
#
# `hsgd.tp.model` assembles the pieces; LayerNorm parameters, `wpe` and the row-parallel biases are replicated,
# everything else split, and every gradient shard must equal `tp_shards.shard(serial_grad, name, rank, tp,
# scheme)`. Three variants: Megatron's f/g ("megatron"), the
# lecture's All-Gather scheme ("gather", backward slices), and "gather" with `reduce_scatter=True` (chapter 5's
# $1/tp$-scaled Reduce-Scatter: the same numbers, more traffic).
#
# Payload of one `loss_and_grads`, $N = BT$, $s$ bytes per number, L blocks (what `CommStats` records and
# `comm_formula` predicts):
#
# * **megatron**: $4L + 4$ All-Reduces: the embedding's (N, C); per block $g$ after the attention and MLP
#   projections and $f$'s backward before q, k, v and before fc, each (N, C); the LM head's $f$ backward (N, C);
#   the cross-entropy's (N,) and (2, N). In bytes $((4L + 2)C + 3)\,N s$.
# * **gather**: per block 4 All-Gathers (heads (N, C), their projection (N, C), GELU output (N, F), MLP projection
#   (N, C)), $L(3C + F)Ns$ bytes; and $4L + 4$ All-Reduces, per block the backward's partial input gradients of
#   the attention projection (N, C), the MLP projection (N, F), fc (N, C) and q, k, v (N, C), plus embedding, LM
#   head and loss: $((3C + F)L + 2C + 3)\,Ns$ bytes. With `reduce_scatter=True`, $4L$ Reduce-Scatters of
#   $L(3C+F)Ns$ bytes more.

# %%
cfg = ModelConfig(vocab_size=13, seq_len=8, d_model=16, n_heads=8, n_layers=2, d_ff=16)   # T splits 1, 2, 4 ways
params = serial.init_params(cfg, seed=0, dtype="float64")
for p in params.values():               # noise, so LayerNorm weights are not all 1 and biases not all 0
    p += rng.normal(0.0, 0.1, p.shape)
batch = 3
idx = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))               # (B, T), the same on every rank
targets = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))
loss_serial, grads_serial = serial.loss_and_grads(params, idx, targets, cfg)
kb = grads_serial["h.0.attn.k.bias"]
say(f"tiny model: {cfg.n_params()} parameters in {len(params)} arrays, batch {batch}, T = {cfg.seq_len}; serial "
    f"loss {loss_serial:.6f}; max |serial d(h.0.attn.k.bias)| = {np.max(np.abs(kb)):.0e} (zero up to rounding)")

measured_of = {}                                                          # {scheme: {(comm, op): (calls, bytes)}}
for scheme, rs in (("megatron", False), ("gather", False), ("gather", True)):
    name = scheme + (" + reduce_scatter" if rs else "")
    local = tp_shards.shard_params(params, i, TP, scheme)                  # my shards, cut the scheme's way
    grid.stats.reset()
    loss, grads = tp_model.loss_and_grads(local, idx, targets, tp_model.TPSetup(cfg, tp, scheme, reduce_scatter=rs))
    measured_of[name] = measured = grid.stats.counts()
    formula = tp_model.comm_formula(cfg, batch, itemsize=8, scheme=scheme, reduce_scatter=rs)
    errs = {n: rel_err(grads[n], tp_shards.shard(grads_serial[n], n, i, TP, scheme)) for n in grads}
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
# At GPT-2 small's size (C = 768, F = 3072, L = 12, V = 50257), B = 8 sequences of T = 1024 in float32, one TP
# group of tp = 4 per step, in both columns (the gather scheme's All-Gathers cost half as much per payload byte on
# a ring):

# %%
gpt2 = ModelConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072)
per_step = {s: tp_model.comm_formula(gpt2, 8, 4, s) for s in ("megatron", "gather")}
say(f"{'GPT-2 small, B=8, T=1024, float32, tp=4':<42}{'payload':>12}{'ring, sent per rank':>22}")
for s, counts in per_step.items():
    say(f"{s + ' (' + ', '.join(f'{c} {op}' for (_, op), (c, _) in counts.items()) + ')':<42}"
        f"{payload(counts) / 2**30:>8.2f} GiB{float(ring_bytes(counts, TP)) / 2**30:>18.2f} GiB")
gpt2_ratio = (payload(per_step["gather"]) / payload(per_step["megatron"]),
              float(ring_bytes(per_step["gather"], TP) / ring_bytes(per_step["megatron"], TP)))
say(f"{'ratio, gather / megatron':<42}{gpt2_ratio[0]:>11.2f}x{gpt2_ratio[1]:>21.2f}x")

# %% [markdown]
# ## 5. Sequence parallelism: the tensor-parallel side of activation memory
#
# Between the split matmuls Megatron's scheme keeps tp identical copies of (B, T, C): the LayerNorms, the
# residuals and the inputs cached by q, k, v, fc and the LM head. Korthikanti et
# al. (2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198) split them along
# the sequence: LayerNorm and the residual treat each position alone, so rank $r$ keeps only its T-shard
# (B, T/tp, C). Two conjugate operators switch layouts (`tp_layers.gather_T_*`, `scatter_T_*`; the paper's $g$
# and $\bar g$):
#
# | operator | forward | backward | replaces |
# |---|---|---|---|
# | gather_T | All-Gather along T: (B, T/tp, C) -> (B, T, C) | Reduce-Scatter along T | $f$: into q, k, v, fc, LM head |
# | scatter_T | Reduce-Scatter along T: partial (B, T, C) -> (B, T/tp, C) | All-Gather along T | $g$: proj, embedding |
#
# Megatron's All-Reduce after each projection becomes its two halves (chapter 2): a Reduce-Scatter, then, after
# LayerNorm and the residual on $1/tp$ of the positions, an All-Gather before the next split matmul. gather_T's
# backward is chapter 5's case 2: every rank's $dX$ is a different partial, summed and scattered. The replicated
# parameters (LayerNorms, projection biases, `wpe`) now see only their positions, so their gradients are partial
# and are All-Reduced, one buffer per gradient group (exercise 3). This is `tp_model`'s "sequence" scheme
# (`hsgd/tp/schemes.py`), checked first on section 4's model and batch (T = 8: 2 positions per rank):

# %%
local = tp_shards.shard_params(params, i, TP, "sequence")                 # cut as Megatron's: the same shards
grid.stats.reset()
loss, grads = tp_model.loss_and_grads(local, idx, targets, tp_model.TPSetup(cfg, tp, "sequence"))
measured_of["sequence"] = grid.stats.counts()
say(f"sequence: between the split matmuls a rank holds {tp_model.stage_activation_shape('sequence', batch, cfg, TP)}"
    f" of the activation, where Megatron's holds {tp_model.stage_activation_shape('megatron', batch, cfg, TP)}")
check("sequence: loss vs serial", abs(loss - loss_serial) / abs(loss_serial))
check(f"sequence: all {len(grads)} gradient shards vs serial",
      max(rel_err(grads[n], tp_shards.shard(grads_serial[n], n, i, TP, "sequence")) for n in grads))
check.equal("sequence: communication == comm_formula", measured_of["sequence"],
            tp_model.comm_formula(cfg, batch, itemsize=8, scheme="sequence"))

# %% [markdown]
# The collectives of one forward and backward on `tp_comm` (N = B T = 24, C = 16, float64), in both columns:

# %%
say(f"{'scheme':<10}{'operation':<22}{'calls':>6}{'payload':>10}{'ring, sent per rank':>22}")
for scheme in ("megatron", "sequence"):
    counts = measured_of[scheme]
    for key, (calls, nb) in sorted(counts.items()):
        say(f"{scheme:<10}{key[1]:<22}{calls:>6}{nb:>10,}{float(ring_bytes({key: (calls, nb)}, TP)):>22,.0f}")
    say(f"{scheme:<10}{'all':<22}{sum(c for c, _ in counts.values()):>6}{payload(counts):>10,}"
        f"{float(ring_bytes(counts, TP)):>22,.0f}")
seq_ratio = (payload(measured_of["sequence"]) / payload(measured_of["megatron"]),
             float(ring_bytes(measured_of["sequence"], TP) / ring_bytes(measured_of["megatron"], TP)))
say(f"{'sequence / megatron':<38}{seq_ratio[0]:>9.2f}x{seq_ratio[1]:>21.2f}x")
L, Ns, itemsize = cfg.n_layers, batch * cfg.seq_len, 8
extra = (Fraction(TP - 1, TP) * (2 * L + 1) * Ns * cfg.d_model * itemsize                # the re-gathers
         + ring_share("Allreduce", TP) * (6 * L + 2 + cfg.seq_len) * cfg.d_model * itemsize)   # replicated grads
check.equal("ring bytes: sequence - megatron == (2L+1) re-gathers + replicated grads",
            ring_bytes(measured_of["sequence"], TP) - ring_bytes(measured_of["megatron"], TP), extra)

# %% [markdown]
# Each large All-Reduce became a Reduce-Scatter and an All-Gather: twice the payload, the same ring bytes. What
# the sequence scheme sends *more* on a ring is the difference checked above: caching only its T-shard of the
# inputs of q, k, v, fc and the LM head, it gathers them again in the backward, $2L + 1$ more (N, C) All-Gathers
# (Megatron-LM does the same, overlapped with the matmuls), plus small All-Reduces of the replicated gradients
# ($6C$ per block, $2C$ for LN_f, $TC$ for `wpe`). Hence the two ratios in the table's last line differ: almost
# all its payload travels at half the ring price of an All-Reduce.
#
# **Asynchronous tensor parallelism.** Here every gather_T and scatter_T sits on the critical path: the All-Gather
# ends before the column-parallel matmul starts, the Reduce-Scatter starts after the row-parallel one ends. Both
# can be cut into tp pieces (Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition
# in Large Deep Learning Models"): the gathered input's product is tp row blocks $X_r W_i$, one per T-shard, so a
# rank multiplies the shard it holds while the next travels one ring step; and the row-parallel product's tp row
# blocks are computed one by one, each passed on and summed around the ring while the next is computed. In
# chapter 2's terms a blocking All-Gather and its matmul cost $(tp-1)(\alpha + \beta n/tp) + t_{mm}$, decomposed
# $t_{mm}/tp + (tp-1)\max(\alpha + \beta n/tp,\ t_{mm}/tp)$: the same messages and bytes, at best all the
# communication hidden, paid for with matmuls $1/tp$ the size (less efficient) and communication competing with
# compute for the device. Megatron-LM enables it with `--tp-comm-overlap` (Transformer Engine's userbuffers;
# sequence parallelism required), PyTorch as "async TP": Inductor's `_micro_pipeline_tp` pass rewrites the pairs
# into `fused_all_gather_matmul` and `fused_matmul_reduce_scatter`, enabled in torchtitan by
# `parallelism.enable_async_tensor_parallel` under `torch.compile`. hsgd's collectives block at their call site,
# so its time is the sum, and each collective is seen and timed apart.
#
# What sequence parallelism buys is memory: `activations.activation_bytes` counts the distinct cached arrays
# (parameters excluded), `activations.activation_formula` predicts them, and the paper's Table 2 formula (16-bit,
# dropout, $34/t$) gives its own ratio. Each scheme on groups of tp = 1, 2 and 4:

# %%
act, predicted = {}, {}
TPS = (1, 2, TP)
for tp_ in TPS:
    g_ = grid if tp_ == TP else ProcessGrid(world, dp=world.Get_size() // tp_, tp=tp_)
    for scheme in ("megatron", "sequence"):
        local = tp_shards.shard_params(params, g_.tp_rank, tp_, scheme)
        _, caches = tp_model.forward(local, idx, targets, tp_model.TPSetup(cfg, g_.tp_comm, scheme))
        act[tp_, scheme] = (activations.activation_bytes(caches.blocks[0], local),        # block 0's cache
                            activations.activation_bytes(caches, local))              # the whole forward's
        f = activations.activation_formula(cfg, batch, itemsize, tp_, scheme)
        predicted[tp_, scheme] = (f["block"], f["model"])
    if g_ is not grid:
        g_.free()

say(f"{'tp':>3}{'megatron per block':>20}{'sequence per block':>20}{'ratio':>7}{'paper':>7}"
    f"{'whole forward m / s':>24}")
for tp_ in TPS:
    (mb, mm), (sb, sm) = act[tp_, "megatron"], act[tp_, "sequence"]
    paper = [activations.paper_activation_bytes(cfg.seq_len, batch, cfg.d_model, cfg.n_heads, tp_, sp)
             for sp in (False, True)]
    say(f"{tp_:>3}{mb:>20,}{sb:>20,}{mb / sb:>7.2f}{paper[0] / paper[1]:>7.2f}{mm:>12,} / {sm:,}")
check.equal("activation bytes (block, model) == activation_formula, tp = 1, 2, 4", act, predicted)
check.equal("sequence: bytes per block x tp, tp = 2, 4 == those of tp = 1",
            [act[t, "sequence"][0] * t for t in TPS[1:]], [act[1, "sequence"][0]] * (len(TPS) - 1))

gpt3 = ModelConfig(vocab_size=50257, seq_len=2048, d_model=12288, n_heads=96, n_layers=96, d_ff=4 * 12288)
f_m, f_s = (activations.activation_formula(gpt3, 1, 2, 8, sc)["block"] for sc in ("megatron", "sequence"))
p_m, p_s = (activations.paper_activation_bytes(2048, 1, 12288, 96, 8, sp) for sp in (False, True))
say(f"GPT-3 175B's shape, one sequence, 16-bit, tp = 8, per block: hsgd {fmt_bytes(f_m)} -> {fmt_bytes(f_s)} "
    f"(ratio {f_m / f_s:.2f}); the paper's Table 2 {fmt_bytes(p_m)} -> {fmt_bytes(p_s)} (ratio {p_m / p_s:.2f})")

# %% [markdown]
# The measured bytes on log scales ($1/tp$ is the dotted line): with sequence parallelism a block's cache falls as
# $1/tp$; with Megatron's the LayerNorm outputs and the split matmuls' inputs stay whole, so it falls more slowly.

# %%
if rank == 0:
    fig, axes = pictures.figure(8, 3.2, ncols=2)
    for ax, k, what in ((axes[0], 0, "one block's cache"), (axes[1], 1, "the whole forward's caches")):
        for scheme, style in (("megatron", "o-"), ("sequence", "s-")):
            values = [act[t, scheme][k] for t in TPS]
            ax.plot(TPS, values, style, label=scheme)
            for t, val in zip(TPS, values):
                ax.annotate(f"{val:,}", (t, val), textcoords="offset points", xytext=(4, 4), fontsize=6)
        ax.plot(TPS, [act[1, "sequence"][k] / t for t in TPS], ":", color="black", lw=1.2, zorder=3,
                label="tp = 1 bytes / tp")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.margins(x=0.15, y=0.15)
        ax.set_xticks(TPS, [str(t) for t in TPS])
        ax.set_xlabel("tp", fontsize=7)
        ax.set_ylabel("bytes per rank (log scale)", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.set_title(f"{what} (measured)", fontsize=8)
        ax.legend(fontsize=7, frameon=False)
    fig.suptitle(f"activation bytes per rank, L = {cfg.n_layers}, B = {batch}, T = {cfg.seq_len}, C = "
                 f"{cfg.d_model}, NH = {cfg.n_heads}, float64", fontsize=8)
    say(f"picture: {pictures.save(fig, '06_activation_bytes_per_block')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# The ratios differ from the paper's because the two count different things: hsgd has no dropout, keeps only the
# softmax per attention entry (the paper keeps scores, softmax, dropout output and mask), and caches q, k, v and
# the GELU's derivative (`activations.paper_activation_bytes` lists the terms); and hsgd's bytes are float64. The
# whole forward's bytes also include the loss's softmax (N, Vp), split by vocabulary in both schemes.
#
# Chapter 8 overlaps such groups' gradient exchange with the backward; chapter 10 puts them side by side as
# data-parallel replicas.

# %%
worst, err = check.worst()
say(f"\nchapter 6: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error "
    f"{err:.1e} ({worst}), tolerance {TOL:.0e}")
grid.free()

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# Megatron-LM keeps activations as (T, B, C), so its sequence-parallel collectives work along dimension 0 where
# hsgd's work along T, axis 1 of (B, T, C).
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | attention by heads: q, k, v column-parallel (C, C/tp), `attn.proj` row-parallel; `tp_shards.check_tp` wants NH divisible by tp | `SelfAttention` (megatron/core/transformer/attention.py): `linear_qkv` column-parallel (one fused matrix), `linear_proj` row-parallel; `num_attention_heads_per_partition = divide(...)`, an exact division | AutoTP: q, k, v `LinearLayer`s, the output projection a `LinearAllreduce` (deepspeed/module_inject/layers.py); `get_shard_size` (tp_shard.py) gives the first NH mod tp ranks one head more | `parallelize_module` with `ColwiseParallel()` for q, k, v and `RowwiseParallel()` for the output projection | three separate weights; equal heads per rank (exercise 2 writes the unequal split) |
# | the vocab-parallel embedding: `tp_layers.vocab_lookup_forward` and the scheme's exit; V padded to $\lceil V/tp \rceil \cdot tp$ | `VocabParallelEmbedding` (megatron/core/tensor_parallel/layers.py); V padded to a multiple of `make_vocab_size_divisible_by` (128) x tp (`calculate_padded_vocab_size`) | none in AutoTP: `EmbeddingLayer` stays whole | `RowwiseParallel()` on an `nn.Embedding`: weight `Shard(0)`, output reduced to `Replicate()` | pads to the smallest multiple of tp |
# | LM head column-parallel (C, Vp) and `tp_layers.vocab_cross_entropy_forward` / `_backward`: MAX of (N,), one SUM of (2, N) | `GPTModel.output_layer`, a `ColumnParallelLinear`, and `vocab_parallel_cross_entropy` (megatron/core/tensor_parallel/cross_entropy.py): MAX, then two SUMs | none: `LmHeadLinearAllreduce` splits the LM head by rows and All-Reduces the whole logits; `vocab_sequence_parallel_cross_entropy` splits the sequence, not the vocabulary | `ColwiseParallel(use_local_output=False)`, then `F.cross_entropy` inside `loss_parallel()` (torch/distributed/tensor/parallel/loss.py) | two calls instead of three, the same $3N$ numbers |
# | the "sequence" scheme (`tp_schemes.Sequence`; `TrainConfig(tp_scheme="sequence")`) | `sequence_parallel=True` (`ModelParallelConfig`) | none in AutoTP; DeepSpeed-Ulysses (`DistributedAttention`, deepspeed/sequence/layer.py) is another sequence parallelism: all-to-alls trade sequence shards for head shards around attention | `SequenceParallel()` on the norms, with `ColwiseParallel(input_layouts=Shard(1))` and `RowwiseParallel(output_layouts=Shard(1))` | one flag; the scheme is an object whose three methods are the only places that differ |
# | `tp_layers.gather_T_forward` / `_backward`: All-Gather along T, backward Reduce-Scatter | `gather_from_sequence_parallel_region` (megatron/core/tensor_parallel/mappings.py); inside `ColumnParallelLinear` the input is gathered again in the backward, overlapped with the input-gradient product | none | `ColwiseParallel(input_layouts=Shard(1))` | the backward re-gather is the same, not overlapped |
# | `tp_layers.scatter_T_forward` / `_backward`: Reduce-Scatter along T, backward All-Gather | `reduce_scatter_to_sequence_parallel_region` (mappings.py), the exit of `RowParallelLinear` | none | `RowwiseParallel(output_layouts=Shard(1))` | - |
# | gather_T then the column-parallel matmul, both blocking | `--tp-comm-overlap` (megatron/training/arguments.py; a userbuffers config with `--tp-comm-overlap-cfg`): Transformer Engine splits the All-Gather into pieces overlapped with the GEMM (transformer_engine/common/comm_gemm_overlap/) | none | async TP: `torch._inductor.config._micro_pipeline_tp` (torch/_inductor/fx_passes/micro_pipeline_tp.py) rewrites it into `fused_all_gather_matmul` on symmetric memory; torchtitan's `parallelism.enable_async_tensor_parallel`, which requires `torch.compile` | no overlap: the collective and the matmul are timed and read apart |
# | the row-parallel matmul then scatter_T, both blocking | the same flag: the GEMM's output chunks reduce-scattered as they are produced | none | the same pass: `fused_matmul_reduce_scatter` | same |
# | `Sequence.finish_replicated`: one All-Reduce per gradient group of the replicated parameters' partial gradients | `_allreduce_non_tensor_model_parallel_grads` in `finalize_model_grads` (megatron/core/distributed/finalize_model_grads.py), after the backward | none | DTensor gives the norms' gradients the placement `Partial` and reduces it when used | per group, so that chapter 8's bucketed All-Reduce can start early |
# | `activations.activation_bytes` / `activation_formula` / `paper_activation_bytes` | `compute_activation_memory` (megatron/training/theoretical_memory_usage.py) | none | none | the cache is counted byte by byte against a formula |
#
# ## Exercises
#
# ### Exercise 1: the vocab-parallel cross-entropy and its backward by hand
# Write the forward with section 3's three All-Reduces, keeping what the backward needs, and the backward on the
# local columns only. Check the loss and every rank's (N, Vp) block of the logits' gradient against the serial
# `layers.cross_entropy_*` with V = 13 on tp = 4, and that the padding columns get exactly 0.
# (solution: `tutorials/solutions/06_attention_heads_and_vocab_parallel.py`, `exercise_1`)
#
# ### Exercise 2: attention with an unequal split of heads
# `tp_shards.check_tp` refuses NH = 6 on tp = 4; DeepSpeed's `get_shard_size` would give the ranks 2, 2, 1 and 1
# heads. Write that split (columns of $W_q$, $W_k$, $W_v$ and rows of $W_o$ at head boundaries, $f$ and $g$ as in
# section 1) and check the output, $da$, every gradient block and the bytes (one (N, C) All-Reduce each way)
# against serial. What does it cost? (The slowest rank does $\lceil NH/tp \rceil / (NH/tp)$ times the average.)
# (solution: `tutorials/solutions/06_attention_heads_and_vocab_parallel.py`, `exercise_2`)
#
# ### Exercise 3: the sequence-parallel LayerNorm needs an All-Reduce of its gradients
# Run `layers.layernorm_forward` / `_backward` on each rank's T-shard with the replicated weight and bias. Check
# that the input gradient of its positions equals the serial one, that the weight and bias gradients do *not*, and
# that their All-Reduce (sum) does; then check which SGD step, with or without it, keeps the weight bit-identical
# on every rank.
# (solution: `tutorials/solutions/06_attention_heads_and_vocab_parallel.py`, `exercise_3`)
#
# ### Exercise 4: the sequence-parallel MLP: twice the payload, the same ring bytes
# Build a block's MLP both ways with `tp_layers`: Megatron's ($f$, column fc, GELU, row proj, $g$) on the whole
# input and the sequence layout's (gather_T, the same matmuls, scatter_T) on T-shards. Check both against serial
# (output and input gradient), and that the sequence MLP's payload is twice Megatron's while a ring sends
# $4\frac{tp-1}{tp}NCs$ per rank for both (cache fc's gathered input; `tp_model` re-gathers it, one All-Gather more).
# (solution: `tutorials/solutions/06_attention_heads_and_vocab_parallel.py`, `exercise_4`)
