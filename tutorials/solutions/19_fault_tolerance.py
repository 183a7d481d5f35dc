"""Solutions to the exercises of chapter 19 (tutorials/19_fault_tolerance.py).

    mpirun -n 4 python tutorials/solutions/19_fault_tolerance.py

Exercise 1 is arithmetic (every rank computes the same); exercises 2-4 share one checkpoint, saved by 4 ranks as
dp 1 x pp 2 x tp 2 with Megatron's scheme after two steps, in a temporary directory removed at the end.
"""
# mpirun -n 4 python tutorials/solutions/19_fault_tolerance.py
import atexit
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from checks import Checks, solve, train_config  # noqa: E402

from hsgd.model.config import ModelConfig  # noqa: E402
from hsgd.checkpoint import store as checkpoint, manifest as hsgd_manifest
from hsgd.grid.process_grid import ProcessGrid  # noqa: E402
from hsgd.step.trainer import HybridTrainer  # noqa: E402

threadpool_limits(1)
world = MPI.COMM_WORLD
rank = world.Get_rank()
# V = 250: not a multiple of 4, so the vocabulary is padded when cut 4 ways (exercise 2)
cfg = ModelConfig(vocab_size=250, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=32)
B = 8
SAVED = {}                              # "tmp", "path": the checkpoint of exercises 2-4 (saved_checkpoint)


def batch(step):
    """A batch of random tokens < V, a pure function of the step (the built-in corpus has bytes up to 255)."""
    rng = np.random.default_rng(step)
    idx = rng.integers(0, cfg.vocab_size, (B, cfg.seq_len + 1))
    return idx[:, :-1], idx[:, 1:]                                     # (B, T) inputs, (B, T) next tokens


def saved_checkpoint():
    """Every rank: a checkpoint of two SGD steps on dp 1 x pp 2 x tp 2 (Megatron's scheme); its path."""
    tmp = world.bcast(tempfile.mkdtemp(prefix="hsgd-ex11-") if rank == 0 else None, root=0)
    if rank == 0:
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    grid = ProcessGrid(world, dp=1, pp=2, tp=2)
    trainer = HybridTrainer(cfg, grid, train_config(dp=1, pp=2, tp=2, steps=2, batch_size=B, threads=1))
    for step in (1, 2):
        trainer.step(*batch(step), step)
    path = checkpoint.save(trainer, 2, os.path.join(tmp, "run"), keep=1)
    trainer.free()
    grid.free()
    return tmp, path


# ---------------------------------------------------------------------------------------------------- exercise 1

def expected_time(tau, C, M, R, work=1.0):
    """Daly's expected wall time to finish `work` seconds of training with a checkpoint (C seconds) after every tau
    seconds of work, failures at rate 1/M (exponential, also while saving and restarting), R seconds to restart:
    every segment needs an unbroken tau + C, or after a failure an unbroken R + tau + C."""
    return M * math.exp(R / M) * (math.exp((tau + C) / M) - 1.0) * work / tau


def simulated_segment_times(tau, C, M, R, n, rng):
    """(n,) wall times of n segments, simulated: draw a failure time; the attempt succeeds if it comes after the
    attempt's length, else that much time is lost and the next attempt (restart + segment) begins."""
    total = np.zeros(n)
    length = np.full(n, tau + C)                                         # the first attempt: no restart before it
    running = np.ones(n, dtype=bool)
    while running.any():
        x = rng.exponential(M, running.sum())                           # time to the next failure
        done = x >= length[running]
        idx = np.flatnonzero(running)
        total[idx] += np.where(done, length[running], x)
        length[idx[~done]] = R + tau + C                                # after a failure: restart first
        running[idx[done]] = False
    return total


