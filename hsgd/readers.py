"""Bounded readers of what is inside a file that may have been crafted (chapter 19). Every reader bounds its work by
the file's size and its nesting before it parses, and refuses by name what would overflow later; every later reader
of a file (a flag's file, a checkpoint, a dump, a hardware file) should use them:
    read_json(path, what, error)    a size bound checked before reading, a nesting bound checked by a linear pass
    read_toml(path, what, error)    before parsing, integers of at most 20 digits, no NaN, infinity or 1e400
    Npz(path, what, error, ...)     an .npz whose every member's header is checked (numbers only, the expected
                                    shape, the zip entry's uncompressed size, a bound on all bytes) before any
                                    array is read
    printable(text)                 text from a file, escaped (ESC -> \\x1b) and cut, for printing
Only regular files are opened (hsgd.files.regular_file, checked again after opening). Left out: bounds on the number
of an .npz's members or of a JSON file's keys (the size bound covers them).
"""
import json
import math
import os
import re
import stat
import zipfile
import zlib

import numpy as np

from hsgd.files import regular_file

try:
    import tomllib
except ImportError:                                  # Python < 3.11
    import tomli as tomllib


MAX_DEPTH = 64                  # nesting of JSON arrays and objects, TOML arrays and tables: hsgd's own use < 10
MAX_DIGITS = 20                 # digits of an integer in JSON or TOML: 10^20 is beyond every count hsgd takes
MAX_NUMBER_TEXT = 100           # characters of one run of digits in TOML (Python's int() stops at 4300 digits)
MAX_TEXT_SHOWN = 200            # characters of a file's text that printable() shows


class Refused(Exception):
    """A number a reader refuses (raised inside a parser, reported as the caller's error)."""


def opened(path, what, error):
    """A binary file object of the regular file at `path`, opened without blocking and checked again after opening
    (a FIFO swapped in between regular_file and the open would block the reader forever)."""
    regular_file(path, what, error)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"{what} {str(path)!r} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{what} {str(path)!r} was replaced by something that is not a regular file; pass a regular file")
    return os.fdopen(fd, "rb")


def read_bytes(path, what, error, max_bytes):
    """The bytes of the regular file at `path`; error(...) naming its size, before reading it, if it has more than
    max_bytes (a 2 GB sparse file), or if it grows past them while being read."""
    with opened(path, what, error) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise error(f"{what} {str(path)!r} is {size} bytes, more than the {max_bytes} such a file may have; "
                        "pass the right file")
        chunks, n, want = [], 0, size + 1                  # (read(n) would allocate all n bytes first)
        try:
            while n <= max_bytes:
                chunks.append(f.read(min(want, max_bytes + 1 - n)))
                if not chunks[-1]:
                    break
                n, want = n + len(chunks[-1]), 1 << 20
        except OSError as e:
            raise error(f"{what} {str(path)!r} cannot be read ({e.strerror})") from None
        data = b"".join(chunks)
    if len(data) > max_bytes:
        raise error(f"{what} {str(path)!r} grew past {max_bytes} bytes while it was read; pass a file that stays put")
    return data


def read_text(path, what, error, max_bytes):
    """read_bytes as UTF-8 text."""
    try:
        return read_bytes(path, what, error, max_bytes).decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {str(path)!r} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None


def deepest(brackets):
    """The deepest nesting of a text of brackets only ("[{}][]" -> 2): one pass, in NumPy."""
    if not brackets:
        return 0
    codes = np.frombuffer(brackets.encode("ascii"), np.uint8)
    return int(np.cumsum(np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)).max())


def check_depth(text, strings, where, error, max_depth):
    """error(...) if the brackets of `text` outside what the regular expression `strings` matches (strings,
    comments) nest deeper than max_depth: the linear pass that runs before a recursive parser would."""
    depth = deepest(NOT_BRACKETS.sub("", strings.sub("", text)))
    if depth > max_depth:
        raise error(f"{where} nests arrays or tables {depth} deep, more than the {max_depth} hsgd reads; "
                    "pass the right file")


NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
JSON_STRINGS = re.compile(r'"(?:[^"\\\x00-\x1f]|\\.)*"?', re.S)       # to its closing quote, or where it breaks off
TOML_SKIPPED = re.compile("|".join((
    r'"""(?:[^"\\]|\\[\s\S]|"{1,2}(?!"))*(?:"{3,5}|\\?\Z)',           # multi-line basic string
    r"'''(?:[^']|'{1,2}(?!'))*(?:'{3,5}|\Z)",                        # multi-line literal string
    r'"(?:[^"\\\n]|\\.)*"?',                                          # basic string, to its end or the line's
    r"'[^'\n]*'?",                                                     # literal string
    r"#[^\n]*")))                                                      # comment


