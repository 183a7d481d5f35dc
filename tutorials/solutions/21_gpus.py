"""Solutions to the exercises of chapter 21 (tutorials/21_gpus.py).

    mpirun -n 2 python tutorials/solutions/21_gpus.py

No GPU needed: exercises 2-4 run on the simulated GPU of tests/simgpu (a stand-in for CuPy over NumPy that keeps
CuPy's host/device rules and counts every transfer), put first on sys.path before anything imports `cupy`.
"""
# mpirun -n 2 python tutorials/solutions/21_gpus.py
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "simgpu"))            # `import cupy` finds the simulated GPU
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
os.environ["HSGD_CUDA_AWARE"] = "0"                                    # staging (exercise 3), decided once

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

import cupy  # noqa: E402  (the simulated one)
import cupyx  # noqa: E402
from checks import Checks, rel_err, solve, train_config  # noqa: E402
from hsgd.model.config import ModelConfig  # noqa: E402
from hsgd.model import backend  # noqa: E402
from hsgd.model.data import Corpus  # noqa: E402
from hsgd.grid.process_grid import ProcessGrid  # noqa: E402
from hsgd.step.trainer import HybridTrainer  # noqa: E402
from hsgd.model.precision import FORMATS, round_to  # noqa: E402
from hsgd.grid.devices import local_ranks  # noqa: E402

threadpool_limits(1)
world = MPI.COMM_WORLD
rank = world.Get_rank()


# ---------------------------------------------------------------------------------------------------- exercise 1

LAUNCHER_VARIABLES = ("LOCAL_RANK",                   # torchrun, the deepspeed launcher
                      "OMPI_COMM_WORLD_LOCAL_RANK",   # Open MPI's mpirun
                      "MPI_LOCALRANKID",              # MPICH's Hydra mpiexec
                      "SLURM_LOCALID")                # Slurm's srun


def local_rank_from_env(env):
    """(local rank, the variable it came from), from the first launcher variable set in `env`; None if none is."""
    for name in LAUNCHER_VARIABLES:
        if name in env:
            return int(env[name]), name
    return None


def local_rank_by_name(comm):
    """DeepSpeed's mpi_discovery: how many lower ranks of comm run on a host of my name (collective)."""
    names = comm.allgather(MPI.Get_processor_name())
    return sum(name == names[comm.Get_rank()] for name in names[:comm.Get_rank()])


def exercise_1(check):
    """The local rank from the environment, and from the host names."""
    made_up = [({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "PATH": "/bin"}, (3, "OMPI_COMM_WORLD_LOCAL_RANK")),
               ({"SLURM_LOCALID": "5", "LOCAL_RANK": "1"}, (1, "LOCAL_RANK")),     # torchrun inside an srun job
               ({"MPI_LOCALRANKID": "0"}, (0, "MPI_LOCALRANKID")),
               ({"HOME": "/root"}, None)]
    check.equal("local_rank_from_env on made-up environments", [local_rank_from_env(e) for e, _ in made_up],
                [want for _, want in made_up])
    split_type, _ = local_ranks(world)                                  # hsgd's: MPI's shared-memory split
    found = local_rank_from_env(os.environ)
    check.say(f"this launcher sets {found[1] if found else 'none of the variables'}; rank 0's local rank: "
              f"{split_type}")
    check.equal("local rank by host name == hsgd.train.local_ranks", local_rank_by_name(world), split_type)
    check.equal("local rank from the environment (if set) == local_ranks",
                found[0] if found else split_type, split_type)


# ---------------------------------------------------------------------------------------------------- exercise 2

def physical_gpu(local_rank, visible):
    """The physical GPU of a rank that sees the devices `visible` (CUDA_VISIBLE_DEVICES, in order) and uses device
    local_rank % len(visible) of them."""
    return visible[local_rank % len(visible)]