def optimum(C, M):
    """The tau that minimises expected_time: the root of d/dtau [(e^{(tau+C)/M} - 1)/tau] = 0, i.e. of
    e^{(tau+C)/M} (tau/M - 1) + 1 = 0, by bisection (the function is negative at 0+ and positive at M)."""
    f = lambda t: math.exp((t + C) / M) * (t / M - 1.0) + 1.0
    lo, hi = 1e-9 * M, M
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def young(C, M):
    """Young (1974): tau = sqrt(2 C M)."""
    return math.sqrt(2 * C * M)


def daly(C, M):
    """Daly (2006), the higher-order estimate: sqrt(2CM) [1 + sqrt(C/2M)/3 + (C/2M)/9] - C for C < 2M, else M."""
    if C >= 2 * M:
        return M
    x = C / (2 * M)
    return math.sqrt(2 * C * M) * (1 + math.sqrt(x) / 3 + x / 9) - C


def exercise_1(check):
    """The checkpoint interval: Young's sqrt(2 C M), Daly's correction, and a simulation."""
    M = 5 * 365 * 24 * 3600 / 1000                                     # 1000 nodes of 5 years' MTBF: 43.8 h
    rng = np.random.default_rng(0)
    for C, R in ((300.0, 600.0), (0.05 * M, 600.0)):                     # a 5-minute save; a very slow one
        tau_y, tau_d, tau_opt = young(C, M), daly(C, M), optimum(C, M)
        check.say(f"C = {C:.0f} s, M = {M:.0f} s, R = {R:.0f} s: optimum {tau_opt:.0f} s, Young {tau_y:.0f} s "
                  f"({tau_y / tau_opt - 1:+.2%}), Daly {tau_d:.0f} s ({tau_d / tau_opt - 1:+.2%})")
        check(f"C/M = {C / M:.3f}: |Daly - optimum| / optimum", abs(tau_d - tau_opt) / tau_opt, 1e-3)
        check.holds(f"C/M = {C / M:.3f}: Daly closer to the optimum than Young",
                    abs(tau_d - tau_opt) < abs(tau_y - tau_opt))
        waste = {}
        for tau in (tau_opt / 3, tau_opt, 3 * tau_opt):
            t = simulated_segment_times(tau, C, M, R, 200_000, rng)
            formula = expected_time(tau, C, M, R, work=tau)             # one segment: tau seconds of work
            stderr = t.std() / math.sqrt(t.size)
            waste[tau] = t.mean() / tau - 1                              # lost time per second of work
            check.say(f"  tau = {tau:7.0f} s: simulated {t.mean():8.1f} s per segment, formula {formula:8.1f} s, "
                      f"waste {waste[tau]:.2%}")
            check(f"C/M = {C / M:.3f}, tau = {tau / tau_opt:.2f} x optimum: simulated vs formula (in std errors)",
                  abs(t.mean() - formula) / stderr, 4.0)
        check.holds(f"C/M = {C / M:.3f}: simulated waste least at the optimum of the three",
                    min(waste, key=waste.get) == tau_opt)


# ---------------------------------------------------------------------------------------------------- exercise 2

