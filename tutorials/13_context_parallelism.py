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
# # Chapter 13: context parallelism: the sequence split over ranks, ring attention and the online softmax
#
# Every layout so far gives each rank whole sequences. Tensor parallelism (chapters 5 to 7 and 10) splits the
# weights and the heads, pipeline parallelism (chapters 9 and 12) the layers, data parallelism the batch; none of them
# splits the T positions of one sequence. But a block's activations grow with T, and the attention probabilities with
# $T^2$, so a long enough sequence outgrows one device whatever happens to the weights. The lecture's section 2
# makes that argument for the model (a GPT-3 or LLaMA-sized model does not fit one node, so the parallelisms are
# combined); its section 4.2 asks to balance the work across partitions and its section 4.1 to overlap
# communication with computation. It has no section on splitting the sequence: context parallelism goes beyond the
# lecture, and this chapter builds it on the same grid, with the same kind of checks against serial SGD. Chapter
# 6's sequence parallelism is not this: it splits T only where tensor parallelism leaves the activations whole
# (LayerNorm, the residual stream) and gathers it back before the attention; context parallelism keeps T split
# everywhere, the attention included.
#
# `hsgd/cp/split.py` splits every sequence over the cp ranks of `grid.cp_comm`. Everything in a block except the core
# attention treats each position on its own, so it runs unchanged on a rank's T/cp positions. The core attention,
# where position t reads the keys and values of positions 0..t, is done one of four ways:
#
# * **ring** (Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
#   Context"): the (k, v) blocks travel around the ring of cp ranks while each rank keeps its queries, and the
#   partial results are merged with the online softmax (Milakov and Gimelshein 2018, "Online normalizer calculation
#   for softmax"; Dao et al. 2022, "FlashAttention");
# * **all-gather** (the scheme the Llama 3 paper, Dubey et al. 2024, "The Llama 3 Herd of Models", uses for long
#   contexts): All-Gather k and v, attend, Reduce-Scatter their gradients;
# * **Ulysses** (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
#   Sequence Transformer Models"): an all-to-all turns the sequence split into a head split, each rank attends
#   with all T positions of NH/cp heads, and another all-to-all turns the output back (`hsgd/cp/ulysses.py`);
# * **a2a+p2p** (Megatron-LM's hierarchical context parallelism): Ulysses inside groups of a adjacent cp ranks and
#   the ring across the r = cp/a groups (`hsgd/cp/hierarchical.py`).
#
# The chapter:
#
# 1. why the sequence dimension: a block's activation bytes against T from
#    `hsgd.accounting.activations.activation_formula`, with tp and with cp;
# 2. the online softmax derived step by step, then checked in NumPy on one process;
# 3. the ring forward and backward on 8 ranks (cp 8, and cp 4 x tp 2) against serial attention, with its messages
#    counted against `split.cp_formula`; the all-gather, Ulysses and a2a+p2p the same way;
# 4. load balancing under the causal mask: the plain split against hsgd's layout (rank r holds chunks r and
#    2cp-1-r), counted and measured, with a picture;
# 5. training with `HybridTrainer` on dp 2 x cp 2 x tp 2, cp 8 and pp 2 x cp 2 x tp 2, the schemes that apply
#    (a2a+p2p on cp 8), against serial SGD, with each step's traffic and activation bytes against their formulas;
# 6. ring, all-gather and Ulysses on 8 ranks: bytes (payload and bytes sent per rank), activation bytes, and time;
# 7. the trace: what moves while the ring's blocks compute (MPICH's progress rule, checked with and without
#    `MPI_Test` in the blocks) and the one hop the ring leaves exposed, drawn;
# 8. Ulysses' all-to-all pictured, a2a+p2p's groups, and the bytes each rank sends as cp grows with T = cp x 8,
#    measured for the four schemes.
#
# Run it with eight ranks (4 s measured on a 2-core machine; on failure every rank raises, so it exits
# non-zero without hanging). Rank 0 draws four pictures into `$HSGD_FIGURES` (default `tutorials/figures/`):
#
# mpirun -n 8 python tutorials/13_context_parallelism.py
#
# The notebook form (`jupytext --to ipynb tutorials/13_context_parallelism.py`) is for reading: the code needs
# eight MPI ranks. Only rank 0 prints. From the command line, `mpirun -n 8 python -m hsgd.train --cp 4 --tp 2
# --cp-scheme ring` trains with context parallelism and ends by printing one step's traffic next to its formula.
#
# Legend: B sequences in the global batch, b sequences per micro-batch, T sequence length, $T_l = T/cp$ the
# positions a cp rank holds, N = b T rows of a micro-batch ($N_l = b T_l$ on a cp rank), C d_model, NH heads,
# hs = C/NH the head size, F the MLP width, V vocabulary, L layers; tp, cp, pp, dp the sizes of the grid (P = dp x
# pp x cp x tp ranks); c = T/(2cp) the length of a chunk; s bytes per number (8, float64, in the runs; 2 in the
# formulas of section 1). In the online softmax: s the scores of one query, m the running maximum, l the running
# sum, o the running (unnormalised) output, lse = m + log l.

# %%
from hsgd.model.config import ModelConfig   # hsgd first, as in chapter 11 (OpenBLAS's thread timeout)
from hsgd.model import serial

import dataclasses
import time
from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from hsgd.cp import split
from hsgd.cp.ring import Ring
from hsgd.cp.layouts import make_split
from hsgd.cp.split import attention_blocks, attention_cache_bytes, chunk_starts, cp_formula
from hsgd.model.data import Corpus
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.model.layers import attention_backward, attention_forward
from hsgd.accounting.activations import activation_formula
from hsgd.run.report import fmt_bytes
from fractions import Fraction
from hsgd.accounting.traffic import step_formula
from hsgd.grid.trace import Tracer

import pictures                                  # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, payload, rel_err, ring_bytes, train_config   # tutorials/checks.py, shared

P = 8
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, P, tol=1e-10, width=78)


def applies(scheme, cp_):
    """Whether a cp scheme runs on cp_ ranks here: a2a+p2p needs cp = a x r with a, r > 1 (split.a2a_sizes)."""
    return scheme != "a2a+p2p" or split.a2a_sizes(cp_)[0] > 1


def sent_per_rank(sent, scheme, cp_):
    """The bytes one rank sends (checks.ring_bytes): on cp_comm of cp_ ranks, or for a2a+p2p its all-to-alls on its
    group of a ranks and its ring's Isends (each sends all of its message) across the groups."""
    if scheme != "a2a+p2p":
        return ring_bytes(sent, cp_)
    a2a = {k: n for k, n in sent.items() if k[1] == "Alltoall"}
    return ring_bytes(a2a, split.a2a_sizes(cp_)[0]) + ring_bytes({k: n for k, n in sent.items() if k not in a2a}, cp_)


# %% [markdown]
# ## 1. Why the sequence dimension
#
# `activation_formula(cfg, b, s, tp, scheme, cp, cp_scheme)["block"]` is what one block's forward caches on one
# rank in hsgd, measured against the caches in chapter 13. With Megatron's tensor-parallel scheme it is
#
# $$s\,\big(4NC + 2N + (4NC + b\,NH\,T^2 + 2NF)/tp\big):$$
#
# the LayerNorms' outputs and the inputs of the q, k, v and fc linears ($4NC + 2N$) are replicated over tp, and
# everything else, the attention's probabilities $b\,NH\,T^2$ included, is split by tp. Two things grow with T: the
# linear terms, through N = bT, and the probabilities, with $T^2$. Tensor parallelism divides the second by tp but
# leaves the replicated $4NC$ whole; the sequence scheme (chapter 6) divides that too, but the $T^2$ is still
# there, divided only by tp. Context parallelism gives each rank $T/cp$ positions of every sequence, so every term
# of the block is of $N_l = N/cp$ rows, and the core attention's cache is the scheme's
# (`split.attention_cache_bytes`):
#
# * ring: q and the rank's own (k, v), $3 N_l C/tp$, and lse, $b\,(NH/tp)\,T_l$ (and its output y, which the output
#   projection keeps as its input anyway): no $T \times T$ matrix at all, only what the online softmax of section 2
#   keeps;
# * all-gather: q, the gathered k and v of the whole sequence ($2\,b\,T\,C/tp$) and the probabilities of the rank's
#   queries against all keys, $b\,(NH/tp)\,T_l\,T$: the $T^2$ term divided by cp;
# * Ulysses: q, k and v of its NH/(tp cp) heads at all T positions, $3 N_l C/tp$ (as many numbers as the ring's),
#   and their probabilities, $b\,NH/(tp\,cp)\,T^2$, the all-gather's $b\,(NH/tp)\,T_l\,T$ again;
# * a2a+p2p (section 8): the ring's, on its group's $a T_l$ positions of NH/(tp a) heads (as many numbers), and
#   the group's output y, which its backward reads: $4 N_l C/tp$ and lse, linear in T as the ring's.
#
# For a block of a 7B-sized model (C = 4096, NH = 32, F = 16384, one sequence, 2-byte numbers), per rank, with the
# 8 ranks used as tp 8 or as cp 8 (plain numbers: these are formulas, nothing is allocated):

# %%
big = ModelConfig(vocab_size=256, seq_len=4096, d_model=4096, n_heads=32, n_layers=32, d_ff=16384)
S2, TS = 2, (4096, 16384, 65536, 131072)                     # bytes per number; sequence lengths


def block(T, tp=1, scheme="megatron", cp_=1, cp_scheme="ring"):
    """One block's activation bytes per rank for one sequence of T positions of the 7B-sized model."""
    return activation_formula(dataclasses.replace(big, seq_len=T), 1, S2, tp, scheme, cp_, cp_scheme)["block"]


