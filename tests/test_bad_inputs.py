"""The bad-input matrix (README, "Bad input"): every case gives one clear line on stderr and exit code 2, with no
traceback and nothing written. Run in one process (the same checks run on every rank of an MPI job, which
tests/test_mpi.py covers for the layouts)."""
import os
import subprocess
import sys

import pytest

BASE = ["--steps", "1", "--d-model", "8", "--n-heads", "2", "--n-layers", "1", "--d-ff", "8", "--seq-len", "8",
        "--batch-size", "2", "--sample-bytes", "0", "--eval-batches", "1"]

OUT_OF_RANGE = [
    (["--steps", "0"], "steps=0 must be a positive integer"),
    (["--batch-size", "0"], "batch_size=0 must be a positive integer"),
    (["--micro-batches", "0"], "micro_batches=0 must be a positive integer"),
    (["--grad-accum", "2"], "unrecognized arguments: --grad-accum 2"),          # renamed: --micro-batches
    (["--lr", "0"], "lr=0.0 must be > 0"),
    (["--momentum", "1"], "momentum=1.0 must be in [0, 1)"),
    (["--weight-decay", "-0.1"], "weight_decay=-0.1 must be >= 0"),
    (["--warmup", "-1"], "warmup=-1 must be an integer >= 0"),
    (["--clip", "-1"], "clip=-1.0 must be >= 0"),
    (["--eval-interval", "-5"], "eval_interval=-5 must be an integer >= 0"),
    (["--eval-batches", "0"], "eval_batches=0 must be a positive integer"),
    (["--log-interval", "0"], "log_interval=0 must be a positive integer"),
    (["--sample-bytes", "-1"], "sample_bytes=-1 must be an integer >= 0"),
    (["--threads", "0"], "threads=0 must be a positive integer"),
    (["--tp", "0"], "tp=0 must be a positive integer"),
    (["--dp", "0"], "dp=0 must be a positive integer"),
    (["--pp", "0"], "pp=0 must be a positive integer"),
    (["--seq-len", "0"], "seq_len=0 must be a positive integer"),
    (["--d-model", "0"], "d_model=0 must be a positive integer"),
    (["--n-layers", "0"], "n_layers=0 must be a positive integer"),
    (["--n-heads", "3"], "d_model=8 is not divisible by n_heads=3"),
    (["--arch", "llama", "--n-kv-heads", "3"], "n_heads=2 is not a multiple of n_kv_heads=3"),
    (["--arch", "llama", "--d-model", "6"], "head size d_model/n_heads = 6/2 = 3 is odd: rotary positions"),
    (["--arch", "mistral"], "argument --arch: invalid choice: 'mistral'"),
    (["--rope-theta", "0.5"], "rope_theta=0.5 must be a number above 1"),
    (["--d-ff", "0"], "d_ff=0 must be a positive integer"),
    (["--save-interval", "-1"], "save_interval=-1 must be an integer >= 0"),
    (["--keep", "0"], "keep=0 must be a positive integer"),
    (["--check-replicas", "-1"], "check_replicas=-1 must be an integer >= 0"),
    (["--ranks-per-node", "0"], "ranks_per_node=0 must be a positive integer"),
    (["--zero", "4"], "argument --zero: invalid choice: 4"),
    (["--recompute", "some"], "argument --recompute: invalid choice: 'some'"),
    (["--zero", "1", "--hierarchical"], "--zero 1 and --hierarchical cannot be combined"),
    (["--zero", "3", "--dp-overlap"], "--dp-overlap and --zero 3 cannot be combined"),
    (["--zero", "3", "--check-replicas", "1"], "--zero 3 keeps no replicas"),
    (["--zero", "3", "--inject-fault", "0:1:diverge"], "--zero 3 keeps no replicas"),
    (["--dp-staleness", "2"], "argument --dp-staleness: invalid choice: 2"),
    (["--on-nan", "ignore"], "argument --on-nan: invalid choice: 'ignore'"),
    (["--schedule", "zigzag"], "argument --schedule: invalid choice: 'zigzag'"),
    (["--tp-scheme", "rows"], "argument --tp-scheme: invalid choice: 'rows'"),
    (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["--straggler", "3"], "straggler='3' must look like RANK:MILLISECONDS"),
    (["--inject-fault", "1:2:explode"], "inject_fault='1:2:explode' must look like RANK:STEP"),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
    (["--unknown-flag"], "unrecognized arguments: --unknown-flag"),
    (["--dp-overlap", "--zero", "1"], "--dp-overlap and --zero 1 cannot be combined"),
    (["--resume", "auto"], "resume='auto' looks for the newest checkpoint in --save-dir"),
    (["--dp-staleness", "1", "--save-dir", "x"], "checkpoints do not hold the gradient in flight"),
    (["--seed", "-1"], "seed=-1 must be an integer >= 0"),
    (["--lr", "inf"], "lr=inf must be a finite number"),
    (["--weight-decay", "inf"], "weight_decay=inf must be a finite number"),
    (["--clip", "nan"], "clip=nan must be a finite number"),
    (["--momentum", "nan"], "momentum=nan must be a finite number"),
    (["--max-skips", "0"], "max_skips=0 must be a positive integer"),
    (["--step-timeout", "-1"], "step_timeout=-1.0 must be a finite number of seconds >= 0"),
    (["--step-timeout", "inf"], "step_timeout=inf must be a finite number of seconds >= 0"),
    (["--straggler", "0:\u00b2"], "must look like RANK:MILLISECONDS"),              # a superscript two
    (["--inject-fault", "\u0663:1"], "must look like RANK:STEP"),                     # an Arabic-Indic three
    (["--straggler", "0:99999999999"], "at most 60000 ms of sleep per step"),
    (["--straggler", "5:10"], "names rank 5, but the job has ranks 0..0"),
    (["--inject-fault", "1:1:kill"], "names rank 1, but the job has ranks 0..0"),
    (["--inject-fault", "0:7"], "names step 7, but the run has steps 1..1"),
    (["--inject-fault", "0:0"], "names step 0, but the run has steps 1..1"),
    (["--fp8-recipe", "rowwise"], "fp8_recipe is an FP8 setting, but --fp8 is off; add --fp8 hybrid"),
    (["--fp8-history", "4"], "fp8_history is an FP8 setting, but --fp8 is off"),
    (["--fp8", "hybrid", "--fp8-history", "0"], "fp8_history=0 must be a positive integer"),
    (["--fp8", "hybrid", "--fp8-recipe", "rowwise", "--fp8-history", "4"], "fp8_history is for --fp8-recipe delayed"),
    (["--fp8", "hybrid", "--fp8-recipe", "blockwise"], "fp8_block=128 does not divide d_model (8)"),
    (["--fp8", "hybrid", "--fp8-recipe", "blockwise", "--fp8-block", "0"], "fp8_block=0 must be a positive integer"),
    (["--fp8", "hybrid", "--fp8-accumulate", "14"], "fp8_accumulate='14' must be BITS:NC, e.g. 14:128"),
    (["--fp8", "hybrid", "--dtype", "bfloat16"], "--fp8 with --dtype bfloat16 is not built"),
    (["--fp8", "fp4"], "argument --fp8: invalid choice: 'fp4'"),
    (["--fp8-allgather"], "fp8_allgather is an FP8 setting, but --fp8 is off"),
    (["--fp8", "hybrid", "--fp8-allgather"], "--fp8-allgather casts the weights ZeRO-3 gathers, but this run has "
                                             "--zero 0"),
    (["--fp8", "hybrid", "--fp8-recipe", "rowwise", "--zero", "3", "--fp8-allgather"],
     "fp8_allgather sends each weight with one scale; --fp8-recipe rowwise"),
]
LAYOUT = [
    (["--tp", "2"], "dp*pp*tp = 1*1*2 = 2 does not match the 1 ranks"),
    (["--dp", "2"], "dp*pp*tp = 2*1*1 = 2 does not match the 1 ranks"),
    (["--pp", "2"], "dp*pp*tp = 1*2*1 = 2 does not match the 1 ranks"),
    (["--pp-split", "2"], "pp_split=2 must give each of the pp=1 stages at least one layer"),
    (["--batch-size", "3", "--micro-batches", "2"], "batch_size=3 does not split into dp=1 groups x micro_batches=2"),
    (["--schedule", "zb-v"], "schedule='zb-v' places two chunks on every stage, down the stages and back up (the V): "
                             "one stage would hand every activation to itself; use --pp 2 or more"),
    (["--schedule", "dualpipev", "--virtual-stages", "3"], "--schedule dualpipev holds 2 chunks per stage, not "
                                                            "--virtual-stages 3"),
]


