"""FP8 on 8 ranks, the exact mode (--fp8 hybrid with --dtype float64: the operands of every block linear cast to
E4M3 / E5M2 with the recipe's scales, everything else float64): every dp x pp x cp x tp of 8 ranks ends three steps
with the serial FP8 reference's parameters and losses to 1e-12, the serial model cast as the layout casts (its batch
computed a micro-batch of one replica at a time: the tensors current scaling takes its amax over; delayed scaling's
history reduced over the whole step). The four recipes take turns over the grid, with the three tensor-parallel
schemes, recomputation, ZeRO, the schedules and the two families (gpt2; llama with grouped-query attention where
tp <= its 4 key/value heads, as FP8 requires: hsgd.fp8.domains.check_fp8_layout); every scale is compared over the
ranks that hold its tile (--fp8-check), every rank's bytes against the step formula. Then the bugs of
hsgd.fp8.scaling.BUGS, each on a layout where it matters, named in one step by the same comparison, and the
histories carried by a checkpoint."""
import numpy as np
import pytest
from mpi4py import MPI

from hsgd.accounting.traffic import step_formula
from hsgd.model.config import ModelConfig
from hsgd.model.data import Corpus
from hsgd.tp import shards as tp_shards

from .conftest import WORLD, check, float64_config, say, world_max

pytestmark = pytest.mark.mpi(min_size=8)

CFG = ModelConfig(vocab_size=256, seq_len=32, d_model=32, n_heads=8, n_layers=4, d_ff=64)
LLAMA = ModelConfig(vocab_size=256, seq_len=32, d_model=32, n_heads=8, n_layers=4, d_ff=64, arch="llama")  # 4 kv
CORPUS = Corpus(np.random.default_rng(5).integers(0, 256, 4000, dtype=np.uint8).tobytes(), "random bytes", 32)
RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise")


def serial_run(cfg, tc):
    """The serial FP8 reference counted as layout tc counts (rank 0 computes, every rank receives): (params, losses,
    histories)."""
    out = None
    if WORLD.Get_rank() == 0:
        try:
            out = serial_sgd(cfg, tc)
        except Exception as e:                                # (said on every rank, not left in a bcast)
            out = e
    out = WORLD.bcast(out)
    if isinstance(out, Exception):
        raise out
    return out


def serial_sgd(cfg, tc):
    """The serial FP8 reference of layout tc (hsgd.fp8.reference): (params, losses, histories)."""
    from hsgd.fp8.reference import serial_fp8_sgd
    return serial_fp8_sgd(cfg, tc, lambda step: CORPUS.batch(tc.seed, step, tc.batch_size))


def compare(layout, kw, cfg=CFG, bugs=()):
    """Train `layout` (dp, pp, cp, tp) with settings kw for 3 float64 FP8 steps against the serial FP8 reference:
    (ok, message), collective; rank 0 says one line."""
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer
    dp, pp, cp, tp = layout
    tc = float64_config(**{**dict(steps=3, warmup=1, dp=dp, pp=pp, cp=cp, tp=tp, fp8="hybrid"), **kw})
    tc.validate()
    ref, losses, histories = serial_run(cfg, tc)
    grid = ProcessGrid(WORLD, dp=dp, pp=pp, tp=tp, cp=cp)
    trainer = HybridTrainer(cfg, grid, tc)
    trainer.stage.fp8.bugs = set(bugs)
    loss_err, error, same = 0.0, None, False
    try:
        for step in range(1, tc.steps + 1):
            before = grid.stats.counts()
            info = trainer.step(*CORPUS.batch(tc.seed, step, tc.batch_size), step)
            loss_err = max(loss_err, abs(info.loss - losses[step - 1]) / losses[step - 1])
        same = grid.stats.since(before) == step_formula(cfg, tc, trainer)
        if not same:
            print(f"rank {WORLD.Get_rank()}: measured {grid.stats.since(before)}\nformula  "
                  f"{step_formula(cfg, tc, trainer)}", flush=True)
    except Exception as e:                                    # (a ScaleMismatch is raised on every holder alike)
        error = f"{type(e).__name__}: {e}"
    same = WORLD.allreduce(same, op=MPI.LAND)
    errors = [e for e in WORLD.allgather(error) if e]
    err, hist_err = float("inf"), float("inf")
    if not errors:
        trainer.finish()
        mine = trainer.exchange.full_params()
        err = world_max(max(float(np.abs(p - tp_shards.shard(ref[n], n, grid.tp_rank, grid.tp, tc.tp_scheme,
                                                             cfg)).max() / max(np.abs(ref[n]).max(), 0.02))
                            for n, p in mine.items()))
        h = trainer.stage.fp8.histories
        hist_err = world_max(max([abs(a - b) / max(abs(b), 1e-30) for k in h for a, b in zip(h[k], histories[k])]
                                 + [0.0 if set(h) <= set(histories) else 1.0]))
    counts = trainer.stage.fp8.summary([WORLD]) if not errors else {}
    say(f"fp8 {tc.fp8_recipe} {cfg.arch} dp={dp} pp={pp} cp={cp} tp={tp} {kw}"
        f"{' bugs ' + str(bugs) if bugs else ''}: max param rel err vs serial FP8 {err:.1e}, loss {loss_err:.1e}, "
        f"amax histories {hist_err:.1e}; last step cast "
        f"{counts.get('values', 0)} values ({counts.get('overflow', 0)} overflowed, {counts.get('underflow', 0)} "
        f"underflowed), bytes == formula {same}" + (f"; stopped: {errors[0]}" if errors else ""))
    trainer.free()
    grid.free()
    return err, loss_err, hist_err, errors + ([] if same or errors else ["bytes != formula"])


