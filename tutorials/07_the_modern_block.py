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
# # Chapter 7: the modern block: RMSNorm, rotary positions, SwiGLU, grouped-query and flash attention
#
# Chapters 1 to 6 built and split GPT-2's block (Radford et al. 2019). The models the lecture's section 2 names as
# too big for one node, LLaMA among them, exchange five pieces of it, and hsgd runs both families
# (`--arch gpt2 | llama`, `hsgd.model.config`):
#
# | GPT-2 | the modern block (Llama) | hsgd |
# |---|---|---|
# | LayerNorm, weight and bias | RMSNorm, weight only (Zhang and Sennrich 2019, "Root Mean Square Layer Normalization") | `llama_layers.rmsnorm_*` |
# | a learned table `wpe` added to the input | q and k rotated by their position (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding") | `llama_layers.rope_*` |
# | GELU MLP (fc, proj) | SwiGLU (gate, up, proj; Shazeer 2020, "GLU Variants Improve Transformer") | `llama_layers.swiglu_*` |
# | NH key/value heads | NKV of them, each read by NH/NKV query heads (Ainslie et al. 2023, "GQA") | `llama_layers.repeat_kv_*` |
# | the (T, T) probabilities kept for the backward | blocks and an online softmax, one number kept per query (Dao et al. 2022, "FlashAttention"; Dao 2023, "FlashAttention-2") | `hsgd.model.flash` |
#
# Biases go too (`--no-bias`). Each piece is taken as chapter 1 took GPT-2's: forward, backward derived, a check
# against finite differences or an identity; then the serial Llama model against finite differences and Hugging
# Face's LlamaForCausalLM; then grouped-query attention under tensor parallelism (the lecture's section 3.2, now
# with fewer key/value heads than ranks), and flash attention's memory against the materialized attention's.
#
# Run it with four ranks, one tensor-parallel group (measured on a 2-core machine loaded to a load average of 15:
# 20 s, where chapter 6 took 21 s). Rank 0 draws four pictures into `$HSGD_FIGURES` (default
# `tutorials/figures/`):
#
# mpirun -n 4 python tutorials/07_the_modern_block.py
#
# Legend: B batch, T sequence, C d_model, NH query heads, NKV key/value heads, n_rep = NH/NKV, hs = C/NH head size,
# F d_ff (Hugging Face's intermediate_size), V vocabulary, L layers, N = B*T rows, tp tensor-parallel ranks, i a
# rank, s bytes per number; m, n positions; theta_i the rotary frequency of pair i.

# %%
import json
import os

import numpy as np

from hsgd.model.config import ModelConfig
from hsgd.model import flash, gradcheck, layers, llama_layers, serial
from hsgd.accounting import activations
from hsgd.cp.split import attention_cache_bytes
from hsgd.tp import attention as tp_attention, model as tp_model, shards as tp_shards
from hsgd.grid.process_grid import ProcessGrid
from hsgd.readers import Npz
from hsgd.run.report import fmt_bytes

import pictures                      # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, payload, rel_err, ring_bytes   # tutorials/checks.py, shared by the chapters

TP = 4                                  # one tensor-parallel group of four ranks
TOL = 1e-10                             # float64: parallel and serial differ by rounding, ~1e-16 relative
FD_TOL = 1e-7                           # finite differences of order 4 with h = 1e-4: truncation ~1e-9
# one BLAS thread per rank; four ranks, else a clear exit; check(what, err, tol), check.holds(what, cond),
# check.equal(what, a, b), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, TP, tol=TOL, width=66)
grid = ProcessGrid(world, dp=1, tp=TP)
tp, i = grid.tp_comm, grid.tp_rank      # the tensor-parallel communicator (hsgd.grid.comm.Comm) and my place in it
RANK_COLORS = [f"C{r}" for r in range(TP)]
HERE = os.path.dirname(os.path.abspath(__file__))
rng = np.random.default_rng(0)          # the same seed on every rank: every rank can build the serial reference


def fd(loss, arrays, grads, n=None):
    """The worst disagreement between a backward's gradients and order-4 central differences of loss(), relative
    to each array's largest entry (hsgd.model.gradcheck; n coordinates drawn per array, or all)."""
    return gradcheck.fd_error(loss, arrays, grads, n=n, h=1e-4, order=4, measure="array")


# %% [markdown]
# The parameters of one block in each family (`ModelConfig.param_shapes`).

# %%
shapes = {arch: ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=1, d_ff=24,
                            arch=arch).param_shapes() for arch in ("gpt2", "llama")}
say(f"{'gpt2':<34}{'llama':<34}")
block0 = {arch: [(n, s) for n, s in shapes[arch].items() if n.startswith("h.0.")] for arch in shapes}
for r in range(max(map(len, block0.values()))):
    cells = [f"{block0[arch][r][0]} {block0[arch][r][1]}" if r < len(block0[arch]) else "" for arch in shapes]
    say(f"{cells[0]:<34}{cells[1]:<34}")
cfg1 = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=1, d_ff=24, arch="llama")
C1, K1, F1 = cfg1.d_model, cfg1.kv_width, cfg1.d_ff
block = sum(int(np.prod(s)) for n, s in cfg1.param_shapes().items() if n.startswith("h.0."))
check.equal("llama block's parameters == 2C + 2C^2 + 2CK + 3CF (K = NKV hs)", block,
            2 * C1 + 2 * C1 * C1 + 2 * C1 * K1 + 3 * C1 * F1)