def attn_cache(T, cp_=1, cp_scheme="ring", tp=1):
    """The core attention's part of it (split.attention_cache_bytes)."""
    return attention_cache_bytes(cp_, cp_scheme, 1, T, big.d_model, big.n_heads, tp, S2)[0]


C7, NH7, F7 = big.d_model, big.n_heads, big.d_ff
rows = [(T, block(T), block(T, 8), block(T, 8, "sequence"), block(T, cp_=8), block(T, cp_=8, cp_scheme="allgather"))
        for T in TS]
say(f"{'T':>7} {'1 rank':>10} {'tp 8':>10} {'tp 8 seq':>10} {'cp 8 ring':>10} {'cp 8 gather':>11}   "
    f"probabilities' share (1 rank)")
for T, one, tp8, seq8, ring8, ag8 in rows:
    say(f"{T:>7} {fmt_bytes(one):>10} {fmt_bytes(tp8):>10} {fmt_bytes(seq8):>10} {fmt_bytes(ring8):>10} "
        f"{fmt_bytes(ag8):>11}   {S2 * NH7 * T * T / one:.1%}")
check.equal("1 rank: block == s (8NC + 2N + 2NF + b NH T^2), every T",
            [r[1] for r in rows], [S2 * (8 * T * C7 + 2 * T + 2 * T * F7 + NH7 * T * T) for T in TS])