def piece_by_hand(path, name, key, new_tp, new_rank, new_scheme_axis):
    """My piece of parameter `name` (key "param" or "velocity") in a layout with new_tp tensor ranks that splits it
    along new_scheme_axis, from the checkpoint's files alone: plain np.load, concatenate, slice."""
    with open(os.path.join(path, "manifest.json")) as f:
        m = json.load(f)
    lay, model = m["layout"], m["model"]
    block = int(name.split(".")[1]) if name.startswith("h.") else None
    stage = 0 if name == "wte" else int(np.searchsorted(np.cumsum(lay["layers"]), block, side="right"))
    field = f"param/{name}" if key == "param" else f"opt/{name}/{key}"
    pieces = []
    for t in range(lay["tp"]):
        with np.load(os.path.join(path, f"shard-pp{stage}-tp{t}.npz"), allow_pickle=False) as f:
            pieces.append(f[field])
    old_axis = {"wte": 0, "h.0.mlp.proj.weight": 0}[name]              # Megatron: vocabulary rows; proj: rows
    full = np.concatenate(pieces, axis=old_axis)
    if name == "wte":
        full = full[:model["vocab_size"]]                               # drop the old padding rows
        rows = -(-model["vocab_size"] // new_tp)                        # Vp = ceil(V / tp)
        full = np.concatenate([full, np.zeros((rows * new_tp - full.shape[0], full.shape[1]))])   # new padding
    size = full.shape[new_scheme_axis] // new_tp
    cut = [slice(None)] * full.ndim
    cut[new_scheme_axis] = slice(new_rank * size, (new_rank + 1) * size)
    return np.ascontiguousarray(full[tuple(cut)])


def exercise_2(check):
    """Reshard by hand: two parameters from dp 1 x pp 2 x tp 2 Megatron to dp 1 x pp 1 x tp 4 All-Gather."""
    path = SAVED["path"]
    grid = ProcessGrid(world, dp=1, pp=1, tp=4)
    trainer = HybridTrainer(cfg, grid, train_config(dp=1, pp=1, tp=4, tp_scheme="gather", steps=2, batch_size=B,
                                                    threads=1))
    checkpoint.load(trainer, checkpoint.open_checkpoint(path, cfg))     # hsgd's resharding, the reference
    state = trainer.state_dict()["moments"]                           # {name: {"velocity": my shard's}}
    for name, axis in (("h.0.mlp.proj.weight", 1), ("wte", 0)):         # gather: proj by columns; wte by rows
        mine = piece_by_hand(path, name, "param", 4, grid.tp_rank, axis)
        velocity = piece_by_hand(path, name, "velocity", 4, grid.tp_rank, axis)
        check.say(f"{name}: my piece {mine.shape}, hsgd's {trainer.params[name].shape}")
        check.holds(f"{name}: my piece by hand == hsgd's load, bit for bit",
                    mine.shape == trainer.params[name].shape and np.array_equal(mine, trainer.params[name]))
        check.holds(f"{name}: its velocity by hand == hsgd's load, bit for bit",
                    np.array_equal(velocity, state[name]["velocity"]))
    trainer.free()
    grid.free()


# ---------------------------------------------------------------------------------------------------- exercise 3

def verify(path):
    """(manifest digest correct, [names of the files whose SHA-256 differs from the manifest's or are missing])."""
    with open(os.path.join(path, "manifest.json")) as f:
        m = json.load(f)
    body = {k: v for k, v in m.items() if k != "digest"}
    digest_ok = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest() == m["digest"]
    bad = []
    for name, info in sorted(m["files"].items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            bad.append(name)
            continue
        h = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 16), b""):
                h.update(block)
        if h.hexdigest() != info["sha256"]:
            bad.append(name)
    return digest_ok, bad


def refused(path):
    """Whether hsgd's open_checkpoint refuses the checkpoint on this rank."""
    try:
        checkpoint.open_checkpoint(path, cfg)
        return False
    except checkpoint.CheckpointError:
        return True


def exercise_3(check):
    """Find the corrupted shard (and an edited manifest) from the manifest's digests."""
    tmp, path = SAVED["tmp"], SAVED["path"]
    flipped, edited = os.path.join(tmp, "flipped"), os.path.join(tmp, "edited")
    if rank == 0:
        shutil.copytree(path, flipped)
        with open(os.path.join(flipped, "shard-pp1-tp0.npz"), "r+b") as f:
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 0x01]))                            # one bit flipped
        shutil.copytree(path, edited)
        with open(os.path.join(edited, "manifest.json")) as f:
            m = json.load(f)
        m["data"]["next_step"] = 1                                      # "resume from the start": an edit
        with open(os.path.join(edited, "manifest.json"), "w") as f:
            json.dump(m, f)
    world.Barrier()
    with open(os.path.join(path, "manifest.json")) as f:
        m = json.load(f)
    check.equal("my digest of the manifest == hsgd.checkpoint.manifest.digest", hashlib.sha256(json.dumps(
        {k: v for k, v in m.items() if k != "digest"}, sort_keys=True).encode()).hexdigest(), hsgd_manifest.digest(m))
    check.equal("the intact checkpoint: (digest correct, bad files)", verify(path), (True, []))
    check.equal("one bit flipped: (digest correct, bad files)", verify(flipped), (True, ["shard-pp1-tp0.npz"]))
    check.equal("the manifest edited: (digest correct, bad files)", verify(edited), (False, []))
    check.equal("hsgd's open_checkpoint refuses (intact, flipped, edited)",
                (refused(path), refused(flipped), refused(edited)), (False, True, True))


