"""Files that hsgd reads and writes, checked before they are used: an input must be a regular file (a FIFO, a device
or a terminal could block the rank reading it forever, and the others with it), an output must be proved writable
by creating and removing a file there before any work (os.access says yes where nothing can be created: /proc, a
read-only bind mount, a name too long), an optional module must import. Every input file passes `regular_file`: the
data, --config and hardware files, a checkpoint's manifest and shards, a dump's files. Each check raises the
caller's UsageError subclass with one line that says what is wrong and what would work (chapter 19). What is inside
a file is read by hsgd.readers, whose readers bound the work before they parse.
"""

import errno
import hashlib
import importlib
import os
import stat


def regular_file(path, what, error):
    """Raise error(...) unless `path` names an existing regular file. what: how the message names it ("data
    file", "config file", ...); error: the UsageError subclass to raise."""
    if not isinstance(path, (str, os.PathLike)):
        raise error(f"{what} {path!r} is not a path; give the file's path as a string")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise error(f"{what} {str(path)!r} does not exist") from None
    except OSError as e:
        raise error(f"{what} {str(path)!r} cannot be read ({e.strerror})") from None
    if stat.S_ISDIR(mode):
        raise error(f"{what} {str(path)!r} is a directory; pass a file")
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
        raise error(f"{what} {str(path)!r} is {kind}, whose reading could block or never end; pass a regular file")


def writable_file(path, what, error):
    """Raise error(...) unless a file can be written at `path`, proved before any work by doing it: a regular file
    there is opened to append (nothing written, nothing truncated); where nothing is, a probe with a name of its
    own and of the same length is created beside it and removed. os.access() is not proof: it says yes under /proc
    and /sys, on a read-only bind mount, and for a name longer than the file system allows. Every rank of a job may
    check the same path at once: no rank creates or removes the path itself, so no rank sees another's probe."""
    if not isinstance(path, (str, os.PathLike)):
        raise error(f"{what} {path!r} is not a path; give a file path as a string")
    path = str(path)
    if os.path.isdir(path):
        raise error(f"{what} {path!r} is a directory; give a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        if os.path.exists(folder):
            raise error(f"{what} {path!r}: its folder {folder!r} is a file; choose another path")
        raise error(f"{what} {path!r}: its folder {folder!r} does not exist; create it first or choose another path")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except (OSError, ValueError) as e:                # a name too long, a NUL byte
        raise error(f"{what} {path!r} cannot be written ({getattr(e, 'strerror', None) or e}); choose another path") \
            from None
    if mode is not None and not stat.S_ISREG(mode):
        raise error(f"{what} {path!r} is not a regular file (a FIFO or a device, whose writing could block); give "
                    "the path of a file")
    try:
        if mode is not None:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_APPEND))      # there: opened, not touched
            return
        name = f".hsgd-probe-{os.getpid()}-{os.urandom(4).hex()}"
        probe = os.path.join(folder, name + "-" * max(0, len(os.path.basename(path).encode()) - len(name)))
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.unlink(probe)                                                           # created and removed
    except (OSError, ValueError) as e:
        raise error(f"{what} {path!r} cannot be written (a file there could not be {'opened' if mode else 'created'}: "
                    f"{getattr(e, 'strerror', None) or e}); choose another path") from None


def writable_dir(path, what, error):
    """Raise error(...) unless `path` is a folder in which a file can be created, or a folder that can be created,
    proved before any work by doing it: a probe file is created and removed in it; for a folder not there yet, a
    probe folder is created in its nearest existing ancestor, the missing folders (the same names) inside it and a
    file in the innermost, then all removed. Nothing is left, and every rank of a job may check the same path at
    once (each probe has a name of its own)."""
    if not isinstance(path, (str, os.PathLike)):
        raise error(f"{what} {path!r} is not a path; give a folder path as a string")
    path = os.path.abspath(str(path))
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "exists and is not a directory" if probe == path else f"is under {probe!r}, which is a file"
        raise error(f"{what} {path!r} {where}; choose another path")
    mine = os.path.join(probe, f".hsgd-probe-{os.getpid()}-{os.urandom(4).hex()}")
    missing = [] if probe == path else os.path.relpath(path, probe).split(os.sep)
    folders = [os.path.join(mine, *missing[:i]) for i in range(len(missing) + 1)] if missing else []
    file = os.path.join(folders[-1], "probe") if missing else mine
    try:
        try:
            for f in folders:
                os.mkdir(f)
            os.close(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        finally:                                     # remove what was made, innermost first
            for made in [file] + folders[::-1]:
                if os.path.lexists(made):
                    (os.rmdir if made in folders else os.unlink)(made)
    except (OSError, ValueError) as e:
        raise error(f"{what} {path!r} cannot be written in {probe!r} (a probe there could not be created: "
                    f"{getattr(e, 'strerror', None) or e}); choose another path") from None


def needs_module(name, why, error):
    """Raise error(...) unless the optional module `name` imports."""
    try:
        importlib.import_module(name)
    except ImportError as e:
        raise error(f"{why} needs {name}, which failed to import ({e}); pip install {name} "
                    "(or pip install -e '.[dev]'), or leave the option out") from None


def sha256(path):
    """The hex SHA-256 of the file at `path`, read in 1 MiB pieces (a checkpoint's shards, a dump's files)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sync_folder(path):
    """fsync the folder `path`, so that the names created or renamed in it are on disk (a file system that cannot
    sync a folder, EINVAL or ENOTSUP, is left as it is; any other error is raised)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
