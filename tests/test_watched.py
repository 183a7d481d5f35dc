"""No quiet hang, no quiet failure: every collective phase is watched by --step-timeout, a run whose updates keep
being skipped ends with exit code 3 (and a checkpoint of its last finite state), a manifest's training state is
checked, and a killed job's zombie ranks do not hold the save folder's lock.

The watched phases are reached deterministically: `--inject-fault RANK:STEP:stop-in-PHASE` stops that rank with
SIGSTOP as the phase starts (hsgd.run.faults); the other rank then waits in the phase's next collective, and its
watchdog must end the job with exit code 5 within seconds. The jobs run three at a time (two ranks each)."""
import io
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .test_mpi import run_mpi

pytestmark = pytest.mark.timeout(180)

TINY = ["--dtype", "float64", "--d-model", "16", "--n-heads", "4", "--n-layers", "2", "--d-ff", "16", "--seq-len", "8",
        "--batch-size", "8", "--eval-batches", "1", "--sample-bytes", "0", "--log-interval", "1",
        "--eval-interval", "0", "--steps", "2"]
LIMIT = 2                       # --step-timeout, seconds: far above a tiny step, even with three jobs on two cores


def timed_run(flags, limit=LIMIT):
    """(exit code, stderr, seconds) of hsgd.train on 2 ranks with --step-timeout `limit` and `flags`."""
    t0 = time.perf_counter()
    r = run_mpi(2, ["-m", "hsgd.train", *TINY, "--step-timeout", str(limit), *flags], timeout=60)
    return r.returncode, r.stderr, time.perf_counter() - t0


def test_a_rank_stopped_in_any_watched_phase_ends_the_job_with_exit_5(tmp_path):
    """A rank stopped (SIGSTOP) as each phase starts: the checkpoint save, the checkpoint load (a resume of the
    checkpoint the last-validation case wrote), the validation before the first step and after the last, the
    sample, the --dump-step dump. Each job ends with exit code 5 and names the phase, in seconds; without the watch
    each hung until the job's time limit (the dump, inside its step, was caught as the step)."""
    ckpt = str(tmp_path / "ckpt")
    cases = {
        "the checkpoint save after step 1": ["--save-dir", str(tmp_path / "saves"), "--save-interval", "1",
                                             "--inject-fault", "1:1:stop-in-save"],
        "the validation before step 1": ["--inject-fault", "1:1:stop-in-validation"],
        "the validation after step 2 (the last)": ["--save-dir", ckpt, "--inject-fault", "1:2:stop-in-validation"],
        "the checkpoint load of --resume": ["--steps", "4", "--save-dir", ckpt, "--resume", "auto",
                                            "--inject-fault", "0:1:stop-in-load"],
        "the sample at the end of the run": ["--sample-bytes", "1", "--inject-fault", "0:2:stop-in-sample"],
        "the --dump-step dump of step 1": ["--dump-step", "1", str(tmp_path / "dump"),
                                           "--inject-fault", "1:1:stop-in-dump"],
    }
    names = list(cases)
    chains = [names[0:2], names[2:4], names[4:6]]            # the load resumes what the last validation's run saved

    def run_chain(chain):                                    # a checkpoint's limit is 10 S: S = 1 s there
        return [(name, *timed_run(cases[name], 1 if "checkpoint" in name else LIMIT)) for name in chain]
    with ThreadPoolExecutor(3) as pool:
        results = [r for chain in pool.map(run_chain, chains) for r in chain]
    for name, code, err, seconds in results:
        first = next((line for line in err.splitlines() if "hsgd: stopped:" in line), err.strip()[-300:])
        print(f"{name}: exit {code} after {seconds:.1f} s; {first}")
    for name, code, err, seconds in results:
        assert code == 5 and f"{name} has run for more than" in err and seconds < 40, (name, err[-2000:])


def test_a_timeout_too_short_for_anything_exits_5_not_0():
    """--step-timeout 0.001: the first watched phase outlasts it; the job must end with exit code 5, however early
    (it printed "ending the job (MPI_Abort)" and exited 0, the ranks finishing before the abort)."""
    r = run_mpi(2, ["-m", "hsgd.train", *TINY, "--step-timeout", "0.001"], timeout=60)
    print(r.stderr.strip().splitlines()[0] if r.stderr.strip() else "(no stderr)")
    assert r.returncode == 5 and "has run for more than" in r.stderr and "ending the job (MPI_Abort)" in r.stderr, \
        r.stderr[-2000:]


# ------------------------------------------------------------------------------------- no quiet failure, in-process

def train_here(capsys, *flags):
    """What `python -m hsgd.train` does (hsgd.train.main), in this process (one rank): (exit code, stdout, stderr)."""
    from mpi4py import MPI

    from hsgd.grid import launch
    from hsgd.run.flags import build_parser, configs_from_args
    from hsgd.train import train
    out = io.StringIO()
    code = launch.run(lambda: train(*configs_from_args(build_parser().parse_args([*TINY, *flags]), 1), MPI.COMM_WORLD,
                                    out=out))
    return code, out.getvalue(), capsys.readouterr().err


