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
# # Chapter 12: GPUs
#
# The lecture trains on GPUs. Its section 4.1 says what the hardware asks of the communication: **NVLink inside a
# server, InfiniBand between servers**, so the model-parallel traffic should stay inside a server; and an
# **efficient collective library such as NCCL**. Every chapter so far ran on CPUs, with NumPy arrays and MPI. This
# chapter shows what changes when each rank drives a GPU, and what does not:
#
# 1. one code path for CPU and GPU: the model code asks each array which module it belongs to (NumPy or CuPy), and
#    the same seed gives the same parameters on both;
# 2. what a GPU rank needs from MPI: device buffers handed to a CUDA-aware MPI, or staged through host memory;
# 3. one GPU per rank: the node-local rank picks the GPU, and ranks share GPUs when there are more ranks than GPUs;
# 4. silent host round trips, and how a training step keeps to one small device-to-host copy; a few data-parallel
#    steps checked against serial SGD;
# 5. launching on a cluster: command lines for MPICH, Open MPI and Slurm; why tp goes inside a node and dp across.
#
# Run it with two ranks: about 1.5 s at best on a 2-core machine without a GPU, about 2 s on the simulated GPU (on
# the same machine shared with other jobs, up to 12 s). On failure every rank raises, so it exits non-zero without
# hanging:
#
# mpirun -n 2 python tutorials/12_gpus.py
#
# It runs on any machine, and what runs depends on what the machine has:
#
# * **No CuPy, or no GPU** (a laptop, the CI machine): every cell runs, on NumPy arrays. The checks that need a
#   device are skipped, and the chapter says so where they would be: GELU on the device (section 1), the current
#   GPU of each rank (section 3), and the count of every host/device transfer of a step (section 4). "The model on
#   the device against NumPy" then compares NumPy with itself, exactly 0.
# * **The simulated GPU** of `tests/simgpu` (section 4 says what it is), with no GPU at all:
#   `PYTHONPATH=tests/simgpu mpirun -n 2 python tutorials/12_gpus.py`. Every cell takes its GPU branch on device
#   arrays that keep CuPy's rules, and all the checks run, including the transfer count; nothing is timed.
# * **CuPy with a GPU** (`pip install -e '.[gpu]'`): the same cells on CuPy arrays, each rank on GPU
#   `local_rank % n_gpus`.
#
# The test suite runs the first two. The notebook form (`jupytext --to ipynb tutorials/12_gpus.py`) is for
# reading: the code needs two MPI ranks. Only rank 0 prints.
#
# Legend: P ranks, dp / tp / pp the grid sizes (chapter 3), xp the array module (numpy or cupy), "host" the CPU
# and its memory, "device" the GPU and its memory, D2H / H2D a device-to-host / host-to-device copy. B batch,
# T sequence, C d_model, NH heads, F d_ff, V vocabulary, L layers.

# %%
import ctypes
import os

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from hsgd import ModelConfig, health, serial
from hsgd.backend import array_module, d2h_count, get_xp, to_device, to_numpy
from hsgd.comm import Comm, cuda_aware_mpi, cuda_support_query
from hsgd.data import Corpus
from hsgd.grid import ProcessGrid
from hsgd.hybrid import HybridTrainer
from hsgd.layers import gelu_forward
from hsgd.train import local_ranks, place_on_device

import pictures                                     # tutorials/pictures.py: where the PNGs go
from checks import Checks, rel_err, train_config   # tutorials/checks.py, shared by the chapters

threadpool_limits(1)                    # two ranks, tiny matrices: one BLAS thread each
P = 2
world = MPI.COMM_WORLD
if world.Get_size() != P:               # every rank exits non-zero; rank 0 says why
    raise SystemExit(f"run this chapter on {P} ranks: mpirun -n {P} python {__file__}"
                     if world.Get_rank() == 0 else 1)
