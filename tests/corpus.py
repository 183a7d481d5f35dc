"""The crafted-file corpus: files made to break hsgd's readers (Step 19), built in a folder, each handed in-process
to the reader that would meet it, each expected to be refused with one line (a UsageError) in bounded time and
memory, or, for text that is printed, to come out escaped.

    python tests/corpus.py          build the corpus in a temporary folder and try every case; exit 1 if one fails
    python tests/corpus.py --big    the same with the zip bomb at full size: a 2.9 MB params.npz whose array
                                    declares 2.96 GB (the size the issue found)

What is in it: JSON nested 200000 deep, TOML nested 100000 deep (arrays, dotted keys, table headers), integers of
5000 digits, 1e400, NaN, a symlink to /dev/zero, a sparse 2 GB file (os.truncate: no disk used), a FIFO, an .npz
whose header declares a giant shape, a zip bomb (zeros, deflated), hardware files with subnormal, zero, absurd and
non-ASCII-digit numbers, a dump and a hardware file whose names carry escape codes. tests/test_readers.py runs
every case (and two of them end to end, through the commands).

Each case: Case(name, read, words): read() must raise a UsageError whose message holds `words`, within
TIME_LIMIT seconds and with at most `memory` bytes at peak (tracemalloc, which sees NumPy's arrays too); a case
with `printed` instead returns the text a command printed, which must hold `printed` and no control character.
"""
import contextlib
import io
import json
import os
import struct
import sys
import tempfile
import time
import tracemalloc
import zipfile
import zlib
from dataclasses import dataclass

import numpy as np

if __name__ == "__main__":                                      # python tests/corpus.py: hsgd from this checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hsgd.errors import UsageError                              # noqa: E402
from hsgd.model.config import ModelConfig                       # noqa: E402

TIME_LIMIT = 2.0                 # seconds a case may take
MEMORY = 32 << 20                # bytes a case may allocate at peak (tracemalloc)
GIANT = 10 ** 12                 # elements an .npz header declares: 8 TB of float64
BOMB_SMALL = 300 << 20           # bytes the test's zip bomb expands to (0.3 MB on disk)
BOMB_BIG = 2_960_000_000         # the issue's: 2.96 GB from 2.9 MB
TINY = ModelConfig(vocab_size=37, seq_len=8, d_model=16, n_heads=4, n_layers=1, d_ff=32)


@dataclass
class Case:
    name: str
    read: object                 # () -> the text printed (printed cases); else must raise a UsageError
    words: str = ""              # in the refusal's message
    printed: str = ""            # printed cases: in the output, which holds no control character but \n
    memory: int = MEMORY


# ---------------------------------------------------------------------------------------------------- crafting

def write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


def sparse(path, size=2 << 30):
    """A file of `size` bytes that takes no disk (a hole)."""
    open(path, "wb").close()
    os.truncate(path, size)
    return str(path)


def zero_link(path):
    os.symlink("/dev/zero", path)
    return str(path)


def fifo(path):
    os.mkfifo(path)
    return str(path)


def npy_header(shape, dtype="<f8"):
    """The bytes of a .npy header (format 1.0) declaring `shape`: what numpy.save writes before the data."""
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": dtype, "fortran_order": False, "shape": tuple(shape)})
    return f.getvalue()


