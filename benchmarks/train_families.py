"""The two model families trained side by side: `mpirun -n NP python -m hsgd.train --arch gpt2` and `--arch llama`,
every other setting the default job's (`make train`: the default corpus, model sizes, optimizer and 1000 steps), and
how far each one's validation loss falls.

    python benchmarks/train_families.py [--np 8] [--steps N]

The llama preset (RMSNorm, rotary positions, SwiGLU, 2 kv heads for 4 query heads, no biases) has the same widths:
its SwiGLU's three C x F matrices give it more parameters than gpt2's two. The claim checked (exit 1 otherwise):
llama's validation loss falls at least as far as gpt2's in the same steps. Writes benchmarks/results/
train_families.md and prints it. About 10 minutes on 2 cores with the default 1000 steps.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FALL = re.compile(r"val loss ([0-9.]+) -> ([0-9.]+) after (\d+) steps")
MODEL = re.compile(r"model: ([0-9,]+) parameters")


def run_train(n, flags):
    """The finished `mpiexec -n n python -m hsgd.train --sample-bytes 0 flags` (one BLAS thread per rank; mpiexec
    next to this Python first, the venv's mpich wheel, else the one on PATH)."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else shutil.which("mpiexec")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "hsgd.train", "--sample-bytes", "0", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)


def write_results(name, text):
    """benchmarks/results/<name>, and the text printed."""
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", name), "w") as f:
        f.write(text)
    print(text)


def train(arch, n, steps):
    """(parameters, val loss before, after, steps) of one run of hsgd.train with --arch `arch` on n ranks."""
    r = run_train(n, ["--arch", arch] + (["--steps", str(steps)] if steps else []))
    fall, model = FALL.search(r.stdout), MODEL.search(r.stdout)
    if r.returncode != 0 or not fall or not model:
        sys.exit(f"hsgd.train --arch {arch} failed (exit {r.returncode}): {r.stderr[-2000:]}")
    return int(model.group(1).replace(",", "")), float(fall.group(1)), float(fall.group(2)), int(fall.group(3))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=8, help="ranks (8, as make train)")
    p.add_argument("--steps", type=int, default=None, help="steps (the default job's 1000)")
    args = p.parse_args()
    rows = {arch: train(arch, args.np, args.steps) for arch in ("gpt2", "llama")}
    lines = ["| arch | parameters | val loss before | after | fall | steps |", "|---|---|---|---|---|---|"]
    for arch, (n, before, after, steps) in rows.items():
        lines.append(f"| {arch} | {n:,} | {before:.4f} | {after:.4f} | {before - after:.4f} | {steps} |")
    fall = {arch: before - after for arch, (_, before, after, _) in rows.items()}
    ok = fall["llama"] >= fall["gpt2"]
    run = f"python benchmarks/train_families.py --np {args.np}" + (f" --steps {args.steps}" if args.steps else "")
    text = "\n".join(lines) + (f"\n\nllama's validation loss falls {'at least as far as' if ok else 'less than'} "
                               f"gpt2's in the same steps ({fall['llama']:.4f} against {fall['gpt2']:.4f}). Run: "
                               f"`{run}`.\n")
    write_results("train_families.md", text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
