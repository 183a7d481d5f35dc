"""Distributed checkpoints: every (stage, tensor) position writes its own shards; they load under any layout.

    python -m hsgd.checkpoint export DIR out.npz      the full model under the serial names (one process)
    python -m hsgd.checkpoint info DIR                what a checkpoint holds, its files verified

The lecture, section 4.3: with the parameters sharded, saving and restoring is a distributed operation itself.
A checkpoint is a directory `step-000123/` with
    shard-pp{s}-tp{t}.npz   the parameter shards and optimizer state of pipeline stage s, tensor rank t, written by
                            the first rank of that position's dp_comm (its DP replicas and, with context
                            parallelism, its cp ranks hold identical shards; with ZeRO their optimizer chunks are
                            first All-Gathered to it). Nothing depends on cp: a checkpoint resumes under any cp.
    shard-pp{s}-tp{t}-ep{r}.npz  with experts split over ep ranks (--ep > 1), one file per expert-parallel rank r,
                            written by the first rank of its edp_comm: its experts' shards and state, every expert
                            once; r = 0's file holds the dense parameters too. It resumes under any ep.
                            The tp = 0 file of a stage also holds, with --fp8 delayed, each block linear's amax
                            history (fp8_history/<operand>: one per tensor, the same on every rank of its domain,
                            so a reshard reads it by name: load_fp8).
    manifest.json           written by rank 0: model config, layout (dp, pp, cp, tp, scheme, virtual stages, layers
                            per piece of the model), step, data position and seed (the batches are a pure function
                            of (seed, step): that is all the random state there is), optimizer, and the SHA-256 of
                            every shard file.
Writing goes into a hidden temporary directory that is renamed into place once every file and the manifest are
on disk: a job killed while saving leaves the previous checkpoint as it was. The newest `keep` of the writing
run's line are kept (hsgd.checkpoint.runs). A manifest is checked before it is trusted (hsgd.checkpoint.manifest).

Loading never executes code (NumPy .npz with allow_pickle=False, JSON) and checks first: the manifest is there
and readable, the model is the one being trained (else what differs), every file exists and has its checksum.
Resharding: each rank rebuilds the full tensor of each parameter it needs from the old layout's pieces
(tp_shards.unshard) and cuts its own piece for the new layout (tp_shards.shard). Each rank reads whole files, so
this takes the memory of a full model on each rank: fine for the model sizes of this project.
"""
import json
import os
import re
import shutil
import signal
import time
import zipfile
from dataclasses import asdict

import numpy as np

from hsgd.model.config import SIZES, ModelConfig
from hsgd.tp import shards as tp_shards
from hsgd.model.backend import array_module, to_numpy
from hsgd.errors import NumericalFault, UsageError
from hsgd.checkpoint.manifest import check as check_manifest
from hsgd.checkpoint.manifest import SCHEDULE
from hsgd.checkpoint.manifest import digest as manifest_digest
from hsgd.ep.layout import expert_of
from hsgd.pp.chunks import chunk_layers, parse_split, stage_names
from hsgd.pp.placement import placement
from hsgd.files import sha256, sync_folder, regular_file, writable_file
from hsgd.readers import Npz, machine_memory, read_json
from hsgd.checkpoint.runs import DEFAULT_LINE, MAX_MANIFEST_BYTES, complete_checkpoints, newest, own

FORMAT = "hsgd-checkpoint-1"


class CheckpointError(UsageError):
    """A checkpoint is missing, corrupt, or does not fit the model."""


# ---------------------------------------------------------------------------------------------------- save