rank = world.Get_rank()
# check(what, err, tol), check.holds(what, cond), check.equal(what, a, b): collective; raise on every rank unless
# err < tol, cond, a == b on all of them
check = Checks(world, tol=1e-10, width=66)
say = check.say                         # print on world rank 0 only


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
# The line above is the `device:` line that `python -m hsgd.train` prints in its header, from the same function
# (`hsgd.train.place_on_device`). Without a GPU it says `cpu (NumPy)`; with one it names the GPU of rank 0 and the
# way buffers reach MPI (section 2).
#
# ## 1. One code path for CPU and GPU
#
# CuPy copies NumPy's interface: `cupy.zeros`, `cupy.exp`, `a @ b`, `a.sum(axis=1)` do on the GPU what their NumPy
# namesakes do on the CPU. So hsgd's layers are written once. A layer never imports numpy for its arrays; it asks
# its input which module it belongs to and computes with that:
#
#     xp = array_module(x)          # hsgd.backend: numpy for a NumPy array, cupy for a CuPy array
#     y = xp.empty_like(x); xp.tanh(u, out=y); ...
#
# Arrays are *created* on a device in one place only, `hsgd/backend.py`: `get_xp(device)` gives the module for
# `"cpu"` or `"gpu"` (or `$HSGD_DEVICE`), `to_device(a, xp)` copies a host array there (nothing to do for NumPy), and
# `to_numpy(x)` brings an array back. After that, every array a layer makes comes from its inputs' module, so a
# whole forward and backward pass stays on the device it started on.

# %%
a = np.linspace(-3.0, 3.0, 8).reshape(2, 4)                             # (2, 4) a host array
y, _ = gelu_forward(a)                                                   # hsgd.layers, as the model calls it
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
# **The same seed gives the same parameters on both.** CuPy has its own random number generators, which do not
# produce NumPy's numbers. So `serial.init_params` always draws on the host, with NumPy, and then copies each array
# to the device (`to_device`): a GPU run and a CPU run of the same seed start from the same model, bit for bit, so
# the serial NumPy reference of the earlier chapters serves GPU runs too. The tensor-parallel shards are slices of
# the same draw (`tp_model.init_params`), so this holds on every grid.
#
# Then the whole model, forward and backward, on the device against NumPy in float64. On a GPU the two differ by
# rounding only (the GPU adds in other orders), far below the 1e-10 of the check, as in `tests/test_gpu.py`.
# On a CPU-only machine both sides are NumPy and the difference is exactly 0: the check is then trivial, and the
# GPU side is checked where there is a GPU (section 5).

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
# On a GPU the gradients to average live in device memory. mpi4py's uppercase methods (`Allreduce`, `Allgather`,
# ...) accept CuPy arrays: they read the array's `__cuda_array_interface__` and hand MPI the raw **device pointer**.
# What MPI does with that pointer depends on how it was built:
#
# * **CUDA-aware MPI** (Open MPI or MPICH built with CUDA support, MVAPICH2-GDR, Cray MPICH, ...) recognises a
#   device pointer and moves the bytes itself: between GPUs of one server over NVLink or PCIe (CUDA IPC), between
#   servers with GPUDirect RDMA, where the InfiniBand card reads and writes GPU memory without a copy to the host.
# * **An MPI that is not CUDA-aware** treats the pointer as host memory, and crashes or reads garbage. Such a rank
#   must **stage**: copy the buffer to the host (D2H), communicate the host copy, and copy the result back (H2D).
#   That always works, at the price of two copies over PCIe per collective.
#
# Either way one more rule applies. CuPy launches kernels **asynchronously**: a call like `g *= 0.5` returns as soon
# as the kernel is queued on the GPU's stream, before it has run. MPI knows nothing about CuPy's stream; given the
# pointer right away, it could send the buffer before the kernels that write it have finished. So before a device
# buffer goes to MPI, the stream must be **synchronized** (the host waits until the queued kernels are done).
# (Staging would not strictly need it, since the copy to the host is queued on the same stream, after those kernels;
# hsgd synchronizes first on both paths, which keeps the rule simple.)
#
# `hsgd.comm.Comm` does all of this in one helper, `Comm._buf`, which every collective calls on its buffers:
#
# 1. the buffer must be C-contiguous: MPI reads a pointer and a length, and a strided view is not one block of
#    memory. A view is an error, not a silent copy;
# 2. a NumPy array goes to MPI as it is;
# 3. a CuPy array: `cupy.cuda.get_current_stream().synchronize()`, then the array itself if `cuda_aware_mpi()`,
#    else a host copy, and after the collective `x.set(host)` copies the result back into the device array.
#    The host copy goes into a **pinned** (page-locked) buffer: pinned memory is what the GPU's copy engine reads
#    and writes directly, so the copies run at full speed, but allocating it is slow (the operating system must
#    lock the pages). So `Comm.staging` (a `HostStaging`) keeps a **pool**: a call takes a free buffer of its
#    shape and dtype and gives it back when MPI is done with it (a blocking call on return, a non-blocking one at
#    `Wait`). Every step sends the same shapes (gradient buckets, activations of one micro-batch), so after the
#    first step every shape has its buffer and nothing is allocated, whatever address the device array has
#    (`hsgd.train` ends with a `host staging:` line that counts the buffers allocated after step 1). A
#    buffer MPI only reads (the input of an Allgather, a Send) is not copied back; one it only writes (a Recv) is
#    not filled first.
#
# `cuda_aware_mpi()` decides once per process (it is cached), so every collective of a run takes the same path, and
# `hsgd.train` prints which in its `device:` line. `HSGD_CUDA_AWARE=1` says "this MPI is CUDA-aware",
# `HSGD_CUDA_AWARE=0` forces staging. Without the variable, hsgd calls the library's own query,
# `MPIX_Query_cuda_support()` (MPICH and Open MPI export it; it returns 1 when the library was built with CUDA and
# can use it now), looked up with `ctypes` (`hsgd.comm.cuda_support_query`): first among the symbols the process
# has loaded for all to see, then in each MPI library the process has loaded, by its path. The second place
# matters: mpi4py may load the MPI library so that its symbols are not visible globally (the MPICH wheel used here
# is loaded so). When neither finds the query, hsgd assumes "not CUDA-aware", the choice that always works. The
# lines below say what this machine gives:

