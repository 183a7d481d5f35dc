"""A crosscheck dump is one set of files of one run (hsgd.crosscheck.manifest, FORMAT.md "One set of files"): the
crosscheck refuses, with one line and exit 2 naming the file, a folder without dump.json or with a listed file
missing (incomplete), a listed file whose digest differs or a file of a dump's name it does not list (mixed, the
other run named by its stamp); a writer first removes what an earlier dump left, only files of a dump's names; and
end to end, a --dump-step folder where a first run was killed half-way holds, after a second real hsgd.train run,
exactly the second run's dump, which passes."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from hsgd.crosscheck.__main__ import main
from hsgd.crosscheck.dump import DumpError
from hsgd.crosscheck.manifest import check_set, clean, new_run, npz_stamp
from hsgd.crosscheck.write import write_rank

from .test_crosscheck import write_tp_dump

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def refused(path, capsys):
    """python -m hsgd.crosscheck path: exit 2 and one line; returns the line."""
    code = main([str(path)])
    err = capsys.readouterr().err
    print(err)
    assert code == 2 and err.count("\n") == 1 and err.startswith("hsgd: error: "), (code, err)
    return err


def flip_a_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))


def run_of(path):
    return check_set(str(path))["run"]


def test_a_whole_dump_is_stamped_and_listed(tmp_path):
    write_tp_dump(tmp_path)
    man = check_set(str(tmp_path))
    assert man["ranks"] == 4 and sorted(man["files"]) == sorted(["layout.json", "params.npz", "batch.npz"] +
                                                                 [f"grads-rank{r}.npz" for r in range(4)])
    stamps = npz_stamp(str(tmp_path / "grads-rank3.npz")), json.load(open(tmp_path / "layout.json"))["run"]
    assert stamps == (man["run"], man["run"])
    assert np.load(tmp_path / "grads-rank3.npz")["wpe"].shape == (8, 16)        # the stamp leaves the arrays be


@pytest.mark.parametrize("edit, words", [
    (lambda d, other: os.remove(d / "dump.json"),
     "dump.json: no such file: an incomplete dump (7 of a dump's files there"),
    (lambda d, other: os.remove(d / "grads-rank1.npz"), "grads-rank1.npz: listed in dump.json (run {run}) but missing"),
    (lambda d, other: shutil.copy(other / "grads-rank1.npz", d / "grads-rank1.npz"),
     "grads-rank1.npz: its sha256 is not the one dump.json (run {run}) lists: a file of run {other}"),
    (lambda d, other: flip_a_byte(d / "params.npz", 300),
     "params.npz: its sha256 is not the one dump.json (run {run}) lists: changed since dump.json was written"),
    (lambda d, other: open(d / "layout.json", "a").write(" "),
     "layout.json: its size is not the one dump.json (run {run}) lists"),
    (lambda d, other: shutil.copy(other / "grads-rank5.npz", d / "grads-rank5.npz"),
     "grads-rank5.npz: not a file of this dump (dump.json: run {run}, ranks 0..3), a file of run {other}; a mixed"),
    (lambda d, other: shutil.copy(d / "grads-rank0.npz", d / "grads-rank0.npz.tmp4242"),
     "grads-rank0.npz.tmp4242: not a file of this dump"),
    (lambda d, other: open(d / "dump.json", "w").write('{"format": "hsgd-crosscheck-files", "version": 1}'),
     "dump.json: \"run\" must be 1 to 64 letters"),
], ids=["no-manifest", "listed-missing", "other-run", "digest", "size", "extra-rank", "temporary", "bad-manifest"])
def test_an_incomplete_or_mixed_dump_is_refused_in_one_line(tmp_path, capsys, edit, words):
    d, other = tmp_path / "d", tmp_path / "other"
    write_tp_dump(other, dp=3)                                # another run, of 6 ranks
    write_tp_dump(d)
    expect = words.format(run=run_of(d), other=run_of(other))
    edit(d, other)
    line = refused(d, capsys)
    assert expect in line and str(d) in line


def manifest(text):
    def edit(d, other):
        (d / "dump.json").write_text(text(json.load(open(d / "dump.json"))))
    return edit


@pytest.mark.parametrize("edit, words", [
    (lambda d, other: (os.remove(d / "batch.npz"), os.mkfifo(d / "batch.npz")), "batch.npz: not a regular file"),
    (lambda d, other: (os.remove(d / "dump.json"), os.mkfifo(d / "dump.json")), "dump.json: not a regular file"),
    (manifest(lambda m: json.dumps(m).replace('"size": ', '"size": NaN, "x": ', 1)), "NaN is not a finite number"),
    (manifest(lambda m: "[" * 100000 + "]" * 100000), "nests arrays or tables 100000 deep"),
    (manifest(lambda m: json.dumps({**m, "ranks": 10 ** 12})), "\"ranks\" must be an integer >= 1 and \"files\""),
    (manifest(lambda m: json.dumps(m).replace('"ranks": 4', '"ranks": ' + "9" * 5000)), "an integer of 5000 digits"),
    (manifest(lambda m: json.dumps({**m, "files": {**m["files"], "../grads-rank4.npz": {}},
                                    "ranks": 5})), "lists '../grads-rank4.npz', no file of a dump of 5 ranks"),
    (manifest(lambda m: json.dumps({**m, "files": {**m["files"], "layout.json": {"size": True, "sha256": "0"}}})),
     "layout.json: must be {\"size\": bytes"),
    (manifest(lambda m: json.dumps({**m, "version": 2})), "must be {\"format\": \"hsgd-crosscheck-files\", "
                                                           "\"version\": 1, \"run\", \"ranks\", \"files\"} ("),
    (manifest(lambda m: json.dumps({**m, "files": {**m["files"], "params.npz": {**m["files"]["params.npz"],
                                                                                "size": 10 ** 15}}})),
     "bytes of files, more than this machine's memory"),
], ids=["fifo-file", "fifo-manifest", "nan", "deep", "huge-ranks", "5000-digits", "path", "size-bool", "version",
        "petabyte"])
def test_a_crafted_dump_json_is_refused_in_one_line_at_once(tmp_path, capsys, edit, words):
    write_tp_dump(tmp_path)
    edit(tmp_path, None)
    assert words in refused(tmp_path, capsys)


def test_a_dump_without_dump_json_is_not_read_at_all(tmp_path, capsys):
    """An external writer of the old format: its files whole and right, no dump.json: refused before any is read,
    and the fix named."""
    write_tp_dump(tmp_path)
    os.remove(tmp_path / "dump.json")
    line = refused(tmp_path, capsys)
    assert "write the dump again" in line and "FORMAT.md" in line


def test_clean_removes_an_earlier_dumps_files_and_nothing_else(tmp_path):
    write_tp_dump(tmp_path, dp=3)                             # 6 ranks, and a killed writer's temporary file
    (tmp_path / "layout.json.tmp99").write_text("{")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "grads-rank1.npz.bak").write_text("mine")
    removed = clean(str(tmp_path))
    assert removed[0] == "dump.json" and len(removed) == 11
    assert sorted(os.listdir(tmp_path)) == ["grads-rank1.npz.bak", "notes.txt"]
    os.mkdir(tmp_path / "params.npz")
    with pytest.raises(DumpError, match="params.npz: a folder with the name of a dump's file"):
        clean(str(tmp_path))


def test_leftovers_of_a_killed_dump_are_cleaned_by_the_next_writer(tmp_path, capsys):
    """A dump cut short after its writer cleaned (a second run killed while it wrote over a whole first dump) is
    refused as incomplete; the next writer removes its leftovers, the set is whole again."""
    write_tp_dump(tmp_path)                                   # run 1: whole
    clean(str(tmp_path))                                      # run 2 starts its dump ...
    killed = new_run()
    write_rank(str(tmp_path), 1, {"wpe": np.ones((8, 16))}, killed)           # ... and is killed after one file
    assert "no such file: an incomplete dump (1 of a dump's files there" in refused(tmp_path, capsys)
    write_tp_dump(tmp_path, tp=1, dp=1)                       # run 3: one rank, written over the leftovers
    assert "grads-rank1.npz: not a file of this dump (dump.json: run" in refused(tmp_path, capsys)
    assert f"a file of run {killed}" in refused(tmp_path, capsys)       # (write_tp_dump does not clean: a writer must)
    clean(str(tmp_path))
    write_tp_dump(tmp_path, tp=1, dp=1)
    assert main([str(tmp_path)]) == 0 and sorted(os.listdir(tmp_path)) == [
        "batch.npz", "dump.json", "grads-rank0.npz", "layout.json", "params.npz"]


@pytest.mark.timeout(120)
def test_two_dump_step_runs_into_one_folder_the_first_killed(tmp_path, capsys):
    """hsgd.train --dump-step 1 DIR where a first run (4 ranks) was killed half-way through its dump: its leftovers
    (three ranks' files, a temporary layout.json, no dump.json) are refused as incomplete; a second, real run (one
    rank) removes them and says so, and its dump alone is there and passes."""
    d = tmp_path / "d"
    write_tp_dump(d)                                          # the first run's files, as a killed run leaves them:
    os.remove(d / "dump.json")                                # not sealed,
    os.remove(d / "grads-rank0.npz")                          # rank 0 not done,
    os.replace(d / "layout.json", d / "layout.json.tmp31337")  # its layout half-written
    assert "an incomplete dump (6 of a dump's files there" in refused(d, capsys)
    r = subprocess.run([sys.executable, "-m", "hsgd.train", "--batch-size", "4", "--seq-len", "8", "--d-model", "16",
                        "--n-layers", "1", "--n-heads", "2", "--d-ff", "16", "--dtype", "float64", "--steps", "1",
                        "--sample-bytes", "0", "--eval-batches", "1", "--dump-step", "1", str(d)],
                       capture_output=True, text=True, cwd=ROOT, timeout=100,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    print(r.stdout[-1500:], r.stderr[-1500:])
    assert r.returncode == 0 and "it replaced an earlier dump's 6 files there" in r.stdout
    assert sorted(os.listdir(d)) == ["batch.npz", "dump.json", "grads-rank0.npz", "layout.json", "params.npz"]
    assert main([str(d)]) == 0 and "PASS" in capsys.readouterr().out
