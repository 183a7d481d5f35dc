"""What the planner knows about a machine: memory per device, matmul peak, and the two links, read from a TOML file.

A link is modelled by Hockney's alpha-beta model: moving n bytes over it takes

    t(n) = latency + n / bandwidth            (alpha = latency in s, beta = 1 / bandwidth in s/byte)

per device and direction. A node has `devices_per_node` devices joined by the intra-node link (NVLink); nodes are
joined by the inter-node link (each device's own NIC). A matmul of F floating-point operations takes
F / (peak(dtype) * efficiency). `python -m hsgd.plan --calibrate` (hsgd.plan.calibrate) measures a machine instead
and adds, per collective and group size p, its own fitted alpha and beta ([measured.OP.p]) and the matmul rate
per rank with all ranks busy ([measured_matmul]).

    from hsgd.plan.hardware import load
    hw = load("a100-80g")                      # a shipped file, hsgd/plan/hw/a100-80g.toml; or load("my.toml")
    hw.peak("bfloat16"), hw.intra.bandwidth, hw.measured_cost("Allreduce", 4)

File schema (SI units: bytes, seconds, FLOP/s; every number > 0 and inside the physical limits below):

    name = "..."                     # what machine this is
    memory_bytes = 80e9              # per device
    devices_per_node = 8
    efficiency = 0.5                 # optional: fraction of peak that matmuls reach
    memory_bandwidth = 2.0e12        # optional: bytes/s to device memory (elementwise work, hsgd.plan.costs)
    [peak_flops]                     # dense matmul peak per device: any of float64, float32, bfloat16, float16
    [intra_node]  bandwidth, latency # bytes/s per device one direction, s
    [inter_node]  bandwidth, latency
    [measured.Allreduce.4]  alpha, beta    # optional (Allreduce, Reduce_scatter_block, Allgather; Sendrecv: p = 2)
    [measured_matmul]  float64 = ...       # optional: FLOP/s per rank, all ranks busy
    elementwise_passes, block_overhead     # optional (--calibrate): elementwise traffic per stored activation
                                           # byte, and seconds per block and micro-batch beyond FLOPs and bytes
    [measured_optimizer]  adamw = ...      # optional: seconds per element of one optimizer step

Physical limits (LIMITS): a number outside them is a typo or a crafted file, refused with one line, since it would
rank layouts as "nan s" or "0 s" (a subnormal latency such as 5e-324, a bandwidth of 1e300):

    memory_bytes                          1e6 .. 1e15 bytes (1 MB .. 1 PB per device)
    peak_flops, measured_matmul           1e6 .. 1e19 FLOP/s (1 MFLOP/s .. 10 EFLOP/s per device)
    bandwidth, memory_bandwidth           1e3 .. 1e16 bytes/s (1 kB/s .. 10 PB/s)
    latency, alpha, block_overhead        1e-10 .. 100 s
    beta                                  1e-16 .. 1e-3 s/byte (the inverse of a bandwidth)
    measured_optimizer                    1e-16 .. 1 s per element
    efficiency                            1e-6 .. 1
    elementwise_passes                    1e-3 .. 1e3
    devices_per_node                      1 .. 65536, an integer; a group size p: ASCII digits, 2 .. 2^20

Left out: topologies beyond two levels (rails, fat-tree oversubscription), contention between collectives that
run at once, and per-size protocol switches (one straight line per collective and group size).
"""
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field

from hsgd.run.config_file import load_toml
from hsgd.readers import printable
from hsgd.errors import UsageError
from hsgd.step.settings import MAX_RANKS

HW_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hw")   # the shipped files
DTYPES = ("float64", "float32", "bfloat16", "float16")
OPS = ("Allreduce", "Reduce_scatter_block", "Allgather", "Sendrecv")      # Sendrecv: p = 2 only

