# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 21: GPUs
#
# The last chapter of Part IV, operations: the course's code on GPUs, one rank per GPU. The lecture's section 4.1
# says what the hardware asks of the communication: **NVLink inside a server, InfiniBand between servers**, so
# model-parallel traffic should stay inside a server; and an **efficient collective library such as NCCL**. This
# chapter shows what changes when each rank drives a GPU, and what does not.
#
# Run it with two ranks: about 3.5 s on a 2-core machine without a GPU, about 5 s on the simulated GPU (up to 20 s on
# a shared machine). On failure every rank raises, so it exits non-zero without hanging:
#
# mpirun -n 2 python tutorials/21_gpus.py
#
# Without CuPy or a GPU every cell runs on NumPy, and the checks that need a device (GELU on the device, each rank's
# current GPU, the count of every host/device transfer) are skipped where they would be. On the simulated GPU of
# `tests/simgpu` (section 4), `PYTHONPATH=tests/simgpu mpirun -n 2 python tutorials/21_gpus.py`, every cell takes its
# GPU branch and every check runs; nothing is timed. With CuPy and a GPU (`pip install -e '.[gpu]'`) each rank runs
# on GPU `local_rank % n_gpus`. The test suite runs the first two. Only rank 0 prints.
#
# Legend: P ranks, dp / tp / pp the grid sizes (chapter 3), xp the array module (numpy or cupy), "host" the CPU
# and its memory, "device" the GPU and its memory, D2H / H2D a device-to-host / host-to-device copy. B batch,
# T sequence, C d_model, NH heads, F d_ff, V vocabulary, L layers.

# %%
import ctypes
import os

import numpy as np
from mpi4py import MPI

from hsgd.model.config import ModelConfig
from hsgd.step import health
from hsgd.model import serial
from hsgd.model.backend import array_module, d2h_count, get_xp, to_device, to_numpy
from hsgd.grid.comm import Comm, cuda_aware_mpi, cuda_support_query
from hsgd.model.data import Corpus
from hsgd.grid.process_grid import ProcessGrid
from hsgd.step.trainer import HybridTrainer
from hsgd.model.layers import gelu_forward
from hsgd.step.loss_scale import LossScaler
from hsgd.model.precision import FORMATS, POINTS, Numerics, round_to, unit_roundoff
from hsgd.grid.devices import local_ranks, place_on_device

import pictures                                     # tutorials/pictures.py: where the PNGs go
from checks import mpi_chapter, rel_err, train_config   # tutorials/checks.py, shared by the chapters

P = 2
# one BLAS thread per rank; the ranks this chapter needs, else a clear exit; check(what, err, tol) and
# check.holds(what, cond), collective: they raise on every rank at once; say(...) prints on rank 0
world, rank, check, say = mpi_chapter(__file__, P, tol=1e-10, width=66)


def gpus_visible():
    """How many GPUs CuPy sees: 0 without CuPy, without a driver or without a device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:                   # ImportError, or CUDA's error when there is no driver or no device
        return 0


N_GPUS = world.allreduce(gpus_visible(), op=MPI.MIN)   # every rank takes the same path, so all make the same checks
DEVICE = "gpu" if N_GPUS else "cpu"
xp = get_xp(DEVICE)                     # numpy, or cupy
say(f"device: {place_on_device(train_config(device=DEVICE), world)}")   # binds each rank to its GPU (section 3)
SEED = 0
corpus = Corpus.load(None, 16)          # the built-in corpus (the Python standard library's source), as hsgd.train

# %% [markdown]
# The line above is the `device:` line of `python -m hsgd.train`'s header, from the same function
# (`hsgd.grid.devices.place_on_device`): `cpu (NumPy)`, or rank 0's GPU and how buffers reach MPI (section 2).
#
# ## 1. One code path for CPU and GPU
#
# CuPy copies NumPy's interface: `cupy.zeros`, `cupy.exp`, `a @ b`, `a.sum(axis=1)` do on the GPU what their NumPy
# namesakes do on the CPU. So a layer never imports numpy for its arrays; it asks its input for its module:
#
#     xp = array_module(x)          # hsgd.model.backend: numpy for a NumPy array, cupy for a CuPy array
#     y = xp.empty_like(x); xp.tanh(u, out=y); ...
#
# Arrays are *created* on a device only in `hsgd/model/backend.py`: `get_xp(device)` gives the module for `"cpu"`
# or `"gpu"` (or `$HSGD_DEVICE`), `to_device(a, xp)` copies a host array there, `to_numpy(x)` brings it back.
# Every other array comes from its inputs' module, so a forward and backward pass stays on its device.

# %%
a = np.linspace(-3.0, 3.0, 8).reshape(2, 4)                             # (2, 4) a host array
y, _ = gelu_forward(a)                                                   # hsgd.model.layers, as the model calls it
say(f"array_module(a) = {array_module(a).__name__}; gelu_forward(a) returned a {type(y).__module__} array")
check.holds("to_device(a, numpy) returns a itself: on the CPU nothing is copied", to_device(a, np) is a)
if DEVICE == "gpu":
    a_dev = to_device(a, xp)                                             # H2D
    y_dev, _ = gelu_forward(a_dev)                                       # the same function, on the GPU
    say(f"array_module(a_dev) = {array_module(a_dev).__name__}; gelu_forward(a_dev) returned a "
        f"{type(y_dev).__module__} array")
    check("gelu_forward on the GPU vs on NumPy (rel)", rel_err(to_numpy(y_dev), y))
else:
    say("(no GPU visible to CuPy: the same cells run on NumPy arrays only)")

# %% [markdown]
# **The same seed gives the same parameters on both.** CuPy's generators do not produce NumPy's numbers, so
# `serial.init_params` draws on the host and copies each array to the device: GPU and CPU runs of a seed start from
# the same model, bit for bit, and tensor-parallel shards are slices of the same draw (`tp_shards.init_params`).
#
# Then the whole model, forward and backward, on the device against NumPy in float64: on a GPU they differ by
# rounding only (other summation orders), far below the check's 1e-10 (as in `tests/test_gpu.py`); without a GPU
# the difference is 0, and the GPU side is checked where there is one (section 5).

# %%
cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)   # a toy
host = serial.init_params(cfg, seed=SEED, dtype="float64", device="cpu")       # NumPy arrays
dev = serial.init_params(cfg, seed=SEED, dtype="float64", device=DEVICE)      # CuPy on a GPU, else NumPy again
idx, targets = corpus.batch(SEED, 1, 4)                                        # (B, T) = (4, 16), host integers
loss_h, grads_h = serial.loss_and_grads(host, idx, targets, cfg)
loss_d, grads_d = serial.loss_and_grads(dev, idx, targets, cfg)                # idx, targets copied H2D inside
say(f"parameters on the host: {type(host['wte']).__module__}, on '{DEVICE}': {type(dev['wte']).__module__}; "
    f"gradients on '{DEVICE}': {type(grads_d['wte']).__module__}")
say(f"loss on the host {loss_h:.15f}, on '{DEVICE}' {loss_d:.15f}")
check.holds(f"init_params on '{DEVICE}' == on the host, bit for bit",
            all(np.array_equal(to_numpy(dev[n]), host[n]) for n in host))
check(f"loss and every gradient on '{DEVICE}' vs NumPy (rel)",
      max([abs(loss_d - loss_h) / loss_h] + [rel_err(to_numpy(grads_d[n]), grads_h[n]) for n in host]))

# %% [markdown]
# ## 2. What a GPU rank needs from MPI
#
# On a GPU the gradients to average live in device memory. mpi4py's uppercase methods accept CuPy arrays and hand
# MPI the **device pointer** of their `__cuda_array_interface__`. What MPI does with it depends on its build:
#
# * **CUDA-aware MPI** (Open MPI or MPICH built with CUDA, MVAPICH2-GDR, Cray MPICH, ...) moves the bytes itself:
#   inside a server over NVLink or PCIe, between servers with GPUDirect RDMA (the InfiniBand card reads and writes
#   GPU memory directly).
# * **Any other MPI** takes the pointer for host memory and crashes or reads garbage. Such a rank must **stage**:
#   copy the buffer to the host (D2H), communicate, copy the result back (H2D): two PCIe copies per collective.
#
# Either way CuPy launches kernels **asynchronously**: `g *= 0.5` returns once the kernel is queued on the stream.
# MPI knows nothing of that stream and could send the buffer before its kernels finish, so the stream must be
# **synchronized** first (hsgd does so on both paths).
#
# `hsgd.grid.comm.Comm._buf`, called by every collective on its buffers:
#
# 1. the buffer must be C-contiguous (MPI reads a pointer and a length): a view is an error, not a silent copy;
# 2. a NumPy array goes to MPI as it is;
# 3. a CuPy array: synchronize the stream, then the array itself if `cuda_aware_mpi()`, else a host copy, copied
#    back after the collective with `x.set(host)`. The host copy is **pinned** (page-locked) memory, which the GPU's
#    copy engine uses at full speed but which is slow to allocate, so `Comm.staging` (a `HostStaging`) keeps a pool
#    per shape and dtype: after the first step nothing is allocated (`hsgd.train`'s `host staging:` line counts the
#    later allocations). A buffer MPI only reads is not copied back; one it only writes is not filled first.
#
# `cuda_aware_mpi()` decides once per process, printed in the `device:` line. `HSGD_CUDA_AWARE=1` or `0` says it;
# otherwise hsgd asks the library's `MPIX_Query_cuda_support()` (MPICH and Open MPI export it) through `ctypes`
# (`hsgd.grid.comm.cuda_support_query`), among the process's global symbols and then in each loaded MPI library
# (mpi4py may load MPI without global symbols, as the MPICH wheel here is). If neither finds it, hsgd assumes "not
# CUDA-aware", which always works. This machine:

# %%
try:
    global_symbol = hasattr(ctypes.CDLL(None), "MPIX_Query_cuda_support")   # the first place hsgd.grid.comm looks
except OSError:                                                          # no process-wide symbol table here
    global_symbol = False
say(f"MPI library:             {' '.join(MPI.Get_library_version().split()[:3])}")
say(f"HSGD_CUDA_AWARE:         {os.environ.get('HSGD_CUDA_AWARE', '(not set)')}")
say(f"MPIX_Query_cuda_support: {'found' if cuda_support_query() else 'not found'} "
    f"({'among the global symbols' if global_symbol else 'not among the global symbols; looked up in the library'})")
path_taken = ("CUDA-aware: device pointers go to MPI" if cuda_aware_mpi()
              else "not CUDA-aware: device buffers are staged through host memory")
say(f"cuda_aware_mpi():        {path_taken}")

# %% [markdown]
# An Allreduce through a `Comm` on the world (chapter 3): rank r makes x_r from its own seed on the host and copies
# it to its device. First a look at what the private `Comm._buf` would hand MPI. The check: every rank rebuilds both
# inputs from their seeds and sums them with NumPy.

# %%
N = 6
world_comm = Comm(world, "world")


def x_of(r):
    """The input vector of world rank r: from r's own seed, on the host, so that anyone can rebuild it."""
    return np.random.default_rng(r).standard_normal(N)                   # (N,)


