"""Solutions to the exercises of chapter 5 (tutorials/05_tensor_parallel_linear.py).

    mpirun -n 4 python tutorials/solutions/05_tensor_parallel_linear.py

Four ranks, one tensor-parallel group of tp = 4 (exercise 3 also builds groups of 1 and 2), float64, the chapter's
sizes. Every rank draws the same full matrices and computes the serial reference itself; every check compares
with it or with a formula, collectively, and stops every rank (non-zero exit) at the first check that fails.
"""
# mpirun -n 4 python tutorials/solutions/05_tensor_parallel_linear.py
import os
import sys
from fractions import Fraction

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from hsgd.model import layers
from hsgd.tp import layers as tp_layers
from hsgd.grid.process_grid import ProcessGrid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, rel_err, ring_bytes, solve  # noqa: E402

threadpool_limits(1)                    # four ranks share the cores: one BLAS thread each
world = MPI.COMM_WORLD
TP = 4
B, T, C, F = 2, 3, 8, 32                # the chapter's sizes; N = B*T rows
N = B * T


def block(n, comm):
    """This rank's block of n columns: [rank n/tp, (rank+1) n/tp)."""
    return slice(comm.rank * n // comm.size, (comm.rank + 1) * n // comm.size)


# ------------------------------------------------------------------------------------------------------------ 1
def gather_backward(dY, comm, replicated):
    """The adjoint of Y = AllGather(Y_i) along the last axis. dY (..., F) -> dY_i (..., F/tp).
    replicated=False: every rank holds a different partial dL/dY; one Reduce-Scatter sums them and hands rank i
    its block. replicated=True: every rank holds the same whole dL/dY; the 1/tp-scaled Reduce-Scatter of tp equal
    copies is the local block, so take it without communicating."""
    c = dY.shape[-1] // comm.size
    if replicated:
        return np.ascontiguousarray(dY[..., comm.rank * c:(comm.rank + 1) * c])          # (..., F/tp)
    full = np.ascontiguousarray(dY.reshape(-1, comm.size, c).transpose(1, 0, 2))       # (tp, N, F/tp) block r
    out = np.empty(full.shape[1:])                                                      # (N, F/tp)
    comm.Reduce_scatter_block(full, out)                # out = sum over ranks of their block for me
    return out.reshape(*dY.shape[:-1], c)


def exercise_1(check):
    """The gather's backward with one Reduce-Scatter."""
    grid = ProcessGrid(world, dp=world.Get_size() // TP, tp=TP)
    tp = grid.tp_comm
    rng = np.random.default_rng(1)                       # the same draws on every rank
    X = rng.standard_normal((B, T, C))                   # (B, T, C) replicated
    A = rng.standard_normal((C, F))                      # (C, F) first layer, split by columns
    Bw = rng.standard_normal((F, C))                     # (F, C) second layer, split by columns
    R_Z = rng.standard_normal((B, T, C))                 # (B, T, C) dL/dZ, replicated
    cols, cols_C = block(F, tp), block(C, tp)

    # case 2: Y = AllGather(X A_i), Z = AllGather(Y B_i); rank r's Z_r = Y B_r gives it a partial dL/dY
    Y = tp_layers.allgather_forward(X @ A[:, cols], tp)                  # (B, T, F)
    Z = tp_layers.allgather_forward(Y @ Bw[:, cols_C], tp)               # (B, T, C)
    check("case 2: the forward Z vs serial X A B", rel_err(Z, X @ A @ Bw))
    dZ_i = gather_backward(R_Z, tp, replicated=True)                     # (B, T, C/tp) L = sum Z * R_Z: replicated
    D_r = dZ_i @ Bw[:, cols_C].T                                         # (B, T, F) my partial dL/dY
    dY_i = gather_backward(D_r, tp, replicated=False)                    # (B, T, F/tp) one Reduce-Scatter
    dY_serial = R_Z @ Bw.T                                               # (B, T, F)
    check("case 2: one Reduce-Scatter vs serial dL/dY_i", rel_err(dY_i, dY_serial[..., cols]))

    # case 1: L = sum Y * R with R the same everywhere: the slice, and what the unscaled Reduce-Scatter gives
    R = rng.standard_normal((B, T, F))                                   # (B, T, F) dL/dY, replicated
    check("case 1: the slice vs serial dL/dY_i", rel_err(gather_backward(R, tp, replicated=True), R[..., cols]))
    too_big = gather_backward(R, tp, replicated=False)                   # tp equal copies summed
    check("case 1: unscaled Reduce-Scatter / slice - tp", float(np.max(np.abs(too_big / R[..., cols] - TP))))
    grid.free()


# ------------------------------------------------------------------------------------------------------------ 2
def row_forward(x_i, W_i, b, comm):
    """Y = sum_i X_i W_i + b: x_i (..., F/tp), W_i (F/tp, C), b (C,) replicated. The partial products are
    All-Reduced first, then the bias is added once, on the sum."""
    y, cache = layers.linear_forward(x_i, W_i)           # (..., C) my partial product
    comm.Allreduce(y)                                    # (..., C) the sum over the tp ranks
    y += b
    return y, cache


def row_backward(dy, cache, dW_i, db, comm):
    """dy (..., C) is replicated (the whole dL/dY on every rank): db += sum of dy over rows, the same numbers
    on every rank; dW_i += X_i^T dy; returns dX_i = dy W_i^T (..., F/tp). No communication."""
    db += dy.reshape(-1, dy.shape[-1]).sum(axis=0)       # (C,)
    return layers.linear_backward(dy, cache, dW_i)       # (..., F/tp)


def exercise_2(check):
    """A row-parallel layer with its bias added once."""
    grid = ProcessGrid(world, dp=world.Get_size() // TP, tp=TP)
    tp = grid.tp_comm
    rng = np.random.default_rng(2)
    H = rng.standard_normal((B, T, F))                   # (B, T, F) the full input
    W = rng.standard_normal((F, C))                      # (F, C) split by rows
    b = rng.standard_normal(C)                           # (C,) replicated
    dY = rng.standard_normal((B, T, C))                  # (B, T, C) dL/dY, replicated
    rows = block(F, tp)

    Y, cache = row_forward(np.ascontiguousarray(H[..., rows]), W[rows, :], b, tp)   # (B, T, C)
    dW_i, db = np.zeros((F // TP, C)), np.zeros(C)
    dX_i = row_backward(dY, cache, dW_i, db, tp)         # (B, T, F/tp)

    Y_s, cache_s = layers.linear_forward(H, W, b)        # serial
    dW_s, db_s = np.zeros_like(W), np.zeros_like(b)
    dX_s = layers.linear_backward(dY, cache_s, dW_s, db_s)
    check("row-parallel: Y vs serial", rel_err(Y, Y_s))
    check("row-parallel: dX_i vs serial dX's block", rel_err(dX_i, dX_s[..., rows]))
    check("row-parallel: dW_i vs serial dW's rows", rel_err(dW_i, dW_s[rows, :]))
    check("row-parallel: db vs serial", rel_err(db, db_s))
    check.holds("row-parallel: db bit-identical on every rank", len(set(tp.allgather_obj(db.tobytes()))) == 1)

    wrong, _ = layers.linear_forward(np.ascontiguousarray(H[..., rows]), W[rows, :], b)  # bias on every rank ...
    tp.Allreduce(wrong)                                                                  # ... then summed tp times
    check("bias before the All-Reduce: Y_wrong - Y vs (tp - 1) b", rel_err(wrong - Y, (TP - 1) * b))
    grid.free()


# ------------------------------------------------------------------------------------------------------------ 3
def f_forward(x, comm):
    return x                                             # f: identity, x is replicated


def f_backward(dx, comm):
    comm.Allreduce(dx)                                   # f^T: the partial dX of every rank's columns, summed
    return dx


def g_forward(y, comm):
    comm.Allreduce(y)                                    # g: the partial products, summed
    return y


def g_backward(dy, comm):
    return dy                                            # g^T: identity, dY is replicated


def megatron_mlp(X, W1, b1, W2, b2, dOut, comm):
    """Section 3's MLP with f and g written out: out and dX, both replicated."""
    cols = block(F, comm)
    U_i, c_fc = layers.linear_forward(f_forward(X, comm), W1[:, cols], b1[cols])   # (B, T, F/tp)
    H_i, c_gelu = layers.gelu_forward(U_i)                                        # (B, T, F/tp)
    P, c_proj = layers.linear_forward(H_i, W2[cols, :])                           # (B, T, C) partial
    out = g_forward(P, comm) + b2                                                 # (B, T, C)
    dP = g_backward(dOut, comm)                                                   # (B, T, C)
    dH_i = layers.linear_backward(dP, c_proj, np.zeros((F // comm.size, C)))      # (B, T, F/tp)
    dU_i = layers.gelu_backward(dH_i, c_gelu)
    dX = layers.linear_backward(dU_i, c_fc, np.zeros((C, F // comm.size)), np.zeros(F // comm.size))  # partial
    return out, f_backward(dX, comm)


def lecture_mlp(X, W1, b1, W2, b2, dOut, comm):
    """Section 4's MLP: both linears column-split and All-Gathered."""
    cols, cols_C = block(F, comm), block(C, comm)
    U_i, c_fc = layers.linear_forward(X, W1[:, cols], b1[cols])                   # (B, T, F/tp)
    H_i, c_gelu = layers.gelu_forward(U_i)
    H = tp_layers.allgather_forward(H_i, comm)                                    # (B, T, F) Allgather
    out, c_proj = tp_layers.gather_linear_forward(H, W2[:, cols_C], b2[cols_C], comm)   # (B, T, C) Allgather
    dH = tp_layers.gather_linear_backward(dOut, c_proj, np.zeros((F, C // comm.size)), np.zeros(C // comm.size),
                                          comm)                                   # (B, T, F) Allreduce
    dU_i = layers.gelu_backward(tp_layers.allgather_backward(dH, comm), c_gelu)  # (B, T, F/tp) the slice
    dX = layers.linear_backward(dU_i, c_fc, np.zeros((C, F // comm.size)), np.zeros(F // comm.size))
    comm.Allreduce(dX)                                                            # (B, T, C)
    return out, dX


def exercise_3(check):
    """The MLP with your own f and g, its bytes against a formula."""
    rng = np.random.default_rng(3)
    X, dOut = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    W1, b1, W2, b2 = (rng.standard_normal(s) for s in ((C, F), (F,), (F, C), (C,)))
    U, c_fc = layers.linear_forward(X, W1, b1)                                    # serial
    H, c_gelu = layers.gelu_forward(U)
    out_s, c_proj = layers.linear_forward(H, W2, b2)
    dH = layers.linear_backward(dOut, c_proj, np.zeros_like(W2))
    dX_s = layers.linear_backward(layers.gelu_backward(dH, c_gelu), c_fc, np.zeros_like(W1))

    s = 8                                                                         # float64
    for tp_size in (1, 2, 4):
        grid = ProcessGrid(world, dp=world.Get_size() // tp_size, tp=tp_size)
        counts = {}
        for name, mlp in (("Megatron", megatron_mlp), ("lecture", lecture_mlp)):
            grid.stats.reset()
            out, dX = mlp(X, W1, b1, W2, b2, dOut.copy(), grid.tp_comm)
            counts[name] = grid.stats.counts()
            check(f"tp={tp_size} {name} MLP: out and dX vs serial", max(rel_err(out, out_s), rel_err(dX, dX_s)))
        check.equal(f"tp={tp_size} Megatron: calls, payload == (2, 2NCs)", counts["Megatron"],
                    {("tp", "Allreduce"): (2, 2 * N * C * s)})
        check.equal(f"tp={tp_size} Megatron: ring bytes == 4 (tp-1)/tp NCs", ring_bytes(counts["Megatron"], tp_size),
                    Fraction(4 * (tp_size - 1) * N * C * s, tp_size))
        payload = {k: sum(b for _, b in c.values()) for k, c in counts.items()}
        check.equal(f"tp={tp_size} payload ratio lecture / Megatron == (F + C)/C",
                    Fraction(payload["lecture"], payload["Megatron"]), Fraction(F + C, C))
        if tp_size > 1:                                   # at tp = 1 a ring sends nothing: no ratio
            check.equal(f"tp={tp_size} ring ratio lecture / Megatron == 3 (F + C)/(4C)",
                        ring_bytes(counts["lecture"], tp_size) / ring_bytes(counts["Megatron"], tp_size),
                        Fraction(3 * (F + C), 4 * C))
        grid.free()


if __name__ == "__main__":
    solve(Checks(world, tol=1e-12, width=62), [exercise_1, exercise_2, exercise_3])