# %%
try:
    global_symbol = hasattr(ctypes.CDLL(None), "MPIX_Query_cuda_support")   # the first place hsgd.comm looks
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
# Now an Allreduce of this rank's arrays, through a `Comm` on the world as in chapter 3. Every rank r makes a vector
# x_r from its own seed, on the host, and copies it to its device (on the CPU: leaves it where it is). Before the
# call, a look at what `Comm._buf` would hand MPI for this buffer (a private helper, called here only to show it;
# `Allreduce` calls it itself). The check against serial: every rank rebuilds both inputs from their seeds and sums
# them with NumPy on the host.

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
# Staging, written out by hand with plain mpi4py, is the three steps of the list above; on a GPU `to_numpy` is the
# D2H copy (`x.get()`, which waits for the stream) and `x[...] = ...` the H2D copy. It gives the same numbers as
# `Comm.Allreduce`:

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
# And a strided view is refused before any communication, on every rank alike, so no rank is left waiting:

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
# **What NCCL would add.** The lecture recommends an efficient collective library such as NCCL, which PyTorch and
# Megatron-LM use on NVIDIA GPUs. NCCL runs each collective as CUDA kernels queued on a stream, like any other
# kernel: the host does not wait, and the collective starts as soon as the kernels before it are done. It knows the
# topology (NVLink, NVSwitch, PCIe, the InfiniBand cards and which GPU is near which) and picks rings or trees to
# match. hsgd keeps MPI for GPUs as for CPUs: one communication layer, with every collective visible at its call
# site. The price is the synchronize above: each collective makes the host wait for the GPU, and with staging
# also crosses PCIe twice. A CUDA-aware MPI built on UCX uses NVLink and GPUDirect RDMA for the bytes too, but it
# does not queue the collective behind the compute. (How large the gap is on a given machine is what `make gpu-check`
# measures for one step against PyTorch; section 5.)
#
# ## 3. One GPU per rank
#
# hsgd runs one MPI rank per GPU. The natural mapping is: rank i of a node uses GPU i of that node. A rank knows its
# world rank, not its place on the node, so it asks MPI: `world.Split_type(MPI.COMM_TYPE_SHARED)` splits the world
# into one communicator per shared-memory node (chapter 3's `Split`, with the node as the color), and the rank in
# it is the **node-local rank**. `hsgd.train.local_ranks(world)` returns (node-local rank, ranks on this node), and
# `backend.select_gpu(local_rank)` makes GPU `local_rank % n_gpus` the current device of the rank
# (`cupy.cuda.Device(i).use()`; `hsgd.train.place_on_device` calls both when `--device gpu`).
#
# Here both ranks run on one machine, so the node-local ranks are the world ranks. The check: the local rank is the
# number of lower world ranks on the same host (ranks keep their order in `Split_type`).

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
# **More ranks than GPUs.** The modulo lets any number of ranks run on any number of GPUs: on a machine with one GPU,
# `mpirun -n 8 python -m hsgd.train --device gpu` puts all eight ranks on GPU 0. That is for testing the parallel
# code on a workstation: the ranks share the GPU's memory and take turns on it (CUDA time-slices the processes; the
# MPS service lets their kernels run side by side), so it is correct but not fast. The mapping for 8 ranks on a node
# with 1, 2, 4 or 8 GPUs, pure arithmetic:

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
# Schedulers can also hand each rank exactly one GPU by setting `CUDA_VISIBLE_DEVICES` per rank (Slurm does with
# `--gpus-per-task=1` or `--gpu-bind`). Each rank then sees one GPU, numbered 0, and `local_rank % 1 = 0` picks it:
# the same rule stays right.
#
# **On two nodes.** With 16 ranks placed 8 per node in blocks (ranks 0-7 on the first node, 8-15 on the second; the
# default of the launchers in section 5), tp = 8 and dp = 2, chapter 3's numbering
# `rank = (dp_rank * pp + pp_rank) * tp + tp_rank`, here with pp = 1 `rank = dp_rank * tp + tp_rank`, gives:

