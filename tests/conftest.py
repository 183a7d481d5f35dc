"""Shared test helpers: small float64 models and the error measure every test prints."""
import os
import tempfile

import numpy as np
import pytest
from hsgd.model.config import ModelConfig
from hsgd.model import serial


def max_rel_err(a, b, floor=1e-12):
    """max |a - b| / max(max |b|, floor): the error measure hsgd's tests print."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor))


@pytest.fixture
def set_threads():
    """threads.set_cpu_threads for the test, the process-wide count restored afterwards."""
    from hsgd.model.threads import cpu_threads, set_cpu_threads
    before = cpu_threads()
    yield set_cpu_threads
    set_cpu_threads(before)


@pytest.fixture
def tiny_cfg():
    return ModelConfig(vocab_size=13, seq_len=6, d_model=8, n_heads=2, n_layers=2, d_ff=12)


def noisy_params(cfg, seed=0, scale=0.1):
    """float64 parameters from init_params, plus noise so biases and LayerNorm weights are not trivial."""
    params = serial.init_params(cfg, seed=seed, dtype="float64", device="cpu")
    rng = np.random.default_rng(seed + 1000)
    for p in params.values():
        p += rng.normal(0.0, scale, p.shape)
    return params


def random_batch(cfg, batch_size, seed=0):
    rng = np.random.default_rng(seed + 2000)
    idx = rng.integers(0, cfg.vocab_size, (batch_size, cfg.seq_len))
    targets = rng.integers(0, cfg.vocab_size, (batch_size, cfg.seq_len))
    return idx, targets


# tests/mpi/ runs only under mpiexec, started by tests/test_mpi.py (which sets HSGD_MPI_SUITE=1)
collect_ignore = [] if os.environ.get("HSGD_MPI_SUITE") == "1" else ["mpi"]

# The suite starts python in child processes some hundred times (every mpiexec rank, every chapter), each importing
# hsgd afresh. Where bytecode may not be written next to the sources (PYTHONDONTWRITEBYTECODE), each would compile
# every module again: about 0.5 s of an 8-rank launch on 2 cores. The children cache it outside the tree instead.
if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
    os.environ["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), f"hsgd-pycache-{os.getuid()}")
    del os.environ["PYTHONDONTWRITEBYTECODE"]