def refuse_integer(text, max_digits=MAX_DIGITS):
    """int(text), unless it has more than max_digits digits (Refused)."""
    digits = len(text.lstrip("+-").replace("_", ""))
    if digits > max_digits:
        raise Refused(f"an integer of {digits} digits ({text[:12]}...), more than the {max_digits} hsgd reads")
    return int(text)


def finite_float(text):
    """float(text), unless it is NaN or infinite, or overflows to infinity (1e400) (Refused)."""
    value = float(text)
    if math.isfinite(value):
        return value
    overflow = " (it overflows a float)" if text.lstrip("+-")[:1].isdigit() else ""      # 1e400, not nan or inf
    raise Refused(f"the number {text[:24]} is not finite{overflow}; write a finite number")


def refuse_constant(text):
    raise Refused(f"{text} is not a finite number; write a finite number")


def read_json(path, what, error, max_bytes=64 << 20, max_depth=MAX_DEPTH, max_digits=MAX_DIGITS, constants=False):
    """The value in the JSON file at `path`: a regular file of at most max_bytes, nested at most max_depth deep
    (checked by a linear pass before parsing), without integers of more than max_digits digits, numbers that
    overflow (1e400), or NaN and Infinity unless `constants` (Python's json writes them for a float that is not
    finite: a dump's loss may be NaN, and saying so is the crosscheck's verdict). Anything else: error(...) naming
    `what`, in one line."""
    text = read_text(path, what, error, max_bytes)
    where = f"{what} {str(path)!r}"
    check_depth(text, JSON_STRINGS, where, error, max_depth)
    try:
        return json.loads(text, parse_int=lambda s: refuse_integer(s, max_digits), parse_float=finite_float,
                          parse_constant=float if constants else refuse_constant)
    except Refused as e:
        raise error(f"{where}: {e}") from None
    except RecursionError:                                  # (not reached: check_depth comes first)
        raise error(f"{where} nests too deep; pass the right file") from None
    except ValueError as e:
        raise error(f"{where} cannot be read: it is not valid JSON ({e})") from None


def read_toml(path, what, error, max_bytes=1 << 20, max_depth=MAX_DEPTH, max_digits=MAX_DIGITS):
    """The table in the TOML file at `path`, bounded as read_json's value is (1 MiB by default; dotted keys nest
    too: their parts are counted before parsing, and the table is walked for its depth after, without recursion).
    Anything else: error(...) naming `what`, in one line."""
    text = read_text(path, what, error, max_bytes)
    where = f"{what} {str(path)!r}"
    outside = TOML_SKIPPED.sub("", text)
    check_depth(outside, NOT_BRACKETS, where, error, max_depth)        # (strings and comments already gone)
    dots = re.search(r"\.{%d,}" % (max_depth + 1), re.sub(r"[\w \t-]+", "", outside))   # a.b. "c" .d -> ...
    if dots:                                             # a.b.c = 1 nests as deep (and tomllib takes its square)
        raise error(f"{where}: a dotted key of more than {max_depth} parts; pass the right file")
    run = re.search(r"[0-9][0-9_]{%d,}" % MAX_NUMBER_TEXT, outside)
    if run:
        raise error(f"{where}: a number of {len(run.group())} digits, more than the {MAX_NUMBER_TEXT} hsgd reads")
    try:
        table = tomllib.loads(text, parse_float=finite_float)
    except Refused as e:
        raise error(f"{where}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{where} cannot be read: it is not valid TOML ({e})") from None
    except (RecursionError, ValueError) as e:              # (not reached: the checks above come first)
        raise error(f"{where} cannot be read ({type(e).__name__}); pass the right file") from None
    stack = [(table, 0)]
    while stack:                                             # depth and integers of the parsed table
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise error(f"{where} nests tables or arrays more than {max_depth} deep; pass the right file")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** max_digits:
            raise error(f"{where}: an integer of more than {max_digits} digits; hsgd reads none that large")
    return table


def printable(text, limit=MAX_TEXT_SHOWN):
    """Text from a file, safe to print: control characters, escape codes and other invisible characters written
    as escapes (ESC -> \\x1b, U+202E -> \\u202e, a backslash doubled), at most `limit` characters of it. A file's
    text printed raw could move the cursor, clear the screen and draw a fake verdict."""
    text = text if isinstance(text, str) else repr(text)
    shown = "".join(escaped(c) for c in text[:limit])
    return shown + (f"... ({len(text)} characters)" if len(text) > limit else "")


SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escaped(c):
    """One character as printable() writes it."""
    if c == "\\":
        return "\\\\"
    if c.isprintable():
        return c
    if c in SHORT_ESCAPES:
        return SHORT_ESCAPES[c]
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def machine_memory():
    """Bytes of memory of this machine (the bound of a read whose size no file or flag states; the planner's
    calibration of this machine): MemTotal of /proc/meminfo, else what sysconf says, else 1 TiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024              # the file says kB and means KiB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


UNREADABLE = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, OSError, EOFError, ValueError, TypeError,
              SyntaxError, NotImplementedError, RuntimeError)         # what zipfile and NumPy raise on a bad file


class Npz:
    """The arrays of an .npz file (numpy.savez), each member's header checked when the file is opened, before any
    array is read: a .npy (never a pickle, never an object array) of numbers, of its expected shape (shapes: {name:
    shape}, optional), the member's uncompressed size (its zip entry's file_size) exactly the header's bytes plus
    the array's, and all the arrays together at most max_bytes. A 3 MB archive that would expand to 3 GB, or a
    header that declares a giant shape, is refused from the headers. Arrays are read when asked for, npz[name].

        with Npz(path, "checkpoint file", CheckpointError, max_bytes=2**30) as z:
            z.files, z.shapes["param/wte"], z["param/wte"]
    """

    KINDS = "biufc"                       # bool, integers, floats, complex: arrays of numbers

    def __init__(self, path, what, error, shapes=None, max_bytes=None):
        self.path, self.what, self.error = str(path), what, error
        self.where = f"{what} {self.path!r}"
        self.file, self.zip = opened(path, what, error), None
        try:
            if self.file.read(6) == b"\x93NUMPY":
                raise Refused("one array (.npy), not an .npz archive of named arrays; write it with numpy.savez")
            self.file.seek(0)
            self.zip = zipfile.ZipFile(self.file)
            self.members, self.shapes, self.dtypes = self.headers(shapes or {}, machine_memory() if max_bytes is None
                                                                  else max_bytes)
        except Refused as e:
            self.close()
            raise error(f"{self.where}: {e}") from None
        except UNREADABLE as e:
            self.close()
            raise error(f"{self.where} cannot be read: it is not an .npz file NumPy can read without pickle "
                        f"({type(e).__name__}: {printable(str(e), 120)}); write it with numpy.savez") from None
        except BaseException:
            self.close()
            raise
        self.files = list(self.members)

    def headers(self, shapes, max_bytes):
        """({name: ZipInfo}, {name: shape}, {name: dtype}) of the members, every header checked (see the class)."""
        members, found, dtypes, total = {}, {}, {}, 0
        for info in self.zip.infolist():
            name = info.filename[:-4]
            if not info.filename.endswith(".npy") or name in members:
                raise Refused(f"member {printable(info.filename, 80)!r} is not a .npy array; an .npz holds "
                              "only arrays (numpy.savez)")
            with self.zip.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version not in ((1, 0), (2, 0)):
                    raise Refused(f"{name} is a .npy of version {version}; numpy.savez writes 1.0")
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f)
                offset = f.tell()
            if dtype.hasobject:
                raise Refused(f"{name} holds Python objects, which cannot be read without pickle; write arrays of "
                              "numbers")
            if dtype.kind not in self.KINDS or dtype.fields is not None:
                raise Refused(f"{name} is of dtype {printable(str(dtype), 60)}; write arrays of numbers (no strings "
                              "or records)")
            if name in shapes and tuple(shape) != tuple(shapes[name]):
                raise Refused(f"{name} declares shape {shape}, {tuple(shapes[name])} expected")
            if any(n < 0 for n in shape):
                raise Refused(f"{name} declares shape {shape}; lengths are >= 0")
            nbytes = math.prod(shape) * dtype.itemsize
            if info.file_size != offset + nbytes:
                raise Refused(f"{name} declares {nbytes} bytes of shape {shape} but its zip entry "
                              f"holds {info.file_size - offset}; the file is corrupt or crafted")
            total += nbytes
            if total > max_bytes:
                raise Refused(f"its arrays declare more than {max_bytes} bytes ({name}: {shape} "
                              f"{dtype}), more than this file may hold; pass the right file")
            members[name], found[name], dtypes[name] = info, tuple(shape), dtype
        return members, found, dtypes

    def __contains__(self, name):
        return name in self.members

    def __getitem__(self, name):
        """The array `name`, read now (its header was checked when the file was opened)."""
        info = self.members[name]
        try:
            with self.zip.open(info) as f:
                return np.lib.format.read_array(f, allow_pickle=False)
        except UNREADABLE as e:
            raise self.error(f"{self.where}: {name} cannot be read ({type(e).__name__}: {printable(str(e), 120)}); "
                             "the file is corrupt") from None

    def close(self):
        if getattr(self, "zip", None) is not None:
            self.zip.close()
        if getattr(self, "file", None) is not None:
            self.file.close()                               # (a ZipFile leaves a file object it was given open)

    __del__ = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