# %%
TP2, DP2 = 8, 2
say(f"{'world rank':>10} {'node':>5} {'local rank = GPU':>17} {'dp_rank':>8} {'tp_rank':>8}")
numbered, inside = True, True
for r in range(TP2 * DP2):
    node, local = divmod(r, RANKS_PER_NODE)                              # block placement
    dp_rank, tp_rank = divmod(r, TP2)                                    # tp fastest
    numbered &= ProcessGrid.rank_of(dp_rank, 0, tp_rank, 1, TP2) == r    # hsgd.grid agrees
    inside &= node == (dp_rank * TP2) // RANKS_PER_NODE                  # on the node of my group's first rank
    if r in (0, 1, 7, 8, 9, 15):
        say(f"{r:>10} {node:>5} {local:>17} {dp_rank:>8} {tp_rank:>8}")
    elif r in (2, 10):
        say(f"{'...':>10}")
check.holds("16 ranks, dp=2 tp=8: numbered as ProcessGrid.rank_of", numbered)
check.holds("16 ranks, 8 per node, dp=2 tp=8: every rank on its tp group's node", inside)

# %% [markdown]
# Each tp_comm (one dp_rank: 8 consecutive ranks) is one node, its 8 GPUs joined by NVLink; each dp_comm (one
# tp_rank: ranks r and r + 8) joins the same GPU position on the two nodes, over InfiniBand. That is the lecture's
# section 4.1 (section 5 says why).
#
# ## 4. Silent host round trips
#
# The host queues GPU kernels and runs ahead; it only has to wait when it needs a *value* from the device. These
# lines look innocent and each is a synchronization on a CuPy array: the host stops until every kernel queued before
# has finished, a few bytes cross PCIe, and the GPU then sits idle until the host has launched the next kernel:
#
# | on a device array `x` | why it waits |
# |---|---|
# | `float(x)`, `int(x)`, `x.item()` | Python needs the number now |
# | `bool(x)`: `if loss > 10:`, `while`, `assert (x > 0).all()` | Python needs the truth value now |
# | `a[mask]`, `xp.nonzero(m)`, `xp.unique(a)` | the result's size depends on the data: the host needs it to allocate |
# | `print(x)`, `x.tolist()`, `x.get()`, `cupy.asnumpy(x)` | a full copy to the host |
# | `np.asarray(x)` | CuPy refuses (TypeError): no implicit conversion, only explicit copies |
#
# One of these costs some microseconds for the copy, plus the wait for everything still queued; one per layer in
# the forward and backward pass, every step, leaves a fast GPU waiting on Python much of the time. On NumPy the
# same lines are free, which is why they creep in unnoticed. hsgd's rules in the hot path: no `float()`, `bool()`
# or `.item()` on device arrays, and **masks by multiplication or `xp.where`, never by indexing**, because the
# shape then stays fixed. The vocabulary-parallel embedding (`tp_layers.vocab_embedding_backward`) and the
# gradient-norm parts of `health.step_numbers` are written that way. The difference, on NumPy:

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
# (The `float()` calls in that check are the kind of host copy meant above; fine in a check, not in the step.)
#
# **One copy per step.** A training step has to bring *some* numbers to the host: the loss to print, whether any
# gradient is NaN or infinite (`--on-nan`, chapter 11), and the gradient norm for clipping, which needs a sum over
# ranks. `HybridTrainer.step` computes all of them on the device, stacks them into one small vector
# `[loss, count of non-finite values, sum of squares of the tp-sharded gradients, of the replicated ones]`, and
# copies that with **one** `backend.to_host` call. Everything after that is host arithmetic and small pickled MPI
# calls on Python floats (the norm's sum over tp_comm, the loss's mean over dp_comm). `to_host` counts its copies
# (`backend.d2h_count()`), on the CPU too, where the copy is free, so that the count can be checked on a machine
# without a GPU; `tests/mpi/test_hybrid.py::test_one_host_copy_per_training_step` does that for three layouts.
#
# Here: dp = 2, tp = 1 (each rank holds the whole toy model and half of each batch, chapter 4), float64, SGD with
# momentum, a warm-up, a cosine schedule and clipping; a few steps, counting the copies of each.

