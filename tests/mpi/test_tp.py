"""Tensor parallelism on 8 ranks, float64: equal to serial for tp in {1, 2, 4, 8} and both schemes, checked
against finite differences through every distributed backward, and the bytes of every collective counted."""
import dataclasses

import numpy as np
import pytest
from hsgd.model.config import ModelConfig
from hsgd.model import gradcheck, serial
from hsgd.tp import layers as tp_layers, model as tp_model, schemes as tp_schemes, shards as tp_shards
from hsgd.errors import ConfigError
from hsgd.grid.process_grid import ProcessGrid
from hsgd.model.layers import linear_backward, linear_forward

from .conftest import WORLD, check, say, world_max

pytestmark = pytest.mark.mpi(min_size=8)

# V = 13 is divisible by no tp > 1 (padding); 8 heads and d_ff = 16 split over up to 8 ranks
CFG = ModelConfig(vocab_size=13, seq_len=6, d_model=16, n_heads=8, n_layers=2, d_ff=16)
VARIANTS = [("megatron", False), ("gather", False), ("gather", True)]      # (scheme, reduce_scatter)


def reference(cfg=CFG, batch=3, seed=0):
    """Serial float64 parameters (with noise, so that no gradient is trivially zero), a batch, loss and grads.
    Every rank draws the same numbers."""
    params = serial.init_params(cfg, seed=seed, dtype="float64")
    rng = np.random.default_rng(seed + 1)
    for p in params.values():
        p += rng.normal(0.0, 0.1, p.shape)
    idx = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))
    targets = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))
    loss, grads = serial.loss_and_grads(params, idx, targets, cfg)
    return params, idx, targets, loss, grads