rep = [S2 * (4 * T * C7 + 2 * T) for T in TS]                # megatron's replicated s (4NC + 2N), b = 1
check.equal("tp 8 (megatron): block - s (4NC + 2N) == (1 rank's - s (4NC + 2N)) / 8",
            [r[2] - x for r, x in zip(rows, rep)], [(r[1] - x) // 8 for r, x in zip(rows, rep)])
check.equal("cp 8: block - attention cache == (1 rank's - its attention cache) / 8",
            [r[4] - attn_cache(T, 8) for r, T in zip(rows, TS)],
            [(r[1] - attn_cache(T)) // 8 for r, T in zip(rows, TS)])
check.equal("cp 8 ring: block(4T) == 4 block(T): linear in T, no T^2 term",
            [block(4 * T, cp_=8) for T in TS[:2]], [4 * block(T, cp_=8) for T in TS[:2]])
check.equal("cp 8 all-gather: its attention cache == s (N_l C + 2 T C + NH T_l T)",
            [attn_cache(T, 8, "allgather") for T in TS],
            [S2 * (T // 8 * C7 + 2 * T * C7 + NH7 * T // 8 * T) for T in TS])
check.equal("cp 8 Ulysses: its attention cache == s (3 N_l C + NH T_l T), the ring's q, k, v and the "
            "all-gather's probabilities", [attn_cache(T, 8, "ulysses") for T in TS],
            [S2 * (3 * T // 8 * C7 + NH7 * T // 8 * T) for T in TS])


def draw_activations():
    fig, ax = pictures.figure(6.5, 3.6)
    Ts = [2 ** k for k in range(11, 18)]
    for label, f, style in (("1 rank", lambda T: block(T), "k-"), ("tp 8 (megatron)", lambda T: block(T, 8), "C0-"),
                            ("tp 8 (sequence)", lambda T: block(T, 8, "sequence"), "C0--"),
                            ("cp 8, all-gather", lambda T: block(T, cp_=8, cp_scheme="allgather"), "C3--"),
                            ("cp 8, ring", lambda T: block(T, cp_=8), "C3-")):
        ax.loglog(Ts, [f(T) / 2 ** 30 for T in Ts], style, marker="o", ms=3, label=label, base=2)
    ax.set_xlabel("T (positions per sequence)")
    ax.set_ylabel("GiB per block and rank")
    ax.set_title("one block's activations, 7B-sized model, 1 sequence, 2 bytes (activation_formula)", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return pictures.save(fig, "13_activations_vs_T")


say(f"picture: {pictures.on_rank0(world, draw_activations, share=True)}")

# %% [markdown]
# The picture plots the five columns of the table against T on log-log axes: the lines with a $T^2$ term steepen to
# slope 2, the ring's keeps slope 1.
#
# At T = 4096 the probabilities are already two thirds of a block on one rank, and at T = 131072 all but 1.5% of
# its 1040 GiB. Tensor parallelism over 8 ranks leaves 133.5 GiB per block on each of them, the sequence scheme
# 130 GiB: the probabilities divided by 8 are almost all of it. Context parallelism with the ring holds 2.1 GiB,
# 1/8 of everything that is not attention plus its own O($T_l$) attention cache; with the all-gather, the
# probabilities of its $T_l$ queries against all T keys are 128 GiB again. hsgd materialises the probabilities of
# the scores it computes at once (all of them in the all-gather, one block at a time in the ring); a fused kernel
# (FlashAttention) would not, and then the all-gather's price is the gathered k and v, O(T) per rank, where the ring
# holds its own block and the two in transit.
#
# ## 2. The online softmax, step by step
#
# The core attention of one query is a softmax-weighted sum over the keys it may read,
#
# $$y = \sum_j p_j v_j,\qquad p_j = \frac{e^{s_j}}{\sum_k e^{s_k}},\qquad s_j = q \cdot k_j / \sqrt{hs}.$$
#
# On a context-parallel rank the keys arrive in blocks, one from each rank. The softmax needs the sum over all of
# them, so it seems that nothing can be done before the last block arrives. It can, because the sum can be carried
# along unnormalised. Keep three numbers per query after the blocks seen so far: the largest score $m$, the sum
# $l = \sum_j e^{s_j - m}$ and the unnormalised output $o = \sum_j e^{s_j - m} v_j$. Then $y = o / l$ for the blocks
# seen so far, exactly. A new block with scores $s_b$ and values $V_b$:
#
# 1. its maximum may be larger: $m' = \max(m, \max_j s_{b,j})$;
# 2. the old terms were computed with $e^{s_j - m}$ and need $e^{s_j - m'}$: multiply both $l$ and $o$ by the
#    same factor $e^{m - m'} \le 1$ (with $m = -\infty$ before the first block, the factor is 0);
# 3. add the block's own terms with the new maximum, $p_b = e^{s_b - m'}$:
#    $l \leftarrow l\,e^{m - m'} + \sum_j p_{b,j}$, $o \leftarrow o\,e^{m - m'} + p_b V_b$, $m \leftarrow m'$.
#
# After the last block, $y = o / l$. Every exponent is $\le 0$, so nothing overflows, whatever the scores. The
# backward pass needs the probabilities again, $p_j = e^{s_j} / \sum_k e^{s_k} = e^{s_j - \mathrm{lse}}$ with
# $\mathrm{lse} = \log \sum_k e^{s_k} = m + \log l$: one number per query is all the ring keeps of the softmax.
# And the softmax's backward, $ds_j = p_j (dp_j - \sum_k p_k\,dp_k)$ with $dp_j = dy \cdot v_j$, needs the sum
# over all keys once more; but $\sum_k p_k\,(dy \cdot v_k) = dy \cdot y$, so $D = dy \cdot y$, known before the
# first block, replaces it. Every block's gradients are then local: $ds = p\,(dp - D)$, $dq \mathrel{+}= ds\,k_b$,
# $dk_b \mathrel{+}= ds^T q$, $dv_b \mathrel{+}= p^T dy$ (the $1/\sqrt{hs}$ aside). That is `Ring.merge` and
# `Ring.grads` (`hsgd/cp/ring.py`). First in NumPy, for 4 queries and 64 keys in 8 blocks, against the
# softmax computed at once:

# %%
rng = np.random.default_rng(15)
nq, nk, hs, nb = 4, 64, 8, 8
s_all = rng.standard_normal((nq, nk)) * 3 + 800.0            # scores of 4 queries: e^709 is float64's largest
V_all = rng.standard_normal((nk, hs))                        # values (nk, hs)
with np.errstate(over="ignore", invalid="ignore"):
    naive = np.exp(s_all) / np.exp(s_all).sum(axis=1, keepdims=True)   # the textbook formula: inf / inf
shift = s_all - s_all.max(axis=1, keepdims=True)
P_ref = np.exp(shift) / np.exp(shift).sum(axis=1, keepdims=True)        # softmax at once (shifted by the max)
y_ref = P_ref @ V_all
lse_ref = s_all.max(axis=1) + np.log(np.exp(shift).sum(axis=1))

m = np.full(nq, -np.inf)                                     # running max
l = np.zeros(nq)                                             # running sum of e^(s - m)
o = np.zeros((nq, hs))                                       # running sum of e^(s - m) v
for b0 in range(0, nk, nk // nb):                            # one block of 8 keys at a time
    sb, Vb = s_all[:, b0:b0 + nk // nb], V_all[b0:b0 + nk // nb]
    m_new = np.maximum(m, sb.max(axis=1))                    # 1. the new maximum
    scale = np.exp(m - m_new)                                # 2. e^(m - m'): rescales the old terms (0 at first)
    p = np.exp(sb - m_new[:, None])                          # 3. the block's terms
    l = l * scale + p.sum(axis=1)
    o = o * scale[:, None] + p @ Vb
    m = m_new
y_online, lse_online = o / l[:, None], m + np.log(l)
say(f"scores around 800: the textbook formula gives {np.isnan(naive).sum()} NaN of {naive.size}; "
    f"the blockwise sum none ({np.isnan(y_online).sum()})")
check("online softmax in 8 blocks: y vs the softmax at once (relative)", rel_err(y_online, y_ref), 1e-14)
check("lse = m + log l vs log sum e^s (relative)", rel_err(lse_online, lse_ref), 1e-14)
dy1 = rng.standard_normal((nq, hs))
dP = dy1 @ V_all.T                                           # (nq, nk) dL/dp
D_soft, D_out = (P_ref * dP).sum(axis=1), (dy1 * y_online).sum(axis=1)
check("backward: sum_k p_k dp_k == dy . y (the D of every block)", rel_err(D_out, D_soft), 1e-13)
dS_ref = P_ref * (dP - D_soft[:, None])                      # the softmax's backward, all keys at once
dS_blocks = np.concatenate([np.exp(s_all[:, b0:b0 + 8] - lse_online[:, None]) * (dP[:, b0:b0 + 8] - D_out[:, None])
                            for b0 in range(0, nk, 8)], axis=1)   # block by block, from lse and D only
check("backward block by block, p = e^(s - lse), ds = p (dp - D): vs all at once", rel_err(dS_blocks, dS_ref), 1e-13)

# %% [markdown]
# The forward's error is rounding, about $10^{-16}$: the blockwise result is the same sum, added in another order,
# and the textbook formula, $e^{800}/e^{800}$, is NaN everywhere while every exponent of the online softmax is at
# most 0. The backward's $10^{-14}$ is the rounding of scores near 800 (one unit in the last place of 800 is
# $10^{-13}$) carried into $e^{s - \mathrm{lse}}$. The merge is associative (exercise 3), so the blocks may come in
# any order, which is what a ring needs.
#
# ## 3. The ring, forward and backward, on 8 ranks
#
# A grid with `cp=8` puts all 8 ranks into one `cp_comm`; `cp=4, tp=2` makes two rings of 4, one for each tp rank
# (ranks are numbered tp fastest, then cp: rank = ((dp_rank pp + pp_rank) cp + cp_rank) tp + tp_rank). A rank's
# positions are `ctx.pos`: with cp = 4 and T = 32 the sequence is cut into 8 chunks of c = 4, and rank r holds
# chunks r and 7 - r (section 4 says why):

# %%
B, T, C, NH = 2, 32, 16, 8                                   # batch, sequence, width, heads of the attention tests
g8 = ProcessGrid(world, dp=1, pp=1, tp=1, cp=8)
g42 = ProcessGrid(world, dp=1, pp=1, tp=2, cp=4)
for r in range(4):
    say(f"  cp 4, T = {T}: cp_rank {r} holds chunks {[g // 4 for _, g, _ in chunk_starts(T, 4, r)]}, positions "
        f"{split.positions(T, 4, r).tolist()}")
rng = np.random.default_rng(0)                               # the same arrays on every rank
q_all, k_all, v_all, dy_all = (rng.standard_normal((B, T, C)) for _ in range(4))
y_all, cache_all = attention_forward(q_all, k_all, v_all, NH)     # serial: the whole sequence, every head
dq_all, dk_all, dv_all = attention_backward(dy_all, cache_all)


def attend(g, scheme, balanced=True):
    """This rank's core attention through the context layout on g.cp_comm: its positions (and with tp its heads'
    columns) of q, k, v and dy in, y, dq, dk, dv out; the error against serial, the cp_comm traffic, the work."""
    ctx = make_split(scheme, g.cp_comm, T, balanced=balanced)
    cols = slice(g.tp_rank * C // g.tp, (g.tp_rank + 1) * C // g.tp)       # my heads' columns
    mine = [np.ascontiguousarray(a[:, ctx.pos, cols]) for a in (q_all, k_all, v_all, dy_all)]   # (B, T/cp, C/tp)
    before = g.stats.counts()
    y, cache = ctx.attention_forward(*mine[:3], NH // g.tp)
    dq, dk, dv = ctx.attention_backward(mine[3], cache)
    sent = {key: n for key, n in g.stats.since(before).items() if key[0] == "cp"}
    err = max(rel_err(got, want[:, ctx.pos, cols]) for got, want in
              ((y, y_all), (dq, dq_all), (dk, dk_all), (dv, dv_all)))
    return err, sent, dict(ctx.work), ctx


say(f"{'grid':<12} {'scheme':<10} {'calls':>30} {'payload':>10} {'sent/rank':>10}   (one layer, forward + backward, "
    f"b = {B}, T = {T}, C = {C})")
runs = {}
for g, name in ((g8, "cp 8"), (g42, "cp 4 x tp 2")):
    for scheme in split.CP_SCHEMES:
        err, sent, work, ctx = runs[name, scheme] = attend(g, scheme)
        check(f"{name}, {scheme}: y, dq, dk, dv vs serial attention at my positions", err, 1e-13)
        want = cp_formula(scheme, g.cp, B, T, C, g.tp, 8, 1)
        check.equal(f"{name}, {scheme}: cp_comm calls and payload == cp_formula", sent, want)
        calls = ", ".join(f"{op} {n}" for (_, op), (n, _) in sorted(sent.items()))
        say(f"{name:<12} {scheme:<10} {calls:>30} {fmt_bytes(payload(sent)):>10} "
            f"{fmt_bytes(float(sent_per_rank(sent, scheme, g.cp))):>10}")
kv8 = 2 * B * (T // 8) * C * 8                              # one (k, v) block on cp 8, bytes
check.equal("cp 8, bytes sent per rank in (k, v) blocks: ring 3cp - 2, all-gather 2 (cp - 1), Ulysses 4 (cp - 1)/cp, "
            "a2a+p2p 4 (a - 1)/a + 3r - 2 (a = 4, r = 2)",
            [sent_per_rank(runs["cp 8", s][1], s, 8) / kv8 for s in split.CP_SCHEMES], [22, 14, Fraction(7, 2), 7])

# %% [markdown]
# Every rank's output and the three gradients match serial attention at its positions to rounding, in both grids:
# with tp the cp ring carries the rank's NH/tp heads only, (k, v) blocks of $b\,T_l\,C/tp$ numbers each.
#
# What each scheme sends, per layer and micro-batch, with a (k, v) block of $2\,b\,T_l\,(C/tp)\,s$ bytes
# (`split.cp_formula`):
#
# * ring: each (k, v) block goes round the ring, cp - 1 hops forward and cp - 1 again backward (it is not kept;
#   only lse and the rank's own block are), and the gradients (dk, dv) of each block, to which every rank adds its
#   share, cp hops, back to their owner: $3cp - 2$ Isends of one block, and as many Irecvs. A send moves all of
#   it, a receive nothing more, so the bytes sent per rank are the Isends' payload: 22 blocks for cp 8.
# * all-gather: one All-Gather of (k, v) (payload: the gathered cp blocks) and one Reduce-Scatter of the gathered
#   (dk, dv) (payload: its input, cp blocks). A ring All-Gather or Reduce-Scatter sends (cp-1)/cp of it per rank:
#   $2(cp-1)$ blocks, 14 for cp 8.
# * Ulysses: four all-to-alls, of [q | k | v] and of y forward, of dy and of [dq | dk | dv] backward, $3 + 1 + 1 +
#   3 = 8$ arrays of $b\,T_l\,C/tp$ numbers, 4 blocks; an all-to-all keeps the rank's own block and sends the
#   other $(cp-1)/cp$: $4(cp-1)/cp$ blocks, 3.5 for cp 8 (the table's Alltoall payload is the send buffers, 4
#   blocks).
# * a2a+p2p (cp 8 = 4 x 2, `split.a2a_sizes`): Ulysses' four all-to-alls inside its group of a = 4 ranks,
#   $4(a-1)/a$ = 3 blocks, and the ring across the r = 2 groups, $3r - 2$ = 4 Isends of a block (the group's $a T_l$
#   positions of its NH/(tp a) heads: as many numbers as the ring's block): 7 blocks. On cp 4 x tp 2 it is 2 x 2.
#
# So the ring sends more than the all-gather, $(3cp-2)/(2cp-2)$ times as much (1.57 for cp 8), for a memory of three
# blocks (its own and the two in transit) where the all-gather holds all cp of them, and with its messages
# overlapped with the blocks' computation (section 7). Ulysses sends least: below 4 of its blocks however many ranks
# share the sequence, where the ring's and the all-gather's count of blocks grows with cp (section 8 measures what
# that means as T and cp grow together). It asks something of the model instead: cp must divide the rank's NH/tp
# heads (8 heads here), and its NKV/tp kv heads with grouped-query attention (`split.check_heads` refuses the rest).
#
# ## 4. Load balancing under the causal mask
#
# Query t reads keys 0..t. With the plain split, rank r holding positions $[rT/cp, (r+1)T/cp)$, rank 0 reads only
# its own keys, one triangle, and the last rank reads every rank's: cp blocks, one of them a triangle. Every layer
# waits for the slowest rank, so the plain split runs at the speed of the last rank, cp times the first's work.
#
# hsgd cuts the sequence into 2cp chunks of c = T/(2cp) positions and gives rank r chunks r and 2cp-1-r, one from
# each end (Brandon et al. 2023, "Striped Attention: Faster Ring Attention for Causal Transformers", study the same
# imbalance and stripe the positions; this zig-zag is what Megatron-LM does). Counted in c x c score blocks that
# are not wholly masked: the early chunk r reads chunks 0..r, r full blocks and one diagonal; the late chunk
# 2cp-1-r reads 2cp-1-r full blocks and one diagonal; together $2cp + 1$ blocks on every rank.
# `split.attention_blocks(T, cp, r, balanced)` counts the scores a rank computes per head and sequence (diagonal
# blocks whole: the masked half of a diagonal block is computed and then masked, as in every blockwise kernel).
# Each `Ring` counts the scores it computes in `ctx.work`; the runs of section 3 and a ring with the plain split:

# %%
err_plain, _, _, ctx_plain = attend(g8, "ring", balanced=False)
check("cp 8, ring, plain split: y, dq, dk, dv vs serial (it is correct, only slow)", err_plain, 1e-13)
plain = [attention_blocks(T, 8, r, balanced=False) for r in range(8)]
balanced = [attention_blocks(T, 8, r) for r in range(8)]
c8 = T // 16
measured_plain = g8.cp_comm.allgather_obj(ctx_plain.work["forward"])
measured_bal = g8.cp_comm.allgather_obj(runs["cp 8", "ring"][2]["forward"])
measured_bwd = g8.cp_comm.allgather_obj(runs["cp 8", "ring"][2]["backward"])
say(f"scores computed per head and sequence, cp 8, T = {T} (c = {c8}):")
say(f"  plain    formula  {plain}\n           measured {measured_plain}")
say(f"  balanced formula  {balanced}\n           measured {measured_bal} (backward {measured_bwd})")
check.equal("plain split: rank r computes (r + 1) (T/cp)^2 scores", plain, [(r + 1) * (T // 8) ** 2 for r in range(8)])
check.equal("plain split: the last rank computes cp times the first's", plain[-1], 8 * plain[0])
check.equal("balanced: every rank computes (2cp + 1) c^2 scores", balanced, [17 * c8 ** 2] * 8)
check.equal("measured ctx.work['forward'] of every rank == attention_blocks, both splits",
            (measured_plain, measured_bal), (plain, balanced))
check.equal("measured ctx.work['backward'] == the forward's (the same blocks again)", measured_bwd, measured_bal)
say(f"all ranks together: plain {sum(plain)}, balanced {sum(balanced)} scores; the causal mask needs "
    f"T (T + 1) / 2 = {T * (T + 1) // 2}")


def owners(T_, cp_, balanced_):
    """(T, T) arrays: which rank computes score (q, k) (-1: nobody) and whether the mask keeps it."""
    who = np.full((T_, T_), -1)
    for r in range(cp_):
        for _, gq, nq_ in chunk_starts(T_, cp_, r, balanced_):
            for o_ in range(cp_):
                for _, gk, nk_ in chunk_starts(T_, cp_, o_, balanced_):
                    if gk <= gq + nq_ - 1:                       # the block Ring.pairs computes
                        who[gq:gq + nq_, gk:gk + nk_] = r
    return who, np.tril(np.ones((T_, T_), dtype=bool))


def draw_balance():
    from matplotlib.colors import ListedColormap
    fig, axes = pictures.figure(11, 3.6, ncols=3)
    cmap = ListedColormap([f"C{i}" for i in range(4)])
    for ax, bal in zip(axes[:2], (False, True)):
        who, needed = owners(T, 4, bal)
        shown = np.ma.masked_where(who < 0, who.astype(float))
        ax.imshow(shown, cmap=cmap, vmin=-0.5, vmax=3.5, alpha=0.35, interpolation="nearest")   # computed
        ax.imshow(np.ma.masked_where(~needed | (who < 0), who.astype(float)), cmap=cmap, vmin=-0.5, vmax=3.5,
                  interpolation="nearest")                                                      # and needed
        ax.set_title(f"{'balanced: chunks r, 2cp-1-r' if bal else 'plain split'} (cp 4, T = {T})", fontsize=8)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position (colour: its rank)")
    x = np.arange(8)
    axes[2].bar(x - 0.2, measured_plain, 0.4, label="plain split", color="0.6")
    axes[2].bar(x + 0.2, measured_bal, 0.4, label="balanced", color="C3")
    axes[2].set_xlabel("cp_rank (cp 8)")
    axes[2].set_ylabel("scores computed (measured ctx.work)")
    axes[2].set_title(f"work per rank, cp 8, T = {T}, one head and sequence", fontsize=8)
    axes[2].legend(fontsize=7)
    return pictures.save(fig, "13_load_balance")


say(f"picture: {pictures.on_rank0(world, draw_balance, share=True)}")

# %% [markdown]
# The picture shows, for cp 4, which rank computes each score of the $T \times T$ matrix, dark where the mask
# keeps it and pale where a diagonal block is computed and then masked: with the plain split rank 3 owns the
# widest rows, while the balanced layout gives each rank a short row band and a long one. On the right, the scores
# every rank of cp 8 computed, measured: a staircase from 16 to 128 against 68 on every rank. The balanced layout
# also computes fewer scores in all (544 against 576), because its chunks are half as long and so are the
# diagonal blocks' wasted halves.
#
# ## 5. Training with context parallelism, against serial SGD
#
# In a training step each rank of a cp group takes its positions of every sequence (`ctx.local` of the token ids and
# the targets) and the position embeddings of those positions (`ctx.rows`). Its loss is the mean over its positions;
# the cp ranks hold equally many, so the mean of their means is the sequence's mean, and the gradients are averaged
# over `dp_comm`, which holds the dp x cp ranks of each parameter shard: parameters are replicated over cp as they
# are over dp. The check is chapter 10's: a few steps of SGD with momentum in float64 on three layouts of the 8
# ranks and the three schemes (8 heads, so that Ulysses' cp 8 has one head a rank), against `serial.sgd` on one
# process, and each step's traffic on every communicator against `accounting.traffic.step_formula`, the
# one-micro-batch activation bytes against `activation_formula`.

# %%
cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=16, n_heads=8, n_layers=2, d_ff=32)
SEED, BT, M, STEPS = 0, 4, 2, 2                # global batch, micro-batches per replica, steps
corpus = Corpus.load(None, cfg.seq_len)        # the built-in corpus, as hsgd.train
LAYOUTS = ((2, 1, 2, 2), (1, 1, 8, 1), (1, 2, 2, 2))    # (dp, pp, cp, tp)


def config(dp, pp, cp_, tp, scheme):
    return train_config(dp=dp, pp=pp, tp=tp, cp=cp_, cp_scheme=scheme, steps=STEPS, batch_size=BT,
                        micro_batches=M, seed=SEED)


ref, ref_losses = pictures.on_rank0(world, lambda: serial.sgd(cfg, config(1, 1, 1, 1, "ring"),
                                                              lambda step: corpus.batch(SEED, step, BT)), share=True)
say(f"model {cfg.n_params():,} parameters (L={cfg.n_layers} C={cfg.d_model} NH={cfg.n_heads} d_ff={cfg.d_ff} "
    f"T={cfg.seq_len}); B={BT}, m={M}; serial SGD losses {' '.join(f'{x:.6f}' for x in ref_losses)}")
say(f"{'dp x pp x cp x tp':<18} {'scheme':<10} {'params vs serial':>16} {'cp_comm calls':>14} {'payload':>9} "
    f"{'sent/rank':>10} {'activations':>12}")
for dp, pp, cp_, tp in LAYOUTS:
    g = ProcessGrid(world, dp=dp, pp=pp, tp=tp, cp=cp_)
    for scheme in [s for s in split.CP_SCHEMES if applies(s, cp_)]:
        tc = config(dp, pp, cp_, tp, scheme)
        trainer = HybridTrainer(cfg, g, tc)
        losses = []
        for step in range(1, STEPS + 1):
            trainer.stage.measure_bytes = step == STEPS
            before = g.stats.counts()
            losses.append(trainer.step(*corpus.batch(SEED, step, BT), step).loss)
        sent = g.stats.since(before)
        full = trainer.full_params()
        err = max(rel_err(full[n], ref[n], floor=0.02) for n in ref)
        name = f"dp {dp} x pp {pp} x cp {cp_} x tp {tp}"
        check(f"{name}, {scheme}: parameters vs serial SGD", err)
        check(f"{name}, {scheme}: losses vs serial SGD", max(abs(a - b) / b for a, b in zip(losses, ref_losses)))
        check.equal(f"{name}, {scheme}: the step's calls and bytes, every comm == step_formula",
                    sent, step_formula(cfg, tc, trainer))
        act = trainer.stage.peak_bytes
        if pp == 1:                            # one stage holds one micro-batch at a time: the whole model's caches
            want = activation_formula(cfg, BT // dp // M, 8, tp, "megatron", cp_, scheme)["model"]
            check.equal(f"{name}, {scheme}: activation bytes at the peak == activation_formula", act, want)
        on_cp = {key: n for key, n in sent.items() if key[0] == "cp"}
        say(f"{f'{dp} x {pp} x {cp_} x {tp}':<18} {scheme:<10} {err:>16.1e} {sum(n for n, _ in on_cp.values()):>14} "
            f"{fmt_bytes(payload(on_cp)):>9} {fmt_bytes(float(sent_per_rank(on_cp, scheme, cp_))):>10} "
            f"{fmt_bytes(act):>12}")
        trainer.finish()
        trainer.stage.ctx.free()                # a2a+p2p's two sub-communicators of cp_comm
        trainer.free()
    g.free()

# %% [markdown]
# Every layout and every scheme that applies (a2a+p2p needs cp = a x r with a, r > 1: cp 8 here) ends the two
# steps with serial SGD's parameters and losses, to rounding. The
# traffic of each step matched `step_formula` on every communicator: tp's collectives on rows of $T_l$ positions,
# the pipeline's messages of $b\,T_l\,C$ numbers, the cp ring's, all-gather's or all-to-alls' $L \cdot m$
# attention exchanges per step, and the dp exchange over the dp x cp ranks that share each shard.
#
# The activation bytes measured (`stage.peak_bytes`: every array the caches reach, each counted once) are the
# formula's exactly: `hsgd.accounting.activations.activation_formula` with cp counts every term on the rank's $T_l$ rows
# and the cp scheme's attention cache in place of q, k, v and the probabilities. (The embedding's cache keeps the
# offsets of its rows and asks the layout for their positions again in the backward pass, so that no array of the layout
# itself is counted as an activation.)
#
# ## 6. Ring, all-gather and Ulysses, measured on 8 ranks
#
# The same model with a longer sequence, T = 64, on cp 8 (8 positions a rank), one sequence per step, the three
# schemes side by side (a2a+p2p, their combination, in section 8): a warm-up step each, then 4 rounds in which the
# schemes take turns, so that whatever else the machine does falls on all of them.

# %%
cfg64 = dataclasses.replace(cfg, seq_len=64)
corpus64 = Corpus.load(None, cfg64.seq_len)
ROUNDS = 4
THREE = ("ring", "allgather", "ulysses")
trainers = {s: HybridTrainer(cfg64, g8, train_config(dp=1, pp=1, tp=1, cp=8, cp_scheme=s, steps=ROUNDS + 1,
                                                     batch_size=1, micro_batches=1)) for s in THREE}
seconds, sent64, act64 = {s: [] for s in THREE}, {}, {}
for step in range(1, ROUNDS + 2):
    for s, tr in trainers.items():
        tr.stage.measure_bytes = step == 1
        world.Barrier()
        before, t0 = g8.stats.counts(), time.perf_counter()
        tr.step(*corpus64.batch(SEED, step, 1), step)
        t = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)   # the step of the slowest rank
        if step > 1:
            seconds[s].append(t)
        sent64[s] = {k: n for k, n in g8.stats.since(before).items() if k[0] == "cp"}
        if step == 1:
            act64[s] = tr.stage.peak_bytes                              # the warm-up step measured them
say(f"cp 8, T = {cfg64.seq_len}, b = 1, L = {cfg64.n_layers}, per step:")
say(f"{'scheme':<10} {'cp calls':>9} {'payload':>9} {'sent/rank':>10} {'activations':>12} {'(formula)':>10} "
    f"{'ms per step (median, min)':>27}")
for s in THREE:
    f_act = activation_formula(cfg64, 1, 8, 1, "megatron", 8, s)["model"]
    ms = sorted(1e3 * x for x in seconds[s])
    say(f"{s:<10} {sum(n for n, _ in sent64[s].values()):>9} {fmt_bytes(payload(sent64[s])):>9} "
        f"{fmt_bytes(float(ring_bytes(sent64[s], 8))):>10} {fmt_bytes(act64[s]):>12} {fmt_bytes(f_act):>10} "
        f"{ms[len(ms) // 2]:>18.1f} {ms[0]:>8.1f}")
    check.equal(f"{s}: cp_comm per step == cp_formula(L blocks)", sent64[s],
                cp_formula(s, 8, 1, cfg64.seq_len, cfg64.d_model, 1, 8, cfg64.n_layers))
    check.equal(f"{s}: activation bytes == activation_formula", act64[s], f_act)
kv = 2 * (cfg64.seq_len // 8) * cfg64.d_model * 8           # one (k, v) block, bytes
check.equal("bytes sent per rank: ring (3cp - 2) blocks, all-gather 2 (cp - 1), Ulysses 4 (cp - 1)/cp, per layer",
            [ring_bytes(sent64[s], 8) for s in THREE], [2 * 22 * kv, 2 * 14 * kv, 2 * Fraction(7, 2) * kv])
for tr in trainers.values():
    tr.finish()
    tr.free()

# %% [markdown]
# The bytes are what section 3 predicted per layer, times L: the ring sends 22 blocks per layer, the all-gather 14,
# Ulysses 3.5. The all-gather already holds more than twice the ring's activations (the gathered k and v and the $8
# \times 64$ probabilities per head and sequence); by section 1 the factor is about 60 at T = 131072. Ulysses holds
# between the two (106.5 KiB against 43.5 and 134.5): the all-gather's probabilities, as a $64 \times 64$ matrix of
# one head, but only its head's k and v, not all of them. The times are printed, never checked: with eight ranks on
# two cores the ring's 44 Isends and 44 Irecvs per step, each a Python call and an MPI handshake, cost more than
# four collectives (or Ulysses' eight all-to-alls), and nothing here computes long enough to hide them. Where a
# block takes longer than a hop (large blocks on a GPU) the ring hides its sends behind the blocks, which is the
# point of it, provided the bytes move while the blocks compute; the next section looks at whether they do here.
#
# ## 7. The trace: what moves while the blocks compute
#
# `cp_comm.tracer = tracer` makes every Isend and Irecv a span on the trace's "async" track, from the call to its
# Wait, and the ring's blocks spans on the "compute" track (`hsgd.grid.trace`). In the forward pass step i issues the
# Isend of the block it holds and the Irecv of the next one, computes the block, then waits; in the backward pass the
# (k, v) blocks travel the same way, and the (dk, dv) shares one step behind. An async span under a block says that a
# message was posted before the block and waited for after it, which the ring's code makes true every time; it does
# not say that a byte moved meanwhile. That depends on the MPI library. The standard only requires a library to move a
# message while a rank is inside an MPI call, and MPICH without a progress thread does no more: it moves a
# non-blocking point-to-point message only inside MPI calls of the ranks at its two ends (the Isend and Irecv that
# post it, and any Test, Wait or other call that runs MPICH's progress engine); with `MPIR_CVAR_ASYNC_PROGRESS=1` it
# starts an extra thread in every rank that progresses all communication in the background (MPICH's description of the
# variable, which its `mpivars` tool prints). A ring block makes no MPI call: it is NumPy from its start to its end.
#
# So this section looks at the bytes themselves. `Watched` is hsgd's `Ring`, its algorithm untouched, on a wrapper
# of `cp_comm` that fills every receive buffer with NaN before posting it and notes when each Isend returned. At the
# start and at the end of every block it reads the buffers of the receives still pending (reading memory is no MPI
# call): one that was NaN at the start and holds the data at the end moved during the block. One ring attention
# forward and backward on cp 8, with T = 256, runs twice: first with an `MPI_Test` (mpi4py's `Request.Testall`) on
# the pending receives after each of a block's chunk pairs; then as hsgd runs it, without, and traced:

# %%
class Watching:
    """cp_comm as the ring uses it (size, rank, tracer, Isend, Irecv), watched: every receive buffer is filled with
    NaN before it is posted, so that reading it tells whether its bytes have arrived (random k, v and their gradients
    are never NaN); every Isend's return time is noted (`sent`), and the receives not yet waited for are `pending`."""

    def __init__(self, comm):
        self.comm, self.size, self.rank = comm, comm.size, comm.rank
        self.sent, self.pending, self.posted = [], [], {}    # [(tag, seconds)]; [Receive]; tag -> receives so far

    @property
    def tracer(self):
        return self.comm.tracer

    def Isend(self, x, dest, tag=0):
        req = self.comm.Isend(x, dest, tag)
        self.sent.append((tag, time.perf_counter()))         # from here on, the bytes are MPI's to move
        return req

    def Irecv(self, x, source, tag=0):
        x.fill(np.nan)
        self.posted[tag] = self.posted.get(tag, 0) + 1
        return Receive(self, tag, self.posted[tag] - 1, x, self.comm.Irecv(x, source, tag))


class Receive:
    """A pending receive of a Watching comm: (tag, its number among that tag's receives, buffer, hsgd Request)."""

    def __init__(self, watching, tag, nth, x, req):
        self.watching, self.tag, self.nth, self.x, self.req = watching, tag, nth, x, req
        watching.pending.append(self)

    def arrived(self):
        return not np.isnan(self.x).any()                    # memory read: no MPI call, no progress

    def Wait(self):
        self.watching.pending.remove(self)
        self.req.Wait()


class Watched(Ring):
    """hsgd's Ring on a Watching cp_comm: at the start and the end of every block, which pending receives have their
    bytes; with poll, an MPI_Test on them after each of the block's chunk pairs."""

    def __init__(self, comm, T, poll):
        super().__init__(Watching(comm), T)
        self.poll, self.seen = poll, []           # per block: (start, end, [(tag, nth, arrived at start, at end)])

    @contextmanager
    def span(self, name, **args):
        pending = list(self.comm.pending)
        before, t0 = [r.arrived() for r in pending], time.perf_counter()
        with super().span(name, **args):
            yield
        self.seen.append((t0, time.perf_counter(), [(r.tag, r.nth, b, r.arrived()) for r, b in zip(pending, before)]))

    def pairs(self, owner):
        for pair in super().pairs(owner):
            yield pair
            if self.poll:                                    # MPICH's progress engine runs inside the Test
                MPI.Request.Testall([r.req.req for r in self.comm.pending])


def run_watched(poll, tracer=None):
    """One ring attention forward and backward on cp 8; per block of my rank: (start, end, receives whose bytes moved
    during it, receives whose sender had posted them before it ended but which had not arrived at its start); and
    when the backward returned."""
    ring = Watched(g8.cp_comm, Tt, poll)
    g8.cp_comm.tracer = tracer
    ring.attention_backward(dyt, ring.attention_forward(qt, kt, vt, NHt)[1])
    t_end = time.perf_counter()
    g8.cp_comm.tracer = None
    sent, when = g8.cp_comm.allgather_obj(ring.comm.sent)[(rank - 1) % 8], {}   # my predecessor's Isends, to me
    for tag, t in sent:
        when[tag, sum(k[0] == tag for k in when)] = t
    return [(t0, t1, sum(not a and b for _, _, a, b in rows),
             sum(not a and when[tag, n] < t1 for tag, n, a, _ in rows)) for t0, t1, rows in ring.seen], t_end


Tt, Ct, NHt = 256, 32, 4
rng = np.random.default_rng(1)
qt, kt, vt, dyt = (rng.standard_normal((B, Tt // 8, Ct)) for _ in range(4))   # my positions' rows (random)
polled, _ = run_watched(poll=True)                   # (also the warm-up of the traced run)
tracer = Tracer(rank, world)
plain, t_end = run_watched(poll=False, tracer=tracer)
kinds = [(n, tr_) for n, tr_, *_ in tracer.events]
check.equal("traced: cp + cp blocks, 3cp - 2 Isends and 3cp - 2 Irecvs (cp = 8)",
            [kinds.count(k) for k in (("attention block", "compute"), ("attention block (backward)", "compute"),
                                      ("Isend", "async"), ("Irecv", "async"))], [8, 8, 3 * 8 - 2, 3 * 8 - 2])
moved = {name: world.allgather([(m, a) for _, _, m, a in blocks]) for name, blocks in (("polled", polled),
                                                                                        ("plain", plain))}
total = {name: [sum(x[i] for r in per_rank for x in r) for i in (0, 1)] for name, per_rank in moved.items()}
say(f"receives whose bytes moved during a block / were posted by their sender before the block ended, all ranks: "
    f"with MPI_Test between the pairs {total['polled'][0]} / {total['polled'][1]}, "
    f"without (as hsgd runs) {total['plain'][0]} / {total['plain'][1]}")
check.holds("ring as hsgd runs it (no MPI call in a block): no bytes moved in a block",
            total["plain"][0] == 0)
check.holds("with MPI_Test after each chunk pair: bytes moved during some block",
            total["polled"][0] > 0)


def ring_model(cp, hop):
    """One rank's ring in the order its code runs it, a block taking 1 and a hop `hop` < 1, each hop starting when
    its Isend is posted: blocks [(backward?, start, end)], hops [(what, start, end)]: a (k, v) hop with each block
    but the last of a pass, a (dk, dv) hop after each backward block; the last of those has no block after it."""
    blocks = [(i >= cp, i, i + 1) for i in range(2 * cp)]
    hops = [("(k, v)", i, i + hop) for i in range(2 * cp) if i % cp != cp - 1]
    return blocks, hops + [("(dk, dv)", cp + j + 1, cp + j + 1 + hop) for j in range(cp)]


every_rank = world.allgather((plain, t_end))     # every rank's blocks, for the picture's lower panel
HOP = 0.6                                        # a hop's time in blocks, for the upper panel (an assumption)


def draw_overlap():
    fig, (ax_m, ax_t) = pictures.figure(10, 5.0, nrows=2)
    blocks_m, hops_m = ring_model(8, HOP)
    for back, color in ((False, "C0"), (True, "C2")):                          # one bar collection per kind
        ax_m.broken_barh([(a, b - a) for k, a, b in blocks_m if k == back], (0.75, 0.5), facecolor=color,
                         edgecolor="white")
    last = max(a for _, a, _ in hops_m)                                         # the exposed one
    for what, y in (("(k, v)", 0.1), ("(dk, dv)", -0.4)):
        ax_m.broken_barh([(a, b - a) for w, a, b in hops_m if w == what and a != last], (y, 0.3), facecolor="C1")
    ax_m.broken_barh([(last, HOP)], (-0.4, 0.3), facecolor="C3", hatch="//", edgecolor="white")
    ax_m.annotate("the last (dk, dv) hop:\nno block left to hide it", (16 + HOP / 2, -0.4), xytext=(13.2, -1.3),
                  fontsize=7, arrowprops=dict(arrowstyle="->", lw=0.8))
    ax_m.set_yticks([1, 0.25, -0.25])
    ax_m.set_yticklabels(["blocks (forward blue,\nbackward green)", "(k, v) hops", "(dk, dv) hops"], fontsize=7)
    ax_m.set_ylim(-1.5, 1.4)
    ax_m.set_xlim(0, 2 * 8 + 1.5)
    ax_m.tick_params(labelsize=7)
    ax_m.set_xlabel("time, a block = 1", fontsize=7)
    ax_m.set_title(f"the ring's order on cp 8 where a block takes longer than a hop ({HOP:g} of a block) and the "
                   f"bytes move while it computes", fontsize=8)
    steps = np.arange(16)
    ms = np.array([[1e3 * (b[1] - b[0]) for b in blocks] for blocks, _ in every_rank])      # (ranks, 16)
    gap = np.array([[1e3 * ((blocks[i + 1][0] if i < 15 else end) - blocks[i][1]) for i in range(16)]
                    for blocks, end in every_rank])
    ax_t.bar(steps - 0.2, np.median(ms, axis=0), 0.4, color=["C0"] * 8 + ["C2"] * 8)
    ax_t.bar(steps + 0.2, np.median(gap, axis=0), 0.4, color="0.75")
    ax_t.set_ylabel("ms, median of 8 ranks", fontsize=7)
    ax_n = ax_t.twinx()
    for name, marker, color in (("polled", "^", "C1"), ("plain", "o", "0.3")):
        ax_n.plot(steps, [sum(per_rank[i][0] > 0 for per_rank in moved[name]) for i in range(16)], marker,
                  color=color, ms=5)
    ax_n.set_ylim(-0.5, 8.5)
    ax_n.set_ylabel("ranks", fontsize=7)
    ax_t.set_title(f"measured, as hsgd runs it (T = {Tt}): each block (blue, green) and the wait after it (grey bars, "
                   f"left axis; after B7: to the backward's end);\nranks whose pending receive's bytes moved during "
                   f"the block (right axis): with MPI_Test after each chunk pair (orange), without (grey)", fontsize=8)
    ax_t.set_xticks(steps)
    ax_t.set_xticklabels([f"F{i}" for i in range(8)] + [f"B{i}" for i in range(8)])
    ax_t.tick_params(labelsize=7)
    ax_n.tick_params(labelsize=7)
    return pictures.save(fig, "13_ring_overlap")


say(f"picture: {pictures.on_rank0(world, draw_overlap, share=True)}")

# %% [markdown]
# The picture shows the ring in the order its code runs it, where a block takes longer than a hop (top), and below
# it what this machine did as hsgd runs the ring: the median over the 8 ranks of each block's time and of the wait
# after it, and on how many ranks a pending receive's bytes moved during each block, with and without `MPI_Test`.
#
# The top panel follows `Ring.around` and `Ring.attention_backward`: every (k, v) hop, the forward's first included,
# is posted before a block and waited for after it, and every (dk, dv) hop but the last is received while the next
# block computes. So where a block takes longer than a hop and the bytes move while it computes, the one transfer the
# ring leaves exposed is the backward's last (dk, dv) hop: after its last block, each rank sends the gradients it has
# summed for the (k, v) block of rank r+1 on to their owner, rank r+1, and waits for its own from rank r-1, with no
# block left to compute behind either. As hsgd runs the ring on this machine, neither condition holds: the blocks are
# short next to the waits between them (the lower panel's bars), and MPICH moved no byte during a block that made no
# MPI call, although the senders had posted many of those messages before the block ended (the counts printed above):
# they waited for the receiving rank's next MPI call, after the block. With a Test between the chunk pairs, MPICH's
# progress engine runs inside the block, and bytes the senders have posted move there (its markers, and the counts
# printed above). A ring on CPUs in MPICH therefore overlaps its hops with its blocks only when it polls like this or
# runs a progress thread on a core of its own; on a GPU the transfers run on their own stream or copy engine while the
# kernels compute.

# %% [markdown]
# ## 8. Ulysses: an all-to-all to a head split, and the bytes as cp grows
#
# The heads of an attention layer are independent, and only the attention mixes positions. Ulysses (`Ulysses` in
# `hsgd/cp/ulysses.py`) uses both facts: before the core attention each rank cuts its $T_l$ positions of q, k and v
# into cp head groups of NH/(tp cp) heads and sends group j to cp rank j, one `Alltoall` on `cp_comm` (block j of
# the send buffer goes to rank j; `hsgd.grid.comm.Comm.Alltoall`). Afterwards rank r holds every position of head
# group r, in rank order (rank 0's positions, then rank 1's, ...), and runs the whole causal attention on them with
# the mask of their global positions, exactly the serial attention of those heads. A second all-to-all sends each
# rank its positions of the output back. The backward pass is the adjoint: an all-to-all is a permutation of all
# the ranks' data, whose adjoint is its inverse, so dy goes to the head split, the attention's backward runs, and
# dq, dk, dv go back. The picture shows which rank holds which (position, head) of q before and after, for cp 4, T
# = 16 and 8 heads; the check reads rank r's cached q after the first all-to-all of section 3's cp 8 (one head a
# rank) and compares it with head r of the serial q at all T positions in rank order:

# %%
def draw_ulysses(T_=16, cp_=4, nh_=8):
    from matplotlib.colors import ListedColormap
    fig, axes = pictures.figure(9, 3.6, ncols=2)
    cmap = ListedColormap([f"C{i}" for i in range(cp_)])
    before, after = np.empty((T_, nh_)), np.empty((T_, nh_))
    for r in range(cp_):
        before[split.positions(T_, cp_, r)] = r                     # rank r: its positions, every head
        after[:, r * nh_ // cp_:(r + 1) * nh_ // cp_] = r             # rank r: every position of head group r
    titles = ("before: rank r holds chunks r and 2cp-1-r of every head", "after the all-to-all: rank r holds "
              "every position of heads 2r, 2r+1")
    for ax, a, title in zip(axes, (before, after), titles):
        ax.imshow(a, cmap=cmap, vmin=-0.5, vmax=cp_ - 0.5, aspect="auto", interpolation="nearest")
        ax.set_xlabel("head")
        ax.set_ylabel("position t")
        ax.set_title(title, fontsize=8)
    for r in range(cp_):
        for _, g0, n in chunk_starts(T_, cp_, r):
            axes[0].text((nh_ - 1) / 2, g0 + (n - 1) / 2, f"rank {r}", ha="center", va="center", fontsize=7)
        axes[1].text(r * nh_ / cp_ + (nh_ / cp_ - 1) / 2, (T_ - 1) / 2, f"rank {r}", ha="center", va="center",
                     fontsize=7, rotation=90)
    return pictures.save(fig, "13_ulysses_all_to_all")


say(f"picture: {pictures.on_rank0(world, draw_ulysses, share=True)}")
uly = make_split("ulysses", g8.cp_comm, T)
qh_mine = uly.attention_forward(*(np.ascontiguousarray(a[:, uly.pos]) for a in (q_all, k_all, v_all)), NH)[1][0]
in_order = np.concatenate([split.positions(T, 8, o) for o in range(8)])        # every rank's positions, in turn
hs8 = C // NH
check.equal("Ulysses on cp 8: after the all-to-all rank r holds head r of q at all T positions, in rank order",
            bool(np.allclose(qh_mine[:, 0] * np.sqrt(hs8), q_all[:, in_order, g8.cp_rank * hs8:(g8.cp_rank + 1) * hs8],
                             rtol=1e-15, atol=0)), True)

# %% [markdown]
# Ulysses' cp can be at most the heads of a tp rank, and its all-to-all wants a fast network among all cp ranks. The
# ring takes any cp but sends $3cp - 2$ blocks. Megatron-LM's hierarchical context parallelism (`--cp-comm-type
# a2a+p2p`, `hsgd/cp/hierarchical.py`) combines them: cp = a x r, an all-to-all inside each group of a adjacent cp
# ranks (on one node) turns the group's sequence split into a head split, and the r groups then run ring attention
# on their $a T_l$ positions of NH/(tp a) heads, passing (k, v) blocks across the groups, merged by the online
# softmax. cp rank c is member c mod a of group c // a; the group's rows after the all-to-all are its a members'
# zig-zag chunks, in member order, and the ring's chunk pairs are masked by their global positions as the plain
# ring's are. hsgd takes r as cp's smallest prime factor and a = cp / r (`split.a2a_sizes`; Megatron-LM asks for
# both, `--hierarchical-context-parallel-sizes a r`): cp 8 is 4 x 2.

# %%
hier = make_split("a2a+p2p", g8.cp_comm, T)
a8, r8 = split.a2a_sizes(8)
grp, mem = divmod(g8.cp_rank, a8)
a2a_members = hier.a2a_comm.allgather_obj(g8.cp_rank)          # the cp ranks of my all-to-all group, in order
ring_members = hier.ring.comm.allgather_obj(g8.cp_rank)        # the cp ranks of my ring, in order
check.equal(f"cp 8 = {a8} x {r8}: my all-to-all group is cp ranks {a8} G .. {a8} G + {a8 - 1}, my ring the cp ranks "
            f"of my index in every group", (a2a_members, ring_members),
            (list(range(a8 * grp, a8 * grp + a8)), list(range(mem, 8, a8))))
rows_pos = np.concatenate([np.arange(g0, g0 + n) for _, g0, n in hier.ring.chunks])
check.equal("after the all-to-all a rank's rows are its group's members' positions, in member order",
            rows_pos.tolist(), np.concatenate([split.positions(T, 8, a8 * grp + i) for i in range(a8)]).tolist())
say(f"cp 8 = {a8} x {r8}: cp rank {g8.cp_rank} is member {mem} of group {grp}: all-to-all with cp ranks "
    f"{a2a_members}, ring with {ring_members}; its rows after the all-to-all are chunks "
    f"{[g0 // (T // 16) for _, g0, _ in hier.ring.chunks]} (of 16)")
hier.free()

# %% [markdown]
# Jacobs et al. argue that Ulysses' communication per device stays constant when the sequence and the devices grow
# together, where the ring's and the all-gather's grow with the devices: every rank must receive the keys and values
# of all T positions (or send its own to all cp - 1 others), while an all-to-all sends each rank only its share of
# the rank's own $T_l$ positions. Measured: one layer's attention, forward and backward, with $T_l = 8$ positions a
# rank (T = 8 cp) on cp 2, 4 and 8 (the 8 ranks as dp 8/cp x cp), b = 2, C = 16, 8 heads, each scheme checked
# against serial attention and its messages against `cp_formula`; bytes sent per rank, and in (k, v) blocks of
# $2\,b\,T_l\,C\,s$ = 4 KiB, the same size at every cp:

# %%
TL = 8                                                       # positions per rank: T grows with cp
blk = 2 * B * TL * C * 8
grow = {s: {} for s in split.CP_SCHEMES}                     # scheme -> {cp: bytes sent per rank}
say(f"{'cp':>3} {'T':>4} " + " ".join(f"{s + ' sent/rank':>21}" for s in split.CP_SCHEMES))
for cp_ in (2, 4, 8):
    g = ProcessGrid(world, dp=8 // cp_, pp=1, tp=1, cp=cp_)
    T_ = TL * cp_
    rng = np.random.default_rng(3)
    qkvd = [rng.standard_normal((B, T_, C)) for _ in range(4)]
    y_ref, c_ref = attention_forward(*qkvd[:3], NH)
    want = (y_ref, *attention_backward(qkvd[3], c_ref))
    for s in [s for s in split.CP_SCHEMES if applies(s, cp_)]:
        ctx = make_split(s, g.cp_comm, T_)
        mine = [np.ascontiguousarray(a[:, ctx.pos]) for a in qkvd]
        before = g.stats.counts()
        y_, cache_ = ctx.attention_forward(*mine[:3], NH)
        got = (y_, *ctx.attention_backward(mine[3], cache_))
        sent = {key: n for key, n in g.stats.since(before).items() if key[0] == "cp"}
        check(f"cp {cp_}, T = {T_}, {s}: y, dq, dk, dv vs serial attention", max(rel_err(a, b[:, ctx.pos])
                                                                                for a, b in zip(got, want)), 1e-13)
        check.equal(f"cp {cp_}, T = {T_}, {s}: cp_comm calls and payload == cp_formula", sent,
                    cp_formula(s, cp_, B, T_, C, 1, 8, 1))
        grow[s][cp_] = sent_per_rank(sent, s, cp_)
        ctx.free()
    say(f"{cp_:>3} {T_:>4} " + " ".join(f"{fmt_bytes(float(grow[s][cp_])):>11} ({float(grow[s][cp_] / blk):>4.1f} blk)"
                                         if cp_ in grow[s] else f"{'-':>21}" for s in split.CP_SCHEMES))
    g.free()
ar = {c: split.a2a_sizes(c) for c in (4, 8)}                  # a2a+p2p's (a, r): 2 x 2, 4 x 2
check.equal("bytes sent per rank, T = 8 cp: ring (3cp - 2) blocks, all-gather 2 (cp - 1), Ulysses 4 (cp - 1)/cp, "
            "a2a+p2p 4 (a - 1)/a + 3r - 2 (cp = a r, cp 4 and 8)",
            [grow[s] for s in split.CP_SCHEMES], [{c: (3 * c - 2) * blk for c in (2, 4, 8)},
                                                  {c: 2 * (c - 1) * blk for c in (2, 4, 8)},
                                                  {c: Fraction(4 * (c - 1), c) * blk for c in (2, 4, 8)},
                                                  {c: (Fraction(4 * (a - 1), a) + 3 * r - 2) * blk
                                                   for c, (a, r) in ar.items()}])
check.holds("Ulysses' bytes per rank stay below 4 blocks at every cp; the ring's and the all-gather's grow with cp; "
            "a2a+p2p's at cp 8 are a third of the ring's",
            all(x < 4 * blk for x in grow["ulysses"].values()) and grow["ring"][8] > 5 * grow["ring"][2]
            and grow["allgather"][8] > 6 * grow["allgather"][2] and 3 * grow["a2a+p2p"][8] < grow["ring"][8])
say("from cp 2 to cp 8: " + ", ".join(f"{s} x {float(grow[s][8] / grow[s][2]):.2f}" for s in THREE)
    + f"; a2a+p2p from cp 4 to cp 8 x {float(grow['a2a+p2p'][8] / grow['a2a+p2p'][4]):.2f}")

# %% [markdown]
# What the measurement shows: with the sequence growing as the ranks do, the ring's bytes per rank grow with cp
# (16 KiB at cp 2, 88 KiB at cp 8: x 5.5) and so do the all-gather's (8 KiB to 56 KiB: x 7), each $\approx$ linear in
# cp; Ulysses' go from 8 KiB to 14 KiB (x 1.75) and can never pass 16 KiB, the four blocks of its own send
# buffers: what grows is only the share $(cp - 1)/cp$ that leaves the rank, from 1/2 to 7/8. So the claim holds in
# the form "bounded by a constant", $4 \cdot 2\,b\,T_l\,C\,s$ per layer, not "equal at every cp": the paper counts
# an all-to-all's aggregate message divided by the devices, and counted as bytes a rank sends its own block stays,
# hence the $(cp - 1)/cp$. Its price is
# in the model: cp at most the heads of a tp rank (NH/tp; with grouped-query attention its NKV/tp kv heads), where
# the ring and the all-gather take any cp the sequence allows. a2a+p2p sits between: 6 blocks on cp 4 (2 x 2) and
# 7 on cp 8 (4 x 2), $4(a-1)/a$ of them from its all-to-alls, which stay below 4, and $3r - 2$ from the ring across
# its r groups, which grow only with r; its heads need only be divisible by a. With r = 2 a larger cp adds to a, the
# all-to-all's group, which is why the step from cp 4 to cp 8 costs it one block (x 1.17) where it costs the ring 12
# (on hardware the all-to-all group is a node, and r grows with the nodes). On two cores nothing here is timed:
# section 6's times are the ones this machine can give.
#
# ## Check against serial
#
# On 8 ranks, every verdict reached collectively: the activation formula's terms (what tp leaves replicated, what cp
# divides, the ring's linear and the all-gather's and Ulysses' quadratic attention caches); the online softmax in
# blocks equals the softmax at once with lse = m + log l, and the backward from lse and D alone equals the full one;
# ring, all-gather, Ulysses and a2a+p2p attention on cp 8 and cp 4 x tp 2 equal serial attention at every rank's
# positions, forward and backward, with exactly `cp_formula`'s messages; every rank's measured work equals
# `attention_blocks`, balanced on every rank and a staircase with the plain split; two steps of SGD on dp 2 x cp 2
# x tp 2, cp 8 and pp 2 x cp 2 x tp 2 with every scheme that applies end with serial SGD's parameters and losses,
# with `step_formula`'s traffic and `activation_formula`'s bytes; the traced ring has the formula's blocks and
# messages, moves no byte during a block that makes no MPI call, and moves bytes during its blocks when it calls
# `MPI_Test` between their chunk pairs; a2a+p2p's groups and rows are Megatron-LM's; and with T = 8 cp the bytes each
# rank sends grow with cp for the ring and the all-gather, stay below four blocks for Ulysses, whose all-to-all
# leaves each rank whole heads at all positions, and for a2a+p2p are its all-to-alls' (below four blocks) and its
# ring's across r groups.

# %%
worst_what, err = check.worst([w for w in check.errors if "serial" in w])
say(f"\nchapter 15: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error against serial "
    f"{err:.1e} ({worst_what})")
for run in runs.values():
    run[3].free()                                # a2a+p2p's sub-communicators (the others hold none)
g8.free()
g42.free()

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `--cp N`: `ProcessGrid(cp=)`, `grid.cp_comm`; `dp_comm` holds the dp x cp ranks of a shard | `--context-parallel-size` (`ModelParallelConfig.context_parallel_size`), `parallel_state.get_context_parallel_group` | `sequence_parallel_size` in the config (Ulysses; `groups._get_sequence_parallel_world_size`) | `context_parallel(mesh, buffers=..., buffer_seq_dims=...)` (torch.distributed.tensor.experimental), a context manager over one `DeviceMesh` dimension | the cp ranks sit next to the tp ranks in the rank order; MPI communicators, no mesh |
# | `--cp-scheme ring`: `hsgd.cp.ring.Ring`, (k, v) over Isend/Irecv, (dk, dv) back to their owner | `--cp-comm-type p2p` (the default): TransformerEngine's `AttnFuncWithCPAndKVP2P`, reached through `attn_forward_func_with_cp` | none | `set_rotate_method("alltoall")` (`_RotateMethod.ALL_TO_ALL`): the (k, v) shifted to the next rank by `permute_tensor` in `_templated_ring_attention` | NumPy blocks and MPI requests, one block's sends posted at a time, which MPICH moves only inside MPI calls (section 7) |
# | `--cp-scheme allgather`: `gather_attention.AllGather`, All-Gather k, v, Reduce-Scatter dk, dv | `--cp-comm-type allgather`: `AttnFuncWithCPAndKVAllGather` | none | `_RotateMethod.ALL_GATHER` (the default): `_AllGatherRotater` gathers once, the ring loop then reads its blocks | one softmax over all keys, no merge; the probabilities of the rank's queries are cached |
# | the online softmax: `Ring.merge` carries (m, l, o), y = o / l, lse = m + log l | `flash_attn_fwd_softmax_lse_correction`, `flash_attn_fwd_out_correction` (TransformerEngine): merge normalised blocks by their lse | `update_out_and_lse` (deepspeed/sequence/fpdt_layer.py, FPDT's chunks) | `_SDPAMerger`: merges normalised outputs by lse | unnormalised o and one division at the end (exercise 3 merges normalised ones) |
# | load balance: `chunk_starts`, rank r holds chunks r and 2cp-1-r; `attention_blocks` counts the work | `get_batch_on_this_cp_rank` (megatron/core/utils.py): the same zig-zag; seq_length a multiple of 2 x cp | none needed: Ulysses gives each rank whole sequences of NH/cp heads | `_HeadTailLoadBalancer` (`_context_parallel/_load_balancer.py`), head and tail chunks | the work is counted (`ctx.work`) and checked |
# | `--cp-scheme ulysses`: `ulysses.Ulysses`, one `Alltoall` of [q, k, v] to the head split, one of y back; the backward the adjoint | `--cp-comm-type a2a`: `AttnFuncWithCPAndQKVOA2A` | `DistributedAttention` with `_SeqAllToAll` (deepspeed/sequence/layer.py): all-to-all from a sequence split to a head split and back | none (its `ALL_TO_ALL` rotation is a ring shift, not a head split) | the zig-zag positions kept (the mask is of their global positions), q, k, v in one all-to-all; cp must divide NH/tp and NKV/tp, else refused (exercise 2 copies the kv heads instead) |
# | `--cp-scheme a2a+p2p`: `hierarchical.Hierarchical`, Ulysses' all-to-alls on groups of a adjacent cp ranks (`Split` of `cp_comm`), `ring.Ring`'s code across the r groups on the group's rows and heads | `--cp-comm-type a2a+p2p` with `--hierarchical-context-parallel-sizes a r` (TransformerEngine's a2a then `AttnFuncWithCPAndKVP2P` on the second-level group) | none | none | a and r fixed by a rule (`split.a2a_sizes`: r the smallest prime factor of cp), not a flag; both sub-communicators named "cp" for the accounting; cp prime, or a not dividing NH/tp and NKV/tp, refused |
#
# ## Exercises
#
# ### Exercise 1: the striped layout
# Brandon et al. give rank r the positions t with t mod cp = r instead of two chunks. Write the striped positions,
# count for each rank of cp = 2, 4, 8 (T = 64) the scores the causal mask needs, by brute force, and check three
# closed forms: plain $n(rn) + n(n+1)/2$, hsgd's zig-zag $2cp\,c^2 + c$ (equal on every rank) and striped
# $n(r+1) + cp\,n(n-1)/2$, with n = T/cp. Then make the striped layout run: subclass `hsgd.cp.ring.Ring`, set
# `pos` and override `pairs(owner)` (one pair of all my rows and all the owner's rows, with the mask of their
# positions), and check its attention forward and backward against serial on cp 8 and its `work` against
# $cp\,n^2$.
# (solution: `tutorials/solutions/13_context_parallelism.py`, `exercise_1`)
#
# ### Exercise 2: Ulysses with fewer kv heads than cp
# `split.check_heads` refuses `--cp-scheme ulysses` when cp does not divide a tp rank's kv heads (a model with 8 kv
# heads on tp 8 has one a rank). When cp is a multiple of them there is a way out: send each head group the one kv
# head its query heads read, a copy of it for each of the cp/NKV groups that read it (NKV here a tp rank's), and
# sum the copies' gradients on the way back (the adjoint of a copy is a sum). Subclass `hsgd.cp.ulysses.Ulysses`:
# its forward repeats k and v to cp heads and calls the parent's, its backward calls the parent's and sums dk, dv
# over the copies. Check it on cp 8 with NH = 8 and NKV = 2 against serial grouped-query attention (k, v repeated
# to the query heads, dk, dv summed over each group), and its all-to-alls against their payload, $2\,b\,T_l\,(C +
# 2\,cp\,hs)\,s$ for q, k, v and $2\,b\,T_l\,C\,s$ for y, each way. Then show that per layer a rank sends less than
# the all-gather of the same kv heads exactly when NH < cp (NKV - 1), so never with one kv head a rank.
# (solution: `tutorials/solutions/13_context_parallelism.py`, `exercise_2`)
#
# ### Exercise 3: the merge of two partial results is associative
# Write `merge((m1, l1, o1), (m2, l2, o2))` for partial results over two disjoint sets of keys, and `finish` =
# o / l. Check on random blocks that merging is commutative and associative (to rounding), that any bracketing of 8
# blocks gives the softmax at once, and that an empty block (m = -inf, l = 0, o = 0) changes nothing. Then merge
# normalised outputs by their lse alone, $y = \sigma(\mathrm{lse}_1 - \mathrm{lse}_2)\,y_1 + \sigma(\mathrm{lse}_2 -
# \mathrm{lse}_1)\,y_2$ and $\mathrm{lse} = \log(e^{\mathrm{lse}_1} + e^{\mathrm{lse}_2})$, and check it against
# the same.
# (solution: `tutorials/solutions/13_context_parallelism.py`, `exercise_3`)
#
# ### Exercise 4: where the memory crosses over
# From the terms of section 1 (7B-sized model, one sequence, 2 bytes), write both schemes' block bytes on cp 8 as
# $\alpha T$ (ring) and $\beta T + \gamma T^2$ (all-gather), and find in closed form the smallest T, a multiple of
# 2cp, from which the all-gather holds at least twice the ring's activations; check it with a search over
# `activation_formula`. Do the same for the T from which the probabilities are more than half of a block on one
# rank without any parallelism.
# (solution: `tutorials/solutions/13_context_parallelism.py`, `exercise_4`)
