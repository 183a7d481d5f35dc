"""hsgd.readers' bounded readers: JSON, TOML and .npz read with a size and a nesting bound checked before parsing,
big integers and non-finite numbers refused by name, .npz headers checked before any array is read, and text from a
file printed escaped; the crafted-file corpus (tests/corpus.py) refused case by case in one line, in bounded time
and memory; two of its files end to end through the commands (one line, exit 2)."""
import os
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

from hsgd.errors import UsageError
from hsgd.readers import Npz, printable, read_json, read_toml
from tests import corpus


class Bad(UsageError):
    pass


def refusal(read, path, *args, **kw):
    """The one-line message of read(path, ...) (which must refuse, within a second)."""
    start = time.perf_counter()
    with pytest.raises(Bad) as e:
        read(path, "test file", Bad, *args, **kw)
    took = time.perf_counter() - start
    print(f"{took:.3f} s  {e.value}")
    assert "\n" not in str(e.value) and took < 1.0
    return str(e.value)


JSON_REFUSED = [
    ("[" * 200000 + "]" * 200000, "nests arrays or tables 200000 deep"),
    ('{"a": ' * 65 + "1" + "}" * 65, "nests arrays or tables 65 deep, more than the 64"),
    ('{"n": 1' + "0" * 4999 + "}", "an integer of 5000 digits"),
    ('{"n": -123456789012345678901}', "an integer of 21 digits"),
    ('{"x": 1e400}', "the number 1e400 is not finite (it overflows a float)"),
    ('{"x": -1e400}', "the number -1e400 is not finite"),
    ('{"x": NaN}', "NaN is not a finite number"),
    ('{"x": [Infinity]}', "Infinity is not a finite number"),
    ('{"x": ', "cannot be read: it is not valid JSON"),
    ('"\\"' * 1000, "cannot be read: it is not valid JSON"),           # unclosed strings: no quadratic scan
]

JSON_READ = [
    ('{"a": "[[[[{{{{", "b": "\\"]]]]", "c": [[1], [2.5e-300]]}', {"a": "[[[[{{{{", "b": '"]]]]',
                                                                      "c": [[1], [2.5e-300]]}),
    ('{"n": 12345678901234567890, "m": -1}', {"n": 12345678901234567890, "m": -1}),
    ("[" * 64 + "]" * 64, None),                                         # 64 deep: the most allowed
]


@pytest.mark.parametrize("text, words", JSON_REFUSED, ids=range(len(JSON_REFUSED)))
def test_json_refused_by_name(tmp_path, text, words):
    (tmp_path / "x.json").write_text(text)
    assert words in refusal(read_json, str(tmp_path / "x.json"))


@pytest.mark.parametrize("text, value", JSON_READ, ids=range(len(JSON_READ)))
def test_json_that_fits_reads(tmp_path, text, value):
    (tmp_path / "x.json").write_text(text)
    got = read_json(str(tmp_path / "x.json"), "test file", Bad)
    assert value is None or got == value


def test_json_constants_only_when_asked(tmp_path):
    """layout.json may carry a NaN loss (the system's, written by Python's json): the verdict says it, not a refusal."""
    (tmp_path / "x.json").write_text('{"loss": NaN}')
    assert np.isnan(read_json(str(tmp_path / "x.json"), "test file", Bad, constants=True)["loss"])


def test_json_size_is_checked_before_reading(tmp_path):
    path = corpus.sparse(tmp_path / "big.json", 2 << 30)
    assert "is 2147483648 bytes, more than the 1000" in refusal(read_json, path, max_bytes=1000)
    (tmp_path / "small.json").write_text("[1, 2]")
    assert "is 6 bytes, more than the 5" in refusal(read_json, str(tmp_path / "small.json"), max_bytes=5)


