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
# # Chapter 5: tensor-parallel linear layers
#
# Chapter 4 replicated the model and split the data. When one copy no longer fits on a device, or computes too
# slowly, section 3 of the lecture splits the copy itself over tp workers, "tensor parallelism": every large weight
# matrix is cut by columns or by rows, and the workers talk inside every layer with the collectives of chapter 2.
# This chapter takes the linear layer $Y = XW$ and works out
#
# 1. the two cuts of $W$ and how the pieces add up to the serial result;
# 2. the lecture's scheme (its sections 3.2 and 3.3): column split, All-Gather, and in the backward the adjoint
#    of the All-Gather, a Reduce-Scatter, exact in one case and scaled by $1/tp$ (a free slice) in the other;
# 3. Megatron-LM's conjugate operators $f$ and $g$ (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
#    Parameter Language Models Using Model Parallelism", arXiv:1909.08053): the MLP with one All-Reduce each way;
# 4. the cost of each scheme in two columns, the **payload** (the logical tensor, what `CommStats` records) and
#    the **bytes a ring sends per rank** ($(tp-1)/tp$ of the tensor for an All-Gather or Reduce-Scatter,
#    $2(tp-1)/tp$ for an All-Reduce). A ratio of payloads is not a ratio of bytes on the wire.
#
# Every result is compared with the serial computation. Run with four ranks (measured: about 5 s on a quiet
# 2-core machine, 14 to 27 s under load, mostly Python and MPI start-up and drawing). Rank 0 draws three pictures
# into `$HSGD_FIGURES` (default `tutorials/figures/`):
#
# mpirun -n 4 python tutorials/05_tensor_parallel_linear.py
#
# Legend: B batch, T sequence, C d_model, F d_ff, N = B*T rows, tp tensor-parallel ranks, i (or r) a rank,
# s bytes per number (8: float64). A `/tp` in a shape comment marks the split dimension, e.g. `(C, F/tp)`.

# %%
from fractions import Fraction

import numpy as np

from hsgd.model import layers
from hsgd.tp import layers as tp_layers
from hsgd.grid.process_grid import ProcessGrid

import pictures                      # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, payload, rel_err, ring_bytes   # tutorials/checks.py, shared by the chapters

