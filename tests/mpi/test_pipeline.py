"""Pipeline parallelism and 3-D grids on 8 ranks, float64: every factorization (dp, pp, tp) of 8 ends several
steps with the parameters of serial SGD; GPipe and 1F1B give the same numbers for m in {1, p, 2p}; the stages
hold the micro-batches the schedules promise; every stage's bytes equal the formulas."""

import dataclasses
import hashlib

import numpy as np
import pytest
from mpi4py import MPI
from hsgd.model.config import ModelConfig
from hsgd.pp.chunks import split_layers
from hsgd.pp.schedules import build, simulate
from hsgd.pp.timelines import bubble_formula, bubble_fraction, peak_held, picture
from hsgd.tp import shards as tp_shards
from hsgd.model.data import Corpus
from hsgd.grid.process_grid import factorizations
from hsgd.accounting.traffic import step_formula

from .conftest import WORLD, check, float64_config, say, serial_params, train_steps, world_max

pytestmark = pytest.mark.mpi(min_size=8)

CFG = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=8, n_layers=8, d_ff=16)
CORPUS = Corpus(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes(), "random bytes", 8)


def config(**kw):
    return float64_config(**{**dict(steps=3, micro_batches=2, warmup=1, seed=5), **kw})


def serial_sgd(tc):
    """Serial SGD's parameters after tc.steps steps on this file's model and batches (shared: conftest)."""
    return serial_params(CFG, CORPUS, tc)


def run(tc):
    return train_steps(CFG, CORPUS, tc)


def param_err(trainer, grid, ref, scheme="megatron"):
    return max(float(np.abs(p - tp_shards.shard(ref[n], n, grid.tp_rank, grid.tp, scheme)).max()
                     / max(np.abs(ref[n]).max(), 0.02)) for n, p in trainer.params.items())


LAYOUTS = [(dp, pp, tp, scheme) for scheme in ("megatron", "sequence") for dp, pp, tp in factorizations(8)
           if tp > 1 or scheme == "megatron"]                  # (at tp 1 the two schemes are the same computation)


@pytest.mark.parametrize("dp, pp, tp, scheme", LAYOUTS, ids=["{}-{}-{}-{}".format(*x) for x in LAYOUTS])
def test_every_3d_layout_equals_serial_sgd(dp, pp, tp, scheme):
    """All 10 factorizations of 8 ranks, with Megatron's scheme and, where tp > 1, with sequence parallelism (whose
    stages hand each other T-shards of the activations); 3 blocks per stage where CFG's 8 allow (a stage's first,
    middle and last block)."""
    cfg = dataclasses.replace(CFG, n_layers=min(CFG.n_layers, 3 * pp))   # 3 blocks a stage: first, middle, last
    tc = config(dp=dp, pp=pp, tp=tp, clip=0.5, tp_scheme=scheme)
    ref = serial_params(cfg, CORPUS, tc)
    grid, trainer, identical, per_step = train_steps(cfg, CORPUS, tc)
    err = param_err(trainer, grid, ref, scheme)
    formula = step_formula(cfg, tc, trainer)
    names = WORLD.allgather(sorted(trainer.params))
    held = set(n for ns in names for n in ns) == set(cfg.param_shapes())            # every parameter somewhere
    say(f"{scheme} dp={dp} pp={pp} tp={tp}: 3 steps (clipped), max param rel err vs serial {world_max(err):.1e}, "
        f"replicas identical {identical}, bytes == formula {per_step == formula}")
    check(err <= 1e-9 and identical and held and per_step == formula,
          f"err {err:.1e}\nmeasured {per_step}\nformula  {formula}")
    grid.free()