def test_a_float16_run_whose_loss_scale_keeps_backing_off_ends_with_exit_3_and_its_last_finite_state(tmp_path,
                                                                                                    capsys):
    """--lr 300 in float16: after a few steps every step overflows at any scale and the scaler halves S each step.
    It used to skip every update to the end and exit 0 (and, after ~1090 steps, crash on log2(0)). Now the skips
    count toward --max-skips (10 by default), S below its floor 1 ends the run, both with exit code 3 and a
    checkpoint of the last finite state: the step of the last applied update, with the scaler's state of then."""
    from hsgd.step.loss_scale import MIN_SCALE
    f16 = ["--dtype", "float16", "--lr", "300", "--steps", "200", "--save-interval", "500"]
    code, out, err = train_here(capsys, *f16, "--save-dir", str(tmp_path / "a"))
    print(err.strip())
    assert code == 3 and "steps in a row had non-finite values" in err and "(--max-skips 10)" in err, err
    code, out, err = train_here(capsys, *f16, "--save-dir", str(tmp_path / "b"), "--max-skips", "100")
    print(err.strip())
    assert code == 3 and f"below its floor {MIN_SCALE:g}" in err and "checkpoint of the last finite state" in err, err
    step = int(err.split("last finite state (after step ")[1].split(")")[0])
    saved = json.loads((tmp_path / "b" / f"step-{step:06d}" / "manifest.json").read_text())
    print(f"last finite state: step {step}, loss scale {saved['loss_scale']}")
    assert saved["loss_scale"]["scale"] >= MIN_SCALE                  # as it was then, not below the floor
    assert saved["optimizer"]["t"] == step - saved["loss_scale"]["skipped"]     # one update per step not skipped


def test_a_run_that_skipped_every_update_never_exits_0(capsys):
    """One step, its update skipped (--on-nan skip and a NaN injected): no update was applied, so exit code 3
    (it exited 0)."""
    code, out, err = train_here(capsys, "--steps", "1", "--on-nan", "skip", "--inject-fault", "0:1:nan")
    print(err.strip())
    assert code == 3 and "none of the 1 update(s) of this run was applied" in err, err


def test_the_progress_line_shows_a_loss_scale_of_zero():
    """S = 0 (what 1090 halvings of 2^16 underflow to) is printed, not passed to log2."""
    from hsgd.run.progress import power_of_two
    assert (power_of_two(2.0 ** -3), power_of_two(0.0), power_of_two(float("nan"))) == ("2^-3", "0", "nan")


def test_a_manifest_with_a_nan_loss_scale_or_too_many_optimizer_steps_is_refused(tmp_path):
    """A manifest whose digest matches but whose loss scale is NaN (every update of the resumed run skipped) or
    whose optimizer step count exceeds its step (AdamW's bias correction) is corrupt: one line naming the field."""
    from mpi4py import MPI

    from hsgd.checkpoint import store as checkpoint
    from hsgd.checkpoint.manifest import check, digest
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.model.config import ModelConfig
    from hsgd.step.settings import TrainConfig
    from hsgd.step.trainer import HybridTrainer
    cfg = ModelConfig(vocab_size=256, seq_len=8, d_model=8, n_heads=2, n_layers=1, d_ff=8)
    grid = ProcessGrid(MPI.COMM_SELF, dp=1, tp=1)
    trainer = HybridTrainer(cfg, grid, TrainConfig(dp=1, tp=1, batch_size=2, dtype="float16", optimizer="adamw"))
    path = checkpoint.save(trainer, 3, str(tmp_path), keep=1)
    grid.free()
    good = json.loads(open(os.path.join(path, "manifest.json")).read())
    for change, words in (({"loss_scale": dict(good["loss_scale"], scale=float("nan"))}, "loss scale nan"),
                          ({"loss_scale": dict(good["loss_scale"], scale=-1.0)}, "loss scale -1.0"),
                          ({"loss_scale": dict(good["loss_scale"], skipped=10 ** 30)}, "step counts"),
                          ({"optimizer": dict(good["optimizer"], t=10 ** 30)}, "optimizer step count")):
        bad = {**good, **change}
        bad["digest"] = digest(bad)
        with pytest.raises(checkpoint.CheckpointError) as e:
            check(bad, path, checkpoint.CheckpointError)              # the manifest as any JSON reader returns it
        print(e.value)
        assert "is corrupt" in str(e.value) and words in str(e.value)
        with open(os.path.join(path, "manifest.json"), "w") as f:
            json.dump(bad, f)                                          # (NaN: refused by the reader already)
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.open_checkpoint(path, cfg)


def test_a_zombie_holding_the_lock_does_not_keep_a_requeued_job_out(tmp_path):
    """After `kill -9` of mpirun its ranks are zombies for a moment (exited, not yet collected by their parent):
    kill(pid, 0) still finds them. A lock held by one is a killed job's, and is taken over at once."""
    from hsgd.checkpoint.runs import FolderLock
    pid = os.fork()
    if pid == 0:
        os._exit(0)                                              # the child exits; nobody collects it yet
    try:
        time.sleep(0.2)
        os.makedirs(tmp_path / "ckpt")
        (tmp_path / "ckpt" / ".hsgd-lock").write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
        t0 = time.perf_counter()
        lock = FolderLock(str(tmp_path / "ckpt"))
        lock.acquire()
        print(f"the zombie's lock taken over in {time.perf_counter() - t0:.3f} s")
        assert lock.held and json.loads((tmp_path / "ckpt" / ".hsgd-lock").read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        os.waitpid(pid, 0)
