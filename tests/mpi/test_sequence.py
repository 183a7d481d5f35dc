"""Sequence parallelism (tp scheme "sequence", hsgd.tp.schemes.Sequence) on 8 ranks, float64: equal to serial for tp in
{1, 2, 4, 8}; the T-axis All-Gather / Reduce-Scatter pair against finite differences; replicated gradients
All-Reduced and identical; on_ready in order with final gradients; the bytes of every collective and of every
cached activation equal to their formulas; and a clear error for a seq_len that does not split."""
import numpy as np
import pytest

from hsgd.model.config import ModelConfig
from hsgd.accounting import activations
from hsgd.model import serial
from hsgd.tp import layers as tp_layers, model as tp_model, shards as tp_shards
from hsgd.errors import ConfigError
from hsgd.grid.process_grid import ProcessGrid

from .conftest import WORLD, check, float64_config, say, world_max
from .test_tp import fd_check, reference

pytestmark = pytest.mark.mpi(min_size=8)

# T = 8 splits over up to 8 ranks (one position each at tp = 8); V = 13 is padded for every tp > 1
CFG = ModelConfig(vocab_size=13, seq_len=8, d_model=16, n_heads=8, n_layers=2, d_ff=16)
B = 3


def rel_err(a, b):
    """max |a - b| / max(max |b|, 1e-6): the floor because the attention k-bias gradients are exactly zero in exact
    arithmetic (a softmax ignores a shift shared by a row of scores); what is computed for them is rounding noise."""
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def sequence_grads(params, idx, targets, tp):
    grid = ProcessGrid(WORLD, dp=8 // tp, tp=tp)
    local = tp_shards.shard_params(params, grid.tp_rank, tp, "sequence")
    grid.stats.reset()
    loss, grads = tp_model.loss_and_grads(local, idx, targets, tp_model.TPSetup(CFG, grid.tp_comm, "sequence"))
    return grid, local, loss, grads


def test_sequence_equals_serial():
    params, idx, targets, loss0, grads0 = reference(CFG, batch=B)
    for tp in (1, 2, 4, 8):
        grid, _, loss, grads = sequence_grads(params, idx, targets, tp)
        loss_err = abs(loss - loss0) / abs(loss0)
        errs = {n: rel_err(grads[n], tp_shards.shard(grads0[n], n, grid.tp_rank, tp, "sequence")) for n in grads}
        worst = max(errs, key=errs.get)
        say(f"sequence tp={tp}: loss rel err {world_max(loss_err):.1e}, max grad-shard rel err "
            f"{world_max(errs[worst]):.1e}")
        check(loss_err <= 1e-12 and errs[worst] <= 1e-10, f"tp={tp} {worst}: {errs[worst]:.2e}, loss {loss_err:.2e}")
        grid.free()


def test_fd_T_axis_allgather_and_reduce_scatter():
    """x^s -> gather_T (All-Gather along T) -> times M_r (a different 'column share' on every rank) -> scatter_T
    (Reduce-Scatter along T) -> y^s;  L = sum over ranks of sum(S_r * y^s_r). dx^s comes out of scatter_T's backward
    All-Gather and gather_T's backward Reduce-Scatter; the shapes show the T-shards."""
    grid = ProcessGrid(WORLD, dp=2, tp=4)
    c = grid.tp_comm
    rng = np.random.default_rng(40 + c.rank)
    x_s = rng.normal(size=(2, 3, 5))                                     # (B, T/tp, C), T = 12
    M, S = rng.normal(size=(2, 12, 5)), rng.normal(size=(2, 3, 5))      # (B, T, C), (B, T/tp, C)

    def loss():
        y_s = tp_layers.scatter_T_forward(tp_layers.gather_T_forward(x_s, c) * M, c)
        return c.comm.allreduce(float(np.sum(S * y_s)))

    x = tp_layers.gather_T_forward(x_s, c)
    shapes_ok = x.shape == (2, 12, 5) and np.array_equal(x[:, 3 * c.rank:3 * c.rank + 3], x_s)
    dy = tp_layers.scatter_T_backward(S.copy(), c)                       # (B, T, C) All-Gather
    dx_s = tp_layers.gather_T_backward(dy * M, c)                        # (B, T/tp, C) Reduce-Scatter
    err = fd_check(loss, [x_s], [dx_s], c, [False], n=4)
    say(f"T-axis All-Gather / Reduce-Scatter pair: max rel err vs finite differences {world_max(err):.1e}")
    check(shapes_ok and dx_s.shape == x_s.shape and err < 1e-8, f"{err:.2e}")
    grid.free()


def test_replicated_gradients_are_all_reduced_and_identical():
    """Each TP rank sees only its T rows, so LayerNorm, wpe and row-parallel-bias gradients are partial until the
    per-group Allreduce; afterwards the copies agree bit for bit. tp_model's lists name exactly the replicated
    parameters of split_of."""
    params, idx, targets, _, _ = reference(CFG, batch=B)
    grid, _, _, grads = sequence_grads(params, idx, targets, 4)
    c = grid.tp_comm
    names = [n for n in grads if tp_shards.split_of(n, "sequence")[0] == "rep"]
    listed = set(tp_model.HEAD_REPLICATED) | set(tp_model.EMBEDDING_REPLICATED) | \
        {f"h.{i}.{n}" for i in range(CFG.n_layers) for n in tp_model.BLOCK_REPLICATED}
    same = all(all(np.array_equal(g, grads[n]) for g in c.allgather_obj(grads[n])) for n in names)
    say(f"{len(names)} replicated gradients ({', '.join(names[:3])}, ...): identical on all 4 ranks: {same}")
    check(same and set(names) == listed, sorted(set(names) ^ listed))
    grid.free()


def test_on_ready_in_backward_order_with_final_gradients():
    """on_ready(group) comes in backward_order, and when it comes the group's gradients are final: equal to what they
    are after the backward pass and to the serial gradient's shards, replicated ones already identical on every rank.
    The backward accumulates (+=): two passes with loss_scale 1/2 on top of each other give the whole gradient."""
    params, idx, targets, _, grads0 = reference(CFG, batch=B)
    grid = ProcessGrid(WORLD, dp=2, tp=4)
    c = grid.tp_comm
    local = tp_shards.shard_params(params, c.rank, 4, "sequence")
    groups = {}
    for n in local:
        groups.setdefault(tp_model.param_group(n), []).append(n)
    grads = serial.zeros_like_params(local)
    tp_model.loss_and_grads(local, idx, targets, tp_model.TPSetup(CFG, c, "sequence"), grads=grads, dloss=0.5)
    seen, snapshots = [], {}

    def on_ready(group):
        seen.append(group)
        snapshots[group] = {n: grads[n].copy() for n in groups[group]}

    tp_model.loss_and_grads(local, idx, targets, tp_model.TPSetup(CFG, c, "sequence"), grads=grads, dloss=0.5,
                            on_ready=on_ready)
    final = all(np.array_equal(snapshots[gr][n], grads[n]) for gr in snapshots for n in snapshots[gr])
    err = max(rel_err(grads[n], tp_shards.shard(grads0[n], n, c.rank, 4, "sequence")) for n in grads)
    rep = [(gr, n) for gr in snapshots for n in snapshots[gr] if tp_shards.split_of(n, "sequence")[0] == "rep"]
    same = all(all(np.array_equal(s, snapshots[gr][n]) for s in c.allgather_obj(snapshots[gr][n])) for gr, n in rep)
    say(f"on_ready order {seen}; final at the call: {final}; accumulated 2 x 1/2 vs serial: rel err "
        f"{world_max(err):.1e}")
    check(seen == tp_model.backward_order(CFG) and final and same and err <= 1e-10, f"{seen} {final} {same} {err}")
    grid.free()


def test_communication_matches_the_formula():
    params, idx, targets, _, _ = reference(CFG, batch=B)
    for tp in (1, 4, 8):
        grid, _, _, _ = sequence_grads(params, idx, targets, tp)
        measured = grid.stats.counts()
        formula = tp_model.comm_formula(CFG, batch_size=B, itemsize=8, scheme="sequence")
        say(f"sequence tp={tp}: measured {measured}\n{' ' * 16}formula  {formula}")
        check(measured == formula, f"measured {measured} vs formula {formula}")
        grid.free()


def test_activation_memory_matches_the_formula_and_shrinks():
    """The bytes of the distinct arrays the forward caches (parameters excluded), per block and for the whole
    model, equal activation_formula for megatron and sequence; with tp > 1 sequence caches less, exactly 1/tp of
    tp = 1. Prints the ratio megatron / sequence next to the paper's Table 2 ratio for the same shape."""
    params, idx, targets, _, _ = reference(CFG, batch=B)
    ok = True
    for tp in (1, 2, 4, 8):
        grid = ProcessGrid(WORLD, dp=8 // tp, tp=tp)
        measured = {}
        for scheme in ("megatron", "sequence"):
            local = tp_shards.shard_params(params, grid.tp_rank, tp, scheme)
            _, caches = tp_model.forward(local, idx, targets, tp_model.TPSetup(CFG, grid.tp_comm, scheme))
            measured[scheme] = (activations.activation_bytes(caches.blocks[0], local),
                                activations.activation_bytes(caches, local))
            f = activations.activation_formula(CFG, B, 8, tp, scheme)
            ok &= measured[scheme] == (f["block"], f["model"])
        (mb, mm), (sb, sm) = measured["megatron"], measured["sequence"]
        ok &= (sb < mb and sm < mm) if tp > 1 else (sb == mb and sm == mm)
        ok &= sb * tp == activations.activation_formula(CFG, B, 8, 1, "sequence")["block"]
        paper = [activations.paper_activation_bytes(CFG.seq_len, B, CFG.d_model, CFG.n_heads, tp, sp)
                 for sp in (False, True)]
        say(f"tp={tp}: bytes per block megatron {mb}, sequence {sb} (ratio {mb / sb:.2f}; paper "
            f"{paper[0] / paper[1]:.2f}); whole forward {mm} / {sm} (ratio {mm / sm:.2f})")
        grid.free()
    check(ok)


def test_gather_activation_memory_matches_the_formula():
    """The gather scheme's projections cache their All-Gathered inputs: its measured bytes equal activation_formula
    too, and lie between megatron's and (for tp = 1) equal them."""
    params, idx, targets, _, _ = reference(CFG, batch=B)
    ok, lines = True, []
    for tp in (1, 2, 4, 8):
        grid = ProcessGrid(WORLD, dp=8 // tp, tp=tp)
        local = tp_shards.shard_params(params, grid.tp_rank, tp, "gather")
        _, caches = tp_model.forward(local, idx, targets, tp_model.TPSetup(CFG, grid.tp_comm, "gather"))
        measured = (activations.activation_bytes(caches.blocks[0], local), activations.activation_bytes(caches, local))
        f, fm = (activations.activation_formula(CFG, B, 8, tp, s) for s in ("gather", "megatron"))
        ok &= measured == (f["block"], f["model"]) and (f["block"] > fm["block"] if tp > 1 else f == fm)
        lines.append(f"tp={tp} {measured[0]}/{f['block']}")
        grid.free()
    say(f"gather: bytes per block measured/formula: {', '.join(lines)}")
    check(ok, lines)


def add_counts(total, counts):
    for k, (calls, nbytes) in counts.items():
        c0, b0 = total.get(k, (0, 0))
        total[k] = (c0 + calls, b0 + nbytes)


def test_pipeline_stages_chained_by_hand_equal_serial():
    """The sequence scheme's stage_forward / stage_backward, chained by hand over 2 pipeline stages on the same 4
    ranks of one tp group (block 0, then block 1 and the head): the first stage hands on its T-shard (B, T/tp, C),
    the shape stage_activation_shape gives, equal to the serial activation's rows of this rank; the second hands
    back dL/d(T-shard). The loss and every gradient shard equal serial's; each stage's collectives (forward and
    backward) equal comm_formula(stage=(1, first, last)). The scheme is passed as an object."""
    from hsgd.model.ops import embedding_forward
    from hsgd.tp.schemes import make_scheme
    params, idx, targets, loss0, grads0 = reference(CFG, batch=B)
    grid = ProcessGrid(WORLD, dp=2, tp=4)
    c, S = grid.tp_comm, make_scheme("sequence")
    local = tp_shards.shard_params(params, c.rank, 4, S)
    grads = serial.zeros_like_params(local)
    stages = [(range(0, 1), True, False), (range(1, 2), False, True)]
    caches, counts, inp, setup = [], [{}, {}], idx, tp_model.TPSetup(CFG, c, S)
    for s, (layers, first, last) in enumerate(stages):                     # F0, F1
        grid.stats.reset()
        inp, cache = tp_model.stage_forward(local, inp, targets, tp_model.Piece(layers, first, last), setup)
        add_counts(counts[s], grid.stats.counts())
        caches.append(cache)
        if s == 0:
            x_s = inp                                                        # (B, T/tp, C) the T-shard handed on
    dout = 1.0
    for s in (1, 0):                                                         # B1, B0
        grid.stats.reset()
        dout = tp_model.stage_backward(dout, caches[s], grads, setup)
        add_counts(counts[s], grid.stats.counts())
    x_ref, _ = embedding_forward(idx, params["wte"], params["wpe"])           # (B, T, C) serial, up to block 0
    x_ref, _ = serial.block_forward(x_ref, params, "h.0.", CFG)
    t0, Tl = 2 * c.rank, CFG.seq_len // 4
    shape = tp_model.stage_activation_shape(S, B, CFG, 4)
    x_err = float(np.abs(x_s - x_ref[:, t0:t0 + Tl]).max())
    loss_err = abs(float(inp) - loss0) / abs(loss0)
    errs = {n: rel_err(grads[n], tp_shards.shard(grads0[n], n, c.rank, 4, S)) for n in grads}
    worst = max(errs, key=errs.get)
    formulas = [tp_model.comm_formula(CFG, B, 8, S, stage=(1, first, last)) for _, first, last in stages]
    say(f"sequence, 2 stages by hand on tp=4: activation {x_s.shape} (max err vs serial {world_max(x_err):.1e}), "
        f"loss rel err {world_max(loss_err):.1e}, max grad-shard rel err {world_max(errs[worst]):.1e}; "
        f"collectives per stage == comm_formula: {counts == formulas}")
    check(x_s.shape == shape == (B, Tl, CFG.d_model) and dout is None and x_err <= 1e-12 and loss_err <= 1e-12
          and errs[worst] <= 1e-10 and counts == formulas, f"{worst} {errs[worst]:.2e} {counts} {formulas}")
    grid.free()


def test_hybrid_training_with_sequence_equals_serial_sgd():
    """Two SGD steps of the hybrid trainer (dp = 2 x tp = 4, gradient accumulation 2, "sequence") end with the
    parameters of serial SGD on the global batch."""
    from hsgd.step.trainer import HybridTrainer
    tc = float64_config(tp=4, dp=2, tp_scheme="sequence", batch_size=8, micro_batches=2, warmup=1)
    rng = np.random.default_rng(7)
    batches = [(rng.integers(0, 13, (8, 8)), rng.integers(0, 13, (8, 8))) for _ in range(2)]
    ref, _ = serial.sgd(CFG, tc, lambda step: batches[step - 1])
    grid = ProcessGrid(WORLD, dp=2, tp=4)
    trainer = HybridTrainer(CFG, grid, tc)
    for step, (idx, targets) in enumerate(batches, 1):
        trainer.step(idx, targets, step)
    err = max(float(np.abs(p - tp_shards.shard(ref[n], n, grid.tp_rank, 4, "sequence")).max())
              / max(float(np.abs(ref[n]).max()), 0.02) for n, p in trainer.params.items())
    init = serial.init_params(CFG, seed=3, dtype="float64")
    moved = max(float(np.abs(ref[n] - init[n]).max()) for n in ref)           # the steps did change the model
    say(f"hybrid dp=2 x tp=4 sequence, 2 SGD steps (parameters moved by up to {moved:.1e}): max parameter rel err "
        f"vs serial {world_max(err):.1e}")
    check(err < 1e-10 and moved > 1e-3, f"{err:.2e} {moved:.1e}")
    grid.free()


def test_bad_seq_len_is_a_clear_error():
    """seq_len = 6 does not split over tp = 4: check_tp names seq_len, tp and what works; so does the forward pass
    for a batch of that length (before any communication, so every rank raises)."""
    cfg = ModelConfig(vocab_size=13, seq_len=6, d_model=16, n_heads=8, n_layers=1, d_ff=16)
    msgs = []
    try:
        tp_shards.check_tp(cfg, 4, "sequence")
    except ConfigError as e:
        msgs.append(str(e))
    tp_shards.check_tp(cfg, 4, "megatron")                                # only "sequence" splits T
    grid = ProcessGrid(WORLD, dp=2, tp=4)
    local = tp_shards.shard_params(serial.init_params(cfg, dtype="float64"), grid.tp_rank, 4, "sequence")
    try:
        tp_model.forward(local, np.zeros((2, 6), dtype=np.int64), np.zeros((2, 6), dtype=np.int64),
                         tp_model.TPSetup(cfg, grid.tp_comm, "sequence"))
    except ConfigError as e:
        msgs.append(str(e))
    say(f"seq_len error: {msgs[0] if msgs else None}")
    check(len(msgs) == 2 and all(m.startswith("seq_len=6 is not divisible by tp=4") for m in msgs)
          and "multiple of 4 (e.g. [4, 8, 12])" in msgs[0] and "tp in [1, 2]" in msgs[0], msgs)
    grid.free()