# What each number is and an example, for the error messages.
TOP = {"name": 'a string saying what machine this is, e.g. "A100 80GB SXM in a DGX A100"',
       "memory_bytes": "bytes of memory per device, e.g. 80e9",
       "devices_per_node": "devices per node, an integer, e.g. 8",
       "efficiency": "the fraction of peak that matmuls reach, a number in (0, 1], e.g. 0.5",
       "memory_bandwidth": "bytes/s between a device and its memory, e.g. 2.0e12 for an A100's HBM2e",
       "peak_flops": "a table [peak_flops] of dense matmul FLOP/s per device by dtype, e.g. bfloat16 = 312e12",
       "intra_node": "a table [intra_node] with bandwidth (bytes/s) and latency (s) of the link inside a node",
       "inter_node": "a table [inter_node] with bandwidth (bytes/s) and latency (s) of each device's network link",
       "measured": "tables [measured.OP.p] with alpha (s) and beta (s/byte), as --calibrate writes them",
       "measured_matmul": "a table [measured_matmul] of FLOP/s per rank by dtype, e.g. float64 = 2e9",
       "elementwise_passes": "how many times the elementwise work moves each activation byte a layer stores, "
                             "e.g. 3.6 (measured by --calibrate; 1 when absent)",
       "block_overhead": "seconds per Transformer block and micro-batch (forward and backward) that neither the "
                         "FLOPs nor the bytes explain, e.g. 1e-3 (measured by --calibrate; 0 when absent)",
       "measured_optimizer": "a table [measured_optimizer] of seconds per parameter element of one optimizer step, "
                             "e.g. adamw = 5e-9"}
LINK = {"intra_node": {"bandwidth": "bytes/s per device, one direction, e.g. 300e9 for NVLink 3",
                       "latency": "seconds, e.g. 2e-6"},
        "inter_node": {"bandwidth": "bytes/s per device, one direction, e.g. 25e9 for one HDR InfiniBand NIC",
                       "latency": "seconds, e.g. 5e-6"}}
FIT = {"alpha": "seconds per call, e.g. 2e-5", "beta": "seconds per byte, e.g. 3e-10"}

# The physical limits of each kind of number (the module docstring's table): (lowest, highest, unit).
LIMITS = {"bytes": (1e6, 1e15, "bytes"), "flops": (1e6, 1e19, "FLOP/s"), "bandwidth": (1e3, 1e16, "bytes/s"),
          "seconds": (1e-10, 100.0, "s"), "beta": (1e-16, 1e-3, "s/byte"), "per_element": (1e-16, 1.0, "s"),
          "fraction": (1e-6, 1.0, ""), "passes": (1e-3, 1e3, "")}
KIND = {"memory_bytes": "bytes", "memory_bandwidth": "bandwidth", "efficiency": "fraction", "bandwidth": "bandwidth",
        "latency": "seconds", "alpha": "seconds", "beta": "beta", "block_overhead": "seconds",
        "elementwise_passes": "passes", "peak_flops": "flops", "measured_matmul": "flops",
        "measured_optimizer": "per_element"}
MAX_DEVICES_PER_NODE = 65536
MAX_GROUP = MAX_RANKS                   # a group of a job's ranks (hsgd.step.settings)


class HardwareError(UsageError):
    """A hardware file or name that cannot be used; the message says why and what would work."""


