"""The tolerance oracle: how far may a bfloat16 or float16 layout differ from float64, and from another layout,
before it is a bug?

    mpirun -n 8 python -m hsgd.verify --dtype bfloat16 --layouts 1x1x1,2x1x4,1x2x4 --seeds 8 [--loss-steps K]

For every seed s (the initial weights and the batch) and every layout L (dp x pp x tp, or dp x pp x cp x tp, on
the first dp pp cp tp ranks), one-step runs of the same code path:

    g          the float64 serial reference (one rank, one micro-batch, plain exchange, float64)
    g_L        L in the low format: what the user's run computes
    g_L^64     L in float64: exact, equal to g up to ~1e-15 (else L has a bug, whatever the format)
    g_L^1..D   L in float64 through the error model, D times (D draws; 2 for gradients, with --loss-steps enough
               that seeds x (D - 1) >= 8): every rounding of the low format, at every point of
               hsgd.model.precision.POINTS, replaced by x -> x (1 + u e), e in [-1, 1) random; a value the format
               already holds is left alone, as a rounding leaves it

and, for every parameter P (relative to a norm; the floor keeps gradients that are zero in exact arithmetic, such
as the attention k-bias's, from dividing by zero):

    d(a, b) = ||a_P - b_P|| / max(||g_P||, 1e-3 max_Q ||g_Q||)          (Frobenius norms; inf if not finite)

    observed      d(g_L, g) against float64, d(g_L, g_B) against the first layout B; median and max over seeds
    model         m_L = sqrt(mean_s sum_d d(g_L^d, mean_d g_L^d)^2 / (D - 1)): the rms rounding error the model
                  predicts for L, from the draws' spread (whatever the draws share, such as a bug in the
                  low-precision code path that every draw takes, cancels and cannot widen the band)
    band          lambda m_L                         + lambda sqrt(N) u_float32          against float64
                  lambda sqrt(m_L^2 + m_B^2)         + lambda sqrt(N) u_float32          between L and B

with lambda = 4. The model is a Monte Carlo simulation of the rounding-error model of Higham & Mary 2019 ("A New
Approach to Probabilistic Rounding Error Analysis": each rounding a relative error bounded by u, independent and
of mean zero), run through the code itself instead of bounded by hand; lambda times an rms measured over a few
draws is a rule of thumb, not a bound with a proven probability. Higham's worst-case gamma_n = n u / (1 - n u)
says nothing in bfloat16 (gamma_n >= 1 from n = 128 terms). The second term is an allowance, in the probabilistic
sqrt(n) u form, for what the model does not perturb: the float32 arithmetic, where a weight gradient adds N = B T
per-token terms (the matrix products' accumulations, the micro-batches, the dp and cp ranks' shares) in another
order in each layout; it is far below the first term for gradients (~3e-6 at N = 128) and matters only where the
rounding in the narrow format is tiny. Where the model is wrong: it cannot underflow (float16's underflow is what
the loss scale is for), and its e is uniform, a larger error than a real rounding's (an error uniform in [-u, u]
has rms u/sqrt(3); a rounding's is about 0.74 of that, tests/test_oracle.py), so the band leans wide.

FP8 (hsgd.verify --dtype fp8, --fp8-recipe tensorwise by default): g_L is the layout in float32 with FP8 products
(--fp8 hybrid), g and g_L^64 run without FP8, and each draw perturbs every FP8 cast at the scale the run takes
(PerturbedFp8: y = x s becomes y (1 + u e), u = 2^-4 for E4M3 and 2^-3 for E5M2; a saturated or subnormal value is
cast as the run casts it). A scale taken over the wrong ranks is then in every draw alike and shows only in g_L: the
sequence scheme's inputs cast on each T-shard's own amax are read with another rank's scale, and so are ZeRO-3's
weight chunks sent as FP8 codes (--fp8-allgather) cast on each chunk's own amax (tests/mpi/test_oracle.py). A scale
that differs between the shards of a weight no rank sends in FP8 changes values by rounding only: the exact FP8 mode
names it (tests/mpi/test_fp8.py), no band can.

With --resume-after K every run trains K steps, a new run loads the state a checkpoint keeps (the optimizer's
moments, delayed scaling's amax histories) and the gradients of step K + 1 are compared: a resume that loses the
histories casts that step with scale 1, as a fresh run's first step does, and is flagged (one step's gradients
of delayed scaling without a history are not held to the band: hsgd.verify refuses them).

A difference outside its band is flagged, and the oracle exits 1; so does a non-finite difference, and a layout
whose float64 run differs from the reference by more than hsgd.verify's float64 tolerance (a bug that is not
rounding at all). Being inside the band is evidence, not proof: a bug smaller than the rounding error is invisible
to any comparison of one step.

With --loss-steps K the same question for the loss after K training steps (the mean loss of one validation batch),
where the rounding errors of K updates have accumulated: one row per layout. One number per seed is a noisy
sample, so there the median over the seeds is held to the band, not the largest.
"""
from dataclasses import replace

