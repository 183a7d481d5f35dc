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
# Every layout so far gives each rank whole sequences. But a block's activations grow with T, and the attention
# probabilities with $T^2$, so a long enough sequence outgrows one device whatever happens to the weights. The lecture
# makes this argument for the model (section 2) and asks to balance the work (section 4.2) and to overlap communication
# with computation (section 4.1), but never splits the sequence: this chapter goes beyond it, with the same checks
# against serial SGD. Chapter 6's sequence parallelism splits T only where tensor parallelism leaves the activations
# whole and gathers it back before the attention; context parallelism keeps T split everywhere.
#
# `hsgd/cp/split.py` splits every sequence over the cp ranks of `grid.cp_comm`. Everything in a block but the core
# attention treats each position on its own and runs unchanged on a rank's T/cp positions. The core attention, where
# position t reads the keys and values of positions 0..t, is done one of four ways:
#
# * **ring** (Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"): the
#   (k, v) blocks travel around the ring of cp ranks while each rank keeps its queries, and the partial results are
#   merged with the online softmax (Milakov and Gimelshein 2018, "Online normalizer calculation for softmax"; Dao et al.
#   2022, "FlashAttention");
# * **all-gather** (Dubey et al. 2024, "The Llama 3 Herd of Models", for long contexts): All-Gather k and v, attend,
#   Reduce-Scatter their gradients;
# * **Ulysses** (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
#   Sequence Transformer Models"): an all-to-all turns the sequence split into a head split, each rank attends with all
#   T positions of NH/cp heads, and another all-to-all turns the output back (`hsgd/cp/ulysses.py`);
# * **a2a+p2p** (Megatron-LM's hierarchical context parallelism): Ulysses inside groups of a adjacent cp ranks, the ring
#   across the r = cp/a groups (`hsgd/cp/hierarchical.py`).
#
# Run it with eight ranks (4 s measured on a 2-core machine; on failure every rank raises). Rank 0 prints and draws four
# pictures into `$HSGD_FIGURES` (default `tutorials/figures/`). From the command line, `mpirun -n 8 python -m hsgd.train
# --cp 4 --tp 2 --cp-scheme ring` trains with context parallelism and prints one step's traffic next to its formula.
#
# mpirun -n 8 python tutorials/13_context_parallelism.py
#
# Legend: B sequences in the global batch, b per micro-batch, T sequence length, $T_l = T/cp$ the positions a cp rank
# holds, N = b T rows of a micro-batch ($N_l = b T_l$ on a cp rank), C d_model, NH heads, hs = C/NH the head size, F the
# MLP width, V vocabulary, L layers; tp, cp, pp, dp the sizes of the grid; c = T/(2cp) the length of a chunk; s bytes
# per number (8, float64, in the runs; 2 in section 1's formulas). In the online softmax: s the scores of one query, m
# the running maximum, l the running sum, o the running (unnormalised) output, lse = m + log l.