x = to_device(x_of(rank), xp)                                            # (N,) on my device
handed, done = world_comm._buf(x)                                       # what MPI would be given
done()                                                                   # (staging) the host buffer back
if handed is x:
    path = "the array itself: host memory" if xp is np else "the device pointer (CUDA-aware MPI)"
else:
    path = "a host copy (staging: D2H, MPI, H2D)"
say(f"rank 0 hands MPI {path}")
world_comm.Allreduce(x)                                                  # in place: x <- x_0 + x_1
reference = np.sum([x_of(r) for r in range(P)], axis=0)                  # (N,) serial: NumPy on the host
say(f"rank 0: Allreduce result {np.array2string(to_numpy(x), precision=4)} ({type(x).__module__} array)")
check("Comm.Allreduce vs the NumPy sum of both ranks' vectors (rel)", rel_err(to_numpy(x), reference), 1e-15)
check.holds("the result is still on my device, in place", array_module(x) is xp)

# %% [markdown]
# Staging by hand with plain mpi4py, the three steps above (on a GPU `to_numpy` is the D2H copy, `x.get()`, which
# waits for the stream, and `x[...] = ...` the H2D copy), gives the same numbers:

# %%
def staged_allreduce(x, comm):
    """x <- sum over the ranks of comm, through host memory: D2H, MPI on the host copy, H2D."""
    host_copy = np.array(to_numpy(x))                                    # 1. device -> host (a copy, also on CPU)
    comm.Allreduce(MPI.IN_PLACE, host_copy, op=MPI.SUM)                  # 2. MPI reads and writes host memory
    x[...] = to_device(host_copy, array_module(x))                       # 3. host -> device, into the same array
    return x


x2 = staged_allreduce(to_device(x_of(rank), xp), world)
check("staged by hand vs Comm.Allreduce (rel)", rel_err(to_numpy(x2), to_numpy(x)), 1e-15)

# %% [markdown]
# A strided view is refused before any communication, on every rank alike, so no rank is left waiting:

# %%
grid_of_numbers = xp.zeros((4, N))                                       # (4, N) C-contiguous
try:
    world_comm.Allreduce(grid_of_numbers[:, ::2])                        # (4, N/2) a view with a stride of 2
    message = ""
except ValueError as e:
    message = str(e)
say(f"Allreduce of a strided view -> ValueError: {message}")
check.holds("a strided view raised ValueError on every rank", message)

# %% [markdown]
# **What NCCL would add.** NCCL, which PyTorch and Megatron-LM use on NVIDIA GPUs, runs each collective as kernels
# queued on a stream: the host does not wait. It knows the topology (NVLink, NVSwitch, PCIe, which InfiniBand card is
# near which GPU) and picks rings or trees to match. hsgd keeps MPI, one communication layer with every collective
# visible at its call site; the price is a host wait at each collective, and with staging two PCIe crossings (a
# CUDA-aware MPI on UCX uses NVLink and GPUDirect RDMA, but still does not queue the collective behind the compute).
# `make gpu-check` measures the gap for one step against PyTorch (section 5).
#
# ## 3. One GPU per rank
#
# Rank i of a node uses GPU i of that node. A rank knows its world rank, not its place on the node, so it asks MPI:
# `world.Split_type(MPI.COMM_TYPE_SHARED)` gives one communicator per node (chapter 3's `Split`, with the node as the
# color), and the rank in it is the **node-local rank**. `hsgd.grid.devices.local_ranks(world)` returns (node-local
# rank, ranks on this node), and `backend.select_gpu(local_rank)` makes GPU `local_rank % n_gpus` current
# (`place_on_device` calls both with `--device gpu`). Check: the local rank counts the lower world ranks on the host.

# %%
local_rank, n_local = local_ranks(world)                                 # collective
hosts = world.allgather(MPI.Get_processor_name())
same_host_before = sum(h == hosts[rank] for h in hosts[:rank])
rows = world.gather((rank, hosts[rank], local_rank, n_local), root=0)
say(f"{'world rank':>10} {'local rank':>11} {'ranks on node':>14}  host")
for r, h, lr, nl in rows or []:
    say(f"{r:>10} {lr:>11} {nl:>14}  {h}")
check.equal("node-local rank == lower world ranks on my host", local_rank, same_host_before)
if DEVICE == "gpu":
    import cupy
    check.equal("my current GPU == local_rank % n_gpus", cupy.cuda.Device().id, local_rank % N_GPUS)
else:
    say("(no GPU visible to CuPy: which GPU each rank made current is checked only where there is one)")

# %% [markdown]
# **More ranks than GPUs.** The modulo lets `mpirun -n 8 python -m hsgd.train --device gpu` put eight ranks on one
# GPU, to test parallel code on a workstation: they share its memory and take turns (CUDA time-slices processes; MPS
# runs their kernels side by side), correct but not fast. The mapping for 8 ranks on 1, 2, 4 or 8 GPUs:

