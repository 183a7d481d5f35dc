"""Context parallelism on 8 ranks, float64: every factorization dp x pp x cp x tp of 8 with cp > 1 ends several
steps with serial SGD's parameters for the cp schemes (ring, allgather, ulysses; a2a+p2p where cp = a x r with a, r
> 1: cp 4 and 8), the three tensor-parallel schemes taking turns; every rank's bytes (cp_comm and a2a+p2p's
sub-communicators included) equal the formulas; ring attention, the all-gather variant, Ulysses' all-to-all and
a2a+p2p equal the serial attention output and gradients on their positions, for the load-balanced and the plain
split (Ulysses and a2a+p2p with grouped-query kv heads too); the balanced split gives every rank the same attention
work (counted), the plain one cp times more to the last rank; the ring's sends are in flight while its blocks are
computed (traced)."""
import numpy as np
import pytest
from mpi4py import MPI

from hsgd.model.config import ModelConfig
from hsgd.cp import split
from hsgd.cp.hierarchical import group_scores
from hsgd.cp.layouts import make_split
from hsgd.model import layers
from hsgd.tp import shards as tp_shards
from hsgd.model.data import Corpus
from hsgd.grid.process_grid import ProcessGrid
from hsgd.accounting.activations import activation_formula
from hsgd.grid.trace import Tracer
from hsgd.accounting.traffic import step_formula

from .conftest import WORLD, check, float64_config, say, serial_params, train_steps, world_max

pytestmark = pytest.mark.mpi(min_size=8)

CFG = ModelConfig(vocab_size=256, seq_len=16, d_model=16, n_heads=8, n_layers=4, d_ff=16)
CORPUS = Corpus(np.random.default_rng(1).integers(0, 256, 4000, dtype=np.uint8).tobytes(), "random bytes", 16)
TP_SCHEMES = ("megatron", "gather", "sequence")