# %% [markdown]
# ## 1. RMSNorm
#
# Over the last axis, with $\mathrm{ms} = \frac{1}{C}\sum_j x_j^2$ and $r = 1/\sqrt{\mathrm{ms} + \epsilon}$:
#
# $$\hat x = x\, r, \qquad y = \hat x \odot w :$$
#
# LayerNorm without the mean and the bias. With $g = \partial L/\partial y \odot w$: $\partial L / \partial w =
# \sum_{rows} \partial L/\partial y \odot \hat x$, and since $\partial r/\partial x_j = -r^3 x_j / C$,
#
# $$\frac{\partial L}{\partial x_j} = r g_j - \frac{r^3 x_j}{C}\sum_i g_i x_i
#   = r\big(g_j - \hat x_j\, \mathrm{mean}(g \odot \hat x)\big).$$
#
# The second term removes $g$'s component along $\hat x$: with $\epsilon = 0$, $y(cx) = y(x)$ for $c > 0$, so
# $x \cdot \partial L/\partial x = 0$; with $\epsilon > 0$, $x \cdot \partial L / \partial x = r\,(g \cdot x)\,
# \epsilon / (\mathrm{ms} + \epsilon)$. Checked below: `rmsnorm_backward` against finite differences of
# $L = \sum y \odot R$, and both identities.

# %%
x = rng.standard_normal((2, 5, 16))                      # (B, T, C)
w = 1.0 + 0.2 * rng.standard_normal(16)                  # (C,) the weight (ones at initialization)
R = rng.standard_normal((2, 5, 16))                      # (B, T, C) a fixed dL/dy
y, c_rms = llama_layers.rmsnorm_forward(x, w)
dw = np.zeros(16)
dx = llama_layers.rmsnorm_backward(R, c_rms, dw)         # (B, T, C), and dw (C,) accumulated
check("RMSNorm: dx, dw vs finite differences", fd(lambda: float(np.sum(llama_layers.rmsnorm_forward(x, w)[0] * R)),
                                                    [x, w], [dx, dw]), FD_TOL)

_, c0 = llama_layers.rmsnorm_forward(x, w, eps=0.0)
dx0 = llama_layers.rmsnorm_backward(R, c0, np.zeros(16))
along = np.abs((x * dx0).sum(-1)) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(dx0, axis=-1))   # (B, T) |cos|
check("RMSNorm, eps = 0: |cos(x, dx)| (x . dx = 0)", float(along.max()), 1e-13)
ms, r = (x * x).mean(-1), c_rms[1][..., 0]                                      # (B, T) mean square, 1/rms
predicted = r * ((R * w) * x).sum(-1) * llama_layers.RMS_EPS / (ms + llama_layers.RMS_EPS)
# x . dx is a sum of terms ~1e5 times larger than it: its rounding, relative to it, is ~1e-11
check("RMSNorm, eps = 1e-5: x . dx == r (g . x) eps / (ms + eps)", rel_err((x * dx).sum(-1), predicted), 1e-8)

# %% [markdown]
# ## 2. Rotary positions
#
# RoPE turns q and k, head by head, by angles that grow with the position. A head's $hs$ coordinates form $hs/2$
# pairs; in Hugging Face's convention (hsgd's) pair $i$ is coordinates $i$ and $i + hs/2$, turned at position $m$
# by $m\,\theta_i$, $\theta_i = \text{base}^{-2i/hs}$ (`rope_theta`: 10000 in Llama 2, 500000 in Llama 3). As a
# complex number $z_i = x_i + \mathrm{i}\, x_{i + hs/2}$ the rotation is $z_i \mapsto z_i e^{\mathrm{i} m
# \theta_i}$; as arrays, `rope_forward` is $y = x \cos a + \mathrm{rotate\_half}(x) \sin a$.
#
# Scores depend on $m - n$ only: $\langle R(m) q, R(n) k\rangle = \langle q, R(n - m) k\rangle$, rotations being
# orthogonal and adding their angles. The backward is the rotation by $-a$. Checked: the complex product, lengths
# kept, the backward as adjoint, and the (T, T) scores of one q and one k at every position constant along each
# diagonal.

