"""Solutions to the exercises of chapter 20 (tutorials/20_checking_another_system.py).

    mpirun -n 8 python tutorials/solutions/20_checking_another_system.py

Exercises 1, 2, 4 and 5 write and check dumps on rank 0 (the other ranks wait asleep); exercise 3 dumps hsgd on the
eight ranks. None needs PyTorch: exercise 4 starts from a committed dump of tutorials/crosscheck_dumps/, exercise 5
from a committed Distributed Checkpoint there (its dcp-metadata.json: no pickle).
"""
# mpirun -n 8 python tutorials/solutions/20_checking_another_system.py
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tutorials/: checks, pictures
from hsgd.model.config import ModelConfig  # noqa: E402  (hsgd first, as in the chapters)
from hsgd.model import serial

import json  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from hsgd.crosscheck.__main__ import check as crosscheck  # noqa: E402
from hsgd.crosscheck.dump import grads_file  # noqa: E402
from hsgd.crosscheck.manifest import check_set, new_run, seal, write_manifest  # noqa: E402
from hsgd.crosscheck.read import load  # noqa: E402
from hsgd.crosscheck.write import shard_entry, write_layout, write_one_rank, write_rank  # noqa: E402
from hsgd.crosscheck import from_dcp  # noqa: E402
from hsgd.crosscheck.__main__ import copies_of  # noqa: E402
from hsgd.crosscheck.dcp import Checkpoint, read_description  # noqa: E402
from hsgd.crosscheck.hsgd_dump import dump_one_step  # noqa: E402
from hsgd.model.data import Corpus  # noqa: E402
from hsgd.check.mutations import injected  # noqa: E402

import pictures  # noqa: E402
from checks import Checks, require_ranks, solve, train_config  # noqa: E402

threadpool_limits(1)
world = MPI.COMM_WORLD
require_ranks(world, 8, __file__)
rank = world.Get_rank()
CFG = ModelConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=4, n_layers=1, d_ff=16)
HS = CFG.d_model // CFG.n_heads
DUMPS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "crosscheck_dumps")


def verdict(path):
    check_set(path)                                   # as python -m hsgd.crosscheck: one whole set of files first
    ok, loss_row, rows = crosscheck(load(path))
    return ok, loss_row, {r["name"]: r for r in rows}


def failed(rows):
    return sorted(n for n, r in rows.items() if not r["ok"])


def on_rank0(work):
    """work(folder) on rank 0 in a temporary folder, its result on every rank (the others asleep)."""
    def run():
        path = tempfile.mkdtemp(prefix="hsgd-ex18-")
        try:
            return work(path)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    return pictures.on_rank0(world, run, share=True)


def step(seed=3, B=4):
    """Parameters, a batch and the exact loss and gradients of one step (float64)."""
    params = serial.init_params(CFG, seed=seed, dtype="float64")
    rng = np.random.default_rng(seed)
    idx, targets = (rng.integers(0, CFG.vocab_size, (B, CFG.seq_len)) for _ in range(2))
    loss, grads = serial.loss_and_grads(params, idx, targets, CFG)
    return params, idx, targets, loss, grads


# ---------------------------------------------------------------------------------------------------- exercise 1

def exercise_1(check):
    """A dump by hand: one rank, 2 micro-batches, wpe's gradient doubled."""
    def work(path):
        params, idx, targets, loss, grads = step()
        grads["wpe"] = 2 * grads["wpe"]                           # the bug: one parameter's 1/m forgotten
        tensors = {n: {"shape": list(s), "dtype": "float64", "shards": [shard_entry(0)]}
                   for n, s in CFG.param_shapes().items()}
        run = new_run()
        files = write_rank(path, 0, grads, run)
        files.update(write_layout(path, system="by hand: one rank, 2 micro-batches", cfg=CFG, dtype="float64",
                                  loss=loss, ranks=1, parallel={"micro_batches": 2}, tensors=tensors, params=params,
                                  idx=idx, targets=targets, run=run))
        write_manifest(path, run, 1, files)                 # dump.json, last
        ok, loss_row, rows = verdict(path)
        return ok, loss_row["ok"], failed(rows), rows["wpe"]["class"], rows["wpe"]["detail"]

    ok, loss_ok, bad, cls, detail = on_rank0(work)
    check.say(f"  wpe: {cls}: {detail}")
    check.holds("the dump fails, its loss is right", not ok and loss_ok)
    check.equal("only wpe fails", bad, ["wpe"])
    check.holds("wpe: constant factor, named '2 x the reference = micro-batches'",
                cls == "constant factor" and "2 x the reference = micro-batches:" in detail)