@pytest.mark.parametrize("make, words", [
    (lambda p: corpus.fifo(p), "is a FIFO"),
    (lambda p: corpus.zero_link(p), "is a device"),
    (lambda p: os.mkdir(p), "is a directory"),
    (lambda p: None, "does not exist"),
], ids=["fifo", "dev-zero", "folder", "missing"])
def test_only_regular_files_are_opened(tmp_path, make, words):
    make(str(tmp_path / "x"))
    assert words in refusal(read_json, str(tmp_path / "x"))
    assert words in refusal(read_toml, str(tmp_path / "x"))


TOML_REFUSED = [
    ("a = " + "[" * 100000 + "]" * 100000, "nests arrays or tables 100000 deep"),
    ("a = " + "{b = " * 70 + "1" + "}" * 70, "nests arrays or tables 70 deep"),
    ("a" + ".a" * 100000 + " = 1", "a dotted key of more than 64 parts"),
    ("[" + ".".join(["t"] * 100) + "]", "a dotted key of more than 64 parts"),
    ('a . "b" . ' * 40 + "c = 1", "a dotted key of more than 64 parts"),
    ("seed = 1" + "0" * 4999, "a number of 5000 digits"),
    ("seed = 1_000_000_000_000_000_000_000", "an integer of more than 20 digits"),
    ("seed = 0x" + "f" * 30, "an integer of more than 20 digits"),
    ("lr = nan", "the number nan is not finite"),
    ("lr = -inf", "the number -inf is not finite"),
    ("lr = 1e400", "the number 1e400 is not finite (it overflows a float)"),
    ("lr = = 1", "cannot be read: it is not valid TOML"),
    ('a = """' + '\\"' * 100000, "cannot be read: it is not valid TOML"),
]

TOML_READ = [
    ('a = "[[[[" # ]]]] [[[[\nb = """x]]]""""\nc = [[1], [2]]\nd = \'\'\'[[[\'\'\'\ne = \'{{\'\n',
     {"a": "[[[[", "b": 'x]]]"', "c": [[1], [2]], "d": "[[[", "e": "{{"}),
    ("x.y.z = 1.5\n[t.u]\nv = 12345678901234567890\n",
     {"x": {"y": {"z": 1.5}}, "t": {"u": {"v": 12345678901234567890}}}),
    ("a = [" + "1.5, " * 1000 + "]\n", {"a": [1.5] * 1000}),
]


@pytest.mark.parametrize("text, words", TOML_REFUSED, ids=range(len(TOML_REFUSED)))
def test_toml_refused_by_name(tmp_path, text, words):
    (tmp_path / "x.toml").write_text(text + "\n")
    assert words in refusal(read_toml, str(tmp_path / "x.toml"))


@pytest.mark.parametrize("text, value", TOML_READ, ids=range(len(TOML_READ)))
def test_toml_that_fits_reads(tmp_path, text, value):
    (tmp_path / "x.toml").write_text(text)
    assert read_toml(str(tmp_path / "x.toml"), "test file", Bad) == value


def test_the_shipped_hardware_files_still_read():
    from hsgd.plan.hardware import load, names
    assert all(load(n).peak_flops for n in names())


def test_npz_reads_what_numpy_savez_writes(tmp_path):
    arrays = {"w": np.arange(12.0).reshape(3, 4), "i": np.arange(5, dtype=np.int32), "e": np.zeros((0, 3))}
    for save in (np.savez, np.savez_compressed):
        save(tmp_path / "a.npz", **arrays)
        with Npz(tmp_path / "a.npz", "test file", Bad, shapes={"w": (3, 4)}, max_bytes=200) as z:
            assert z.files == list(arrays) and z.shapes["w"] == (3, 4) and "i" in z
            assert all(np.array_equal(z[k], v) and z[k].dtype == v.dtype for k, v in arrays.items())