def giant_header_npz(path, name, elements=GIANT):
    """An .npz whose member `name` declares `elements` float64 (8 TB) and holds 16 bytes."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.npy", npy_header((elements,)) + bytes(16))
    return str(path)


def zip_bomb_npz(path, name, nbytes):
    """An .npz whose member `name` is a true .npy of nbytes / 8 float64 zeros, deflated: about nbytes / 1000 on
    disk. Built without compressing nbytes: after a full flush deflate starts afresh, so every 16 MiB block of zeros
    compresses to the same bytes, written as often as needed."""
    head = npy_header((nbytes // 8,))
    block = 16 << 20
    total = len(head) + nbytes // 8 * 8
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = c.compress(head + bytes(block - len(head))) + c.flush(zlib.Z_FULL_FLUSH)
    middle = c.compress(bytes(block)) + c.flush(zlib.Z_FULL_FLUSH)
    n_middle, rest = divmod(total - block, block)
    last = c.compress(bytes(rest)) + c.flush()
    crc, zeros = zlib.crc32(head + bytes(block - len(head))), bytes(block)
    for _ in range(n_middle):
        crc = zlib.crc32(zeros, crc)
    crc = zlib.crc32(bytes(rest), crc)
    size = len(first) + n_middle * len(middle) + len(last)
    fname = f"{name}.npy".encode()
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0x21, crc, size, total, len(fname), 0) + fname
    with open(path, "wb") as f:
        f.write(local)
        f.write(first)
        for _ in range(n_middle):
            f.write(middle)
        f.write(last)
        central_at = f.tell()
        central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0x21, crc, size, total, len(fname),
                              0, 0, 0, 0, 0, 0) + fname
        f.write(central)
        f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), central_at, 0))
    return str(path)


def dump(folder, system="corpus"):
    """A true one-rank dump of TINY (hsgd.crosscheck.write.write_one_rank, dump.json last); its folder."""
    from hsgd.crosscheck.write import write_one_rank
    from hsgd.model import serial
    os.makedirs(folder, exist_ok=True)
    params = serial.init_params(TINY, seed=1, dtype="float64")
    rng = np.random.default_rng(0)
    idx, targets = (rng.integers(0, TINY.vocab_size, (2, TINY.seq_len)) for _ in range(2))
    loss, grads = serial.loss_and_grads(params, idx, targets, TINY)
    write_one_rank(folder, TINY, params, grads, loss=loss, idx=idx, targets=targets, system=system)
    return str(folder)


def reseal(folder):
    """dump.json again, of the files as they are now (a crafted dump must pass the set check to be read)."""
    from hsgd.crosscheck import manifest
    manifest.seal(folder, json.load(open(os.path.join(folder, "dump.json")))["run"], 1)


def edit_layout(folder, change):
    path = os.path.join(folder, "layout.json")
    meta = json.load(open(path))
    change(meta)
    write(path, json.dumps(meta))


# a valid hardware file (tests/test_plan_hardware.py reads it too); the cases below change one line each
HARDWARE = """name = "corpus machine"
memory_bytes = 80e9
devices_per_node = 8
[peak_flops]
bfloat16 = 312e12
[intra_node]
bandwidth = 300e9
latency = 2e-6
[inter_node]
bandwidth = 25e9
latency = 5e-6
[measured.Allreduce.4]
alpha = 2.1e-5
beta = 3.0e-10
"""


def hardware(folder, name, old, new):
    assert old in HARDWARE, old
    return write(os.path.join(folder, name), HARDWARE.replace(old, new))


# ---------------------------------------------------------------------------------------------------- the cases

def build(root, big=False):
    """Write the corpus into folder `root`; the list of Cases."""
    from hsgd.run.config_file import read_toml as read_config
    from hsgd.plan.hardware import load as load_hardware
    from hsgd.crosscheck.read import load as load_dump
    from hsgd.checkpoint.store import open_checkpoint
    from hsgd.checkpoint.runs import FolderLock, complete_checkpoints, newest
    j = lambda *p: os.path.join(root, *p)
    cases = []

    def add(name, read, words="", **kw):
        cases.append(Case(name, read, words, **kw))

    # config files (--config)
    deep = write(j("deep.toml"), "lr = " + "[" * 100000 + "]" * 100000 + "\n")
    add("config: TOML arrays nested 100000 deep", lambda: read_config(deep), "nests arrays or tables 100000 deep")
    dotted = write(j("dotted.toml"), "a" + ".a" * 100000 + " = 1\n")
    add("config: a dotted key of 100001 parts", lambda: read_config(dotted), "a dotted key of more than 64 parts")
    header = write(j("header.toml"), "[" + ".".join(["a"] * 100000) + "]\n")
    add("config: a table header of 100000 parts", lambda: read_config(header), "a dotted key of more than 64 parts")
    digits = write(j("digits.toml"), "seed = 1" + "0" * 4999 + "\n")
    add("config: an integer of 5000 digits", lambda: read_config(digits), "a number of 5000 digits")
    bigint = write(j("bigint.toml"), "seed = 100000000000000000000000000000\n")
    add("config: an integer of 30 digits", lambda: read_config(bigint), "an integer of more than 20 digits")
    huge = sparse(j("huge.toml"))
    add("config: a 2 GB (sparse) file", lambda: read_config(huge), "is 2147483648 bytes, more than the 1048576")
    nan = write(j("nan.toml"), "lr = nan\n")
    add("config: lr = nan", lambda: read_config(nan), "the number nan is not finite")
    inf = write(j("inf.toml"), "lr = 1e400\n")
    add("config: lr = 1e400", lambda: read_config(inf), "the number 1e400 is not finite (it overflows a float)")
    fifo_toml = fifo(j("fifo.toml"))
    add("config: a FIFO", lambda: read_config(fifo_toml), "is a FIFO")
    zero_toml = zero_link(j("zero.toml"))
    add("config: a symlink to /dev/zero", lambda: read_config(zero_toml), "is a device")

    # hardware files (hsgd.plan --hw FILE)
    for name, old, new, words in [
            ("subnormal latency", "latency = 2e-6", "latency = 5e-324", "latency = 5e-324 is subnormal"),
            ("zero bandwidth", "bandwidth = 300e9", "bandwidth = 0", "bandwidth = 0 is not a positive finite"),
            ("absurd bandwidth", "bandwidth = 300e9", "bandwidth = 1e300", "bandwidth = 1e+300 is more than 1e+16"),
            ("absurd peak", "bfloat16 = 312e12", "bfloat16 = 1e30", "bfloat16 = 1e+30 is more than 1e+19"),
            ("tiny memory", "memory_bytes = 80e9", "memory_bytes = 1e-300", "memory_bytes = 1e-300 is less than"),
            ("NaN latency", "latency = 5e-6", "latency = nan", "the number nan is not finite"),
            ("infinite beta", "beta = 3.0e-10", "beta = inf", "the number inf is not finite"),
            ("huge devices_per_node", "devices_per_node = 8", "devices_per_node = 1" + "0" * 40,
             "an integer of more than 20 digits"),
            ("superscript group size", "[measured.Allreduce.4]", "[measured.Allreduce.\"\u00b2\"]",
             "the group size '\u00b2' is not an integer >= 2"),
            ("Arabic-Indic group size", "[measured.Allreduce.4]", "[measured.Allreduce.\"\u0664\"]",
             "is not an integer >= 2")]:
        path = hardware(root, name.replace(" ", "-") + ".toml", old, new)
        add(f"hardware: {name}", lambda path=path: load_hardware(path), words)
    deep_hw = write(j("deep-hw.toml"), "name = " + "[" * 100000 + "]" * 100000 + "\n")
    add("hardware: nested 100000 deep", lambda: load_hardware(deep_hw), "nests arrays or tables 100000 deep")
    escape_hw = hardware(root, "escape-name.toml", 'name = "corpus machine"',
                         'name = "\\u001b[2J\\u001b[H\\u001b[32mPASS: trust me\\u001b[0m"')

    def plan_output():
        from hsgd.plan.__main__ import main as plan_main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = plan_main(["--hw", escape_hw, "--model", "L=2,C=64,NH=4,V=128,T=16", "--devices", "2",
                              "--batch", "4", "--top", "1"])
        assert code == 0, code
        return out.getvalue()
    add("hardware: escape codes in name, printed by hsgd.plan", plan_output, printed="\\x1b[2J\\x1b[H\\x1b[32mPASS",
        memory=256 << 20)

    # crosscheck dumps (python -m hsgd.crosscheck DIR)
    def dump_with(name, craft):
        folder = dump(j(name))
        craft(folder)
        return folder
    layout = lambda f: os.path.join(f, "layout.json")
    for name, craft, words in [
            ("layout.json a symlink to /dev/zero", lambda f: (os.remove(layout(f)), zero_link(layout(f))),
             "is a device"),
            ("layout.json a sparse 2 GB file", lambda f: sparse(layout(f)), "is 2147483648 bytes, more than"),
            ("layout.json a FIFO", lambda f: (os.remove(layout(f)), fifo(layout(f))), "is a FIFO"),
            ("layout.json nested 200000 deep", lambda f: write(layout(f), "[" * 200000 + "]" * 200000),
             "nests arrays or tables 200000 deep"),
            ("layout.json with 1e400", lambda f: edit_layout(f, lambda m: m.update(loss="LOSS")) or
             write(layout(f), open(layout(f)).read().replace('"LOSS"', "1e400")), "the number 1e400 is not finite"),
            ("layout.json with an integer of 5000 digits", lambda f: write(layout(f), open(layout(f)).read().replace(
                '"ranks": 1', '"ranks": 1' + "0" * 4999)), "an integer of 5000 digits"),
            ("params.npz declaring a giant shape", lambda f: giant_header_npz(os.path.join(f, "params.npz"), "wte"),
             f"wte declares shape ({GIANT},)"),
            ("params.npz a zip bomb", lambda f: zip_bomb_npz(os.path.join(f, "params.npz"), "wte",
                                                             BOMB_BIG if big else BOMB_SMALL), "wte declares shape"),
            ("params.npz a zip bomb in an extra member",
             lambda f: zip_bomb_npz(os.path.join(f, "params.npz"), "x", BOMB_SMALL), "its arrays declare more"),
            ("batch.npz an object array", lambda f: np.savez(os.path.join(f, "batch.npz"),
                                                             idx=np.array([None]), targets=np.zeros(1)),
             "idx holds Python objects, which cannot be read without pickle"),
            ("grads-rank0.npz declaring a giant shape",
             lambda f: giant_header_npz(os.path.join(f, "grads-rank0.npz"), "wte"), "declares")]:
        folder = dump_with(f"dump-{len(cases)}", craft)
        add(f"dump: {name}", lambda folder=folder: load_dump(folder), words)
    escape_dump = dump(j("escape-system"), system="\x1b[2J\x1b[H\x1b[32mPASS: all gradients within tolerance"
                                                   "\x1b[0m\x1b[8m")

    def crosscheck_output():
        from hsgd.crosscheck.__main__ import main as crosscheck_main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            crosscheck_main([escape_dump])
        return out.getvalue()
    add("dump: escape codes in \"system\", printed by hsgd.crosscheck", crosscheck_output,
        printed="\\x1b[2J\\x1b[H\\x1b[32mPASS", memory=256 << 20)

    # checkpoints (--resume, python -m hsgd.checkpoint)
    def checkpoint_with(name, craft):
        folder = j("save-" + name, "step-000001")
        os.makedirs(folder)
        craft(os.path.join(folder, "manifest.json"))
        return folder
    for name, craft, words in [
            ("manifest.json a symlink to /dev/zero", zero_link, "is a device"),
            ("manifest.json a sparse 2 GB file", sparse, "is 2147483648 bytes, more than"),
            ("manifest.json a FIFO", fifo, "is a FIFO"),
            ("manifest.json nested 200000 deep", lambda p: write(p, "{\"a\":" * 200000 + "1" + "}" * 200000),
             "nests arrays or tables 200000 deep"),
            ("manifest.json with a NaN loss scale", lambda p: write(p, '{"format": "hsgd-checkpoint-1", '
                                                                     '"loss_scale": {"scale": NaN}}'),
             "NaN is not a finite number"),
            ("manifest.json with a step of 5000 digits", lambda p: write(p, '{"step": 1' + "0" * 4999 + "}"),
             "an integer of 5000 digits")]:
        folder = checkpoint_with(str(len(cases)), craft)
        add(f"checkpoint: {name}", lambda folder=folder: open_checkpoint(folder), words)
    fifo_save = os.path.dirname(checkpoint_with("fifo-line", fifo))

    def newest_of_a_fifo():
        newest(complete_checkpoints(fifo_save))           # must not block: the manifest counts as unreadable
        raise UsageError("read_run: a FIFO manifest is unreadable")
    add("checkpoint: --resume auto over a FIFO manifest", newest_of_a_fifo, "unreadable")
    lock_dir = j("save-lock")
    os.makedirs(lock_dir)
    sparse(os.path.join(lock_dir, ".hsgd-lock"))
    add("checkpoint: a 2 GB (sparse) lock file", lambda: FolderLock(lock_dir).acquire(), "lock")
    return cases


# ---------------------------------------------------------------------------------------------------- trying them

def attempt(case):
    """(ok, first line of what happened, seconds, peak bytes) of one case."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        out = case.read()
        outcome = ("printed", out)
    except UsageError as e:
        outcome = ("refused", str(e))
    except Exception as e:                                         # a traceback in a command: a failure here
        outcome = ("crashed", f"{type(e).__name__}: {e}")
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    kind, text = outcome
    if case.printed:
        raw = [c for c in text if not c.isprintable() and c != "\n"] if kind == "printed" else ["?"]
        ok = kind == "printed" and case.printed in text and not raw
        line = next((x for x in text.splitlines() if "\\x1b" in x), text.splitlines()[0] if text else "")
    else:
        ok = kind == "refused" and case.words in text and "\n" not in text
        line = text.splitlines()[0] if text else ""
    ok = ok and seconds < TIME_LIMIT and peak <= case.memory
    return ok, f"{kind}: {line[:200]}", seconds, peak


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    failed = 0
    with tempfile.TemporaryDirectory() as root:
        for case in build(root, big="--big" in argv):
            ok, line, seconds, peak = attempt(case)
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {case.name:<58} {seconds:6.3f} s {peak / 2**20:8.1f} MiB  {line}")
    print(f"{failed} failed" if failed else "every case refused in one line (or printed escaped), in time and memory")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