def save(trainer, step, save_dir, keep=3, kill_in_save=False, identity=None):
    """Collective (every rank): write the checkpoint of `step` into save_dir/step-{step:06d}. Returns its path.
    identity: the writing run's {"line", "id", "started_from"} (hsgd.checkpoint.runs; default: the line "default").
    A write that fails on any rank (a full disk, a file system gone read-only) removes the partial checkpoint on
    every rank's word and raises CheckpointError everywhere; the previous checkpoints stay as they were."""
    grid, world = trainer.grid, trainer.grid.base
    state = trainer.state_dict()                                        # collective over dp_comm with ZeRO
    refuse_non_finite(state, step, save_dir, world)                     # never rotate good checkpoints away for it
    tmp, error = world.bcast(attempt(lambda: make_tmp(save_dir, step)) if world.Get_rank() == 0 else None, root=0)
    if error is not None:                                               # rank 0 could not even make the folder
        raise not_written(step, f"{error} on rank 0", save_dir)
    entry = None
    if (grid.edp_comm if grid.ep > 1 else grid.dp_comm).rank == 0:     # one writer per (stage, tensor[, ep] rank)
        entry, error = attempt(lambda: write_shard(trainer, state, tmp))
    if kill_in_save:                                                    # fault injection: die mid-save
        os.kill(os.getpid(), signal.SIGKILL)
    entries, errors = world.gather(entry, root=0), world.allgather(error and f"{error} on rank {world.Get_rank()}")
    outcome = None
    if world.Get_rank() == 0:
        error = next((e for e in errors if e), None)
        final = None
        if error is None:
            manifest = build_manifest(trainer, step, state, entries, identity or {"line": DEFAULT_LINE, "id": None,
                                                                               "started_from": None})
            final, error = attempt(lambda: publish(tmp, manifest, save_dir, step, keep))
            error = error and f"{error} on rank 0"
        if error is not None and tmp:
            shutil.rmtree(tmp, ignore_errors=True)                      # the partial checkpoint, nothing else
        outcome = (final, error)
    final, error = world.bcast(outcome, root=0)
    if error is not None:
        raise not_written(step, error, save_dir)
    return final


def refuse_non_finite(state, step, save_dir, world):
    """Collective: raise NumericalFault on every rank if any rank's parameters or optimizer moments (a
    state_dict) hold a NaN or an infinity: a checkpoint of them would be useless, and rotate a good one away."""
    arrays = list(state["params"].values()) + [v for m in state["moments"].values() for v in m.values()]
    finite = all(bool(array_module(a).isfinite(a).all()) for a in arrays)
    bad = [r for r, ok in enumerate(world.allgather(finite)) if not ok]
    if bad:
        raise NumericalFault(f"the parameters or optimizer state are not finite after step {step} (on ranks {bad}); "
                             f"no checkpoint written, the ones in {save_dir!r} are kept; resume from the newest with "
                             "a smaller --lr")


def not_written(step, error, save_dir):
    return CheckpointError(f"the checkpoint of step {step} could not be written ({error}); the previous ones in "
                           f"{save_dir!r} are kept; free some space or choose another --save-dir")


def attempt(fn):
    """(fn(), None), or (None, what went wrong) if fn raised OSError: the outcome of one rank's file work, to be
    shared with the others before anyone acts on it."""
    try:
        return fn(), None
    except OSError as e:
        return None, f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")


TEMPORARY = re.compile(r"\.(tmp|old)-step-\d{6,}-\d+")                    # this module's own temporary names


def make_tmp(save_dir, step):
    """Rank 0: the hidden folder the checkpoint is written into, after removing this module's leftovers of an
    interrupted save (and nothing else)."""
    os.makedirs(save_dir, exist_ok=True)
    for old in os.listdir(save_dir):
        if TEMPORARY.fullmatch(old):
            shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)
    tmp = os.path.join(save_dir, f".tmp-step-{step:06d}-{os.getpid()}")
    os.makedirs(tmp)
    return tmp


