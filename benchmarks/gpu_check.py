"""make gpu-check: the GPU path checked on a machine with a GPU, in one short run (well under 10 minutes).

    python benchmarks/gpu_check.py [--ranks 2] [--quick]

Installs nothing. Needs CuPy (pip install -e '.[gpu]') and, for the last row, PyTorch with CUDA. Runs:
  1. the float64 serial-equivalence tests on the GPU (tests/test_gpu.py: GPU against CPU, to 1e-10);
  2. hsgd.verify with --device gpu for a few layouts, context parallelism among them (ranks share the GPUs when
     there are more ranks than GPUs), and the tolerance oracle in bfloat16 (CuPy's rounding);
  3. one float32 training run on the GPU whose validation loss must fall, staged through pinned host buffers
     (HSGD_CUDA_AWARE=0) none of which may be allocated after the first step;
  4. the device-to-host copies of a training step (hsgd.model.backend.d2h_count: expected 1, the step's one
     small vector) and, under cupyx.allow_synchronize(False), that forward and backward make no implicit device sync;
  5. one serial training step, float32, hsgd (CuPy) against PyTorch (CUDA), same model and weights.
Prints one summary table (and writes benchmarks/results/gpu_check.md); exits 1 if any check failed.

Dry run without a GPU (`make gpu-sim`): with tests/simgpu first on PYTHONPATH, CuPy is the simulated GPU (NumPy
with CuPy's host/device rules), and every row but the PyTorch one runs. That checks this script and the GPU code
path's transfers, not a GPU: nothing is written to benchmarks/results then.
"""
import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, timeout, env=None):
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                           env=dict(os.environ, **(env or {})))
        return r.returncode, r.stdout + r.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {timeout} s\n{e.stdout or ''}", time.perf_counter() - t0


def mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else "mpiexec"


