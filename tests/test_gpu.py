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


from hsgd.model.config import ModelConfig  # noqa: E402
from hsgd.model import serial  # noqa: E402

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
    cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
    a = serial.init_params(cfg, seed=3, dtype="float64", device="cpu")
    b = serial.init_params(cfg, seed=3, dtype="float64", device="gpu")
    assert all(np.array_equal(a[n], cupy.asnumpy(b[n])) for n in a)


def test_embedding_scatter_add_on_gpu():
    from hsgd.model.backend import scatter_add
    target = cupy.zeros((5, 2))
    scatter_add(target, cupy.asarray([1, 1, 3]), cupy.ones((3, 2)))
    assert cupy.asnumpy(target).tolist() == [[0, 0], [2, 2], [0, 0], [1, 1], [0, 0]]


def test_staging_through_pinned_host_buffers(monkeypatch, request):
    """Without a CUDA-aware MPI a device buffer goes to MPI through a pinned host buffer: filled from the device
    before MPI reads it, copied back after MPI wrote it, then given back to the pool and taken again next time."""
    from mpi4py import MPI

    from hsgd.grid.comm import Comm, cuda_aware_mpi
    monkeypatch.setenv("HSGD_CUDA_AWARE", "0")
    cuda_aware_mpi.cache_clear()                                        # decided once per process: decide again
    request.addfinalizer(cuda_aware_mpi.cache_clear)                    # and again after the variable is restored
    comm = Comm(MPI.COMM_SELF, "test")
    x = cupy.arange(6, dtype=cupy.float32).reshape(2, 3)
    host, done = comm._buf(x)
    assert isinstance(host, np.ndarray) and host.tolist() == [[0, 1, 2], [3, 4, 5]]
    host *= 10                                                          # what MPI would write
    done()
    assert cupy.asnumpy(x).tolist() == [[0, 10, 20], [30, 40, 50]]
    again, done = comm._buf(x)                                          # the buffer came back to the pool
    send, sent = comm._buf(cupy.ones((2, 3), dtype=cupy.float32), "send")      # another one, while `again` is out
    assert again is host and send is not host and send.tolist() == [[1, 1, 1], [1, 1, 1]]
    sent()
    done()
    assert cupy.asnumpy(x).tolist() == [[0, 10, 20], [30, 40, 50]] and comm.staging.allocated == 2


@pytest.mark.parametrize("B, T, NH", [(1, 130, 1), (3, 256, 2)])
def test_layers_on_gpu_equal_cpu_float64(B, T, NH):
    """Each layer on CuPy against NumPy, float64, with sequences long enough for several causal blocks (strided
    views of the scores, the skipped blocks set to 0, column-block products in the backward)."""
    from hsgd.model import kernels as layers                                 # the tuned layers the models run
    rng = np.random.default_rng(0)
    C, F, V = 8 * NH, 32, 50
    q, k, v, dy = (rng.normal(size=(B, T, C)) for _ in range(4))
    x, h, dh = rng.normal(size=(B, T, C)), rng.normal(size=(B, T, F)), rng.normal(size=(B, T, F))
    w, b = rng.normal(size=C), rng.normal(size=C)
    logits, targets = rng.normal(size=(B, T, V)), rng.integers(0, V, (B, T))
    g = lambda *a: [cupy.asarray(t) for t in a]                         # NumPy -> CuPy
    errs = {}
    y, c = layers.attention_forward(q, k, v, NH)
    yg, cg = layers.attention_forward(*g(q, k, v), NH)
    grads, grads_g = layers.attention_backward(dy, c), layers.attention_backward(cupy.asarray(dy), cg)
    errs["attention"] = max(max_rel_err(cupy.asnumpy(a), e) for a, e in zip((yg, cg[3], *grads_g), (y, c[3], *grads)))
    y, c = layers.gelu_forward(h)
    yg, cg = layers.gelu_forward(cupy.asarray(h))
    errs["gelu"] = max(max_rel_err(cupy.asnumpy(yg), y), max_rel_err(cupy.asnumpy(layers.gelu_backward(
        cupy.asarray(dh), cg)), layers.gelu_backward(dh, c)))
    y, c = layers.layernorm_forward(x, w, b)
    yg, cg = layers.layernorm_forward(*g(x, w, b))
    dw, db, dwg, dbg = np.zeros(C), np.zeros(C), cupy.zeros(C), cupy.zeros(C)
    dx, dxg = layers.layernorm_backward(dy, c, dw, db), layers.layernorm_backward(cupy.asarray(dy), cg, dwg, dbg)
    errs["layernorm"] = max(max_rel_err(cupy.asnumpy(a), e) for a, e in ((yg, y), (dxg, dx), (dwg, dw), (dbg, db)))
    loss, c = layers.cross_entropy_forward(logits, targets)
    loss_g, cg = layers.cross_entropy_forward(*g(logits, targets))
    errs["cross-entropy"] = max(abs(float(loss_g) - float(loss)) / abs(float(loss)), max_rel_err(
        cupy.asnumpy(layers.cross_entropy_backward(1.0, cg)), layers.cross_entropy_backward(1.0, c)))
    print(f"GPU vs CPU float64, B={B} T={T} NH={NH}: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    assert max(errs.values()) < 1e-12