def write_shard(trainer, state, tmp):
    """This rank's file: its parameter shards and optimizer state, on disk (fsync) before its checksum is taken."""
    grid = trainer.grid
    name = f"shard-pp{grid.pp_rank}-tp{grid.tp_rank}" + (f"-ep{grid.ep_rank}" if grid.ep > 1 else "") + ".npz"
    path = os.path.join(tmp, name)
    saved = trainer.stage.saved_names()                                # (DualPipe: the downward copy alone)
    mine = lambda n: n in saved and (grid.ep_rank == 0 or expert_of(n) is not None)   # ep rank r > 0: its experts
    arrays = {f"param/{n}": to_numpy(p) for n, p in state["params"].items() if mine(n)}
    arrays.update({f"opt/{n}/{k}": to_numpy(v) for n, st in state["moments"].items() for k, v in st.items()
                   if mine(n)})
    if grid.ep_rank == 0:                                               # the stage's selection biases, once
        arrays.update({f"moe_bias/{k}": to_numpy(b) for k, b in state.get("moe_biases", {}).items()})
    if grid.ep_rank == 0 and grid.tp_rank == 0:                         # FP8: the stage's amax histories, once
        arrays.update({f"fp8_history/{k}": np.asarray(v, dtype=np.float64)
                       for k, v in (state.get("fp8") or {}).get("histories", {}).items()})
    with open(path, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    entry = {"pp": grid.pp_rank, "tp": grid.tp_rank, "sha256": sha256(path), "bytes": os.path.getsize(path)}
    return name, ({**entry, "ep": grid.ep_rank} if grid.ep > 1 else entry)


def build_manifest(trainer, step, state, entries, run):
    """Rank 0: the manifest (see the module docstring), with its own digest. run: {"line", "id", "started_from"}
    (hsgd.checkpoint.runs)."""
    tc, grid = trainer.tc, trainer.grid
    manifest = {
        "format": FORMAT, "step": step, "model": asdict(trainer.cfg),
        "layout": {"dp": grid.dp, "pp": grid.pp, "cp": grid.cp, "tp": grid.tp, "ep": grid.ep,
                   "tp_scheme": trainer.scheme,
                   "virtual_stages": trainer.stage.v,
                   "placement": trainer.stage.placement.shape,         # which stage holds each piece
                   "layers": [len(r) for r in chunk_layers(trainer.cfg.n_layers, grid.pp,
                                                           trainer.stage.placement.K // grid.pp,
                                                           parse_split(tc.pp_split))]},
        "optimizer": {"name": tc.optimizer, "t": int(state["t"])}, "dtype": tc.dtype,
        "loss_scale": state["loss_scale"],                              # float16: the loss scaler's state
        "data": {"next_step": step + 1, "seed": tc.seed, "corpus": tc.data or "built-in", "batch_size": tc.batch_size},
        "rng": {"seed": tc.seed, "note": "batches and initialization are pure functions of the seed (and step)"},
        "schedule": {k: getattr(tc, k) for k in SCHEDULE},
        "files": dict(e for e in entries if e),
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "written_ns": time.time_ns(), "run": run,
    }
    manifest["digest"] = manifest_digest(manifest)                      # any later edit is detected
    return manifest


def publish(tmp, manifest, save_dir, step, keep):
    """Rank 0: the manifest into tmp, tmp renamed into place (the atomic moment), then the oldest checkpoints
    beyond `keep` renamed aside before they are deleted (a kill while deleting leaves a hidden leftover, never a
    half-deleted checkpoint that looks complete). Returns the checkpoint's path."""
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    sync_folder(tmp)
    final = os.path.join(save_dir, f"step-{step:06d}")
    olds = [final] if os.path.exists(final) else []                     # a checkpoint of this step exists already
    aside = lambda path: os.path.join(save_dir, f".old-{os.path.basename(path)}-{os.getpid()}")
    for old in olds:
        os.rename(old, aside(old))
    os.rename(tmp, final)
    for old in own(complete_checkpoints(save_dir), manifest["run"]["line"])[:-keep]:   # this line's only
        os.rename(old, aside(old))
        olds.append(old)
    sync_folder(save_dir)
    for old in olds:
        shutil.rmtree(aside(old), ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------------------- open and check

def resolve(path):
    """A checkpoint directory from a path that is one, or a save directory holding some (the newest)."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist; pass a checkpoint directory (step-NNNNNN) "
                              "or the --save-dir that holds them")
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    found = newest(complete_checkpoints(path))                          # the newest line's highest step
    if not found:
        raise CheckpointError(f"{path!r} holds no complete checkpoint (no step-*/manifest.json)")
    return found


def check_same_model(saved, cfg, path):
    """Raise CheckpointError unless the checkpoint's model (saved; a manifest without the family fields is of
    gpt2's) is cfg: another family first, by name, then other sizes."""
    if saved.family() != cfg.family():
        diff = {k: v for k, v in saved.family().items() if cfg.family()[k] != v}
        flags = " ".join(f"--{k.replace('_', '-')}" if v is True else f"--no-{k}" if v is False else
                         f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {v}"
                         for k, v in diff.items())
        preset = ModelConfig(**{k: getattr(saved, k) for k in SIZES}, arch=saved.arch)
        if preset.family() == saved.family():                           # the checkpoint's arch, as it comes
            flags = f"--arch {saved.arch} and none of the family's flags"
        raise CheckpointError(f"checkpoint {path!r} holds a model of another family "
                              f"({', '.join(f'{k} {v}' for k, v in diff.items())}; arch {saved.arch}) than this run's "
                              f"(arch {cfg.arch}); resume with {flags}, or start a new run in another --save-dir")
    diff = ", ".join(f"{k} {v} in the checkpoint vs {getattr(cfg, k)} now"
                     for k, v in asdict(saved).items() if getattr(cfg, k) != v and k in SIZES)
    if diff:
        raise CheckpointError(f"checkpoint {path!r} is of a different model: {diff}")


def open_checkpoint(path, cfg=None):
    """The manifest of the checkpoint at `path`, after checking it (see the module docstring)."""
    path = resolve(path)
    manifest = read_json(os.path.join(path, "manifest.json"), "checkpoint manifest", CheckpointError,
                         max_bytes=MAX_MANIFEST_BYTES)          # a regular file, bounded; no NaN, no huge integers
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not an hsgd checkpoint of format {FORMAT}")
    check_manifest(manifest, path, CheckpointError)             # digest, schema, the files' names
    if cfg is not None:
        check_same_model(ModelConfig(**manifest["model"]), cfg, path)
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
    the old layout (hsgd.readers.Npz: every header checked before an array is read, never a pickle)."""

    def __init__(self, manifest):
        self.m = manifest
        self.cfg = ModelConfig(**manifest["model"])
        lay = manifest["layout"]
        self.placement = placement(lay.get("placement", "loop"), lay["pp"], lay.get("virtual_stages", 1))
        self.pieces = chunk_layers(self.cfg.n_layers, lay["pp"], self.placement.K // lay["pp"], lay["layers"])
        self.files = {}

    def _file(self, pp, tp, ep=0):
        """The shard file of (stage pp, tensor rank tp, expert-parallel rank ep), its headers checked before any
        array is read (hsgd.readers.Npz): all its arrays together at most the whole model's parameters and two
        optimizer moments in float64, and at most this machine's memory."""
        key = (pp, tp, ep)
        if key not in self.files:
            corrupt = lambda why: CheckpointError(f"checkpoint {self.m['path']!r} is corrupt: {why}; resume from "
                                                  "another checkpoint")
            name = f"shard-pp{pp}-tp{tp}" + (f"-ep{ep}" if self.m["layout"].get("ep", 1) > 1 else "") + ".npz"
            self.files[key] = Npz(os.path.join(self.m["path"], name), "checkpoint file",
                                  corrupt, max_bytes=min(3 * 8 * self.cfg.n_params() + (1 << 20), machine_memory()))
        return self.files[key]

    def stage_of(self, name):
        """The stage whose files hold parameter `name`: the holder of its piece, as the checkpoint's placement says
        (a manifest written before placements existed: the loop, piece k on stage k mod pp)."""
        for k, layers in enumerate(self.pieces):
            if name in stage_names(self.cfg, layers, k == 0, k == len(self.pieces) - 1):
                return self.placement.stage(k)
        raise KeyError(name)

    def full(self, name, key="param"):
        """The full tensor (serial shape) of a parameter (key "param") or of its optimizer state ("velocity",
        "m", "v"); None if the checkpoint has no such state. Anything unreadable or of the wrong shape: corrupt."""
        lay, s = self.m["layout"], self.stage_of(name)
        field = f"param/{name}" if key == "param" else f"opt/{name}/{key}"
        e, ep = expert_of(name), lay.get("ep", 1)
        r = 0 if e is None else e // (self.cfg.moe_experts // ep)        # the ep rank that saved it
        try:
            if field not in self._file(s, 0, r).files:
                if key == "param":
                    raise KeyError(f"no array {field}")
                return None
            pieces = [self._file(s, t, r)[field] for t in range(lay["tp"])]
            out = tp_shards.unshard(pieces, name, self.cfg, lay["tp_scheme"])
        except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            raise CheckpointError(f"checkpoint {self.m['path']!r} is corrupt: {field} of stage {s} cannot be read "
                                  f"({e}); resume from another checkpoint") from None
        expected = self.cfg.param_shapes()[name]
        if out.shape != expected or out.dtype.kind != "f":
            raise CheckpointError(f"checkpoint {self.m['path']!r} is corrupt: {field} has shape {out.shape} "
                                  f"({out.dtype}), the model needs {expected} (float)")
        return out


def load_biases(shards, trainer):
    """{"h.{i}.moe": (E,)} the saved selection biases of this rank's stage's MoE blocks (none saved: {})."""
    out = {}
    for i in trainer.stage.layers:
        if trainer.cfg.is_moe(i):
            field = f"moe_bias/h.{i}.moe"
            f = shards._file(shards.stage_of(f"h.{i}.ln2.weight"), 0, 0)
            if field in f.files:
                out[f"h.{i}.moe"] = trainer.stage.xp.asarray(f[field])
    return out


def load_fp8(shards, trainer):
    """{"histories": {key: [amax, ...]}}: the saved amax histories of this rank's stage's block linears (delayed
    scaling, hsgd.fp8.scaling). They are reduced over tp and dp_comm in every step (one history per tensor, the same
    on every rank that holds a piece of it), so a reshard takes each by its tensor's name, whatever the new tp and
    pipeline split. One thing moves with dp x cp and the batch: a replica differentiates the mean loss of its own
    B/dp rows and T/cp positions, so the output gradients it casts (the ":dy" histories) scale as dp cp / B; a
    history saved by (dp cp, B) = (r, B) and read by (r', B') is scaled by (r'/r) (B/B'), which the next cast then
    sees as the run itself would have recorded it. A checkpoint without histories (not FP8, or not delayed) gives
    none: the run starts from scale 1, as a new one does."""
    lay, grid = shards.m["layout"], trainer.grid
    factor = (grid.dp * grid.cp) / (lay["dp"] * lay.get("cp", 1)) * shards.m["data"]["batch_size"] / \
        trainer.tc.batch_size
    out = {}
    for i in trainer.stage.layers:
        f = shards._file(shards.stage_of(f"h.{i}.ln1.weight"), 0, 0)
        for field in f.files:
            if field.startswith(f"fp8_history/h.{i}."):
                key = field[len("fp8_history/"):]
                out[key] = [float(a) * (factor if key.endswith(":dy") else 1.0) for a in f[field]]
    return {"histories": out}


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
    dtype = trainer.dtype
    for name in trainer.shard_shapes:
        params[name] = tp_shards.shard(shards.full(name).astype(dtype), name, grid.tp_rank, grid.tp, trainer.scheme,
                                      trainer.cfg)
        st = {k: shards.full(name, k) for k in keys}
        if all(v is not None for v in st.values()):
            state[name] = {k: tp_shards.shard(v.astype(dtype), name, grid.tp_rank, grid.tp, trainer.scheme, trainer.cfg)
                           for k, v in st.items()}
    trainer.load_state_dict({"params": params, "moments": state, "t": manifest["optimizer"]["t"],
                             "loss_scale": manifest.get("loss_scale"), "moe_biases": load_biases(shards, trainer),
                             "fp8": load_fp8(shards, trainer)})
    return manifest["step"]


def export(path, out):
    """Write the full model of a checkpoint under the serial parameter names to `out` (.npz)."""
    out = str(out) if str(out).endswith(".npz") else f"{out}.npz"          # the name np.savez writes
    writable_file(out, "export file", CheckpointError)                    # before any work (reading every file)
    manifest = open_checkpoint(path)
    if os.path.realpath(os.path.dirname(os.path.abspath(out))) == os.path.realpath(manifest["path"]):
        raise CheckpointError(f"{out!r} is inside the checkpoint it exports from; write it elsewhere")
    shards = Shards(manifest)
    full = {name: shards.full(name) for name in shards.cfg.param_shapes()}
    np.savez(out, **full)
    return manifest, full
