"""Runs each file of tests/mpi under `mpiexec -n 8` (inside an outer `timeout`), and the MPI command-line checks.

Eight ranks share the machine's cores; every rank uses one BLAS thread.
"""
import glob
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI_FILES = sorted(glob.glob(os.path.join(ROOT, "tests", "mpi", "test_*.py")))
TIMEOUT_S = 400


def mpiexec():
    """mpiexec next to this Python first (the venv's mpich wheel), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def mpi_env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)


def run_mpi(n, args, timeout=TIMEOUT_S, env=None):
    cmd = ["timeout", "-k", "10", str(timeout), mpiexec(), "-n", str(n), sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env or mpi_env())


@pytest.mark.parametrize("path", MPI_FILES, ids=[os.path.basename(p) for p in MPI_FILES])
def test_mpi_file(path, tmp_path):
    r = run_mpi(8, ["tests/mpi_run.py", path, "--with-mpi", "-q", "-s", "-p", "no:cacheprovider",
                    "--timeout=180"], env=mpi_env(HSGD_MPI_LOGDIR=str(tmp_path)))
    print(r.stdout[-6000:])
    if r.returncode != 0:
        for log in sorted(glob.glob(str(tmp_path / "rank*.log")))[:2]:
            print(f"--- {os.path.basename(log)} ---\n" + open(log).read()[-3000:])
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-3000:]}"


def test_grid_size_error_is_reported_once_and_every_rank_exits_2():
    r = run_mpi(4, ["-m", "hsgd.grid", "--dp", "3", "--tp", "2"], timeout=60)
    print(r.stderr)
    assert r.returncode == 2
    assert r.stderr.count("hsgd: error:") == 1
    assert "dp*pp*tp = 3*1*2 = 6 does not match the 4 ranks" in r.stderr and "dp=2 pp=1 tp=2" in r.stderr


def test_grid_prints_the_layout_table():
    r = run_mpi(4, ["-m", "hsgd.grid", "--tp", "2"], timeout=60)
    print(r.stdout)
    assert r.returncode == 0
    assert "4 ranks = dp 2 x pp 1 x tp 2" in r.stdout
    assert "tp_comm groups: [[0, 1], [2, 3]]" in r.stdout and "dp_comm groups: [[0, 2], [1, 3]]" in r.stdout
