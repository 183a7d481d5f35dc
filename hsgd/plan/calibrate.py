"""Calibration: measure this machine's matmul rate, memory bandwidth and the cost of each collective, and write a
hardware file.

    mpirun -n 8 python -m hsgd.plan.calibrate --out hsgd/plan/hw/this-machine.toml [--quick]
    (the planner's CLI calls the same function: mpirun -n 8 python -m hsgd.plan --calibrate --out FILE)

Matmul: every rank at once multiplies two n x n matrices (n = 256, one BLAS thread per rank), k = 16 or 32 times in
a row per trial so that a trial spans many of the scheduler's time slices (with k = 4 on 8 ranks sharing 2 cores, a
rank could finish inside one slice and seem 4x faster); a trial's time is its slowest rank's, the time of one
multiply t = (trial time) / k, the median over trials, and the rate per rank

    rate = 2 n^3 / t     (FLOP/s per rank with all ranks busy: what a training step sees when ranks share cores)

for float64 and float32 (the slowest rank's, so the minimum over ranks).

Memory bandwidth: every rank at once computes c[:] = a + b on float64 arrays of 8 MiB each (two ranks running at a
time on 2 cores touch 48 MiB, beyond a 32 MiB L3), k = 4 or 8 passes per trial; a pass moves 3 x 8 MiB, a trial's
time is its slowest rank's, and

    memory_bandwidth = 3 x array bytes / (median over trials of the time of one pass)   (bytes/s per rank)

(hsgd.plan.costs prices elementwise work with it: each stored activation written and read).

Collectives: for p = 2 .. P the ranks form size // p disjoint groups of p consecutive ranks (world.Split; the ranks
left over wait), and all groups call at once, as a training step's tp groups (or dp, pp groups) do: on a box whose
ranks share cores and memory, one group alone would see idle neighbours and seem up to 2x faster. Each of Allreduce,
Reduce_scatter_block and Allgather (and Sendrecv between 2 ranks, p = 2 only) runs on float64 arrays of S sizes,
log-spaced from 8 B to 4 MiB. One repetition: Barrier over every group's ranks, then the call, timed on each rank;
the call is done when its slowest rank is, so a repetition's time is the maximum over the ranks of all groups; per
size the median over repetitions.
The payload n is counted as hsgd's CommStats counts it: the whole array for Allreduce and Reduce_scatter_block
(the send buffer), the whole received array for Allgather, the message for Sendrecv. Then the line

    t(n) = alpha + beta n                  (alpha: s per call, beta: s per byte; 1/beta is a bandwidth)

is fitted by least squares on the relative error, min sum_i ((alpha + beta n_i - t_i) / t_i)^2, so that the small
sizes (which fix alpha) count as much as the large ones (which fix beta); alpha and beta are clipped to tiny positive
values when noise makes one negative. The fits go to [measured.OP.p]; the Sendrecv line also gives [intra_node]
(latency = alpha, bandwidth = 1/beta) and, as there is no network on one box, [inter_node].

Left out: groups of ranks that are not consecutive (on one node all ranks are alike), overlap of communication with
compute (a rank waiting in a collective while its neighbours compute), sizes beyond 4 MiB (the line is
extrapolated), and the cost of hsgd's own elementwise layers, optimizer and Python per layer (which the
bandwidth of c = a + b prices low: see benchmarks/plan_this_machine.py).
"""
import datetime
import os
import sys
import time

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from hsgd.errors import UsageError
from hsgd.cli import Parser
from hsgd.files import writable_file
from hsgd.readers import machine_memory
from .hardware import OPS, Hardware, HardwareError, Link, to_toml

TINY_ALPHA = 1e-9               # s: the smallest alpha written (a fit may come out negative from noise)
TINY_BETA = 1e-15               # s/byte: the smallest beta written (1 PB/s)
STREAM_BYTES = 8 * 2 ** 20      # bytes of each of a, b, c in the bandwidth test: 2 ranks at a time on 2 cores hold
                                # 48 MiB, beyond a 32 MiB L3 (8 ranks: 192 MiB)