def layouts(n=8):
    """Every (dp, pp, cp, tp) with dp pp cp tp = n and cp > 1 that CFG allows (pp up to its 4 layers)."""
    return [(n // (p * c * t), p, c, t) for p in (1, 2, 4) for c in (2, 4, 8) for t in (1, 2, 4, 8)
            if n % (p * c * t) == 0 and p <= CFG.n_layers]


def config(**kw):
    return float64_config(**{**dict(steps=3, micro_batches=2, warmup=1), **kw})


def serial_sgd(tc):
    """Serial SGD's parameters after tc.steps steps on this file's model and batches (shared: conftest)."""
    return serial_params(CFG, CORPUS, tc)


def param_err(trainer, grid, ref, scheme):
    """Collective (ZeRO-3 gathers this rank's shards over dp_comm): the largest relative error of a shard."""
    mine = trainer.exchange.full_params()
    return max(float(np.abs(p - tp_shards.shard(ref[n], n, grid.tp_rank, grid.tp, scheme)).max()
                     / max(np.abs(ref[n]).max(), 0.02)) for n, p in mine.items())


@pytest.mark.parametrize("i, layout", list(enumerate(layouts())), ids=[f"dp{d}-pp{p}-cp{c}-tp{t}"
                                                                        for d, p, c, t in layouts()])
def test_every_layout_with_cp_equals_serial_sgd(i, layout):
    """Every cp scheme on one layout: 3 steps equal serial SGD's parameters (1e-10), the replicas (dp x cp ranks)
    stay bit-identical, the bytes of step 2 on every communicator equal step_formula's; without a pipeline, the
    activation bytes held at the peak of a 4th step equal hsgd.accounting.activations.activation_formula's."""
    dp, pp, cp, tp = layout
    scheme = TP_SCHEMES[i % 3]
    ref, lines, ok, params = None, [], True, {}
    for cp_scheme in [c for c in split.CP_SCHEMES if c != "a2a+p2p" or split.a2a_sizes(cp)[0] > 1]:
        tc = config(dp=dp, pp=pp, cp=cp, tp=tp, tp_scheme=scheme, cp_scheme=cp_scheme)
        ref = ref or serial_sgd(tc)
        grid, trainer, identical, per_step = train_steps(CFG, CORPUS, tc)
        err = world_max(param_err(trainer, grid, ref, scheme))
        formula = step_formula(CFG, tc, trainer)
        same = WORLD.allreduce(per_step == formula, op=MPI.LAND)
        params[cp_scheme] = {n: p.copy() for n, p in trainer.params.items()}
        if pp == 1:                  # one step more, measured: the caches of one micro-batch at the peak
            trainer.stage.measure_bytes = True
            trainer.step(*CORPUS.batch(tc.seed, tc.steps + 1, tc.batch_size), tc.steps + 1)
            b = tc.batch_size // dp // tc.micro_batches
            act = activation_formula(CFG, b, 8, tp, scheme, cp, cp_scheme)["model"]
            ok &= WORLD.allreduce(trainer.stage.peak_bytes == act, op=MPI.LAND)
            lines.append(f"  {cp_scheme:<9}: activation bytes at the peak {trainer.stage.peak_bytes} (formula {act})")
        cp_bytes = sorted((op, v) for (c, op), v in per_step.items() if c == "cp")
        lines.append(f"  {cp_scheme:<9}: max param rel err vs serial {err:.1e}, replicas identical {identical}, "
                     f"bytes == formula {same} (cp_comm: {cp_bytes})")
        ok &= err <= 1e-10 and identical and same
        if not same:
            say(f"measured {per_step}\nformula  {formula}")
        trainer.stage.ctx.free()
        trainer.free()
        grid.free()
    apart = world_max(max(float(np.abs(params["ring"][n] - p).max()) for other in list(params)[1:]
                          for n, p in params[other].items()))
    say(f"dp={dp} pp={pp} cp={cp} tp={tp} ({scheme}), 3 steps of 2 micro-batches:\n" + "\n".join(lines)
        + f"\n  ring against {', '.join(list(params)[1:])}: max param diff {apart:.1e}")
    check(ok and apart <= 1e-12)


@pytest.mark.parametrize("layout, kw", [
    ((2, 1, 2, 2), dict(zero=3, recompute="full")),
    ((2, 1, 2, 2), dict(zero=2, recompute="selective", cp_scheme="allgather", tp_scheme="sequence")),
    ((1, 2, 2, 2), dict(schedule="zb-h1", micro_batches=4, dp_overlap=True)),
    ((1, 2, 4, 1), dict(schedule="interleaved", virtual_stages=2, micro_batches=4, recompute="selective",
                        cp_scheme="ulysses")),
    ((2, 1, 2, 2), dict(hierarchical=True, ranks_per_node=2, cp_scheme="ulysses", recompute="full")),
    ((4, 1, 2, 1), dict(zero=1, optimizer="adamw", lr=0.01, tp_scheme="gather", cp_scheme="allgather")),
    ((1, 1, 4, 2), dict(recompute="full", cp_scheme="a2a+p2p", tp_scheme="sequence")),
], ids=["zero3-full", "zero2-selective-allgather-sequence", "zb-h1-overlap", "interleaved-selective-ulysses",
        "hier-full-ulysses", "zero1-adamw-allgather-gather", "full-a2a+p2p-sequence"])
def test_cp_with_zero_recompute_and_the_schedules(layout, kw):
    dp, pp, cp, tp = layout
    tc = config(dp=dp, pp=pp, cp=cp, tp=tp, batch_size=16, **kw)
    ref = serial_sgd(tc)
    grid, trainer, identical, per_step = train_steps(CFG, CORPUS, tc)
    err = world_max(param_err(trainer, grid, ref, tc.tp_scheme))
    same = WORLD.allreduce(per_step == step_formula(CFG, tc, trainer), op=MPI.LAND)
    say(f"dp={dp} pp={pp} cp={cp} tp={tp} {kw}: max param rel err vs serial {err:.1e}, bytes == formula {same}")
    check(err <= 1e-10 and same)
    trainer.stage.ctx.free()
    trainer.free()
    grid.free()


def attention_case(grid, scheme, balanced, B=2, nh=4, hs=3, T=32, seed=0, nkv=None):
    """A cp scheme's attention on this rank's positions against the serial attention of the whole sequence:
    (max rel error of y, dq, dk, dv; the context split, for its work counts). nkv: grouped-query kv heads (the
    serial reference reads them repeated, and sums the repeated heads' gradients)."""
    rng = np.random.default_rng(seed)
    C, nkv = nh * hs, nkv or nh
    q, dy = (rng.standard_normal((B, T, C)) for _ in range(2))
    k, v = (rng.standard_normal((B, T, nkv * hs)) for _ in range(2))
    rep = lambda a: np.repeat(a.reshape(B, T, nkv, 1, hs), nh // nkv, axis=3).reshape(B, T, C)    # noqa: E731
    y0, cache0 = layers.attention_forward(q, rep(k), rep(v), nh)
    dq0, dk0, dv0 = layers.attention_backward(dy, cache0)
    grads0 = [dq0] + [d.reshape(B, T, nkv, nh // nkv, hs).sum(axis=3).reshape(B, T, nkv * hs) for d in (dk0, dv0)]
    ctx = make_split(scheme, grid.cp_comm, T, balanced=balanced)
    pos = ctx.pos
    y, cache = ctx.attention_forward(q[:, pos], k[:, pos], v[:, pos], nh)
    grads = ctx.attention_backward(dy[:, pos], cache)
    err = max(float(np.abs(a - b[:, pos]).max() / np.abs(b).max()) for a, b in zip((y, *grads), (y0, *grads0)))
    return err, ctx


def test_the_cp_schemes_attention_equals_the_serial_attention_and_the_work_is_balanced():
    """a2a+p2p on cp 4 is 2 groups of 2 (a2a_sizes): its work, counted per head of the rank's, is its group's
    (hsgd.cp.hierarchical.group_scores), the ring's on every rank with the balanced split."""
    grid = ProcessGrid(WORLD, dp=1, pp=1, tp=2, cp=4)                 # 2 rings of 4, side by side
    cp, T, ok, lines = grid.cp, 32, True, []
    a = split.a2a_sizes(cp)[0]
    for balanced in (True, False):
        for scheme in split.CP_SCHEMES + ("ulysses gqa", "a2a+p2p gqa"):   # 8 query heads on 4 kv heads too
            gqa = scheme.endswith("gqa")
            err, ctx = attention_case(grid, scheme.split()[0], balanced, nh=8 if gqa else 4, nkv=4 if gqa else None)
            work = grid.cp_comm.comm.allgather(ctx.work["forward"])
            expect = [split.attention_blocks(T, cp, r, balanced) for r in range(cp)]
            good = err <= 1e-12
            if scheme == "ring":                                      # the ring skips the masked chunk pairs
                good &= work == expect and ctx.work["backward"] == ctx.work["forward"]
            if scheme.startswith("a2a+p2p"):                          # and so does a2a+p2p's ring of groups
                groups = [group_scores(T, cp, a, r // a, balanced) for r in range(cp)]
                good &= work == groups and ctx.work["backward"] == ctx.work["forward"]
                good &= not balanced or groups == expect
                ctx.free()
            lines.append(f"  {'balanced' if balanced else 'plain':<8} {scheme:<11}: max rel err {world_max(err):.1e}; "
                         f"scores per rank {work}")
            ok &= good
    blocks = [split.attention_blocks(T, cp, r) for r in range(cp)]
    plain = [split.attention_blocks(T, cp, r, balanced=False) for r in range(cp)]
    c = T // (2 * cp)
    ok &= blocks == [(2 * cp + 1) * c * c] * cp and plain == [(r + 1) * (T // cp) ** 2 for r in range(cp)]
    say(f"cp={cp}, T={T}, float64:\n" + "\n".join(lines) + f"\n  the formula: balanced {blocks}, plain {plain} "
        f"(last / first = {plain[-1] / plain[0]:.0f} = cp)")
    check(ok)
    grid.free()


def test_the_work_is_equal_in_training_and_the_plain_split_would_not_be():
    """One training step on cp 8: every rank computed the same number of attention scores, the formula's."""
    tc = config(dp=1, pp=1, cp=8, tp=1, steps=1, micro_batches=1)
    grid, trainer, _, _ = train_steps(CFG, CORPUS, tc)
    ctx = trainer.stage.ctx
    work = WORLD.allgather(ctx.work["forward"])
    expect = CFG.n_layers * split.attention_blocks(CFG.seq_len, 8, 0)  # one attention per block (m = 1)
    say(f"cp=8, one step: forward scores per rank {work} (formula {expect} each)")
    check(work == [expect] * 8)
    trainer.free()
    grid.free()


def test_the_ring_sends_overlap_its_blocks():
    """A Tracer on cp_comm: in every ring step but the last, the next (k, v) block's Isend is in flight while the
    step's block is computed (forward), and the same for the backward pass's (k, v)."""
    grid = ProcessGrid(WORLD, dp=1, pp=1, tp=1, cp=8)
    tracer = Tracer(WORLD.Get_rank(), WORLD)
    grid.cp_comm.tracer = tracer
    attention_case(grid, "ring", True, B=4, nh=2, hs=8, T=64)
    blocks = [(n, t0, t1) for n, tr, t0, t1, _ in tracer.events if tr == "compute"]
    sends = [(t0, t1) for n, tr, t0, t1, _ in tracer.events if tr == "async" and n == "Isend"]
    fwd = [b for b in blocks if b[0] == "attention block"]
    bwd = [b for b in blocks if b[0] == "attention block (backward)"]
    overlapped = lambda bs: sum(any(s0 <= t0 and s1 >= t1 for s0, s1 in sends) for _, t0, t1 in bs[:-1])
    n_f, n_b = overlapped(fwd), overlapped(bwd)
    say(f"cp=8 ring: forward blocks with a send in flight from before to after them {n_f}/{len(fwd) - 1}, "
        f"backward {n_b}/{len(bwd) - 1} (rank 0)")
    check(len(fwd) == 8 and len(bwd) == 8 and n_f == 7 and n_b == 7)
    grid.free()