@pytest.mark.parametrize("scheme, rs", VARIANTS, ids=["megatron", "gather", "gather-reduce-scatter"])
def test_tp_equals_serial(scheme, rs):
    params, idx, targets, loss0, grads0 = reference()
    for tp in (1, 2, 4, 8):
        grid = ProcessGrid(WORLD, dp=8 // tp, tp=tp)
        c = grid.tp_comm
        local = tp_shards.shard_params(params, c.rank, tp, scheme)
        loss, grads = tp_model.loss_and_grads(local, idx, targets, tp_model.TPSetup(CFG, c, scheme,
                                                                                    reduce_scatter=rs))
        loss_err = abs(loss - loss0) / abs(loss0)
        # floor 1e-6: the k-bias gradients are exactly zero in exact arithmetic (softmax ignores a shift shared
        # by a row of scores), so what is computed for them is rounding noise; the other gradients are ~1e-2
        errs = {n: np.abs(grads[n] - tp_shards.shard(grads0[n], n, c.rank, tp, scheme)).max()
                / max(np.abs(grads0[n]).max(), 1e-6) for n in grads}
        worst = max(errs, key=errs.get)
        say(f"{scheme}{'+rs' if rs else ''} tp={tp}: loss rel err {world_max(loss_err):.1e}, "
            f"max grad-shard rel err {world_max(errs[worst]):.1e}")
        check(loss_err <= 1e-12 and errs[worst] <= 1e-10, f"tp={tp} {worst}: {errs[worst]:.2e}, loss {loss_err:.2e}")
        grid.free()


def test_replicated_gradients_are_identical_on_every_tp_rank():
    """LayerNorm parameters, wpe and the row-parallel biases are replicated: each TP rank computes their full
    gradient from replicated data, so the copies agree bit for bit (no reduction is needed for them)."""
    params, idx, targets, _, _ = reference()
    grid = ProcessGrid(WORLD, dp=2, tp=4)
    c = grid.tp_comm
    _, grads = tp_model.loss_and_grads(tp_shards.shard_params(params, c.rank, 4), idx, targets,
                                       tp_model.TPSetup(CFG, c))
    names = [n for n in grads if tp_shards.split_of(n)[0] == "rep"]
    same = all(all(np.array_equal(g, grads[n]) for g in c.allgather_obj(grads[n])) for n in names)
    say(f"{len(names)} replicated parameters ({', '.join(names[:4])}, ...): identical gradients on all 4 ranks")
    check(same and any("ln1" in n for n in names))
    grid.free()


# ---------------------------------------------------------------------------------------------- finite differences

def fd_check(loss_fn, arrays, grads, comm, replicated, n=3, h=1e-3, seed=0, floor=1e-6):
    """Max relative error (max |fd - an| / max |an| per array) of `grads` against 4th-order central differences of
    the collective `loss_fn`: hsgd.model.gradcheck.fd_error, a shard perturbed on its owner alone (one rank at a
    time), a replicated array on every rank at once (it is one logical parameter)."""
    return gradcheck.fd_error(loss_fn, arrays, grads, n=n, h=h, floor=floor, order=4, measure="array",
                              rng=np.random.default_rng(seed), comm=comm, replicated=replicated)


def test_fd_f_and_g_pair():
    """x -> f -> column-parallel A_i -> row-parallel B_i -> g -> y;  L = sum(R * y). dx comes out of f's
    backward Allreduce, dA_i and dB_i are local."""
    grid = ProcessGrid(WORLD, dp=2, tp=4)
    c = grid.tp_comm
    rng = np.random.default_rng(10 + c.rank)                     # different shards per rank ...
    A, B = rng.normal(size=(5, 2)), rng.normal(size=(2, 5))
    same = np.random.default_rng(3)                              # ... and the same x, R on every rank
    x, R = same.normal(size=(4, 5)), same.normal(size=(4, 5))
    bias = np.zeros(5)

    def loss():
        h, _ = linear_forward(tp_layers.f_forward(x, c), A)
        y, _ = tp_layers.row_linear_forward(h, B, bias, c)
        return float(np.sum(R * y))

    h, c1 = linear_forward(tp_layers.f_forward(x, c), A)
    y, c2 = tp_layers.row_linear_forward(h, B, bias, c)
    dA, dB, db = np.zeros_like(A), np.zeros_like(B), np.zeros_like(bias)
    dh = tp_layers.row_linear_backward(R.copy(), c2, dB, db, c)
    dx = tp_layers.f_backward(linear_backward(dh, c1, dA), c)
    err = max(fd_check(loss, [x], [dx], c, [True]), fd_check(loss, [A, B], [dA, dB], c, [False, False]))
    say(f"f/g pair: max rel err vs finite differences {world_max(err):.1e}")
    check(err < 1e-8, f"{err:.2e}")
    grid.free()


def test_allgather_adjoint_is_a_reduce_scatter():
    """Y = Allgather(X A_i). Downstream replicated (L = sum(R * Y), R the same everywhere): the 1/tp-scaled
    Reduce-scatter equals the local slice, and the unscaled one is exactly tp times too large. Downstream split
    (rank r adds its own term sum(R_r * Y), L = sum over r): the plain Reduce-scatter is the exact adjoint."""
    grid = ProcessGrid(WORLD, dp=2, tp=4)
    c = grid.tp_comm
    A = np.random.default_rng(20 + c.rank).normal(size=(5, 3))
    same = np.random.default_rng(4)
    x, R = same.normal(size=(4, 5)), same.normal(size=(4, 12))
    R_mine = np.random.default_rng(30 + c.rank).normal(size=(4, 12))

    def Y():
        return tp_layers.allgather_forward(linear_forward(x, A)[0], c)

    sliced = tp_layers.allgather_backward(R.copy(), c)
    scaled = tp_layers.allgather_backward(R.copy(), c, reduce_scatter=True)
    unscaled = tp_layers.allgather_backward(R.copy(), c, reduce_scatter=True, scale=1.0)
    ratio = unscaled / sliced
    ok = np.allclose(scaled, sliced, rtol=1e-14, atol=0) and np.allclose(ratio, c.size, rtol=1e-14)
    # replicated downstream: the slice gives the right dA
    dA = np.zeros_like(A)
    linear_backward(sliced, linear_forward(x, A)[1], dA)
    err_rep = fd_check(lambda: float(np.sum(R * Y())), [A], [dA], c, [False])
    # split downstream: L = sum over ranks of sum(R_r * Y), the Reduce-scatter of the R_r is dY_i
    dy_i = tp_layers.allgather_backward(R_mine.copy(), c, replicated=False)
    dA2 = np.zeros_like(A)
    linear_backward(dy_i, linear_forward(x, A)[1], dA2)
    err_split = fd_check(lambda: c.comm.allreduce(float(np.sum(R_mine * Y()))), [A], [dA2], c, [False])
    say(f"allgather adjoint: scaled Reduce-scatter == slice: {ok}; unscaled / correct = {ratio.min():.1f}"
        f"; FD err replicated {world_max(err_rep):.1e}, split {world_max(err_split):.1e}")
    check(ok and err_rep < 1e-8 and err_split < 1e-8)
    grid.free()


def test_fd_vocab_parallel_cross_entropy():
    """Logits split by vocabulary columns (V = 13 over 4 ranks: the last rank holds 1 real and 3 padded
    columns): the loss equals the serial one and dlogits matches finite differences."""
    grid = ProcessGrid(WORLD, dp=2, tp=4)
    c = grid.tp_comm
    rng = np.random.default_rng(5)
    V, N = 13, 7
    logits, targets = rng.normal(size=(1, N, V)), rng.integers(0, V, (1, N))
    start, Vp = tp_layers.vocab_range(V, 4, c.rank)
    padded = np.concatenate([logits, np.zeros((1, N, 4 * Vp - V))], axis=-1)
    local = np.ascontiguousarray(padded[..., start:start + Vp])
    loss = lambda: float(tp_layers.vocab_cross_entropy_forward(local, targets, start, V, c)[0])
    value, cache = tp_layers.vocab_cross_entropy_forward(local, targets, start, V, c)
    dlocal = tp_layers.vocab_cross_entropy_backward(1.0, cache)
    from hsgd.model.layers import cross_entropy_forward
    serial_loss = float(cross_entropy_forward(logits, targets)[0])
    err = fd_check(loss, [local], [dlocal], c, [False], n=4)
    say(f"vocab-parallel cross-entropy: loss diff {abs(value - serial_loss):.1e}, FD rel err {world_max(err):.1e}")
    check(abs(value - serial_loss) < 1e-14 and err < 1e-8 and np.all(dlocal[..., max(V - start, 0):] == 0))
    grid.free()


@pytest.mark.parametrize("scheme", ["megatron", "gather"])
def test_fd_tp_model(scheme):
    """Every parameter shard of a one-block tp=4 model (head-split attention, vocab-parallel embedding and loss, the
    f/g or gather pairs) against finite differences of the distributed loss: one block shows every layer's
    backward (the gradients of deeper models equal serial's to 1e-10 in the other tests). The loss is O(1) and
    single coordinates of the gradient can be tiny, so the error is taken relative to at least 1e-4 (typical
    gradients are ~1e-2). The two tp groups hold the same model: each checks every other parameter, so that
    together they check all."""
    cfg = dataclasses.replace(CFG, n_layers=1)
    params, idx, targets, _, _ = reference(cfg, batch=2)
    grid = ProcessGrid(WORLD, dp=2, tp=4)
    c = grid.tp_comm
    local = tp_shards.shard_params(params, c.rank, 4, scheme)
    _, grads = tp_model.loss_and_grads(local, idx, targets, tp_model.TPSetup(cfg, c, scheme))
    names = list(local)
    rep = {n: tp_shards.split_of(n, scheme)[0] == "rep" for n in names}
    # this tp group's half: every other sharded and every other replicated parameter (a sharded one costs tp
    # times as many loss evaluations), so that the two groups take about as long
    mine = [n for kind in (False, True) for n in [n for n in names if rep[n] == kind][grid.dp_rank::grid.dp]]
    loss = lambda: tp_model.forward(local, idx, targets, tp_model.TPSetup(cfg, c, scheme))[0]
    err = fd_check(loss, [local[n] for n in mine], [grads[n] for n in mine], c, [rep[n] for n in mine], n=2,
                   floor=1e-4)
    checked = sum(WORLD.allgather(len(mine) if c.rank == 0 else 0))
    say(f"tp=4 {scheme} model of one block, {checked} of {len(names)} parameters (half in each tp group): max rel "
        f"err vs finite differences {world_max(err):.1e}")
    check(err < 1e-6 and checked == len(names), f"{err:.2e}, {checked} of {len(names)} parameters checked")
    grid.free()


# ---------------------------------------------------------------------------------------------- communication

@pytest.mark.parametrize("scheme, rs", VARIANTS, ids=["megatron", "gather", "gather-reduce-scatter"])
def test_communication_matches_the_formula(scheme, rs):
    params, idx, targets, _, _ = reference(batch=3)
    grid = ProcessGrid(WORLD, dp=2, tp=4)
    c = grid.tp_comm
    local = tp_shards.shard_params(params, c.rank, 4, scheme)
    grid.stats.reset()
    tp_model.loss_and_grads(local, idx, targets, tp_model.TPSetup(CFG, c, scheme, reduce_scatter=rs))
    measured = grid.stats.counts()
    formula = tp_model.comm_formula(CFG, batch_size=3, itemsize=8, scheme=scheme, reduce_scatter=rs)
    say(f"{scheme}{'+rs' if rs else ''}: measured {measured}, formula {formula}")
    check(measured == formula, f"measured {measured} vs formula {formula}")
    grid.free()


def test_bad_tp_is_a_clear_error():
    cfg = ModelConfig(vocab_size=13, seq_len=4, d_model=12, n_heads=6, n_layers=1, d_ff=24)
    msgs = []
    for tp, scheme in ((4, "megatron"), (3, "nope")):
        try:
            tp_shards.check_tp(cfg, tp, scheme)
        except ConfigError as e:
            msgs.append(str(e))
    check(msgs[0].startswith("n_heads=6 is not divisible by tp=4") and "[1, 2, 3, 6]" in msgs[0]
          and "tp_scheme='nope' is not known" in msgs[1], msgs)
    cfg2 = ModelConfig(vocab_size=13, seq_len=4, d_model=16, n_heads=4, n_layers=1, d_ff=6)
    try:
        tp_shards.check_tp(cfg2, 4)
        msg = ""
    except ConfigError as e:
        msg = str(e)
    check(msg.startswith("d_ff=6 is not divisible by tp=4"), msg)


def test_init_params_are_slices_of_the_serial_init():
    cfg = ModelConfig(vocab_size=13, seq_len=4, d_model=16, n_heads=4, n_layers=1, d_ff=8)
    grid = ProcessGrid(WORLD, dp=2, tp=4)
    c = grid.tp_comm
    full = serial.init_params(cfg, seed=11, dtype="float64")
    ok = True
    for scheme in tp_schemes.SCHEMES:
        local = tp_shards.init_params(cfg, c, seed=11, dtype="float64", scheme=scheme)
        ok &= all(np.array_equal(local[n], tp_shards.shard(full[n], n, c.rank, 4, scheme)) for n in full)
        ok &= local["wte"].shape == (4, 16) and local["h.0.attn.q.weight"].shape == (16, 4)
    check(ok)
    grid.free()


def test_float32_error_budget():
    """float32 is not exact: its documented budget (README) is a loss within 1e-6 relative and every gradient
    shard within 1e-4 of the parameter's largest float64 gradient, for a model of this size (measured ~2e-5)."""
    cfg = ModelConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=8, n_layers=2, d_ff=256)
    p64 = serial.init_params(cfg, seed=0, dtype="float64")
    rng = np.random.default_rng(1)
    idx, targets = rng.integers(0, 256, (4, 32)), rng.integers(0, 256, (4, 32))
    loss0, grads0 = serial.loss_and_grads(p64, idx, targets, cfg)
    p32 = {n: p.astype(np.float32) for n, p in p64.items()}
    for tp, scheme in ((4, "megatron"), (8, "gather")):
        grid = ProcessGrid(WORLD, dp=8 // tp, tp=tp)
        c = grid.tp_comm
        loss, grads = tp_model.loss_and_grads(tp_shards.shard_params(p32, c.rank, tp, scheme), idx, targets,
                                              tp_model.TPSetup(cfg, c, scheme))
        loss_err = abs(loss - loss0) / loss0
        err = max(np.abs(grads[n] - tp_shards.shard(grads0[n], n, c.rank, tp, scheme)).max()
                  / max(np.abs(grads0[n]).max(), 1e-6) for n in grads)
        say(f"float32 tp={tp} {scheme}: loss rel err {world_max(loss_err):.1e}, max grad rel err {world_max(err):.1e}")
        check(grads["wte"].dtype == np.float32 and loss_err < 1e-6 and err < 1e-4, f"{loss_err:.1e} {err:.1e}")
        grid.free()
