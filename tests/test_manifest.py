"""Checkpoints are validated, not trusted (hsgd.checkpoint.manifest): an edited manifest, one that names files outside
the checkpoint or none at all, a layout that does not split the model, arrays of the wrong shape or unreadable ones:
each is `checkpoint ... is corrupt: ...`, exit code 2 from the command line, before anything is used."""
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from hsgd.checkpoint import store as checkpoint
from hsgd.checkpoint.runs import complete_checkpoints
from hsgd.checkpoint.store import CheckpointError, Shards
from hsgd.checkpoint.manifest import digest

from .test_bad_inputs import BASE


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    r = subprocess.run([sys.executable, "-m", "hsgd.train", *BASE, "--n-layers", "2", "--save-dir", str(d)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return d / "step-000001"


def copy(saved, tmp_path):
    out = tmp_path / "step-000001"
    shutil.copytree(saved, out)
    return out


def edit(ckpt, change, sign=True):
    """Apply change(manifest) to the manifest on disk; sign=True records a matching digest (as a writer with a bug
    would), sign=False leaves the old one (an edit by hand)."""
    path = ckpt / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    if sign:
        m["digest"] = digest(m)
    path.write_text(json.dumps(m))


def refused(ckpt, words):
    with pytest.raises(CheckpointError) as e:
        checkpoint.open_checkpoint(str(ckpt))
    print(e.value)
    assert "is corrupt" in str(e.value) and words in str(e.value), str(e.value)


def test_the_saved_manifest_verifies_and_records_its_digest(saved):
    m = checkpoint.open_checkpoint(str(saved))
    assert m["digest"] == digest(m) and len(m["digest"]) == 64


@pytest.mark.parametrize("change, sign, words", [
    (lambda m: m["layout"].update(tp=2), False, "was changed after it was written"),
    (lambda m: m["data"].update(seed=7), False, "was changed after it was written"),
    (lambda m: m.pop("digest"), False, "records no digest"),
    (lambda m: m.update(files={}), True, "lists the files []"),
    (lambda m: m["files"].update({"../../etc/passwd": m["files"]["shard-pp0-tp0.npz"]}), True, "lists the files"),
    (lambda m: m.update(files={"/etc/hostname": m["files"].pop("shard-pp0-tp0.npz")}), True, "lists the files"),
    (lambda m: m["layout"].update(tp_scheme="rows"), True, "unknown tensor-parallel scheme 'rows'"),
    (lambda m: m["layout"].update(layers=[1]), True, "does not split its model"),
    (lambda m: m["layout"].update(tp=3), True, "does not split its model"),
    (lambda m: m["model"].update(d_model=17), True, "describes no valid model"),
    (lambda m: m["model"].update(colour=1), True, "describes no valid model"),
    (lambda m: m.update(step=-9), True, "not a step >= 1"),
    (lambda m: m.update(dtype="float8"), True, "unknown dtype 'float8'"),
    (lambda m: m["optimizer"].update(name="lion"), True, "no optimizer name"),
    (lambda m: m["files"]["shard-pp0-tp0.npz"].update(sha256="00"), True, "bad entry for shard-pp0-tp0.npz"),
], ids=["edited layout", "edited seed", "no digest", "no files", "a path outside", "an absolute path",
        "unknown scheme", "layers", "tp", "bad model", "unknown model key", "negative step", "dtype", "optimizer",
        "short checksum"])
def test_a_bad_manifest_is_refused(saved, tmp_path, change, sign, words):
    ckpt = copy(saved, tmp_path)
    edit(ckpt, change, sign)
    refused(ckpt, words)


def rewrite_shard(ckpt, arrays):
    """Replace shard-pp0-tp0.npz by `arrays` and update its checksum, size and the manifest's digest: only the
    contents can tell."""
    path = ckpt / "shard-pp0-tp0.npz"
    if isinstance(arrays, bytes):
        path.write_bytes(arrays)
    else:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        path.write_bytes(buf.getvalue())
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    edit(ckpt, lambda m: m["files"]["shard-pp0-tp0.npz"].update(sha256=sha, bytes=path.stat().st_size))


def test_arrays_are_checked_before_use(saved, tmp_path):
    with np.load(saved / "shard-pp0-tp0.npz") as f:
        good = {k: f[k] for k in f.files}
    cases = [({**good, "param/wpe": good["param/wpe"][:-1]}, "param/wpe has shape (7, 8)"),
             ({k: v for k, v in good.items() if k != "param/h.0.ln1.weight"}, "param/h.0.ln1.weight of stage 0 "
                                                                             "cannot be read"),
             ({**good, "param/wte": good["param/wte"].astype(np.int64)}, "param/wte has shape"),
             (b"not a zip file at all", "cannot be read")]
    for i, (arrays, words) in enumerate(cases):
        ckpt = copy(saved, tmp_path / str(i))
        rewrite_shard(ckpt, arrays)
        m = checkpoint.open_checkpoint(str(ckpt))                       # the manifest itself is fine now
        with pytest.raises(CheckpointError) as e:
            shards = Shards(m)
            for name in shards.cfg.param_shapes():
                shards.full(name)
        print(e.value)
        assert "is corrupt" in str(e.value) and words in str(e.value), str(e.value)


def test_the_command_line_says_corrupt_with_exit_2(saved, tmp_path):
    ckpt = copy(saved, tmp_path)
    edit(ckpt, lambda m: m.update(files={}))
    for cmd in (["-m", "hsgd.checkpoint", "info", str(ckpt)], ["-m", "hsgd.checkpoint", "export", str(ckpt),
                                                                 str(tmp_path / "out.npz")],
                ["-m", "hsgd.sample", str(ckpt)]):
        r = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=60)
        print(r.stderr.strip())
        assert r.returncode == 2 and "is corrupt" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "out.npz")


