"""Distributed checkpoints: every (stage, tensor) position writes its own shards; they load under any layout.

    python -m hsgd.checkpoint export DIR out.npz      the full model under the serial names (one process)
    python -m hsgd.checkpoint info DIR                what a checkpoint holds, its files verified

The lecture, section 4.3: with the parameters sharded, saving and restoring is a distributed operation itself.
A checkpoint is a directory `step-000123/` with
    shard-pp{s}-tp{t}.npz   the parameter shards and optimizer state of pipeline stage s, tensor rank t, written by
                            the first DP replica of that position (replicas are identical; with ZeRO the DP ranks'
                            optimizer chunks are first All-Gathered to it)
    manifest.json           written by rank 0: model config, layout (dp, pp, tp, scheme, layers per stage), step,
                            data position and seed (the batches are a pure function of (seed, step): that is all the
                            random state there is), optimizer, and the SHA-256 of every shard file.
Writing goes into a hidden temporary directory that is renamed into place once every file and the manifest are
on disk: a job killed while saving leaves the previous checkpoint as it was. The newest `keep` are kept.

Loading never executes code (NumPy .npz with allow_pickle=False, JSON) and checks first: the manifest is there
and readable, the model is the one being trained (else what differs), every file exists and has its checksum.
Resharding: each rank rebuilds the full tensor of each parameter it needs from the old layout's pieces
(tp_model.unshard) and cuts its own piece for the new layout (tp_model.shard). Each rank reads whole files, so
this takes the memory of a full model on each rank: fine for the model sizes of this project.
"""
import hashlib
import json
import os
import shutil
import signal
import sys
import time
import zipfile
from dataclasses import asdict

import numpy as np

from . import tp_model
from .backend import array_module, to_numpy
from .config import ModelConfig
from .errors import NumericalFault, UsageError
from .manifest import check as check_manifest
from .manifest import SCHEDULE
from .manifest import digest as manifest_digest
from .pp import parse_split, split_layers, stage_names
from .preflight import regular_file

FORMAT = "hsgd-checkpoint-1"


class CheckpointError(UsageError):
    """A checkpoint is missing, corrupt, or does not fit the model."""


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------- state

def optimizer_state(trainer):
    """Collective over dp_comm when the exchange shards the optimizer (ZeRO). ({name: {key: shard}}, t): the
    optimizer state of every parameter shard of this rank (keys "velocity" for SGD, "m", "v" for AdamW; none for
    plain SGD) and AdamW's step count. The optimizer holds it flat, over the exchange's owned slice."""
    st = trainer.opt.state.get("flat")
    arrays = {} if st is None else dict(zip(("m", "v"), st)) if isinstance(st, tuple) else {"velocity": st}
    full = {k: trainer.exchange.gather(v) for k, v in arrays.items()}       # (N,) the whole flat layout
    per = {n: {k: v[lo:hi].reshape(trainer.params[n].shape) for k, v in full.items()}
           for n, (lo, hi) in trainer.pbuf.offsets.items()}
    return {n: v for n, v in per.items() if v}, getattr(trainer.opt, "t", 0)


def set_state(trainer, params, state, t):
    """Set this rank's parameter shards and optimizer state (the layout of optimizer_state)."""
    xp = array_module(trainer.pbuf.flat)
    for n, p in params.items():
        trainer.params[n][...] = xp.asarray(p)                              # (host arrays onto the device)
    if hasattr(trainer.opt, "t"):
        trainer.opt.t = t
    flat = {k: xp.zeros(trainer.pbuf.flat.size, dtype=trainer.pbuf.flat.dtype) for st in state.values() for k in st}
    for n, st in state.items():
        lo, hi = trainer.pbuf.offsets[n]
        for k, v in st.items():
            flat[k][lo:hi] = xp.asarray(v).reshape(-1)
    mine = {k: xp.array(v[trainer.exchange.owned]) for k, v in flat.items()}    # my part of the layout
    trainer.opt.state.clear()
    if mine:
        trainer.opt.state["flat"] = (mine["m"], mine["v"]) if "m" in mine else mine["velocity"]


# ---------------------------------------------------------------------------------------------------- save

def refuse_non_finite(trainer, state, step, save_dir, world):
    """Collective: raise NumericalFault on every rank if any rank's parameters or optimizer state hold a NaN or an
    infinity (a checkpoint of them would be useless, and rotate a good one away)."""
    xp = array_module(trainer.pbuf.flat)
    finite = bool(xp.isfinite(trainer.pbuf.flat).all()) and all(bool(xp.isfinite(v).all())
                                                                 for st in state.values() for v in st.values())
    bad = [r for r, ok in enumerate(world.allgather(finite)) if not ok]
    if bad:
        raise NumericalFault(f"the parameters or optimizer state are not finite after step {step} (on ranks {bad}); "
                             f"no checkpoint written, the ones in {save_dir!r} are kept; resume from the newest with "
                             "a smaller --lr")