# %%
hs, T_r = 16, 64
pos = np.arange(T_r)
cos, sin = llama_layers.rope_angles(pos, hs)                                # (T, hs) each, [cos a, cos a]
theta = llama_layers.rope_frequencies(hs)                                   # (hs/2,) radians per position
q = rng.standard_normal((1, 2, T_r, hs))                                    # (B, NH, T, hs)
qr, c_rope = llama_layers.rope_forward(q, cos, sin)
z = (q[..., :hs // 2] + 1j * q[..., hs // 2:]) * np.exp(1j * pos[:, None] * theta)   # (B, NH, T, hs/2) complex
check("RoPE == the complex product z_i e^{i m theta_i}", rel_err(qr, np.concatenate([z.real, z.imag], -1)))
check("RoPE keeps each head's length", rel_err(np.linalg.norm(qr, axis=-1), np.linalg.norm(q, axis=-1)))
dy = rng.standard_normal(q.shape)
dq = llama_layers.rope_backward(dy, c_rope)
check("RoPE's backward is its adjoint: <dy, R q> == <R^T dy, q>",
      abs(np.sum(dy * qr) - np.sum(dq * q)) / abs(np.sum(dy * qr)))
q1, k1 = rng.standard_normal(hs), rng.standard_normal(hs)                   # one query, one key, at every position
Qm = llama_layers.rope_forward(np.broadcast_to(q1, (T_r, hs)), cos, sin)[0]  # (T, hs) R(m) q
Kn = llama_layers.rope_forward(np.broadcast_to(k1, (T_r, hs)), cos, sin)[0]  # (T, hs) R(n) k
S = Qm @ Kn.T                                                                # (T, T) S[m, n] = <R(m) q, R(n) k>
check("scores <R(m) q, R(n) k> constant along diagonals (m - n)", rel_err(S[1:, 1:], S[:-1, :-1]))
say(f"head size {hs}: theta_i from {theta[0]:.0f} to {theta[-1]:.1e} radians per position; pair 0 turns a full "
    f"circle every {2 * np.pi / theta[0]:.1f} positions, pair {hs // 2 - 1} every {2 * np.pi / theta[-1]:,.0f}")

# %% [markdown]
# Left, the angle $m\theta_i \bmod 2\pi$ of every position and pair (fast pairs wrap many times, slow ones barely
# turn: together they tell near from far); right, pair 1 of one query at positions 0 to 7.

# %%
if rank == 0:
    fig, (ax, ax2) = pictures.figure(10, 3.6, ncols=2, gridspec_kw={"width_ratios": [1.6, 1]})
    im = ax.imshow(np.mod(pos[:, None] * theta, 2 * np.pi).T, aspect="auto", cmap="twilight", origin="lower",
                   interpolation="nearest")
    ax.set_xlabel("position m", fontsize=8)
    ax.set_ylabel("pair i (coordinates i, i + hs/2)", fontsize=8)
    ax.set_title(f"angle m theta_i mod 2 pi, hs = {hs}, base 10000", fontsize=8)
    fig.colorbar(im, ax=ax, label="radians")
    t = np.linspace(0, 2 * np.pi, 200)
    ax2.plot(np.cos(t), np.sin(t), color="0.8", lw=0.8)
    pair = 1
    zp = (q1[pair] + 1j * q1[pair + hs // 2]) * np.exp(1j * np.arange(8) * theta[pair])
    zp = zp / abs(zp)
    for m, zz in enumerate(zp):
        ax2.annotate("", (zz.real, zz.imag), (0, 0), arrowprops=dict(arrowstyle="->", color=f"C{m}"))
        ax2.text(1.12 * zz.real, 1.12 * zz.imag, f"m={m}", fontsize=7, ha="center", va="center")
    ax2.set_aspect("equal")
    ax2.set_xlim(-1.35, 1.35)
    ax2.set_ylim(-1.35, 1.35)
    ax2.axis("off")
    ax2.set_title(f"pair {pair} of q at m = 0..7: turned by m x {theta[pair]:.3f} rad", fontsize=8)
    say(f"picture: {pictures.save(fig, '07_rope_angles')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# ## 3. SwiGLU
#
# $$h = \mathrm{silu}(x W_g) \odot (x W_u), \qquad \text{out} = h W_d, \qquad \mathrm{silu}(u) = u\,\sigma(u).$$
#
# With $g = x W_g$, $u = x W_u$, $dh = d\text{out}\, W_d^\top$, the product rule gives $du = dh \odot
# \mathrm{silu}(g)$, $dg = dh \odot u \odot \mathrm{silu}'(g)$, $\mathrm{silu}'(g) = \sigma(g)(1 + g(1 -
# \sigma(g)))$, and $dx = dg\, W_g^\top + du\, W_u^\top$. Three (C, F) matrices where GELU's MLP has two, so
# Llama takes $F \approx \frac{2}{3} 4C = \frac{8C}{3}$ (rounded up), keeping GPT-2's parameters and FLOPs.
# Checked: `swiglu_mlp_backward` against finite differences, and the count.

# %%
C3, F3 = 12, 32                                                # F = 8C/3
x3 = rng.standard_normal((2, 5, C3))                           # (B, T, C)
Wg, Wu = 0.5 * rng.standard_normal((C3, F3)), 0.5 * rng.standard_normal((C3, F3))   # (C, F) each
Wd = 0.5 * rng.standard_normal((F3, C3))                       # (F, C)
R3 = rng.standard_normal((2, 5, C3))
out3, c_mlp = llama_layers.swiglu_mlp_forward(x3, Wg, Wu, Wd)
dWg, dWu, dWd = np.zeros_like(Wg), np.zeros_like(Wu), np.zeros_like(Wd)
dx3 = llama_layers.swiglu_mlp_backward(R3, c_mlp, dWg, dWu, dWd)
# finite differences run the forward hundreds of times: on rank 0 alone, the others asleep (pictures.on_rank0),
# the error broadcast so that every rank makes the same check
err = pictures.on_rank0(world, lambda: fd(lambda: float(np.sum(llama_layers.swiglu_mlp_forward(x3, Wg, Wu, Wd)[0]
                                                                * R3)), [x3, Wg, Wu, Wd], [dx3, dWg, dWu, dWd], n=24),
                        share=True)
check("SwiGLU MLP: dx, dW_gate, dW_up, dW_down vs finite differences", err, FD_TOL)
check.equal(f"SwiGLU with F = 8C/3 = {F3}: 3CF == GELU's 2C(4C)", 3 * C3 * F3, 2 * C3 * 4 * C3)

# %% [markdown]
# ## 4. Grouped-query attention, and the whole block
#
# With NKV < NH, k and v are (C, NKV hs) and query head j reads kv head $j // n_{rep}$ (`repeat_kv`, Hugging Face's
# order). The repeat is a copy, so its adjoint sums the gradients of the $n_{rep}$ readers. NKV = NH is multi-head
# attention, NKV = 1 multi-query (Shazeer 2019, "Fast Transformer Decoding: One Write-Head is All You Need").
#
# Then the whole Llama model of `hsgd.model.serial`: a few coordinates of every parameter's gradient against
# finite differences of the loss.

# %%
k4 = rng.standard_normal((2, 2, 5, 4))                                     # (B, NKV, T, hs)
rep, c_rep = llama_layers.repeat_kv_forward(k4, 3)                         # (B, NH = 6, T, hs)
d_rep = rng.standard_normal(rep.shape)
check("repeat_kv's backward is its adjoint (the sum over each group)",
      abs(np.sum(d_rep * rep) - np.sum(llama_layers.repeat_kv_backward(d_rep, c_rep) * k4)) / abs(np.sum(d_rep * rep)))

cfg4 = ModelConfig(vocab_size=16, seq_len=6, d_model=16, n_heads=4, n_layers=1, d_ff=24, arch="llama")
p4 = serial.init_params(cfg4, seed=0, dtype="float64")
for name, a in p4.items():              # noise: the norms' weights off one, no gradient trivial
    a += rng.normal(0.0, 0.2 if ".ln" in name or name.startswith("ln_f") else 0.1, a.shape)
idx4, tgt4 = rng.integers(0, 16, (2, 6)), rng.integers(0, 16, (2, 6))
_, g4 = serial.loss_and_grads(p4, idx4, tgt4, cfg4)
names4 = list(p4)
say(f"llama, NH = {cfg4.n_heads}, NKV = {cfg4.n_kv_heads}, {len(names4)} parameters: {', '.join(names4)}")
err = pictures.on_rank0(world, lambda: fd(lambda: serial.loss(p4, idx4, tgt4, cfg4), [p4[n] for n in names4],
                                          [g4[n] for n in names4], n=4), share=True)          # rank 0 alone
check(f"serial llama: all {len(names4)} gradients vs finite differences", err, FD_TOL)

# %% [markdown]
# Finite differences cannot tell a wrong forward; an independent implementation can. `tests/data/hf_llama` holds
# the loss and every gradient of Hugging Face's LlamaForCausalLM in float64 on one batch, for multi-head,
# grouped-query and multi-query attention and a tied head (from `benchmarks/hf_llama_reference.py`, which maps the
# names). hsgd's serial model on the same weights:

# %%
def hf_reference(name):
    """(cfg, params, idx, targets, loss, grads, meta) of tests/data/hf_llama/<name>.npz."""
    path = os.path.join(os.path.dirname(HERE), "tests", "data", "hf_llama", f"{name}.npz")
    with Npz(path, "Hugging Face reference file", ValueError, max_bytes=1 << 20) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        arrays = {member: z[member] for member in z.files}
    params = {n[len("param/"):]: a.astype(np.float64) for n, a in arrays.items() if n.startswith("param/")}
    grads = {n[len("grad/"):]: a for n, a in arrays.items() if n.startswith("grad/")}
    return (ModelConfig(**meta["config"]), params, arrays["idx"], arrays["targets"], float(arrays["loss"]), grads,
            meta)


for name in ("mha", "gqa", "mqa", "gqa_tied"):
    cfg_h, p_h, idx_h, tgt_h, loss_h, grads_h, meta = hf_reference(name)
    loss, grads = serial.loss_and_grads(p_h, idx_h, tgt_h, cfg_h)
    worst = max(float(np.abs(grads[n] - g).max() / np.abs(g).max()) for n, g in grads_h.items())
    say(f"{name:>8}: NKV = {cfg_h.n_kv_heads} of NH = {cfg_h.n_heads}, tied {cfg_h.tied}; Hugging Face loss "
        f"{loss_h:.12f}, hsgd {loss:.12f}")
    check(f"{name}: loss and all {len(grads_h)} gradients vs Hugging Face", max(abs(loss - loss_h) / loss_h, worst),
          1e-12)
say(f"the reference: {meta['model']}; torch {meta['torch']}, transformers {meta['transformers']}")

# %% [markdown]
# ## 5. Grouped-query attention under tensor parallelism
#
# Chapter 6 split by heads; with NKV kv heads two cases arise (`hsgd.tp.model.kv_heads`):
#
# * **split** (tp divides NKV): rank i holds the NKV/tp kv heads its query heads read; nothing else changes
#   (Megatron-LM's rule: tp must divide `num_query_groups`).
# * **replicated** (NKV < tp, tp a multiple of NKV): each rank holds the one kv head its query heads read, tp/NKV
#   ranks the same one. Each holder's backward sees only its query heads' part of dk, dv, so the copies stay equal
#   only after `kv_sum`: one All-Reduce over tp of (N, 2 NKV hs) per block.
#
# GQA saves k and v weights per rank, $2 C \cdot \max(NKV/tp, 1)\, hs$ numbers per block instead of $2C \cdot C/tp$,
# and in inference the key/value cache by the same factor. hsgd's training cache holds k and v after the repeat,
# so the activation bytes do not change with NKV (under context parallelism the kv heads themselves travel:
# chapter 13's cp_comm carries NH/NKV times fewer bytes).
#
# The four cases on tp = 4 with NH = 8: which kv heads each rank holds.

# %%
NH5 = 8
if rank == 0:
    from matplotlib.patches import Rectangle
    fig, axes = pictures.figure(11, 3.4, ncols=4)
    for ax, nkv in zip(axes, (8, 4, 2, 1)):
        cfg_p = ModelConfig(vocab_size=16, seq_len=8, d_model=32, n_heads=NH5, n_layers=1, d_ff=32, arch="llama",
                            n_kv_heads=nkv)
        for r in range(TP):
            x0 = r * 2.6
            ax.add_patch(Rectangle((x0 - 0.15, -0.3), 2.3, 3.1, fc="none", ec=RANK_COLORS[r], lw=1.5))
            ax.text(x0 + 1.0, 2.95, f"rank {r}", ha="center", fontsize=7, color=RANK_COLORS[r])
            n_local, first = tp_model.kv_heads(cfg_p, TP, r)
            for j in range(NH5 // TP):                                       # my query heads
                head = r * NH5 // TP + j
                ax.add_patch(Rectangle((x0 + j * 1.05, 1.7), 0.9, 0.8, fc=RANK_COLORS[r], alpha=0.6))
                ax.text(x0 + j * 1.05 + 0.45, 2.1, f"q{head}", ha="center", va="center", fontsize=6.5)
                g = head // (NH5 // nkv)                                     # the kv head it reads
                gx = x0 + (g - first) * (2.0 / n_local) + 1.0 / n_local
                ax.plot([x0 + j * 1.05 + 0.45, gx], [1.7, 0.9], color="0.4", lw=0.8)
            for g in range(first, first + n_local):                          # my kv heads
                gx = x0 + (g - first) * (2.0 / n_local)
                copy = nkv < TP and r % (TP // nkv) != 0
                ax.add_patch(Rectangle((gx + 0.05, 0.1), 2.0 / n_local - 0.1, 0.8, fc="0.8" if copy else "white",
                                       ec="black", lw=0.8))
                ax.text(gx + 1.0 / n_local, 0.5, f"kv{g}" + ("\ncopy" if copy else ""), ha="center", va="center",
                        fontsize=6.5)
        if nkv < TP:
            ax.text(TP * 1.3 - 0.2, -0.45, "kv_sum: dk, dv All-Reduced over tp", ha="center", fontsize=7)
        ax.set_title(f"NKV = {nkv}, n_rep = {NH5 // nkv}: {'split' if nkv >= TP else 'replicated'}", fontsize=8)
        ax.set_xlim(-0.4, TP * 2.6)
        ax.set_ylim(-0.7, 3.3)
        ax.axis("off")
    fig.suptitle(f"NH = {NH5} query heads on tp = {TP}: each rank's query heads and the key/value heads it holds "
                 "(grey: a copy of a kv head another rank holds too)",
                 fontsize=9)
    say(f"picture: {pictures.save(fig, '07_gqa_heads_under_tp')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# The four cases, a two-block float64 model, against serial: loss, gradient shards, k and v weight bytes
# (`tp_shards.shard_numel`), communication (`tp_model.comm_formula`, payload and ring bytes), one block's cache
# (`activation_formula`).

# %%
batch, s = 3, 8
rows5 = []
for nkv in (8, 4, 2, 1):
    cfg5 = ModelConfig(vocab_size=16, seq_len=8, d_model=32, n_heads=NH5, n_layers=2, d_ff=32, arch="llama",
                       n_kv_heads=nkv)
    params = serial.init_params(cfg5, seed=0, dtype="float64")
    for a in params.values():
        a += rng.normal(0.0, 0.1, a.shape)
    idx = rng.integers(0, cfg5.vocab_size, (batch, cfg5.seq_len))            # (B, T), the same on every rank
    targets = rng.integers(0, cfg5.vocab_size, (batch, cfg5.seq_len))
    loss_serial, grads_serial = serial.loss_and_grads(params, idx, targets, cfg5)
    local = tp_shards.shard_params(params, i, TP, "megatron", cfg5)          # my shards
    setup = tp_model.TPSetup(cfg5, tp)
    grid.stats.reset()
    loss, grads = tp_model.loss_and_grads(local, idx, targets, setup)
    measured = grid.stats.counts()
    formula = tp_model.comm_formula(cfg5, batch, s, tp=TP)
    errs = {n: rel_err(grads[n], tp_shards.shard(grads_serial[n], n, i, TP, "megatron", cfg5)) for n in grads}
    kv_names = ["h.0.attn.k.weight", "h.0.attn.v.weight"]
    kv_bytes = sum(local[n].nbytes for n in kv_names)
    _, caches = tp_model.forward(local, idx, targets, setup)
    act = activations.activation_bytes(caches.blocks[0], local)
    rule = "split" if nkv >= TP else "replicated"
    check(f"NKV = {nkv} ({rule}): loss and all {len(grads)} gradient shards vs serial",
          max(max(errs.values()), abs(loss - loss_serial) / abs(loss_serial)))
    check.equal(f"NKV = {nkv}: k, v weight bytes per rank == shard_numel x s", kv_bytes,
                tp_shards.shard_numel(cfg5, TP, kv_names) * s)
    check.equal(f"NKV = {nkv}: communication == comm_formula", measured, formula)
    check.equal(f"NKV = {nkv}: one block's cached bytes == activation_formula", act,
                activations.activation_formula(cfg5, batch, s, TP, "megatron")["block"])
    rows5.append((nkv, rule, setup.nkv, kv_bytes, act, payload(measured), float(ring_bytes(measured, TP))))

say(f"\nB = {batch}, T = 8, C = 32, NH = {NH5}, L = 2, float64, tp = {TP}; per rank:")
say(f"{'NKV':>4} {'rule':<11}{'kv heads':>9}{'k,v weights/block':>19}{'block cache':>13}{'payload/step':>14}"
    f"{'ring bytes/step':>17}")
for nkv, rule, n_local, kvb, act, pay, ring in rows5:
    say(f"{nkv:>4} {rule:<11}{n_local:>9}{kvb:>19,}{act:>13,}{pay:>14,}{ring:>17,.0f}")
cfg_r = ModelConfig(vocab_size=16, seq_len=8, d_model=32, n_heads=NH5, n_layers=2, d_ff=32, arch="llama",
                    n_kv_heads=2)
check.equal("NKV = 2 pays NKV = 4's payload + L All-Reduces of (N, 2 NKV hs) (kv_sum)", rows5[2][5] - rows5[1][5],
            cfg_r.n_layers * batch * cfg_r.seq_len * 2 * cfg_r.kv_width * s)

# %% [markdown]
# The k and v weights per rank shrink with NKV until NKV = tp, then stop (a rank holds a whole kv head); the
# replicated cases pay one more All-Reduce per block, $2NKV\,hs$ wide, small next to the two (N, C) All-Reduces each
# way; and the cache is the same in every case. Llama 3 70B (C = 8192, NH = 64, NKV = 8, hs = 128) on tp = 8
# holds one kv head per rank; exercise 3 counts what that saves.
#
# ## 6. Flash attention: blocks and an online softmax
#
# The materialized attention keeps P, (B, NH, T, T), for its backward: at T = 8192 and NH = 64, one sequence's P
# of one layer is 8 GiB in bfloat16 (printed below). Flash attention never forms P. For each query keep a running
# max $m$, sum $l$ and output $o$, and take in key block $b$ (scores $s$) by
#
# $$m' = \max(m, \max_j s_j),\quad p = e^{s - m'},\quad l \leftarrow l\,e^{m - m'} + \textstyle\sum_j p_j,\quad
#   o \leftarrow o\, e^{m - m'} + p\, v_b,\quad m \leftarrow m'$$
#
# (`flash.merge`; chapter 13 derives it). Finally $y = o / l$, and the forward keeps only $\mathrm{lse} = m + \log
# l$ per query, from which the backward recomputes each block's P (`flash.block_grads`). Causality skips the
# blocks above the diagonal. The picture: the (query block, key block) pairs computed at T = 16, blocks of 4, in
# order.

# %%
T6, blk = 16, 4
edges = flash.edges(T6, blk)
pairs = [(qi, kj) for qi, (i0, i1) in enumerate(edges) for kj, _ in enumerate(flash.edges(i1, blk))]
nb = len(edges)
check.equal(f"T = {T6}, blocks of {blk}: pairs computed == nb (nb + 1) / 2, nb = {nb}", len(pairs),
            nb * (nb + 1) // 2)
if rank == 0:
    from matplotlib.patches import Rectangle
    fig, ax = pictures.figure(4.6, 4.4)
    for qi in range(nb):
        for kj in range(nb):
            kind = "masked" if qi == kj else ("computed" if kj < qi else "skipped")
            color = {"computed": "C0", "masked": "C1", "skipped": "0.9"}[kind]
            ax.add_patch(Rectangle((kj * blk, qi * blk), blk, blk, fc=color, ec="white", lw=2))
            if kind != "skipped":
                at = (0.3, 0.75) if kind == "masked" else (0.5, 0.5)           # under the diagonal's mask
                ax.text((kj + at[0]) * blk, (qi + at[1]) * blk, f"{pairs.index((qi, kj)) + 1}", ha="center",
                        va="center", fontsize=9, color="white")
    for t in range(T6):                                  # the masked entries of the diagonal blocks
        ax.add_patch(Rectangle((t + 1, t), (t // blk + 1) * blk - t - 1, 1, fc="0.55", ec="none"))
    ax.set_xlim(0, T6)
    ax.set_ylim(T6, 0)
    ax.set_xlabel("key position (key blocks)", fontsize=8)
    ax.set_ylabel("query position (query blocks)", fontsize=8)
    ax.set_title(f"T = {T6}, blocks of {blk}: {len(pairs)} of {nb * nb} block pairs, in order;\nblue below the "
                 "diagonal, orange on it (grey: masked), light: skipped", fontsize=8)
    say(f"picture: {pictures.save(fig, '07_flash_blocks')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# The same numbers as the materialized attention, forward and backward, with T not a multiple of the block:

# %%
Bf, NHf, hsf, Tf = 2, 3, 4, 50
qf, kf, vf, dyf = (rng.standard_normal((Bf, Tf, NHf * hsf)) for _ in range(4))     # (B, T, C) each
y_m, c_m = layers.attention_forward(qf, kf, vf, NHf)
y_f, c_f = flash.attention_forward(qf, kf, vf, NHf, block=16)
check("flash: y vs materialized (T = 50, blocks of 16)", rel_err(y_f, y_m))
check("flash: dq, dk, dv vs materialized", max(rel_err(a, b) for a, b in zip(
    flash.attention_backward(dyf, c_f, block=16), layers.attention_backward(dyf, c_m))))

# %% [markdown]
# Its memory, measured by `activation_bytes` at growing T (one sequence, NH = 4, hs = 16, float64), against
# `attention_cache_bytes`: materialized, q, k, v and P, $(3NC + B\,NH\,T^2)s$; flash, q, k, v and lse,
# $(3NC + B\,NH\,T)s$ (and y, which the output projection keeps anyway). P is as large as one of q, k, v at
# $T = hs$, and beyond it dominates.

# %%
NHm, hsm = 4, 16
Ts = (16, 32, 64, 128, 256)


def measure(T):
    """The bytes each attention's cache holds beyond its output y, on q, k, v (1, T, NH hs) drawn at random."""
    qm, km, vm = (np.random.default_rng(T).standard_normal((1, T, NHm * hsm)) for _ in range(3))
    y, c_flash = flash.attention_forward(qm, km, vm, NHm)
    return {"materialized": activations.activation_bytes(layers.attention_forward(qm, km, vm, NHm)[1], {}),
            "flash": activations.activation_bytes(c_flash, {"y": y})}   # (the second argument: arrays not counted)


mem = pictures.on_rank0(world, lambda: {T: measure(T) for T in Ts}, share=True)   # rank 0 measures, all check
predicted = {T: {a: attention_cache_bytes(1, "ring", 1, T, NHm * hsm, NHm, 1, s, attention=a)[0]
                 for a in ("materialized", "flash")} for T in Ts}
say(f"{'T':>5}{'materialized':>14}{'flash':>12}{'ratio':>8}")
for T in Ts:
    say(f"{T:>5}{mem[T]['materialized']:>14,}{mem[T]['flash']:>12,}{mem[T]['materialized'] / mem[T]['flash']:>8.1f}")
check.equal(f"attention cache bytes == attention_cache_bytes, T = {Ts[0]} .. {Ts[-1]}", mem, predicted)
grow = {a: mem[Ts[-1]][a] / mem[Ts[-2]][a] for a in ("materialized", "flash")}
say(f"doubling T from {Ts[-2]} to {Ts[-1]}: materialized x {grow['materialized']:.2f}, flash x {grow['flash']:.2f}")
check.holds("doubling T: materialized grows > 3x (towards 4), flash exactly 2x",
            grow["materialized"] > 3.0 and grow["flash"] == 2.0)
p70 = 64 * 8192 * 8192 * 2
say(f"one sequence of T = 8192, NH = 64 (Llama 3 70B), bfloat16: P of one layer {fmt_bytes(p70)}; flash's lse "
    f"{fmt_bytes(64 * 8192 * 2)}")

# %% [markdown]
# On log scales $T^2$ and $T$ are lines of slope 2 and 1.

# %%
if rank == 0:
    fig, ax = pictures.figure(5.5, 3.6)
    for a, style in (("materialized", "o-"), ("flash", "s-")):
        ax.plot(Ts, [mem[T][a] for T in Ts], style, label=a)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(Ts, [str(T) for T in Ts])
    ax.set_xlabel("T", fontsize=8)
    ax.set_ylabel("bytes cached (log scale)", fontsize=8)
    ax.set_title(f"one attention's cache, B = 1, NH = {NHm}, hs = {hsm}, float64 (measured)", fontsize=8)
    ax.legend(fontsize=8, frameon=False)
    say(f"picture: {pictures.save(fig, '07_flash_memory')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# And inside section 5's tensor-parallel Llama model (`--attention flash`: `tp_attention.FLASH` in place of
# `WHOLE`): the same loss and gradient shards, no more communication, and one block's cache against
# `activation_formula(..., attention="flash")` at T = 32.

# %%
cfg7 = ModelConfig(vocab_size=16, seq_len=32, d_model=32, n_heads=NH5, n_layers=2, d_ff=32, arch="llama")
params = serial.init_params(cfg7, seed=0, dtype="float64")
idx = rng.integers(0, cfg7.vocab_size, (batch, cfg7.seq_len))
targets = rng.integers(0, cfg7.vocab_size, (batch, cfg7.seq_len))
loss_serial, grads_serial = serial.loss_and_grads(params, idx, targets, cfg7)
local = tp_shards.shard_params(params, i, TP, "megatron", cfg7)
block_bytes = {}
for attention, ctx in (("materialized", tp_attention.WHOLE), ("flash", tp_attention.FLASH)):
    setup = tp_model.TPSetup(cfg7, tp, ctx=ctx)
    grid.stats.reset()
    loss, grads = tp_model.loss_and_grads(local, idx, targets, setup)
    comm = grid.stats.counts()
    check(f"{attention}: T = {cfg7.seq_len}, loss and all gradient shards vs serial",
          max([rel_err(grads[n], tp_shards.shard(grads_serial[n], n, i, TP, "megatron", cfg7)) for n in grads]
              + [abs(loss - loss_serial) / abs(loss_serial)]))
    check.equal(f"{attention}: communication == comm_formula", comm, tp_model.comm_formula(cfg7, batch, s, tp=TP))
    _, caches = tp_model.forward(local, idx, targets, setup)
    block_bytes[attention] = activations.activation_bytes(caches.blocks[0], local)
    check.equal(f"{attention}: one block's cached bytes == activation_formula", block_bytes[attention],
                activations.activation_formula(cfg7, batch, s, TP, "megatron", attention=attention)["block"])
say(f"T = {cfg7.seq_len}, B = {batch}, NH/tp = {NH5 // TP} heads per rank: one block caches "
    f"{block_bytes['materialized']:,} bytes per rank materialized, {block_bytes['flash']:,} with flash")

# %% [markdown]
# ## What the checks covered
#
# Each layer against finite differences or an identity, the serial model against Hugging Face, GQA and flash
# attention under tp against serial, and their bytes against formulas.

# %%
worst, err = check.worst()
say(f"\nchapter 7: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error "
    f"{err:.1e} ({worst})")
grid.free()

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# Megatron-LM's flags (megatron/training/arguments.py); DeepSpeed trains the model it is given, so its column is
# mostly AutoTP; PyTorch's is torchtitan's Llama 3 (torchtitan/models/llama3/); Hugging Face's is `LlamaConfig`
# and the modules of `LlamaForCausalLM`.
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch (torchtitan's llama3) | Hugging Face transformers | where hsgd differs, on purpose |
# |---|---|---|---|---|---|
# | `--norm rmsnorm` (`llama_layers.rmsnorm_*`, eps `RMS_EPS` = 1e-5), weights `h.{i}.ln1`, `h.{i}.ln2`, `ln_f` | `--normalization RMSNorm`, `--norm-epsilon` | none of its own: the model's | `norm_eps`; `nn.RMSNorm` as `attention_norm`, `ffn_norm`, `norm` | `rms_norm_eps`; `LlamaRMSNorm` as `input_layernorm`, `post_attention_layernorm`, `model.norm` | computes in the input's dtype (Hugging Face casts to float32); eps is not a flag |
# | `--positions rope --rope-theta` (`llama_layers.rope_*`): pair i is coordinates (i, i + hs/2), `rotate_half` | `--position-embedding-type rope`, `--rotary-base` | none of its own: the model's | `rope_theta`; `precompute_freqs_cis`, `apply_rotary_emb` on complex numbers: pairs (2i, 2i + 1), interleaved; plus Llama 3.1's `rope_scaling_args` | `rope_theta`; `rotate_half`, `apply_rotary_pos_emb`: pairs (i, i + hs/2) | Hugging Face's pairs; the interleaved order converts by `rope_half_order` (exercise 2); no long-context rescaling |
# | `--mlp swiglu`: `mlp.gate`, `mlp.up`, `mlp.proj` (C, F), (C, F), (F, C); under tp one product [gate_i \| up_i] | `--swiglu`; `linear_fc1` one linear of 2F outputs, each rank's shard holding its gate and up columns; `--ffn-hidden-size` | AutoTP: `gate_proj`, `up_proj` column-split (`LinearLayer`), `down_proj` a `LinearAllreduce` | `FeedForward`: `w1` (gate), `w3` (up), `w2` (down), F from `multiple_of` and `ffn_dim_multiplier`; `w1`, `w3` `ColwiseParallel`, `w2` `RowwiseParallel` | `intermediate_size`, `hidden_act="silu"`, `mlp.gate_proj`, `up_proj`, `down_proj`, `mlp_bias` | F given directly (`--d-ff`); weights (in, out), the transpose of torch's |
# | `--n-kv-heads` (NKV); `repeat_kv_rows_*`; under tp split, or (NKV < tp) replicated with `kv_sum` | `--group-query-attention --num-query-groups`; `num_query_groups_per_partition = divide(num_query_groups, world_size)`: tp must divide NKV | AutoTP splits q, k, v by kv groups, unequally when tp does not divide them (`get_shard_size`, deepspeed/module_inject/tp_shard.py) | `n_kv_heads`; `repeat_kv`; `attention.wk`, `wv` `ColwiseParallel()`: the kv heads split, so tp must divide n_kv_heads | `num_key_value_heads`; `repeat_kv` | replicates a kv head when NKV < tp, as inference engines do, at one All-Reduce of (N, 2 NKV hs) per block |
# | `--attention flash` (`hsgd.model.flash`; `tp_attention.FLASH`): blocks of 64, online softmax, lse kept | `--use-flash-attn` (newer releases: `--attention-backend flash`) | none of its own in training: the model's attention | `attn_type`: `"sdpa"` (`F.scaled_dot_product_attention`, which picks a flash kernel on GPUs) or `"flex"` | `attn_implementation`: `"flash_attention_2"`, `"sdpa"` or `"eager"` | NumPy: the algorithm and its memory, not the speed |
# | `--no-bias`, `--tied` (`lm_head` = `wte` transposed) | `--disable-bias-linear`, `--untie-embeddings-and-output-weights` (tied by default) | none | no biases; `output` a separate weight | `attention_bias`, `mlp_bias`, `tie_word_embeddings` | the llama preset is untied, as Llama 2 and 3 |
#
# ## Exercises
#
# ### Exercise 1: RMSNorm's backward by hand
# Write $\partial L/\partial x$ of $y = w \odot x / \sqrt{\mathrm{ms}(x) + \epsilon}$ without `llama_layers`;
# check it against finite differences and `rmsnorm_backward`, and that for $\epsilon = 0$ it is orthogonal to
# every row of $x$.
# (solution: `tutorials/solutions/07_the_modern_block.py`, `exercise_1`)
#
# ### Exercise 2: rotary positions in the other order
# RoFormer and Meta's original Llama code (and torchtitan) pair coordinates (2i, 2i + 1). Write that rotation,
# check that its scores depend only on m - n, and that it equals `rope_forward` after permuting each head's
# coordinates by `rope_half_order`: a checkpoint converts by permuting the columns of W_q and W_k, head by head.
# (solution: `tutorials/solutions/07_the_modern_block.py`, `exercise_2`)
#
# ### Exercise 3: Llama 3 70B's key/value bytes on tp = 8
# Llama 3 70B: C = 8192, NH = 64, NKV = 8, L = 80, torchtitan's `ffn_dim_multiplier` = 1.3, `multiple_of` = 4096.
# Check that torchtitan's rule gives F = 28672. With `tp_shards.shard_numel`, count one rank's k and v weights on
# tp = 8 in bfloat16 against multi-head attention's (NKV = 64), and its key/value cache for 8192 tokens. Then
# tp = 16: what stops shrinking, and why?
# (solution: `tutorials/solutions/07_the_modern_block.py`, `exercise_3`)
#
# ### Exercise 4: the online softmax merge of two blocks
# Compute the partial $(m, l, o)$ of each of two key blocks of one attention row, write their merge (each
# rescaled to the larger max), and check it against the full softmax, against `flash.merge`, and in either order.
# Then check that $\mathrm{lse} = m + \log l$ recomputes every probability.
# (solution: `tutorials/solutions/07_the_modern_block.py`, `exercise_4`)