import numpy as np
from mpi4py import MPI

from hsgd.grid import launch
from hsgd.model.backend import array_module, to_numpy
from hsgd.cp.split import check_cp, check_heads
from hsgd.ep.layout import counts_by_layout
from hsgd.dp.average import check_batch
from hsgd.errors import ConfigError
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.model.precision import LOW, POINTS, Numerics, round_to, unit_roundoff
from hsgd.pp.schedules import check_pipeline
from hsgd.tp.shards import check_tied, check_tp, unshard
from hsgd.check.verdict import Verdict
from hsgd.fp8.recipes import make_recipe
from hsgd.fp8.scaling import Fp8

FLOOR = 1e-3                  # the norm a parameter's difference is relative to: at least FLOOR x the largest


# ------------------------------------------------------------------------------------------- the error model

def uniform_of(x, salt):
    """A number in [-1, 1) for every element of the float64 array x, a hash of its bits and `salt` (splitmix64's
    finalizer): random to look at, but a function of the value, as a rounding is (two ranks that compute the
    same value replicated perturb it the same way, and stay replicas)."""
    xp = array_module(x)
    h = xp.ascontiguousarray(x, dtype=xp.float64).view(xp.uint64) ^ xp.uint64(salt)
    h = h * xp.uint64(0x9E3779B97F4A7C15)                            # (wraps modulo 2^64)
    h = (h ^ (h >> xp.uint64(30))) * xp.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> xp.uint64(27))) * xp.uint64(0x94D049BB133111EB)
    h = h ^ (h >> xp.uint64(31))
    return (h >> xp.uint64(11)).astype(xp.float64) * 2.0 ** -52 - 1.0     # 53 random bits -> [-1, 1)


# a salt per rounding point (odd multiples of a 64-bit constant): the same value rounded at two points is
# perturbed independently
POINT_SALT = {p: ((2 * i + 1) * 0x9E3779B97F4A7C15) % 2 ** 64 for i, p in enumerate(POINTS)}


class Perturbed(Numerics):
    """The rounding-error model: a float64 run whose every rounding to `compute` (and to `reduce`) is
    x (1 + u e), u the format's unit roundoff and e = uniform_of(x, salt of the draw and of the point), except
    where x is a number of the format (a rounding leaves it alone, and so does the model): an error as large as a
    rounding's can be, random in size and sign. Nothing else changes: the same points, counted the same way."""

    def __init__(self, compute, reduce="float32", salt=0):
        super().__init__(compute, reduce)
        self.salt = salt

    def rounded(self, x, fmt, point):
        xp = array_module(x)
        e = uniform_of(x, self.salt ^ POINT_SALT[point])
        return xp.where(round_to(x, fmt) == x, x, x * (1.0 + unit_roundoff(fmt) * e))