# %%
RANKS_PER_NODE = 8
say(f"{'GPUs':>5} | GPU of local rank {' '.join(f'{r:>2}' for r in range(RANKS_PER_NODE))} | ranks per GPU")
balanced = True                         # every GPU gets as many ranks as every other
for n_gpus in (1, 2, 4, 8):
    gpu_of = [r % n_gpus for r in range(RANKS_PER_NODE)]                 # backend.select_gpu's rule
    per_gpu = [gpu_of.count(g) for g in range(n_gpus)]
    balanced &= max(per_gpu) == min(per_gpu)
    say(f"{n_gpus:>5} | {'':>17} {' '.join(f'{g:>2}' for g in gpu_of)} | {per_gpu}")
check.holds("8 ranks on 1, 2, 4, 8 GPUs: as many ranks on every GPU", balanced)

# %% [markdown]
# A scheduler setting `CUDA_VISIBLE_DEVICES` per rank (Slurm's `--gpus-per-task=1`) shows each rank one GPU, 0:
# `local_rank % 1 = 0` picks it.
#
# **On two nodes.** 16 ranks placed 8 per node in blocks (the launchers' default, section 5), tp = 8, dp = 2, and
# chapter 3's `rank = (dp_rank * pp + pp_rank) * tp + tp_rank` with pp = 1:

# %%
TP2, DP2 = 8, 2
say(f"{'world rank':>10} {'node':>5} {'local rank = GPU':>17} {'dp_rank':>8} {'tp_rank':>8}")
numbered, inside = True, True
for r in range(TP2 * DP2):
    node, local = divmod(r, RANKS_PER_NODE)                              # block placement
    dp_rank, tp_rank = divmod(r, TP2)                                    # tp fastest
    numbered &= ProcessGrid.rank_of(dp_rank, 0, tp_rank, 1, TP2) == r    # hsgd.grid.process_grid agrees
    inside &= node == (dp_rank * TP2) // RANKS_PER_NODE                  # on the node of my group's first rank
    if r in (0, 1, 7, 8, 9, 15):
        say(f"{r:>10} {node:>5} {local:>17} {dp_rank:>8} {tp_rank:>8}")
    elif r in (2, 10):
        say(f"{'...':>10}")
check.holds("16 ranks, dp=2 tp=8: numbered as ProcessGrid.rank_of", numbered)
check.holds("16 ranks, 8 per node, dp=2 tp=8: every rank on its tp group's node", inside)

# %% [markdown]
# Each tp_comm (8 consecutive ranks) is one node, its GPUs joined by NVLink; each dp_comm (ranks r and r + 8) joins
# the same GPU position on the two nodes, over InfiniBand: the lecture's section 4.1 (section 5 says why).
#
# ## 4. Silent host round trips
#
# The host queues kernels and runs ahead; it waits only when it needs a *value* from the device. Each of these, on a
# CuPy array, stops the host until every queued kernel has run, moves a few bytes over PCIe, and leaves the GPU idle
# until the next launch:
#
# | on a device array `x` | why it waits |
# |---|---|
# | `float(x)`, `int(x)`, `x.item()` | Python needs the number now |
# | `bool(x)`: `if loss > 10:`, `while`, `assert (x > 0).all()` | Python needs the truth value now |
# | `a[mask]`, `xp.nonzero(m)`, `xp.unique(a)` | the result's size depends on the data: the host needs it to allocate |
# | `print(x)`, `x.tolist()`, `x.get()`, `cupy.asnumpy(x)` | a full copy to the host |
# | `np.asarray(x)` | CuPy refuses (TypeError): no implicit conversion, only explicit copies |
#
# One per layer, every step, leaves a fast GPU waiting on Python much of the time; on NumPy the same lines are free,
# so they creep in unnoticed. hsgd's hot path has no `float()`, `bool()` or `.item()` on device arrays, and **masks by
# multiplication or `xp.where`, never by indexing**, so shapes stay fixed (`tp_layers.vocab_embedding_backward`, the
# norm parts of `health.step_numbers`). The difference, on NumPy:

# %%
rng = np.random.default_rng(1)
g = to_device(rng.standard_normal(10), xp)                               # (10,) a gradient
mask = to_device(np.arange(10) % 3 != 0, xp)                             # (10,) which entries are "sharded"
picked = g[mask]                                                         # shape (count of True,): data-dependent
by_index = (picked * picked).sum()                                       # on a GPU: a sync at g[mask]
by_product = (g * g * mask).sum()                                        # shape (10,) fixed: no sync, stays queued
say(f"g[mask] has shape {picked.shape}: known only after counting the True entries; g * mask has shape "
    f"{(g * mask).shape}")
check("sum of squares by mask multiplication vs by boolean indexing (rel)",
      abs(float(by_product) - float(by_index)) / float(by_index), 1e-15)

# %% [markdown]
# (The `float()` calls of that check are host copies: fine in a check, not in the step.)
#
# **One copy per step.** A step must bring *some* numbers to the host: the loss, whether any gradient is non-finite
# (`--on-nan`, chapter 19), and the gradient norm for clipping. `HybridTrainer.step` computes them on the device,
# stacks `[loss, count of non-finite values, sum of squares of the tp-sharded gradients, of the replicated ones]`,
# and copies that with **one** `backend.to_host` call; the rest is host arithmetic and small pickled MPI calls on
# Python floats. `to_host` counts its copies (`backend.d2h_count()`), on the CPU too, so the count is checked
# without a GPU (`tests/mpi/test_hybrid.py::test_one_host_copy_per_training_step`, three layouts).
#
# Here: dp = 2, tp = 1 (each rank the whole toy model and half of each batch), float64, SGD with momentum, warm-up,
# a cosine schedule and clipping; a few steps, counting each one's copies.

# %%
STEPS = 6
tc = train_config(tp=1, dp=P, steps=STEPS, batch_size=4, warmup=2, clip=1.0, seed=SEED, device=DEVICE)
grid = ProcessGrid(world, dp=P, tp=1)
trainer = HybridTrainer(cfg, grid, tc)                                   # parameters on DEVICE, in one flat buffer
say(f"parameters: one flat {type(trainer.pbuf.flat).__module__} buffer of {trainer.pbuf.flat.size:,} float64")
SIMULATED = getattr(xp, "SIMULATED", False)                             # the simulated GPU (see below)
copies, transfers, losses, traffic, host_bytes = [], [], [], [], []
to_host = health.to_host                                                 # the one copy of a step (hsgd.step.health)
health.to_host = lambda x: host_bytes.append(x.nbytes) or to_host(x)     # ... noting its bytes, for the picture
for step in range(1, STEPS + 1):
    idx, targets = corpus.batch(tc.seed, step, tc.batch_size)            # (B, T) the global batch, host integers
    before, calls = d2h_count(), grid.stats.counts()
    all_before = xp.counts["d2h"] if SIMULATED else 0
    info = trainer.step(idx, targets, step)
    copies.append(d2h_count() - before)
    transfers.append(xp.counts["d2h"] - all_before if SIMULATED else None)
    traffic.append(grid.stats.since(calls))                              # {(comm, op): (calls, payload bytes)}
    losses.append(info.loss)
    per_comm = ", ".join(f"{c} {op} {n - calls.get((c, op), (0, 0))[0]}"
                         for (c, op), (n, _) in sorted(grid.stats.counts().items()))
    say(f"step {step}: loss {info.loss:.4f}  grad norm {info.grad_norm:.4f}  lr {info.lr:.4f}  "
        f"to_host copies {copies[-1]}  collectives: {per_comm}")
health.to_host = to_host
check.equal(f"{STEPS} steps: to_host copies of every step", copies, [1] * STEPS)

