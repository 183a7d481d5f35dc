"""Before and after: the hsgd / PyTorch step-time ratios of `make bench` (section a) for two commits, run in turn.

    python benchmarks/compare_commits.py OLD [NEW] [--runs 5] [--threads N] [--quick]

OLD and NEW are commits (NEW defaults to HEAD; "." is the working tree as it is). Each commit's files are
exported with `git archive` into a temporary folder, and each run is a fresh Python process started there with
PYTHONPATH pointing at it, so that `import hsgd` loads that commit's package and `import bench` that commit's
benchmarks/bench.py; the run calls its compare_with_torch(cfg, batch, rounds, block, threads) for every model of
its CONFIGS and prints the ratios. Whatever a commit's bench times as hsgd's step (an older one
serial.loss_and_grads(split=True), a newer one the trainer's HybridTrainer.step), it times against PyTorch on the
same machine in the same process, so the ratios of two commits compare even where the step changed.

The runs alternate, OLD NEW OLD NEW ..., so that both commits see the same drift of the machine. Printed: every
run's ratio of medians per model, then per model and commit the median over runs and the spread (largest minus
smallest, over the median): the run-to-run noise. A ratio counts as worse only if NEW's median exceeds OLD's by
more than that noise (the larger of the two commits' spreads). With --runs 1 there is no spread between runs, and
the noise shown is each run's own, median ratio against best ratio.

Takes about runs x 2 x (one bench section a) of time; --quick: 1 run each, 2 blocks per model (a check that it
works, not a measurement). Run it on an idle machine.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What one run does, in the exported tree of one commit (cwd = the tree, PYTHONPATH = the tree).
RUN_ONE = """
import json, sys
sys.path.insert(0, "benchmarks")
import bench                                            # imports that commit's hsgd first
import hsgd
rounds, threads, names = json.loads(sys.argv[1])
bench.set_cpu_threads(threads)
bench.tune_allocator()
out = {"hsgd": hsgd.__file__, "ratios": {}}
for name, (cfg, batch, default_rounds, block) in bench.CONFIGS.items():
    if names and name not in names:
        continue
    r = bench.compare_with_torch(cfg, batch, rounds or default_rounds, block, threads)
    out["ratios"][name] = {"ratio": r["hsgd_s"] / r["torch_s"], "ratio_best": r["hsgd_best_s"] / r["torch_best_s"],
                           "hsgd_s": r["hsgd_s"], "torch_s": r["torch_s"]}
print(json.dumps(out))
"""


def export(commit, into):
    """The files of `commit` under the folder `into` (git archive: the repository's index and work tree untouched);
    "." is the working tree itself. Returns the folder to run in."""
    if commit == ".":
        return ROOT
    sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", commit + "^{commit}"], capture_output=True,
                         text=True, check=True).stdout.strip()
    tree = os.path.join(into, sha[:12])
    os.makedirs(tree)
    archive = subprocess.Popen(["git", "-C", ROOT, "archive", sha], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", tree], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {commit} failed")
    return tree


def run_one(tree, rounds, threads, names):
    """One fresh process timing section a of the bench in `tree`: {model: {ratio, ratio_best, ...}}."""
    env = dict(os.environ, PYTHONPATH=tree)
    env.pop("OPENBLAS_THREAD_TIMEOUT", None)                  # each commit's hsgd sets its own
    r = subprocess.run([sys.executable, "-c", RUN_ONE, json.dumps([rounds, threads, names])], cwd=tree, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"the bench of {tree} failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if not os.path.realpath(out["hsgd"]).startswith(os.path.realpath(tree) + os.sep):
        raise SystemExit(f"the run in {tree} imported hsgd from {out['hsgd']}, not from its own tree")
    return out["ratios"]


def summary(ratios, say):
    """ratios: {commit: {model: [per run {ratio, ratio_best}]}} -> one verdict line per model. Returns True when
    no model's NEW ratio is worse than OLD's by more than the noise."""
    (old, by_old), (new, by_new) = ratios.items()
    ok = True
    say(f"\n| model | {old} ratio: median [runs] | spread | {new} ratio: median [runs] | spread | "
        f"{new} / {old} | noise | worse by more than the noise |")
    say("|---|---|---|---|---|---|---|---|")
    for model in by_new:
        if model not in by_old:
            say(f"| {model} | (not in {old}) | | | | | | |")
            continue
        cells, spreads, medians = [], [], []
        for runs in (by_old[model], by_new[model]):
            r = [x["ratio"] for x in runs]
            med = float(np.median(r))
            spread = (max(r) - min(r)) / med if len(r) > 1 else abs(runs[0]["ratio"] / runs[0]["ratio_best"] - 1)
            cells += [f"{med:.3f} [{', '.join(f'{x:.3f}' for x in r)}]", f"{100 * spread:.1f}%"]
            spreads.append(spread)
            medians.append(med)
        change, noise = medians[1] / medians[0] - 1, max(spreads)
        worse = change > noise
        ok = ok and not worse
        say(f"| {model} | {' | '.join(cells)} | {1 + change:.3f} | {100 * noise:.1f}% | {'YES' if worse else 'no'} |")
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", help="the commit before (e.g. 6d2bf5f)")
    p.add_argument("new", nargs="?", default="HEAD", help="the commit after (default HEAD; '.': the working tree)")
    p.add_argument("--runs", type=int, default=5, help="runs of each commit, alternating")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=0, help="blocks per model in a run (default: the bench's own)")
    p.add_argument("--model", action="append", default=[], help="only this model of CONFIGS (repeatable)")
    p.add_argument("--quick", action="store_true", help="1 run each, 2 blocks per model: a check that it works")
    a = p.parse_args(argv)
    runs, rounds = (1, 2) if a.quick else (a.runs, a.rounds)
    say = lambda s="": print(s, flush=True)
    with tempfile.TemporaryDirectory(prefix="hsgd-compare-") as tmp:
        trees = {c: export(c, tmp) for c in (a.old, a.new)}
        ratios = {c: {} for c in trees}
        for i in range(runs):
            for commit, tree in trees.items():                   # alternating: both see the same drift
                for model, r in run_one(tree, rounds, a.threads, a.model).items():
                    ratios[commit].setdefault(model, []).append(r)
                    say(f"run {i + 1} {commit:>8} {model}: hsgd / PyTorch {r['ratio']:.3f} (best "
                        f"{r['ratio_best']:.3f}; hsgd {r['hsgd_s'] * 1e3:.1f} ms, PyTorch {r['torch_s'] * 1e3:.1f} ms)")
    ok = summary(ratios, say)
    say("\nno ratio worse by more than the noise" if ok else "\nA RATIO IS WORSE BY MORE THAN THE NOISE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