def device_step_checks(simulated=False):
    """In this process: host copies per step, and the serial step against PyTorch on the same GPU."""
    import cupy
    import numpy as np
    from mpi4py import MPI

    from hsgd.model.config import ModelConfig
    from hsgd.model import serial
    from hsgd.model.backend import d2h_count
    from hsgd.model.data import Corpus
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer
    from hsgd.model.optim import SGD
    from hsgd.step.settings import TrainConfig
    rows = []
    cfg = ModelConfig(256, 64, 128, 4, 2, 512)
    corpus = Corpus(np.random.default_rng(0).integers(0, 256, 20000, dtype=np.uint8).tobytes(), "random", 64)
    tc = TrainConfig(tp=1, dp=1, steps=3, batch_size=8, device="gpu")
    grid = ProcessGrid(MPI.COMM_SELF, dp=1, tp=1)
    trainer = HybridTrainer(cfg, grid, tc)
    idx, targets = corpus.batch(0, 1, 8)
    trainer.step(idx, targets, 1)
    before = d2h_count()
    trainer.step(idx, targets, 2)
    copies = d2h_count() - before
    rows.append(("host copies in one training step (to_host)", f"{copies}", copies == 1))
    import cupyx
    what = "no implicit device sync in forward + backward (1 rank)"
    if not hasattr(cupyx, "allow_synchronize"):                 # deprecated since CuPy 10; may be gone
        rows.append((what, "not checked: this CuPy has no cupyx.allow_synchronize", True))
    else:
        try:                                      # implicit syncs (float(), .item(), a[mask], ...) raise in here
            with cupyx.allow_synchronize(False):
                trainer.gradients(cupy.asarray(idx), cupy.asarray(targets))
            rows.append((what, "none", True))
        except Exception as e:
            rows.append((what, f"{type(e).__name__}: {e}", False))
    grid.free()
    if simulated:
        rows.append(("serial step vs PyTorch on the GPU", "skipped (the simulated GPU)", True))
        return rows
    try:
        import torch
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from torch_gpt import loss_fn, sgd_step
        if not torch.cuda.is_available():
            raise ImportError("PyTorch without CUDA")
    except ImportError as e:
        rows.append(("serial step vs PyTorch on the GPU", f"skipped ({e})", True))
        return rows
    cfg, B = ModelConfig(256, 256, 512, 8, 4, 2048), 8
    p = serial.init_params(cfg, 0, "float32", device="gpu")
    tparams = {n: torch.tensor(cupy.asnumpy(v), device="cuda", requires_grad=True) for n, v in p.items()}
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, 256, (B, cfg.seq_len)), rng.integers(0, 256, (B, cfg.seq_len))
    ti, tt = torch.tensor(idx, device="cuda"), torch.tensor(targets, device="cuda")
    grads, opt = serial.zeros_like_params(p), SGD(1e-4)

    def ours():
        for g in grads.values():
            g.fill(0)
        serial.loss_and_grads(p, idx, targets, cfg, grads=grads)
        opt.step(p, grads)
        cupy.cuda.get_current_stream().synchronize()

    def theirs():
        loss_fn(tparams, ti, tt, cfg).backward()
        sgd_step(tparams, 1e-4)
        torch.cuda.synchronize()

    times = {}
    for name, f in (("hsgd", ours), ("torch", theirs)):
        f()
        t0 = time.perf_counter()
        for _ in range(10):
            f()
        times[name] = (time.perf_counter() - t0) / 10
    ratio = times["hsgd"] / times["torch"]
    rows.append(("serial step, mid-size model, hsgd / PyTorch", f"{times['hsgd'] * 1e3:.1f} ms / "
                 f"{times['torch'] * 1e3:.1f} ms = {ratio:.2f}", True))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="MPI ranks for verify and training (2)")
    p.add_argument("--quick", action="store_true", help="a shorter training run")
    a = p.parse_args(argv)
    rows = []
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        rows.append(("GPU", f"{n} x {name}, CuPy {cupy.__version__}", n > 0))
    except Exception as e:                                               # no CuPy, no driver, no device
        print(f"gpu-check needs CuPy and a GPU: {e}\n(without a GPU, `make gpu-sim` runs this script on the "
              "simulated GPU of tests/simgpu)")
        return 1
    simulated = getattr(cupy, "SIMULATED", False)
    if simulated:
        print("the simulated GPU (tests/simgpu): a dry run of the checks; no timing means anything, none is written")
    code, out, s = run([sys.executable, "-m", "pytest", "-q", "tests/test_gpu.py", "-p", "no:cacheprovider"], 300)
    rows.append(("float64 GPU vs CPU tests (tests/test_gpu.py)", (out.strip().splitlines() or ["?"])[-1] +
                 f" ({s:.0f} s)", code == 0))
    R = a.ranks
    for flags, env in ((["--tp", str(R)], None), (["--tp", "1"], None),
                       (["--tp", str(R), "--tp-scheme", "gather", "--micro-batches", "2"], None),
                       (["--tp", "1", "--pp", str(R), "--n-layers", str(2 * R), "--micro-batches", "2"], None),
                       (["--tp", str(R), "--dtype", "float32"], None),
                       (["--tp", str(R), "--seq-len", "256"], None),                  # several causal blocks
                       (["--tp", "1", "--micro-batches", "2"], {"HSGD_CUDA_AWARE": "0"}),    # pinned host staging
                       (["--tp", "1", "--zero", "3", "--recompute", "full", "--micro-batches", "2"], None),
                       (["--tp", "1", "--zero", "3"], {"HSGD_CUDA_AWARE": "0"}),      # staged Ireduce_scatter
                       (["--tp", "1", "--cp", str(R)], {"HSGD_CUDA_AWARE": "0"}),    # ring attention: staged Isend
                       (["--tp", "1", "--cp", str(R), "--cp-scheme", "allgather"], None),
                       (["--dtype", "bfloat16", "--layouts", f"1x1x1,1x1x{R}", "--seeds", "2"], None)):   # oracle
        code, out, s = run(["timeout", "240", mpiexec(), "-n", str(R), sys.executable, "-m", "hsgd.verify",
                            "--device", "gpu", *flags], 260, env)
        last = [ln for ln in out.splitlines() if ln.startswith(("PASS", "FAIL"))] or out.strip().splitlines()[-1:]
        shown = " ".join([f"{k}={v}" for k, v in (env or {}).items()] + ["hsgd.verify --device gpu", *flags])
        rows.append((shown, (last[0] if last else "?") + f" ({s:.0f} s)", code == 0))
    steps = "40" if simulated else "100" if a.quick else "300"      # the dry run checks the script, not the GPU
    code, out, s = run(["timeout", "400", mpiexec(), "-n", str(R), sys.executable, "-m", "hsgd.train", "--device",
                        "gpu", "--steps", steps, "--log-interval", "50", "--eval-interval", "0", "--sample-bytes",
                        "0"], 420, {"HSGD_CUDA_AWARE": "0"})                 # staged: the pool is reported
    m = re.search(r"val loss ([\d.]+) -> ([\d.]+) after", out)
    falls = bool(m) and float(m.group(2)) < float(m.group(1)) - 1.0
    rows.append((f"float32 training, {R} ranks, {steps} steps, staged", (m.group(0) if m else out.strip()[-200:]) +
                 f" ({s:.0f} s)", code == 0 and falls))
    m = re.search(r"host staging .*: (\d+) pinned buffers, (.*) on rank 0; allocated after step 1, most on any "
                  r"rank: (\d+)", out)
    rows.append(("pinned staging buffers of that run: held / allocated after step 1",
                 f"{m.group(1)} ({m.group(2)}) / {m.group(3)}" if m else "no report", bool(m) and m.group(3) == "0"))
    try:
        rows += device_step_checks(simulated)
    except Exception as e:
        rows.append(("in-process device checks", f"error: {e!r}", False))
    width = max(len(r[0]) for r in rows)
    table = "\n".join(f"| {r[0]:<{width}} | {'ok ' if r[2] else 'FAIL'} | {r[1]} |" for r in rows)
    print(table)
    if not simulated:
        os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
        with open(os.path.join(ROOT, "benchmarks", "results", "gpu_check.md"), "w") as f:
            f.write("| check | verdict | measured |\n|---|---|---|\n" + table + "\n")
    return 0 if all(r[2] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
