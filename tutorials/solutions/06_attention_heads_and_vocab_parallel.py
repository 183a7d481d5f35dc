"""Solutions to the exercises of chapter 6 (tutorials/06_attention_heads_and_vocab_parallel.py).

    mpirun -n 4 python tutorials/solutions/06_attention_heads_and_vocab_parallel.py

Four ranks, one tensor-parallel group of tp = 4, float64, tiny sizes. Every rank draws the same full arrays and
computes the serial reference itself; every check compares with it or with a formula, collectively, and stops
every rank (non-zero exit) at the first check that fails.
"""
# mpirun -n 4 python tutorials/solutions/06_attention_heads_and_vocab_parallel.py
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


def same_everywhere(comm, a):
    """Whether the array a is bit-identical on every rank of comm."""
    return len(set(comm.allgather_obj(a.tobytes()))) == 1


# ------------------------------------------------------------------------------------------------------------ 1
def vocab_ce_forward(z_i, targets, start, V, comm):
    """Mean cross-entropy over N positions from this rank's logits z_i (B, T, Vp), ids [start, start + Vp).
    Three All-Reduces of (N,) numbers: the max, the sum of exp(z - m), the shifted target logit."""
    N, Vp = targets.size, z_i.shape[-1]
    z = z_i.reshape(N, Vp).copy()                               # (N, Vp)
    z[:, max(V - start, 0):] = -np.inf                          # padding columns (the last rank's) count as -inf
    m = z.max(axis=1)                                           # (N,) my max ...
    comm.Allreduce(m, op=MPI.MAX)                               # ... the max over the whole vocabulary
    e = np.exp(z - m[:, None])                                  # (N, Vp) exp(z - m), 0 on padding
    s = e.sum(axis=1)                                           # (N,) my part of the sum ...
    comm.Allreduce(s)                                           # ... the sum over the whole vocabulary
    tgt = targets.reshape(-1) - start                           # (N,) the target's column in my shard
    mine = (tgt >= 0) & (tgt < Vp)
    zt = np.where(mine, z[np.arange(N), np.where(mine, tgt, 0)] - m, 0.0)   # (N,) only the owner's is non-zero
    comm.Allreduce(zt)                                          # (N,) z_t - m on every rank
    loss = float(np.mean(np.log(s) - zt))
    return loss, (e / s[:, None], tgt, mine, z_i.shape)         # my columns of the softmax


def vocab_ce_backward(dloss, cache):
    """dz_nv = dloss (softmax_nv - [v = t_n]) / N on my columns only: no communication."""
    probs, tgt, mine, shape = cache
    N = probs.shape[0]
    dz = probs * (dloss / N)                                    # (N, Vp)
    rows = np.arange(N)[mine]
    dz[rows, tgt[mine]] -= dloss / N                            # the target column, where it is mine
    return dz.reshape(shape)