# %%
STEPS = 6
tc = train_config(tp=1, dp=P, steps=STEPS, batch_size=4, warmup=2, clip=1.0, seed=SEED, device=DEVICE)
grid = ProcessGrid(world, dp=P, tp=1)
trainer = HybridTrainer(cfg, grid, tc)                                   # parameters on DEVICE, in one flat buffer
say(f"parameters: one flat {type(trainer.pbuf.flat).__module__} buffer of {trainer.pbuf.flat.size:,} float64")
SIMULATED = getattr(xp, "SIMULATED", False)                             # the simulated GPU (see below)
copies, transfers, losses, traffic, host_bytes = [], [], [], [], []
to_host = health.to_host                                                 # the one copy of a step (hsgd.health)
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
# Note the collectives of each step: the one Allreduce of the gradient buffer over dp_comm, and those the layers
# make on tp_comm. With tp = 1 that communicator has one rank and an Allreduce over it changes nothing; hsgd still
# makes the call, so that the counts match the formulas of chapter 7, but `Comm` skips MPI for it (no
# synchronization, no staging). On a GPU every other collective is a synchronization (`Comm._buf`), and with
# staging a D2H and an H2D copy of its buffer: communication, not values read by Python, and not in `d2h_count`.
#
# **The simulated GPU.** `d2h_count` counts the copies made *through* `to_host`. An implicit `float(x)` hidden
# somewhere in the step would not be counted by it, and on NumPy it is no copy at all, so a CPU run cannot see it.
# `tests/simgpu` holds a package named `cupy` (with a `cupyx`) that is NumPy underneath but keeps CuPy's rules at
# the host/device boundary: its arrays are a type of their own, `np.asarray(x)` and `x + numpy_array` raise
# `TypeError` as CuPy's do, and it counts every device-to-host transfer (`xp.counts["d2h"]`), explicit (`x.get()`)
# or implicit (`float(x)`, `x.item()`, `bool(x)`, a boolean mask, printing); inside `cupyx.allow_synchronize(False)`
# each one raises, as it does in CuPy. MPI sees its arrays only through `__cuda_array_interface__`, the way it sees
# CuPy's; since that pointer is really host memory, both transfer paths run on any MPI. It also keeps the rule of
# section 2: every device operation counts as a kernel queued on the stream, and a pointer handed to MPI before the
# stream is synchronized raises. With `tests/simgpu` first
# on `PYTHONPATH`, hsgd takes its whole GPU path on a machine without a GPU:
#
#     PYTHONPATH=tests/simgpu mpirun -n 2 python -m hsgd.verify --device gpu --tp 2
#     PYTHONPATH=tests/simgpu HSGD_CUDA_AWARE=1 mpirun -n 2 python -m hsgd.train --device gpu --steps 50
#     make gpu-sim            # the `make gpu-check` script, as a dry run
#
# It says nothing about kernels, speed or memory. What it does check is that nothing crosses to the host unannounced
# (`tests/mpi/test_simgpu.py` accounts for every transfer of a step on five layouts, both paths, on 8 ranks). When
# this chapter runs on it, the cell below accounts for the transfers of the steps above: each step's one `to_host`
# copy, and with staging one more, the gradient buffer copied out for the Allreduce over dp_comm (the buffer MPI
# writes goes back with an H2D copy, not counted here).