def exercise_2(check):
    """Which GPU a rank uses."""
    before = os.environ.get("SIMGPU_DEVICES")
    mine, selected = [], []                                              # (GPUs, local rank, physical GPU)
    cases = [(n, list(range(n))) for n in (1, 2, 4, 8)]                  # every GPU of the node visible to all
    try:
        for local in range(8):
            for n, visible in cases + [("one each", [local])]:          # or CUDA_VISIBLE_DEVICES=<local rank>
                os.environ["SIMGPU_DEVICES"] = str(len(visible))        # the devices the rank sees
                backend.select_gpu(local)                               # hsgd's rule, on the simulated GPU
                selected.append((n, local, visible[cupy.cuda.Device().id]))
                mine.append((n, local, physical_gpu(local, visible)))
    finally:
        if before is None:
            os.environ.pop("SIMGPU_DEVICES", None)
        else:
            os.environ["SIMGPU_DEVICES"] = before
        cupy.cuda.Device(0).use()
    for n in (2, "one each"):
        check.say(f"GPUs {n}: physical GPU of local ranks 0-7: {[g for k, _, g in mine if k == n]}")
    check.equal("physical_gpu == the GPU select_gpu makes current, in every case", mine, selected)


# ---------------------------------------------------------------------------------------------------- exercise 3

def staged_bytes(traffic, sizes, to_host_bytes):
    """(device-to-host bytes, host-to-device bytes, device-to-host transfers) of a step with staging, from the
    step's {(comm, op): (calls, payload)}: every collective on a communicator of more than one rank."""
    d2h, h2d, transfers = to_host_bytes, 0, 1                           # the step's one to_host vector
    for (comm, op), (calls, payload) in traffic.items():
        p = sizes[comm]
        if p == 1:                                                      # Comm skips MPI: nothing staged
            continue
        if op in ("Allreduce", "Iallreduce"):                           # the buffer out, and back
            d2h, h2d = d2h + payload, h2d + payload
        elif op == "Allgather":                                         # my part out, the whole back
            d2h, h2d = d2h + payload // p, h2d + payload
        elif op == "Reduce_scatter_block":                              # the whole out, my part back
            d2h, h2d = d2h + payload, h2d + payload // p
        else:
            raise ValueError(f"no rule for {op}")
        transfers += calls
    return d2h, h2d, transfers


def exercise_3(check):
    """The bytes staged in one step, against the simulated GPU."""
    cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
    corpus = Corpus.load(None, cfg.seq_len)
    moved = {"d2h": 0, "h2d": 0}
    get, put = cupy.ndarray.get, cupy.ndarray.set

    def counting_get(self, *args, **kwargs):
        moved["d2h"] += self.nbytes
        return get(self, *args, **kwargs)

    def counting_set(self, host, *args, **kwargs):
        moved["h2d"] += host.nbytes
        return put(self, host, *args, **kwargs)

    cupy.ndarray.get, cupy.ndarray.set = counting_get, counting_set
    try:
        for scheme in ("megatron", "gather"):
            grid = ProcessGrid(world, dp=1, tp=2)
            trainer = HybridTrainer(cfg, grid, train_config(dp=1, tp=2, tp_scheme=scheme, steps=2, batch_size=4,
                                                            device="gpu", threads=1))
            for step in (1, 2):                                         # step 1 also fills the staging pool
                idx, targets = corpus.batch(0, step, 4)
                calls, got, counted = grid.stats.counts(), dict(moved), cupy.counts["d2h"]
                trainer.step(idx, targets, step)
            traffic = grid.stats.since(calls)                           # the last step's collectives
            measured = (moved["d2h"] - got["d2h"], moved["h2d"] - got["h2d"], cupy.counts["d2h"] - counted)
            sizes = {"dp": grid.dp_comm.size, "tp": grid.tp_comm.size}
            vector = 4 * np.dtype(trainer.pbuf.flat.dtype).itemsize      # to_host: loss, non-finite, 2 norms
            predicted = staged_bytes(traffic, sizes, vector)
            check.say(f"{scheme}: {', '.join(f'{c} {o} {n} calls {b:,} B' for (c, o), (n, b) in traffic.items())}; "
                      f"staged D2H {measured[0]:,} B, H2D {measured[1]:,} B, {measured[2]} D2H transfers")
            check.equal(f"{scheme}: (D2H bytes, H2D bytes, D2H transfers) == the prediction", measured, predicted)
            trainer.free()
            grid.free()
    finally:
        cupy.ndarray.get, cupy.ndarray.set = get, put


# ---------------------------------------------------------------------------------------------------- exercise 4

def clip_by_norm(g, max_norm):
    """The exercise's version: float() copies the norm to the host, and `if` needs it there."""
    norm = float((g * g).sum()) ** 0.5
    if norm > max_norm:
        g = g * (max_norm / norm)
    return g