def run(*flags, cwd=None):
    r = subprocess.run([sys.executable, "-m", "hsgd.train", *BASE, *flags], capture_output=True, text=True,
                       timeout=60, cwd=cwd)
    return r.returncode, r.stderr


# One Python process runs the cases in turn: hsgd.train's main(argv) in the case's folder, with stderr captured, then
# its exit code (the code `python -m hsgd.train` exits with). The refusals all come before any work or
# communication, so the cases cannot disturb each other; one start-up instead of one per case.
IN_ONE_PROCESS = """
import contextlib, io, json, os, sys
from hsgd.train import main
out = []
for flags, folder in json.loads(sys.stdin.read()):
    os.chdir(folder)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(flags)
    out.append((code, err.getvalue()))
print(json.dumps(out))
"""


def run_all(cases, cwds=None):
    """What run(*flags, cwd=cwd) gives for every flags of `cases` (and cwd of `cwds`, default the current folder),
    all in one process: [(exit code, stderr)], in the order of `cases`."""
    import json
    cwds = [str(c) for c in cwds] if cwds else [os.getcwd()] * len(cases)
    r = subprocess.run([sys.executable, "-c", IN_ONE_PROCESS], capture_output=True, text=True, timeout=120,
                       input=json.dumps([([*BASE, *flags], cwd) for flags, cwd in zip(cases, cwds)]))
    assert r.returncode == 0, r.stderr[-3000:]
    return [tuple(x) for x in json.loads(r.stdout.strip().splitlines()[-1])]


