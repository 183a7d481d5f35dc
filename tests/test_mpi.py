"""Runs the files of tests/mpi under `mpiexec -n 8`, all in one launch (inside an outer `timeout`), and the MPI
command-line checks.

Eight ranks share the machine's cores; every rank uses one BLAS thread. A test stuck in a blocking MPI call (a
rank that raised while the others wait in a collective) is ended by pytest-timeout's thread method, which dumps
every thread's stack and exits the process, so that mpiexec ends the other ranks; the default signal method
cannot interrupt a call that never returns to Python. The outer `timeout` is the last resort.
"""
import glob
import os
import re
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


# MPICH: a rank that waits inside MPI gives its core away now and then (eight ranks share two cores here, and the
# busy-waiting ones would slow the working ones; about 15% faster for the MPI tests); other MPIs ignore the name
YIELD = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


def mpi_env(**extra):
    return {**YIELD, **os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            **extra}


def run_mpi(n, args, timeout=TIMEOUT_S, env=None):
    cmd = ["timeout", "-k", "10", str(timeout), mpiexec(), "-n", str(n), sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env or mpi_env())


# the files in one group, one mpiexec (starting eight ranks and collecting costs ~3 s a launch on two cores; one per
# file was ~45 s of the suite, three groups ~6 s more than one)
GROUPS = [MPI_FILES]


@pytest.mark.timeout(2 * TIMEOUT_S + 60)                 # (the outer timeout of mpiexec ends first)
@pytest.mark.parametrize("paths", GROUPS, ids=["all"])
def test_mpi_files(paths, tmp_path):
    r = run_mpi(8, ["tests/mpi_run.py", *paths, "--with-mpi", "-q", "-s", "-p", "no:cacheprovider",
                    "--timeout=180", "--timeout-method=thread"], env=mpi_env(HSGD_MPI_LOGDIR=str(tmp_path)),
                timeout=2 * TIMEOUT_S)
    print(r.stdout[-30000:])
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
    assert "4 ranks = dp 2 x pp 1 x cp 1 x tp 2" in r.stdout
    assert "tp_comm groups: [[0, 1], [2, 3]]" in r.stdout and "dp_comm groups: [[0, 2], [1, 3]]" in r.stdout


TINY = ["--steps", "3", "--d-model", "16", "--n-heads", "4", "--n-layers", "1", "--d-ff", "16", "--seq-len", "8",
        "--batch-size", "8", "--eval-batches", "1", "--sample-bytes", "0", "--log-interval", "1"]

# Commands that end before any work, all in one launch of 8 ranks: every rank calls each case's main(argv) in turn
# (what `python -m` runs) with its stdout and stderr captured, and rank 0 prints, per case, every rank's (exit code,
# stdout, stderr) as JSON. A refusal comes before any training or communication of the job, so the cases cannot
# disturb each other; one start-up instead of one per case. (The refusals through `python -m` itself, with
# mpiexec's exit code: test_grid_size_error_is_reported_once_and_every_rank_exits_2, the --dump-step ones below,
# tests/test_faults.py's checkpoint refusals.)
MAINS_IN_ONE_LAUNCH = """
import contextlib, importlib, io, json, sys
from mpi4py import MPI
out = []
for module, argv in json.load(open(sys.argv[1])):
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            code = importlib.import_module(module).main(argv)
        except SystemExit as x:                          # (argparse's --help outside launch.run)
            code = x.code if isinstance(x.code, int) else 0
    out.append(MPI.COMM_WORLD.gather((code, o.getvalue(), e.getvalue()), root=0))
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(out))
"""