# %%
from hsgd.model.config import ModelConfig   # hsgd first, as appendix B explains (OpenBLAS's thread timeout)
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
# `activation_formula(cfg, b, s, tp, scheme, cp, cp_scheme)["block"]` is what one block's forward caches on one rank
# (measured against the caches in chapter 11). With Megatron's tensor-parallel scheme it is
#
# $$s\,\big(4NC + 2N + (4NC + b\,NH\,T^2 + 2NF)/tp\big):$$
#
# the LayerNorms' outputs and the inputs of the q, k, v and fc linears ($4NC + 2N$) are replicated over tp; the rest,
# the probabilities $b\,NH\,T^2$ included, is split. Tensor parallelism divides the $T^2$ term by tp but leaves $4NC$
# whole; the sequence scheme (chapter 6) divides that too, but not the $T^2$ further. Context parallelism gives each
# rank $N_l = N/cp$ rows of every term, and the core attention's cache is the scheme's (`split.attention_cache_bytes`):
#
# * ring: q and the rank's own (k, v), $3 N_l C/tp$, and lse, $b\,(NH/tp)\,T_l$: no $T \times T$ matrix, only what the
#   online softmax of section 2 keeps;
# * all-gather: q, the gathered k and v ($2\,b\,T\,C/tp$), and the probabilities of the rank's queries against all keys,
#   $b\,(NH/tp)\,T_l\,T$: the $T^2$ term divided by cp;
# * Ulysses: q, k and v of NH/(tp cp) heads at all T positions, $3 N_l C/tp$, and their probabilities, the all-gather's
#   $b\,(NH/tp)\,T_l\,T$ again;
# * a2a+p2p (section 8): the ring's, on its group's $a T_l$ positions of NH/(tp a) heads, plus the group's output y,
#   which its backward reads: $4 N_l C/tp$ and lse, linear in T.
#
# For a block of a 7B-sized model (C = 4096, NH = 32, F = 16384, one sequence, 2-byte numbers), per rank, the 8 ranks
# used as tp 8 or as cp 8 (formulas; nothing is allocated):

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
say(f"T = {TS[-1]}, cp 8: the all-gather holds {rows[-1][5] / rows[-1][4]:.0f} x the ring's activations per block")
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
# The picture plots the table's columns against T on log-log axes: a $T^2$ term steepens a line to slope 2. The
# probabilities are «66.7%» of a block on one rank at T = 4096 and «98.5%» of its «1040.0 GiB» at T = 131072. There tp 8
# leaves «133.5 GiB» per rank, the sequence scheme «130.0 GiB»: the probabilities divided by 8 are almost all of it. The
# ring holds «2.0 GiB», the all-gather «131.8 GiB». hsgd materialises the probabilities of the scores it computes at
# once (all of them in the all-gather, a block at a time in the ring); a fused kernel (FlashAttention) would not, and
# then the all-gather's price is the gathered k and v, O(T) per rank, where the ring holds its own block and the two in
# transit.
#
# ## 2. The online softmax, step by step
#
# The core attention of one query is a softmax-weighted sum over the keys it may read,
#
# $$y = \sum_j p_j v_j,\qquad p_j = \frac{e^{s_j}}{\sum_k e^{s_k}},\qquad s_j = q \cdot k_j / \sqrt{hs}.$$
#
# On a context-parallel rank the keys arrive in blocks, and the softmax needs the sum over all of them; it can still
# start at the first block, because the sum can be carried along unnormalised. Keep per query, over the blocks seen so
# far, the largest score $m$, the sum $l = \sum_j e^{s_j - m}$ and the unnormalised output $o = \sum_j e^{s_j - m} v_j$;
# then $y = o / l$ exactly. A new block with scores $s_b$ and values $V_b$:
#
# 1. its maximum may be larger: $m' = \max(m, \max_j s_{b,j})$;
# 2. the old terms used $e^{s_j - m}$ and need $e^{s_j - m'}$: multiply $l$ and $o$ by $e^{m - m'} \le 1$ (0 before the
#    first block, where $m = -\infty$);
# 3. add the block's terms, $p_b = e^{s_b - m'}$: $l \leftarrow l\,e^{m - m'} + \sum_j p_{b,j}$, $o \leftarrow o\,e^{m -
#    m'} + p_b V_b$, $m \leftarrow m'$.
#
# After the last block, $y = o / l$. Every exponent is $\le 0$, so nothing overflows. The backward needs the
# probabilities again, $p_j = e^{s_j - \mathrm{lse}}$ with $\mathrm{lse} = m + \log l$: one number per query is all the
# ring keeps of the softmax. The softmax's backward, $ds_j = p_j (dp_j - \sum_k p_k\,dp_k)$ with $dp_j = dy \cdot v_j$,
# needs a sum over all keys once more, but $\sum_k p_k\,(dy \cdot v_k) = dy \cdot y$, so $D = dy \cdot y$, known before
# the first block, replaces it. Every block's gradients are then local: $ds = p\,(dp - D)$, $dq \mathrel{+}= ds\,k_b$,
# $dk_b \mathrel{+}= ds^T q$, $dv_b \mathrel{+}= p^T dy$ (the $1/\sqrt{hs}$ aside). That is `Ring.merge` and
# `Ring.grads` (`hsgd/cp/ring.py`). In NumPy, for 4 queries and 64 keys in 8 blocks, against the softmax at once:

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
# The forward's error is rounding: the same sum in another order, while the textbook formula, $e^{800}/e^{800}$, is NaN
# everywhere. The backward's larger error is the rounding of scores near 800 (one unit in the last place of 800 is
# $10^{-13}$) carried into $e^{s - \mathrm{lse}}$. The merge is associative (exercise 3), so the blocks may come in any
# order, as a ring needs.
#
# ## 3. The ring, forward and backward, on 8 ranks
#
# `cp=8` puts all 8 ranks into one `cp_comm`; `cp=4, tp=2` makes two rings of 4, one per tp rank (rank = ((dp_rank pp +
# pp_rank) cp + cp_rank) tp + tp_rank). A rank's positions are `ctx.pos`: with cp = 4 and T = 32 the sequence is cut
# into 8 chunks of c = 4, and rank r holds chunks r and 7 - r (section 4 says why):

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
# With tp the cp ring carries the rank's NH/tp heads only, blocks of $b\,T_l\,C/tp$ numbers. What each scheme sends per
# layer and micro-batch, in (k, v) blocks of $2\,b\,T_l\,(C/tp)\,s$ bytes (`split.cp_formula`):
#
# * ring: each (k, v) block goes round the ring, cp - 1 hops forward and cp - 1 again backward (only lse and the rank's
#   own block are kept), and the (dk, dv) of each block, summed along the way, cp hops back to their owner: $3cp - 2$
#   Isends of a block, and as many Irecvs; the bytes sent per rank are the Isends' payload;
# * all-gather: one All-Gather of (k, v) and one Reduce-Scatter of the gathered (dk, dv), each sending (cp-1)/cp of its
#   cp blocks per rank: $2(cp-1)$ blocks;
# * Ulysses: four all-to-alls, of [q | k | v] and y forward, of dy and [dq | dk | dv] backward, 8 arrays of
#   $b\,T_l\,C/tp$ numbers (4 blocks, the table's payload), of which an all-to-all sends $(cp-1)/cp$: $4(cp-1)/cp$
#   blocks;
# * a2a+p2p (cp 8 = 4 x 2, `split.a2a_sizes`): Ulysses' four all-to-alls in its group of a ranks, $4(a-1)/a$ blocks, and
#   the ring across the r groups, $3r - 2$ Isends of a block of the group's $a T_l$ positions and NH/(tp a) heads, as
#   many numbers as the ring's.
#
# The ring sends $(3cp-2)/(2cp-2)$ times the all-gather's bytes, but holds three blocks (its own and two in transit)
# instead of cp, and overlaps its messages with computation (section 7). Ulysses sends least, below 4 blocks for any cp
# (section 8), but cp must divide the rank's NH/tp heads and NKV/tp kv heads (`split.check_heads`).
#
# ## 4. Load balancing under the causal mask
#
# Query t reads keys 0..t. With the plain split, rank r holding positions $[rT/cp, (r+1)T/cp)$, rank 0 reads one
# triangle of its own keys and the last rank every rank's keys: cp times the work, and every layer waits for it.
#
# hsgd cuts the sequence into 2cp chunks of c = T/(2cp) positions and gives rank r chunks r and 2cp-1-r, one from each
# end (the zig-zag of Megatron-LM; Brandon et al. 2023, "Striped Attention: Faster Ring Attention for Causal
# Transformers", stripe the positions instead). In c x c score blocks not wholly masked, chunk r reads r full blocks and
# one diagonal, chunk 2cp-1-r reads 2cp-1-r and one diagonal: $2cp + 1$ on every rank. `split.attention_blocks(T, cp, r,
# balanced)` counts the scores a rank computes per head and sequence (a diagonal block is computed whole, then masked,
# as in every blockwise kernel), and each `Ring` counts them in `ctx.work`:

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
# The picture shows, for cp 4, which rank computes each score of the $T \times T$ matrix, dark where the mask keeps it
# and pale where a diagonal block is computed and then masked: with the plain split rank 3 owns the widest rows, while
# the balanced layout gives each rank a short row band and a long one. On the right, the scores every rank of cp 8
# computed, measured: a staircase from «16» to «128» against «68» on every rank. The balanced layout also computes fewer
# in all («544» against «576»), its diagonal blocks being half as long.
#
# ## 5. Training with context parallelism, against serial SGD
#
# Each cp rank takes its positions of every sequence (`ctx.local` of the tokens and targets) and their position
# embeddings (`ctx.rows`). Its loss is the mean over its positions, equally many on every cp rank, and the gradients are
# averaged over `dp_comm`, which holds the dp x cp ranks of each parameter shard (parameters are replicated over cp as
# over dp). The check is chapter 10's: a few steps of SGD with momentum in float64 on three layouts of the 8 ranks and
# every scheme (8 heads, so that Ulysses' cp 8 has one head a rank), against `serial.sgd`, each step's traffic against
# `accounting.traffic.step_formula` and the activation bytes against `activation_formula`:

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
# a2a+p2p needs cp = a x r with a, r > 1, so it runs on cp 8 only. The traffic counted covers tp's collectives on rows
# of $T_l$ positions, the pipeline's messages of $b\,T_l\,C$ numbers, the cp scheme's $L \cdot m$ attention exchanges
# and the dp exchange over the dp x cp ranks of each shard; the activation formula counts every term on $T_l$ rows, with
# the cp scheme's attention cache.
#
# ## 6. Ring, all-gather and Ulysses, measured on 8 ranks
#
# The same model with T = 64 on cp 8, one sequence per step, the three schemes side by side (a2a+p2p in section 8): a
# warm-up step each, then 4 rounds in which they take turns, so that whatever else the machine does falls on all of
# them.

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
# The bytes are section 3's per layer, times L. The all-gather already holds more than twice the ring's activations (the
# gathered k and v and the $8 \times 64$ probabilities per head and sequence), and by section 1 about «66 x» as much at
# T = 131072. Ulysses holds between the two («106.5 KiB» against «43.5 KiB» and «134.5 KiB»): the all-gather's
# probabilities, but only its head's k and v. The times are printed, never checked: on two cores the ring's «88»
# point-to-point calls per step, each a Python call and a handshake, cost more than four collectives, and nothing
# computes long enough to hide them. Where a block takes longer than a hop (large blocks on a GPU) the ring hides its
# sends behind the blocks, if the bytes move while the blocks compute.
#
# ## 7. The trace: what moves while the blocks compute
#
# `cp_comm.tracer = tracer` makes every Isend and Irecv a span on the trace's "async" track, from the call to its Wait,
# and the ring's blocks spans on the "compute" track (`hsgd.grid.trace`). An async span under a block says only that a
# message was posted before the block and waited for after it, not that a byte moved meanwhile. The MPI standard
# requires progress only inside MPI calls, and MPICH without a progress thread does no more: it moves a non-blocking
# message only inside MPI calls of the ranks at its two ends (the Isend and Irecv, and any Test or Wait);
# `MPIR_CVAR_ASYNC_PROGRESS=1` adds a background thread to every rank. A ring block is NumPy from start to end, with no
# MPI call.
#
# So `Watched`, hsgd's `Ring` on a wrapper of `cp_comm`, fills every receive buffer with NaN before posting it, notes
# when each Isend returned, and reads the pending receives' buffers at the start and end of every block (no MPI call):
# one NaN at the start and filled at the end moved during the block. One ring forward and backward on cp 8, T = 256,
# runs twice: with an `MPI_Test` (mpi4py's `Request.Testall`) on the pending receives after each of a block's chunk
# pairs, then as hsgd runs it, without, traced:

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
# The picture shows the ring in its code's order where a block outlasts a hop (top), and below what this machine did:
# the median over the ranks of each block's time and the wait after it, and on how many ranks a pending receive moved
# during each block, with and without `MPI_Test`.
#
# Following `Ring.around` and `Ring.attention_backward`, every (k, v) hop is posted before a block and waited for after
# it, and every (dk, dv) hop but the last is received while the next block computes. So where blocks outlast hops and
# bytes move during them, the one exposed transfer is the backward's last (dk, dv) hop, to the owner, with no block left
# behind it. Here neither condition holds: the blocks are short next to the waits, and MPICH moved no byte during a
# block without an MPI call, though the senders had posted many of those messages (the counts printed above); they
# waited for the receiver's next MPI call. With a Test between the chunk pairs the progress engine runs inside the block
# and the posted bytes move there. On CPUs in MPICH a ring overlaps only by polling like this or with a progress thread
# on a core of its own; on a GPU the transfers run on their own stream or copy engine.

