"""The GPU code path on 8 ranks of the simulated GPU (tests/simgpu: CuPy's host/device rules, over NumPy).

What a machine without a GPU can check of the GPU path, and what goes wrong silently on a real one:
  * every device-to-host transfer of training is accounted for: each step's one `to_host` vector, plus, with
    staging, one copy out of each buffer MPI reads; nothing else (no float(), item(), mask or print);
  * forward and backward make no transfer at all (under cupyx.allow_synchronize(False), where one raises);
  * staging takes its pinned host buffers from a pool: none is allocated after the first step (the second with
    staleness, where two exchanges are in flight from then on);
  * both transfer paths, device pointers to MPI (HSGD_CUDA_AWARE=1) and staging (0), train exactly as the CPU
    path does, float64, on 3-D, ZeRO, overlapped, hierarchical, sequence- and context-parallel layouts (bfloat16
    and float16, emulated, bit for bit too), and MPI is never handed a device pointer while kernels are still
    queued on the stream.
Kernels, speed and memory need a real GPU: `make gpu-check`.
"""
import os
import sys

import numpy as np
import pytest

from hsgd.model.config import ModelConfig
from hsgd.model.backend import d2h_count, to_numpy
from hsgd.grid.comm import cuda_aware_mpi
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer

from .conftest import WORLD, check, say, world_max
from .test_hybrid import CFG, CORPUS, config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "simgpu"))
import cupy  # noqa: E402  (the simulated one: its folder is first on the path)
import cupyx  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=8)

# operation -> whether it copies its buffer out of the device when staged: it sends data (a Recv only receives;
# a Bcast sends from its root only, and a training step has none); Allreduce, Allgather and Reduce_scatter_block
# skip MPI altogether on a one-rank communicator
SENDS = {"Allreduce": True, "Iallreduce": True, "Allgather": True, "Reduce_scatter_block": True, "Send": True,
         "Isend": True, "Recv": False, "Irecv": False, "Ireduce_scatter_block": True, "Alltoall": True}
SKIPPED_ON_ONE_RANK = ("Allreduce", "Allgather", "Reduce_scatter_block", "Alltoall")

LAYOUTS = {
    "dp2 pp2 tp2, 2 micro-batches": dict(dp=2, pp=2, tp=2, micro_batches=2),
    "dp4 tp2, overlapped dp, clip": dict(dp=4, tp=2, dp_overlap=True, clip=0.5),
    "dp4 tp2, ZeRO-2 adamw": dict(dp=4, tp=2, zero=2, optimizer="adamw", lr=0.01),
    "dp4 pp2, ZeRO-3 adamw, full recomputation": dict(dp=4, pp=2, tp=1, zero=3, optimizer="adamw", lr=0.01,
                                                      recompute="full", micro_batches=2),
    "dp2 tp4, sequence parallel": dict(dp=2, tp=4, tp_scheme="sequence"),
    "dp8, hierarchical (4 per node)": dict(dp=8, tp=1, hierarchical=True, ranks_per_node=4),
    "dp4 tp2, staleness 1": dict(dp=4, tp=2, dp_staleness=1),        # two exchanges of one shape in flight
    "dp2 cp2 tp2, ring attention": dict(dp=2, cp=2, tp=2),
    "cp4 tp2, all-gather attention, ZeRO-1": dict(dp=1, cp=4, tp=2, cp_scheme="allgather", zero=1),
    "dp2 cp2 tp2, Ulysses' all-to-alls": dict(dp=2, cp=2, tp=2, cp_scheme="ulysses"),
    "dp2 pp2 tp2, bfloat16, exchange in bfloat16": dict(dp=2, pp=2, tp=2, micro_batches=2, dtype="bfloat16",
                                                        reduce_dtype="bfloat16"),
    "dp4 tp2, float16, loss scaling": dict(dp=4, tp=2, dtype="float16"),
}


@pytest.fixture(params=[True, False], ids=["cuda-aware", "staging"])
def transfer_path(request, monkeypatch):
    monkeypatch.setenv("HSGD_CUDA_AWARE", "1" if request.param else "0")
    cuda_aware_mpi.cache_clear()                                 # decided once per process: decide again
    request.addfinalizer(cuda_aware_mpi.cache_clear)
    return request.param