def test_a_layout_that_does_not_split_ends_every_rank_of_sample(saved, tmp_path):
    """hsgd.sample on 2 ranks with a (validly signed) manifest whose layout does not split the model: once rank 0
    exited 2 and rank 1 waited in a Barrier forever."""
    from .test_mpi import run_mpi
    ckpt = copy(saved, tmp_path)
    edit(ckpt, lambda m: m["layout"].update(pp=2, layers=[1, 1, 1]))
    r = run_mpi(2, ["-m", "hsgd.sample", str(ckpt)], timeout=60)
    print(r.stderr.strip())
    assert r.returncode == 2 and r.stderr.count("hsgd: error:") == 1 and "is corrupt" in r.stderr, r.stderr


def test_strings_from_a_manifest_are_printed_escaped(saved, tmp_path):
    """A manifest's free text (here the data name, signed as if written so) reaches the terminal escaped: no
    control character (an escape sequence could clear the screen or hide the message) is printed raw."""
    ckpt = copy(saved, tmp_path)
    edit(ckpt, lambda m: m["data"].update(corpus="x\x1b[2J\rhidden"))
    r = subprocess.run([sys.executable, "-m", "hsgd.train", *BASE, "--n-layers", "2", "--steps", "2", "--resume",
                        str(ckpt)], capture_output=True, text=True, timeout=60)
    print(r.stderr.strip())
    assert r.returncode == 2 and "\\x1b[2J\\rhidden" in r.stderr and "\x1b" not in r.stderr, r.stderr


def test_rotation_renames_a_checkpoint_aside_before_deleting_it(tmp_path, monkeypatch):
    """A job killed while rotation deletes an old checkpoint must not leave a half-deleted one that still looks
    complete: it is renamed to a hidden .old-* name first (cleaned up by the next save)."""
    from mpi4py import MPI

    from hsgd.model.config import ModelConfig
    from hsgd.grid.process_grid import ProcessGrid
    from hsgd.step.trainer import HybridTrainer
    from hsgd.step.settings import TrainConfig
    cfg = ModelConfig(vocab_size=256, seq_len=8, d_model=8, n_heads=2, n_layers=1, d_ff=8)
    grid = ProcessGrid(MPI.COMM_SELF, dp=1, tp=1)
    trainer = HybridTrainer(cfg, grid, TrainConfig(dp=1, tp=1, batch_size=2, dtype="float64"))
    checkpoint.save(trainer, 1, str(tmp_path), keep=1)

    def killed(path, ignore_errors=False):
        raise KeyboardInterrupt("killed while deleting")
    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(trainer, 2, str(tmp_path), keep=1)
    monkeypatch.undo()
    listing = sorted(os.listdir(tmp_path))
    print(listing)
    assert [os.path.basename(p) for p in complete_checkpoints(str(tmp_path))] == ["step-000002"]
    assert any(n.startswith(".old-step-000001-") for n in listing)
    checkpoint.save(trainer, 3, str(tmp_path), keep=1)                 # the next save removes the leftover
    assert sorted(os.listdir(tmp_path)) == ["step-000003"]
    grid.free()
