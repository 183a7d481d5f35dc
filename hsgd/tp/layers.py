"""Tensor-parallel layers: forward/backward pairs with their communication written out.

M = tp ranks hold one copy of the model between them. `comm` is the tensor-parallel communicator (hsgd.grid.comm.Comm).
Legend: B batch, T sequence, C d_model, F d_ff, V vocab, Vp = ceil(V / tp) vocabulary rows per rank, N = B*T rows,
tp ranks; a dimension divided by tp is this rank's share of it.

Megatron's conjugate operators (Shoeybi et al. 2019, arXiv:1909.08053):
    f: forward identity,  backward Allreduce      (enters a column-parallel region: x is replicated, dx partial)
    g: forward Allreduce, backward identity       (leaves a row-parallel region: y is partial, dy replicated)
Column-parallel linear  Y = X A,  A = [A_1 ... A_tp] split by output columns: rank i computes Y_i = X A_i.
Row-parallel linear     Y = X B,  B = [B_1; ...; B_tp] split by input rows, X = [X_1 ... X_tp]: rank i computes
                        the partial product X_i B_i; g sums them; the bias is added once, after the sum.

The lecture's scheme: every linear column-split, its output gathered, Y = [Y_1 ... Y_tp] = Allgather(Y_i).
The adjoint of Allgather is Reduce-scatter: if rank r's loss term gives it the gradient D^(r) with respect to
the whole gathered Y, then dL/dY_i = sum_r D^(r)_i, which is exactly Reduce_scatter(D). That is the case when
the downstream work is split between ranks (each rank's D^(r) is a different partial gradient). When the
downstream computation is *replicated* (every rank computes the same thing from the same full Y, and the loss
counts it once), every rank already holds the same, complete D = dL/dY, and Reduce_scatter would return
tp * D_i: it must be scaled by 1/tp, which is the local slice D_i, with no communication at all.

The pair along T of sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198; the paper's g and g-bar).
Rank r holds the T-shard X^s_r, positions [r T/tp, (r+1) T/tp):
    gather_T:   forward All-Gather along T      (B, T/tp, C) -> (B, T, C)          backward Reduce-Scatter along T
    scatter_T:  forward Reduce-Scatter along T  (B, T, C) partial -> (B, T/tp, C)  backward All-Gather along T
After gather_T every rank holds the whole X = [X^s_0; ...; X^s_tp-1] but uses it for its own columns, so its
dL/dX is partial and dL/dX^s_i = sum_r (dL/dX^(r))_i: a Reduce-Scatter. scatter_T hands the sum's row block i to
rank i, so every rank needs all of dL/dY: an All-Gather. scatter_T then gather_T moves the bytes of one Allreduce.
"""
import math

from mpi4py import MPI

from hsgd.model.backend import array_module, scatter_add
from hsgd.model.ops import linear_backward, linear_forward

# ------------------------------------------------------------------------------------------------ f and g

def f_forward(x, comm):
    """f, forward: identity. x (replicated) enters a column-parallel region."""
    return x


def payload(x, comm):
    """The partial sums a collective is about to add, as they travel: rounded in place when the communicator
    carries a narrower format (comm.payload_round, set by a bfloat16 or float16 stage: hsgd.model.precision's
    "payload"); x untouched otherwise."""
    rnd = getattr(comm, "payload_round", None)
    return rnd(x) if rnd is not None else x


def f_backward(dx, comm):
    """f, backward: each rank holds a partial dx (its columns' contribution); Allreduce sums them."""
    comm.Allreduce(payload(dx, comm))                   # (N, C) sum over tp ranks: partial dx -> full dx
    return dx


def g_forward(y, comm):
    """g, forward: each rank holds a partial y (its rows' product); Allreduce sums them."""
    comm.Allreduce(payload(y, comm))                    # (N, C) sum over tp ranks: partial y -> full y
    return y


def g_backward(dy, comm):
    """g, backward: identity. dy is replicated."""
    return dy


# ------------------------------------------------------------------------------------------------ Megatron linears

def column_linear_forward(x, W_part, b_part, comm):
    """Y_i = f(X) A_i + b_i.  x (..., C) replicated, W_part (C, Cout/tp), b_part (Cout/tp,). Output is sharded."""
    return linear_forward(f_forward(x, comm), W_part, b_part)


def column_linear_backward(dy_part, cache, dW_part, db_part, comm):
    """dA_i += X^T dY_i; db_i += sum dY_i; dX = f^T(dY_i A_i^T) = Allreduce of the partial dX."""
    dx_partial = linear_backward(dy_part, cache, dW_part, db_part)      # (..., C) this rank's share of dX
    return f_backward(dx_partial, comm)


def row_linear_forward(x_part, W_part, b, comm):
    """Y = g(X_i B_i) + b.  x_part (..., Cin/tp), W_part (Cin/tp, C), b (C,) replicated. Output replicated."""
    y, cache = linear_forward(x_part, W_part)          # (..., C) partial product
    y = g_forward(y, comm)                              # Allreduce
    y += b                                              # added once, after the sum
    return y, cache


