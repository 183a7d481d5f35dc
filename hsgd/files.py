"""Files that hsgd reads and writes, checked before they are used: an input must be a regular file (a FIFO, a device
or a terminal could block the rank reading it forever, and the others with it), an output's folder must exist and
be writable, an optional module must import. Every input file passes `regular_file`: the data, --config and
hardware files, a checkpoint's manifest and shards. Each check raises the caller's UsageError subclass with one
line that says what is wrong and what would work (chapter 11)."""
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
    """Raise error(...) unless a file can be written at `path` (its folder exists and is writable; the path is not
    a folder, or a file that cannot be written)."""
    if not isinstance(path, (str, os.PathLike)):
        raise error(f"{what} {path!r} is not a path; give a file path as a string")
    path = str(path)
    if os.path.isdir(path):
        raise error(f"{what} {path!r} is a directory; give a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise error(f"{what} {path!r}: its folder {folder!r} does not exist; create it first or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise error(f"{what} {path!r} cannot be written (permissions or a read-only file system); "
                    "choose another path")


def writable_dir(path, what, error):
    """Raise error(...) unless `path` is a writable folder, or one that can be created (its nearest existing
    ancestor is a writable folder)."""
    if not isinstance(path, (str, os.PathLike)):
        raise error(f"{what} {path!r} is not a path; give a folder path as a string")
    path = os.path.abspath(str(path))
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "exists and is not a directory" if probe == path else f"is under {probe!r}, which is a file"
        raise error(f"{what} {path!r} {where}; choose another path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise error(f"{what} {path!r} cannot be written in {probe!r} (permissions or a read-only file system); "
                    "choose another path")


def needs_module(name, why, error):
    """Raise error(...) unless the optional module `name` imports."""
    try:
        importlib.import_module(name)
    except ImportError as e:
        raise error(f"{why} needs {name}, which failed to import ({e}); pip install {name} "
                    "(or pip install -e '.[dev]'), or leave the option out") from None