@pytest.mark.parametrize("make, words", [
    (lambda p: corpus.giant_header_npz(p, "x"), f"x declares 8000000000000 bytes of shape ({corpus.GIANT},) but"),
    (lambda p: corpus.giant_header_npz(p, "w"), f"w declares shape ({corpus.GIANT},), (3, 4) expected"),
    (lambda p: corpus.zip_bomb_npz(p, "x", 64 << 20), "its arrays declare more than 1000000 bytes"),
    (lambda p: np.savez(p, w=np.zeros((4, 4))), "w declares shape (4, 4), (3, 4) expected"),
    (lambda p: np.savez(p, w=np.array([{}], dtype=object)), "w holds Python objects, which cannot be read without "
                                                            "pickle"),
    (lambda p: np.savez(p, w=np.array(["text"])), "w is of dtype <U4; write arrays of numbers"),
    (lambda p: np.savez(p, w=np.zeros(2, dtype=[("a", "f8")])), "write arrays of numbers"),
    (lambda p: zipfile.ZipFile(p, "w").writestr("raw.bin", b"x" * 100), "member 'raw.bin' is not a .npy array"),
    (lambda p: np.save(p, np.zeros(3)) or os.replace(str(p) + ".npy", p), "one array (.npy), not an .npz archive"),
    (lambda p: open(p, "wb").write(b"PK\x03\x04 not a zip"), "cannot be read: it is not an .npz file"),
], ids=["giant-shape", "giant-expected", "zip-bomb", "shape", "object", "string", "record", "not-npy", "npy",
        "not-zip"])
def test_npz_headers_are_checked_before_any_array_is_read(tmp_path, make, words):
    path = tmp_path / "a.npz"
    make(path)
    assert words in refusal(Npz, str(path), shapes={"w": (3, 4)}, max_bytes=1_000_000)


def test_printable_escapes_what_a_terminal_would_obey():
    fake = "\x1b[2J\x1b[H\x1b[32mPASS\x1b[0m\r\n\u202etxt\x00\\"
    shown = printable(fake)
    print(shown)
    assert shown == "\\x1b[2J\\x1b[H\\x1b[32mPASS\\x1b[0m\\r\\n\\u202etxt\\x00\\\\"
    assert all(c.isprintable() for c in shown)
    assert printable("x" * 1000, 10) == "x" * 10 + "... (1000 characters)"
    assert printable("A100 80GB SXM4, 8 per node") == "A100 80GB SXM4, 8 per node"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return str(root), corpus.build(str(root))


def test_the_corpus_is_refused_in_one_line_in_bounded_time_and_memory(built):
    """Every crafted file of tests/corpus.py: one line (or, printed, escaped), < 2 s, <= its memory bound."""
    failed = []
    for case in built[1]:
        ok, line, seconds, peak = corpus.attempt(case)
        print(f"{'ok  ' if ok else 'FAIL'} {case.name:<58} {seconds:6.3f} s {peak / 2**20:7.1f} MiB  {line[:150]}")
        if not ok:
            failed.append(case.name)
    assert not failed, failed


def command(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=60, env=env)
    print(r.returncode, r.stderr.strip(), r.stdout[-300:])
    return r.returncode, r.stderr


def test_end_to_end_a_crafted_dump_and_a_crafted_hardware_file_exit_2_in_one_line(tmp_path):
    folder = corpus.dump(str(tmp_path / "dump"))
    corpus.giant_header_npz(os.path.join(folder, "params.npz"), "wte")
    corpus.reseal(folder)                                   # a whole set of files: the reading is what refuses
    hw = corpus.hardware(str(tmp_path), "hw.toml", "latency = 2e-6", "latency = 5e-324")
    for args, words in [(("hsgd.crosscheck", folder), f"wte declares shape ({corpus.GIANT},), (37, 16) expected"),
                        (("hsgd.plan", "--hw", hw), "latency = 5e-324 is subnormal")]:
        code, err = command(*args)
        assert code == 2 and words in err and err.count("hsgd: error:") == 1 and len(err.strip().splitlines()) == 1