def row_linear_backward(dy, cache, dW_part, db, comm):
    """dB_i += X_i^T dY; db += sum dY (the same on every rank); dX_i = dY B_i^T (no communication)."""
    dy = g_backward(dy, comm)
    db += dy.reshape(-1, dy.shape[-1]).sum(axis=0)
    return linear_backward(dy, cache, dW_part)


# ------------------------------------------------------------------------------------------ the lecture's gather

def allgather_forward(y_part, comm):
    """Y = [Y_1 ... Y_tp] along the last axis: every rank gets the whole Y. y_part (..., c) -> (..., tp*c)."""
    xp = array_module(y_part)
    lead, c = y_part.shape[:-1], y_part.shape[-1]
    part = xp.ascontiguousarray(y_part).reshape(-1, c)                   # (N, c)
    out = xp.empty((comm.size, part.shape[0], c), dtype=part.dtype)     # (tp, N, c)
    comm.Allgather(part, out)                                           # out[r] = Y_r
    return out.transpose(1, 0, 2).reshape(*lead, comm.size * c)         # (..., tp*c)


def allgather_backward(dy, comm, replicated=True, reduce_scatter=False, scale=None):
    """dY_i from the gradient with respect to the gathered Y. dy (..., tp*c) -> (..., c).

    replicated=True: every rank holds the same complete dL/dY (the downstream computation was replicated).
        reduce_scatter=False: take the local slice (what a Reduce-scatter scaled by 1/tp returns), no communication.
        reduce_scatter=True:  call Reduce_scatter_block and scale by `scale` (default 1/tp): the same numbers, paid
                              for with communication; scale=1 shows the error (exactly tp times too large).
    replicated=False: each rank holds a different partial gradient; Reduce_scatter_block (sum) is the exact adjoint.
    """
    xp = array_module(dy)
    tp, rank = comm.size, comm.rank
    lead, c = dy.shape[:-1], dy.shape[-1] // tp
    if replicated and not reduce_scatter:
        return xp.ascontiguousarray(dy[..., rank * c:(rank + 1) * c])    # (..., c) the local slice
    full = xp.ascontiguousarray(dy.reshape(-1, tp, c).transpose(1, 0, 2))  # (tp, N, c) block r -> rank r
    out = xp.empty(full.shape[1:], dtype=dy.dtype)                       # (N, c)
    comm.Reduce_scatter_block(payload(full, comm), out)                  # out = sum over ranks of full[rank]
    if replicated:
        out *= (1.0 / tp) if scale is None else scale
    return out.reshape(*lead, c)


def gather_linear_forward(x, W_part, b_part, comm, linear=linear_forward):
    """The lecture's column-parallel linear: Y_i = X A_i + b_i, then Y = Allgather(Y_i). All replicated. linear:
    the product's function (an FP8 run's: hsgd.fp8.linear)."""
    y_part, cache = linear(x, W_part, b_part)                            # (..., Cout/tp)
    return allgather_forward(y_part, comm), cache


def gather_linear_backward(dy, cache, dW_part, db_part, comm, reduce_scatter=False):
    """dY_i = adjoint of the gather; dA_i += X^T dY_i; dX = Allreduce of the partial dY_i A_i^T."""
    dy_part = allgather_backward(dy, comm, replicated=True, reduce_scatter=reduce_scatter)
    dx_partial = linear_backward(dy_part, cache, dW_part, db_part)
    comm.Allreduce(payload(dx_partial, comm))                            # (..., Cin) partial -> full dX
    return dx_partial


# ------------------------------------------------------------------------------------------ gather_T and scatter_T

def gather_T_forward(x_s, comm):
    """gather_T, forward: All-Gather along T. x^s (B, T/tp, C) -> (B, T, C), rank r's rows at [r T/tp, (r+1) T/tp)."""
    xp = array_module(x_s)
    B, Tl, C = x_s.shape
    out = xp.empty((comm.size, B, Tl, C), dtype=x_s.dtype)             # (tp, B, T/tp, C) block r from rank r
    comm.Allgather(xp.ascontiguousarray(x_s), out)                     # out[r] = x^s of rank r
    return out.transpose(1, 0, 2, 3).reshape(B, comm.size * Tl, C)     # (B, T, C) copy, blocks along T


def gather_T_backward(dx, comm):
    """gather_T, backward: dX (B, T, C) is partial on every rank (its columns' share); Reduce-Scatter along T sums
    it and keeps this rank's rows (B, T/tp, C)."""
    return scatter_T_forward(dx, comm)


def scatter_T_forward(y, comm):
    """scatter_T, forward: Reduce-Scatter along T. y (B, T, C), a different partial sum on every rank ->
    (B, T/tp, C): this rank's rows of the sum."""
    xp = array_module(y)
    B, T, C = y.shape
    Tl = T // comm.size
    full = xp.ascontiguousarray(y.reshape(B, comm.size, Tl, C).transpose(1, 0, 2, 3))   # (tp, B, T/tp, C)
    out = xp.empty((B, Tl, C), dtype=y.dtype)                          # (B, T/tp, C)
    comm.Reduce_scatter_block(payload(full, comm), out)                # out = sum over ranks of full[rank]
    return out