# ---------------------------------------------------------------------------------------------------- exercise 2

def write_fused(path, interleave_said):
    """A one-rank dump in PyTorch's orientation, q|k|v fused as [q | k | v] (block) and stored (out, in); its
    layout.json says `interleave_said`."""
    params, idx, targets, loss, grads = step(seed=4)
    write_one_rank(path, CFG, params, grads, loss=loss, idx=idx, targets=targets, stored="block",
                   said=interleave_said, system=f"by hand: qkv stored block, layout says {interleave_said}")


def exercise_2(check):
    """A layout.json that lies about the interleave of the fused qkv."""
    def work(path):
        out = {}
        for said in ("block", "head"):
            write_fused(path, said)
            with open(os.path.join(path, "layout.json")) as f:
                told = json.load(f)["tensors"]["h.0.attn.qkv.weight"]["fused"]["interleave"]
            ok, loss_row, rows = verdict(path)
            out[said] = (told, ok, loss_row["ok"], loss_row["error"], failed(rows),
                         {n: rows[n]["class"] for n in failed(rows)})
        return out

    out = on_rank0(work)
    told, ok, loss_ok, _, _, _ = out["block"]
    check.holds("stored [q | k | v], layout.json says block: PASS", told == "block" and ok and loss_ok)
    told, ok, loss_ok, loss_err, bad, classes = out["head"]
    check.say(f"  layout.json says head: the loss differs by {loss_err:.1e} (relative); {len(bad)} of "
              f"{len(CFG.param_shapes())} gradients fail: {sorted(set(classes.values()))}")
    check.holds("layout.json says head for the same files: FAIL, and the loss row fails too",
                told == "head" and not ok and not loss_ok)
    check.holds("the q, k, v weights are not called a permutation",
                all(classes.get(f"h.0.attn.{m}.weight") not in (None, "permutation") for m in "qkv"))
    # why: the parameters are read through the same wrong mapping, so the reference runs another model (its q, k
    # and v mixed up) on the batch: every gradient is compared with that other model's, and the loss row, computed
    # by the reference, says first that the forward pass is not the system's. A permutation of the gradient alone
    # would leave the loss right.


# ---------------------------------------------------------------------------------------------------- exercise 3

CFG2 = ModelConfig(vocab_size=16, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=16)     # pp 2: 2 layers
CORPUS = Corpus(np.random.default_rng(1).integers(0, 16, 4000, dtype=np.uint8).tobytes(), "random bytes", 8)


def broken_zero(**kw):
    """hsgd's step with ZeRO 1 and no 1/dp, dumped on the 8 ranks, crosschecked on rank 0: the failing rows'
    details."""
    tc = train_config(batch_size=8, steps=1, zero=1, **kw)
    path = world.bcast(tempfile.mkdtemp(prefix="hsgd-ex18-") if rank == 0 else None)
    try:
        with injected("zero-without-1/dp"):
            dump_one_step(CFG2, tc, world, path, CORPUS)

        def details():
            ok, _, rows = verdict(path)
            return ok, {n: rows[n]["detail"] for n in failed(rows)}
        return pictures.on_rank0(world, details, share=True)
    finally:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def exercise_3(check):
    """A factor of 2 is ambiguous when two sizes of the layout are 2."""
    ok, details = broken_zero(dp=2, pp=2, tp=2)
    check.say(f"  dp 2 x pp 2 x tp 2: {next(iter(details.values()))}")
    check.holds("dp 2 x pp 2 x tp 2: FAIL, every failing gradient '2 x the reference = dp or pp or tp'",
                not ok and details and all("2 x the reference = dp or pp or tp:" in d for d in details.values()))
    ok, details = broken_zero(dp=2, pp=1, tp=4)
    check.say(f"  dp 2 x tp 4:        {next(iter(details.values()))}")
    check.holds("dp 2 x tp 4 (sizes 2 and 4): every failing gradient '2 x the reference = dp' alone",
                not ok and details and all("2 x the reference = dp:" in d for d in details.values()))


# ---------------------------------------------------------------------------------------------------- exercise 4

