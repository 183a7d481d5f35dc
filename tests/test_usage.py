"""Every command's usage errors through the one parser (hsgd.cli): one line, exit code 2, on every rank; --help
full; output paths proved writable (created and removed) before any work.

The table COMMANDS names every command (and the planner's validation against the paper): its main, its prog, a bad
value and the first line it must give. For each command: an unknown flag, a bad value and a flag carrying a newline
and an escape code end with exactly one line on stderr, `hsgd: error: ... (see PROG --help)`, and exit code 2;
--help prints the full help and exits 0. OUTPUTS lists every output path of every command (--json, --plot,
--log-json, --trace, --save-dir, the dump folder, the export file; the calibration's --out on 2 ranks), each given
paths where nothing can be created although os.access() may say yes (a folder that is a file, a name longer than 255
bytes, a path in /proc): one line, exit 2, nothing on stdout (no work began) and nothing left in the folder. All
cases run in one Python process (each command's main(argv) in turn, what `python -m` runs), and the MPI ones in one
launch of 2 ranks.
"""
import json
import os
import subprocess
import sys

import pytest

from .test_mpi import ROOT, mpi_env, run_mpi

# name: (module whose main(argv) is the command, its prog, argv of a bad value, the start of its message)
COMMANDS = {
    "train": ("hsgd.train", "mpirun -n P python -m hsgd.train", ["--steps", "many"],
              "argument --steps: invalid int value: 'many'"),
    "verify": ("hsgd.verify", "mpirun -n P python -m hsgd.verify", ["--seeds", "x"],
               "argument --seeds: invalid int value: 'x'"),
    "plan": ("hsgd.plan.__main__", "python -m hsgd.plan", ["--devices", "0"],
             "argument --devices: --devices 0: give an integer of at least 1"),
    "plan.calibrate": ("hsgd.plan.calibrate", "mpirun -n P python -m hsgd.plan.calibrate", ["--out"],
                       "argument --out: expected one argument"),
    "plan.validate": ("hsgd.plan.validate", "python -m hsgd.plan.validate", ["12"],
                      "argument FIT: invalid choice: '12'"),
    "crosscheck": ("hsgd.crosscheck.__main__", "python -m hsgd.crosscheck", ["DIR", "--draws", "x"],
                   "argument --draws: invalid int value: 'x'"),
    "schedule": ("hsgd.schedule", "python -m hsgd.schedule", ["--pp", "two"],
                 "argument --pp: invalid int value: 'two'"),
    "sample": ("hsgd.sample", "python -m hsgd.sample", ["DIR", "--top-k", "x"],
               "argument --top-k: invalid int value: 'x'"),
    "checkpoint": ("hsgd.checkpoint.__main__", "python -m hsgd.checkpoint", ["frobnicate"],
                   "argument {export,info}: invalid choice: 'frobnicate'"),
    "grid": ("hsgd.grid.__main__", "mpirun -n P python -m hsgd.grid", ["--tp", "x"],
             "argument --tp: invalid int value: 'x'"),
}
# what a command needs before an unknown flag is the error argparse reports (its required arguments)
POSITIONAL = {"crosscheck": ["DIR"], "sample": ["DIR"], "checkpoint": ["info", "DIR"],
              "plan.calibrate": ["--out", "hw.toml"]}
ESCAPE = "--bogus\n\x1b[2J\x1b[32mPASS"                   # a newline and escape codes: a second line, a cleared screen
TINY = ["--steps", "1", "--d-model", "8", "--n-heads", "2", "--n-layers", "1", "--d-ff", "8", "--seq-len", "8",
        "--batch-size", "2", "--sample-bytes", "0", "--eval-batches", "1"]

# every output path of every command: (command, argv with {} for the path, folder or file, how the message names it)
OUTPUTS = [
    ("train", [*TINY, "--log-json", "{}"], "file", "--log-json file"),
    ("train", [*TINY, "--trace", "{}"], "file", "--trace file"),
    ("train", [*TINY, "--plot", "{}"], "folder", "--plot folder"),
    ("train", [*TINY, "--save-dir", "{}"], "folder", "--save-dir"),
    ("train", [*TINY, "--dump-step", "1", "{}"], "folder", "--dump-step folder"),
    ("verify", ["--dtype", "bfloat16", "--seeds", "1", "--plot", "{}"], "file", "--plot"),
    ("plan", ["--json", "{}"], "file", "--json"),
    ("crosscheck", ["no-such-dump", "--json", "{}"], "file", "--json"),
    ("schedule", ["--plot", "{}"], "file", "--plot"),
    ("checkpoint", ["export", "no-such-checkpoint", "{}"], "file", "export file"),
]