REFUSED = [
    (["--tp", "3"], "dp*pp*tp = 2*1*3 = 6 does not match the 8 ranks"),
    (["--tp", "8"], "n_heads=4 is not divisible by tp=8"),
    (["--batch-size", "10"], "batch_size=10 does not split into dp=4 groups x micro_batches=1"),
    (["--micro-batches", "3"], "does not split into dp=4 groups x micro_batches=3"),
    (["--steps", "0"], "steps=0 must be a positive integer"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--optimizer", "adam"], "invalid choice: 'adam'"),
    (["--inject-fault", "x"], "inject_fault='x' must look like RANK:STEP"),
    (["--pp", "2"], "n_layers=1 cannot be split into pp=2 stages"),
    (["--pp", "2", "--n-layers", "2", "--pp-split", "2,1"], "pp_split=2,1 must give each of the pp=2 stages"),
    (["--pp", "3"], "dp*pp*tp = 2*3*1 = 6 does not match the 8 ranks"),
    (["--cp", "8"], "seq_len=8 does not cut into 2*cp = 16 equal chunks"),     # more: test_settings.py
    (["--zero", "1", "--dp-overlap"], "--dp-overlap and --zero 1 cannot be combined"),
    (["--config", "{bad}"], "has unknown keys ['learning_rate']"),
    (["--config", "{broken}"], "cannot be read"),
    (["--data", "/nonexistent/corpus.txt"], "does not exist"),                  # (last: it sets the threads)
]


@pytest.fixture(scope="module")
def one_launch(tmp_path_factory):
    """Every case of REFUSED (hsgd.train with TINY and its flags), hsgd.train --help and hsgd.grid --tp 2 --cp 2,
    run in one launch of 8 ranks: {case: [(exit code, stdout, stderr) of each rank]}."""
    import json
    folder = tmp_path_factory.mktemp("one-launch")
    (folder / "bad.toml").write_text("steps = 3\nlearning_rate = 0.1\n")
    (folder / "broken.toml").write_text("steps = = 3\n")
    files = {"bad": folder / "bad.toml", "broken": folder / "broken.toml"}
    cases = {tuple(flags): ("hsgd.train", TINY + [f.format(**files) for f in flags]) for flags, _ in REFUSED}
    cases["help"] = ("hsgd.train", ["--help"])
    for module in ENTRY_POINTS:
        cases[module] = (module, ["--help"])
    cases["grid"] = ("hsgd.grid.__main__", ["--tp", "2", "--cp", "2"])
    (folder / "cases.json").write_text(json.dumps(list(cases.values())))
    r = run_mpi(8, ["-c", MAINS_IN_ONE_LAUNCH, str(folder / "cases.json")], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(zip(cases, json.loads(r.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize("flags, words", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_invalid_flags_exit_2_with_one_message(flags, words, one_launch):
    """Every rank ends with exit code 2 before any work, and the job says why in one line, once (rank 0)."""
    ranks = one_launch[tuple(flags)]
    err = "".join(e for _, _, e in ranks)
    print(f"{flags} -> exit codes {[c for c, _, _ in ranks]}: {err.strip()}")
    assert [c for c, _, _ in ranks] == [2] * 8
    assert err.count("hsgd: error:") == 1 and words in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_help_describes_the_dp_pp_tp_grid_once(one_launch):
    ranks = one_launch["help"]
    out = "".join(o for _, o, _ in ranks)
    print(out[:600])
    text = " ".join(out.split())
    assert [c for c, _, _ in ranks] == [0] * 8 and out.count("usage: mpirun -n P python -m hsgd.train") == 1
    assert "P = dp x pp x cp x tp MPI ranks" in text and "--micro-batches" in text and "dp x tp " not in text


ENTRY_POINTS = ["hsgd.verify", "hsgd.schedule", "hsgd.sample", "hsgd.grid.__main__", "hsgd.checkpoint.__main__",
                "hsgd.plan.__main__", "hsgd.crosscheck.__main__"]


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_entry_point_explains_itself(module, one_launch):
    """--help of every command (hsgd.train's: above), started on 8 ranks: exit 0 on every rank, rank 0 prints the
    usage and what the command does (the one-process tools print it on every rank)."""
    ranks = one_launch[module]
    print(ranks[0][1][:400])
    assert [c for c, _, _ in ranks] == [0] * 8
    assert ranks[0][1].startswith("usage:") and len(ranks[0][1].splitlines()) > 5 and not ranks[0][2]


def test_grid_places_cp_next_to_tp(one_launch):
    ranks = one_launch["grid"]
    out = ranks[0][1]
    print(out)
    assert [c for c, _, _ in ranks] == [0] * 8 and "8 ranks = dp 2 x pp 1 x cp 2 x tp 2" in out
    assert "cp_comm groups: [[0, 2], [1, 3], [4, 6], [5, 7]]" in out
    assert "dp_comm groups: [[0, 2, 4, 6], [1, 3, 5, 7]]" in out                   # every rank of a shard


def test_toml_config_is_read_and_flags_win(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('steps = 2\noptimizer = "adamw"\nlr = 0.002\nd_model = 16\nn_heads = 4\n')
    r = run_mpi(4, ["-m", "hsgd.train", *TINY[2:], "--config", str(cfg), "--lr", "0.004"], timeout=120)
    print(r.stdout[-2000:])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "optim: adamw lr=0.004" in r.stdout and "step 2/2" in r.stdout


def test_an_exception_on_one_rank_ends_the_job_quickly():
    import time
    t0 = time.perf_counter()
    r = run_mpi(4, ["-m", "hsgd.train", *TINY, "--steps", "50", "--inject-fault", "3:2"], timeout=60)
    elapsed = time.perf_counter() - t0
    print(f"exit {r.returncode} after {elapsed:.1f} s\n{r.stderr[-1500:]}")
    assert r.returncode not in (0, 124, 137) and elapsed < 30
    assert "[rank 3] RuntimeError: fault injected on rank 3 at step 2" in r.stderr
    assert "[rank 3] Traceback (most recent call last):" in r.stderr


def test_a_late_failure_on_rank_0_always_reaches_stderr(tmp_path):
    """Rank 0 fails after the other ranks are done (in the end-of-run work only it does): the others must not
    finalize and leave, or the launcher may tear down rank 0's output before its traceback is out (an empty stderr
    in some runs). launch.run holds them in a Barrier until rank 0's abort ends them."""
    script = tmp_path / "late.py"
    script.write_text("import sys, time\nfrom mpi4py import MPI\nfrom hsgd.grid import launch\n\n\ndef main():\n"
                      "    if MPI.COMM_WORLD.Get_rank() == 0:\n        time.sleep(0.5)\n"
                      "        raise RuntimeError('late failure on rank 0')\n    return 0\n\n\n"
                      "sys.exit(launch.run(main))\n")
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(3) as pool:              # three jobs at a time: the race only gets more chances
        runs = list(pool.map(lambda _: run_mpi(3, [str(script)], timeout=60), range(6)))
    seen = [r.returncode != 0 and "late failure on rank 0" in r.stderr for r in runs]
    print(f"the traceback reached stderr in {sum(seen)} of {len(seen)} runs")
    assert all(seen)


def test_hybrid_training_run_prints_everything(tmp_path):
    """One run of the default layout with every report on: the header and layout, the progress and validation lines,
    the sample, the communication table (measured bytes == formula), --log-json records, and with --dp-overlap its
    --trace (a track per rank: compute, comm, async spans) and --plot pictures."""
    import json
    log, trace, plots = tmp_path / "steps.jsonl", tmp_path / "trace.json", tmp_path / "plots"
    r = run_mpi(8, ["-m", "hsgd.train", *TINY[:-6], "--steps", "6", "--eval-interval", "3", "--sample-bytes", "20",
                    "--log-json", str(log), "--eval-batches", "1", "--dp-overlap", "--trace", str(trace),
                    "--plot", str(plots)], timeout=120)
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for words in ("8 ranks = dp 4 x pp 1 x tp 2 (megatron)", "rank   dp   pp   cp   tp  host", "step 6/6 | loss",
                  "= compute", "val loss", "at step 3", "communication per step on each rank", "sample:",
                  "dp exchange:", "memory per rank: parameters"):
        assert words in out, words
    assert "<- differs" not in out                                 # measured bytes == formula on every line
    traffic = re.findall(r"dp traffic ([\d.]+) Psi' per step \(formula ([\d.]+);", out)
    assert traffic and all(a == b for a, b in traffic), traffic
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]                      # the step records (the others: val_loss)
    assert [x["step"] for x in steps] == list(range(1, 7)) and all(x["loss"] > 0 for x in steps)
    assert [(x["step"], x["val_loss"] > 0) for x in lines if "val_loss" in x] == [(0, True), (3, True), (6, True)]
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(8))                       # a process (track group) per rank
    assert {e["tid"] for e in spans} == {0, 1, 2}                           # compute, comm, async
    comms = [e for e in spans if e["tid"] in (1, 2)]
    assert comms and all({"comm", "bytes"} <= set(e["args"]) for e in comms)
    assert {e["name"] for e in spans} >= {"forward", "backward", "optimizer", "Allreduce", "Iallreduce", "step 2"}
    for png in ("loss.png", "timeline.png"):
        data = (plots / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_memory_flag_measures_every_category_next_to_its_formula(tmp_path):
    """hsgd.train --memory on 8 ranks (pp 2 x tp 2, ZeRO-3, full recomputation, 2 micro-batches): a table per group
    of ranks with every category's measured peak next to the formula, all equal within 5%, and memory.png; the
    communication table of the same run (measured bytes == formula, ZeRO-3's dp traffic)."""
    r = run_mpi(8, ["-m", "hsgd.train", *TINY, "--n-layers", "2", "--pp", "2", "--tp", "2", "--micro-batches", "2",
                    "--zero", "3", "--recompute", "full", "--memory", "--plot", str(tmp_path)], timeout=180)
    out = r.stdout
    print(out[-2500:])
    assert r.returncode == 0, r.stderr[-3000:]
    ratios = [float(x) for x in re.findall(r"measured/formula +([\d.]+)", out)]
    cats = set(re.findall(r"^ +(params|grads|optimizer|activations|comm|recompute) ", out, re.M))
    assert "memory by category" in out and len(ratios) >= 12 and all(abs(x - 1) <= 0.05 for x in ratios), ratios
    assert cats == {"params", "grads", "optimizer", "activations", "comm", "recompute"}, cats
    assert "<- differs" not in out and "communication per step on each rank" in out and "dp exchange:" in out
    assert "memory per rank: parameters" in out
    traffic = re.findall(r"dp traffic ([\d.]+) Psi' per step \(formula ([\d.]+);", out)   # ZeRO's units
    assert traffic and all(a == b for a, b in traffic), traffic
    assert (tmp_path / "memory.png").stat().st_size > 0


def test_memory_flag_on_one_threaded_process_counts_the_measured_step():
    """--memory measures an unthreaded step; the communication formula must count that step's calls (the threaded
    steps around it split each micro-batch over 2 threads, which doubles the tp calls: the table used to print
    "8 calls | 16 calls <- differs" on a single process)."""
    r = run_mpi(1, ["-m", "hsgd.train", *TINY, "--threads", "2", "--memory"], timeout=120)
    out = r.stdout
    print(out[-2500:])
    assert r.returncode == 0, r.stderr[-3000:]
    calls = re.findall(r"^ +(dp|tp) +Allreduce +(\d+) calls .*\| +(\d+) calls", out, re.M)
    ratios = [float(x) for x in re.findall(r"measured/formula +([\d.]+)", out)]
    assert len(calls) == 2 and all(a == b for _, a, b in calls) and "<- differs" not in out, calls
    assert len(ratios) >= 5 and all(abs(x - 1) <= 0.05 for x in ratios), ratios



# (--dp-overlap: test_hybrid_training_run_prints_everything; --zero 3 with pp 2: the --memory run above.) Options
# that are not exchanges ride along with one that is; layouts that need no more than dp 2 x tp 2 run on 4 ranks.
@pytest.mark.parametrize("n, flags", [(4, ["--zero", "1", "--straggler", "3:5"]),
                                      (4, ["--zero", "2", "--optimizer", "adamw"]),
                                      (8, ["--hierarchical", "--ranks-per-node", "2"]),
                                      (4, ["--dp-staleness", "1", "--tp-scheme", "sequence"]),
                                      (8, ["--cp", "2", "--tp", "2", "--zero", "1"])])
def test_every_communication_option_trains_and_matches_its_formula(n, flags):
    r = run_mpi(n, ["-m", "hsgd.train", *TINY, *flags], timeout=120)
    out = r.stdout
    print(out[-1500:])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "communication per step on each rank" in out and "<- differs" not in out and "dp exchange:" in out
    assert "memory per rank: parameters" in out
    traffic = re.findall(r"dp traffic ([\d.]+) Psi' per step \(formula ([\d.]+);", out)   # ZeRO's units
    assert traffic and all(a == b for a, b in traffic), traffic


def test_an_expert_parallel_run_reports_its_routing(tmp_path):
    """--moe-experts 4 --ep 2 beside tp 2 (dp 4), in bfloat16 (the experts' products are not rounded at points of
    their own yet): the run trains, its bytes equal their formulas (the all-to-all's from the measured step's
    routing: measured/formula 1.000), the end of the run reports each MoE block's load per expert and drops, and
    --plot draws the load per expert over the steps; --check-replicas compares each expert over its own replicas."""
    r = run_mpi(8, ["-m", "hsgd.train", *TINY, "--moe-experts", "4", "--moe-capacity-factor", "1.0", "--ep", "2",
                    "--tp", "2", "--dtype", "bfloat16", "--plot", str(tmp_path), "--check-replicas", "1"], timeout=120)
    out = r.stdout
    print(out[-1500:])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "<- differs" not in out and re.search(r"^ +ep +Alltoallv +4 calls", out, re.M)
    assert "experts: 4 per MoE block, top-2, 3 steps, capacity factor 1" in out
    assert re.search(r"h\.0\.moe: token-slots per expert min \d+ max \d+ .*dropped \d+ of 384", out)
    assert "all-to-all on ep_comm, step 2: measured/formula = 1.000" in out
    assert (tmp_path / "load.png").exists()


def test_float16_training_reports_its_loss_scale(tmp_path):
    """--dtype float16: the progress line and every --log-json record carry the loss scale and the updates it
    skipped; bfloat16 has no loss scale (its range is float32's)."""
    import json
    for dtype in ("float16", "bfloat16"):
        log = tmp_path / f"{dtype}.jsonl"
        r = run_mpi(2, ["-m", "hsgd.train", *TINY, "--tp", "2", "--dtype", dtype, "--log-json", str(log)], timeout=60)
        print(r.stdout[-600:])
        assert r.returncode == 0, r.stderr[-2000:]
        steps = [rec for rec in map(json.loads, log.read_text().splitlines()) if "loss" in rec]
        if dtype == "float16":
            assert "| loss scale 2^16, 0 skipped" in r.stdout
            assert [(x["loss_scale"], x["scale_skips"]) for x in steps] == [(65536.0, 0)] * 3
        else:
            assert "loss scale" not in r.stdout and not any("loss_scale" in x for x in steps)


@pytest.mark.parametrize("flags", [["--pp", "2", "--n-layers", "4", "--micro-batches", "2", "--schedule",
                                    "interleaved", "--virtual-stages", "2"],
                                   ["--pp", "4", "--tp", "1", "--n-layers", "4", "--micro-batches", "8", "--batch-size",
                                    "16", "--schedule", "zb-h1", "--dp-overlap"]], ids=["interleaved", "zb-h1"])
def test_pipeline_training_reports_its_schedule(flags):
    """The end-of-run schedule report of the schedules beyond GPipe and 1F1B (zb-h1 with --dp-overlap: the
    buckets start after each chunk's last W)."""
    r = run_mpi(8, ["-m", "hsgd.train", *TINY, *flags], timeout=120)
    out = r.stdout
    print(out[-2500:])
    assert r.returncode == 0, r.stderr[-3000:]
    for words in ("pipeline schedule of the last step, measured", "stage 0 |", "bubble fraction: measured",
                  "micro-batches held at once per stage", "of stage 1", "equal-cost bubble"):
        assert words in out, words
    assert ("(p-1)/(vm+p-1) = 0.200" if "interleaved" in flags else "(p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)) = 0.111") \
        in out
    assert "<- differs" not in out


@pytest.mark.parametrize("n, flags", [(4, ["--tp", "2", "--tp-scheme", "sequence", "--schedule", "dualpipev"]),
                                      (8, ["--tp", "2", "--cp", "2", "--cp-scheme", "allgather", "--schedule",
                                           "dualpipe"])])
def test_the_schedule_lab_runs_and_measures(n, flags):
    """python -m hsgd.schedule --run: dualpipev executed on pp 2 x tp 2 (sequence scheme: the V's turn keeps a
    T-shard of the activation) and dualpipe on pp 2 x cp 2 x tp 2 (the all-gather attention; the gradients to the
    twin stage), with selective recomputation, measured next to their predictions: the pairs and activation bytes
    held equal them (a pair looked at after its F and after its B), the bytes sent on pp_comm equal the formula
    (chapter 12 measures the other schedules with the megatron scheme)."""
    r = run_mpi(n, ["-m", "hsgd.schedule", "--pp", "2", *flags, "--recompute", "selective", "--micro-batches", "4",
                    "--batch-size", "4", "--seq-len", "16", "--d-model", "32", "--n-heads", "4",
                    "--d-ff", "64", "--run"], timeout=120)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stderr[-3000:]
    sent = [line for line in r.stdout.splitlines() if line.startswith("pp_comm sent per step: measured")]
    assert sent and sent[0].split("measured ")[1].split(" | formula ") == [sent[0].split(" | formula ")[1]] * 2
    for words in ("pairs measured", "activation bytes measured"):                 # (the same lists)
        line = [line for line in r.stdout.splitlines() if words in line][0]
        assert line.split("measured ")[1].split(" | predicted ") == [line.split("predicted ")[1]] * 2, line
    assert "bubble: measured" in r.stdout and "activation bytes measured" in r.stdout


def test_train_dumps_a_step_that_crosscheck_passes_and_refuses_a_bad_dump_step(tmp_path):
    """hsgd.train --dump-step 2 DIR on 4 ranks (tp 2 x dp 2, ZeRO 1) writes step 2 and trains on; python -m
    hsgd.crosscheck DIR passes it. Resumed from its checkpoint: dump_step = [3, DIR] in a --config file dumps step 3
    (the parameters loaded from the checkpoint), which passes too; --dump-step 1 is refused (step 1 is never run),
    as are a step past the last and --dp-staleness 1: one line, exit 2."""
    small = ["--batch-size", "8", "--seq-len", "16", "--d-model", "32", "--n-layers", "2", "--n-heads", "4",
             "--d-ff", "64", "--dtype", "float64", "--sample-bytes", "0", "--eval-batches", "1"]
    ck = ["--save-dir", str(tmp_path / "ck"), "--tp", "2", "--zero", "1"]

    def crosscheck(dump):
        c = subprocess.run([sys.executable, "-m", "hsgd.crosscheck", str(dump)], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
        print(c.stdout[-800:])
        assert c.returncode == 0 and "PASS: the loss and all 37 gradients" in c.stdout

    r = run_mpi(4, ["-m", "hsgd.train", *small, *ck, "--steps", "2", "--dump-step", "2", str(tmp_path / "d2")],
                timeout=120)
    print(r.stdout[-1500:], r.stderr[-2000:])
    assert r.returncode == 0 and f"dump of step 2: {tmp_path / 'd2'}" in r.stdout and "step 2/2" in r.stdout
    crosscheck(tmp_path / "d2")
    (tmp_path / "c.toml").write_text(f'dump_step = [3, "{tmp_path / "d3"}"]\n')
    r = run_mpi(4, ["-m", "hsgd.train", *small, *ck, "--steps", "3", "--resume", "auto", "--config",
                    str(tmp_path / "c.toml")], timeout=120)
    print(r.stdout[-1500:], r.stderr[-2000:])
    assert r.returncode == 0 and "resumed from" in r.stdout and "dump of step 3" in r.stdout
    crosscheck(tmp_path / "d3")
    for n, extra, words in ((4, [*ck, "--steps", "4", "--resume", "auto", "--dump-step", "1", str(tmp_path / "x")],
                             "the run resumes after step 3, so step 1 is never run"),
                            (2, ["--steps", "2", "--dump-step", "3", str(tmp_path / "x")],
                             "step 3 is not a step of the run (1..2)"),
                            (2, ["--steps", "2", "--dump-step", "1", str(tmp_path / "x"), "--dp-staleness", "1"],
                             "dump a run with --dp-staleness 0")):
        r = run_mpi(n, ["-m", "hsgd.train", *small, *extra], timeout=60)
        print(r.stderr)
        assert r.returncode == 2 and r.stderr.count("hsgd: error:") == 1 and words in r.stderr