class PerturbedFp8(Fp8):
    """The error model of an FP8 run (hsgd.verify --dtype fp8): a float64 run whose every cast keeps its scale s
    (the recipe's, as the run takes it: the scales are fixed by the values, not drawn) and puts, in place of the
    rounding of y = x s to the operand's format, y (1 + u e), u the format's unit roundoff (2^-4 E4M3, 2^-3 E5M2)
    and e = uniform_of(y, salt of the draw and of the role); where the cast is not a rounding of that size, the cast
    itself: a value the format holds, one past fmax (saturated) or below its normal range (subnormal, absolute
    error). A bug in the scales is then in every draw alike: it cancels out of the band and stays in the run."""

    def __init__(self, settings, salt):
        s = settings
        super().__init__(s.fmt, make_recipe(s.recipe, s.history, s.margin, s.block), s.accumulate, s.check)
        self.salt = salt
        self.sends_codes = False                 # (y (1 + u e) is no FP8 number: hsgd.dp.fp8_gather sends values)

    def cast(self, y, f, role):
        xp = array_module(y)
        q = round_to(y, f.name, saturate=True)
        e = uniform_of(y, self.salt ^ ROLE_SALT[role])
        normal = (xp.abs(y) >= 2.0 ** f.emin) & (xp.abs(y) <= f.max) & (q != y)
        return xp.where(normal, y * (1.0 + 2.0 ** -f.p * e), q)


ROLE_SALT = {r: ((2 * i + 101) * 0x9E3779B97F4A7C15) % 2 ** 64 for i, r in enumerate(("x", "w", "dy"))}


def perturbed_fp8(tc, salt):
    """What run_layout does to a trainer for one draw of the FP8 error model: its stage's Fp8 replaced by a
    PerturbedFp8 of the same settings (the stage builds its model again around it)."""
    def prepare(trainer):
        bugs = trainer.stage.fp8.bugs                       # (hsgd.check.mutations: the draws take them too)
        trainer.stage.fp8 = PerturbedFp8(tc.fp8_settings(), salt)
        trainer.stage.fp8.bugs = bugs
        trainer.use_numerics(trainer.num)
    return prepare


# ------------------------------------------------------------------------------------------- layouts

def parse_layouts(text, cfg, tc, world_size):
    """[(dp, pp, cp, tp)] from "1x1x1,2x1x4,1x2x4" (dp x pp x tp) or with four numbers dp x pp x cp x tp; each
    checked as hsgd.train would (the model splits, the batch divides, the pipeline has layers): ConfigError."""
    out = []
    for spec in text.split(","):
        try:
            dims = [int(d) for d in spec.strip().lower().split("x")]
        except ValueError:
            dims = []
        if len(dims) not in (3, 4) or min(dims) < 1:
            raise ConfigError(f"--layouts: {spec!r} is not a layout; write dp x pp x tp or dp x pp x cp x tp, e.g. "
                              f"--layouts 1x1x1,2x1x4,1x2x4 (on 8 ranks)")
        dp, pp, cp, tp = dims if len(dims) == 4 else (dims[0], dims[1], 1, dims[2])
        if dp * pp * cp * tp > world_size:
            raise ConfigError(f"--layouts: {spec} needs {dp * pp * cp * tp} ranks, mpirun started {world_size}; "
                              f"start more ranks or give layouts of at most {world_size}")
        if (dp, pp, cp, tp) in out:
            raise ConfigError(f"--layouts: {spec} is given twice; give each layout once")
        ltc = layout_config(tc, (dp, pp, cp, tp))
        ltc.validate()
        ltc.resolve_layout(dp * pp * cp * tp)
        check_tp(cfg, tp, tc.tp_scheme)
        check_tied(cfg, pp, ltc.zero)
        check_cp(cfg.seq_len, cp, tp, tc.tp_scheme == "sequence")
        check_heads(cfg.n_heads, cfg.n_kv_heads, cp, tp, tc.cp_scheme, cfg.seq_len)
        check_batch(tc.batch_size, dp, tc.micro_batches)
        check_pipeline(cfg.n_layers, ltc)
        out.append((dp, pp, cp, tp))
    return out


def label(tc):
    """The format a run is checked in: bfloat16, float16, or "fp8 hybrid tensorwise"."""
    return f"fp8 {tc.fp8} {tc.fp8_settings().recipe}" if tc.fp8 else tc.dtype


def serial_config(tc):
    """The reference's settings: tc on one rank, one micro-batch, the plain exchange and schedule, nothing
    recomputed, every expert on it (whatever tc asks of its layouts)."""
    return layout_config(tc, (1, 1, 1, 1), micro_batches=1, zero=0, hierarchical=False, dp_overlap=False,
                         dp_staleness=0, pp_split=None, virtual_stages=1, schedule="1f1b", recompute="none", ep=1)