# sizes and numbers bounded before any work: (command, argv, the start of the one line)
BOUNDED = [
    ("schedule", ["--costs", "nan,1,1"], "costs='nan,1,1' must be three numbers F,B,W, each from 0.001 to 1000"),
    ("schedule", ["--costs", "1e308,1e308,1e308"], "costs='1e308,1e308,1e308' must be three numbers F,B,W"),
    ("schedule", ["--costs", "1,inf,1"], "costs='1,inf,1' must be three numbers F,B,W"),
    ("schedule", ["--costs", "1,1e-300,1"], "costs='1,1e-300,1' must be three numbers F,B,W"),
    ("schedule", ["--pp", "100000"], "--pp 100000 is more than the schedule lab draws (at most 64)"),
    ("schedule", ["--micro-batches", "100000000"], "--micro-batches 100000000 is more than the schedule lab draws"),
    ("schedule", ["--schedule", "interleaved", "--virtual-stages", "1000"], "--virtual-stages 1000 is more than"),
    ("schedule", ["--n-layers", "1000000000000"], "--n-layers 1000000000000 is more than the schedule lab draws"),
    ("verify", ["--dtype", "bfloat16", "--seeds", "1000000000"],
     "--seeds 1000000000 --loss-steps 0 --resume-after 0: give --seeds"),
    ("verify", ["--dtype", "bfloat16", "--loss-steps", "1000000000"],
     "--seeds 4 --loss-steps 1000000000 --resume-after 0: give --seeds from 1 to 64, --loss-steps and --resume-after "
     "from 0 to 10000"),
    ("verify", ["--dtype", "bfloat16", "--resume-after", "1000000000"],
     "--seeds 4 --loss-steps 0 --resume-after 1000000000: give --seeds from 1 to 64"),
    ("sample", ["DIR", "--bytes", "1000000000000"], "--bytes 1000000000000 is more than 1,048,576"),
]


# main(argv) of each case in turn, on every rank, stdout and stderr captured; rank 0 prints, per case, every rank's
# (exit code, stdout, stderr, seconds) as JSON
IN_ONE_PROCESS = """
import contextlib, importlib, io, json, sys, time
from mpi4py import MPI
out = []
for module, argv in json.load(open(sys.argv[1])):
    o, e, t0 = io.StringIO(), io.StringIO(), time.perf_counter()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            code = importlib.import_module(module).main(argv)
        except SystemExit as x:
            code = ["SystemExit", x.code]                # a command that exits instead of returning: a failure
        except Exception as x:
            code = ["raised", repr(x)]                   # one that raises: a failure
    out.append(MPI.COMM_WORLD.gather((code, o.getvalue(), e.getvalue(), time.perf_counter() - t0)))
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(out))
"""


def cases_of(tmp):
    """{case id: (module, argv, the folder whose listing must not change or None)}."""
    cases = {}
    for name, (module, prog, bad_value, _) in COMMANDS.items():
        cases[(name, "unknown flag")] = (module, [*POSITIONAL.get(name, []), "--bogus"], None)
        cases[(name, "bad value")] = (module, bad_value, None)
        cases[(name, "escape")] = (module, [*POSITIONAL.get(name, []), ESCAPE], None)
        cases[(name, "help")] = (module, ["--help"], None)
    for command, argv, words in BOUNDED:
        cases[(command, "bounded", " ".join(argv))] = (COMMANDS[command][0], argv, None)
    for command, argv, kind, what in OUTPUTS:
        for where, path in paths(tmp, kind).items():
            cases[(command, what, where)] = (COMMANDS[command][0], [a.replace("{}", path) for a in argv], tmp)
    return cases


def paths(tmp, kind):
    """Paths where a file (kind "file") or a folder cannot be created, though os.access() may say yes."""
    out = {"under a file": os.path.join(tmp, "a-file", "out" if kind == "folder" else "out.json"),
           "name of 300 bytes": os.path.join(tmp, "n" * 300)}
    if os.access("/proc", os.W_OK | os.X_OK):                           # access() says yes, mkdir/open say ENOENT
        out["in /proc"] = "/proc/hsgd-usage-test" + ("" if kind == "folder" else ".out")
    return out