def save(trainer, step, save_dir, keep=3, kill_in_save=False):
    """Collective (every rank): write the checkpoint of `step` into save_dir/step-{step:06d}. Returns its path."""
    grid, world = trainer.grid, trainer.grid.base
    state, t = optimizer_state(trainer)                                 # collective over dp_comm with ZeRO
    refuse_non_finite(trainer, state, step, save_dir, world)             # never rotate good checkpoints away for it
    tmp = None
    if world.Get_rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        for old in os.listdir(save_dir):                                # leftovers of an interrupted save
            if old.startswith((".tmp-", ".old-")):
                shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)
        tmp = os.path.join(save_dir, f".tmp-step-{step:06d}-{os.getpid()}")
        os.makedirs(tmp)
    tmp = world.bcast(tmp, root=0)
    entry = None
    if grid.dp_rank == 0:                                                  # one writer per (stage, tensor rank)
        name = f"shard-pp{grid.pp_rank}-tp{grid.tp_rank}.npz"
        path = os.path.join(tmp, name)
        arrays = {f"param/{n}": to_numpy(p) for n, p in trainer.params.items()}
        arrays.update({f"opt/{n}/{k}": to_numpy(v) for n, st in state.items() for k, v in st.items()})
        with open(path, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        entry = (name, {"pp": grid.pp_rank, "tp": grid.tp_rank, "sha256": sha256(path), "bytes": os.path.getsize(path)})
    if kill_in_save:                                                    # fault injection: die mid-save
        os.kill(os.getpid(), signal.SIGKILL)
    entries = world.gather(entry, root=0)
    final = None
    if world.Get_rank() == 0:
        tc = trainer.tc
        manifest = {
            "format": FORMAT, "step": step, "model": asdict(trainer.cfg),
            "layout": {"dp": grid.dp, "pp": grid.pp, "tp": grid.tp, "tp_scheme": trainer.scheme,
                       "layers": [len(r) for r in split_layers(trainer.cfg.n_layers, grid.pp,
                                                               parse_split(tc.pp_split))]},
            "optimizer": {"name": tc.optimizer, "t": int(t)}, "dtype": tc.dtype,
            "data": {"next_step": step + 1, "seed": tc.seed, "corpus": tc.data or "built-in",
                     "batch_size": tc.batch_size},
            "rng": {"seed": tc.seed, "note": "batches and initialization are pure functions of the seed (and step)"},
            "schedule": {k: getattr(tc, k) for k in SCHEDULE},
            "files": dict(e for e in entries if e),
            "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        manifest["digest"] = manifest_digest(manifest)                  # any later edit is detected
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        final = os.path.join(save_dir, f"step-{step:06d}")
        aside = None
        if os.path.exists(final):                                       # a checkpoint of this step exists already
            aside = os.path.join(save_dir, f".old-step-{step:06d}-{os.getpid()}")
            os.rename(final, aside)                                     # (only a kill between the two renames
        os.rename(tmp, final)                                           #  leaves it hidden in .old-*) the atomic moment
        _fsync_dir(save_dir)
        if aside:
            shutil.rmtree(aside, ignore_errors=True)
        for old in complete_checkpoints(save_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return world.bcast(final, root=0)


def complete_checkpoints(save_dir):
    """The complete checkpoints in save_dir (those with a manifest), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    dirs = [d for d in os.listdir(save_dir) if d.startswith("step-") and d[5:].isdigit()]
    dirs.sort(key=lambda d: int(d[5:]))                                 # by step: step-1000000 after step-999999
    return [os.path.join(save_dir, d) for d in dirs if os.path.exists(os.path.join(save_dir, d, "manifest.json"))]


# ---------------------------------------------------------------------------------------------------- open and check

def resolve(path):
    """A checkpoint directory from a path that is one, or a save directory holding some (the newest)."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist; pass a checkpoint directory (step-NNNNNN) "
                              "or the --save-dir that holds them")
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    found = complete_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path!r} holds no complete checkpoint (no step-*/manifest.json)")
    return found[-1]


def open_checkpoint(path, cfg=None):
    """The manifest of the checkpoint at `path`, after checking it (see the module docstring)."""
    path = resolve(path)
    regular_file(os.path.join(path, "manifest.json"), "checkpoint manifest", CheckpointError)
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"manifest of checkpoint {path!r} cannot be read ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not an hsgd checkpoint of format {FORMAT}")
    check_manifest(manifest, path, FORMAT, CheckpointError)             # digest, schema, the files' names
    if cfg is not None and manifest["model"] != asdict(cfg):
        diff = ", ".join(f"{k} {manifest['model'].get(k)} in the checkpoint vs {v} now"
                         for k, v in asdict(cfg).items() if manifest["model"].get(k) != v)
        raise CheckpointError(f"checkpoint {path!r} is of a different model: {diff}")
    for name, info in manifest["files"].items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise CheckpointError(f"checkpoint file {file!r} is missing")
        regular_file(file, "checkpoint file", CheckpointError)   # a FIFO or /dev/zero would never hash to an end
        if sha256(file) != info["sha256"]:
            raise CheckpointError(f"checkpoint file {file!r} is corrupt: its SHA-256 does not match the manifest "
                                  f"(truncated or modified); resume from an older checkpoint")
    manifest["path"] = path
    return manifest