# %% [markdown]
# Each step makes one Allreduce of the gradient buffer over dp_comm, and the layers' calls on tp_comm, which with
# tp = 1 still happen (so the counts match chapter 10's formulas) but skip MPI. On a GPU every other collective
# synchronizes, and with staging copies its buffer D2H and H2D: communication, not in `d2h_count`.
#
# **The simulated GPU.** An implicit `float(x)` in the step would escape `d2h_count`, and on NumPy it is no copy at
# all. `tests/simgpu` holds a package named `cupy` (with a `cupyx`), NumPy underneath, that keeps CuPy's rules at the
# host/device boundary: its arrays are a type of their own, `np.asarray(x)` and `x + numpy_array` raise `TypeError`,
# and it counts every device-to-host transfer (`xp.counts["d2h"]`), explicit or implicit (`float(x)`, `x.item()`,
# `bool(x)`, a boolean mask, printing), each raising inside `cupyx.allow_synchronize(False)`. MPI sees its arrays
# through `__cuda_array_interface__` (really host memory, so both paths run on any MPI), and a pointer handed to MPI
# before a synchronize raises. With it first on `PYTHONPATH`, hsgd takes its whole GPU path without a GPU:
#
#     PYTHONPATH=tests/simgpu mpirun -n 2 python -m hsgd.verify --device gpu --tp 2
#     PYTHONPATH=tests/simgpu HSGD_CUDA_AWARE=1 mpirun -n 2 python -m hsgd.train --device gpu --steps 50
#     make gpu-sim            # the `make gpu-check` script, as a dry run
#
# It says nothing of kernels, speed or memory, only that nothing crosses to the host unannounced
# (`tests/mpi/test_simgpu.py`: five layouts, both paths, 8 ranks). On it, the cell below accounts for each step's
# transfers: the `to_host` copy, and with staging the gradient buffer copied out for the dp Allreduce.

# %%
if SIMULATED:
    staged = 0 if cuda_aware_mpi() else 1                                # the dp Allreduce's copy to the host
    say(f"simulated GPU: device-to-host transfers per step {transfers}: to_host {copies[0]} + staged {staged}")
    check.equal(f"{STEPS} steps: all transfers of every step == to_host + staged copies",
                transfers, [c + staged for c in copies])
else:
    say("(on NumPy or a real GPU only to_host's count is known; the simulated GPU counts every transfer)")

# %% [markdown]
# The picture: left, section 2's two paths for the step's dp All-Reduce of the gradient buffer; right, the bytes
# a GPU run of the step moves between host and device on each path, from its `CommStats` (staging copies each
# payload on more than one rank out and back) plus the `to_host` vector.