def layout_config(tc, layout, **changes):
    """tc on `layout` (dp, pp, cp, tp), with `changes`."""
    dp, pp, cp, tp = layout
    return replace(tc, dp=dp, pp=pp, cp=cp, tp=tp, **changes)


# ------------------------------------------------------------------------------------------- one run

def run_layout(cfg, tc, layout, seed, world, dtype, corpus, num=None, loss_steps=0, resume_after=0):
    """Collective over world: one run of `layout` on its first dp pp cp tp ranks, from the weights of `seed`, in
    `dtype` (with `num`: the stage rounds as num says), on the batches of hsgd.model.data's `corpus`. loss_steps = 0:
    one step's gradient of the batch of `seed`, returned on world rank 0 as {name: full float64 array} (a float16
    run that overflows at its loss scale S halves S and tries again, as the scaler would); loss_steps = K: K
    training steps, then the mean loss of one validation batch (a float on rank 0); resume_after = K: K training steps,
    the state a checkpoint keeps (HybridTrainer.state_dict) loaded by a new trainer, and then the gradient of step
    K + 1's batch. None on the other ranks. A settings error on any rank is raised on every rank of world
    (launch.agree)."""
    n = int(np.prod(layout))
    sub = world.Split(0 if world.Get_rank() < n else MPI.UNDEFINED, world.Get_rank())
    ltc = layout_config(tc, layout, seed=seed, dtype=dtype, steps=max(1, loss_steps, resume_after + 1))

    def mine():                                                  # (the ranks outside the layout: nothing to do)
        return None if sub == MPI.COMM_NULL else one_run(cfg, ltc, sub, corpus, num, loss_steps, resume_after)

    try:
        result = launch.agree(world, mine)
    finally:
        if sub != MPI.COMM_NULL:
            sub.Free()
    return result if world.Get_rank() == 0 else None


def one_run(cfg, tc, sub, corpus, num, loss_steps, resume_after=0):
    """run_layout's work on the ranks of the layout (sub, of dp pp cp tp ranks)."""
    grid = ProcessGrid(sub, dp=tc.dp, pp=tc.pp, tp=tc.tp, cp=tc.cp, ep=tc.ep)
    trainer = None

    def new_trainer():
        t = HybridTrainer(cfg, grid, tc)
        if callable(num):                                        # (an FP8 draw: perturbed_fp8)
            num(t)
        elif num is not None:
            t.use_numerics(num)
        return t

    try:
        trainer = new_trainer()
        if loss_steps:
            for step in range(1, loss_steps + 1):
                trainer.step(*corpus.batch(tc.seed, step, tc.batch_size), step)
            return trainer.evaluate(corpus, 1, tc.batch_size)                  # (collective)
        for step in range(1, resume_after + 1):
            trainer.step(*corpus.batch(tc.seed, step, tc.batch_size), step)
        if resume_after:                                         # a resume: only what the state carries goes on
            state = trainer.state_dict()                         # (collective over dp_comm)
            trainer.finish()
            trainer.free()
            trainer = None
            trainer = new_trainer()
            trainer.load_state_dict(state)
        idx, targets = corpus.batch(tc.seed, resume_after + 1, tc.batch_size)
        for _ in range(64):
            trainer.gradients(idx, targets)
            mine = {k: to_numpy(g).astype(np.float64) for k, g in trainer.averaged_grads().items()}   # (unscaled)
            if not trainer.scaler.dynamic or sub.allreduce(all(np.isfinite(g).all() for g in mine.values()),
                                                           op=MPI.LAND):
                break                                                   # (else not finite: reported as such)
            trainer.scaler.update(True)                                  # S / 2, and again
        shards = grid.tp_comm.allgather_obj(mine)                      # one pickled message, not one per name
        stage = {k: unshard([sh[k] for sh in shards], k, cfg, tc.tp_scheme) for k in mine}
        full = {}
        for part in grid.pp_comm.allgather_obj(stage):                 # every stage's parameters
            full.update(part)
        for part in grid.ep_comm.allgather_obj(full) if grid.ep > 1 else []:
            full.update(part)                                           # every ep rank's experts
        return full
    finally:
        if trainer is not None:
            trainer.finish()
            trainer.free()
        grid.free()