@pytest.mark.parametrize("m_of_p", [lambda p: 1, lambda p: p, lambda p: 2 * p], ids=["m=1", "m=p", "m=2p"])
def test_gpipe_equals_1f1b_and_holds_what_it_promises(m_of_p):
    p = 4
    m = m_of_p(p)
    results = {}
    for kind in ("gpipe", "1f1b"):
        tc = config(dp=1, pp=p, tp=2, micro_batches=m, batch_size=2 * m, schedule=kind)
        grid, trainer, _, _ = run(tc)
        results[kind] = (dict(trainer.params), trainer.stage.peak_held)
        s = grid.pp_rank
        grid.free()
    same = max(float(np.abs(results["gpipe"][0][n] - results["1f1b"][0][n]).max()) for n in results["gpipe"][0])
    held = {k: v[1] for k, v in results.items()}
    say(f"p={p} m={m}: GPipe vs 1F1B max param diff {world_max(same):.1e}; micro-batches held on stage 0: "
        f"GPipe {WORLD.bcast(held['gpipe'])}, 1F1B {WORLD.bcast(held['1f1b'])}")
    check(same == 0.0 and held["gpipe"] == m and held["1f1b"] == min(p - s, m), f"{same} {held}")


V_LAYOUTS = [(dp, pp, cp, tp) for pp in (2, 4, 8) for cp in (1, 2, 4) for tp in (1, 2, 4)
             if 8 % (pp * cp * tp) == 0 for dp in [8 // (pp * cp * tp)]]
LLAMA = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=4, n_layers=4, d_ff=16, arch="llama")


def test_the_v_and_dual_schedules_train_as_1f1b_on_every_pipelined_layout():
    """zb-v, dualpipev and dualpipe (hsgd.pp.vshape) on every dp x pp x cp x tp of 8 ranks with pp > 1, the llama
    block, ZeRO 1 where dp > 1, selective and full recomputation in turn, m = 2 pp, 2 pp blocks (two chunks a stage):
    2 steps of each end with 1F1B's parameters, bit for bit for the V schedules and to
    rounding for DualPipe (its twin sum regroups the micro-batches' sum: hsgd.pp.dual); the replicas agree, the
    bytes of step 2 equal the formulas (the V's turn sends nothing, DualPipe's twin gets the gradient), every stage
    holds the pairs of peak_formula, DualPipe's twin stages hold the same parameters bit for bit, and twice 1F1B's
    parameters over the pipeline."""
    from hsgd.pp.timelines import peak_formula
    worst, lines, ok = 0.0, [], True
    for i, (dp, pp, cp, tp) in enumerate(V_LAYOUTS):
        cfg = dataclasses.replace(LLAMA, n_layers=2 * pp)
        kw = dict(dp=dp, pp=pp, cp=cp, tp=tp, micro_batches=2 * pp, batch_size=2 * pp * dp, zero=int(dp > 1),
                  recompute=("selective", "full")[i % 2])
        out = {}
        for kind in ("1f1b", "zb-v", "dualpipev", "dualpipe"):
            tc = config(steps=2, schedule=kind, **kw)
            tc.validate()
            grid, trainer, identical, per_step = train_steps(cfg, CORPUS, tc)
            numel = sum(int(np.prod(x)) for x in trainer.shard_shapes.values())
            held = trainer.stage.peak_held == peak_formula(tc.schedule, tc.micro_batches, pp, grid.pp_rank, 2)
            if kind == "dualpipe":                                     # the twin p-1-s holds the same pieces, equal
                mine = hashlib.sha256(b"".join(np.ascontiguousarray(trainer.params[n]).tobytes()
                                               for n in sorted(trainer.params))).hexdigest()
                twin = pp - 1 - grid.pp_rank
                held &= grid.pp_comm.comm.sendrecv(mine, dest=twin, source=twin) == mine
            out[kind] = (trainer.full_params(), identical and per_step == step_formula(cfg, tc, trainer),
                         WORLD.allreduce(numel), held or kind == "1f1b")
            trainer.free(), grid.free()
        base = out["1f1b"][0]
        diff = {k: max(float(np.abs(out[k][0][n] - base[n]).max() / max(np.abs(base[n]).max(), 0.02)) for n in base)
                for k in out}
        good = (diff["zb-v"] == 0.0 and diff["dualpipev"] == 0.0 and diff["dualpipe"] <= 1e-13
                and all(v[1] and v[3] for v in out.values()) and out["dualpipe"][2] == 2 * out["1f1b"][2])
        ok &= bool(WORLD.allreduce(int(good), op=MPI.MIN))
        worst = max(worst, diff["dualpipe"])
        lines.append(f"dp{dp} pp{pp} cp{cp} tp{tp}: zb-v {diff['zb-v']:.0e}, dualpipev {diff['dualpipev']:.0e}, "
                     f"dualpipe {diff['dualpipe']:.1e} from 1F1B; bytes, replicas, pairs "
                     f"{all(v[1] and v[3] for v in out.values())}; parameters dualpipe/1f1b "
                     f"{out['dualpipe'][2] / out['1f1b'][2]:g}")
    say("\n".join(lines) + f"\nlargest DualPipe difference from 1F1B {world_max(worst):.1e} (relative)")
    check(ok, "a V or dual schedule left 1F1B's parameters, its formulas or its pairs")


def test_dualpipe_clips_by_the_norm_of_one_copy():
    """Clipped by the global gradient norm (dp 2 x pp 4, clip 0.5, which every step's norm exceeds): DualPipe's
    norm counts each layer once though two stages hold it (Stage.copies), so its steps' norms and parameters are
    1F1B's to rounding (the sum over pp of the twins' squares alone would be sqrt(2) too large)."""
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer
    cfg, out = dataclasses.replace(LLAMA, n_layers=8), {}
    for kind in ("1f1b", "dualpipe"):
        tc = config(steps=2, schedule=kind, dp=2, pp=4, tp=1, micro_batches=8, batch_size=16, clip=0.5)
        grid = ProcessGrid(WORLD, dp=2, pp=4, tp=1)
        trainer = HybridTrainer(cfg, grid, tc)
        norms = [trainer.step(*CORPUS.batch(tc.seed, step, tc.batch_size), step).grad_norm for step in (1, 2)]
        trainer.finish()
        out[kind] = (norms, trainer.full_params())
        trainer.free(), grid.free()
    (n1, p1), (n2, p2) = out["1f1b"], out["dualpipe"]
    norm_err = max(abs(a - b) / a for a, b in zip(n1, n2))
    err = max(float(np.abs(p2[n] - p1[n]).max() / max(np.abs(p1[n]).max(), 0.02)) for n in p1)
    say(f"clipped at 0.5: 1F1B's norms {[f'{x:.4f}' for x in n1]}, DualPipe's differ by {norm_err:.1e} (relative), "
        f"its parameters by {err:.1e}")
    check(min(n1) > 0.5 and norm_err < 1e-12 and err < 1e-12, f"{n1} {n2} {err}")


def test_schedules_and_bubble_formula():
    """The schedules as documented, and the equal-cost bubble (p-1)/(m+p-1) for both."""
    acts = [(a.kind, a.mb) for a in build("1f1b", 6, 4)[1]]   # stage 1 of 4: two warm-up forwards
    ok = acts == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4), ("B", 2), ("F", 5), ("B", 3),
                  ("B", 4), ("B", 5)]
    ok &= [str(a) for a in build("gpipe", 2, 3)[0]] == ["F0", "F1", "B0", "B1"]
    worst = 0.0
    for p in (2, 3, 4, 8):
        for m in (1, 2, p, 2 * p, 3 * p):
            for kind in ("gpipe", "1f1b"):
                t = simulate(build(kind, m, p), m, costs=(1.0, 2.0, 0.0))
                worst = max(worst, abs(bubble_fraction(t) - bubble_formula(kind, m, p)))
                ok &= [peak_held(build(kind, m, p)[s]) for s in range(p)] == \
                    ([m] * p if kind == "gpipe" else [min(p - s, m) for s in range(p)])
    say(f"equal-cost bubble vs (p-1)/(m+p-1): max difference {worst:.1e}")
    say(picture(simulate(build("1f1b", 8, 4), 8, costs=(1.0, 2.0, 0.0)), width=72))
    check(ok and worst < 1e-12)


def test_impossible_layouts_are_refused():
    from hsgd.errors import ConfigError
    msgs = []
    for fn in (lambda: split_layers(2, 4), lambda: split_layers(4, 2, [3, 2]),
               lambda: split_layers(4, 2, [4, 0]), lambda: build("zigzag", 2, 2)[0]):
        try:
            fn()
            msgs.append("")
        except ConfigError as e:
            msgs.append(str(e))
    say("\n".join(msgs))
    check(msgs[0].startswith("n_layers=2 cannot be split into pp=4 stages") and "e.g. 2,2" in msgs[1]
          and "at least one layer" in msgs[2] and "schedule='zigzag' is not known" in msgs[3])