@dataclass(frozen=True)
class Link:
    bandwidth: float               # bytes/s per device, one direction
    latency: float                 # s per message
    name: str = "intra-node"       # "intra-node" or "inter-node", for reports

    def time(self, nbytes):
        """Seconds to move nbytes over this link: latency + nbytes / bandwidth."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Hardware:
    name: str                      # what machine this is (the file's name line)
    memory_bytes: float            # per device
    devices_per_node: int          # devices joined by the intra-node link
    peak_flops: dict               # dtype -> dense matmul FLOP/s per device
    intra: Link                    # inside a node (NVLink)
    inter: Link                    # between nodes (each device's NIC)
    efficiency: float = None       # fraction of peak that matmuls reach; None: the caller fits it
    memory_bandwidth: float = None  # bytes/s to the device's memory (elementwise work); None: not modelled
    measured: dict = field(default_factory=dict)          # op -> {p: (alpha s, beta s/byte)}, from --calibrate
    measured_matmul: dict = field(default_factory=dict)   # dtype -> FLOP/s per rank with all ranks busy
    elementwise_passes: float = 1.0                        # elementwise traffic per stored activation byte
    block_overhead: float = 0.0                            # s per block and micro-batch beyond FLOPs and bytes
    measured_optimizer: dict = field(default_factory=dict)  # "sgd", "adamw" -> s per element of one step
    source: str = ""               # the file it was read from

    def peak(self, dtype):
        """Dense matmul peak FLOP/s per device for dtype (a name such as "bfloat16", or a NumPy dtype)."""
        key = dtype if isinstance(dtype, str) else getattr(dtype, "name", None) or getattr(dtype, "__name__", "?")
        if key not in self.peak_flops:
            raise HardwareError(f"hardware file {self.source!r} has no peak for {key}; it has "
                                f"{sorted(self.peak_flops)}: add '{key} = ...' (FLOP/s) under [peak_flops] or "
                                "choose one of those dtypes")
        return self.peak_flops[key]

    def measured_cost(self, op, p):
        """(alpha s, beta s/byte) measured for collective op on a group of p ranks, or None when not measured."""
        return self.measured.get(op, {}).get(int(p))


def names():
    """The shipped hardware names (the files in hsgd/plan/hw without .toml)."""
    return sorted(f[:-5] for f in os.listdir(HW_DIR) if f.endswith(".toml"))


def load(path_or_name):
    """The Hardware in a TOML file: a shipped name ("a100-80g") or a path (anything with a '/' or ending in .toml)."""
    if not isinstance(path_or_name, (str, os.PathLike)):
        raise HardwareError(f"hardware {path_or_name!r} is neither a name nor a path; give one of {names()} or a "
                            "TOML file's path")
    path = os.fspath(path_or_name)
    if not (path.endswith(".toml") or "/" in path or os.sep in path):
        if path not in names():
            raise HardwareError(f"unknown hardware {path!r}; shipped: {', '.join(names())}; or give a TOML file's "
                                "path (see hsgd/plan/hw/a100-80g.toml)")
        path = os.path.join(HW_DIR, path + ".toml")
    if not os.path.lexists(path):
        raise HardwareError(f"hardware file {path!r} does not exist; give an existing TOML file or one of the shipped "
                            f"names: {', '.join(names())}")
    return from_table(load_toml(path, "hardware file", HardwareError), path)


def from_table(t, path="<table>"):
    """Hardware from a parsed TOML table, every key checked; path names the file in the messages."""
    where = f"hardware file {path!r}"
    unknown = sorted(set(t) - set(TOP))
    if unknown:
        raise HardwareError(f"{where}: unknown key or table {unknown[0]!r}; known: {', '.join(TOP)}")
    for key in ("name", "memory_bytes", "devices_per_node", "peak_flops", "intra_node", "inter_node"):
        if key not in t:
            raise HardwareError(f"{where} has no {key!r} ({TOP[key]})")
    if not isinstance(t["name"], str) or not t["name"].strip():
        raise HardwareError(f"{where}: name = {t['name']!r} is not {TOP['name']}")
    dpn = t["devices_per_node"]
    if not isinstance(dpn, int) or isinstance(dpn, bool) or not 1 <= dpn <= MAX_DEVICES_PER_NODE:
        raise HardwareError(f"{where}: devices_per_node = {dpn!r} is not a positive integer (at most "
                            f"{MAX_DEVICES_PER_NODE}), e.g. 8")
    memory = number(where, "memory_bytes", t["memory_bytes"], TOP["memory_bytes"], "memory_bytes")
    efficiency = None
    if "efficiency" in t:
        efficiency = number(where, "efficiency", t["efficiency"], TOP["efficiency"], "efficiency")   # <= 1
    bandwidth = None
    if "memory_bandwidth" in t:
        bandwidth = number(where, "memory_bandwidth", t["memory_bandwidth"], TOP["memory_bandwidth"],
                           "memory_bandwidth")
    peak = per_dtype(where, "peak_flops", t["peak_flops"], "dense matmul FLOP/s per device, e.g. 312e12")
    if not peak:
        raise HardwareError(f"{where}: [peak_flops] is empty; {TOP['peak_flops']}")
    links = {}
    for key, label in (("intra_node", "intra-node"), ("inter_node", "inter-node")):
        links[key] = Link(**table_of(where, key, t[key], LINK[key]), name=label)
    measured = {}
    for op, by_p in table(where, "measured", t.get("measured", {}), TOP["measured"]).items():
        if op not in OPS:
            raise HardwareError(f"{where}: unknown collective [measured.{op}]; known: {', '.join(OPS)}")
        for p, fit in table(where, f"measured.{op}", by_p, "tables [measured.OP.p], one per group size p").items():
            ok = re.fullmatch(r"[0-9]{1,7}", p) and 2 <= int(p) <= MAX_GROUP    # ASCII: "\u00b2".isdigit() is True
            if not ok or (op == "Sendrecv" and int(p) != 2):
                allowed = "2 (between two ranks)" if op == "Sendrecv" else \
                    f"an integer >= 2 (at most {MAX_GROUP}, in ASCII digits), e.g. [measured.OP.4]"
                raise HardwareError(f"{where}: [measured.{op}.{printable(p, 40)}]: the group size {printable(p, 40)!r}"
                                    f" is not {allowed}")
            alpha, beta = table_of(where, f"measured.{op}.{p}", fit, FIT).values()
            measured.setdefault(op, {})[int(p)] = (alpha, beta)
    matmul = per_dtype(where, "measured_matmul", t.get("measured_matmul", {}), "FLOP/s per rank, e.g. 2e9")
    extra = {k: number(where, k, t[k], TOP[k], k) for k in ("elementwise_passes", "block_overhead") if k in t}
    optim = table(where, "measured_optimizer", t.get("measured_optimizer", {}), TOP["measured_optimizer"])
    if set(optim) - {"sgd", "adamw"}:
        raise HardwareError(f"{where}: [measured_optimizer] has an unknown optimizer "
                            f"{sorted(set(optim) - {'sgd', 'adamw'})[0]!r}; known: sgd, adamw")
    optim = {k: number(where, f"[measured_optimizer] {k}", v, TOP["measured_optimizer"], "measured_optimizer")
             for k, v in optim.items()}
    return Hardware(name=t["name"], memory_bytes=memory, devices_per_node=dpn, peak_flops=peak,
                    intra=links["intra_node"], inter=links["inter_node"], efficiency=efficiency, measured=measured,
                    measured_matmul=matmul, source=str(path), memory_bandwidth=bandwidth, measured_optimizer=optim,
                    **extra)


def number(where, key, value, what, name):
    """value as a float, if it is a finite number > 0 (not a bool, not a string), not subnormal, and inside the
    physical limits of its kind (LIMITS[KIND[name]]; name: the key or table it is, "latency", "peak_flops")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HardwareError(f"{where}: {key} = {printable(repr(value), 60)} is not a number (TOML type "
                            f"{type(value).__name__}); it should be {what}")
    if not math.isfinite(value) or value <= 0:
        raise HardwareError(f"{where}: {key} = {value!r} is not a positive finite number; it should be {what}")
    if value < sys.float_info.min:
        raise HardwareError(f"{where}: {key} = {value!r} is subnormal (below {sys.float_info.min:.3g}), no physical "
                            f"quantity; it should be {what}")
    low, high, unit = LIMITS[KIND[name]]
    if not low <= value <= high:
        side = f"less than {low:g}" if value < low else f"more than {high:g}"
        raise HardwareError(f"{where}: {key} = {value!r} is {side}{' ' + unit if unit else ''}, beyond physical limits "
                            f"(hsgd/plan/hardware.py); it should be {what}")
    return float(value)