def differences(a, b, ref):
    """{name: d(a, b)} of the module docstring, relative to the reference gradient ref; inf where a or b is not
    finite (an overflow, a NaN: outside every band)."""
    floor = FLOOR * max(float(np.linalg.norm(g)) for g in ref.values())
    out = {}
    for k in ref:
        d = float(np.linalg.norm(a[k] - b[k])) / max(float(np.linalg.norm(ref[k])), floor)
        out[k] = d if np.isfinite(d) else float("inf")
    return out


def spread(draws, ref):
    """{name: sum_d d(draw_d, mean of the draws)^2 / (D - 1)}: the draws' variance, relative as d is."""
    mean = {k: sum(g[k] for g in draws) / len(draws) for k in ref}
    each = [differences(g, mean, ref) for g in draws]
    return {k: sum(e[k] ** 2 for e in each) / (len(draws) - 1) for k in ref}


def oracle(cfg, tc, layouts, seeds, world, corpus, loss_steps=0, progress=None, resume_after=0):
    """Collective over world: the Verdict on rank 0 (None elsewhere). tc.dtype is bfloat16 or float16, or float32
    with tc.fp8 (hsgd.verify --dtype fp8: the runs in float32 with FP8 products, the draws through PerturbedFp8, the
    float64 runs without FP8); seeds: the seeds tc.seed, tc.seed + 1, ...; progress(text): a line per seed on
    rank 0; resume_after = K: every run trains K steps and resumes from its state before its gradient is taken."""
    fp8 = bool(tc.fp8)
    if tc.dtype not in LOW and not (fp8 and tc.dtype == "float32"):
        raise ConfigError(f"the tolerance oracle is for --dtype {' or '.join(LOW)} or fp8, not {tc.dtype}")
    if counts_by_layout(cfg):
        raise ConfigError("the tolerance oracle compares every layout with one reference on one rank, but a capacity "
                          "or the micro-batch balance domain counts each layout's tokens its own way; use no "
                          "--moe-capacity-factor and --moe-balance-domain sequence or global (or hsgd.verify in "
                          "float64, which counts as the layout does)")
    names = ["loss"] if loss_steps else list(cfg.param_shapes())
    verdict = Verdict(layouts, names, "float8_e4m3fn" if fp8 else tc.dtype, tc.batch_size * cfg.seq_len)
    plain = replace(tc, fp8=None, fp8_recipe=None, fp8_history=None, fp8_margin=None, fp8_block=None,
                    fp8_accumulate=None, fp8_check=False, fp8_allgather=False)   # the float64 runs: no FP8
    rank0 = world.Get_rank() == 0
    n_draws = 2 if not loss_steps else max(2, 1 + -(-8 // seeds))     # one number per run: >= 8 degrees of freedom

    def run(L, seed, dtype, num=None, ltc=tc):
        x = run_layout(cfg, ltc, L, seed, world, dtype, corpus, num, loss_steps, resume_after)
        return {"loss": np.array(x)} if loss_steps and rank0 else x

    for i in range(seeds):
        seed = tc.seed + i
        ref = run((1, 1, 1, 1), seed, "float64", ltc=serial_config(plain))         # the serial reference
        base = None
        for j, L in enumerate(layouts):
            low = run(L, seed, tc.dtype)
            exact = run(L, seed, "float64", ltc=plain)
            salts = [(1000 * i + j) * 64 + d + 1 for d in range(n_draws)]
            draws = [run(L, seed, "float64", perturbed_fp8(tc, salt) if fp8 else
                         Perturbed(tc.dtype, tc.reduce_dtype, salt=salt)) for salt in salts]
            if rank0:
                base = low if j == 0 else base
                verdict.add(L, differences(low, ref, ref), differences(low, base, ref), spread(draws, ref),
                            differences(exact, ref, ref))
        if rank0 and progress:
            progress(f"seed {seed}: {len(layouts)} layouts x {2 + n_draws} runs (in {label(tc)}, in float64, "
                     f"{n_draws} draws of the error model) done")
    return verdict if rank0 else None