# %%
if SIMULATED:
    staged = 0 if cuda_aware_mpi() else 1                                # the dp Allreduce's copy to the host
    say(f"simulated GPU: device-to-host transfers per step {transfers}: to_host {copies[0]} + staged {staged}")
    check.equal(f"{STEPS} steps: all transfers of every step == to_host + staged copies",
                transfers, [c + staged for c in copies])
else:
    say("(on NumPy or a real GPU only to_host's count is known; the simulated GPU counts every transfer)")

# %% [markdown]
# The picture: on the left the two paths of section 2 for this step's one collective on more than one rank, the
# All-Reduce of the gradient buffer over dp_comm; on the right the bytes that cross between host and device in one
# step on each path, from the step's `CommStats` (the payload of every collective on a communicator of more than one
# rank: staging copies it out and back) and the bytes of the step's one `to_host` copy, noted above. (The tp_comm
# All-Reduces have one rank here and never reach MPI.) On the CPU nothing crosses; these are the bytes a GPU run of
# the same step moves, and on the simulated GPU the check above has counted the copies.

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
    say(f"picture: {pictures.save(fig, '12_transfer_paths')}")
pictures.wait_asleep(world)                      # the other ranks sleep while rank 0 draws

# %% [markdown]
# **The check against serial.** Rank 0 runs serial mini-batch SGD on the whole batch of every step, with the same
# optimizer, schedule and clipping, in NumPy on the host (`serial.sgd`, from parameters initialized on the host),
# and broadcasts the result; every rank compares its parameters (copied back with `to_numpy`) and the losses. As in
# chapters 4 and 7 the error is relative to each parameter's largest entry, but at least to 0.02, the scale of the
# initialization.

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
# A typical GPU cluster: nodes of 8 GPUs each, the GPUs of a node joined by NVLink (hundreds of GB/s per GPU), the
# nodes by InfiniBand (often one card per GPU, tens of GB/s each). hsgd runs one rank per GPU, so 2 such nodes are
# 16 ranks. With tp = 8 and dp = 2:
#
#     mpirun -n 16 -ppn 8 --hostfile hosts python -m hsgd.train --device gpu --tp 8 --dp 2
#
# `-ppn 8` ("processes per node") is MPICH's launcher (hydra), which reads a hostfile of `host:slots` lines:
#
#     node001:8
#     node002:8
#
# Open MPI spells it `mpirun -n 16 -npernode 8 --hostfile hosts ...` or `--map-by ppr:8:node`, with hostfile lines
# `node001 slots=8`. Under Slurm, `srun` starts the ranks itself (some sites add `--mpi=pmix`):
#
#     srun -N 2 --ntasks-per-node=8 --gpus-per-node=8 python -m hsgd.train --device gpu --tp 8 --dp 2
#
# mpi4py must run on the cluster's MPI library (the one that knows its network, is usually CUDA-aware and works with
# `srun`), not on the MPICH wheel from PyPI that `make train` installs for one machine: install without the `mpi`
# extra, `make test EXTRAS=dev` or `pip install -e '.[dev,gpu]'`, with the site's MPI module loaded (`mpicc` on
# PATH), and check on a compute node with `python -c "from mpi4py import MPI; print(MPI.Get_library_version())"`.
# If that MPI is CUDA-aware, say so with `HSGD_CUDA_AWARE=1` (section 2), and read the `device:` line of the header.
#
# **Why tp inside a node and dp across nodes.** All three launch lines place ranks **in blocks**: ranks 0-7 on the first
# node, 8-15 on the second. hsgd numbers ranks tp fastest, then pp, then dp:
# rank = (dp_rank * pp + pp_rank) * tp + tp_rank, so a tensor-parallel group is 8 consecutive ranks, one node (the table
# of section 3). That is where its traffic must be: tensor parallelism communicates in every layer, forward and backward
# (4L + 4 All-Reduces per micro-batch, all but the loss's two of (B, T, C) activations, chapters 6 and 7), and the next
# layer waits for each, so it needs NVLink. hsgd puts dp outermost, so that each data-parallel replica (one pipeline of
# tp groups) is a contiguous block of ranks, the lecture's G groups of M consecutive workers; data parallelism
# communicates once per step, the gradient of each shard, and can overlap the backward pass (chapter 8), so it can cross
# InfiniBand. By bytes, pp carries the least (one activation per micro-batch between neighbours), which is why
# Megatron-LM puts pp outermost instead: its default order is "tp-cp-ep-dp-pp" (tp fastest, pipeline slowest;
# `RankGenerator` in megatron/core/parallel_state.py), and then the pipeline's point-to-point sends cross the nodes
# where hsgd's dp All-Reduce does. Both keep tp inside the node. A round-robin placement (Open MPI's `--map-by node`,
# Slurm's `--distribution=cyclic`) would put every tp group across both nodes; check the `layout:` table that
# `hsgd.train` prints (rank, dp, pp, tp, host): the ranks of one tp group should share a host.
#
# **What has been checked where.** Three levels, each catching what the one before cannot:
#
# 1. **NumPy** (the test suite, every chapter): the model code, the arithmetic of the GPU mapping, and one
#    `to_host` copy per step.
# 2. **The simulated GPU** (the test suite too: this chapter, `tests/mpi/test_simgpu.py`, `tests/test_simgpu.py`,
#    `make gpu-sim`): device arrays end to end; no implicit conversion of a device array to NumPy and no host
#    array in device arithmetic; every transfer of a step accounted for, on both transfer paths and every kind
#    of layout; no pinned allocation once the first step has run; training on the device equal to training on
#    the host.
# 3. **A real GPU**, with
#
#        make gpu-check          # python benchmarks/gpu_check.py
#
#    on a machine with a GPU and CuPy: the float64 GPU-against-CPU tests of every layer and the model
#    (`tests/test_gpu.py`, skipped elsewhere), `hsgd.verify --device gpu` for several layouts (ranks sharing the
#    GPU when there are more ranks than GPUs), a float32 training run whose loss must fall, the host copies of a
#    step, forward and backward under CuPy's own `cupyx.allow_synchronize(False)` (deprecated since CuPy 10: not
#    checked where it is gone), and one training step against PyTorch on the same GPU; it prints one table and
#    exits non-zero if a check failed. Only this level runs CuPy's kernels, so only it can find an argument or
#    array method CuPy lacks, a result it computes differently, a wrong stream, or the speed. The README says
#    whether it has been run.
#
# ## Check against serial
#
# On 2 ranks, every verdict reached collectively: the parameters drawn for the device are the host's, bit for bit,
# and the loss and gradients computed there match NumPy's; an Allreduce through `hsgd.comm.Comm` of each rank's
# device array equals the NumPy sum on one rank, and staging it by hand gives the same; node-local ranks and the GPU
# mapping are as computed, and a tp group of 8 stays on one node; masks by multiplication give what boolean
# indexing gives; every data-parallel training step made exactly one counted device-to-host copy (on the simulated
# GPU: every transfer of the step accounted for), reached MPI only with the dp All-Reduce of the flat gradient
# buffer, and ended with the parameters of serial SGD.