def scatter_T_backward(dy_s, comm):
    """scatter_T, backward: every rank needs the whole dY for its share of the partial sum: All-Gather along T of
    the T-shards dY^s (B, T/tp, C) -> (B, T, C)."""
    return gather_T_forward(dy_s, comm)


# ------------------------------------------------------------------------------------------------ vocab-parallel

def vocab_range(V, tp, rank):
    """Rank `rank` owns vocabulary ids [start, start + Vp); the last rank's range may run past V (padding)."""
    Vp = math.ceil(V / tp)
    return rank * Vp, Vp


def vocab_lookup_forward(idx, wte_part, start):
    """wte[idx] restricted to this rank's rows: the rows of the tokens in [start, start + Vp), zeros for the others.
    idx (B, T) -> (B, T, C), a partial sum over the tp ranks (each token's row comes from its owner alone)."""
    xp = array_module(wte_part)
    Vp = wte_part.shape[0]
    local = idx - start                                                  # (B, T) ids relative to the shard
    mine = (local >= 0) & (local < Vp)                                   # (B, T) tokens this rank owns
    local = xp.where(mine, local, 0)
    x = wte_part[local]                                                  # (B, T, C) gather (a copy)
    x *= mine[..., None]                                                 # zero the rows owned elsewhere
    return x, (local, mine)


def vocab_lookup_backward(dx, cache, dwte_part):
    """dwte rows of this rank's tokens from the whole dx (B, T, C): no communication."""
    local, mine = cache
    # rows owned elsewhere add zeros (to row 0): no boolean indexing, which would cost a device-host sync on GPUs
    scatter_add(dwte_part, local.reshape(-1), (dx * mine[..., None]).reshape(-1, dx.shape[-1]))


def vocab_embedding_forward(idx, wte_part, wpe, start, comm):
    """Megatron's embedding in one call: x = wte[idx] + wpe[:T], wte split by rows; each rank looks up its own
    tokens and an Allreduce assembles the rows. (hsgd.tp.model writes it as the lookup and its scheme's exit.)"""
    x, cache = vocab_lookup_forward(idx, wte_part, start)               # (B, T, C) partial
    comm.Allreduce(x)                                                    # (B, T, C) each row from its owner
    x += wpe[:idx.shape[1]]
    return x, cache


def vocab_embedding_backward(dx, cache, dwte_part, dwpe):
    """dwte rows of this rank's tokens (dx is replicated: no communication); dwpe as in the serial layer."""
    dwpe[:dx.shape[1]] += dx.sum(axis=0)
    vocab_lookup_backward(dx, cache, dwte_part)


def vocab_cross_entropy_forward(logits_part, targets, start, V, comm):
    """Mean softmax cross-entropy over all N positions, with the logits split by vocabulary columns.

    Never gathers the (N, V) logits. Per row: m = max over all ranks (Allreduce MAX), s = sum over ranks of
    sum exp(z - m), and the target logit z_t, which only its owner holds (both in one Allreduce SUM):
        loss = mean(log s - (z_t - m)).  Columns past V (padding of the last rank) count as -inf.
    """
    xp = array_module(logits_part)
    Vp = logits_part.shape[-1]
    z = logits_part.reshape(-1, Vp).copy()                               # (N, Vp)
    N = z.shape[0]
    if start + Vp > V:
        z[:, max(V - start, 0):] = -xp.inf                               # padded columns
    m = z.max(axis=1)                                                    # (N,) local max
    comm.Allreduce(m, op=MPI.MAX)                                     # (N,) global max
    z -= m[:, None]
    tgt = targets.reshape(-1) - start                                    # (N,) target column in this shard
    mine = (tgt >= 0) & (tgt < Vp)
    rows = xp.arange(N)
    both = xp.zeros((2, N), dtype=z.dtype)                               # [sum exp, target logit]
    both[1] = xp.where(mine, z[rows, xp.where(mine, tgt, 0)], 0.0)
    xp.exp(z, out=z)                                                     # z now holds exp(z - m)
    both[0] = z.sum(axis=1)
    comm.Allreduce(both)                                                 # (2, N) sums over tp ranks
    loss = (xp.log(both[0]) - both[1]).mean()
    z /= both[0][:, None]                                                # local columns of the softmax
    return loss, (z, tgt, mine, rows, logits_part.shape)


def vocab_cross_entropy_backward(dloss, cache):
    """dlogits_i = dloss * (softmax_i - onehot_i) / N on the local columns: no communication."""
    probs, tgt, mine, rows, shape = cache
    xp = array_module(probs)
    N = probs.shape[0]
    dz = probs * (dloss / N)                                             # (N, Vp)
    dz[rows, xp.where(mine, tgt, 0)] -= (dloss / N) * mine               # the target column, if it is mine
    return dz.reshape(shape)