# ---------------------------------------------------------------------------------------------------- exercise 4

def shard_elements(name, shape, tp, scheme_split):
    """Elements of one tensor rank's shard: the whole parameter if replicated, 1/tp of the split axis, or
    ceil(V/tp) vocabulary rows (columns)."""
    kind, axis = scheme_split
    if kind == "rep":
        return math.prod(shape)
    n = shape[axis]
    part = -(-n // tp) if kind == "vocab" else n // tp
    return math.prod(shape) // n * part


def exercise_4(check):
    """The bytes of a checkpoint, predicted from the model's shape and the layout."""
    path = SAVED["path"]
    from hsgd.pp.chunks import split_layers, stage_names
    from hsgd.tp.shards import split_of
    with open(os.path.join(path, "manifest.json")) as f:
        m = json.load(f)
    lay = m["layout"]
    s = np.dtype(m["dtype"]).itemsize
    copies = 2                                                          # parameter + SGD velocity
    stages = split_layers(cfg.n_layers, lay["pp"], lay["layers"])
    predicted, measured = {}, {}
    for st, layers in enumerate(stages):
        names = stage_names(cfg, layers, st == 0, st == lay["pp"] - 1)
        for t in range(lay["tp"]):
            file = f"shard-pp{st}-tp{t}.npz"
            predicted[file] = copies * s * sum(shard_elements(n, cfg.param_shapes()[n], lay["tp"],
                                                              split_of(n, lay["tp_scheme"])) for n in names)
            with np.load(os.path.join(path, file), allow_pickle=False) as f:
                measured[file] = sum(f[k].nbytes for k in f.files)
    for file in sorted(predicted):
        check.say(f"{file}: predicted {predicted[file]:,} bytes of arrays, found {measured[file]:,} "
                  f"(the file: {m['files'][file]['bytes']:,} bytes with the .npz headers)")
    check.equal("bytes of arrays in every file == the prediction", measured, predicted)
    serial_bytes = copies * s * cfg.n_params()
    extra = sum(predicted.values()) - serial_bytes
    rep = sum(math.prod(sh) for n, sh in cfg.param_shapes().items() if split_of(n, lay["tp_scheme"])[0] == "rep")
    pad = (-(-cfg.vocab_size // lay["tp"]) * lay["tp"] - cfg.vocab_size) * cfg.d_model * 2    # wte rows, lm_head cols
    check.say(f"the whole checkpoint: {sum(predicted.values()):,} bytes of arrays, the serial model and velocity "
              f"{serial_bytes:,}: {extra:,} more = (tp - 1) copies of the replicated parameters + the padding")
    check.equal("extra bytes == copies * s * ((tp - 1) * replicated + padding)", extra,
                copies * s * ((lay["tp"] - 1) * rep + pad))


if __name__ == "__main__":
    check = Checks(world, tol=1e-12, width=78)
    if world.Get_size() != 4:
        raise SystemExit("run on 4 ranks: mpirun -n 4 python tutorials/solutions/19_fault_tolerance.py"
                         if rank == 0 else 1)
    SAVED["tmp"], SAVED["path"] = saved_checkpoint()
    solve(check, [exercise_1, exercise_2, exercise_3, exercise_4])