def table(where, key, value, what):
    if not isinstance(value, dict):
        raise HardwareError(f"{where}: {key} = {value!r} is not a table; it should be {what}")
    return value


def table_of(where, key, value, keys):
    """{k: float} for a table that must have exactly the keys of `keys` (k -> what it is), in that order."""
    value = table(where, key, value, ", ".join(keys))
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise HardwareError(f"{where}: [{key}] has an unknown key {unknown[0]!r}; known: {', '.join(keys)}")
    for k, what in keys.items():
        if k not in value:
            raise HardwareError(f"{where}: [{key}] has no {k!r} ({what})")
    return {k: number(where, f"[{key}] {k}", value[k], what, k) for k, what in keys.items()}


def per_dtype(where, key, value, what):
    """{dtype: float} for a table keyed by dtype names."""
    value = table(where, key, value, f"a table [{key}] by dtype ({', '.join(DTYPES)})")
    unknown = sorted(set(value) - set(DTYPES))
    if unknown:
        raise HardwareError(f"{where}: [{key}] has an unknown dtype {unknown[0]!r}; known: {', '.join(DTYPES)}")
    return {d: number(where, f"[{key}] {d}", v, what, key) for d, v in value.items()}


def to_toml(hw, notes=(), comments=None):
    """hw as TOML text that load() reads back. notes: comment lines at the top; comments: {key or table name:
    a comment after that line}, e.g. {"memory_bytes": "MemTotal / 8 ranks", "intra_node": "measured Sendrecv"}."""
    comments = comments or {}

    def line(key, value):
        text = f"{key} = {value}"
        return f"{text:<34}# {comments[key]}" if key in comments else text

    def head(name):
        return f"[{name}]".ljust(34) + f"# {comments[name]}" if name in comments else f"[{name}]"

    out = [f"# {n}" for n in notes]
    out += [line("name", string(hw.name)), line("memory_bytes", num(hw.memory_bytes)),
            line("devices_per_node", str(int(hw.devices_per_node)))]
    if hw.efficiency is not None:
        out.append(line("efficiency", num(hw.efficiency)))
    if hw.memory_bandwidth is not None:
        out.append(line("memory_bandwidth", num(hw.memory_bandwidth)))
    if hw.elementwise_passes != 1.0:                  # (top-level keys: before the first table)
        out.append(line("elementwise_passes", num(hw.elementwise_passes)))
    if hw.block_overhead:
        out.append(line("block_overhead", num(hw.block_overhead)))
    out += ["", head("peak_flops")] + [line(d, num(v)) for d, v in hw.peak_flops.items()]
    for name, link in (("intra_node", hw.intra), ("inter_node", hw.inter)):
        out += ["", head(name), line("bandwidth", num(link.bandwidth)), line("latency", num(link.latency))]
    if hw.measured_matmul:
        out += ["", head("measured_matmul")] + [line(d, num(v)) for d, v in hw.measured_matmul.items()]
    if hw.measured_optimizer:
        out += ["", head("measured_optimizer")] + [line(k, num(v)) for k, v in hw.measured_optimizer.items()]
    for op, by_p in hw.measured.items():
        for p, (alpha, beta) in sorted(by_p.items()):
            out += ["", f"[measured.{op}.{p}]", f"alpha = {num(alpha)}", f"beta = {num(beta)}"]
    return "\n".join(out) + "\n"


def num(x):
    """A float in TOML (4 significant digits are plenty for a cost model): 2.1e-05, 300000000000.0 -> 3e+11."""
    return f"{float(x):.4g}"


def string(s):
    """A TOML basic string: JSON's escapes are TOML's, except DEL, which TOML wants escaped too."""
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")
