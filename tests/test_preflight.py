"""Checks before any work (hsgd.run.preflight): inputs that would block, outputs that would fail only at the end of a
run, optional modules that are missing. Each case: one clear line, exit 2, nothing written, in seconds; under
mpiexec every rank ends (an outer `timeout` turns a hang into exit 124, which fails)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from .test_bad_inputs import BASE, assert_one_clear_line, run_all   # run_all: the cases in one process
from .test_mpi import ROOT, mpi_env, run_mpi

pytestmark = pytest.mark.timeout(300)


def run(*flags, cwd=None, env=None):
    r = subprocess.run([sys.executable, "-m", "hsgd.train", *BASE, *flags], capture_output=True, timeout=60,
                       cwd=cwd, env=env)
    return r.returncode, r.stderr.decode(errors="replace")


def missing(tmp_path, *modules):
    """An environment in which `import m` fails for each of modules (a package that raises ImportError first on
    the path), whatever is installed."""
    fake = tmp_path / "missing"
    for m in modules:
        (fake / m).mkdir(parents=True)
        (fake / m / "__init__.py").write_text(f"raise ImportError('{m} is hidden by the test')\n")
    path = os.pathsep.join([str(fake), ROOT, os.environ.get("PYTHONPATH", "")])
    return mpi_env(PYTHONPATH=path)


def test_inputs_that_would_block_are_refused(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    toml_fd = tmp_path / "fd.toml"
    toml_fd.write_text("data = 0\n")                                    # an integer: once read as stdin
    toml_fd5 = tmp_path / "fd5.toml"
    toml_fd5.write_text("data = 5\n")
    cases = [(["--data", str(fifo)], "is a FIFO"), (["--data", "/dev/zero"], "is a device"),
             (["--data", "/dev/null"], "is a device"), (["--config", str(fifo)], "is a FIFO"),
             (["--config", "/dev/zero"], "is a device"), (["--config", str(toml_fd)], "data = 0 is not a string"),
             (["--config", str(toml_fd5)], "data = 5 is not a string")]
    for result, (_, words) in zip(run_all([flags for flags, _ in cases]), cases):
        assert_one_clear_line(*result, words)
    from hsgd.model.data import Corpus                                        # the same gate from Python
    from hsgd.errors import DataError
    for path, words in ((0, "data 0 is not a path"), (str(fifo), "is a FIFO"), ("/dev/zero", "is a device")):
        with pytest.raises(DataError, match=words):
            Corpus.load(path, 8)


def test_outputs_are_checked_before_training(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    before = sorted(os.listdir(tmp_path))
    cases = [(["--save-dir", str(a_file / "ckpt")], "which is a file"),
             (["--save-dir", str(a_file)], "exists and is not a directory"),
             (["--log-json", str(tmp_path / "no" / "log.jsonl")], "does not exist; create it first"),
             (["--log-json", str(tmp_path)], "is a directory"),
             (["--trace", str(tmp_path / "no" / "trace.json")], "does not exist; create it first"),
             (["--trace", str(tmp_path)], "is a directory"),
             (["--plot", str(a_file / "plots")], "which is a file")]
    for (code, err), (_, words) in zip(run_all([[*flags, "--steps", "50"] for flags, _ in cases]), cases):
        assert_one_clear_line(code, err, words)
    assert sorted(os.listdir(tmp_path)) == before                       # nothing written


def test_a_prompt_that_is_not_text_is_refused_before_training():
    for prompt in (b"\xff\xfe", b"def \x80"):                           # not UTF-8: decoded with surrogates
        r = subprocess.run([sys.executable.encode(), b"-m", b"hsgd.train", *[a.encode() for a in BASE],
                            b"--sample-bytes", b"10", b"--prompt", prompt], capture_output=True, timeout=60)
        assert_one_clear_line(r.returncode, r.stderr.decode(errors="replace"), "is not valid text")


def test_missing_optional_modules_stop_every_rank_before_any_work(tmp_path):
    """--plot without matplotlib, --device gpu without CuPy: once rank 0 failed after training and the other
    ranks waited in a collective forever."""
    env = missing(tmp_path, "matplotlib", "cupy")
    for flags, words in ((["--plot", str(tmp_path / "plots")], "--plot needs matplotlib"),
                         (["--device", "gpu"], "needs CuPy")):
        r = run_mpi(2, ["-m", "hsgd.train", *BASE, *flags], timeout=60, env=env)
        print(r.stderr.strip())
        assert r.returncode == 2 and words in r.stderr and r.stderr.count("hsgd: error:") == 1, r.stderr[-2000:]
    assert not os.path.exists(tmp_path / "plots")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("sample")
    r = subprocess.run([sys.executable, "-m", "hsgd.train", *BASE, "--save-dir", str(d)], capture_output=True,
                       text=True, timeout=60, env=mpi_env())
    assert r.returncode == 0, r.stderr
    return d


@pytest.mark.parametrize("flags, words", [(["--device", "gpu"], "needs CuPy"),
                                          (["--temperature", "0"], "--temperature 0.0 must be a finite number > 0"),
                                          (["--temperature", "inf"], "must be a finite number > 0"),
                                          (["--top-k", "0"], "--top-k 0 must be in 1..256"),
                                          (["--bytes", "-1"], "--bytes -1 must be an integer >= 0")])
def test_sample_refuses_on_every_rank(ckpt, tmp_path, flags, words):
    """hsgd.sample on 2 ranks: what rank 0 alone would find (no CuPy, a bad setting) ends every rank."""
    r = run_mpi(2, ["-m", "hsgd.sample", str(ckpt), *flags], timeout=60, env=missing(tmp_path, "cupy"))
    print(r.stderr.strip())
    assert r.returncode == 2 and words in r.stderr and r.stderr.count("hsgd: error:") == 1, r.stderr[-2000:]


def test_checkpoint_files_must_be_regular(ckpt, tmp_path):
    """A checkpoint whose shard was replaced by a FIFO: refused, not hashed forever."""
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    step = sorted(p for p in os.listdir(bad) if p.startswith("step-"))[-1]
    shard = bad / step / "shard-pp0-tp0.npz"
    shard.unlink()
    os.mkfifo(shard)
    r = run_mpi(2, ["-m", "hsgd.sample", str(bad)], timeout=60)
    print(r.stderr.strip())
    assert r.returncode == 2 and "is a FIFO" in r.stderr, r.stderr[-2000:]
    manifest = bad / step / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    r = run_mpi(2, ["-m", "hsgd.sample", str(bad / step)], timeout=60)
    assert r.returncode == 2 and "is a FIFO" in r.stderr, r.stderr[-2000:]


def test_log_json_appends_on_resume(tmp_path):
    """A run of 3 steps, resumed to 6 with the same --log-json: the file holds both runs' records."""
    log, save = tmp_path / "log.jsonl", tmp_path / "ckpt"
    import json
    r = run_mpi(2, ["-m", "hsgd.train", *BASE, "--steps", "3", "--save-dir", str(save), "--log-json", str(log)],
                timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    first = log.read_text()
    r = run_mpi(2, ["-m", "hsgd.train", *BASE, "--steps", "6", "--save-dir", str(save), "--resume", "auto",
                    "--log-json", str(log)], timeout=60)
    assert r.returncode == 0 and "after step 3" in r.stdout, r.stderr[-2000:]
    text = log.read_text()
    records = [json.loads(line) for line in text.splitlines()]
    steps = [rec["step"] for rec in records if "loss" in rec]
    print(f"{len(records)} records; loss records for steps {steps}")
    assert text.startswith(first) and steps == [1, 2, 3, 4, 5, 6]
    assert np.isfinite([rec["loss"] for rec in records if "loss" in rec]).all()


def test_sizes_this_machine_cannot_hold_are_refused_at_once():
    """Once --n-layers 10000000 grew memory for minutes and a wide model tried to allocate terabytes; now the
    estimate (parameters, gradients, optimizer state, one micro-batch's activations) is checked first (and sizes
    past hsgd's stated maxima before it: tests/test_bounds.py)."""
    import time
    for flags, words in ((["--n-layers", "4096", "--d-model", "4096"], "this run needs at least"),
                         (["--d-model", "262144", "--n-heads", "2"], "this run needs at least"),
                         (["--seq-len", "65536", "--batch-size", "64"], "activations of one micro-batch")):
        t0 = time.perf_counter()
        code, err = run(*flags)
        seconds = time.perf_counter() - t0
        print(f"{seconds:.1f} s: {err.strip()[:160]}")
        assert_one_clear_line(code, err, words)
        assert seconds < 30


def test_the_memory_estimate_is_a_lower_bound_of_what_a_run_holds():
    """The estimate's parameter part equals the model's parameter count x (2 + optimizer states) x bytes; the check
    refuses exactly when the ranks of this machine need more than it has."""
    from hsgd.model.config import ModelConfig
    from hsgd.errors import ConfigError
    from hsgd.run.preflight import check_memory, memory_estimate
    from hsgd.step.settings import TrainConfig
    cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=3, d_ff=64)
    tc = TrainConfig(dp=1, tp=1, pp=1, batch_size=4, dtype="float64", momentum=0.9)
    weights, activations = memory_estimate(cfg, tc)
    assert weights == cfg.n_params() * 8 * 3 and activations > 0
    check_memory(cfg, tc, 4, ConfigError, available=4 * (weights + activations))
    with pytest.raises(ConfigError, match="x 4 ranks on this machine"):
        check_memory(cfg, tc, 4, ConfigError, available=4 * (weights + activations) - 1)
    for zero, copies in ((0, 1), (2, 1), (3, 0)):        # bfloat16: the model's rounded copy, but with ZeRO-3
        low, _ = memory_estimate(cfg, TrainConfig(dp=1, tp=1, pp=1, batch_size=4, dtype="bfloat16", zero=zero))
        plain, _ = memory_estimate(cfg, TrainConfig(dp=1, tp=1, pp=1, batch_size=4, dtype="float32", zero=zero))
        assert low - plain == copies * cfg.n_params() * 4, zero


def test_data_is_mapped_and_ranks_compare_what_they_read(tmp_path):
    from hsgd.model.data import Corpus, same_data
    from hsgd.errors import DataError
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(bytes(range(256)) * 4000)
    b.write_bytes(bytes(range(256)) * 3999 + bytes(255) + b"x")                    # the same size, one byte off
    ca, cb = Corpus.load(str(a), 8), Corpus.load(str(b), 8)
    assert isinstance(ca.all.base, np.memmap)                                       # mapped, not read into memory
    assert ca.fingerprint()[0] == cb.fingerprint()[0] and ca.fingerprint() != cb.fingerprint()
    same_data([ca.fingerprint()] * 3, str(a))
    with pytest.raises(DataError, match=r"ranks \[2\] read other data than rank 0"):
        same_data([ca.fingerprint(), ca.fingerprint(), cb.fingerprint()], str(a))