class Shards:
    """Read access to a checkpoint's pieces: full tensors of any parameter or optimizer state, reassembled from
    the old layout (np.load with allow_pickle=False: nothing is executed)."""

    def __init__(self, manifest):
        self.m = manifest
        self.cfg = ModelConfig(**manifest["model"])
        lay = manifest["layout"]
        self.stages = split_layers(self.cfg.n_layers, lay["pp"], lay["layers"])
        self.files = {}

    def _file(self, pp, tp):
        key = (pp, tp)
        if key not in self.files:
            self.files[key] = np.load(os.path.join(self.m["path"], f"shard-pp{pp}-tp{tp}.npz"), allow_pickle=False)
        return self.files[key]

    def stage_of(self, name):
        lay = self.m["layout"]
        for s, layers in enumerate(self.stages):
            if name in stage_names(self.cfg, layers, s == 0, s == lay["pp"] - 1):
                return s
        raise KeyError(name)

    def full(self, name, key="param"):
        """The full tensor (serial shape) of a parameter (key "param") or of its optimizer state ("velocity",
        "m", "v"); None if the checkpoint has no such state. Anything unreadable or of the wrong shape: corrupt."""
        lay, s = self.m["layout"], self.stage_of(name)
        field = f"param/{name}" if key == "param" else f"opt/{name}/{key}"
        try:
            if field not in self._file(s, 0).files:
                if key == "param":
                    raise KeyError(f"no array {field}")
                return None
            pieces = [self._file(s, t)[field] for t in range(lay["tp"])]
            out = tp_model.unshard(pieces, name, self.cfg, lay["tp_scheme"])
        except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            raise CheckpointError(f"checkpoint {self.m['path']!r} is corrupt: {field} of stage {s} cannot be read "
                                  f"({e}); resume from another checkpoint") from None
        expected = self.cfg.param_shapes()[name]
        if out.shape != expected or out.dtype.kind != "f":
            raise CheckpointError(f"checkpoint {self.m['path']!r} is corrupt: {field} has shape {out.shape} "
                                  f"({out.dtype}), the model needs {expected} (float)")
        return out


def load(trainer, manifest):
    """Every rank: set its shards and optimizer state from the checkpoint, resharded to its own layout.
    Returns the step the checkpoint was written after."""
    tc, grid = trainer.tc, trainer.grid
    if manifest["optimizer"]["name"] != tc.optimizer:
        raise CheckpointError(f"checkpoint {manifest['path']!r} holds {manifest['optimizer']['name']} state; "
                              f"resume with --optimizer {manifest['optimizer']['name']}")
    shards = Shards(manifest)
    keys = ("m", "v") if tc.optimizer == "adamw" else ("velocity",)
    params, state = {}, {}
    dtype = trainer.pbuf.flat.dtype
    for name in trainer.params:
        params[name] = tp_model.shard(shards.full(name).astype(dtype), name, grid.tp_rank, grid.tp, trainer.scheme)
        st = {k: shards.full(name, k) for k in keys}
        if all(v is not None for v in st.values()):
            state[name] = {k: tp_model.shard(v.astype(dtype), name, grid.tp_rank, grid.tp, trainer.scheme)
                           for k, v in st.items()}
    set_state(trainer, params, state, manifest["optimizer"]["t"])
    return manifest["step"]


def export(path, out):
    """Write the full model of a checkpoint under the serial parameter names to `out` (.npz)."""
    manifest = open_checkpoint(path)
    shards = Shards(manifest)
    full = {name: shards.full(name) for name in shards.cfg.param_shapes()}
    np.savez(out, **full)
    return manifest, full


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="python -m hsgd.checkpoint", description="Inspect or export an hsgd checkpoint.")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write the full model under the serial parameter names to an .npz file")
    e.add_argument("dir", help="a checkpoint directory (step-NNNNNN) or a --save-dir (its newest checkpoint)")
    e.add_argument("out", help="the .npz file to write")
    i = sub.add_parser("info", help="print what a checkpoint holds, after verifying its files")
    i.add_argument("dir")
    args = p.parse_args(argv)
    try:
        if args.cmd == "export":
            manifest, full = export(args.dir, args.out)
            n = sum(a.size for a in full.values())
            print(f"{manifest['path']}: step {manifest['step']}, {len(full)} parameters ({n:,} numbers) -> {args.out}")
        else:
            m = open_checkpoint(args.dir)
            lay = m["layout"]
            opt = m["optimizer"]
            print(f"{m['path']}: step {m['step']}, layout dp {lay['dp']} x pp {lay['pp']} x tp {lay['tp']} "
                  f"({lay['tp_scheme']}), layers per stage {lay['layers']}, {opt['name']} (t={opt['t']}), "
                  f"{m['dtype']}\nmodel {m['model']}\nfiles (SHA-256 verified): {', '.join(sorted(m['files']))}")
    except UsageError as err:
        print(f"hsgd: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
