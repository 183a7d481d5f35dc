"""The GPU path's command lines on the simulated GPU (tests/simgpu: CuPy's host/device rules over NumPy), run in
subprocesses with it first on PYTHONPATH: `make gpu-check`'s script end to end, so that it cannot rot between runs
on real GPUs; `hsgd.train --device gpu` with evaluation, a sample, and a checkpoint resumed on another layout
through the other transfer path; chapter 21 on device arrays. (tests/mpi/test_simgpu.py checks the transfers of
every layout on 8 ranks.)"""
import os
import subprocess
import sys

from .test_mpi import ROOT, mpi_env, run_mpi
from .test_tutorials import mpiexec

SIMGPU = os.path.join(ROOT, "tests", "simgpu")


def sim_env(**extra):
    return mpi_env(PYTHONPATH=SIMGPU, MPLBACKEND="Agg", **extra)


def test_gpu_check_script_runs_on_the_simulated_gpu():
    results = os.path.join(ROOT, "benchmarks", "results", "gpu_check.md")
    before = open(results).read() if os.path.exists(results) else None
    r = subprocess.run(["timeout", "-k", "10", "300", sys.executable, "benchmarks/gpu_check.py", "--quick"],
                       capture_output=True, text=True, cwd=ROOT, env=sim_env())
    print(r.stdout[-4000:])
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ")]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(rows) == 19 and not any("| FAIL |" in ln for ln in rows)
    assert "simulated GPU (NumPy)" in rows[0] and "host copies in one training step" in r.stdout
    after = open(results).read() if os.path.exists(results) else None
    assert after == before, "a dry run must not write results"


def test_training_on_the_simulated_gpu_saves_and_resumes_across_transfer_paths(tmp_path):
    tiny = ["--d-model", "16", "--n-heads", "4", "--n-layers", "2", "--d-ff", "32", "--seq-len", "16",
            "--batch-size", "8", "--eval-batches", "1", "--log-interval", "2", "--save-dir", str(tmp_path),
            "--device", "gpu"]
    first = run_mpi(2, ["-m", "hsgd.train", *tiny, "--tp", "2", "--steps", "4", "--eval-interval", "2",
                        "--save-interval", "2", "--sample-bytes", "16"], timeout=120, env=sim_env(HSGD_CUDA_AWARE="0"))
    print(first.stdout[-2500:])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "device: gpu (CuPy simulated), 1 GPU(s) on this node" in first.stdout
    assert "staged through host memory" in first.stdout
    assert "sample:" in first.stdout and "after 4 steps" in first.stdout
    assert "allocated after step 1, most on any rank: 0" in first.stdout
    second = run_mpi(2, ["-m", "hsgd.train", *tiny, "--tp", "1", "--steps", "6", "--resume", "auto",
                         "--sample-bytes", "0"], timeout=120, env=sim_env(HSGD_CUDA_AWARE="1"))
    print(second.stdout[-2500:])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "CUDA-aware MPI: device buffers to MPI" in second.stdout and "step 6/6" in second.stdout
    assert "resum" in second.stdout and "after 2 steps" in second.stdout


def test_gpu_chapter_on_the_simulated_gpu():
    r = subprocess.run(["timeout", "-k", "5", "240", mpiexec(), "-n", "2", sys.executable, "tutorials/21_gpus.py"],
                       capture_output=True, text=True, cwd=ROOT, env=sim_env())
    print(r.stdout[-2500:])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "device: gpu (CuPy simulated)" in r.stdout and "checks passed on 2 ranks (gpu)" in r.stdout


def test_experts_on_the_simulated_gpu(tmp_path):
    """Experts split over ep = 2 ranks on the simulated GPU (2 ranks, dp 2): routing, the all-to-all (its counts
    through the host), the folded exchange, the per-step routing report and a checkpoint, with CuPy's host/device
    rules (every host copy explicit)."""
    r = run_mpi(2, ["-m", "hsgd.train", "--d-model", "16", "--n-heads", "4", "--n-layers", "2", "--d-ff", "32",
                    "--seq-len", "16", "--batch-size", "8", "--eval-batches", "1", "--log-interval", "2",
                    "--device", "gpu", "--tp", "1", "--moe-experts", "4", "--moe-capacity-factor", "1.0", "--ep", "2",
                    "--steps", "3", "--sample-bytes", "8", "--save-dir", str(tmp_path)],
                timeout=120, env=sim_env(HSGD_CUDA_AWARE="0"))
    print(r.stdout[-2000:])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "device: gpu (CuPy simulated)" in r.stdout and "experts: 4 per MoE block" in r.stdout
    assert "measured/formula = 1.000" in r.stdout and "<- differs" not in r.stdout


def test_fp8_on_the_simulated_gpu(tmp_path):
    """FP8 products (--fp8 hybrid, blockwise tiles, dp 1 x tp 2 with the sequence scheme) on the simulated GPU: the
    casts, the amax Allreduces (staged through the host), the counts in the progress line, the step formula's
    bytes, a checkpoint, with CuPy's host/device rules; then ZeRO-3 sending its weights as FP8 codes on dp 2."""
    r = run_mpi(2, ["-m", "hsgd.train", "--d-model", "32", "--n-heads", "4", "--n-layers", "2", "--d-ff", "64",
                    "--seq-len", "32", "--batch-size", "8", "--eval-batches", "1", "--log-interval", "3",
                    "--device", "gpu", "--tp", "2", "--tp-scheme", "sequence", "--fp8", "hybrid", "--fp8-recipe",
                    "blockwise", "--fp8-block", "16", "--fp8-check", "--steps", "3", "--sample-bytes", "0",
                    "--save-dir", str(tmp_path)], timeout=120, env=sim_env(HSGD_CUDA_AWARE="0"))
    print(r.stdout[-2000:])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "device: gpu (CuPy simulated)" in r.stdout and "fp8 casts: " in r.stdout
    assert "<- differs" not in r.stdout
    r = run_mpi(2, ["-m", "hsgd.train", "--d-model", "32", "--n-heads", "4", "--n-layers", "2", "--d-ff", "64",
                    "--seq-len", "32", "--batch-size", "8", "--eval-batches", "1", "--log-interval", "2",
                    "--device", "gpu", "--dp", "2", "--zero", "3", "--fp8", "hybrid", "--fp8-recipe", "tensorwise",
                    "--fp8-allgather", "--fp8-check", "--steps", "2", "--sample-bytes", "0"],
                timeout=120, env=sim_env(HSGD_CUDA_AWARE="0"))              # ZeRO-3 sending FP8 codes (uint8)
    print(r.stdout[-800:])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fp8 casts: " in r.stdout and "<- differs" not in r.stdout