def matmul_rate(world, dtype, n, k, trials):
    """FLOP/s per rank of an n x n matmul in dtype with every rank of world multiplying at once (the slowest rank)."""
    rng = np.random.default_rng(world.Get_rank())
    a, b = rng.standard_normal((2, n, n)).astype(dtype)       # (n, n) each
    c = np.empty((n, n), dtype)

    def k_matmuls(_):
        for _ in range(k):
            np.matmul(a, b, out=c)
    with threadpool_limits(1):
        return 2 * n ** 3 / (time_call(world, k_matmuls, trials) / k)


def memory_bandwidth(world, nbytes, k, trials):
    """Bytes/s per rank of c[:] = a + b on float64 arrays of nbytes each with every rank of world adding at once (the
    slowest rank): a pass reads a and b and writes c, 3 nbytes."""
    rng = np.random.default_rng(world.Get_rank())
    a, b = rng.standard_normal((2, max(1, nbytes // 8)))      # (n,) each, float64
    c = np.empty_like(a)

    def k_adds(_):
        for _ in range(k):
            np.add(a, b, out=c)
    return 3 * a.nbytes / (time_call(world, k_adds, trials) / k)


def buffers(op, nbytes, p):
    """(call, payload bytes as CommStats counts them) for op moving about nbytes in total on p ranks."""
    if op in ("Allreduce", "Sendrecv"):
        x = np.zeros(max(1, nbytes // 8))                      # (m,) float64
        if op == "Allreduce":
            return lambda comm: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM), x.nbytes
        y = np.empty_like(x)
        return lambda comm: comm.Sendrecv(x, dest=1 - comm.Get_rank(), recvbuf=y, source=1 - comm.Get_rank()), \
            x.nbytes
    m = max(p, round(nbytes / 8 / p) * p)                      # whole-array elements, a multiple of p
    full, part = np.zeros(m), np.zeros(m // p)                 # (m,) and (m/p,) float64
    if op == "Reduce_scatter_block":
        return lambda comm: comm.Reduce_scatter_block(full, part, op=MPI.SUM), full.nbytes
    return lambda comm: comm.Allgather(part, full), full.nbytes  # Allgather: the received array counts


def time_call(comm, call, reps, sync=None):
    """Median over reps of the call's time on comm, each repetition's time the maximum over the ranks of `sync` (a
    communicator holding comm's ranks and those of the groups that run at the same time; default comm)."""
    sync = sync or comm
    call(comm)                                                 # warm-up: connections, buffers
    times = np.empty(reps)
    for i in range(reps):
        sync.Barrier()                                         # every group starts together
        t0 = time.perf_counter()
        call(comm)
        times[i] = time.perf_counter() - t0
    sync.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)            # (reps,) the slowest rank of each repetition
    return float(np.median(times))


def fit(ns, ts):
    """(alpha, beta) of t = alpha + beta n, least squares on the relative error; both clipped to be > 0."""
    ns, ts = np.asarray(ns, float), np.asarray(ts, float)
    A = np.stack([np.ones_like(ns), ns], axis=1) / ts[:, None]  # (S, 2) rows divided by t_i: relative error
    (alpha, beta), *_ = np.linalg.lstsq(A, np.ones_like(ts), rcond=None)
    return max(float(alpha), TINY_ALPHA), max(float(beta), TINY_BETA)


def measure_collectives(world, sizes, reps, say):
    """{op: {p: (alpha, beta)}} on rank 0 ({} elsewhere), for p = 2 .. world size: size // p disjoint groups of p
    consecutive ranks call at once, as a training step's tp (or dp, pp) groups do; the ranks left over wait."""
    rank, size, measured = world.Get_rank(), world.Get_size(), {}
    for p in range(2, size + 1):
        busy = size // p * p                                   # ranks in a group: 0 .. busy - 1
        comm = world.Split(rank // p if rank < busy else MPI.UNDEFINED, rank)   # my group; COMM_NULL: left over
        both = world.Split(0 if rank < busy else MPI.UNDEFINED, rank)          # every group's ranks
        if comm != MPI.COMM_NULL:
            for op in OPS:
                if op == "Sendrecv" and p != 2:
                    continue
                calls = dict((n, call) for call, n in (buffers(op, s, p) for s in sizes))   # n -> call, no repeats
                points = [(n, time_call(comm, call, reps, both)) for n, call in calls.items()]   # (n bytes, s)
                if rank == 0:
                    alpha, beta = measured.setdefault(op, {})[p] = fit(*zip(*points))
                    say(f"calibrate: {op} p={p} ({size // p} groups at once): alpha {alpha * 1e6:.1f} us, 1/beta "
                        f"{1 / beta / 1e9:.2f} GB/s ({len(points)} sizes, {points[0][0]} B .. {points[-1][0]} B)")
            comm.Free()
            both.Free()
        world.Barrier()                                        # the ranks left out wait here, not in a collective
    return measured


def summary(hw):
    """The measured numbers as a table: matmul rates, then op, p, alpha (us), 1/beta (GB/s)."""
    lines = [f"matmul {d}: {r / 1e9:.2f} GFLOP/s per rank (all ranks busy)" for d, r in hw.measured_matmul.items()]
    if hw.memory_bandwidth:
        lines.append(f"memory bandwidth: {hw.memory_bandwidth / 1e9:.2f} GB/s per rank (all ranks busy)")
    lines.append(f"{'op':<22}{'p':>3}{'alpha (us)':>12}{'1/beta (GB/s)':>15}")
    for op, by_p in hw.measured.items():
        for p, (alpha, beta) in sorted(by_p.items()):
            lines.append(f"{op:<22}{p:>3}{alpha * 1e6:>12.1f}{1 / beta / 1e9:>15.2f}")
    return "\n".join(lines)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "an unknown CPU"


def agree(world, error):
    """Raise HardwareError(error of rank 0) on every rank if rank 0 had one (a message or None)."""
    error = world.bcast(error, root=0)
    if error:
        raise HardwareError(error)


def optimizer_cost(world, name, n, trials):
    """Seconds per element of one hsgd.model.optim step of `name` ("sgd" with momentum 0.9, "adamw") on a flat float32
    array of n elements with a weight-decay mask, as the trainer steps its `master`, every rank stepping at once
    (the slowest rank, the median over trials)."""
    from hsgd.model.optim import make_optimizer
    rng = np.random.default_rng(world.Get_rank())
    p, g = rng.standard_normal((2, n)).astype(np.float32)
    decay = {"flat": np.ones(n, np.float32)}
    opt = make_optimizer(name, 1e-3, momentum=0.9, weight_decay=0.1)
    return time_call(world, lambda _: opt.step({"flat": p}, {"flat": g}, decay=decay), trials) / n


# the reference block of block_cost: not a model the planner is checked on (benchmarks/plan_this_machine.py uses
# C = 128, NH = 8, T = 64), so that what calibration measures is not fitted to what the benchmark compares
BLOCK = dict(vocab_size=64, seq_len=48, d_model=96, n_heads=6, d_ff=384)


def block_cost(world, rate, bandwidth, trials, batches=(1, 2, 4, 8)):
    """(elementwise_passes, block_overhead) of this machine: the forward and backward of one Transformer block on
    one rank (hsgd.tp.model on a 1-rank communicator, float32; BLOCK's shape), every rank at once. A block's time
    is half of a 3-block model's step less a 1-block model's (the embedding and the head cancel); less its matmul
    FLOPs at the measured rate (hsgd.plan.costs.micro_batch_flops), what is left is fitted, over b sequences, to

        overhead + passes x 6 A(b) / bandwidth      A(b): the activation bytes the block stores (hsgd.plan.paper)

    6 A(b) / bandwidth being the planner's elementwise term of a block's forward (2) and backward (4): `passes`
    scales it, and `overhead` is a fixed cost per block and micro-batch (Python, small arrays, the calls)."""
    from hsgd.grid.comm import Comm
    from hsgd.model.config import ModelConfig
    from hsgd.model.data import Corpus
    from hsgd.tp import model as tp_model, shards as tp_shards
    from .costs import micro_batch_flops
    from .paper import activation_bytes
    comm = Comm(MPI.COMM_SELF, "tp")
    corpus = Corpus(np.random.default_rng(0).integers(0, 64, 20000, dtype=np.uint8).tobytes(), "random", 48)
    rest, bytes_ = [], []
    with threadpool_limits(1):
        for b in batches:
            t = {}
            for L in (1, 3):
                cfg = ModelConfig(n_layers=L, **BLOCK)
                params = tp_shards.init_params(cfg, comm, seed=0, dtype="float32")
                idx, targets = corpus.batch(0, 1, b)
                setup = tp_model.TPSetup(cfg, comm)
                t[L] = time_call(world, lambda _: tp_model.loss_and_grads(params, idx, targets, setup), trials)
            cfg = ModelConfig(n_layers=1, **BLOCK)
            flops = sum(micro_batch_flops(cfg, b, 1, 1, 1, False, "none"))
            rest.append((t[3] - t[1]) / 2 - flops / rate)
            bytes_.append(6 * activation_bytes(cfg, b, 1, False, "none") * 4 / 2 / bandwidth)   # float32: 4 bytes
    (passes, overhead) = np.polyfit(bytes_, rest, 1)
    return max(float(passes), 1e-3), max(float(overhead), 1e-9)


def file_notes(size, quick, sizes, reps):
    """The comment lines at the top of the written file: what each number is and how it was measured."""
    return [f"Measured by hsgd.plan.calibrate ({'quick' if quick else 'full'}): {size} ranks, one BLAS thread each.",
            "[peak_flops], [measured_matmul]: FLOP/s per rank of a 256 x 256 matmul with all ranks multiplying",
            "at once (the min over ranks); bfloat16 and float16 are emulated on float32 arrays (hsgd.model.precision),",
            "so their matmuls run at the float32 rate. A CPU has no datasheet peak here: the measured rate is it.",
            f"memory_bandwidth: bytes/s per rank of c[:] = a + b on float64 arrays of {STREAM_BYTES >> 20} MiB",
            "(3 x the array's bytes per pass), all ranks adding at once; the median over trials, slowest rank.",
            "elementwise_passes, block_overhead: one Transformer block's forward and backward (hsgd.tp.model,",
            "float32, C = 96, T = 48) less its matmuls at the measured rate, fitted over b = 1, 2, 4, 8 sequences",
            "to block_overhead + elementwise_passes x 6 x (its stored activation bytes) / memory_bandwidth.",
            "[measured_optimizer]: seconds per element of one hsgd.model.optim step on a flat float32 array.",
            "[measured.OP.p]: t(n bytes) = alpha + beta * n seconds, fitted to the median time (max over ranks)",
            f"of {len(sizes)} float64 sizes from {sizes[0]} B to {sizes[-1]} B, {reps} repetitions each,",
            f"{size} // p groups of p consecutive ranks calling at once; n as",
            "hsgd's CommStats counts it (Allreduce, Reduce_scatter_block: the whole array; Allgather: the whole",
            "received array; Sendrecv: the message)."]


def write_file(hw, out_path, notes, per_node):
    """Write hw as TOML at out_path, whole or not at all; None, or the one-line error."""
    comments = {"memory_bytes": f"MemTotal of /proc/meminfo / {per_node} ranks",
                "memory_bandwidth": "bytes/s per rank of c = a + b, all ranks busy",
                "devices_per_node": "the MPI ranks on this node",
                "intra_node": "the measured Sendrecv between 2 ranks (shared memory)",
                "inter_node": "the same numbers: there is no network, every rank is on this one node"}
    try:
        tmp = f"{out_path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(to_toml(hw, notes, comments))
        os.replace(tmp, out_path)                             # whole or not at all
    except OSError as e:
        return f"calibration output {str(out_path)!r} cannot be written ({e.strerror}); choose another path"
    return None


def calibrate(world, out_path, quick=False, say=print, command=None):
    """Measure on every rank of world, write the hardware file at out_path on rank 0; returns the Hardware on every
    rank. quick: fewer sizes and repetitions (about 2 s on 8 ranks of a 2-core box). say: progress, rank 0 only.
    command: the command line to record in the file's name (default: the planner's `hsgd.plan --calibrate`)."""
    size, rank = world.Get_size(), world.Get_rank()
    if size < 2:
        raise HardwareError("calibration needs at least 2 ranks to time collectives; run it under mpirun, e.g. "
                            "mpirun -n 8 python -m hsgd.plan --calibrate --out FILE")
    error = None
    if rank == 0:
        try:
            writable_file(out_path, "calibration output", HardwareError)
        except UsageError as e:
            error = str(e)
    agree(world, error)                                       # before minutes of measuring, not after
    say = say if rank == 0 else (lambda *a, **k: None)
    sizes = [int(s) for s in np.geomspace(8, 2 ** 20 if quick else 4 * 2 ** 20, 4 if quick else 8)]
    reps, (k, trials) = (3 if quick else 10), ((16, 3) if quick else (32, 5))
    node = world.Split_type(MPI.COMM_TYPE_SHARED)             # the ranks on this node: its "devices"
    per_node = node.Get_size()
    node.Free()

    matmul = {}
    for dtype in ("float64", "float32"):
        matmul[dtype] = matmul_rate(world, dtype, 256, k, trials)
        say(f"calibrate: matmul {dtype} n=256: {matmul[dtype] / 1e9:.2f} GFLOP/s per rank, {size} ranks busy")
    bandwidth = memory_bandwidth(world, STREAM_BYTES, 4 if quick else 8, trials)
    say(f"calibrate: c = a + b on 3 x {STREAM_BYTES >> 20} MiB: {bandwidth / 1e9:.2f} GB/s per rank, {size} ranks busy")
    passes, overhead = block_cost(world, matmul["float32"], bandwidth, 3 if quick else 7,
                                  (1, 4) if quick else (1, 2, 4, 8))
    say(f"calibrate: a block's forward and backward beyond its matmuls: {overhead * 1e3:.3f} ms + {passes:.2f} x its "
        f"stored activations' bytes at the memory bandwidth, {size} ranks busy")
    optimizer = {name: optimizer_cost(world, name, 2 ** 18 if quick else 2 ** 20, trials) for name in ("sgd", "adamw")}
    say("calibrate: optimizer step " + ", ".join(f"{k} {v * 1e9:.2f} ns" for k, v in optimizer.items())
        + f" per element, {size} ranks busy")
    measured = measure_collectives(world, sizes, reps, say)

    hw, error = None, None
    if rank == 0:
        alpha, beta = measured["Sendrecv"][2]
        link = dict(bandwidth=1 / beta, latency=alpha)
        rates = dict(matmul, bfloat16=matmul["float32"], float16=matmul["float32"])   # emulated in float32 arrays
        when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        command = command or f"python -m hsgd.plan --calibrate{' --quick' * quick} --out {out_path}"
        hw = Hardware(name=f"this machine: {size} MPI ranks on {os.cpu_count()} cores of {cpu_name()}, calibrated "
                           f"{when} by `mpirun -n {size} {command}`",
                      memory_bytes=float(machine_memory() // per_node), devices_per_node=per_node, peak_flops=rates,
                      intra=Link(**link, name="intra-node"), inter=Link(**link, name="inter-node"),
                      memory_bandwidth=bandwidth, measured=measured, measured_matmul=rates, source=str(out_path),
                      elementwise_passes=passes, block_overhead=overhead, measured_optimizer=optimizer)
        error = write_file(hw, out_path, file_notes(size, quick, sizes, reps), per_node)
        say(summary(hw))
        if not error:
            say(f"calibrate: wrote {out_path}")
    agree(world, error)
    return world.bcast(hw, root=0)


def main(argv=None):
    """The exit code of mpirun -n P python -m hsgd.plan.calibrate argv: 0, or 2 on every rank with one line from
    rank 0 for a usage error (hsgd.cli)."""
    from hsgd.grid import launch
    ap = Parser(prog="mpirun -n P python -m hsgd.plan.calibrate", speaks=launch.on_rank_zero,
                description="Measure this machine's matmul rate and collective costs (run under mpirun -n 8) and "
                            "write them as a hardware file for hsgd.plan.")
    ap.add_argument("--out", required=True, help="the TOML file to write, e.g. hsgd/plan/hw/this-machine.toml")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (seconds, not a minute)")
    world = MPI.COMM_WORLD

    def body():
        args = ap.parse_args(argv)
        calibrate(world, args.out, quick=args.quick, say=lambda *a: print(*a, flush=True),
                  command=f"python -m hsgd.plan.calibrate{' --quick' * args.quick} --out {args.out}")
        return 0

    return launch.run(body, world)


if __name__ == "__main__":
    sys.exit(main())