def exercise_4(check):
    """Repair the ln-not-reduced dump: the dp average the program forgot, done on the dump."""
    def work(path):
        shutil.rmtree(path)
        shutil.copytree(os.path.join(DUMPS, "torch_tp2_dp2_ln-not-reduced"), path)
        dump = load(path)
        tp, dp = dump.parallel["tp"], dump.parallel["dp"]
        grads = [dict(g) for g in dump.grads]
        for name in dump.tensors:
            if ".ln" not in name and not name.startswith("ln_f"):
                continue
            for t in range(tp):                          # rank = dp_rank x tp + tp_rank: one dp group per tp rank
                group = [d * tp + t for d in range(dp)]
                mean = sum(grads[r][name] for r in group) / dp
                for r in group:
                    grads[r][name] = mean
        for r, g in enumerate(grads):
            os.remove(os.path.join(path, grads_file(r)))
            write_rank(path, r, g)
        seal(path, new_run(), len(grads))                 # a new set: the old dump.json's digests no longer hold
        ok, _, rows = verdict(path)
        good = load(os.path.join(DUMPS, "torch_tp2_dp2"))
        repaired = load(path)
        diff = max(float(np.abs(repaired.grads[r][k] - good.grads[r][k]).max() / np.abs(good.grads[r][k]).max())
                   for r in range(good.ranks) for k in good.grads[r])
        return ok, max(r["error"] for r in rows.values()), diff

    ok, err, diff = on_rank0(work)
    check.holds("the repaired dump: PASS", ok)
    check("the repaired dump: the largest gradient error against hsgd.model.serial", err, 1e-10)
    check("the repaired gradients = the correct program's (torch_tp2_dp2), relative", diff, 1e-12)


# ---------------------------------------------------------------------------------------------------- exercise 5

def exercise_5(check):
    """Read a Distributed Checkpoint by hand: which ranks hold row 13 of wo's gradient and of wq's, found from
    dcp-metadata.json, the row put together from those chunks' bytes, and checked against copies_of on the dump
    from_dcp makes. wo is Shard(0) over dp, Shard(1) over tp: row r is in dp rank r // ceil(C/dp)'s rows, and both
    of its tp ranks hold half of it. wq is split over tp by rows first (tp rank t: rows t C/tp ..), and FSDP2 cuts
    each tp piece again over dp (_StridedShard): row r is in one rank's strip, whole."""
    src, row = os.path.join(DUMPS, "dcp_fsdp2_dp3_tp2"), 13

    def work(path):
        ckpt = Checkpoint(src, read_description(os.path.join(src, "dcp-metadata.json")), "dcp-metadata.json")
        if from_dcp.main([src, "--out", path, "--metadata-json"]) != 0:
            raise RuntimeError("from_dcp could not convert the committed checkpoint")
        dump = load(path)
        out = {}
        for name in ("layers.0.attention.wo.weight", "layers.0.attention.wq.weight"):
            fqn = "grads." + name
            ckpt.check(fqn)                                   # the chunks' bytes fit their files, before reading
            _, size, chunks = ckpt.tensors[fqn]
            holders, by_hand = [], np.full(size[1], np.nan)    # (C,): row `row`, from the chunks that hold it
            for c in chunks:
                if c.offsets[0] <= row < c.offsets[0] + c.sizes[0]:
                    holders.append(c.rank)
                    by_hand[c.offsets[1]:c.offsets[1] + c.sizes[1]] = ckpt.read(c)[row - c.offsets[0]]
            G = copies_of(dump.tensors[name], dump.grads)[0][0]
            out[name] = (sorted(holders), bool(np.array_equal(by_hand, G[row])))
        return out, dump.parallel["dp"], dump.parallel["tp"], dump.cfg.d_model

    out, dp, tp, C = on_rank0(work)
    wo, wq = out["layers.0.attention.wo.weight"], out["layers.0.attention.wq.weight"]
    d = row // -(-C // dp)                                # wo: FSDP2's rows of dp rank d, ceil(C/dp) each
    check.equal(f"row {row} of wo: both tp ranks of dp rank {d} (half the columns each)", wo[0],
                [d * tp + t for t in range(tp)])
    piece = C // tp                                       # wq: tp rank t's rows, cut again over dp
    t, e = divmod(row, piece)
    d = e // -(-piece // dp)
    check.equal(f"row {row} of wq: one rank, dp rank {d} of tp rank {t} (every column)", wq[0], [d * tp + t])
    check.holds(f"row {row} of wo from the chunks' bytes = copies_of's, exactly", wo[1])
    check.holds(f"row {row} of wq from the chunks' bytes = copies_of's, exactly", wq[1])


if __name__ == "__main__":
    solve(Checks(world, tol=1e-12, width=84), [exercise_1, exercise_2, exercise_3, exercise_4, exercise_5])
