"""Experts split over ranks (--ep) against data parallelism alone, at equal active parameters: `mpirun -n NP python -m
hsgd.train` on the default corpus and model widths (C 128, F 512, 4 blocks, tp 2 x dp 4 on 8 ranks), three ways:

    dense      the default job: every block's MLP (the active parameters' baseline)
    ep 1       8 experts of the same width F in every block, top-1 (each token runs one MLP of the dense one's size:
               the same active parameters, 8 times the MLP parameters), every dp rank holding all 8 (dp alone)
    ep 4       the same model, its experts split over the 4 dp ranks (2 each), tokens sent by all-to-all

    python benchmarks/bench_experts.py [--np 8] [--steps 200] [--rounds 2] [--timing-steps 30]

Each is trained --steps steps (validation loss before and after); the step time is the best of --rounds short runs
of --timing-steps steps, ep 1 and ep 4 alternating (timings wander 5-15% on a shared machine); the bytes per step on
every communicator and the parameters per rank are what each run prints for its measured step. Writes
benchmarks/results/bench_experts.md and prints it. The claims checked (exit 1 otherwise): ep 4 holds fewer parameters
per rank than ep 1, its measured bytes equal their formulas (the run prints "<- differs" otherwise), and the losses
of ep 1 and ep 4 fall (the same model; their float32 sums run in other orders and routing decisions near a tie may
differ, so they are not compared for equality).
"""
import argparse
import re
import sys

from train_families import run_train, write_results

FALL = re.compile(r"val loss ([0-9.]+) -> ([0-9.]+) after (\d+) steps in \S+ \(([0-9,]+) tok/s\)")
PARAMS = re.compile(r"model: ([0-9,]+) parameters.*?; ([0-9,]+) on each rank")
COMM = re.compile(r"^  (\w+) +(\w+) +(\d+) calls +([0-9.]+ [KMG]?i?B) \|", re.M)
RUNS = {"dense": [], "ep 1": ["--moe-experts", "8", "--moe-top-k", "1", "--moe-gates", "probabilities"],
        "ep 4": ["--moe-experts", "8", "--moe-top-k", "1", "--moe-gates", "probabilities", "--ep", "4"]}


def train(flags, n, steps):
    """(stdout of hsgd.train with `flags` on n ranks for `steps` steps, its parsed numbers)."""
    r = run_train(n, ["--steps", str(steps), *flags])
    fall, params = FALL.search(r.stdout), PARAMS.search(r.stdout)
    if r.returncode != 0 or not fall or not params:
        sys.exit(f"hsgd.train {' '.join(flags)} failed (exit {r.returncode}): {r.stderr[-2000:]}")
    return dict(before=float(fall.group(1)), after=float(fall.group(2)), tok_s=int(fall.group(4).replace(",", "")),
                total=int(params.group(1).replace(",", "")), per_rank=int(params.group(2).replace(",", "")),
                comm={f"{c} {op}": f"{calls} x {size}" for c, op, calls, size in COMM.findall(r.stdout)},
                differs="<- differs" in r.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=8, help="ranks (8, as make train)")
    p.add_argument("--steps", type=int, default=200, help="steps of the loss runs")
    p.add_argument("--rounds", type=int, default=2, help="timing rounds, ep 1 and ep 4 alternating")
    p.add_argument("--timing-steps", type=int, default=30, help="steps of each timing run")
    args = p.parse_args()
    runs = {name: train(flags, args.np, args.steps) for name, flags in RUNS.items()}
    best = {name: 0 for name in RUNS}
    for _ in range(args.rounds):
        for name in ("ep 1", "ep 4", "dense"):
            best[name] = max(best[name], train(RUNS[name], args.np, args.timing_steps)["tok_s"])
    lines = ["| run | parameters | on each rank | val loss before | after | tokens/s (best of rounds) |",
             "|---|---|---|---|---|---|"]
    for name, r in runs.items():
        lines.append(f"| {name} | {r['total']:,} | {r['per_rank']:,} | {r['before']:.4f} | {r['after']:.4f} | "
                     f"{best[name]:,} |")
    keys = sorted({k for r in runs.values() for k in r["comm"]})
    lines += ["", "bytes per step on each rank (rank 0, the measured step), as each run prints them:", "",
              "| communicator, operation | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    lines += [f"| {k} | " + " | ".join(r["comm"].get(k, "") for r in runs.values()) + " |" for k in keys]
    ok = (runs["ep 4"]["per_rank"] < runs["ep 1"]["per_rank"] and not any(r["differs"] for r in runs.values())
          and all(runs[n]["after"] < runs[n]["before"] for n in ("ep 1", "ep 4")))
    run = f"python benchmarks/bench_experts.py --np {args.np} --steps {args.steps} --rounds {args.rounds} " \
          f"--timing-steps {args.timing_steps}"
    text = "\n".join(lines) + (f"\n\nep 4 holds {runs['ep 4']['per_rank']:,} parameters per rank against ep 1's "
                               f"{runs['ep 1']['per_rank']:,}; bytes equal their formulas in every run: "
                               f"{not any(r['differs'] for r in runs.values())}; claims {'hold' if ok else 'FAIL'}. "
                               f"Run: `{run}`.\n")
    write_results("bench_experts.md", text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