def test_the_simulated_device_keeps_cupys_rules():
    """The stand-in must refuse what CuPy refuses and count what CuPy transfers, or the tests below prove nothing."""
    x = cupy.arange(6.0).reshape(2, 3)                           # (2, 3) on the device
    refused = []
    for what, f in (("np.asarray", lambda: np.asarray(x)), ("x + host", lambda: x + np.ones(3)),
                    ("host + x", lambda: np.ones(3) + x), ("cupy.exp(host)", lambda: cupy.exp(np.ones(3))),
                    ("x + list", lambda: x + [1.0, 2.0, 3.0]), ("a function CuPy lacks", lambda: cupy.busday_count),
                    ("get(out=) of another dtype", lambda: x.get(out=np.zeros((2, 3), np.float32)))):
        try:
            f()
        except (TypeError, AttributeError):
            refused.append(what)
    before = dict(cupy.counts)
    total = float((x * 2).sum())                                 # one transfer
    picked = x[x > 2.0]                                          # a boolean mask: one transfer (the size)
    host = x.get()                                               # one transfer
    transfers = cupy.counts["d2h"] - before["d2h"]
    with cupyx.allow_synchronize(False):
        try:
            x.item()
            raised = False
        except cupyx.DeviceSynchronized:
            raised = True
    y = cupy.zeros(6)                                            # a kernel queued: MPI must not read yet
    try:
        WORLD.Allreduce(x.reshape(-1), y)
        unsynchronized = "accepted"
    except (RuntimeError, TypeError):                           # mpi4py reports it as a TypeError
        unsynchronized = "refused"
    flat = x.reshape(-1)
    cupy.cuda.get_current_stream().synchronize()
    WORLD.Allreduce(flat, y)                                     # mpi4py reads __cuda_array_interface__
    summed = y.get()
    say(f"refused: {refused}; transfers counted: {transfers}; sync refused: {raised}; MPI before the stream "
        f"synchronized: {unsynchronized}")
    check(len(refused) == 7 and transfers == 3 and raised and unsynchronized == "refused" and total == 30.0
          and picked.shape == (3,) and host.tolist() == [[0, 1, 2], [3, 4, 5]]
          and summed.tolist() == [8.0 * i for i in range(6)])


def staged_sends(since, sizes):
    """How many device-to-host copies staging makes for the calls in `since` ({(comm, op): (calls, bytes)})."""
    return sum(n for (c, op), (n, _) in since.items()
               if SENDS[op] and not (op in SKIPPED_ON_ONE_RANK and sizes[c] == 1))