def exercise_1(check):
    """The vocab-parallel cross-entropy and its backward by hand."""
    grid = ProcessGrid(world, dp=world.Get_size() // TP, tp=TP)
    tp, i = grid.tp_comm, grid.tp_rank
    rng = np.random.default_rng(1)
    B, T, V = 2, 5, 13
    Vp = -(-V // TP)                                            # 4 ids per rank; the last rank has 3 padding
    z = 3.0 * rng.standard_normal((B, T, V))                    # (B, T, V) full logits
    targets = rng.integers(0, V, (B, T))
    targets[0, 0] = V - 1                                       # one target on the last rank
    padded = np.concatenate([z, np.zeros((B, T, Vp * TP - V))], axis=-1)   # (B, T, tp*Vp)
    start = i * Vp
    z_i = np.ascontiguousarray(padded[..., start:start + Vp])   # (B, T, Vp) my logits

    grid.stats.reset()
    loss, cache = vocab_ce_forward(z_i, targets, start, V, tp)
    counts = grid.stats.counts()
    dz_i = vocab_ce_backward(1.0, cache)                        # (B, T, Vp)

    loss_s, cache_s = layers.cross_entropy_forward(z, targets)
    dz = np.concatenate([layers.cross_entropy_backward(1.0, cache_s), np.zeros((B, T, Vp * TP - V))], axis=-1)
    check("vocab cross-entropy: loss vs serial", abs(loss - loss_s) / abs(loss_s))
    check("vocab cross-entropy: my block of dlogits vs serial", rel_err(dz_i, dz[..., start:start + Vp]))
    check("vocab cross-entropy: max |dlogits| on padding columns",
          float(np.max(np.abs(dz_i[..., max(V - start, 0):]), initial=0.0)))
    check.equal("three All-Reduces: calls, payload == (3, 3 N 8)", counts, {("tp", "Allreduce"): (3, 3 * B * T * 8)})
    grid.free()


# ------------------------------------------------------------------------------------------------------------ 2
def exercise_2(check):
    """Attention with an unequal split of heads."""
    grid = ProcessGrid(world, dp=world.Get_size() // TP, tp=TP)
    tp, i = grid.tp_comm, grid.tp_rank
    rng = np.random.default_rng(2)
    B, T, NH, hs = 2, 5, 6, 2
    C = NH * hs
    heads = [NH // TP + (r < NH % TP) for r in range(TP)]       # 2, 2, 1, 1: DeepSpeed's get_shard_size rule
    h0, nh = sum(heads[:i]), heads[i]                           # my first head, my number of heads
    cols = slice(h0 * hs, (h0 + nh) * hs)                       # my columns of q, k, v = my rows of W_o
    W = {m: 0.5 * rng.standard_normal((C, C)) for m in "qkvo"}  # (C, C)
    b = {m: rng.standard_normal(C) for m in "qkvo"}             # (C,)
    a = rng.standard_normal((B, T, C))                          # (B, T, C) replicated
    dO = rng.standard_normal((B, T, C))                         # (B, T, C) dL/do, replicated

    grid.stats.reset()
    a_f = tp_layers.f_forward(a, tp)                            # f: identity
    qkv = [layers.linear_forward(a_f, W[m][:, cols], b[m][cols]) for m in "qkv"]   # (B, T, nh*hs) each
    y_i, c_att = layers.attention_forward(qkv[0][0], qkv[1][0], qkv[2][0], nh)     # my nh heads
    o, c_o = tp_layers.row_linear_forward(y_i, W["o"][cols, :], b["o"], tp)        # (B, T, C) g: Allreduce
    dW = {m: np.zeros((C, nh * hs)) for m in "qkv"}
    db = {m: np.zeros(nh * hs) for m in "qkv"}
    dW["o"], db["o"] = np.zeros((nh * hs, C)), np.zeros(C)
    dy_i = tp_layers.row_linear_backward(dO, c_o, dW["o"], db["o"], tp)            # g^T: identity
    dqkv = layers.attention_backward(dy_i, c_att)
    da = sum(layers.linear_backward(d, qkv[j][1], dW[m], db[m]) for j, (m, d) in enumerate(zip("qkv", dqkv)))
    da = tp_layers.f_backward(da, tp)                           # f^T: Allreduce
    counts = grid.stats.counts()

    sq = {m: layers.linear_forward(a, W[m], b[m]) for m in "qkv"}                  # serial, all heads
    y, c_atts = layers.attention_forward(sq["q"][0], sq["k"][0], sq["v"][0], NH)
    o_s, c_os = layers.linear_forward(y, W["o"], b["o"])
    sW, sb = {m: np.zeros((C, C)) for m in "qkvo"}, {m: np.zeros(C) for m in "qkvo"}
    dq, dk, dv = layers.attention_backward(layers.linear_backward(dO, c_os, sW["o"], sb["o"]), c_atts)
    da_s = sum(layers.linear_backward(d, sq[m][1], sW[m], sb[m]) for m, d in zip("qkv", (dq, dk, dv)))

    check("unequal heads: output o vs serial", rel_err(o, o_s))
    check("unequal heads: da vs serial", rel_err(da, da_s))
    check("unequal heads: dWq, dWk, dWv, dbq, dbv blocks vs serial",
          max([rel_err(dW[m], sW[m][:, cols]) for m in "qkv"] + [rel_err(db[m], sb[m][cols]) for m in "qv"]))
    check("unequal heads: dWo rows, dbo vs serial", max(rel_err(dW["o"], sW["o"][cols, :]), rel_err(db["o"], sb["o"])))
    check.equal("unequal heads: one (N, C) All-Reduce each way",
                counts, {("tp", "Allreduce"): (2, 2 * B * T * C * 8)})
    scores = tp.allgather_obj(c_att[3].shape[1])                # the heads each rank really computed
    check.equal("unequal heads: heads computed per rank == 2, 2, 1, 1", scores, [2, 2, 1, 1])
    check.say(f"  the slowest rank computes {max(scores)} heads, the average {NH / TP}: "
              f"{max(scores) * TP / NH:.2f} times the average attention work, while the others wait")
    grid.free()


# ------------------------------------------------------------------------------------------------------------ 3
def exercise_3(check):
    """The sequence-parallel LayerNorm needs an All-Reduce of its gradients."""
    grid = ProcessGrid(world, dp=world.Get_size() // TP, tp=TP)
    tp, i = grid.tp_comm, grid.tp_rank
    rng = np.random.default_rng(3)
    B, T, C = 2, 8, 16
    x = rng.standard_normal((B, T, C))                          # (B, T, C) the full input
    w, b = 1 + 0.1 * rng.standard_normal(C), 0.1 * rng.standard_normal(C)   # (C,) replicated parameters
    dy = rng.standard_normal((B, T, C))                         # (B, T, C) dL/dy
    rows = slice(i * T // TP, (i + 1) * T // TP)                # my positions: the T-shard

    y_s, cache = layers.layernorm_forward(np.ascontiguousarray(x[:, rows]), w, b)   # (B, T/tp, C)
    dw_part, db_part = np.zeros(C), np.zeros(C)
    dx_s = layers.layernorm_backward(np.ascontiguousarray(dy[:, rows]), cache, dw_part, db_part)

    y, cache_full = layers.layernorm_forward(x, w, b)           # serial
    dw, db = np.zeros(C), np.zeros(C)
    dx = layers.layernorm_backward(dy, cache_full, dw, db)
    check("LN on my T-shard: y vs serial rows", rel_err(y_s, y[:, rows]))
    check("LN on my T-shard: dx vs serial rows (no communication)", rel_err(dx_s, dx[:, rows]))
    partial_err = max(rel_err(dw_part, dw), rel_err(db_part, db))
    check.say(f"  rank 0's dw, db alone (a sum over its {T // TP} of {T} positions) are off by {partial_err:.0%}")
    check.holds("LN: without the All-Reduce dw, db are not the serial ones", partial_err > 0.1)
    both = np.concatenate([dw_part, db_part])                   # (2C,) one buffer, one call
    tp.Allreduce(both)                                          # sum over the ranks: every position counted
    check("LN: All-Reduce(dw, db) vs serial", max(rel_err(both[:C], dw), rel_err(both[C:], db)))

    lr = 0.1
    check.holds("SGD step with the All-Reduce: w bit-identical on every rank", same_everywhere(tp, w - lr * both[:C]))
    check.holds("SGD step without it: the ranks' w differ", not same_everywhere(tp, w - lr * dw_part))
    grid.free()


# ------------------------------------------------------------------------------------------------------------ 4
def exercise_4(check):
    """The sequence-parallel MLP: twice the payload, the same ring bytes."""
    grid = ProcessGrid(world, dp=world.Get_size() // TP, tp=TP)
    tp, i = grid.tp_comm, grid.tp_rank
    rng = np.random.default_rng(4)
    B, T, C, F = 2, 8, 8, 32
    N, s = B * T, 8
    x, dOut = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    W1, b1, W2, b2 = (rng.standard_normal(sh) for sh in ((C, F), (F,), (F, C), (C,)))
    cols, rows = slice(i * F // TP, (i + 1) * F // TP), slice(i * T // TP, (i + 1) * T // TP)

    U, c_fc = layers.linear_forward(x, W1, b1)                  # serial MLP
    H, c_gelu = layers.gelu_forward(U)
    out, c_proj = layers.linear_forward(H, W2, b2)
    dX = layers.linear_backward(layers.gelu_backward(layers.linear_backward(dOut, c_proj, np.zeros_like(W2)),
                                                     c_gelu), c_fc, np.zeros_like(W1))

    # Megatron: f, column fc, GELU, row proj, g on the whole (B, T, C)
    grid.stats.reset()
    U_i, c1 = tp_layers.column_linear_forward(x, W1[:, cols], b1[cols], tp)           # f: identity
    H_i, cg = layers.gelu_forward(U_i)
    out_m, c2 = tp_layers.row_linear_forward(H_i, W2[cols, :], b2, tp)                # g: Allreduce
    dH_i = tp_layers.row_linear_backward(dOut, c2, np.zeros((F // TP, C)), np.zeros(C), tp)
    dX_m = tp_layers.column_linear_backward(layers.gelu_backward(dH_i, cg), c1, np.zeros((C, F // TP)),
                                            np.zeros(F // TP), tp)                    # f^T: Allreduce
    megatron = grid.stats.counts()

    # sequence parallelism: gather_T, the same matmuls, scatter_T, on my T-shard (B, T/tp, C)
    grid.stats.reset()
    x_in = tp_layers.gather_T_forward(x[:, rows], tp)                                 # (B, T, C) All-Gather
    U_i, c1 = layers.linear_forward(x_in, W1[:, cols], b1[cols])                      # caches x_in, gathered
    H_i, cg = layers.gelu_forward(U_i)
    P, c2 = layers.linear_forward(H_i, W2[cols, :])                                   # (B, T, C) partial
    out_s = tp_layers.scatter_T_forward(P, tp) + b2                                   # (B, T/tp, C) Reduce-Scatter
    dP = tp_layers.scatter_T_backward(np.ascontiguousarray(dOut[:, rows]), tp)       # (B, T, C) All-Gather
    dH_i = layers.linear_backward(dP, c2, np.zeros((F // TP, C)))
    dx_in = layers.linear_backward(layers.gelu_backward(dH_i, cg), c1, np.zeros((C, F // TP)), np.zeros(F // TP))
    dX_s = tp_layers.gather_T_backward(dx_in, tp)                                     # (B, T/tp, C) Reduce-Scatter
    sequence = grid.stats.counts()

    check("Megatron MLP: out and dX vs serial", max(rel_err(out_m, out), rel_err(dX_m, dX)))
    check("sequence MLP: out and dX on my T-shard vs serial rows",
          max(rel_err(out_s, out[:, rows]), rel_err(dX_s, dX[:, rows])))
    check.equal("Megatron: 2 All-Reduces of N C s", megatron, {("tp", "Allreduce"): (2, 2 * N * C * s)})
    check.equal("sequence: 2 All-Gathers and 2 Reduce-Scatters of N C s", sequence,
                {("tp", "Allgather"): (2, 2 * N * C * s), ("tp", "Reduce_scatter_block"): (2, 2 * N * C * s)})
    pay = {k: sum(b for _, b in c.values()) for k, c in (("megatron", megatron), ("sequence", sequence))}
    check.equal("payload: sequence == 2 x Megatron", pay["sequence"], 2 * pay["megatron"])
    check.equal("ring bytes per rank: both == 4 (tp-1)/tp N C s",
                (ring_bytes(megatron, TP), ring_bytes(sequence, TP)), (Fraction(4 * (TP - 1) * N * C * s, TP),) * 2)
    grid.free()


if __name__ == "__main__":
    solve(Checks(world, tol=1e-12, width=64), [exercise_1, exercise_2, exercise_3, exercise_4])
