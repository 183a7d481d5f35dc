"""Fault tolerance, end to end with mpiexec: checkpoints that resume exactly and reshard, a rank killed with SIGKILL,
a kill while a checkpoint is written, corrupt and foreign checkpoints, non-finite values and diverged replicas."""
import os
import shutil

import numpy as np
import pytest

from .test_mpi import run_mpi

pytestmark = pytest.mark.timeout(600)

# float64, tiny: 4 heads (tp up to 4), 2 layers (pp up to 2), 6 steps with a cosine schedule over all 6
BASE = ["-m", "hsgd.train", "--dtype", "float64", "--d-model", "16", "--n-heads", "4", "--n-layers", "2",
        "--d-ff", "16", "--seq-len", "8", "--batch-size", "8", "--eval-batches", "1", "--sample-bytes", "0",
        "--log-interval", "1", "--eval-interval", "0", "--steps", "6", "--warmup", "2", "--momentum", "0.9"]


def train(n, *flags, timeout=120):
    return run_mpi(n, [*BASE, *flags], timeout=timeout)


def export(ckpt, out, cli=False):
    """The full model of checkpoint `ckpt`, written to `out` and read back: with cli, by `python -m hsgd.checkpoint
    export` under mpiexec as a user runs it; else by the function it calls, hsgd.checkpoint.store.export, in this
    process (the same export, without a process start-up)."""
    if cli:
        r = run_mpi(1, ["-m", "hsgd.checkpoint", "export", str(ckpt), str(out)], timeout=60)
        assert r.returncode == 0, r.stderr
    else:
        from hsgd.checkpoint import store as checkpoint
        checkpoint.export(str(ckpt), str(out))
    with np.load(out, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (dp 2 x tp 2), its final checkpoint exported. It also compares its replicas every 2
    steps (--check-replicas 2, which changes no parameter), and must pass: test_diverged_replicas_are_named's
    healthy run."""
    d = tmp_path_factory.mktemp("reference")
    r = train(4, "--save-dir", str(d / "ckpt"), "--check-replicas", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    return export(d / "ckpt", d / "final.npz")


def max_rel(a, b):
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 0.02)) for k in b)


def save_then_resume_elsewhere(reference, tmp_path, saved_with, saved_as, layouts):
    """Train with `saved_with` until rank 0 is killed after the step-3 checkpoint, then resume it under each (ranks,
    flags) of `layouts`: every resumed run names the saved layout and ends where the uninterrupted run ends."""
    saved = tmp_path / "saved"
    r = train(8, *saved_with, "--save-dir", str(saved), "--save-interval", "3", "--inject-fault", "0:4:kill")
    assert r.returncode != 0 and (saved / "step-000003" / "manifest.json").exists(), r.stderr[-2000:]
    for n, layout in layouts:
        out = tmp_path / f"resumed-{n}"
        r = train(n, *layout, "--resume", str(saved / "step-000003"), "--save-dir", str(out))
        print(r.stdout[-400:])
        assert r.returncode == 0 and f"saved as {saved_as}" in r.stdout, r.stderr[-2000:]
        err = max_rel(export(out, tmp_path / f"final-{n}.npz"), reference)
        print(f"saved {saved_as}, resumed {layout} on {n} ranks: max rel diff to the uninterrupted run {err:.1e}")
        assert err < 1e-9


def test_a_checkpoint_saved_with_cp_2_resumes_with_cp_1_and_cp_4(reference, tmp_path):
    """Context parallelism splits the positions, not the parameters: a checkpoint saved by dp 2 x cp 2 x tp 2 (ZeRO 1:
    the optimizer chunks are sharded over dp x cp = 4 ranks) resumes with cp 1 and with cp 4 (ring and all-gather)
    and ends where the uninterrupted dp 2 x tp 2 run ends."""
    save_then_resume_elsewhere(reference, tmp_path, ["--dp", "2", "--cp", "2", "--tp", "2", "--zero", "1"],
                               "dp 2 x pp 1 x cp 2 x tp 2",
                               ((2, ["--dp", "1", "--tp", "2"]), (8, ["--dp", "1", "--cp", "4", "--tp", "2"]),
                                (4, ["--dp", "1", "--cp", "4", "--tp", "1", "--cp-scheme", "allgather"])))


def test_sigkill_then_resume_auto_ends_bit_identical(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    r = train(4, "--save-dir", str(ckpt), "--save-interval", "3", "--inject-fault", "3:4:kill")
    print(r.stdout[-600:], r.stderr[-600:])
    assert r.returncode not in (0, 124)                             # the job ended (124: it would have hung)
    assert (ckpt / "step-000003" / "manifest.json").exists()
    r = train(4, "--save-dir", str(ckpt), "--resume", "auto")
    print(r.stdout[-800:])
    assert r.returncode == 0 and "resumed from" in r.stdout and "after step 3" in r.stdout, r.stderr[-2000:]
    final = export(ckpt, tmp_path / "final.npz")
    same = all(np.array_equal(final[k], reference[k]) for k in reference)
    print(f"resumed at step 3 after SIGKILL: bit-identical to the uninterrupted run: {same}")
    assert same


def test_resharding_to_other_layouts_and_world_sizes(reference, tmp_path):
    """Saved by dp 2 x tp 4 on 8 ranks, resumed on 2 ranks as pp 2 and on 4 as tp 4 with the gather scheme (more
    layouts, resharded in one process: chapter 19)."""
    save_then_resume_elsewhere(reference, tmp_path, ["--dp", "2", "--tp", "4"], "dp 2 x pp 1 x cp 1 x tp 4",
                               ((2, ["--dp", "1", "--pp", "2", "--tp", "1"]),
                                (4, ["--dp", "1", "--pp", "1", "--tp", "4", "--tp-scheme", "gather"])))


def test_kill_while_saving_leaves_the_previous_checkpoint(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    r = train(4, "--save-dir", str(ckpt), "--save-interval", "2", "--inject-fault", "3:4:kill-in-save")
    assert r.returncode != 0
    names = sorted(os.listdir(ckpt))
    print(names)
    assert "step-000002" in names and "step-000004" not in names and any(n.startswith(".tmp-") for n in names)
    info = run_mpi(1, ["-m", "hsgd.checkpoint", "info", str(ckpt)], timeout=60)
    assert info.returncode == 0 and "step 2" in info.stdout, info.stderr
    r = train(4, "--save-dir", str(ckpt), "--resume", "auto")
    assert r.returncode == 0 and "after step 2" in r.stdout, r.stderr[-2000:]
    assert not any(n.startswith(".tmp-") for n in os.listdir(ckpt))                   # cleaned on the next save
    final = export(ckpt, tmp_path / "final.npz")
    assert all(np.array_equal(final[k], reference[k]) for k in reference)


@pytest.fixture(scope="module")
def saved_4(tmp_path_factory):
    """A checkpoint after 2 steps on 4 ranks; each test damages a copy of its own."""
    ckpt = tmp_path_factory.mktemp("saved_4") / "ckpt"
    assert train(4, "--steps", "2", "--save-dir", str(ckpt)).returncode == 0
    return ckpt


@pytest.fixture(scope="module")
def saved_2(tmp_path_factory):
    """A checkpoint after 2 steps on 2 ranks; each test resumes from a copy of its own."""
    ckpt = tmp_path_factory.mktemp("saved_2") / "ckpt"
    assert train(2, "--steps", "2", "--save-dir", str(ckpt)).returncode == 0
    return ckpt


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_shard_is_caught_by_its_checksum(saved_4, tmp_path, damage):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_4, ckpt)
    shard = ckpt / "step-000002" / "shard-pp0-tp1.npz"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[:len(data) // 3]
    shard.write_bytes(bytes(data))
    before = sorted(os.listdir(ckpt))
    r = train(4, "--save-dir", str(ckpt), "--resume", "auto")
    print(r.stderr)
    assert r.returncode == 2 and r.stderr.count("hsgd: error:") == 1 and "Traceback" not in r.stderr
    assert "shard-pp0-tp1.npz" in r.stderr and "is corrupt" in r.stderr
    assert sorted(os.listdir(ckpt)) == before and shard.read_bytes() == bytes(data)   # nothing overwritten


@pytest.mark.parametrize("flags, words", [
    (["--d-model", "32"], "is of a different model: d_model 16 in the checkpoint vs 32 now"),
    (["--optimizer", "adamw"], "holds sgd state; resume with --optimizer sgd"),
    (["--arch", "llama"], "holds a model of another family (norm layernorm, positions learned, mlp gelu, n_kv_heads "
                          "4, bias True; arch gpt2) than this run's (arch llama); resume with --arch gpt2"),
])
def test_incompatible_checkpoint_is_refused(saved_2, tmp_path, flags, words):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_2, ckpt)
    r = train(2, "--resume", str(ckpt), *flags)
    print(r.stderr)
    assert r.returncode == 2 and r.stderr.count("hsgd: error:") == 1 and words in r.stderr


def test_missing_checkpoint_and_resume_auto_without_one(tmp_path):
    r = train(2, "--resume", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = train(2, "--resume", str(empty))
    assert r.returncode == 2 and "holds no complete checkpoint" in r.stderr
    r = train(2, "--steps", "1", "--save-dir", str(empty), "--resume", "auto")
    assert r.returncode == 0 and "no complete checkpoint" in r.stdout


def test_nan_stops_or_skips(tmp_path):
    """A NaN on rank 3 of 4 (dp 2 x tp 2): every rank stops with it, or every rank skips the update."""
    r = train(4, "--inject-fault", "3:2:nan")
    print(r.stderr)
    assert r.returncode == 3 and r.stderr.count("hsgd: stopped:") == 1
    assert "non-finite loss or gradient at step 2 on ranks [3]" in r.stderr and "Traceback" not in r.stderr
    r = train(4, "--inject-fault", "3:2:nan", "--on-nan", "skip")
    print(r.stdout[-300:])
    assert r.returncode == 0 and "1 update(s) skipped for non-finite values" in r.stdout


def test_a_run_that_diverged_for_good_stops_and_keeps_its_good_checkpoints(tmp_path):
    """--on-nan skip with a learning rate that blows the model up: every step from the second on is non-finite.
    The run stops with exit code 3 after --max-skips steps in a row (it used to skip to the end and exit 0), and no
    checkpoint is written after a skipped step (they used to rotate the good ones away)."""
    ckpt = tmp_path / "ckpt"
    r = train(2, "--lr", "1e300", "--steps", "12", "--on-nan", "skip", "--max-skips", "4", "--save-dir", str(ckpt),
              "--save-interval", "1", "--keep", "2")
    print(r.stdout[-700:], r.stderr[-400:])
    assert r.returncode == 3 and r.stderr.count("hsgd: stopped:") == 1, r.stderr[-2000:]
    assert "4 steps in a row had non-finite values (the last: step 5)" in r.stderr
    assert "checkpoint after step 2 not written" in r.stdout and "checkpoint after step 4 not written" in r.stdout
    assert sorted(os.listdir(ckpt)) == ["step-000001"]
    r = train(2, "--lr", "1e300", "--steps", "6", "--on-nan", "skip")        # 5 skips, fewer than the default 10
    assert r.returncode == 0 and "5 update(s) skipped" in r.stdout, r.stderr[-2000:]


def test_resuming_past_the_last_step_has_nothing_to_do(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert train(2, "--save-dir", str(ckpt)).returncode == 0                        # 6 steps
    for steps in ("6", "4"):
        r = train(2, "--steps", steps, "--save-dir", str(ckpt), "--resume", "auto")
        print(r.stdout[-400:])
        assert r.returncode == 0 and "nothing to do: the checkpoint is after step 6 and --steps is " + steps in \
            r.stdout and "tok/s)" not in r.stdout, r.stderr[-2000:]
    assert sorted(os.listdir(ckpt)) == ["step-000006"]


def test_a_resume_says_what_changed(tmp_path):
    """Seed, data and batch size decide the batches: a resume that changes one is not the saved run's continuation
    and needs --allow-changes; learning rate, schedule and dtype are reported."""
    ckpt = tmp_path / "ckpt"
    assert train(2, "--steps", "3", "--save-dir", str(ckpt)).returncode == 0
    data = tmp_path / "data.txt"
    data.write_bytes(bytes(range(256)) * 8)
    for flags, words in ((["--seed", "1"], "with seed 0 -> 1"), (["--batch-size", "4"], "batch_size 8 -> 4"),
                         (["--data", str(data)], "data 'built-in' -> "),
                         (["--seed", "2", "--batch-size", "16"], "seed 0 -> 2, batch_size 8 -> 16")):
        r = train(2, *flags, "--resume", str(ckpt))
        print(r.stderr.strip())
        assert r.returncode == 2 and words in r.stderr and "--allow-changes" in r.stderr, r.stderr[-2000:]
    r = train(2, "--seed", "1", "--allow-changes", "--lr", "0.01", "--dtype", "float32", "--resume", str(ckpt))
    print(r.stdout[:1500])
    assert r.returncode == 0, r.stderr[-2000:]
    for words in ("resume: seed 0 in the checkpoint's run, 1 now", "resume: lr 0.05 in the checkpoint's run, 0.01 now",
                  "resume: steps 3 in the checkpoint's run, 6 now", "resume: dtype 'float64' in the checkpoint's "
                  "run, 'float32' now"):
        assert words in r.stdout, words


def start_training(n, *flags):
    """A long run under mpiexec, returned once it has printed its first step line."""
    import subprocess
    import sys

    from .test_mpi import mpi_env, mpiexec
    p = subprocess.Popen([mpiexec(), "-n", str(n), sys.executable, *BASE, *flags], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=mpi_env())
    for line in p.stdout:
        if line.startswith("step "):
            return p
    raise AssertionError(f"the run ended before its first step: {p.wait()} {p.stderr.read()[-2000:]}")


def rank_pids(p):
    """The PIDs of the ranks of the mpiexec process p (children of its proxy)."""
    import subprocess
    kids = lambda pid: [int(x) for x in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                       text=True).stdout.split()]
    return [rank for proxy in kids(p.pid) for rank in kids(proxy)]


@pytest.mark.parametrize("sig, to", [("SIGTERM", "mpiexec"), ("SIGINT", "mpiexec"), ("SIGTERM", "one rank")])
def test_a_signal_ends_the_run_with_a_checkpoint(tmp_path, sig, to):
    """Preemption (SIGTERM) or Ctrl-C (SIGINT), to the whole job or to one rank only: every rank finishes its step,
    the ranks agree, a checkpoint of that step is written, exit code 4 with one line; --resume auto goes on."""
    import signal
    import subprocess
    ckpt = tmp_path / "ckpt"
    p = start_training(2, "--steps", "100000", "--save-dir", str(ckpt), "--log-interval", "50")
    target = p.pid if to == "mpiexec" else rank_pids(p)[-1]
    os.kill(target, getattr(signal, sig))
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    print(err.strip())
    assert p.returncode == 4 and err.count("hsgd: stopped:") == 1 and f"{sig} after step" in err, err[-2000:]
    step = int(err.split(f"{sig} after step ")[1].split(";")[0])
    assert f"checkpoint {ckpt / f'step-{step:06d}'}; continue with --resume auto" in err
    r = train(2, "--steps", str(step + 2), "--save-dir", str(ckpt), "--resume", "auto")
    assert r.returncode == 0 and f"after step {step}" in r.stdout, r.stderr[-2000:]


def test_runs_in_one_folder_keep_their_own_checkpoints(tmp_path):
    """Lines of runs (hsgd.checkpoint.runs): a fresh run into a folder with checkpoints needs --overwrite, and then
    neither loses its own checkpoints to the other's higher steps (even with --keep 1) nor deletes theirs; --resume auto
    follows the run written last. A resume from an older checkpoint is a branch: the checkpoint it started from
    stays, and --resume auto follows the branch."""
    ckpt = tmp_path / "ckpt"
    assert train(2, "--save-dir", str(ckpt), "--save-interval", "1", "--keep", "6").returncode == 0    # steps 1-6
    r = train(2, "--steps", "2", "--save-dir", str(ckpt))
    assert r.returncode == 2 and "holds checkpoints of another run (the newest: step-000006)" in r.stderr, r.stderr
    r = train(2, "--steps", "2", "--seed", "5", "--save-dir", str(ckpt), "--overwrite", "--keep", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step-000002" in os.listdir(ckpt) and "step-000006" in os.listdir(ckpt)
    r = train(2, "--steps", "3", "--seed", "5", "--save-dir", str(ckpt), "--resume", "auto")
    assert r.returncode == 0 and "after step 2" in r.stdout, r.stdout[-1500:] + r.stderr[-1500:]
    branch = tmp_path / "branch"
    assert train(2, "--save-dir", str(branch), "--save-interval", "1", "--keep", "2").returncode == 0   # 5, 6
    r = train(2, "--steps", "8", "--save-dir", str(branch), "--resume", str(branch / "step-000005"), "--keep", "1",
              "--save-interval", "1")
    print(sorted(os.listdir(branch)))
    assert r.returncode == 0 and "step-000005" in os.listdir(branch) and "step-000008" in os.listdir(branch)
    assert "step-000007" not in os.listdir(branch)                                   # the branch's own rotation
    r = train(2, "--steps", "9", "--save-dir", str(branch), "--resume", "auto")
    assert r.returncode == 0 and "after step 8" in r.stdout, r.stderr[-2000:]
    import json
    run = {s: json.loads((branch / f"step-{s:06d}" / "manifest.json").read_text())["run"] for s in (5, 8, 9)}
    print(run)
    assert run[8]["started_from"] == "step-000005" and run[8]["line"] != run[5]["line"]       # a branch
    assert run[9]["started_from"] == "step-000008" and run[9]["line"] == run[8]["line"]       # a continuation
    assert len({run[s]["id"] for s in run}) == 3                                               # three runs


def test_a_second_job_on_the_same_folder_is_refused(tmp_path):
    import json
    import signal
    import socket
    import subprocess
    ckpt = tmp_path / "ckpt"
    p = start_training(2, "--steps", "100000", "--save-dir", str(ckpt), "--log-interval", "50")
    r = train(2, "--save-dir", str(ckpt), "--resume", "auto")
    print(r.stderr.strip())
    assert r.returncode == 2 and "another job is using the save folder" in r.stderr, r.stderr[-2000:]
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 4 and not (ckpt / ".hsgd-lock").exists()
    dead = subprocess.Popen(["true"])
    dead.wait()                                                                   # a pid that no longer runs
    (ckpt / ".hsgd-lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    r = train(2, "--steps", "2", "--save-dir", str(tmp_path / "ckpt"), "--resume", "auto")
    assert r.returncode == 0, r.stderr[-2000:]                                   # a killed job's lock: taken over
    (ckpt / ".hsgd-lock").write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    r = train(2, "--save-dir", str(ckpt), "--resume", "auto")
    assert r.returncode == 2 and "(process 1 on elsewhere)" in r.stderr and "delete" in r.stderr, r.stderr


def test_trace_and_plots_of_a_resumed_run(tmp_path):
    """A resumed run traces its own first steps (it used to claim steps 2-4, which it never ran, and write an empty
    trace) and plots its losses at their step numbers."""
    import json
    ckpt = tmp_path / "ckpt"
    assert train(2, "--steps", "4", "--save-dir", str(ckpt)).returncode == 0
    trace, plots = tmp_path / "trace.json", tmp_path / "plots"
    r = train(2, "--steps", "9", "--save-dir", str(ckpt), "--resume", "auto", "--trace", str(trace), "--plot",
              str(plots))
    print(r.stdout[-600:])
    assert r.returncode == 0 and "trace of steps 6-8, all ranks" in r.stdout, r.stderr[-2000:]
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"step 6", "step 7", "step 8"} <= names and "step 2" not in names
    assert (plots / "loss.png").exists() and (plots / "timeline.png").exists()


def test_export_does_not_write_into_its_checkpoint(tmp_path):
    import subprocess
    import sys
    ckpt = tmp_path / "ckpt"
    assert train(2, "--steps", "1", "--save-dir", str(ckpt)).returncode == 0
    step = ckpt / "step-000001"
    before = sorted(os.listdir(step))
    for out, words in ((step / "full.npz", "is inside the checkpoint it exports from"),
                       (tmp_path / "no" / "full.npz", "does not exist; create it first")):
        r = subprocess.run([sys.executable, "-m", "hsgd.checkpoint", "export", str(step), str(out)],
                           capture_output=True, text=True, timeout=60)
        print(r.stderr.strip())
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sorted(os.listdir(step)) == before


def test_a_killed_run_keeps_every_step_it_logged(tmp_path):
    """--log-json is flushed line by line: a rank killed at step 5 leaves the records of steps 1-4."""
    import json
    log = tmp_path / "log.jsonl"
    r = train(2, "--log-json", str(log), "--inject-fault", "1:5:kill")
    assert r.returncode not in (0, 124)
    steps = [rec["step"] for rec in map(json.loads, log.read_text().splitlines()) if "loss" in rec]
    print(f"logged steps {steps}")
    assert steps == [1, 2, 3, 4]


@pytest.mark.parametrize("how", ["a straggler of 60 s", "a rank stopped with SIGSTOP"])
def test_a_stalled_rank_ends_the_job_after_the_step_timeout(how):
    """--step-timeout: a rank that stops without dying stalls every other rank in the next collective; the
    watchdog ends the whole job with exit code 5 and one line per rank that noticed, in seconds."""
    import signal
    import time
    if how.startswith("a straggler"):                   # rank 1 sleeps 60 s in step 1: any limit catches it
        limit = 1
        t0 = time.perf_counter()
        r = train(2, "--steps", "5", "--straggler", "1:60000", "--step-timeout", str(limit), timeout=60)
        out, err, code = r.stdout, r.stderr, r.returncode
    else:          # 50 steps run first, then the stop lands anywhere: in a step, its stop agreement, a validation
        limit = 2
        p = start_training(2, "--steps", "100000", "--log-interval", "50", "--eval-interval", "20",
                           "--step-timeout", str(limit))
        t0 = time.perf_counter()
        os.kill(rank_pids(p)[-1], signal.SIGSTOP)
        out, err = p.communicate(timeout=60)
        code = p.returncode
    seconds = time.perf_counter() - t0
    print(f"{how}: exit {code} after {seconds:.1f} s; {err.strip().splitlines()[0]}")
    timed = (f"has run for more than --step-timeout {limit} s", f"--step-timeout {limit} s per validation batch")
    assert code == 5 and any(t in err for t in timed) and seconds < 30, err[-2000:]


def test_diverged_replicas_are_named(reference):
    r = train(4, "--inject-fault", "3:3:diverge", "--check-replicas", "1")
    print(r.stderr)
    assert r.returncode == 3 and "data-parallel replicas diverged by step 3" in r.stderr
    assert "the first parameter that differs is wpe" in r.stderr and r.stderr.count("hsgd: stopped:") == 1
    # the same run without the fault, --check-replicas 2: the uninterrupted run of `reference`, which ended with 0


def test_sample_and_export_from_any_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert train(4, "--steps", "2", "--pp", "2", "--tp", "2", "--save-dir", str(ckpt)).returncode == 0   # 4 shards
    full = export(ckpt, tmp_path / "full.npz", cli=True)
    from hsgd.model.config import ModelConfig
    cfg = ModelConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=16)
    assert {k: v.shape for k, v in full.items()} == cfg.param_shapes()
    for n in (1, 3):
        r = run_mpi(n, ["-m", "hsgd.sample", str(ckpt), "--prompt", "def ", "--bytes", "20"], timeout=60)
        print(r.stdout)
        assert r.returncode == 0 and r.stdout.count("# ") == 1 and "(step 2)" in r.stdout, r.stderr


def test_checkpoint_keeps_the_newest(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert train(2, "--save-dir", str(ckpt), "--save-interval", "1", "--keep", "2").returncode == 0
    assert sorted(os.listdir(ckpt)) == ["step-000005", "step-000006"]
    shutil.rmtree(ckpt)