# %%
sizes = {"dp": grid.dp_comm.size, "tp": grid.tp_comm.size}
reaching_mpi = {key: nb for key, (n, nb) in traffic[-1].items() if sizes[key[0]] > 1}     # the last step's
check.equal("the collectives of a step that reach MPI", sorted(reaching_mpi), [("dp", "Allreduce")])
staged = reaching_mpi[("dp", "Allreduce")]                              # payload: out to the host, and back in
check.equal("the dp Allreduce's payload == the flat gradient buffer's bytes", staged, trainer.pbuf.flat.nbytes)
if rank == 0:
    from matplotlib.patches import FancyBboxPatch
    fig, (ax, bx) = pictures.figure(10, 3.4, ncols=2, gridspec_kw=dict(width_ratios=[1.6, 1]))

    def box(x, y, text, colour, w=1.9):
        ax.add_patch(FancyBboxPatch((x - w / 2, y - 0.32), w, 0.64, boxstyle="round,pad=0.03", fc=colour,
                                    ec="black"))
        ax.text(x, y, text, ha="center", va="center", fontsize=7)

    def arrow(x0, y0, x1, y1, text, dy=0.12):
        ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="->", lw=1.2))
        ax.text((x0 + x1) / 2, (y0 + y1) / 2 + dy, text, ha="center", va="bottom" if dy > 0 else "top",
                fontsize=6.5)

    gpu, host, net = "#c6dbef", "0.9", "#fdd0a2"
    box(0, 2, "gradient buffer\n(device memory)", gpu)
    box(4.0, 2, "pinned host buffer\n(HostStaging pool)", host)
    box(7.6, 2, "MPI Allreduce\non host memory", net)
    arrow(0.95, 2.12, 3.05, 2.12, f"sync, then\nD2H {staged:,} B")
    arrow(3.05, 1.88, 0.95, 1.88, f"H2D {staged:,} B", dy=-0.12)
    arrow(4.95, 2.0, 6.65, 2.0, "host pointer")
    box(0, 0.4, "gradient buffer\n(device memory)", gpu)
    box(7.4, 0.4, "CUDA-aware MPI\n(CUDA IPC, GPUDirect RDMA)", net, w=2.6)
    arrow(0.95, 0.4, 6.1, 0.4, "sync, then the device pointer: nothing staged")
    ax.text(-0.95, 2.55, "staging (HSGD_CUDA_AWARE=0, or no query found)", fontsize=7.5, weight="bold")
    ax.text(-0.95, 0.95, "CUDA-aware MPI (HSGD_CUDA_AWARE=1)", fontsize=7.5, weight="bold")
    ax.set_xlim(-1.1, 8.8)
    ax.set_ylim(-0.1, 2.8)
    ax.axis("off")
    one_copy = host_bytes[-1]                                            # the step's to_host vector
    x = np.arange(2)                                                     # staging, CUDA-aware
    for shift, (label, nbytes, colour) in zip((-0.2, 0.2), (
            ("device to host", [one_copy + staged, one_copy], pictures.COLORS["tp"]),
            ("host to device", [staged, 0], pictures.COLORS["pp"]))):
        bx.bar(x + shift, [max(b, 1) for b in nbytes], width=0.4, color=colour, label=label)
        for i, b in enumerate(nbytes):
            bx.text(i + shift, max(b, 1), f"{b:,} B", ha="center", va="bottom", fontsize=6.5)
    bx.set_xticks(x, ["staging", "CUDA-aware"])
    bx.set_yscale("log")
    bx.set_ylim(1, 20 * staged)
    bx.set_ylabel("bytes per step (log scale)")
    bx.set_title(f"host <-> device per step, dp {P} x tp 1, float64\n(to_host: {one_copy} B, gradients: "
                 f"{trainer.pbuf.flat.size:,} numbers)", fontsize=8)
    bx.legend(fontsize=7, loc="upper right")
    say(f"picture: {pictures.save(fig, '21_transfer_paths')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# **The check against serial.** Rank 0 runs serial SGD on every step's whole batch (`serial.sgd`, the same optimizer,
# schedule and clipping, on the host) and broadcasts the result; every rank compares its parameters and losses
# (error relative to each parameter's largest entry, floored at 0.02, as in chapters 4 and 10).

# %%
reference = None
if rank == 0:
    start = serial.init_params(cfg, seed=tc.seed, dtype="float64", device="cpu")     # NumPy, whatever DEVICE is
    reference = serial.sgd(cfg, tc, lambda step: corpus.batch(tc.seed, step, tc.batch_size), params=start)
ref, ref_losses = world.bcast(reference, root=0)          # a toy model: a pickled broadcast is fine

param_errs = {n: rel_err(to_numpy(p), ref[n], floor=0.02) for n, p in trainer.params.items()}
worst = max(param_errs, key=param_errs.get)
say(f"largest parameter difference from serial SGD on rank 0: {worst} {param_errs[worst]:.1e}")
check(f"{STEPS} steps: losses vs serial SGD (rel)", max(abs(a - b) / b for a, b in zip(losses, ref_losses)), 1e-9)
check(f"{STEPS} steps: every parameter vs serial SGD's (rel)", max(param_errs.values()), 1e-9)
grid.free()

# %% [markdown]
# ## 5. Launching on a cluster
#
# A typical GPU cluster: nodes of 8 GPUs joined by NVLink (hundreds of GB/s per GPU), nodes joined by InfiniBand
# (often one card per GPU, tens of GB/s each). Two nodes are 16 ranks; tp = 8 and dp = 2 in MPICH (hydra: `-ppn`
# processes per node, hostfile lines `node001:8`), then under Slurm (some sites add `--mpi=pmix`):
#
#     mpirun -n 16 -ppn 8 --hostfile hosts python -m hsgd.train --device gpu --tp 8 --dp 2
#     srun -N 2 --ntasks-per-node=8 --gpus-per-node=8 python -m hsgd.train --device gpu --tp 8 --dp 2
#
# Open MPI spells it `-npernode 8` or `--map-by ppr:8:node`, hostfile lines `node001 slots=8`. mpi4py must run on
# the cluster's MPI (it knows the network, is usually CUDA-aware and works with `srun`), not the PyPI MPICH wheel
# `make train` installs: install without the `mpi` extra (`pip install -e '.[dev,gpu]'`) with the site's MPI module
# loaded, check `python -c "from mpi4py import MPI; print(MPI.Get_library_version())"` on a compute node, and set
# `HSGD_CUDA_AWARE=1` if it is CUDA-aware.
#
# **Why tp inside a node and dp across nodes.** The launchers place ranks **in blocks** (0-7 on the first node), and
# hsgd numbers tp fastest, then pp, then dp, so a tensor-parallel group is one node (section 3's table). Tensor
# parallelism communicates in every layer, forward and backward (4L + 4 All-Reduces per micro-batch, all but the
# loss's two of (B, T, C) activations, chapters 6 and 10), and the next layer waits for each: it needs NVLink. Data
# parallelism communicates once per step and can overlap the backward (chapter 8), so it can cross InfiniBand; dp
# outermost makes each replica a contiguous block, the lecture's G groups of M consecutive workers. pp carries the
# fewest bytes, so Megatron-LM puts it outermost instead (order "tp-cp-ep-dp-pp", `RankGenerator` in
# megatron/core/parallel_state.py); both keep tp inside the node. A round-robin placement (`--map-by node`,
# `--distribution=cyclic`) would split every tp group: the `layout:` table `hsgd.train` prints should show one host
# per tp group.
#
# **What has been checked where.** Three levels, each catching what the one before cannot:
#
# 1. **NumPy** (the test suite): the model code, the GPU mapping's arithmetic, one `to_host` copy per step.
# 2. **The simulated GPU** (the test suite too: this chapter, `tests/mpi/test_simgpu.py`, `tests/test_simgpu.py`,
#    `make gpu-sim`): device arrays end to end, every transfer accounted for on both paths and every kind of layout,
#    no pinned allocation after the first step, device training equal to host training.
# 3. **A real GPU**, `make gpu-check` (`benchmarks/gpu_check.py`, with CuPy): `tests/test_gpu.py`'s float64
#    GPU-against-CPU tests of every layer, `hsgd.verify --device gpu` on several layouts, a float32 run whose loss
#    must fall, a step's host copies under `cupyx.allow_synchronize(False)` (where CuPy still has it), and one step
#    against PyTorch, in one table, exit non-zero on failure. Only it runs CuPy's kernels, so only it finds a missing
#    CuPy method, a result computed differently, a wrong stream, or the speed. The README says whether it has run.
#
# ## 6. Numbers narrower than float32: bfloat16 and float16, emulated
#
# Tensor cores multiply 16-bit numbers several times faster than float32 ones, and 16-bit activations and
# gradients halve memory and NVLink bytes. A format with a p-bit significand (leading bit included), smallest normal
# exponent emin and largest finite value max holds the numbers M 2^(e - p + 1), M an integer below 2^p; rounding to
# it costs at most the **unit roundoff u = 2^-p**, relative (Higham 2002, "Accuracy and Stability of Numerical
# Algorithms", section 2.1), and a sum of n + 1 terms at most gamma_n = n u / (1 - n u) of the sum of their
# magnitudes (section 3.1 there). Chapters 14 and 15 took these formats further (sums in other orders, FP8).
#
# * **float16** (IEEE 754 binary16): 5 exponent bits, p = 11; it ends at 65504, its normal numbers at
#   2^-14 = 6.1e-5 and its subnormal ones at 2^-24 = 6.0e-8: a smaller gradient becomes 0.
# * **bfloat16**: float32 with the lower 16 significand bits cut off, p = 8, all 8 exponent bits, so float32's range
#   (Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning Training"): nothing that fits float32 overflows or
#   underflows, but each number carries about 2.4 significant decimal digits instead of float16's 3.3.
#
# `hsgd.model.precision.FORMATS` holds (p, emin, max) of each, checked against `np.finfo` (NumPy has no bfloat16).

# %%
say(f"{'format':>9} {'p':>3} {'emin':>5} {'max':>11} {'smallest normal':>16} {'smallest subnormal':>19} "
    f"{'u = 2^-p':>9}")
for f in FORMATS.values():
    say(f"{f.name:>9} {f.p:>3} {f.emin:>5} {f.max:>11.4e} {2.0 ** f.emin:>16.3e} {2.0 ** (f.emin - f.p + 1):>19.3e} "
        f"{unit_roundoff(f.name):>9.2e}")
for name in ("float16", "float32"):
    fi = np.finfo(name)
    check.equal(f"{name}: (p, emin, max, u) == NumPy's (nmant + 1, minexp, max, eps / 2)",
                (FORMATS[name].p, FORMATS[name].emin, FORMATS[name].max, unit_roundoff(name)),
                (fi.nmant + 1, fi.minexp, float(fi.max), float(fi.eps) / 2))
bf16, f32 = FORMATS["bfloat16"], FORMATS["float32"]
check.equal("bfloat16: max == (2 - 2^-7) 2^127, and emin, largest exponent == float32's",
            (bf16.max, bf16.emin, np.frexp(bf16.max)[1]),
            ((2 - 2.0 ** -7) * 2.0 ** 127, f32.emin, np.frexp(f32.max)[1]))

# %% [markdown]
# `round_to(x, fmt)` rounds each entry of a float32 or float64 array to the nearest number of `fmt`, ties to even,
# and returns it in x's dtype. The cases below are worked by hand: a bfloat16 bit pattern is the upper half of a
# float32's (1.0 is 0x3F80, the next number 1 + 2^-7 is 0x3F81); a tie goes to the even last bit; halfway past max
# goes to infinity; float16's subnormals end at 2^-24, and half of that rounds to a signed zero.

# %%
INF = float("inf")
by_hand = [  # (x, format, what rounding to nearest with ties to even gives, worked out by hand)
    (1 + 2.0 ** -8, "bfloat16", 1.0),                           # halfway between 0x3F80 and 0x3F81: the even 0x3F80
    (1 + 3 * 2.0 ** -8, "bfloat16", 1 + 2.0 ** -6),             # halfway between 0x3F81 and 0x3F82: 0x3F82
    (1 + 2.0 ** -8 + 2.0 ** -20, "bfloat16", 1 + 2.0 ** -7),    # just past halfway: up, to 0x3F81
    (bf16.max + 2.0 ** 119, "bfloat16", INF),                   # halfway from max (odd, 0x7F7F) to 2^128: overflow
    (bf16.max + 2.0 ** 119 - 2.0 ** 104, "bfloat16", bf16.max),  # a float32 step below halfway: max
    (2.0 ** -130 + 2.0 ** -140, "bfloat16", 2.0 ** -130),       # a subnormal, spacing 2^-133 as in float32
    (65519.0, "float16", 65504.0),                              # below halfway between max and 2^16
    (65520.0, "float16", INF),                                  # halfway: the even neighbour is 2^16, past max
    (3 * 2.0 ** -25, "float16", 2.0 ** -23),                    # halfway between the subnormals 1 and 2 x 2^-24
    (2.0 ** -25, "float16", 0.0),                               # halfway between 0 and 2^-24: to 0
    (-2.0 ** -26, "float16", -0.0),                             # below half the smallest subnormal: -0
]
got = [float(round_to(np.array([x], np.float32), fmt)[0]) for x, fmt, _ in by_hand]
for (x, fmt, want), g in zip(by_hand, got):
    bits = (int(np.float32(g).view(np.uint32)) >> 16 if fmt == "bfloat16"     # bfloat16: float32's upper half
            else int(np.float16(g).view(np.uint16)))                           # float16: NumPy's own pattern
    bits = f"0x{bits:04X}"
    say(f"round_to({x!r:>24}, {fmt!r:>10}) = {g!r:>24}   bits {bits}")
check.equal(f"round_to on {len(by_hand)} cases worked out by hand (ties, overflow, subnormals, -0)",
            [(g, np.signbit(g)) for g in got], [(w, np.signbit(w)) for _, _, w in by_hand])
check.holds("bfloat16 results: the lower 16 bits of their float32 patterns are 0",
            all(int(np.float32(g).view(np.uint32)) & 0xFFFF == 0 for g, (_, f, _) in zip(got, by_hand)
                if f == "bfloat16"))

# %% [markdown]
# Then many values against NumPy's float16 cast (nearest, ties to even): float64 values over float16's whole range
# and past it, and the exact midpoints between neighbouring float16 numbers.

# %%
rng = np.random.default_rng(2)
spread = rng.choice([-1.0, 1.0], 20000) * 2.0 ** rng.uniform(-27, 17, 20000)      # (20000,) float64, 2^-27 .. 2^17
h = rng.integers(0, 0x7C00, 20000, dtype=np.uint16).view(np.float16)               # (20000,) finite float16 >= 0
midpoints = (h.astype(np.float64) + np.nextafter(h, np.float16(INF)).astype(np.float64)) / 2   # exact ties
for what, x64 in (("spread values", spread), ("midpoints", midpoints)):
    with np.errstate(over="ignore"):
        numpy_says = x64.astype(np.float16).astype(np.float64)
    check.holds(f"round_to(float64, 'float16') == NumPy's float16 cast: 20,000 {what}",
                np.array_equal(round_to(x64, "float16"), numpy_says))
for fmt in ("float16", "bfloat16"):                                      # one rounding costs at most u, relative
    normal = (np.abs(spread) >= 2.0 ** FORMATS[fmt].emin) & (np.abs(spread) <= FORMATS[fmt].max)
    rel = np.abs(round_to(spread, fmt) - spread)[normal] / np.abs(spread[normal])
    check(f"{fmt}: largest relative error of one rounding, normal range (< u)", rel.max(), unit_roundoff(fmt))

# %% [markdown]
# **How hsgd emulates them.** NumPy has no bfloat16 and no fast float16, so hsgd keeps every array float32 and
# *rounds* it to the format where a GPU would hold that format: every later operation sees what it would see on the
# GPU. `--dtype bfloat16` or `float16` makes `hsgd.model.precision.make_numerics` a `Numerics` object per stage
# (`Stage.num`, also `HybridTrainer.num`), and `num.round(x, point)` runs at each point below. The model's lines do
# not call it: `hsgd.tp.rounded` wraps the layer functions, the scheme's collectives and the core attention, so
# `x = op.residual_forward(x, o)` stays the formula `x = x + o` (a float32 or float64 run rounds nothing):

# %%
for point, where in POINTS.items():
    say(f"  {point:>9}: {where}")

# %% [markdown]
# What is *not* rounded stays float32, as in Micikevicius et al. 2018 ("Mixed Precision Training"): the **master
# weights** (`trainer.params`; the model gets a rounded copy each step, `num.weights`), the momentum, the **weight
# gradients** (products of rounded inputs, accumulated in float32), the LayerNorm and softmax statistics. Where it
# differs from hardware:
#
# * a tensor core multiplies the rounded inputs exactly and adds in float32 in its own order; hsgd uses float32
#   BLAS in another order: float32 rounding apart, far below u;
# * a fused kernel (flash attention, a fused LayerNorm) may round another set of intermediates; hsgd's points are
#   one consistent, named choice;
# * hsgd rounds the partial sums before a tensor-parallel collective ("payload") and the sum after it, and
#   `--reduce-dtype bfloat16` each rank's gradient and the dp average ("reduce"). NCCL's bfloat16 ring All-Reduce
#   rounds after **every** addition, p - 1 roundings, an error growing with p (about gamma_(p-1)); hsgd rounds once;
# * nothing is faster or smaller: the emulation is for the numbers, not the speed.
#
# **Training.** The 2 ranks as tp 2, on section 1's toy in float32, bfloat16 and float16 (dynamic loss scaling, the
# default), from the same seed on the same batches, on the host (the rounding is the same on any device); then dp 2
# with a bfloat16 gradient exchange (`reduce_dtype="bfloat16"`).

# %%
MP_STEPS = 6


def mp_run(dtype, dp=1, tp=P, **kw):
    """MP_STEPS steps of float32 SGD (lr 0.1, momentum 0.9) with `dtype` arithmetic: (trainer, grid, [StepInfo])."""
    tc_mp = train_config(dtype=dtype, dp=dp, tp=tp, steps=MP_STEPS, batch_size=8, device="cpu", **kw)
    mp_grid = ProcessGrid(world, dp=dp, tp=tp)
    mp = HybridTrainer(cfg, mp_grid, tc_mp)
    infos = [mp.step(*corpus.batch(tc_mp.seed, s, tc_mp.batch_size), s) for s in range(1, MP_STEPS + 1)]
    return mp, mp_grid, infos


runs = {dtype: mp_run(dtype) for dtype in ("float32", "bfloat16", "float16")}
mp_losses = {dtype: [i.loss for i in infos] for dtype, (_, _, infos) in runs.items()}
for dtype, losses_of in mp_losses.items():
    say(f"tp {P}, {dtype:>8}: losses {' '.join(f'{v:.4f}' for v in losses_of)}")
for dtype in ("bfloat16", "float16"):
    check(f"tp {P}: {dtype} losses vs float32's, {MP_STEPS} steps (rel)",
          max(abs(a - b) / b for a, b in zip(mp_losses[dtype], mp_losses["float32"])), 2e-2)
    counts = runs[dtype][0].num.counts
    say(f"tp {P}, {dtype}: roundings per point {counts}")
    check.holds(f"tp {P}, {dtype}: every point of POINTS rounded but 'reduce', which did not",
                all(counts[pt] > 0 for pt in POINTS if pt != "reduce") and counts["reduce"] == 0)
mp16, _, infos16 = runs["float16"]
say(f"float16: the progress line ends '| loss scale 2^{np.log2(infos16[-1].loss_scale):g}, "
    f"{infos16[-1].scale_skips} skipped'")
check.equal("float16: loss scale and skipped updates after 6 steps (2^16, none)",
            (infos16[-1].loss_scale, infos16[-1].scale_skips), (2.0 ** 16, 0))
mpbf, _, _ = runs["bfloat16"]
model_copy = mpbf.num.weights(mpbf.params)                                # what the forward pass of a step gets
check.holds("bfloat16: the model's copy is float32 arrays holding bfloat16 numbers only",
            all(w.dtype == np.float32 and np.array_equal(round_to(w, "bfloat16"), w) for w in model_copy.values()))
check.holds("bfloat16: the master weights are float32 numbers, not all of them bfloat16 ones",
            any(not np.array_equal(round_to(w, "bfloat16"), w) for w in mpbf.params.values()))
runs["dp"] = dpbf, _, infos_dp = mp_run("bfloat16", dp=P, tp=1, reduce_dtype="bfloat16")
say(f"dp {P}, bfloat16, reduce in bfloat16: losses {' '.join(f'{i.loss:.4f}' for i in infos_dp)}; "
    f"'reduce' rounded {dpbf.num.counts['reduce']} times")
check(f"dp {P}, bfloat16 exchange: losses vs float32's on tp {P} (rel)",
      max(abs(i.loss - b) / b for i, b in zip(infos_dp, mp_losses["float32"])), 2e-2)
check.holds(f"dp {P}, --reduce-dtype bfloat16: the gradient exchange was rounded", dpbf.num.counts["reduce"] > 0)
for mp, mp_grid, _ in runs.values():
    mp.free()
    mp_grid.free()

# %% [markdown]
# **Loss scaling, step by step.** float16 ends at 2^-24. The gradient of a mean over N = B T positions starts at 1/N
# per position and shrinks through the layers; entries below 2^-25 round to 0 ("flushed"), those near 2^-24 keep one
# or two bits. Scaling the loss by S multiplies every gradient of the backward pass by S (it is linear in dloss); the
# optimizer divides by S in float32. In hsgd the last stage's backward starts from dloss = S / m (`Stage.loss_scale`)
# and `HybridTrainer.update` divides by S before clipping.
#
# The case: 2 heads of 16 on random tokens, 256 sequences of 16, dp 2 (each rank's mean over 128 x 16 = 2,048
# positions); one `trainer.gradients` each in float32, in float16 without scaling (`loss_scale="none"`) and with
# S = 2^16, compared per parameter after dividing by S (relative to its largest entry, at least 1e-3 of the largest
# of all). A `Numerics` subclass counts the activation-gradient entries that rounding at "grad" flushed.

# %%
class CountingFlushes(Numerics):
    """Numerics that also counts, at the point "grad", the nonzero entries that rounding made 0."""

    def __init__(self, compute, reduce):
        super().__init__(compute, reduce)
        self.flushed = self.nonzero = 0

    def round(self, x, point):
        y = super().round(x, point)
        if point == "grad" and self.rounds:
            self.flushed += int(((x != 0) & (y == 0)).sum())
            self.nonzero += int((x != 0).sum())
        return y


ls_cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=2, n_layers=2, d_ff=64)
LS_BATCH = 256
ls_rng = np.random.default_rng(0)
ls_idx, ls_targets = (ls_rng.integers(0, ls_cfg.vocab_size, (LS_BATCH, ls_cfg.seq_len)) for _ in range(2))


