"""Whose checkpoints are in a save folder: lines of runs, and the lock that keeps a second job out.

A save folder can hold the checkpoints of more than one run: a run and its resumptions, an abandoned attempt, a
branch resumed from an older checkpoint. Ranking them by step number alone loses work: a fresh run into a folder
that holds a higher step has its own checkpoints rotated away as soon as it writes them, and a resume from an older
checkpoint deletes the one it started from while `--resume auto` later picks up the abandoned run. So every
checkpoint records its **line** (`manifest["run"]["line"]`, a random id), the id of the run that wrote it and the
checkpoint that run started from:

* a fresh run starts a new line; into a folder that already holds checkpoints only with `--overwrite`;
* a run resumed from the newest checkpoint of a line continues that line; resumed from an older one, it starts a
  new line (a branch), and the checkpoint it started from stays;
* rotation (`--keep K`) keeps the newest K checkpoints of the writing run's own line, and touches no other;
* `--resume auto` and a save folder given as a checkpoint follow the newest line (the one written last, by the
  manifests' `written_ns`), and take its highest step.

A checkpoint of a branch with the step number of one in another line replaces it (the names are `step-NNNNNN`).

`FolderLock`: rank 0 holds `save_dir/.hsgd-lock` (host and pid) while a run trains; a second job on the same folder
is refused, unless the holder is a process of this host that no longer runs (a job that was killed), whose
lock is taken over. A killed job's ranks are zombies for a moment after `kill -9` of mpirun (exited, not yet
collected): they do not count as running (`alive`), so a requeue right after the kill resumes.
"""
import json
import os
import secrets
import socket
import time

from hsgd.errors import ConfigError
from hsgd.readers import read_json

DEFAULT_LINE = "default"        # checkpoints saved from Python without a line (tutorials, tests)
ZOMBIE_WAIT_S = 2.0             # without /proc: how long a lock's holder that still exists is given to go away
MAX_MANIFEST_BYTES = 16 << 20   # manifest.json: about 200 bytes per shard file, so room for 80000 of them


def random_id():
    """A new line's or run's id: 16 hex digits."""
    return secrets.token_hex(8)


def read_run(path):
    """(line, written_ns) of the checkpoint at path, from its manifest; (None, 0) if it cannot be read."""
    try:
        m = read_json(os.path.join(path, "manifest.json"), "checkpoint manifest", ValueError,
                      max_bytes=MAX_MANIFEST_BYTES)            # bounded: a FIFO or /dev/zero there is unreadable
        run = m.get("run", {})
        return str(run.get("line", DEFAULT_LINE)), int(m.get("written_ns", 0))
    except (OSError, ValueError, AttributeError, TypeError):
        return None, 0


