"""hsgd.plan.hardware: the shipped hardware files load with their datasheet numbers, a written file reads back the
same, and every bad file or name is refused with one line that names the file, the key and what would work."""
import os

import numpy as np
import pytest

from hsgd.errors import UsageError
from hsgd.plan.hardware import OPS, HardwareError, from_table, load, names, to_toml
from tests.corpus import HARDWARE as GOOD          # a valid hardware file, which the corpus varies

try:
    import tomllib
except ModuleNotFoundError:                                     # Python < 3.11
    import tomli as tomllib



def write(tmp_path, text, name="x.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def refused(path_or_name, *words):
    """load() raises one HardwareError line that contains every one of words."""
    with pytest.raises(HardwareError) as e:
        load(path_or_name)
    msg = str(e.value)
    print(msg)
    assert isinstance(e.value, UsageError) and "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


G = 2**30                                   # a GiB: devices are sold in them


@pytest.mark.parametrize("name, memory, peaks, intra, inter", [
    ("a100-80g", 80 * G, {"float64": 19.5e12, "float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12}, 300e9, 25e9),
    ("h100-80g", 80 * G, {"float64": 67e12, "float32": 67e12, "bfloat16": 989e12, "float16": 989e12}, 450e9, 50e9),
    ("h200-141g", 143771 * 2**20,                   # (nvidia-smi's 143771 MiB)
     {"float64": 67e12, "float32": 67e12, "bfloat16": 989e12, "float16": 989e12}, 450e9, 50e9),
])
def test_shipped_datasheet_files(name, memory, peaks, intra, inter):
    """A shipped file has its datasheet's numbers; memory in GiB (2^30 bytes), as devices are sold."""
    hw = load(name)
    print(hw.name)
    assert hw.memory_bytes == memory and hw.devices_per_node == 8 and hw.peak_flops == peaks
    assert hw.peak("bfloat16") == peaks["bfloat16"] and hw.peak(np.dtype("float64")) == peaks["float64"]
    assert (hw.intra.bandwidth, hw.inter.bandwidth) == (intra, inter)
    assert 0 < hw.intra.latency <= hw.inter.latency < 1e-4
    assert (hw.intra.name, hw.inter.name) == ("intra-node", "inter-node")
    assert (hw.efficiency is None) == (name != "a100-80g") and hw.measured == {}   # a100: fitted on Table 1
    assert hw.measured_cost("Allreduce", 8) is None
    assert hw.source.endswith(os.path.join("hw", name + ".toml"))
    assert load(hw.source) == hw                                   # the same file by its path


def test_this_machine_is_measured():
    hw = load("this-machine")
    print(hw.name)
    assert set(names()) >= {"a100-80g", "h100-80g", "h200-141g", "this-machine"}
    assert "calibrate" in hw.name and hw.devices_per_node == 8 and hw.memory_bytes > 1e8
    assert set(hw.measured_matmul) >= {"float64", "float32"} and all(r > 0 for r in hw.measured_matmul.values())
    for op in OPS:
        for p in ([2] if op == "Sendrecv" else range(2, 9)):
            alpha, beta = hw.measured_cost(op, p)
            assert alpha > 0 and beta > 0, (op, p)
    alpha, beta = hw.measured_cost("Sendrecv", 2)
    assert hw.intra.latency == hw.inter.latency == alpha
    assert abs(hw.intra.bandwidth * beta - 1) < 1e-3               # bandwidth = 1/beta (4 digits in the file)


def test_written_file_reads_back(tmp_path):
    hw = load(write(tmp_path, GOOD))
    assert hw.measured_cost("Allreduce", 4) == (2.1e-5, 3.0e-10) and hw.intra.time(300e9) == pytest.approx(1 + 2e-6)
    back = load(write(tmp_path, to_toml(hw, notes=["a note"], comments={"intra_node": "a comment"}), "y.toml"))
    assert back.measured == hw.measured and back.intra == hw.intra and back.name == hw.name


def test_peak_of_a_missing_dtype_names_the_ones_there(tmp_path):
    hw = load(write(tmp_path, GOOD))
    with pytest.raises(HardwareError, match=r"no peak for float64; it has \['bfloat16'\]"):
        hw.peak("float64")


@pytest.mark.parametrize("change, words", [
    (("bandwidth = 300e9\n", ""), ["x.toml", "[intra_node] has no 'bandwidth'", "e.g. 300e9 for NVLink 3"]),
    (("latency = 5e-6", "latency = -5e-6"), ["[inter_node] latency = -5e-06 is not a positive finite number",
                                            "e.g. 5e-6"]),
    (("memory_bytes = 80e9", 'memory_bytes = "80e9"'), ["memory_bytes = '80e9' is not a number", "e.g. 80e9"]),
    (("devices_per_node = 8", "devices_per_node = 8.5"), ["devices_per_node = 8.5 is not a positive integer"]),
    (("name =", "nmae ="), ["unknown key or table 'nmae'", "known: name, memory_bytes"]),
    (("[peak_flops]\n", "[peak_flops]\nfloat128 = 1e12\n"), ["unknown dtype 'float128'", "float64, float32"]),
    (("[measured.Allreduce.4]", "[measured.Allreduce.1]"), ["[measured.Allreduce.1]", "an integer >= 2"]),
    (("[measured.Allreduce.4]", "[measured.Sendrecv.4]"), ["[measured.Sendrecv.4]", "2 (between two ranks)"]),
    (("[measured.Allreduce.4]", "[measured.Alltoall.4]"), ["unknown collective [measured.Alltoall]", "Allgather"]),
    (("beta = 3.0e-10", "gamma = 1"), ["[measured.Allreduce.4] has an unknown key 'gamma'", "alpha, beta"]),
    (("[inter_node]\nbandwidth = 25e9\nlatency = 5e-6\n", ""), ["has no 'inter_node'", "each device's network"]),
    (("name =", "efficiency = 1.5\nname ="), ["efficiency = 1.5 is more than 1", "in (0, 1]"]),
])
def test_bad_files_are_refused_in_one_line(tmp_path, change, words):
    old, new = change
    assert old in GOOD
    refused(write(tmp_path, GOOD.replace(old, new, 1)), *words)


def test_not_a_hardware_file(tmp_path):
    refused(write(tmp_path, "name = [unclosed\n"), "x.toml", "is not valid TOML")
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe name")
    refused(str(tmp_path / "bin.toml"), "bin.toml", "not UTF-8")
    (tmp_path / "d.toml").mkdir()
    refused(str(tmp_path / "d.toml"), "d.toml", "is a directory; pass a file")
    refused(str(tmp_path / "absent.toml"), "absent.toml", "does not exist", "shipped names: a100-80g")
    refused(str(tmp_path), "is a directory")
    refused("a100", "unknown hardware 'a100'", "a100-80g, h100-80g, h200-141g")
    refused(80, "neither a name nor a path", "a100-80g")
    with pytest.raises(HardwareError, match="intra_node = 3 is not a table"):
        from_table({**tomllib.loads(GOOD), "intra_node": 3})