def scaled_gradients(dtype, loss_scale):
    """One gradients() on dp P: ({name: gradient / S}, the CountingFlushes, the trainer, its grid)."""
    ls_grid = ProcessGrid(world, dp=P, tp=1)
    ls = HybridTrainer(ls_cfg, ls_grid, train_config(dtype=dtype, loss_scale=loss_scale, dp=P, steps=1,
                                                     batch_size=LS_BATCH, device="cpu"))
    ls.use_numerics(CountingFlushes(ls.num.compute, ls.num.reduce))   # the stage and the exchange round with it
    ls.gradients(ls_idx, ls_targets)
    return {n: np.array(g) / ls.stage.loss_scale for n, g in ls.grads.items()}, ls.num, ls, ls_grid


ref_grads, _, ls32, ls32_grid = scaled_gradients("float32", "none")
largest = max(float(np.abs(g).max()) for g in ref_grads.values())
ls_err, ls_flushed = {}, {}
for mode in ("none", "dynamic"):
    g16, num16, ls, ls_grid = scaled_gradients("float16", mode)
    errs = {n: float(np.abs(g16[n] - ref_grads[n]).max()) / max(float(np.abs(ref_grads[n]).max()), 1e-3 * largest)
            for n in ref_grads}
    worst_name = max(errs, key=errs.get)
    flushed, nonzero = world.allreduce(num16.flushed), world.allreduce(num16.nonzero)
    ls_err[mode], ls_flushed[mode] = errs[worst_name], flushed / nonzero
    say(f"float16, loss scale {mode:>7} (S = {ls.stage.loss_scale:g}): largest error {errs[worst_name]:.2e} "
        f"({worst_name}); activation-gradient entries flushed to 0: {flushed:,} of {nonzero:,} "
        f"({100 * flushed / nonzero:.2f}%)")
    if mode == "dynamic":
        kept = ls                                                        # for the overflow below
    else:
        ls.free()
        ls_grid.free()