# %%
worst, err = check.worst()
say(f"\nchapter 12: all {len(check.passed)} checks passed on {P} ranks ({DEVICE}); largest error {err:.1e} "
    f"({worst})")

# %% [markdown]
# ## Cross-walk: hsgd and the production frameworks
#
# | hsgd | Megatron-LM | DeepSpeed | PyTorch | where hsgd differs, on purpose |
# |---|---|---|---|---|
# | collectives on device buffers: `hsgd.comm.Comm` hands MPI a device pointer (CUDA-aware) or stages through pinned host buffers (`Comm._buf`, `HostStaging`), after synchronizing the stream | NCCL through torch.distributed: `distributed_backend` "nccl" by default (megatron/training/config/common_config.py) | `deepspeed.comm` (deepspeed/comm/comm.py): `init_distributed(dist_backend=...)` over torch.distributed, NCCL on NVIDIA GPUs | `init_process_group(backend="nccl")`: `ProcessGroupNCCL` queues each collective on a CUDA stream of its own, ordered after the current stream by an event (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp); the host does not wait | one communication layer for CPU and GPU, every collective visible at its call site, any MPI; the price is a host wait per collective, and two PCIe copies when staging |
# | `hsgd.comm.cuda_aware_mpi()`: `HSGD_CUDA_AWARE`, else the library's `MPIX_Query_cuda_support()` | - | - | the "mpi" backend's `cudaAwareMpiCheck()` (torch/csrc/distributed/c10d/ProcessGroupMPI.cpp) asks the same `MPIX_Query_cuda_support()`, and refuses CUDA tensors without it | hsgd stages instead of refusing: slower, but it runs on any MPI |
# | `hsgd.train.local_ranks(world)`: `Split_type(COMM_TYPE_SHARED)`, the rank within the node's communicator | `local_rank` from `LOCAL_RANK` (megatron/training/config/common_config.py), set by the launcher | `mpi_discovery` (deepspeed/comm/comm.py): under mpirun, counts the lower ranks with the same `MPI.Get_processor_name()`, then sets `LOCAL_RANK`; the `deepspeed` launcher sets it otherwise (deepspeed/launcher/launch.py) | `torchrun` (torch/distributed/run.py) sets `LOCAL_RANK`, `RANK`, `WORLD_SIZE` in each worker's environment | MPI knows the node: no environment variable to trust, whichever launcher started the ranks |
# | `backend.select_gpu(local_rank)`: `cupy.cuda.Device(local_rank % n_gpus).use()` | `torch.cuda.set_device(args.local_rank)` in `_initialize_distributed` (megatron/training/initialize.py) | `get_accelerator().set_device(self.local_rank)` in the engine (deepspeed/runtime/engine.py) | `torch.cuda.set_device(local_rank)` | the modulo lets more ranks than GPUs share them, for testing the parallel code on one GPU |
# | launching: `mpirun -n 16 -ppn 8`, Open MPI's `-npernode 8`, `srun --ntasks-per-node=8`, ranks placed in blocks | `torchrun --nproc-per-node 8 --nnodes 2 ...` (one process per GPU) | the `deepspeed` launcher (deepspeed/launcher/runner.py), `--launcher` pdsh, openmpi, mpich, mvapich or slurm | `torchrun` (torch/distributed/run.py) | the site's MPI launcher, so the MPI library's own network and placement apply |
# | `backend.to_host`, `d2h_count()`: one counted device-to-host copy per step; the simulated GPU (`tests/simgpu`) counts every transfer | - | - | `torch.cuda.set_sync_debug_mode("warn")` reports operations that synchronize with the host | a count checked on every machine, with or without a GPU |
#
# ## Exercises
#
# All four run without a GPU: on NumPy, on MPI's view of the machine, and on the simulated GPU of `tests/simgpu`
# (put `tests/simgpu` first on `sys.path` before anything imports `cupy`).
#
# ### Exercise 1: the local rank from the environment
# Launchers tell each process its place on the node in an environment variable: `LOCAL_RANK` (torchrun, the
# `deepspeed` launcher), `OMPI_COMM_WORLD_LOCAL_RANK` (Open MPI), `MPI_LOCALRANKID` (MPICH's Hydra, the launcher
# of this course), `SLURM_LOCALID` (srun). Write `local_rank_from_env(env)` that returns the first one found (and
# its name), or None; and `local_rank_by_name(world)`, DeepSpeed's way: the number of lower world ranks with the
# same `MPI.Get_processor_name()`. Check the first on a few made-up environments, and both against
# `hsgd.train.local_ranks(world)` on every rank.
# (solution: `tutorials/solutions/12_gpus.py`, `exercise_1`)
#
# ### Exercise 2: which GPU a rank uses
# Write `physical_gpu(local_rank, visible)`: the rank uses device `local_rank % len(visible)` of the devices it
# sees, and `visible` (from `CUDA_VISIBLE_DEVICES`) says which physical GPU that is. Check it, for 8 local ranks on
# nodes of 1, 2, 4 and 8 GPUs and for one GPU per rank (`CUDA_VISIBLE_DEVICES=<local rank>`), against what
# `backend.select_gpu` makes current on the simulated GPU (`SIMGPU_DEVICES=n` simulates n devices).
# (solution: `tutorials/solutions/12_gpus.py`, `exercise_2`)
#
# ### Exercise 3: the bytes staged in one step
# With staging (`HSGD_CUDA_AWARE=0`), predict from one step's `CommStats` the bytes that cross from device to host
# and back in a training step on dp 1 x tp 2, for Megatron's scheme and for the All-Gather scheme: for each
# collective on a communicator of more than one rank, an All-Reduce copies its payload out and back, an
# All-Gather copies out the rank's part (payload / p) and back the whole, plus the step's one `to_host` vector.
# Check the prediction against the simulated GPU, with its `ndarray.get` and `ndarray.set` wrapped to add up
# bytes, and the number of device-to-host transfers against its `counts["d2h"]`.
# (solution: `tutorials/solutions/12_gpus.py`, `exercise_3`)
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
# (solution: `tutorials/solutions/12_gpus.py`, `exercise_4`)
