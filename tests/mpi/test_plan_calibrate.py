"""hsgd.plan.calibrate on 8 ranks (quick mode, ~2 s here): the file it writes loads with hsgd.plan.hardware.load,
every collective has a positive alpha and beta for every group size 2..8, the matmul rates and the memory bandwidth
(c = a + b, all ranks busy; written to 4 digits) are positive; an output that cannot be written, or a single rank,
is refused on every rank before any measuring.
Timings on a shared box are noisy, so this checks the shape of the result, not its numbers (calibrate prints them)."""
import os
import tempfile

from hsgd.plan.calibrate import calibrate
from hsgd.plan.hardware import OPS, HardwareError, load

from .conftest import WORLD, check, say


def test_quick_calibration_writes_a_loadable_file():
    folder = tempfile.mkdtemp(prefix="hsgd-cal-") if WORLD.Get_rank() == 0 else None
    path = os.path.join(WORLD.bcast(folder, root=0), "cal.toml")          # rank 0's folder, on every rank
    returned = calibrate(WORLD, path, quick=True, say=say)
    hw = load(path)                                                        # every rank reads what rank 0 wrote
    bad = [(op, p) for op in OPS for p in ([2] if op == "Sendrecv" else range(2, WORLD.Get_size() + 1))
           if not (hw.measured_cost(op, p) and min(hw.measured_cost(op, p)) > 0)]
    ok = (not bad and hw.devices_per_node == WORLD.Get_size() and hw.memory_bytes > 0
          and all(hw.measured_matmul.get(d, 0) > 0 for d in ("float64", "float32"))
          and (hw.memory_bandwidth or 0) > 0 and abs(returned.memory_bandwidth / hw.memory_bandwidth - 1) < 1e-3
          and hw.intra.latency == hw.measured_cost("Sendrecv", 2)[0] and returned.measured.keys() == hw.measured.keys())
    check(ok, f"missing or non-positive fits {bad}; matmul {hw.measured_matmul}; memory bandwidth "
                   f"{hw.memory_bandwidth}; {hw.devices_per_node} per node")
    WORLD.Barrier()                                                        # everyone has read it
    if WORLD.Get_rank() == 0:
        os.remove(path)
        os.rmdir(folder)


def refusal(comm, path):
    """The HardwareError message calibrate(comm, path) raises on this rank, or None."""
    try:
        calibrate(comm, path, quick=True, say=say)
    except HardwareError as e:
        return str(e)


def test_refused_on_every_rank_before_measuring(tmp_path):
    folder = WORLD.bcast(str(tmp_path), root=0)
    msg = refusal(WORLD, folder)                                           # a folder is not a file to write
    say(msg)
    check(msg and "is a directory" in msg, f"an output folder: {msg!r}")
    alone = WORLD.Split(WORLD.Get_rank(), 0)                               # a communicator of one rank each
    msg = refusal(alone, os.path.join(folder, "x.toml"))
    alone.Free()
    say(msg)
    check(msg and "at least 2 ranks" in msg, f"one rank: {msg!r}")