def complete_checkpoints(save_dir):
    """The complete checkpoints in save_dir (those with a manifest), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    dirs = [d for d in os.listdir(save_dir) if d.startswith("step-") and d[5:].isdigit()]
    dirs.sort(key=lambda d: int(d[5:]))                                 # by step: step-1000000 after step-999999
    return [os.path.join(save_dir, d) for d in dirs if os.path.exists(os.path.join(save_dir, d, "manifest.json"))]


def lines(checkpoints):
    """{line: [paths, by step]} of the given complete checkpoints (listed by step)."""
    out = {}
    for path in checkpoints:
        line, _ = read_run(path)
        out.setdefault(line, []).append(path)
    return out


def newest(checkpoints):
    """The checkpoint to resume: the highest step of the line written last; None if there is none."""
    if not checkpoints:
        return None
    written = {path: read_run(path) for path in checkpoints}
    last_line = max(written.values(), key=lambda lw: lw[1])[0]
    return [p for p in checkpoints if written[p][0] == last_line][-1]


def own(checkpoints, line):
    """The checkpoints of `line`, by step."""
    return lines(checkpoints).get(line, [])


def line_to_write(manifest, checkpoints):
    """The line a run resumed from `manifest` writes into: the checkpoint's own line if it is that line's newest
    checkpoint (a continuation), else a new one (a branch)."""
    line, _ = read_run(manifest["path"])
    mine = own(checkpoints, line)
    if mine and os.path.samefile(mine[-1], manifest["path"]):
        return line
    return random_id()


class FolderLock:
    """Rank 0's lock on a save folder while a run trains (see the module docstring)."""

    def __init__(self, save_dir):
        self.path = os.path.join(save_dir, ".hsgd-lock")
        self.held = self.created = False

    def acquire(self):
        self.created = not os.path.exists(os.path.dirname(self.path))    # removed again if the run writes nothing
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self.take_over_if_stale(me)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise ConfigError(f"cannot lock {self.path!r}; try again")

    def take_over_if_stale(self, me):
        try:
            holder = read_json(self.path, "lock file", ValueError, max_bytes=4096)   # {"host", "pid"}: small
            host, pid = holder["host"], int(holder["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            host, pid = None, None
        if host == me["host"] and not alive(pid):
            os.remove(self.path)                                    # a killed job's lock: ours now
            return
        where = f"process {pid} on {host}" if host else "an unreadable lock"
        raise ConfigError(f"another job is using the save folder {os.path.dirname(self.path)!r} ({where}); wait for it "
                          f"to end or choose another --save-dir (if no job runs there, delete {self.path!r})")

    def release(self):
        if self.held:
            try:
                os.remove(self.path)
                if self.created:
                    os.rmdir(os.path.dirname(self.path))                 # only if empty: OSError otherwise
            except OSError:
                pass
            self.held = False


def alive(pid, wait=ZOMBIE_WAIT_S):
    """Whether process `pid` of this host still runs. A zombie (it has exited, its parent has not collected it yet:
    the ranks of an mpirun killed with SIGKILL, for a moment) does not: with /proc, its state says so ('Z', or 'X'
    while it goes); without /proc (macOS), a process that still exists is given `wait` seconds to go away. A pid
    that no process can have (0 or less: kill() would signal a group) is not alive."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    deadline = time.monotonic() + wait
    while True:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, OverflowError):
            return False
        except PermissionError:
            return True                                                 # another user's process: it exists
        state = proc_state(pid)
        if state is not None:
            return state not in ("Z", "X")
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)


def proc_state(pid):
    """The one-letter state of process pid from /proc/<pid>/stat ("pid (name) S ..."; the name may hold spaces and
    parentheses, so the state is the first word after the last ')'), or None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read(4096).decode("ascii", "replace")
    except OSError:
        return None if not os.path.isdir("/proc/self") else "X"           # gone between kill() and here
    return text.rpartition(")")[2].split()[0] if ")" in text else None


def lock_folder(tc):
    """Rank 0, before a run reads or writes its --save-dir: the folder's lock (None without --save-dir)."""
    if not tc.save_dir:
        return None
    lock = FolderLock(tc.save_dir)
    lock.acquire()
    return lock


def choose_line(tc, manifest):
    """Rank 0: the identity of this run that its checkpoints record, {"line", "id", "started_from"} (see the module
    docstring): id is this run's own, started_from the checkpoint it resumed from. manifest: that checkpoint's, or
    None for a fresh run, which is refused in a folder holding checkpoints unless --overwrite."""
    if manifest is not None:
        folder = os.path.dirname(manifest["path"])
        return {"line": line_to_write(manifest, complete_checkpoints(folder)), "id": random_id(),
                "started_from": os.path.basename(manifest["path"])}
    found = complete_checkpoints(tc.save_dir) if tc.save_dir else []
    if found and not tc.overwrite:
        raise ConfigError(f"--save-dir {tc.save_dir!r} holds checkpoints of another run (the newest: "
                          f"{os.path.basename(newest(found))}); continue it with --resume auto, choose another "
                          "--save-dir, or pass --overwrite to start a new run beside them")
    return {"line": random_id(), "id": random_id(), "started_from": None}
