"""dump.json: a crosscheck dump's files as one set, written by one run (hsgd/crosscheck/FORMAT.md).

A dump is several files written by several processes, and a folder can hold the files of two runs: one killed
half-way through its dump, another that wrote into the same folder before or after. Checked file by file, such a
mix looks like wrong arithmetic ("no simple pattern", "replicas differ"). So a dump records its run and its files:

    every file      written to a temporary name, synced and renamed (whole or absent); hsgd.crosscheck.write also
                    stamps it with the run's id: layout.json's "run", an .npz's zip archive comment
                    "hsgd-crosscheck run ID"
    dump.json       written LAST, when every other file is whole on disk (temporary name, renamed): the run's id,
                    the ranks, and every file of the dump with its size and sha256. No dump.json: an incomplete dump
    clean(DIR)      a writer's first act: the files an earlier dump left in DIR (only names a dump's files have:
                    dump.json first, then layout.json, params.npz, batch.npz, grads-rank{r}.npz and their temporary
                    names) are removed, so that a dump cut short leaves a folder without dump.json

check_set(DIR), before a byte of the dump is read (python -m hsgd.crosscheck does it first), refuses with one line
(DumpError, exit 2): no dump.json (incomplete); a listed file missing (incomplete); a listed file whose size or
sha256 differs (mixed: the file's stamp names the run that wrote it); a file with a dump's name that dump.json does
not list (mixed: a grads-rank{r}.npz beyond the ranks, a temporary file of a killed writer). A digest proves the set;
a stamp only names the other run, so the stamps are optional for another system's writer, dump.json is not.
"""
import json
import os
import re
import secrets
import stat
import time

from hsgd.files import sha256, sync_folder
from hsgd.readers import machine_memory, read_json

from .dump import DumpError, grads_file

MANIFEST = "dump.json"
SET_FORMAT, SET_VERSION = "hsgd-crosscheck-files", 1
MAX_MANIFEST = 16 << 20          # bytes of dump.json: 100 bytes a file, room for 100000 ranks
STAMP = b"hsgd-crosscheck run "  # an .npz's zip archive comment: STAMP + the run's id
RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,63}")
SHA256 = re.compile(r"[0-9a-f]{64}")
# the names of a dump's files, and their temporary names (name.tmpPID) while a writer writes them
DUMP_NAME = re.compile(r"(dump\.json|layout\.json|(params|batch|grads-rank(0|[1-9][0-9]{0,8}))\.(npz|safetensors))"
                       r"(\.tmp[0-9]{1,10})?")
ARRAYS = (".npz", ".safetensors")    # a dump's arrays: each file in either (FORMAT.md), never both
FIX = "write the dump again (into an empty folder, or let its writer clean this one: hsgd/crosscheck/FORMAT.md)"


