"""FP8 on 8 ranks, the exact mode (--fp8 hybrid with --dtype float64: the operands of every block linear cast to
E4M3 / E5M2 with the recipe's scales, everything else float64): every dp x pp x cp x tp of 8 ranks ends three steps
with the serial FP8 reference's parameters and losses to 1e-12, the serial model cast as the layout casts (its batch
computed a micro-batch of one replica at a time: the tensors current scaling takes its amax over; delayed scaling's
history reduced over the whole step). The four recipes take turns over the grid, with the three tensor-parallel
schemes, recomputation, ZeRO and the schedules; every scale is compared over the ranks that hold its tile
(--fp8-check). Then the bugs of hsgd.fp8.scaling.BUGS, each on a layout where it matters, named in one step by the
same comparison, and the histories carried by a checkpoint."""
import numpy as np
import pytest

from hsgd.model.config import ModelConfig
from hsgd.model.data import Corpus
from hsgd.tp import shards as tp_shards

from .conftest import WORLD, check, float64_config, say, world_max

pytestmark = pytest.mark.mpi(min_size=8)

CFG = ModelConfig(vocab_size=256, seq_len=32, d_model=32, n_heads=8, n_layers=4, d_ff=64)
CORPUS = Corpus(np.random.default_rng(5).integers(0, 256, 4000, dtype=np.uint8).tobytes(), "random bytes", 32)
RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise")


def fp8_of(tc):
    from hsgd.fp8.scaling import make_fp8
    return make_fp8(tc.fp8_settings())


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
    """serial.sgd through the FP8 products (hsgd.fp8.linear.Fp8Ops around the plain layers), a micro-batch of one
    replica at a time, the histories moving on after each step: (params, losses, histories)."""
    from hsgd.fp8.linear import Fp8Ops
    from hsgd.model import layers, serial
    fp8 = fp8_of(tc)
    params = serial.init_params(cfg, seed=tc.seed, dtype="float64")
    ops = Fp8Ops(layers, fp8)
    ops.bind(params)
    params, losses = serial.sgd(cfg, tc, lambda step: CORPUS.batch(tc.seed, step, tc.batch_size), params,
                                micro_sequences=tc.batch_size // (tc.dp * tc.micro_batches), ops=ops,
                                after_step=fp8.end_step, replicas=tc.dp * tc.cp)
    return params, losses, fp8.histories


def compare(layout, kw, cfg=CFG, bugs=()):
    """Train `layout` (dp, pp, cp, tp) with settings kw for 3 float64 FP8 steps against the serial FP8 reference:
    (ok, message), collective; rank 0 says one line."""
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer
    dp, pp, cp, tp = layout
    tc = float64_config(steps=3, warmup=1, dp=dp, pp=pp, cp=cp, tp=tp, fp8="hybrid", **kw)
    tc.validate()
    ref, losses, histories = serial_run(cfg, tc)
    grid = ProcessGrid(WORLD, dp=dp, pp=pp, tp=tp, cp=cp)
    trainer = HybridTrainer(cfg, grid, tc)
    trainer.stage.fp8.bugs = set(bugs)
    loss_err, error = 0.0, None
    try:
        for step in range(1, tc.steps + 1):
            info = trainer.step(*CORPUS.batch(tc.seed, step, tc.batch_size), step)
            loss_err = max(loss_err, abs(info.loss - losses[step - 1]) / losses[step - 1])
    except Exception as e:                                    # (a ScaleMismatch is raised on every holder alike)
        error = f"{type(e).__name__}: {e}"
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
    say(f"fp8 {tc.fp8_recipe} dp={dp} pp={pp} cp={cp} tp={tp} {kw}{' bugs ' + str(bugs) if bugs else ''}: max "
        f"param rel err vs serial FP8 {err:.1e}, loss {loss_err:.1e}, amax histories {hist_err:.1e}; last step cast "
        f"{counts.get('values', 0)} values ({counts.get('overflow', 0)} overflowed, {counts.get('underflow', 0)} "
        f"underflowed)" + (f"; stopped: {errors[0]}" if errors else ""))
    trainer.free()
    grid.free()
    return err, loss_err, hist_err, errors


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
    err, loss_err, hist_err, errors = compare(layout, grid_settings(i, layout))
    check(not errors and err <= 1e-12 and loss_err <= 1e-12 and hist_err <= 1e-12,
          f"{layout}: {errors} {err} {loss_err} {hist_err}")