def grid_layouts(n=8):
    """Every (dp, pp, cp, tp) of n ranks, pp up to CFG's 4 layers."""
    return [(n // (p * c * t), p, c, t) for p in (1, 2, 4) for c in (1, 2, 4, 8) for t in (1, 2, 4, 8)
            if n % (p * c * t) == 0]


def grid_settings(i, layout):
    """The settings layout i runs with: the recipes, schemes, recomputation, ZeRO and schedules in turn."""
    dp, pp, cp, tp = layout
    recipe = RECIPES[i % 4]
    kw = dict(fp8_recipe=recipe, tp_scheme=("megatron", "gather", "sequence")[i % 3],
              recompute=("none", "selective", "full")[(i // 2) % 3], micro_batches=2 if pp < 4 else 4,
              zero=i % 4, fp8_check=True)
    if kw["tp_scheme"] == "sequence" and tp > 1 and (CFG.seq_len // cp) % tp:
        kw["tp_scheme"] = "megatron"
    if recipe == "blockwise":                                 # the largest tile no piece cuts
        run = CFG.seq_len // (2 * cp) if cp > 1 else CFG.seq_len
        kw["fp8_block"] = max(b for b in (2, 4, 8) if (CFG.d_model // tp) % b == 0 and run % b == 0)
    if recipe == "delayed":
        kw["fp8_history"] = 2
    if pp > 1:
        kw["schedule"] = ("1f1b", "gpipe", "zb-h1", "interleaved")[i % 4] if pp == 2 else ("1f1b", "zb-h1")[i % 2]
        if kw["schedule"] == "interleaved":
            kw["virtual_stages"] = 2
        if kw["schedule"] == "zb-h1":
            kw["zero"] = min(kw["zero"], 1)
    return kw


@pytest.mark.parametrize("i, layout", list(enumerate(grid_layouts())),
                         ids=[f"dp{d}-pp{p}-cp{c}-tp{t}" for d, p, c, t in grid_layouts()])
def test_every_layout_of_8_ranks_equals_the_serial_fp8_reference(i, layout):
    cfg = LLAMA if (i + i // 4) % 2 and layout[3] <= LLAMA.n_kv_heads else CFG   # each recipe on both families
    err, loss_err, hist_err, errors = compare(layout, grid_settings(i, layout), cfg)
    check(not errors and err <= 1e-12 and loss_err <= 1e-12 and hist_err <= 1e-12,
          f"{layout}: {errors} {err} {loss_err} {hist_err}")


GATHER_CASES = [  # (layout, settings): ZeRO-3 sending the block linears' weights as FP8 codes
    ((8, 1, 1, 1), dict(fp8_recipe="tensorwise")),
    ((2, 1, 2, 2), dict(fp8_recipe="delayed", fp8_history=2, tp_scheme="sequence", recompute="full")),
    ((4, 1, 1, 2), dict(fp8_recipe="tensorwise", micro_batches=2, hierarchical=True, ranks_per_node=2)),
]


@pytest.mark.parametrize("layout, kw", GATHER_CASES, ids=[f"dp{d}-cp{c}-tp{t}" for (d, p, c, t), _ in GATHER_CASES])
def test_zero_3_sending_fp8_weights_equals_the_serial_fp8_reference(layout, kw):
    """--zero 3 --fp8-allgather (hsgd.dp.fp8_gather): each rank casts its chunk of the weights with the scale agreed
    over the shards (and tp) and sends one byte a value; the values are the serial FP8 reference's casts, so the
    run equals it to 1e-12, its bytes the step formula's (the gathers' bytes included), every scale checked."""
    err, loss_err, hist_err, errors = compare(layout, dict(kw, zero=3, fp8_allgather=True, fp8_check=True))
    check(not errors and err <= 1e-12 and loss_err <= 1e-12 and hist_err <= 1e-12,
          f"{layout}: {errors} {err} {loss_err} {hist_err}")


BUG_CASES = [  # (bug, layout, settings): a layout where the bug changes a scale
    ("amax-local-shard", (4, 1, 1, 2), dict(fp8_recipe="tensorwise")),
    ("amax-local-shard", (4, 1, 1, 2), dict(fp8_recipe="tensorwise", zero=3, fp8_allgather=True)),
    ("amax-dp-only", (2, 1, 1, 4), dict(fp8_recipe="delayed", fp8_history=2)),
    ("amax-no-sp-reduce", (2, 1, 1, 4), dict(fp8_recipe="tensorwise", tp_scheme="sequence")),
]


@pytest.mark.parametrize("bug, layout, kw", BUG_CASES,
                         ids=[b + ("-sent-in-fp8" if kw.get("fp8_allgather") else "") for b, _, kw in BUG_CASES])
def test_a_scale_taken_over_the_wrong_ranks_is_named_in_one_step(bug, layout, kw):
    """Each bug, one step: the exact mode differs from the serial FP8 reference by whole FP8 steps (the parameters,
    or delayed scaling's histories, which the next step casts with); with --fp8-check the run stops with
    ScaleMismatch naming the operand whose holders disagree (in the step the wrong scale is first used)."""
    err, loss_err, hist_err, errors = compare(layout, dict(kw, steps=1), bugs=[bug])
    caught = max(err, hist_err) > 1e-6 and not errors
    err2, _, _, errors2 = compare(layout, dict(kw, steps=2, fp8_check=True), bugs=[bug])
    named = bool(errors2) and all("ScaleMismatch" in e for e in errors2)
    say(f"{bug}: exact mode after one step: params {err:.1e}, histories {hist_err:.1e}; --fp8-check: "
        f"{errors2[0] if errors2 else 'nothing raised'}")
    check(caught and named, f"{bug}: {err} {hist_err} {errors} {errors2}")


def test_a_resume_carries_the_amax_histories_bit_exactly():
    """Delayed scaling, saved after step 1 by dp 2 x tp 4, which goes on to step 3: resumed by the same layout for
    steps 2 and 3, the same bits; resumed by dp 4 x pp 2 (another layout: the histories are one per tensor, read by
    name; the output gradients' scaled by dp'/dp = 2, hsgd.checkpoint.store.load_fp8), the serial FP8 reference's
    parameters and histories (counted as dp 2 counts) to 1e-12; with the bug "stale-history" (a resume that drops
    them) the steps after the resume differ."""
    import tempfile
    from hsgd.checkpoint import store
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer
    base = dict(fp8="hybrid", fp8_recipe="delayed", fp8_history=2)
    tc = float64_config(steps=3, warmup=1, dp=2, tp=4, **base)
    ref, _, histories = serial_run(CFG, tc)
    folder = WORLD.bcast(tempfile.mkdtemp() if WORLD.Get_rank() == 0 else None)

    def run(layout, bugs=(), save=False, resume=None):
        dp, pp, tp = layout
        grid = ProcessGrid(WORLD, dp=dp, pp=pp, tp=tp)
        trainer = HybridTrainer(CFG, grid, float64_config(steps=3, warmup=1, dp=dp, pp=pp, tp=tp, **base))
        trainer.stage.fp8.bugs = set(bugs)
        start, path = 1, None
        if resume:
            start = store.load(trainer, store.open_checkpoint(resume, CFG)) + 1
        for s in range(start, 4):
            trainer.step(*CORPUS.batch(tc.seed, s, tc.batch_size), s)
            if save and s == 1:
                path = store.save(trainer, 1, folder)
        trainer.finish()
        out = (trainer.exchange.full_params(), dict(trainer.stage.fp8.histories), path)
        trainer.free()
        grid.free()
        return out

    straight, _, path = run((2, 1, 4), save=True)
    same, _, _ = run((2, 1, 4), resume=path)
    bits = WORLD.allreduce(all(np.array_equal(straight[n], same[n]) for n in straight), op=MPI.LAND)
    errs = []
    for bugs in ((), ("stale-history",)):
        mine, h, _ = run((4, 2, 1), bugs, resume=path)
        errs.append(world_max(max(float(np.abs(p - ref[n]).max() / max(np.abs(ref[n]).max(), 0.02))
                                  for n, p in mine.items())))
        errs.append(world_max(max(abs(a * (0.5 if k.endswith(":dy") else 1.0) - b) / b for k in h
                                  for a, b in zip(h[k], histories[k]))))
    say(f"delayed scaling saved by dp 2 x tp 4 after step 1: resumed by the same layout, the same bits as straight "
        f"through {bits}; resumed by dp 4 x pp 2: params vs serial FP8 {errs[0]:.1e}, histories {errs[1]:.1e}; "
        f"resumed without its histories (stale-history): params {errs[2]:.1e}, histories {errs[3]:.1e}")
    check(bits and errs[0] <= 1e-12 and errs[1] <= 1e-12 and errs[2] > 1e-6 and errs[3] > 1e-6, str(errs))