def new_run():
    """A run's id: the UTC time it was made and 8 random hex digits, e.g. 20261203T172100Z-3f9a1c2e."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}"


def dump_files(ranks, listed=()):
    """The files of a dump of `ranks` ranks, as dump.json lists them (itself not among them): layout.json, and
    params, batch and grads-rank{r}, each .npz or, where `listed` names it so, .safetensors."""
    stems = ["params", "batch"] + [grads_file(r)[:-len(".npz")] for r in range(ranks)]
    return ["layout.json"] + [f"{n}.safetensors" if f"{n}.safetensors" in listed else f"{n}.npz" for n in stems]


def file_entry(path):
    """{"size": bytes, "sha256": hex digest} of the file at path."""
    return {"size": os.path.getsize(path), "sha256": sha256(path)}


# ------------------------------------------------------------------------------------------------ writing

def write_manifest(path, run, ranks, files):
    """dump.json in folder `path`: run, ranks and files {name: file_entry}, which must be exactly the dump's
    (dump_files(ranks)). Call it last, when every listed file is whole on disk."""
    if sorted(files) != sorted(dump_files(ranks, files)):        # (a writer's mistake, not the user's)
        raise ValueError(f"dump.json of {ranks} ranks lists {dump_files(ranks, files)}, not {sorted(files)}")
    text = json.dumps({"format": SET_FORMAT, "version": SET_VERSION, "run": run, "ranks": ranks,
                       "files": {n: files[n] for n in dump_files(ranks, files)}}, indent=1) + "\n"
    final = os.path.join(path, MANIFEST)
    tmp = f"{final}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)                                       # dump.json appears whole, after every other file
    sync_folder(path)


def seal(path, run, ranks):
    """dump.json for the dump's files as they are in `path` now (a writer that did not keep each file's entry; a
    folder written before dump.json existed)."""
    here = set(os.listdir(path))
    write_manifest(path, run, ranks, {n: file_entry(os.path.join(path, n)) for n in dump_files(ranks, here)})


def clean(path):
    """Remove what an earlier dump left in folder `path` (created if absent): dump.json first (from then on the
    folder is no dump until the new one is sealed), then every file with a dump file's name (DUMP_NAME), temporary
    names included. Nothing else is touched. Returns the names removed; DumpError if such a name is a folder."""
    os.makedirs(path, exist_ok=True)
    names = sorted((n for n in os.listdir(path) if DUMP_NAME.fullmatch(n)), key=lambda n: (n != MANIFEST, n))
    for n in names:
        p = os.path.join(path, n)
        if os.path.isdir(p) and not os.path.islink(p):
            raise DumpError(f"{p}: a folder with the name of a dump's file; remove it or choose another folder")
        os.remove(p)
    if names:
        sync_folder(path)
    return names


# ------------------------------------------------------------------------------------------------ checking

def check_set(path):
    """The manifest of the dump in folder `path` ({"run", "ranks", "files"}) once every file it lists is there, of
    its size and sha256, and no file of a dump's name is there that it does not list; DumpError (one line) naming
    what is missing or foreign otherwise."""
    if not os.path.isdir(path):
        raise DumpError(f"{path}: not a folder; give the folder a dump was written to (hsgd.train --dump-step N DIR, "
                        "or another system's writer of hsgd/crosscheck/FORMAT.md)")
    man = _manifest(path)
    run, listed = man["run"], man["files"]
    for name in dump_files(man["ranks"], listed):
        _same(path, name, listed[name], run)
    foreign = sorted((n for n in os.listdir(path) if DUMP_NAME.fullmatch(n) and n != MANIFEST and n not in listed),
                     key=lambda n: (len(n), n))
    if foreign:
        name = foreign[0]
        of = _stamp(os.path.join(path, name))
        who = f"a file of run {of}" if of and of != run else "a file of another run, or of a writer still writing"
        raise DumpError(f"{os.path.join(path, name)}: not a file of this dump (dump.json: run {run}, ranks 0.."
                        f"{man['ranks'] - 1}), {who}" + (f" (and {len(foreign) - 1} more such files)"
                                                          if len(foreign) > 1 else "") + f"; a mixed dump: {FIX}")
    return man


def _manifest(path):
    """dump.json's object, checked: a run id, ranks >= 1, and exactly the dump's files, each {"size", "sha256"}."""
    mpath = os.path.join(path, MANIFEST)
    try:
        mode = os.stat(mpath).st_mode
    except FileNotFoundError:
        left = [n for n in os.listdir(path) if DUMP_NAME.fullmatch(n)]
        raise DumpError(f"{mpath}: no such file: an incomplete dump ({len(left)} of a dump's files there; its writer "
                        f"was killed, failed or is still writing, and dump.json is written last); {FIX}") from None
    if not stat.S_ISREG(mode):
        raise DumpError(f"{mpath}: not a regular file; dump.json is the dump's list of its files (FORMAT.md)")
    man = read_json(mpath, "the dump's list of files", DumpError, max_bytes=MAX_MANIFEST)   # bounded, depth first
    if not isinstance(man, dict) or man.get("format") != SET_FORMAT or man.get("version") != SET_VERSION:
        raise DumpError(f"{mpath}: must be {{\"format\": \"{SET_FORMAT}\", \"version\": {SET_VERSION}, \"run\", "
                        "\"ranks\", \"files\"} (hsgd/crosscheck/FORMAT.md)")
    run, ranks, files = man.get("run"), man.get("ranks"), man.get("files")
    if not isinstance(run, str) or not RUN.fullmatch(run):
        raise DumpError(f"{mpath}: \"run\" must be 1 to 64 letters, digits or ._:+- (the id every file is stamped "
                        "with)")
    if not isinstance(files, dict) or isinstance(ranks, bool) or not isinstance(ranks, int) or \
            not 1 <= ranks == len(files) - 3:
        raise DumpError(f"{mpath}: \"ranks\" must be an integer >= 1 and \"files\" list layout.json, params.npz, "
                        "batch.npz and grads-rank{r}.npz for r = 0 .. ranks - 1")
    expected = dump_files(ranks, files)
    odd = sorted(set(files) - set(expected), key=lambda n: (len(n), n))
    if odd:
        raise DumpError(f"{mpath}: lists {odd[0]!r}, no file of a dump of {ranks} ranks (its files: layout.json, "
                        f"params, batch, grads-rank0..{ranks - 1}, each .npz or .safetensors)")
    for name, e in files.items():
        if not isinstance(e, dict) or isinstance(e.get("size"), bool) or not isinstance(e.get("size"), int) or \
                e["size"] < 0 or not isinstance(e.get("sha256"), str) or not SHA256.fullmatch(e["sha256"]):
            raise DumpError(f"{mpath}: {name}: must be {{\"size\": bytes, \"sha256\": 64 lowercase hex digits}}")
    total, most = sum(e["size"] for e in files.values()), machine_memory()
    if total > most:                                 # before a byte is hashed: the crosscheck reads them all to memory
        raise DumpError(f"{mpath}: lists {total} bytes of files, more than this machine's memory ({most} bytes), "
                        "which the crosscheck reads them into; check the dump on a larger machine")
    return man


def _same(path, name, entry, run):
    """DumpError unless path/name is the regular file dump.json lists: of its size and sha256."""
    p = os.path.join(path, name)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise DumpError(f"{p}: listed in dump.json (run {run}) but missing: an incomplete dump; {FIX}") from None
    if not stat.S_ISREG(st.st_mode):
        raise DumpError(f"{p}: not a regular file; a dump's files are regular files (dump.json lists them)")
    if st.st_size == entry["size"] and file_entry(p)["sha256"] == entry["sha256"]:
        return
    of = _stamp(p)
    who = f"a file of run {of}" if of and of != run else "changed since dump.json was written, or a file of another run"
    what = "size" if st.st_size != entry["size"] else "sha256"
    raise DumpError(f"{p}: its {what} is not the one dump.json (run {run}) lists: {who}; a mixed dump: {FIX}")


def _stamp(p):
    """The run id a file is stamped with (layout.json's "run", an .npz's archive comment), or None."""
    try:
        if not stat.S_ISREG(os.stat(p).st_mode):
            return None
        if os.path.basename(p).split(".tmp")[0].endswith(".json"):
            run = read_json(p, "a dump's layout", DumpError, max_bytes=MAX_MANIFEST, constants=True).get("run")
        else:
            run = npz_stamp(p)
    except (OSError, ValueError, AttributeError):                   # (DumpError is a ValueError)
        return None
    return run if isinstance(run, str) and RUN.fullmatch(run) else None


def npz_stamp(p):
    """The run id in the zip archive comment of the .npz at p, or None: read from the end of central directory
    record (the last 22 bytes, plus a comment of up to 64 KiB), nothing else of the file."""
    with open(p, "rb") as f:
        f.seek(0, os.SEEK_END)
        n = min(f.tell(), 22 + 0xFFFF)
        f.seek(-n, os.SEEK_END)
        tail = f.read(n)
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or end + 22 > len(tail):
        return None
    comment = tail[end + 22:end + 22 + int.from_bytes(tail[end + 20:end + 22], "little")]
    return comment[len(STAMP):].decode("ascii", "replace") if comment.startswith(STAMP) else None