def harness(cases, folder, ranks=None):
    """Run the cases in one process (ranks None) or one launch of `ranks`, from `folder` (where the list of cases is
    written): {case: [(exit code, stdout, stderr, seconds) per rank]}."""
    spec = folder / "cases.json"
    spec.write_text(json.dumps([(module, argv) for module, argv, _ in cases.values()]))
    if ranks is None:
        r = subprocess.run(["timeout", "-k", "5", "120", sys.executable, "-c", IN_ONE_PROCESS, str(spec)],
                           capture_output=True, text=True, cwd=folder, env=mpi_env(PYTHONPATH=ROOT))
    else:
        r = run_mpi(ranks, ["-c", IN_ONE_PROCESS, str(spec)], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(zip(cases, json.loads(r.stdout.strip().splitlines()[-1])))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("usage")
    (tmp / "a-file").write_text("x")
    cases = cases_of(str(tmp))
    before = sorted(os.listdir(tmp))
    results = harness(cases, tmp_path_factory.mktemp("usage-cases"))
    return results, before, sorted(os.listdir(tmp))


def one_line(code, out, err, expected_start):
    print(f"exit {code}: {err.strip()[:300]}")
    assert code == 2, (code, err)
    assert len(err.splitlines()) == 1 and err.startswith(expected_start), err
    assert "Traceback" not in err and "usage:" not in err


@pytest.mark.parametrize("name", COMMANDS)
def test_usage_errors_are_one_line_and_exit_2(runs, name):
    """An unknown flag and a bad value: `hsgd: error: <argparse's message> (see PROG --help)`, one line, exit 2 (not
    argparse's multi-line usage); a flag with a newline and escape codes in it is still one line, printed escaped."""
    results, _, _ = runs
    _, prog, _, words = COMMANDS[name]
    [(code, out, err, _)] = results[(name, "unknown flag")]
    one_line(code, out, err, f"hsgd: error: unrecognized arguments: --bogus (see {prog} --help)")
    [(code, out, err, _)] = results[(name, "bad value")]
    one_line(code, out, err, f"hsgd: error: {words}")
    assert err.rstrip().endswith(f"(see {prog} --help)"), err
    [(code, out, err, _)] = results[(name, "escape")]
    one_line(code, out, err, "hsgd: error: unrecognized arguments: --bogus\\n\\x1b[2J\\x1b[32mPASS")
    assert "\x1b" not in err


@pytest.mark.parametrize("name", COMMANDS)
def test_help_is_full_and_exits_0(runs, name):
    results, _, _ = runs
    _, prog, _, words = COMMANDS[name]
    [(code, out, err, _)] = results[(name, "help")]
    print(out[:300])
    assert code == 0 and not err and out.startswith(f"usage: {prog}") and len(out.splitlines()) > 6, (code, err)
    flag = words.split(":")[0].removeprefix("argument ")                # the flag of the bad value, described
    assert flag in out and "show this help message and exit" in out


@pytest.mark.parametrize("command, argv, words", BOUNDED, ids=[f"{c} {' '.join(a)}" for c, a, _ in BOUNDED])
def test_sizes_and_costs_are_bounded_before_any_work(runs, command, argv, words):
    """A NaN, infinite, subnormal or huge cost, a size beyond the command's stated maximum: one line, exit 2, at
    once (before: tracebacks, or a simulation or a run that does not end)."""
    results, _, _ = runs
    [(code, out, err, seconds)] = results[(command, "bounded", " ".join(argv))]
    one_line(code, out, err, f"hsgd: error: {words}")
    assert not out and seconds < 20, (out, seconds)


@pytest.mark.parametrize("output", OUTPUTS, ids=[f"{c} {w}" for c, _, _, w in OUTPUTS])
def test_unwritable_outputs_are_refused_before_any_work(runs, output):
    """Each output path where nothing can be created: one line naming the flag, exit 2, in seconds, nothing on
    stdout (the command did no work), nothing left behind."""
    results, before, after = runs
    command, _, _, what = output
    found = {case[2]: r for case, r in results.items() if case[:2] == (command, what)}
    assert len(found) >= 2
    for where, [(code, out, err, seconds)] in found.items():
        print(f"{where}: {seconds:.1f} s, {err.strip()[:200]}")
        one_line(code, out, err, f"hsgd: error: {what} ")
        assert not out and seconds < 20, (out, seconds)
    assert after == before and not os.path.exists("/proc/hsgd-usage-test")


# under mpiexec -n 2: every rank exits 2, and the job prints one line in all (rank 0's)
ON_TWO_RANKS = {
    "schedule --run unknown flag": ("hsgd.schedule", ["--run", "--bogus"], "unrecognized arguments: --bogus"),
    "schedule --run --costs nan": ("hsgd.schedule", ["--run", "--pp", "2", "--costs", "nan,1,1"],
                                   "costs='nan,1,1' must be three numbers F,B,W, each from 0.001 to 1000"),
    "schedule --run huge --costs": ("hsgd.schedule", ["--run", "--pp", "2", "--costs", "1e308,1,1"],
                                    "costs='1e308,1,1' must be three numbers"),
    "schedule --run --pp huge": ("hsgd.schedule", ["--run", "--pp", "1000000"],
                                 "--pp 1000000 is more than the schedule lab draws (at most 64)"),
    "schedule --run bad --plot": ("hsgd.schedule", ["--run", "--pp", "2", "--plot", "{tmp}/a-file/s.png"],
                                  "--plot '{tmp}/a-file/s.png': its folder '{tmp}/a-file' is a file"),
    "plan unknown flag": ("hsgd.plan.__main__", ["--bogus"], "unrecognized arguments: --bogus"),
    "train kv heads over tp": ("hsgd.train", [*TINY, "--d-model", "12", "--n-heads", "6", "--n-kv-heads", "3",
                                              "--d-ff", "8", "--tp", "2"],
                               "n_kv_heads=3 can be neither split over tp=2 (tp must divide it) nor replicated"),
    "train tied over pp": ("hsgd.train", [*TINY, "--arch", "llama", "--tied", "--n-layers", "2", "--pp", "2"],
                           "--tied needs wte in the embedding and in the LM head of one stage"),
    "crosscheck unknown flag": ("hsgd.crosscheck.__main__", ["DIR", "--bogus"], "unrecognized arguments: --bogus"),
    "calibrate bad --out": ("hsgd.plan.calibrate", ["--quick", "--out", "{tmp}/" + "n" * 300],
                            "calibration output '{tmp}/nnn"),
}


def test_usage_errors_end_every_rank_with_one_line(tmp_path):
    (tmp_path / "a-file").write_text("x")
    fill = lambda s: s.replace("{tmp}", str(tmp_path))
    cases = {k: (m, [fill(a) for a in argv], None) for k, (m, argv, _) in ON_TWO_RANKS.items()}
    results = harness(cases, tmp_path, ranks=2)
    for case, (_, _, words) in ON_TWO_RANKS.items():
        ranks = results[case]
        err = "".join(e for _, _, e, _ in ranks)
        print(f"{case}: exit codes {[c for c, _, _, _ in ranks]}, {max(s for *_, s in ranks):.1f} s: {err.strip()}")
        assert [c for c, _, _, _ in ranks] == [2, 2], case
        assert len(err.splitlines()) == 1 and err.startswith("hsgd: error:") and fill(words) in err, (case, err)
    assert sorted(os.listdir(tmp_path)) == ["a-file", "cases.json"]


def test_the_probe_creates_and_removes_or_opens_without_writing(tmp_path):
    """hsgd.files.writable_file / writable_dir: a file that is there is opened, not truncated nor touched; a new one
    and a new folder are created and removed (nothing left); a FIFO is refused at once (opening it to write would
    wait for a reader); where os.access() says yes but nothing can be created, refused."""
    from hsgd.errors import UsageError
    from hsgd.files import writable_dir, writable_file
    kept = tmp_path / "log.jsonl"
    kept.write_text("a record\n")
    stamp = os.stat(kept).st_mtime_ns
    writable_file(str(kept), "--log-json file", UsageError)
    assert kept.read_text() == "a record\n" and os.stat(kept).st_mtime_ns == stamp
    writable_file(str(tmp_path / "new.json"), "--json", UsageError)
    writable_dir(str(tmp_path / "a" / "b" / "c"), "--save-dir", UsageError)
    writable_dir(str(tmp_path), "--save-dir", UsageError)
    assert sorted(os.listdir(tmp_path)) == ["log.jsonl"]
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(UsageError, match="is not a regular file"):
        writable_file(str(tmp_path / "pipe"), "--json", UsageError)
    for check, path in ((writable_file, "/proc/hsgd-probe.json"), (writable_dir, "/proc/hsgd-probe"),
                        (writable_file, str(tmp_path / ("n" * 256))), (writable_dir, str(tmp_path / ("n" * 256)))):
        with pytest.raises(UsageError, match="cannot be written") as e:
            check(path, "--out", UsageError)
        print(f"os.access says {os.access(os.path.dirname(path), os.W_OK | os.X_OK)}: {e.value}")
    assert sorted(os.listdir(tmp_path)) == ["log.jsonl", "pipe"]
