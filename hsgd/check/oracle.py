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
from hsgd.cp.split import check_cp
from hsgd.ep.layout import counts_by_layout
from hsgd.dp.average import check_batch
from hsgd.errors import ConfigError
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.model.precision import LOW, POINTS, Numerics, round_to, unit_roundoff
from hsgd.pp.schedules import check_pipeline
from hsgd.tp.shards import check_tied, check_tp, unshard
from hsgd.check.verdict import Verdict

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
        check_batch(tc.batch_size, dp, tc.micro_batches)
        check_pipeline(cfg.n_layers, ltc)
        out.append((dp, pp, cp, tp))
    return out


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

def run_layout(cfg, tc, layout, seed, world, dtype, corpus, num=None, loss_steps=0):
    """Collective over world: one run of `layout` on its first dp pp cp tp ranks, from the weights of `seed`, in
    `dtype` (with `num`: the stage rounds as num says), on the batches of hsgd.model.data's `corpus`. loss_steps = 0:
    one step's gradient of the batch of `seed`, returned on world rank 0 as {name: full float64 array} (a float16
    run that overflows at its loss scale S halves S and tries again, as the scaler would); loss_steps = K: K
    training steps, then the mean loss of one validation batch (a float on rank 0). None on the other ranks. A
    settings error on any rank is raised on every rank of world (launch.agree)."""
    n = int(np.prod(layout))
    sub = world.Split(0 if world.Get_rank() < n else MPI.UNDEFINED, world.Get_rank())
    ltc = layout_config(tc, layout, seed=seed, dtype=dtype, steps=max(1, loss_steps))

    def mine():                                                  # (the ranks outside the layout: nothing to do)
        return None if sub == MPI.COMM_NULL else one_run(cfg, ltc, sub, corpus, num, loss_steps)

    try:
        result = launch.agree(world, mine)
    finally:
        if sub != MPI.COMM_NULL:
            sub.Free()
    return result if world.Get_rank() == 0 else None


def one_run(cfg, tc, sub, corpus, num, loss_steps):
    """run_layout's work on the ranks of the layout (sub, of dp pp cp tp ranks)."""
    grid = ProcessGrid(sub, dp=tc.dp, pp=tc.pp, tp=tc.tp, cp=tc.cp, ep=tc.ep)
    trainer = None
    try:
        trainer = HybridTrainer(cfg, grid, tc)
        if num is not None:
            trainer.use_numerics(num)
        if loss_steps:
            for step in range(1, loss_steps + 1):
                trainer.step(*corpus.batch(tc.seed, step, tc.batch_size), step)
            return trainer.evaluate(corpus, 1, tc.batch_size)                  # (collective)
        idx, targets = corpus.batch(tc.seed, 1, tc.batch_size)
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


def oracle(cfg, tc, layouts, seeds, world, corpus, loss_steps=0, progress=None):
    """Collective over world: the Verdict on rank 0 (None elsewhere). tc.dtype is bfloat16 or float16;
    seeds: the seeds tc.seed, tc.seed + 1, ...; progress(text): a line per seed on rank 0."""
    if tc.dtype not in LOW:
        raise ConfigError(f"the tolerance oracle is for --dtype {' or '.join(LOW)}, not {tc.dtype}")
    if counts_by_layout(cfg):
        raise ConfigError("the tolerance oracle compares every layout with one reference on one rank, but a capacity "
                          "or the micro-batch balance domain counts each layout's tokens its own way; use no "
                          "--moe-capacity-factor and --moe-balance-domain sequence or global (or hsgd.verify in "
                          "float64, which counts as the layout does)")
    names = ["loss"] if loss_steps else list(cfg.param_shapes())
    verdict = Verdict(layouts, names, tc.dtype, tc.batch_size * cfg.seq_len)
    rank0 = world.Get_rank() == 0
    n_draws = 2 if not loss_steps else max(2, 1 + -(-8 // seeds))     # one number per run: >= 8 degrees of freedom

    def run(L, seed, dtype, num=None, ltc=tc):
        x = run_layout(cfg, ltc, L, seed, world, dtype, corpus, num, loss_steps)
        return {"loss": np.array(x)} if loss_steps and rank0 else x

    for i in range(seeds):
        seed = tc.seed + i
        ref = run((1, 1, 1, 1), seed, "float64", ltc=serial_config(tc))            # the serial reference
        base = None
        for j, L in enumerate(layouts):
            low = run(L, seed, tc.dtype)
            exact = run(L, seed, "float64")
            draws = [run(L, seed, "float64", Perturbed(tc.dtype, tc.reduce_dtype, salt=(1000 * i + j) * 64 + d + 1))
                     for d in range(n_draws)]
            if rank0:
                base = low if j == 0 else base
                verdict.add(L, differences(low, ref, ref), differences(low, base, ref), spread(draws, ref),
                            differences(exact, ref, ref))
        if rank0 and progress:
            progress(f"seed {seed}: {len(layouts)} layouts x {2 + n_draws} runs (in {tc.dtype}, in float64, "
                     f"{n_draws} draws of the error model) done")
    return verdict if rank0 else None
