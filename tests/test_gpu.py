"""The GPU path (CuPy arrays end to end). Skipped unless CuPy imports and sees a GPU; `make gpu-check` runs these
on a machine with one, together with hsgd.verify, a training run and the benchmark."""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    N_GPUS = cupy.cuda.runtime.getDeviceCount()
except Exception:                                                       # no driver, no device
    N_GPUS = 0
pytestmark = pytest.mark.skipif(N_GPUS == 0, reason="no GPU visible to CuPy")

import hsgd  # noqa: E402
from hsgd import serial  # noqa: E402

from .conftest import max_rel_err, noisy_params, random_batch  # noqa: E402


def test_serial_model_on_gpu_equals_cpu_float64(tiny_cfg):
    params = noisy_params(tiny_cfg)
    idx, targets = random_batch(tiny_cfg, 3)
    loss_cpu, grads_cpu = serial.loss_and_grads(params, idx, targets, tiny_cfg)
    gparams = {n: cupy.asarray(p) for n, p in params.items()}
    loss_gpu, grads_gpu = serial.loss_and_grads(gparams, idx, targets, tiny_cfg)
    assert all(type(g).__module__.startswith("cupy") for g in grads_gpu.values())
    err = max(max_rel_err(cupy.asnumpy(grads_gpu[n]), grads_cpu[n], floor=1e-6) for n in params)
    print(f"GPU vs CPU float64: loss diff {abs(loss_gpu - loss_cpu):.1e}, max grad rel err {err:.1e}")
    assert abs(loss_gpu - loss_cpu) <= 1e-12 * abs(loss_cpu) and err < 1e-10


def test_init_on_gpu_equals_cpu():
    cfg = hsgd.ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
    a = serial.init_params(cfg, seed=3, dtype="float64", device="cpu")
    b = serial.init_params(cfg, seed=3, dtype="float64", device="gpu")
    assert all(np.array_equal(a[n], cupy.asnumpy(b[n])) for n in a)


def test_embedding_scatter_add_on_gpu():
    from hsgd.backend import scatter_add
    target = cupy.zeros((5, 2))
    scatter_add(target, cupy.asarray([1, 1, 3]), cupy.ones((3, 2)))
    assert cupy.asnumpy(target).tolist() == [[0, 0], [2, 2], [0, 0], [1, 1], [0, 0]]


def test_staging_through_pinned_host_buffers(monkeypatch):
    """Without a CUDA-aware MPI a device buffer goes to MPI through a pinned host buffer: filled from the device
    before MPI reads it, copied back after MPI wrote it, and the same host buffer every step."""
    from mpi4py import MPI

    from hsgd.comm import Comm
    monkeypatch.setenv("HSGD_CUDA_AWARE", "0")
    comm = Comm(MPI.COMM_SELF, "test")
    x = cupy.arange(6, dtype=cupy.float32).reshape(2, 3)
    host, unstage = comm._buf(x)
    assert isinstance(host, np.ndarray) and host.tolist() == [[0, 1, 2], [3, 4, 5]]
    host *= 10                                                          # what MPI would write
    unstage()
    assert cupy.asnumpy(x).tolist() == [[0, 10, 20], [30, 40, 50]]
    again, _ = comm._buf(x)
    send, nothing = comm._buf(x, "send")
    assert again is host and nothing is None and comm.staging.allocated == 2