check.holds("float16 without loss scaling: largest gradient error > 2%, and > 10x the scaled one's",
            ls_err["none"] > 0.02 and ls_err["none"] > 10 * ls_err["dynamic"])
check("float16 with loss scale 2^16: gradients vs float32's (rel)", ls_err["dynamic"], 1e-2)
check.holds("flushed to 0: > 0.1% of the entries without scaling, > 100x fewer with it",
            ls_flushed["none"] > 1e-3 and ls_flushed["dynamic"] * 100 < ls_flushed["none"])

# %% [markdown]
# The scaled run's errors are float16's own rounding, a few u = 4.9e-4 per entry; the unscaled one loses gradients,
# mostly in q and k, which pass through the softmax's small derivatives.
#
# **Too large a scale overflows**: past 65504 a gradient is inf. `LossScaler` (the rules of PyTorch's `GradScaler`)
# starts at S = 2^16; a step whose gradients hold an inf or NaN on any rank (a collective verdict,
# `hsgd.step.health`) is skipped and S halves; after `growth_interval` (2000) good steps in a row S doubles. First
# the trainer above with S = 2^40: the update is skipped, the weights stay, S halves. Then the rules alone, with a
# growth interval of 3.

# %%
before_update = {n: np.array(p) for n, p in kept.params.items()}
kept.scaler.scale = 2.0 ** 40
with np.errstate(over="ignore", invalid="ignore"):                     # inf - inf = NaN in the backward pass
    info = kept.step(ls_idx[:8], ls_targets[:8], 1)
check.equal("S = 2^40: step skipped, S halved to 2^39, one skip counted, weights unchanged",
            (kept.scaler.scale, kept.scaler.skipped, info.scale_skips,
             all(np.array_equal(kept.params[n], p) for n, p in before_update.items())),
            (2.0 ** 39, 1, 1, True))
scaler = LossScaler(init_scale=2.0 ** 16, growth_interval=3)
verdicts = [False, False, False, True, False, False, False]              # found inf or NaN at step 1 .. 7
trace = [(scaler.update(found), scaler.scale) for found in verdicts]      # (update applied?, S after the step)
say("found inf:   " + " ".join(f"{str(v):>6}" for v in verdicts))
say("applied:     " + " ".join(f"{str(a):>6}" for a, _ in trace))
say("S after, 2^: " + " ".join(f"{np.log2(s):>6g}" for _, s in trace))
check.equal("LossScaler (growth interval 3): the updates applied and S after each step",
            trace, [(True, 2.0 ** 16), (True, 2.0 ** 16), (True, 2.0 ** 17), (False, 2.0 ** 16), (True, 2.0 ** 16),
                    (True, 2.0 ** 16), (True, 2.0 ** 17)])
for done_with in (kept, ls32):
    done_with.free()
    done_with.grid.free()

# %% [markdown]
# bfloat16 needs none of this: with float32's range its gradients neither underflow nor overflow where float32's
# would not; it pays with 8 significant bits instead of 11. So hsgd scales only float16, and with `--dp-staleness 1`
# unscales each gradient by the S it was made with (`LossScaler.made_with`).
#
# ## Check against serial
#
# On 2 ranks, every verdict collective: device and host agree (parameters, gradients, Allreduces, hand staging);
# the GPU mapping is as computed; each data-parallel step made one counted device-to-host copy and ended at serial
# SGD's parameters; the formats match NumPy, 16-bit runs train within 2% of float32, and loss scaling keeps the
# gradients float16 alone loses.

# %%
worst, err = check.worst()
say(f"\nchapter 21: all {len(check.passed)} checks passed on {P} ranks ({DEVICE}); largest error {err:.1e} "
    f"({worst})")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | collectives on device buffers: `hsgd.grid.comm.Comm` hands MPI a device pointer (CUDA-aware) or stages through pinned host buffers (`Comm._buf`, `HostStaging`), after synchronizing the stream | NCCL through torch.distributed: `distributed_backend` "nccl" by default (megatron/training/config/common_config.py) | `deepspeed.comm` (deepspeed/comm/comm.py): `init_distributed(dist_backend=...)` over torch.distributed, NCCL on NVIDIA GPUs | `init_process_group(backend="nccl")`: `ProcessGroupNCCL` queues each collective on a CUDA stream of its own, ordered after the current stream by an event (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp); the host does not wait | one communication layer for CPU and GPU, every collective visible at its call site, any MPI; the price is a host wait per collective, and two PCIe copies when staging |