TP = 4                                  # tensor-parallel size; more ranks than 4 form data-parallel copies
TOL = 1e-12                             # float64 throughout: parallel and serial differ only by rounding
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, TP, tol=TOL, width=60, multiple=True)
grid = ProcessGrid(world, dp=world.Get_size() // TP, tp=TP)
tp, i = grid.tp_comm, grid.tp_rank      # the tensor-parallel communicator (hsgd.grid.comm.Comm) and my place in it
RANK_COLORS = [f"C{r}" for r in range(TP)]  # one colour per tp rank in the pictures (matplotlib's cycle)


def merged(*counts):
    """Several {(comm, op): (calls, bytes)} added up into one."""
    out = {}
    for c in counts:
        for key, (calls, nbytes) in c.items():
            out[key] = (out.get(key, (0, 0))[0] + calls, out.get(key, (0, 0))[1] + nbytes)
    return out


# Every rank draws the *same* full matrices from the same seed and keeps its slice of the weights; the serial
# reference is then computable on every rank without any communication.
rng = np.random.default_rng(0)
B, T, C, F = 2, 3, 8, 32                # F = 4C as in GPT-2; F/tp = 8 columns of F per rank
N = B * T
X = rng.standard_normal((B, T, C))      # (B, T, C) the layer input, replicated on every rank
say(f"{world.Get_size()} ranks; tensor-parallel groups of tp = {TP}; B={B} T={T} C={C} F={F}")

# %% [markdown]
# ## 1. Two ways to cut a weight matrix
#
# Take $Y = XW$ with $X$: (N, C) and $W$: (C, F).
#
# **Column split.** $W = [W_1\ \cdots\ W_{tp}]$, rank $i$ holding $W_i$: (C, F/tp). Column $j$ of $Y$ needs only
# column $j$ of $W$, so
#
# $$Y = X\,[W_1\ \cdots\ W_{tp}] = [XW_1\ \cdots\ XW_{tp}], \qquad Y_i = X W_i \ \text{: (N, F/tp)}.$$
#
# The input is replicated, the output sharded; a bias is cut the same way.
#
# **Row split.** $W = [W_1; \cdots; W_{tp}]$ (here $W$ maps F to C), rank $i$ holding $W_i$: (F/tp, C), and the
# input cut by columns, $X = [X_1 \cdots X_{tp}]$ with $X_i$: (N, F/tp). Block multiplication gives
#
# $$Y = [X_1 \cdots X_{tp}] \begin{bmatrix} W_1 \\ \vdots \\ W_{tp} \end{bmatrix} = \sum_{i=1}^{tp} X_i W_i .$$
#
# Each rank computes a full-sized *partial* product; $Y$ is their sum, an All-Reduce. A bias is added once, after
# the sum (before it, it would count tp times).

# %%
cols = slice(i * F // TP, (i + 1) * F // TP)     # my block of F: columns of a column split, rows of a row split

W_col = rng.standard_normal((C, F))             # (C, F)     full, for the column split
W_row = rng.standard_normal((F, C))             # (F, C)     full, for the row split
H = rng.standard_normal((B, T, F))              # (B, T, F)  full input of the row-split layer

W_col_i = W_col[:, cols]                        # (C, F/tp)  my columns
Y_col_i, _ = layers.linear_forward(X, W_col_i)  # (B, T, F/tp) my block of output columns, no communication
H_i = np.ascontiguousarray(H[..., cols])        # (B, T, F/tp) my block of the input's columns
W_row_i = W_row[cols, :]                        # (F/tp, C)  my rows
Y_row, _ = layers.linear_forward(H_i, W_row_i)  # (B, T, C)  partial product X_i W_i, full-sized

shapes = tp.allgather_obj((i, cols.start, cols.stop, W_col_i.shape, Y_col_i.shape, W_row_i.shape, Y_row.shape))
say("rank  block of F   column split: W_i (C, F/tp)  Y_i (B, T, F/tp)   row split: W_i (F/tp, C)  X_i W_i (B, T, C)")
for r, a, b, sw, sy, rw, ry in shapes:
    say(f"{r:>4}  [{a:>2}, {b:>2})     {str(sw):<20s}  {str(sy):<17s}              {str(rw):<14s}   {ry}")

# %% [markdown]
# The two cuts to scale, one colour per rank: column split on top, row split below.

# %%
if rank == 0:
    from matplotlib.patches import Patch, Rectangle

    def matrix(ax, x, y, rows, ncols, label, split=None, color="0.85"):
        """A (rows, ncols) matrix drawn to scale, top-left corner at (x, y); split=1 cuts it into tp blocks of
        columns, split=0 into tp blocks of rows, block r in rank r's colour."""
        for r in range(TP if split is not None else 1):
            w, h = (ncols / TP, rows) if split == 1 else (ncols, rows / TP) if split == 0 else (ncols, rows)
            x0, y0 = (x + r * w, y) if split == 1 else (x, y - r * h)
            ax.add_patch(Rectangle((x0, y0 - h), w, h, fc=RANK_COLORS[r] if split is not None else color,
                                   ec="black", lw=0.7, alpha=0.85))
        ax.text(x + ncols / 2, y - rows - 1.0, label, ha="center", va="top", fontsize=7)

    fig, (top, bottom) = pictures.figure(9.5, 6.6, nrows=2, gridspec_kw={"height_ratios": [1, 2.3]})
    _, _, _, sw, sy, rw, ry = shapes[0]                         # rank 0's shapes: every rank's are the same
    matrix(top, 0, C, N, C, f"$X$ (N, C) = ({N}, {C})\nreplicated")
    top.text(C + 2, C - N / 2, "x", fontsize=12, ha="center", va="center")
    matrix(top, C + 4, C, C, F, f"$W$ (C, F) = ({C}, {F}), cut by columns:\nrank $i$ holds $W_i$ {sw}", split=1)
    top.text(C + F + 6, C - N / 2, "=", fontsize=12, ha="center", va="center")
    matrix(top, C + F + 8, C, N, F, f"$Y = [XW_0 \\cdots XW_{TP - 1}]$: rank $i$ computes\n$Y_i = XW_i$ {sy}",
           split=1)
    top.set_title("column split: $Y_i = XW_i$, no communication (an All-Gather joins the $Y_i$)", fontsize=8)
    matrix(bottom, 0, F, N, F, f"$X$ (N, F) = ({N}, {F}), cut by columns:\nrank $i$ holds $X_i$ (N, F/tp)",
           split=1)
    bottom.text(F + 2, F - N / 2, "x", fontsize=12, ha="center", va="center")
    matrix(bottom, F + 4, F, F, C, f"$W$ (F, C) = ({F}, {C}),\ncut by rows:\n$W_i$ {rw}", split=0)
    x_sum = F + C + 16                                          # where the partial products start
    bottom.text(F + C + 10, F - N / 2, "= $\\sum_i$", fontsize=10, ha="center", va="center")
    for r in range(TP):                                         # the partial products X_i W_i, full-sized
        x0 = x_sum + r * (C + 2)
        bottom.add_patch(Rectangle((x0, F - N), C, N, fc=RANK_COLORS[r], ec="black", lw=0.7, alpha=0.85))
        bottom.text(x0 + C / 2, F - N - 1.0, f"$X_{r} W_{r}$\n{ry}", ha="center", va="top", fontsize=7)
    bottom.set_title("row split: rank $i$ computes the full-sized partial product $X_i W_i$; an All-Reduce sums "
                     "them", fontsize=8)
    for ax, height in ((top, C), (bottom, F)):
        ax.set_xlim(-1, C + F + 8 + F + 1 if ax is top else x_sum + TP * (C + 2))
        ax.set_ylim(-5.5 if ax is bottom else C - N - 5.5, height + 1)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.legend(handles=[Patch(fc=RANK_COLORS[r], ec="black", label=f"tp rank {r}") for r in range(TP)],
               loc="lower right", ncol=1, fontsize=7, frameon=False)
    say(f"picture: {pictures.save(fig, '05_column_and_row_split')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# For the column split, rank $i$'s block must equal columns $iF/tp \ldots (i+1)F/tp - 1$ of the serial $XW$, and
# after `tp_layers.allgather_forward` (an `Allgather`) every rank holds the whole $Y$. For the row split
# `Allreduce` sums the partial products.

# %%
Y_serial_col = X @ W_col                                    # (B, T, F)
check("column split: Y_i vs block i of serial X W", rel_err(Y_col_i, Y_serial_col[..., cols]))
Y_col = tp_layers.allgather_forward(Y_col_i, tp)            # (B, T, F) Allgather: [Y_1 ... Y_tp]
check("column split: Allgather(Y_i) vs serial X W", rel_err(Y_col, Y_serial_col))

Y_serial_row = H @ W_row                                    # (B, T, C)
partial_err = rel_err(Y_row, Y_serial_row)                  # one partial product alone is far from Y
tp.Allreduce(Y_row)                                         # (B, T, C) in place: sum over i of X_i W_i
check("row split: Allreduce(X_i W_i) vs serial X W", rel_err(Y_row, Y_serial_row))
say(f"  (before the Allreduce, one rank's partial product is off by {partial_err:.0%} of max|Y|)")

# %% [markdown]
# The output of a column split, $Y_i$: (N, F/tp), is exactly the input a row split wants, so a column-split layer
# followed by a row-split one needs no communication in between, nor does anything elementwise between them
# (GELU). Section 3 builds the MLP this way. Something that mixes columns (LayerNorm, a softmax over F) could not
# sit there.

# %% [markdown]
# ## 2. The lecture's scheme: column split, All-Gather, and its adjoint
#
# **Forward** (the lecture's section 3.2): each worker computes $Y_{part} = X W_{part}$ and the workers All-Gather
# the parts, so every worker has the whole $Y$ for the next layer. That is `tp_layers.gather_linear_forward`:
#
# $$Y_i = X A_i + b_i \ \text{: (N, F/tp)}, \qquad Y = \text{AllGather}(Y_1, \ldots, Y_{tp}) \ \text{: (N, F)
# on every rank}.$$

# %%
A = rng.standard_normal((C, F))                 # (C, F)
bA = rng.standard_normal(F)                     # (F,)
A_i, bA_i = A[:, cols], bA[cols]                # (C, F/tp), (F/tp,) my columns

grid.stats.reset()
Y, cache_A = tp_layers.gather_linear_forward(X, A_i, bA_i, tp)      # (B, T, F) Allgather inside
flow = {"forward": grid.stats.counts()}                             # for the picture at the end of section 2
Y_serial, cache_A_serial = layers.linear_forward(X, A, bA)          # (B, T, F)
check("Allgather(X A_i + b_i) vs serial X A + b", rel_err(Y, Y_serial))

# %% [markdown]
# **Backward** (the lecture's section 3.3). Write $D = \partial L / \partial Y$. Three gradients are needed:
#
# * $\partial L/\partial A_i = X^\top\, \partial L/\partial Y_i$ and $\partial L / \partial b_i = \sum_n
#   \partial L / \partial Y_{i,n}$: local once $\partial L / \partial Y_i$ is known;
# * $\partial L / \partial X = \sum_i \partial L/\partial Y_i\, A_i^\top$, since every $Y_i$ depends on all of
#   $X$: each rank computes a partial $dX$ and an **All-Reduce** sums them;
# * and first $\partial L / \partial Y_i$ itself, the backward of the All-Gather.
#
# **The adjoint of All-Gather is Reduce-Scatter.** The All-Gather copies rank $i$'s block into block $i$ of the
# $Y$ on *every* rank, and a value copied to several places receives the sum of its copies' gradients (chapter 1).
# If rank $r$'s computation hands it $D^{(r)}$, the gradient for its copy of $Y$,
#
# $$\frac{\partial L}{\partial Y_i} = \sum_{r=1}^{tp} D^{(r)}_i = \big[\text{ReduceScatter}(D^{(1)}, \ldots,
# D^{(tp)})\big]_i .$$
#
# What the code must do depends on what the $D^{(r)}$ are.
#
# **Case 1: the downstream computation is replicated.** Every rank computes the same thing from the same $Y$ (a
# LayerNorm, a residual, the loss), counted once by the loss, so each rank holds the same complete $D$: tp copies
# of one gradient, not tp contributions. The sum must count it once, a Reduce-Scatter scaled by $1/tp$:
#
# $$\frac{\partial L}{\partial Y_i} = \tfrac{1}{tp}\, \text{ReduceScatter}(D, \ldots, D)_i = D_i ,$$
#
# the rank's own slice of $D$: no communication. Unscaled, it would be $tp \cdot D_i$. `tp_layers.allgather_backward`
# does all three; the probe is $L = \sum Y \odot R$ with the same random $R$ on every rank, so $D = R$:

# %%
R = rng.standard_normal((B, T, F))                              # (B, T, F) dL/dY, the same on every rank

dY_slice = tp_layers.allgather_backward(R, tp)                  # (B, T, F/tp) the local slice, no communication
dY_rs = tp_layers.allgather_backward(R, tp, reduce_scatter=True)             # Reduce_scatter_block, then / tp
dY_rs1 = tp_layers.allgather_backward(R, tp, reduce_scatter=True, scale=1.0)  # Reduce_scatter_block, unscaled

check("replicated: slice D_i vs serial dL/dY_i", rel_err(dY_slice, R[..., cols]))
check("replicated: ReduceScatter / tp vs slice", rel_err(dY_rs, dY_slice))
ratio = dY_rs1 / dY_slice                                       # (B, T, F/tp) elementwise
check("replicated: unscaled ReduceScatter / slice - tp", float(np.max(np.abs(ratio - TP))))
say(f"  unscaled Reduce-Scatter / correct gradient: min {ratio.min():.15g}, max {ratio.max():.15g} (tp = {TP})")

# %% [markdown]
# With the right $\partial L / \partial Y_i$, `gather_linear_backward` accumulates $dA_i \mathrel{+}= X^\top dY_i$
# and $db_i \mathrel{+}= \sum_n dY_i$, and All-Reduces the partial $dX_i = dY_i A_i^\top$; the unscaled
# Reduce-Scatter would make every gradient tp times too large.

# %%
dA_i, dbA_i = np.zeros_like(A_i), np.zeros_like(bA_i)          # (C, F/tp), (F/tp,)
dX = tp_layers.gather_linear_backward(R, cache_A, dA_i, dbA_i, tp)  # (B, T, C) Allreduce of the partial dX

dA, dbA = np.zeros_like(A), np.zeros_like(bA)                   # serial: (C, F), (F,)
dX_serial = layers.linear_backward(R, cache_A_serial, dA, dbA)  # (B, T, C)
check("replicated: dA_i vs block i of serial dA", rel_err(dA_i, dA[:, cols]))
check("replicated: db_i vs block i of serial db", rel_err(dbA_i, dbA[cols]))
check("replicated: Allreduce(dY_i A_i^T) vs serial dX", rel_err(dX, dX_serial))

dA_wrong = np.zeros_like(A_i)
layers.linear_backward(dY_rs1, cache_A, dA_wrong)               # dA_i from the unscaled Reduce-Scatter
check("unscaled: dA_i / serial dA_i - tp", float(np.max(np.abs(dA_wrong / dA[:, cols] - TP))))

# %% [markdown]
# **Case 2: the downstream work is split.** Let the next layer be another gather linear $Z = \text{AllGather}(Y
# B_i)$, $B_i$: (F, C/tp), with $L = \sum Z \odot R_Z$. Rank $r$ computes only $Z_r = Y B_r$, so its gradient for
# the whole $Y$ is its own term,
#
# $$D^{(r)} = \frac{\partial L}{\partial Z_r}\, B_r^\top \ \text{: (N, F)},$$
#
# different on every rank, and $\partial L / \partial Y = \sum_r D^{(r)}$: the plain Reduce-Scatter is the exact
# adjoint.
#
# `tp_layers` (and `tp_model`) take another route to the same $\partial L/\partial Y_i$: All-Reduce the second
# layer's partial $dX$ to the full $\partial L/\partial Y$, then, now in case 1, slice. Both carry the same (N, F)
# payload, but a ring sends $(tp-1)/tp$ of it for the Reduce-Scatter and $2(tp-1)/tp$ for the All-Reduce, which on
# a ring (or with recursive halving and doubling: Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective
# Communication Operations in MPICH") *is* a Reduce-Scatter followed by an All-Gather, whose half is wasted here.

# %%
Bw = rng.standard_normal((F, C))                                # (F, C) the next layer's weight
R_Z = rng.standard_normal((B, T, C))                            # (B, T, C) dL/dZ, the same on every rank
cols_C = slice(i * C // TP, (i + 1) * C // TP)                  # my block of the next layer's C outputs
Bw_i = Bw[:, cols_C]                                            # (F, C/tp)

Z, cache_B = tp_layers.gather_linear_forward(Y, Bw_i, None, tp)                  # (B, T, C) Allgather
dZ_i = tp_layers.allgather_backward(R_Z, tp)                    # (B, T, C/tp) case 1: my slice of R_Z
D_r = layers.linear_backward(dZ_i, cache_B, np.zeros_like(Bw_i))                 # (B, T, F) my partial dL/dY

grid.stats.reset()
dY_i_rs = tp_layers.allgather_backward(D_r, tp, replicated=False)                # (B, T, F/tp) Reduce-Scatter
route_rs = grid.stats.counts()
grid.stats.reset()
D_full = D_r.copy()
tp.Allreduce(D_full)                                            # (B, T, F) the All-Reduce route ...
dY_i_ar = tp_layers.allgather_backward(D_full, tp)              # (B, T, F/tp) ... and then the slice
route_ar = grid.stats.counts()

dY_serial = R_Z @ Bw.T                                          # (B, T, F) serial dL/dY
check("split: ReduceScatter(D^(r)) vs serial dL/dY_i", rel_err(dY_i_rs, dY_serial[..., cols]))
check("split: ReduceScatter vs Allreduce + slice", rel_err(dY_i_rs, dY_i_ar))
say(f"  (taking the slice of my own partial D^(r) without communication would be off by "
    f"{rel_err(D_r[..., cols], dY_serial[..., cols]):.0%}: case 2 needs the sum)")
say(f"{'route to dL/dY_i':<26}{'payload':>10}{'ring, sent per rank':>22}")
for name, counts in (("Reduce-Scatter", route_rs), ("All-Reduce + slice", route_ar)):
    say(f"{name:<26}{payload(counts):>10,}{float(ring_bytes(counts, TP)):>22,.0f}")
check.equal("split: both routes' payload == N*F*8", (payload(route_rs), payload(route_ar)), (N * F * 8,) * 2)
check.equal("split: ring bytes, Reduce-Scatter route == 1/2 All-Reduce's", ring_bytes(route_rs, TP) * 2,
            ring_bytes(route_ar, TP))

# %% [markdown]
# The rest of the first layer's backward is as before; against the serial chain $X \to XA + b \to (XA + b)B$:

# %%
dA_i = np.zeros_like(A_i)
dX_partial = layers.linear_backward(dY_i_rs, cache_A, dA_i)     # (B, T, C) my partial dX = dY_i A_i^T
grid.stats.reset()
tp.Allreduce(dX_partial)                                        # (B, T, C) sum over the tp ranks: the full dX
flow["backward"] = {**route_rs, **grid.stats.counts()}          # Reduce-Scatter of dY, All-Reduce of dX

dA = np.zeros_like(A)
dX_serial = layers.linear_backward(dY_serial, cache_A_serial, dA)                # (B, T, C)
check("split: dA_i vs block i of serial dA", rel_err(dA_i, dA[:, cols]))
check("split: Allreduce(dY_i A_i^T) vs serial dX", rel_err(dX_partial, dX_serial))

# %% [markdown]
# The first layer through the lecture's scheme, one row per rank, with the bytes recorded: forward, each rank's
# block gathered onto every rank; backward (case 2), each rank's partial gradient of the whole $Y$ (hatched), the
# Reduce-Scatter leaving each rank its summed block, and the All-Reduce of the partial $dX$.

# %%
if rank == 0:
    from matplotlib.patches import Rectangle

    def strip(ax, x, y, width, owner, filled, hatched=False, blocks=TP):
        """One rank's copy of a (N, width) tensor as a strip of `blocks` column blocks at (x, y): block b filled
        in rank b's colour (hatched=True: in the colour of the rank `owner` whose partial it is), else empty."""
        w = width / blocks
        for b in range(blocks):
            if b in filled:                                     # a whole, unsplit tensor (blocks=1): grey
                color = RANK_COLORS[owner] if hatched else RANK_COLORS[b] if blocks == TP else "0.45"
                ax.add_patch(Rectangle((x + b * w, y), w, 0.55, fc=color, alpha=0.45 if hatched else 0.85,
                                       hatch="///" if hatched else None, ec="black", lw=0.6))
            else:
                ax.add_patch(Rectangle((x + b * w, y), w, 0.55, fc="white", ec="0.6", lw=0.6, ls=":"))

    def stage(ax, x, title, width, filled_of, hatched=False, blocks=TP):
        for r in range(TP):                                     # rank 0 on top
            strip(ax, x, (TP - 1 - r) * 0.85, width, r, filled_of(r), hatched, blocks)
            if x == 0:
                ax.text(-0.25, (TP - 1 - r) * 0.85 + 0.27, f"rank {r}", ha="right", va="center", fontsize=7)
        ax.text(x + width / 2, TP * 0.85 + 0.05, title, ha="center", va="bottom", fontsize=7)

    def arrow(ax, x0, x1, label):
        ax.annotate("", (x1, TP * 0.85 / 2), (x0, TP * 0.85 / 2), arrowprops=dict(arrowstyle="->", lw=1.3))
        if label:
            ax.text((x0 + x1) / 2, TP * 0.85 / 2 + 0.12, label, ha="center", va="bottom", fontsize=6.5,
                    bbox=dict(fc="white", ec="none", pad=0.5))

    def cost(counts):                                           # "Allgather: payload 1,536 B, ring 1,152 B/rank"
        (_, op), (_, nb) = next(iter(counts.items()))
        return f"{op}\npayload {nb:,} B\nring {float(ring_bytes(counts, TP)):,.0f} B/rank"

    wF, wC = 3.2, 3.2 * C / F                                   # strip widths to scale: F and C columns
    fig, (fwd, bwd) = pictures.figure(10, 5.2, nrows=2)
    everything = set(range(TP))
    stage(fwd, 0, f"$Y_i = XA_i + b_i$\n{Y_col_i.shape} on rank $i$", wF, lambda r: {r})
    arrow(fwd, wF + 0.3, wF + 3.3, cost(flow["forward"]))
    stage(fwd, wF + 3.6, f"$Y = [Y_0 \\cdots Y_{TP - 1}]$\n{Y.shape} on every rank", wF, lambda r: everything)
    fwd.set_title("forward (the lecture's section 3.2): each rank's block of columns, then All-Gather", fontsize=8)
    rs = {k: v for k, v in flow["backward"].items() if k[1] == "Reduce_scatter_block"}
    ar = {k: v for k, v in flow["backward"].items() if k[1] == "Allreduce"}
    stage(bwd, 0, f"$D^{{(r)}} = dZ_r B_r^\\top$, partial\n{D_r.shape} on rank $r$", wF, lambda r: everything,
          hatched=True)
    arrow(bwd, wF + 0.3, wF + 3.3, cost(rs))
    x2 = wF + 3.6
    stage(bwd, x2, f"$dY_i = \\sum_r D^{{(r)}}_i$\n{dY_i_rs.shape} on rank $i$", wF, lambda r: {r})
    stage(bwd, x2 + wF + 1.0, f"$dX_i = dY_i A_i^\\top$,\npartial {dX_partial.shape}", wC, lambda r: {0},
          hatched=True, blocks=1)
    arrow(bwd, x2 + wF + 0.1, x2 + wF + 0.9, "")                 # local: no communication
    arrow(bwd, x2 + wF + wC + 1.3, x2 + wF + wC + 4.3, cost(ar))
    stage(bwd, x2 + wF + wC + 4.6, f"$dX = \\sum_i dX_i$\n{dX_serial.shape} on every rank", wC, lambda r: {0},
          blocks=1)
    for ax in (fwd, bwd):
        ax.set_xlim(-1.2, x2 + wF + wC + 4.6 + wC + 0.6)
        ax.set_ylim(-0.2, TP * 0.85 + 0.75)
        ax.axis("off")
    bwd.set_title("backward (section 3.3, case 2): Reduce-Scatter of the partial dL/dY, then All-Reduce of dX",
                  fontsize=8)
    say(f"picture: {pictures.save(fig, '05_gather_scheme_flow')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# So the lecture's "the backward of the All-Gather is a Reduce-Scatter" is exact when each rank contributes a
# different part of the gradient, and is the free local slice when every rank holds the same gradient. In
# `hsgd.tp.model` ("gather" scheme) every gathered tensor receives its gradient replicated, so the slice runs;
# `reduce_scatter=True` calls the scaled Reduce-Scatter instead (same numbers, more traffic), which the tests use.
# Before a projection, the All-Reduce + slice could be one unscaled Reduce-Scatter (case 2).
#
# ## 3. Megatron's f and g: the MLP with one All-Reduce each way
#
# The lecture's scheme communicates after every linear layer. Megatron-LM (Shoeybi et al. 2019) pairs the two cuts
# of section 1 and names the two places where communication is unavoidable:
#
# | operator | forward | backward | where |
# |---|---|---|---|
# | $f$ | identity | All-Reduce | entry of a column-parallel region: $X$ is replicated, each rank's $dX$ is partial |
# | $g$ | All-Reduce | identity | exit of a row-parallel region: each rank's $Y$ is partial, $dY$ is replicated |
#
# They are *conjugate*, each the other's adjoint: $f$ copies, so its backward sums; $g$ sums, so its backward
# copies. The MLP $\text{GELU}(X W_1 + b_1)\, W_2 + b_2$ becomes
#
# $$X \xrightarrow{f} X \xrightarrow{\text{column}} U_i = XW_{1,i} + b_{1,i} \xrightarrow{\text{GELU}} H_i
# \xrightarrow{\text{row}} H_i W_{2,i} \xrightarrow{g} \sum_i H_i W_{2,i} + b_2 ,$$
#
# with $W_1$ split by columns (C, F/tp), $W_2$ by rows (F/tp, C), $b_1$ split, $b_2$ replicated. The backward runs
# the line right to left; only $f$'s backward communicates, All-Reducing the partial $dX$. In `tp_layers` these are
# `column_linear_forward/backward` ($f$ inside) and `row_linear_forward/backward` ($g$ inside); `CommStats` is read
# after each pass.

# %%
W1 = rng.standard_normal((C, F))                # (C, F)
b1 = rng.standard_normal(F)                     # (F,)
W2 = rng.standard_normal((F, C))                # (F, C)
b2 = rng.standard_normal(C)                     # (C,)
dOut = rng.standard_normal((B, T, C))           # (B, T, C) dL/dMLP(X), the same on every rank (replicated)

W1_i, b1_i = W1[:, cols], b1[cols]              # (C, F/tp), (F/tp,) column-parallel fc
W2_i = W2[cols, :]                              # (F/tp, C)           row-parallel proj; b2 (C,) replicated

grid.stats.reset()
U_i, c_fc = tp_layers.column_linear_forward(X, W1_i, b1_i, tp)       # (B, T, F/tp) f: identity
H_i, c_gelu = layers.gelu_forward(U_i)                               # (B, T, F/tp) elementwise, local
out_mega, c_proj = tp_layers.row_linear_forward(H_i, W2_i, b2, tp)   # (B, T, C)    g: Allreduce
fwd_counts = grid.stats.counts()
say("Megatron MLP, forward:\n" + grid.stats.format())

grid.stats.reset()
mega = {"dW1": np.zeros_like(W1_i), "db1": np.zeros_like(b1_i), "dW2": np.zeros_like(W2_i), "db2": np.zeros_like(b2)}
dH_i = tp_layers.row_linear_backward(dOut, c_proj, mega["dW2"], mega["db2"], tp)     # (B, T, F/tp) g^T: identity
dU_i = layers.gelu_backward(dH_i, c_gelu)                                          # (B, T, F/tp) local
mega["dX"] = tp_layers.column_linear_backward(dU_i, c_fc, mega["dW1"], mega["db1"], tp)  # (B, T, C) f^T: Allreduce
bwd_counts = grid.stats.counts()
say("Megatron MLP, backward:\n" + grid.stats.format())

one = {("tp", "Allreduce"): (1, N * C * 8)}     # one Allreduce of an (N, C) float64 tensor
check.equal("Megatron MLP forward: calls, bytes == (1, N*C*8)", fwd_counts, one)
check.equal("Megatron MLP backward: calls, bytes == (1, N*C*8)", bwd_counts, one)

# %% [markdown]
# The payload is the logical tensor, $N \cdot C \cdot 8 = 384$ bytes; the hidden activation (N, F), four times
# larger, never travels.
#
# ## 4. The lecture's MLP, for comparison
#
# Both linears column-split and gathered, $W_2$ and $b_2$ now split by *columns*, (F, C/tp). GELU is elementwise,
# so the first gather can wait until after it, as in `tp_model`'s "gather" scheme. Forward: All-Gathers of the
# (N, F) hidden activation and the (N, C) output; backward: two free slices (case 1) and two All-Reduces of partial
# $dX$, (N, F) and (N, C).

# %%
W2_ci, b2_ci = W2[:, cols_C], b2[cols_C]                            # (F, C/tp), (C/tp,) column split of proj

grid.stats.reset()
U_i, c_fc_g = layers.linear_forward(X, W1_i, b1_i)                  # (B, T, F/tp) local
H_i, c_gelu_g = layers.gelu_forward(U_i)                            # (B, T, F/tp) local
H = tp_layers.allgather_forward(H_i, tp)                            # (B, T, F)    Allgather
out_gath, c_proj_g = tp_layers.gather_linear_forward(H, W2_ci, b2_ci, tp)  # (B, T, C) Allgather
gath = {"dW1": np.zeros_like(W1_i), "db1": np.zeros_like(b1_i), "dW2": np.zeros_like(W2_ci),
        "db2": np.zeros_like(b2_ci)}
dH = tp_layers.gather_linear_backward(dOut, c_proj_g, gath["dW2"], gath["db2"], tp)  # (B, T, F) Allreduce
dH_i = tp_layers.allgather_backward(dH, tp)                         # (B, T, F/tp) case 1: the slice
dU_i = layers.gelu_backward(dH_i, c_gelu_g)                         # (B, T, F/tp)
gath["dX"] = layers.linear_backward(dU_i, c_fc_g, gath["dW1"], gath["db1"])          # (B, T, C) partial
tp.Allreduce(gath["dX"])                                            # (B, T, C) full dX
gather_counts = grid.stats.counts()
say("the lecture's MLP, forward and backward:\n" + grid.stats.format())

expected = {("tp", "Allgather"): (2, N * (F + C) * 8), ("tp", "Allreduce"): (2, N * (F + C) * 8)}
check.equal("the lecture's MLP: calls, bytes == expected", gather_counts, expected)

# %% [markdown]
# Per MLP forward + backward, with $s$ bytes per number:
#
# | | payload | ring, sent per rank |
# |---|---|---|
# | Megatron | $2NCs$ | $2 \cdot 2\frac{tp-1}{tp} NCs = 4\frac{tp-1}{tp} NCs$ |
# | the lecture's | $2N(F + C)s$ | $\big(\frac{tp-1}{tp} + 2\frac{tp-1}{tp}\big) N(F + C)s = 3\frac{tp-1}{tp} N(F+C)s$ |
# | ratio | $(F + C)/C$ | $3(F + C)/(4C)$ |
#
# Half of the lecture's payload travels in All-Gathers, half the ring price per byte of an All-Reduce, so its
# ratio on the wire is below its ratio of payloads:

# %%
mlp = {"Megatron": merged(fwd_counts, bwd_counts), "the lecture's": gather_counts}   # {(comm, op): (calls, bytes)}
say(f"{'per MLP forward + backward':<28}{'payload (bytes)':>18}{'ring, sent per rank (bytes)':>30}")
for name, counts in mlp.items():
    say(f"{name:<28}{payload(counts):>18,}{float(ring_bytes(counts, TP)):>30,.0f}")
pay_ratio = Fraction(payload(mlp["the lecture's"]), payload(mlp["Megatron"]))
ring_ratio = ring_bytes(mlp["the lecture's"], TP) / ring_bytes(mlp["Megatron"], TP)
say(f"{'ratio, the lecture / Megatron':<28}{float(pay_ratio):>17.2f}x{float(ring_ratio):>29.2f}x")
check.equal("payload ratio == (F + C) / C", pay_ratio, Fraction(F + C, C))
check.equal("ring-bytes ratio == 3 (F + C) / (4 C)", ring_ratio, Fraction(3 * (F + C), 4 * C))

if rank == 0:
    fig, ax = pictures.figure(6, 2.8)
    names = list(mlp)
    xs = np.arange(len(names))
    for k, (label, values) in enumerate((("payload (the logical tensors)", [payload(mlp[n]) for n in names]),
                                         (f"ring: bytes sent per rank, tp = {TP}",
                                          [float(ring_bytes(mlp[n], TP)) for n in names]))):
        bars = ax.bar(xs + (k - 0.5) * 0.38, values, 0.36, label=label, color=["0.55", "C0"][k])
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=7)
    ax.set_xticks(xs, [f"{n} MLP\n({', '.join(f'{c} {op}' for (_, op), (c, _) in mlp[n].items())})"
                       for n in names], fontsize=7)
    ax.set_ylim(0, 1.15 * max(float(ring_bytes(mlp[n], TP)) for n in names))
    ax.set_ylabel("bytes per forward + backward", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.set_title(f"the MLP of sections 3 and 4 (N={N}, C={C}, F={F}, float64): payload ratio "
                 f"{float(pay_ratio):.2f}x, ring ratio {float(ring_ratio):.2f}x", fontsize=8)
    ax.legend(fontsize=7, frameon=False)
    say(f"picture: {pictures.save(fig, '05_mlp_bytes')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# With $F = 4C$ the lecture's scheme carries 5 times Megatron's payload, in four collectives instead of two, and
# sends 3.75 times the ring bytes, whatever tp is. What it buys is simplicity: every layer's output is complete on
# every rank, so any layer can follow any other. Megatron's pairing needs a column split followed by a row split,
# the shape of a Transformer's MLP and, as chapter 6 shows, of its attention.
#
# ## Check against serial
#
# Both MLPs against `hsgd.model.layers`: the output, $dX$, and every rank's shard of the parameter gradients, cut
# the way that scheme cuts the parameter (Megatron: $W_2$ by rows, $b_2$ whole; the lecture's: both by columns).

# %%
U, c_fc_s = layers.linear_forward(X, W1, b1)                        # (B, T, F)
Hs, c_gelu_s = layers.gelu_forward(U)                               # (B, T, F)
out_serial, c_proj_s = layers.linear_forward(Hs, W2, b2)            # (B, T, C)
ser = {"dW1": np.zeros_like(W1), "db1": np.zeros_like(b1), "dW2": np.zeros_like(W2), "db2": np.zeros_like(b2)}
dHs = layers.linear_backward(dOut, c_proj_s, ser["dW2"], ser["db2"])
ser["dX"] = layers.linear_backward(layers.gelu_backward(dHs, c_gelu_s), c_fc_s, ser["dW1"], ser["db1"])

shard_of = {"megatron": {"dX": ser["dX"], "dW1": ser["dW1"][:, cols], "db1": ser["db1"][cols],
                         "dW2": ser["dW2"][cols, :], "db2": ser["db2"]},
            "gather": {"dX": ser["dX"], "dW1": ser["dW1"][:, cols], "db1": ser["db1"][cols],
                       "dW2": ser["dW2"][:, cols_C], "db2": ser["db2"][cols_C]}}
for scheme, out, grads in (("megatron", out_mega, mega), ("gather", out_gath, gath)):
    check(f"{scheme} MLP: output vs serial", rel_err(out, out_serial))
    check(f"{scheme} MLP: dX and dW1, db1, dW2, db2 shards vs serial",
          max(rel_err(grads[name], shard_of[scheme][name]) for name in grads))

worst, err = check.worst()
say(f"chapter 5: all {len(check.passed)} checks passed on {world.Get_size()} ranks; largest error {err:.1e} "
    f"({worst}), tolerance {TOL:.0e}")
grid.free()

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# The frameworks store an `nn.Linear` weight as (out, in) and compute $XW^\top$, so their column split cuts axis 0
# and their row split axis 1; hsgd stores $W$ as (in, out), as the lecture's $Y = XW$, and cuts axis 1 and axis 0.
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | `tp_layers.f_forward` / `f_backward`: identity, backward All-Reduce | `copy_to_tensor_model_parallel_region` (megatron/core/tensor_parallel/mappings.py); inside `ColumnParallelLinear` the backward All-Reduce runs in the linear's own backward (`allreduce_dgrad`, layers.py), overlapped with the weight-gradient product | `ColumnParallel` autograd function (deepspeed/module_inject/layers.py); `AsyncColumnParallel` overlaps the All-Reduce with the weight gradient | no named operator: `ColwiseParallel` makes the input a `Replicate()` DTensor, and `DTensor.from_local`'s backward turns the partial input gradient into a replicated one (an All-Reduce) | a plain function pair with no autograd and no overlap: every collective is seen at its call site |
# | `tp_layers.g_forward` / `g_backward`: All-Reduce, backward identity | `reduce_from_tensor_model_parallel_region` (mappings.py) | `RowParallel` autograd function (layers.py) | `RowwiseParallel`'s default `output_layouts=Replicate()`: the partial output is All-Reduced | same |
# | `column_linear_forward` / `_backward`: $W_i$ (C, F/tp), output split | `ColumnParallelLinear(..., gather_output=False)` (megatron/core/tensor_parallel/layers.py) | `LinearLayer` (layers.py), chosen by `AutoTP` (deepspeed/module_inject/auto_tp.py) | `ColwiseParallel()` on an `nn.Linear` (torch/distributed/tensor/parallel/style.py): weight and bias `Shard(0)` | (in, out) storage, as the lecture's $Y = XW$ |
# | `row_linear_forward` / `_backward`: $W_i$ (F/tp, C), bias added once after the sum | `RowParallelLinear(..., input_is_parallel=True)`: bias added after `reduce_from_tensor_model_parallel_region` | `LinearAllreduce`: weight split, bias replicated and added after the All-Reduce | `RowwiseParallel()`: weight `Shard(1)`, bias `Replicate()` | - |
# | `gather_linear_forward`, `allgather_forward`: the lecture's All-Gather of the output | `ColumnParallelLinear(..., gather_output=True)`, which calls `gather_from_tensor_model_parallel_region` | `LinearLayer(..., gather_output=True)`, which calls `GatherFromTensorParallelRegion` | `ColwiseParallel(output_layouts=Replicate())` | none: the frameworks offer the gather but build GPTs with Megatron's pairing (section 3); hsgd keeps the lecture's scheme runnable to compare |
# | `allgather_backward(replicated=True)`: case 1, the slice | `gather_from_tensor_model_parallel_region`'s backward is `_split_along_last_dim` (a slice); `gather_from_sequence_parallel_region(..., tensor_parallel_output_grad=False)` slices along the first dimension | `GatherFromTensorParallelRegion`'s backward: `narrow`, a slice | a `Replicate()` gradient redistributed back to `Shard(-1)` (`Redistribute.backward`, torch/distributed/tensor/_redistribute.py): a local chunk | hsgd can also pay for the $1/tp$-scaled Reduce-Scatter (`reduce_scatter=True`), to show that both give the same numbers |
# | `allgather_backward(replicated=False)`: case 2, the Reduce-Scatter | `all_gather_last_dim_from_tensor_parallel_region` (backward `_reduce_scatter_along_last_dim`); `gather_from_sequence_parallel_region(..., tensor_parallel_output_grad=True)` (the default: Reduce-Scatter along the first dimension) | none | a `Partial` gradient redistributed to `Shard(-1)`: a reduce-scatter | one function with a flag that names the case, where Megatron has one operator per case |
# | none: a rank slices its block of a replicated input directly (`H[..., cols]`) | `scatter_to_tensor_model_parallel_region` (forward split, backward All-Gather), used by `RowParallelLinear(..., input_is_parallel=False)` | none | `RowwiseParallel(input_layouts=Replicate())` | hsgd's models never feed a replicated activation to a row-parallel layer |
# | `CommStats`: calls and payload bytes per (communicator, operation) | none | `deepspeed.comm`'s `comms_logger` records message sizes; `calc_bw_log` (deepspeed/utils/comms_logging.py) turns them into a "bus bandwidth" with this chapter's ring factors | `CommDebugMode` (torch.distributed.tensor.debug) counts the collectives, not their bytes | hsgd counts every payload byte to check it against a formula, and converts to ring bytes in the open (`ring_bytes`) |
#
# ## Exercises
#
# ### Exercise 1: the gather's backward with one Reduce-Scatter
# Write the All-Gather's backward with one `tp.Reduce_scatter_block` (its `full` argument is (tp, ...), block r
# to rank r), without `tp_layers.allgather_backward`. Check it in case 2 (section 2's chain of two gather linears)
# against the serial block of $\partial L / \partial Y$; then write case 1 as the slice, check it too, and show
# that the unscaled Reduce-Scatter of a replicated gradient is exactly tp times too large.
# (solution: `tutorials/solutions/05_tensor_parallel_linear.py`, `exercise_1`)
#
# ### Exercise 2: a row-parallel layer with its bias added once
# Write `row_forward(X_i, W_i, b, comm)` and `row_backward(dY, cache, dW_i, db, comm)` for $Y = \sum_i X_i W_i
# + b$ with a replicated bias, and check $Y$, $dX_i$, $dW_i$ and $db$ against the serial layer. Then add the
# bias *before* the All-Reduce and check that the output is off by exactly $(tp - 1)\,b$. Why is $db$ the same on
# every rank without any communication? Check that it is, bit for bit.
# (solution: `tutorials/solutions/05_tensor_parallel_linear.py`, `exercise_2`)
#
# ### Exercise 3: the MLP with your own f and g, its bytes against a formula
# Write $f$ and $g$ with `comm.Allreduce`, build section 3's MLP with them, and run it on tp = 1, 2 and 4 (a
# `ProcessGrid(world, dp=4 // tp, tp=tp)` each). Check the output and $dX$ against serial, the payload against
# $2NCs$ and the ring bytes per rank against $4\frac{tp-1}{tp}NCs$. Then check, with section 4's MLP, that the
# ratio of ring bytes is $3(F + C)/(4C)$ for every tp > 1 while that of payloads is $(F + C)/C$.
# (solution: `tutorials/solutions/05_tensor_parallel_linear.py`, `exercise_3`)