# %% [markdown]
# ## 8. Ulysses: an all-to-all to a head split, and the bytes as cp grows
#
# The heads of an attention layer are independent, and only the attention mixes positions. Before the core attention
# each rank cuts its $T_l$ positions of q, k and v into cp head groups of NH/(tp cp) heads and sends group j to cp rank
# j, one `Alltoall` on `cp_comm` (`hsgd.grid.comm.Comm.Alltoall`). Rank r then holds every position of head group r, in
# rank order, and runs the whole causal attention on them with the mask of their global positions: exactly the serial
# attention of those heads. A second all-to-all sends the output back. The backward is the adjoint: an all-to-all is a
# permutation, whose adjoint is its inverse. The picture shows which rank holds which (position, head) of q before and
# after, for cp 4, T = 16 and 8 heads; the check compares rank r's cached q after section 3's first all-to-all on cp 8
# with head r of the serial q:

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
# Ulysses' cp is at most a tp rank's heads, and its all-to-all wants a fast network among all cp ranks; the ring takes
# any cp but sends $3cp - 2$ blocks. Megatron-LM's hierarchical context parallelism (`--cp-comm-type a2a+p2p`,
# `hsgd/cp/hierarchical.py`) combines them, cp = a x r: an all-to-all inside each group of a adjacent cp ranks (one
# node), then ring attention across the r groups on their $a T_l$ positions of NH/(tp a) heads. cp rank c is member c
# mod a of group c // a. hsgd takes r as cp's smallest prime factor (`split.a2a_sizes`; Megatron-LM asks for both,
# `--hierarchical-context-parallel-sizes a r`): cp 8 is 4 x 2.

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
# together, where the ring's and the all-gather's grow with the devices, every rank receiving all T positions' keys and
# values. Measured: one layer's attention, forward and backward, with T = 8 cp on cp 2, 4 and 8 (the 8 ranks as dp 8/cp
# x cp), b = 2, C = 16, 8 heads, each scheme checked against serial attention and `cp_formula`; bytes sent per rank, and
# in (k, v) blocks of $2\,b\,T_l\,C\,s$ = 4 KiB at every cp:

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
# From cp 2 to cp 8 the ring's bytes per rank grow «x 5.50» and the all-gather's «x 7.00», each about linear in cp;
# Ulysses' grow «x 1.75» and never pass its four blocks of send buffers, only the share $(cp - 1)/cp$ that leaves the
# rank growing. So the claim holds as "bounded by a constant", not "equal at every cp": the paper divides an
# all-to-all's aggregate message by the devices, while a rank keeps its own block. a2a+p2p sits between: $4(a-1)/a$
# blocks from its all-to-alls, below 4, and $3r - 2$ from the ring across its r groups, growing only with r; its heads
# need only be divisible by a. With r = 2 a larger cp adds to a, so cp 4 to cp 8 costs it «x 1.17» (on hardware the
# all-to-all group is a node, and r grows with the nodes). Nothing here is timed; section 6's times are what this
# machine can give.
#
# ## Check against serial
#
# Every verdict above is collective over 8 ranks: all four schemes equal serial attention, forward and backward, with
# `cp_formula`'s messages; training on three layouts ends with serial SGD's parameters and losses, with the formulas'
# traffic and activation bytes.

