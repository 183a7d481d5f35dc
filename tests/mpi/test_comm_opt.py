"""Communication optimizations on 8 ranks, float64: overlapped buckets, ZeRO 1/2, hierarchical all-reduce and
stragglers change nothing in the result (equal to serial SGD and to the plain path); staleness 1 equals a serial
simulation of delayed SGD; every mode's measured bytes equal its formula; ZeRO's optimizer state falls by dp."""

import numpy as np
import pytest
from hsgd.model.config import ModelConfig
from hsgd.tp import model as tp_model, shards as tp_shards
from hsgd.model.data import Corpus
from hsgd.grid.trace import Tracer, overlap_seconds

from .conftest import WORLD, check, float64_config, say, serial_params, train_steps, world_max

pytestmark = pytest.mark.mpi(min_size=8)

CFG = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=8, n_layers=2, d_ff=16)
CORPUS = Corpus(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes(), "random bytes", 8)
STEPS = 4


def config(**kw):
    return float64_config(**{**dict(steps=STEPS, batch_size=8, warmup=2), **kw})


def serial_sgd(tc, delayed=False):
    """Serial mini-batch SGD on the global batch (shared: conftest.serial_params); delayed=True applies step s's
    gradient at step s+1 (nothing at step 1): w_{s+1} = w_s - lr_s * g(w_{s-1}), the update of --dp-staleness 1."""
    return serial_params(CFG, CORPUS, tc, delayed)


def run(tc, tracer=None):
    return train_steps(CFG, CORPUS, tc, tracer)


def param_err(trainer, grid, ref, scheme="megatron"):
    """Max over parameters of max |p - ref shard| / max(max |ref|, 0.02) (k-biases stay ~0: see test_hybrid)."""
    return max(float(np.abs(p - tp_shards.shard(ref[n], n, grid.tp_rank, grid.tp, scheme)).max()
                     / max(np.abs(ref[n]).max(), 0.02)) for n, p in trainer.params.items())


