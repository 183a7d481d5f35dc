"""Which device each rank computes on: with --device gpu, the GPU of its node-local rank (ranks share the GPUs when
there are more ranks than GPUs), and how its buffers reach MPI (CUDA-aware, or staged through host memory). The
node-local rank comes from MPI's shared-memory split, whatever launcher started the job (chapter 21)."""
from mpi4py import MPI

from hsgd.grid import launch
from hsgd.grid.comm import cuda_aware_mpi
from hsgd.model.backend import resolve_device, select_gpu
from hsgd.model.threads import set_cpu_threads


def local_ranks(world):
    """(this rank's index among the job's ranks on this machine, how many there are)."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    rank, n = node.Get_rank(), node.Get_size()
    node.Free()
    return rank, n


def place_on_device(tc, world):
    """"cpu", or for --device gpu: use the GPU of this node-local rank (ranks share GPUs when there are more
    ranks than GPUs) and say how buffers reach MPI. Returns a description for the header."""
    if resolve_device(tc.device) == "cpu":
        return "cpu (NumPy)"
    local, _ = local_ranks(world)
    gpu, n_gpus = launch.agree(world, lambda: select_gpu(local))
    set_cpu_threads(1)                                               # the GPU does the elementwise work
    path = "CUDA-aware MPI: device buffers to MPI" if cuda_aware_mpi() else \
        "MPI not CUDA-aware: buffers staged through host memory"
    import cupy
    return (f"gpu (CuPy {cupy.__version__}), {n_gpus} GPU(s) on this node, rank 0 on GPU {gpu}; {path} "
            "(HSGD_CUDA_AWARE=0|1 overrides)")