# %%
worst_what, err = check.worst([w for w in check.errors if "serial" in w])
say(f"\nchapter 13: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error against serial "
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
# Brandon et al. give rank r the positions t with t mod cp = r. Count by brute force, for each rank of cp = 2, 4, 8
# (T = 64), the scores the causal mask needs, and check three closed forms, with n = T/cp: plain $n(rn) + n(n+1)/2$,
# zig-zag $2cp\,c^2 + c$ and striped $n(r+1) + cp\,n(n-1)/2$. Then run it: subclass `hsgd.cp.ring.Ring`, set `pos`
# and override `pairs(owner)` (one pair of all my rows and all the owner's, masked by their positions), and check
# its forward and backward against serial on cp 8 and its `work` against $cp\,n^2$.
# (solution: `tutorials/solutions/13_context_parallelism.py`, `exercise_1`)
#
# ### Exercise 2: Ulysses with fewer kv heads than cp
# `split.check_heads` refuses Ulysses when cp does not divide a tp rank's kv heads. When cp is a multiple of them,
# send each head group a copy of the kv head its query heads read and sum the copies' gradients on the way back
# (the adjoint of a copy is a sum): subclass `hsgd.cp.ulysses.Ulysses`, repeating k and v to cp heads before the
# parent's forward and summing dk, dv over the copies after its backward. Check it on cp 8 with NH = 8, NKV = 2
# against serial grouped-query attention, and its all-to-alls against their payload, $2\,b\,T_l\,(C +
# 2\,cp\,hs)\,s$ for q, k, v and $2\,b\,T_l\,C\,s$ for y, each way. Then show that a rank sends less per layer than
# the all-gather of the same kv heads exactly when NH < cp (NKV - 1).
# (solution: `tutorials/solutions/13_context_parallelism.py`, `exercise_2`)
#
# ### Exercise 3: the merge of two partial results is associative
# Write `merge((m1, l1, o1), (m2, l2, o2))` for two disjoint sets of keys, and `finish` = o / l. Check on random
# blocks that merging is commutative and associative (to rounding), that any bracketing of 8 blocks gives the
# softmax at once, and that an empty block (m = -inf, l = 0, o = 0) changes nothing. Then merge normalised outputs
# by their lse, $y = \sigma(\mathrm{lse}_1 - \mathrm{lse}_2)\,y_1 + \sigma(\mathrm{lse}_2 - \mathrm{lse}_1)\,y_2$,
# $\mathrm{lse} = \log(e^{\mathrm{lse}_1} + e^{\mathrm{lse}_2})$, and check it against the same.
# (solution: `tutorials/solutions/13_context_parallelism.py`, `exercise_3`)
#
# ### Exercise 4: where the memory crosses over
# From section 1's terms, write the cp 8 block bytes as $\alpha T$ (ring) and $\beta T + \gamma T^2$ (all-gather),
# find in closed form the smallest T, a multiple of 2cp, from which the all-gather holds at least twice the ring's,
# and check it with a search over `activation_formula`. The same for the T from which the probabilities are more
# than half of a block on one rank.
# (solution: `tutorials/solutions/13_context_parallelism.py`, `exercise_4`)