def assert_one_clear_line(code, err, words):
    print(err.strip())
    assert code == 2, err
    assert words in err, err
    assert err.count("hsgd: error:") == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def flag_runs(tmp_path_factory):
    """Every case of the flag matrix run once, each in an empty folder of its own: {flags: (code, stderr, folder)}."""
    flags = [tuple(f) for f, _ in OUT_OF_RANGE + LAYOUT]
    folders = [tmp_path_factory.mktemp("flags") for _ in flags]
    return {f: (*result, folder) for f, result, folder in zip(flags, run_all(flags, folders), folders)}


@pytest.mark.parametrize("flags, words", OUT_OF_RANGE + LAYOUT, ids=[" ".join(f) for f, _ in OUT_OF_RANGE + LAYOUT])
def test_flag_matrix(flags, words, flag_runs):
    code, err, folder = flag_runs[tuple(flags)]
    assert_one_clear_line(code, err, words)
    assert os.listdir(folder) == []                                     # nothing written


def test_data_path_matrix(tmp_path):
    empty, short, folder = tmp_path / "empty.txt", tmp_path / "short.txt", tmp_path / "folder"
    empty.write_bytes(b"")
    short.write_bytes(b"abc")
    folder.mkdir()
    cases = ((tmp_path / "missing.txt", "does not exist"), (empty, "is empty"),
             (short, "has 3 bytes, fewer than seq_len + 1 = 9"), (folder, "is a directory"))
    for result, (_, words) in zip(run_all([("--data", str(path)) for path, _ in cases]), cases):
        assert_one_clear_line(*result, words)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file: unreadable files are tested in test_errors.py")
def test_unreadable_data_file(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"x" * 100)
    secret.chmod(0)
    assert_one_clear_line(*run("--data", str(secret)), "cannot be read")


def test_config_file_matrix(tmp_path):
    cases = {"malformed.toml": ("steps = = 1\n", "cannot be read"),
             "unknown.toml": ("step = 1\n", "has unknown keys ['step']"),
             "badvalue.toml": ("lr = -1.0\n", "lr=-1.0 must be > 0"),
             "renamed.toml": ("grad_accum = 2\n", "grad_accum is now micro_batches"),
             "none.toml": (None, "does not exist")}
    for name, (text, _) in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
    for result, (_, words) in zip(run_all([("--config", str(tmp_path / name)) for name in cases]), cases.values()):
        assert_one_clear_line(*result, words)


def test_config_values_of_the_wrong_type(tmp_path):
    """A TOML value must have its field's type: a string "no" for a switch would count as on, an integer path
    would be used as a file descriptor, a string number would fail deep inside the run."""
    cases = {"lr_string.toml": ('lr = "0.1"\n', "lr = '0.1' is not a number"),
             "dtype_int.toml": ("dtype = 5\n", "dtype = 5 is not a string"),
             "seed_float.toml": ("seed = 1.5\n", "seed = 1.5 is not an integer"),
             "steps_bool.toml": ("steps = true\n", "steps = True is not an integer"),
             "overlap_string.toml": ('dp_overlap = "no"\n', "dp_overlap = 'no' is not true or false"),
             "log_int.toml": ("log_json = 1\n", "log_json = 1 is not a string"),
             "data_int.toml": ("data = 5\n", "data = 5 is not a string"),
             "d_model_float.toml": ("d_model = 16.0\n", "d_model = 16.0 is not an integer")}
    for name, (text, _) in cases.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "latin1.toml").write_bytes("prompt = 'caf\u00e9'\n".encode("latin-1"))
    words = [w for _, w in cases.values()] + ["is not UTF-8 text"]
    for result, w in zip(run_all([("--config", str(tmp_path / name)) for name in [*cases, "latin1.toml"]]), words):
        assert_one_clear_line(*result, w)


def test_existing_log_is_not_overwritten_by_a_failing_run(tmp_path):
    log = tmp_path / "steps.jsonl"
    log.write_text("precious\n")
    assert_one_clear_line(*run("--log-json", str(log), "--lr", "-1"), "lr=-1.0 must be > 0")
    assert log.read_text() == "precious\n"


def test_ulysses_with_heads_that_cp_does_not_divide(tmp_path):
    """--cp-scheme ulysses on 2 ranks (cp 2) of a model with one head: every rank exits 2, rank 0 says in one line
    that cp does not divide the heads and what would work, and nothing is written (the one case here that needs
    an MPI launch: a single process cannot have cp = 2)."""
    import shutil
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    launcher = here if os.path.exists(here) else shutil.which("mpiexec")
    if launcher is None:
        pytest.skip("no mpiexec")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    r = subprocess.run([launcher, "-n", "2", sys.executable, "-m", "hsgd.train", *BASE, "--n-heads", "1", "--cp", "2",
                        "--cp-scheme", "ulysses"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert_one_clear_line(r.returncode, r.stderr, "cp=2 does not divide; no cp > 1 divides them; use --cp-scheme ring")
    assert not list(tmp_path.iterdir())