def clip_by_norm_on_device(g, max_norm):
    """No transfer: the scale is min(1, max_norm / norm), computed and applied on the device."""
    xp = cupy.get_array_module(g)
    norm = xp.sqrt((g * g).sum())                                       # a 0-d device array
    return g * xp.minimum(1.0, max_norm / xp.maximum(norm, 1e-30))     # (the floor: a zero gradient stays zero)


def exercise_4(check):
    """Find the host round trip, and remove it."""
    rng = np.random.default_rng(rank)
    for scale, where in ((10.0, "above"), (0.01, "below")):            # a norm above, and below, the limit
        g = cupy.asarray(rng.standard_normal(1000) * scale)
        before = cupy.counts["d2h"]
        host_version = clip_by_norm(g, 1.0)
        in_clip = cupy.counts["d2h"] - before
        before = cupy.counts["d2h"]
        with cupyx.allow_synchronize(False):                            # any synchronizing transfer would raise
            device_version = clip_by_norm_on_device(g, 1.0)
        in_device_clip = cupy.counts["d2h"] - before
        check.say(f"gradient norm of order {scale * 1000 ** 0.5:.1f}: clip_by_norm made {in_clip} transfer(s), "
                  f"the device version {in_device_clip}")
        check.equal(f"norm {where} the limit: transfers (clip_by_norm, device version)",
                    (in_clip, in_device_clip), (1, 0))
        check(f"norm {where} the limit: device version vs clip_by_norm (rel)",
              rel_err(cupy.asnumpy(device_version), cupy.asnumpy(host_version)), 1e-15)


# ---------------------------------------------------------------------------------------------------- exercise 5

def bf16_bits(x):
    """float32 x rounded to bfloat16 (ties to even) on its bit pattern: b + 0x7FFF + the lowest kept bit, the lower
    16 bits cleared. NaNs pass untouched: a NaN whose payload sits only in the lower 16 bits would become inf, and
    one with all significand bits set would carry into the sign bit."""
    b = x.view(np.uint32).astype(np.uint64)                             # room for the carry of 0xFFFFxxxx patterns
    r = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, r)


def exercise_5(check):
    """bfloat16 by integer arithmetic."""
    rng = np.random.default_rng(5 + rank)
    patterns = rng.integers(0, 2 ** 32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    upper = rng.integers(0, 0x7F80, 100_000, dtype=np.uint32) << 16     # finite bfloat16 numbers >= 0
    midpoints = (upper | 0x8000).view(np.float32)                       # exactly halfway to the next one
    top = np.float32(FORMATS["bfloat16"].max).view(np.uint32) + np.arange(-4, 0x8001, dtype=np.int64)
    near_max = top.astype(np.uint32).view(np.float32)                   # just below max .. halfway to 2^128
    near_max = np.concatenate([near_max, -near_max])
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0 ** -149, -2.0 ** -149], np.float32)
    for what, x in (("100,000 random bit patterns", patterns), ("100,000 midpoints", midpoints),
                    ("around bfloat16's max, both signs", near_max), ("0, -0, +-inf, NaN, +-2^-149", specials)):
        with np.errstate(invalid="ignore"):
            mine = bf16_bits(x).view(np.uint32)
        theirs = round_to(x, "bfloat16").view(np.uint32)
        check.equal(f"bf16_bits == round_to, bit for bit: {what} (differing)", int((mine != theirs).sum()), 0)
    n_nan = int(np.isnan(patterns).sum())
    check.say(f"({n_nan} of the random patterns are NaNs, passed through; "
              f"{int(np.isinf(round_to(near_max, 'bfloat16')).sum())} values near max overflowed to +-inf)")
    ties = bf16_bits(midpoints).view(np.uint32)
    check.holds("every midpoint went to the neighbour with an even last bit", not ((ties >> 16) & 1).any())


if __name__ == "__main__":
    if world.Get_size() != 2:
        raise SystemExit("run on 2 ranks: mpirun -n 2 python tutorials/solutions/21_gpus.py" if rank == 0 else 1)
    solve(Checks(world, tol=1e-12, width=72), [exercise_1, exercise_2, exercise_3, exercise_4, exercise_5])