def expected_bytes(trainer, tc):
    f = dict(tp_model.comm_formula(CFG, tc.batch_size // tc.dp // tc.micro_batches, 8, tc.tp_scheme))
    f = {k: (v[0] * tc.micro_batches, v[1] * tc.micro_batches) for k, v in f.items()}
    f.update(trainer.exchange.sizes.formula())
    return f


MODES = {
    "overlap": dict(dp_overlap=True),
    "zero1": dict(zero=1),
    "zero2": dict(zero=2, optimizer="adamw", lr=0.01, weight_decay=0.1, clip=0.5),
    "hier2": dict(hierarchical=True, ranks_per_node=2),
    "hier-default": dict(hierarchical=True),
    "straggler": dict(straggler="5:20"),
}


PLAIN = {}                          # repr(plain TrainConfig) -> its parameters: modes with the same plain run share it


def plain_run_params(plain):
    """This rank's parameters after the plain data-parallel run `plain`, run once for all the modes it serves (ZeRO 1,
    the hierarchical modes and the straggler compare with the same plain run)."""
    key = repr(plain)
    if key not in PLAIN:
        grid0, trainer0, _, _ = run(plain)
        PLAIN[key] = {n: p.copy() for n, p in trainer0.params.items()}
        grid0.free()
    return PLAIN[key]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("tp, dp", [(2, 4), (1, 8)])
def test_mode_equals_serial_and_plain_and_its_formula(mode, tp, dp):
    extra = MODES[mode]
    k = 2 if mode == "overlap" else 1                                 # overlap: only the last micro-batch overlaps
    tc = config(tp=tp, dp=dp, micro_batches=k, batch_size=8 * k, **extra)
    plain = config(tp=tp, dp=dp, micro_batches=k, batch_size=8 * k,
                   **{key: v for key, v in extra.items() if key in ("optimizer", "lr", "weight_decay", "clip")})
    ref = serial_sgd(tc)
    grid, trainer, identical, per_step = run(tc)
    err = param_err(trainer, grid, ref)
    formula = expected_bytes(trainer, tc)
    grid.free()
    trainer.free()
    plain_params = plain_run_params(plain)
    vs_plain = max(float(np.abs(trainer.params[n] - plain_params[n]).max()) for n in trainer.params)
    say(f"{mode} tp={tp} dp={dp}: param rel err vs serial {world_max(err):.1e}, max diff vs plain DP "
        f"{world_max(vs_plain):.1e}, replicas identical {identical}, bytes == formula {per_step == formula}")
    check(err <= 1e-9 and vs_plain <= 1e-12 and identical and per_step == formula,
          f"err {err:.1e} plain {vs_plain:.1e} identical {identical}\nmeasured {per_step}\nformula  {formula}")


def test_staleness_equals_delayed_serial_sgd():
    for tp, dp in ((2, 4), (1, 8)):
        tc = config(tp=tp, dp=dp, dp_staleness=1, steps=5)
        ref = serial_sgd(tc, delayed=True)
        grid, trainer, identical, per_step = run(tc)
        err = param_err(trainer, grid, ref)
        nbytes = int(trainer.exchange.buf.flat.nbytes)
        say(f"staleness 1 tp={tp} dp={dp}: param rel err vs delayed serial SGD {world_max(err):.1e}")
        check(err <= 1e-9 and identical and per_step.get(("dp", "Iallreduce")) == (1, nbytes), f"{err:.1e}")
        grid.free()


def test_zero_shards_the_optimizer_state_by_dp():
    mems, sizes = {}, {}
    for zero in (0, 1, 2):
        grid, trainer, _, _ = run(config(tp=2, dp=4, zero=zero, optimizer="adamw", lr=0.01, steps=2))
        mems[zero], sizes[zero] = trainer.memory(), trainer.exchange.sizes.size       # elements (ZeRO: padded)
        grid.free()
    n, chunk, chunks2 = sizes[0], sizes[1] // 4, sizes[2] // 4          # ceil(n / dp); ZeRO-2: per layer
    full, z1, z2 = mems[0]["optimizer"], mems[1]["optimizer"], mems[2]["optimizer"]
    say(f"optimizer state per rank (AdamW, dp=4): plain {full:,} B, ZeRO-1 {z1:,} B, ZeRO-2 {z2:,} B; gradients kept: "
        f"plain {mems[0]['grads']:,} B, ZeRO-1 {mems[1]['grads']:,} B, ZeRO-2 {mems[2]['grads']:,} B")
    # AdamW keeps two float64 moments per element it updates: all n elements, or the chunk of ceil(n / dp)
    # (ZeRO-2: the chunks of ceil(n_g / dp) of every layer's bucket, padded layer by layer)
    check(full == 16 * n and z1 == 16 * chunk and z2 == 16 * chunks2 and sizes[1] - n < 4
          and 0 <= sizes[2] - n < 4 * len(trainer.exchange.groups) and mems[2]["grads"] == 8 * chunks2
          and mems[1]["grads"] == 8 * (sizes[1] + chunk), f"{mems} n={n} chunk={chunk} chunks2={chunks2}")


def test_overlap_is_visible_in_the_trace():
    tracer = Tracer(WORLD.Get_rank(), WORLD)
    grid, trainer, _, _ = run(config(tp=2, dp=4, dp_overlap=True, steps=2), tracer)
    events = tracer.chrome_events()
    overlap = overlap_seconds(events, WORLD.Get_rank())
    n_async = sum(1 for e in events if e.get("ph") == "X" and e["name"] == "Iallreduce")
    say(f"Iallreduce in flight during compute: {world_max(overlap) * 1e3:.1f} ms (max over ranks), "
        f"{n_async} requests traced on rank 0")
    check(overlap > 0 and n_async == 2 * len(trainer.exchange.buckets))
    grid.free()


def test_straggler_delays_only_its_rank():
    tracer = Tracer(WORLD.Get_rank(), WORLD)
    grid, trainer, _, _ = run(config(tp=2, dp=4, straggler="5:10", steps=2), tracer)
    delays = [e for e in tracer.chrome_events() if e.get("name") == "straggler delay"]
    check(len(delays) == (2 if WORLD.Get_rank() == 5 else 0), f"{len(delays)} delay spans")
    grid.free()


def test_zero_checkpoint_resumes_bit_identical():
    """ZeRO 2 with AdamW: stopped after step 2, saved (every DP rank's optimizer chunk gathered into the per-name
    state), resumed in the same layout: the parameters after step 4 are bit-identical to the uninterrupted run's;
    resumed without ZeRO (the state cut by name instead of by chunk): equal to rounding."""
    import shutil
    import tempfile

    from hsgd.checkpoint import store as checkpoint
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer

    tc = config(tp=2, dp=4, zero=2, optimizer="adamw", lr=0.01, weight_decay=0.1, clip=0.5, steps=4)
    where = WORLD.bcast(tempfile.mkdtemp() if WORLD.Get_rank() == 0 else None)

    def steps(trainer, first, last):
        for step in range(first, last + 1):
            trainer.step(*CORPUS.batch(tc.seed, step, tc.batch_size), step)

    finals = {}
    for name, resumed in (("uninterrupted", None), ("zero 2", tc), ("no zero", config(**{**vars(tc), "zero": 0}))):
        grid = ProcessGrid(WORLD, dp=tc.dp, tp=tc.tp)
        trainer = HybridTrainer(CFG, grid, tc)
        steps(trainer, 1, 2 if resumed else 4)
        if resumed:
            path = checkpoint.save(trainer, 2, where)
            grid.free()
            grid = ProcessGrid(WORLD, dp=tc.dp, tp=tc.tp)
            trainer = HybridTrainer(CFG, grid, resumed)
            checkpoint.load(trainer, checkpoint.open_checkpoint(path, CFG))
            steps(trainer, 3, 4)
        finals[name] = {n: p.copy() for n, p in trainer.params.items()}
        grid.free()
    ref = finals["uninterrupted"]
    same = all(np.array_equal(finals["zero 2"][n], ref[n]) for n in ref)
    plain = max(float(np.abs(finals["no zero"][n] - ref[n]).max()) for n in ref)
    say(f"ZeRO 2 AdamW resumed after step 2: bit-identical {world_max(not same) == 0}; resumed without ZeRO: max "
        f"|difference| {world_max(plain):.1e}")
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(where, ignore_errors=True)
    check(same and plain <= 1e-13, f"bit-identical {same}, without ZeRO {plain:.1e}")