# | `hsgd.grid.comm.cuda_aware_mpi()`: `HSGD_CUDA_AWARE`, else the library's `MPIX_Query_cuda_support()` | - | - | the "mpi" backend's `cudaAwareMpiCheck()` (torch/csrc/distributed/c10d/ProcessGroupMPI.cpp) asks the same `MPIX_Query_cuda_support()`, and refuses CUDA tensors without it | hsgd stages instead of refusing: slower, but it runs on any MPI |
# | `hsgd.train.local_ranks(world)`: `Split_type(COMM_TYPE_SHARED)`, the rank within the node's communicator | `local_rank` from `LOCAL_RANK` (megatron/training/config/common_config.py), set by the launcher | `mpi_discovery` (deepspeed/comm/comm.py): under mpirun, counts the lower ranks with the same `MPI.Get_processor_name()`, then sets `LOCAL_RANK`; the `deepspeed` launcher sets it otherwise (deepspeed/launcher/launch.py) | `torchrun` (torch/distributed/run.py) sets `LOCAL_RANK`, `RANK`, `WORLD_SIZE` in each worker's environment | MPI knows the node: no environment variable to trust, whichever launcher started the ranks |
# | `backend.select_gpu(local_rank)`: `cupy.cuda.Device(local_rank % n_gpus).use()` | `torch.cuda.set_device(args.local_rank)` in `_initialize_distributed` (megatron/training/initialize.py) | `get_accelerator().set_device(self.local_rank)` in the engine (deepspeed/runtime/engine.py) | `torch.cuda.set_device(local_rank)` | the modulo lets more ranks than GPUs share them, for testing the parallel code on one GPU |
# | launching: `mpirun -n 16 -ppn 8`, Open MPI's `-npernode 8`, `srun --ntasks-per-node=8`, ranks placed in blocks | `torchrun --nproc-per-node 8 --nnodes 2 ...` (one process per GPU) | the `deepspeed` launcher (deepspeed/launcher/runner.py), `--launcher` pdsh, openmpi, mpich, mvapich or slurm | `torchrun` (torch/distributed/run.py) | the site's MPI launcher, so the MPI library's own network and placement apply |
# | `backend.to_host`, `d2h_count()`: one counted device-to-host copy per step; the simulated GPU (`tests/simgpu`) counts every transfer | - | - | `torch.cuda.set_sync_debug_mode("warn")` reports operations that synchronize with the host | a count checked on every machine, with or without a GPU |
# | `--dtype bfloat16` / `float16`: `hsgd.model.precision.Numerics` rounds float32 arrays (`round_to`) at every point of `POINTS`; float32 master weights, a rounded copy per step (`num.weights`) | `--bf16`, `--fp16` (megatron/training/arguments.py); `Float16Module` (megatron/core/transformer/module.py) casts the model to 16 bits, and the mixed-precision optimizer keeps float32 main params | `"bf16": {"enabled": true}`, `"fp16": {"enabled": true, ...}` in the config (deepspeed/runtime/constants.py) | `torch.autocast(device_type="cuda", dtype=torch.bfloat16)` casts op by op, the parameters stay float32 | emulated: no 16-bit tensors or tensor cores, every rounding point named and counted, so a test can say which ran; no speed or memory gained |
# | weight gradients accumulated in float32; `--reduce-dtype bfloat16` rounds each rank's gradient and the average (`num.reduced`) | `--accumulate-allreduce-grads-in-fp32`: gradients accumulated and all-reduced in float32 `param.main_grad` (megatron/core/distributed/param_and_grad_buffer.py) | `"communication_data_type"` (deepspeed/runtime/constants.py) | DDP's `bf16_compress_hook` (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py) | NCCL's bfloat16 ring rounds at every hop; hsgd rounds the partials and the sum once |
# | `--loss-scale dynamic` (float16): `hsgd.step.loss_scale.LossScaler`, S = 2^16, halve and skip on inf/NaN, double after 2000 good steps; `Stage.loss_scale`: dloss = S / m | `--loss-scale` (a static S; unset: dynamic), `--initial-loss-scale` (2^32), `--loss-scale-window` 1000, `--hysteresis` 2; `DynamicGradScaler` (megatron/core/optimizer/grad_scaler.py) | `"fp16": {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}` (0: dynamic); `DynamicLossScaler` (deepspeed/runtime/fp16/loss_scaler.py) | `torch.amp.GradScaler` (torch/amp/grad_scaler.py): init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000 | GradScaler's rules, without hysteresis; a floor of S = 1 ends the run (DeepSpeed's `min_loss_scale`, chapter 19); the skip verdict is one collective (`hsgd.step.health`), the same on every rank |
#
# ## Exercises
#
# All five run without a GPU (for the simulated one, put `tests/simgpu` first on `sys.path` before anything imports
# `cupy`).
#
# ### Exercise 1: the local rank from the environment
# Launchers give each process its place on the node in a variable: `LOCAL_RANK` (torchrun, `deepspeed`),
# `OMPI_COMM_WORLD_LOCAL_RANK` (Open MPI), `MPI_LOCALRANKID` (MPICH's Hydra), `SLURM_LOCALID` (srun). Write
# `local_rank_from_env(env)`, the first one found (and its name) or None, and `local_rank_by_name(world)`,
# DeepSpeed's way: the lower world ranks with the same `MPI.Get_processor_name()`. Check the first on made-up
# environments, and both against `hsgd.train.local_ranks(world)` on every rank.
# (solution: `tutorials/solutions/21_gpus.py`, `exercise_1`)
#
# ### Exercise 2: which GPU a rank uses
# Write `physical_gpu(local_rank, visible)`: the rank uses device `local_rank % len(visible)` of the devices it
# sees, and `visible` (from `CUDA_VISIBLE_DEVICES`) says which physical GPU that is. Check it, for 8 local ranks on
# nodes of 1, 2, 4 and 8 GPUs and for one GPU per rank (`CUDA_VISIBLE_DEVICES=<local rank>`), against what
# `backend.select_gpu` makes current on the simulated GPU (`SIMGPU_DEVICES=n` simulates n devices).
# (solution: `tutorials/solutions/21_gpus.py`, `exercise_2`)
#
# ### Exercise 3: the bytes staged in one step
# With staging (`HSGD_CUDA_AWARE=0`), predict from one step's `CommStats` the bytes crossing between device and
# host in a step on dp 1 x tp 2, for Megatron's and the All-Gather scheme: per collective on more than one rank, an
# All-Reduce copies its payload out and back, an All-Gather its part (payload / p) out and the whole back; plus the
# `to_host` vector. Check against the simulated GPU with `ndarray.get` and `ndarray.set` wrapped to add up bytes,
# and the device-to-host transfers against its `counts["d2h"]`.
# (solution: `tutorials/solutions/21_gpus.py`, `exercise_3`)
#
# ### Exercise 4: find the host round trip
# `clip_by_norm(g, max_norm)` below scales a gradient to norm `max_norm` if it is larger; it makes a hidden
# synchronization on a GPU. Count its device-to-host transfers on the simulated GPU, then write a version that
# makes none (it must run inside `cupyx.allow_synchronize(False)`) and gives the same result, for a gradient both
# above and below the limit.
#
#     def clip_by_norm(g, max_norm):
#         norm = float((g * g).sum()) ** 0.5
#         if norm > max_norm:
#             g = g * (max_norm / norm)
#         return g
#
# (solution: `tutorials/solutions/21_gpus.py`, `exercise_4`)
#
# ### Exercise 5: bfloat16 by integer arithmetic
# Rounding a float32 to bfloat16 can be done on its bit pattern as an unsigned 32-bit integer b: add 0x7FFF plus
# the lowest kept bit, (b >> 16) & 1 (ties to even), and clear the lower 16 bits; a carry out of the significand
# moves into the exponent, rightly, up to infinity. Write `bf16_bits(x)` for a float32 array, leaving NaNs as they
# are (why would the rule break them?), and check it equals `hsgd.model.precision.round_to(x, "bfloat16")` bit for
# bit on 100,000 random bit patterns (every exponent, subnormals, infinities), on the exact midpoints between
# neighbouring bfloat16 numbers, and around bfloat16's max.
# (solution: `tutorials/solutions/21_gpus.py`, `exercise_5`)