def run(tc, steps=4):
    """tc's layout for `steps` steps; returns (grid, trainer, per-step [to_host copies, all device-to-host
    transfers, transfers staging accounts for, pinned allocations], the same for the whole run). A non-blocking
    exchange is counted by the stats when it completes, which with staleness is the next step (or finish), so
    the exact accounting is over the whole run."""
    grid = ProcessGrid(WORLD, dp=tc.dp, pp=tc.pp, tp=tc.tp, cp=tc.cp)
    trainer = HybridTrainer(CFG, grid, tc)
    rpn = tc.ranks_per_node or 1
    sizes = {"world": WORLD.Get_size(), "tp": grid.tp, "pp": grid.pp, "dp": grid.dp_comm.size, "cp": grid.cp,
             "dp-node": rpn, "dp-cross": grid.dp // rpn}

    def now():
        return d2h_count(), cupy.counts["d2h"], grid.stats.counts(), cupy.counts["pinned"]

    def since(then):
        copies, d2h, calls, pinned = then
        staged = 0 if cuda_aware_mpi() else staged_sends(grid.stats.since(calls), sizes)
        return d2h_count() - copies, cupy.counts["d2h"] - d2h, staged, cupy.counts["pinned"] - pinned

    start, per_step = now(), []
    for step in range(1, steps + 1):
        idx, targets = CORPUS.batch(tc.seed, step, tc.batch_size)
        before = now()
        trainer.step(idx, targets, step)
        per_step.append(since(before))
    trainer.finish()
    return grid, trainer, per_step, since(start)


CPU_PARAMS = {}                     # layout -> the CPU path's parameters after the run: one run serves both paths


def cpu_run_params(layout):
    """The parameters the CPU path ends with in `layout` (ZeRO-3: gathered), run once: the transfer path only
    decides how device arrays reach MPI, so both transfer paths compare with the same CPU run."""
    if layout not in CPU_PARAMS:
        grid, cpu, *_ = run(config(device="cpu", **LAYOUTS[layout]))
        CPU_PARAMS[layout] = {n: np.array(p) for n, p in cpu.exchange.full_params().items()}
        grid.free()
    return CPU_PARAMS[layout]


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_gpu_path_transfers_and_training(layout, transfer_path):
    kw = LAYOUTS[layout]
    gpu_grid, gpu, per_step, (to_host, d2h, staged, _) = run(config(device="gpu", **kw))
    gpu_params = gpu.exchange.full_params()                      # (ZeRO-3: gathered)
    cpu_params = cpu_run_params(layout)
    on_device = all(type(p).__module__ == "cupy" for p in gpu_params.values())
    err = max(float(np.abs(to_numpy(gpu_params[n]) - p).max() / max(np.abs(p).max(), 0.02))
              for n, p in cpu_params.items())
    accounted = all(step[0] == 1 for step in per_step) and d2h == to_host + staged
    settled = 2 if kw.get("dp_staleness") else 1                 # staleness: two exchanges in flight from step 2
    pinned_later = sum(p for *_, p in per_step[settled:])
    say(f"{layout} ({'CUDA-aware' if transfer_path else 'staging'}): per step [to_host, device-to-host, of them "
        f"staged, pinned allocations] {per_step}; run: {d2h} transfers = {to_host} to_host + {staged} staged; "
        f"params vs the CPU path {world_max(err):.1e}")
    gpu_grid.free()
    check(on_device and accounted and pinned_later == 0 and err <= 1e-12,
          f"on device {on_device}, accounted {accounted} {per_step}, pinned after step {settled}: {pinned_later}, "
          f"err {err:.1e}")
    if transfer_path:
        check(all(p == 0 for *_, p in per_step), "the CUDA-aware path allocated pinned host memory")


def test_a_staged_receive_waits_for_the_copy_out_of_its_buffer(monkeypatch, request):
    """Staging: a Recv ends with x.set(host), an asynchronous copy out of the host buffer, which then goes back to
    the pool. The next Recv of that shape takes the same buffer and MPI writes into it: Comm._buf must synchronize
    the stream first, or the copy may still be reading. Two Recvs in a row, nothing in between to synchronize."""
    from hsgd.grid.comm import Comm
    monkeypatch.setenv("HSGD_CUDA_AWARE", "0")
    cuda_aware_mpi.cache_clear()
    request.addfinalizer(cuda_aware_mpi.cache_clear)
    rank = WORLD.Get_rank()
    pair = Comm(WORLD.Split(color=rank // 2, key=rank), "pair")              # ranks 2i and 2i + 1
    x = cupy.zeros(4)
    error = ""
    try:
        if pair.rank == 0:
            for message in (1.0, 2.0):
                pair.Send(cupy.full(4, message), dest=1)
        else:
            pair.Recv(x, source=0)
            pair.Recv(x, source=0)                                           # the same pinned buffer again
            cupy.cuda.get_current_stream().synchronize()                     # raises if it was overwritten early
    except RuntimeError as e:
        error = str(e)
    got = x.get().tolist() if pair.rank == 1 else [2.0] * 4
    pair.free()
    error = next((e for e in WORLD.allgather(error) if e), "")                 # the receivers' verdict, on all
    say(f"two staged Recvs into one buffer: {error or 'the copy out finished before MPI wrote again'}; got {got}")
    check(not error and got == [2.0] * 4, error or str(got))


@pytest.mark.parametrize("scheme", ["megatron", "gather"])
def test_forward_and_backward_never_synchronize(scheme):
    """Under cupyx.allow_synchronize(False) any transfer raises. Each rank trains alone here (a one-rank grid on
    COMM_SELF), so an exception cannot leave another rank waiting in a collective; the verdict is collective."""
    from mpi4py import MPI
    grid = ProcessGrid(MPI.COMM_SELF, dp=1, tp=1)
    trainer = HybridTrainer(CFG, grid, config(dp=1, tp=1, device="gpu", tp_scheme=scheme))
    idx, targets = (cupy.asarray(a) for a in CORPUS.batch(0, WORLD.Get_rank(), 8))
    with cupyx.allow_synchronize(False):
        try:
            trainer.gradients(idx, targets)
            error = ""
        except cupyx.DeviceSynchronized as e:
            error = str(e)
    grid.free()
    say(f"{scheme}: forward and backward under allow_synchronize(False): {error or 'no transfer'}")
    check(not error, error)


def test_verify_on_the_simulated_gpu(transfer_path):
    """hsgd.verify's own check (parallel gradients against serial NumPy) on device arrays."""
    import io

    from hsgd import verify
    tc = config(dp=2, pp=2, tp=2, micro_batches=2, device="gpu")
    ok, rows = verify.verify(ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=4, n_layers=2,
                                              d_ff=16), tc, WORLD, out=io.StringIO())
    worst = max((r[5] for r in rows), default=0.0)
    say(f"hsgd.verify dp2 pp2 tp2 on the simulated GPU: {'PASS' if ok else 'FAIL'}, largest error {worst:.1e}")
    check(ok)


@pytest.mark.parametrize("n_gpus", [1, 4, 8])
def test_each_rank_uses_the_gpu_of_its_node_local_rank(n_gpus, monkeypatch):
    """place_on_device binds rank r (node-local) to GPU r % n_gpus: one GPU each when there are enough, shared
    evenly when there are fewer (the simulated node has $SIMGPU_DEVICES of them)."""
    from hsgd.grid.devices import local_ranks, place_on_device
    monkeypatch.setenv("SIMGPU_DEVICES", str(n_gpus))
    try:
        where = place_on_device(config(device="gpu"), WORLD)
        mine = cupy.cuda.Device().id
    finally:
        monkeypatch.setenv("SIMGPU_DEVICES", "1")
        cupy.cuda.Device(0).use()                                # as the other tests expect
    local, _ = local_ranks(WORLD)
    per_gpu = np.bincount(WORLD.allgather(mine), minlength=n_gpus)
    say(f"{n_gpus} GPU(s): ranks per GPU {per_gpu.tolist()}; header: {where}")
    check(mine == local % n_gpus and per_gpu.max() - per_gpu.min() <= 1 and f"{n_gpus} GPU(s) on this node" in where,
          f"rank on GPU {mine}, local rank {local}")
